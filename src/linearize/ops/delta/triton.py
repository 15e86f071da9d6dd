"""Triton kernels of the delta rule's chunk form: the inter-chunk scan (the one sequential part) and,
for the (gated) delta rule of order 1, the parallel parts around it (``delta_chunk_triton``).

The scan has the same meaning and layout as ``chunk.scan_torch`` (its reference): W, Kd (B, H, NC, L, Dk),
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
The step is affine, S_{c+1} = A_c S_c + Kd_c^T U0_c with A_c = total_c I - Kd_c^T W_c, so with few
long rows the chain runs in segments (``_segments``): each segment walked from a zero state, the
segments' entering states joined through the products of their A_c, then each walked again from
its own (the backward likewise, with A_c^T).
Products are tf32x3 (three tf32 tensor-core products per product, about fp32's accuracy): plain
tf32 would put 5e-4 relative errors into a state that carries them over the sequence, and exact
fp32 products (``"ieee"``) lower to FMA loops that spilled 7 KB a thread on sm_90a. The
interpreter computes every precision in fp32, so only the GPU tests see the tf32 rounding.

The chunk kernels (``chunk.chunk_form``'s algebra, one program per (batch*head, chunk), its tiles in
registers): the prep forms A's strict part N = strict(diag(beta) (K K^T * pair)), T = (I + N)^-1 in
blocks of 16 rows, W = T diag(beta start) K, U0 = T diag(beta) V and Kd = diag(end) K, storing T
for the backward; the read forms O = diag(start) Q S_c + (causal(Q K^T) * pair) U. Backward: the
read's (dQ, its part of dK and d log alpha, dU and dS_c for the scan), the scan's, then the prep's
(dW, dKd, d total from the scan's outputs; dN = -T^T dT T^T; dK, dV, d beta, d log alpha). Every
decay factor is exp of a sum of its own segment's log alphas, as in ``naive``; their gradients
come back through those sums. Products are tf32 for a model in 16 bits, tf32x3 otherwise
(``_chunk_precision``). DeltaProduct keeps the batched torch algebra around the scan.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..backend.dispatch import chain_segments, device_sms, patch_interpreter, pow2, strides_bht, unit_last

patch_interpreter()

PREC = "tf32x3"  # see the module docstring
# The smallest chunk and key side of the scan's and the chunk kernels' tiles: heads of 16 faulted
# on an H200 (illegal memory access; 32 and wider ran), so narrower widths and short chunks are
# masked tiles of 32 (docs/results/train-methods-h200.md). The scan's value blocks of 16 passed
# their GPU test.
MIN_TILE = 32


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
    NC, L, NSEG,
    DK: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, STORE: tl.constexpr, PREC: tl.constexpr,
):
    # one program per (batch*head, segment of NC / NSEG chunks), value block
    pid = tl.program_id(0).to(tl.int64)
    bh, first = pid // NSEG, (pid % NSEG) * (NC // NSEG)
    rl, rk = tl.arange(0, BL), tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    ml, mk, mv = rl < L, rk < DK, rv < DV
    state_off = pid * DK * DV  # S0, ST: (B*H*NSEG, Dk, Dv); SC: (B*H, NC, Dk, Dv); U: (B*H, NC, L, Dv), contiguous
    S = _tile(S0 + state_off, rk, rv, mk, mv, DV).to(tl.float32)
    for i in range(0, NC // NSEG):
        c = first + i
        if STORE:
            _put(SC + (bh * NC + c) * DK * DV, S, rk, rv, mk, mv, DV)
        w = _tile(W + bh * sw_bh + c * sw_c, rl, rk, ml, mk, sw_l).to(tl.float32)
        u = _tile(U0 + bh * su0_bh + c * su0_c, rl, rv, ml, mv, su0_l).to(tl.float32)
        u = u - tl.dot(w, S, input_precision=PREC)
        if STORE:
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
    NC, L, NSEG,
    DK: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, HAS_DU: tl.constexpr, HAS_DSC: tl.constexpr, HAS_DST: tl.constexpr,
    STORE: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    n = NC // NSEG
    bh, first = pid // NSEG, (pid % NSEG) * n
    rl, rk = tl.arange(0, BL), tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    ml, mk, mv = rl < L, rk < DK, rv < DV
    state_off = pid * DK * DV  # DST, DS0: (B*H*NSEG, Dk, Dv); DSC, DSN: (B*H, NC, Dk, Dv); DU, DUT: (B*H, NC, L, Dv)
    if HAS_DST:
        dS = _tile(DST + state_off, rk, rv, mk, mv, DV).to(tl.float32)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(0, n):
        c = first + n - 1 - i
        if STORE:
            _put(DSN + (bh * NC + c) * DK * DV, dS, rk, rv, mk, mv, DV)
        kd = _tile(KD + bh * skd_bh + c * skd_c, rl, rk, ml, mk, skd_l).to(tl.float32)
        if HAS_DU:
            du = _tile(DU + (bh * NC + c) * L * DV, rl, rv, ml, mv, DV).to(tl.float32)
            du = tl.dot(kd, dS, du, input_precision=PREC)
        else:
            du = tl.dot(kd, dS, input_precision=PREC)
        if STORE:
            _put(DUT + (bh * NC + c) * L * DV, du, rl, rv, ml, mv, DV)
        w = _tile(W + bh * sw_bh + c * sw_c, rl, rk, ml, mk, sw_l).to(tl.float32)
        if GATED:
            dS = dS * tl.load(TOT + bh * NC + c)
        dS = dS - tl.dot(tl.trans(w), du, input_precision=PREC)
        if HAS_DSC:
            dS += _tile(DSC + (bh * NC + c) * DK * DV, rk, rv, mk, mv, DV).to(tl.float32)
    _put(DS0 + state_off, dS, rk, rv, mk, mv, DV)


# ---------------------------------------------------------------------------------------------
# the whole chunk form of the delta rule (order 1), gated or not: prep, scan, read


@triton.jit
def _inverse_rows(n, r, BL: tl.constexpr, PREC: tl.constexpr):
    """(I + n)^-1 of the (BL, BL) tile n, strictly lower triangular, in blocks of 16 rows: the
    diagonal blocks' inverses D by forward substitution, row i of every block at once (row r of D
    is e_r - sum_j n_rj D_j over the rows j before it in its block, already final), then the rows
    below block by block, T_I = D_II (E_I - sum_{J < I} n_IJ T_J): 15 + 2 (BL / 16 - 1) products
    instead of BL steps of two reductions each."""
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    blk = r // 16
    nd = tl.where(blk[:, None] == blk[None, :], n, 0.0)
    d = eye
    for i in range(1, 16):
        row = (r % 16) == i
        d = tl.where(row[:, None], eye - tl.dot(tl.where(row[:, None], nd, 0.0), d, input_precision=PREC), d)
    below = tl.where(blk[:, None] > blk[None, :], n, 0.0)
    t = d
    for b in range(1, BL // 16):
        rhs = eye - tl.dot(below, t, input_precision=PREC)
        t = tl.where((blk == b)[:, None], tl.dot(d, rhs, input_precision=PREC), t)
    return t


@triton.jit
def _decay_pair(la, r):
    """exp(b_t - b_s) for s <= t else 0 (BL, BL), from a chunk's log alphas la (BL,), padding 0.
    Every exponent here and in ``_decay_ends`` is the sum of its own segment's log alphas (no
    difference of two cumulative sums), as ``naive.log_decay_segments``."""
    seg = tl.cumsum(tl.where(r[:, None] > r[None, :], la[:, None], 0.0), 0)  # [t, s]: la over (s, t]
    return tl.where(r[:, None] >= r[None, :], tl.exp(seg), 0.0)


@triton.jit
def _decay_ends(la, r):
    """start (BL,) exp(b_t - b_start), end (BL,) exp(b_end - b_s) and the total decay of a chunk."""
    end = tl.exp(tl.sum(tl.where(r[:, None] > r[None, :], la[:, None], 0.0), 0))
    return tl.exp(tl.cumsum(la, 0)), end, tl.exp(tl.sum(la, 0))


@triton.jit
def _decay(la, r):
    """A chunk's decay factors: pair, start, end, total (``_decay_pair``, ``_decay_ends``)."""
    start, end, total = _decay_ends(la, r)
    return _decay_pair(la, r), start, end, total


