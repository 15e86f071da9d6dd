"""Recurrent gated linear attention: one token at a time (the decoding form).

Shapes: q, k (B, H, T, Dk); v (B, H, T, Dv); log_g (B, H, T) or (B, H, T, Dk); o (B, H, T, Dv).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .naive import GLAState, check_inputs, feature


def gla_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, *, normalize: bool = True,
    log_space_features: bool = False, state: Optional[GLAState] = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, GLAState]:
    dt, vector_gate, (S, z) = check_inputs(q, k, v, log_g, state)
    # gates as (B, H, T, Dk|1): a scalar gate broadcasts over the channels
    gamma = log_g.to(dt).exp() if vector_gate else log_g.to(dt).exp().unsqueeze(-1)
    outs = []
    for t in range(q.shape[2]):
        qt = feature(q[:, :, t].to(dt), log_space_features)  # (B, H, Dk)
        kt = feature(k[:, :, t].to(dt), log_space_features)
        vt, gt = v[:, :, t].to(dt), gamma[:, :, t]  # (B, H, Dv), (B, H, Dk|1)
        S = gt.unsqueeze(-1) * S + kt.unsqueeze(-1) * vt.unsqueeze(-2)
        num = (qt.unsqueeze(-2) @ S).squeeze(-2)
        if normalize:
            z = gt * z + kt
            den = (qt * z).sum(-1, keepdim=True)
            num = common.normalize_output(num, den, eps)
        outs.append(num)
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), GLAState(S, z)


def gla_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: Optional[torch.Tensor], S: torch.Tensor,
              z: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """One normalised decoding step on the state, in place (what a decoder with static buffers runs).

    q, k (B, H, Dk) plain features and v (B, H, Dv), all in the state's dtype; log_g (B, H) or
    (B, H, Dk), or None for no decay (plain linear attention); S (B, H, Dk, Dv) and z (B, H, Dk)
    are updated in place: S = g S + k v^T, z = g z + k. Returns o (B, H, Dv) in the state's dtype,
    the same as ``gla_recurrent`` for one token with ``normalize=True``."""
    if log_g is not None:
        gt = log_g.to(S.dtype).exp()
        if gt.dim() == 2:
            gt = gt.unsqueeze(-1)
        S.mul_(gt.unsqueeze(-1)).add_(k.unsqueeze(-1) * v.unsqueeze(-2))
        z.mul_(gt).add_(k)
    else:
        S.add_(k.unsqueeze(-1) * v.unsqueeze(-2))
        z.add_(k)
    num = (q.unsqueeze(-2) @ S).squeeze(-2)
    den = (q * z).sum(-1, keepdim=True)
    return common.normalize_output(num, den, eps)
