"""Triton kernels for sliding-window softmax with v2 sink logits, and the Lizard combine.

Same meaning as ``ops.window_attn.window_attn_chunk`` for a standard (not terraced) window,
no soft-cap, no v1 key/value sinks and a state whose cache is never visible (``pos <= 0``):

    o_t = sum_{s visible} e^{q_t.k_s*scale} v_s / [sum_{s visible} e^{q_t.k_s*scale} + sum_j e^{t_j}]

with s visible iff t - w < s <= t and s >= kmin (kmin = left padding of the row, 0 without).
Shapes: q, k (B, H, T, D), v (B, H, T, Dv), sink_logits (H, m), o (B, H, T, Dv). D, Dv <= 256.

The softmax is FlashAttention's online form in base 2, started from the sinks: m = max_j t_j,
l = sum_j e^{t_j - m}, acc = 0 (sink values are zero). Each query block of BM rows visits only
the key blocks that intersect its window (w + BM - 1 keys). The row's log-sum-exp (base 2,
+inf for a row that sees nothing) is kept for the backward:

    p_ts = exp2(s_ts - lse_t),  D_t = do_t . o_t,  ds = p (do v^T - D),
    dq = ds k * scale,  dk = ds^T q * scale,  dv = p^T do,  d t_j = -sum_t e^{t_j - lse_t} D_t.

Lizard's combine ``y = y_g + alpha_h * y_w`` is fused into the forward's epilogue (read y_g,
write y, and y_w only when a backward will need it) and into the backward's prologue
(do_w = alpha_h * dy, d alpha_h = sum dy . y_w, dy_g = dy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import common
from .naive import WindowState, check_pos, check_sinks, check_window, keep_last
from ..backend.dispatch import device_sms, gluon_kernels, patch_interpreter, pow2, strides_bht, unit_last
from ..backend.settings import KernelSettings, resolve as resolve_settings

patch_interpreter()

LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------- kernels


@triton.jit
def tile_visible(rows, cols, kmin, W: tl.constexpr):
    """(BM, BN) bool: key col visible to query row (window w, left padding kmin)."""
    return (cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - W) & (cols[None, :] >= kmin)


@triton.jit
def load_kmin(KMIN, i_b, HAS_KMIN: tl.constexpr):
    """Row i_b's first visible key (its left padding), or 0 without padding."""
    if HAS_KMIN:
        return tl.load(KMIN + i_b)
    else:
        return 0


@triton.jit
def block_offsets(i_m, T, BM: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, D: tl.constexpr,
                   DV: tl.constexpr):
    """Query block i_m's rows and which are in range, and the key and value columns with theirs."""
    rows = i_m * BM + tl.arange(0, BM)
    od = tl.arange(0, BD)
    odv = tl.arange(0, BDV)
    return rows, rows < T, od, odv, od < D, odv < DV


