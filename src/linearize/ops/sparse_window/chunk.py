"""Chunked sparse window: ``chunk_size`` queries per span, the state carried between spans.

Each span gathers its own copies of the cached keys and values and a (C, M + w + C) softmax, and
autograd would keep all of them: O(T (M + w) (D + C)) bytes a layer, which outgrows a GPU at
training shapes (a 30-layer model, 8 x 2K rows, M = 256). With gradients on, the spans therefore
run under activation checkpointing: autograd keeps the inputs and recomputes the spans in the
backward pass, one layer at a time (one more forward of this op; the selection is exact, so the
recomputation is the same)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from .. import common
from ..window_attn.naive import check_softcap
from .naive import SparseWindowState, check_inputs, span_step


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


def sparse_window_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score: torch.Tensor, *, window: int, cache_size: int,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[SparseWindowState] = None, softcap: Optional[float] = None, chunk_size: int = 64,
    recompute: bool = True, cache_q: Optional[torch.Tensor] = None, leave_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, SparseWindowState]:
    """``recompute``: with gradients on, keep only the inputs and recompute the spans in backward
    (see the module); False keeps every span's tensors (faster backward, far more memory)."""
    dt, state = check_inputs(q, k, v, score, window, cache_size, sink_logits, sink_k, sink_v, state, cache_q, leave_k)
    scale, softcap = common.softmax_scale(scale, q.shape[-1]), check_softcap(softcap)
    args = (q, k, v, score, state, sink_logits, sink_k, sink_v, cache_q, leave_k)
    kw = dict(window=window, scale=scale, softcap=softcap, chunk_size=chunk_size, dt=dt)
    if recompute and torch.is_grad_enabled():
        # no randomness inside, so no RNG state to save (and none to query while a CUDA graph captures)
        o, state = checkpoint(run_spans, *args, use_reentrant=False, preserve_rng_state=False, **kw)
    else:
        o, state = run_spans(*args, **kw)
    return o.to(v.dtype), state
