"""The whole Lizard forward in one hand-written Hopper kernel (Gluon): gated branch, window with
sinks and the combine, for inference (no intermediates kept for a backward).

    y = gla(phi_q, phi_k, v, log_g) / den + alpha_h * window(q_w, k_w, v; sinks)

One program per (segment, batch x head) walks its chunks of 64 tokens in order, carrying the
state S (F x Dv, fp32, in registers) and the normaliser z (F). Every tile is read from HBM once:
the window's keys and values of the two chunks before stay in a ring of three shared-memory
slots, and each chunk's tiles are brought in by TMA while the chunk before is being computed
(the loads of chunk c+1 are issued as soon as the products that read their slots are done).
Per chunk, with b_t the gates' cumulative sum from the chunk start (<= 0, decreasing):

    window: s = q_w k_w^T * scale over the chunk and the two before (masked to t - w < s <= t),
            softmax with the sink logits in the denominator, o_w = P V
    gated:  A = (phi_q phi_k^T) * e^{b_t - b_s} (s <= t),  num = e^{b_t} phi_q S + A V,
            den = e^{b_t} phi_q . z + rowsum(A)
    state:  S <- e^{b_end} S + (phi_k * e^{b_end - b_s})^T V,  z likewise
    y     = num / (den + eps) + alpha_h * o_w

Only factors <= 1 are ever formed (DESIGN.md, Lizard's factorisation). The Triton kernels
(``kernels.lizard``) run the same forward as three passes; this kernel exists because their
sum stays above the issue-6 target, and a fused walk needs explicit prefetching that Triton's
pipeliner does not give (docs/results/kernels-h200.md).

Scope: CUDA sm_90, bf16/fp16 inputs, F = D = Dv = 128, T a multiple of 64, window 65..129
(three key tiles), v2 sink logits or none, normalised features (not log-space), no padding.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BT = 64  # tokens per chunk
LOG2E = 1.4426950408889634


@gluon.jit
def _load_tile(desc, row, bar, dst):
    mbarrier.expect(bar, dst.numel * 2)  # 16-bit elements
    tma.async_copy_global_to_shared(desc, [row, 0], bar, dst)


@gluon.jit
def _load_kv(kd, vd, row, bar, k_dst, v_dst):
    mbarrier.expect(bar, (k_dst.numel + v_dst.numel) * 2)
    tma.async_copy_global_to_shared(kd, [row, 0], bar, k_dst)
    tma.async_copy_global_to_shared(vd, [row, 0], bar, v_dst)


@gluon.jit
def _lizard_fwd_kernel(qw_d, kw_d, v_d, fq_d, fk_d, y_d, BL, SINK, ALPHA, S_IN, Z_IN, S_OUT, Z_OUT,
                       T, H, seg_len, nseg, qk_scale, eps,
                       W: gl.constexpr, NSINK: gl.constexpr, HAS_INIT: gl.constexpr,
                       D: gl.constexpr, F: gl.constexpr, DV: gl.constexpr, C: gl.constexpr):
    i_s = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_h = i_bh % H
    row0 = i_bh * T  # the (B*H*T, .) views' first row of this batch x head
    c0 = i_s * (seg_len // C)
    nc = gl.minimum(seg_len // C, T // C - c0)

    # ---- layouts: two warpgroups side by side along N (each M=64 product is split in columns)
    mma_a: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, C // 2, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, DV // 2, 16])
    dot_p: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    row_a: gl.constexpr = gl.SliceLayout(1, mma_a)
    col_a: gl.constexpr = gl.SliceLayout(0, mma_a)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    col_o: gl.constexpr = gl.SliceLayout(0, mma_o)
    row_b: gl.constexpr = gl.SliceLayout(1, blk)
    col_b: gl.constexpr = gl.SliceLayout(0, blk)
    dt: gl.constexpr = qw_d.dtype

    # ---- shared memory: the window's key/value ring, one slot per other tile, S for phi_q S, and
    # x: K~ (phi_k rescaled, the state update's operand), then y on its way out
    k_s = gl.allocate_shared_memory(dt, [3, C, D], kw_d.layout)
    v_s = gl.allocate_shared_memory(dt, [3, C, DV], v_d.layout)
    q_s = gl.allocate_shared_memory(dt, [C, D], qw_d.layout)
    fq_s = gl.allocate_shared_memory(dt, [C, F], fq_d.layout)
    fk_s = gl.allocate_shared_memory(dt, [C, F], fk_d.layout)
    x_s = gl.allocate_shared_memory(dt, [C, DV], y_d.layout)
    s_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([F, DV], dt)
    st_s = gl.allocate_shared_memory(dt, [F, DV], s_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())  # q_w, phi_q, phi_k
    for i in gl.static_range(3):
        mbarrier.init(kv_bar.index(i), count=1)
        mbarrier.init(q_bar.index(i), count=1)

    # ---- the state entering the segment
    f_o = gl.arange(0, F, layout=row_o)
    dv_o = gl.arange(0, DV, layout=col_o)
    f_b = gl.arange(0, F, layout=col_b)
    if HAS_INIT:
        sp = S_IN + (i_bh * nseg + i_s) * F * DV
        S = gl.load(sp + f_o[:, None] * DV + dv_o[None, :])
        z = gl.load(Z_IN + (i_bh * nseg + i_s) * F + f_b)
    else:
        S = gl.zeros([F, DV], gl.float32, layout=mma_o)
        z = gl.zeros([F], gl.float32, layout=col_b)
    st_s.store(S.to(dt))

    # ---- the sinks' log-sum-exp (log2 units): a logit each in the window's denominator
    if NSINK > 0:
        sk = gl.load(SINK + i_h * NSINK + gl.arange(0, NSINK, layout=gl.BlockedLayout([1], [32], [8], [0])))
        sk = sk * 1.4426950408889634
        smax = gl.max(sk, axis=0)
        sink2 = smax + gl.log2(gl.sum(gl.exp2(sk - smax), axis=0))
    else:
        sink2 = -float("inf")
    alpha = gl.load(ALPHA + i_h)

    # ---- prologue: the key/value tiles of the two chunks before the first, and the first chunk's
    for r in gl.static_range(3):
        # (rows before the tensor's first hold nothing a query sees: clamped, they are masked out)
        _load_kv(kw_d, v_d, gl.maximum(row0 + (c0 + r - 2) * C, 0), kv_bar.index(r), k_s.index(r), v_s.index(r))
    _load_tile(qw_d, row0 + c0 * C, q_bar.index(0), q_s)
    _load_tile(fq_d, row0 + c0 * C, q_bar.index(1), fq_s)
    _load_tile(fk_d, row0 + c0 * C, q_bar.index(2), fk_s)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.wait(kv_bar.index(0), 0)
    mbarrier.wait(kv_bar.index(1), 0)

    rows_a = gl.arange(0, C, layout=row_a)
    cols_a = gl.arange(0, C, layout=col_a)
    rows_o = gl.arange(0, C, layout=row_o)
    rows_b = gl.arange(0, C, layout=row_b)
    causal = cols_a[None, :] <= rows_a[:, None]
    zero_a = gl.zeros([C, C], gl.float32, layout=mma_a)
    zero_o = gl.zeros([C, DV], gl.float32, layout=mma_o)

    for ci in range(nc):
        c = c0 + ci
        ph = ci & 1
        j = ci + 2  # ring index of this chunk's keys/values; j - 1 and j - 2 hold the two before
        t_q = c * C + rows_a  # query positions
        more = ci + 1 < nc
        # b_t: the gates' cumulative sum from the chunk start (precomputed), in each layout used
        bl = BL + row0 + c * C
        b_end = gl.load(bl + C - 1)

        # ---- first what reads phi_q and phi_k, so that their slots take the next chunk's early:
        # A = phi_q phi_k^T and phi_q S (async); phi_q . z, K~ and z (plain reads) beside them
        mbarrier.wait(q_bar.index(1), ph)
        mbarrier.wait(q_bar.index(2), ph)
        a = warpgroup_mma(fq_s, fk_s.permute((1, 0)), zero_a, use_acc=False, is_async=True)
        o_i = warpgroup_mma(fq_s, st_s, zero_o, use_acc=False, is_async=True)
        qz = gl.convert_layout(gl.sum(fq_s.load(blk).to(gl.float32) * z[None, :], axis=1), row_o)
        kt = fk_s.load(blk).to(gl.float32) * gl.exp(b_end - gl.load(bl + rows_b))[:, None]
        z = z * gl.exp(b_end) + gl.sum(kt, axis=0)
        tma.store_wait(0)  # the chunk before's y has left x
        gl.thread_barrier()
        x_s.store(kt.to(dt))
        a, o_i, _, _, _ = warpgroup_mma_wait(0, deps=(a, o_i, fq_s, fk_s, st_s))
        fence_async_shared()
        gl.thread_barrier()  # phi_q, phi_k read by both warpgroups; K~ in x for the state update
        if more:
            _load_tile(fq_d, row0 + (c + 1) * C, q_bar.index(1), fq_s)
            _load_tile(fk_d, row0 + (c + 1) * C, q_bar.index(2), fk_s)

        # ---- window scores against the three key tiles
        mbarrier.wait(q_bar.index(0), ph)
        mbarrier.wait(kv_bar.index(j % 3), (j // 3) & 1)
        k0 = k_s.index((j - 2) % 3)
        k1 = k_s.index((j - 1) % 3)
        k2 = k_s.index(j % 3)
        s0 = warpgroup_mma(q_s, k0.permute((1, 0)), zero_a, use_acc=False, is_async=True)
        s1 = warpgroup_mma(q_s, k1.permute((1, 0)), zero_a, use_acc=False, is_async=True)
        s2 = warpgroup_mma(q_s, k2.permute((1, 0)), zero_a, use_acc=False, is_async=True)
        s0, s1, s2, _, _, _, _ = warpgroup_mma_wait(0, deps=(s0, s1, s2, q_s, k0, k1, k2))
        gl.thread_barrier()  # both warpgroups are done with q_w: bring in the next chunk's
        if more:
            _load_tile(qw_d, row0 + (c + 1) * C, q_bar.index(0), q_s)

        # ---- window softmax (log2 units), sinks included; masked before the exp; P V async
        s0 = gl.where(_visible(t_q, (c - 2) * C + cols_a, W), s0 * qk_scale, -float("inf"))
        s1 = gl.where(_visible(t_q, (c - 1) * C + cols_a, W), s1 * qk_scale, -float("inf"))
        s2 = gl.where(_visible(t_q, c * C + cols_a, W), s2 * qk_scale, -float("inf"))
        m = gl.maximum(gl.maximum(gl.max(s0, axis=1), gl.max(s1, axis=1)), gl.max(s2, axis=1))
        m = gl.maximum(m, sink2)
        p0 = gl.exp2(s0 - m[:, None])
        p1 = gl.exp2(s1 - m[:, None])
        p2 = gl.exp2(s2 - m[:, None])
        l_w = gl.sum(p0, axis=1) + gl.sum(p1, axis=1) + gl.sum(p2, axis=1) + gl.exp2(sink2 - m)
        v0 = v_s.index((j - 2) % 3)
        v1 = v_s.index((j - 1) % 3)
        v2 = v_s.index(j % 3)
        p0 = gl.convert_layout(p0.to(dt), dot_p)
        p1 = gl.convert_layout(p1.to(dt), dot_p)
        p2 = gl.convert_layout(p2.to(dt), dot_p)
        o_w = warpgroup_mma(p0, v0, zero_o, use_acc=False, is_async=True)
        o_w = warpgroup_mma(p1, v1, o_w, is_async=True)
        o_w = warpgroup_mma(p2, v2, o_w, is_async=True)

        # ---- gated output e^{b_t} phi_q S + A V and its normaliser; the state update
        a = a * gl.exp(gl.where(causal, gl.load(bl + rows_a)[:, None] - gl.load(bl + cols_a)[None, :],
                                -float("inf")))
        den = gl.convert_layout(gl.sum(a, axis=1), row_o)
        e_t = gl.exp(gl.load(bl + rows_o))
        a_op = gl.convert_layout(a.to(dt), dot_p)
        num = warpgroup_mma(a_op, v2, o_i * e_t[:, None], is_async=True)
        S = warpgroup_mma(x_s.permute((1, 0)), v2, S * gl.exp(b_end), is_async=True)
        o_w, num, S, _, _, _, _, _, _, _, _ = warpgroup_mma_wait(
            0, deps=(o_w, num, S, p0, p1, p2, a_op, x_s, v0, v1, v2))
        gl.thread_barrier()  # the oldest key/value slot, S's copy and x are free
        if more:
            _load_kv(kw_d, v_d, row0 + (c + 1) * C, kv_bar.index((j + 1) % 3),
                     k_s.index((j + 1) % 3), v_s.index((j + 1) % 3))
        st_s.store(S.to(dt))

        # ---- combine; y leaves through x by TMA
        y = num / (den + qz * e_t + eps)[:, None] + o_w * (alpha / gl.convert_layout(l_w, row_o))[:, None]
        x_s.store(y.to(dt))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(y_d, [row0 + c * C, 0], x_s)

    tma.store_wait(0)
    for i in gl.static_range(3):
        mbarrier.invalidate(kv_bar.index(i))
        mbarrier.invalidate(q_bar.index(i))
    if i_s == nseg - 1:
        gl.store(S_OUT + i_bh * F * DV + f_o[:, None] * DV + dv_o[None, :], S)
        gl.store(Z_OUT + i_bh * F + f_b, z)


@gluon.jit
def _visible(t, s, W: gl.constexpr):
    """(C, C) bool: key position s visible to query position t (window W, no left padding)."""
    return (s[None, :] <= t[:, None]) & (s[None, :] > t[:, None] - W) & (s[None, :] >= 0)


def supports(phi_q, phi_k, v, log_g, q_w, k_w, window: int, sinks, S0) -> bool:
    """Whether ``lizard_fwd_fused`` takes these inputs (see the module's scope)."""
    if not (v.is_cuda and torch.cuda.get_device_capability(v.device)[0] == 9):
        return False
    B, H, T, DV = v.shape
    return (v.dtype in (torch.bfloat16, torch.float16) and all(x.dtype == v.dtype for x in (phi_q, phi_k, q_w, k_w))
            and phi_q.shape[-1] == phi_k.shape[-1] == q_w.shape[-1] == k_w.shape[-1] == DV == 128
            and T % BT == 0 and T > 0 and 64 < window <= 129 and log_g.dtype == torch.float32
            and (sinks is None or sinks.shape[1] in (1, 2, 4, 8, 16)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B*H*T, D) rows, contiguous."""
    return x.contiguous().view(-1, x.shape[-1])


def lizard_fwd_fused(phi_q, phi_k, v, log_g, q_w, k_w, alpha, sinks: Optional[torch.Tensor], *, window: int,
                     scale: float, eps: float, nseg: int = 1, S_in: Optional[torch.Tensor] = None,
                     z_in: Optional[torch.Tensor] = None):
    """y (B, H, T, Dv) in v's dtype, S_T (B, H, F, Dv) fp32, z_T (B, H, F) fp32.

    ``nseg`` > 1: the sequence in that many segments of whole chunks, one program each; S_in
    (B*H, nseg, F, Dv) and z_in (B*H, nseg, F) the states entering each (fp32), from the
    gated op's segment pre-pass and scan. Without segments, S_in/z_in the initial state or None."""
    B, H, T, DV = v.shape
    F = phi_q.shape[-1]
    D = q_w.shape[-1]
    el = gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16
    nc = T // BT
    seg_chunks = math.ceil(nc / nseg)
    nseg = math.ceil(nc / seg_chunks)
    lay = gl.NVMMASharedLayout.get_default_for([BT, 128], el)
    y = torch.empty_like(v)
    descs = [TensorDescriptor.from_tensor(_rows(x), [BT, x.shape[-1]], lay) for x in (q_w, k_w, v, phi_q, phi_k, y)]
    S_T = torch.empty(B, H, F, DV, dtype=torch.float32, device=v.device)
    z_T = torch.empty(B, H, F, dtype=torch.float32, device=v.device)
    has_init = S_in is not None
    # b_t: the gates' cumulative sum within each chunk of BT tokens, from its start
    b = log_g.float().reshape(B, H, nc, BT).cumsum(-1).reshape(B, H, T).contiguous()
    _lizard_fwd_kernel[(nseg, B * H)](
        *descs, b, sinks if sinks is not None else b, alpha.float().contiguous(),
        S_in if has_init else S_T, z_in if has_init else z_T, S_T, z_T,
        T, H, seg_chunks * BT, nseg, scale * LOG2E, eps,
        W=window, NSINK=0 if sinks is None else sinks.shape[1], HAS_INIT=has_init, D=D, F=F, DV=DV, C=BT,
        num_warps=8)
    return y, S_T, z_T


def segment_states(phi_k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, seg_len: int, nseg: int):
    """The state and normaliser entering each of ``nseg`` segments of ``seg_len`` tokens, from a zero
    start: (B*H, nseg, F, Dv) and (B*H, nseg, F) fp32. The gated op's own segment pre-pass (each
    segment's state from zero, the last segment's not needed) and its scan (``kernels.gla``)."""
    from . import gla as kgla

    B, H, T, F = phi_k.shape
    DV = v.shape[-1]
    cfg = kgla.CONFIG
    f32 = dict(dtype=torch.float32, device=v.device)
    s_in = torch.empty(B * H, nseg, F, DV, **f32)
    z_in = torch.zeros(B * H, nseg, F, **f32)
    g_seg = torch.empty(B * H, nseg, **f32)
    BV = min(kgla.pow2(cfg.fwd_bv), DV)
    common_kw = dict(DK=F, BK=kgla.pow2(F), BT=kgla._chunk(cfg, phi_k.dtype), LOG=False)
    for z_only in (False, True):
        kgla._gla_fwd_state_kernel[(1 if z_only else math.ceil(DV / BV), nseg - 1, B * H)](
            phi_k, v, log_g, s_in, z_in, g_seg, *kgla.strides_bht(phi_k), *kgla.strides_bht(v),
            *kgla.strides_bht(log_g), T, H, seg_len, nseg, DV=DV, BV=BV, PREC="tf32", Z_ONLY=z_only,
            num_warps=cfg.den_warps if z_only else cfg.fwd_warps, num_stages=cfg.fwd_stages, **common_kw)
    BVS = min(32, kgla.pow2(DV))
    kgla._gla_scan_kernel[(math.ceil(DV / BVS), B * H)](
        s_in, z_in, g_seg, s_in, z_in, nseg, DK=F, DV=DV, BK=kgla.pow2(F), BV=BVS, HAS_INIT=False, REVERSE=False,
        DO_S=True, DO_Z=True, num_warps=4)
    return s_in, z_in
