"""Chunked causal linear attention: quadratic inside a chunk, state carried between chunks."""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .naive import LinearAttnState, check_inputs


def linear_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, normalize: bool = True,
    state: Optional[LinearAttnState] = None, chunk_size: int = 64, eps: float = 1e-6,
) -> tuple[torch.Tensor, LinearAttnState]:
    dt, state = check_inputs(q, k, v, state)
    S, z = state
    T = q.shape[2]
    outs = []
    for s0, s1 in common.chunk_spans(T, chunk_size):
        qc, kc, vc = q[:, :, s0:s1].to(dt), k[:, :, s0:s1].to(dt), v[:, :, s0:s1].to(dt)
        C = s1 - s0
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        a = (qc @ kc.transpose(-1, -2)).masked_fill(~causal, 0.0)  # (B, H, C, C)
        num = qc @ S + a @ vc
        if normalize:
            den = (qc @ z.unsqueeze(-1)) + a.sum(-1, keepdim=True)
            outs.append(common.normalize_output(num, den, eps))
            z = z + kc.sum(2)
        else:
            outs.append(num)
        S = S + kc.transpose(-1, -2) @ vc
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), LinearAttnState(S, z)
