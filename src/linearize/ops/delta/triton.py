"""Triton kernels for the delta rule's inter-chunk scan, the one sequential part of the chunk form.

Same meaning and layout as ``chunk.scan_torch`` (its reference): W, Kd (B, H, NC, L, Dk),
U0 (B, H, NC, L, Dv), total (B, H, NC) or None, S0 (B, H, Dk, Dv), all fp32 (the chunk form's
compute dtype for bf16/fp16/fp32 inputs); Dk, Dv <= 128. Per (batch*head) and chunk c:

    S_c given (S_0 the initial state)
    U_c = U0_c - W_c S_c,   S_{c+1} = total_c S_c + Kd_c^T U_c

Columns of S never mix (W_c S_c and Kd_c^T U_c act on each column alone), so one program takes a
(batch*head, block of BV value columns) and walks its chunks with the (Dk, BV) state in fp32
registers, storing U_c and the entering state S_c (what the chunk form's outputs and the
backward read). The backward (reverse walk) carries dS, the gradient of the state leaving the
current chunk, with dU, dS_c, dS_final the gradients of the outputs:

    dU~_c = dU_c + Kd_c dS                                    (all of U_c's gradient)
    dS   <- total_c dS - W_c^T dU~_c + dS_c                  (then it is the entering state's)

storing dU~_c and the leaving dS of each chunk; what remains is parallel over chunks and done in
batched torch: dU0 = dU~, dW_c = -dU~_c S_c^T, dKd_c = U_c dS_{c+1}^T, dtotal_c = <S_c, dS_{c+1}>.
Products are tf32x3 (three tf32 tensor-core products per product, about fp32's accuracy): plain
tf32 would put 5e-4 relative errors into a state that carries them over the sequence, and exact
fp32 products (``"ieee"``) lower to FMA loops that spilled 7 KB a thread on sm_90a. The
interpreter computes every precision in fp32, so only the GPU tests see the tf32 rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..backend.dispatch import patch_interpreter, pow2

patch_interpreter()

PREC = "tf32x3"  # see the module docstring


@triton.jit
def _tile(ptr, rows, cols, mrow, mcol, stride_row):
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :], mask=mrow[:, None] & mcol[None, :], other=0.0)


@triton.jit
def _put(ptr, x, rows, cols, mrow, mcol, stride_row):
    tl.store(ptr + rows[:, None] * stride_row + cols[None, :], x, mask=mrow[:, None] & mcol[None, :])


@triton.jit
def _delta_scan_fwd_kernel(
    W, U0, KD, TOT, S0, U, SC, ST,
    sw_bh, sw_c, sw_l, su0_bh, su0_c, su0_l, skd_bh, skd_c, skd_l,
    NC, L,
    DK: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, PREC: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    rl, rk = tl.arange(0, BL), tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    ml, mk, mv = rl < L, rk < DK, rv < DV
    state_off = bh * DK * DV  # S0, ST: (B*H, Dk, Dv); SC: (B*H, NC, Dk, Dv); U: (B*H, NC, L, Dv), contiguous
    S = _tile(S0 + state_off, rk, rv, mk, mv, DV).to(tl.float32)
    for c in range(0, NC):
        _put(SC + (bh * NC + c) * DK * DV, S, rk, rv, mk, mv, DV)
        w = _tile(W + bh * sw_bh + c * sw_c, rl, rk, ml, mk, sw_l).to(tl.float32)
        u = _tile(U0 + bh * su0_bh + c * su0_c, rl, rv, ml, mv, su0_l).to(tl.float32)
        u = u - tl.dot(w, S, input_precision=PREC)
        _put(U + (bh * NC + c) * L * DV, u, rl, rv, ml, mv, DV)
        kd = _tile(KD + bh * skd_bh + c * skd_c, rl, rk, ml, mk, skd_l).to(tl.float32)
        if GATED:
            S = S * tl.load(TOT + bh * NC + c)
        S = tl.dot(tl.trans(kd), u, S, input_precision=PREC)
    _put(ST + state_off, S, rk, rv, mk, mv, DV)


@triton.jit
def _delta_scan_bwd_kernel(
    W, KD, TOT, DU, DSC, DST, DUT, DSN, DS0,
    sw_bh, sw_c, sw_l, skd_bh, skd_c, skd_l,
    NC, L,
    DK: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, HAS_DU: tl.constexpr, HAS_DSC: tl.constexpr, HAS_DST: tl.constexpr,
    PREC: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    rl, rk = tl.arange(0, BL), tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    ml, mk, mv = rl < L, rk < DK, rv < DV
    state_off = bh * DK * DV  # DST, DS0: (B*H, Dk, Dv); DSC, DSN: (B*H, NC, Dk, Dv); DU, DUT: (B*H, NC, L, Dv)
    if HAS_DST:
        dS = _tile(DST + state_off, rk, rv, mk, mv, DV).to(tl.float32)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(0, NC):
        c = NC - 1 - i
        _put(DSN + (bh * NC + c) * DK * DV, dS, rk, rv, mk, mv, DV)
        kd = _tile(KD + bh * skd_bh + c * skd_c, rl, rk, ml, mk, skd_l).to(tl.float32)
        if HAS_DU:
            du = _tile(DU + (bh * NC + c) * L * DV, rl, rv, ml, mv, DV).to(tl.float32)
            du = tl.dot(kd, dS, du, input_precision=PREC)
        else:
            du = tl.dot(kd, dS, input_precision=PREC)
        _put(DUT + (bh * NC + c) * L * DV, du, rl, rv, ml, mv, DV)
        w = _tile(W + bh * sw_bh + c * sw_c, rl, rk, ml, mk, sw_l).to(tl.float32)
        if GATED:
            dS = dS * tl.load(TOT + bh * NC + c)
        dS = dS - tl.dot(tl.trans(w), du, input_precision=PREC)
        if HAS_DSC:
            dS += _tile(DSC + (bh * NC + c) * DK * DV, rk, rv, mk, mv, DV).to(tl.float32)
    _put(DS0 + state_off, dS, rk, rv, mk, mv, DV)


@triton.jit
def _unit_lower_inverse_kernel(N, T, L, BL: tl.constexpr):
    """One matrix a program: T = (I + N)^-1 for N strictly lower triangular (L x L, fp32), by forward
    substitution row by row in registers: T_i = e_i - sum_j N_ij T_j (rows j < i already final)."""
    base = tl.program_id(0).to(tl.int64) * L * L
    r = tl.arange(0, BL)
    m = r < L
    # N transposed (nt[j, i] = N_ij), so that row i of N comes out along the axis T's rows run on
    nt = tl.load(N + base + r[None, :] * L + r[:, None], mask=m[:, None] & m[None, :], other=0.0)
    t = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, L):
        n_i = tl.sum(tl.where(r[None, :] == i, nt, 0.0), 1)        # N_ij over j
        t = tl.where(r[:, None] == i, t - tl.sum(n_i[:, None] * t, 0)[None, :], t)
    tl.store(T + base + r[:, None] * L + r[None, :], t, mask=m[:, None] & m[None, :])


def unit_lower_inverse_triton(N: torch.Tensor) -> torch.Tensor:
    """(I + N)^-1 of every (L, L) matrix of N (..., L, L), fp32, N strictly lower triangular (what is
    on or above the diagonal is not read); L <= 128."""
    L = N.shape[-1]
    if L > 128 or N.dtype != torch.float32:
        raise ValueError(f"the Triton inverse takes fp32 matrices of at most 128 rows, got {L} rows in {N.dtype}")
    n = N.reshape(-1, L, L).contiguous()
    t = torch.empty_like(n)
    if n.shape[0]:
        _unit_lower_inverse_kernel[(n.shape[0],)](n, t, L, BL=pow2(L), num_warps=4 if L <= 64 else 8)
    return t.view(N.shape)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x (B, H, NC, L, D) as (B*H, NC, L, D) with its last axis contiguous (a view where the
    strides allow, e.g. the W and U0 halves of one solve), and that view's first three strides."""
    B, H, NC, L, D = x.shape
    x = x.reshape(B * H, NC, L, D)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, x.stride(0), x.stride(1), x.stride(2)


