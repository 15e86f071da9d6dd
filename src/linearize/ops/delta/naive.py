"""Parallel (quadratic) reference for the delta rule and DeltaProduct, plus their shared checks.

Shapes: q, k (B, H, T, Dk), v (B, H, T, Dv), beta (B, H, T) [or (B, H, T, n) for DeltaProduct],
state S (B, H, Dk, Dv); DeltaProduct also carries k_prev (B, H, n-1, Dk), v_prev (B, H, n-1, Dv).

The closed form. Write the delta rule as S_t = S_0 + sum_{s<=t} k_s u_s^T with the pseudo-value
u_t = beta_t (v_t - S_{t-1}^T k_t). Substituting S_{t-1} gives, stacked over time,

    (I + tril(diag(beta) K K^T, -1)) U = diag(beta) (V - K S_0)        (unit lower triangular)
    O = Q S_0 + tril(Q K^T) U,    S_T = S_0 + K^T U.

(The TPTT paper's eq. 7 writes I - tril(...); the sign is +.) DeltaProduct is the same system
over the n*T virtual tokens, with output row t reading virtual columns s < n (t + 1).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import common

DEFAULT_EPS = 1e-6


class DeltaState(NamedTuple):
    """S: (B, H, Dk, Dv), the associative memory, in the compute dtype."""

    S: torch.Tensor


class DeltaProductState(NamedTuple):
    """S: (B, H, Dk, Dv) memory; k_prev (B, H, n-1, Dk), v_prev (B, H, n-1, Dv): the last n-1 raw
    (undifferenced) keys and values, oldest first, zeros before the sequence start. They let the
    next piece form its finite differences, so prefill in pieces equals prefill in one."""

    S: torch.Tensor
    k_prev: torch.Tensor
    v_prev: torch.Tensor


# ---------------------------------------------------------------------------------------------
# checks


def _check_state_field(name: str, x: torch.Tensor, shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
    common.check_state_tensor(name, x, shape)
    common.check_float(f"state.{name}", x)
    return x.to(dt)


def check_delta_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, state: Optional[DeltaState],
) -> tuple[torch.dtype, torch.Tensor]:
    """Validate delta-rule inputs; returns (compute dtype, initial S in that dtype)."""
    B, H, T, Dk, Dv = common.check_qkv(q, k, v)
    common.check_per_token("beta", beta, B, H, T, allow_vector=False)
    dt = common.compute_dtype(q, k, v, beta)
    if state is None:
        return dt, q.new_zeros(B, H, Dk, Dv, dtype=dt)
    if not isinstance(state, DeltaState):
        raise ValueError(f"state must be a DeltaState or None, got {type(state).__name__}")
    return dt, _check_state_field("S", state.S, (B, H, Dk, Dv), dt)


def check_product_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, order: int,
    state: Optional[DeltaProductState], eps: float,
) -> tuple[torch.dtype, DeltaProductState]:
    """Validate DeltaProduct inputs; returns (compute dtype, initial state in that dtype)."""
    common.check_positive_int("order", order)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    B, H, T, Dk, Dv = common.check_qkv(q, k, v)
    common.check_per_token("beta", beta, B, H, T, D=order)
    dt = common.compute_dtype(q, k, v, beta)
    if state is None:
        return dt, DeltaProductState(
            q.new_zeros(B, H, Dk, Dv, dtype=dt),
            q.new_zeros(B, H, order - 1, Dk, dtype=dt),
            q.new_zeros(B, H, order - 1, Dv, dtype=dt),
        )
    if not isinstance(state, DeltaProductState):
        raise ValueError(f"state must be a DeltaProductState or None, got {type(state).__name__}")
    return dt, DeltaProductState(
        _check_state_field("S", state.S, (B, H, Dk, Dv), dt),
        _check_state_field("k_prev", state.k_prev, (B, H, order - 1, Dk), dt),
        _check_state_field("v_prev", state.v_prev, (B, H, order - 1, Dv), dt),
    )


# ---------------------------------------------------------------------------------------------
# virtual tokens (shared by the parallel and chunk forms; the recurrent form has its own)


def l2_renormalize(x: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """x / sqrt(||x||^2 + eps) over the last axis.

    Smooth everywhere (a zero difference, e.g. a repeated key, stays zero with finite gradients),
    unit length to within eps / (2 ||x||^2), and never longer than 1, so beta in [0, 1] keeps
    every virtual step a contraction. Near-equal consecutive keys give a short difference, which
    this down-weights rather than blowing up its noise to unit length.
    """
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def finite_differences(x: torch.Tensor, prev: torch.Tensor, order: int) -> torch.Tensor:
    """x (B, H, T, D), prev (B, H, order-1, D) the raw tokens before x -> (B, H, T, order, D),
    entry [..., t, m, :] = sum_{j=0..m} (-1)^j C(m, j) x_{t-j}."""
    T = x.shape[2]
    padded = torch.cat([prev.to(x.dtype), x], dim=2)  # x_{t-j} sits at index order-1+t-j
    diffs = []
    for m in range(order):
        terms = [(-1) ** j * math.comb(m, j) * padded[:, :, order - 1 - j: order - 1 - j + T] for j in range(m + 1)]
        diffs.append(torch.stack(terms).sum(0))
    return torch.stack(diffs, dim=3)


def last_tokens(prev: torch.Tensor, x: torch.Tensor, count: int) -> torch.Tensor:
    """The last ``count`` tokens of prev ++ x along time (the history the next piece needs)."""
    joined = torch.cat([prev, x], dim=2)
    return joined[:, :, joined.shape[2] - count:]


def virtual_sequence(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, state: DeltaProductState, order: int, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The n*T virtual keys (B, H, nT, Dk), values (B, H, nT, Dv) and gates (B, H, nT), t-major.

    All inputs already in the compute dtype.
    """
    B, H, T, _ = k.shape
    dk = finite_differences(k, state.k_prev, order)
    # m = 0 is the caller's (already normalised) key; only the differences need renormalising.
    dk = torch.cat([dk[:, :, :, :1], l2_renormalize(dk[:, :, :, 1:], eps)], dim=3)
    dv = finite_differences(v, state.v_prev, order)
    if beta.dim() == 3:
        beta = beta.unsqueeze(-1).expand(B, H, T, order)
    return dk.flatten(2, 3), dv.flatten(2, 3), beta.reshape(B, H, T * order)


