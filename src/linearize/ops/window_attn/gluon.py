"""The sliding window's backward (dq, dk, dv) as one hand-written Hopper kernel (Gluon).

Same math as ``window._win_bwd_dq_kernel`` and ``window._win_bwd_dkdv_kernel`` (see
``ops.window_attn.triton``'s docstring), for windows of at most 129 keys, so that a chunk of 64 queries
sees keys in its own chunk and the two before, and a chunk of 64 keys is seen from its own chunk
and the two after. With p_ts = exp2(s_ts - lse_t) (s = q k^T * scale * log2 e, masked to
t - w < s <= t) and D_t = alpha_h * (dy_t . o_t) from ``window``'s delta pre-pass:

    dq_c = scale * sum_{j = c-2..c} [p (alpha dy v^T - D)]_{c,j} k_j
    dk_c = scale * sum_{i = c..c+2} [p (alpha dy v^T - D)]_{i,c}^T q_i,   dv_c = alpha sum_i p_{i,c}^T dy_i

One program per (chunk c, batch x head) holds the twelve tiles it reads in shared memory (q and dy
of chunks c..c+2, k and v of chunks c-2..c; neighbouring programs read the same tiles, mostly from
L2), brought by TMA, and runs two warpgroups side by side (``gl.warp_specialize``): one forms
dq (scores of its queries against three key tiles), the other dk and dv in the transposed form
(scores of its keys against three query tiles: p^T, rows = keys, is then the left operand of
dv += p^T dy and dk += ds^T q straight from registers, as FlashAttention's backward does). Tiles
before the first chunk or after the last are clamped to a real chunk and masked out.

The walking kernel (``_win_bwd_walk_kernel``, ``WindowLaunch.gluon_bwd_walk``) does the same
work with one program per segment of chunks: its twelve slots are two rings (query and dy tiles
of three consecutive chunks, key and value tiles of three), each tile is read once per segment and
comes by TMA while the chunks before it are computed, where the one-chunk kernel waits for its
twelve tiles with nothing else to do (one program per multiprocessor) and reads each tile three
times. The default on Hopper since it ran there (faster than the one-chunk kernel in Lizard's
backward on an H100). Its dk and dv leave by TMA through one staging tile and dq through another
(each written once the store before it has left), and it forms D itself
(``WindowLaunch.gluon_walk_delta``; the dq partition reads the tile after next's o a chunk
ahead, where Nsight Compute found it waiting). The dk/dv partition takes all 256 registers a thread
(the dq partition keeps 256 too: 65536 in all): with 248 it spilled, and its reloads, missing the
small L1 beside 231 KB of shared memory, waited on L2. Each of these was kept for the time it saved
on an H100; the measurements are in git (benchmarks/README.md names the commit).

Scope: CUDA sm_90, bf16/fp16, D = Dv = 128, T a multiple of 64, window <= 129, no left padding;
q, k, v (B, H, T, D) contiguous or a model's (B, T, H, D) transposed; dy, lse, D contiguous.
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from ..backend.dispatch import chain_segments, sm_major
from ..gla.gluon import load_pair, prof_init, qkv_rows, store_tile, prof_tick, model_layout_bits, tma_readable, tma_tiles

BT = 64  # tokens per chunk (query and key tiles)
WIDTH = 128


@gluon.jit
def _score_pair(a, b, c, d, C: gl.constexpr, mma_s: gl.constexpr):
    """a b^T and c d^T ((C, C) fp32 each: the scores and dy v^T, or both transposed), two MMAs
    issued together and waited for together."""
    s = warpgroup_mma(a, b.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False, is_async=True)
    t = warpgroup_mma(c, d.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False, is_async=True)
    s, t, _, _, _, _ = warpgroup_mma_wait(0, deps=(s, t, a, b, c, d))
    return s, t


@gluon.jit
def _probs(s, lse, rows, cols, lag: gl.constexpr, c, qk_scale, W: gl.constexpr, C: gl.constexpr):
    """p = exp2(s qk_scale - lse) of a query tile (chunk c) against the key tile of chunk c - lag, 0
    where a key is not visible: col <= row + lag C and col > row + lag C - W (and c >= lag)."""
    vis = (cols[None, :] <= rows[:, None] + lag * C) & (cols[None, :] > rows[:, None] + (lag * C - W)) & (c >= lag)
    return gl.where(vis, gl.exp2(s * qk_scale - lse[:, None]), 0.0)


@gluon.jit
def _dq_tile(q_t, dy_t, kd, vd, dq, lse, delta, rows, cols, lag: gl.constexpr, c, alpha, qk_scale,
             W: gl.constexpr, C: gl.constexpr, mma_s: gl.constexpr, dot_o: gl.constexpr, pacc, pt,
             NPROF: gl.constexpr):
    """dq += ds kd for the query tile (q_t, dy_t) of chunk c against the key tile (kd, vd) of chunk
    c - lag: a key column is visible iff col <= row + lag C and col > row + lag C - W (and c >= lag).
    Profiling builds (NPROF): the scores' MMAs, the elementwise work and dq's MMA as phases 2, 3, 4."""
    s, dp = _score_pair(q_t, kd, dy_t, vd, C, mma_s)
    if NPROF > 0:
        pacc, pt = prof_tick(pacc, pt, 2)
    p = _probs(s, lse, rows, cols, lag, c, qk_scale, W, C)
    ds = gl.convert_layout((p * (dp * alpha - delta[:, None])).to(q_t.dtype), dot_o)
    if NPROF > 0:
        pacc, pt = prof_tick(pacc, pt, 3)
    dq = warpgroup_mma(ds, kd, dq, is_async=True)
    dq, _, _ = warpgroup_mma_wait(0, deps=(dq, ds, kd))
    if NPROF > 0:
        pacc, pt = prof_tick(pacc, pt, 4)
    return dq, pacc, pt


@gluon.jit
def _dkdv_tile(k0, v0, qd, dyd, dk, dv, lse, delta, keys, qry, d: gl.constexpr, c, nc, alpha, qk_scale,
               W: gl.constexpr, C: gl.constexpr, mma_s: gl.constexpr, dot_o: gl.constexpr, pacc, pt,
               NPROF: gl.constexpr):
    """dk += ds^T qd, dv += p^T dyd for the key tile (k0, v0) of chunk c against the query tile
    (qd, dyd) of chunk c + d, transposed (rows are keys): visible iff key <= query + d C and
    key > query + d C - W (and c + d < nc). Profiling builds: phases as ``_dq_tile``'s."""
    st, dpt = _score_pair(k0, qd, v0, dyd, C, mma_s)
    if NPROF > 0:
        pacc, pt = prof_tick(pacc, pt, 2)
    vis = (keys[:, None] <= qry[None, :] + d * C) & (keys[:, None] > qry[None, :] + (d * C - W)) & (c + d < nc)
    pt_ = gl.where(vis, gl.exp2(st * qk_scale - lse[None, :]), 0.0)
    dst = gl.convert_layout((pt_ * (dpt * alpha - delta[None, :])).to(k0.dtype), dot_o)
    pt_ = gl.convert_layout(pt_.to(k0.dtype), dot_o)
    if NPROF > 0:
        pacc, pt = prof_tick(pacc, pt, 3)
    dv = warpgroup_mma(pt_, dyd, dv, is_async=True)
    dk = warpgroup_mma(dst, qd, dk, is_async=True)
    dv, dk, _, _, _, _ = warpgroup_mma_wait(0, deps=(dv, dk, pt_, dst, dyd, qd))
    if NPROF > 0:
        pacc, pt = prof_tick(pacc, pt, 4)
    return dk, dv, pacc, pt


