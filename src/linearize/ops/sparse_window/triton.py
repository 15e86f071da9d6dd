"""Triton kernels of the sparse window's live form (``live.py``): each block of BM queries attends to
its three key groups in one online softmax, with the scores in registers (FlashAttention's form).

Block b (queries t0 = b BM .. t0 + BM - 1; BM is the live form's block C):

    old     the M slots of ``pick[b]`` (pairs cached before t0; P = an empty slot), read with cache_q
            against the pairs' cache keys: visible while t - w < j_s
    new     the pairs t0 - w .. t0 - w + BM - 1 (leaving the window during the block), cache_q against
            their cache keys: visible while s <= t - w < j_s
    window  keys t - w < s <= t at s >= kmin (the row's left padding), q against k

and the sink logits (zero values) start the softmax, as in ``window_attn.triton`` (base 2; the row's
log-sum-exp is kept for the backward). The backward takes three passes, each program owning what
it writes (no atomics; a cached pair is read by many query blocks): per query block dq, d cache_q,
the sinks' part and D_t = do_t . o_t; per tile of window keys their dk and dv, from the query blocks
that see them; per tile of pairs their d cache-key and their part of dv, from the query blocks of
their stay in the cache (t - w in [s, j_s)); fp32 accumulators, then cast. Restrictions (the torch
live form runs otherwise): no soft-cap, no key/value sinks, D and Dv <= 256.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..backend.dispatch import chain_segments, device_sms, patch_interpreter, pow2
from ..window_attn.triton import block_offsets, load_kmin, online_step, sink_start, store_sink_grad, tile_visible
from . import live

patch_interpreter()

LOG2E = 1.4426950408889634
NEVER = tl.constexpr(live.NEVER)  # the j_s of no pair
BN = 64  # keys a tile
KEY_PASS_BM = 64  # queries a tile of the backward's key passes


@triton.jit
def _tile(Q_T, KEYS, VALS, idx, valid, jj, rows, kind: tl.constexpr, kmin, W: tl.constexpr, qk_scale, od, md, odv, mdv,
          D: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr):
    """One key tile: its keys (BN, BD), values (BN, BDV), scores (BM, BN) in base 2 and visibility.
    kind 0: old slots, 1: the band leaving the window, 2: the window."""
    k = tl.load(KEYS + idx[:, None].to(tl.int64) * D + od[None, :], mask=valid[:, None] & md[None, :], other=0.0)
    v = tl.load(VALS + idx[:, None].to(tl.int64) * DV + odv[None, :], mask=valid[:, None] & mdv[None, :], other=0.0)
    s = tl.dot(Q_T, tl.trans(k), input_precision=PREC) * qk_scale
    tw = rows[:, None] - W
    if kind == 0:
        vis = valid[None, :] & (tw < jj[None, :])
    elif kind == 1:
        vis = valid[None, :] & (idx[None, :] <= tw) & (tw < jj[None, :])
    else:
        vis = valid[None, :] & tile_visible(rows, idx, kmin, W)
    return k, v, s, vis


@triton.jit
def _tile_args(i_m, j, kind: tl.constexpr, PICK, UNTIL, pick_off, until_off, T, P, M: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr):
    """Tile j of group ``kind``: its key indices, which are there, and their j_s (window: unused)."""
    if kind == 0:
        sl = j * BN + tl.arange(0, BN)
        idx = tl.load(PICK + pick_off + sl, mask=sl < M, other=P)
        valid = idx < P
    elif kind == 1:
        idx = i_m * BM - W + j * BN + tl.arange(0, BN)
        valid = (idx >= 0) & (idx < P) & (j * BN + tl.arange(0, BN) < BM)
    else:
        idx = tl.maximum(i_m * BM - W + 1, 0) // BN * BN + j * BN + tl.arange(0, BN)
        valid = (idx >= 0) & (idx < T)
    if kind == 2:
        jj = idx
    else:
        jj = tl.load(UNTIL + until_off + idx, mask=valid, other=NEVER)
    return idx, valid, jj


@triton.jit
def _tiles(kind: tl.constexpr, NOLD: tl.constexpr, NNEW: tl.constexpr, NWIN: tl.constexpr):
    if kind == 0:
        return NOLD
    elif kind == 1:
        return NNEW
    else:
        return NWIN


@triton.jit
def _group_tile(i_m, j, kind: tl.constexpr, q, cq, K, LK, V, UNTIL, PICK, bh, T, P, NB, rows, kmin, qk_scale,
                od, md, odv, mdv, W: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """Tile j of group ``kind`` for query block i_m of head bh: (idx, valid, keys, values, scores, visible);
    the window reads q against k, the cache groups cache_q against the pairs' cache keys."""
    idx, valid, jj = _tile_args(i_m, j, kind, PICK, UNTIL, (bh * NB + i_m) * M, bh * P, T, P, M, BM, BN, W)
    if kind == 2:
        k, v, s, vis = _tile(q, K + bh * T * D, V + bh * T * DV, idx, valid, jj, rows, kind, kmin, W, qk_scale,
                             od, md, odv, mdv, D, DV, PREC)
    else:
        k, v, s, vis = _tile(cq, LK + bh * P * D, V + bh * T * DV, idx, valid, jj, rows, kind, kmin, W, qk_scale,
                             od, md, odv, mdv, D, DV, PREC)
    return idx, valid, k, v, s, vis