@triton.jit
def _decay_grad(gp, gs, ge, gt, r):
    """d log alpha (BL,) of one chunk from the gradients of the decay exponents: gp (BL, BL) of
    pair's (la over (s, t]), gs (BL,) of start's (la over [0, t]), ge (BL,) of end's (la after s),
    gt (scalar) of total's (all)."""
    m = tl.cumsum(gp, 1) - gp + gs[:, None]  # [t, l]: sum_{s < l} gp[t, s], + gs[t]
    return (tl.sum(tl.where(r[:, None] >= r[None, :], m, 0.0), 0)
            + tl.sum(tl.where(r[:, None] < r[None, :], ge[:, None], 0.0), 0) + gt)


@triton.jit
def _rows_bht(ptr, b, h, tok, cols, mrow, mcol, s_b, s_h, s_t):
    """A (rows, cols) tile of a (B, H, T, D) tensor (last axis contiguous), zero outside, fp32."""
    return _tile(ptr + b * s_b + h * s_h, tok, cols, mrow, mcol, s_t).to(tl.float32)


@triton.jit
def _put_bht(ptr, x, b, h, tok, cols, mrow, mcol, s_b, s_h, s_t):
    _put(ptr + b * s_b + h * s_h, x.to(ptr.dtype.element_ty), tok, cols, mrow, mcol, s_t)


@triton.jit
def _gates_bht(ptr, b, h, tok, mrow, s_b, s_h, s_t):
    return tl.load(ptr + b * s_b + h * s_h + tok * s_t, mask=mrow, other=0.0).to(tl.float32)


