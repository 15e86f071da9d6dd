"""Triton kernels for chunked gated linear attention with scalar (per-head) log-gates.

Same meaning and layout as ``ops.gla.gla_chunk``: q, k (B, H, T, Dk) features (or log-features
with ``log_space_features``), v (B, H, T, Dv), log_g (B, H, T), o (B, H, T, Dv), GLAState
(S (B, H, Dk, Dv), z (B, H, Dk)) in fp32. Dk, Dv <= 128; q, k, v of one dtype among
bf16/fp16/fp32 (fp32 uses exact fp32 dot products, for tests); state and accumulation in fp32.

Math (per head, chunks of BT tokens, b = cumulative log-gate counted from the chunk start,
b_end its last value; docs/design.md "Chunked gated form and Lizard's factorisation"):

    Q~_t = phi(q_t) e^{b_t},   K~_s = phi(k_s) e^{b_end - b_s}   (phi(x) = e^x for log-features)
    A_ts = (phi(q_t) . phi(k_s)) e^{b_t - b_s}, masked to s <= t with -inf BEFORE the exp
    num  = Q~ S + A v,   den = Q~ z + rowsum(A),   o = num / (den + eps)  (or num)
    S   <- e^{b_end} S + K~^T v,   z <- e^{b_end} z + colsum(K~)

Every exponent is <= 0, so nothing overflows for log-gates anywhere in [-20, 0]. The decays are
per-row factors <= 1, so the kernels never form Q~ or K~: they scale a product's rows instead,
Q~ S = diag(e^b) (phi(q) S) and K~^T v = phi(k)^T (diag(e^{b_end - b}) v) (v has fewer columns
than there are features when the forward splits V; the backward does the same with dn). That is
Lizard's factorisation (factors <= 1 only) with one exp per feature and fewer live tiles: the
forward held Q~ and K~ beside phi(q) and phi(k) and spilled registers.

Backward, with dn = do / (den + eps) and dd = -(do . o) / (den + eps) (dn = do, dd = 0 when
unnormalised) and M = (dn v^T + dd) * mask(e^{b_t - b_s}), per chunk with S (z) the state
entering it and dS (dz) the state gradient leaving it:

    dphi(q) = M phi(k) + e^{b_t} (dn S^T + dd z^T)
    dphi(k) = M^T phi(q) + e^{b_end - b_s} (v dS^T + dz^T)
    dv      = A^T dn + K~ dS,      dS_in = e^{b_end} dS + Q~^T dn,   dz_in = e^{b_end} dz + Q~^T dd
    dq = phi(q) * dphi(q) for log-features, else dphi(q) (same for k).

Gate gradient. Every b enters through weights e^{b_t - b_s}; collecting, for each token j, the
terms where j is the query side (+) and the key side (-) gives

    d b_j = phi(q_j) . dphi(q_j) - phi(k_j) . dphi(k_j)   (+ <dS_T, S_T> + <dz_T, z_T> at j = T-1)

(phi . dphi is q . dq for plain features and sum(dq) for log-features), and since
b_j = sum_{i<=j} log_g_i, d log_g_i = sum_{j>=i} d b_j. The part of that sum after a chunk is the
derivative by a scale of the state leaving the chunk, <dS, S> + <dz, z>, so the cumulative sum
only ever runs inside one chunk (in bf16 a sum over the whole sequence of these large, mostly
cancelling terms loses digits as T grows).

Passes. Forward: [den kernel: the normaliser, carrying z alone] -> main kernel, one program per
(batch*head, V-block) walking its chunks with the fp32 (Dk, BV) state in registers; when a
gradient is needed it also stores the state entering each chunk (input dtype). Backward: one
reverse pass carrying dS (one small product per chunk) stores dS per chunk and dd, then one
program per chunk computes dq, dk, dv and d log_g with no loop (fully parallel).
When the main pass's (batch*head, V-block) programs are fewer than the GPU's multiprocessors,
the sequence is cut into segments: a pre-pass computes each segment's own state (normalised, z in
a launch of its own), a scan turns them into the state entering each segment, and the segments
run in parallel (the backward does the same for dS from the end). ``fwd_prologue``/``fwd_main``
and ``bwd_states``/``bwd_chunks`` are those passes in two halves, for ``ops.lizard_attn.fused``, which
runs the sequential half beside the window branch on a second CUDA stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import common
from .naive import GLAState
from ..backend.settings import KernelSettings, resolve as resolve_settings
from ..backend.dispatch import (device_sms, fork_stream, fused_segment_count, gluon_kernels, join_stream, patch_interpreter,
                       pow2, sm_major, strides_bht, unit_last)

patch_interpreter()

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _load_rows(ptr, rows, cols, mrow, mcol, stride_t, other):
    """A (rows x cols) tile of a (T, D) slab with row stride ``stride_t`` and unit column stride."""
    offs = rows[:, None].to(tl.int64) * stride_t + cols[None, :]
    return tl.load(ptr + offs, mask=mrow[:, None] & mcol[None, :], other=other)


@triton.jit
def _load_tile(desc, ptr, t0, c0, rows, cols, mrow, mcol, stride_t, other: tl.constexpr, TMA: tl.constexpr):
    """The (BT, BN) tile of a (T, D) slab at rows t0.., columns c0.. (``rows``/``cols`` hold the
    same indices), through a tensor descriptor (TMA) or pointers, ``other`` outside (mrow,
    mcol). TMA pads with 0; another ``other`` (-inf for log-features) costs one select."""
    if TMA:
        x = desc.load([t0, c0])
        if other != 0.0:
            x = tl.where(mrow[:, None] & mcol[None, :], x.to(tl.float32), other).to(x.dtype)
    else:
        x = _load_rows(ptr, rows, cols, mrow, mcol, stride_t, other)
    return x


@triton.jit
def _chunk_gates(G, rows, mrow, sgt):
    """One chunk's log-gates (padding rows add 0): b = cumsum from the chunk start, b_end = the
    total, and r = b_end - b summed directly from the end (an exclusive suffix sum), which keeps
    the decays that matter (keys near the chunk end) exact where b_end - b would cancel."""
    g = tl.load(G + rows.to(tl.int64) * sgt, mask=mrow, other=0.0).to(tl.float32)
    return tl.cumsum(g, 0), tl.sum(g, 0), tl.cumsum(g, 0, reverse=True) - g


@triton.jit
def _phi(x, LOG: tl.constexpr):
    """phi(x) in the dtype of x (the dot dtype): e^x for log-features, else x itself."""
    if LOG:
        return tl.exp(x.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _rows(x, log_decay):
    """x (BT, N) with row t scaled by e^{log_decay_t} <= 1, in fp32 before rounding to x's dtype."""
    return (x.to(tl.float32) * tl.exp(log_decay)[:, None]).to(x.dtype)


@triton.jit
def _carry(S, f, x, log_decay, b_end, PREC: tl.constexpr):
    """One chunk of a state recurrence, with the decays as row scales (factors <= 1):
    S <- e^{b_end} S + f^T diag(e^{log_decay}) x. Forward: f = phi(k), x = v, log_decay = b_end - b;
    backward: f = phi(q), x = dn, log_decay = b."""
    return S * tl.exp(b_end) + tl.dot(tl.trans(f), _rows(x, log_decay).to(f.dtype), input_precision=PREC)


@triton.jit
def _carry_z(z, f, w, log_decay, b_end):
    """The normaliser's part of a state recurrence: z <- e^{b_end} z + f^T (w e^{log_decay}).
    Forward: f = phi(k), w = 1, log_decay = b_end - b; backward: f = phi(q), w = dd, log_decay = b.
    The forward's segment pre-pass runs it in a launch of its own: beside the matrix carry this
    reduction over the chunk's rows cost more than the matrix did (H200, one sequence of 32K tokens:
    the pre-pass took 0.42 ms with z, 0.16 without, and Lizard's gated forward 1.19 ms, against
    1.12 with z in programs of its own in the same launch and 1.07 in a launch of its own). In the
    backward's reverse passes, dz in programs of its own in the same launch lost; a launch of its
    own there is not measured (docs/results/kernels-h200-carry-split.json)."""
    return z * tl.exp(b_end) + tl.sum(f.to(tl.float32) * (w * tl.exp(log_decay))[:, None], 0)


@triton.jit
def _intra_decay(b, ot):
    """e^{b_t - b_s} for s <= t, else 0; masked before the exp."""
    return tl.exp(tl.where(ot[:, None] >= ot[None, :], b[:, None] - b[None, :], float("-inf")))


