"""Chunked sparse window: ``chunk_size`` queries per span, the state carried between spans.

From a fresh state (no state, or ``fresh_state``) the spans can also run all at once (``live``:
each pair's stay in the cache is an interval, found by comparisons), the same outputs and state
without a sequential loop. ``form`` picks: "spans", "live", or None: live where it pays, on a GPU
(one batch of kernels for the whole input instead of a few dozen small ones a span) up to
``LIVE_MAX`` tokens; a CPU loops, its comparisons would cost more than the spans.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from .. import common
from ..window_attn.naive import check_softcap
from .live import cache_until, final_state, live_attend, pair_keys
from .naive import SparseWindowState, check_inputs, span_step

LIVE_MAX = 16384  # beyond, the live form's O(T^2) comparisons cost more than the span loop
FORMS = ("spans", "live")


def run_spans(q, k, v, score, state, sink_logits, sink_k, sink_v, cache_q, leave_k, *, window, scale, softcap,
           chunk_size, dt):
    outs = []
    for s0, s1 in common.chunk_spans(q.shape[2], chunk_size):
        part = lambda x: None if x is None else x[:, :, s0:s1].to(dt)  # noqa: E731
        o, state = span_step(part(q), part(k), part(v), part(score), state, window=window, scale=scale,
                             sink_logits=sink_logits, sink_k=sink_k, sink_v=sink_v, softcap=softcap,
                             cache_q=part(cache_q), leave_k=part(leave_k))
        outs.append(o)
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o, state


def on_gpu(x: torch.Tensor) -> bool:
    return x.device.type != "cpu"


def sparse_window_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score: torch.Tensor, *, window: int, cache_size: int,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[SparseWindowState] = None, softcap: Optional[float] = None, chunk_size: int = 64,
    recompute: bool = True, cache_q: Optional[torch.Tensor] = None, leave_k: Optional[torch.Tensor] = None,
    fresh_state: bool = False, form: Optional[str] = None,
) -> tuple[torch.Tensor, SparseWindowState]:
    """``recompute``: with gradients on, keep only the inputs and recompute the spans in backward
    (see the module); False keeps every span's tensors (faster backward, far more memory).
    ``fresh_state``: the caller vouches that ``state`` has seen nothing (an empty cache, its window
    before the first position, as ``fresh_state()`` makes it), so the live form may run.
    ``form``: "spans", "live" (needs a fresh state) or None (see the module)."""
    fresh = state is None or fresh_state
    if form is None:
        live = fresh and on_gpu(q) and q.shape[2] <= LIVE_MAX
    elif form in FORMS:
        if form == "live" and not fresh:
            raise ValueError("form='live' needs a fresh state: state=None, or fresh_state=True for one that has "
                             "seen nothing")
        live = form == "live"
    else:
        raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")
    dt, state = check_inputs(q, k, v, score, window, cache_size, sink_logits, sink_k, sink_v, state, cache_q, leave_k)
    scale, softcap = common.softmax_scale(scale, q.shape[-1]), check_softcap(softcap)
    grad = recompute and torch.is_grad_enabled()
    if live:
        P, out_dtype = max(q.shape[2] - window, 0), v.dtype
        cast = lambda x: None if x is None else x.to(dt)  # noqa: E731
        q, k, v, cache_q, leave_k, score = (cast(x) for x in (q, k, v, cache_q, leave_k, score))
        pair_pos = state.pos[:, None] + torch.arange(P, device=q.device)
        until = cache_until(score[:, :, window:], pair_pos >= 0, cache_size)
        args = (q, k, v, cache_q, leave_k, until, state.pos, sink_logits, sink_k, sink_v)
        kw = dict(window=window, cache_size=cache_size, scale=scale, softcap=softcap, block=chunk_size)
        if grad:
            o = checkpoint(live_attend, *args, use_reentrant=False, preserve_rng_state=False, **kw)
        else:
            o = live_attend(*args, **kw)
        return o.to(out_dtype), final_state(k, v, pair_keys(k, leave_k, window), score, until, state, window)
    args = (q, k, v, score, state, sink_logits, sink_k, sink_v, cache_q, leave_k)
    kw = dict(window=window, scale=scale, softcap=softcap, chunk_size=chunk_size, dt=dt)
    if grad:
        # no randomness inside, so no RNG state to save (and none to query while a CUDA graph captures)
        o, state = checkpoint(run_spans, *args, use_reentrant=False, preserve_rng_state=False, **kw)
    else:
        o, state = run_spans(*args, **kw)
    return o.to(v.dtype), state
