"""Gated linear attention as hand-written Hopper kernels (Gluon): the backward's chunk pass, the
whole backward in one kernel (``bwd_fused``, below), and the whole inference forward in one
(``fwd_fused``, at the end: Lizard's fused forward without the window, whose state partition,
``state_partition``, both kernels run).

Same math, inputs and outputs as ``gla._gla_bwd_chunk_kernel`` (see ``ops.gla.triton``'s docstring):
one program per (chunk, batch x head), no loop, from the state S (z) entering the chunk and the
state gradient dS (dz) leaving it, with b_t the gates' cumulative sum from the chunk start,
p_ts = e^{b_t - b_s} (s <= t), dn = do / (den + eps), dd from the reverse state pass:

    A     = (phi_q phi_k^T) * p                      M = (dn v^T + dd) * p
    dv    = e^{b_end - b_s} (phi_k dS) + A^T dn
    dphi_k = e^{b_end - b_s} (v dS^T + dz) + M^T phi_q
    dphi_q = e^{b_t} (dn S^T + dd z^T) + M phi_k
    d log_g_i = sum_{j >= i in the chunk} (phi_q . dphi_q - phi_k . dphi_k)_j + YC (the part after it)

Why a kernel of its own: the Triton pass keeps all of it in registers and spills (1.37 ms of the
2.42 of GLA's forward + backward at B16 T2048 on an H200). Here every tile sits in shared memory,
brought by TMA, and each product is one warpgroup MMA reading its operands there (transposes are
views of the same tiles), so one warpgroup holds at most two 64 x 128 fp32 tiles: 104 KB of shared
memory and no spills, two programs per multiprocessor, each one's loads in flight while the other
computes. dS is read first (dv and dphi_k); S then comes into dS's slot while M and dphi_k are
formed, for dphi_q last.

The fused backward (``_gla_bwd_fused_kernel``, ``GLALaunch.gluon_fused_bwd``): one program
per (segment, batch x head) walks its chunks from the end, the reverse state pass and the chunk
pass in one, so the state gradient of every chunk (as many bytes as two (B, H, T, 128) tensors)
is never written or read back, nor are phi_q, do and o read twice. Two warp-specialised
partitions hand over through shared memory: the *state* partition carries dS (fp32, 128 registers
a thread) and dz, gives the chunk partition dS's bf16 copy and <dS, S_out> + <dz, z_out> (the gate
gradient's part after the chunk, with S_out the state leaving it: from dS's copy and S, still in
shared memory from the chunk after, on the tensor cores), forms the chunk's dv (A^T in registers,
dv in two halves of columns) and applies dS <- e^{b_end} dS + (phi_q e^{b_t})^T dn (the scaled
phi_q^T in registers) and dz <- e^{b_end} dz + phi_q^T (e^{b_t} dd) as soon as the chunk partition
has formed dd; the *chunk* partition forms dk, dq and d log_g as the chunk pass does (e^{b_t}
scaling dn S^T's rows) and issues the loads (each chunk's tiles come into one of two slots while
the chunk before is computed); each partition forms half of dd's rows. The split balances the two
partitions' work a chunk (read from a profiling build's per-phase cycle counters, ``prof`` below):
with all of the chunk pass's products in the chunk partition the state partition mostly waited. dv
leaves by TMA through o's slot where that slot is free once dv is formed (Lizard's, where it held o
and then the window's dv; unnormalised, where it is unused); the state partition reads each chunk's
gates once into shared memory; the chunk partition forms the dz update's operand (e^{b_t} dd) with
dd; <dS, S_out> is a product on the tensor cores from dS's copy, before the S of the next chunk
comes. dn itself is never formed (each product scales do's rows or columns by 1 / (den + eps)
instead), and both partitions read their row vectors (gates, den, z) a chunk ahead, where Nsight
Compute found their latency left the warps waiting. dk and dq leave by TMA too, through v's and
k's slots once their readers are done (stored from the MMA layout). Each of these was kept for the
time it saved on an H100; the measurements are in git (benchmarks/README.md names the commit). With ``SIDE`` (Lizard's ``og_from_y``) o is y and
the window's part of do . o comes as a row vector. With ``PAIRED`` (Lizard's ``paired_states``, a
memory option) the forward kept the states of even chunks only, and each odd chunk's is formed
from the even one's before it (``_tq_paired``).

Scope: CUDA sm_90, bf16/fp16, Dk = Dv = 128, chunks of 64 with T a multiple of 64, plain
features (not log-space); q, k, v (B, H, T, D) contiguous or a model's (B, T, H, D) transposed.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..backend.dispatch import sm_major

BT = 64  # tokens per chunk
WIDTH = 128  # the one feature and value width the kernels take


# ----------------------------------------------------------------------------- shared pieces


@gluon.jit
def prof_tick(acc, t_prev, k: gl.constexpr):
    """Profiling builds (NPROF): add the cycles since t_prev to phase k of acc ((8,) int64); returns (acc, now)."""
    idx = gl.arange(0, 8, layout=acc.type.layout)
    t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [idx], dtype=gl.int64, is_pure=False, pack=1)
    return gl.where(idx == k, acc + (t - t_prev), acc), t


@gluon.jit
def prof_init():
    acc = gl.zeros([8], gl.int64, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    return prof_tick(acc, acc, 8)


@gluon.jit
def tile_at_step(buf, step):
    """A single shared-memory tile seen at an address that depends on ``step`` (a loop's counter,
    shifted to 0): the MMAs reading this view form their operand descriptors where they run.
    Else the compiler hoists the descriptors of a loop-invariant tile out of the loop (2 registers
    for each 16 of K) and, beside fp32 accumulators, spills them."""
    return buf._reinterpret(buf.dtype, [1] + buf.shape, buf.layout).index(step >> 30)


@gluon.jit
def load_tile(desc, row, col, bar, dst):
    mbarrier.expect(bar, dst.numel * 2)  # 16-bit elements
    tma.async_copy_global_to_shared(desc, [row, col], bar, dst)


@gluon.jit
def load_pair(da, db, ra, ca, rb, cb, bar, sa, sb):
    """Two tiles by TMA on one barrier."""
    mbarrier.expect(bar, (sa.numel + sb.numel) * 2)
    tma.async_copy_global_to_shared(da, [ra, ca], bar, sa)
    tma.async_copy_global_to_shared(db, [rb, cb], bar, sb)


@gluon.jit
def store_tile(desc, row, x, x_s, pending: gl.constexpr):
    """x out by TMA through the staging tile x_s, once at most ``pending`` of this warpgroup's
    stores are still reading their tiles (0: all have left; 1: all but the last, in another slot)."""
    tma.store_wait(pending)
    _stage_out(desc, row, x, x_s)


@gluon.jit
def _stage_out(desc, row, x, x_s):
    """x out by TMA at ``row`` of desc's rows, through the tile x_s (free: its readers are done)."""
    gl.thread_barrier()
    x_s.store(x.to(x_s.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(desc, [row, 0], x_s)


@gluon.jit
def row_col(MODEL_LAYOUT: gl.constexpr, i: gl.constexpr, i_b, i_h, row0, T, D: gl.constexpr):
    """(first row, column) of one batch x head in input i's 2-D view (``view2d``): bit i of
    MODEL_LAYOUT set for a (B*T, H*D) view, else (B*H*T, D) with row0 = (batch x head) * T."""
    if (MODEL_LAYOUT >> i) & 1:
        return i_b * T, i_h * D
    else:
        return row0, 0


@gluon.jit
def qkv_rows(MODEL_LAYOUT: gl.constexpr, i_bh, H, T, DK: gl.constexpr, DV: gl.constexpr):
    """A program's batch x head i_bh: its first row in the (B*H*T, .) tensors, and (first row,
    column) of q, k (width DK) and v (width DV) in their 2-D views (``row_col``, inputs 0, 1, 2)."""
    i_b = i_bh // H
    i_h = i_bh % H
    row0 = i_bh * T
    r_q, c_q = row_col(MODEL_LAYOUT, 0, i_b, i_h, row0, T, DK)
    r_k, c_k = row_col(MODEL_LAYOUT, 1, i_b, i_h, row0, T, DK)
    r_v, c_v = row_col(MODEL_LAYOUT, 2, i_b, i_h, row0, T, DV)
    return row0, r_q, c_q, r_k, c_k, r_v, c_v


def view2d(x: torch.Tensor):
    """(B, H, T, D) -> (2-D view for a TMA descriptor, (sb, sh, sc)) such that batch b, head h,
    token t is row b*sb + h*sh + t, columns h*sc onward; None for other layouts. Two layouts:
    (B, H, T, D) contiguous, and the (B, T, H, D) projection a model transposes to (B, H, T, D)."""
    B, H, T, D = x.shape
    if x.is_contiguous():
        return x.view(B * H * T, D), (H * T, T, 0)
    if x.transpose(1, 2).is_contiguous():
        return x.transpose(1, 2).view(B * T, H * D), (T, 0, D)
    return None


def model_layout_bits(views) -> int:
    """MODEL_LAYOUT for the kernels: bit i set where ``views[i]`` (from ``view2d``) is a (B*T, H*D) view."""
    return sum(1 << i for i, (_, spec) in enumerate(views) if spec[1] == 0)


def _tma_views(xs) -> Optional[list]:
    """``view2d`` of each of xs ((B, H, T, D)), or None where TMA cannot read one of them: in neither
    layout, or not 16-byte aligned."""
    views = [view2d(x) for x in xs]
    if any(v is None for v in views) or any(x.data_ptr() % 16 for x in xs):
        return None
    return views


def tma_readable(xs) -> bool:
    """Whether TMA can read each of xs ((B, H, T, D)): in one of ``view2d``'s layouts, 16-byte aligned."""
    return _tma_views(xs) is not None


@functools.lru_cache(maxsize=None)
def smem_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout of a TMA tile of ``block`` (16-bit ``dtype``), made once (making it
    cost the host about 4 us at every launch)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def tma_tiles(xs, block) -> Optional[list]:
    """Tensor descriptors of ``block`` tiles over each of xs (16-bit, (B, H, T, D)) in its 2-D view,
    and the views; None where TMA cannot read one of them (``tma_readable``)."""
    views = _tma_views(xs)
    if views is None:
        return None
    lay = smem_layout(tuple(block), xs[0].dtype)
    return [TensorDescriptor.from_tensor(x2, block, lay) for x2, _ in views], views


# ----------------------------------------------------------------------------- the chunk pass


@gluon.jit
def _sum(a, b):
    return a + b


@gluon.jit
def _intra_decay(bl, rows, cols):
    """p_ts = e^{b_t - b_s} for s <= t, else 0 (masked before the exp: every exponent <= 0)."""
    return gl.exp(gl.where(cols[None, :] <= rows[:, None], gl.load(bl + rows)[:, None] - gl.load(bl + cols)[None, :],
                           -float("inf")))


@gluon.jit
def _gla_bwd_chunk_kernel(q_d, k_d, v_d, do_d, sc_d, dsc_d, BL, DEN, DDEN, ZC, DZC, YC, DQ, DK_, DV_, DG,
                          T, H, NC, eps, MODEL_LAYOUT: gl.constexpr, NORM: gl.constexpr, DV_ADD: gl.constexpr,
                          NVD: gl.constexpr, F: gl.constexpr, DV: gl.constexpr, C: gl.constexpr):
    """Grid (NC, B*H). BL: b_t (B*H*T,) fp32; DEN, DDEN (B*H*T,) fp32; ZC (B*H, NC+1, F), DZC (B*H,
    NC, F) fp32; YC (B*H, NC, NVD) fp32; DQ, DK_, DV_ (B*H*T, .) contiguous, DG (B*H*T,) fp32."""
    i_c = gl.program_id(0)
    i_bh = gl.program_id(1)
    row0, r_q, c_q, r_k, c_k, r_v, c_v = qkv_rows(MODEL_LAYOUT, i_bh, H, T, F, DV)
    t0 = i_c * C
    dt: gl.constexpr = q_d.dtype

    q_s = gl.allocate_shared_memory(dt, [C, F], q_d.layout)
    k_s = gl.allocate_shared_memory(dt, [C, F], k_d.layout)
    v_s = gl.allocate_shared_memory(dt, [C, DV], v_d.layout)
    dn_s = gl.allocate_shared_memory(dt, [C, DV], do_d.layout)  # do, then dn = do / (den + eps) in place
    st_s = gl.allocate_shared_memory(dt, [F, DV], sc_d.layout)  # dS, then S
    am_s = gl.allocate_shared_memory(dt, [C, C], gl.NVMMASharedLayout.get_default_for([C, C], dt))  # A, then M
    bar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(bar.index(i), count=1)
    fence_async_shared()
    mbarrier.expect(bar.index(0), 2 * C * F * 2)
    tma.async_copy_global_to_shared(q_d, [r_q + t0, c_q], bar.index(0), q_s)
    tma.async_copy_global_to_shared(k_d, [r_k + t0, c_k], bar.index(0), k_s)
    mbarrier.expect(bar.index(1), (2 * C * DV + F * DV) * 2)
    tma.async_copy_global_to_shared(do_d, [row0 + t0, 0], bar.index(1), dn_s)
    tma.async_copy_global_to_shared(dsc_d, [(i_bh * NC + i_c) * F, 0], bar.index(1), st_s)
    tma.async_copy_global_to_shared(v_d, [r_v + t0, c_v], bar.index(1), v_s)

    mma_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    row_t: gl.constexpr = gl.SliceLayout(1, mma_t)
    col_t: gl.constexpr = gl.SliceLayout(0, mma_t)
    rows_s = gl.arange(0, C, layout=gl.SliceLayout(1, mma_s))
    cols_s = gl.arange(0, C, layout=gl.SliceLayout(0, mma_s))
    rows_t = gl.arange(0, C, layout=row_t)
    cols_t = gl.arange(0, DV, layout=col_t)
    tok = row0 + t0
    bl = BL + tok
    b_end = gl.load(bl + C - 1)
    b_t = gl.load(bl + rows_t)
    r_end = gl.exp(b_end - b_t)  # e^{b_end - b_s}, by key row
    # the outputs' rows: a 64-bit base per program, 32-bit offsets within the chunk (fewer registers)
    out0 = tok.to(gl.int64) * DV
    offs = rows_t[:, None] * DV + cols_t[None, :]

    # ---- A = (phi_q phi_k^T) * p, for dv's A^T dn
    mbarrier.wait(bar.index(0), 0)
    a = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False,
                      is_async=True)
    a, _, _ = warpgroup_mma_wait(0, deps=(a, q_s, k_s))
    am_s.store((a * _intra_decay(bl, rows_s, cols_s)).to(dt))

    # ---- dn in place of do; dv = e^{b_end - b_s} (phi_k dS) + A^T dn
    mbarrier.wait(bar.index(1), 0)
    if NORM:
        r = 1.0 / (gl.load(DEN + tok + rows_t) + eps)
        dn_s.store((dn_s.load(mma_t).to(gl.float32) * r[:, None]).to(dt))
        dd_t = gl.load(DDEN + tok + rows_t)
        dd_s = gl.load(DDEN + tok + rows_s)
    fence_async_shared()
    gl.thread_barrier()
    dv = warpgroup_mma(k_s, st_s, gl.zeros([C, DV], gl.float32, layout=mma_t), use_acc=False, is_async=True)
    dv, _, _ = warpgroup_mma_wait(0, deps=(dv, k_s, st_s))
    dv = warpgroup_mma(am_s.permute((1, 0)), dn_s, dv * r_end[:, None], is_async=True)
    dv, _, _ = warpgroup_mma_wait(0, deps=(dv, am_s, dn_s))
    if DV_ADD:
        dv += gl.load(DV_ + out0 + offs).to(gl.float32)
    gl.store(DV_ + out0 + offs, dv.to(DV_.dtype.element_ty))
    # v dS^T (dphi_k's state part): then dS's slot takes S, which comes while M and dphi_k are formed
    tk = warpgroup_mma(v_s, st_s.permute((1, 0)), gl.zeros([C, F], gl.float32, layout=mma_t), use_acc=False,
                       is_async=True)
    tk, _, _ = warpgroup_mma_wait(0, deps=(tk, v_s, st_s))
    gl.thread_barrier()
    load_tile(sc_d, (i_bh * (NC + 1) + i_c) * F, 0, bar.index(2), st_s)

    # ---- M = (dn v^T + dd) * p; dphi_k = e^{b_end - b_s} (v dS^T + dz) + M^T phi_q
    m = warpgroup_mma(dn_s, v_s.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False,
                      is_async=True)
    m, _, _ = warpgroup_mma_wait(0, deps=(m, dn_s, v_s))
    if NORM:
        m = m + dd_s[:, None]
        tk = tk + gl.load(DZC + (i_bh * NC + i_c) * F + cols_t)[None, :]
    am_s.store((m * _intra_decay(bl, rows_s, cols_s)).to(dt))  # (formed again: fewer registers live)
    fence_async_shared()
    gl.thread_barrier()
    dk = warpgroup_mma(am_s.permute((1, 0)), q_s, tk * r_end[:, None], is_async=True)
    dk, _, _ = warpgroup_mma_wait(0, deps=(dk, am_s, q_s))
    db = -gl.sum(k_s.load(mma_t).to(gl.float32) * dk, axis=1)
    gl.store(DK_ + out0 + offs, dk.to(DK_.dtype.element_ty))

    # ---- dphi_q = e^{b_t} (dn S^T + dd z^T) + M phi_k
    mbarrier.wait(bar.index(2), 0)
    tq = warpgroup_mma(dn_s, st_s.permute((1, 0)), gl.zeros([C, F], gl.float32, layout=mma_t), use_acc=False,
                       is_async=True)
    tq, _, _ = warpgroup_mma_wait(0, deps=(tq, dn_s, st_s))
    if NORM:
        tq = tq + dd_t[:, None] * gl.load(ZC + (i_bh * (NC + 1) + i_c) * F + cols_t)[None, :]
    dq = warpgroup_mma(am_s, k_s, tq * gl.exp(b_t)[:, None], is_async=True)
    dq, _, _ = warpgroup_mma_wait(0, deps=(dq, am_s, k_s))
    db += gl.sum(q_s.load(mma_t).to(gl.float32) * dq, axis=1)
    gl.store(DQ + out0 + offs, dq.to(DQ.dtype.element_ty))

    # ---- d log_g: the cumulative sum over the chunk's later tokens, plus the part after the chunk
    lin: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    yc = gl.sum(gl.load(YC + (i_bh * NC + i_c) * NVD + gl.arange(0, NVD, layout=lin)), axis=0)
    dlg = gl.associative_scan(gl.convert_layout(db, lin), 0, _sum, reverse=True) + yc  # (a scan takes no MMA slice)
    gl.store(DG + tok + gl.arange(0, C, layout=lin), dlg)
    for i in gl.static_range(3):
        mbarrier.invalidate(bar.index(i))


# ----------------------------------------------------------------------------- the fused backward


@gluon.jit
def _load_chunk(q_d, k_d, v_d, do_d, r_q, c_q, r_k, c_k, r_v, c_v, tok, t0, bar, q_s, k_s, v_s, do_s):
    """One chunk's phi_q, phi_k, v and do tiles by TMA on one barrier (``tok`` = do's first row of
    the batch x head, t0 the chunk's first token)."""
    mbarrier.expect(bar, (q_s.numel + k_s.numel + v_s.numel + do_s.numel) * 2)
    tma.async_copy_global_to_shared(q_d, [r_q + t0, c_q], bar, q_s)
    tma.async_copy_global_to_shared(k_d, [r_k + t0, c_k], bar, k_s)
    tma.async_copy_global_to_shared(v_d, [r_v + t0, c_v], bar, v_s)
    tma.async_copy_global_to_shared(do_d, [tok + t0, 0], bar, do_s)


@gluon.jit
def _rows_ptr(base, rows, cols, D: gl.constexpr):
    """Pointers to the (rows, cols) tile of a row-major (., D) tensor at ``base``."""
    return (base + rows * D)[:, None] + cols[None, :]


@gluon.jit
def _bwd_chunk_partition(q_d, k_d, v_d, do_d, o_d, dva_d, dq_d, dk_d, BL, DEN, SIDE_DOT, alpha, ZC, DK_, DG,
                         q_s, k_s, v_s, do_s, o_s, st_s, ds_s, am_s, dd_s, dz_s, w_s, sdot_s, in_bar, s_bar, o_bar,
                         dva_bar, ds_ready, ds_free, tq_done, dd_ready, dv_done, r_q, c_q, r_k, c_k, r_v, c_v, row0,
                         i_bh, c_hi, n, NC, eps, PROF, prof_row,
                         NORM: gl.constexpr, DV_ADD: gl.constexpr, SIDE: gl.constexpr, F: gl.constexpr,
                         DV: gl.constexpr, C: gl.constexpr, NPROF: gl.constexpr, PAIRED: gl.constexpr):
    """Four warps forming the first half of one chunk's dd rows (and of e^{b_t} dd for dz's update;
    the state partition forms the second before ``ds_ready``), handed over with ``dd_ready``, then,
    from the state partition's dS (dz) leaving the chunk (ds_s, dz_s; ``ds_ready``; handed back
    read: ``ds_free``), dphi_k, dphi_q and d log_g as
    ``_gla_bwd_chunk_kernel`` does (dv is the state partition's). dn = do / (den + eps) is never
    formed: the products read do as it came, and 1 / (den + eps) scales their rows (M's, dn S^T's,
    with e^{b_t}) or, in the state partition, columns. They issue every load but S's. What they
    read from global memory by row (gates, den, z) is read a chunk ahead (``_chunk_rows``): read at
    the chunk's start it left the warps waiting (ncu, 2026-11-26). With ``DV_ADD`` the dv the state
    partition adds to comes by TMA into o's slot once both partitions have read o for dd (after
    ``ds_ready``; o's next tile then follows once dv is formed). With ``SIDE`` the tile read as o is
    y = o + alpha x (alpha: this head's), and SIDE_DOT holds the rows' do . x: dd takes do . o as
    do . y - alpha (do . x). dk and dq leave by TMA, through v's slot (read only by this partition's
    first products; PAIRED: the state partition reads it, so dk goes by rows) and k's (its last
    reader dq's product); dq_d, dk_d: their tiles, DK_: dk's rows."""
    dt: gl.constexpr = q_d.dtype
    mma_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    row_t: gl.constexpr = gl.SliceLayout(1, mma_t)
    col_t: gl.constexpr = gl.SliceLayout(0, mma_t)
    rows_s = gl.arange(0, C, layout=gl.SliceLayout(1, mma_s))
    cols_s = gl.arange(0, C, layout=gl.SliceLayout(0, mma_s))
    rows_t = gl.arange(0, C, layout=row_t)
    cols_t = gl.arange(0, DV, layout=col_t)
    lin: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # (tokens, width) of half a chunk
    rows_b = gl.arange(0, C // 2, layout=gl.SliceLayout(1, blk))
    # cycles per phase: waits 0 tiles, 1 o, 2 dS, 3 dv formed, 4 S; work 5 dphi_k, 6 dphi_q and d log_g,
    # 7 the rest (dd)
    if NPROF > 0:
        pacc, pt = prof_init()
    c_lo = c_hi - n + 1
    nxt = _chunk_rows(BL, DEN, SIDE_DOT, ZC, alpha, row0 + c_hi * C, i_bh * (NC + 1) + c_hi, rows_t, rows_b, F, C,
                      NORM, SIDE)
    for i in range(n):
        c = c_hi - i
        sl = i % 2
        qs = q_s.index(sl)
        ks = k_s.index(sl)
        vs = v_s.index(sl)
        dos = do_s.index(sl)
        tok = row0 + c * C
        bl = BL + tok
        b_end, b_t, den0, side0, b_h0, z_row, den_t = nxt
        r_end = gl.exp(b_end - b_t)  # e^{b_end - b_s}, by key row
        e_t = gl.exp(b_t)
        rden_t = 1.0 / (den_t + eps)
        # the outputs' rows: per-row pointers formed at each store (a hoisted offset tile would hold 64
        # registers through the loop)
        out0 = tok.to(gl.int64) * DV
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 7)
        mbarrier.wait(in_bar.index(sl), (i // 2) & 1)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 0)

        # ---- dd = -(do . o) / (den + eps) and e^{b_t} dd (dz's operand); then the dv to add to
        if NORM:
            if NPROF > 0:
                pacc, pt = prof_tick(pacc, pt, 7)
            mbarrier.wait(o_bar, i & 1)
            if NPROF > 0:
                pacc, pt = prof_tick(pacc, pt, 1)
            # the first half of the rows here, the second in the state partition (before ds_ready)
            _dd_half(dos, o_s, dd_s.index(sl), den0, side0, 0, eps, blk)
            _dz_half(dd_s.index(sl), b_h0, w_s.index(sl), 0)

        # ---- dS (dz) leaving the chunk; the state partition is done with the slot of the chunk before
        # and has formed its half of dd
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 7)
        mbarrier.wait(ds_ready, i & 1)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 2)
        if NORM:
            gl.thread_barrier()
            dd_t = dd_s.index(sl).load(row_t)
            if not DV_ADD:
                if i + 1 < n:
                    load_tile(o_d, tok - C, 0, o_bar, o_s)
        if DV_ADD:  # into o's slot (free: o is read by both partitions, or not used; the dv of the chunk before
            load_tile(dva_d, tok, 0, dva_bar, o_s)  # is formed)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(dd_ready)
        # the next chunk's rows, read a chunk ahead (at its start their latency would wait; the last
        # chunk reads its own again)
        cn = gl.maximum(c - 1, c_lo)
        nxt = _chunk_rows(BL, DEN, SIDE_DOT, ZC, alpha, row0 + cn * C, i_bh * (NC + 1) + cn, rows_t, rows_b, F, C,
                          NORM, SIDE)
        if i >= 1:
            if i + 1 < n:
                tma.store_wait(0)  # dq and dk of the chunk before have left the slot
                _load_chunk(q_d, k_d, v_d, do_d, r_q, c_q, r_k, c_k, r_v, c_v, row0, (c - 1) * C,
                            in_bar.index(1 - sl), q_s.index(1 - sl), k_s.index(1 - sl), v_s.index(1 - sl),
                            do_s.index(1 - sl))

        # ---- dphi_k = e^{b_end - b_s} (v dS^T + dz) + M^T phi_q, M = (dn v^T + dd) * p, dn v^T as
        # (do v^T) / (den + eps) by row
        tk = warpgroup_mma(vs, ds_s.permute((1, 0)), gl.zeros([C, F], gl.float32, layout=mma_t), use_acc=False,
                           is_async=True)
        m = warpgroup_mma(dos, vs.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False,
                          is_async=True)
        tk, m, _, _, _ = warpgroup_mma_wait(0, deps=(tk, m, vs, ds_s, dos))
        if NORM:
            tk = tk + dz_s.load(col_t)[None, :]
            m = (m * gl.convert_layout(rden_t, gl.SliceLayout(1, mma_s))[:, None]
                 + gl.convert_layout(dd_t, gl.SliceLayout(1, mma_s))[:, None])
        gl.thread_barrier()
        mbarrier.arrive(ds_free)  # dS's copy and dz are read: the state partition may write the next
        am_s.store((m * _intra_decay(bl, rows_s, cols_s)).to(dt))
        fence_async_shared()
        gl.thread_barrier()
        dk = warpgroup_mma(am_s.permute((1, 0)), qs, tk * r_end[:, None], is_async=True)
        dk, _, _ = warpgroup_mma_wait(0, deps=(dk, am_s, qs))
        db = -gl.sum(ks.load(mma_t).to(gl.float32) * dk, axis=1)
        if PAIRED:  # (the state partition reads v's slot)
            gl.store(_rows_ptr(DK_ + out0, rows_t, cols_t, DV), dk.to(DK_.dtype.element_ty))
        else:  # out by TMA through v's slot, read only by the products above (stored from the MMA layout, the
            # rows' 4-byte pieces used half of each sector)
            _stage_out(dk_d, tok, dk, vs)
        if PAIRED:  # an odd chunk's state is formed from the chunk after's (the next walked; rows in nxt):
            # the part of do S^T that needs no S is formed here, while the state partition forms dv
            tq_kv = gl.zeros([C, F], gl.float32, layout=mma_t)
            if c % 2 == 1:
                tq_kv = _tq_paired(dos, k_s.index(1 - sl), v_s.index(1 - sl), in_bar.index(1 - sl),
                                   ((i + 1) // 2) & 1, nxt[0], nxt[1], mma_t)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 5)

        # dv formed: o's slot (the dv added to) is free again; and the next dd_ready cannot complete a
        # phase before the state partition has waited for this one (a parity wait two phases behind
        # would wait for a third)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 7)
        mbarrier.wait(dv_done, i & 1)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 3)
        if NORM and DV_ADD:
            if i + 1 < n:
                load_tile(o_d, tok - C, 0, o_bar, o_s)

        # ---- dphi_q = e^{b_t} (dn S^T + dd z^T) + M phi_k
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 7)
        if PAIRED:  # (S comes for even chunks only: an odd one and the even one after it share it)
            mbarrier.wait(s_bar, (c_hi // 2 - c // 2) & 1)
        else:
            mbarrier.wait(s_bar, i & 1)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 4)
        tq = warpgroup_mma(dos, st_s.permute((1, 0)), gl.zeros([C, F], gl.float32, layout=mma_t), use_acc=False,
                           is_async=True)
        tq, _, _ = warpgroup_mma_wait(0, deps=(tq, dos, st_s))
        gl.thread_barrier()
        mbarrier.arrive(tq_done)  # S's slot is read here: the state partition brings the next S into it
        if PAIRED:
            if c % 2 == 1:  # st_s held the state entering chunk c - 1
                tq = tq * gl.exp(nxt[0]) + tq_kv
        if NORM:
            tq = tq * (e_t * rden_t)[:, None] + (e_t * dd_t)[:, None] * gl.convert_layout(z_row, col_t)[None, :]
        else:
            tq = tq * e_t[:, None]
        dq = warpgroup_mma(am_s, ks, tq, is_async=True)
        dq, _, _ = warpgroup_mma_wait(0, deps=(dq, am_s, ks))
        db += gl.sum(qs.load(mma_t).to(gl.float32) * dq, axis=1)
        _stage_out(dq_d, tok, dq, ks)  # through k's slot: read by now (the state partition's reads came before dv_done)

        # ---- d log_g: the cumulative sum over the chunk's later tokens, plus the part after the chunk
        y_c = gl.max(sdot_s.index(sl).load(lin), axis=0)
        dlg = gl.associative_scan(gl.convert_layout(db, lin), 0, _sum, reverse=True) + y_c
        gl.store(DG + tok + gl.arange(0, C, layout=lin), dlg)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 6)
    tma.store_wait(0)
    if NPROF > 0:
        pacc, pt = prof_tick(pacc, pt, 7)
        gl.store(PROF + prof_row * 16 + gl.arange(0, 8, layout=pacc.type.layout), pacc)


@gluon.jit
def _chunk_rows(BL, DEN, SIDE_DOT, ZC, alpha, tok, z_slot, rows_t, rows_b, F: gl.constexpr, C: gl.constexpr,
                NORM: gl.constexpr, SIDE: gl.constexpr):
    """What the chunk partition reads from global memory for the chunk of tokens tok..tok+C: b_end,
    b_t (rows_t's layout), den, alpha (do . x) (SIDE; else 0) and b_t of its first half of rows
    (rows_b's; ``_half_rows``), z entering it (row z_slot of ZC) and den by row (rows_t's); zeros
    for what an unnormalised backward does not read."""
    b_end = gl.load(BL + tok + C - 1)
    b_t = gl.load(BL + tok + rows_t)
    if NORM:
        den0, side0, b_h0 = _half_rows(BL, DEN, SIDE_DOT, alpha, tok, rows_b, SIDE)
        z_row = gl.load(ZC + z_slot * F + gl.arange(0, F, layout=gl.BlockedLayout([1], [32], [4], [0])))
        den_t = gl.load(DEN + tok + rows_t)
    else:
        den0 = gl.zeros_like(rows_b.to(gl.float32))
        side0 = den0
        b_h0 = den0
        z_row = gl.zeros([F], gl.float32, layout=gl.BlockedLayout([1], [32], [4], [0]))
        den_t = gl.zeros_like(b_t)
    return b_end, b_t, den0, side0, b_h0, z_row, den_t


@gluon.jit
def _tq_paired(dos, kn, vn, bar, phase, b_end, b_t, mma_t: gl.constexpr):
    """For an odd chunk whose state S the forward did not keep (PAIRED): the part of do S^T that the
    chunk before's state S' does not give. S = e^{b_end} S' + K~^T V with the chunk before's keys and
    values (kn (C, F), vn (C, Dv), in shared memory once ``bar`` completes ``phase``) and gates
    (b_end; b_t by row), K~ = phi_k e^{b_end - b_s}; so do S^T = e^{b_end} do S'^T + P K with
    P = (do V^T) e^{b_end - b_s} by column, formed in registers as the product's left operand."""
    C: gl.constexpr = dos.shape[0]
    F: gl.constexpr = kn.shape[1]
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    mbarrier.wait(bar, phase)
    p = warpgroup_mma(dos, vn.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False,
                      is_async=True)
    p, _, _ = warpgroup_mma_wait(0, deps=(p, dos, vn))
    r = gl.exp(b_end - gl.convert_layout(b_t, gl.SliceLayout(0, mma_s)))
    pa = gl.convert_layout((p * r[None, :]).to(dos.dtype), gl.DotOperandLayout(operand_index=0, parent=mma_t,
                                                                               k_width=2))
    t = warpgroup_mma(pa, kn, gl.zeros([C, F], gl.float32, layout=mma_t), use_acc=False, is_async=True)
    t, _, _ = warpgroup_mma_wait(0, deps=(t, pa, kn))
    return t


@gluon.jit
def _half_rows(BL, DEN, SIDE_DOT, alpha, tok, rows_b, SIDE: gl.constexpr):
    """den, alpha (do . x) (SIDE; else 0) and b_t of the half chunk of rows tok + rows_b, for dd's
    half (``_dd_half``, ``_dz_half``)."""
    den = gl.load(DEN + tok + rows_b)
    if SIDE:
        side = alpha * gl.load(SIDE_DOT + tok + rows_b)
    else:
        side = gl.zeros_like(den)
    return den, side, gl.load(BL + tok + rows_b)


@gluon.jit
def _dz_half(dd_sl, b_h, w_sl, h: gl.constexpr):
    """Rows [h C/2, (h+1) C/2) of e^{b_t} dd (dd from dd_sl, b_t as b_h) as a bf16 hi + lo pair in
    w_sl's columns 0 and 1, the rest zero: the right operand of the state partition's dz update (an
    MMA)."""
    HC: gl.constexpr = w_sl.shape[0] // 2
    wblk: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])  # (tokens, 16) of half of w_s
    c_w = gl.arange(0, 16, layout=gl.SliceLayout(0, wblk))
    w = dd_sl.slice(h * HC, HC).load(gl.SliceLayout(1, wblk)) * gl.exp(gl.convert_layout(b_h, gl.SliceLayout(1, wblk)))
    w_hi = w.to(w_sl.dtype)
    w_lo = (w - w_hi.to(gl.float32)).to(w_sl.dtype)
    w = gl.where(c_w[None, :] == 0, w_hi[:, None], gl.where(c_w[None, :] == 1, w_lo[:, None], 0.0))
    w_sl.slice(h * HC, HC).store(w.to(w_sl.dtype))