@triton.jit
def _grad_out(DO, O, DEN, rows, ov, mt, mv, DV: tl.constexpr, eps, NORM: tl.constexpr, BT: tl.constexpr,
              BVF: tl.constexpr):
    """dn = do / (den + eps) over the columns ``ov`` and dd = -(do . o) / (den + eps) over all
    of them (fp32; with ``BVF`` > 0 ``ov`` is a V-block and dd reads whole rows of BVF); do
    itself and 0 when unnormalised."""
    offs = rows[:, None].to(tl.int64) * DV + ov[None, :]
    m2 = mt[:, None] & mv[None, :]
    do = tl.load(DO + offs, mask=m2, other=0.0).to(tl.float32)
    if NORM:
        r = 1.0 / (tl.load(DEN + rows, mask=mt, other=0.0) + eps)
        if BVF > 0:
            of = tl.arange(0, BVF)
            offf = rows[:, None].to(tl.int64) * DV + of[None, :]
            mf = mt[:, None] & (of < DV)[None, :]
            dd = -tl.sum(tl.load(DO + offf, mask=mf, other=0.0).to(tl.float32)
                         * tl.load(O + offf, mask=mf, other=0.0).to(tl.float32), 1) * r
        else:
            o = tl.load(O + offs, mask=m2, other=0.0).to(tl.float32)
            dd = -tl.sum(do * o, 1) * r
        dn = do * r[:, None]
    else:
        dd = tl.zeros([BT], dtype=tl.float32)
        dn = do
    return dn, dd