def _blocks(L: int, Dk: int, Dv: int, bv: Optional[int]) -> tuple[int, int, int, int, int]:
    """(BL, BK, BV, warps, stages). A program holds a whole chunk and the whole key width, and
    value columns in blocks of 32 (64 spilled more registers at every width, compiled for sm_90a);
    8 warps where the W and Kd tiles are large. The next chunk's tiles are loaded during this
    one's products (2 stages) where two sets of them fit in shared memory beside the products'
    own (at most 115 KB at chunks of 64 and 128 virtual tokens), else one."""
    BL, BK = pow2(L), pow2(Dk)
    big = BL * BK > 64 * 64
    BV = bv if bv is not None else min(pow2(Dv), 32)
    tile_bytes = 4 * BL * (2 * BK + BV)
    return BL, BK, BV, 8 if big else 4, 2 if tile_bytes <= 96 * 1024 else 1


class _DeltaScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, W, U0, Kd, total, S0, bv):
        B, H, NC, L, Dk = W.shape
        Dv = U0.shape[-1]
        f32 = torch.float32
        w, *sw = _rows(W)
        u0, *su0 = _rows(U0)
        kd, *skd = _rows(Kd)
        gated = total is not None
        tot = total.reshape(B * H, NC).to(f32).contiguous() if gated else w  # unread when not gated
        S0c = S0.reshape(B * H, Dk, Dv).to(f32).contiguous()
        U = torch.empty(B * H, NC, L, Dv, dtype=f32, device=W.device)
        SC = torch.empty(B * H, NC, Dk, Dv, dtype=f32, device=W.device)
        ST = torch.empty(B * H, Dk, Dv, dtype=f32, device=W.device)
        BL, BK, BV, warps, stages = _blocks(L, Dk, Dv, bv)
        grid = (B * H, triton.cdiv(Dv, BV))
        _delta_scan_fwd_kernel[grid](w, u0, kd, tot, S0c, U, SC, ST, *sw, *su0, *skd, NC, L, DK=Dk, DV=Dv,
                                     BL=BL, BK=BK, BV=BV, GATED=gated, PREC=PREC, num_warps=warps,
                                     num_stages=stages)
        U, SC, ST = U.view(B, H, NC, L, Dv), SC.view(B, H, NC, Dk, Dv), ST.view(B, H, Dk, Dv)
        ctx.save_for_backward(W, Kd, total if gated else None, U, SC)
        ctx.bv, ctx.s0_dtype = bv, S0.dtype
        ctx.set_materialize_grads(False)
        return U, SC, ST

    @staticmethod
    def backward(ctx, dU, dSC, dST):
        W, Kd, total, U, SC = ctx.saved_tensors
        B, H, NC, L, Dk = W.shape
        Dv = U.shape[-1]
        f32 = torch.float32
        w, *sw = _rows(W)
        kd, *skd = _rows(Kd)
        gated = total is not None
        # w stands in for what the kernel does not read (no decay, outputs without a gradient)
        tot = total.reshape(B * H, NC).to(f32).contiguous() if gated else w
        du = dU.reshape(B * H, NC, L, Dv).to(f32).contiguous() if dU is not None else w
        dsc = dSC.reshape(B * H, NC, Dk, Dv).to(f32).contiguous() if dSC is not None else w
        dst = dST.reshape(B * H, Dk, Dv).to(f32).contiguous() if dST is not None else w
        DUT = torch.empty(B * H, NC, L, Dv, dtype=f32, device=W.device)
        DSN = torch.empty(B * H, NC, Dk, Dv, dtype=f32, device=W.device)
        DS0 = torch.empty(B * H, Dk, Dv, dtype=f32, device=W.device)
        BL, BK, BV, warps, stages = _blocks(L, Dk, Dv, ctx.bv)
        grid = (B * H, triton.cdiv(Dv, BV))
        _delta_scan_bwd_kernel[grid](w, kd, tot, du, dsc, dst, DUT, DSN, DS0, *sw, *skd, NC, L, DK=Dk, DV=Dv,
                                     BL=BL, BK=BK, BV=BV, GATED=gated, HAS_DU=dU is not None,
                                     HAS_DSC=dSC is not None, HAS_DST=dST is not None, PREC=PREC,
                                     num_warps=warps, num_stages=stages)
        dUt, dSn = DUT.view(B, H, NC, L, Dv), DSN.view(B, H, NC, Dk, Dv)
        dW = -(dUt @ SC.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
        dKd = U @ dSn.transpose(-1, -2) if ctx.needs_input_grad[2] else None
        dtot = (SC * dSn).sum((-1, -2)).to(total.dtype) if gated and ctx.needs_input_grad[3] else None
        dS0 = DS0.view(B, H, Dk, Dv).to(ctx.s0_dtype) if ctx.needs_input_grad[4] else None
        return dW, dUt if ctx.needs_input_grad[1] else None, dKd, dtot, dS0, None


def delta_scan_triton(
    W: torch.Tensor, U0: torch.Tensor, Kd: torch.Tensor, total: Optional[torch.Tensor], S0: torch.Tensor,
    bv: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chunk.scan_torch`` on the Triton kernels, differentiable (one autograd node). Shapes as
    there, fp32 in and out; ``bv``: the value columns per program (a power of two >= 16; None:
    ``_blocks``' choice), for tests that split narrow values."""
    if W.shape[-1] > 128 or U0.shape[-1] > 128:
        raise ValueError(f"the Triton delta scan takes Dk, Dv <= 128, got Dk={W.shape[-1]}, Dv={U0.shape[-1]}")
    if bv is not None and (bv < 16 or bv & (bv - 1)):
        raise ValueError(f"bv must be a power of two >= 16, got {bv}")
    return _DeltaScanFunction.apply(W, U0, Kd, total, S0, bv)
