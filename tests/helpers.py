"""Shared test utilities: tolerances, comparison by relative RMS, step counting for chunk forms,
work done once per session."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from linearize.ops import common

# Relative-RMS tolerance of a form against the fp64 reference, by input dtype.
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (b is the reference)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str = "") -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = rel_rms(a, b)
    assert err <= tol, f"{what}: relative RMS {err:.3e} > {tol:.1e}"


def assert_state_close(a, b, tol: float, what: str = "state") -> None:
    for name, x, y in zip(a._fields, a, b):
        if x.is_floating_point():
            assert_rel_close(x, y, tol, f"{what}.{name}")
        else:
            assert torch.equal(x, y), f"{what}.{name} differs"


@contextlib.contextmanager
def count_chunk_steps():
    """Counts the spans that chunk forms walk through via common.chunk_spans."""
    counter = {"calls": 0, "spans": 0}
    original = common.chunk_spans

    def counting(T, C):
        spans = original(T, C)
        counter["calls"] += 1
        counter["spans"] += len(spans)
        return spans

    common.chunk_spans = counting
    try:
        yield counter
    finally:
        common.chunk_spans = original


def randn(*shape, dtype=torch.float64, seed=None, scale=1.0):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def window_of(t: int, w: int, terraced: bool) -> list[int]:
    """The window keys of query t, written out by hand (an oracle independent of ops.window_attn)."""
    first = max(0, (t // w - 1) * w) if terraced else max(0, t - w + 1)
    return list(range(first, t + 1))


def capped(x, softcap):
    """Gemma 2's soft-cap, written out for the references."""
    return x if softcap is None else softcap * torch.tanh(x / softcap)


_SYNC = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist, torch.Tensor.__int__,
         torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
         torch.Tensor.cpu, torch.Tensor.numpy, torch.masked_select, torch.Tensor.masked_select}


class NoHostSync(TorchFunctionMode):
    """Raises on every call that reads a tensor's value on the host (``.item()``, ``bool(t)``, boolean
    indexing, ``nonzero``, ...): on CUDA each is a sync, and inside a CUDA graph's capture an error."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNC:
            raise AssertionError(f"host synchronisation: {func}")
        if func is torch.Tensor.__getitem__:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                raise AssertionError("host synchronisation: boolean indexing (a data-dependent shape)")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def capturing():
    """As while a CUDA graph is captured (on the CPU, for ``NoHostSync`` checks): transformers and the
    ops skip their host-side value checks and shortcuts then (``ops.common.graph_capturing``)."""
    from unittest import mock

    with mock.patch("torch.cuda.is_current_stream_capturing", return_value=True), \
            mock.patch("torch.cuda.is_available", return_value=True):
        yield


def once_per_session(request, tmp_path_factory, name: str, make) -> Path:
    """The folder ``name`` that ``make(folder)`` fills once per test session, for work too costly
    to repeat (module fixtures that launch processes). Under xdist the workers share it: the first
    to ask makes it, under a file lock, and the others wait for it and read what it left."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # an xdist worker: its basetemp is one per worker
        base = base.parent
    folder, done = base / name, base / f"{name}.done"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder
