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

Everything but the state recurrence is computed for all chunks at once (batched over a chunk
axis: (B, H, NC, L, .)), so autograd sees a handful of large ops whatever T is. The recurrence

    U_c = U0_c - W_c S_c,   S_{c+1} = total_c S_c + Kd_c^T U_c        (Kd = diag(end) K)

is the one sequential part (the "scan"): ``scan_torch`` walks it in torch, and on CUDA the
public functions hand it to the Triton kernels of ``ops.delta.triton`` when ``delta_applies``.
W and U0 take the inverse T = A^{-1} (``unit_lower_inverse``: a batched triangular solve in torch,
forward substitution in registers on the kernels) times the right-hand sides, so that both
directions are matrix products (dN = -T^T dT T^T). All mean the same; the result does not depend
on the chunk size.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .. import common
from ..backend.dispatch import all_tensors, kernels_enabled, on_kernel_device
from .naive import (
    DEFAULT_EPS, Decay, DeltaProductState, DeltaState, check_delta_inputs, check_product_inputs, decay_factors,
    last_tokens, read_mask, virtual_log_alpha, virtual_sequence,
)

MAX_DIM = 128  # widest Dk, Dv the Triton scan holds in registers
MAX_VIRTUAL_CHUNK = 128  # most virtual tokens in one chunk of the Triton scan (its W and Kd tiles)

# (W, U0, Kd, total, S0) -> (U, S_c, S_final); see ``scan_torch``
Scan = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor],
                tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# N (..., L, L) strictly lower -> (I + N)^-1, without autograd; see ``inverse_torch``
Inverse = Callable[[torch.Tensor], torch.Tensor]


def inverse_torch(N: torch.Tensor) -> torch.Tensor:
    """(I + N)^-1 for every (L, L) matrix of N (strictly lower triangular; its diagonal and upper
    part are not read): one batched triangular solve against the identity."""
    eye = torch.eye(N.shape[-1], dtype=N.dtype, device=N.device).expand_as(N)
    return torch.linalg.solve_triangular(N, eye, upper=False, unitriangular=True)


class _UnitLowerInverse(torch.autograd.Function):
    """T = (I + N)^-1 by ``inverse``; backward dN = -T^T dT T^T on the strictly lower part."""

    @staticmethod
    def forward(ctx, N: torch.Tensor, inverse: Inverse) -> torch.Tensor:
        T = inverse(N)
        ctx.save_for_backward(T)
        return T

    @staticmethod
    def backward(ctx, dT: torch.Tensor):
        (T,) = ctx.saved_tensors
        Tt = T.transpose(-1, -2)
        return -(Tt @ dT @ Tt).tril(-1), None


def unit_lower_inverse(N: torch.Tensor, inverse: Inverse = inverse_torch) -> torch.Tensor:
    """(I + N)^-1 of every (L, L) matrix of N (..., L, L), N strictly lower triangular, differentiable
    in N; ``inverse`` computes it (``inverse_torch`` or the Triton kernel)."""
    return _UnitLowerInverse.apply(N, inverse)