@triton.jit
def sink_start(SINK, i_h, NSINK, BM: tl.constexpr, BS: tl.constexpr, HAS_SINK: tl.constexpr):
    """The online softmax's start (m, l) per row, base 2: the sink logits (values zero), or empty."""
    if HAS_SINK:
        osk = tl.arange(0, BS)
        sl = tl.load(SINK + i_h * NSINK + osk, mask=osk < NSINK, other=float("-inf")).to(tl.float32)
        sl = sl * 1.4426950408889634  # base 2, like the scores
        ms = tl.max(sl, 0)
        m_i = tl.zeros([BM], dtype=tl.float32) + ms
        l_i = tl.zeros([BM], dtype=tl.float32) + tl.sum(tl.exp2(sl - ms), 0)
    else:
        m_i = tl.zeros([BM], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BM], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def online_step(m_i, l_i, acc, s, v, PREC: tl.constexpr):
    """One key tile into the online softmax: scores s (BM, BN, base 2, -inf where invisible), values
    v (BN, BDV) in the inputs' dtype; returns the new (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    corr = tl.exp2(m_i - m_new)
    l_i = l_i * corr + tl.sum(p, 1)
    acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _win_fwd_kernel(
    Q, K, V, SINK, KMIN, O, LSE, YG, ALPHA, Y,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
    T, H, NSINK, qk_scale,
    W: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, NKB: tl.constexpr,
    HAS_SINK: tl.constexpr, HAS_KMIN: tl.constexpr, FUSE: tl.constexpr, STORE_O: tl.constexpr,
    PREC: tl.constexpr,
):
    """Grid (query blocks, B*H): o (or y = y_g + alpha * o, and o when STORE_O) and lse (fp32, base 2)."""
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    Q += i_b.to(tl.int64) * sqb + i_h.to(tl.int64) * sqh
    K += i_b.to(tl.int64) * skb + i_h.to(tl.int64) * skh
    V += i_b.to(tl.int64) * svb + i_h.to(tl.int64) * svh
    rows, mrow, od, odv, md, mdv = block_offsets(i_m, T, BM, BD, BDV, D, DV)
    q = tl.load(Q + rows[:, None].to(tl.int64) * sqt + od[None, :], mask=mrow[:, None] & md[None, :], other=0.0)
    kmin = load_kmin(KMIN, i_b, HAS_KMIN)
    m_i, l_i = sink_start(SINK, i_h, NSINK, BM, BS, HAS_SINK)
    acc = tl.zeros([BM, BDV], dtype=tl.float32)
    # key blocks from the one holding key (block start - w + 1) up to the diagonal block
    start = tl.maximum(i_m * BM - W + 1, 0) // BN * BN
    for j in range(0, NKB):
        cols = start + j * BN + tl.arange(0, BN)
        mcol = (cols >= 0) & (cols < T)
        k = tl.load(K + cols[:, None].to(tl.int64) * skt + od[None, :], mask=mcol[:, None] & md[None, :], other=0.0)
        v = tl.load(V + cols[:, None].to(tl.int64) * svt + odv[None, :], mask=mcol[:, None] & mdv[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        s = tl.where(tile_visible(rows, cols, kmin, W), s, float("-inf"))
        m_i, l_i, acc = online_step(m_i, l_i, acc, s, v, PREC)
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(LSE + i_bh.to(tl.int64) * T + rows, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("inf")),
             mask=mrow)
    offs = i_bh.to(tl.int64) * T * DV + rows[:, None].to(tl.int64) * DV + odv[None, :]
    m2 = mrow[:, None] & mdv[None, :]
    if FUSE:
        yg = tl.load(YG + offs, mask=m2, other=0.0).to(tl.float32)
        alpha = tl.load(ALPHA + i_h).to(tl.float32)
        tl.store(Y + offs, (yg + alpha * o).to(Y.dtype.element_ty), mask=m2)
        if STORE_O:
            tl.store(O + offs, o.to(O.dtype.element_ty), mask=m2)
    else:
        tl.store(O + offs, o.to(O.dtype.element_ty), mask=m2)


@triton.jit
def _win_bwd_dq_kernel(
    Q, K, V, SINK, KMIN, O, DY, LSE, ALPHA, DQ, DELTA, DSINK, DALPHA,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
    T, H, NSINK, NMB, qk_scale, sm_scale,
    W: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, NKB: tl.constexpr,
    HAS_SINK: tl.constexpr, HAS_KMIN: tl.constexpr, HAS_ALPHA: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (query blocks, B*H): dq; D = do . o (fp32, for the dk/dv pass); per-block partial
    sums of the sink-logit gradient (B*H, NMB, BS) and of d alpha (B*H, NMB)."""
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    dt = Q.dtype.element_ty
    Q += i_b.to(tl.int64) * sqb + i_h.to(tl.int64) * sqh
    K += i_b.to(tl.int64) * skb + i_h.to(tl.int64) * skh
    V += i_b.to(tl.int64) * svb + i_h.to(tl.int64) * svh
    rows, mrow, od, odv, md, mdv = block_offsets(i_m, T, BM, BD, BDV, D, DV)
    q = tl.load(Q + rows[:, None].to(tl.int64) * sqt + od[None, :], mask=mrow[:, None] & md[None, :], other=0.0)
    offs = i_bh.to(tl.int64) * T * DV + rows[:, None].to(tl.int64) * DV + odv[None, :]
    m2 = mrow[:, None] & mdv[None, :]
    dy = tl.load(DY + offs, mask=m2, other=0.0).to(tl.float32)
    o = tl.load(O + offs, mask=m2, other=0.0).to(tl.float32)
    dyo = tl.sum(dy * o, 1)
    if HAS_ALPHA:
        alpha = tl.load(ALPHA + i_h).to(tl.float32)
        do = dy * alpha
        delta = dyo * alpha
        tl.store(DALPHA + i_bh * NMB + i_m, tl.sum(dyo, 0))
    else:
        do = dy
        delta = dyo
    tl.store(DELTA + i_bh.to(tl.int64) * T + rows, delta, mask=mrow)
    lse = tl.load(LSE + i_bh.to(tl.int64) * T + rows, mask=mrow, other=float("inf"))
    kmin = load_kmin(KMIN, i_b, HAS_KMIN)
    do_c = do.to(dt)
    dq = tl.zeros([BM, BD], dtype=tl.float32)
    start = tl.maximum(i_m * BM - W + 1, 0) // BN * BN
    for j in range(0, NKB):
        cols = start + j * BN + tl.arange(0, BN)
        mcol = (cols >= 0) & (cols < T)
        k = tl.load(K + cols[:, None].to(tl.int64) * skt + od[None, :], mask=mcol[:, None] & md[None, :], other=0.0)
        v = tl.load(V + cols[:, None].to(tl.int64) * svt + odv[None, :], mask=mcol[:, None] & mdv[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.where(tile_visible(rows, cols, kmin, W), tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do_c, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(dt), k, input_precision=PREC)
    tl.store(DQ + i_bh.to(tl.int64) * T * D + rows[:, None].to(tl.int64) * D + od[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=mrow[:, None] & md[None, :])
    if HAS_SINK:
        store_sink_grad(SINK, DSINK, i_h, i_bh * NMB + i_m, NSINK, lse, delta, BS)


@triton.jit
def store_sink_grad(SINK, DSINK, i_h, i_blk, NSINK, lse, delta, BS: tl.constexpr):
    """A query block's part of d t_j = -sum_t e^{t_j - lse_t} D_t, into DSINK[i_blk, :BS]."""
    osk = tl.arange(0, BS)
    sl = tl.load(SINK + i_h * NSINK + osk, mask=osk < NSINK, other=float("-inf")).to(tl.float32)
    sl = sl * 1.4426950408889634  # base 2, like the scores
    ps = tl.exp2(sl[None, :] - lse[:, None])  # (BM, BS) sink probabilities
    tl.store(DSINK + i_blk.to(tl.int64) * BS + osk, -tl.sum(ps * delta[:, None], 0))


@triton.jit
def _win_head_sums_kernel(DSINK, DALPHA, D_SINKS, D_ALPHA, H, NB, NSINK, N, BS: tl.constexpr, BN: tl.constexpr,
                          HAS_SINK: tl.constexpr, HAS_ALPHA: tl.constexpr):
    """Grid (H,): a head's d sink_logits (NSINK) and d alpha from its query blocks' partial sums
    (DSINK (B*H*NB, BS), DALPHA (B*H*NB,)) over every batch row: N = B * NB of them, summed in
    BN-long tiles in a fixed order (deterministic)."""
    i_h = tl.program_id(0)
    osk = tl.arange(0, BS)
    acc_s = tl.zeros([BS], dtype=tl.float32)
    acc_a = tl.zeros([BN], dtype=tl.float32)
    for j0 in range(0, N, BN):
        j = j0 + tl.arange(0, BN)  # (batch row, block) pairs: row j // NB, block j % NB
        m = j < N
        blk = ((j // NB) * H + i_h).to(tl.int64) * NB + j % NB
        if HAS_SINK:
            acc_s += tl.sum(tl.load(DSINK + blk[:, None] * BS + osk[None, :], mask=m[:, None], other=0.0), 0)
        if HAS_ALPHA:
            acc_a += tl.load(DALPHA + blk, mask=m, other=0.0)
    if HAS_SINK:
        tl.store(D_SINKS + i_h * NSINK + osk, acc_s, mask=osk < NSINK)
    if HAS_ALPHA:
        tl.store(D_ALPHA + i_h, tl.sum(acc_a, 0))


@triton.jit
def _win_bwd_delta_kernel(O, DY, LSE, SINK, ALPHA, DELTA, DSINK, DALPHA, T, H, NSINK, NMB,
                          DV: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
                          HAS_SINK: tl.constexpr, HAS_ALPHA: tl.constexpr, FROM_O: tl.constexpr):
    """Grid (query blocks, B*H), for the Gluon backward (``window_gluon``). FROM_O: D = alpha (dy . o)
    per row into DELTA (the Gluon kernel takes D ready; o, dy (B*H*T, Dv) contiguous); else DELTA
    holds dy . o already (the walking kernel formed it). Either way, per block, the partial sums
    of d alpha (dy . o) and of the sink-logit gradient, as the dq pass stores them."""
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_h = i_bh % H
    rows = i_m * BM + tl.arange(0, BM)
    mrow = rows < T
    if FROM_O:
        odv = tl.arange(0, BDV)
        offs = i_bh.to(tl.int64) * T * DV + rows[:, None].to(tl.int64) * DV + odv[None, :]
        m2 = mrow[:, None] & (odv < DV)[None, :]
        dyo = tl.sum(tl.load(DY + offs, mask=m2, other=0.0).to(tl.float32)
                     * tl.load(O + offs, mask=m2, other=0.0).to(tl.float32), 1)
    else:
        dyo = tl.load(DELTA + i_bh.to(tl.int64) * T + rows, mask=mrow, other=0.0)
    if HAS_ALPHA:
        delta = dyo * tl.load(ALPHA + i_h).to(tl.float32)
        tl.store(DALPHA + i_bh * NMB + i_m, tl.sum(dyo, 0))
    else:
        delta = dyo
    if FROM_O:
        tl.store(DELTA + i_bh.to(tl.int64) * T + rows, delta, mask=mrow)
    if HAS_SINK:
        lse = tl.load(LSE + i_bh.to(tl.int64) * T + rows, mask=mrow, other=float("inf"))
        store_sink_grad(SINK, DSINK, i_h, i_bh * NMB + i_m, NSINK, lse, delta, BS)


@triton.jit
def _win_bwd_dkdv_kernel(
    Q, K, V, KMIN, DY, LSE, ALPHA, DELTA, DK, DV_,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
    T, H, qk_scale, sm_scale,
    W: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, NQB: tl.constexpr,
    HAS_KMIN: tl.constexpr, HAS_ALPHA: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (key blocks, B*H): dk, dv over the query blocks whose window holds these keys."""
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    dt = Q.dtype.element_ty
    Q += i_b.to(tl.int64) * sqb + i_h.to(tl.int64) * sqh
    K += i_b.to(tl.int64) * skb + i_h.to(tl.int64) * skh
    V += i_b.to(tl.int64) * svb + i_h.to(tl.int64) * svh
    cols = i_n * BN + tl.arange(0, BN)
    mcol = cols < T
    od = tl.arange(0, BD)
    odv = tl.arange(0, BDV)
    md = od < D
    mdv = odv < DV
    k = tl.load(K + cols[:, None].to(tl.int64) * skt + od[None, :], mask=mcol[:, None] & md[None, :], other=0.0)
    v = tl.load(V + cols[:, None].to(tl.int64) * svt + odv[None, :], mask=mcol[:, None] & mdv[None, :], other=0.0)
    kmin = load_kmin(KMIN, i_b, HAS_KMIN)
    if HAS_ALPHA:
        alpha = tl.load(ALPHA + i_h).to(tl.float32)
    else:
        alpha = 1.0
    dk = tl.zeros([BN, BD], dtype=tl.float32)
    dv = tl.zeros([BN, BDV], dtype=tl.float32)
    start = i_n * BN // BM * BM
    for j in range(0, NQB):
        rows = start + j * BM + tl.arange(0, BM)
        mrow = rows < T
        q = tl.load(Q + rows[:, None].to(tl.int64) * sqt + od[None, :], mask=mrow[:, None] & md[None, :], other=0.0)
        offs = i_bh.to(tl.int64) * T * DV + rows[:, None].to(tl.int64) * DV + odv[None, :]
        do = (tl.load(DY + offs, mask=mrow[:, None] & mdv[None, :], other=0.0).to(tl.float32) * alpha).to(dt)
        lse = tl.load(LSE + i_bh.to(tl.int64) * T + rows, mask=mrow, other=float("inf"))
        delta = tl.load(DELTA + i_bh.to(tl.int64) * T + rows, mask=mrow, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.where(tile_visible(rows, cols, kmin, W), tl.exp2(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p.to(dt)), do, input_precision=PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(dt)), q, input_precision=PREC)
    tl.store(DK + i_bh.to(tl.int64) * T * D + cols[:, None].to(tl.int64) * D + od[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=mcol[:, None] & md[None, :])
    tl.store(DV_ + i_bh.to(tl.int64) * T * DV + cols[:, None].to(tl.int64) * DV + odv[None, :],
             dv.to(DV_.dtype.element_ty), mask=mcol[:, None] & mdv[None, :])


# ----------------------------------------------------------------------------- launch settings


@dataclass(frozen=True)
class WindowLaunch:
    """How the passes launch: query block BM, key block BN (powers of two >= 16), warps and stages,
    tuned once on an H200 (the fastest candidates of ``linearize.bench.kernels tune``;
    ``benchmarks/kernel-settings.md`` names the evidence). Not a user setting: ``gluon`` is copied
    from ``KernelSettings`` by the entry points (``launch_for``); the other fields keep their
    defaults except where the tune sweep or a test passes a variant explicitly
    (``window_attn_triton(launch=...)``).

    ``bm`` / ``bn`` serve the forward and the backward's dq pass (a query block visiting key
    blocks); ``kv_bm`` / ``kv_bn`` / ``kv_warps`` the dk/dv pass (a key block visiting query
    blocks), None meaning the same as ``bm`` / ``bn`` / ``bwd_warps``. (On an H200 with Triton 3.6
    a kv_bm of 16 gave dk 5% off in bf16, right under the interpreter: keep query blocks at 32 or more.)
    ``gluon_bwd_walk``: where Gluon runs, the backward is the *walking* Gluon kernel (one program
    per segment of chunks, each tile read once); False runs the Gluon kernel of one program per
    chunk (the bench's "two-pass" rows; tested). ``gluon_walk_delta``: the walking kernel forms
    D = alpha (dy . o) itself instead of a pre-pass reading dy and o once more (False: tested)."""

    bm: int = 64
    bn: int = 32
    fwd_warps: int = 4
    fwd_stages: int = 3
    bwd_warps: int = 4
    bwd_stages: int = 3
    kv_bm: Optional[int] = 32
    kv_bn: Optional[int] = 64
    kv_warps: Optional[int] = 4
    gluon: bool = True
    gluon_bwd_walk: bool = True
    gluon_walk_delta: bool = True


LAUNCH = WindowLaunch()  # the tuned defaults


def launch_for(settings: Optional[KernelSettings] = None, launch: Optional[WindowLaunch] = None) -> WindowLaunch:
    """``launch`` (default ``LAUNCH``) with the user's ``gluon`` from ``settings`` (default:
    ``current_settings()``)."""
    return replace(launch or LAUNCH, gluon=resolve_settings(settings).gluon)


MAX_DIM = 256


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, terraced: bool = False,
             softcap: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
             sink_k: Optional[torch.Tensor] = None) -> bool:
    """Whether these (already validated) inputs fit the kernels: standard window, no soft-cap,
    no v1 sinks, q/k/v of one dtype among bf16/fp16/fp32, head dims <= 256, T > 0."""
    return (not terraced and softcap is None and sink_k is None
            and q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (sink_logits is None or sink_logits.dtype in (torch.bfloat16, torch.float16, torch.float32))
            and q.shape[-1] <= MAX_DIM and v.shape[-1] <= MAX_DIM and q.shape[2] > 0)


# ----------------------------------------------------------------------------- forward / backward


def _key_blocks(window: int, BM: int, BN: int) -> int:
    """Key blocks a query block of BM visits: the most over all block positions (the pattern
    repeats every BM * BN tokens)."""
    return max((m0 + BM - 1) // BN - max(m0 - window + 1, 0) // BN + 1 for m0 in range(0, BM * (BN + 1) + window, BM))


def _query_blocks(window: int, BM: int, BN: int) -> int:
    """Query blocks a key block of BN visits (the most over all block positions)."""
    return max((n0 + BN + window - 2) // BM - n0 // BM + 1 for n0 in range(0, BN * (BM + 1), BN))


def _fwd(q, k, v, sinks, kmin, yg, alpha, window: int, scale: float, store_o: bool, cfg: WindowLaunch):
    B, H, T, D = q.shape
    DV = v.shape[-1]
    BM, BN = cfg.bm, cfg.bn
    nkb = _key_blocks(window, BM, BN)
    nmb = math.ceil(T / BM)
    dev = q.device
    fuse = yg is not None
    y = torch.empty(B, H, T, DV, dtype=v.dtype, device=dev) if fuse else None
    o = torch.empty(B, H, T, DV, dtype=v.dtype, device=dev) if (store_o or not fuse) else None
    lse = torch.empty(B * H, T, dtype=torch.float32, device=dev)
    nsink = sinks.shape[1] if sinks is not None else 0
    dummy = lse
    _win_fwd_kernel[(nmb, B * H)](
        q, k, v, sinks if nsink else dummy, kmin if kmin is not None else dummy,
        o if o is not None else dummy, lse, yg if fuse else dummy, alpha if fuse else dummy,
        y if fuse else dummy, *strides_bht(q), *strides_bht(k), *strides_bht(v),
        T, H, max(nsink, 1), scale * LOG2E,
        W=window, D=D, DV=DV, BD=pow2(D), BDV=pow2(DV), BM=BM, BN=BN, BS=pow2(max(nsink, 1)), NKB=nkb,
        HAS_SINK=nsink > 0, HAS_KMIN=kmin is not None, FUSE=fuse, STORE_O=store_o,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)
    return o, y, lse


def _bwd(q, k, v, sinks, kmin, o, lse, alpha, dy, window: int, scale: float, cfg: WindowLaunch,
         sums: bool = True):
    """Returns dq, dk, dv, d sink_logits (or None), d alpha (or None), and the rows' dy . o
    ((B*H, T) fp32) where the walking kernel formed it (``forms_dyo``), else None. o may be None
    only where ``forms_dyo``: the kernel then forms dy . o from the scores. ``sums`` False, where
    the walking kernel forms dy . o: d sink_logits and d alpha are not formed (None, None); the
    caller forms them from dy . o with ``sink_alpha_sums``, where that costs least."""
    B, H, T, D = q.shape
    DV = v.shape[-1]
    BM, BN = cfg.bm, cfg.bn
    KV_BM, KV_BN = cfg.kv_bm or BM, cfg.kv_bn or BN
    nmb, nnb = math.ceil(T / BM), math.ceil(T / KV_BN)
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    dy = dy.to(v.dtype).contiguous()
    dq = torch.empty(B, H, T, D, dtype=q.dtype, device=dev)
    dk = torch.empty(B, H, T, D, dtype=k.dtype, device=dev)
    dv = torch.empty(B, H, T, DV, dtype=v.dtype, device=dev)
    delta = torch.empty(B * H, T, **f32)
    nsink = sinks.shape[1] if sinks is not None else 0
    BS = pow2(max(nsink, 1))
    strides = (*strides_bht(q), *strides_bht(k), *strides_bht(v))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    geo = dict(W=window, D=D, DV=DV, BD=pow2(D), BDV=pow2(DV))
    launch = dict(num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages)
    dummy = delta
    gluon = _gluon_bwd(cfg, q, k, v, window, kmin)
    if gluon is not None:
        walk = cfg.gluon_bwd_walk
        # the walking kernel forms D itself (from o, or from the scores where there is no o)
        own = _walk_forms_d(cfg, gluon) and (o is None or o.is_contiguous())
        if own:
            gluon.bwd(q, k, v, dy, lse, delta, alpha, dq, dk, dv, window=window, scale=scale, walk=walk,
                      sms=device_sms(q), o=o, scores_delta=o is None)
            d_sinks = d_alpha = None
            if sums:
                d_sinks, d_alpha = in_dtypes(*sink_alpha_sums(delta, lse, sinks, alpha), sinks, alpha)
            return dq, dk, dv, d_sinks, d_alpha, delta
        dsink = torch.empty(B * H, nmb, BS, **f32) if nsink else None
        dalpha = torch.empty(B * H, nmb, **f32) if alpha is not None else None
        _win_bwd_delta_kernel[(nmb, B * H)](
            o, dy, lse, sinks if nsink else dummy, alpha if alpha is not None else dummy, delta,
            dsink if nsink else dummy, dalpha if alpha is not None else dummy, T, H, max(nsink, 1), nmb,
            DV=DV, BDV=pow2(DV), BM=BM, BS=BS, HAS_SINK=nsink > 0, HAS_ALPHA=alpha is not None, FROM_O=True,
            num_warps=4)
        gluon.bwd(q, k, v, dy, lse, delta, alpha, dq, dk, dv, window=window, scale=scale, walk=walk,
                  sms=device_sms(q))
        return dq, dk, dv, *_sink_alpha_grads(dsink, dalpha, sinks, alpha, B, H, nmb, nsink, BS), None
    dsink = torch.empty(B * H, nmb, BS, **f32) if nsink else None
    dalpha = torch.empty(B * H, nmb, **f32) if alpha is not None else None
    _win_bwd_dq_kernel[(nmb, B * H)](
        q, k, v, sinks if nsink else dummy, kmin if kmin is not None else dummy, o, dy, lse,
        alpha if alpha is not None else dummy, dq, delta, dsink if nsink else dummy,
        dalpha if alpha is not None else dummy, *strides, T, H, max(nsink, 1), nmb, scale * LOG2E, scale,
        BM=BM, BN=BN, BS=BS, NKB=_key_blocks(window, BM, BN), HAS_SINK=nsink > 0, HAS_KMIN=kmin is not None,
        HAS_ALPHA=alpha is not None, PREC=prec, **geo, **launch)
    _win_bwd_dkdv_kernel[(nnb, B * H)](
        q, k, v, kmin if kmin is not None else dummy, dy, lse, alpha if alpha is not None else dummy, delta,
        dk, dv, *strides, T, H, scale * LOG2E, scale, BM=KV_BM, BN=KV_BN, NQB=_query_blocks(window, KV_BM, KV_BN),
        HAS_KMIN=kmin is not None, HAS_ALPHA=alpha is not None, PREC=prec, **geo,
        **{**launch, "num_warps": cfg.kv_warps or cfg.bwd_warps})
    return dq, dk, dv, *_sink_alpha_grads(dsink, dalpha, sinks, alpha, B, H, nmb, nsink, BS), None


def sink_alpha_sums(dyo: torch.Tensor, lse: torch.Tensor, sinks: Optional[torch.Tensor],
                    alpha: Optional[torch.Tensor], beside: Optional[tuple] = None,
                    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """d sink_logits (H, m) and d alpha (H,) in fp32 (None each where there are no sinks, no alpha)
    from the rows' dy . o (dyo (B*H, T) fp32, as the walking Gluon backward leaves it) and the
    forward's base-2 log-sum-exp (lse (B*H, T) fp32): two launches, the partial sums by long blocks
    of rows, then by head. ``beside``: (stream, after, done): the two kernels run on that stream once
    the event ``after`` has been reached, and the current stream waits for them (``done``) before
    whatever it is given next. Every buffer is the current stream's and is referenced until that
    wait is queued (no ``record_stream``); the caller keeps dyo and lse until then too."""
    nsink = sinks.shape[1] if sinks is not None else 0
    if not nsink and alpha is None:
        return None, None
    BH, T = dyo.shape
    H = (sinks if nsink else alpha).shape[0]
    BS = pow2(max(nsink, 1))
    # dy . o is formed already: long blocks of rows (B16 T2048: 0.021 ms for 16K programs of 64 rows)
    BM = min(1024, pow2(T))
    nmb = math.ceil(T / BM)
    f32 = dict(dtype=torch.float32, device=dyo.device)
    dsink = torch.empty(BH, nmb, BS, **f32) if nsink else dyo
    dalpha = torch.empty(BH, nmb, **f32) if alpha is not None else dyo
    d_sinks, d_alpha = torch.empty(H, max(nsink, 1), **f32), torch.empty(H, **f32)
    if beside is not None:
        stream, after, done = beside
        caller = torch.cuda.current_stream(dyo.device)
        stream.wait_event(after)
        torch.cuda.set_stream(stream)
    try:
        _win_bwd_delta_kernel[(nmb, BH)](
            dyo, dyo, lse, sinks if nsink else dyo, alpha if alpha is not None else dyo, dyo, dsink, dalpha, T, H,
            max(nsink, 1), nmb, DV=1, BDV=1, BM=BM, BS=BS, HAS_SINK=nsink > 0, HAS_ALPHA=alpha is not None,
            FROM_O=False, num_warps=4)
        _head_sums(dsink, dalpha, d_sinks, d_alpha, BH // H, H, nmb, nsink, alpha is not None, BS)
    finally:
        if beside is not None:
            done.record(stream)
            torch.cuda.set_stream(caller)
            caller.wait_event(done)
    return (d_sinks if nsink else None), (d_alpha if alpha is not None else None)


def _sink_alpha_grads(dsink, dalpha, sinks, alpha, B: int, H: int, nmb: int, nsink: int, BS: int):
    """d sink_logits and d alpha (or None each, in their own dtypes) from the query blocks' partial
    sums (``_head_sums``)."""
    if not nsink and alpha is None:
        return None, None
    f32 = dict(dtype=torch.float32, device=(dsink if nsink else dalpha).device)
    d_sinks, d_alpha = torch.empty(H, max(nsink, 1), **f32), torch.empty(H, **f32)
    _head_sums(dsink if nsink else d_sinks, dalpha if alpha is not None else d_alpha, d_sinks, d_alpha, B, H, nmb,
               nsink, alpha is not None, BS)
    return in_dtypes(d_sinks if nsink else None, d_alpha if alpha is not None else None, sinks, alpha)


def in_dtypes(d_sinks: Optional[torch.Tensor], d_alpha: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
              alpha: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """d sink_logits and d alpha (fp32, or None) in the dtypes of sinks and alpha."""
    return (d_sinks.to(sinks.dtype) if d_sinks is not None else None), (
        d_alpha.to(alpha.dtype) if d_alpha is not None else None)


def _head_sums(dsink, dalpha, d_sinks, d_alpha, B: int, H: int, nmb: int, nsink: int, has_alpha: bool,
               BS: int) -> None:
    """d_sinks (H, max(nsink, 1)) and d_alpha (H,), fp32, from the query blocks' partial sums (dsink
    (B*H, nmb, BS), dalpha (B*H, nmb); any fp32 tensor where unused), in one launch (torch's
    reductions over the batch and block dims took 0.026 ms at B16 T2048)."""
    N = B * nmb
    _win_head_sums_kernel[(H,)](dsink, dalpha, d_sinks, d_alpha, H, nmb, max(nsink, 1), N, BS=BS,
                                BN=min(pow2(N), 1024), HAS_SINK=nsink > 0, HAS_ALPHA=has_alpha, num_warps=4)


def _gluon_bwd(cfg: WindowLaunch, q, k, v, window: int, kmin):
    """The ``window_gluon`` module where the backward runs there (``cfg.gluon``), else None."""
    mod = gluon_kernels("window_attn.gluon") if cfg.gluon and q.is_cuda else None
    return mod if mod is not None and mod.supports_bwd(q, k, v, window, kmin) else None


def forms_dyo(cfg: WindowLaunch, q, k, v, window: int, kmin) -> bool:
    """Whether ``_bwd`` runs the walking Gluon kernel that forms D itself (from a contiguous o, or
    from the scores where o is None: a forward need not keep o), and so leaves the rows' dy . o for
    a caller (Lizard's gated backward takes dy . o_g from it and y)."""
    return _walk_forms_d(cfg, _gluon_bwd(cfg, q, k, v, window, kmin))


def _walk_forms_d(cfg: WindowLaunch, gluon) -> bool:
    """``forms_dyo`` once ``_gluon_bwd`` has given the module (or None)."""
    return gluon is not None and cfg.gluon_bwd_walk and cfg.gluon_walk_delta


class _WindowFunction(torch.autograd.Function):
    """y_w = window(q, k, v; sinks), or with y_g and alpha: y = y_g + alpha * y_w."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, yg, alpha, kmin, window, scale, cfg, grad_mode):
        # fused, o itself is only needed by a backward, which torch.no_grad rules out whatever
        # the inputs' requires_grad (which is all needs_input_grad reflects)
        store_o = yg is None or (grad_mode and any(ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 5)))
        o, y, lse = _fwd(q, k, v, sinks, kmin, yg, alpha, window, scale, store_o, cfg)
        ctx.save_for_backward(q, k, v, sinks, kmin, o, lse, alpha)
        ctx.args = (window, scale, cfg, yg is not None)
        return y if yg is not None else o

    @staticmethod
    def backward(ctx, dy):
        q, k, v, sinks, kmin, o, lse, alpha = ctx.saved_tensors
        window, scale, cfg, fused = ctx.args
        dq, dk, dv, d_sinks, d_alpha, _ = _bwd(q, k, v, sinks, kmin, o, lse, alpha if fused else None, dy,
                                            window, scale, cfg)
        dyg = dy if fused else None
        return dq, dk, dv, d_sinks, dyg, d_alpha, None, None, None, None, None


def _new_state(state: Optional[WindowState], k: torch.Tensor, v: torch.Tensor, L: int, dt: torch.dtype):
    """The state ``window_attn_chunk`` returns: the last L keys/values of [cache ++ input]."""
    T = k.shape[2]
    take = min(T, L)
    return _continue_state(state, k[:, :, T - take:].to(dt), v[:, :, T - take:].to(dt), T, L)


def _continue_state(state: Optional[WindowState], k_tail: torch.Tensor, v_tail: torch.Tensor, T: int, L: int):
    """The state after an input of T tokens whose last min(T, L) keys and values are k_tail,
    v_tail (in the state's dtype): with a cache, its last slots first where the input is shorter;
    without one, empty (zero) slots."""
    B, H, take, _ = k_tail.shape
    dt = k_tail.dtype
    if state is None:
        pos = torch.full((B,), T, dtype=torch.int64, device=k_tail.device)
        if take < L:  # an input shorter than the cache: empty (zero) slots first
            k_tail = torch.cat([k_tail.new_zeros(B, H, L - take, k_tail.shape[-1]), k_tail], 2)
            v_tail = torch.cat([v_tail.new_zeros(B, H, L - take, v_tail.shape[-1]), v_tail], 2)
        return WindowState(k_tail, v_tail, pos)
    if take < L:
        k_tail = keep_last(torch.cat([state.k.to(dt), k_tail], 2), L)
        v_tail = keep_last(torch.cat([state.v.to(dt), v_tail], 2), L)
    return WindowState(k_tail, v_tail, state.pos + T)


def window_attn_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, scale: Optional[float] = None,
    sink_logits: Optional[torch.Tensor] = None, state: Optional[WindowState] = None,
    y_global: Optional[torch.Tensor] = None, alpha: Optional[torch.Tensor] = None,
    settings: Optional[KernelSettings] = None, launch: Optional[WindowLaunch] = None,
) -> tuple[torch.Tensor, WindowState]:
    """``ops.window_attn.window_attn_chunk`` (standard window, v2 sinks) on the Triton kernels.

    ``settings``: the user's kernel settings (default ``current_settings()``); ``launch``: a launch
    variant (the tune sweep, tests; default ``LAUNCH``). The backward runs with those of its forward.

    ``state`` may only be a fresh one (``pos <= 0`` in every row, so its cache is never seen:
    left padding at negative positions); the caller guarantees that, nothing here synchronises
    to check it. With ``y_global`` (B, H, T, Dv) and ``alpha`` (H,) it returns Lizard's
    ``y_global + alpha[h] * y_window`` instead of y_window, fused. Differentiable in q, k, v,
    sink_logits, y_global and alpha. The new state is the last L keys/values, as the torch op's.
    """
    B, H, T, D, DV = common.check_qkv(q, k, v)
    L = check_window(window, False)
    check_sinks(H, D, DV, sink_logits, None, None)
    if state is not None:
        common.check_state_tensor("k", state.k, (B, H, L, D))
        common.check_state_tensor("v", state.v, (B, H, L, DV))
        check_pos(state.pos, B)
    dt = common.compute_dtype(q, k, v, *([sink_logits] if sink_logits is not None else []))
    scale = common.softmax_scale(scale, q.shape[-1])
    if not supports(q, k, v, sink_logits=sink_logits):
        raise ValueError(f"the window kernels need q/k/v of one dtype among bf16/fp16/fp32, head dims <= "
                         f"{MAX_DIM} and T > 0; got q {q.dtype}, k {k.dtype}, v {v.dtype}, "
                         f"D={q.shape[-1]}, Dv={v.shape[-1]}, T={q.shape[2]}")
    if (y_global is None) != (alpha is None):
        raise ValueError("y_global and alpha must be given together (or neither), got "
                         f"y_global={'None' if y_global is None else 'a tensor'}, "
                         f"alpha={'None' if alpha is None else 'a tensor'}")
    if y_global is not None:
        if tuple(y_global.shape) != tuple(v.shape):
            raise ValueError(f"y_global must have shape {tuple(v.shape)}, got {tuple(y_global.shape)}")
        if not isinstance(alpha, torch.Tensor) or tuple(alpha.shape) != (H,):
            got = tuple(alpha.shape) if isinstance(alpha, torch.Tensor) else type(alpha).__name__
            raise ValueError(f"alpha must have shape ({H},), got {got}")
        y_global = y_global.to(v.dtype).contiguous()
    sinks = sink_logits.contiguous() if sink_logits is not None and sink_logits.shape[1] > 0 else None
    kmin = None
    if state is not None:
        kmin = (-state.pos).clamp_min(0).to(torch.int32).contiguous()
    q, k, v = (unit_last(x) for x in (q, k, v))
    out = _WindowFunction.apply(q, k, v, sinks, y_global, alpha.contiguous() if alpha is not None else None,
                                kmin, int(window), float(scale), launch_for(settings, launch), torch.is_grad_enabled())
    return out, _new_state(state, k, v, L, dt)
