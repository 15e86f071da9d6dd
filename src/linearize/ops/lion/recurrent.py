"""LION as a bidirectional RNN: a forward and a backward recurrence, token by token.

Shapes: q, k (B, H, T, F); v (B, H, T, Dv); log_a None | (H,) | (B, H, T); valid (B, T) or None;
o (B, H, T, Dv).

    S^F_t = a_t S^F_{t-1} + k_t v_t^T        z^F_t = a_t z^F_{t-1} + k_t
    S^B_t = a'_t S^B_{t+1} + k_t v_t^T       z^B_t = a'_t z^B_{t+1} + k_t    (a' = a unless log_a_back)
    y_t   = q_t^T (S^F_t + S^B_t - k_t v_t^T) / q_t^T (z^F_t + z^B_t - k_t)

Both states include token t, so its own term k_t v_t^T is subtracted once: the diagonal counts
once. q_t^T S is read per direction and the three reads are combined, so only the two running
states and the per-token reads are kept (the output has that size anyway), never a state per
token. Given feature maps (``phi_q`` / ``phi_k``) and no autograd, each sweep makes the features of
a block of ``FEATURE_BLOCK`` tokens at a time, so no F-wide tensor spans the input either.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .naive import FeatureMap, LionState, check_inputs, feature_width, records_graph, span_qkv, token_log_gates

FEATURE_BLOCK = 64  # tokens whose features are made at once when the op applies the feature maps


def lion_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_a: Optional[torch.Tensor] = None, *,
    valid: Optional[torch.Tensor] = None, scaled: bool = True, eps: float = 1e-6,
    log_a_back: Optional[torch.Tensor] = None, phi_q: Optional[FeatureMap] = None,
    phi_k: Optional[FeatureMap] = None, key_valid: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, LionState]:
    dt, valid, keys = check_inputs(q, k, v, log_a, valid, log_a_back, phi_q, phi_k, key_valid)
    B, H, T, _ = q.shape
    Dv, out_dtype = v.shape[-1], v.dtype
    F = feature_width(k, phi_k)
    lg = token_log_gates(log_a, valid, B, T, dt)
    a_fwd = None if lg is None else lg.exp().unsqueeze(-1)  # (B, H, T, 1)
    a_bwd = a_fwd if log_a_back is None else token_log_gates(log_a_back, valid, B, T, dt).exp().unsqueeze(-1)
    graph = records_graph((q, k, v, log_a, log_a_back), phi_q)
    # features given, or kept by autograd anyway: make them once
    if phi_q is None or graph:
        q, k, v = span_qkv(q, k, v, valid, keys, dt, phi_q, phi_k)
        phi_q = phi_k = valid = keys = None
        blocks = [(0, T)]
    else:  # a block of tokens at a time in each sweep, so no F-wide tensor spans the input
        blocks = [(s, min(s + FEATURE_BLOCK, T)) for s in range(0, T, FEATURE_BLOCK)]

    def step(S, z, t, a, kt, vt):
        if a is not None:
            S, z = a[:, :, t].unsqueeze(-1) * S, a[:, :, t] * z
        return S + kt.unsqueeze(-1) * vt.unsqueeze(-2), z + kt

    def read(S, z, qt):
        return (qt.unsqueeze(-2) @ S).squeeze(-2), (qt * z).sum(-1, keepdim=True)

    # Per token: the forward sweep's reads q_t^T S^F_t and q_t^T z^F_t, and the output. Without
    # autograd they go into buffers made once, indexed by t: T small tensors that outlive the
    # sweep's temporaries fragment the CPU heap (peak 862 MiB for one layer at 32K tokens).
    # Under autograd, lists (writing slices in place would cost the backward a copy per token).
    if graph:
        num_fs, den_fs, outs = [None] * T, [None] * T, [None] * T
    else:
        num_fs, den_fs, outs = (v.new_empty(T, B, H, n, dtype=dt) for n in (Dv, 1, Dv))
    S_f, z_f = v.new_zeros(B, H, F, Dv, dtype=dt), v.new_zeros(B, H, F, dtype=dt)
    for s0, s1 in blocks:
        qb, kb, vb = span_qkv(q, k, v, valid, keys, dt, phi_q, phi_k, s0, s1)
        for t in range(s0, s1):
            S_f, z_f = step(S_f, z_f, t, a_fwd, kb[:, :, t - s0], vb[:, :, t - s0])
            num_fs[t], den_fs[t] = read(S_f, z_f, qb[:, :, t - s0])
    S_b, z_b = torch.zeros_like(S_f), torch.zeros_like(z_f)
    for s0, s1 in reversed(blocks):
        qb, kb, vb = span_qkv(q, k, v, valid, keys, dt, phi_q, phi_k, s0, s1)
        for t in range(s1 - 1, s0 - 1, -1):
            qt, kt, vt = qb[:, :, t - s0], kb[:, :, t - s0], vb[:, :, t - s0]
            S_b, z_b = step(S_b, z_b, t, a_bwd, kt, vt)
            num_b, den_b = read(S_b, z_b, qt)
            self_w = (qt * kt).sum(-1, keepdim=True)  # q_t . k_t: in both sweeps, counted once
            num = num_fs[t] + num_b - self_w * vt
            outs[t] = common.normalize_output(num, den_fs[t] + den_b - self_w, eps) if scaled else num
    if graph:
        o = torch.stack(outs, 2) if T else v.new_zeros(B, H, 0, Dv)
    else:
        o = outs.movedim(0, 2).contiguous()
    return o.to(out_dtype), LionState(S_f, z_f, S_b, z_b)