def read_mask(T: int, order: int, device: torch.device) -> torch.Tensor:
    """(T, order*T) bool: real token t reads virtual token s iff s belongs to a token <= t."""
    s = torch.arange(order * T, device=device)
    t = torch.arange(T, device=device)
    return (s // order).unsqueeze(0) <= t.unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# the closed form


def _closed_form(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S0: torch.Tensor, order: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, Dk) real queries; k, v, beta over the n*T virtual tokens; all in the compute dtype."""
    L = k.shape[2]
    strict = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
    system = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2))).masked_fill(~strict, 0.0)
    system = system + torch.eye(L, dtype=k.dtype, device=k.device)
    rhs = beta.unsqueeze(-1) * (v - k @ S0)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    reads = (q @ k.transpose(-1, -2)).masked_fill(~read_mask(q.shape[2], order, q.device), 0.0)
    o = q @ S0 + reads @ u
    return o, S0 + k.transpose(-1, -2) @ u


def delta_rule_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
    state: Optional[DeltaState] = None,
) -> tuple[torch.Tensor, DeltaState]:
    """The delta rule over the whole sequence at once: one T x T triangular solve (the reference)."""
    dt, S0 = check_delta_inputs(q, k, v, beta, state)
    o, S = _closed_form(q.to(dt), k.to(dt), v.to(dt), beta.to(dt), S0, order=1)
    return o.to(v.dtype), DeltaState(S)


def delta_product_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, order: int,
    state: Optional[DeltaProductState] = None, eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, DeltaProductState]:
    """DeltaProduct of ``order`` n: the delta rule's closed form over the n*T virtual tokens.

    ``eps`` enters the renormalisation of the differenced keys (see ``l2_renormalize``).
    """
    dt, state = check_product_inputs(q, k, v, beta, order, state, eps)
    kf, vf = k.to(dt), v.to(dt)
    kv, vv, bv = virtual_sequence(kf, vf, beta.to(dt), state, order, eps)
    o, S = _closed_form(q.to(dt), kv, vv, bv, state.S, order)
    new = DeltaProductState(S, last_tokens(state.k_prev, kf, order - 1), last_tokens(state.v_prev, vf, order - 1))
    return o.to(v.dtype), new
