"""The kernels' user settings: one frozen ``KernelSettings``, passed explicitly or set for a block.

    from linearize.ops.backend import KernelSettings, kernel_settings

    with kernel_settings(ow_from_scores=True, paired_states=True):   # trade time for memory
        loss = model(batch).loss
        loss.backward()

    y, *_ = lizard_attention(..., settings=KernelSettings(gluon=False))  # or for one call

A call without ``settings=`` takes ``current_settings()``: the defaults, or what the innermost
``kernel_settings`` block set. An autograd op keeps the settings of its forward for its backward,
so a backward run after the block ends still runs as its forward did. Every field is a choice a
user may want: memory for time, or a kernel switched off to debug. Launch constants (block sizes,
warps, stages) are not settings: they live in each backend module, tuned once
(``benchmarks/kernel-settings.md`` names the evidence; ``linearize.bench.kernels tune`` sweeps them).
Nothing here imports Triton.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace
from typing import Iterator, Optional

__all__ = ["KernelSettings", "current_settings", "kernel_settings"]


@dataclass(frozen=True)
class KernelSettings:
    """What a user may change about how the GPU kernels run; no field changes a result beyond rounding.

    ``chunk``: the token chunk of the gated (GLA) kernels, a power of two from 16 to 128 (fp32 inputs
    use at most 32). Smaller chunks keep fewer bytes per state in shared memory but more states for
    the backward; the Hopper Gluon kernels run only at 64, so any other value runs the Triton passes.
    ``gluon``: the hand-written Gluon kernels on Hopper (GLA's fused forward and backward, the
    window's backward, Lizard's fused forward). False runs the portable Triton passes only: to
    debug, or to compare against a kernel suspected wrong. Slower where Gluon applies.
    ``side_streams``: Lizard's op runs independent passes on extra CUDA streams beside each other.
    False keeps every pass on the caller's stream (simpler profiles; when something else must
    own the other streams); a little slower at shapes with few (batch x head) pairs.
    ``og_from_y``: Lizard's training forward keeps no gated output o_g: its backward forms dy . o_g
    from y and the window's rows. One (B, H, T, Dv) tensor fewer kept per layer, and faster; the
    price is y's rounding in the gradients of phi_q and log_g (about 0.5% relative RMS instead of
    0.4% in fp32). False keeps o_g, for the last bit of gradient accuracy.
    ``ow_from_scores``: Lizard's training forward keeps no window output o_w either: the window's
    backward forms it again from its scores. Memory for time: one (B, H, T, Dv) tensor fewer kept
    per layer until its backward, the backward about 4% slower.
    ``paired_states``: Lizard's fused training forward keeps the gated state of every second chunk
    only; the backward forms the others. Memory for time: half of those states (277 of 554 MB a
    layer at B16 T2048, 32 heads of 128), fwd+bwd about 3% slower."""

    chunk: int = 64
    gluon: bool = True
    side_streams: bool = True
    og_from_y: bool = True
    ow_from_scores: bool = False
    paired_states: bool = False

    def __post_init__(self):
        c = self.chunk
        if isinstance(c, bool) or not isinstance(c, int) or c < 16 or c > 128 or c & (c - 1):
            raise ValueError(f"KernelSettings.chunk must be a power of two from 16 to 128, got {c!r}")
        for f in fields(self):
            if f.name != "chunk" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"KernelSettings.{f.name} must be a bool, got {getattr(self, f.name)!r}")


_CURRENT = KernelSettings()


def current_settings() -> KernelSettings:
    """The settings a call without ``settings=`` runs with (the defaults outside any block)."""
    return _CURRENT


def resolve(settings: Optional[KernelSettings]) -> KernelSettings:
    """``settings`` when given, else ``current_settings()``; rejects anything else by name."""
    if settings is None:
        return _CURRENT
    if not isinstance(settings, KernelSettings):
        raise TypeError(f"settings must be a KernelSettings or None, got {type(settings).__name__}")
    return settings


@contextlib.contextmanager
def kernel_settings(settings: Optional[KernelSettings] = None, **changes) -> Iterator[KernelSettings]:
    """Run the block with ``settings`` (or the current ones) with ``changes`` applied; the settings
    before come back afterwards, also after an error. Blocks nest. Yields the settings in force.
    The settings are process-wide (as the kernels' launches are), not per thread."""
    global _CURRENT
    base = resolve(settings)
    unknown = sorted(set(changes) - {f.name for f in fields(KernelSettings)})
    if unknown:
        raise ValueError(f"unknown kernel settings {unknown}; allowed: {[f.name for f in fields(KernelSettings)]}")
    new = replace(base, **changes)
    before = _CURRENT
    _CURRENT = new
    try:
        yield new
    finally:
        _CURRENT = before
