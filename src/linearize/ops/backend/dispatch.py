"""When the Triton kernels run instead of the torch ops.

The kernels run when all of these hold: the environment variable ``LINEARIZE_KERNELS`` is not
``"0"`` (read at every call, so it can be flipped at run time), Triton imports, and the tensors
are on a CUDA device; or, for tests only, ``TRITON_INTERPRET=1`` was set before Triton was
imported and the tensors are on the CPU (the Triton interpreter). Everything else takes the
torch path, which always exists and means the same thing.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch

ENV_SWITCH = "LINEARIZE_KERNELS"


_GLUON_MODULES: dict = {}


def gluon_kernels(name: str):
    """The Gluon kernel module ``linearize.ops.<name>`` (e.g. ``"gla.gluon"``), or None with a Triton that has no Gluon (any other
    import error, a misspelt name included, is raised). Remembered per name: the scope checks ask
    several times a call, and each import lookup cost the host microseconds."""
    if name in _GLUON_MODULES:
        return _GLUON_MODULES[name]
    import importlib

    try:
        mod = importlib.import_module(f"linearize.ops.{name}")
    except ImportError as e:
        if not (e.name or "").startswith("triton"):
            raise
        mod = None
    _GLUON_MODULES[name] = mod
    return mod


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton imports (cached: importing it is slow)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


def kernels_enabled() -> bool:
    """False when ``LINEARIZE_KERNELS=0`` (or ``false``/``off``/``no``), or Triton is missing."""
    flag = os.environ.get(ENV_SWITCH, "1").strip().lower()
    return flag not in ("0", "false", "off", "no") and triton_available()


@contextlib.contextmanager
def kernels_switched(on: bool):
    """Run the block with the kernels on where they apply (``on``) or forced off, through
    ``LINEARIZE_KERNELS``, which is put back as it was afterwards (benchmarks run both side by side)."""
    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_SWITCH, None)
        else:
            os.environ[ENV_SWITCH] = before


def all_tensors(*xs) -> bool:
    """Whether every argument is a tensor (the kernels take no lists, Nones or numbers there)."""
    return all(isinstance(x, torch.Tensor) for x in xs)


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_kernel_device(*tensors: torch.Tensor) -> bool:
    """All tensors on one CUDA device, or all on the CPU under the Triton interpreter."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        return False
    dev = next(iter(devices))
    return dev.type == "cuda" or (dev.type == "cpu" and interpreting())


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    """Multiprocessors of the CUDA device (4 under the interpreter): sizes sequence splits."""
    if device_index is None or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def sm_major(x: torch.Tensor) -> int:
    """The major compute capability of the CUDA device ``x`` lives on (9: Hopper), 0 off CUDA;
    cached per device (torch's query cost the host microseconds at every launch's scope check)."""
    if not x.is_cuda:
        return 0
    return _capability_major(x.device.index if x.device.index is not None else torch.cuda.current_device())


def device_sms(x: torch.Tensor) -> int:
    """Multiprocessors of the device ``x`` lives on (4 off CUDA)."""
    if not x.is_cuda:
        return num_sms(None)
    return num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device())


def chain_segments(programs: int, steps: int, sms: int, min_steps: int, whole: bool = False) -> int:
    """Segments for a kernel whose ``programs`` each walk a chain of ``steps`` in order (a state
    carried from step to step): doubled while the programs leave multiprocessors idle and every
    segment keeps at least ``min_steps`` (``whole``: and the steps split into equal segments). A
    walk is a chain of latencies; G segments run G chains of 1/G the length at once."""
    G = 1
    while programs * G < sms and steps // (2 * G) >= min_steps and (not whole or steps % (2 * G) == 0):
        G *= 2
    return G


def pow2(n: int) -> int:
    """The block width that holds n columns: the next power of two, at least 16 (tl.dot's least)."""
    return max(16, 1 << (max(1, n) - 1).bit_length())


def strides_bht(x: torch.Tensor) -> tuple[int, ...]:
    """(batch, head, time) strides of a (B, H, T, D) tensor; the kernels need its last axis
    contiguous (see ``unit_last``)."""
    return tuple(x.stride()[:3])


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last axis is contiguous (or of length <= 1), else a contiguous copy."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def patch_interpreter() -> None:
    """Work around two bugs of Triton 3.6's CPU interpreter (only under ``TRITON_INTERPRET=1``).

    1. It holds scalars as 1-element arrays and converts them with ``int(array)``, which numpy
       >= 2.3 refuses for arrays of one dimension, so every ``range(0, n)`` over a kernel
       argument fails: ``__index__`` is re-registered to read the single element.
    2. It stores bf16 as raw uint16 and ``tl.dot`` multiplies those raw bits: bf16 operands are
       widened to fp32 first (exact, as the GPU's bf16 products are).
    """
    if not interpreting() or not triton_available():
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_linearize_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._linearize_patched = True
    interpreter._patch_lang_tensor = patched

    import numpy as np
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(x):
            if x.dtype.scalar == tl.bfloat16:
                data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data.reshape(x.data.shape), tl.float32)
            return x
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


@contextlib.contextmanager
def fork_stream(side: Optional["torch.cuda.Stream"]):
    """Run the block on ``side`` (after the work queued so far on the current stream), or inline."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        yield


def join_stream(side: Optional["torch.cuda.Stream"], *tensors) -> None:
    """The current stream waits for ``side``; tensors made there are marked as used here, so the
    allocator does not hand their memory back to ``side`` while this stream still reads them."""
    if side is None:
        return
    main = torch.cuda.current_stream(side.device)
    main.wait_stream(side)
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t.record_stream(main)


def fused_segment_count(B: int, H: int, T: int, sms: int) -> int:
    """Segments for the fused Gluon forwards, Lizard's and GLA's (each one a program; its entering
    state costs a pre-pass over the sequence before it). One where the (batch x head) programs keep at least half the
    multiprocessors busy; else the most, in powers of two, that make at most two programs per
    multiprocessor, at least 16 chunks long each (the H200 sweep's optima: benchmarks/kernel-settings.md)."""
    if 2 * B * H >= sms:
        return 1
    n = 1
    while B * H * n <= sms and T // (64 * 2 * n) >= 16:  # doubling n keeps <= 2 per SM
        n *= 2
    return n
