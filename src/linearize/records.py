"""What every measurement writes, for eval, train and bench alike.

- ``environment``: where the numbers came from (one record, the same keys everywhere);
- ``write_outputs``: NAME.json first, then NAME.png and NAME.md drawn from the JSON read back;
- ``write_json`` / ``write_text_atomically``: files a reader never sees half-written;
- ``markdown_table``, ``human_size``: text;
- ``new_figure`` / ``save_png``: figures without pyplot (no global state, no GUI backend).

Nothing here imports transformers or matplotlib until a function needs it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Sequence

import torch

# ---------------------------------------------------------------------------- files


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def json_safe(x):
    """JSON has no NaN/inf: they become null rather than invalid JSON; keys become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_json(path: str | os.PathLike, value, *, indent: int = 2) -> Path:
    """``value`` as JSON (unknown types as their ``str``), written atomically."""
    return write_text_atomically(path, json.dumps(value, indent=indent, default=str) + "\n")


def write_outputs(out_dir: str | os.PathLike, stem: str, data: dict, markdown: Callable[[dict], str],
                  figure: Callable[[dict, Path], None] | None = None) -> dict[str, Path]:
    """Write ``stem.json``, then ``stem.png`` and ``stem.md`` from the JSON as read back.

    Drawing from the file (not from the in-memory results) keeps figure and numbers one thing:
    what the PNG shows is what the JSON holds. Returns the paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json(out / f"{stem}.json", json_safe(data))}
    saved = json.loads(paths["json"].read_text())
    if figure is not None:
        paths["png"] = out / f"{stem}.png"
        figure(saved, paths["png"])
    paths["md"] = write_text_atomically(out / f"{stem}.md", markdown(saved))
    return paths


# ---------------------------------------------------------------------------- environment


def _version(package: str) -> str | None:
    """The installed version of ``package`` (from its metadata: nothing is imported), or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def device_name(device: str | torch.device | None = None) -> str:
    """The GPU's name, or ``cpu (N cores)``."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    return f"cpu ({os.cpu_count()} cores)"


def _program() -> str:
    """This process's program as a user would type it: ``linearize`` for ``python -m linearize[.cli]``
    (whose argv[0] is a ``__main__.py``), else argv[0]'s file name."""
    path = Path(sys.argv[0])
    if path.name == "__main__.py" and path.parent.name in ("linearize", "cli"):
        return "linearize"
    return path.name


def environment(device: str | torch.device | None = None, command: str | None = None,
                packages: Sequence[str] = ()) -> dict:
    """Where the numbers came from: python, torch, transformers, CUDA and Triton versions, the
    device (and its memory on CUDA), the command (``command``, else this process's argv) and the
    date. ``packages``: more packages whose versions to record (None where not installed)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": _version("transformers"), "cuda": torch.version.cuda, "triton": _version("triton"),
           "device": device_name(dev),
           "command": command if command is not None else " ".join([_program(), *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if dev.type == "cuda" and torch.cuda.is_available():
        env["device_memory_bytes"] = torch.cuda.get_device_properties(dev).total_memory
    for name in packages:
        env[name] = _version(name)
    return env


# ---------------------------------------------------------------------------- text


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(x) -> str:
        if x is None:
            return "–"
        if isinstance(x, float):
            return f"{x:.4g}"
        return str(x).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def human_size(n: float) -> str:
    """Bytes as ``512 B``, ``1.5 KiB``, ``3.2 MiB``, ``1.1 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# ---------------------------------------------------------------------------- figures


def new_figure(figsize: tuple[float, float] = (7.5, 4.5), nrows: int = 1, ncols: int = 1):
    """A figure without pyplot (no global state, no GUI backend): ``(fig, axes)``; ``nrows=0``
    gives no axes, for a caller that lays out its own grid."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=100, layout="constrained")
    return fig, (fig.subplots(nrows, ncols, squeeze=True) if nrows else None)


def save_png(fig, path: str | os.PathLike) -> Path:
    """Write atomically: a reader never sees half a PNG."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        fig.clear()
    return path
