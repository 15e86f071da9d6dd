"""Parallel (quadratic) reference for the delta rule and DeltaProduct, plus their shared checks.

Shapes: q, k (B, H, T, Dk), v (B, H, T, Dv), beta (B, H, T) [or (B, H, T, n) for DeltaProduct],
log_alpha (B, H, T) or None, state S (B, H, Dk, Dv); DeltaProduct also carries
k_prev (B, H, n-1, Dk), v_prev (B, H, n-1, Dv).

The closed form. Write the delta rule as S_t = S_0 + sum_{s<=t} k_s u_s^T with the pseudo-value
u_t = beta_t (v_t - S_{t-1}^T k_t). Substituting S_{t-1} gives, stacked over time,

    (I + tril(diag(beta) K K^T, -1)) U = diag(beta) (V - K S_0)        (unit lower triangular)
    O = Q S_0 + tril(Q K^T) U,    S_T = S_0 + K^T U.

(The TPTT paper's eq. 7 writes I - tril(...); the sign is +.) DeltaProduct is the same system
over the n*T virtual tokens, with output row t reading virtual columns s < n (t + 1).

With a decay (the gated delta rule, S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T)
the same substitution, with u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t) and
S_t = alpha_t S_{t-1} + k_t u_t^T, gives with b_t = sum_{l<=t} log alpha_l (b_0 = 0 before the
first token), D_ts = exp(b_t - b_s) for s <= t and 0 above, and g_t = exp(b_t):

    (I + tril(diag(beta) (K K^T * D), -1)) U = diag(beta) (V - diag(g) K S_0)
    O = diag(g) Q S_0 + (tril(Q K^T) * D) U,    S_T = g_T S_0 + K^T diag(exp(b_T - b_s)) U.

Every factor is exp of a sum of log alpha over a segment, so <= 1: the differences b_t - b_s are
formed as segment sums (``log_decay_segments``), masked to -inf above the diagonal before the exp.
For DeltaProduct the decay of real token t sits on its first virtual token (0 on the others), so
the state decays once per real token, before that token's n updates.
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


def check_log_alpha(log_alpha: Optional[torch.Tensor], B: int, H: int, T: int) -> None:
    """log_alpha: None, or (B, H, T) floating with every value in [-inf, 0] (alpha in [0, 1]).

    Positive values (a growing state) and NaN are rejected; -inf (alpha = 0, the state is
    cleared before the token's update) is allowed. Checking the values reads one bool back from
    the device; under torch.compile and while a CUDA graph is captured the value check is skipped
    (shapes and dtypes are still checked).
    """
    if log_alpha is None:
        return
    common.check_per_token("log_alpha", log_alpha, B, H, T, allow_vector=False)
    if log_alpha.numel() == 0 or torch.compiler.is_compiling() or common.graph_capturing():
        return
    bad = ~(log_alpha <= 0)  # NaN compares False, so it lands here too
    if bool(bad.any()):
        value = log_alpha[bad][0].item()
        raise ValueError(
            f"log_alpha must be <= 0 (log of a decay alpha in [0, 1]; values in [-inf, 0] allowed), got {value}"
        )


def check_delta_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, state: Optional[DeltaState],
    log_alpha: Optional[torch.Tensor] = None,
) -> tuple[torch.dtype, torch.Tensor]:
    """Validate delta-rule inputs; returns (compute dtype, initial S in that dtype)."""
    B, H, T, Dk, Dv = common.check_qkv(q, k, v)
    common.check_per_token("beta", beta, B, H, T, allow_vector=False)
    check_log_alpha(log_alpha, B, H, T)
    dt = common.compute_dtype(q, k, v, beta, *(() if log_alpha is None else (log_alpha,)))
    if state is None:
        return dt, q.new_zeros(B, H, Dk, Dv, dtype=dt)
    if not isinstance(state, DeltaState):
        raise ValueError(f"state must be a DeltaState or None, got {type(state).__name__}")
    return dt, _check_state_field("S", state.S, (B, H, Dk, Dv), dt)


def check_product_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, order: int,
    state: Optional[DeltaProductState], eps: float, log_alpha: Optional[torch.Tensor] = None,
) -> tuple[torch.dtype, DeltaProductState]:
    """Validate DeltaProduct inputs; returns (compute dtype, initial state in that dtype)."""
    common.check_positive_int("order", order)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    B, H, T, Dk, Dv = common.check_qkv(q, k, v)
    common.check_per_token("beta", beta, B, H, T, D=order)
    check_log_alpha(log_alpha, B, H, T)
    dt = common.compute_dtype(q, k, v, beta, *(() if log_alpha is None else (log_alpha,)))
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


def virtual_log_alpha(log_alpha: Optional[torch.Tensor], order: int) -> Optional[torch.Tensor]:
    """(B, H, T) -> (B, H, n*T), t-major: real token t's log alpha on its first virtual token, 0 on
    the others, so the state decays once per real token. None stays None."""
    if log_alpha is None or order == 1:
        return log_alpha
    B, H, T = log_alpha.shape
    rest = log_alpha.new_zeros(B, H, T, order - 1)
    return torch.cat([log_alpha.unsqueeze(-1), rest], dim=3).reshape(B, H, T * order)


def read_mask(T: int, order: int, device: torch.device) -> torch.Tensor:
    """(T, order*T) bool: real token t reads virtual token s iff s belongs to a token <= t."""
    s = torch.arange(order * T, device=device)
    t = torch.arange(T, device=device)
    return (s // order).unsqueeze(0) <= t.unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# the decay (gated delta rule)


def log_decay_segments(log_alpha: torch.Tensor) -> torch.Tensor:
    """log_alpha (..., L) -> (..., L+1, L+1): entry [i, j] = sum(log_alpha[..., j:i]) = b_i - b_j for
    j <= i, with b_i the sum over the first i tokens; -inf for j > i.

    Each entry sums only its own segment (no difference of two long cumulative sums is taken), so
    it keeps full relative precision however much decay came before, it is never > 0, and -inf
    (alpha = 0) gives -inf without forming -inf - (-inf). Tokens outside a segment enter as exact
    zeros, not masked afterwards, so gradients stay finite.
    """
    L = log_alpha.shape[-1]
    idx = torch.arange(L + 1, device=log_alpha.device)
    counts = idx[:L, None] >= idx[None, :]  # (L, L+1): token l lies in segment [j, i) iff j <= l < i
    terms = torch.where(counts, log_alpha.unsqueeze(-1), log_alpha.new_zeros(()))  # (..., L, L+1)
    sums = terms.cumsum(-2)  # row i-1 holds sum_{j <= l <= i-1}
    sums = torch.cat([log_alpha.new_zeros(*log_alpha.shape[:-1], 1, L + 1), sums], dim=-2)
    return sums.masked_fill(idx[:, None] < idx[None, :], float("-inf"))


class Decay(NamedTuple):
    """The decay factors of one span of L (virtual) tokens, all in [0, 1]; b as in the module
    docstring, counted from the start of the span (b_start = 0)."""

    pair: torch.Tensor  # (B, H, L, L): exp(b_t - b_s) for s <= t, 0 above the diagonal
    start: torch.Tensor  # (B, H, L): exp(b_t - b_start), the part of the entering state left at t
    end: torch.Tensor  # (B, H, L): exp(b_end - b_s), the part of token s's write left at the end
    total: torch.Tensor  # (B, H): exp(b_end - b_start)
    read_pair: torch.Tensor  # (B, H, R, L): rows of ``pair`` at the R reads (every order-th token)
    read_start: torch.Tensor  # (B, H, R): entries of ``start`` at the reads


def decay_factors(log_alpha: torch.Tensor, order: int) -> Decay:
    """log_alpha (B, H, L) over one span of virtual tokens -> its ``Decay``; one exp, of values <= 0."""
    L = log_alpha.shape[-1]
    e = log_decay_segments(log_alpha).exp()
    return Decay(e[..., 1:, 1:], e[..., 1:, 0], e[..., L, 1:], e[..., L, 0], e[..., order::order, 1:],
                 e[..., order::order, 0])


# ---------------------------------------------------------------------------------------------
# the closed form


def _closed_form(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S0: torch.Tensor, order: int,
    log_alpha: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, Dk) real queries; k, v, beta, log_alpha over the n*T virtual tokens; all in the
    compute dtype. log_alpha None is the ungated rule."""
    L = k.shape[2]
    d = None if log_alpha is None else decay_factors(log_alpha, order)
    strict = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
    kk = k @ k.transpose(-1, -2)
    ks0 = k @ S0
    if d is not None:
        kk, ks0 = kk * d.pair, d.start.unsqueeze(-1) * ks0
    system = (beta.unsqueeze(-1) * kk).masked_fill(~strict, 0.0)
    system = system + torch.eye(L, dtype=k.dtype, device=k.device)
    rhs = beta.unsqueeze(-1) * (v - ks0)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    reads = q @ k.transpose(-1, -2)
    qs0 = q @ S0
    if d is not None:
        reads, qs0 = reads * d.read_pair, d.read_start.unsqueeze(-1) * qs0
    reads = reads.masked_fill(~read_mask(q.shape[2], order, q.device), 0.0)
    o = qs0 + reads @ u
    if d is None:
        return o, S0 + k.transpose(-1, -2) @ u
    return o, d.total[..., None, None] * S0 + (d.end.unsqueeze(-1) * k).transpose(-1, -2) @ u


def delta_rule_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
    state: Optional[DeltaState] = None, log_alpha: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, DeltaState]:
    """The delta rule over the whole sequence at once: one T x T triangular solve (the reference).

    ``log_alpha`` (B, H, T), values in [-inf, 0], makes it the gated delta rule
    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T; None is alpha = 1.
    """
    dt, S0 = check_delta_inputs(q, k, v, beta, state, log_alpha)
    la = None if log_alpha is None else log_alpha.to(dt)
    o, S = _closed_form(q.to(dt), k.to(dt), v.to(dt), beta.to(dt), S0, order=1, log_alpha=la)
    return o.to(v.dtype), DeltaState(S)


def delta_product_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, order: int,
    state: Optional[DeltaProductState] = None, eps: float = DEFAULT_EPS,
    log_alpha: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, DeltaProductState]:
    """DeltaProduct of ``order`` n: the delta rule's closed form over the n*T virtual tokens.

    ``eps`` enters the renormalisation of the differenced keys (see ``l2_renormalize``).
    ``log_alpha`` (B, H, T), values in [-inf, 0], decays the state once per real token, before
    that token's n updates (gated DeltaProduct); None is alpha = 1.
    """
    dt, state = check_product_inputs(q, k, v, beta, order, state, eps, log_alpha)
    kf, vf = k.to(dt), v.to(dt)
    kv, vv, bv = virtual_sequence(kf, vf, beta.to(dt), state, order, eps)
    la = virtual_log_alpha(None if log_alpha is None else log_alpha.to(dt), order)
    o, S = _closed_form(q.to(dt), kv, vv, bv, state.S, order, la)
    new = DeltaProductState(S, last_tokens(state.k_prev, kf, order - 1), last_tokens(state.v_prev, vf, order - 1))
    return o.to(v.dtype), new
