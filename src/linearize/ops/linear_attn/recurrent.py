"""Recurrent causal linear attention: one token at a time (the decoding form)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .naive import LinearAttnState, check_inputs


def linear_attn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, normalize: bool = True,
    state: Optional[LinearAttnState] = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, LinearAttnState]:
    dt, state = check_inputs(q, k, v, state)
    S, z = state
    outs = []
    for t in range(q.shape[2]):
        qt, kt, vt = q[:, :, t].to(dt), k[:, :, t].to(dt), v[:, :, t].to(dt)  # (B, H, D)
        S = S + kt.unsqueeze(-1) * vt.unsqueeze(-2)
        num = (qt.unsqueeze(-2) @ S).squeeze(-2)
        if normalize:
            z = z + kt
            den = (qt * z).sum(-1, keepdim=True)
            num = common.normalize_output(num, den, eps)
        outs.append(num)
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), LinearAttnState(S, z)