@gluon.jit
def _store_rows(ptr, tok, x, C: gl.constexpr, D: gl.constexpr, mma_o: gl.constexpr):
    """x (C, D) in mma_o into rows tok.. of a row-major (., D) tensor."""
    rows_o = gl.arange(0, C, layout=gl.SliceLayout(1, mma_o))
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, mma_o))
    gl.store(ptr + tok.to(gl.int64) * D + (rows_o[:, None] * D + cols_o[None, :]), x.to(ptr.dtype.element_ty))


@gluon.jit
def _dq_partition(q_s, dy_s, k_s, v_s, bar_q, bar_kv, LSE, DELTA, DQ, tok, c, alpha, qk_scale, sm_scale,
                  W: gl.constexpr, C: gl.constexpr, D: gl.constexpr):
    """dq of the chunk's queries from the key tiles c, c-1, c-2 (slots 0, 1, 2)."""
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    dot_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    rows = gl.arange(0, C, layout=gl.SliceLayout(1, mma_s))
    cols = gl.arange(0, C, layout=gl.SliceLayout(0, mma_s))
    lse = gl.load(LSE + tok + rows)
    delta = gl.load(DELTA + tok + rows)
    dq = gl.zeros([C, D], gl.float32, layout=mma_o)
    mbarrier.wait(bar_q.index(0), 0)
    for d in gl.static_range(3):
        mbarrier.wait(bar_kv.index(d), 0)
        dq, _, _ = _dq_tile(q_s.index(0), dy_s.index(0), k_s.index(d), v_s.index(d), dq, lse, delta, rows, cols, d,
                            c, alpha, qk_scale, W, C, mma_s, dot_o, 0, 0, 0)
    _store_rows(DQ, tok, dq * sm_scale, C, D, mma_o)


