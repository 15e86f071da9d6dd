"""Triton kernels of the LoLCATs chunk form's band: each chunk of C queries against its L + C band keys
(window terms f e^{a - c_t}, linear terms fq.fk) and its linear state S_j, z_j, in registers.

Same meaning as ``chunk.hybrid_combine`` over the chunk form's bands for a standard window without
soft-cap (the torch path does the rest). Per query t, with a_s = q_t.k_s*scale (base 2 inside):

    c_t = max_{s in win(t)} a_s,   w_s = f e^{a_s - c_t} (window) | fq_t.fk_s (older, in the band)
    y_t = [sum_s w_s v_s + fq_t S_j] / ([sum_s w_s + fq_t.z_j] + eps)

The forward takes two passes over the band (c_t, then the sums and how many window scores tie
with c_t) and keeps c_t, the denominator and the ties for the backward. c_t belongs to the model
(see ``naive``): its gradient, dc_t = -sum_{s in win} dw_s w_s, goes to the tied maxima in equal
parts, as ``amax``'s does. With D'_t = den_t + eps, dnum = dy / D', dden = -(dy.y) / D' and
dw_s = dnum.v_s + dden, the backward (one program per chunk, two passes) forms dq, dfq, d(S_j),
d(z_j) and the head's df in registers and adds dk, dfk, dv into the band's keys with atomics (a
key is in two chunks' bands; relaxed: only the sums after the kernel are read, and acq_rel atomics
fence every add).
Inputs: q, fq (B, H, T, .), the joined keys, key features and values (B, H, L + NC C, .) (cache ++
input ++ zero padding), their positions (B, L + NC C), S_j (B, H, NC, F, Dv), z_j (B, H, NC, F),
f (H,), all in one float dtype (the compute dtype); D, F, Dv <= 256.
The products run on tensor cores in tf32 (``FP32_PRECISION``): exact on the 16-bit q, k, v and
features the chunk op sends, rounding the fp32 window weights and states to 10-bit mantissas
(about 5e-4 relative; the output is 16-bit). In ieee fp32 the same kernels spill and run slower
than the torch path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..backend.dispatch import patch_interpreter, pow2

patch_interpreter()

LOG2E = 1.4426950408889634
BN = 64  # band keys a tile
# fp32 tiles of 64 x 64 and features up to 128 wide: software pipelining would pass an H100's shared memory
LAUNCH = dict(num_warps=8, num_stages=1)
FP32_PRECISION = "tf32"  # or "tf32x3", "ieee" (FMA: at these tiles ptxas spills, see the module)


@triton.jit
def _band_tile(Q_, FQ_, K, FK, V, KPOS, b, bh, j, t, q_pos, NK, C: tl.constexpr, L: tl.constexpr, W: tl.constexpr,
               D: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, od, md, of, mf, odv, mdv, qk_scale,
               BN: tl.constexpr, PREC: tl.constexpr):
    """Band tile t of chunk j: key indices (BN,), which exist, keys, features, values, base-2 scores
    (BM, BN), the window and older masks, and the linear weights fq.fk (BM, BN)."""
    idx = j * C + t * BN + tl.arange(0, BN)
    ok = (idx < j * C + L + C) & (idx < NK)
    kp = tl.load(KPOS + b.to(tl.int64) * NK + idx, mask=ok, other=-1)
    base = bh * NK + idx[:, None].to(tl.int64)
    k = tl.load(K + base * D + od[None, :], mask=ok[:, None] & md[None, :], other=0.0)
    fk = tl.load(FK + base * F + of[None, :], mask=ok[:, None] & mf[None, :], other=0.0)
    v = tl.load(V + base * DV + odv[None, :], mask=ok[:, None] & mdv[None, :], other=0.0)
    a2 = tl.dot(Q_, tl.trans(k), input_precision=PREC) * qk_scale
    seen = ok[None, :] & (kp[None, :] >= 0) & (kp[None, :] <= q_pos[:, None])
    win = seen & (kp[None, :] > q_pos[:, None] - W)
    older = seen & (kp[None, :] <= q_pos[:, None] - W)
    lin = tl.dot(FQ_, tl.trans(fk), input_precision=PREC)
    return idx, ok, k, fk, v, a2, win, older, lin


@triton.jit
def _chunk_queries(Q, FQ, KPOS, T, H, NK, C: tl.constexpr, L: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
                   DV: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr):
    """This program's chunk j and head (b, h; bh flat), its rows r (and which are in range), the
    column offsets and masks of keys, features and values, and the chunk's q, fq and positions."""
    j = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // H
    bh = i_bh.to(tl.int64)
    r = j * C + tl.arange(0, C)
    mr = r < T
    od, of, odv = tl.arange(0, BD), tl.arange(0, BF), tl.arange(0, BDV)
    md, mf, mdv = od < D, of < F, odv < DV
    q = tl.load(Q + (bh * T + r[:, None]) * D + od[None, :], mask=mr[:, None] & md[None, :], other=0.0)
    fq = tl.load(FQ + (bh * T + r[:, None]) * F + of[None, :], mask=mr[:, None] & mf[None, :], other=0.0)
    q_pos = tl.load(KPOS + b.to(tl.int64) * NK + L + r)
    return j, b, i_bh % H, bh, r, mr, od, of, odv, md, mf, mdv, q, fq, q_pos


