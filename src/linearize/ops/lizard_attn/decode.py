"""Triton kernels of one decode step of a Lizard student layer (used by ``models.decode``).

``launch_lizard_step`` runs the recurrent step of the gated branch and the sliding window with
sinks for one new token per row: a prep kernel per (row, head) (RoPE, Hedgehog features, gate,
the window over the ring buffer, the normaliser) and a state kernel per (row, head, value
block) that updates S in place and writes y. ``launch_rmsnorm`` is the one-kernel RMSNorm the
decoder swaps in for HF's. Both round intermediate values to the model's dtype where the torch
ops do, so the step matches ``HybridAttention``'s recurrent form (tests/models/test_decode.py).

Triton is optional: without it ``lizard_step_launcher()`` is None and the decoder keeps the
torch step.
"""

from __future__ import annotations

import os

import torch

try:  # optional: the fused decode kernel (module level, so Triton can resolve the helper)
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - no Triton, or one that fails to import: torch ops only
    triton = None


def lizard_step_launcher():
    """The fused Lizard step kernel's launcher, or None without a usable Triton."""
    return launch_lizard_step if triton is not None else None


def fused_norms_ok(device: torch.device) -> bool:
    """Whether the decoder may swap HF's RMSNorms for the one-kernel norm (on CUDA with Triton,
    unless ``LINEARIZE_DECODE_NORM=0``)."""
    return (triton is not None and device.type == "cuda"
            and os.environ.get("LINEARIZE_DECODE_NORM", "1") != "0")