@gluon.jit
def _dd_half(do_s, o_s, dd_sl, den_h, side_h, h: gl.constexpr, eps, blk: gl.constexpr):
    """Rows [h C/2, (h+1) C/2) of a chunk: dd = -(do . o - side_h) / (den + eps) into dd_sl (also for
    dz's update); side_h: what of do . o is the other branch's (or 0)."""
    HC: gl.constexpr = do_s.shape[0] // 2
    do = do_s.slice(h * HC, HC).load(blk).to(gl.float32)
    dd_h = (side_h - gl.sum(do * o_s.slice(h * HC, HC).load(blk).to(gl.float32), axis=1)) / (den_h + eps)
    dd_sl.slice(h * HC, HC).store(dd_h)


@gluon.jit
def _state_rows(BL, DEN, SIDE_DOT, ZC, alpha, tok, z_slot, f_Z, rows_b, lin: gl.constexpr, C: gl.constexpr,
                NORM: gl.constexpr, SIDE: gl.constexpr):
    """What the state partition reads from global memory for the chunk of tokens tok..tok+C: b_t and
    den (lin's layout), b_end, z leaving the chunk (row z_slot of ZC, f_Z's layout) and, for its
    half of dd, den, alpha (do . x) and b_t of the second half of rows (rows_b's); zeros for what an
    unnormalised backward does not read."""
    F: gl.constexpr = f_Z.shape[0]
    b_lin = gl.load(BL + tok + gl.arange(0, C, layout=lin))
    b_end = gl.load(BL + tok + C - 1)
    if NORM:
        den_lin = gl.load(DEN + tok + gl.arange(0, C, layout=lin))
        z_row = gl.load(ZC + z_slot * F + f_Z)
        den1, side1, b_h1 = _half_rows(BL, DEN, SIDE_DOT, alpha, tok + C // 2, rows_b, SIDE)
    else:
        den_lin = gl.zeros_like(b_lin)
        z_row = gl.zeros_like(f_Z.to(gl.float32))
        den1 = gl.zeros_like(rows_b.to(gl.float32))
        side1 = den1
        b_h1 = den1
    return b_lin, den_lin, b_end, z_row, den1, side1, b_h1


@gluon.jit
def _state_dot(ds_s, st_s, i):
    """<dS, S> from dS's copy (ds_s) and S (st_s), (F, Dv) tiles in shared memory, on the tensor
    cores: the trace of dS_0 S_0^T + dS_1 S_1^T (their halves of feature rows), one (F/2, F/2)
    product. The elementwise product read 128 elements of the swizzled tile into each thread. i:
    the walk's step (``tile_at_step``)."""
    FH: gl.constexpr = ds_s.shape[0] // 2
    ds_v = tile_at_step(ds_s, i)
    st_v = tile_at_step(st_s, i)
    mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, FH, 16])
    acc = warpgroup_mma(ds_v.slice(0, FH), st_v.slice(0, FH).permute((1, 0)),
                        gl.zeros([FH, FH], gl.float32, layout=mma_d), use_acc=False, is_async=True)
    acc = warpgroup_mma(ds_v.slice(FH, FH), st_v.slice(FH, FH).permute((1, 0)), acc, is_async=True)
    acc, _, _ = warpgroup_mma_wait(0, deps=(acc, ds_v, st_v))
    r = gl.arange(0, FH, layout=gl.SliceLayout(1, mma_d))
    c = gl.arange(0, FH, layout=gl.SliceLayout(0, mma_d))
    return gl.sum(gl.sum(gl.where(r[:, None] == c[None, :], acc, 0.0), axis=1), axis=0)


