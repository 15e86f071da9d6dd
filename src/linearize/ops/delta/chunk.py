"""Chunked delta rule and DeltaProduct: the WY/UT form inside a chunk, state carried between chunks.

Shapes as in ``naive``. For a chunk of C real tokens (L = n*C virtual tokens) starting from
state S, with A = I + tril(diag(beta) K K^T, -1) (L x L, unit lower triangular):

    W  = A^{-1} diag(beta) K        U0 = A^{-1} diag(beta) V          (independent of S)
    U  = U0 - W S                                                     (the pseudo-values)
    O  = Q S + mask(Q K^T) U,       S <- S + K^T U

so the only sequential dependency between chunks is the small matrix S. Memory per chunk is
O(L^2); the sequential steps are the ceil(T / C) spans of ``common.chunk_spans``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .naive import (
    DEFAULT_EPS, DeltaProductState, DeltaState, check_delta_inputs, check_product_inputs, last_tokens,
    read_mask, virtual_sequence,
)


def _chunk_loop(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S: torch.Tensor, order: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, Dk) real queries; k, v, beta over the n*T virtual tokens; all in the compute dtype."""
    n, Dk = order, k.shape[-1]
    outs = []
    for s0, s1 in common.chunk_spans(q.shape[2], chunk_size):
        qc = q[:, :, s0:s1]
        kc, vc, bc = k[:, :, n * s0: n * s1], v[:, :, n * s0: n * s1], beta[:, :, n * s0: n * s1, None]
        L = kc.shape[2]
        strict = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
        A = (bc * (kc @ kc.transpose(-1, -2))).masked_fill(~strict, 0.0)
        A = A + torch.eye(L, dtype=k.dtype, device=k.device)
        # W and U0 do not depend on the carried state; solve for both with one call.
        wu = torch.linalg.solve_triangular(A, torch.cat([bc * kc, bc * vc], dim=-1), upper=False, unitriangular=True)
        u = wu[..., Dk:] - wu[..., :Dk] @ S
        reads = (qc @ kc.transpose(-1, -2)).masked_fill(~read_mask(s1 - s0, n, q.device), 0.0)
        outs.append(qc @ S + reads @ u)
        S = S + kc.transpose(-1, -2) @ u
    o = torch.cat(outs, dim=2) if outs else q.new_zeros(*q.shape[:3], v.shape[-1])
    return o, S


def delta_rule_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
    state: Optional[DeltaState] = None, chunk_size: int = 64,
) -> tuple[torch.Tensor, DeltaState]:
    """The delta rule, ``chunk_size`` tokens per sequential step."""
    dt, S0 = check_delta_inputs(q, k, v, beta, state)
    o, S = _chunk_loop(q.to(dt), k.to(dt), v.to(dt), beta.to(dt), S0, 1, chunk_size)
    return o.to(v.dtype), DeltaState(S)


def delta_product_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, order: int,
    state: Optional[DeltaProductState] = None, chunk_size: int = 64, eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, DeltaProductState]:
    """Chunks over real tokens (``chunk_size`` of them, so order*chunk_size virtual tokens each)."""
    dt, state = check_product_inputs(q, k, v, beta, order, state, eps)
    kf, vf = k.to(dt), v.to(dt)
    # The differences only look back order-1 tokens, so expanding the whole sequence up front
    # gives each chunk exactly the virtual tokens it would get from the carried history.
    kv, vv, bv = virtual_sequence(kf, vf, beta.to(dt), state, order, eps)
    o, S = _chunk_loop(q.to(dt), kv, vv, bv, state.S, order, chunk_size)
    new = DeltaProductState(S, last_tokens(state.k_prev, kf, order - 1), last_tokens(state.v_prev, vf, order - 1))
    return o.to(v.dtype), new