@gluon.jit
def _dkdv_partition(q_s, dy_s, k_s, v_s, bar_q, bar_kv, LSE, DELTA, DK, DV_, tok, c, nc, alpha, qk_scale,
                    sm_scale, W: gl.constexpr, C: gl.constexpr, D: gl.constexpr, DV: gl.constexpr):
    """dk, dv of the chunk's keys from the query tiles c, c+1, c+2 (slots 0, 1, 2), transposed:
    rows are keys, so p^T and ds^T are left operands from registers."""
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    dot_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    keys = gl.arange(0, C, layout=gl.SliceLayout(1, mma_s))
    qry = gl.arange(0, C, layout=gl.SliceLayout(0, mma_s))
    dk = gl.zeros([C, D], gl.float32, layout=mma_o)
    dv = gl.zeros([C, DV], gl.float32, layout=mma_o)
    mbarrier.wait(bar_kv.index(0), 0)
    for d in gl.static_range(3):
        mbarrier.wait(bar_q.index(d), 0)
        i_tok = tok + gl.minimum(d, nc - 1 - c) * C  # (clamped like its tiles; masked below)
        dk, dv, _, _ = _dkdv_tile(k_s.index(0), v_s.index(0), q_s.index(d), dy_s.index(d), dk, dv,
                                  gl.load(LSE + i_tok + qry), gl.load(DELTA + i_tok + qry), keys, qry, d, c, nc,
                                  alpha, qk_scale, W, C, mma_s, dot_o, 0, 0, 0)
    _store_rows(DK, tok, dk * sm_scale, C, D, mma_o)
    _store_rows(DV_, tok, dv * alpha, C, DV, mma_o)


@gluon.jit
def _win_bwd_kernel(q_d, k_d, v_d, dy_d, LSE, DELTA, ALPHA, DQ, DK, DV_, T, H, qk_scale, sm_scale,
                    MODEL_LAYOUT: gl.constexpr, HAS_ALPHA: gl.constexpr, W: gl.constexpr, C: gl.constexpr,
                    D: gl.constexpr, DV: gl.constexpr):
    """Grid (T // C, B*H). LSE, DELTA (B*H*T,) fp32 (base-2 log-sum-exp; alpha * dy . o); DQ, DK,
    DV_ (B*H*T, .) contiguous; dy read from (B*H*T, Dv) rows."""
    c = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_h = i_bh % H
    nc = T // C
    row0, r_q, c_q, r_k, c_k, r_v, c_v = qkv_rows(MODEL_LAYOUT, i_bh, H, T, D, DV)
    tok = row0 + c * C
    dt: gl.constexpr = q_d.dtype
    q_s = gl.allocate_shared_memory(dt, [3, C, D], q_d.layout)  # queries of chunks c, c+1, c+2
    dy_s = gl.allocate_shared_memory(dt, [3, C, DV], dy_d.layout)
    k_s = gl.allocate_shared_memory(dt, [3, C, D], k_d.layout)  # keys of chunks c, c-1, c-2
    v_s = gl.allocate_shared_memory(dt, [3, C, DV], v_d.layout)
    bar_q = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    bar_kv = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(bar_q.index(i), count=1)
        mbarrier.init(bar_kv.index(i), count=1)
    fence_async_shared()
    for d in gl.static_range(3):  # in the order the two warpgroups need them
        cq = gl.minimum(c + d, nc - 1)
        ck = gl.maximum(c - d, 0)
        load_pair(q_d, dy_d, r_q + cq * C, c_q, row0 + cq * C, 0, bar_q.index(d), q_s.index(d), dy_s.index(d))
        load_pair(k_d, v_d, r_k + ck * C, c_k, r_v + ck * C, c_v, bar_kv.index(d), k_s.index(d), v_s.index(d))
    if HAS_ALPHA:
        alpha = gl.load(ALPHA + i_h)
    else:
        alpha = 1.0
    gl.warp_specialize([
        (_dq_partition, (q_s, dy_s, k_s, v_s, bar_q, bar_kv, LSE, DELTA, DQ, tok, c, alpha, qk_scale, sm_scale,
                         W, C, D)),
        (_dkdv_partition, (q_s, dy_s, k_s, v_s, bar_q, bar_kv, LSE, DELTA, DK, DV_, tok, c, nc, alpha, qk_scale,
                           sm_scale, W, C, D, DV)),
    ], [4], [240])
    for i in gl.static_range(3):
        mbarrier.invalidate(bar_q.index(i))
        mbarrier.invalidate(bar_kv.index(i))


# ----------------------------------------------------------------------------- the walking kernel


@gluon.jit
def _o_rows(O, tok, C: gl.constexpr, DV: gl.constexpr, blk: gl.constexpr):
    """o of the chunk's rows tok.. (C, DV) in registers (``blk``), for ``_publish_rows``."""
    r = gl.arange(0, C, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, blk))
    return gl.load(O + tok.to(gl.int64) * DV + (r[:, None] * DV + cols[None, :]))


@gluon.jit
def _share_rows(dl_s, ls_s, d_ready, sq, dyo, lse, DYO, tok, r, alpha):
    """D = alpha (dy . o) and lse of a query tile's rows (r: their offsets, in dyo's layout) into
    its slot's row vectors (dl_s, ls_s), for both partitions (``d_ready``); dy . o itself into DYO
    (the caller's alpha and sink sums)."""
    gl.store(DYO + tok + r, dyo)
    dl_s.index(sq).store(dyo * alpha)
    ls_s.index(sq).store(lse)
    gl.thread_barrier()  # every warp's rows are written before the one arrival
    mbarrier.arrive(d_ready.index(sq))


