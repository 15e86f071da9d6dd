"""Recurrent sliding-window softmax with sinks: one token at a time over the fixed-size cache."""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .naive import (
    WindowState, check_inputs, check_softcap, keep_last, key_positions, sink_softmax_attend, visible,
)


def window_attn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, terraced: bool = False,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[WindowState] = None, softcap: Optional[float] = None,
) -> tuple[torch.Tensor, WindowState]:
    dt, L, state = check_inputs(q, k, v, window, terraced, sink_logits, sink_k, sink_v, state)
    scale = common.softmax_scale(scale, q.shape[-1])
    softcap = check_softcap(softcap)
    cache_k, cache_v, pos = state
    outs = []
    for t in range(q.shape[2]):
        keys = torch.cat([cache_k, k[:, :, t:t + 1].to(dt)], dim=2)  # (B, H, L + 1, Dk)
        values = torch.cat([cache_v, v[:, :, t:t + 1].to(dt)], dim=2)
        k_pos = key_positions(pos, L, 1)
        # standard windows see every filled slot; terraced ones may not (previous block only)
        mask = visible(k_pos[:, L:], k_pos, window, terraced)
        outs.append(sink_softmax_attend(q[:, :, t:t + 1].to(dt), keys, values, mask, scale,
                                        sink_logits, sink_k, sink_v, softcap))
        cache_k, cache_v, pos = keys[:, :, 1:], values[:, :, 1:], pos + 1
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), WindowState(cache_k, cache_v, pos)
