"""What every evaluation writes: JSON first, figures drawn from the JSON read back, Markdown."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import torch


def write_text_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _clean(x):
    """JSON has no NaN/inf: write them as null rather than emit invalid JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def environment(device: str | torch.device | None = None) -> dict:
    """Where the numbers came from."""
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(dev)
    else:
        env["device"] = f"cpu ({os.cpu_count()} cores)"
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - a hard dependency
        pass
    return env


def write_outputs(out_dir: str | os.PathLike, stem: str, data: dict, markdown: Callable[[dict], str],
                  figure: Callable[[dict, Path], None] | None = None) -> dict[str, Path]:
    """Write ``stem.json``, then ``stem.png`` and ``stem.md`` from the JSON as read back.

    Drawing from the file (not from the in-memory results) keeps figure and numbers one thing:
    what the PNG shows is what the JSON holds. Returns the paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json"}
    write_text_atomically(paths["json"], json.dumps(_clean(data), indent=2) + "\n")
    saved = json.loads(paths["json"].read_text())
    if figure is not None:
        paths["png"] = out / f"{stem}.png"
        figure(saved, paths["png"])
    paths["md"] = out / f"{stem}.md"
    write_text_atomically(paths["md"], markdown(saved))
    return paths


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
