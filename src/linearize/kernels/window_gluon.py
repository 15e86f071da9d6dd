"""The sliding window's backward (dq, dk, dv) as one hand-written Hopper kernel (Gluon).

Same math as ``window._win_bwd_dq_kernel`` and ``window._win_bwd_dkdv_kernel`` (see
``kernels.window``'s docstring), for windows of at most 129 keys, so that a chunk of 64 queries
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

Scope: CUDA sm_90, bf16/fp16, D = Dv = 128, T a multiple of 64, window <= 129, no left padding;
q, k, v (B, H, T, D) contiguous or a model's (B, T, H, D) transposed; dy, lse, D contiguous.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gla_gluon import _load_pair, _row_col, model_layout_bits, tma_readable, tma_tiles

BT = 64  # tokens per chunk (query and key tiles)
WIDTH = 128


@gluon.jit
def _dq_partition(q_s, dy_s, k_s, v_s, bar_q, bar_kv, LSE, DELTA, DQ, tok, c, alpha, qk_scale, sm_scale,
                  W: gl.constexpr, C: gl.constexpr, D: gl.constexpr):
    """dq of the chunk's queries from the key tiles c, c-1, c-2 (slots 0, 1, 2)."""
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    dot_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    dt: gl.constexpr = q_s.dtype
    rows = gl.arange(0, C, layout=gl.SliceLayout(1, mma_s))
    cols = gl.arange(0, C, layout=gl.SliceLayout(0, mma_s))
    lse = gl.load(LSE + tok + rows)
    delta = gl.load(DELTA + tok + rows)
    dq = gl.zeros([C, D], gl.float32, layout=mma_o)
    mbarrier.wait(bar_q.index(0), 0)
    for d in gl.static_range(3):  # key tile c - d: key col visible iff col <= row + d C and col > row + d C - W
        mbarrier.wait(bar_kv.index(d), 0)
        kd = k_s.index(d)
        vd = v_s.index(d)
        s = warpgroup_mma(q_s.index(0), kd.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s),
                          use_acc=False, is_async=True)
        dp = warpgroup_mma(dy_s.index(0), vd.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s),
                           use_acc=False, is_async=True)
        s, dp, _, _, _, _ = warpgroup_mma_wait(0, deps=(s, dp, q_s.index(0), kd, dy_s.index(0), vd))
        vis = (cols[None, :] <= rows[:, None] + d * C) & (cols[None, :] > rows[:, None] + (d * C - W)) & (c >= d)
        p = gl.where(vis, gl.exp2(s * qk_scale - lse[:, None]), 0.0)
        ds = gl.convert_layout((p * (dp * alpha - delta[:, None])).to(dt), dot_o)
        dq = warpgroup_mma(ds, kd, dq, is_async=True)
        dq, _, _ = warpgroup_mma_wait(0, deps=(dq, ds, kd))
    rows_o = gl.arange(0, C, layout=gl.SliceLayout(1, mma_o))
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, mma_o))
    gl.store(DQ + tok.to(gl.int64) * D + (rows_o[:, None] * D + cols_o[None, :]), (dq * sm_scale).to(dt))


@gluon.jit
def _dkdv_partition(q_s, dy_s, k_s, v_s, bar_q, bar_kv, LSE, DELTA, DK, DV_, tok, c, nc, alpha, qk_scale,
                    sm_scale, W: gl.constexpr, C: gl.constexpr, D: gl.constexpr, DV: gl.constexpr):
    """dk, dv of the chunk's keys from the query tiles c, c+1, c+2 (slots 0, 1, 2), transposed:
    rows are keys, so p^T and ds^T are left operands from registers."""
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    dot_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    dt: gl.constexpr = q_s.dtype
    keys = gl.arange(0, C, layout=gl.SliceLayout(1, mma_s))
    qry = gl.arange(0, C, layout=gl.SliceLayout(0, mma_s))
    dk = gl.zeros([C, D], gl.float32, layout=mma_o)
    dv = gl.zeros([C, DV], gl.float32, layout=mma_o)
    k0 = k_s.index(0)
    v0 = v_s.index(0)
    mbarrier.wait(bar_kv.index(0), 0)
    for d in gl.static_range(3):  # query tile c + d: visible iff key <= query + d C and key > query + d C - W
        mbarrier.wait(bar_q.index(d), 0)
        qd = q_s.index(d)
        dyd = dy_s.index(d)
        i_tok = tok + gl.minimum(d, nc - 1 - c) * C  # (clamped like its tiles; masked below)
        lse = gl.load(LSE + i_tok + qry)
        delta = gl.load(DELTA + i_tok + qry)
        st = warpgroup_mma(k0, qd.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False,
                           is_async=True)
        dpt = warpgroup_mma(v0, dyd.permute((1, 0)), gl.zeros([C, C], gl.float32, layout=mma_s), use_acc=False,
                            is_async=True)
        st, dpt, _, _, _, _ = warpgroup_mma_wait(0, deps=(st, dpt, k0, qd, v0, dyd))
        vis = (keys[:, None] <= qry[None, :] + d * C) & (keys[:, None] > qry[None, :] + (d * C - W)) & (c + d < nc)
        pt = gl.where(vis, gl.exp2(st * qk_scale - lse[None, :]), 0.0)
        dst = gl.convert_layout((pt * (dpt * alpha - delta[None, :])).to(dt), dot_o)
        pt = gl.convert_layout(pt.to(dt), dot_o)
        dv = warpgroup_mma(pt, dyd, dv, is_async=True)
        dk = warpgroup_mma(dst, qd, dk, is_async=True)
        dv, dk, _, _, _, _ = warpgroup_mma_wait(0, deps=(dv, dk, pt, dst, dyd, qd))
    rows_o = gl.arange(0, C, layout=gl.SliceLayout(1, mma_o))
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, mma_o))
    gl.store(DK + tok.to(gl.int64) * D + (rows_o[:, None] * D + cols_o[None, :]), (dk * sm_scale).to(dt))
    gl.store(DV_ + tok.to(gl.int64) * DV + (rows_o[:, None] * DV + cols_o[None, :]), (dv * alpha).to(dt))