def scan_torch(
    W: torch.Tensor, U0: torch.Tensor, Kd: torch.Tensor, total: Optional[torch.Tensor], S0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inter-chunk recurrence, one chunk per step (the reference of the Triton scan).

    W, Kd: (B, H, NC, L, Dk); U0: (B, H, NC, L, Dv); total: (B, H, NC) or None (no decay);
    S0: (B, H, Dk, Dv). Returns U (B, H, NC, L, Dv), the states entering each chunk
    S_c (B, H, NC, Dk, Dv) and the final state (B, H, Dk, Dv).
    """
    S, us, states = S0, [], []
    # unbind, not indexing: its backward stacks the chunks' gradients once, where each index's
    # backward would fill a zero tensor of the whole sequence (quadratic in the chunk count)
    totals = [None] * W.shape[2] if total is None else total.unbind(2)
    for w, u0, kd, tot in zip(W.unbind(2), U0.unbind(2), Kd.unbind(2), totals):
        states.append(S)
        u = u0 - w @ S
        us.append(u)
        S = (S if tot is None else tot[..., None, None] * S) + kd.transpose(-1, -2) @ u
    return torch.stack(us, dim=2), torch.stack(states, dim=2), S


def delta_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                  log_alpha: Optional[torch.Tensor] = None, state: tuple = (), order: int = 1) -> bool:
    """Whether ``delta_rule_chunk`` / ``delta_product_chunk`` run their scan on the Triton kernels:
    kernels enabled (``ops.backend``), every tensor on one CUDA device (or the CPU under the Triton
    interpreter), no fp64 input (the kernel's state is fp32), Dk, Dv <= 128, DeltaProduct
    ``order`` <= 128. ``state``: the (validated) state's tensors, e.g. a ``DeltaState``."""
    extra = () if log_alpha is None else (log_alpha,)
    st = tuple(state)
    if not kernels_enabled() or not all_tensors(q, k, v, beta, *extra, *st):
        return False
    if not on_kernel_device(q, k, v, beta, *extra, *st):
        return False
    if any(x.dtype not in (torch.bfloat16, torch.float16, torch.float32) for x in (q, k, v, beta, *extra, *st)):
        return False
    return (q.dim() == 4 and v.dim() == 4 and q.shape[-1] <= MAX_DIM and v.shape[-1] <= MAX_DIM
            and order <= MAX_VIRTUAL_CHUNK)


def _pad_time(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (B, H, T[, D]) with n zero tokens appended along time."""
    if n == 0:
        return x
    return F.pad(x, (0, 0, 0, n) if x.dim() == 4 else (0, n))


def chunk_form(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S0: torch.Tensor, order: int,
    chunk_size: int, log_alpha: Optional[torch.Tensor] = None, scan: Scan = scan_torch,
    inverse: Inverse = inverse_torch, extra_queries: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, ...]:
    """The chunked rule, all chunks at once around ``scan`` (and ``inverse``, see the module).

    q (B, H, T, Dk) real queries; k (B, H, nT, Dk), v (B, H, nT, Dv), beta (B, H, nT), log_alpha
    (B, H, nT) or None over the n*T virtual tokens; S0 (B, H, Dk, Dv); all in the compute dtype.
    Returns o (B, H, T, Dv) and the final state, and with ``extra_queries`` (q's shape and dtype)
    their reads too, without a gradient (the memory read with other queries: one prep and scan for
    both). T is padded to whole chunks with tokens of zero key, value, beta and log alpha, which
    leave the state as it is and are cut from o. Autocast is off inside: every product runs in the
    compute dtype (a model trained under bf16 autocast would otherwise get bf16 products of the fp32
    state and of the triangular systems).
    """
    with torch.autocast(q.device.type, enabled=False):
        return _chunk_form(q, k, v, beta, S0, order, chunk_size, log_alpha, scan, inverse, extra_queries)


def _chunk_form(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S0: torch.Tensor, order: int,
    chunk_size: int, log_alpha: Optional[torch.Tensor], scan: Scan, inverse: Inverse,
    extra_queries: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, ...]:
    B, H, T, Dk = q.shape
    NC = len(common.chunk_spans(T, chunk_size))
    if NC == 0:
        o = q.new_zeros(B, H, 0, v.shape[-1])
        return (o, S0) if extra_queries is None else (o, S0, o.clone())
    C = min(chunk_size, T)  # one short chunk needs no padding up to chunk_size
    d = None if log_alpha is None else decay_factors(_chunks(log_alpha, order, C, NC), order)
    W, U0, kd = chunk_prep(k, v, beta, d, order, C, NC, inverse)
    u, states, S = scan(W, U0, kd, None if d is None else d.total, S0)
    o = chunk_read(q, k, d, u, states, order, C, NC)
    if extra_queries is None:
        return o, S
    with torch.no_grad():
        return o, S, chunk_read(extra_queries, k, d, u, states, order, C, NC)


def _chunks(x: torch.Tensor, n: int, C: int, NC: int) -> torch.Tensor:
    """x (B, H, n T[, D]) over virtual tokens, zero-padded to NC chunks of n C: (B, H, NC, n C[, D])."""
    pad = NC * n * C - x.shape[2]
    x = _pad_time(x, pad)
    return x.view(*x.shape[:2], NC, n * C, *x.shape[3:])


def chunk_prep(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, d: Optional[Decay], order: int, C: int,
               NC: int, inverse: Inverse = inverse_torch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the scan needs that does not depend on the state, every chunk at once: W, U0
    (B, H, NC, L, .) from the chunks' inverses A^{-1} (one batched call of ``inverse``) and
    Kd = diag(end) K. ``d``: the chunks' decay factors, or None (ungated)."""
    L = order * C
    kc, vc, bc = _chunks(k, order, C, NC), _chunks(v, order, C, NC), _chunks(beta, order, C, NC)[..., None]
    strict = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
    kk = kc @ kc.transpose(-1, -2)
    bk = bc * kc
    if d is not None:
        kk, bk = kk * d.pair, d.start.unsqueeze(-1) * bk
    # A = I + N; W and U0 do not depend on the carried state: one inverse of every chunk's A for both
    wu = unit_lower_inverse((bc * kk).masked_fill(~strict, 0.0), inverse) @ torch.cat([bk, bc * vc], dim=-1)
    kd = kc if d is None else d.end.unsqueeze(-1) * kc
    Dk = k.shape[-1]
    return wu[..., :Dk], wu[..., Dk:], kd


def chunk_read(q: torch.Tensor, k: torch.Tensor, d: Optional[Decay], u: torch.Tensor, states: torch.Tensor,
               order: int, C: int, NC: int) -> torch.Tensor:
    """o (B, H, T, Dv): each chunk's queries against the state entering it and, causally, against
    the chunk's own keys with their pseudo-values u."""
    B, H, T, Dk = q.shape
    qc, kc = _chunks(q, 1, C, NC), _chunks(k, order, C, NC)
    reads = qc @ kc.transpose(-1, -2)
    qS = qc @ states
    if d is not None:
        reads, qS = reads * d.read_pair, d.read_start.unsqueeze(-1) * qS
    reads = reads.masked_fill(~read_mask(C, order, q.device), 0.0)
    return (qS + reads @ u).reshape(B, H, NC * C, -1)[:, :, :T]


def kernel_chunk(chunk_size: int, order: int) -> int:
    """The real tokens per chunk when the scan runs on the Triton kernels: ``chunk_size``, cut to
    at most ``MAX_VIRTUAL_CHUNK`` virtual tokens (DeltaProduct of order 3 takes 42 tokens, not
    64). The result does not depend on the chunk size; registers and shared memory do."""
    return max(1, min(chunk_size, MAX_VIRTUAL_CHUNK // order))


def _plan(applies: bool, chunk_size: int, order: int) -> tuple[Scan, int, Inverse]:
    """(scan, chunk size, inverse) of a chunk-form call."""
    if not applies:
        return scan_torch, chunk_size, inverse_torch
    from .triton import delta_scan_triton, unit_lower_inverse_triton

    return delta_scan_triton, kernel_chunk(chunk_size, order), unit_lower_inverse_triton


def _check_extra(q: torch.Tensor, extra_queries: Optional[torch.Tensor]) -> None:
    if extra_queries is not None and (extra_queries.shape != q.shape or extra_queries.dtype != q.dtype):
        raise ValueError(f"extra_queries must have q's shape {tuple(q.shape)} and dtype {q.dtype}, got "
                         f"{tuple(extra_queries.shape)} in {extra_queries.dtype}")


def _outputs(o: torch.Tensor, state, extra: Optional[torch.Tensor], dtype: torch.dtype) -> tuple:
    return (o.to(dtype), state) if extra is None else (o.to(dtype), state, extra.to(dtype))


def delta_rule_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
    state: Optional[DeltaState] = None, chunk_size: int = 64, log_alpha: Optional[torch.Tensor] = None,
    extra_queries: Optional[torch.Tensor] = None,
) -> tuple:
    """The delta rule, ``chunk_size`` tokens per sequential step; ``log_alpha`` (B, H, T) in
    [-inf, 0] gives the gated delta rule (see ``delta_rule_parallel``). Returns (o, state), and
    with ``extra_queries`` (q's shape and dtype) (o, state, their reads) where the reads, without a
    gradient, come from the same prep and scan. On the Triton kernels where ``delta_applies``."""
    dt, S0 = check_delta_inputs(q, k, v, beta, state, log_alpha)
    common.check_positive_int("chunk_size", chunk_size)
    _check_extra(q, extra_queries)
    applies = delta_applies(q, k, v, beta, log_alpha, (S0,))
    if applies and q.shape[2]:
        from .triton import delta_chunk_triton

        o, S, extra = delta_chunk_triton(q, k, v, beta, log_alpha, S0, chunk_size, extra_queries)
        return _outputs(o, DeltaState(S), extra, v.dtype)
    scan, chunk, inverse = _plan(applies, chunk_size, 1)
    la = None if log_alpha is None else log_alpha.to(dt)
    xq = None if extra_queries is None else extra_queries.to(dt)
    o, S, *extra = chunk_form(q.to(dt), k.to(dt), v.to(dt), beta.to(dt), S0, 1, chunk, la, scan, inverse, xq)
    return _outputs(o, DeltaState(S), extra[0] if extra else None, v.dtype)


def delta_product_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, order: int,
    state: Optional[DeltaProductState] = None, chunk_size: int = 64, eps: float = DEFAULT_EPS,
    log_alpha: Optional[torch.Tensor] = None, extra_queries: Optional[torch.Tensor] = None,
) -> tuple:
    """Chunks over real tokens (``chunk_size`` of them, so order*chunk_size virtual tokens each);
    ``log_alpha`` (B, H, T) decays once per real token (see ``delta_product_parallel``);
    ``extra_queries`` as in ``delta_rule_chunk``. On the Triton kernels where ``delta_applies``: order
    1, the whole chunk form; else the scan, in chunks of ``kernel_chunk`` tokens."""
    dt, state = check_product_inputs(q, k, v, beta, order, state, eps, log_alpha)
    common.check_positive_int("chunk_size", chunk_size)
    _check_extra(q, extra_queries)
    applies = delta_applies(q, k, v, beta, log_alpha, state, order)
    if applies and order == 1 and q.shape[2]:
        from .triton import delta_chunk_triton

        b = beta if beta.dim() == 3 else beta.squeeze(-1)
        o, S, extra = delta_chunk_triton(q, k, v, b, log_alpha, state.S, chunk_size, extra_queries)
        return _outputs(o, DeltaProductState(S, state.k_prev, state.v_prev), extra, v.dtype)
    scan, chunk, inverse = _plan(applies, chunk_size, order)
    kf, vf = k.to(dt), v.to(dt)
    # The differences only look back order-1 tokens, so expanding the whole sequence up front
    # gives each chunk exactly the virtual tokens it would get from the carried history.
    kv, vv, bv = virtual_sequence(kf, vf, beta.to(dt), state, order, eps)
    la = virtual_log_alpha(None if log_alpha is None else log_alpha.to(dt), order)
    xq = None if extra_queries is None else extra_queries.to(dt)
    o, S, *extra = chunk_form(q.to(dt), kv, vv, bv, state.S, order, chunk, la, scan, inverse, xq)
    new = DeltaProductState(S, last_tokens(state.k_prev, kf, order - 1), last_tokens(state.v_prev, vf, order - 1))
    return _outputs(o, new, extra[0] if extra else None, v.dtype)
