"""LION as a bidirectional RNN: a forward and a backward recurrence, token by token.

Shapes: q, k (B, H, T, F); v (B, H, T, Dv); log_a None | (H,) | (B, H, T); valid (B, T) or None;
o (B, H, T, Dv).

    S^F_t = a_t S^F_{t-1} + k_t v_t^T        z^F_t = a_t z^F_{t-1} + k_t
    S^B_t = a'_t S^B_{t+1} + k_t v_t^T       z^B_t = a'_t z^B_{t+1} + k_t    (a' = a unless log_a_back)
    y_t   = q_t^T (S^F_t + S^B_t - k_t v_t^T) / q_t^T (z^F_t + z^B_t - k_t)

Both states include token t, so its own term k_t v_t^T is subtracted once: the diagonal counts
once. q_t^T S is read per direction and the three reads are combined, so only the two running
states and the per-token reads are kept (the output has that size anyway), never a state per
token.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .naive import LionState, check_inputs, masked_inputs, token_log_gates


def lion_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_a: Optional[torch.Tensor] = None, *,
    valid: Optional[torch.Tensor] = None, scaled: bool = True, eps: float = 1e-6,
    log_a_back: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, LionState]:
    dt, valid = check_inputs(q, k, v, log_a, valid, log_a_back)
    B, H, T, F = q.shape
    qf, kf, vf = masked_inputs(q, k, v, valid, dt)
    lg = token_log_gates(log_a, valid, B, T, dt)
    a_fwd = None if lg is None else lg.exp().unsqueeze(-1)  # (B, H, T, 1)
    a_bwd = a_fwd if log_a_back is None else token_log_gates(log_a_back, valid, B, T, dt).exp().unsqueeze(-1)

    def step(S, z, t, a):
        if a is not None:
            S, z = a[:, :, t].unsqueeze(-1) * S, a[:, :, t] * z
        kt = kf[:, :, t]
        return S + kt.unsqueeze(-1) * vf[:, :, t].unsqueeze(-2), z + kt

    def read(S, z, t):
        qt = qf[:, :, t]
        return (qt.unsqueeze(-2) @ S).squeeze(-2), (qt * z).sum(-1, keepdim=True)

    zeros = lambda: (qf.new_zeros(B, H, F, vf.shape[-1]), qf.new_zeros(B, H, F))  # noqa: E731
    S_f, z_f = zeros()
    reads = [None] * T  # the forward reads q_t^T S^F_t, q_t^T z^F_t, freed as the backward sweep uses them
    for t in range(T):
        S_f, z_f = step(S_f, z_f, t, a_fwd)
        reads[t] = read(S_f, z_f, t)
    S_b, z_b = zeros()
    outs = [None] * T
    for t in range(T - 1, -1, -1):
        S_b, z_b = step(S_b, z_b, t, a_bwd)
        num_b, den_b = read(S_b, z_b, t)
        (num_f, den_f), reads[t] = reads[t], None
        self_w = (qf[:, :, t] * kf[:, :, t]).sum(-1, keepdim=True)  # q_t . k_t: in both sweeps, counted once
        num = num_f + num_b - self_w * vf[:, :, t]
        outs[t] = common.normalize_output(num, den_f + den_b - self_w, eps) if scaled else num
    o = torch.stack(outs, 2) if T else vf
    return o.to(v.dtype), LionState(S_f, z_f, S_b, z_b)
