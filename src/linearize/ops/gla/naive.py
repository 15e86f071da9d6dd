"""Parallel (quadratic) reference for gated linear attention, straight from the formula.

Shapes: q, k (B, H, T, Dk); v (B, H, T, Dv); log_g (B, H, T) or (B, H, T, Dk); o (B, H, T, Dv).

The pairwise cumulative-gate differences b_t - b_s are taken over the whole sequence, so this
form is a reference for test sizes, not a way to run long inputs (``gla_chunk`` is).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import common


class GLAState(NamedTuple):
    """S: (B, H, Dk, Dv) = Σ_s (Π_{l>s} γ_l) ⊙ k_s v_s^T;  z: (B, H, Dk) the same sum of k_s
    (zeros when unnormalised). Both in the compute dtype."""

    S: torch.Tensor
    z: torch.Tensor


def check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, state: Optional[GLAState],
) -> tuple[torch.dtype, bool, GLAState]:
    """Validate the inputs; returns (compute dtype, whether the gate is per channel, initial state)."""
    B, H, T, Dk, Dv = common.check_qkv(q, k, v)
    vector_gate = common.check_per_token("log_g", log_g, B, H, T, Dk)
    dt = common.compute_dtype(q, k, v, log_g)
    if state is None:
        state = GLAState(q.new_zeros(B, H, Dk, Dv, dtype=dt), q.new_zeros(B, H, Dk, dtype=dt))
    else:
        common.check_state_tensor("S", state.S, (B, H, Dk, Dv))
        common.check_state_tensor("z", state.z, (B, H, Dk))
        state = GLAState(state.S.to(dt), state.z.to(dt))
    return dt, vector_gate, state


def feature(x: torch.Tensor, log_space_features: bool) -> torch.Tensor:
    """The feature itself: exp of a log-feature (exp(-inf) = 0), else the input."""
    return x.exp() if log_space_features else x


def gla_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, *, normalize: bool = True,
    log_space_features: bool = False, state: Optional[GLAState] = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, GLAState]:
    """o_t = Σ_{s<=t} Σ_f φq_t[f] φk_s[f] e^{b_t[f] - b_s[f]} v_s (+ φq_t^T (e^{b_t} ⊙ S_0)),
    divided by the same sum without v when normalised."""
    dt, vector_gate, state = check_inputs(q, k, v, log_g, state)
    qf, kf = feature(q.to(dt), log_space_features), feature(k.to(dt), log_space_features)
    vf = v.to(dt)
    T = q.shape[2]
    # A trailing channel axis of 1 for scalar gates lets one expression serve both kinds.
    lg = log_g.to(dt) if vector_gate else log_g.to(dt).unsqueeze(-1)  # (B, H, T, Dk|1)
    b = lg.cumsum(2)
    b_total = b[:, :, -1] if T else lg.sum(2)  # (B, H, Dk|1): the whole input's log-decay

    # Mask before the exp: for s > t, b_t - b_s >= 0 and its exp may overflow.
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    diff = (b.unsqueeze(3) - b.unsqueeze(2)).masked_fill(~causal.unsqueeze(-1), float("-inf"))
    decay = diff.exp()  # (B, H, T, T, Dk|1): e^{b_t - b_s} for s <= t, else 0
    if vector_gate:
        weights = torch.einsum("bhtf,bhsf,bhtsf->bhts", qf, kf, decay)
    else:
        weights = (qf @ kf.transpose(-1, -2)) * decay.squeeze(-1)

    q_from_start = qf * b.exp()  # reads the initial state, decayed through token t
    num = weights @ vf + q_from_start @ state.S
    k_to_end = kf * (b_total.unsqueeze(2) - b).exp()  # decayed from token s to the end
    S = b_total.exp().unsqueeze(-1) * state.S + k_to_end.transpose(-1, -2) @ vf
    if normalize:
        den = weights.sum(-1, keepdim=True) + q_from_start @ state.z.unsqueeze(-1)
        o = common.normalize_output(num, den, eps)
        z = b_total.exp() * state.z + k_to_end.sum(2)
    else:
        o, z = num, state.z
    return o.to(v.dtype), GLAState(S, z)
