"""What the GPU probes in benchmarks/probes/ share: other versions of a kernel file timed beside the current
one (``--alt NAME=FILE``), and their JSON output."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional

from linearize.bench.kernels import _env


def timed(run, rounds: int) -> dict:
    """``run()`` (a forward + backward, already called once to warm up) timed ``rounds`` times with CUDA events:
    {"fwd_bwd_ms_median", "ms"}."""
    import statistics

    import torch

    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return {"fwd_bwd_ms_median": statistics.median(times), "ms": times}


def kernel_table(run, rows: int = 22) -> str:
    """One ``run()`` (a forward + backward) under the CUDA profiler: its kernels by self CUDA time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        run()
        torch.cuda.synchronize()
    return p.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows)


def probe_args(kernel_file: str, shapes: list[str], rounds: int) -> argparse.Namespace:
    """--out, --shape (repeatable BxT; ``shapes`` by default), --rounds, --alt NAME=FILE; the
    parsed arguments, with ``shapes`` the list of (B, T)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", action="append", default=None, help=f"BxT (repeatable; default {', '.join(shapes)})")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--alt", action="append", default=[], help=f"NAME=FILE: another {kernel_file} to time beside")
    a = p.parse_args()
    a.shapes = [tuple(int(v) for v in s.split("x")) for s in a.shape or shapes]
    return a


def cells_parser(cells: list[str], profile: str) -> argparse.ArgumentParser:
    """What the op-and-model probes take: --out, --cells BxT ... (default ``cells``), --skip-model
    and --profile (``profile``: its help)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cells", nargs="+", default=cells)
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--profile", action="store_true", help=profile)
    return p


def probe_record(out: str) -> tuple[dict, Callable[[Optional[list]], None]]:
    """An op-and-model probe's JSON record (the card, torch, "op" and "model" rows) and its
    ``save(model_rows=None)``, which writes it to ``out`` (with those model rows, where given), so
    that a call cut short keeps the cells done."""
    import torch

    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "op": [], "model": []}

    def save(model_rows: Optional[list] = None) -> None:
        if model_rows is not None:
            record["model"] = model_rows
        Path(out).write_text(json.dumps(record, indent=1))

    return record, save


def host_probe_parser(calls: int, rounds: Optional[int] = 5) -> argparse.ArgumentParser:
    """The arguments the host-time probes share: --out, --shape BxT (one), --calls (calls queued a
    round) and, unless ``rounds`` is None, --rounds."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="16x2048", help="BxT (default: %(default)s)")
    p.add_argument("--calls", type=int, default=calls)
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds)
    return p


def parse_shape(shape: str) -> tuple[int, int]:
    """'16x2048' -> (16, 2048)."""
    B, T = (int(v) for v in shape.split("x"))
    return B, T


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
