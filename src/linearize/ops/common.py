"""Shared conventions and input checks for every op.

Layout (all causal ops): ``q, k: (B, H, T, Dk)``, ``v: (B, H, T, Dv)``, per-token gates
``(B, H, T)`` (scalar) or ``(B, H, T, Dk)`` (per channel), outputs ``(B, H, T, Dv)``.
Heads are already expanded for GQA by the caller.

Precision: states and accumulation are fp32 (fp64 when the inputs are fp64); inputs may be
bf16/fp16/fp32/fp64 and the output has the dtype of ``v``.

Every op has three forms with one meaning and one signature ``(..., state=None) -> (o, state)``:
``*_parallel`` (quadratic, written straight from the formula: the reference), ``*_chunk``
(training and prefill; loops over ``chunk_spans`` only, so ceil(T / C) sequential steps, or
none: ``lolcats_attn_chunk`` takes all chunks at once) and
``*_recurrent`` (token by token, what decoding runs). ``state`` is the op's NamedTuple of
tensors, ``None`` meaning "nothing seen yet"; the final state comes back in every form.
"""

from __future__ import annotations

import contextlib
import gc
import math
from typing import Iterable, Iterator

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: the dtype of states and accumulation."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def chunk_spans(T: int, chunk_size: int) -> list[tuple[int, int]]:
    """The ceil(T / chunk_size) half-open spans a chunk form walks through, in order.

    Chunk forms must iterate over ``common.chunk_spans(...)`` (looked up on this module) and
    nothing else along time, so tests can count their sequential steps.
    """
    check_positive_int("chunk_size", chunk_size)
    return [(s, min(s + chunk_size, T)) for s in range(0, T, chunk_size)]


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_float(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise ValueError(f"{name} has dtype {x.dtype}; allowed: {allowed}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Validate the (B, H, T, D) layout; returns (B, H, T, Dk, Dv)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, T, D), got shape {tuple(x.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape (B, H, T, Dk), got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be (B, H, T, Dv) with B, H, T of q {tuple(q.shape[:3])}, got {tuple(v.shape)}")
    B, H, T, Dk = q.shape
    return B, H, T, Dk, v.shape[-1]


def check_state_tensor(name: str, x: torch.Tensor, shape: Iterable[int]) -> None:
    shape = tuple(shape)
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"state.{name} must have shape {shape}, got {got}")


def check_per_token(name: str, x: torch.Tensor, B: int, H: int, T: int, D: int | None = None,
                    allow_vector: bool = True) -> bool:
    """Validate a per-token tensor of shape (B, H, T) or, if allowed, (B, H, T, D).

    Returns True for the per-channel (vector) form.
    """
    check_float(name, x)
    if tuple(x.shape) == (B, H, T):
        return False
    if allow_vector and D is not None and tuple(x.shape) == (B, H, T, D):
        return True
    allowed = f"({B}, {H}, {T})" + (f" or ({B}, {H}, {T}, {D})" if allow_vector and D is not None else "")
    raise ValueError(f"{name} must have shape {allowed}, got {tuple(x.shape)}")


def normalize_output(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    """num / den for normalised linear attention; ``den`` (..., 1) is >= 0 for positive features.

    One definition for every form, so the forms agree even where den is tiny.
    """
    return num / (den + eps)


def softmax_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def graph_capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream: no device value may be read on
    the host then (value checks are skipped, shortcuts not taken)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage now, then keep Python's collector off until the block ends: wrap every CUDA
    graph capture in it. A collection that runs during a capture can free an older ``CUDAGraph``
    caught in a reference cycle, and destroying a graph invalidates the capture in progress
    (``cudaErrorStreamCaptureInvalidated``). torch no longer collects before a capture
    (``torch.compiler.config.force_cudagraph_gc`` is off by default), so the capture must."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def known_all_true(mask: torch.Tensor) -> bool:
    """Whether every entry of the bool ``mask`` is True, for a caller that may skip masking then (the
    result is the same either way). While a CUDA graph is being captured the answer is False, and
    the caller keeps the mask."""
    if graph_capturing():
        return False
    return bool(mask.all())