@gluon.jit
def _publish_rows(dy_s, bar_qdy, dl_s, ls_s, d_ready, o, LSE, DYO, row0, c0, m, alpha, C: gl.constexpr,
                  blk: gl.constexpr):
    """For query tile m of the segment (chunk c0 + m, slot m % 3): dy . o from o (``_o_rows``, read
    ahead by the caller) and dy (its tile slot), shared (``_share_rows``)."""
    sq = m % 3
    tok = row0 + (c0 + m) * C
    r = gl.arange(0, C, layout=gl.SliceLayout(1, blk))
    lse = gl.load(LSE + tok + r)
    mbarrier.wait(bar_qdy.index(sq), (m // 3) & 1)
    dyo = gl.sum(dy_s.index(sq).load(blk).to(gl.float32) * o.to(gl.float32), axis=1)
    _share_rows(dl_s, ls_s, d_ready, sq, dyo, lse, DYO, tok, r, alpha)


@gluon.jit
def _publish_scores(q_s, dy_s, k_s, v_s, bar_qdy, bar_kv, dl_s, ls_s, d_ready, LSE, DYO, row0, c0, m, alpha, qk_scale,
                    W: gl.constexpr, C: gl.constexpr, mma_s: gl.constexpr):
    """For query tile m of the segment (chunk c0 + m, slot m % 3): dy . o as sum_s p_ts (dy_t . v_s)
    over its three key tiles (m - 2..m, slots (m' + 2) % 3), p from the scores and lse, so that o is
    not read (nor stored by the forward), shared (``_share_rows``); returns (lse, D) for the caller."""
    sq = m % 3
    c = c0 + m
    tok = row0 + c * C
    rows = gl.arange(0, C, layout=gl.SliceLayout(1, mma_s))
    cols = gl.arange(0, C, layout=gl.SliceLayout(0, mma_s))
    lse = gl.load(LSE + tok + rows)
    mbarrier.wait(bar_qdy.index(sq), (m // 3) & 1)
    dyo = gl.zeros([C], gl.float32, layout=gl.SliceLayout(1, mma_s))
    for d in gl.static_range(3):  # key tiles c - 2, c - 1, c
        mk = m - 2 + d
        sk = (mk + 2) % 3
        mbarrier.wait(bar_kv.index(sk), ((mk + 2) // 3) & 1)
        s, dp = _score_pair(q_s.index(sq), k_s.index(sk), dy_s.index(sq), v_s.index(sk), C, mma_s)
        dyo += gl.sum(_probs(s, lse, rows, cols, 2 - d, c, qk_scale, W, C) * dp, axis=1)
    _share_rows(dl_s, ls_s, d_ready, sq, dyo, lse, DYO, tok, rows, alpha)
    return lse, dyo * alpha


@gluon.jit
def _walk_dq_partition(q_s, dy_s, k_s, v_s, dl_s, ls_s, out_s, bar_qdy, bar_kv, qdy_free, kv_free, d_ready, k_d, v_d,
                       LSE, DELTA, dq_d, O, PROF, prof_row, row0, r_k, c_k, r_v, c_v, c0, n, nc, alpha, qk_scale,
                       sm_scale,
                       W: gl.constexpr, C: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
                       OWN_DELTA: gl.constexpr, D_SCORES: gl.constexpr, NPROF: gl.constexpr):
    """dq of the segment's query chunks c0 + j in order, each from its key tiles oldest first, out by
    TMA through ``out_s``'s second tile (stored from registers it cost 1.4K cycles a chunk). Key
    tile m (chunk c0 + m, m >= -2) lives in slot (m + 2) % 3, query tile m (m >= 0) in slot m % 3.
    Once it and the dk/dv partition are done with key tile j - 2, this partition brings key
    tile j + 1 into its slot (needed last, by the next chunk). With OWN_DELTA it also forms D
    and shares lse for every query tile (``_publish_rows``): tile j + 1's once the dk/dv partition
    is done with key tile j - 2 (that partition needs it two key chunks later), the first before
    the walk and the one past the segment's end after it. With D_SCORES instead, D of every query
    tile from its scores (``_publish_scores``) as the tile comes, and of the two past the segment's
    end after the walk (their key tiles brought too)."""
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    dot_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # o and dy rows for D
    rows = gl.arange(0, C, layout=gl.SliceLayout(1, mma_s))
    cols = gl.arange(0, C, layout=gl.SliceLayout(0, mma_s))
    pacc = 0
    pt = 0
    if NPROF > 0:
        pacc, pt = prof_init()
    FROM_O: gl.constexpr = OWN_DELTA and not D_SCORES
    n_keys = n  # key tiles this partition brings: with D_SCORES also the one after the segment
    if D_SCORES:
        n_keys = gl.minimum(n + 1, nc - c0)
    if FROM_O:
        _publish_rows(dy_s, bar_qdy, dl_s, ls_s, d_ready, _o_rows(O, row0 + c0 * C, C, DV, blk), LSE, DELTA, row0, c0,
                      0, alpha, C, blk)
        o_next = _o_rows(O, row0 + gl.minimum(c0 + 1, nc - 1) * C, C, DV, blk)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 6)
    for j in range(n):
        c = c0 + j
        tok = row0 + c * C
        sq = j % 3
        if not OWN_DELTA:
            lse = gl.load(LSE + tok + rows)
            delta = gl.load(DELTA + tok + rows)
        if D_SCORES:
            lse, delta = _publish_scores(q_s, dy_s, k_s, v_s, bar_qdy, bar_kv, dl_s, ls_s, d_ready, LSE, DELTA, row0,
                                         c0, j, alpha, qk_scale, W, C, mma_s)
            if NPROF > 0:
                pacc, pt = prof_tick(pacc, pt, 6)
        mbarrier.wait(bar_qdy.index(sq), (j // 3) & 1)
        if FROM_O:
            lse = ls_s.index(sq).load(gl.SliceLayout(1, mma_s))
            delta = dl_s.index(sq).load(gl.SliceLayout(1, mma_s))
        dq = gl.zeros([C, D], gl.float32, layout=mma_o)
        for d in gl.static_range(3):  # key tiles c - 2, c - 1, c
            m = j - 2 + d
            sk = (m + 2) % 3
            if NPROF > 0:
                pacc, pt = prof_tick(pacc, pt, 7)
            mbarrier.wait(bar_kv.index(sk), ((m + 2) // 3) & 1)
            if NPROF > 0:
                pacc, pt = prof_tick(pacc, pt, 0)
            dq, pacc, pt = _dq_tile(q_s.index(sq), dy_s.index(sq), k_s.index(sk), v_s.index(sk), dq, lse, delta,
                                    rows, cols, 2 - d, c, alpha, qk_scale, W, C, mma_s, dot_o, pacc, pt, NPROF)
            if d == 0:
                gl.thread_barrier()  # every warp is past its MMAs on the tile
                mbarrier.arrive(kv_free.index(sk))
                if m + 3 < n_keys:
                    mbarrier.wait(kv_free.index(sk), ((m + 2) // 3) & 1)
                    ck = c0 + m + 3
                    load_pair(k_d, v_d, r_k + ck * C, c_k, r_v + ck * C, c_v, bar_kv.index(sk), k_s.index(sk),
                               v_s.index(sk))
                if NPROF > 0:
                    pacc, pt = prof_tick(pacc, pt, 1)
                if FROM_O:
                    if c + 1 < nc:
                        _publish_rows(dy_s, bar_qdy, dl_s, ls_s, d_ready, o_next, LSE, DELTA, row0, c0, j + 1, alpha,
                                      C, blk)
                    # the o of the tile after, read a chunk ahead: read at the chunk's start, its latency
                    # was still waited for here (ncu, 2026-11-26)
                    o_next = _o_rows(O, row0 + gl.minimum(c + 2, nc - 1) * C, C, DV, blk)
                    if NPROF > 0:
                        pacc, pt = prof_tick(pacc, pt, 6)
        # by TMA through a staging tile of its own (written once its store of the chunk before has left)
        store_tile(dq_d, tok, dq * sm_scale, out_s.index(1), 0)
        gl.thread_barrier()
        mbarrier.arrive(qdy_free.index(sq))
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 5)
    if FROM_O:
        if c0 + n + 1 < nc:  # the query tile after next, which the segment's last key chunk sees
            _publish_rows(dy_s, bar_qdy, dl_s, ls_s, d_ready, _o_rows(O, row0 + (c0 + n + 1) * C, C, DV, blk), LSE,
                          DELTA, row0, c0, n + 1, alpha, C, blk)
    if D_SCORES:  # the two query tiles after the segment, which its last key chunks see
        if c0 + n < nc:  # (its key tile n came in the walk)
            _publish_scores(q_s, dy_s, k_s, v_s, bar_qdy, bar_kv, dl_s, ls_s, d_ready, LSE, DELTA, row0, c0, n,
                            alpha, qk_scale, W, C, mma_s)
        if c0 + n + 1 < nc:  # key tile n + 1 into key tile n - 2's slot, once both partitions are done with it
            sk = n % 3
            gl.thread_barrier()
            mbarrier.arrive(kv_free.index(sk))
            mbarrier.wait(kv_free.index(sk), (n // 3) & 1)
            ck = c0 + n + 1
            load_pair(k_d, v_d, r_k + ck * C, c_k, r_v + ck * C, c_v, bar_kv.index(sk), k_s.index(sk), v_s.index(sk))
            _publish_scores(q_s, dy_s, k_s, v_s, bar_qdy, bar_kv, dl_s, ls_s, d_ready, LSE, DELTA, row0, c0, n + 1,
                            alpha, qk_scale, W, C, mma_s)
    tma.store_wait(0)
    if NPROF > 0:
        pacc, pt = prof_tick(pacc, pt, 6)
        gl.store(PROF + prof_row * 16 + gl.arange(0, 8, layout=pacc.type.layout), pacc)


@gluon.jit
def _walk_dkdv_partition(q_s, dy_s, k_s, v_s, dl_s, ls_s, out_s, bar_qdy, bar_kv, qdy_free, kv_free, d_ready, q_d,
                         dy_d, LSE, DELTA, dk_d, dv_d, PROF, prof_row, row0, r_q, c_q, c0, n, nc, alpha, qk_scale,
                         sm_scale, W: gl.constexpr, C: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
                         OWN_DELTA: gl.constexpr, NPROF: gl.constexpr):
    """dk, dv of the segment's key chunks c0 + i in order, each from the query tiles i, i + 1, i + 2.
    Once it and the dq partition are done with query tile i, this partition brings query tile
    i + 3 into its slot. dk and dv leave by TMA through one staging tile (``out_s``'s first; the
    dq partition has the second). With OWN_DELTA, D
    and lse of a query tile come from the dq partition (``d_ready``); a tile past the sequence's
    end (clamped, masked) waits for nothing and takes D = 0."""
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    dot_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    keys = gl.arange(0, C, layout=gl.SliceLayout(1, mma_s))
    qry = gl.arange(0, C, layout=gl.SliceLayout(0, mma_s))
    pacc = 0
    pt = 0
    if NPROF > 0:
        pacc, pt = prof_init()
    # the key tiles before the segment (m = -2, -1) are no key chunk of this partition's
    mbarrier.arrive(kv_free.index(0))
    mbarrier.arrive(kv_free.index(1))
    for i in range(n):
        c = c0 + i
        tok = row0 + c * C
        sk = (i + 2) % 3
        mbarrier.wait(bar_kv.index(sk), ((i + 2) // 3) & 1)
        dk = gl.zeros([C, D], gl.float32, layout=mma_o)
        dv = gl.zeros([C, DV], gl.float32, layout=mma_o)
        for d in gl.static_range(3):  # query tiles c, c + 1, c + 2
            m = i + d
            sq = m % 3
            if NPROF > 0:
                pacc, pt = prof_tick(pacc, pt, 7)
            mbarrier.wait(bar_qdy.index(sq), (m // 3) & 1)
            if OWN_DELTA:
                real = c + d < nc
                if real:
                    mbarrier.wait(d_ready.index(sq), (m // 3) & 1)
                lse = ls_s.index(sq).load(gl.SliceLayout(0, mma_s))
                delta = gl.where(real, dl_s.index(sq).load(gl.SliceLayout(0, mma_s)), 0.0)  # (never NaN * 0)
            else:
                i_tok = row0 + gl.minimum(c + d, nc - 1) * C  # (clamped like its tiles; masked below)
                lse = gl.load(LSE + i_tok + qry)
                delta = gl.load(DELTA + i_tok + qry)
            if NPROF > 0:
                pacc, pt = prof_tick(pacc, pt, 0)
            dk, dv, pacc, pt = _dkdv_tile(k_s.index(sk), v_s.index(sk), q_s.index(sq), dy_s.index(sq), dk, dv, lse,
                                          delta, keys, qry, d, c, nc, alpha, qk_scale, W, C, mma_s, dot_o, pacc, pt,
                                          NPROF)
            if d == 0:
                gl.thread_barrier()
                mbarrier.arrive(qdy_free.index(sq))
                if i + 3 <= n + 1:
                    mbarrier.wait(qdy_free.index(sq), (i // 3) & 1)
                    cq = gl.minimum(c + 3, nc - 1)
                    load_pair(q_d, dy_d, r_q + cq * C, c_q, row0 + cq * C, 0, bar_qdy.index(sq), q_s.index(sq),
                               dy_s.index(sq))
                if NPROF > 0:
                    pacc, pt = prof_tick(pacc, pt, 1)
        # by TMA through one staging tile, each written once the store before it has left
        store_tile(dk_d, tok, dk * sm_scale, out_s.index(0), 0)
        store_tile(dv_d, tok, dv * alpha, out_s.index(0), 0)
        mbarrier.arrive(kv_free.index(sk))
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 5)
    tma.store_wait(0)
    if NPROF > 0:
        pacc, pt = prof_tick(pacc, pt, 7)
        gl.store(PROF + prof_row * 16 + gl.arange(0, 8, layout=pacc.type.layout), pacc)


@gluon.jit
def _win_bwd_walk_kernel(q_d, k_d, v_d, dy_d, LSE, DELTA, ALPHA, dk_d, dv_d, dq_d, O, PROF, T, H, SEG_CHUNKS, qk_scale,
                         sm_scale, MODEL_LAYOUT: gl.constexpr, HAS_ALPHA: gl.constexpr, W: gl.constexpr,
                         C: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, OWN_DELTA: gl.constexpr,
                         NPROF: gl.constexpr, D_SCORES: gl.constexpr = False):
    """Grid (segments, B*H): as ``_win_bwd_kernel``, but one program walks a segment of SEG_CHUNKS
    chunks (the last may be shorter), its twelve tile slots two rings: query and dy tiles of three
    consecutive chunks, key and value tiles of three, each tile read once per segment and brought
    by TMA while the chunks before are computed. The dq partition works on query chunk c with key
    tiles c - 2..c, the dk/dv partition on key chunk c with query tiles c..c + 2, each at its own
    pace; ``qdy_free`` and ``kv_free`` (two arrivals each: both partitions) free a slot for the tile
    three chunks on. dk_d, dv_d, dq_d: TMA descriptors of the (B*H*T, D) outputs. OWN_DELTA: D is formed
    here from O (B*H*T, Dv) (the dq partition, as each query tile comes) and DELTA receives dy . o;
    with D_SCORES too, from the scores (O not read); else DELTA holds D, from ``window``'s delta pass.
    NPROF > 0 (profiling builds): each partition's cycles in 8 phases into PROF (programs * 2, 16)."""
    i_s = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_h = i_bh % H
    nc = T // C
    row0, r_q, c_q, r_k, c_k, r_v, c_v = qkv_rows(MODEL_LAYOUT, i_bh, H, T, D, DV)
    c0 = i_s * SEG_CHUNKS
    n = gl.minimum(SEG_CHUNKS, nc - c0)
    dt: gl.constexpr = q_d.dtype
    q_s = gl.allocate_shared_memory(dt, [3, C, D], q_d.layout)
    dy_s = gl.allocate_shared_memory(dt, [3, C, DV], dy_d.layout)
    k_s = gl.allocate_shared_memory(dt, [3, C, D], k_d.layout)
    v_s = gl.allocate_shared_memory(dt, [3, C, DV], v_d.layout)
    out_s = gl.allocate_shared_memory(dt, [2, C, D], dk_d.layout)  # staging tiles: dk's and dv's, dq's
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    dl_s = gl.allocate_shared_memory(gl.float32, [3, C], flat)  # D of the query tiles (OWN_DELTA)
    ls_s = gl.allocate_shared_memory(gl.float32, [3, C], flat)  # their lse
    bar_qdy = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    bar_kv = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    qdy_free = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    d_ready = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(bar_qdy.index(i), count=1)
        mbarrier.init(bar_kv.index(i), count=1)
        mbarrier.init(qdy_free.index(i), count=2)
        mbarrier.init(kv_free.index(i), count=2)
        mbarrier.init(d_ready.index(i), count=1)
    fence_async_shared()
    for m in gl.static_range(3):  # key tiles -2, -1, 0 (slots 0, 1, 2) and query tiles 0, 1, 2 (clamped)
        ck = gl.maximum(c0 + m - 2, 0)
        cq = gl.minimum(c0 + m, nc - 1)
        load_pair(k_d, v_d, r_k + ck * C, c_k, r_v + ck * C, c_v, bar_kv.index(m), k_s.index(m), v_s.index(m))
        load_pair(q_d, dy_d, r_q + cq * C, c_q, row0 + cq * C, 0, bar_qdy.index(m), q_s.index(m), dy_s.index(m))
    if HAS_ALPHA:
        alpha = gl.load(ALPHA + i_h)
    else:
        alpha = 1.0
    prof_row = (i_bh * gl.num_programs(0) + i_s) * 2
    gl.warp_specialize([
        (_walk_dq_partition, (q_s, dy_s, k_s, v_s, dl_s, ls_s, out_s, bar_qdy, bar_kv, qdy_free, kv_free, d_ready, k_d,
                              v_d, LSE, DELTA, dq_d, O, PROF, prof_row, row0, r_k, c_k, r_v, c_v, c0, n, nc, alpha,
                              qk_scale, sm_scale, W, C, D, DV, OWN_DELTA, D_SCORES, NPROF)),
        (_walk_dkdv_partition, (q_s, dy_s, k_s, v_s, dl_s, ls_s, out_s, bar_qdy, bar_kv, qdy_free, kv_free, d_ready,
                                q_d, dy_d, LSE, DELTA, dk_d, dv_d, PROF, prof_row + 1, row0, r_q, c_q, c0, n, nc, alpha,
                                qk_scale, sm_scale, W, C, D, DV, OWN_DELTA, NPROF)),
    ], [4], [256])  # all the registers there are (the dk/dv partition spilled with 248)
    for i in gl.static_range(3):
        mbarrier.invalidate(bar_qdy.index(i))
        mbarrier.invalidate(bar_kv.index(i))
        mbarrier.invalidate(qdy_free.index(i))
        mbarrier.invalidate(kv_free.index(i))
        mbarrier.invalidate(d_ready.index(i))


def supports_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, kmin) -> bool:
    """Whether ``bwd`` takes these inputs (see the module's scope)."""
    if sm_major(q) != 9:
        return False
    xs = (q, k, v)
    return (kmin is None and window <= 2 * BT + 1 and q.dtype in (torch.bfloat16, torch.float16)
            and all(x.dtype == q.dtype and x.shape[-1] == WIDTH and x.shape[:3] == q.shape[:3] for x in xs)
            and q.shape[2] % BT == 0 and tma_readable(xs))


def walk_segments(programs: int, n_chunks: int, sms: int) -> int:
    """Segments per (batch x head) for the walking kernel: doubled while the programs leave
    multiprocessors idle and every segment keeps at least 8 chunks (each one's two rings fill
    with tiles of the chunks around it, read again by its neighbour)."""
    return chain_segments(programs, n_chunks, sms, 8)


def bwd(q, k, v, dy, lse, delta, alpha, dq, dk, dv, *, window: int, scale: float, walk: bool = False,
        sms: int = 132, o: Optional[torch.Tensor] = None, scores_delta: bool = False,
        prof: Optional[torch.Tensor] = None) -> None:
    """dq, dk, dv ((B, H, T, .) contiguous) from dy ((B, H, T, Dv) contiguous), lse ((B*H, T) fp32,
    from the forward) and alpha (H,) fp32 or None. ``delta`` (B*H, T) fp32: D from ``window``'s
    delta pre-pass; or, with ``o`` (the window's output, (B, H, T, Dv) contiguous; walking kernel
    only), filled here with dy . o (no alpha: for the caller's alpha and sink sums) while the
    kernel forms D itself; or, with ``scores_delta`` (walking kernel, no o), the same from the
    scores: dy . o_t = sum_s p_ts (dy_t . v_s), so that o need not exist.
    ``walk``: the walking kernel (``_win_bwd_walk_kernel``), in ``walk_segments`` segments for
    ``sms`` multiprocessors. ``prof`` (walking kernel only): an int64 tensor of (programs * 2, 16)
    for a profiling build's cycle counters (each partition's 8 phases)."""
    B, H, T, D = q.shape
    DV = v.shape[-1]
    tiles = tma_tiles([q, k, v, dy], [BT, WIDTH])
    if tiles is None or not dy.is_contiguous():
        raise ValueError("window_gluon.bwd: inputs outside its scope (supports_bwd)")
    if (o is not None or prof is not None or scores_delta) and not walk:
        raise ValueError("window_gluon.bwd: o, scores_delta and prof are arguments of the walking kernel (walk=True)")
    if o is not None and scores_delta:
        raise ValueError("window_gluon.bwd: D comes from o or from the scores (scores_delta), not both")
    if o is not None and not (o.is_contiguous() and o.shape == dy.shape and o.dtype == dy.dtype):
        raise ValueError(f"window_gluon.bwd: o must be contiguous {tuple(dy.shape)} {dy.dtype}, got "
                         f"{tuple(o.shape)} {o.dtype} (contiguous: {o.is_contiguous()})")
    descs, views = tiles
    common = (lse, delta, alpha if alpha is not None else lse, dq)
    scales = (scale * 1.4426950408889634, scale)
    consts = dict(MODEL_LAYOUT=model_layout_bits(views[:3]), HAS_ALPHA=alpha is not None, W=window, C=BT, D=D, DV=DV,
                  num_warps=4)
    if walk:
        nc = T // BT
        seg_chunks = -(-nc // walk_segments(B * H, nc, sms))
        grid = (-(-nc // seg_chunks), B * H)
        if prof is not None and tuple(prof.shape) != (grid[0] * grid[1] * 2, 16):
            raise ValueError(f"window_gluon.bwd: prof must be ({grid[0] * grid[1] * 2}, 16), got {tuple(prof.shape)}")
        outs = tma_tiles([dk, dv, dq], [BT, WIDTH])
        if outs is None or not (dk.is_contiguous() and dv.is_contiguous() and dq.is_contiguous()):
            raise ValueError("window_gluon.bwd: dq, dk and dv must be contiguous (B, H, T, 128) for the walking kernel")
        _win_bwd_walk_kernel[grid](*descs, *common[:3], *outs[0], o if o is not None else dy,
                                   prof if prof is not None else lse, T, H, seg_chunks, *scales,
                                   OWN_DELTA=o is not None or scores_delta, D_SCORES=scores_delta,
                                   NPROF=8 if prof is not None else 0, **consts)
    else:
        _win_bwd_kernel[(T // BT, B * H)](*descs, *common, dk, dv, T, H, *scales, **consts)


def compile_for_hopper(window: int = 128, has_alpha: bool = True, model_layout: int = 0, walk: bool = False,
                       own_delta: bool = True, nprof: int = 0, scores_delta: bool = False):
    """Compile the kernel (``walk``: the walking one, forming D itself with ``own_delta``, from the
    scores with ``scores_delta``, with cycle counters with ``nprof``) for sm_90a without a GPU (CI,
    probes); returns Triton's compiled kernel."""
    from ..gla.gluon import compile_gluon, compile_args

    d, _, f32, bf = compile_args()
    args = dict(q_d=d, k_d=d, v_d=d, dy_d=d, LSE=f32, DELTA=f32, ALPHA=f32, T=256, H=4, qk_scale=0.1,
                sm_scale=0.1)
    if walk:
        args.update(dk_d=d, dv_d=d, dq_d=d, O=bf, PROF=torch.empty(16, dtype=torch.int64), SEG_CHUNKS=3)
    else:
        args.update(DQ=bf, DK=bf, DV_=bf)
    consts = dict(MODEL_LAYOUT=model_layout, HAS_ALPHA=has_alpha, W=window, C=BT, D=WIDTH, DV=WIDTH)
    if walk:
        consts.update(OWN_DELTA=own_delta or scores_delta, NPROF=nprof, D_SCORES=scores_delta)
    return compile_gluon(_win_bwd_walk_kernel if walk else _win_bwd_kernel, args, consts, num_warps=4)