@gluon.jit
def _win_bwd_kernel(q_d, k_d, v_d, dy_d, LSE, DELTA, ALPHA, DQ, DK, DV_, T, H, qk_scale, sm_scale,
                    MODEL_LAYOUT: gl.constexpr, HAS_ALPHA: gl.constexpr, W: gl.constexpr, C: gl.constexpr,
                    D: gl.constexpr, DV: gl.constexpr):
    """Grid (T // C, B*H). LSE, DELTA (B*H*T,) fp32 (base-2 log-sum-exp; alpha * dy . o); DQ, DK,
    DV_ (B*H*T, .) contiguous; dy read from (B*H*T, Dv) rows."""
    c = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    nc = T // C
    row0 = i_bh * T
    tok = row0 + c * C
    r_q, c_q = _row_col(MODEL_LAYOUT, 0, i_b, i_h, row0, T, D)
    r_k, c_k = _row_col(MODEL_LAYOUT, 1, i_b, i_h, row0, T, D)
    r_v, c_v = _row_col(MODEL_LAYOUT, 2, i_b, i_h, row0, T, DV)
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
        _load_pair(q_d, dy_d, r_q + cq * C, c_q, row0 + cq * C, 0, bar_q.index(d), q_s.index(d), dy_s.index(d))
        _load_pair(k_d, v_d, r_k + ck * C, c_k, r_v + ck * C, c_v, bar_kv.index(d), k_s.index(d), v_s.index(d))
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


def supports_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, kmin) -> bool:
    """Whether ``bwd`` takes these inputs (see the module's scope)."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    xs = (q, k, v)
    return (kmin is None and window <= 2 * BT + 1 and q.dtype in (torch.bfloat16, torch.float16)
            and all(x.dtype == q.dtype and x.shape[-1] == WIDTH and x.shape[:3] == q.shape[:3] for x in xs)
            and q.shape[2] % BT == 0 and tma_readable(xs))


def bwd(q, k, v, dy, lse, delta, alpha, dq, dk, dv, *, window: int, scale: float) -> None:
    """dq, dk, dv ((B, H, T, .) contiguous) from dy ((B, H, T, Dv) contiguous), lse and delta
    ((B*H, T) fp32, from the forward and ``window``'s delta pre-pass), alpha (H,) fp32 or None."""
    B, H, T, D = q.shape
    DV = v.shape[-1]
    tiles = tma_tiles([q, k, v, dy], [BT, WIDTH])
    if tiles is None or not dy.is_contiguous():
        raise ValueError("window_gluon.bwd: inputs outside its scope (supports_bwd)")
    descs, views = tiles
    _win_bwd_kernel[(T // BT, B * H)](
        *descs, lse, delta, alpha if alpha is not None else lse, dq, dk, dv, T, H, scale * 1.4426950408889634, scale,
        MODEL_LAYOUT=model_layout_bits(views[:3]), HAS_ALPHA=alpha is not None, W=window, C=BT, D=D, DV=DV,
        num_warps=4)


def compile_for_hopper(window: int = 128, has_alpha: bool = True, model_layout: int = 0):
    """Compile the kernel for sm_90a without a GPU (CI, probes); returns Triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    x = torch.empty(2 * 4 * 256, WIDTH, dtype=torch.bfloat16)
    d = TensorDescriptor.from_tensor(x, [BT, WIDTH], gl.NVMMASharedLayout.get_default_for([BT, WIDTH], gl.bfloat16))
    f32 = torch.empty(16, dtype=torch.float32)
    bf = torch.empty(16, dtype=torch.bfloat16)
    args = dict(q_d=d, k_d=d, v_d=d, dy_d=d, LSE=f32, DELTA=f32, ALPHA=f32, DQ=bf, DK=bf, DV_=bf, T=256, H=4,
                qk_scale=0.1, sm_scale=0.1)
    sig = {k: mangle_type(v) for k, v in args.items()}
    consts = dict(MODEL_LAYOUT=model_layout, HAS_ALPHA=has_alpha, W=window, C=BT, D=WIDTH, DV=WIDTH)
    sig.update({k: "constexpr" for k in consts})
    names = [p.name for p in _win_bwd_kernel.params]
    src = GluonASTSource(_win_bwd_kernel, sig, {(names.index(k),): v for k, v in consts.items()})
    return tcompile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
