"""One way to open any model the commands accept: a linearize checkpoint, a bundled teacher name
(``smollm2-135m``) or a Hugging Face model directory / hub id."""

from __future__ import annotations

from pathlib import Path

import torch


def check_model_name(name: str) -> None:
    """Fail fast, before any loading, on a model that is neither bundled nor an existing path
    but clearly meant as a local path (absolute, ./, ~, or nested deeper than a hub id)."""
    from .teacher import BUNDLED_TEACHERS

    if not isinstance(name, str) or not name:
        raise ValueError(f"a model must be a checkpoint directory or a teacher name, got {name!r}")
    if name in BUNDLED_TEACHERS or Path(name).exists():
        return
    looks_local = name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name
    if looks_local:
        raise FileNotFoundError(f"model directory {name} does not exist "
                                f"(bundled teachers: {', '.join(BUNDLED_TEACHERS)})")
    if "/" not in name:
        raise ValueError(f"unknown model {name!r}: use a bundled teacher ({', '.join(BUNDLED_TEACHERS)}), "
                         "a linearize checkpoint directory, a local model directory, or a Hugging Face hub id (org/name)")


def is_checkpoint(name: str) -> bool:
    from .checkpoint import META_FILE

    return (Path(name) / META_FILE).is_file()


def load_model(name: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` in eval mode for a checkpoint directory or a teacher name/path."""
    from .checkpoint import load
    from .teacher import load_teacher

    if is_checkpoint(name):
        return load(name, device=device, dtype=dtype)
    check_model_name(name)
    return load_teacher(name, dtype=dtype, device=device)


def model_label(name: str, model=None) -> str:
    """A short name for tables: the method for a checkpoint (``lizard (x)``), else the name. A
    checkpoint that kept every layer as softmax (``--softmax-layers 1.0``: a fine-tuned teacher
    baseline) is labelled ``softmax (x)``."""
    if is_checkpoint(name):
        from .checkpoint import read_meta

        method = read_meta(name)["method"] if model is None or is_linearized(model) else "softmax"
        return f"{method} ({Path(name).name})"
    return name


def is_linearized(model) -> bool:
    """Whether any attention layer of ``model`` is a linearized one (state instead of a KV cache)."""
    from .attention import LinearizedAttention

    return any(isinstance(m, LinearizedAttention) for m in model.modules())


def context_length(model) -> int | None:
    """The teacher's trained context (``max_position_embeddings``), None when unknown."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)