@triton.jit
def _chunk_coords(H, T, C, DK: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr):
    """A chunk program's (batch*head, chunk), (batch, head), its rows, key and value columns, tokens
    and masks (rows that are tokens, key and value columns, rows of the chunk)."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    r, rk, rv = tl.arange(0, BL), tl.arange(0, BK), tl.arange(0, BV)
    tok = c * C + r
    return bh, c, bh // H, bh % H, r, rk, rv, tok, (r < C) & (tok < T), rk < DK, rv < DV, r < C


@triton.jit
def _chunk_prep_kernel(
    K, V, BETA, LA, W, U0, KD, TINV, TOT,
    sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sb_b, sb_h, sb_t, sa_b, sa_h, sa_t,
    H, T, NC, C,
    DK: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, PREC: tl.constexpr,
):
    """Per (batch*head, chunk): W = T diag(beta start) K, U0 = T diag(beta) V, Kd = diag(end) K with
    T = (I + strict(diag(beta) (K K^T * pair)))^-1, stored with T and the chunk's total decay."""
    bh, c, b, h, r, rk, rv, tok, ml, mk, mv, mr = _chunk_coords(H, T, C, DK, DV, BL, BK, BV)
    k = _rows_bht(K, b, h, tok, rk, ml, mk, sk_b, sk_h, sk_t)
    v = _rows_bht(V, b, h, tok, rv, ml, mv, sv_b, sv_h, sv_t)
    beta = _gates_bht(BETA, b, h, tok, ml, sb_b, sb_h, sb_t)
    g = tl.dot(k, tl.trans(k), input_precision=PREC)
    bk = beta[:, None] * k
    kd = k
    if GATED:
        pair, start, end, total = _decay(_gates_bht(LA, b, h, tok, ml, sa_b, sa_h, sa_t), r)
        g = g * pair
        bk = start[:, None] * bk
        kd = end[:, None] * k
        tl.store(TOT + bh * NC + c, total)
    tinv = _inverse_rows(tl.where(r[:, None] > r[None, :], beta[:, None] * g, 0.0), r, BL, PREC)
    chunk = (bh * NC + c) * C
    _put(TINV + chunk * C, tinv, r, r, mr, mr, C)
    _put(W + chunk * DK, tl.dot(tinv, bk, input_precision=PREC), r, rk, mr, mk, DK)
    _put(U0 + chunk * DV, tl.dot(tinv, beta[:, None] * v, input_precision=PREC), r, rv, mr, mv, DV)
    _put(KD + chunk * DK, kd, r, rk, mr, mk, DK)


@triton.jit
def _chunk_read_kernel(
    Q, K, LA, U, SC, O,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sa_b, sa_h, sa_t, so_b, so_h, so_t,
    H, T, NC, C,
    DK: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, PREC: tl.constexpr,
):
    """Per (batch*head, chunk): O = diag(start) Q S_c + (causal(Q K^T) * pair) U."""
    bh, c, b, h, r, rk, rv, tok, ml, mk, mv, mr = _chunk_coords(H, T, C, DK, DV, BL, BK, BV)
    q = _rows_bht(Q, b, h, tok, rk, ml, mk, sq_b, sq_h, sq_t)
    k = _rows_bht(K, b, h, tok, rk, ml, mk, sk_b, sk_h, sk_t)
    chunk = bh * NC + c
    u = _tile(U + chunk * C * DV, r, rv, mr, mv, DV)
    s = _tile(SC + chunk * DK * DV, rk, rv, mk, mv, DV)
    reads = tl.dot(q, tl.trans(k), input_precision=PREC)
    qs = tl.dot(q, s, input_precision=PREC)
    if GATED:
        pair, start, end, total = _decay(_gates_bht(LA, b, h, tok, ml, sa_b, sa_h, sa_t), r)
        reads = reads * pair
        qs = start[:, None] * qs
    reads = tl.where(r[:, None] >= r[None, :], reads, 0.0)
    _put_bht(O, tl.dot(reads, u, qs, input_precision=PREC), b, h, tok, rv, ml, mv, so_b, so_h, so_t)


@triton.jit
def _chunk_read_bwd_kernel(
    Q, K, LA, U, SC, DO, DQ, DKR, DLAR, DU, DSC,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sa_b, sa_h, sa_t, sdo_b, sdo_h, sdo_t, sdq_b, sdq_h, sdq_t,
    H, T, NC, C,
    DK: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, PREC: tl.constexpr,
):
    """The read's backward per (batch*head, chunk): dQ (final), the read's part of dK and of
    d log alpha (fp32, (B*H, NC, C, .)), and dU, dS_c for the scan's backward."""
    bh, c, b, h, r, rk, rv, tok, ml, mk, mv, mr = _chunk_coords(H, T, C, DK, DV, BL, BK, BV)
    q = _rows_bht(Q, b, h, tok, rk, ml, mk, sq_b, sq_h, sq_t)
    k = _rows_bht(K, b, h, tok, rk, ml, mk, sk_b, sk_h, sk_t)
    do = _rows_bht(DO, b, h, tok, rv, ml, mv, sdo_b, sdo_h, sdo_t)
    chunk = bh * NC + c
    u = _tile(U + chunk * C * DV, r, rv, mr, mv, DV)
    s = _tile(SC + chunk * DK * DV, rk, rv, mk, mv, DV)
    causal = r[:, None] >= r[None, :]
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    dread = tl.dot(do, tl.trans(u), input_precision=PREC)  # the gradient of reads (before the mask)
    dos = do
    if GATED:
        pair, start, end, total = _decay(_gates_bht(LA, b, h, tok, ml, sa_b, sa_h, sa_t), r)
        gs = tl.sum(do * tl.dot(q, s, input_precision=PREC), 1) * start
        gp = tl.where(causal, dread * qk * pair, 0.0)
        dla = _decay_grad(gp, gs, tl.zeros([BL], tl.float32), 0.0, r)
        tl.store(DLAR + chunk * C + r, dla, mask=mr)
        dread = dread * pair
        qk = qk * pair
        dos = start[:, None] * do
    dread = tl.where(causal, dread, 0.0)
    reads = tl.where(causal, qk, 0.0)
    dq = tl.dot(dread, k, input_precision=PREC)
    dq = tl.dot(dos, tl.trans(s), dq, input_precision=PREC)
    _put_bht(DQ, dq, b, h, tok, rk, ml, mk, sdq_b, sdq_h, sdq_t)
    _put(DKR + chunk * C * DK, tl.dot(tl.trans(dread), q, input_precision=PREC), r, rk, mr, mk, DK)
    _put(DU + chunk * C * DV, tl.dot(tl.trans(reads), do, input_precision=PREC), r, rv, mr, mv, DV)
    _put(DSC + chunk * DK * DV, tl.dot(tl.trans(q), dos, input_precision=PREC), rk, rv, mk, mv, DV)