@triton.jit
def _lolcats_fwd_kernel(
    Q, FQ, K, FK, V, KPOS, SJ, ZJ, FAC, Y, CMAX, DEN, TIES,
    T, H, NC, NK, qk_scale, eps,
    C: tl.constexpr, L: tl.constexpr, W: tl.constexpr, D: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BD: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (chunks, B*H): y; per row c_t (base 2), D' = den + eps and the ties with c_t."""
    j, b, h, bh, r, mr, od, of, odv, md, mf, mdv, q, fq, q_pos = _chunk_queries(Q, FQ, KPOS, T, H, NK, C, L, D, F,
                                                                               DV, BD, BF, BDV)
    c = tl.zeros([C], dtype=tl.float32) - float("inf")
    for t in range(0, NT):
        idx, ok, k, fk, v, a2, win, older, lin = _band_tile(q, fq, K, FK, V, KPOS, b, bh, j, t, q_pos, NK, C, L, W,
                                                            D, F, DV, od, md, of, mf, odv, mdv, qk_scale, BN, PREC)
        c = tl.maximum(c, tl.max(tl.where(win, a2, float("-inf")), 1))
    c = tl.where(c == float("-inf"), 0.0, c)  # an empty window (a padding query): c = 0, no window terms
    acc_w = tl.zeros([C, BDV], dtype=tl.float32)
    acc_l = tl.zeros([C, BDV], dtype=tl.float32)
    l_w = tl.zeros([C], dtype=tl.float32)
    l_l = tl.zeros([C], dtype=tl.float32)
    ties = tl.zeros([C], dtype=tl.float32)
    for t in range(0, NT):
        idx, ok, k, fk, v, a2, win, older, lin = _band_tile(q, fq, K, FK, V, KPOS, b, bh, j, t, q_pos, NK, C, L, W,
                                                            D, F, DV, od, md, of, mf, odv, mdv, qk_scale, BN, PREC)
        e = tl.where(win, tl.exp2(a2 - c[:, None]), 0.0)
        ties += tl.sum(tl.where(win & (a2 == c[:, None]), 1.0, 0.0), 1)
        lw = tl.where(older, lin, 0.0)
        acc_w += tl.dot(e.to(v.dtype), v, input_precision=PREC)
        acc_l += tl.dot(lw.to(v.dtype), v, input_precision=PREC)
        l_w += tl.sum(e, 1)
        l_l += tl.sum(lw, 1)
    f = tl.load(FAC + h).to(tl.float32)
    st = (bh * NC + j)
    S = tl.load(SJ + st * F * DV + of[:, None] * DV + odv[None, :], mask=mf[:, None] & mdv[None, :], other=0.0)
    z = tl.load(ZJ + st * F + of, mask=mf, other=0.0).to(tl.float32)
    num = f * acc_w + acc_l + tl.dot(fq, S, input_precision=PREC)
    den = f * l_w + l_l + tl.sum(fq.to(tl.float32) * z[None, :], 1) + eps
    y = num / den[:, None]
    tl.store(Y + (bh * T + r[:, None]) * DV + odv[None, :], y.to(Y.dtype.element_ty), mask=mr[:, None] & mdv[None, :])
    tl.store(CMAX + bh * T + r, c, mask=mr)
    tl.store(DEN + bh * T + r, den, mask=mr)
    tl.store(TIES + bh * T + r, ties, mask=mr)


@triton.jit
def _lolcats_bwd_kernel(
    Q, FQ, K, FK, V, KPOS, SJ, ZJ, FAC, Y, CMAX, DEN, TIES, DY,
    DQ, DFQ, DK, DFK, DV_, DSJ, DZJ, DFAC,
    T, H, NC, NK, qk_scale, scale,
    C: tl.constexpr, L: tl.constexpr, W: tl.constexpr, D: tl.constexpr, F: tl.constexpr, DV: tl.constexpr,
    BD: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (chunks, B*H): dq, dfq, d S_j, d z_j and the chunk's part of df (DFAC[bh, j]); dk, dfk and
    dv added into the band's joined keys (fp32, atomics)."""
    j, b, h, bh, r, mr, od, of, odv, md, mf, mdv, q, fq, q_pos = _chunk_queries(Q, FQ, KPOS, T, H, NK, C, L, D, F,
                                                                               DV, BD, BF, BDV)
    yoff = (bh * T + r[:, None]) * DV + odv[None, :]
    dy = tl.load(DY + yoff, mask=mr[:, None] & mdv[None, :], other=0.0).to(tl.float32)
    y = tl.load(Y + yoff, mask=mr[:, None] & mdv[None, :], other=0.0).to(tl.float32)
    c = tl.load(CMAX + bh * T + r, mask=mr, other=0.0)
    den = tl.load(DEN + bh * T + r, mask=mr, other=1.0)
    ties = tl.load(TIES + bh * T + r, mask=mr, other=1.0)
    f = tl.load(FAC + h).to(tl.float32)
    dnum = dy / den[:, None]
    dden = -tl.sum(dy * y, 1) / den
    dn = dnum.to(Q.dtype.element_ty)
    # pass A: c_t's gradient, -sum over the window of dw_s w_s
    dc = tl.zeros([C], dtype=tl.float32)
    for t in range(0, NT):
        idx, ok, k, fk, v, a2, win, older, lin = _band_tile(q, fq, K, FK, V, KPOS, b, bh, j, t, q_pos, NK, C, L, W,
                                                            D, F, DV, od, md, of, mf, odv, mdv, qk_scale, BN, PREC)
        dw = tl.dot(dn, tl.trans(v), input_precision=PREC) + dden[:, None]
        dc -= tl.sum(tl.where(win, dw * f * tl.exp2(a2 - c[:, None]), 0.0), 1)
    share = dc / tl.where(ties > 0, ties, 1.0)
    dq = tl.zeros([C, BD], dtype=tl.float32)
    dfq = tl.zeros([C, BF], dtype=tl.float32)
    df = tl.zeros([C], dtype=tl.float32)
    for t in range(0, NT):
        idx, ok, k, fk, v, a2, win, older, lin = _band_tile(q, fq, K, FK, V, KPOS, b, bh, j, t, q_pos, NK, C, L, W,
                                                            D, F, DV, od, md, of, mf, odv, mdv, qk_scale, BN, PREC)
        dw = tl.dot(dn, tl.trans(v), input_precision=PREC) + dden[:, None]
        e = tl.where(win, tl.exp2(a2 - c[:, None]), 0.0)
        g = dw * f * e + tl.where(win & (a2 == c[:, None]), share[:, None], 0.0)   # d a_s (natural units)
        gl = tl.where(older, dw, 0.0)                                            # d (fq.fk_s)
        wt = f * e + tl.where(older, lin, 0.0)                                   # w_s
        df += tl.sum(dw * e, 1)
        dq += tl.dot(g.to(k.dtype), k, input_precision=PREC)
        dfq += tl.dot(gl.to(fk.dtype), fk, input_precision=PREC)
        base = bh * NK + idx[:, None].to(tl.int64)
        dk = tl.dot(tl.trans(g.to(q.dtype)), q, input_precision=PREC) * scale
        tl.atomic_add(DK + base * D + od[None, :], dk, mask=ok[:, None] & md[None, :], sem="relaxed")
        dfk = tl.dot(tl.trans(gl.to(fq.dtype)), fq, input_precision=PREC)
        tl.atomic_add(DFK + base * F + of[None, :], dfk, mask=ok[:, None] & mf[None, :], sem="relaxed")
        dv = tl.dot(tl.trans(wt.to(v.dtype)), dn, input_precision=PREC)
        tl.atomic_add(DV_ + base * DV + odv[None, :], dv, mask=ok[:, None] & mdv[None, :], sem="relaxed")
    st = (bh * NC + j)
    S = tl.load(SJ + st * F * DV + of[:, None] * DV + odv[None, :], mask=mf[:, None] & mdv[None, :], other=0.0)
    z = tl.load(ZJ + st * F + of, mask=mf, other=0.0).to(tl.float32)
    dfq += tl.dot(dn, tl.trans(S), input_precision=PREC) + dden[:, None] * z[None, :]
    qoff = (bh * T + r[:, None])
    tl.store(DQ + qoff * D + od[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=mr[:, None] & md[None, :])
    tl.store(DFQ + qoff * F + of[None, :], dfq.to(DFQ.dtype.element_ty), mask=mr[:, None] & mf[None, :])
    dS = tl.dot(tl.trans(fq), dn, input_precision=PREC)
    tl.store(DSJ + st * F * DV + of[:, None] * DV + odv[None, :], dS, mask=mf[:, None] & mdv[None, :])
    tl.store(DZJ + st * F + of, tl.sum(fq.to(tl.float32) * dden[:, None], 0), mask=mf)
    tl.store(DFAC + st, tl.sum(tl.where(mr, df, 0.0), 0))


def _geometry(q, fq, v, window: int, L: int, C: int, NC: int) -> dict:
    D, F, DV = q.shape[-1], fq.shape[-1], v.shape[-1]
    return dict(C=C, L=L, W=window, D=D, F=F, DV=DV, BD=pow2(D), BF=pow2(F), BDV=pow2(DV), BN=BN,
                NT=math.ceil((L + C) / BN), PREC=FP32_PRECISION)


class _LolcatsBand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, fq, keys, fkeys, values, k_pos, S_j, z_j, f, window, L, C, scale, eps):
        B, H, T, _ = q.shape
        NC, NK, DV = S_j.shape[2], keys.shape[2], values.shape[-1]
        dev, f32 = q.device, dict(dtype=torch.float32, device=q.device)
        y = torch.empty(B, H, T, DV, dtype=values.dtype, device=dev)
        cmax, den, ties = (torch.empty(B * H, T, **f32) for _ in range(3))
        geo = _geometry(q, fq, values, window, L, C, NC)
        _lolcats_fwd_kernel[(NC, B * H)](q, fq, keys, fkeys, values, k_pos, S_j, z_j, f, y, cmax, den, ties,
                                         T, H, NC, NK, scale * LOG2E, eps, **geo, **LAUNCH)
        ctx.save_for_backward(q, fq, keys, fkeys, values, k_pos, S_j, z_j, f, y, cmax, den, ties)
        ctx.geometry = (window, L, C, scale)
        return y

    @staticmethod
    def backward(ctx, dy):
        q, fq, keys, fkeys, values, k_pos, S_j, z_j, f, y, cmax, den, ties = ctx.saved_tensors
        window, L, C, scale = ctx.geometry
        B, H, T, _ = q.shape
        NC, NK = S_j.shape[2], keys.shape[2]
        f32 = dict(dtype=torch.float32, device=q.device)
        dq, dfq = torch.empty_like(q), torch.empty_like(fq)
        dk, dfk, dv = (torch.zeros(x.shape, **f32) for x in (keys, fkeys, values))
        dS, dz = torch.empty(S_j.shape, **f32), torch.empty(z_j.shape, **f32)
        dfac = torch.empty(B * H * NC, **f32)
        geo = _geometry(q, fq, values, window, L, C, NC)
        _lolcats_bwd_kernel[(NC, B * H)](q, fq, keys, fkeys, values, k_pos, S_j, z_j, f, y, cmax, den, ties,
                                         dy.to(y.dtype).contiguous(), dq, dfq, dk, dfk, dv, dS, dz, dfac,
                                         T, H, NC, NK, scale * LOG2E, scale, **geo, **LAUNCH)
        cast = lambda g, x: g.to(x.dtype)  # noqa: E731
        return (dq, dfq, cast(dk, keys), cast(dfk, fkeys), cast(dv, values), None, cast(dS, S_j), cast(dz, z_j),
                dfac.view(B, H, NC).sum((0, 2)).to(f.dtype), None, None, None, None, None)


def lolcats_band_triton(q, fq, keys, fkeys, values, k_pos, S_j, z_j, f, *, window: int, L: int, C: int,
                        scale: float, eps: float) -> torch.Tensor:
    """y (B, H, T, Dv) of the chunk form's bands (see the module); every float input one dtype."""
    c = lambda x: x.contiguous()  # noqa: E731
    return _LolcatsBand.apply(c(q), c(fq), c(keys), c(fkeys), c(values), c(k_pos), c(S_j), c(z_j), c(f),
                              window, L, C, scale, eps)