@gluon.jit
def _z_col(dz2, zc):
    """dz from its (F, 16) product form: the sum of columns 0 and 1 (a bf16 hi + lo pair's products)."""
    return gl.sum(gl.where(zc[None, :] < 2, dz2, 0.0), axis=1)


@gluon.jit
def _bwd_state_partition(sc_d, dv_d, SC, BL, DEN, SIDE_DOT, alpha, ZC, DS_IN, DZ_IN, DS0, DZ0, DV_, q_s, k_s, v_s, do_s,
                         o_s, st_s, ds_s, dz_s, w_s, dd_s, sdot_s, b_s, in_bar, s_bar, o_bar, dva_bar, ds_ready,
                         ds_free, tq_done, dd_ready, dv_done,
                         row0, i_bh, i_seg, NSEG, c_hi, n, NC, eps, PROF, prof_row,
                         NORM: gl.constexpr, DV_ADD: gl.constexpr, HAS_DS: gl.constexpr, STORE_DS0: gl.constexpr,
                         F: gl.constexpr, DV: gl.constexpr, C: gl.constexpr, NPROF: gl.constexpr,
                         SIDE: gl.constexpr, PAIRED: gl.constexpr):
    """Four warps carrying dS (F, DV) in fp32 registers, in two halves of feature rows, and dz.
    Per chunk, from the segment's end: dS's bf16 copy and dz for the chunk partition (``ds_ready``);
    <dS, S_out> + <dz, z_out> with the state leaving the chunk (the gate gradient's part after it:
    dS's copy against S entering the chunk after, still in st_s, on the tensor cores), read by the
    chunk partition once dv is formed, then the state entering the chunk into st_s; the chunk's
    dv = e^{b_end - b_s} (phi_k dS) + A^T dn (A^T = (phi_k phi_q^T) * p^T / (den + eps) by column,
    then A^T do, in registers, in two halves of columns, adding the window's where ``DV_ADD``, once
    the chunk partition has formed its half of dd (``dd_ready``; ``dv_done`` once formed); then the gradient
    entering the chunk, dS <- e^{b_end} dS + (phi_q e^{b_t} / (den + eps))^T do (the scaled phi_q^T
    an operand in registers; the two scales in b_s's second row as b_t - log(den + eps)), dz <-
    e^{b_end} dz + phi_q^T (e^{b_t} dd) (an MMA too: dz as an (F, 16)
    product whose columns 0 and 1 sum to it, e^{b_t} dd as a bf16 hi + lo pair in w_s's columns 0 and
    1, the rest zero, each partition writing its half of the rows with dd, a slot per chunk parity; elementwise,
    its reduction over tokens crossed warps). It writes dS's next copy once the chunk partition has
    read the last (``ds_free``), and the next S once it has read the last (``tq_done``). Before dS's
    copy it forms the second half of the chunk's dd rows (and of dz's operand) from do and o: the
    chunk partition is this kernel's bound, and this one waited for it (Nsight Compute: 27% of its
    samples). What it reads from global memory by row comes a chunk ahead (``_state_rows``).
    PAIRED: st_s holds S for even chunks only, so where the chunk after (c + 1) is odd it holds the
    state entering this one, S_c, and S_out = e^{b_end} S_c + K~^T V: <dS, S_out> is e^{b_end}
    <dS, S_c> plus <(K~ dS), V>, whose K~ dS is dv's first product; a new S comes for odd chunks."""
    dt: gl.constexpr = ds_s.dtype
    FH: gl.constexpr = F // 2
    DH: gl.constexpr = DV // 2
    mma_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    dot_S: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_S, k_width=2)
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    mma_h: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
    dot_h: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_h, k_width=2)
    f_S = gl.arange(0, FH, layout=gl.SliceLayout(1, mma_S))
    s_off = f_S[:, None] * DV + gl.arange(0, DV, layout=gl.SliceLayout(0, mma_S))[None, :]
    lin: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    rows_s = gl.arange(0, C, layout=gl.SliceLayout(1, mma_s))
    cols_s = gl.arange(0, C, layout=gl.SliceLayout(0, mma_s))
    rows_h = gl.arange(0, C, layout=gl.SliceLayout(1, mma_h))
    cols_h = gl.arange(0, DH, layout=gl.SliceLayout(0, mma_h))
    st0 = (i_bh * NSEG + i_seg).to(gl.int64)
    if HAS_DS:
        dS0 = gl.load(DS_IN + st0 * F * DV + s_off)
        dS1 = gl.load(DS_IN + st0 * F * DV + FH * DV + s_off)
    else:
        dS0 = gl.zeros([FH, DV], gl.float32, layout=mma_S)
        dS1 = gl.zeros([FH, DV], gl.float32, layout=mma_S)
    mma_Z: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    f_Z = gl.arange(0, F, layout=gl.SliceLayout(1, mma_Z))
    zc = gl.arange(0, 16, layout=gl.SliceLayout(0, mma_Z))
    if NORM and HAS_DS:
        dzv = gl.load(DZ_IN + st0 * F + f_Z)
    else:
        dzv = gl.zeros([F], gl.float32, layout=gl.SliceLayout(1, mma_Z))
    dz = gl.where(zc[None, :] == 0, dzv[:, None], 0.0)  # (F, 16): dz in column 0
    # the state leaving the segment (from global memory: st_s holds the one entering its last chunk);
    # without a gradient leaving the segment its part is 0 and that state is not read (a forward that
    # keeps no state, lizard_fwd_fused(final_state=False), does not write it)
    if HAS_DS:
        slot = i_bh * (NC + 1) + c_hi + 1
        sp = SC + _sc_row(i_bh, c_hi + 1, NC, F, PAIRED).to(gl.int64) * DV
        s_dot = (gl.sum(gl.sum(gl.load(sp + s_off).to(gl.float32) * dS0, axis=1), axis=0)
                 + gl.sum(gl.sum(gl.load(sp + FH * DV + s_off).to(gl.float32) * dS1, axis=1), axis=0))
        if NORM:
            s_dot += gl.sum(dzv * gl.load(ZC + slot * F + f_Z), axis=0)
    else:
        s_dot = gl.sum(dzv, axis=0)  # (dzv is zeros: an fp32 0 of the loop's type)
    # cycles per phase: waits 0 dS's copy read, 2 S read (its slot free), 3 tiles and the dv to add, 4 dd;
    # work 5 dv, 6 dS's copy, 7 the rest (<dS, S_out> among it); 1 unused
    if NPROF > 0:
        pacc, pt = prof_init()
    c_lo = c_hi - n + 1
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # (tokens, width) of half a chunk
    rows_b = gl.arange(0, C // 2, layout=gl.SliceLayout(1, blk))
    nxt = _state_rows(BL, DEN, SIDE_DOT, ZC, alpha, row0 + c_hi * C, i_bh * (NC + 1) + c_hi + 1, f_Z, rows_b, lin, C,
                      NORM, SIDE)
    for i in range(n):
        c = c_hi - i
        sl = i % 2
        qs = q_s.index(sl)
        ks = k_s.index(sl)
        dos = do_s.index(sl)
        # the chunk's gates, den and z's row, read a chunk ahead; the gates then kept in shared memory
        # for the layouts they are read in
        b_lin, den_lin, b_end, z_row, den1, side1, b_h1 = nxt
        if NORM:  # the queries' columns take 1 / (den + eps) too (dn is never formed: do stays as it came)
            bq_lin = b_lin - gl.log(den_lin + eps)
            # ---- the second half of dd's rows (and of dz's operand), written before ds_ready
            mbarrier.wait(in_bar.index(sl), (i // 2) & 1)
            mbarrier.wait(o_bar, i & 1)
            _dd_half(dos, o_s, dd_s.index(sl), den1, side1, 1, eps, blk)
            _dz_half(dd_s.index(sl), b_h1, w_s.index(sl), 1)
        else:
            bq_lin = b_lin
        # ---- dS (dz) leaving the chunk for the chunk partition (once it has read the chunk before's)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 7)
        if i >= 1:
            mbarrier.wait(ds_free, (i - 1) & 1)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 0)
        if NORM:
            dz_s.store(_z_col(dz, zc))
        ds_s.slice(0, FH).store(dS0.to(dt))
        ds_s.slice(FH, FH).store(dS1.to(dt))
        b_s.index(0).store(b_lin)
        b_s.index(1).store(bq_lin)  # (their last reader, the chunk before's, is behind a barrier of this partition)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_ready)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 6)
        # ---- <dS, S_out> + <dz, z_out> (the gate gradient's part after the chunk; the segment's last
        # chunk's came from global memory): dS's copy against S entering the chunk after, still in st_s
        # once the chunk partition has read it; then the state entering this chunk comes into st_s
        if i >= 1:
            if NPROF > 0:
                pacc, pt = prof_tick(pacc, pt, 7)
            mbarrier.wait(tq_done, (i - 1) & 1)
            if NPROF > 0:
                pacc, pt = prof_tick(pacc, pt, 2)
            s_dot = _state_dot(ds_s, st_s, i)
            if PAIRED:
                if c % 2 == 0:  # st_s holds S_c (c + 1 is odd): dv's product adds the rest below
                    s_dot = s_dot * gl.exp(b_end)
            if NORM:
                s_dot += gl.sum(_z_col(dz, zc) * z_row, axis=0)
            gl.thread_barrier()
            if PAIRED:
                if c % 2 == 1:
                    load_tile(sc_d, _sc_row(i_bh, c - 1, NC, F, True), 0, s_bar, st_s)
            else:
                load_tile(sc_d, (i_bh * (NC + 1) + c) * F, 0, s_bar, st_s)
        if not PAIRED:
            sdot_s.index(sl).store(gl.full([C], 0.0, gl.float32, layout=lin) + s_dot)  # read after dv_done

        # ---- dv = e^{b_end - b_s} (phi_k dS) + A^T dn, A^T_st = (phi_k . phi_q)_st e^{b_t - b_s} (s <= t),
        # as (A^T / (den_t + eps)) do
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 7)
        mbarrier.wait(in_bar.index(sl), (i // 2) & 1)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 3)
        at = warpgroup_mma(ks, qs.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False,
                           is_async=True)
        at, _, _ = warpgroup_mma_wait(0, deps=(at, ks, qs))
        b_cols = b_s.index(1).load(gl.SliceLayout(0, mma_s))
        at = at * gl.exp(gl.where(cols_s[None, :] >= rows_s[:, None],
                                  b_cols[None, :] - b_s.index(0).load(gl.SliceLayout(1, mma_s))[:, None],
                                  -float("inf")))
        at = gl.convert_layout(at.to(dt), dot_h)
        r_end = gl.exp(b_end - b_s.index(0).load(gl.SliceLayout(1, mma_h)))
        out = DV_ + (row0 + c * C).to(gl.int64) * DV + rows_h[:, None] * DV
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 7)
        mbarrier.wait(dd_ready, i & 1)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 4)
        if DV_ADD:
            mbarrier.wait(dva_bar, i & 1)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 3)
        if PAIRED:
            kdv = 0.0  # <(K~ dS), V>
        for h in gl.static_range(2):
            ds_h = tile_at_step(ds_s, i).slice(h * DH, DH, dim=1)
            dv = warpgroup_mma(ks, ds_h, gl.zeros([C, DH], gl.float32, layout=mma_h), use_acc=False, is_async=True)
            dv, _, _ = warpgroup_mma_wait(0, deps=(dv, ks, ds_h))
            dv = dv * r_end[:, None]
            if PAIRED:
                kdv += gl.sum(gl.sum(dv * v_s.index(sl).slice(h * DH, DH, dim=1).load(mma_h).to(gl.float32), axis=1),
                              axis=0)
            dv = warpgroup_mma(at, dos.slice(h * DH, DH, dim=1), dv, is_async=True)
            dv, at, _ = warpgroup_mma_wait(0, deps=(dv, at, dos))
            if DV_ADD:
                dv += o_s.slice(h * DH, DH, dim=1).load(mma_h).to(gl.float32)
            if DV_ADD or not NORM:  # out by TMA through o's slot (free: o and the window's dv are read)
                o_s.slice(h * DH, DH, dim=1).store(dv.to(dt))
            else:
                gl.store(out + h * DH + cols_h[None, :], dv.to(DV_.dtype.element_ty))
        if PAIRED:
            if (c % 2 == 0) & (i >= 1):
                s_dot += kdv
            sdot_s.index(sl).store(gl.full([C], 0.0, gl.float32, layout=lin) + s_dot)  # read after dv_done
        if DV_ADD or not NORM:
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(dv_d, [row0 + c * C, 0], o_s)
            tma.store_wait(0)  # the slot read out before the chunk partition brings its next tile into it
        gl.thread_barrier()
        mbarrier.arrive(dv_done)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 5)
        cn = gl.maximum(c - 1, c_lo)  # the next chunk's rows (the last chunk reads its own again)
        nxt = _state_rows(BL, DEN, SIDE_DOT, ZC, alpha, row0 + cn * C, i_bh * (NC + 1) + cn + 1, f_Z, rows_b, lin, C,
                          NORM, SIDE)

        # ---- the gradient entering the chunk: phi_q^T (e^{b_t} dn) as (phi_q e^{b_t} / (den + eps))^T do,
        # the scaled phi_q^T an MMA operand in registers
        g = gl.exp(b_end)
        e_k = gl.exp(b_s.index(1).load(gl.SliceLayout(0, dot_S)))
        qt0 = (qs.slice(0, FH, dim=1).permute((1, 0)).load(dot_S).to(gl.float32) * e_k[None, :]).to(dt)
        qt1 = (qs.slice(FH, FH, dim=1).permute((1, 0)).load(dot_S).to(gl.float32) * e_k[None, :]).to(dt)
        dS0 = warpgroup_mma(qt0, dos, dS0 * g, is_async=True)
        dS1 = warpgroup_mma(qt1, dos, dS1 * g, is_async=True)
        if NORM:
            ws = w_s.index(sl)  # e^{b_t} dd: this partition's half, and the chunk partition's (dd_ready)
            dz = warpgroup_mma(qs.permute((1, 0)), ws, dz * g, is_async=True)
            dS0, dS1, dz, _, _, _, _, _ = warpgroup_mma_wait(0, deps=(dS0, dS1, dz, qt0, qt1, qs, dos, ws))
        else:
            dS0, dS1, _, _, _ = warpgroup_mma_wait(0, deps=(dS0, dS1, qt0, qt1, dos))
    if NPROF > 0:
        pacc, pt = prof_tick(pacc, pt, 7)
        gl.store(PROF + prof_row * 16 + 8 + gl.arange(0, 8, layout=pacc.type.layout), pacc)
    if STORE_DS0:
        if i_seg == 0:
            gl.store(DS0 + i_bh.to(gl.int64) * F * DV + s_off, dS0)
            gl.store(DS0 + i_bh.to(gl.int64) * F * DV + FH * DV + s_off, dS1)
            if NORM:
                gl.store(DZ0 + i_bh.to(gl.int64) * F + f_Z, _z_col(dz, zc))