@triton.jit
def _sparse_fwd_kernel(
    Q, CQ, K, LK, V, UNTIL, PICK, SINK, KMIN, O, LSE,
    T, P, H, NB, NSINK, qk_scale,
    W: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, NOLD: tl.constexpr, NNEW: tl.constexpr,
    NWIN: tl.constexpr, HAS_SINK: tl.constexpr, HAS_KMIN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (query blocks, B*H): o and lse (fp32, base 2; +inf for a row that sees nothing)."""
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bh = i_bh.to(tl.int64)
    rows, mrow, od, odv, md, mdv = block_offsets(i_m, T, BM, BD, BDV, D, DV)
    qoff = bh * T * D + rows[:, None].to(tl.int64) * D + od[None, :]
    q = tl.load(Q + qoff, mask=mrow[:, None] & md[None, :], other=0.0)
    cq = tl.load(CQ + qoff, mask=mrow[:, None] & md[None, :], other=0.0)
    kmin = load_kmin(KMIN, i_b, HAS_KMIN)
    m_i, l_i = sink_start(SINK, i_h, NSINK, BM, BS, HAS_SINK)
    acc = tl.zeros([BM, BDV], dtype=tl.float32)
    for kind in tl.static_range(3):
        for j in range(0, _tiles(kind, NOLD, NNEW, NWIN)):
            idx, valid, k, v, s, vis = _group_tile(i_m, j, kind, q, cq, K, LK, V, UNTIL, PICK, bh, T, P, NB, rows, kmin,
                                                   qk_scale, od, md, odv, mdv, W, M, D, DV, BM, BN, PREC)
            m_i, l_i, acc = online_step(m_i, l_i, acc, tl.where(vis, s, float("-inf")), v, PREC)
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(LSE + bh * T + rows, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("inf")), mask=mrow)
    tl.store(O + bh * T * DV + rows[:, None].to(tl.int64) * DV + odv[None, :], o.to(O.dtype.element_ty),
             mask=mrow[:, None] & mdv[None, :])


@triton.jit
def _sparse_bwd_kernel(
    Q, CQ, K, LK, V, UNTIL, PICK, SINK, KMIN, O, DO, LSE, DQ, DCQ, DELTA, DSINK,
    T, P, H, NB, NSINK, qk_scale, sm_scale,
    W: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, NOLD: tl.constexpr, NNEW: tl.constexpr,
    NWIN: tl.constexpr, HAS_SINK: tl.constexpr, HAS_KMIN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (query blocks, B*H): dq, d cache_q, D_t = do_t . o_t (for the key passes) and the
    block's part of the sink logits' gradient into DSINK[(bh, block), :BS]."""
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    dt = Q.dtype.element_ty
    bh = i_bh.to(tl.int64)
    rows, mrow, od, odv, md, mdv = block_offsets(i_m, T, BM, BD, BDV, D, DV)
    qoff = bh * T * D + rows[:, None].to(tl.int64) * D + od[None, :]
    q = tl.load(Q + qoff, mask=mrow[:, None] & md[None, :], other=0.0)
    cq = tl.load(CQ + qoff, mask=mrow[:, None] & md[None, :], other=0.0)
    ooff = bh * T * DV + rows[:, None].to(tl.int64) * DV + odv[None, :]
    do = tl.load(DO + ooff, mask=mrow[:, None] & mdv[None, :], other=0.0).to(tl.float32)
    o = tl.load(O + ooff, mask=mrow[:, None] & mdv[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(do * o, 1)
    tl.store(DELTA + bh * T + rows, delta, mask=mrow)
    lse = tl.load(LSE + bh * T + rows, mask=mrow, other=float("inf"))
    do_c = do.to(dt)
    kmin = load_kmin(KMIN, i_b, HAS_KMIN)
    dq = tl.zeros([BM, BD], dtype=tl.float32)
    dcq = tl.zeros([BM, BD], dtype=tl.float32)
    for kind in tl.static_range(3):
        for j in range(0, _tiles(kind, NOLD, NNEW, NWIN)):
            idx, valid, k, v, s, vis = _group_tile(i_m, j, kind, q, cq, K, LK, V, UNTIL, PICK, bh, T, P, NB, rows, kmin,
                                                   qk_scale, od, md, odv, mdv, W, M, D, DV, BM, BN, PREC)
            p = tl.where(vis & mrow[:, None], tl.exp2(s - lse[:, None]), 0.0)
            dp = tl.dot(do_c, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            if kind == 2:
                dq += tl.dot(ds.to(dt), k, input_precision=PREC)
            else:
                dcq += tl.dot(ds.to(dt), k, input_precision=PREC)
    tl.store(DQ + qoff, (dq * sm_scale).to(DQ.dtype.element_ty), mask=mrow[:, None] & md[None, :])
    tl.store(DCQ + qoff, (dcq * sm_scale).to(DCQ.dtype.element_ty), mask=mrow[:, None] & md[None, :])
    if HAS_SINK:
        store_sink_grad(SINK, DSINK, i_h, i_bh * NB + i_m, NSINK, tl.where(mrow, lse, float("inf")), delta, BS)


@triton.jit
def _key_tile_grads(QS, DO, LSE, DELTA, k, v, cols, mcol, jj, bh, T, q_lo, q_hi, kmin, qk_scale,
                    od, md, odv, mdv, CACHE: tl.constexpr, W: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                    BD: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """One tile of keys k (BN, BD) with values v against query blocks q_lo .. q_hi - 1 of QS (q for
    window keys; cache_q for pairs, ``CACHE``): their (dk / scale, dv) in fp32. Visible: the window
    (t - w < s <= t, s >= kmin), or a pair's stay in the cache (s <= t - w < j_s)."""
    dt = k.dtype
    dk = tl.zeros([BN, BD], dtype=tl.float32)
    dv = tl.zeros([BN, BDV], dtype=tl.float32)
    for qb in range(q_lo, q_hi):
        rows = qb * BM + tl.arange(0, BM)
        mrow = rows < T
        qoff = bh * T * D + rows[:, None].to(tl.int64) * D + od[None, :]
        q = tl.load(QS + qoff, mask=mrow[:, None] & md[None, :], other=0.0)
        do = tl.load(DO + bh * T * DV + rows[:, None].to(tl.int64) * DV + odv[None, :],
                     mask=mrow[:, None] & mdv[None, :], other=0.0)
        lse = tl.load(LSE + bh * T + rows, mask=mrow, other=float("inf"))
        delta = tl.load(DELTA + bh * T + rows, mask=mrow, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        if CACHE:
            tw = rows[:, None] - W
            vis = (cols[None, :] <= tw) & (tw < jj[None, :])
        else:
            vis = tile_visible(rows, cols, kmin, W)
        p = tl.where(vis & mrow[:, None] & mcol[None, :], tl.exp2(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p.to(dt)), do, input_precision=PREC)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(dt)), q, input_precision=PREC)
    return dk, dv


@triton.jit
def _key_tile(KEYS, V, cols, mcol, bh, NK, T, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr,
              BDV: tl.constexpr):
    """The keys ``cols`` (where ``mcol``) of head bh (KEYS (B*H, NK, D): the window's k, NK = T, or the
    pairs' cache keys, NK = P) with their values (rows of V (B*H, T, DV)): column offsets and masks,
    keys, values, and the values' offsets."""
    od, odv = tl.arange(0, BD), tl.arange(0, BDV)
    md, mdv = od < D, odv < DV
    k = tl.load(KEYS + bh * NK * D + cols[:, None].to(tl.int64) * D + od[None, :], mask=mcol[:, None] & md[None, :],
                other=0.0)
    voff = bh * T * DV + cols[:, None].to(tl.int64) * DV + odv[None, :]
    v = tl.load(V + voff, mask=mcol[:, None] & mdv[None, :], other=0.0)
    return od, odv, md, mdv, k, v, voff


@triton.jit
def _sparse_bwd_window_kernel(
    Q, K, V, DO, LSE, DELTA, KMIN, DK, DV_, T, H, qk_scale, sm_scale,
    W: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, HAS_KMIN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (tiles of BN keys, B*H): the window keys' dk and dv (fp32), from the query blocks that see
    them (t in [s, s + w))."""
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    bh = i_bh.to(tl.int64)
    cols = i_n * BN + tl.arange(0, BN)
    mcol = cols < T
    od, odv, md, mdv, k, v, voff = _key_tile(K, V, cols, mcol, bh, T, T, D, DV, BD, BDV)
    kmin = load_kmin(KMIN, i_bh // H, HAS_KMIN)
    q_lo = i_n * BN // BM
    q_hi = tl.minimum(tl.cdiv(i_n * BN + BN - 1 + W, BM), tl.cdiv(T, BM))
    dk, dv = _key_tile_grads(Q, DO, LSE, DELTA, k, v, cols, mcol, cols, bh, T, q_lo, q_hi, kmin, qk_scale,
                             od, md, odv, mdv, False, W, D, DV, BD, BDV, BM, BN, PREC)
    tl.store(DK + bh * T * D + cols[:, None].to(tl.int64) * D + od[None, :], dk * sm_scale,
             mask=mcol[:, None] & md[None, :])
    tl.store(DV_ + voff, dv, mask=mcol[:, None] & mdv[None, :])


@triton.jit
def _sparse_bwd_cache_kernel(
    CQ, LK, V, UNTIL, TILES, DO, LSE, DELTA, DLK, DV_, T, P, qk_scale, sm_scale,
    W: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (tiles of BN pairs, B*H): the pairs' d cache-key (fp32) and their part of dv, added to the
    window's in DV_ (this program owns those rows), from the query blocks of their stay in the cache.
    TILES (B*H, P): the pairs in tile order (``cache_tiles``: by how long they stay, then position),
    so that a tile's query blocks, from its first arrival to its last eviction, are few."""
    i_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    idx = i_n * BN + tl.arange(0, BN)
    mcol = idx < P
    cols = tl.load(TILES + bh * P + idx, mask=mcol, other=0)
    od, odv, md, mdv, lk, v, voff = _key_tile(LK, V, cols, mcol, bh, P, T, D, DV, BD, BDV)
    jj = tl.load(UNTIL + bh * P + cols, mask=mcol, other=NEVER)
    q_lo = (tl.min(tl.where(mcol, cols, P), 0) + W) // BM
    q_hi = tl.minimum(tl.cdiv(tl.max(jj, 0) + W, BM), tl.cdiv(T, BM))
    dk, dv = _key_tile_grads(CQ, DO, LSE, DELTA, lk, v, cols, mcol, jj, bh, T, q_lo, q_hi, 0, qk_scale,
                             od, md, odv, mdv, True, W, D, DV, BD, BDV, BM, BN, PREC)
    tl.store(DLK + bh * P * D + cols[:, None].to(tl.int64) * D + od[None, :], dk * sm_scale,
             mask=mcol[:, None] & md[None, :])
    dv += tl.load(DV_ + voff, mask=mcol[:, None] & mdv[None, :], other=0.0)
    tl.store(DV_ + voff, dv, mask=mcol[:, None] & mdv[None, :])


@triton.jit
def _cache_until_kernel(RANK, UNTIL, P, M, BS: tl.constexpr, BJ: tl.constexpr):
    """Per (batch*head, block of BS pairs s): j_s = the first j >= s at which M pairs s' <= j rank above
    s, else P (``live.cache_until``), by one pass over the pairs in blocks of BJ, counting."""
    bh = tl.program_id(0).to(tl.int64)
    s0 = tl.program_id(1) * BS
    s = s0 + tl.arange(0, BS)
    ms = s < P
    r_s = tl.load(RANK + bh * P + s, mask=ms, other=0)
    count = tl.zeros([BS], dtype=tl.int32)
    until = tl.zeros([BS], dtype=tl.int32) + P
    rj = tl.arange(0, BJ)
    for j0 in range(0, s0 - s0 % BJ, BJ):  # pairs before the block's first: they count, no j_s is among them
        r_j = tl.load(RANK + bh * P + j0 + rj)
        count += tl.sum((r_j[None, :] < r_s[:, None]).to(tl.int32), 1)
    through = (rj[:, None] <= rj[None, :]).to(tl.int8)  # [j', j]: j' <= j, so that above @ through counts to j
    for j0 in range(s0 - s0 % BJ, P, BJ):
        j = j0 + rj
        mj = j < P
        r_j = tl.load(RANK + bh * P + j, mask=mj, other=0)
        above = ((r_j[None, :] < r_s[:, None]) & mj[None, :]).to(tl.int8)
        # the running counts as an int8 product on the tensor cores (a scan along the tile is slower)
        hit = ((count[:, None] + tl.dot(above, through, out_dtype=tl.int32)) >= M) & (j[None, :] >= s[:, None]) \
            & mj[None, :]
        until = tl.minimum(until, tl.min(tl.where(hit, j[None, :], P), 1))
        count += tl.sum(above.to(tl.int32), 1)
    tl.store(UNTIL + bh * P + s, until, mask=ms)


@triton.jit
def _cache_until_scan_kernel(RANK, ORDER, UNTIL, KEPT, P, M, NSEG, SEG, MS: tl.constexpr, BJ: tl.constexpr,
                             CB: tl.constexpr, N: tl.constexpr):
    """``live.cache_until``'s scan on one program per (batch*head, segment of SEG pairs), O(SEG (M + BJ))
    work: the pairs in blocks of BJ, carrying the M best ranks so far sorted in KEPT (MS slots, P + 1
    where empty; it comes in holding the M best of the pairs before the segment). In a block, a kept
    pair at slot p has p kept pairs above it, a new pair the kept ones ranked above it; the block's
    pairs above each add up through j (an int8 product with a triangle of ones); j_s is the first j
    (at or after s's arrival) where M are above s. Then the kept set and the block are sorted
    together and the first M kept. ORDER (B*H, P + 1): each candidate rank's pair. A pair's j_s is
    written by the one segment where it leaves the kept set."""
    pid = tl.program_id(0)  # (int32 where it can: the kernel is at the edge of its registers)
    bh = (pid // NSEG).to(tl.int64)
    start = (pid % NSEG) * SEG
    end = tl.minimum(start + SEG, P)
    rj = tl.arange(0, BJ)
    rc = tl.arange(0, CB)
    rs = tl.arange(0, MS)
    rn = tl.arange(0, N)
    empty = P + 1
    through = (rj[:, None] <= rj[None, :]).to(tl.int8)  # [i, j]: i <= j
    for j0 in range(start, end, BJ):
        jb = j0 + rj
        mb = jb < end
        rb = tl.load(RANK + bh * P + jb, mask=mb, other=empty)
        kept = tl.load(KEPT + pid * MS + rs)
        for c0 in tl.static_range(0, MS, CB):  # the kept pairs, CB at a time
            xc = tl.load(KEPT + pid * MS + c0 + rc)
            above = ((rb[None, :] < xc[:, None]) & mb[None, :]).to(tl.int8)
            count = (c0 + rc)[:, None] + tl.dot(above, through, out_dtype=tl.int32)
            hit = (count >= M) & mb[None, :]
            first = tl.min(tl.where(hit, jb[None, :], P), 1)
            out = (first < P) & (xc < P)  # (a pair of rank P is no candidate: its j_s is not used)
            pair = tl.load(ORDER + bh * (P + 1) + xc, mask=out, other=0)
            tl.store(UNTIL + bh * P + pair, first, mask=out)
        for c0 in tl.static_range(0, BJ, CB):  # the block's own pairs, CB at a time
            sc = j0 + c0 + rc
            mc = sc < end
            xc = tl.load(RANK + bh * P + sc, mask=mc, other=empty)
            before = tl.sum((kept[None, :] < xc[:, None]).to(tl.int32), 1)
            above = ((rb[None, :] < xc[:, None]) & mb[None, :]).to(tl.int8)
            count = before[:, None] + tl.dot(above, through, out_dtype=tl.int32)
            hit = (count >= M) & mb[None, :] & (jb[None, :] >= sc[:, None])
            first = tl.min(tl.where(hit, jb[None, :], P), 1)
            tl.store(UNTIL + bh * P + sc, first, mask=mc & (first < P))
        # the new kept set: the M best of the kept and the block's ranks
        x = tl.where(rn < MS, tl.load(KEPT + pid * MS + rn, mask=rn < MS, other=empty),
                     tl.load(RANK + bh * P + j0 + rn - MS, mask=(rn >= MS) & (rn < MS + BJ) & (j0 + rn - MS < end),
                             other=empty))
        x = tl.sort(x)
        tl.debug_barrier()  # (every thread has read KEPT before it is written)
        tl.store(KEPT + pid * MS + rn, tl.where(rn < M, x, empty), mask=rn < MS)
        tl.debug_barrier()


@triton.jit
def _old_slots_kernel(UNTIL, PICK, P, NB, C, W, M, BP: tl.constexpr):
    """Per (batch*head, query block b): the pairs s < b C - w still cached at its first query
    (j_s > b C - w) into its M slots in position order (``live.old_slots``; the rest stay P)."""
    bh = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    t0 = b * C - W
    base = PICK + (bh * NB + b) * M
    taken = 0
    for s0 in range(0, tl.minimum(tl.maximum(t0, 0), P), BP):
        s = s0 + tl.arange(0, BP)
        old = (s < t0) & (tl.load(UNTIL + bh * P + s, mask=s < P, other=0) > t0)
        slot = taken + tl.cumsum(old.to(tl.int32), 0) - 1
        tl.store(base + slot, s, mask=old & (slot < M))
        taken += tl.sum(old.to(tl.int32), 0)


# pairs from which the selection runs as a scan (O(P (M + 128)) on B * H programs) rather than by
# counting all pairs against all (O(P^2) on B * H * P / 64 programs); set without a GPU measurement
SCAN_SELECTION_FROM = 4096
SCAN_BLOCK = 128  # pairs a step of the scan


def _selection_segments(P: int, rows: int, sms: int) -> int:
    """Segments of the selection scan's pairs for each (batch*head), a chain of blocks on one
    program a row (``chain_segments``: at least 4 blocks a segment)."""
    return chain_segments(rows, P, sms, 4 * SCAN_BLOCK)


def _entering_kept(rank: torch.Tensor, M: int, MS: int, seg: int, G: int) -> torch.Tensor:
    """(B*H*G, MS) int32: the kept set entering each segment of ``seg`` pairs, the M best ranks of
    the pairs before it, sorted, P + 1 where empty. The scan's kept set is the M best of all the pairs
    so far, so each segment's M best (a top-k a segment) joined over the segments before it (a top-k
    of those) is the set it carries in."""
    BH, P = rank.shape
    empty = P + 1
    padded = torch.full((BH, G * seg), empty, dtype=rank.dtype, device=rank.device)
    padded[:, :P] = rank
    best = padded.view(BH, G, seg).topk(min(M, seg), dim=-1, largest=False, sorted=True).values  # (BH, G, m)
    before = torch.arange(G, device=rank.device)
    earlier = before[None, :, None] < before[:, None, None]  # [g, g', 1]: segment g' comes before g
    joined = torch.where(earlier, best[:, None], empty).flatten(2)  # (BH, G, G * m)
    kept = joined.topk(min(M, joined.shape[-1]), dim=-1, largest=False, sorted=True).values
    out = torch.full((BH, G, MS), empty, dtype=rank.dtype, device=rank.device)
    out[..., :kept.shape[-1]] = kept
    return out.view(BH * G, MS).contiguous()


@torch.no_grad()
def cache_until_triton(pair_score: torch.Tensor, candidate: torch.Tensor, cache_size: int,
                       scan: Optional[bool] = None, segments: Optional[int] = None) -> torch.Tensor:
    """``live.cache_until`` (B, H, P) int32 on a kernel: the ranks in torch (``live.pair_ranks``), then
    every pair's j_s, counted directly (O(P^2) comparisons in one launch) for short rows, or by the
    scan of ``_cache_until_scan_kernel`` from ``SCAN_SELECTION_FROM`` pairs (``scan``: force either),
    its pairs in segments that run at once where the rows are few (``_selection_segments``;
    ``segments``: force a count), each entering with the kept set of the pairs before it."""
    B, H, P = pair_score.shape
    rank = live.pair_ranks(pair_score, candidate).contiguous()
    if scan is None:
        scan = P >= SCAN_SELECTION_FROM
    if scan and rank.numel():
        MS = max(pow2(cache_size), 16)
        BJ, CB = SCAN_BLOCK, min(64, MS)
        G = segments or _selection_segments(P, B * H, device_sms(rank))
        seg = BJ * triton.cdiv(triton.cdiv(P, G), BJ)
        G = triton.cdiv(P, seg)
        until = torch.full_like(rank, P)
        # the pair of each candidate's rank (the no-candidates' shared rank P lands in a spare slot)
        order = torch.zeros(B, H, P + 1, dtype=torch.int32, device=rank.device).scatter_(
            -1, rank.long(), torch.arange(P, device=rank.device, dtype=torch.int32).expand(B, H, P))
        if G == 1:
            kept = torch.full((B * H, MS), P + 1, dtype=torch.int32, device=rank.device)
        else:
            kept = _entering_kept(rank.view(B * H, P), cache_size, MS, seg, G)
        _cache_until_scan_kernel[(B * H * G,)](rank, order, until, kept, P, cache_size, G, seg, MS=MS, BJ=BJ,
                                               CB=CB, N=pow2(MS + BJ), num_warps=4)
    elif rank.numel():
        until = torch.empty_like(rank)
        _cache_until_kernel[(B * H, triton.cdiv(P, 64))](rank, until, P, cache_size, BS=64, BJ=64, num_warps=4)
    else:
        until = torch.empty_like(rank)
    idx = torch.arange(P, device=rank.device, dtype=torch.int32)
    return torch.where(candidate[:, None, :], until, idx)


@torch.no_grad()
def old_slots_triton(until: torch.Tensor, T: int, window: int, cache_size: int, block: int) -> torch.Tensor:
    """``live.old_slots`` (B, H, ceil(T / block), M) as int32, one launch: a program a query block."""
    B, H, P = until.shape
    nb = triton.cdiv(T, block)
    pick = torch.full((B, H, nb, cache_size), P, dtype=torch.int32, device=until.device)
    if B * H and nb and P:
        _old_slots_kernel[(B * H, nb)](until.int().contiguous(), pick, P, nb, block, window, cache_size, BP=128,
                                       num_warps=4)
    return pick


def cache_tiles(until: torch.Tensor) -> torch.Tensor:
    """(B, H, P) int32: the pairs ordered for the backward's cache pass, by how long they stay in the
    cache (in powers of two) and then by position. A tile of pairs visits the query blocks from its
    first pair's arrival to its last one's eviction: in position order one long stay among 64 short
    ones made a tile visit every later block (the pass grew with T^2); grouped by stay, the blocks a
    tile visits are about as many as its pairs' stays need."""
    B, H, P = until.shape
    s = torch.arange(P, device=until.device)
    stay = (until.long() - s).clamp_min(0)
    group = torch.floor(torch.log2(stay.double() + 1)).long()
    return torch.argsort(group * P + s, dim=-1).int().contiguous()


def _launch_args(q, v, sinks, kmin, window: int, cache_size: int, block: int) -> dict:
    """The kernels' constexprs, the same for the forward and the backward."""
    D, DV = q.shape[-1], v.shape[-1]
    nsink = sinks.shape[1] if sinks is not None else 0
    return dict(W=window, M=cache_size, D=D, DV=DV, BD=pow2(D), BDV=pow2(DV), BM=block, BN=BN,
                BS=pow2(max(nsink, 1)), NOLD=math.ceil(cache_size / BN), NNEW=math.ceil(block / BN),
                NWIN=math.ceil((window + block) / BN) + 1, HAS_SINK=nsink > 0, HAS_KMIN=kmin is not None,
                PREC="ieee" if q.dtype == torch.float32 else "tf32")


class _SparseLive(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cq, lk, sinks, until, pick, kmin, window, cache_size, scale, block):
        B, H, T, _ = q.shape
        P, nb = lk.shape[2], pick.shape[2]
        o = torch.empty(B, H, T, v.shape[-1], dtype=v.dtype, device=q.device)
        lse = torch.empty(B * H, T, dtype=torch.float32, device=q.device)
        kw = _launch_args(q, v, sinks, kmin, window, cache_size, block)
        dummy = lse
        _sparse_fwd_kernel[(nb, B * H)](
            q, cq, k, lk, v, until, pick, sinks if kw["HAS_SINK"] else dummy, kmin if kw["HAS_KMIN"] else dummy, o,
            lse, T, P, H, nb, sinks.shape[1] if kw["HAS_SINK"] else 1, scale * LOG2E, **kw)
        ctx.save_for_backward(q, k, v, cq, lk, sinks, until, pick, kmin, o, lse)
        ctx.geometry = (window, cache_size, scale, block)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, cq, lk, sinks, until, pick, kmin, o, lse = ctx.saved_tensors
        window, cache_size, scale, block = ctx.geometry
        B, H, T, D = q.shape
        DV, P, nb = v.shape[-1], lk.shape[2], pick.shape[2]
        f32 = dict(dtype=torch.float32, device=q.device)
        dq, dcq = torch.empty_like(q), torch.empty_like(cq)
        # every row written by the one program that owns it (the cache pass adds to the window's dv)
        dk, dlk, dv = torch.empty(B, H, T, D, **f32), torch.empty(B, H, P, D, **f32), torch.empty(B, H, T, DV, **f32)
        delta = torch.empty(B * H, T, **f32)
        kw = _launch_args(q, v, sinks, kmin, window, cache_size, block)
        nsink = sinks.shape[1] if kw["HAS_SINK"] else 0
        dsink = torch.empty(B * H * nb, kw["BS"], **f32) if nsink else None
        dummy = lse
        do = do.to(v.dtype).contiguous()
        _sparse_bwd_kernel[(nb, B * H)](
            q, cq, k, lk, v, until, pick, sinks if nsink else dummy, kmin if kw["HAS_KMIN"] else dummy, o,
            do, lse, dq, dcq, delta, dsink if nsink else dummy,
            T, P, H, nb, max(nsink, 1), scale * LOG2E, scale, **kw)
        keys = dict(W=window, D=D, DV=DV, BD=kw["BD"], BDV=kw["BDV"], BM=KEY_PASS_BM, BN=BN, PREC=kw["PREC"])
        _sparse_bwd_window_kernel[(triton.cdiv(T, BN), B * H)](
            q, k, v, do, lse, delta, kmin if kw["HAS_KMIN"] else dummy, dk, dv, T, H, scale * LOG2E, scale,
            HAS_KMIN=kw["HAS_KMIN"], **keys)
        if P:
            _sparse_bwd_cache_kernel[(triton.cdiv(P, BN), B * H)](
                cq, lk, v, until, cache_tiles(until), do, lse, delta, dlk, dv, T, P, scale * LOG2E, scale, **keys)
        d_sinks = None
        if nsink:
            d_sinks = dsink.view(B, H, nb, -1).sum((0, 2))[:, :nsink].to(sinks.dtype)
        return (dq, dk.to(k.dtype), dv.to(v.dtype), dcq, dlk.to(lk.dtype), d_sinks,
                None, None, None, None, None, None, None)


def sparse_live_triton(q, k, v, cache_q, cache_k, sink_logits: Optional[torch.Tensor], until, pick,
                       kmin: Optional[torch.Tensor], *, window: int, cache_size: int, scale: float,
                       block: int) -> torch.Tensor:
    """``live.live_attend``'s output from the kernels. q, k, cache_q (B, H, T, D), v (B, H, T, Dv),
    cache_k (B, H, P, D) the pairs' cache keys, until (B, H, P) int32, pick (B, H, T/block, M) int32
    (P: an empty slot), kmin (B,) int32 or None; any float dtype, one for all (fp32 math inside)."""
    c = lambda x: x.contiguous()  # noqa: E731
    return _SparseLive.apply(c(q), c(k), c(v), c(cache_q), c(cache_k), sink_logits, c(until), c(pick), kmin,
                             window, cache_size, scale, block)