@triton.jit
def _chunk_prep_bwd_kernel(
    K, V, BETA, LA, TINV, TOT, U, SC, DUT, DSN, DKR, DLAR, DK_, DV_, DBETA, DLA,
    sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sb_b, sb_h, sb_t, sa_b, sa_h, sa_t,
    sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t, sdb_b, sdb_h, sdb_t, sda_b, sda_h, sda_t,
    H, T, NC, C,
    DK: tl.constexpr, DV: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATED: tl.constexpr, PREC: tl.constexpr,
):
    """The prep's backward per (batch*head, chunk), from the scan's: dW = -dU~ S_c^T,
    dKd = U dS_{c+1}^T, d total = <S_c, dS_{c+1}>, dU0 = dU~; then through T (dN = -T^T dT T^T)
    to the final dK (with the read's part), dV, d beta and d log alpha (with the read's part)."""
    bh, c, b, h, r, rk, rv, tok, ml, mk, mv, mr = _chunk_coords(H, T, C, DK, DV, BL, BK, BV)
    chunk = bh * NC + c
    # ordered so that few (C, D) and (C, C) tiles are live at once (at 64 x 64 they fill the registers)
    du0 = _tile(DUT + chunk * C * DV, r, rv, mr, mv, DV)
    s = _tile(SC + chunk * DK * DV, rk, rv, mk, mv, DV)
    dw = -tl.dot(du0, tl.trans(s), input_precision=PREC)
    dsn = _tile(DSN + chunk * DK * DV, rk, rv, mk, mv, DV)
    if GATED:
        gt = tl.sum(tl.sum(s * dsn, 1), 0) * tl.load(TOT + chunk)
    dkd = tl.dot(_tile(U + chunk * C * DV, r, rv, mr, mv, DV), tl.trans(dsn), input_precision=PREC)
    k = _rows_bht(K, b, h, tok, rk, ml, mk, sk_b, sk_h, sk_t)
    beta = _gates_bht(BETA, b, h, tok, ml, sb_b, sb_h, sb_t)
    dk = _tile(DKR + chunk * C * DK, r, rk, mr, mk, DK)
    bs = beta
    if GATED:
        la = _gates_bht(LA, b, h, tok, ml, sa_b, sa_h, sa_t)
        start, end, total = _decay_ends(la, r)
        ge = tl.sum(dkd * k, 1) * end
        dkd = end[:, None] * dkd
        bs = beta * start
    dk += dkd
    tinv = _tile(TINV + chunk * C * C, r, r, mr, mr, C)
    dt = tl.dot(dw, tl.trans(bs[:, None] * k), input_precision=PREC)
    dbk = tl.dot(tl.trans(tinv), dw, input_precision=PREC)  # d (diag(beta start) K)
    dk += bs[:, None] * dbk
    dkb = tl.sum(dbk * k, 1)  # d (beta start), per row
    v = _rows_bht(V, b, h, tok, rv, ml, mv, sv_b, sv_h, sv_t)
    dt = tl.dot(du0, tl.trans(beta[:, None] * v), dt, input_precision=PREC)
    dbv = tl.dot(tl.trans(tinv), du0, input_precision=PREC)  # d (diag(beta) V)
    dbeta = tl.sum(dbv * v, 1)
    _put_bht(DV_, beta[:, None] * dbv, b, h, tok, rv, ml, mv, sdv_b, sdv_h, sdv_t)
    tt = tl.trans(tinv)
    dn = -tl.dot(tl.dot(tt, dt, input_precision=PREC), tt, input_precision=PREC)
    dn = tl.where(r[:, None] > r[None, :], dn, 0.0)
    g = tl.dot(k, tl.trans(k), input_precision=PREC)
    if GATED:
        pair = _decay_pair(la, r)
        g = g * pair
    dbeta += tl.sum(dn * g, 1)
    dg = beta[:, None] * dn
    if GATED:
        dbeta += dkb * start
        gs = dkb * beta * start
        dla = _decay_grad(dg * g, gs, ge, gt, r) + tl.load(DLAR + chunk * C + r, mask=mr, other=0.0)
        tl.store(DLA + b * sda_b + h * sda_h + tok * sda_t, dla.to(DLA.dtype.element_ty), mask=ml)
        dg = dg * pair
    else:
        dbeta += dkb
    dk = tl.dot(dg + tl.trans(dg), k, dk, input_precision=PREC)
    _put_bht(DK_, dk, b, h, tok, rk, ml, mk, sdk_b, sdk_h, sdk_t)
    tl.store(DBETA + b * sdb_b + h * sdb_h + tok * sdb_t, dbeta.to(DBETA.dtype.element_ty), mask=ml)