@gluon.jit
def _gla_bwd_fused_kernel(q_d, k_d, v_d, do_d, o_d, dva_d, dq_d, dk_d, sc_d, SC, BL, DEN, SIDE_DOT, ALPHA, ZC, DS_IN,
                          DZ_IN, DK_, DV_, DG, DS0, DZ0, PROF, T, H, NC, NSEG, SEG_CHUNKS, eps, MODEL_LAYOUT: gl.constexpr,
                          NORM: gl.constexpr, DV_ADD: gl.constexpr, HAS_DS: gl.constexpr, STORE_DS0: gl.constexpr,
                          F: gl.constexpr, DV: gl.constexpr, C: gl.constexpr, SIDE: gl.constexpr = False,
                          NPROF: gl.constexpr = 0, PAIRED: gl.constexpr = False):
    """Grid (NSEG, B*H): the whole backward of one segment of chunks, walked from its end, in two
    partitions (``_bwd_chunk_partition``, ``_bwd_state_partition``). BL: b_t (B*H*T,) fp32; DEN
    (B*H*T,) fp32; ZC (B*H, NC+1, F) fp32; DS_IN (B*H*NSEG, F, DV), DZ_IN (B*H*NSEG, F) fp32: the
    state gradient leaving each segment (HAS_DS); dq_d, dk_d: dq's and dk's tiles, DK_, DV_ the
    (B*H*T, .) contiguous rows of dk (PAIRED) and dv (normalised without DV_ADD); DG (B*H*T,)
    fp32; DS0, DZ0 the initial state's gradient (STORE_DS0, written by segment 0). dva_d: dv's tiles,
    where the window's dv comes from (DV_ADD) and, through o's slot, where dv leaves (DV_ADD or
    unnormalised; else by DV_'s rows). SIDE (normalised): o_d holds y = o + alpha_h x (ALPHA (H,)
    fp32) and SIDE_DOT (B*H*T,) fp32 the rows' do . x (Lizard: y and the window's dy . o_w, so that
    the forward need not store the gated output o beside y). PAIRED: sc holds the states entering
    even chunks only (and the last one; ``_sc_row``), and segments are an even number of chunks:
    each odd chunk's comes from the even one's before it and that chunk's keys and values (the next
    walked, already in the other slot; ``_tq_paired``, and the dv product's part of <dS, S_out>)."""
    i_seg = gl.program_id(0)
    i_bh = gl.program_id(1)
    row0, r_q, c_q, r_k, c_k, r_v, c_v = qkv_rows(MODEL_LAYOUT, i_bh, H, T, F, DV)
    c_lo = i_seg * SEG_CHUNKS
    n = gl.minimum(SEG_CHUNKS, NC - c_lo)
    c_hi = c_lo + n - 1  # the first chunk walked
    dt: gl.constexpr = q_d.dtype

    # two slots of each chunk tile (the next chunk's loads fly while one is computed): 128 KB;
    # with S, dS's bf16 copy, A/M and o about 217 KB, one program per multiprocessor
    q_s = gl.allocate_shared_memory(dt, [2, C, F], q_d.layout)
    k_s = gl.allocate_shared_memory(dt, [2, C, F], k_d.layout)
    v_s = gl.allocate_shared_memory(dt, [2, C, DV], v_d.layout)
    do_s = gl.allocate_shared_memory(dt, [2, C, DV], do_d.layout)
    o_s = gl.allocate_shared_memory(dt, [C, DV], o_d.layout)
    st_s = gl.allocate_shared_memory(dt, [F, DV], sc_d.layout)  # S entering the chunk
    ds_s = gl.allocate_shared_memory(dt, [F, DV], sc_d.layout)  # dS leaving it, for the MMAs
    am_s = gl.allocate_shared_memory(dt, [C, C], gl.NVMMASharedLayout.get_default_for([C, C], dt))  # M
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    dd_s = gl.allocate_shared_memory(gl.float32, [2, C], flat)  # e^{b_t} dd
    dz_s = gl.allocate_shared_memory(gl.float32, [F], flat)
    w_s = gl.allocate_shared_memory(dt, [2, C, 16], gl.NVMMASharedLayout.get_default_for([C, 16], dt))  # e^{b_t} dd
    sdot_s = gl.allocate_shared_memory(gl.float32, [2, C], flat)  # <dS, S_out> + <dz, z_out> in every element
    b_s = gl.allocate_shared_memory(gl.float32, [2, C], flat)  # the chunk's b_t, and b_t - log(den_t + eps)
    in_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # S, o, the dv to add; the handshakes: ds_ready, ds_free, tq_done, dd_ready, dv_done
    bar = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(in_bar.index(i), count=1)
    for i in gl.static_range(8):
        mbarrier.init(bar.index(i), count=1)
    fence_async_shared()
    for j in gl.static_range(2):
        if j < n:
            _load_chunk(q_d, k_d, v_d, do_d, r_q, c_q, r_k, c_k, r_v, c_v, row0, (c_hi - j) * C, in_bar.index(j),
                        q_s.index(j), k_s.index(j), v_s.index(j), do_s.index(j))
    if PAIRED:
        c_s = c_hi - c_hi % 2  # an odd chunk's state is formed from the even one's before it
    else:
        c_s = c_hi
    load_tile(sc_d, _sc_row(i_bh, c_s, NC, F, PAIRED), 0, bar.index(0), st_s)  # s_bar
    if NORM:
        load_tile(o_d, row0 + c_hi * C, 0, bar.index(1), o_s)  # o_bar
    s_bar, o_bar, dva_bar = bar.index(0), bar.index(1), bar.index(2)
    ds_ready, ds_free, tq_done, dd_ready, dv_done = bar.index(3), bar.index(4), bar.index(5), bar.index(6), bar.index(7)
    prof_row = i_bh * NSEG + i_seg
    if SIDE:
        alpha = gl.load(ALPHA + i_bh % H)
    else:
        alpha = 0.0
    gl.warp_specialize([
        (_bwd_chunk_partition, (q_d, k_d, v_d, do_d, o_d, dva_d, dq_d, dk_d, BL, DEN, SIDE_DOT, alpha, ZC, DK_, DG,
                                q_s, k_s, v_s, do_s, o_s, st_s, ds_s, am_s, dd_s, dz_s, w_s, sdot_s, in_bar, s_bar,
                                o_bar,
                                dva_bar, ds_ready, ds_free, tq_done, dd_ready, dv_done, r_q, c_q, r_k, c_k, r_v, c_v,
                                row0, i_bh, c_hi, n, NC, eps, PROF, prof_row, NORM, DV_ADD, SIDE, F, DV, C, NPROF,
                                PAIRED)),
        (_bwd_state_partition, (sc_d, dva_d, SC, BL, DEN, SIDE_DOT, alpha, ZC, DS_IN, DZ_IN, DS0, DZ0, DV_, q_s, k_s,
                                v_s, do_s, o_s, st_s, ds_s, dz_s, w_s, dd_s, sdot_s, b_s, in_bar, s_bar, o_bar, dva_bar,
                                ds_ready, ds_free, tq_done, dd_ready, dv_done, row0, i_bh, i_seg, NSEG, c_hi, n, NC,
                                eps, PROF, prof_row,
                                NORM, DV_ADD, HAS_DS, STORE_DS0, F, DV, C, NPROF, SIDE, PAIRED)),
    ], [4], [248])
    for i in gl.static_range(2):
        mbarrier.invalidate(in_bar.index(i))
    for i in gl.static_range(8):
        mbarrier.invalidate(bar.index(i))


