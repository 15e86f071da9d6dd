"""Sliding-window softmax attention with sinks (Lizard's anchor window).

Query t (absolute position) sees key s iff s <= t and, for window w,
    standard:  t - w < s                    (the w most recent keys, itself included)
    terraced:  s // w >= t // w - 1         (its own w-block up to t plus the previous block)

    o_t = [sum_{s visible} e^{q_t.k_s*scale} v_s + sum_j e^{q_t.sk_j*scale} sv_j]
          / [sum_{s visible} e^{q_t.k_s*scale} + sum_j e^{q_t.sk_j*scale} + sum_j e^{t_j}]

v1 sinks ``sink_k (H, m, Dk)``, ``sink_v (H, m, Dv)``: key/value vectors every query attends to.
v2 sinks ``sink_logits (H, m)``: logits t_j with zero values (denominator only). Either, both or
none. ``softcap=c`` caps every query-key logit (window and sink keys, not sink logits) to
c * tanh(logit / c), as Gemma 2 does; None leaves them alone. The state is the last L = w - 1
(standard) or 2w - 1 (terraced) keys/values plus ``pos``, so it never grows with T.
Layout: see ``ops.common`` and ``naive``.

``window_attn_chunk`` (and ``window_attn_sum``, Lizard's combine fused into the window) is the
public op and the one place that picks a backend: the Triton/Gluon kernels (``triton``,
``gluon``) when ``window_applies`` (a standard window with v2 sink logits or none, no soft-cap, a
state that is None or fresh, on CUDA, kernels enabled: see ``ops.backend``), else the torch chunk
form (``chunk.window_attn_chunk``). Triton is imported only when the kernels run.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backend.dispatch import all_tensors, kernels_enabled, on_kernel_device
from ..backend.settings import KernelSettings

from .chunk import window_attn_chunk as window_attn_chunk_torch
from .naive import WindowState, cache_len, check_softcap, soft_cap, visible, window_attn_parallel
from .recurrent import window_attn_recurrent, window_ring_step_

__all__ = ["WindowState", "cache_len", "check_softcap", "soft_cap", "visible", "window_applies",
           "window_attn_chunk", "window_attn_chunk_torch", "window_attn_parallel", "window_attn_recurrent",
           "window_attn_sum", "window_ring_step_"]


def window_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, terraced: bool = False,
                   softcap: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
                   sink_k: Optional[torch.Tensor] = None, state: Optional[WindowState] = None,
                   fresh_state: bool = False) -> bool:
    """Whether the window kernels would run for these inputs (a given state must be fresh)."""
    if not kernels_enabled() or not all_tensors(q, k, v) or q.dim() != 4 or v.dim() != 4:
        return False
    if state is not None and not (fresh_state and isinstance(state, WindowState) and all_tensors(*state)):
        return False
    extra = [sink_logits] if isinstance(sink_logits, torch.Tensor) else []
    extra += [state.pos] if state is not None else []
    if not on_kernel_device(q, k, v, *extra):
        return False
    from . import triton as _window
    return _window.supports(q, k, v, terraced=terraced, softcap=softcap, sink_logits=sink_logits, sink_k=sink_k)


def window_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, terraced: bool = False,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[WindowState] = None, softcap: Optional[float] = None, chunk_size: int = 64,
    fresh_state: bool = False, settings: Optional[KernelSettings] = None,
) -> tuple[torch.Tensor, WindowState]:
    """Chunked window attention: ``chunk.window_attn_chunk`` (same result), on the Triton kernels when they apply.

    ``settings``: the kernels' user settings (default ``ops.backend.current_settings()``).
    ``fresh_state=True`` promises that ``state`` was just made for this input (``pos <= 0``:
    its cache is never visible), which lets the kernels take it without a device sync.
    """
    if window_applies(q, k, v, terraced=terraced, softcap=softcap, sink_logits=sink_logits, sink_k=sink_k,
                      state=state, fresh_state=fresh_state):
        from ..common import check_positive_int
        from .triton import window_attn_triton
        check_positive_int("chunk_size", chunk_size)
        return window_attn_triton(q, k, v, window=window, scale=scale, sink_logits=sink_logits, state=state,
                                  settings=settings)
    return window_attn_chunk_torch(q, k, v, window=window, terraced=terraced, scale=scale, sink_logits=sink_logits,
                               sink_k=sink_k, sink_v=sink_v, state=state, softcap=softcap, chunk_size=chunk_size)


def window_attn_sum(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y_global: torch.Tensor, alpha: torch.Tensor, *,
    window: int, terraced: bool = False, scale: Optional[float] = None,
    sink_logits: Optional[torch.Tensor] = None, sink_k: Optional[torch.Tensor] = None,
    sink_v: Optional[torch.Tensor] = None, state: Optional[WindowState] = None,
    softcap: Optional[float] = None, chunk_size: int = 64, fresh_state: bool = False,
    settings: Optional[KernelSettings] = None,
) -> Optional[tuple[torch.Tensor, WindowState]]:
    """Lizard's ``y = y_global + alpha[h] * window_attn(q, k, v)`` (B, H, T, Dv) in the dtype of
    v, with the combine fused into the window kernel; None when the kernels do not apply."""
    if not (window_applies(q, k, v, terraced=terraced, softcap=softcap, sink_logits=sink_logits, sink_k=sink_k,
                           state=state, fresh_state=fresh_state)
            and all_tensors(y_global, alpha) and on_kernel_device(q, y_global, alpha)):
        return None
    from ..common import check_positive_int
    from .triton import window_attn_triton
    check_positive_int("chunk_size", chunk_size)
    return window_attn_triton(q, k, v, window=window, scale=scale, sink_logits=sink_logits, state=state,
                              y_global=y_global, alpha=alpha, settings=settings)