@triton.jit
def _gla_fwd_state_kernel(
    K, V, G, S_SEG, Z_SEG, G_SEG,
    skb, skh, skt, svb, svh, svt, sgb, sgh, sgt,
    T, H, SEG_LEN, NSEG,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    LOG: tl.constexpr, PREC: tl.constexpr, Z_ONLY: tl.constexpr,
):
    """Grid (V-blocks, NSEG - 1, B*H): the state each segment builds from zero, and its total
    log-decay; with Z_ONLY (grid (1, NSEG - 1, B*H)) the normaliser's z and the log-decay instead,
    in a launch of its own (in the same launch, its programs took the registers and shared memory
    of the others; and so the normaliser's chain needs nothing of the state's)."""
    i_v = tl.program_id(0)
    i_seg = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    K += i_b.to(tl.int64) * skb + i_h.to(tl.int64) * skh
    V += i_b.to(tl.int64) * svb + i_h.to(tl.int64) * svh
    G += i_b.to(tl.int64) * sgb + i_h.to(tl.int64) * sgh
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    ot = tl.arange(0, BT)
    mk = ok < DK
    mv = ov < DV
    neg = float("-inf") if LOG else 0.0
    t_start = i_seg * SEG_LEN
    t_stop = tl.minimum(t_start + SEG_LEN, T)
    st = (i_bh * NSEG + i_seg).to(tl.int64)
    if Z_ONLY:
        z = tl.zeros([BK], dtype=tl.float32)
        g_total = tl.sum(tl.zeros([BT], dtype=tl.float32), 0)
        for c in range(0, SEG_LEN // BT):
            rows = t_start + c * BT + ot
            mt = rows < t_stop
            b, b_end, r_end = _chunk_gates(G, rows, mt, sgt)
            z = _carry_z(z, _phi(_load_rows(K, rows, ok, mt, mk, skt, neg), LOG), 1.0, r_end, b_end)
            g_total += b_end
        tl.store(Z_SEG + st * DK + ok, z, mask=mk)
        tl.store(G_SEG + st, g_total)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
        g_total = tl.sum(tl.zeros([BT], dtype=tl.float32), 0)
        for c in range(0, SEG_LEN // BT):  # a fixed trip count: chunks past T are fully masked
            rows = t_start + c * BT + ot
            mt = rows < t_stop
            k = _load_rows(K, rows, ok, mt, mk, skt, neg)
            v = _load_rows(V, rows, ov, mt, mv, svt, 0.0)
            b, b_end, r_end = _chunk_gates(G, rows, mt, sgt)
            S = _carry(S, _phi(k, LOG), v, r_end, b_end, PREC)
            g_total += b_end
        tl.store(S_SEG + st * DK * DV + ok[:, None] * DV + ov[None, :], S, mask=mk[:, None] & mv[None, :])
        tl.store(G_SEG + st, g_total, mask=i_v == 0)


@triton.jit
def _gla_scan_kernel(
    S_SEG, Z_SEG, G_SEG, S_INIT, Z_INIT, NSEG,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, DO_S: tl.constexpr = True, DO_Z: tl.constexpr = True,
):
    """Grid (V-blocks, B*H). In place: slot j of S_SEG holds a segment's own (d)state on entry
    and the (d)state at its start (forward) or its end (REVERSE) on exit. DO_S / DO_Z: which of
    S and z (two chains of the forward may scan them apart).

    forward: S = S_init; for j = 0..NSEG-2: slot_j <- S, S = e^{G_j} S + own_j; slot_{NSEG-1} <- S
    reverse: dS = dS_T; for j = NSEG-1..1: slot_j <- dS, dS = e^{G_j} dS + own_j; slot_0 <- dS
    """
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    m2 = (ok < DK)[:, None] & (ov < DV)[None, :] & DO_S
    mz = (ok < DK) & (i_v == 0) & DO_Z
    offs = ok[:, None] * DV + ov[None, :]
    if HAS_INIT:
        S = tl.load(S_INIT + i_bh.to(tl.int64) * DK * DV + offs, mask=m2, other=0.0)
        z = tl.load(Z_INIT + i_bh.to(tl.int64) * DK + ok, mask=mz, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
        z = tl.zeros([BK], dtype=tl.float32)
    for i in range(0, NSEG - 1):
        if REVERSE:
            j = NSEG - 1 - i
        else:
            j = i
        st = (i_bh * NSEG + j).to(tl.int64)
        own = tl.load(S_SEG + st * DK * DV + offs, mask=m2, other=0.0)
        own_z = tl.load(Z_SEG + st * DK + ok, mask=mz, other=0.0)
        decay = tl.exp(tl.load(G_SEG + st))
        tl.store(S_SEG + st * DK * DV + offs, S, mask=m2)
        tl.store(Z_SEG + st * DK + ok, z, mask=mz)
        S = S * decay + own
        z = z * decay + own_z
    if REVERSE:
        st = (i_bh * NSEG).to(tl.int64)
    else:
        st = (i_bh * NSEG + NSEG - 1).to(tl.int64)
    tl.store(S_SEG + st * DK * DV + offs, S, mask=m2)
    tl.store(Z_SEG + st * DK + ok, z, mask=mz)


@triton.jit
def _gla_bwd_state_kernel(
    Q, G, DO, O, DEN, DS_SEG, DZ_SEG, G_SEG,
    sqb, sqh, sqt, sgb, sgh, sgt,
    T, H, SEG_LEN, NSEG, eps,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    LOG: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (NSEG - 1, B*H) for segments 1..NSEG-1: the dS each segment sends to its start,
    sum_t e^{b_t - b_start} phi(q_t) dn_t^T (and dz), and its total log-decay."""
    i_seg = tl.program_id(0) + 1
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    Q += i_b.to(tl.int64) * sqb + i_h.to(tl.int64) * sqh
    G += i_b.to(tl.int64) * sgb + i_h.to(tl.int64) * sgh
    DO += i_bh.to(tl.int64) * T * DV
    O += i_bh.to(tl.int64) * T * DV
    DEN += i_bh.to(tl.int64) * T
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BV)
    ot = tl.arange(0, BT)
    mk = ok < DK
    mv = ov < DV
    neg = float("-inf") if LOG else 0.0
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    dz = tl.zeros([BK], dtype=tl.float32)
    g_total = tl.sum(tl.zeros([BT], dtype=tl.float32), 0)
    t_start = i_seg * SEG_LEN
    t_stop = tl.minimum(t_start + SEG_LEN, T)
    n = SEG_LEN // BT  # a fixed trip count: chunks past T are fully masked no-ops
    for i in range(0, n):
        rows = t_start + (n - 1 - i) * BT + ot
        mt = rows < t_stop
        q = _load_rows(Q, rows, ok, mt, mk, sqt, neg)
        b, b_end, r_end = _chunk_gates(G, rows, mt, sgt)
        dn, dd = _grad_out(DO, O, DEN, rows, ov, mt, mv, DV, eps, NORM, BT, 0)
        q_ph = _phi(q, LOG)
        dS = _carry(dS, q_ph, dn, b, b_end, PREC)
        if NORM:
            dz = _carry_z(dz, q_ph, dd, b, b_end)
        g_total += b_end
    st = (i_bh * NSEG + i_seg).to(tl.int64)
    tl.store(DS_SEG + st * DK * DV + ok[:, None] * DV + ov[None, :], dS, mask=mk[:, None] & mv[None, :])
    tl.store(DZ_SEG + st * DK + ok, dz, mask=mk)
    tl.store(G_SEG + st, g_total)


@triton.jit
def _gla_fwd_kernel(
    Q, K, V, G, O, DEN_IN, DEN, S_IN, S_OUT, SC, OW, ALPHA, Y,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sgb, sgh, sgt,
    T, H, SEG_LEN, NSEG, NC, eps,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    LOG: tl.constexpr, NORM: tl.constexpr, HAS_INIT: tl.constexpr, STORE_CHUNKS: tl.constexpr,
    COMBINE: tl.constexpr, STORE_O: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
):
    """Grid (V-blocks, segments, B*H): o (divided by den + eps when NORM: DEN_IN's inter-chunk
    part from ``_gla_den_kernel`` plus rowsum(A), which this pass holds anyway; the V-block 0
    program stores the whole den in DEN for the backward) and the final state; with STORE_CHUNKS
    also the state entering every chunk and the final state, SC (B*H, NC + 1, Dk, Dv) in the input
    dtype, for the backward. (A variant computing all of den here, carrying z beside S, ran 1.6x
    slower on an H200: more registers spilled.) With COMBINE (Lizard) it also writes
    Y = o + alpha_h * OW, OW (B*H, T, Dv) being the window branch's output, and o itself only
    with STORE_O."""
    i_v = tl.program_id(0)
    i_seg = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    dt = O.dtype.element_ty
    Q += i_b.to(tl.int64) * sqb + i_h.to(tl.int64) * sqh
    K += i_b.to(tl.int64) * skb + i_h.to(tl.int64) * skh
    V += i_b.to(tl.int64) * svb + i_h.to(tl.int64) * svh
    G += i_b.to(tl.int64) * sgb + i_h.to(tl.int64) * sgh
    O += i_bh.to(tl.int64) * T * DV
    OW += i_bh.to(tl.int64) * T * DV
    Y += i_bh.to(tl.int64) * T * DV
    DEN_IN += i_bh.to(tl.int64) * T
    DEN += i_bh.to(tl.int64) * T

    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    ot = tl.arange(0, BT)
    mk = ok < DK
    mv = ov < DV
    m2 = mk[:, None] & mv[None, :]
    if HAS_INIT:
        st = (i_bh * NSEG + i_seg).to(tl.int64)
        S = tl.load(S_IN + st * DK * DV + ok[:, None] * DV + ov[None, :], mask=m2, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    neg = float("-inf") if LOG else 0.0
    q_desc, k_desc, v_desc, ow_desc, y_desc = Q, K, V, OW, Y  # unused unless TMA
    if TMA:  # tensor descriptors: the copy engine makes the addresses, no offset tiles held in registers
        q_desc = tl.make_tensor_descriptor(Q, shape=[T, DK], strides=[sqt, 1], block_shape=[BT, BK])
        k_desc = tl.make_tensor_descriptor(K, shape=[T, DK], strides=[skt, 1], block_shape=[BT, BK])
        v_desc = tl.make_tensor_descriptor(V, shape=[T, DV], strides=[svt, 1], block_shape=[BT, BV])
        o_desc = tl.make_tensor_descriptor(O, shape=[T, DV], strides=[DV, 1], block_shape=[BT, BV])
        if COMBINE:
            ow_desc = tl.make_tensor_descriptor(OW, shape=[T, DV], strides=[DV, 1], block_shape=[BT, BV])
            y_desc = tl.make_tensor_descriptor(Y, shape=[T, DV], strides=[DV, 1], block_shape=[BT, BV])
        if STORE_CHUNKS and DK == BK:
            sc_desc = tl.make_tensor_descriptor(SC + i_bh.to(tl.int64) * (NC + 1) * DK * DV, shape=[(NC + 1) * DK, DV],
                                                strides=[DV, 1], block_shape=[BK, BV])

    t_start = i_seg * SEG_LEN
    t_stop = tl.minimum(t_start + SEG_LEN, T)
    for c in range(0, SEG_LEN // BT):  # a fixed trip count: chunks past T are fully masked
        rows = t_start + c * BT + ot
        mt = rows < t_stop
        if STORE_CHUNKS:
            ci = (i_seg * (SEG_LEN // BT) + c).to(tl.int64)
            if TMA and DK == BK:
                # a chunk past T (ci >= NC) holds the final state: slot NC gets that same value,
                # later slots lie outside the descriptor
                sc_desc.store([(i_seg * (SEG_LEN // BT) + c) * DK, i_v * BV], S.to(dt))
            else:
                tl.store(SC + (i_bh.to(tl.int64) * (NC + 1) + ci) * DK * DV + ok[:, None] * DV + ov[None, :],
                         S.to(dt), mask=m2 & (ci < NC))
        q_ph = _phi(_load_tile(q_desc, Q, t_start + c * BT, 0, rows, ok, mt, mk, sqt, neg, TMA), LOG)
        k_ph = _phi(_load_tile(k_desc, K, t_start + c * BT, 0, rows, ok, mt, mk, skt, neg, TMA), LOG)
        v = _load_tile(v_desc, V, t_start + c * BT, i_v * BV, rows, ov, mt, mv, svt, 0.0, TMA)
        b, b_end, r_end = _chunk_gates(G, rows, mt, sgt)
        a = (tl.dot(q_ph, tl.trans(k_ph), input_precision=PREC) * _intra_decay(b, ot)).to(dt)
        num = tl.dot(q_ph, S.to(dt), input_precision=PREC) * tl.exp(b)[:, None]
        num = tl.dot(a, v, num, input_precision=PREC)
        if NORM:  # rowsum of A rounded to the dot dtype, as the numerator's A @ v uses it
            den = tl.load(DEN_IN + rows, mask=mt, other=1.0) + tl.sum(a.to(tl.float32), 1)
            tl.store(DEN + rows, den, mask=mt & (i_v == 0))
            num = num / (den + eps)[:, None]
        if STORE_O:
            if TMA:
                o_desc.store([t_start + c * BT, i_v * BV], num.to(dt))
            else:
                tl.store(O + rows[:, None].to(tl.int64) * DV + ov[None, :], num.to(dt),
                         mask=mt[:, None] & mv[None, :])
        if COMBINE:
            ow = _load_tile(ow_desc, OW, t_start + c * BT, i_v * BV, rows, ov, mt, mv, DV, 0.0, TMA)
            y = num + tl.load(ALPHA + i_h).to(tl.float32) * ow.to(tl.float32)
            if TMA:
                y_desc.store([t_start + c * BT, i_v * BV], y.to(dt))
            else:
                tl.store(Y + rows[:, None].to(tl.int64) * DV + ov[None, :], y.to(dt), mask=mt[:, None] & mv[None, :])
        S = _carry(S, k_ph, v, r_end, b_end, PREC)

    last = i_seg == NSEG - 1
    tl.store(S_OUT + i_bh.to(tl.int64) * DK * DV + ok[:, None] * DV + ov[None, :], S, mask=m2 & last)
    if STORE_CHUNKS:  # slot NC: the final state
        tl.store(SC + (i_bh.to(tl.int64) * (NC + 1) + NC) * DK * DV + ok[:, None] * DV + ov[None, :], S.to(dt),
                 mask=m2 & last)


@triton.jit
def _gla_den_kernel(
    Q, K, G, DEN, Z_IN, Z_OUT, ZC,
    sqb, sqh, sqt, skb, skh, skt, sgb, sgh, sgt,
    T, H, SEG_LEN, NSEG, NC,
    DK: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    LOG: tl.constexpr, HAS_INIT: tl.constexpr, STORE_CHUNKS: tl.constexpr, TMA: tl.constexpr,
):
    """Grid (segments, B*H): the normaliser's inter-chunk part Q~_t . z (fp32, (B*H, T); the
    main pass adds rowsum(A)_t, the intra-chunk part, from the A it computes anyway), i.e. the same
    recurrence with values 1, carrying z (Dk) alone; also the final z and, with STORE_CHUNKS, the
    z entering every chunk and the final z, ZC (B*H, NC + 1, Dk) fp32. Kept out of the main
    forward kernel, whose registers the (Dk, Dv) state and the tiles already fill."""
    i_seg = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    Q += i_b.to(tl.int64) * sqb + i_h.to(tl.int64) * sqh
    K += i_b.to(tl.int64) * skb + i_h.to(tl.int64) * skh
    G += i_b.to(tl.int64) * sgb + i_h.to(tl.int64) * sgh
    DEN += i_bh.to(tl.int64) * T
    ok = tl.arange(0, BK)
    ot = tl.arange(0, BT)
    mk = ok < DK
    if HAS_INIT:
        z = tl.load(Z_IN + (i_bh * NSEG + i_seg).to(tl.int64) * DK + ok, mask=mk, other=0.0)
    else:
        z = tl.zeros([BK], dtype=tl.float32)
    neg = float("-inf") if LOG else 0.0
    q_desc, k_desc = Q, K  # unused unless TMA
    if TMA:
        q_desc = tl.make_tensor_descriptor(Q, shape=[T, DK], strides=[sqt, 1], block_shape=[BT, BK])
        k_desc = tl.make_tensor_descriptor(K, shape=[T, DK], strides=[skt, 1], block_shape=[BT, BK])
    t_start = i_seg * SEG_LEN
    t_stop = tl.minimum(t_start + SEG_LEN, T)
    for c in range(0, SEG_LEN // BT):
        rows = t_start + c * BT + ot
        mt = rows < t_stop
        if STORE_CHUNKS:
            ci = (i_seg * (SEG_LEN // BT) + c).to(tl.int64)
            tl.store(ZC + (i_bh.to(tl.int64) * (NC + 1) + ci) * DK + ok, z, mask=mk & (ci < NC))
        q_ph = _phi(_load_tile(q_desc, Q, t_start + c * BT, 0, rows, ok, mt, mk, sqt, neg, TMA), LOG)
        k_ph = _phi(_load_tile(k_desc, K, t_start + c * BT, 0, rows, ok, mt, mk, skt, neg, TMA), LOG)
        b, b_end, r_end = _chunk_gates(G, rows, mt, sgt)
        tl.store(DEN + rows, tl.sum(q_ph.to(tl.float32) * z[None, :], 1) * tl.exp(b), mask=mt)
        z = _carry_z(z, k_ph, 1.0, r_end, b_end)
    tl.store(Z_OUT + i_bh.to(tl.int64) * DK + ok, z, mask=mk & (i_seg == NSEG - 1))
    if STORE_CHUNKS:
        tl.store(ZC + (i_bh.to(tl.int64) * (NC + 1) + NC) * DK + ok, z, mask=mk & (i_seg == NSEG - 1))


@triton.jit
def _gla_bwd_dstate_kernel(
    Q, G, DO, O, DEN, SC, ZC, DS_IN, DZ_IN, DSC, DZC, DDEN, YC, DS0, DZ0,
    sqb, sqh, sqt, sgb, sgh, sgt,
    T, H, SEG_LEN, NSEG, NC, eps,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    BVF: tl.constexpr, NVD: tl.constexpr,
    LOG: tl.constexpr, NORM: tl.constexpr, HAS_DS: tl.constexpr, STORE_DS0: tl.constexpr,
    PREC: tl.constexpr,
):
    """Grid (V-blocks, segments, B*H), reverse over chunks carrying dS (Dk, BV) and dz: stores
    the state gradient leaving every chunk, DSC (B*H, NC, Dk, Dv) in the input dtype and DZC
    fp32; dd per token (fp32); and YC (B*H, NC, NVD), summed over its last axis <dS_out, S_out>
    + <dz_out, z_out> with S_out the state leaving the chunk: the gate gradient that every token
    of the chunk gets from everything after it (see ``_gla_bwd_chunk_kernel``); each V-block
    stores its own part (the first also the z term), so the sum has a fixed order. The segment-0
    programs write the initial state's gradient. Every V-block carries dz; the first stores it."""
    i_v = tl.program_id(0)
    i_seg = tl.program_id(1)
    i_bh = tl.program_id(2)
    first_v = i_v == 0
    i_b = i_bh // H
    i_h = i_bh % H
    dt = DO.dtype.element_ty
    Q += i_b.to(tl.int64) * sqb + i_h.to(tl.int64) * sqh
    G += i_b.to(tl.int64) * sgb + i_h.to(tl.int64) * sgh
    DO += i_bh.to(tl.int64) * T * DV
    O += i_bh.to(tl.int64) * T * DV
    DEN += i_bh.to(tl.int64) * T
    DDEN += i_bh.to(tl.int64) * T
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    ot = tl.arange(0, BT)
    mk = ok < DK
    mv = ov < DV
    m2 = mk[:, None] & mv[None, :]
    neg = float("-inf") if LOG else 0.0
    if HAS_DS:
        st = (i_bh * NSEG + i_seg).to(tl.int64)
        dS = tl.load(DS_IN + st * DK * DV + ok[:, None] * DV + ov[None, :], mask=m2, other=0.0)
        dz = tl.load(DZ_IN + st * DK + ok, mask=mk, other=0.0)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
        dz = tl.zeros([BK], dtype=tl.float32)
    t_start = i_seg * SEG_LEN
    t_stop = tl.minimum(t_start + SEG_LEN, T)
    n = SEG_LEN // BT  # a fixed trip count: chunks past T are fully masked no-ops
    for i in range(0, n):
        c = n - 1 - i
        rows = t_start + c * BT + ot
        mt = rows < t_stop
        ci = (i_seg * n + c).to(tl.int64)
        mc = ci < NC
        sc = (i_bh.to(tl.int64) * NC + ci) * DK
        tl.store(DSC + sc * DV + ok[:, None] * DV + ov[None, :], dS.to(dt), mask=m2 & mc)
        b, b_end, r_end = _chunk_gates(G, rows, mt, sgt)
        nxt = (i_bh.to(tl.int64) * (NC + 1) + ci + 1) * DK  # the state leaving the chunk
        s_out = tl.load(SC + nxt * DV + ok[:, None] * DV + ov[None, :], mask=m2 & mc, other=0.0).to(tl.float32)
        y = tl.sum(tl.sum(s_out * dS, 1), 0)
        if NORM:
            tl.store(DZC + sc + ok, dz, mask=mk & mc & first_v)
            y += tl.where(first_v, tl.sum(tl.load(ZC + nxt + ok, mask=mk & mc, other=0.0) * dz, 0), 0.0)
        tl.store(YC + (i_bh.to(tl.int64) * NC + ci) * NVD + i_v, y, mask=mc)
        q = _load_rows(Q, rows, ok, mt, mk, sqt, neg)
        dn, dd = _grad_out(DO, O, DEN, rows, ov, mt, mv, DV, eps, NORM, BT, BVF if NVD > 1 else 0)
        if NORM:
            tl.store(DDEN + rows, dd, mask=mt & first_v)
        q_ph = _phi(q, LOG)
        dS = _carry(dS, q_ph, dn, b, b_end, PREC)
        if NORM:
            dz = _carry_z(dz, q_ph, dd, b, b_end)
    if STORE_DS0:
        first = i_seg == 0
        tl.store(DS0 + i_bh.to(tl.int64) * DK * DV + ok[:, None] * DV + ov[None, :], dS, mask=m2 & first)
        tl.store(DZ0 + i_bh.to(tl.int64) * DK + ok, dz, mask=mk & first & first_v)


@triton.jit
def _gla_bwd_chunk_kernel(
    Q, K, V, G, DO, DEN, DDEN, SC, ZC, DSC, DZC, YC, DQ, DK_, DV_, DG,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sgb, sgh, sgt,
    T, H, NC, eps,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    NVD: tl.constexpr, LOG: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr, DV_ADD: tl.constexpr,
):
    """Grid (NC, B*H), one chunk each, no loop: dq, dk, dv and d log_g from the state S (and z)
    entering the chunk and the state gradient dS (and dz) leaving it. With DV_ADD, dv is added
    to what DV_ holds.

    Gate gradient: with db_j = phi(q_j).dphi(q_j) - phi(k_j).dphi(k_j), d log_g_i = sum_{j >= i}
    db_j (+ the final state's term). Split at the chunk end: the part after the chunk is the
    derivative of the loss by a scale of the state leaving the chunk, YC = <dS_out, S_out> +
    <dz_out, z_out> (one number per chunk, from the dS pass), so the cumulative sum runs over
    at most one chunk: its rounding does not grow with T (over the whole sequence in bf16 the
    large terms of db cancel and the error grows like sqrt(T))."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    dt = DO.dtype.element_ty
    Q += i_b.to(tl.int64) * sqb + i_h.to(tl.int64) * sqh
    K += i_b.to(tl.int64) * skb + i_h.to(tl.int64) * skh
    V += i_b.to(tl.int64) * svb + i_h.to(tl.int64) * svh
    G += i_b.to(tl.int64) * sgb + i_h.to(tl.int64) * sgh
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BV)
    ot = tl.arange(0, BT)
    mk = ok < DK
    mv = ov < DV
    m2 = mk[:, None] & mv[None, :]
    neg = float("-inf") if LOG else 0.0
    rows = i_c * BT + ot
    mt = rows < T
    sc_in = (i_bh.to(tl.int64) * (NC + 1) + i_c) * DK
    sc_out = (i_bh.to(tl.int64) * NC + i_c) * DK
    S = tl.load(SC + sc_in * DV + ok[:, None] * DV + ov[None, :], mask=m2, other=0.0)
    dS = tl.load(DSC + sc_out * DV + ok[:, None] * DV + ov[None, :], mask=m2, other=0.0)
    q = _load_rows(Q, rows, ok, mt, mk, sqt, neg)
    k = _load_rows(K, rows, ok, mt, mk, skt, neg)
    v = _load_rows(V, rows, ov, mt, mv, svt, 0.0)
    b, b_end, r_end = _chunk_gates(G, rows, mt, sgt)
    tok = i_bh.to(tl.int64) * T + rows
    do = tl.load(DO + tok[:, None] * DV + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
    if NORM:
        r = 1.0 / (tl.load(DEN + tok, mask=mt, other=0.0) + eps)
        dn_c = (do * r[:, None]).to(dt)
        dd = tl.load(DDEN + tok, mask=mt, other=0.0)
    else:
        dn_c = do.to(dt)
        dd = tl.zeros([BT], dtype=tl.float32)
    q_ph = _phi(q, LOG)
    k_ph = _phi(k, LOG)
    p = _intra_decay(b, ot)
    # values: dv = A^T dn + K~ dS
    a = (tl.dot(q_ph, tl.trans(k_ph), input_precision=PREC) * p).to(dt)
    dv = tl.dot(k_ph, dS, input_precision=PREC) * tl.exp(r_end)[:, None]
    dv = tl.dot(tl.trans(a), dn_c, dv, input_precision=PREC)
    if DV_ADD:
        dv += tl.load(DV_ + tok[:, None] * DV + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
    tl.store(DV_ + tok[:, None] * DV + ov[None, :], dv.to(DV_.dtype.element_ty), mask=mt[:, None] & mv[None, :])
    m = ((tl.dot(dn_c, tl.trans(v), input_precision=PREC) + dd[:, None]) * p).to(dt)
    # queries: dphi(q) = M phi(k) + e^b (dn S^T + dd z^T)
    inter = tl.dot(dn_c, tl.trans(S), input_precision=PREC)
    if NORM:
        inter += dd[:, None] * tl.load(ZC + sc_in + ok, mask=mk, other=0.0)[None, :]
    dphi = tl.dot(m, k_ph, input_precision=PREC) + tl.exp(b)[:, None] * inter
    if LOG:  # dq = e^q dphi, with e^q in fp32 (its bf16-rounded phi(q) would add that rounding to dq)
        dq = tl.exp(q.to(tl.float32)) * dphi
        db = tl.sum(dq, 1)
    else:
        dq = dphi
        db = tl.sum(q.to(tl.float32) * dq, 1)
    tl.store(DQ + tok[:, None] * DK + ok[None, :], dq.to(DQ.dtype.element_ty), mask=mt[:, None] & mk[None, :])
    # keys: dphi(k) = M^T phi(q) + e^{b_end - b} (v dS^T + dz^T)
    inter = tl.dot(v, tl.trans(dS), input_precision=PREC)
    if NORM:
        inter += tl.load(DZC + sc_out + ok, mask=mk, other=0.0)[None, :]
    dphi = tl.dot(tl.trans(m), q_ph, input_precision=PREC) + tl.exp(r_end)[:, None] * inter
    if LOG:
        dk = tl.exp(k.to(tl.float32)) * dphi
        db -= tl.sum(dk, 1)
    else:
        dk = dphi
        db -= tl.sum(k.to(tl.float32) * dk, 1)
    tl.store(DK_ + tok[:, None] * DK + ok[None, :], dk.to(DK_.dtype.element_ty), mask=mt[:, None] & mk[None, :])
    oy = tl.arange(0, NVD)
    dlg = tl.cumsum(db, 0, reverse=True) + tl.sum(tl.load(YC + (i_bh.to(tl.int64) * NC + i_c) * NVD + oy), 0)
    tl.store(DG + tok, dlg, mask=mt)


# ----------------------------------------------------------------------------- launch settings


@dataclass(frozen=True)
class GLALaunch:
    """How the passes launch: block sizes, warps and stages tuned once on an H200 (the fastest
    candidates of ``linearize.bench.kernels tune``; ``benchmarks/kernel-settings.md`` names the
    evidence). Not a user setting: ``chunk`` and ``gluon`` are copied from ``KernelSettings`` by the
    entry points (``launch_for``); the other fields keep their defaults except where the tune sweep
    or a test passes a variant explicitly (``gla_chunk_triton(launch=...)``).

    ``fwd_bv``: the forward's V-block (32 with log-features hit an illegal address on an H200 with
    Triton 3.6: avoid it). ``par_warps``: the backward's chunk pass for plain features.
    ``dstate_bv`` / ``dstate_bv_norm``: the V-block of the backward's reverse pass, unnormalised /
    normalised. ``fill``: (batch * head) programs per multiprocessor that a split of the sequence
    into segments aims at (see ``_segments``).
    ``tma``: the forward's passes load and store through tensor descriptors where the tensors allow
    it (``_tma``); False only to test the path that unaligned tensors take.
    ``gluon_fused_bwd``: the whole backward as ONE Gluon kernel where Gluon runs; False runs the
    reverse state pass, then the Gluon chunk pass (the two-pass backward, timed by the bench's
    "two-pass" rows and tested).
    Test hooks (None: the rule): ``seg_chunks`` forces the segment length in chunks;
    ``gluon_fwd_segments`` runs the fused Gluon forward in about that many segments wherever it applies."""

    chunk: int = 64
    fwd_bv: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 2
    den_warps: int = 2
    dstate_warps: int = 4
    dstate_bv: int = 128
    dstate_bv_norm: int = 128
    par_warps: int = 4
    par_stages: int = 1
    fill: int = 2
    tma: bool = True
    gluon: bool = True
    gluon_fused_bwd: bool = True
    seg_chunks: Optional[int] = None
    gluon_fwd_segments: Optional[int] = None


LAUNCH = GLALaunch()  # the tuned defaults
# settled, never swept since: the reverse pass's stages (3 lost in sweep3); the chunk pass's warps for
# log-features (more tiles than plain ones: 4 warps spilled); the fused backward runs the sequence whole
# where the (batch x head) programs fill this share of the multiprocessors (else ``_segments`` cuts it)
_DSTATE_STAGES = 2
_PAR_WARPS_LOG = 8
_FUSED_WHOLE = 0.5
MAX_DIM = 128


def launch_for(settings: Optional[KernelSettings] = None, launch: Optional[GLALaunch] = None) -> GLALaunch:
    """``launch`` (default ``LAUNCH``) with the user's ``chunk`` and ``gluon`` from ``settings``
    (default: ``current_settings()``)."""
    s = resolve_settings(settings)
    return replace(launch or LAUNCH, chunk=s.chunk, gluon=s.gluon)


def _tma(cfg: GLALaunch, *xs: torch.Tensor) -> bool:
    """Whether a pass may load and store through tensor descriptors (TMA): asked for, a GPU with the
    copy engine (sm_90+) or the interpreter, and (B, H, T, D) tensors whose per-head bases and
    row strides are 16-byte multiples with unit last stride, as TMA requires. Installs Triton's
    allocator for the descriptors' global scratch when it says yes."""
    if not cfg.tma:
        return False
    x0 = xs[0]
    if x0.is_cuda and sm_major(x0) < 9:
        return False
    for x in xs:
        es = x.element_size()
        if x.stride(-1) != 1 or x.data_ptr() % 16 or any(st * es % 16 for st in x.stride()[:3]):
            return False
    # Triton keeps its allocator in a context variable: set it on every launch, since the
    # backward runs in autograd's own thread, which does not see the forward's setting
    triton.set_allocator(_tma_scratch)
    return True


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the descriptors that kernels build on the device (128 bytes each)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def _gluon_bwd(cfg: GLALaunch, q, k, v, chunk: int, log_space: bool):
    """The ``gla_gluon`` module where the backward's chunk pass runs there (``cfg.gluon``), else None."""
    mod = gluon_kernels("gla.gluon") if cfg.gluon and q.is_cuda else None
    return mod if mod is not None and mod.supports_bwd_chunks(q, k, v, chunk, log_space) else None


def _gluon_fused_bwd(cfg: GLALaunch, q, k, v, chunk: int, log_space: bool):
    """The ``gla_gluon`` module where the whole backward runs there (``cfg.gluon_fused_bwd``, under
    ``cfg.gluon``: that one turns every Gluon kernel off), else None."""
    return _gluon_bwd(cfg, q, k, v, chunk, log_space) if cfg.gluon_fused_bwd else None


def _chunk(cfg: GLALaunch, dtype: torch.dtype) -> int:
    return min(cfg.chunk, 32) if dtype == torch.float32 else cfg.chunk


def _segments(T: int, BT: int, programs: int, sms: int, cfg: GLALaunch, v_blocks: int = 1) -> tuple[int, int]:
    """(number of segments, segment length in tokens, a whole number of chunks) for T tokens, with
    ``programs`` = batch * heads and ``v_blocks`` the forward main pass's programs per (batch, head).
    No split where those programs already give every multiprocessor one: the pre-pass and the scan
    of a split then cost more than its extra programs buy."""
    n_chunks = max(1, math.ceil(T / BT))
    if cfg.seg_chunks is not None:
        seg_chunks = cfg.seg_chunks
    elif programs * v_blocks >= sms:
        seg_chunks = n_chunks
    else:
        want = round(cfg.fill * sms / max(1, programs))
        nseg = max(1, min(want, n_chunks // 8))  # keep segments at least 8 chunks long
        seg_chunks = math.ceil(n_chunks / nseg)
    return math.ceil(n_chunks / seg_chunks), seg_chunks * BT


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor) -> bool:
    """Whether these (already validated) inputs fit the kernels: scalar gates, one dtype among
    bf16/fp16/fp32 for q, k, v, feature and value widths <= 128."""
    return (log_g.dim() == 3 and q.dtype == k.dtype == v.dtype
            and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and log_g.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and q.shape[-1] <= MAX_DIM and v.shape[-1] <= MAX_DIM and q.shape[2] > 0)


# ----------------------------------------------------------------------------- forward / backward


@dataclass
class FwdPlan:
    """What a forward's main pass needs from the passes before it (``fwd_prologue``): the chunk
    and block sizes, the segments, the state entering each segment (or None), the normaliser's
    inter-chunk part, and the buffers the main pass fills."""
    BT: int
    BK: int
    BV: int
    NV: int
    nseg: int
    seg_len: int
    NC: int
    prec: str
    has_init: bool
    s_in: Optional[torch.Tensor]  # (B*H, nseg, Dk, Dv) fp32, or the initial state
    den: Optional[torch.Tensor]  # (B*H, T) fp32: the whole den, for the backward
    den_in: Optional[torch.Tensor]  # (B*H, T) fp32: the normaliser pass's inter-chunk part
    S_T: torch.Tensor
    z_T: torch.Tensor
    sc: Optional[torch.Tensor]  # (B*H, NC + 1, Dk, Dv), input dtype: the state entering every chunk
    zc: Optional[torch.Tensor]  # (B*H, NC + 1, Dk) fp32
    tma_qk: bool


def fwd_blocks(q: torch.Tensor, v: torch.Tensor, cfg: GLALaunch, bv: int) -> tuple[int, int, int, int, int]:
    """The forward's (chunk BT, V-block BV, V-blocks NV, segments, segment length) for a main pass
    of V-blocks of ``bv``."""
    B, H, T, _ = q.shape
    DV = v.shape[-1]
    BT = _chunk(cfg, q.dtype)
    BV = min(pow2(bv), pow2(DV))
    NV = math.ceil(DV / BV)
    nseg, seg_len = _segments(T, BT, B * H, device_sms(q), cfg, v_blocks=NV)
    return BT, BV, NV, nseg, seg_len


def fwd_prologue(q, k, v, log_g, S0, z0, normalize: bool, log_space: bool, cfg: GLALaunch,
                 store_chunks: bool, bv: int, split_normaliser: bool = False,
                 z_stream: Optional["torch.cuda.Stream"] = None) -> FwdPlan:
    """Everything of the forward before its main pass, for a main pass of V-blocks of ``bv``:
    with segments, each segment's own state and the scan; when normalised, the normaliser pass.

    ``split_normaliser`` (with segments, normalised): the normaliser's chain (its own segment
    pre-pass and scan, then the normaliser pass) shares nothing with the state's (pre-pass, scan);
    on ``z_stream`` it runs beside it, and the current stream waits for it before this returns
    (every buffer is made before the fork, on the current stream); without a stream, first."""
    B, H, T, DK = q.shape
    DV = v.shape[-1]
    BT, BV, NV, nseg, seg_len = fwd_blocks(q, v, cfg, bv)
    BK = pow2(DK)
    NC = math.ceil(T / BT)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    den = torch.empty(B * H, T, **f32) if normalize else None
    S_T = torch.empty(B, H, DK, DV, **f32)
    z_T = torch.empty(B, H, DK, **f32) if normalize else (
        z0.float().clone() if z0 is not None else torch.zeros(B, H, DK, **f32))
    sc = torch.empty(B * H, NC + 1, DK, DV, dtype=q.dtype, device=dev) if store_chunks else None
    zc = torch.empty(B * H, NC + 1, DK, **f32) if store_chunks and normalize else None
    sq, sk, sv, sg = strides_bht(q), strides_bht(k), strides_bht(v), strides_bht(log_g)
    common_kw = dict(DK=DK, BK=BK, BT=BT, LOG=log_space)  # the normaliser pass forms no dot: no PREC
    has_init = S0 is not None or nseg > 1
    split = split_normaliser and nseg > 1 and normalize
    s_in = z_in = g_seg = g_seg_z = None
    S0c = z0c = None
    if nseg > 1:
        s_in = torch.empty(B * H, nseg, DK, DV, **f32)
        z_in = torch.zeros(B * H, nseg, DK, **f32)
        g_seg = torch.empty(B * H, nseg, **f32)
        g_seg_z = torch.empty(B * H, nseg, **f32) if split else g_seg
        if S0 is not None:
            S0c, z0c = S0.float().contiguous(), z0.float().contiguous()
    elif S0 is not None:
        s_in, z_in = S0.float().contiguous(), z0.float().contiguous()
    # the main pass reads the normaliser pass's part and stores the whole den: in place where one
    # program per chunk does both, else into a buffer of its own (the other V-blocks still read)
    den_in = den if NV == 1 or not normalize else torch.empty_like(den)
    tma_qk = _tma(cfg, q, k)  # the normaliser pass reads q and k; the main pass also v and o
    BVS = min(32, pow2(DV))

    def scan(s_part: bool, z_part: bool, g) -> None:  # the state entering every segment, from each one's own
        _gla_scan_kernel[(math.ceil(DV / BVS) if s_part else 1, B * H)](
            s_in, z_in, g, S0c if S0 is not None else s_in, z0c if S0 is not None else z_in, nseg,
            DK=DK, DV=DV, BK=BK, BV=BVS, HAS_INIT=S0 is not None, REVERSE=False, DO_S=s_part, DO_Z=z_part,
            num_warps=4)

    def pre_pass(z_only: bool, g) -> None:  # each segment's own state (or z) from zero, and its log-decay
        _gla_fwd_state_kernel[(1 if z_only else NV, nseg - 1, B * H)](
            k, v, log_g, s_in, z_in, g, *sk, *sv, *sg, T, H, seg_len, nseg, DV=DV, BV=BV, PREC=prec,
            Z_ONLY=z_only, num_warps=cfg.den_warps if z_only else cfg.fwd_warps, num_stages=cfg.fwd_stages,
            **common_kw)

    def normaliser() -> None:
        _gla_den_kernel[(nseg, B * H)](
            q, k, log_g, den_in, z_in if has_init else den, z_T, zc if zc is not None else den, *sq, *sk, *sg,
            T, H, seg_len, nseg, NC, HAS_INIT=has_init, STORE_CHUNKS=store_chunks, TMA=tma_qk,
            num_warps=cfg.den_warps, num_stages=2, **common_kw)

    if split:
        with fork_stream(z_stream):
            pre_pass(True, g_seg_z)
            scan(False, True, g_seg_z)
            normaliser()
        pre_pass(False, g_seg)
        scan(True, False, g_seg)
        join_stream(z_stream)
    else:
        if nseg > 1:
            pre_pass(False, g_seg)
            if normalize:
                pre_pass(True, g_seg)
            scan(True, True, g_seg)
        if normalize:
            normaliser()
    return FwdPlan(BT, BK, BV, NV, nseg, seg_len, NC, prec, has_init, s_in, den, den_in, S_T, z_T, sc, zc, tma_qk)


def fwd_main(q, k, v, log_g, p: FwdPlan, normalize: bool, log_space: bool, eps: float, cfg: GLALaunch,
             store_chunks: bool, ow: Optional[torch.Tensor] = None, alpha: Optional[torch.Tensor] = None,
             store_o: bool = True) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The forward's main pass after ``fwd_prologue``; returns (o or None, y or None). With ``ow``
    (the window branch's output, (B, H, T, Dv) contiguous) and ``alpha`` (H,) it also writes
    Lizard's y = o + alpha_h * ow, and o only with ``store_o`` (a backward reads it)."""
    B, H, T, DK = q.shape
    DV = v.shape[-1]
    combine = ow is not None
    o = torch.empty(B, H, T, DV, dtype=v.dtype, device=q.device) if store_o or not combine else None
    y = torch.empty(B, H, T, DV, dtype=v.dtype, device=q.device) if combine else None
    any_out = o if o is not None else y
    tma = p.tma_qk and _tma(cfg, v, any_out, *((ow, y) if combine else ()))
    _gla_fwd_kernel[(p.NV, p.nseg, B * H)](
        q, k, v, log_g, any_out if o is None else o, p.den_in if normalize else any_out,
        p.den if normalize else any_out, p.s_in if p.has_init else any_out, p.S_T,
        p.sc if store_chunks else any_out, ow if combine else any_out, alpha if combine else any_out,
        y if combine else any_out,
        *strides_bht(q), *strides_bht(k), *strides_bht(v), *strides_bht(log_g), T, H, p.seg_len, p.nseg, p.NC, eps,
        DK=DK, DV=DV, BK=p.BK, BV=p.BV, BT=p.BT, LOG=log_space, NORM=normalize, HAS_INIT=p.has_init,
        STORE_CHUNKS=store_chunks, COMBINE=combine, STORE_O=o is not None, TMA=tma, PREC=p.prec,
        num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)
    return o, y


def _fwd_fused(q, k, v, log_g, S0, z0, normalize: bool, log_space: bool, eps: float, cfg: GLALaunch):
    """(o, S_T, z_T) from GLA's fused Gluon forward (where ``cfg.gluon``; inference only),
    or None where it does not apply (off Hopper, log-space features, outside its scope)."""
    if not cfg.gluon or log_space or not q.is_cuda:
        return None
    gla_gluon = gluon_kernels("gla.gluon")
    if gla_gluon is None or not gla_gluon.supports_fwd_fused(q, k, v, log_g):
        return None
    B, H, T, DK = q.shape
    if cfg.gluon_fwd_segments is None and fused_segment_count(B, H, T, device_sms(q)) > 1:
        return None  # too few (batch x head) pairs to fill the GPU: the Triton passes' segments were faster
    s_in = z_in = None
    nseg = 1
    if S0 is not None:
        s_in = S0.float().reshape(B * H, 1, DK, v.shape[-1]).contiguous()
        z_in = z0.float().reshape(B * H, 1, DK).contiguous()
    elif cfg.gluon_fwd_segments:
        nseg, seg_len = gla_gluon.segment_plan(T, cfg.gluon_fwd_segments)
        if nseg > 1:
            s_in, z_in = gla_gluon.segment_states(k, v, log_g, seg_len, nseg)
    o, S_T, z_T = gla_gluon.fwd_fused(q, k, v, log_g, normalize=normalize, eps=eps, nseg=nseg, S_in=s_in, z_in=z_in)
    if not normalize:  # (the kernel's z is the normaliser's; unnormalised, the state's z passes through)
        z_T = z0.float().clone() if z0 is not None else torch.zeros_like(z_T)
    return o, S_T, z_T


def _fwd(q, k, v, log_g, S0, z0, normalize: bool, log_space: bool, eps: float, cfg: GLALaunch,
         store_chunks: bool):
    """Runs the forward; returns (o, den, S_T, z_T, (nseg, seg_len), sc, zc)."""
    p = fwd_prologue(q, k, v, log_g, S0, z0, normalize, log_space, cfg, store_chunks, cfg.fwd_bv)
    o, _ = fwd_main(q, k, v, log_g, p, normalize, log_space, eps, cfg, store_chunks)
    return o, p.den, p.S_T, p.z_T, (p.nseg, p.seg_len), p.sc, p.zc


@dataclass
class BwdPlan:
    """What the backward's chunk pass needs from the passes before it (``bwd_states``)."""
    do: torch.Tensor
    den: torch.Tensor
    dden: torch.Tensor
    sc: torch.Tensor
    zc: torch.Tensor
    dsc: torch.Tensor  # (B*H, NC, Dk, Dv): the state gradient leaving every chunk
    dzc: torch.Tensor
    yc: torch.Tensor
    dlog_g: torch.Tensor
    dS0: Optional[torch.Tensor]
    dz0: Optional[torch.Tensor]
    dz_T: Optional[torch.Tensor]
    NC: int
    NVD: int
    # the fused kernel's (``gla_gluon.bwd_fused``): its module (asked once, in ``bwd_states``), o, the
    # state gradient leaving each of its segments (None with one segment and no dS_T) and their
    # length in chunks
    fused: bool = False
    gluon: Optional[ModuleType] = None
    o: Optional[torch.Tensor] = None
    ds_in: Optional[torch.Tensor] = None
    dz_in: Optional[torch.Tensor] = None
    seg_chunks: int = 0
    paired: bool = False  # sc holds the states entering even chunks only (``gla_gluon.state_slots``)


def _segment_dstates(q, log_g, do, o_, den_, ds_in, dz_in, nseg: int, seg_len: int, eps: float, common_kw: dict,
                     cfg: GLALaunch):
    """The state gradient leaving each of nseg segments of seg_len tokens, (B*H, nseg, Dk, Dv) and
    (B*H, nseg, Dk) fp32: each segment's own (a pre-pass over segments 1..) and a reverse scan from
    ds_in, dz_in (dS_T, dz_T fp32, or None)."""
    B, H, T, DK = q.shape
    DV = do.shape[-1]
    f32 = dict(dtype=torch.float32, device=q.device)
    ds_buf = torch.empty(B * H, nseg, DK, DV, **f32)
    dz_buf = torch.empty(B * H, nseg, DK, **f32)
    g_seg = torch.empty(B * H, nseg, **f32)
    _gla_bwd_state_kernel[(nseg - 1, B * H)](
        q, log_g, do, o_, den_, ds_buf, dz_buf, g_seg, *strides_bht(q), *strides_bht(log_g), T, H, seg_len, nseg,
        eps, num_warps=cfg.dstate_warps, num_stages=_DSTATE_STAGES, **common_kw)
    BVS = min(32, common_kw["BV"])
    _gla_scan_kernel[(math.ceil(DV / BVS), B * H)](
        ds_buf, dz_buf, g_seg, ds_in if ds_in is not None else ds_buf, dz_in if ds_in is not None else dz_buf,
        nseg, DK=DK, DV=DV, BK=common_kw["BK"], BV=BVS, HAS_INIT=ds_in is not None, REVERSE=True, num_warps=4)
    return ds_buf, dz_buf


def fused_bwd_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_space: bool, cfg: GLALaunch) -> int:
    """The segments the fused Gluon backward walks for these inputs (each beyond the first costs a
    pre-pass reading o), or 0 where that backward does not run."""
    BT = _chunk(cfg, q.dtype)
    if _gluon_fused_bwd(cfg, q, k, v, BT, log_space) is None:
        return 0
    B, H, T = q.shape[:3]
    return _fused_segments(T, BT, B * H, device_sms(q), cfg)[0]


def _fused_segments(T: int, BT: int, programs: int, sms: int, cfg: GLALaunch) -> tuple[int, int]:
    """(segments, segment length in tokens) of the fused backward: whole where the programs fill
    ``_FUSED_WHOLE`` of the multiprocessors (unless ``cfg.seg_chunks`` forces a length), else
    ``_segments``."""
    if cfg.seg_chunks is None and programs >= _FUSED_WHOLE * sms:
        return 1, max(1, math.ceil(T / BT)) * BT
    return _segments(T, BT, programs, sms, cfg)


def bwd_states(q, k, v, log_g, o, den, sc, zc, do, dS_T, dz_T, need_dstate: bool, normalize: bool, log_space: bool,
               eps: float, segs: tuple[int, int], cfg: GLALaunch, paired: bool = False) -> BwdPlan:
    """The backward up to its chunk pass: with segments, each segment's own state gradient and
    the reverse scan; then the reverse state pass (dS and dz leaving every chunk, dd). Where the
    fused Gluon backward runs (``cfg.gluon_fused_bwd``), only the segments' part, over segments of
    its own: the plan is marked ``fused`` for ``bwd_chunks``. ``paired``: sc holds the states
    entering even chunks only (Lizard's fused training forward, ``paired_states``), which only the
    fused backward in one segment reads."""
    B, H, T, DK = q.shape
    DV = v.shape[-1]
    BT, BK, BV = _chunk(cfg, q.dtype), pow2(DK), pow2(DV)
    nseg, seg_len = segs
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    do = do.to(v.dtype).contiguous()
    dlog_g = torch.empty(B * H, T, **f32)
    dden = torch.empty(B * H, T, **f32) if normalize else dlog_g
    if normalize and dz_T is None and dS_T is not None:
        dz_T = torch.zeros(B, H, DK, **f32)
    if dS_T is None and normalize and dz_T is not None:
        dS_T = torch.zeros(B, H, DK, DV, **f32)
    common_kw = dict(DK=DK, DV=DV, BK=BK, BV=BV, BT=BT, LOG=log_space, NORM=normalize, PREC=prec)
    sq, sk, sv, sg = strides_bht(q), strides_bht(k), strides_bht(v), strides_bht(log_g)
    o_ = o if normalize else do
    den_ = den if normalize else dlog_g
    # the state gradient leaving every segment: dS_T for the last, a reverse scan for the others
    ds_in = dz_in = None
    if dS_T is not None:
        ds_in = dS_T.float().contiguous()
        dz_in = dz_T.float().contiguous() if normalize else torch.zeros(B, H, DK, **f32)
    dS0 = torch.empty(B, H, DK, DV, **f32) if need_dstate else None
    dz0 = torch.empty(B, H, DK, **f32) if need_dstate else None
    fused = _gluon_fused_bwd(cfg, q, k, v, BT, log_space)
    if fused is not None:
        # the fused kernel walks segments of its own (one program per multiprocessor each)
        nseg, seg_len = _fused_segments(T, BT, B * H, device_sms(q), cfg)
        if paired and nseg > 1:
            raise RuntimeError(f"gla.bwd_states: paired states take the fused backward in one segment, not {nseg} "
                               f"(fused_bwd_segments)")
        if nseg > 1:
            ds_in, dz_in = _segment_dstates(q, log_g, do, o_, den_, ds_in, dz_in, nseg, seg_len, eps, common_kw, cfg)
        return BwdPlan(do, den_, dlog_g, sc, zc if zc is not None else dlog_g, None, None, None, dlog_g, dS0, dz0,
                       dz_T, T // BT, 0, fused=True, gluon=fused, o=o_, ds_in=ds_in, dz_in=dz_in, seg_chunks=seg_len // BT,
                       paired=paired)
    if paired:
        raise RuntimeError("gla.bwd_states: paired states take the fused Gluon backward (fused_bwd_segments)")
    NC = sc.shape[1] - 1  # (every chunk's state: the passes below read them all)
    if nseg > 1:
        ds_in, dz_in = _segment_dstates(q, log_g, do, o_, den_, ds_in, dz_in, nseg, seg_len, eps, common_kw, cfg)
    dsc = torch.empty(B * H, NC, DK, DV, dtype=q.dtype, device=dev)
    dzc = torch.empty(B * H, NC, DK, **f32) if normalize else dlog_g
    BVD = min(pow2(cfg.dstate_bv_norm if normalize else cfg.dstate_bv), BV)
    NVD = BV // BVD  # a power of two (YC's last axis is read with one arange)
    yc = torch.empty(B * H, NC, NVD, **f32)
    zc_ = zc if zc is not None else dlog_g
    _gla_bwd_dstate_kernel[(NVD, nseg, B * H)](
        q, log_g, do, o_, den_, sc, zc_, ds_in if ds_in is not None else dlog_g,
        dz_in if dz_in is not None else dlog_g, dsc, dzc, dden, yc,
        dS0 if need_dstate else dlog_g, dz0 if need_dstate else dlog_g,
        *sq, *sg, T, H, seg_len, nseg, NC, eps, HAS_DS=ds_in is not None, STORE_DS0=need_dstate,
        BVF=BV, NVD=NVD, num_warps=cfg.dstate_warps, num_stages=_DSTATE_STAGES, **{**common_kw, "BV": BVD})
    return BwdPlan(do, den_, dden, sc, zc_, dsc, dzc, yc, dlog_g, dS0, dz0, dz_T, NC, NVD)


def bwd_chunks(q, k, v, log_g, p: BwdPlan, normalize: bool, log_space: bool, eps: float, cfg: GLALaunch,
               dv_into: Optional[torch.Tensor] = None, side: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               bl: Optional[torch.Tensor] = None):
    """The backward's chunk pass after ``bwd_states`` (or, for a ``fused`` plan, the whole fused
    Gluon backward); returns (dq, dk, dv, dlog_g, dS0, dz0).
    With ``dv_into`` (contiguous, v's shape and dtype) dv is added to it in place and returned,
    which spares a sum of two dv tensors where v also feeds another branch (Lizard's window).
    With ``side`` = (side_dot, alpha), for a fused plan of one segment only (``fused_bwd_segments``):
    the o given to ``bwd_states`` was y = o + alpha_h x, side_dot ((B*H, T) fp32) the rows' do . x
    (``gla_gluon.bwd_fused``). ``bl``: for a fused plan, the gates' cumulative sums within chunks
    where a forward kept them (``gla_gluon.chunk_gates``), else formed again."""
    B, H, T, DK = q.shape
    DV = v.shape[-1]
    BT, BK, BV = _chunk(cfg, q.dtype), pow2(DK), pow2(DV)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    dev = q.device
    dq, dk = (torch.empty(x.shape, dtype=x.dtype, device=dev) for x in (q, k))
    dv = dv_into if dv_into is not None else torch.empty(v.shape, dtype=v.dtype, device=dev)
    common_kw = dict(DK=DK, DV=DV, BK=BK, BV=BV, BT=BT, LOG=log_space, NORM=normalize, PREC=prec)
    NC, NVD, dlog_g, dS0, dz0 = p.NC, p.NVD, p.dlog_g, p.dS0, p.dz0
    # (the chunk pass's scope is asked only where it may run: each ask costs the host a few view checks)
    gluon = None if p.fused or side is not None else _gluon_bwd(cfg, q, k, v, BT, log_space)
    if p.fused:
        if dv_into is not None and not dv_into.is_contiguous():
            raise ValueError("gla.bwd_chunks: the fused backward adds dv into a contiguous tensor only")
        if side is not None and p.seg_chunks * BT < T:  # the segments' pre-pass read y as o
            raise RuntimeError("gla.bwd_chunks: side takes a fused plan of one segment (fused_bwd_segments)")
        p.gluon.bwd_fused(
            q, k, v, log_g, p.o.contiguous(), p.den, p.sc, p.zc, p.do, p.ds_in, p.dz_in, dq, dk, dv, dlog_g, dS0, dz0,
            seg_chunks=p.seg_chunks, normalize=normalize, eps=eps, dv_add=dv_into is not None,
            side_dot=side[0] if side is not None else None, alpha=side[1] if side is not None else None,
            paired=p.paired, bl=bl)
    elif side is not None:
        raise RuntimeError("gla.bwd_chunks: side takes a fused plan (fused_bwd_segments)")
    elif gluon is not None and (dv_into is None or dv_into.is_contiguous()):
        gluon.bwd_chunks(q, k, v, log_g, p.do, p.den, p.dden, p.sc, p.zc, p.dsc, p.dzc, p.yc, dq, dk, dv, dlog_g,
                         normalize=normalize, eps=eps, dv_add=dv_into is not None)
    else:
        _gla_bwd_chunk_kernel[(NC, B * H)](
            q, k, v, log_g, p.do, p.den, p.dden, p.sc, p.zc, p.dsc, p.dzc, p.yc, dq, dk, dv, dlog_g,
            *strides_bht(q), *strides_bht(k), *strides_bht(v), *strides_bht(log_g), T, H, NC, eps, NVD=NVD,
            DV_ADD=dv_into is not None,
            num_warps=_PAR_WARPS_LOG if log_space else cfg.par_warps, num_stages=cfg.par_stages, **common_kw)
    if dS0 is not None and not normalize:
        dz0 = p.dz_T.float() if p.dz_T is not None else torch.zeros(B, H, DK, dtype=torch.float32, device=dev)
    return dq, dk, dv, dlog_g.view(B, H, T).to(log_g.dtype), dS0, dz0


def _bwd(q, k, v, log_g, o, den, sc, zc, do, dS_T, dz_T, need_dstate: bool, normalize: bool, log_space: bool,
         eps: float, segs: tuple[int, int], cfg: GLALaunch):
    """Runs the backward; returns (dq, dk, dv, dlog_g, dS0, dz0)."""
    p = bwd_states(q, k, v, log_g, o, den, sc, zc, do, dS_T, dz_T, need_dstate, normalize, log_space, eps, segs, cfg)
    return bwd_chunks(q, k, v, log_g, p, normalize, log_space, eps, cfg)


class _GLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_g, S0, z0, normalize, log_space, eps, cfg, grad_mode):
        # needs_input_grad follows requires_grad alone; under torch.no_grad no backward will run,
        # and storing the per-chunk states for it cost 0.06 of 0.59 ms at B16 T2048 on an H200
        training = grad_mode and any(ctx.needs_input_grad[:6])
        fused = None if training else _fwd_fused(q, k, v, log_g, S0, z0, normalize, log_space, eps, cfg)
        if fused is not None:
            o, S_T, z_T = fused
            ctx.set_materialize_grads(False)
            return o, S_T, z_T
        o, den, S_T, z_T, segs, sc, zc = _fwd(q, k, v, log_g, S0, z0, normalize, log_space, eps, cfg, training)
        ctx.save_for_backward(q, k, v, log_g, o if normalize else None, den, sc, zc)
        ctx.args = (normalize, log_space, eps, segs, cfg, S0 is not None)
        ctx.set_materialize_grads(False)
        return o, S_T, z_T

    @staticmethod
    def backward(ctx, do, dS_T, dz_T):
        q, k, v, log_g, o, den, sc, zc = ctx.saved_tensors
        normalize, log_space, eps, segs, cfg, has_state = ctx.args
        if do is None:
            do = torch.zeros_like(v)
        need_dstate = has_state and (ctx.needs_input_grad[4] or ctx.needs_input_grad[5])
        dq, dk, dv, dlog_g, dS0, dz0 = _bwd(q, k, v, log_g, o, den, sc, zc, do, dS_T, dz_T, need_dstate,
                                            normalize, log_space, eps, segs, cfg)
        return dq, dk, dv, dlog_g, dS0, dz0, None, None, None, None, None


def gla_chunk_checks(q, k, v, log_g, eps, state: Optional[GLAState]) -> tuple:
    """``gla_chunk_triton``'s input checks (clear errors naming the value); returns the initial
    state's (S0, z0), or (None, None)."""
    B, H, T, DK, DV = common.check_qkv(q, k, v)
    common.check_per_token("log_g", log_g, B, H, T, DK)
    if not supports(q, k, v, log_g):
        raise ValueError(
            f"the GLA kernels need scalar log_g (B, H, T), q/k/v of one dtype among bf16/fp16/fp32 and "
            f"Dk, Dv <= {MAX_DIM}, T > 0; got log_g {tuple(log_g.shape)} {log_g.dtype}, q {q.dtype}, "
            f"k {k.dtype}, v {v.dtype}, Dk={DK}, Dv={DV}, T={T}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    S0 = z0 = None
    if state is not None:
        common.check_state_tensor("S", state.S, (B, H, DK, DV))
        common.check_state_tensor("z", state.z, (B, H, DK))
        S0, z0 = state.S, state.z
    return S0, z0


def gla_chunk_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, *, normalize: bool = True,
    log_space_features: bool = False, state: Optional[GLAState] = None, eps: float = 1e-6,
    settings: Optional[KernelSettings] = None, launch: Optional[GLALaunch] = None,
) -> tuple[torch.Tensor, GLAState]:
    """``ops.gla.gla_chunk`` on the Triton kernels (forward and backward, initial state included).

    ``settings``: the user's kernel settings (default ``current_settings()``); ``launch``: a launch
    variant (the tune sweep, tests; default ``LAUNCH``). The backward runs with those of its forward.

    Inputs must satisfy ``supports``; the final state comes back in fp32. Differentiable in q, k,
    v, log_g and the initial state. When a gradient is needed (grad mode on and an input that
    requires one) the forward keeps the state entering every chunk (Dk * Dv values of the input
    dtype per chunk and head) for the backward.
    """
    S0, z0 = gla_chunk_checks(q, k, v, log_g, eps, state)
    q, k, v = (unit_last(x) for x in (q, k, v))
    o, S, z = _GLAFunction.apply(q, k, v, log_g, S0, z0, bool(normalize), bool(log_space_features),
                                 float(eps), launch_for(settings, launch), torch.is_grad_enabled())
    return o, GLAState(S, z)