# ----------------------------------------------------------------------------- the fused forward's state partition


@gluon.jit
def _state_out(S0, S1, z, st_s, zq_s, zc):
    """The state's copies for the output partition: S (its two halves of feature rows) in bf16, z as a
    bf16 hi + lo pair (columns 0, 1)."""
    dt: gl.constexpr = st_s.dtype
    FH: gl.constexpr = S0.shape[0]
    st_s.slice(0, FH).store(S0.to(dt))
    st_s.slice(FH, FH).store(S1.to(dt))
    z_hi = z.to(dt)
    z_lo = (z - z_hi.to(gl.float32)).to(dt)
    zq_s.store(gl.where(zc[None, :] == 0, z_hi, gl.where(zc[None, :] == 1, z_lo, 0.0)).to(dt))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _sc_row(i_bh, c, NC, F: gl.constexpr, PAIRED: gl.constexpr):
    """The first of sc's (B*H*slots*F, Dv) rows holding the state entering chunk c (c = NC: the
    state leaving the last chunk): every chunk's in NC + 1 slots, or with PAIRED only those of even
    chunks and NC's, in slot (c + 1) // 2 of (NC + 1) // 2 + 1 (``state_slots``)."""
    if PAIRED:
        slot = i_bh * ((NC + 1) // 2 + 1) + (c + 1) // 2
    else:
        slot = i_bh * (NC + 1) + c
    return slot * F


@gluon.jit
def _store_z(ZC, z, f_Z, zc, i_bh, c, NC, F: gl.constexpr):
    """Training: z entering chunk c (fp32, column 0 of z's (F, 16) product) into row i_bh * (NC + 1) + c
    of ZC's (B*H*(NC+1), F) rows."""
    gl.store(ZC + (i_bh * (NC + 1) + c) * F + f_Z[:, None] + 0 * zc[None, :], z, mask=zc[None, :] == 0)


@gluon.jit
def _store_state(sc_d, st_s, z, ZC, f_Z, zc, i_bh, c, NC, F: gl.constexpr, PAIRED: gl.constexpr):
    """Training: the state entering chunk c for the backward: z (``_store_z``), and S from its bf16
    copy (by TMA) into its slot of sc (``_sc_row``; with PAIRED only even chunks' and the last's)."""
    _store_z(ZC, z, f_Z, zc, i_bh, c, NC, F)
    if PAIRED:
        if (c % 2 == 0) | (c == NC):
            tma.async_copy_shared_to_global(sc_d, [_sc_row(i_bh, c, NC, F, True), 0], st_s)
    else:
        tma.async_copy_shared_to_global(sc_d, [_sc_row(i_bh, c, NC, F, False), 0], st_s)


@gluon.jit
def state_partition(fk_d, sc_d, v_s, fq_s, fk_s, st_s, zq_s, a_s, den_s, ones_s, kv_bar, q_bar, st_ready, st_free,
                     a_ready, BL,
                     S_IN, Z_IN, S_OUT, Z_OUT, ZC, PROF, row0, r_fk, c_fk, c0, nc, i_bh, i_s, nseg, T,
                     HAS_INIT: gl.constexpr, F: gl.constexpr, DV: gl.constexpr, C: gl.constexpr,
                     NPROF: gl.constexpr, TRAIN: gl.constexpr, PAIRED: gl.constexpr = False,
                     FINAL: gl.constexpr = True):
    """One warpgroup carrying the state. Per chunk: the gated scores A = (phi_q phi_k^T) e^{b_t - b_s}
    (s <= t) and their row sums for the output partition (a_s, den_s); K~ = phi_k e^{b_end - b_s}
    (factors <= 1) over phi_k's slot; S <- e^{b_end} S + K~^T V and z <- e^{b_end} z + K~^T 1 (z in
    every column of a (F, 16) product); the next chunk's phi_k; then, once the output partition has
    read the copies, S in st_s and z as a bf16 hi + lo pair in zq_s for the next chunk. TRAIN: the
    state entering every chunk, and the one leaving the last, out for the backward (``_store_state``;
    PAIRED: S only where the chunk is even). FINAL: the state leaving the walk (fp32) into S_OUT, Z_OUT
    (a caller that keeps no state, a training step, asks for none); without it (and without PAIRED) a
    training forward keeps no S leaving the last chunk either, only its z: a backward with no gradient
    leaving the sequence reads none (``_bwd_state_partition``, HAS_DS)."""
    mma_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    mma_Z: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    dt: gl.constexpr = st_s.dtype
    FH: gl.constexpr = F // 2  # S in two halves of feature rows: each one's bf16 copy is made alone
    f_S = gl.arange(0, FH, layout=gl.SliceLayout(1, mma_S))
    dv_S = gl.arange(0, DV, layout=gl.SliceLayout(0, mma_S))
    f_Z = gl.arange(0, F, layout=gl.SliceLayout(1, mma_Z))
    zc = gl.arange(0, 16, layout=gl.SliceLayout(0, mma_Z))
    s_off = f_S[:, None] * DV + dv_S[None, :]
    if HAS_INIT:
        sp = S_IN + (i_bh * nseg + i_s) * F * DV
        S0 = gl.load(sp + s_off)
        S1 = gl.load(sp + FH * DV + s_off)
        z = gl.load(Z_IN + (i_bh * nseg + i_s) * F + f_Z[:, None] + 0 * zc[None, :])
    else:
        S0 = gl.zeros([FH, DV], gl.float32, layout=mma_S)
        S1 = gl.zeros([FH, DV], gl.float32, layout=mma_S)
        z = gl.zeros([F, 16], gl.float32, layout=mma_Z)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows_b = gl.arange(0, C // 2, layout=gl.SliceLayout(1, blk))
    _state_out(S0, S1, z, st_s, zq_s, zc)
    mbarrier.arrive(st_ready)
    if TRAIN:
        _store_state(sc_d, st_s, z, ZC, f_Z, zc, i_bh, c0, T // C, F, PAIRED)
    if NPROF > 0:
        pacc, pt = prof_init()
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    rows_s = gl.arange(0, C, layout=gl.SliceLayout(1, mma_s))
    cols_s = gl.arange(0, C, layout=gl.SliceLayout(0, mma_s))
    causal = cols_s[None, :] <= rows_s[:, None]
    mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    qc = gl.arange(0, 16, layout=gl.SliceLayout(0, mma_q))
    for ci in range(nc):
        c = c0 + ci
        ph = ci & 1
        j = ci + 2  # ring index of this chunk's values
        bl = BL + row0 + c * C
        b_end = gl.load(bl + C - 1)
        b_r = gl.load(bl + rows_s)
        b_c = gl.load(bl + cols_s)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 2)
        mbarrier.wait(q_bar.index(1), ph)
        mbarrier.wait(q_bar.index(2), ph)
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 0)
        # A for the output partition (its copy of the chunk before was read: st_free below)
        # and the normaliser's whole den = rowsum(A) + e^{b_t} phi_q . z (z of the chunk before, as
        # the hi + lo pair in zq_s)
        fqv = tile_at_step(fq_s, ci)  # (views through tile_at_step: their descriptors formed here, not hoisted and spilled)
        fkv = tile_at_step(fk_s, ci)
        zqv = tile_at_step(zq_s, ci)
        a = warpgroup_mma(fqv, fkv.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s),
                          use_acc=False, is_async=True)
        qz = warpgroup_mma(fqv, zqv, gl.zeros([C, 16], gl.float32, layout=mma_q), use_acc=False,
                           is_async=True)
        a, qz, _, _, _ = warpgroup_mma_wait(0, deps=(a, qz, fqv, fkv, zqv))
        a = a * gl.exp(gl.where(causal, b_r[:, None] - b_c[None, :], -float("inf")))
        qz = gl.convert_layout(gl.sum(gl.where(qc[None, :] < 2, qz, 0.0), axis=1), gl.SliceLayout(1, mma_s))
        den_s.store(gl.sum(a, axis=1) + gl.exp(b_r) * qz)
        a_s.store(a.to(dt))
        for h in gl.static_range(2):  # K~ in two halves of rows (fewer registers live beside S)
            part = fk_s.slice(h * (C // 2), C // 2)
            b_h = gl.load(bl + h * (C // 2) + rows_b)
            part.store((part.load(blk).to(gl.float32) * gl.exp(b_end - b_h)[:, None]).to(dt))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(a_ready)
        g = gl.exp(b_end)
        mbarrier.wait(kv_bar.index(j % 3), (j // 3) & 1)
        vj = v_s.index(j % 3)
        onesv = tile_at_step(ones_s, ci)
        S0 = warpgroup_mma(fkv.slice(0, FH, dim=1).permute((1, 0)), vj, S0 * g, is_async=True)
        S1 = warpgroup_mma(fkv.slice(FH, FH, dim=1).permute((1, 0)), vj, S1 * g, is_async=True)
        z = warpgroup_mma(fkv.permute((1, 0)), onesv, z * g, is_async=True)
        S0, S1, z, _, _, _ = warpgroup_mma_wait(0, deps=(S0, S1, z, fkv, vj, onesv))
        gl.thread_barrier()
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 1)
        if ci + 1 < nc:
            load_tile(fk_d, r_fk + (c + 1) * C, c_fk, q_bar.index(2), fk_s)
        mbarrier.wait(st_free, ph)  # the output partition has read the copies of S and A
        if NPROF > 0:
            pacc, pt = prof_tick(pacc, pt, 3)
        if ci + 1 < nc:
            if TRAIN:
                tma.store_wait(0)  # the copy of the chunk before has left st_s
                gl.thread_barrier()
            _state_out(S0, S1, z, st_s, zq_s, zc)
            mbarrier.arrive(st_ready)
            if TRAIN:
                _store_state(sc_d, st_s, z, ZC, f_Z, zc, i_bh, c + 1, T // C, F, PAIRED)
    if TRAIN:
        tma.store_wait(0)
        if i_s == nseg - 1:  # and the state leaving the last chunk (the st_s copy of it is read: st_free)
            if FINAL or PAIRED:
                gl.thread_barrier()
                _state_out(S0, S1, z, st_s, zq_s, zc)
                _store_state(sc_d, st_s, z, ZC, f_Z, zc, i_bh, c0 + nc, T // C, F, PAIRED)
                tma.store_wait(0)
            else:
                _store_z(ZC, z, f_Z, zc, i_bh, c0 + nc, T // C, F)
    if NPROF > 0:
        gl.store(PROF + (i_bh * nseg + i_s) * 16 + 8 + gl.arange(0, 8, layout=pacc.type.layout), pacc)
    if FINAL:
        if i_s == nseg - 1:
            gl.store(S_OUT + i_bh * F * DV + s_off, S0)
            gl.store(S_OUT + i_bh * F * DV + FH * DV + s_off, S1)
            gl.store(Z_OUT + i_bh * F + f_Z[:, None] + 0 * zc[None, :], z, mask=zc[None, :] == 0)


# ----------------------------------------------------------------------------- GLA's fused forward


@gluon.jit
def gated_smem(fq_d, fk_d, y_d, F: gl.constexpr, DV: gl.constexpr, C: gl.constexpr):
    """The fused forwards' shared memory for the gated branch and the output: phi_q's and phi_k's
    tiles, the state's copies (S; z as a bf16 hi + lo pair), the ones the normaliser's product
    takes, y's two staging slots, A and den; the barriers of the tiles (q_bar: the window's q_w
    (Lizard's), phi_q, phi_k) and of the partitions' handshakes (hs), initialised."""
    dt: gl.constexpr = fq_d.dtype
    fq_s = gl.allocate_shared_memory(dt, [C, F], fq_d.layout)
    fk_s = gl.allocate_shared_memory(dt, [C, F], fk_d.layout)
    st_s = gl.allocate_shared_memory(dt, [F, DV], gl.NVMMASharedLayout.get_default_for([F, DV], dt))
    zq_s = gl.allocate_shared_memory(dt, [F, 16], gl.NVMMASharedLayout.get_default_for([F, 16], dt))
    ones_s = gl.allocate_shared_memory(dt, [C, 16], gl.NVMMASharedLayout.get_default_for([C, 16], dt))
    y_s = gl.allocate_shared_memory(dt, [2, C, DV], y_d.layout)  # staging for the stores, used in turn
    a_s = gl.allocate_shared_memory(dt, [C, C], gl.NVMMASharedLayout.get_default_for([C, C], dt))
    den_s = gl.allocate_shared_memory(gl.float32, [C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    hs = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(hs.index(i), count=1)
    ones_s.store(gl.full([C, 16], 1.0, dt, layout=gl.BlockedLayout([1, 8], [16, 2], [gl.num_warps(), 1], [1, 0])))
    return fq_s, fk_s, st_s, zq_s, ones_s, y_s, a_s, den_s, q_bar, hs


@gluon.jit
def _gla_fwd_output_partition(fq_d, v_d, y_d, BL, fq_s, v_s, st_s, a_s, den_s, y_s, kv_bar, q_bar, st_ready, st_free,
                              a_ready, row0, r_v, c_v, r_fq, c_fq, c0, nc, eps, DV: gl.constexpr, C: gl.constexpr,
                              NORM: gl.constexpr):
    """One warpgroup: per chunk o = e^{b_t} phi_q S + A V from the state partition's copies of S
    (st_s) and A (a_s), over its den (den_s) where NORM, out by TMA; it issues phi_q's and v's loads
    (the state partition brings phi_k)."""
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    rows_o = gl.arange(0, C, layout=gl.SliceLayout(1, mma_o))
    for ci in range(nc):
        c = c0 + ci
        ph = ci & 1
        j = ci + 2  # ring index of this chunk's values (the state partition's: Lizard's window ring)
        e_t = gl.exp(gl.load(BL + row0 + c * C + rows_o))
        mbarrier.wait(q_bar.index(1), ph)
        mbarrier.wait(st_ready, ph)
        mbarrier.wait(a_ready, ph)
        fqv = tile_at_step(fq_s, ci)
        stv = tile_at_step(st_s, ci)
        o_i = warpgroup_mma(fqv, stv, gl.zeros([C, DV], gl.float32, layout=mma_o), use_acc=False, is_async=True)
        o_i, _, _ = warpgroup_mma_wait(0, deps=(o_i, fqv, stv))
        mbarrier.wait(kv_bar.index(j % 3), (j // 3) & 1)
        vj = v_s.index(j % 3)
        av = tile_at_step(a_s, ci)
        num = warpgroup_mma(av, vj, o_i * e_t[:, None], is_async=True)
        num, _, _ = warpgroup_mma_wait(0, deps=(num, av, vj))
        if NORM:
            num = num * (1.0 / (den_s.load(gl.SliceLayout(1, mma_o)) + eps))[:, None]
        gl.thread_barrier()
        mbarrier.arrive(st_free)  # the copies of S, z and A are read: the state partition may write the next
        if ci + 1 < nc:  # phi_q, and v into the slot of two chunks back (the state partition is past it)
            load_tile(fq_d, r_fq + (c + 1) * C, c_fq, q_bar.index(1), fq_s)
            load_tile(v_d, r_v + (c + 1) * C, c_v, kv_bar.index((j + 1) % 3), v_s.index((j + 1) % 3))
        store_tile(y_d, row0 + c * C, num, y_s.index(ci % 2), 1)
    tma.store_wait(0)
    return (eps,)


@gluon.jit
def _gla_fwd_fused_kernel(fq_d, fk_d, v_d, y_d, BL, S_IN, Z_IN, S_OUT, Z_OUT, T, H, seg_len, nseg, eps,
                          MODEL_LAYOUT: gl.constexpr, HAS_INIT: gl.constexpr, NORM: gl.constexpr, F: gl.constexpr,
                          DV: gl.constexpr, C: gl.constexpr):
    """GLA's forward in one pass: Lizard's fused forward (``lizard_gluon``) without the window. One
    program per (segment, batch x head) walks its chunks in order in two warpgroups: the output
    one above, and the state one (``state_partition``: A, den, S and z in fp32 registers, their
    bf16 copies). Each tile is read once, by TMA, while the chunk before is computed."""
    i_s = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    row0 = i_bh * T  # y's and b's (B*H*T, .) rows: this batch x head's first
    r_fq, c_fq = row_col(MODEL_LAYOUT, 0, i_b, i_h, row0, T, F)
    r_fk, c_fk = row_col(MODEL_LAYOUT, 1, i_b, i_h, row0, T, F)
    r_v, c_v = row_col(MODEL_LAYOUT, 2, i_b, i_h, row0, T, DV)
    c0 = i_s * (seg_len // C)
    nc = gl.minimum(seg_len // C, T // C - c0)
    dt: gl.constexpr = v_d.dtype

    v_s = gl.allocate_shared_memory(dt, [3, C, DV], v_d.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(kv_bar.index(i), count=1)
    fq_s, fk_s, st_s, zq_s, ones_s, y_s, a_s, den_s, q_bar, hs = gated_smem(fq_d, fk_d, y_d, F, DV, C)
    # the ring's first two slots stand for the two chunks before, which only Lizard's window reads:
    # their first phase completes empty, so the walk's ring index and phases are Lizard's
    mbarrier.arrive(kv_bar.index(0))
    mbarrier.arrive(kv_bar.index(1))
    load_tile(v_d, r_v + c0 * C, c_v, kv_bar.index(2), v_s.index(2))
    load_tile(fq_d, r_fq + c0 * C, c_fq, q_bar.index(1), fq_s)
    load_tile(fk_d, r_fk + c0 * C, c_fk, q_bar.index(2), fk_s)
    fence_async_shared()
    gl.thread_barrier()

    st_ready = hs.index(0)
    st_free = hs.index(1)
    a_ready = hs.index(2)
    gl.warp_specialize([
        (_gla_fwd_output_partition, (fq_d, v_d, y_d, BL, fq_s, v_s, st_s, a_s, den_s, y_s, kv_bar, q_bar, st_ready,
                                     st_free, a_ready, row0, r_v, c_v, r_fq, c_fq, c0, nc, eps, DV, C, NORM)),
        (state_partition, (fk_d, fk_d, v_s, fq_s, fk_s, st_s, zq_s, a_s, den_s, ones_s, kv_bar, q_bar, st_ready,
                            st_free, a_ready, BL, S_IN, Z_IN, S_OUT, Z_OUT, BL, BL, row0, r_fk, c_fk, c0, nc, i_bh,
                            i_s, nseg, T, HAS_INIT, F, DV, C, 0, False)),
    ], [4], [232])
    for i in gl.static_range(3):
        mbarrier.invalidate(kv_bar.index(i))
        mbarrier.invalidate(q_bar.index(i))
        mbarrier.invalidate(hs.index(i))


def state_slots(NC: int, paired: bool) -> int:
    """The states a training forward keeps per (batch x head) for the backward over NC chunks: the
    one entering every chunk and the one leaving the last, or ``paired``, those entering even
    chunks and the last one (``_sc_row``)."""
    return (NC + 1) // 2 + 1 if paired else NC + 1


def supports_bwd_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, log_space: bool) -> bool:
    """Whether ``bwd_chunks`` takes these inputs (see the module's scope)."""
    if sm_major(q) != 9:
        return False
    xs = (q, k, v)
    return (chunk == BT and not log_space and q.dtype in (torch.bfloat16, torch.float16)
            and all(x.dtype == q.dtype and x.shape[-1] == WIDTH and x.shape[:3] == q.shape[:3] for x in xs)
            and q.shape[2] % BT == 0 and tma_readable(xs))


def chunk_gates(log_g: torch.Tensor) -> torch.Tensor:
    """b_t: the gates' cumulative sum within each chunk of BT tokens, from its start, (B*H*T,) fp32."""
    B, H, T = log_g.shape
    return log_g.float().reshape(B, H, T // BT, BT).cumsum(-1).reshape(-1).contiguous()


def bwd_chunks(q, k, v, log_g, do, den, dden, sc, zc, dsc, dzc, yc, dq, dk, dv, dlog_g, *, normalize: bool,
               eps: float, dv_add: bool) -> None:
    """The chunk pass into dq, dk, dv ((B, H, T, .) contiguous; dv accumulated into with ``dv_add``)
    and dlog_g ((B*H, T) fp32), from the reverse pass's outputs (``ops.gla.triton.bwd_states``): do
    (B, H, T, Dv) contiguous, den, dden (B*H, T) fp32, sc (B*H, NC+1, F, Dv) and dsc (B*H, NC, F, Dv)
    in q's dtype, zc, dzc, yc fp32 (ignored where not ``normalize``, but for yc)."""
    B, H, T, F = q.shape
    DV = v.shape[-1]
    NC = T // BT
    tiles = tma_tiles([q, k, v, do], [BT, WIDTH])
    if tiles is None or not (sc.is_contiguous() and dsc.is_contiguous()):
        raise ValueError("gla_gluon.bwd_chunks: inputs outside its scope (supports_bwd_chunks)")
    descs, views = tiles
    states = tma_tiles([sc.view(B * H, NC + 1, F, DV), dsc.view(B * H, NC, F, DV)], [F, DV])[0]
    _gla_bwd_chunk_kernel[(NC, B * H)](
        *descs, *states, chunk_gates(log_g), den, dden, zc, dzc, yc, dq, dk, dv, dlog_g,
        T, H, NC, eps, MODEL_LAYOUT=model_layout_bits(views[:3]), NORM=normalize, DV_ADD=dv_add,
        NVD=yc.shape[-1], F=F, DV=DV, C=BT, num_warps=4)


def bwd_fused(q, k, v, log_g, o, den, sc, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g, dS0, dz0, *, seg_chunks: int,
              normalize: bool, eps: float, dv_add: bool, side_dot: Optional[torch.Tensor] = None,
              alpha: Optional[torch.Tensor] = None, prof: Optional[torch.Tensor] = None, paired: bool = False,
              bl: Optional[torch.Tensor] = None) -> None:
    """The whole backward (``_gla_bwd_fused_kernel``) into dq, dk, dv ((B, H, T, .) contiguous; dv
    accumulated into with ``dv_add``), dlog_g ((B*H, T) fp32) and, where given, dS0 (B, H, F, Dv)
    and dz0 (B, H, F) fp32. o (B, H, T, Dv) contiguous (read where ``normalize``), do likewise;
    den (B*H, T) fp32; sc (B*H, NC+1, F, Dv) in q's dtype, zc (B*H, NC+1, F) fp32; ds_in
    (B*H*nseg, F, Dv), dz_in (B*H*nseg, F) fp32 or None: the state gradient leaving each segment of
    ``seg_chunks`` chunks (the last may be shorter). With ``side_dot`` ((B*H, T) fp32) and ``alpha``
    ((H,) fp32), normalised: o is y = o_g + alpha_h x and side_dot the rows' do . x. ``paired``: sc
    holds the states entering even chunks and the last one only ((B*H, state_slots(NC, True), F, Dv),
    Lizard's fused training forward's ``paired_states``); segments then of an even number of chunks
    (or one). ``bl``: ``chunk_gates(log_g)`` where the caller has it (Lizard's fused forward made
    it), else formed here. ``prof``
    (B*H*nseg, 16) int64, zeroed: a profiling build adds each program's cycles per phase into it."""
    B, H, T, F = q.shape
    DV = v.shape[-1]
    NC = T // BT
    nseg = -(-NC // seg_chunks)
    tiles = tma_tiles([q, k, v, do, o if normalize else do, dv, dq, dk], [BT, WIDTH])
    if tiles is None or not (sc.is_contiguous() and (ds_in is not None or nseg == 1) and dv.is_contiguous()
                             and dq.is_contiguous() and dk.is_contiguous()):
        raise ValueError("gla_gluon.bwd_fused: inputs outside its scope (supports_bwd_chunks)")
    slots = state_slots(NC, paired)
    if sc.numel() != B * H * slots * F * DV:
        raise ValueError(f"gla_gluon.bwd_fused: sc must hold {slots} states of ({F}, {DV}) per batch x head "
                         f"(paired={paired}, {NC} chunks), got {tuple(sc.shape)}")
    if paired and nseg > 1 and seg_chunks % 2:
        raise ValueError(f"gla_gluon.bwd_fused: paired states take segments of an even number of chunks, got "
                         f"seg_chunks={seg_chunks}")
    descs, views = tiles
    st_d = tma_tiles([sc.view(B * H, slots, F, DV)], [F, DV])[0][0]
    side = side_dot is not None
    if side and not (normalize and alpha is not None and side_dot.is_contiguous() and side_dot.numel() == B * H * T
                     and alpha.numel() == H and alpha.dtype == torch.float32 and side_dot.dtype == torch.float32):
        raise ValueError("gla_gluon.bwd_fused: side_dot takes normalize, (B*H, T) fp32 side_dot and (H,) fp32 alpha")
    if bl is None:
        bl = chunk_gates(log_g)
    elif not (bl.dtype == torch.float32 and bl.is_contiguous() and bl.numel() == B * H * T):
        raise ValueError(f"gla_gluon.bwd_fused: bl must be ({B * H * T},) fp32 contiguous (chunk_gates), got "
                         f"{tuple(bl.shape)} {bl.dtype}")
    f32 = dlog_g  # a placeholder for the pointers a configuration does not read
    _gla_bwd_fused_kernel[(nseg, B * H)](
        *descs, st_d, sc, bl, den if normalize else f32, side_dot if side else f32,
        alpha if side else f32, zc if normalize else f32,
        ds_in if ds_in is not None else f32, dz_in if (ds_in is not None and normalize) else f32,
        dk, dv, dlog_g, dS0 if dS0 is not None else f32, dz0 if dz0 is not None else f32,
        prof if prof is not None else f32, T, H, NC, nseg, seg_chunks, eps, MODEL_LAYOUT=model_layout_bits(views[:3]),
        NORM=normalize, DV_ADD=dv_add, HAS_DS=ds_in is not None, STORE_DS0=dS0 is not None, F=F, DV=DV, C=BT,
        SIDE=side, PAIRED=paired, **({"NPROF": 8} if prof is not None else {}), num_warps=4)


def supports_fwd_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor) -> bool:
    """Whether ``fwd_fused`` takes these inputs: Hopper, bf16/fp16 q, k, v of width 128 in one of
    ``view2d``'s layouts, fp32 gates, T a multiple of the chunk (features plain, not log-space: the
    caller's part)."""
    if sm_major(v) != 9:
        return False
    T = v.shape[2]
    return (v.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype
            and q.shape[-1] == k.shape[-1] == v.shape[-1] == WIDTH and T % BT == 0 and T > 0
            and log_g.dtype == torch.float32 and tma_readable([q, k, v]))


def fwd_fused(q, k, v, log_g, *, normalize: bool, eps: float, nseg: int = 1, S_in: Optional[torch.Tensor] = None,
              z_in: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GLA's forward in one kernel (``_gla_fwd_fused_kernel``; inference: nothing kept for a
    backward): o (B, H, T, Dv) in v's dtype (over den + eps where ``normalize``), S_T (B, H, F, Dv)
    and z_T (B, H, F) fp32. ``nseg`` > 1: about that many sequence segments (``segment_plan``), a
    program each, S_in (B*H, nseg, F, Dv) and z_in (B*H, nseg, F) fp32 the states entering them
    (``segment_states``); else S_in, z_in the initial state ((B*H, 1, .) fp32) or None."""
    B, H, T, DV = v.shape
    F = q.shape[-1]
    nseg, seg_len = segment_plan(T, nseg)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # (B, H, T, Dv) contiguous, whatever v's layout
    descs, views = tma_tiles([q, k, v, o], [BT, WIDTH])
    S_T = torch.empty(B, H, F, DV, dtype=torch.float32, device=v.device)
    z_T = torch.empty(B, H, F, dtype=torch.float32, device=v.device)
    has_init = S_in is not None
    _gla_fwd_fused_kernel[(nseg, B * H)](
        *descs, chunk_gates(log_g), S_in if has_init else S_T, z_in if has_init else z_T, S_T, z_T, T, H, seg_len,
        nseg, eps, MODEL_LAYOUT=model_layout_bits(views[:3]), HAS_INIT=has_init, NORM=normalize, F=F, DV=DV, C=BT,
        num_warps=4)
    return o, S_T, z_T


def segment_plan(T: int, nseg: int) -> tuple[int, int]:
    """(segments, tokens per segment) for about ``nseg`` segments of whole chunks over T tokens."""
    seg_chunks = math.ceil(T // BT / nseg)
    return math.ceil(T // BT / seg_chunks), seg_chunks * BT


def segment_states(phi_k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, seg_len: int, nseg: int, cfg=None):
    """The state and normaliser entering each of ``nseg`` segments of ``seg_len`` tokens, from a zero
    start: (B*H, nseg, F, Dv) and (B*H, nseg, F) fp32. The gated op's own segment pre-pass (each
    segment's state from zero, the last segment's not needed) and its scan (``ops.gla.triton``), launched
    as ``cfg`` (a ``GLALaunch``; default ``LAUNCH``) says."""
    from . import triton as kgla

    B, H, T, F = phi_k.shape
    DV = v.shape[-1]
    cfg = cfg or kgla.LAUNCH
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


def compile_gluon(kernel, args: dict, consts: dict, num_warps: int):
    """Compile a Gluon kernel for sm_90a without a GPU; returns Triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig = {k: mangle_type(v) for k, v in args.items()}
    sig.update({k: "constexpr" for k in consts})
    names = [p.name for p in kernel.params]
    # as a launch specialises: pointers (16-byte aligned) and integers that are multiples of 16 are
    # known to divide by 16 (without it global stores of pairs compile to 2-byte stores, say)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in args.items()
             if isinstance(v, torch.Tensor) or (type(v) is int and v % 16 == 0)}
    src = GluonASTSource(kernel, sig, {(names.index(k),): v for k, v in consts.items()}, attrs)
    return tcompile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def compile_args():
    """Stand-ins of the kernels' arguments for ``compile_gluon``: a tile descriptor, a state descriptor,
    fp32 and bf16 pointers."""
    x = torch.empty(2 * 4 * 256, WIDTH, dtype=torch.bfloat16)
    d = TensorDescriptor.from_tensor(x, [BT, WIDTH], gl.NVMMASharedLayout.get_default_for([BT, WIDTH], gl.bfloat16))
    ds = TensorDescriptor.from_tensor(x, [WIDTH, WIDTH], gl.NVMMASharedLayout.get_default_for([WIDTH, WIDTH],
                                                                                              gl.bfloat16))
    return d, ds, torch.empty(16, dtype=torch.float32), torch.empty(16, dtype=torch.bfloat16)


def compile_for_hopper(normalize: bool = True, dv_add: bool = False, model_layout: int = 0, nvd: int = 1):
    """Compile the chunk pass for sm_90a without a GPU (CI, probes); returns Triton's compiled kernel."""
    d, ds, f32, bf = compile_args()
    args = dict(q_d=d, k_d=d, v_d=d, do_d=d, sc_d=ds, dsc_d=ds, BL=f32, DEN=f32, DDEN=f32, ZC=f32, DZC=f32, YC=f32,
                DQ=bf, DK_=bf, DV_=bf, DG=f32, T=256, H=4, NC=4, eps=1e-6)
    consts = dict(MODEL_LAYOUT=model_layout, NORM=normalize, DV_ADD=dv_add, NVD=nvd, F=WIDTH, DV=WIDTH, C=BT)
    return compile_gluon(_gla_bwd_chunk_kernel, args, consts, num_warps=4)


def compile_fused_for_hopper(normalize: bool = True, dv_add: bool = False, has_ds: bool = False,
                             store_ds0: bool = False, model_layout: int = 0, seg_chunks: int = 4, nprof: int = 0,
                             side: bool = False, paired: bool = False):
    """Compile the fused backward for sm_90a without a GPU (CI, probes); returns Triton's compiled kernel."""
    d, ds, f32, bf = compile_args()
    args = dict(q_d=d, k_d=d, v_d=d, do_d=d, o_d=d, dva_d=d, dq_d=d, dk_d=d, sc_d=ds, SC=bf, BL=f32, DEN=f32,
                SIDE_DOT=f32, ALPHA=f32, ZC=f32, DS_IN=f32, DZ_IN=f32, DK_=bf, DV_=bf, DG=f32, DS0=f32, DZ0=f32, PROF=f32, T=256, H=4, NC=4, NSEG=2,
                SEG_CHUNKS=seg_chunks, eps=1e-6)
    consts = dict(MODEL_LAYOUT=model_layout, NORM=normalize, DV_ADD=dv_add, HAS_DS=has_ds, STORE_DS0=store_ds0,
                  F=WIDTH, DV=WIDTH, C=BT, SIDE=side, NPROF=nprof, PAIRED=paired)
    if nprof:
        args["PROF"] = torch.empty(16, dtype=torch.int64)
    return compile_gluon(_gla_bwd_fused_kernel, args, consts, num_warps=4)


def compile_fwd_fused_for_hopper(normalize: bool = False, has_init: bool = False, model_layout: int = 0):
    """Compile GLA's fused forward for sm_90a without a GPU (CI, probes); returns Triton's compiled kernel."""
    d, _, f32, _ = compile_args()
    args = dict(fq_d=d, fk_d=d, v_d=d, y_d=d, BL=f32, S_IN=f32, Z_IN=f32, S_OUT=f32, Z_OUT=f32, T=256, H=4,
                seg_len=256, nseg=1, eps=1e-6)
    consts = dict(MODEL_LAYOUT=model_layout, HAS_INIT=has_init, NORM=normalize, F=WIDTH, DV=WIDTH, C=BT)
    return compile_gluon(_gla_fwd_fused_kernel, args, consts, num_warps=4)
