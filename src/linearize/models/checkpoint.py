"""Checkpoints: safetensors + JSON, never pickles; loading runs no code.

A checkpoint directory holds
  linearize.json      format version, method + settings, softmax layers, the base model and the
                      fingerprint of its weights, LoRA settings, the file list;
  adapter.safetensors what conversion and training added or changed (the new attention modules,
                      LoRA weights) — a small fraction of the base;
or, with ``merged=True``, model.safetensors with every weight (LoRA folded into the projections),
the HF config and the tokenizer, so it loads without the base.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

FORMAT_VERSION = 1
META_FILE = "linearize.json"
ADAPTER_FILE = "adapter.safetensors"
MERGED_FILE = "model.safetensors"
ADDED_MARKERS = (".hybrid.", ".lion.", "lora_")  # new attention modules (causal, LION encoder) and LoRA
REQUIRED_META_KEYS = ("method", "softmax_layers", "overrides", "base")  # what load() reads
# What ``linearize train`` writes beside its checkpoint (train/run.py: CONFIG_FILE, metrics.jsonl,
# summary.json, state/; train/plots.py: the *.png curves): a folder holding them is a training run.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "state")


def _is_added(name: str) -> bool:
    return any(m in name for m in ADDED_MARKERS)


def _base_name(name: str) -> str:
    """A base parameter's name as in the unwrapped HF model (peft adds prefixes and base_layer)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def base_fingerprint(model: nn.Module) -> str:
    """SHA-256 over the names, shapes, dtypes and bytes of the base weights (added modules excluded)."""
    h = hashlib.sha256()
    tensors = {}
    for name, t in model.state_dict(keep_vars=False).items():
        if not _is_added(name):
            tensors.setdefault(_base_name(name), t)  # tied weights appear once
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _added_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if _is_added(k)}