@triton.jit
def _unit_lower_inverse_kernel(N, T, L, BL: tl.constexpr):
    """One matrix a program: T = (I + N)^-1 for N strictly lower triangular (L x L, fp32), by forward
    substitution row by row in registers, T_i = e_i - sum_j N_ij T_j (DeltaProduct's chunks of up
    to 128 virtual tokens, whose products in ``_inverse_rows`` would need 256 KB of shared memory)."""
    base = tl.program_id(0).to(tl.int64) * L * L
    r = tl.arange(0, BL)
    m = r < L
    # N transposed (nt[j, i] = N_ij), so that row i of N comes out along the axis T's rows run on
    nt = tl.load(N + base + r[None, :] * L + r[:, None], mask=m[:, None] & m[None, :] & (r[None, :] > r[:, None]),
                 other=0.0)
    t = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, L):
        n_i = tl.sum(tl.where(r[None, :] == i, nt, 0.0), 1)
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


def _blocks(L: int, Dk: int, Dv: int, bv: Optional[int], rows: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BL, BK, BV, warps, stages) for ``rows`` (batch*head) on ``sms`` multiprocessors. A program
    holds a whole chunk and the whole key width (no side below ``MIN_TILE``, masked), and value
    columns in blocks of 32 (64 spilled more registers at every width, compiled for sm_90a), 16
    where 32 leave multiprocessors idle: with few long rows the walk is a chain of latencies, and
    more programs run more chains at once (op forward + backward at 1 x 16K, 9 heads of 64: 10%
    faster). 8 warps where the W and Kd tiles are large. The next chunk's tiles are loaded during
    this one's products (2 stages) where two sets of them fit in shared memory beside the
    products' own (at most 115 KB at chunks of 64 and 128 virtual tokens), else one."""
    BL, BK = max(pow2(L), MIN_TILE), max(pow2(Dk), MIN_TILE)
    big = BL * BK > 64 * 64
    BV = bv if bv is not None else MIN_TILE
    if bv is None and rows * triton.cdiv(Dv, BV) < sms:
        BV = 16
    tile_bytes = 4 * BL * (2 * BK + BV)
    return BL, BK, BV, 8 if big else 4, 2 if tile_bytes <= 96 * 1024 else 1


MIN_SEGMENT = 16  # chunks: a segment shorter than this gains less than its extra pass costs


def _segments(NC: int, programs: int, sms: int) -> int:
    """Segments of the scan's chain for each (batch*head) (``chain_segments``: equal ones of at
    least ``MIN_SEGMENT`` chunks); 1 (the plain walk) below 4, as two passes over segments of half
    the chain gain nothing."""
    G = chain_segments(programs, NC, sms, MIN_SEGMENT, whole=True)
    return G if G >= 4 else 1


def _segment_transfers(w: torch.Tensor, kd: torch.Tensor, tot: Optional[torch.Tensor], G: int) -> torch.Tensor:
    """P_g (B*H, G, Dk, Dk): what each segment's chunks do to the state entering it, the product
    of A_c = total_c I - Kd_c^T W_c over its chunks (later ones on the left; S_{c+1} = A_c S_c +
    Kd_c^T U0_c), by pairwise products (a tree of log2(chunks) batched products). fp32 products:
    the segments' states are built from them."""
    A = -(kd.transpose(-1, -2) @ w)  # (B*H, NC, Dk, Dk)
    A.diagonal(dim1=-2, dim2=-1).add_(tot[..., None] if tot is not None else 1.0)
    M = A.view(A.shape[0], G, -1, *A.shape[-2:])
    while M.shape[2] > 1:
        m = M.shape[2] - M.shape[2] % 2
        paired = M[:, :, 1:m:2] @ M[:, :, 0:m:2]
        M = torch.cat([paired, M[:, :, m:]], 2) if m < M.shape[2] else paired
    return M[:, :, 0]


def _scan_launch(W: torch.Tensor, Dv: int, bv: Optional[int], segments: Optional[int]) -> tuple[dict, int, int]:
    """The scan kernels' launch for W (B, H, NC, L, Dk) and Dv value columns, the same in the forward
    and the backward: their block sizes, warps and stages (``_blocks``) as keyword arguments, the
    value blocks a row, and the chain's segments (``_segments``; ``segments`` forces a count)."""
    B, H, NC, L, Dk = W.shape
    sms = device_sms(W)
    BL, BK, BV, warps, stages = _blocks(L, Dk, Dv, bv, B * H, sms)
    cols = triton.cdiv(Dv, BV)
    launch = dict(DK=Dk, DV=Dv, BL=BL, BK=BK, BV=BV, PREC=PREC, num_warps=warps, num_stages=stages)
    return launch, cols, segments or _segments(NC, B * H * cols, sms)


