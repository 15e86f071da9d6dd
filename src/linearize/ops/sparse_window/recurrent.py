"""Recurrent sparse window: one token per step (decoding), the same span step with C = 1."""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from ..window_attn.naive import check_softcap
from .chunk import run_spans
from .naive import SparseWindowState, check_inputs, stored


def sparse_window_attn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score: torch.Tensor, *, window: int, cache_size: int,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[SparseWindowState] = None, softcap: Optional[float] = None,
    cache_q: Optional[torch.Tensor] = None, leave_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, SparseWindowState]:
    dt, state = check_inputs(q, k, v, score, window, cache_size, sink_logits, sink_k, sink_v, state, cache_q, leave_k)
    scale, softcap = common.softmax_scale(scale, q.shape[-1]), check_softcap(softcap)
    o, new = run_spans(q, k, v, score, state, sink_logits, sink_k, sink_v, cache_q, leave_k, window=window,
                       scale=scale, softcap=softcap, chunk_size=1, dt=dt)
    return o.to(v.dtype), stored(new, k, v, leave_k)
