"""One way to open any model the commands accept: a linearize checkpoint, a bundled student name
(``smollm2-135m-lizard``, a checkpoint shipped in the package), a bundled teacher name
(``smollm2-135m``) or a Hugging Face model directory / hub id."""

from __future__ import annotations

from pathlib import Path

import torch

from .students import BUNDLED_STUDENTS, resolve_student


MODEL_FORMS = ("a linearize checkpoint directory (it holds linearize.json), a bundled student ({students}), "
               "a bundled teacher ({teachers}), a local Hugging Face model directory, or a hub id org/name "
               "where a network exists")


def model_forms() -> str:
    """The forms a model name takes, for messages."""
    from .teacher import BUNDLED_TEACHERS

    return MODEL_FORMS.format(students=", ".join(BUNDLED_STUDENTS), teachers=", ".join(BUNDLED_TEACHERS))


def looks_local(name: str) -> bool:
    """Whether ``name`` is meant as a local path rather than a hub id: it starts with ``/``, ``.``
    or ``~``, holds a backslash or more than one ``/``, or its first component is a folder here
    (``runs/x`` where ``runs/`` exists: a path, not the hub's org ``runs``)."""
    if name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1:
        return True
    return "/" in name and Path(name.split("/", 1)[0]).is_dir()


def _near_names(path: Path) -> str:
    """'; did you mean ...?' for an existing folder's entries that resemble ``path``'s name."""
    import difflib

    try:
        names = [p.name for p in path.parent.iterdir() if p.is_dir()] if path.parent.is_dir() else []
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(str(path.parent / n) for n in close)}?" if close else ""


def check_model_name(name: str) -> None:
    """Fail fast, before any loading, on a model that is neither bundled nor an existing path
    but clearly meant as a local path (``looks_local``), naming it and the accepted forms; and on a
    bundled student that is not installed, naming it and how to get it."""
    from .teacher import BUNDLED_TEACHERS

    if not isinstance(name, str) or not name:
        raise ValueError(f"a model must be a checkpoint directory or a teacher name, got {name!r}")
    if name in BUNDLED_STUDENTS:
        resolve_student(name)
        return
    if name in BUNDLED_TEACHERS or Path(name).exists():
        return
    if looks_local(name):
        org = name.split("/", 1)[0]
        why = (f" (a folder {org}/ exists here, so it is read as a local path, not a hub id)"
               if name.count("/") == 1 and not name.startswith(("/", ".", "~")) and "\\" not in name else "")
        raise FileNotFoundError(f"model directory {name} does not exist{why}{_near_names(Path(name))}. "
                                f"A model is {model_forms()}")
    if "/" not in name:
        raise ValueError(f"unknown model {name!r}: use a bundled student ({', '.join(BUNDLED_STUDENTS)}), a bundled "
                         f"teacher ({', '.join(BUNDLED_TEACHERS)}), a linearize checkpoint directory, a local model "
                         "directory, or a Hugging Face hub id (org/name)")


def is_checkpoint(name: str) -> bool:
    """Whether ``name`` opens as a linearize checkpoint: a checkpoint directory, or an installed bundled student."""
    from .checkpoint import META_FILE

    if name in BUNDLED_STUDENTS:
        return BUNDLED_STUDENTS[name].installed()
    return (Path(name) / META_FILE).is_file()


def load_model(name: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` in eval mode for a checkpoint directory, a bundled student or a teacher name/path."""
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
    """The positions the model can address (``max_position_embeddings``), None when unknown."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def trained_context(name: str, model=None) -> int | None:
    """The longest context the model was trained on, as evals report it: for a checkpoint written by
    ``linearize train``, its training row length (its teacher saw longer text, the student did not);
    for any other model, ``context_length``. None when unknown (e.g. an untrained conversion)."""
    if is_checkpoint(name):
        from .checkpoint import read_meta

        return (read_meta(name).get("training") or {}).get("seq_len")
    return context_length(model)