def _scan_forward(W, U0, Kd, total, S0, bv, segments=None):
    """The scan's forward kernel: U, S_c (B*H, NC, L, .), S_final (B*H, Dk, Dv), fp32. With few
    rows and long ones (``_segments``; ``segments`` forces a count) the chain runs in G segments
    at once, twice: from a zero state, giving each segment's own contribution Q_g to the state it
    leaves, then, with each segment's entering state S_{g+1} = P_g S_g + Q_g (``_segment_transfers``;
    G small products), for the outputs. The walk is a chain of latencies, and G times as many
    programs run G chains of 1/G the length."""
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
    launch, cols, G = _scan_launch(W, Dv, bv, segments)

    def walk(starts: torch.Tensor, store: bool) -> torch.Tensor:
        ends = torch.empty(B * H * G, Dk, Dv, dtype=f32, device=W.device)
        _delta_scan_fwd_kernel[(B * H * G, cols)](
            w, u0, kd, tot, starts, U, SC, ends, *sw, *su0, *skd, NC, L, G, GATED=gated, STORE=store, **launch)
        return ends

    if G == 1:
        return U, SC, walk(S0c, True)
    Q = walk(torch.zeros(B * H * G, Dk, Dv, dtype=f32, device=W.device), False).view(B * H, G, Dk, Dv)
    with torch.autocast(W.device.type, enabled=False):  # (the layer may run under autocast: fp32 products)
        P = _segment_transfers(w, kd, tot if gated else None, G)
        starts = [S0c]
        for g in range(G - 1):
            starts.append(torch.baddbmm(Q[:, g], P[:, g], starts[-1]))
    ends = walk(torch.stack(starts, 1).view(B * H * G, Dk, Dv), True)
    return U, SC, ends.view(B * H, G, Dk, Dv)[:, -1]


def _scan_backward(W, Kd, total, dU, dSC, dST, Dv, bv, segments=None):
    """The scan's backward kernel: dU~ (B*H, NC, L, Dv), the leaving states' dS (B*H, NC, Dk, Dv)
    and dS0 (B*H, Dk, Dv), fp32; dU, dSC, dST may be None (no gradient). In segments as the
    forward (the same count): each segment's walk from a zero gradient at its end gives R_g, its
    own part of the gradient of the state entering it; the gradient leaving segment g is then
    that entering g + 1, D_g = P_{g+1}^T D_{g+1} + R_{g+1} (the last one dS_final), and a second
    walk from them gives the outputs."""
    B, H, NC, L, Dk = W.shape
    f32 = torch.float32
    w, *sw = _rows(W)
    kd, *skd = _rows(Kd)
    gated = total is not None
    # w stands in for what the kernel does not read (no decay, outputs without a gradient)
    tot = total.reshape(B * H, NC).to(f32).contiguous() if gated else w
    du = dU.reshape(B * H, NC, L, Dv).to(f32).contiguous() if dU is not None else w
    dsc = dSC.reshape(B * H, NC, Dk, Dv).to(f32).contiguous() if dSC is not None else w
    DUT = torch.empty(B * H, NC, L, Dv, dtype=f32, device=W.device)
    DSN = torch.empty(B * H, NC, Dk, Dv, dtype=f32, device=W.device)
    launch, cols, G = _scan_launch(W, Dv, bv, segments)

    def walk(ends: Optional[torch.Tensor], store: bool) -> torch.Tensor:
        starts = torch.empty(B * H * G, Dk, Dv, dtype=f32, device=W.device)
        _delta_scan_bwd_kernel[(B * H * G, cols)](
            w, kd, tot, du, dsc, w if ends is None else ends, DUT, DSN, starts, *sw, *skd, NC, L, G,
            GATED=gated, HAS_DU=dU is not None, HAS_DSC=dSC is not None, HAS_DST=ends is not None, STORE=store,
            **launch)
        return starts

    dst = dST.reshape(B * H, Dk, Dv).to(f32).contiguous() if dST is not None else None
    if G == 1:
        return DUT, DSN, walk(dst, True)
    R = walk(None, False).view(B * H, G, Dk, Dv)
    with torch.autocast(W.device.type, enabled=False):
        P = _segment_transfers(w, kd, tot if gated else None, G)
        ends = [dst if dst is not None else torch.zeros(B * H, Dk, Dv, dtype=f32, device=W.device)]
        for g in range(G - 1, 0, -1):
            ends.insert(0, torch.baddbmm(R[:, g], P[:, g].transpose(-1, -2), ends[0]))
    starts = walk(torch.stack(ends, 1).view(B * H * G, Dk, Dv), True)
    return DUT, DSN, starts.view(B * H, G, Dk, Dv)[:, 0]


