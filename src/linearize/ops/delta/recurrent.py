"""Recurrent delta rule and DeltaProduct: explicit rank-1 updates, one token at a time (decoding).

Shapes as in ``naive``. DeltaProduct forms its finite differences here from the carried raw
history (k_prev, v_prev), independently of ``naive.finite_differences``, so that the recurrent
form is a check on the expansion the parallel and chunk forms share. With a decay the state is
multiplied by alpha_t = exp(log_alpha_t) before token t's update (before its first virtual update
for DeltaProduct), which is the rule alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .naive import (
    DEFAULT_EPS, DeltaProductState, DeltaState, check_delta_inputs, check_product_inputs, l2_renormalize,
)


def _step(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """S (B, H, Dk, Dv), k (B, H, Dk), v (B, H, Dv), beta (B, H): S + beta k (v - S^T k)^T."""
    error = v - (k.unsqueeze(-2) @ S).squeeze(-2)
    return S + (beta[..., None, None] * k.unsqueeze(-1)) * error.unsqueeze(-2)


def _read(S: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (q.unsqueeze(-2) @ S).squeeze(-2)


def _decay(S: torch.Tensor, log_alpha: Optional[torch.Tensor], t: int, dt: torch.dtype) -> torch.Tensor:
    """S scaled by alpha_t = exp(log_alpha[:, :, t]) <= 1; unchanged without a decay."""
    if log_alpha is None:
        return S
    return log_alpha[:, :, t].to(dt).exp()[..., None, None] * S


def delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
    state: Optional[DeltaState] = None, log_alpha: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, DeltaState]:
    """The delta rule, one explicit rank-1 update per token; ``log_alpha`` (B, H, T) in [-inf, 0]
    gives the gated delta rule (see ``delta_rule_parallel``)."""
    dt, S = check_delta_inputs(q, k, v, beta, state, log_alpha)
    outs = []
    for t in range(q.shape[2]):
        S = _decay(S, log_alpha, t, dt)
        S = _step(S, k[:, :, t].to(dt), v[:, :, t].to(dt), beta[:, :, t].to(dt))
        outs.append(_read(S, q[:, :, t].to(dt)))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), DeltaState(S)


def _difference(window: torch.Tensor, m: int) -> torch.Tensor:
    """window (B, H, n, D) holds x_{t-n+1}, ..., x_t; returns sum_j (-1)^j C(m, j) x_{t-j}."""
    out = window[:, :, -1]
    for j in range(1, m + 1):
        out = out + (-1) ** j * math.comb(m, j) * window[:, :, -1 - j]
    return out


def delta_product_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, order: int,
    state: Optional[DeltaProductState] = None, eps: float = DEFAULT_EPS,
    log_alpha: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, DeltaProductState]:
    """DeltaProduct of ``order`` n: per token, the decay alpha_t (if ``log_alpha`` is given), n
    explicit rank-1 updates, then the read."""
    dt, (S, k_hist, v_hist) = check_product_inputs(q, k, v, beta, order, state, eps, log_alpha)
    per_virtual = beta.dim() == 4
    outs = []
    for t in range(q.shape[2]):
        k_win = torch.cat([k_hist, k[:, :, t: t + 1].to(dt)], dim=2)  # (B, H, n, Dk), oldest first
        v_win = torch.cat([v_hist, v[:, :, t: t + 1].to(dt)], dim=2)
        S = _decay(S, log_alpha, t, dt)
        for m in range(order):
            km = _difference(k_win, m)
            if m > 0:
                km = l2_renormalize(km, eps)
            bm = beta[:, :, t, m] if per_virtual else beta[:, :, t]
            S = _step(S, km, _difference(v_win, m), bm.to(dt))
        outs.append(_read(S, q[:, :, t].to(dt)))
        k_hist, v_hist = k_win[:, :, 1:], v_win[:, :, 1:]
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), DeltaProductState(S, k_hist, v_hist)
