"""Chunked delta rule and DeltaProduct: the WY/UT form inside a chunk, state carried between chunks.

Shapes as in ``naive``. For a chunk of C real tokens (L = n*C virtual tokens) starting from
state S, with A = I + tril(diag(beta) K K^T, -1) (L x L, unit lower triangular):

    W  = A^{-1} diag(beta) K        U0 = A^{-1} diag(beta) V          (independent of S)
    U  = U0 - W S                                                     (the pseudo-values)
    O  = Q S + mask(Q K^T) U,       S <- S + K^T U

so the only sequential dependency between chunks is the small matrix S. Memory per chunk is
O(L^2); the sequential steps are the ceil(T / C) spans of ``common.chunk_spans``.

With a decay (log_alpha), b_t is the cumulative log alpha counted from the chunk start
(b_start = 0) and every factor is exp of a segment sum b_t - b_s with s <= t, masked to -inf
before the exp (``naive.decay_factors``), so none exceeds 1 and cumulative sums never leave a
chunk (their precision does not degrade with T):

    A  = I + tril(diag(beta) (K K^T * exp(b_t - b_s)), -1)
    W  = A^{-1} diag(beta exp(b_t - b_start)) K                       (the state enters decayed)
    O  = diag(exp(b_t - b_start)) Q S + (mask(Q K^T) * exp(b_t - b_s)) U
    S <- exp(b_end - b_start) S + K^T diag(exp(b_end - b_s)) U        (writes leave decayed)
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .naive import (
    DEFAULT_EPS, DeltaProductState, DeltaState, check_delta_inputs, check_product_inputs, decay_factors,
    last_tokens, read_mask, virtual_log_alpha, virtual_sequence,
)


def _chunk_loop(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S: torch.Tensor, order: int,
    chunk_size: int, log_alpha: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, Dk) real queries; k, v, beta, log_alpha over the n*T virtual tokens; all in the
    compute dtype. log_alpha None is the ungated rule."""
    n, Dk = order, k.shape[-1]
    outs = []
    for s0, s1 in common.chunk_spans(q.shape[2], chunk_size):
        qc = q[:, :, s0:s1]
        kc, vc, bc = k[:, :, n * s0: n * s1], v[:, :, n * s0: n * s1], beta[:, :, n * s0: n * s1, None]
        d = None if log_alpha is None else decay_factors(log_alpha[:, :, n * s0: n * s1], n)
        L = kc.shape[2]
        strict = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
        kk = kc @ kc.transpose(-1, -2)
        bk = bc * kc
        if d is not None:
            kk, bk = kk * d.pair, d.start.unsqueeze(-1) * bk
        A = (bc * kk).masked_fill(~strict, 0.0)
        A = A + torch.eye(L, dtype=k.dtype, device=k.device)
        # W and U0 do not depend on the carried state; solve for both with one call.
        wu = torch.linalg.solve_triangular(A, torch.cat([bk, bc * vc], dim=-1), upper=False, unitriangular=True)
        u = wu[..., Dk:] - wu[..., :Dk] @ S
        reads = qc @ kc.transpose(-1, -2)
        qS = qc @ S
        if d is not None:
            reads, qS = reads * d.read_pair, d.read_start.unsqueeze(-1) * qS
        reads = reads.masked_fill(~read_mask(s1 - s0, n, q.device), 0.0)
        outs.append(qS + reads @ u)
        if d is None:
            S = S + kc.transpose(-1, -2) @ u
        else:
            S = d.total[..., None, None] * S + (d.end.unsqueeze(-1) * kc).transpose(-1, -2) @ u
    o = torch.cat(outs, dim=2) if outs else q.new_zeros(*q.shape[:3], v.shape[-1])
    return o, S


def delta_rule_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
    state: Optional[DeltaState] = None, chunk_size: int = 64, log_alpha: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, DeltaState]:
    """The delta rule, ``chunk_size`` tokens per sequential step; ``log_alpha`` (B, H, T) in
    [-inf, 0] gives the gated delta rule (see ``delta_rule_parallel``)."""
    dt, S0 = check_delta_inputs(q, k, v, beta, state, log_alpha)
    la = None if log_alpha is None else log_alpha.to(dt)
    o, S = _chunk_loop(q.to(dt), k.to(dt), v.to(dt), beta.to(dt), S0, 1, chunk_size, la)
    return o.to(v.dtype), DeltaState(S)


def delta_product_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, order: int,
    state: Optional[DeltaProductState] = None, chunk_size: int = 64, eps: float = DEFAULT_EPS,
    log_alpha: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, DeltaProductState]:
    """Chunks over real tokens (``chunk_size`` of them, so order*chunk_size virtual tokens each);
    ``log_alpha`` (B, H, T) decays once per real token (see ``delta_product_parallel``)."""
    dt, state = check_product_inputs(q, k, v, beta, order, state, eps, log_alpha)
    kf, vf = k.to(dt), v.to(dt)
    # The differences only look back order-1 tokens, so expanding the whole sequence up front
    # gives each chunk exactly the virtual tokens it would get from the carried history.
    kv, vv, bv = virtual_sequence(kf, vf, beta.to(dt), state, order, eps)
    la = virtual_log_alpha(None if log_alpha is None else log_alpha.to(dt), order)
    o, S = _chunk_loop(q.to(dt), kv, vv, bv, state.S, order, chunk_size, la)
    new = DeltaProductState(S, last_tokens(state.k_prev, kf, order - 1), last_tokens(state.v_prev, vf, order - 1))
    return o.to(v.dtype), new
