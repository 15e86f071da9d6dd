"""Chunked LoLCATs hybrid: each chunk's queries against S/z and [cache ++ chunk keys].

Per chunk, keys split by the rule into window (softmax) terms, linear terms and invisible ones;
then the keys that leave the cache fold into S/z. Work per chunk is O(C (L + C)); no T x T matrix.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from ..window_attn.naive import check_softcap, keep_last, key_positions
from .naive import LolcatsState, check_inputs, fold_leaving, hybrid_attend


def lolcats_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor,
    window_factor: torch.Tensor, *, window: int, terraced: bool = False, scale: Optional[float] = None,
    state: Optional[LolcatsState] = None, eps: float = 1e-6, softcap: Optional[float] = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, LolcatsState]:
    dt, L, state = check_inputs(q, k, v, fq, fk, window_factor, window, terraced, state)
    scale = common.softmax_scale(scale, q.shape[-1])
    softcap = check_softcap(softcap)
    f = window_factor.to(dt)
    S, z, cache_k, cache_fk, cache_v, pos = state
    outs = []
    for s0, s1 in common.chunk_spans(q.shape[2], chunk_size):
        C = s1 - s0
        keys = torch.cat([cache_k, k[:, :, s0:s1].to(dt)], dim=2)  # (B, H, L + C, Dk)
        fkeys = torch.cat([cache_fk, fk[:, :, s0:s1].to(dt)], dim=2)
        values = torch.cat([cache_v, v[:, :, s0:s1].to(dt)], dim=2)
        k_pos = key_positions(pos, L, C)
        outs.append(hybrid_attend(q[:, :, s0:s1].to(dt), fq[:, :, s0:s1].to(dt), keys, fkeys, values,
                                  k_pos[:, L:], k_pos, S, z, f, window, terraced, scale, eps, softcap))
        S, z = fold_leaving(S, z, fkeys, values, k_pos, C)
        cache_k, cache_fk, cache_v = keep_last(keys, L), keep_last(fkeys, L), keep_last(values, L)
        pos = pos + C
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), LolcatsState(S, z, cache_k, cache_fk, cache_v, pos)
