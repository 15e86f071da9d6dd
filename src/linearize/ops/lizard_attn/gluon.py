"""The whole Lizard forward in one hand-written Hopper kernel (Gluon): gated branch, window with
sinks and the combine; it can also write the window's decode state from its key/value ring
(``WSTATE``), and (``TRAIN``) for training it also stores what the backward reads (den, lse, the
state entering every chunk and the one leaving the last, and o_g, o_w unless told not to:
STORE_OG, STORE_OW).

    y = gla(phi_q, phi_k, v, log_g) / den + alpha_h * window(q_w, k_w, v; sinks)

One program per (segment, batch x head) walks its chunks of 64 tokens in order, in two
warpgroups (``gl.warp_specialize``) that hand over through shared memory and mbarriers: the
*output* warpgroup (the window, the gated output from the state's copy, the combine, y out by
TMA; it issues every load but phi_k's) and the *state* warpgroup (A and the normaliser, K~, S and
z in fp32 registers, S's bf16 copy, the next phi_k: ``gla.gluon.state_partition``, which GLA's
own fused forward runs too). Each warpgroup owns whole rows of its tiles,
so no reduction or layout change crosses warpgroups. Every tile is read from HBM once: the
window's keys and values of the two chunks before stay in a ring of three shared-memory slots,
and each chunk's tiles come by TMA while the chunk before is computed.
Per chunk, with b_t the gates' cumulative sum from the chunk start (<= 0, decreasing):

    window: s = q_w k_w^T * scale over the chunk and the two before (masked to t - w < s <= t),
            softmax with the sink logits in the denominator, o_w = P V
    gated:  A = (phi_q phi_k^T) * e^{b_t - b_s} (s <= t),  num = e^{b_t} phi_q S + A V,
            den = e^{b_t} phi_q . z + rowsum(A)
    state:  S <- e^{b_end} S + (phi_k * e^{b_end - b_s})^T V,  z likewise
    y     = num / (den + eps) + alpha_h * o_w

Only factors <= 1 are ever formed (docs/design.md, Lizard's factorisation). The Triton kernels
(``ops.lizard_attn.fused``) run the same forward as three passes, about twice as long; a fused walk
needs the warp specialisation and explicit prefetching that Triton 3.6 does not give on Hopper.

Scope: CUDA sm_90, bf16/fp16 inputs, F = D = Dv = 128, T a multiple of 64, window 65..129
(three key tiles), v2 sink logits or none, normalised features (not log-space), no padding;
inputs (B, H, T, D) contiguous or (B, T, H, D) transposed, as a model's projections come.
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..backend.dispatch import sm_major
from ..gla.gluon import (gated_smem, tile_at_step, load_pair, load_tile, prof_init, row_col, state_partition, store_tile,
                        prof_tick, chunk_gates, model_layout_bits, segment_plan, smem_layout, state_slots, tma_readable,
                        view2d)

BT = 64  # tokens per chunk
LOG2E = 1.4426950408889634


@gluon.jit
def _output_partition(qw_d, kw_d, v_d, fq_d, y_d, BL, SINK, ALPHA, og_d, ow_d, LSE, DEN, WK, WV, k_s, v_s, q_s, fq_s,
                      st_s, a_s, den_s, y_s, kv_bar, q_bar, st_ready, st_free, a_ready, row0, r_q, c_q, r_k, c_k, r_v,
                      c_v, r_fq, c_fq, c0, nc, i_h, i_bh, i_s, nseg, qk_scale, eps, T,
                      PROF, W: gl.constexpr, NSINK: gl.constexpr, F: gl.constexpr, DV: gl.constexpr, C: gl.constexpr,
                      NPROF: gl.constexpr, TRAIN: gl.constexpr, STORE_OG: gl.constexpr, STORE_OW: gl.constexpr,
                      WSTATE: gl.constexpr):
    """One warpgroup: per chunk the window (scores, softmax with sinks, P V), then the gated output
    e^{b_t} phi_q S + A V from the state partition's copies of S (st_s) and A (a_s) over its den
    (den_s), the combine, and y out by TMA. It issues every load but phi_k's (the state partition
    rescales phi_k in place, then brings the next)."""
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    dot_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    col_s: gl.constexpr = gl.SliceLayout(0, mma_s)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    dt: gl.constexpr = qw_d.dtype

    if NSINK > 0:  # the sinks' log-sum-exp (log2 units): a logit each in the window's denominator
        sk = gl.load(SINK + i_h * NSINK + gl.arange(0, NSINK, layout=gl.BlockedLayout([1], [32], [4], [0])))
        sk = sk * 1.4426950408889634
        smax = gl.max(sk, axis=0)
        sink2 = smax + gl.log2(gl.sum(gl.exp2(sk - smax), axis=0))
    else:
        sink2 = -float("inf")
    alpha = gl.load(ALPHA + i_h)
    rows_s = gl.arange(0, C, layout=row_s)
    cols_s = gl.arange(0, C, layout=col_s)
    rows_o = gl.arange(0, C, layout=row_o)
    causal = cols_s[None, :] <= rows_s[:, None]
    NST: gl.constexpr = (1 + STORE_OG + STORE_OW) if TRAIN else 1  # tiles stored a chunk

    if NPROF > 0:
        pacc, pt = prof_init()
    for ci in range(nc):
        c = c0 + ci
        ph = ci & 1
        j = ci + 2  # ring index of this chunk's keys/values; j - 1 and j - 2 hold the two before
        more = ci + 1 < nc
        bl = BL + row0 + c * C  # b_t, the gates' cumulative sum from the chunk start (precomputed)
        e_t = gl.exp(gl.load(bl + rows_o))  # (issued early: its latency hides behind the window)

        # ---- window: scores against the three key tiles, softmax with the sinks, P V (async)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 7)
        mbarrier.wait(q_bar.index(0), ph)
        mbarrier.wait(kv_bar.index(j % 3), (j // 3) & 1)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 0)
        k0 = k_s.index((j - 2) % 3)
        k1 = k_s.index((j - 1) % 3)
        k2 = k_s.index(j % 3)
        qv = tile_at_step(q_s, ci)
        s0 = warpgroup_mma(qv, k0.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False,
                           is_async=True)
        s1 = warpgroup_mma(qv, k1.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False,
                           is_async=True)
        s2 = warpgroup_mma(qv, k2.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False,
                           is_async=True)
        s0, s1, s2, _, _, _, _ = warpgroup_mma_wait(0, deps=(s0, s1, s2, qv, k0, k1, k2))
        gl.thread_barrier()
        if more:
            load_tile(qw_d, r_q + (c + 1) * C, c_q, q_bar.index(0), q_s)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 1)
        # The visible keys of the chunk two back (col > row + 128 - W) and of the chunk itself
        # (col <= row) never overlap: one merged tile takes both, so a query pays two tiles of
        # exponentials for its three key tiles.
        upper = cols_s[None, :] > rows_s[:, None] + (2 * C - W)
        s1 = gl.where((cols_s[None, :] > rows_s[:, None] + (C - W)) & (c >= 1), s1 * qk_scale, -float("inf"))
        sm = gl.where(causal, s2, gl.where(upper & (c >= 2), s0, -float("inf"))) * qk_scale
        m = gl.maximum(gl.max(gl.maximum(sm, s1), axis=1), sink2)
        pm = gl.exp2(sm - m[:, None])
        p1 = gl.exp2(s1 - m[:, None])
        l_w = gl.sum(pm + p1, axis=1) + gl.exp2(sink2 - m)
        p0 = gl.convert_layout(gl.where(causal, 0.0, pm).to(dt), dot_o)
        p1 = gl.convert_layout(p1.to(dt), dot_o)
        p2 = gl.convert_layout(gl.where(causal, pm, 0.0).to(dt), dot_o)
        v0 = v_s.index((j - 2) % 3)
        v1 = v_s.index((j - 1) % 3)
        v2 = v_s.index(j % 3)
        o_w = warpgroup_mma(p0, v0, gl.zeros([C, DV], gl.float32, layout=mma_o), use_acc=False, is_async=True)
        o_w = warpgroup_mma(p1, v1, o_w, is_async=True)
        o_w = warpgroup_mma(p2, v2, o_w, is_async=True)

        # ---- gated: e^{b_t} phi_q S + A V, from the state partition's copies of S, z and A
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 2)
        mbarrier.wait(q_bar.index(1), ph)
        mbarrier.wait(st_ready, ph)
        mbarrier.wait(a_ready, ph)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 3)
        # P V done first: the three P operands' registers are free before the gated products'
        # (queuing these behind P V instead spills: 0.82 against 0.75 ms at B16 T2048, v5's JSON)
        o_w, _, _, _, _, _ = warpgroup_mma_wait(0, deps=(o_w, p0, p1, p2, v0, v1))
        fqv = tile_at_step(fq_s, ci)
        stv = tile_at_step(st_s, ci)
        o_i = warpgroup_mma(fqv, stv, gl.zeros([C, DV], gl.float32, layout=mma_o), use_acc=False, is_async=True)
        o_i, _, _ = warpgroup_mma_wait(0, deps=(o_i, fqv, stv))
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 4)
        av = tile_at_step(a_s, ci)
        num = warpgroup_mma(av, v2, o_i * e_t[:, None], is_async=True)
        den = den_s.load(row_o)
        num, _, _ = warpgroup_mma_wait(0, deps=(num, av, v2))
        gl.thread_barrier()
        mbarrier.arrive(st_free)  # the copies of S, z and A are read: the state partition may write the next
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 5)
        if more:  # phi_q (the state partition's A is done: a_ready)
            load_tile(fq_d, r_fq + (c + 1) * C, c_fq, q_bar.index(1), fq_s)
        if more:  # the oldest key/value slot: the state partition is past its chunk (st_ready)
            load_pair(kw_d, v_d, r_k + (c + 1) * C, c_k, r_v + (c + 1) * C, c_v, kv_bar.index((j + 1) % 3),
                     k_s.index((j + 1) % 3), v_s.index((j + 1) % 3))

        # ---- combine and store
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 6)
        # one division per row, not per element
        # The tiles go out by TMA through two staging slots in turn: store k of the walk through slot
        # k % 2, once the store before it in that slot (k - 2) has left. (With o_g into slot 0 after
        # all stores had left, y's store of each chunk waited for the last one's: dropping o_g's
        # store, which also dropped that wait, shortened the training forward more than its bytes.)
        k = ci * NST  # this chunk's first store
        if TRAIN:  # and what the backward reads: o_g, o_w (normalised; STORE_OG, STORE_OW), den, lse (base 2)
            tok = row0 + c * C
            gl.store(DEN + tok + rows_o, den)
            gl.store(LSE + tok + rows_s, m + gl.log2(l_w))
            o_g = num * (1.0 / (den + eps))[:, None]
            if STORE_OG:
                store_tile(og_d, tok, o_g, y_s.index(k % 2), 1)
                k += 1
            y = o_g + o_w * (alpha / gl.convert_layout(l_w, row_o))[:, None]
            if STORE_OW:
                store_tile(ow_d, tok, o_w * (1.0 / gl.convert_layout(l_w, row_o))[:, None], y_s.index(k % 2), 1)
                k += 1
            store_tile(y_d, tok, y, y_s.index(k % 2), 1)
        else:
            y = num * (1.0 / (den + eps))[:, None] + o_w * (alpha / gl.convert_layout(l_w, row_o))[:, None]
            store_tile(y_d, row0 + c * C, y, y_s.index(k % 2), 1)
    if WSTATE:
        if i_s == nseg - 1:
            _window_state_out(WK, WV, k_s, v_s, i_bh, nc, T, W - 1, C)
    tma.store_wait(0)
    if NPROF > 0:
        gl.store(PROF + (i_bh * nseg + i_s) * 16 + gl.arange(0, 8, layout=pacc.type.layout), pacc)
    return (alpha,)


@gluon.jit
def _window_state_out(WK, WV, k_s, v_s, i_bh, nc, T, L, C: gl.constexpr):
    """The window's decode state, the last L (<= 2 C) keys and values in fp32 ((B*H, L, D) rows
    each), from the ring's last two chunks (slots nc % 3 and (nc + 1) % 3 of a walk of nc chunks);
    rows before the sequence's start (T < L) are zeros, as ``window._new_state`` leaves them."""
    D: gl.constexpr = k_s.shape[2]
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, C, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    for d in gl.static_range(2):  # the chunk before the last, then the last
        tok = (T // C - 2 + d) * C + r
        row = tok - (T - L)
        keep = (row >= 0)[:, None]
        real = (tok >= 0)[:, None]
        off = (i_bh.to(gl.int64) * L + row)[:, None] * D + cols[None, :]
        slot = (nc + d) % 3
        gl.store(WK + off, gl.where(real, k_s.index(slot).load(blk).to(gl.float32), 0.0), mask=keep)
        gl.store(WV + off, gl.where(real, v_s.index(slot).load(blk).to(gl.float32), 0.0), mask=keep)


@gluon.jit
def _lizard_fwd_kernel(qw_d, kw_d, v_d, fq_d, fk_d, y_d, sc_d, og_d, ow_d, BL, SINK, ALPHA, S_IN, Z_IN, S_OUT,
                       Z_OUT, PROF, LSE, DEN, ZC, WK, WV,
                       T, H, seg_len, nseg, qk_scale, eps, MODEL_LAYOUT: gl.constexpr,
                       W: gl.constexpr, NSINK: gl.constexpr, HAS_INIT: gl.constexpr, NPROF: gl.constexpr,
                       D: gl.constexpr, F: gl.constexpr, DV: gl.constexpr, C: gl.constexpr, TRAIN: gl.constexpr,
                       STORE_OG: gl.constexpr = True, STORE_OW: gl.constexpr = True, WSTATE: gl.constexpr = False,
                       PAIRED: gl.constexpr = False, FINAL: gl.constexpr = True):
    i_s = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_h = i_bh % H
    row0 = i_bh * T  # y's and b's (B*H*T, .) rows: this batch x head's first
    # each input's first row and its column in its own 2-D view (``gla_gluon.view2d``): bit i of
    # MODEL_LAYOUT set for input i (q_w, k_w, v, phi_q, phi_k) read from (B*T, H*D) rows
    i_b = i_bh // H
    r_q, c_q = row_col(MODEL_LAYOUT, 0, i_b, i_h, row0, T, D)
    r_k, c_k = row_col(MODEL_LAYOUT, 1, i_b, i_h, row0, T, D)
    r_v, c_v = row_col(MODEL_LAYOUT, 2, i_b, i_h, row0, T, DV)
    r_fq, c_fq = row_col(MODEL_LAYOUT, 3, i_b, i_h, row0, T, F)
    r_fk, c_fk = row_col(MODEL_LAYOUT, 4, i_b, i_h, row0, T, F)
    c0 = i_s * (seg_len // C)
    nc = gl.minimum(seg_len // C, T // C - c0)
    dt: gl.constexpr = qw_d.dtype

    # ---- shared memory: the window's key/value ring and q_w's tile, then the gated branch's and the output's
    k_s = gl.allocate_shared_memory(dt, [3, C, D], kw_d.layout)
    v_s = gl.allocate_shared_memory(dt, [3, C, DV], v_d.layout)
    q_s = gl.allocate_shared_memory(dt, [C, D], qw_d.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(kv_bar.index(i), count=1)
    fq_s, fk_s, st_s, zq_s, ones_s, y_s, a_s, den_s, q_bar, hs = gated_smem(fq_d, fk_d, y_d, F, DV, C)

    # ---- the key/value tiles of the two chunks before the first, and the first chunk's tiles
    for r in gl.static_range(3):
        # (rows before the tensor's first hold nothing a query sees: clamped, they are masked out)
        load_pair(kw_d, v_d, gl.maximum(r_k + (c0 + r - 2) * C, 0), c_k, gl.maximum(r_v + (c0 + r - 2) * C, 0),
                 c_v, kv_bar.index(r), k_s.index(r), v_s.index(r))
    load_tile(qw_d, r_q + c0 * C, c_q, q_bar.index(0), q_s)
    load_tile(fq_d, r_fq + c0 * C, c_fq, q_bar.index(1), fq_s)
    load_tile(fk_d, r_fk + c0 * C, c_fk, q_bar.index(2), fk_s)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.wait(kv_bar.index(0), 0)
    mbarrier.wait(kv_bar.index(1), 0)

    st_ready = hs.index(0)
    st_free = hs.index(1)
    a_ready = hs.index(2)
    gl.warp_specialize([
        (_output_partition, (qw_d, kw_d, v_d, fq_d, y_d, BL, SINK, ALPHA, og_d, ow_d, LSE, DEN, WK, WV, k_s, v_s, q_s,
                             fq_s, st_s, a_s, den_s, y_s, kv_bar, q_bar, st_ready, st_free, a_ready, row0, r_q, c_q,
                             r_k, c_k, r_v, c_v, r_fq, c_fq, c0, nc, i_h, i_bh, i_s, nseg, qk_scale, eps, T, PROF, W,
                             NSINK, F, DV, C, NPROF, TRAIN, STORE_OG, STORE_OW, WSTATE)),
        (state_partition, (fk_d, sc_d, v_s, fq_s, fk_s, st_s, zq_s, a_s, den_s, ones_s, kv_bar, q_bar, st_ready,
                            st_free, a_ready, BL,
                            S_IN, Z_IN, S_OUT, Z_OUT, ZC, PROF, row0, r_fk, c_fk, c0, nc, i_bh, i_s, nseg, T, HAS_INIT,
                            F, DV, C, NPROF, TRAIN, PAIRED, FINAL)),
    ], [4], [232])
    for i in gl.static_range(3):
        mbarrier.invalidate(kv_bar.index(i))
        mbarrier.invalidate(q_bar.index(i))
    for i in gl.static_range(3):
        mbarrier.invalidate(hs.index(i))


def supports(phi_q, phi_k, v, log_g, q_w, k_w, window: int, sinks, S0) -> bool:
    """Whether ``lizard_fwd_fused`` takes these inputs (see the module's scope; S0 is accepted and
    then runs without segments)."""
    if sm_major(v) != 9:
        return False
    B, H, T, DV = v.shape
    xs = (phi_q, phi_k, v, q_w, k_w)
    return (v.dtype in (torch.bfloat16, torch.float16) and all(x.dtype == v.dtype for x in xs)
            and all(x.shape[:3] == v.shape[:3] and x.shape[-1] == 128 for x in xs)
            and T % BT == 0 and T > 0 and 64 < window <= 129 and log_g.dtype == torch.float32
            and (sinks is None or sinks.shape[1] in (1, 2, 4, 8, 16))
            # TMA reads whole rows from 16-byte aligned bases, in one of two layouts
            and tma_readable(xs))


def lizard_fwd_fused(phi_q, phi_k, v, log_g, q_w, k_w, alpha, sinks: Optional[torch.Tensor], *, window: int,
                     scale: float, eps: float, nseg: int = 1, S_in: Optional[torch.Tensor] = None,
                     z_in: Optional[torch.Tensor] = None, prof: Optional[torch.Tensor] = None, store: bool = False,
                     store_og: bool = True, store_ow: bool = True, out: Optional[torch.Tensor] = None,
                     window_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None, paired_states: bool = False,
                     final_state: bool = True):
    """y (B, H, T, Dv) in v's dtype, S_T (B, H, F, Dv) fp32, z_T (B, H, F) fp32 (None each without
    ``final_state``: the kernel then writes no final state, 34 MB at B16 T2048 and 32 heads, and with
    ``store`` keeps no S leaving the last chunk in sc, which only a backward given a gradient for the
    final state reads, or one in segments: only for a backward of one segment with none), and with ``store``
    what the backward reads (``ops.lizard_attn.fused``'s intermediates, the Triton passes' conventions):
    dict(o_g, o_w (B, H, T, Dv) in v's dtype: the gated output over its den and the window's
    normalised; den, lse (B*H, T) fp32, lse base 2 with the sinks; sc (B*H, NC+1, F, Dv) in v's
    dtype and zc (B*H, NC+1, F) fp32: the state entering every chunk and the one leaving the
    last; bl (B*H*T,) fp32: the gates' cumulative sums within chunks the kernel read,
    ``chunk_gates(log_g)``, which the gated backward reads too), else None.
    ``store_og`` False: o_g is not stored (None in the dict): a backward that takes dy . o_g as
    dy . y - alpha_h (dy . o_w) needs only y and o_w (``gla_gluon.bwd_fused``'s side_dot).
    ``store_ow`` False: nor o_w (a window backward forming dy . o_w from its scores needs none).
    ``paired_states``: sc holds the state entering every even chunk and the one leaving the last,
    (B*H, ``state_slots(NC, True)``, F, Dv): half the bytes, written here and read by the backward
    (``gla_gluon.bwd_fused(paired=True)`` forms each odd chunk's from the even one before it).
    ``out``: y's buffer ((B, H, T, Dv) contiguous in v's dtype), else a new one.
    ``window_state``: (k, v) buffers ((B, H, window - 1, 128) fp32, contiguous) that receive the
    window's decode state, the last window - 1 keys and values (zeros first where T is shorter),
    written from the kernel's ring (no copy of its own: ``window._new_state``'s result).

    ``nseg`` > 1: the sequence in about that many segments (``segment_plan``), one program each; S_in
    (B*H, nseg, F, Dv) and z_in (B*H, nseg, F) the states entering each (fp32), from the
    gated op's segment pre-pass and scan. Without segments, S_in/z_in the initial state or None."""
    B, H, T, DV = v.shape
    F = phi_q.shape[-1]
    D = q_w.shape[-1]
    NC = T // BT
    nseg, seg_len = segment_plan(T, nseg)
    lay = smem_layout((BT, 128), v.dtype)
    if out is not None and not (out.shape == v.shape and out.dtype == v.dtype and out.is_contiguous()
                                and out.device == v.device):
        raise ValueError(f"lizard_fwd_fused: out must be contiguous {tuple(v.shape)} {v.dtype} on {v.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device} (contiguous: {out.is_contiguous()})")
    # (B, H, T, Dv) contiguous, whatever v's layout
    y = out if out is not None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if window_state is not None:
        want = (B, H, window - 1, 128)
        for name, t in zip(("k", "v"), window_state):
            if not (tuple(t.shape) == want and t.dtype == torch.float32 and t.is_contiguous() and t.device == v.device):
                raise ValueError(f"lizard_fwd_fused: window_state's {name} must be contiguous {want} float32 on "
                                 f"{v.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    views = [view2d(x) for x in (q_w, k_w, v, phi_q, phi_k, y)]
    descs = [TensorDescriptor.from_tensor(x2, [BT, 128], lay) for x2, _ in views]
    b = chunk_gates(log_g)
    S_T = z_T = None
    if final_state:
        S_T = torch.empty(B, H, F, DV, dtype=torch.float32, device=v.device)
        z_T = torch.empty(B, H, F, dtype=torch.float32, device=v.device)
    has_init = S_in is not None
    inter = None
    sc_d = og_d = ow_d = descs[-1]  # (unused without ``store``)
    if store:
        f32 = dict(dtype=torch.float32, device=v.device)
        inter = dict(o_g=torch.empty_like(y) if store_og else None, o_w=torch.empty_like(y) if store_ow else None,
                     lse=torch.empty(B * H, T, **f32), den=torch.empty(B * H, T, **f32),
                     sc=torch.empty(B * H, state_slots(NC, paired_states), F, DV, dtype=v.dtype, device=v.device),
                     zc=torch.empty(B * H, NC + 1, F, **f32), bl=b)
        sc_d = TensorDescriptor.from_tensor(inter["sc"].view(-1, DV), [F, DV], smem_layout((F, DV), v.dtype))
        og_d, ow_d = (TensorDescriptor.from_tensor(inter[n].view(-1, DV), [BT, 128], lay) if inter[n] is not None
                      else sc_d for n in ("o_g", "o_w"))
    _lizard_fwd_kernel[(nseg, B * H)](
        *descs, sc_d, og_d, ow_d, b, sinks if sinks is not None else b, alpha.float().contiguous(),
        S_in if has_init else b, z_in if has_init else b, S_T if final_state else b, z_T if final_state else b,
        prof if prof is not None else b,
        *((inter[n] for n in ("lse", "den", "zc")) if store else (b, b, b)),
        *(window_state if window_state is not None else (b, b)),
        T, H, seg_len, nseg, scale * LOG2E, eps,
        W=window, NSINK=0 if sinks is None else sinks.shape[1], HAS_INIT=has_init, NPROF=0 if prof is None else 8,
        MODEL_LAYOUT=model_layout_bits(views[:5]),
        D=D, F=F, DV=DV, C=BT, TRAIN=store, STORE_OG=store_og, STORE_OW=store_ow, WSTATE=window_state is not None,
        PAIRED=store and paired_states, FINAL=final_state, num_warps=4)
    return y, S_T, z_T, inter


def compile_for_hopper(has_init: bool = False, nsink: int = 4, window: int = 128, nprof: int = 0,
                       model_layout: int = 0, train: bool = False, store_og: bool = True, store_ow: bool = True,
                       window_state: bool = False, paired: bool = False, final: bool = True):
    """Compile the kernel for sm_90a without a GPU (CI, probes); returns Triton's compiled kernel
    (``.metadata.shared``: bytes of shared memory per block; ``.asm["ptx"]``)."""
    from ..gla.gluon import compile_gluon, compile_args

    d, sc_d, f32, _ = compile_args()
    args = dict(qw_d=d, kw_d=d, v_d=d, fq_d=d, fk_d=d, y_d=d, sc_d=sc_d, og_d=d, ow_d=d, BL=f32, SINK=f32, ALPHA=f32,
                S_IN=f32, Z_IN=f32, S_OUT=f32, Z_OUT=f32, PROF=f32, LSE=f32, DEN=f32, ZC=f32, WK=f32, WV=f32,
                T=256, H=4, seg_len=256, nseg=1, qk_scale=0.1, eps=1e-6)
    consts = dict(W=window, NSINK=nsink, HAS_INIT=has_init, NPROF=nprof, D=128, F=128, DV=128, C=BT,
                  MODEL_LAYOUT=model_layout, TRAIN=train, STORE_OG=store_og, STORE_OW=store_ow, WSTATE=window_state,
                  PAIRED=paired, FINAL=final)
    return compile_gluon(_lizard_fwd_kernel, args, consts, num_warps=4)