def _write_atomically(directory: Path, write) -> None:
    """Write a checkpoint's files into ``directory`` without ever leaving a half-written one.

    ``write(tmp)`` fills a temporary folder beside it; the files then move in one by one with
    ``os.replace``, the metadata last (and the old metadata removed first), so the folder holds
    a loadable checkpoint or none. Other files in the folder (a training run's metrics, curves
    and resume state) are left alone; a previous checkpoint's payload files are removed.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    created = not directory.exists()
    try:
        write(tmp)
        _usual_permissions(tmp)
        directory.mkdir(exist_ok=True)
        old_meta = directory / META_FILE
        stale = set()
        if old_meta.is_file():
            try:
                stale = set(json.loads(old_meta.read_text()).get("files", []))
            except (json.JSONDecodeError, AttributeError):
                pass
            old_meta.unlink()
        new_files = sorted(p.name for p in tmp.iterdir() if p.name != META_FILE)
        for name in stale - set(new_files):
            if "/" not in name and name not in (".", ".."):
                (directory / name).unlink(missing_ok=True)
        for name in new_files:
            os.replace(tmp / name, directory / name)
        os.replace(tmp / META_FILE, directory / META_FILE)
    except BaseException:
        if created:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _usual_permissions(folder: Path) -> None:
    """Give the files in ``folder`` the mode a plain ``open()`` would (0666 less the umask, 0644
    normally): safetensors writes its files 0600, which would hide a checkpoint from other users."""
    probe = folder / ".mode-probe"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask applies, as to any file
    try:
        mode = os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def _listed(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit] + ([f"... {len(names) - limit} more"] if len(names) > limit else []))


def _is_run_config(path: Path) -> bool:
    """A training run's config.json (a TrainConfig), not a Hugging Face model's config.json."""
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(values, dict) and "model_type" not in values and "method" in values


def directory_contents(directory: str | os.PathLike) -> dict[str, list[str]]:
    """What in ``directory`` a new checkpoint would replace or leave describing another model:
    ``{"a training run": [names], "a checkpoint": [names]}``, only the kinds present (empty for a
    missing or unrelated folder). A checkpoint is its linearize.json and the files it lists (or a
    stray adapter.safetensors); a run is what ``linearize train`` writes beside it (``RUN_FILES``
    and the *.png curves)."""
    directory = Path(directory)
    if not directory.is_dir():
        return {}
    checkpoint = []
    meta = directory / META_FILE
    if meta.is_file():
        checkpoint.append(META_FILE)
        try:
            listed = json.loads(meta.read_text()).get("files", [])
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            listed = [ADAPTER_FILE, MERGED_FILE]
        checkpoint += [n for n in listed if isinstance(n, str) and "/" not in n and (directory / n).is_file()]
    elif (directory / ADAPTER_FILE).is_file():
        checkpoint.append(ADAPTER_FILE)
    run = []
    for name in RUN_FILES:
        path = directory / name
        if name in checkpoint or not path.exists():
            continue
        if name == "config.json" and not _is_run_config(path):
            continue  # e.g. a Hugging Face model's own config
        run.append(name + "/" if path.is_dir() else name)
    run += sorted(p.name for p in directory.glob("*.png") if p.is_file())
    if run and "config.json" not in run and (directory / "config.json").is_file() and "config.json" not in checkpoint:
        run.insert(0, "config.json")  # metrics and curves make a config beside them the run's
    return {kind: names for kind, names in (("a training run", run), ("a checkpoint", checkpoint)) if names}


def check_directory_path(directory: str | os.PathLike, label: str | None = None) -> None:
    """Fail, naming it, when ``directory`` or a folder above it is a file (a directory cannot be
    made there). ``label`` names it in the message (default: the path itself)."""
    directory = Path(directory)
    label = label or str(directory)
    for path in (directory, *directory.parents):
        if path.is_dir():
            return
        if path.exists():
            if path == directory:
                raise NotADirectoryError(f"{label} is a file, not a directory")
            raise NotADirectoryError(f"{label} cannot be a directory: {path} is a file")


def check_out_dir(directory: str | os.PathLike, overwrite: bool = False, *, label: str | None = None,
                  overwrite_hint: str = "pass overwrite=True to replace it",
                  other_hint: str = "choose another directory") -> None:
    """The check ``save`` (and ``linearize convert``) makes before writing into ``directory``:
    refuse a path that is a file, and, unless ``overwrite``, a folder that holds a training run or
    another checkpoint, naming the folder and what is in it. Changes nothing."""
    label = label or str(directory)
    check_directory_path(directory, label)
    if overwrite:
        return
    found = directory_contents(directory)
    if found:
        held = " and ".join(f"{kind} ({_listed(names)})" for kind, names in found.items())
        raise FileExistsError(f"{label} holds {held}; {overwrite_hint}, or {other_hint}")


def save(model: nn.Module, directory: str | os.PathLike, merged: bool = False, tokenizer=None,
         overwrite: bool = False) -> Path:
    """Write a checkpoint of a converted (and possibly trained) model; returns the directory.

    A ``directory`` that already holds a checkpoint or a training run is refused (nothing is
    written) unless ``overwrite=True``; then the old checkpoint's files are replaced and any other
    files (a run's metrics, curves, resume state) are left as they are."""
    spec = getattr(model, "linearize_spec", None)
    if spec is None:
        raise ValueError("save() takes a model converted with linearize.convert (it has no linearize_spec)")
    check_out_dir(directory, overwrite)
    base = getattr(model, "linearize_base", None) or getattr(model.config, "_name_or_path", None)
    lora = getattr(model, "linearize_lora", None)
    meta = {"format_version": FORMAT_VERSION, "library": "linearize", **spec, "lora": lora, "merged": merged,
            "base": {"name": base, "fingerprint": None if merged else base_fingerprint(model)}}

    def write(tmp: Path) -> None:
        if merged:
            full = _merged_model(model)
            state = {k: v.detach().to("cpu").contiguous() for k, v in full.state_dict().items()}
            save_file(_untie(state, full), str(tmp / MERGED_FILE), metadata={"format": "pt"})
            full.config.save_pretrained(tmp)
            meta["lora"] = None
            tok = tokenizer if tokenizer is not None else _base_tokenizer(base)
            if tok is not None:
                tok.save_pretrained(tmp)
            meta["files"] = sorted(p.name for p in tmp.iterdir())
        else:
            save_file(_added_state(model), str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
            meta["files"] = [ADAPTER_FILE]
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))

    _write_atomically(Path(directory), write)
    return Path(directory)


def _base_tokenizer(base: str | None):
    """The base model's tokenizer, so a merged export is self-contained (None if it has none)."""
    if not base:
        return None
    from transformers import AutoTokenizer

    from .teacher import resolve_teacher_path

    path = Path(resolve_teacher_path(base))
    if path.is_dir() and not (path / "tokenizer_config.json").is_file():
        return None
    return AutoTokenizer.from_pretrained(path)


def _untie(state: dict, model: nn.Module) -> dict:
    """safetensors refuses shared storage: drop the tied output embedding (HF re-ties on load)."""
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in state:
        state = dict(state)
        state.pop("lm_head.weight")
    return state


def _merged_model(model: nn.Module) -> nn.Module:
    """The model with any LoRA folded into its projections (a copy; ``model`` is not changed)."""
    if getattr(model, "linearize_lora", None) is None:
        return model
    import copy

    from .lora import merge_lora

    merged = merge_lora(copy.deepcopy(model))
    merged.linearize_spec = model.linearize_spec
    return merged