class _DeltaScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, W, U0, Kd, total, S0, bv, segments):
        B, H, NC, L, Dk = W.shape
        Dv = U0.shape[-1]
        U, SC, ST = _scan_forward(W, U0, Kd, total, S0, bv, segments)
        U, SC, ST = U.view(B, H, NC, L, Dv), SC.view(B, H, NC, Dk, Dv), ST.view(B, H, Dk, Dv)
        ctx.save_for_backward(W, Kd, total, U, SC)
        ctx.bv, ctx.segments, ctx.s0_dtype = bv, segments, S0.dtype
        ctx.set_materialize_grads(False)
        return U, SC, ST

    @staticmethod
    def backward(ctx, dU, dSC, dST):
        W, Kd, total, U, SC = ctx.saved_tensors
        B, H, NC, L, Dk = W.shape
        Dv = U.shape[-1]
        DUT, DSN, DS0 = _scan_backward(W, Kd, total, dU, dSC, dST, Dv, ctx.bv, ctx.segments)
        dUt, dSn = DUT.view(B, H, NC, L, Dv), DSN.view(B, H, NC, Dk, Dv)
        dW = -(dUt @ SC.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
        dKd = U @ dSn.transpose(-1, -2) if ctx.needs_input_grad[2] else None
        gated = total is not None
        dtot = (SC * dSn).sum((-1, -2)).to(total.dtype) if gated and ctx.needs_input_grad[3] else None
        dS0 = DS0.view(B, H, Dk, Dv).to(ctx.s0_dtype) if ctx.needs_input_grad[4] else None
        return dW, dUt if ctx.needs_input_grad[1] else None, dKd, dtot, dS0, None, None


def delta_scan_triton(
    W: torch.Tensor, U0: torch.Tensor, Kd: torch.Tensor, total: Optional[torch.Tensor], S0: torch.Tensor,
    bv: Optional[int] = None, segments: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chunk.scan_torch`` on the Triton kernels, differentiable (one autograd node). Shapes as
    there, fp32 in and out; ``bv``: the value columns per program (a power of two >= 16; None:
    ``_blocks``' choice), ``segments``: the chain's segments (dividing NC; None: ``_segments``'
    choice), for tests."""
    if W.shape[-1] > 128 or U0.shape[-1] > 128:
        raise ValueError(f"the Triton delta scan takes Dk, Dv <= 128, got Dk={W.shape[-1]}, Dv={U0.shape[-1]}")
    if bv is not None and (bv < 16 or bv & (bv - 1)):
        raise ValueError(f"bv must be a power of two >= 16, got {bv}")
    if segments is not None and (segments < 1 or W.shape[2] % segments):
        raise ValueError(f"segments must divide the {W.shape[2]} chunks, got {segments}")
    return _DeltaScanFunction.apply(W, U0, Kd, total, S0, bv, segments)


FUSED_MAX_CHUNK = 64  # the chunk kernels hold (C, C) and (C, D) fp32 tiles of a whole chunk (C * D <= 64 * 64)
# warps of the chunk kernels (their fp32 tiles of 64 x 64 at liza's widths: fewer spill registers)
CHUNK_WARPS = {"prep": 8, "read": 4, "read_bwd": 8, "prep_bwd": 8}


def _chunk_precision(*xs: torch.Tensor) -> str:
    """The chunk kernels' products: tf32 for a model in 16 bits (an input in bf16 / fp16, or CUDA
    autocast on: the features arrive in fp32 from bf16 projections, whose rounding is far above
    tf32's), else tf32x3 (about fp32's accuracy, as the scan's). The scan is tf32x3 either way."""
    half = any(x.dtype in (torch.bfloat16, torch.float16) for x in xs)
    return "tf32" if half or torch.is_autocast_enabled("cuda") else PREC


def fused_chunk(chunk_size: int, Dk: int, Dv: int, T: int) -> int:
    """The chunk kernels' tokens per chunk: ``chunk_size`` cut to ``FUSED_MAX_CHUNK``, to 32 for
    heads wider than 64 (their (C, D) tiles), and to T. The result does not depend on it."""
    wide = max(pow2(Dk), pow2(Dv)) > 64
    return max(1, min(chunk_size, 32 if wide else FUSED_MAX_CHUNK, T))


class _DeltaChunkFunction(torch.autograd.Function):
    """The delta rule's chunk form (order 1, gated or not) on four kernels and the scan's:
    prep (W, U0, Kd, T per chunk) -> scan -> read, and back: read -> scan -> prep."""

    @staticmethod
    def forward(ctx, q, k, v, beta, log_alpha, S0, C, prec, extra_q):
        B, H, T, Dk = q.shape
        Dv = v.shape[-1]
        NC = triton.cdiv(T, C)
        f32, dev = torch.float32, q.device
        gated = log_alpha is not None
        la = log_alpha if gated else beta  # unread when not gated
        W = torch.empty(B, H, NC, C, Dk, dtype=f32, device=dev)
        U0 = torch.empty(B, H, NC, C, Dv, dtype=f32, device=dev)
        Kd = torch.empty_like(W)
        Tinv = torch.empty(B * H, NC, C, C, dtype=f32, device=dev)
        total = torch.empty(B, H, NC, dtype=f32, device=dev) if gated else None
        # rows: the tile of a whole chunk at these widths (a shorter C, at short T, is masked)
        rows = fused_chunk(FUSED_MAX_CHUNK, Dk, Dv, FUSED_MAX_CHUNK)
        meta = dict(DK=Dk, DV=Dv, BL=rows, BK=max(pow2(Dk), MIN_TILE), BV=max(pow2(Dv), MIN_TILE), GATED=gated,
                    PREC=prec)
        grid = (B * H, NC)
        _chunk_prep_kernel[grid](k, v, beta, la, W, U0, Kd, Tinv, total if gated else W,
                                 *strides_bht(k), *strides_bht(v), *strides_bht(beta), *strides_bht(la),
                                 H, T, NC, C, **meta, num_warps=CHUNK_WARPS["prep"])
        U, SC, ST = _scan_forward(W, U0, Kd, total, S0, None)
        o = torch.empty(B, H, T, Dv, dtype=v.dtype, device=dev)

        def read(queries, out):
            _chunk_read_kernel[grid](queries, k, la, U, SC, out, *strides_bht(queries), *strides_bht(k),
                                     *strides_bht(la), *strides_bht(out), H, T, NC, C, **meta,
                                     num_warps=CHUNK_WARPS["read"])
            return out

        read(q, o)
        # the extra queries' reads: no gradient (an empty stand-in where there are none)
        extra = torch.empty(0, dtype=v.dtype, device=dev) if extra_q is None else read(extra_q, torch.empty_like(o))
        ctx.mark_non_differentiable(extra)
        ctx.save_for_backward(q, k, v, beta, log_alpha, W, Kd, Tinv, total, U, SC)
        ctx.C, ctx.meta, ctx.s0_dtype = C, meta, S0.dtype
        ctx.set_materialize_grads(False)
        return o, ST.view(B, H, Dk, Dv), extra

    @staticmethod
    def backward(ctx, do, dST, _):
        q, k, v, beta, log_alpha, W, Kd, Tinv, total, U, SC = ctx.saved_tensors
        B, H, T, Dk = q.shape
        Dv, C, NC = v.shape[-1], ctx.C, W.shape[2]
        f32, dev = torch.float32, q.device
        gated, meta = log_alpha is not None, ctx.meta
        la = log_alpha if gated else beta
        grid = (B * H, NC)
        dq = torch.empty_like(q)
        dU = torch.empty(B * H, NC, C, Dv, dtype=f32, device=dev)
        dSC = torch.empty(B * H, NC, Dk, Dv, dtype=f32, device=dev)
        dk_read = torch.empty(B * H, NC, C, Dk, dtype=f32, device=dev)
        dla_read = torch.empty(B * H, NC, C, dtype=f32, device=dev) if gated else dU
        if do is None:
            do = torch.zeros(B, H, T, Dv, dtype=v.dtype, device=dev)
        do = unit_last(do)
        _chunk_read_bwd_kernel[grid](q, k, la, U, SC, do, dq, dk_read, dla_read, dU, dSC,
                                     *strides_bht(q), *strides_bht(k), *strides_bht(la), *strides_bht(do),
                                     *strides_bht(dq), H, T, NC, C, **meta, num_warps=CHUNK_WARPS["read_bwd"])
        dUt, dSn, dS0 = _scan_backward(W, Kd, total, dU, dSC, dST, Dv, None)
        dk, dv, dbeta = torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)
        dla = torch.empty_like(log_alpha) if gated else dbeta
        _chunk_prep_bwd_kernel[grid](k, v, beta, la, Tinv, total if gated else Tinv, U, SC, dUt, dSn, dk_read,
                                     dla_read, dk, dv, dbeta, dla,
                                     *strides_bht(k), *strides_bht(v), *strides_bht(beta), *strides_bht(la),
                                     *strides_bht(dk), *strides_bht(dv), *strides_bht(dbeta), *strides_bht(dla),
                                     H, T, NC, C, **meta, num_warps=CHUNK_WARPS["prep_bwd"])
        return (dq, dk, dv, dbeta, dla if gated else None, dS0.view(B, H, Dk, Dv).to(ctx.s0_dtype), None, None, None)


def delta_chunk_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, log_alpha: Optional[torch.Tensor],
    S0: torch.Tensor, chunk_size: int, extra_queries: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The delta rule's chunk form (``chunk.chunk_form`` of order 1) on the kernels, differentiable:
    q, k (B, H, T, Dk), v (B, H, T, Dv), beta and log_alpha (or None) (B, H, T) in bf16, fp16 or
    fp32 (read as they are, computed in fp32), S0 (B, H, Dk, Dv) fp32; chunks of ``fused_chunk``
    tokens. Returns o (B, H, T, Dv) in v's dtype, the final state (fp32) and, for ``extra_queries``
    (q's shape), their reads (no gradient; one more read kernel) or None."""
    C = fused_chunk(chunk_size, q.shape[-1], v.shape[-1], q.shape[2])
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    xq = None if extra_queries is None else unit_last(extra_queries.detach())
    o, S, extra = _DeltaChunkFunction.apply(q, k, v, beta, log_alpha, S0, C, _chunk_precision(q, k, v), xq)
    return o, S, None if extra_queries is None else extra
