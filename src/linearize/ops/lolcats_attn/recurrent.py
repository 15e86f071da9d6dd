"""Recurrent LoLCATs hybrid: one token at a time; the oldest cached key folds into S/z."""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from ..window_attn.naive import check_softcap, key_positions
from .naive import LolcatsState, check_inputs, fold_leaving, hybrid_attend


def lolcats_attn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor,
    window_factor: torch.Tensor, *, window: int, terraced: bool = False, scale: Optional[float] = None,
    state: Optional[LolcatsState] = None, eps: float = 1e-6, softcap: Optional[float] = None,
) -> tuple[torch.Tensor, LolcatsState]:
    dt, L, state = check_inputs(q, k, v, fq, fk, window_factor, window, terraced, state)
    scale = common.softmax_scale(scale, q.shape[-1])
    softcap = check_softcap(softcap)
    f = window_factor.to(dt)
    S, z, cache_k, cache_fk, cache_v, pos = state
    outs = []
    for t in range(q.shape[2]):
        keys = torch.cat([cache_k, k[:, :, t:t + 1].to(dt)], dim=2)  # (B, H, L + 1, Dk)
        fkeys = torch.cat([cache_fk, fk[:, :, t:t + 1].to(dt)], dim=2)
        values = torch.cat([cache_v, v[:, :, t:t + 1].to(dt)], dim=2)
        k_pos = key_positions(pos, L, 1)
        outs.append(hybrid_attend(q[:, :, t:t + 1].to(dt), fq[:, :, t:t + 1].to(dt), keys, fkeys, values,
                                  k_pos[:, L:], k_pos, S, z, f, window, terraced, scale, eps, softcap))
        S, z = fold_leaving(S, z, fkeys, values, k_pos, 1)
        cache_k, cache_fk, cache_v, pos = keys[:, :, 1:], fkeys[:, :, 1:], values[:, :, 1:], pos + 1
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), LolcatsState(S, z, cache_k, cache_fk, cache_v, pos)
