"""Chunked sliding-window softmax with sinks: each chunk's queries against [cache ++ chunk keys].

Work and memory per chunk are O(C (L + C)); nothing of size T x T is ever built. After a chunk
the cache keeps the last L keys/values, which is all a later query can see (see ``naive``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .naive import (
    WindowState, check_inputs, check_softcap, keep_last, key_positions, sink_softmax_attend, visible,
)


def window_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, terraced: bool = False,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[WindowState] = None, softcap: Optional[float] = None, chunk_size: int = 64,
) -> tuple[torch.Tensor, WindowState]:
    dt, L, state = check_inputs(q, k, v, window, terraced, sink_logits, sink_k, sink_v, state)
    scale = common.softmax_scale(scale, q.shape[-1])
    softcap = check_softcap(softcap)
    cache_k, cache_v, pos = state
    outs = []
    for s0, s1 in common.chunk_spans(q.shape[2], chunk_size):
        C = s1 - s0
        keys = torch.cat([cache_k, k[:, :, s0:s1].to(dt)], dim=2)  # (B, H, L + C, Dk)
        values = torch.cat([cache_v, v[:, :, s0:s1].to(dt)], dim=2)
        k_pos = key_positions(pos, L, C)
        mask = visible(k_pos[:, L:], k_pos, window, terraced)
        outs.append(sink_softmax_attend(q[:, :, s0:s1].to(dt), keys, values, mask, scale,
                                        sink_logits, sink_k, sink_v, softcap))
        cache_k, cache_v, pos = keep_last(keys, L), keep_last(values, L), pos + C
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), WindowState(cache_k, cache_v, pos)
