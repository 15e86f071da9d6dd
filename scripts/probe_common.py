"""What the GPU probes in scripts/ share: other versions of a kernel file timed beside the current
one (``--alt NAME=FILE``), and their JSON output."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from linearize.bench.kernels import _env


def alt_modules(current: ModuleType, alts: list[str]) -> dict[str, ModuleType]:
    """{"current": current, NAME: the module of FILE for each "NAME=FILE"}: each FILE a copy of
    current's file, loaded into current's package so that its relative imports resolve."""
    mods = {"current": current}
    package = current.__name__.rpartition(".")[0]
    for alt in alts:
        name, sep, path = alt.partition("=")
        if not sep or not Path(path).is_file():
            raise SystemExit(f"--alt takes NAME=FILE with FILE an existing copy of {current.__file__}, got {alt!r}")
        spec = importlib.util.spec_from_file_location(f"{current.__name__}_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = package
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods


def write_rows(out_dir: str, filename: str, script: str, rows: list[dict]) -> Path:
    """rows with the run's environment into out_dir/filename (JSON); returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename
    path.write_text(json.dumps({"env": _env(script), "rows": rows}, indent=1))
    return path