def read_meta(directory: str | os.PathLike) -> dict:
    """The checkpoint's linearize.json, checked; ``directory`` may be a bundled student's name."""
    from .students import resolve_student

    directory = resolve_student(directory)
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a linearize checkpoint: {META_FILE} is missing")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupted checkpoint: {path} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"corrupted checkpoint: {path} holds a JSON {type(meta).__name__}, not an object")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"checkpoint format_version {version!r} is not supported by this linearize "
                         f"(supported: {FORMAT_VERSION})")
    required = ", ".join(REQUIRED_META_KEYS)
    for key in REQUIRED_META_KEYS:
        if key not in meta:
            raise ValueError(f"corrupted checkpoint: {path} has no {key!r} key (required: {required})")
    if not isinstance(meta["base"], dict) or "name" not in meta["base"]:
        raise ValueError(f"corrupted checkpoint: {path} has no 'base.name' key (the base model; required: {required})")
    if not meta.get("merged") and "fingerprint" not in meta["base"]:
        raise ValueError(f"corrupted checkpoint: {path} has no 'base.fingerprint' key (the base weights' "
                         f"SHA-256, required unless merged)")
    if not isinstance(meta["overrides"], dict):
        raise ValueError(f"corrupted checkpoint: {path}: 'overrides' must be an object, got {meta['overrides']!r}")
    return meta


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"corrupted checkpoint: {path} is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"corrupted checkpoint: cannot read {path} ({e})") from None


def load(directory: str | os.PathLike, base: str | None = None, device=None, dtype=None,
         overrides: dict | None = None):
    """Rebuild a saved model: ``(model, tokenizer)``. ``directory`` is a checkpoint directory or a
    bundled student's name (``smollm2-135m-lizard``). ``base`` overrides the recorded base model.

    ``overrides``: attention settings merged over the recorded ones, for settings that add no
    parameters (e.g. ``{"sparse_cache": 64}``, LoLA's training-free cache, on a trained student);
    ``save`` then records the merged settings. One that changes the new modules' parameters is
    refused with the mismatch named."""
    from .convert import convert
    from .students import resolve_student
    from .teacher import load_teacher

    directory = Path(resolve_student(directory))
    meta = read_meta(directory)
    if overrides:
        if not isinstance(overrides, dict):
            raise ValueError(f"overrides must be a dict of attention settings, got {type(overrides).__name__}")
        meta["overrides"] = {**meta["overrides"], **overrides}
    if meta.get("merged"):
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

        config = AutoConfig.from_pretrained(directory)
        encoder = str(meta["method"]).startswith("lion-")  # LION converts encoders: the bare AutoModel
        model = (AutoModel if encoder else AutoModelForCausalLM).from_config(config)
        tokenizer = AutoTokenizer.from_pretrained(directory) if (directory / "tokenizer_config.json").is_file() else None
        convert(model, meta["method"], softmax_layers=meta["softmax_layers"], **meta["overrides"])
        state = _load_tensors(directory / MERGED_FILE)
        tied = getattr(config, "tie_word_embeddings", False) and not encoder
        _load_exact(model, state, allow_missing={"lm_head.weight"} if tied else set(), overrides=overrides)
        if tied:
            model.tie_weights()
    else:
        base_name = base or meta["base"]["name"]
        model, tokenizer = load_teacher(base_name)
        found = base_fingerprint(model)
        if found != meta["base"]["fingerprint"]:
            raise ValueError(f"base model {base_name!r} does not match the checkpoint: weights fingerprint "
                             f"{found[:16]}... != recorded {str(meta['base']['fingerprint'])[:16]}...")
        convert(model, meta["method"], softmax_layers=meta["softmax_layers"], **meta["overrides"])
        if meta.get("lora"):
            from .lora import add_lora

            lora = meta["lora"]
            add_lora(model, rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"], targets=lora["targets"])
        state = _load_tensors(directory / ADAPTER_FILE)
        expected = set(_added_state(model))
        if set(state) != expected:
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"{_why(overrides)}: {ADAPTER_FILE} does not match the model "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
        try:
            model.load_state_dict(state, strict=False)
        except RuntimeError as e:  # a shape mismatch
            raise ValueError(f"{_why(overrides)}: {e}") from None
    model.linearize_base = meta["base"]["name"] if base is None else base
    if meta.get("training"):  # what the student was trained on survives a load and a save
        model.linearize_spec["training"] = meta["training"]
    if dtype is not None or device is not None:
        model.to(device=device, dtype=dtype)
    model.eval()
    return model, tokenizer


def _why(overrides: dict | None) -> str:
    return (f"the overrides {overrides} change the checkpoint's parameters" if overrides
            else "corrupted checkpoint")


def _load_exact(model: nn.Module, state: dict, allow_missing: set[str], overrides: dict | None = None) -> None:
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape mismatch
        raise ValueError(f"{_why(overrides)}: {e}") from None
    missing = set(result.missing_keys) - allow_missing
    if missing or result.unexpected_keys:
        raise ValueError(f"{_why(overrides)}: missing {sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}")