if triton is not None:

    @triton.jit
    def _rnd(x, DT: tl.constexpr):
        """Round an fp32 value to the model's dtype and back (what a torch op in that dtype stores)."""
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _rope(x_ptr, row, cos_ptr, sin_ptr, b, offs_d, md, D: tl.constexpr, DT: tl.constexpr):
        """HF's x * cos + rotate_half(x) * sin for one head row, each product and the sum rounded to DT."""
        x = tl.load(x_ptr + row * D + offs_d, mask=md, other=0.0).to(tl.float32)
        rot = tl.load(x_ptr + row * D + (offs_d + D // 2) % D, mask=md, other=0.0).to(tl.float32)
        rot = tl.where(offs_d < D // 2, -rot, rot)
        c = tl.load(cos_ptr + b * D + offs_d, mask=md, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + b * D + offs_d, mask=md, other=0.0).to(tl.float32)
        return _rnd(_rnd(x * c, DT) + _rnd(rot * s, DT), DT)

    @triton.jit
    def _hedgehog(x, w, mf, DT: tl.constexpr):
        """phi(x) = softmax(xW) ++ softmax(-xW), as the two halves; rounded like the torch module
        (log-softmax and exp in fp32, one rounding at the end)."""
        xw = _rnd(tl.sum(x[:, None] * w, axis=0), DT)
        xp = tl.where(mf, xw, float("-inf"))
        xn = tl.where(mf, -xw, float("-inf"))
        mp = tl.max(xp, axis=0)
        mn = tl.max(xn, axis=0)
        lp = xp - mp - tl.log(tl.sum(tl.exp(xp - mp), axis=0))
        ln = xn - mn - tl.log(tl.sum(tl.exp(xn - mn), axis=0))
        fp = _rnd(tl.exp(lp), DT)
        fn = _rnd(tl.exp(ln), DT)
        return tl.where(mf, fp, 0.0), tl.where(mf, fn, 0.0)

    @triton.jit
    def _lizard_prep_kernel(
        q_ptr, k_ptr, qr_ptr, kr_ptr, cos_ptr, sin_ptr, v_ptr, x_ptr, gw_ptr, gb_ptr, logg_ptr, wq_ptr, wk_ptr,
        z_ptr, ringk_ptr, ringv_ptr, pos_ptr, sink_ptr, alpha_ptr,
        fq_ptr, fk_ptr, g_ptr, den_ptr, yw_ptr,
        scale, eps, H, G,
        D: tl.constexpr, F2: tl.constexpr, W: tl.constexpr, M: tl.constexpr, HID: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_F2: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_HID: tl.constexpr,
        GATE: tl.constexpr, FUSE_ROPE: tl.constexpr,
        ROPE_GLOBAL: tl.constexpr, ROPE_WINDOW: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):
        """Part 1 of a Lizard-family decode step, one program per (row b, head h): RoPE, features,
        gate, z and the normaliser, the window branch (ring write included). Writes the features,
        gates and normaliser for part 2 and the window output already scaled by alpha.

        GATE: 0 none (plain linear attention), 1 a scalar log-gate per head from ``logg_ptr``,
        2 per-channel log-gates from ``logg_ptr``, 3 the sigmoid gate logsigmoid(x . w_h + c_h) here."""
        pid = tl.program_id(0)  # = b * H + h
        b = pid // H
        h = pid % H
        kv = b * (H // G) + h // G  # row of the KV head this query head reads
        DT = q_ptr.dtype.element_ty
        offs_d = tl.arange(0, BLOCK_D)
        md = offs_d < D
        offs_f = tl.arange(0, BLOCK_F2)
        mf = offs_f < F2
        wmask = md[:, None] & mf[None, :]
        woffs = h * D * F2 + offs_d[:, None] * F2 + offs_f[None, :]

        # ---- queries and keys of both branches (RoPE here, or taken precomputed)
        q = tl.load(q_ptr + pid * D + offs_d, mask=md, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + kv * D + offs_d, mask=md, other=0.0).to(tl.float32)
        if ROPE_GLOBAL or ROPE_WINDOW:
            if FUSE_ROPE:
                q_r = _rope(q_ptr, pid, cos_ptr, sin_ptr, b, offs_d, md, D, DT)
                k_r = _rope(k_ptr, kv, cos_ptr, sin_ptr, b, offs_d, md, D, DT)
            else:
                q_r = tl.load(qr_ptr + pid * D + offs_d, mask=md, other=0.0).to(tl.float32)
                k_r = tl.load(kr_ptr + kv * D + offs_d, mask=md, other=0.0).to(tl.float32)
        if ROPE_GLOBAL:
            gq, gk = q_r, k_r
        else:
            gq, gk = q, k

        # ---- global branch: features, gate, z and the normaliser
        fqp, fqn = _hedgehog(gq, tl.load(wq_ptr + woffs, mask=wmask, other=0.0).to(tl.float32), mf, DT)
        fkp, fkn = _hedgehog(gk, tl.load(wk_ptr + woffs, mask=wmask, other=0.0).to(tl.float32), mf, DT)
        if GATE == 3:
            acc = tl.zeros([BLOCK_HID], dtype=tl.float32)
            for i0 in range(0, HID, BLOCK_HID):
                offs_x = i0 + tl.arange(0, BLOCK_HID)
                mx = offs_x < HID
                xv = tl.load(x_ptr + b * HID + offs_x, mask=mx, other=0.0).to(tl.float32)
                wv = tl.load(gw_ptr + h * HID + offs_x, mask=mx, other=0.0).to(tl.float32)
                acc += xv * wv
            logit = _rnd(_rnd(tl.sum(acc, axis=0), DT) + tl.load(gb_ptr + h).to(tl.float32), DT)
            lg = tl.minimum(logit, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(logit)))  # logsigmoid
            gp = tl.zeros([BLOCK_F2], dtype=tl.float32) + tl.exp(lg)
            gn = gp
        elif GATE == 2:
            gp = tl.exp(tl.load(logg_ptr + pid * 2 * F2 + offs_f, mask=mf, other=0.0))
            gn = tl.exp(tl.load(logg_ptr + pid * 2 * F2 + F2 + offs_f, mask=mf, other=0.0))
        elif GATE == 1:
            gp = tl.zeros([BLOCK_F2], dtype=tl.float32) + tl.exp(tl.load(logg_ptr + pid))
            gn = gp
        else:
            gp = tl.zeros([BLOCK_F2], dtype=tl.float32) + 1.0
            gn = gp
        zb = z_ptr + pid * 2 * F2
        zp = tl.load(zb + offs_f, mask=mf, other=0.0)
        zn = tl.load(zb + F2 + offs_f, mask=mf, other=0.0)
        if GATE != 0:
            zp = gp * zp + fkp
            zn = gn * zn + fkn
        else:
            zp = zp + fkp
            zn = zn + fkn
        tl.store(zb + offs_f, zp, mask=mf)
        tl.store(zb + F2 + offs_f, zn, mask=mf)
        tl.store(den_ptr + pid, tl.sum(fqp * zp, axis=0) + tl.sum(fqn * zn, axis=0) + eps)
        fb = pid * 2 * F2
        tl.store(fq_ptr + fb + offs_f, fqp, mask=mf)
        tl.store(fq_ptr + fb + F2 + offs_f, fqn, mask=mf)
        tl.store(fk_ptr + fb + offs_f, fkp, mask=mf)
        tl.store(fk_ptr + fb + F2 + offs_f, fkn, mask=mf)
        tl.store(g_ptr + fb + offs_f, gp, mask=mf)
        tl.store(g_ptr + fb + F2 + offs_f, gn, mask=mf)

        # ---- window branch: scores against the ring (minus the slot this token replaces) + itself
        if HAS_WINDOW:
            if ROPE_WINDOW:
                lq, lk = q_r, k_r
            else:
                lq, lk = q, k
            pos = tl.load(pos_ptr + b)
            slot = ((pos % W) + W) % W
            offs_w = tl.arange(0, BLOCK_W)
            rel = (((pos - offs_w) % W) + W) % W
            vis = (offs_w < W) & (pos - rel >= 0) & (offs_w != slot)
            tile = kv * W * D + offs_w[:, None] * D + offs_d[None, :]
            tmask = (offs_w < W)[:, None] & md[None, :]
            rk = tl.load(ringk_ptr + tile, mask=tmask, other=0.0).to(tl.float32)
            s = tl.sum(rk * lq[None, :], axis=1) * scale
            s = tl.where(vis, s, float("-inf"))
            s_cur = tl.sum(lq * lk, axis=0) * scale
            c = tl.maximum(tl.max(s, axis=0), s_cur)
            if HAS_SINKS:
                offs_m = tl.arange(0, BLOCK_M)
                sinks = tl.load(sink_ptr + h * M + offs_m, mask=offs_m < M, other=float("-inf")).to(tl.float32)
                c = tl.maximum(c, tl.max(sinks, axis=0))
            p = tl.where(vis, tl.exp(s - c), 0.0)
            p_cur = tl.exp(s_cur - c)
            den_w = tl.sum(p, axis=0) + p_cur
            if HAS_SINKS:
                den_w += tl.sum(tl.exp(sinks - c), axis=0)
            vv = tl.load(v_ptr + kv * D + offs_d, mask=md, other=0.0)
            rv = tl.load(ringv_ptr + tile, mask=tmask, other=0.0).to(tl.float32)
            yw = (tl.sum(p[:, None] * rv, axis=0) + p_cur * vv.to(tl.float32)) / den_w
            alpha = tl.load(alpha_ptr + h).to(tl.float32)
            tl.store(yw_ptr + pid * D + offs_d, _rnd(alpha * _rnd(yw, DT), DT), mask=md)
            # one program per KV head writes the new key/value; the others mask that slot out
            writer = (h % G) == 0
            tl.store(ringk_ptr + kv * W * D + slot * D + offs_d, lk.to(DT), mask=md & writer)
            tl.store(ringv_ptr + kv * W * D + slot * D + offs_d, vv, mask=md & writer)

    @triton.jit
    def _lizard_state_kernel(
        S_ptr, v_ptr, fq_ptr, fk_ptr, g_ptr, den_ptr, yw_ptr, y_ptr, H, G,
        D: tl.constexpr, F: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_WINDOW: tl.constexpr,
    ):
        """Part 2, one program per (row, head, block of value channels): S = g * S + fk v^T in place,
        y = round(fq^T S / den) + the window part; S is read once and written once."""
        pid = tl.program_id(0)  # = b * H + h
        j0 = tl.program_id(1) * BLOCK_DV
        b = pid // H
        h = pid % H
        kv = b * (H // G) + h // G
        DT = y_ptr.dtype.element_ty
        offs_f = tl.arange(0, BLOCK_F)
        mf = offs_f < F
        offs_j = j0 + tl.arange(0, BLOCK_DV)
        mj = offs_j < D
        m2 = mf[:, None] & mj[None, :]
        ptrs = S_ptr + pid * F * D + offs_f[:, None] * D + offs_j[None, :]
        S = tl.load(ptrs, mask=m2, other=0.0)
        fq = tl.load(fq_ptr + pid * F + offs_f, mask=mf, other=0.0)
        fk = tl.load(fk_ptr + pid * F + offs_f, mask=mf, other=0.0)
        g = tl.load(g_ptr + pid * F + offs_f, mask=mf, other=0.0)
        vj = tl.load(v_ptr + kv * D + offs_j, mask=mj, other=0.0).to(tl.float32)
        S = g[:, None] * S + fk[:, None] * vj[None, :]
        tl.store(ptrs, S, mask=m2)
        num = tl.sum(fq[:, None] * S, axis=0)
        y = _rnd(num / tl.load(den_ptr + pid), DT)
        if HAS_WINDOW:
            y += tl.load(yw_ptr + pid * D + offs_j, mask=mj, other=0.0)
        tl.store(y_ptr + pid * D + offs_j, y.to(DT), mask=mj)

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr):
        """HF's Llama RMSNorm of one row: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < N
        DT = y_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        xn = _rnd(x * (1.0 / tl.sqrt(var + eps)), DT)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * N + offs, (w * xn).to(DT), mask=m)


def launch_lizard_step(q, k, q_rope, k_rope, cos, sin, v, x, gate_w, gate_b, log_g, wq, wk, S, z, ring_k, ring_v,
                        pos, sinks, alpha, y, *, scale, eps, H, G, D, F2, W, M, HID, gate, fuse_rope,
                        rope_global, rope_window, has_window, has_sinks):
    """Two launches: per (row, head) the prep kernel, per (row, head, value block) the state kernel.
    All tensors contiguous; S, z updated and the ring written in place; y (B, H, D) written."""
    B = y.shape[0]
    F = 2 * F2
    fq = torch.empty(B, H, F, dtype=torch.float32, device=y.device)
    fk, g = torch.empty_like(fq), torch.empty_like(fq)
    den = torch.empty(B, H, dtype=torch.float32, device=y.device)
    yw = torch.empty(B, H, D, dtype=torch.float32, device=y.device) if has_window else den
    block_d = triton.next_power_of_2(D)
    block_w = triton.next_power_of_2(max(W, 1))
    _lizard_prep_kernel[(B * H,)](
        q, k, q_rope, k_rope, cos, sin, v, x, gate_w, gate_b, log_g, wq, wk, z, ring_k, ring_v, pos, sinks, alpha,
        fq, fk, g, den, yw, float(scale), float(eps), H, G,
        D=D, F2=F2, W=max(W, 1), M=max(M, 1), HID=max(HID, 1),
        BLOCK_D=block_d, BLOCK_F2=triton.next_power_of_2(F2), BLOCK_W=block_w,
        BLOCK_M=triton.next_power_of_2(max(M, 1)), BLOCK_HID=min(1024, triton.next_power_of_2(max(HID, 1))),
        GATE=gate, FUSE_ROPE=fuse_rope, ROPE_GLOBAL=rope_global, ROPE_WINDOW=rope_window,
        HAS_WINDOW=has_window, HAS_SINKS=has_sinks,
        num_warps=8 if block_w * block_d >= 8192 else 4,
    )
    block_dv = min(32, block_d)
    _lizard_state_kernel[(B * H, triton.cdiv(D, block_dv))](
        S, v, fq, fk, g, den, yw, y, H, G, D=D, F=F, BLOCK_F=triton.next_power_of_2(F), BLOCK_DV=block_dv,
        HAS_WINDOW=has_window, num_warps=4,
    )


def launch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last axis in one kernel (what HF's Llama-family norms compute)."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()
    y = torch.empty_like(x2)
    block = triton.next_power_of_2(N)
    _rmsnorm_kernel[(x2.shape[0],)](x2, weight, y, float(eps), N=N, BLOCK=block,
                                    num_warps=8 if block >= 4096 else 4)
    return y.view(x.shape)
