"""The backward's chunk pass of gated linear attention as a hand-written Hopper kernel (Gluon).

Same math, inputs and outputs as ``gla._gla_bwd_chunk_kernel`` (see ``kernels.gla``'s docstring):
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

Scope: CUDA sm_90, bf16/fp16, Dk = Dv = 128, chunks of 64 with T a multiple of 64, plain
features (not log-space); q, k, v (B, H, T, D) contiguous or a model's (B, T, H, D) transposed.
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BT = 64  # tokens per chunk
WIDTH = 128  # the one feature and value width the kernels take


# ----------------------------------------------------------------------------- shared pieces


@gluon.jit
def _load_tile(desc, row, col, bar, dst):
    mbarrier.expect(bar, dst.numel * 2)  # 16-bit elements
    tma.async_copy_global_to_shared(desc, [row, col], bar, dst)


@gluon.jit
def _load_pair(da, db, ra, ca, rb, cb, bar, sa, sb):
    """Two tiles by TMA on one barrier."""
    mbarrier.expect(bar, (sa.numel + sb.numel) * 2)
    tma.async_copy_global_to_shared(da, [ra, ca], bar, sa)
    tma.async_copy_global_to_shared(db, [rb, cb], bar, sb)


@gluon.jit
def _row_col(MODEL_LAYOUT: gl.constexpr, i: gl.constexpr, i_b, i_h, row0, T, D: gl.constexpr):
    """(first row, column) of one batch x head in input i's 2-D view (``view2d``): bit i of
    MODEL_LAYOUT set for a (B*T, H*D) view, else (B*H*T, D) with row0 = (batch x head) * T."""
    if (MODEL_LAYOUT >> i) & 1:
        return i_b * T, i_h * D
    else:
        return row0, 0


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


def tma_readable(xs) -> bool:
    """Whether TMA can read each of xs ((B, H, T, D)): in one of ``view2d``'s layouts, 16-byte aligned."""
    return all(view2d(x) is not None and x.data_ptr() % 16 == 0 for x in xs)


def tma_tiles(xs, block) -> Optional[list]:
    """Tensor descriptors of ``block`` tiles over each of xs (16-bit, (B, H, T, D)) in its 2-D view,
    and the views; None where TMA cannot read one of them (``tma_readable``)."""
    if not tma_readable(xs):
        return None
    views = [view2d(x) for x in xs]
    el = gl.bfloat16 if xs[0].dtype == torch.bfloat16 else gl.float16
    lay = gl.NVMMASharedLayout.get_default_for(block, el)
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
    i_b = i_bh // H
    i_h = i_bh % H
    row0 = i_bh * T
    r_q, c_q = _row_col(MODEL_LAYOUT, 0, i_b, i_h, row0, T, F)
    r_k, c_k = _row_col(MODEL_LAYOUT, 1, i_b, i_h, row0, T, F)
    r_v, c_v = _row_col(MODEL_LAYOUT, 2, i_b, i_h, row0, T, DV)
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
    _load_tile(sc_d, (i_bh * (NC + 1) + i_c) * F, 0, bar.index(2), st_s)

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


def supports_bwd_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, log_space: bool) -> bool:
    """Whether ``bwd_chunks`` takes these inputs (see the module's scope)."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
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
    and dlog_g ((B*H, T) fp32), from the reverse pass's outputs (``kernels.gla.bwd_states``): do
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


def compile_for_hopper(normalize: bool = True, dv_add: bool = False, model_layout: int = 0, nvd: int = 1):
    """Compile the chunk pass for sm_90a without a GPU (CI, probes); returns Triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    x = torch.empty(2 * 4 * 256, WIDTH, dtype=torch.bfloat16)
    lay = gl.NVMMASharedLayout.get_default_for([BT, WIDTH], gl.bfloat16)
    d = TensorDescriptor.from_tensor(x, [BT, WIDTH], lay)
    ds = TensorDescriptor.from_tensor(x, [WIDTH, WIDTH], gl.NVMMASharedLayout.get_default_for([WIDTH, WIDTH],
                                                                                              gl.bfloat16))
    f32 = torch.empty(16, dtype=torch.float32)
    bf = torch.empty(16, dtype=torch.bfloat16)
    args = dict(q_d=d, k_d=d, v_d=d, do_d=d, sc_d=ds, dsc_d=ds, BL=f32, DEN=f32, DDEN=f32, ZC=f32, DZC=f32, YC=f32,
                DQ=bf, DK_=bf, DV_=bf, DG=f32, T=256, H=4, NC=4, eps=1e-6)
    sig = {k: mangle_type(v) for k, v in args.items()}
    consts = dict(MODEL_LAYOUT=model_layout, NORM=normalize, DV_ADD=dv_add, NVD=nvd, F=WIDTH, DV=WIDTH, C=BT)
    sig.update({k: "constexpr" for k in consts})
    names = [p.name for p in _gla_bwd_chunk_kernel.params]
    src = GluonASTSource(_gla_bwd_chunk_kernel, sig, {(names.index(k),): v for k, v in consts.items()})
    return tcompile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
