"""Recurrent sparse window: one token per step (decoding), the same span step with C = 1."""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from ..window_attn.naive import check_softcap
from .naive import SparseWindowState, check_inputs, span_step


def sparse_window_attn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score: torch.Tensor, *, window: int, cache_size: int,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[SparseWindowState] = None, softcap: Optional[float] = None,
    cache_q: Optional[torch.Tensor] = None, leave_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, SparseWindowState]:
    dt, state = check_inputs(q, k, v, score, window, cache_size, sink_logits, sink_k, sink_v, state, cache_q, leave_k)
    scale, softcap = common.softmax_scale(scale, q.shape[-1]), check_softcap(softcap)
    outs = []
    for t in range(q.shape[2]):
        part = lambda x: None if x is None else x[:, :, t:t + 1].to(dt)  # noqa: E731
        o, state = span_step(part(q), part(k), part(v), part(score), state, window=window, scale=scale,
                             sink_logits=sink_logits, sink_k=sink_k, sink_v=sink_v, softcap=softcap,
                             cache_q=part(cache_q), leave_k=part(leave_k))
        outs.append(o)
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), state
