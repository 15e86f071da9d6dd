"""Parallel (quadratic) reference for causal linear attention, straight from the formula."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import common


class LinearAttnState(NamedTuple):
    """S: (B, H, Dk, Dv) = sum_s k_s v_s^T;  z: (B, H, Dk) = sum_s k_s (zeros when unnormalised)."""

    S: torch.Tensor
    z: torch.Tensor


def check_inputs(q, k, v, state: Optional[LinearAttnState]):
    B, H, T, Dk, Dv = common.check_qkv(q, k, v)
    dt = common.compute_dtype(q, k, v)
    if state is None:
        state = LinearAttnState(q.new_zeros(B, H, Dk, Dv, dtype=dt), q.new_zeros(B, H, Dk, dtype=dt))
    else:
        common.check_state_tensor("S", state.S, (B, H, Dk, Dv))
        common.check_state_tensor("z", state.z, (B, H, Dk))
        state = LinearAttnState(state.S.to(dt), state.z.to(dt))
    return dt, state


def linear_attn_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, normalize: bool = True,
    state: Optional[LinearAttnState] = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, LinearAttnState]:
    """o_t = sum_{s<=t} (q_t.k_s) v_s (+ q_t^T S_0), divided by the same sum of weights when normalised."""
    dt, state = check_inputs(q, k, v, state)
    qf, kf, vf = q.to(dt), k.to(dt), v.to(dt)
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    weights = (qf @ kf.transpose(-1, -2)).masked_fill(~causal, 0.0)  # (B, H, T, T)
    num = weights @ vf + qf @ state.S
    S = state.S + kf.transpose(-1, -2) @ vf
    if normalize:
        den = weights.sum(-1, keepdim=True) + (qf @ state.z.unsqueeze(-1))
        o = common.normalize_output(num, den, eps)
        z = state.z + kf.sum(2)
    else:
        o, z = num, state.z
    return o.to(v.dtype), LinearAttnState(S, z)
