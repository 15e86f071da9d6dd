"""Kernel-vs-reference cases, shared by the kernel tests of tests/ops/test_gla.py, test_window_attn.py,
test_lizard_attn.py and test_delta_fast.py.

Each case runs the Triton path (forward and backward) and the torch reference on the same
inputs and returns the relative RMS error of every output and gradient. The GPU tests call the
cases in process on CUDA; the CPU tests run ``python kernel_cases.py <op>`` in a subprocess with
``TRITON_INTERPRET=1`` (Triton reads it when the kernels are decorated, i.e. at import), which
prints one JSON object {case name: {quantity: error}}.

The reference is the fp64 parallel form on the same (rounded) inputs and the same (rounded)
upstream gradient, so the errors are the kernels' own arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

# relative-RMS tolerance of the kernels against the fp64 reference, by input dtype
KTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fused_bwd_emulated(q, k, v, log_g, o, den, sc, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g, dS0, dz0, *,
                       seg_chunks: int, normalize: bool, eps: float, dv_add: bool, side_dot=None, alpha=None,
                       paired: bool = False, bl=None) -> None:
    """What ``kernels.gla_gluon.bwd_fused`` computes, in fp32 torch, with its signature: each segment
    of ``seg_chunks`` chunks walked from its end from the state gradient leaving it (ds_in, dz_in),
    chunk by chunk as the kernel does (the gate gradient's part after a chunk from the state leaving
    it, sc[c + 1]). CPU interpreter cases put it in the kernel's place (``_emulated_fused_bwd``) to
    run the host side of the fused path: the plan, the segments' entering gradients, the
    arguments' meaning, dv added into the window's, dS0 and dz0. With side_dot and alpha, o is
    y = o_g + alpha_h x and side_dot the rows' do . x, as the kernel takes them. (``paired`` states
    come only from the fused Gluon forward, which the interpreter does not run; ``bl``, the gates'
    sums within chunks, read where given, as the kernel does.)"""
    assert not paired, "paired states come from the Gluon forward alone"
    B, H, T, F_ = q.shape
    NC = sc.shape[1] - 1
    BT = T // NC
    nseg = -(-NC // seg_chunks)
    f = torch.float32
    mask = torch.tril(torch.ones(BT, BT, dtype=torch.bool))
    for bh in range(B * H):
        b_, h_ = divmod(bh, H)
        for seg in range(nseg):
            if ds_in is not None:
                dS, dz = ds_in.view(-1, F_, v.shape[-1])[bh * nseg + seg].clone(), torch.zeros(F_)
                if normalize:
                    dz = dz_in.view(-1, F_)[bh * nseg + seg].clone()
            else:
                dS, dz = torch.zeros(F_, v.shape[-1]), torch.zeros(F_)
            for c in reversed(range(seg * seg_chunks, min(NC, (seg + 1) * seg_chunks))):
                t = slice(c * BT, (c + 1) * BT)
                qc, kc, vc, doc = (x[b_, h_, t].to(f) for x in (q, k, v, do))
                bb = log_g[b_, h_, t].to(f).cumsum(0) if bl is None else bl.view(B, H, T)[b_, h_, t]
                p = torch.where(mask, bb[:, None] - bb[None, :], torch.tensor(-float("inf"))).exp()
                r_end = (bb[-1] - bb).exp()
                S, z = sc[bh, c].to(f), zc[bh, c] if normalize else torch.zeros(F_)
                if normalize:
                    rden = 1.0 / (den.view(B * H, T)[bh, t] + eps)
                    do_o = (doc * o[b_, h_, t].to(f)).sum(1)
                    if side_dot is not None:
                        do_o = do_o - alpha[h_] * side_dot.view(B * H, T)[bh, t]
                    dn, dd = doc * rden[:, None], -do_o * rden
                else:
                    dn, dd = doc, torch.zeros(BT)
                A = (qc @ kc.T) * p
                M = (dn @ vc.T + dd[:, None]) * p
                dvc = r_end[:, None] * (kc @ dS) + A.T @ dn
                dkc = r_end[:, None] * (vc @ dS.T + dz) + M.T @ qc
                dqc = bb.exp()[:, None] * (dn @ S.T + dd[:, None] * z) + M @ kc
                db = (qc * dqc).sum(1) - (kc * dkc).sum(1)
                y = (dS * sc[bh, c + 1].to(f)).sum() + ((dz * zc[bh, c + 1]).sum() if normalize else 0.0)
                dlog_g[bh, t] = db.flip(0).cumsum(0).flip(0) + y
                if dv_add:
                    dvc = dvc + dv[b_, h_, t].to(f)
                dq[b_, h_, t], dk[b_, h_, t], dv[b_, h_, t] = dqc, dkc, dvc
                w = bb.exp()[:, None] * qc
                dS = bb[-1].exp() * dS + w.T @ dn
                dz = bb[-1].exp() * dz + w.T @ dd
            if seg == 0 and dS0 is not None:
                dS0.view(B * H, F_, -1)[bh] = dS
                if normalize:
                    dz0.view(B * H, F_)[bh] = dz


class _emulated_fused_bwd:
    """With ``on``: kernels.gla routes its backward to ``fused_bwd_emulated`` wherever a config asks
    for the fused Gluon backward (plain features), as it routes to the kernel on a Hopper GPU; on
    leaving without an error, asserts that the backward went there."""

    def __init__(self, on: bool):
        self.on, self.calls, self.sides = on, [], []

    def __enter__(self):
        from linearize.ops.gla import triton as kgla

        self.old = kgla._gluon_fused_bwd
        if self.on:
            def bwd_fused(*args, **kw):
                self.calls.append(kw["seg_chunks"])
                self.sides.append(kw.get("side_dot") is not None)
                fused_bwd_emulated(*args, **kw)

            emu = type("FusedEmulation", (), {"bwd_fused": staticmethod(bwd_fused)})
            kgla._gluon_fused_bwd = lambda cfg, q, k, v, chunk, log_space: (
                emu if cfg.gluon_fused_bwd and not log_space else None)

    def __exit__(self, exc_type, *exc):
        from linearize.ops.gla import triton as kgla

        kgla._gluon_fused_bwd = self.old
        assert exc_type is not None or not self.on or self.calls, "the backward did not take the fused path"


def window_walk_emulated(q, k, v, dy, lse, delta, alpha, dq, dk, dv, *, window: int, scale: float, walk: bool,
                         sms: int, o=None, scores_delta: bool = False) -> None:
    """What ``window_gluon.bwd``'s walking kernel computes, in torch (fp32, every query against
    every key, masked): with ``o`` it forms D = alpha (dy . o) itself and leaves dy . o in
    ``delta``; with ``scores_delta`` the same, dy . o as sum_s p_ts (dy_t . v_s); else it reads D
    from ``delta``; lse is the forward's (base 2)."""
    assert walk and not (o is not None and scores_delta)
    f = lambda x: x.float()
    a = alpha.float()[None, :, None] if alpha is not None else torch.ones(1, 1, 1)
    B, H, T, _ = q.shape
    t = torch.arange(T)
    vis = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    s = f(q) @ f(k).transpose(-1, -2) * (scale * 1.4426950408889634)
    p = torch.where(vis, torch.exp2(s - lse.view(B, H, T, 1)), 0.0)
    if o is not None or scores_delta:
        dyo = (f(dy) * f(o)).sum(-1) if o is not None else (p * (f(dy) @ f(v).transpose(-1, -2))).sum(-1)
        delta.copy_(dyo.reshape(B * H, T))
        D = a * dyo
    else:
        D = delta.view(B, H, T)
    ds = p * (a[..., None] * (f(dy) @ f(v).transpose(-1, -2)) - D[..., None])
    dq.copy_(scale * ds @ f(k))
    dk.copy_(scale * ds.transpose(-1, -2) @ f(q))
    dv.copy_(a[..., None] * p.transpose(-1, -2) @ f(dy))


class _emulated_window_walk:
    """With ``on``: kernels.window routes its backward to ``window_walk_emulated`` (as it routes
    to the walking Gluon kernel on a Hopper GPU), so that the host side around it (the delta
    pre-pass or the sums after the kernel's own D) runs in the interpreter; on leaving without
    an error, asserts that the backward went there, with o exactly where the config asks."""

    def __init__(self, on: bool, own: bool):
        self.on, self.own, self.calls, self.scores = on, own, [], []

    def __enter__(self):
        from linearize.ops.window_attn import triton as kwin

        self.old = kwin._gluon_bwd
        if self.on:
            def bwd(*args, **kw):
                self.calls.append(kw.get("o") is not None or kw.get("scores_delta", False))
                self.scores.append(kw.get("scores_delta", False))
                window_walk_emulated(*args, **kw)

            emu = type("WalkEmulation", (), {"bwd": staticmethod(bwd)})
            kwin._gluon_bwd = lambda cfg, q, k, v, window, kmin: emu if kmin is None else None

    def __exit__(self, exc_type, *exc):
        from linearize.ops.window_attn import triton as kwin

        kwin._gluon_bwd = self.old
        assert exc_type is not None or not self.on or self.calls == [self.own], (self.calls, self.own)


def gla_case(device: str, dtype: torch.dtype, *, normalize: bool, log_space: bool, T: int, DK: int, DV: int,
             B: int = 1, H: int = 2, state: bool = False, extreme: bool = False, seg_chunks: int | None = None,
             chunk: int | None = 16, fwd_bv: int = 16, dstate_bv: int = 128, tma: bool = True,
             bthd: bool = False, seed: int = 0, gla_cfg: dict | None = None) -> dict[str, float]:
    """gla_chunk_triton vs gla_parallel (fp64): o, final state, and d{q, k, v, log_g, S0, z0}.
    ``chunk=None``: the module's launch table and settings (what users get), with ``seg_chunks`` applied;
    ``dstate_bv``: the V-block of the backward's reverse pass (16 splits the test widths);
    ``tma=False``: the forward's pointer loads even where descriptors would apply;
    ``bthd``: q, k, v as a model gives them, (B, T, H, D) projections seen as (B, H, T, D);
    ``gla_cfg``: more GLALaunch fields (on CPU, ``gluon_fused_bwd=True`` given here runs
    ``fused_bwd_emulated``; the default alone leaves the interpreter on the Triton passes)."""
    import dataclasses
    from linearize.ops.backend import KernelSettings
    from linearize.ops.gla import triton as kgla
    from linearize.ops.gla import GLAState, gla_parallel

    g = _gen(seed)
    if log_space:  # Hedgehog-like log-features: log-softmax halves, some exact zeros (-inf)
        q = torch.cat([F.log_softmax(torch.randn(B, H, T, DK - DK // 2, generator=g, dtype=torch.float64) * 2, -1),
                       F.log_softmax(torch.randn(B, H, T, DK // 2, generator=g, dtype=torch.float64) * 2, -1)], -1)
        k = torch.cat([F.log_softmax(torch.randn(B, H, T, DK - DK // 2, generator=g, dtype=torch.float64) * 2, -1),
                       F.log_softmax(torch.randn(B, H, T, DK // 2, generator=g, dtype=torch.float64) * 2, -1)], -1)
        k[:, :, ::7, ::5] = float("-inf")
    else:
        q = torch.rand(B, H, T, DK, generator=g, dtype=torch.float64)
        k = torch.rand(B, H, T, DK, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    if extreme:  # runs of gates near 0 (log -20), near 1, exactly 1, and anywhere between
        u = torch.rand(B, H, T, generator=g, dtype=torch.float64)
        kind = (torch.arange(T) // 7) % 4
        log_g = torch.stack([-20 + 2 * u, -1e-4 * u, torch.zeros_like(u), -20 * u])[kind, :, :, torch.arange(T)]
        log_g = log_g.permute(1, 2, 0)
    else:
        log_g = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64) * 3 + 2)
    dev = torch.device(device)
    ins = [x.to(dtype) for x in (q, k, v)] + [log_g.float()]
    st = None
    if state:
        st = GLAState(torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64),
                      torch.rand(B, H, DK, generator=g, dtype=torch.float64) * 3)
    do = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64).to(dtype).double()
    dS = torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64)
    dz = torch.randn(B, H, DK, generator=g, dtype=torch.float64)

    ref_in = [x.double().requires_grad_() for x in ins]
    ref_st = GLAState(*(x.clone().requires_grad_() for x in st)) if state else None
    o, s = gla_parallel(*ref_in, normalize=normalize, log_space_features=log_space, state=ref_st)
    loss = (o * do).sum() + (s.S * dS).sum() + ((s.z * dz).sum() if normalize else 0)
    loss.backward()

    k_in = [x.to(dev).requires_grad_() for x in ins]
    if bthd:  # leaves in the model's layout
        k_in[:3] = [x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in k_in[:3]]
    k_st = GLAState(*(x.float().to(dev).requires_grad_() for x in st)) if state else None
    if chunk is None:
        settings = KernelSettings()
        cfg = dataclasses.replace(kgla.LAUNCH, seg_chunks=seg_chunks, tma=tma, **(gla_cfg or {}))
    else:
        settings = KernelSettings(chunk=chunk)
        cfg = kgla.GLALaunch(fwd_bv=fwd_bv, seg_chunks=seg_chunks, dstate_bv=dstate_bv, dstate_bv_norm=dstate_bv,
                             tma=tma, **(gla_cfg or {}))
    with _emulated_fused_bwd(device == "cpu" and bool((gla_cfg or {}).get("gluon_fused_bwd"))):
        o2, s2 = kgla.gla_chunk_triton(*k_in, normalize=normalize, log_space_features=log_space, state=k_st,
                                       settings=settings, launch=cfg)
        assert o2.dtype == dtype and s2.S.dtype == torch.float32 and s2.z.dtype == torch.float32
        loss2 = (o2.double() * do.to(dev)).sum() + (s2.S.double() * dS.to(dev)).sum()
        if normalize:
            loss2 = loss2 + (s2.z.double() * dz.to(dev)).sum()
        loss2.backward()
    err = {"o": rel_rms(o2.cpu(), o), "S": rel_rms(s2.S.cpu(), s.S)}
    if normalize:
        err["z"] = rel_rms(s2.z.cpu(), s.z)
    for name, a, b in zip(("dq", "dk", "dv", "dlog_g"), k_in, ref_in):
        err[name] = rel_rms(a.grad.cpu(), b.grad)
    if state:
        err["dS0"] = rel_rms(k_st.S.grad.cpu(), ref_st.S.grad)
        if normalize:
            err["dz0"] = rel_rms(k_st.z.grad.cpu(), ref_st.z.grad)
    return err


def gla_wide_values_case(device: str, dtype: torch.dtype, *, T: int, DK: int, DV: int, B: int = 1, H: int = 2,
                         state: bool = True, seed: int = 0) -> dict[str, float]:
    """The public ``gla_chunk`` with values wider than the kernels take (Gemma's heads of 256): blocks
    of 128 columns, each on the kernels (asserted: one kernel call a block), vs gla_parallel (fp64):
    o, final state (S and z), d{q, k, v, log_g, S0, z0}. Hedgehog-like plain features, normalised."""
    from linearize.ops import gla as G
    from linearize.ops.gla import triton as kgla

    g = _gen(seed)
    q = torch.softmax(torch.randn(B, H, T, DK, generator=g, dtype=torch.float64) * 2, -1)
    k = torch.softmax(torch.randn(B, H, T, DK, generator=g, dtype=torch.float64) * 2, -1)
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    log_g = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64) * 3 + 2)
    st = (torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64),
          torch.rand(B, H, DK, generator=g, dtype=torch.float64) * 3) if state else None
    do = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64).to(dtype).double()
    dS = torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64)
    dz = torch.randn(B, H, DK, generator=g, dtype=torch.float64)
    ins = [x.to(dtype) for x in (q, k, v)] + [log_g.float()]

    def run(xs, sts, fn):
        o, s = fn(*xs, state=G.GLAState(*sts) if sts else None)
        return o, s, (o.double() * do.to(o.device)).sum() + (s.S.double() * dS.to(o.device)).sum() \
            + (s.z.double() * dz.to(o.device)).sum()

    ref_in = [x.double().requires_grad_() for x in ins]
    ref_st = [x.clone().requires_grad_() for x in st] if state else []
    o, s, loss = run(ref_in, ref_st, G.gla_parallel)
    loss.backward()
    dev = torch.device(device)
    k_in = [x.to(dev).requires_grad_() for x in ins]
    k_st = [x.float().to(dev).requires_grad_() for x in st] if state else []
    calls, real = [], kgla.gla_chunk_triton
    kgla.gla_chunk_triton = lambda *a, **kw: calls.append(a[2].shape[-1]) or real(*a, **kw)
    try:
        o2, s2, loss2 = run(k_in, k_st, G.gla_chunk)
        loss2.backward()
    finally:
        kgla.gla_chunk_triton = real
    err = {"o": rel_rms(o2.cpu(), o), "S": rel_rms(s2.S.cpu(), s.S), "z": rel_rms(s2.z.cpu(), s.z),
           "one kernel call a block of at most 128 columns": float(
               calls != [min(128, DV - c0) for c0 in range(0, DV, 128)])}
    for name, a, b in zip(("dq", "dk", "dv", "dlog_g"), k_in, ref_in):
        err[name] = rel_rms(a.grad.cpu(), b.grad)
    if state:
        err["dS0"], err["dz0"] = rel_rms(k_st[0].grad.cpu(), ref_st[0].grad), rel_rms(k_st[1].grad.cpu(), ref_st[1].grad)
    return err


def window_case(device: str, dtype: torch.dtype, *, T: int, D: int, DV: int, W: int, nsink: int,
                fuse: bool = False, pad: int | None = None, bm: int | None = 16, bn: int = 16, B: int = 2,
                H: int = 2, seed: int = 0, kv: dict | None = None, bthd: bool = False,
                emulate_walk: bool = False) -> dict[str, float]:
    """window_attn_triton vs window_attn_parallel (fp64): output, state, d{q, k, v, sinks[, y_g, alpha]}.
    ``emulate_walk`` (CPU): the backward through ``window_walk_emulated`` in the Gluon kernel's place.
    ``bm=None`` takes the module's launch table; ``kv`` sets more ``WindowLaunch`` fields (kv_bm, ...,
    gluon_bwd_walk); ``bthd``: q, k, v as a model gives them, (B, T, H, D) projections seen as (B, H, T, D)."""
    from linearize.ops.window_attn import triton as kwin
    from linearize.ops.window_attn import WindowState, cache_len, window_attn_parallel

    g = _gen(seed)
    q, k = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    yg = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    alpha = torch.randn(H, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, nsink, generator=g, dtype=torch.float64) if nsink else None
    do = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64).to(dtype).double()
    L = cache_len(W, False)
    st = None
    if pad is not None:  # row 0 carries `pad` tokens of left padding at negative positions
        st = WindowState(torch.zeros(B, H, L, D, dtype=torch.float64), torch.zeros(B, H, L, DV, dtype=torch.float64),
                         torch.tensor([-pad] + [0] * (B - 1)))
    ins = [x.to(dtype) for x in (q, k, v, yg)] + [alpha.float()] + ([sinks.float()] if nsink else [])
    ref = [x.double().requires_grad_() for x in ins]
    r_sinks = ref[5] if nsink else None
    o, s = window_attn_parallel(ref[0], ref[1], ref[2], window=W, sink_logits=r_sinks, state=st)
    if fuse:
        o = ref[3] + ref[4][:, None, None] * o
    (o * do).sum().backward()

    dev = torch.device(device)
    kin = [x.to(dev).requires_grad_() for x in ins]
    if bthd:  # leaves in the model's layout
        kin[:3] = [x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in kin[:3]]
    k_st = WindowState(st.k.float().to(dev), st.v.float().to(dev), st.pos.to(dev)) if st is not None else None
    cfg = kwin.LAUNCH if bm is None else kwin.WindowLaunch(bm=bm, bn=bn)
    cfg = dataclasses.replace(cfg, **(kv or {}))
    o2, s2 = kwin.window_attn_triton(kin[0], kin[1], kin[2], window=W, sink_logits=kin[5] if nsink else None,
                                     state=k_st, y_global=kin[3] if fuse else None, alpha=kin[4] if fuse else None,
                                     launch=cfg)
    assert o2.dtype == dtype
    with _emulated_window_walk(emulate_walk, cfg.gluon_walk_delta):
        (o2.double() * do.to(dev)).sum().backward()
    err = {"o": rel_rms(o2.cpu(), o), "state.k": rel_rms(s2.k.cpu(), s.k), "state.v": rel_rms(s2.v.cpu(), s.v),
           "state.pos": 0.0 if torch.equal(s2.pos.cpu(), s.pos) else float("inf")}
    names = ["dq", "dk", "dv"] + (["dy_g", "dalpha"] if fuse else []) + (["dsinks"] if nsink else [])
    idx = [0, 1, 2] + ([3, 4] if fuse else []) + ([5] if nsink else [])
    for name, i in zip(names, idx):
        err[name] = rel_rms(kin[i].grad.cpu(), ref[i].grad)
    if pad:
        err["padding rows are 0"] = 0.0 if bool((o2[0, :, :pad] == (yg[0, :, :pad].to(dtype).to(dev) if fuse else 0)
                                                  ).all()) else float("inf")
    return err


def hybrid_case(device: str, dtype: torch.dtype, *, padded: bool, T: int = 40, seed: int = 0) -> dict[str, float]:
    """HybridAttention (Lizard: gated + window + sinks + sum) with the kernels on vs LINEARIZE_KERNELS=0:
    output, both states and every parameter gradient."""
    from linearize.layers.hybrid import HybridAttention
    from linearize.methods import AttentionConfig

    B, H, d, hidden = 2, 2, 16, 32
    torch.manual_seed(seed)
    cfg = AttentionConfig(window=8, sinks=4, chunk_size=8)
    layer = HybridAttention(cfg, H, d, hidden).to(device=device, dtype=dtype)
    with torch.no_grad():  # non-trivial parameters: gates, sinks, alpha, feature maps
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    g = _gen(seed + 1)
    q, k, v, qr, kr = (torch.randn(B, H, T, d, generator=g).to(device=device, dtype=dtype) for _ in range(5))
    x = torch.randn(B, T, hidden, generator=g).to(device=device, dtype=dtype)
    valid = None
    if padded:
        valid = torch.ones(B, T, dtype=torch.bool, device=device)
        valid[0, :5] = False  # left padding
        valid[1, -3:] = False  # right padding
    dy = torch.randn(B, H, T, d, generator=g).to(device=device, dtype=dtype)
    from linearize.ops.gla import triton as kgla
    from linearize.ops.lizard_attn import fused as kliz
    from linearize.ops.window_attn import triton as kwin

    calls = {"0": 0, "1": 0}
    flag = "0"
    gla_apply, win_apply, liz_apply = kgla._GLAFunction.apply, kwin._WindowFunction.apply, kliz._LizardFunction.apply

    def counting(apply):
        def run(*args):
            calls[flag] += 1
            return apply(*args)
        return run

    outs = {}
    before = os.environ.get("LINEARIZE_KERNELS")
    kgla._GLAFunction.apply, kwin._WindowFunction.apply = counting(gla_apply), counting(win_apply)
    kliz._LizardFunction.apply = counting(liz_apply)
    try:
        for flag in ("0", "1"):
            os.environ["LINEARIZE_KERNELS"] = flag
            layer.zero_grad()
            ins = [t.clone().requires_grad_() for t in (q, k, v, qr, kr, x)]
            y, state = layer(*ins, None, valid)
            (y.float() * dy.float()).sum().backward()
            outs[flag] = (y.detach(), state, {n: p.grad.clone() for n, p in layer.named_parameters()},
                          [t.grad for t in ins])
    finally:
        kgla._GLAFunction.apply, kwin._WindowFunction.apply = gla_apply, win_apply
        kliz._LizardFunction.apply = liz_apply
        if before is None:
            os.environ.pop("LINEARIZE_KERNELS", None)
        else:
            os.environ["LINEARIZE_KERNELS"] = before
    (y0, s0, p0, i0), (y1, s1, p1, i1) = outs["0"], outs["1"]
    err = {"y": rel_rms(y1, y0), "global.S": rel_rms(s1["global"].S, s0["global"].S),
           "global.z": rel_rms(s1["global"].z, s0["global"].z), "local.k": rel_rms(s1["local"].k, s0["local"].k),
           "local.v": rel_rms(s1["local"].v, s0["local"].v),
           "local.pos": 0.0 if torch.equal(s1["local"].pos, s0["local"].pos) else float("inf"),
           # with LINEARIZE_KERNELS=1 Lizard's one op (no padding) or the two kernels (gated +
           # window with the combine, padding), none with 0
           "kernel calls": 0.0 if calls == {"0": 0, "1": 2 if padded else 1} else float("inf")}
    for n in p0:
        err["d" + n] = rel_rms(p1[n], p0[n])
    for n, a, b in zip(("q", "k", "v", "q_rope", "k_rope", "x"), i1, i0):
        err["d" + n] = rel_rms(a, b)
    return err


def model_autocast_case(device: str, dtype: torch.dtype, *, T: int = 48, seed: int = 0) -> dict[str, float]:
    """A converted random tiny Llama (fp32 weights) trained the way ``linearize train`` runs on a GPU,
    under ``dtype`` autocast: every layer's Lizard attention must take the kernels' one op (the RoPE'd
    q and k once reached it in fp32 beside a bf16 v, and the window fell back to torch's chunk loop).
    Errors: the logits and the attention parameters' gradients against the torch path in fp32."""
    import linearize
    from linearize.bench.generate import build_model
    from linearize.ops.lizard_attn import fused as kliz

    model = linearize.convert(build_model("tiny-random", torch.float32, device)[0], "lizard", window=8,
                              chunk_size=16)
    torch.manual_seed(seed)
    with torch.no_grad():  # non-trivial gates, sinks, alpha
        for n, p in model.named_parameters():
            if ".hybrid." in n:
                p.add_(torch.randn_like(p) * 0.3)
    ids = torch.randint(3, model.config.vocab_size, (2, T), generator=_gen(seed + 1)).to(device)
    calls = {"ref": 0, "0": 0, "1": 0}
    apply = kliz._LizardFunction.apply

    def counting(*args):
        calls[flag] += 1
        return apply(*args)

    outs, before = {}, os.environ.get("LINEARIZE_KERNELS")
    kliz._LizardFunction.apply = counting
    try:
        for flag in ("ref", "0", "1"):  # ref: the torch path in fp32, no autocast
            os.environ["LINEARIZE_KERNELS"] = "0" if flag == "ref" else flag
            model.zero_grad()
            with torch.autocast(torch.device(device).type, dtype=dtype, enabled=flag != "ref"):
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            logits.float().square().mean().backward()
            outs[flag] = (logits.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                    if ".hybrid." in n and p.grad is not None})
    finally:
        kliz._LizardFunction.apply = apply
        if before is None:
            os.environ.pop("LINEARIZE_KERNELS", None)
        else:
            os.environ["LINEARIZE_KERNELS"] = before
    layers = model.config.num_hidden_layers
    # against fp32: the torch path under the same autocast is 0.1-1.7% off here, the kernels 0.5-2.2%
    err = {"one op in every layer": 0.0 if calls == {"ref": 0, "0": 0, "1": layers} else float("inf"),
           "logits": rel_rms(outs["1"][0], outs["ref"][0])}
    for n, g in outs["ref"][1].items():
        err["d" + n.split("layers.", 1)[-1]] = rel_rms(outs["1"][1][n], g)
    return err


def lizard_case(device: str, dtype: torch.dtype, *, T: int, DK: int, DV: int, D: int, W: int, nsink: int,
                log_space: bool = False, state: bool = False, pad: int | None = None, seg_chunks: int | None = None,
                chunk: int | None = 16, first: bool | None = None, overlap: bool = True, B: int = 2, H: int = 2,
                seed: int = 0, lizard_cfg: dict | None = None, gla_cfg: dict | None = None,
                emulate_walk: bool = False, og_from_y: bool | None = None,
                ow_from_scores: bool | None = None, sums_beside: bool | None = None) -> dict[str, float]:
    """lizard_attention as one op vs gla_parallel + alpha * window_attn_parallel (fp64): y, both
    states, every gradient. ``first``: LizardPlan.window_first (the window kernel first,
    the gated main pass combining; None: the rule); ``overlap`` False: one CUDA stream
    (KernelSettings.side_streams).
    ``pad``: row 0 starts with that many tokens of left padding (a fresh window state at -pad);
    ``seg_chunks``: forces sequence segments in the gated passes; ``chunk`` None: the launch
    settings users get (else chunks of 16 and V-blocks of 16); ``lizard_cfg``: more KernelSettings or
    LizardPlan fields; ``gla_cfg``: more GLALaunch fields (on CPU, ``gluon_fused_bwd=True`` given here runs
    ``fused_bwd_emulated``); ``emulate_walk`` (CPU): the window's backward through
    ``window_walk_emulated``, forming its own D; ``og_from_y`` (with both emulations): whether the
    gated backward must have taken dy . o_g from y and the window's dy . o_w (asserted);
    ``ow_from_scores`` (with ``emulate_walk``): whether the window's backward must have formed
    dy . o_w from its scores, the forward keeping no o_w (asserted); ``sums_beside`` (with
    ``emulate_walk``): whether the backward must have formed the sink and alpha sums after the gated
    backward (``side_streams``; inline here, off CUDA) rather than in the window's (asserted)."""
    from linearize.ops.backend import KernelSettings
    from linearize.ops.gla import triton as kgla
    from linearize.ops.lizard_attn import fused as kliz
    from linearize.ops.gla import GLAState, gla_parallel
    from linearize.ops.window_attn import WindowState, cache_len, window_attn_parallel

    g = _gen(seed)
    if log_space:
        fq = F.log_softmax(torch.randn(B, H, T, DK, generator=g, dtype=torch.float64) * 2, -1)
        fk = F.log_softmax(torch.randn(B, H, T, DK, generator=g, dtype=torch.float64) * 2, -1)
    else:
        fq, fk = (torch.rand(B, H, T, DK, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    log_g = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64) * 3 + 2)
    qw, kw = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    alpha = torch.randn(H, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, nsink, generator=g, dtype=torch.float64) if nsink else None
    dy = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64).to(dtype).double()
    dS = torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64)
    dz = torch.randn(B, H, DK, generator=g, dtype=torch.float64)
    L = cache_len(W, False)
    dWk, dWv = (torch.randn(B, H, L, n, generator=g, dtype=torch.float64) for n in (D, DV))
    ins = [x.to(dtype) for x in (fq, fk, v)] + [log_g.float()] + [x.to(dtype) for x in (qw, kw)] + [alpha.float()]
    ins += [sinks.float()] if nsink else []
    if state:
        ins += [torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64),
                torch.rand(B, H, DK, generator=g, dtype=torch.float64) * 3]
    names = ["dphi_q", "dphi_k", "dv", "dlog_g", "dq_w", "dk_w", "dalpha"] + (["dsinks"] if nsink else [])
    names += ["dS0", "dz0"] if state else []
    w_st = None
    if pad is not None:
        w_st = WindowState(torch.zeros(B, H, L, D, dtype=torch.float64), torch.zeros(B, H, L, DV, dtype=torch.float64),
                           torch.tensor([-pad] + [0] * (B - 1)))

    def run(xs, lizard):
        it = iter(xs)
        fq_, fk_, v_, lg_, qw_, kw_, al_ = (next(it) for _ in range(7))
        sk_ = next(it) if nsink else None
        st_ = GLAState(next(it), next(it)) if state else None
        if lizard:
            return kliz.lizard_attention(fq_, fk_, v_, lg_, qw_, kw_, al_, window=W, sink_logits=sk_,
                                         log_space_features=log_space, state=st_, window_state=ws_dev,
                                         settings=settings, plan=plan)
        y_g, s_g = gla_parallel(fq_, fk_, v_, lg_, log_space_features=log_space, state=st_)
        y_w, s_w = window_attn_parallel(qw_, kw_, v_, window=W, sink_logits=sk_, state=w_st)
        return y_g + al_[:, None, None] * y_w, s_g, s_w

    ref = [x.double().requires_grad_() for x in ins]
    y, sg, sw = run(ref, False)
    # (the window's state too: it holds the last keys and values, so its gradient reaches k_w and v)
    ((y * dy).sum() + (sg.S * dS).sum() + (sg.z * dz).sum() + (sw.k * dWk).sum() + (sw.v * dWv).sum()).backward()

    dev = torch.device(device)
    kin = [x.to(dev).requires_grad_() for x in ins]
    if state:  # the kernels take the state in fp32
        kin[-2:] = [x.detach().float().requires_grad_() for x in kin[-2:]]
    ws_dev = WindowState(w_st.k.to(dtype).to(dev), w_st.v.to(dtype).to(dev), w_st.pos.to(dev)) if pad else None
    setting_names = {f.name for f in dataclasses.fields(KernelSettings)}
    settings = KernelSettings(side_streams=overlap, **({} if chunk is None else dict(chunk=chunk)),
                              **{n: x for n, x in (lizard_cfg or {}).items() if n in setting_names})
    gla_launch = dataclasses.replace(kgla.LAUNCH, seg_chunks=seg_chunks, **({} if chunk is None else dict(fwd_bv=16)),
                                     **(gla_cfg or {}))
    plan = kliz.LizardPlan(gla=gla_launch, window_first=first,
                           **{n: x for n, x in (lizard_cfg or {}).items() if n not in setting_names})
    try:
        calls, beside = [], []
        fn_apply, fn_beside = kliz._LizardFunction.apply, kliz._sums_beside
        kliz._LizardFunction.apply = lambda *a: calls.append(1) or fn_apply(*a)
        kliz._sums_beside = lambda *a: beside.append(1) or fn_beside(*a)
        emu_fused = _emulated_fused_bwd(device == "cpu" and bool((gla_cfg or {}).get("gluon_fused_bwd")))
        emu_walk = _emulated_window_walk(emulate_walk, True)
        with emu_fused, emu_walk:
            y2, sg2, sw2 = run(kin, True)
            assert y2.dtype == dtype and calls, "lizard_attention did not run as one op"
            ((y2.double() * dy.to(dev)).sum() + (sg2.S.double() * dS.to(dev)).sum()
             + (sg2.z.double() * dz.to(dev)).sum() + (sw2.k.double() * dWk.to(dev)).sum()
             + (sw2.v.double() * dWv.to(dev)).sum()).backward()
        if og_from_y is not None:
            assert emu_fused.sides == [og_from_y], (emu_fused.sides, og_from_y)
        if ow_from_scores is not None:
            assert emu_walk.scores == [ow_from_scores], (emu_walk.scores, ow_from_scores)
        if sums_beside is not None:
            assert len(beside) == int(sums_beside), (beside, sums_beside)
    finally:
        kliz._LizardFunction.apply, kliz._sums_beside = fn_apply, fn_beside
    err = {"y": rel_rms(y2.cpu(), y), "S": rel_rms(sg2.S.cpu(), sg.S), "z": rel_rms(sg2.z.cpu(), sg.z),
           "window.k": rel_rms(sw2.k.cpu(), sw.k), "window.v": rel_rms(sw2.v.cpu(), sw.v),
           "window.pos": 0.0 if torch.equal(sw2.pos.cpu(), sw.pos) else float("inf")}
    for name, a, b in zip(names, kin, ref):
        err[name] = rel_rms(a.grad.cpu(), b.grad)
    return err


def lizard_fused_case(dtype: torch.dtype, *, T: int, W: int = 128, nsink: int = 4, state: bool = False,
                      segments: int | None = None, bthd: bool = False, B: int = 2, H: int = 3,
                      seed: int = 0) -> dict[str, float]:
    """lizard_attention in inference on CUDA, where it runs the fused Gluon forward, which writes
    the window's state too (both asserted), vs
    gla_parallel + alpha * window_attn_parallel in fp64: y and both states. Lizard's widths (128);
    ``segments`` forces LizardPlan.fused_segments; ``bthd``: q_w, k_w and v come as a model
    gives them, (B, T, H, D) projections transposed to (B, H, T, D)."""
    from linearize.ops.lizard_attn import fused as kliz
    from linearize.ops.lizard_attn import gluon as lizard_gluon
    from linearize.ops.gla import GLAState, gla_parallel
    from linearize.ops.window_attn import window_attn_parallel

    g = _gen(seed)
    D = 128
    fq, fk = (torch.rand(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    v, qw, kw = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    log_g = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64) * 3 + 2)
    alpha = torch.randn(H, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, nsink, generator=g, dtype=torch.float64) if nsink else None
    st = None
    if state:
        st = GLAState(torch.randn(B, H, D, D, generator=g, dtype=torch.float64),
                      torch.rand(B, H, D, generator=g, dtype=torch.float64) * 3)
    # the reference sees what the kernel sees: inputs rounded to the kernel's dtypes first
    fq, fk, v, qw, kw = (x.to(dtype).double() for x in (fq, fk, v, qw, kw))
    log_g, alpha = log_g.float().double(), alpha.float().double()
    sinks = sinks.float().double() if nsink else None
    y_g, s_g = gla_parallel(fq, fk, v, log_g, state=st)
    y_w, s_w = window_attn_parallel(qw, kw, v, window=W, sink_logits=sinks)
    y = y_g + alpha[:, None, None] * y_w

    dev = torch.device("cuda")
    calls = []
    fused = lizard_gluon.lizard_fwd_fused
    wrote_state = []
    lizard_gluon.lizard_fwd_fused = lambda *a, **k: (calls.append(k.get("nseg")), wrote_state.append(
        k.get("window_state") is not None))[0] or fused(*a, **k)
    try:
        with torch.no_grad():
            def put(x):
                x = x.to(dev, dtype)
                return x.transpose(1, 2).contiguous().transpose(1, 2) if bthd else x

            y2, sg2, sw2 = kliz.lizard_attention(
                fq.to(dev, dtype), fk.to(dev, dtype), put(v), log_g.to(dev, torch.float32), put(qw), put(kw),
                alpha.to(dev, torch.float32), window=W,
                sink_logits=sinks.to(dev, torch.float32) if nsink else None,
                state=GLAState(st.S.to(dev, torch.float32), st.z.to(dev, torch.float32)) if state else None,
                plan=kliz.LizardPlan(fused_segments=segments))
        torch.cuda.synchronize()
    finally:
        lizard_gluon.lizard_fwd_fused = fused
    assert calls, "lizard_attention did not run the fused forward"
    assert wrote_state == [True], "the fused forward did not write the window's state"
    assert segments is None or state or calls[0] == segments, calls
    return {"y": rel_rms(y2.cpu(), y), "S": rel_rms(sg2.S.cpu(), s_g.S), "z": rel_rms(sg2.z.cpu(), s_g.z),
            "window.k": rel_rms(sw2.k.cpu(), s_w.k), "window.v": rel_rms(sw2.v.cpu(), s_w.v)}


def gla_fused_case(dtype: torch.dtype, *, T: int, normalize: bool, state: bool = False, bthd: bool = False,
                   segments: int | None = None, B: int = 2, H: int = 3, seed: int = 0) -> dict[str, float]:
    """gla_chunk_triton in inference on CUDA, where it runs GLA's fused Gluon forward (asserted, in
    ``segments``: GLALaunch.gluon_fwd_segments), vs gla_parallel in fp64: o and the final
    state. Widths 128; ``bthd``: q, k, v as a model gives them, (B, T, H, D) projections transposed."""
    import dataclasses

    from linearize.ops.gla import triton as kgla
    from linearize.ops.gla import gluon as gla_gluon
    from linearize.ops.gla.triton import gla_chunk_triton
    from linearize.ops.gla import GLAState, gla_parallel

    g = _gen(seed)
    D = 128
    q, k = (torch.rand(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    log_g = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64) * 3 + 2)
    st = None
    if state:
        st = GLAState(torch.randn(B, H, D, D, generator=g, dtype=torch.float64),
                      torch.rand(B, H, D, generator=g, dtype=torch.float64) * 3)
    q, k, v = (x.to(dtype).double() for x in (q, k, v))  # the reference sees the kernel's inputs
    log_g = log_g.float().double()
    o, s = gla_parallel(q, k, v, log_g, normalize=normalize, state=st)

    dev = torch.device("cuda")
    calls, fused = [], gla_gluon.fwd_fused
    gla_gluon.fwd_fused = lambda *a, **kw: calls.append(kw["nseg"]) or fused(*a, **kw)
    try:
        def put(x):
            x = x.to(dev, dtype)
            return x.transpose(1, 2).contiguous().transpose(1, 2) if bthd else x

        with torch.no_grad():
            o2, s2 = gla_chunk_triton(put(q), put(k), put(v), log_g.to(dev, torch.float32), normalize=normalize,
                                      state=GLAState(st.S.to(dev).float(), st.z.to(dev).float()) if state else None,
                                      launch=dataclasses.replace(kgla.LAUNCH, gluon_fwd_segments=segments))
        torch.cuda.synchronize()
    finally:
        gla_gluon.fwd_fused = fused
    want = 1 if state or segments is None else gla_gluon.segment_plan(T, segments)[0]
    assert calls == [want], (calls, want)
    return {"o": rel_rms(o2.cpu(), o), "S": rel_rms(s2.S.cpu(), s.S), "z": rel_rms(s2.z.cpu(), s.z)}


def _delta_gates(g: torch.Generator, B: int, H: int, T: int, extreme: bool) -> torch.Tensor:
    """log alpha (B, H, T), fp64: moderate decays, or runs of alpha = 0 (-inf), near 0 (log -20),
    exactly 1, near 1 and anywhere between."""
    u = torch.rand(B, H, T, generator=g, dtype=torch.float64)
    if not extreme:
        return F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64) * 2 + 3)
    kind = ((torch.arange(T) // 5) % 5).expand(B, H, T)
    choices = torch.stack([torch.full_like(u, float("-inf")), -20 + 2 * u, torch.zeros_like(u), -1e-4 * u, -20 * u])
    return choices.gather(0, kind.unsqueeze(0)).squeeze(0)


def delta_case(device: str, dtype: torch.dtype, *, T: int, DK: int, DV: int, order: int | None = None,
               gated: bool = True, state: bool = False, extreme: bool = False, chunk: int = 16, B: int = 1,
               H: int = 2, segments: int | None = None, autocast: bool = False, seed: int = 0) -> dict[str, float]:
    """delta_rule_chunk (``order`` None) or delta_product_chunk of that order on the kernels (the
    delta rule's whole chunk form, or DeltaProduct's scan and chunks' inverses: each asserted to
    run once), vs the fp64 parallel form on the same rounded inputs: o, final state and
    d{q, k, v, beta, log_alpha, S0} (with DeltaProduct's history, d{k_prev, v_prev}). ``segments``:
    the scan's chain in that many segments, as on a GPU with few long rows; ``autocast``: called
    under bf16 autocast, as a model trains (the op's own products stay in fp32)."""
    from linearize.ops import delta as D
    from linearize.ops.delta import triton as kdelta

    g = _gen(seed)
    q = torch.randn(B, H, T, DK, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, H, T, DK, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    beta = 0.1 + 0.9 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    la = _delta_gates(g, B, H, T, extreme) if gated else None
    ins = [x.to(dtype) for x in (q, k, v, beta)] + ([la.to(dtype)] if gated else [])
    n = order or 1
    st = []
    if state:
        st = [0.3 * torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64)]
        if order is not None:
            st += [F.normalize(torch.randn(B, H, n - 1, DK, generator=g, dtype=torch.float64), dim=-1),
                   torch.randn(B, H, n - 1, DV, generator=g, dtype=torch.float64)]
    do = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64).to(dtype).double()
    dS = torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64)

    def call(fn, xs, sts, **kw):
        kw = dict(kw, log_alpha=xs[4] if gated else None)
        if order is None:
            return fn(*xs[:4], state=D.DeltaState(*sts) if sts else None, **kw)
        return fn(*xs[:4], order=order, state=D.DeltaProductState(*sts) if sts else None, **kw)

    ref_in = [x.double().requires_grad_() for x in ins]
    ref_st = [x.clone().requires_grad_() for x in st]
    o, s = call(D.delta_rule_parallel if order is None else D.delta_product_parallel, ref_in, ref_st)
    ((o * do).sum() + (s.S * dS).sum()).backward()

    dev = torch.device(device)
    k_in = [x.to(dev).requires_grad_() for x in ins]
    k_st = [x.float().to(dev).requires_grad_() for x in st]
    apply, calls = kdelta._DeltaScanFunction.apply, []
    kdelta._DeltaScanFunction.apply = lambda *a: calls.append(a[0].shape[3]) or apply(*a)  # W's chunk length
    inverse, inverses = kdelta.unit_lower_inverse_triton, []
    kdelta.unit_lower_inverse_triton = lambda n: inverses.append(n.shape[-1]) or inverse(n)
    fused, chunks = kdelta._DeltaChunkFunction.apply, []
    kdelta._DeltaChunkFunction.apply = lambda *a: chunks.append(a[6]) or fused(*a)  # its chunk size
    choose = kdelta._segments
    if segments is not None:
        kdelta._segments = lambda *a: segments
    try:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            o2, s2 = call(D.delta_rule_chunk if order is None else D.delta_product_chunk, k_in, k_st, chunk_size=chunk)
        assert o2.dtype == dtype and s2.S.dtype == torch.float32
        ((o2.double() * do.to(dev)).sum() + (s2.S.double() * dS.to(dev)).sum()).backward()
    finally:
        kdelta._DeltaScanFunction.apply, kdelta.unit_lower_inverse_triton = apply, inverse
        kdelta._DeltaChunkFunction.apply, kdelta._segments = fused, choose
    if n == 1:
        ran = len(chunks) == 1 and chunks[0] <= kdelta.FUSED_MAX_CHUNK and not calls and not inverses
    else:
        ran = len(calls) == 1 and calls[0] <= 128 and inverses == calls and not chunks
    err = {"o": rel_rms(o2.cpu(), o), "S": rel_rms(s2.S.cpu(), s.S),
           "the kernels ran once (order 1: the whole chunk form; else the scan and inverse)":
           0.0 if ran else float("inf")}
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dlog_alpha"), k_in, ref_in):
        err[name] = rel_rms(a.grad.cpu(), b.grad)
    for name, a, b in zip(("dS0", "dk_prev", "dv_prev"), k_st, ref_st):
        err[name] = rel_rms(a.grad.cpu(), b.grad)
    return err


def delta_extra_case(device: str, dtype: torch.dtype, *, T: int, DK: int, DV: int, gated: bool = True,
                     chunk: int = 16, B: int = 1, H: int = 2, seed: int = 0) -> dict[str, float]:
    """``delta_rule_chunk``'s ``extra_queries`` on the kernels (one chunk-form call) vs a second call
    with them as the queries; o and the state unchanged by them (exactly)."""
    from linearize.ops import delta as D

    g = _gen(seed)
    q, q2 = (torch.randn(B, H, T, DK, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    k = F.normalize(torch.randn(B, H, T, DK, generator=g), dim=-1).to(device=device, dtype=dtype)
    v = torch.randn(B, H, T, DV, generator=g).to(device=device, dtype=dtype)
    beta = (0.1 + 0.9 * torch.rand(B, H, T, generator=g)).to(device=device, dtype=dtype)
    la = _delta_gates(g, B, H, T, False).to(device=device, dtype=dtype) if gated else None
    call = lambda queries, **kw: D.delta_rule_chunk(queries, k, v, beta, log_alpha=la, chunk_size=chunk, **kw)  # noqa: E731
    o, st, extra = call(q, extra_queries=q2)
    o1, st1 = call(q)
    same = torch.equal(o, o1) and torch.equal(st.S, st1.S)
    return {"extra": rel_rms(extra.cpu(), call(q2)[0].cpu()), "o and S unchanged": 0.0 if same else float("inf")}


def delta_layer_case(device: str, dtype: torch.dtype, *, order: int = 1, T: int = 40, seed: int = 0) -> dict[str, float]:
    """HybridAttention as liza configures it (the delta rule, or DeltaProduct of ``order``, beside a
    window, mixed by mu; no parameters of its own) with the kernels on vs LINEARIZE_KERNELS=0:
    output, the delta state and the input gradients (those of q_rope, k_rope and v: the others
    do not reach the output); the kernels (the delta rule's chunk form, or DeltaProduct's scan) run
    once with the kernels on, never off."""
    from linearize.layers.hybrid import HybridAttention
    from linearize.methods import method_config
    from linearize.ops.delta import triton as kdelta

    B, H, d, hidden = 2, 2, 16, 32
    layer = HybridAttention(method_config("liza", window=8, chunk_size=8, delta_order=order), H, d, hidden)
    layer = layer.to(device=device, dtype=dtype)
    g = _gen(seed + 1)
    q, k, v, qr, kr = (torch.randn(B, H, T, d, generator=g).to(device=device, dtype=dtype) for _ in range(5))
    x = torch.randn(B, T, hidden, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(B, H, T, d, generator=g).to(device=device, dtype=dtype)
    calls = {"0": 0, "1": 0}
    apply, fused = kdelta._DeltaScanFunction.apply, kdelta._DeltaChunkFunction.apply

    def counting(fn):
        def call(*args):
            calls[flag] += 1
            return fn(*args)
        return call

    outs, before = {}, os.environ.get("LINEARIZE_KERNELS")
    kdelta._DeltaScanFunction.apply, kdelta._DeltaChunkFunction.apply = counting(apply), counting(fused)
    try:
        for flag in ("0", "1"):
            os.environ["LINEARIZE_KERNELS"] = flag
            layer.zero_grad()
            ins = [t.clone().requires_grad_() for t in (q, k, v, qr, kr, x)]
            y, state = layer(*ins, None, None)
            (y.float() * dy.float()).sum().backward()
            outs[flag] = (y.detach(), state["global"].S.detach(), [t.grad for t in ins])
    finally:
        kdelta._DeltaScanFunction.apply, kdelta._DeltaChunkFunction.apply = apply, fused
        if before is None:
            os.environ.pop("LINEARIZE_KERNELS", None)
        else:
            os.environ["LINEARIZE_KERNELS"] = before
    (y0, s0, i0), (y1, s1, i1) = outs["0"], outs["1"]
    err = {"y": rel_rms(y1, y0), "global.S": rel_rms(s1, s0),
           "kernel calls": 0.0 if calls == {"0": 0, "1": 1} else float("inf")}
    for n, a, b in zip(("q", "k", "v", "q_rope", "k_rope", "x"), i1, i0):
        if b is not None:
            err["d" + n] = rel_rms(a, b)
    return err


def delta_scan_case(device: str, dtype: torch.dtype, *, NC: int, L: int, DK: int, DV: int, gated: bool = True,
                    bv: int | None = 16, segments: int | None = None, B: int = 1, H: int = 2,
                    seed: int = 0) -> dict[str, float]:
    """The Triton scan (ops.delta.triton.delta_scan_triton, forward and backward) vs its torch
    twin (ops.delta.chunk.scan_torch, through autograd), fp32, on random inputs of the chunk
    form's shapes: U, S_c, S_final and d{W, U0, Kd, total, S0}; ``bv`` splits the value columns,
    ``segments`` the chain."""
    from linearize.ops.delta.chunk import scan_torch
    from linearize.ops.delta.triton import delta_scan_triton

    g = _gen(seed)
    W = 0.3 * torch.randn(B, H, NC, L, DK, generator=g)
    U0 = torch.randn(B, H, NC, L, DV, generator=g)
    Kd = 0.3 * torch.randn(B, H, NC, L, DK, generator=g)
    total = torch.rand(B, H, NC, generator=g) if gated else None
    S0 = torch.randn(B, H, DK, DV, generator=g)
    ups = [torch.randn(B, H, NC, L, DV, generator=g), torch.randn(B, H, NC, DK, DV, generator=g),
           torch.randn(B, H, DK, DV, generator=g)]
    xs = [W, U0, Kd, total, S0]
    dev = torch.device(device)
    ref_in = [None if x is None else x.double().requires_grad_() for x in xs]
    ref = scan_torch(*ref_in)
    sum((y * u.double()).sum() for y, u in zip(ref, ups)).backward()
    k_in = [None if x is None else x.to(dev).requires_grad_() for x in xs]
    out = delta_scan_triton(*k_in, bv=bv, segments=segments)
    sum((y * u.to(dev)).sum() for y, u in zip(out, ups)).backward()
    err = {name: rel_rms(a.cpu(), b) for name, a, b in zip(("U", "S_c", "S_final"), out, ref)}
    for name, a, b in zip(("dW", "dU0", "dKd", "dtotal", "dS0"), k_in, ref_in):
        if a is not None:
            err[name] = rel_rms(a.grad.cpu(), b.grad)
    return err


# name -> (case function, kwargs, dtype); small shapes for the CPU interpreter (T not a multiple
# of the 16-token chunks, widths not powers of two, forced sequence segments)
F32, BF16 = torch.float32, torch.bfloat16
def lolcats_case(device: str, dtype: torch.dtype, *, T: int, D: int, F: int, DV: int, W: int, C: int,
                 state: bool = False, pad: int = 0, B: int = 2, H: int = 2, seed: int = 0) -> dict[str, float]:
    """LoLCATs' chunk form with its bands on the Triton kernels (asserted to run once) vs the fp64
    parallel form on the same rounded inputs: o, the state, d{q, k, v, fq, fk, window_factor} (and
    d of a given state). Row 1 starts ``pad`` tokens of left padding in (negative positions)."""
    from linearize.ops.lolcats_attn import LolcatsState, lolcats_attn_chunk, lolcats_attn_parallel
    from linearize.ops.lolcats_attn import chunk as lolcats_chunk
    from linearize.ops.lolcats_attn import triton as klol

    g = _gen(seed)
    x = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    ins = [x(B, H, T, D), x(B, H, T, D), x(B, H, T, DV), torch.rand(B, H, T, F, generator=g, dtype=torch.float64),
           torch.rand(B, H, T, F, generator=g, dtype=torch.float64), torch.rand(H, generator=g, dtype=torch.float64)]
    ins = [t.to(dtype) for t in ins]
    L = W - 1
    st = []
    if state:  # a cache that has seen 2L tokens: every slot filled, S and z non-zero
        st = [x(B, H, F, DV).abs(), x(B, H, F).abs(), x(B, H, L, D), torch.rand(B, H, L, F, generator=g,
              dtype=torch.float64), x(B, H, L, DV)]
    pos = torch.tensor([2 * L if state else 0, -pad] + [0] * (B - 2))[:B]
    if not state:
        st = [torch.zeros(B, H, F, DV, dtype=torch.float64), torch.zeros(B, H, F, dtype=torch.float64),
              torch.zeros(B, H, L, D, dtype=torch.float64), torch.zeros(B, H, L, F, dtype=torch.float64),
              torch.zeros(B, H, L, DV, dtype=torch.float64)]
    do = x(B, H, T, DV)

    def run(fn, xs, sts, **kw):
        return fn(*xs, window=W, state=LolcatsState(*sts, pos.to(xs[0].device)), **kw)

    ref_in = [t.double().requires_grad_() for t in ins]
    ref_st = [t.clone().requires_grad_() for t in st]
    o, s_ref = run(lolcats_attn_parallel, ref_in, ref_st)
    ((o * do).sum() + s_ref.S.sum() + s_ref.z.sum()).backward()
    dev = torch.device(device)
    k_in = [t.to(dev).requires_grad_() for t in ins]
    k_st = [t.float().to(dev).requires_grad_() for t in st]
    apply, calls = klol._LolcatsBand.apply, []
    klol._LolcatsBand.apply = lambda *a: calls.append(1) or apply(*a)
    applies, precision = lolcats_chunk.band_kernel_applies, klol.FP32_PRECISION
    if dtype == torch.float32:  # the chunk op sends the kernels 16-bit inputs only: fp32 ones here, in fp32
        lolcats_chunk.band_kernel_applies, klol.FP32_PRECISION = (lambda *a: True), "ieee"
    try:
        o2, s2 = run(lolcats_attn_chunk, k_in, k_st, chunk_size=C)
        ((o2.double() * do.to(dev)).sum() + s2.S.double().sum() + s2.z.double().sum()).backward()
    finally:
        klol._LolcatsBand.apply = apply
        lolcats_chunk.band_kernel_applies, klol.FP32_PRECISION = applies, precision
    err = {"o": rel_rms(o2.cpu(), o), "one kernel call": 0.0 if calls == [1] else float("inf")}
    for field in ("S", "z", "k", "fk", "v"):
        err[f"state.{field}"] = rel_rms(getattr(s2, field).cpu().double(), getattr(s_ref, field))
    for name, a, b in zip(("dq", "dk", "dv", "dfq", "dfk", "dwindow_factor"), k_in, ref_in):
        err[name] = rel_rms(a.grad.cpu(), b.grad)
    if state:
        for name, a, b in zip(("dS0", "dz0", "dk_cache", "dfk_cache", "dv_cache"), k_st, ref_st):
            err[name] = rel_rms(a.grad.cpu(), b.grad)
    return err


def sparse_layer_case(device: str, dtype: torch.dtype, *, T: int = 60, pad: int = 3, seed: int = 0) -> dict[str, float]:
    """HybridAttention as lizard-recall configures it (the gated delta rule beside a window with sink
    logits and the sparse cache, read at a fixed RoPE distance), small, from a fresh state, with a
    left-padded row: the sparse window's live form on its Triton kernels (asserted to run once) vs
    the span loop with the kernels off; output, the cache's state and every input and parameter
    gradient."""
    from linearize.layers.hybrid import HybridAttention
    from linearize.methods import method_config
    from linearize.ops.sparse_window import chunk as schunk
    from linearize.ops.sparse_window import triton as ksparse

    B, H, d, hidden = 2, 2, 16, 32
    cfg = method_config("lizard-recall", window=8, chunk_size=16, sparse_cache=5, sparse_distance=12)
    torch.manual_seed(seed)
    layer = HybridAttention(cfg, H, d, hidden).to(device=device, dtype=dtype)
    g = _gen(seed + 1)
    q, k, v, qr, kr, qf = (torch.randn(B, H, T, d, generator=g).to(device=device, dtype=dtype) for _ in range(6))
    x = torch.randn(B, T, hidden, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(B, H, T, d, generator=g).to(device=device, dtype=dtype)
    valid = torch.ones(B, T, dtype=torch.bool, device=device)
    valid[1, :pad] = False
    calls, apply, on_gpu = [], ksparse._SparseLive.apply, schunk.on_gpu
    outs, before = {}, os.environ.get("LINEARIZE_KERNELS")
    ksparse._SparseLive.apply = lambda *a: calls.append(os.environ["LINEARIZE_KERNELS"]) or apply(*a)
    try:
        for flag in ("0", "1"):
            os.environ["LINEARIZE_KERNELS"] = flag
            schunk.on_gpu = (lambda t: True) if flag == "1" else (lambda t: False)  # live + kernels, or spans
            layer.zero_grad()
            ins = [t.clone().requires_grad_() for t in (q, k, v, qr, kr, x, qf)]
            y, state = layer(*ins[:6], None, valid, q_far=ins[6])
            (y.float() * dy.float()).sum().backward()
            grads = [t.grad for t in ins] + [p.grad for p in layer.parameters()]
            outs[flag] = (y.detach(), state["local"], grads)
    finally:
        ksparse._SparseLive.apply, schunk.on_gpu = apply, on_gpu
        if before is None:
            os.environ.pop("LINEARIZE_KERNELS", None)
        else:
            os.environ["LINEARIZE_KERNELS"] = before
    (y0, s0, g0), (y1, s1, g1) = outs["0"], outs["1"]
    err = {"y": rel_rms(y1, y0), "kernel calls": 0.0 if calls == ["1"] else float("inf"),
           "cache_pos": 0.0 if torch.equal(torch.sort(s1.cache_pos, -1).values, torch.sort(s0.cache_pos, -1).values)
           else float("inf")}
    for i, (a, b) in enumerate(zip(g1, g0)):
        if b is not None:
            err[f"grad {i}"] = rel_rms(a, b)
    return err


def sparse_case(device: str, dtype: torch.dtype, *, T: int, D: int, DV: int, W: int, M: int, C: int, nsink: int,
                cache_qk: bool = True, pad: int = 0, ties: bool = False, B: int = 2, H: int = 2,
                seed: int = 0) -> dict[str, float]:
    """The sparse window's chunk op from a fresh state, its live form on the Triton kernels (asserted
    to run once), vs the span loop in fp64 on the same rounded inputs: o, every field of the final
    state, d{q, k, v, cache_q, leave_k, sink_logits}. Row 1 starts with ``pad`` tokens of padding."""
    from linearize.ops.sparse_window import fresh_state, sparse_window_attn_chunk
    from linearize.ops.sparse_window import triton as ksparse

    g = _gen(seed)
    x = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    ins = [x(B, H, T, D), x(B, H, T, D), x(B, H, T, DV)] + ([x(B, H, T, D), x(B, H, T, D)] if cache_qk else [])
    ins = [t.to(dtype) for t in ins]
    sinks = x(H, nsink) if nsink else None
    score = (torch.randint(0, 3, (B, H, T), generator=g).double() if ties
             else torch.rand(B, H, T, generator=g, dtype=torch.float64))
    pos = torch.tensor([0, -pad] + [0] * (B - 2))[:B]
    do = x(B, H, T, DV).to(dtype).double()

    def run(xs, s, dev, form):
        st = fresh_state(B, H, D, DV, W, M, dtype=torch.float64 if form == "spans" else torch.float32,
                         device=dev, pos=pos.to(dev))
        cq, lk = (xs[3], xs[4]) if cache_qk else (None, None)
        return sparse_window_attn_chunk(xs[0], xs[1], xs[2], score.to(dev), window=W, cache_size=M,
                                        sink_logits=s, state=st, fresh_state=True, form=form, cache_q=cq,
                                        leave_k=lk, chunk_size=C)

    ref_in = [t.double().requires_grad_() for t in ins]
    ref_s = sinks.clone().requires_grad_() if nsink else None
    o, st = run(ref_in, ref_s, torch.device("cpu"), "spans")
    (o * do).sum().backward()
    dev = torch.device(device)
    k_in = [t.to(dev).requires_grad_() for t in ins]
    k_s = sinks.float().to(dev).requires_grad_() if nsink else None
    apply, calls = ksparse._SparseLive.apply, []
    ksparse._SparseLive.apply = lambda *a: calls.append(1) or apply(*a)
    try:
        o2, st2 = run(k_in, k_s, dev, "live")
        assert o2.dtype == dtype
        (o2.double() * do.to(dev)).sum().backward()
    finally:
        ksparse._SparseLive.apply = apply
    err = {"o": rel_rms(o2.cpu(), o), "one kernel call": 0.0 if calls == [1] else float("inf")}
    for field in ("k", "v", "cache_k", "cache_v", "cache_score"):
        err[f"state.{field}"] = rel_rms(getattr(st2, field).cpu().double(), getattr(st, field))
    err["state.cache_pos"] = 0.0 if torch.equal(st2.cache_pos.cpu(), st.cache_pos) else float("inf")
    for name, a, b in zip(("dq", "dk", "dv", "dcache_q", "dleave_k"), k_in, ref_in):
        err[name] = rel_rms(a.grad.cpu(), b.grad)
    if nsink:
        err["dsink_logits"] = rel_rms(k_s.grad.cpu(), ref_s.grad)
    return err


def sparse_slots_case(device: str, dtype: torch.dtype, *, T: int, W: int, M: int, C: int, pad: int = 0,
                      ties: bool = False, B: int = 2, H: int = 3, seed: int = 0,
                      scan: bool | None = None, segments: int | None = None) -> dict[str, float]:
    """The live form's selection on its kernels (``cache_until_triton``, ``old_slots_triton``) vs the torch
    scan and lists (``live.cache_until``, ``live.old_slots``): every j_s and every block's slots, exactly
    (0 or inf). Row 1's first ``pad`` pairs are no candidates (left padding); ``ties``: scores in {0, 1, 2};
    ``scan``: the selection's scan kernel (True) or its all-pairs count (False); None: by length;
    ``segments``: the scan's pairs in about that many segments."""
    from linearize.ops.sparse_window import live
    from linearize.ops.sparse_window import triton as ksparse

    g = _gen(seed)
    P = T - W
    score = (torch.randint(0, 3, (B, H, P), generator=g).to(dtype) if ties
             else torch.rand(B, H, P, generator=g).to(dtype))
    candidate = torch.ones(B, P, dtype=torch.bool)
    candidate[1, :pad] = False
    until = live.cache_until(score, candidate, M)
    slots = live.old_slots(until, T, W, M, C)
    dev = torch.device(device)
    until2 = ksparse.cache_until_triton(score.to(dev), candidate.to(dev), M, scan=scan, segments=segments)
    slots2 = ksparse.old_slots_triton(until2, T, W, M, C)
    exact = lambda a, b: 0.0 if a.dtype == torch.int32 and torch.equal(a.cpu().long(), b.long()) else float("inf")  # noqa: E731
    return {"until": exact(until2, until), "slots": exact(slots2, slots),
            "slots from the torch until": exact(ksparse.old_slots_triton(until.to(dev), T, W, M, C), slots)}


INTERPRETER_CASES = {
    "gla f32 norm log": (gla_case, dict(normalize=True, log_space=True, T=45, DK=16, DV=24, dstate_bv=16), F32),
    "gla f32 norm plain": (gla_case, dict(normalize=True, log_space=False, T=45, DK=16, DV=24), F32),
    "gla f32 unnorm log": (gla_case, dict(normalize=False, log_space=True, T=45, DK=16, DV=24), F32),
    "gla f32 unnorm plain": (gla_case, dict(normalize=False, log_space=False, T=45, DK=16, DV=24, dstate_bv=16), F32),
    "gla bf16 norm log": (gla_case, dict(normalize=True, log_space=True, T=45, DK=16, DV=24, dstate_bv=16), BF16),
    "gla bf16 unnorm plain": (gla_case, dict(normalize=False, log_space=False, T=45, DK=16, DV=24), BF16),
    "gla f32 norm log state+segments": (gla_case, dict(normalize=True, log_space=True, T=70, DK=20, DV=16,
                                                       state=True, seg_chunks=2, dstate_bv=16), F32),
    "gla f32 unnorm plain state+segments": (gla_case, dict(normalize=False, log_space=False, T=50, DK=16, DV=16,
                                                           state=True, seg_chunks=1), F32),
    "gla f32 norm log extreme gates": (gla_case, dict(normalize=True, log_space=True, T=61, DK=16, DV=16,
                                                      extreme=True, seg_chunks=2), F32),
    "gla bf16 norm log extreme gates": (gla_case, dict(normalize=True, log_space=True, T=61, DK=16, DV=16,
                                                       extreme=True), BF16),
    "gla f32 norm log state+segments pointer loads": (gla_case, dict(normalize=True, log_space=True, T=70, DK=20,
                                                                     DV=16, state=True, seg_chunks=2, tma=False), F32),
    # a 40-byte row stride is no TMA stride: the kernels fall back to pointer loads by themselves
    "gla bf16 norm plain DK=20": (gla_case, dict(normalize=True, log_space=False, T=45, DK=20, DV=16), BF16),
    "gla f32 wide values 136": (gla_wide_values_case, dict(T=45, DK=16, DV=136), F32),
    "gla bf16 wide values 256 no state": (gla_wide_values_case, dict(T=30, DK=16, DV=256, state=False), BF16),
    "gla f32 norm plain T=1": (gla_case, dict(normalize=True, log_space=False, T=1, DK=16, DV=16, state=True), F32),
    "gla bf16 norm plain T=100 segments": (gla_case, dict(normalize=True, log_space=False, T=100, DK=16, DV=16,
                                                          seg_chunks=2, state=True), BF16),
    # the fused gated backward's host side (plan, segments, arguments, dv added into the window's),
    # with fused_bwd_emulated in the Gluon kernel's place
    "gla f32 norm plain fused bwd emulated state+segments": (gla_case, dict(
        normalize=True, log_space=False, T=80, DK=16, DV=24, state=True, seg_chunks=2,
        gla_cfg=dict(gluon_fused_bwd=True)), F32),
    "gla f32 unnorm plain fused bwd emulated state": (gla_case, dict(
        normalize=False, log_space=False, T=64, DK=16, DV=16, state=True, gla_cfg=dict(gluon_fused_bwd=True)), F32),
    "lizard f32 sinks state fused bwd emulated segments": (lizard_case, dict(
        T=96, DK=16, DV=16, D=16, W=20, nsink=4, state=True, seg_chunks=2, gla_cfg=dict(gluon_fused_bwd=True)), F32),
    # with the walking window backward emulated too: the gated backward takes dy . o_g from y and
    # the window's dy . o_w (og_from_y; one segment), or reads o_g where told not to, or segmented;
    # the window's dy . o_w from its scores (ow_from_scores), or from o where told not to; the sink
    # and alpha sums after the gated backward (side_streams), or in the window's where told not to
    "lizard f32 sinks state fused bwd + walk emulated, og from y": (lizard_case, dict(
        T=96, DK=16, DV=16, D=16, W=20, nsink=4, state=True, gla_cfg=dict(gluon_fused_bwd=True),
        emulate_walk=True, og_from_y=True, ow_from_scores=False, sums_beside=True), F32),
    "lizard f32 sinks state fused bwd + walk emulated, og from y, ow from scores": (lizard_case, dict(
        T=96, DK=16, DV=16, D=16, W=20, nsink=4, state=True, gla_cfg=dict(gluon_fused_bwd=True),
        emulate_walk=True, lizard_cfg=dict(ow_from_scores=True), og_from_y=True, ow_from_scores=True), F32),
    "lizard f32 sinks fused bwd + walk emulated, og kept": (lizard_case, dict(
        T=64, DK=16, DV=16, D=16, W=20, nsink=4, gla_cfg=dict(gluon_fused_bwd=True), emulate_walk=True,
        overlap=False, lizard_cfg=dict(og_from_y=False), og_from_y=False, ow_from_scores=False,
        sums_beside=False), F32),
    "lizard f32 sinks fused bwd + walk emulated, segments": (lizard_case, dict(
        T=96, DK=16, DV=16, D=16, W=20, nsink=4, seg_chunks=2, gla_cfg=dict(gluon_fused_bwd=True),
        emulate_walk=True, lizard_cfg=dict(ow_from_scores=True), og_from_y=False, ow_from_scores=True), F32),
    "window f32 sinks": (window_case, dict(T=41, D=16, DV=24, W=20, nsink=4), F32),
    "window bf16 sinks fused": (window_case, dict(T=41, D=16, DV=24, W=20, nsink=4, fuse=True), BF16),
    "window f32 no sinks padded": (window_case, dict(T=41, D=16, DV=16, W=20, nsink=0, pad=5), F32),
    "window f32 sinks fused padded w>T": (window_case, dict(T=19, D=16, DV=16, W=25, nsink=3, fuse=True, pad=4), F32),
    "window f32 w=1 bm32": (window_case, dict(T=37, D=16, DV=16, W=1, nsink=2, bm=32, bn=16), F32),
    "window f32 sinks padded kv blocks": (window_case, dict(T=75, D=16, DV=24, W=20, nsink=3, pad=5, bm=16, bn=16,
                                                            kv=dict(kv_bm=32, kv_bn=16, kv_warps=2)), F32),
    "window bf16 sinks fused kv blocks": (window_case, dict(T=75, D=16, DV=16, W=33, nsink=4, fuse=True, bm=32,
                                                            bn=16, kv=dict(kv_bm=32, kv_bn=64)), BF16),
    # the walking window backward's host side (the kernel's own D and the sums after it, or the
    # delta pre-pass), with window_walk_emulated in the Gluon kernel's place
    "window f32 sinks fused walk emulated": (window_case, dict(T=41, D=16, DV=24, W=20, nsink=4, fuse=True,
                                                               emulate_walk=True), F32),
    "window bf16 sinks fused walk emulated pre-pass": (window_case, dict(
        T=41, D=16, DV=24, W=20, nsink=4, fuse=True, emulate_walk=True, kv=dict(gluon_walk_delta=False)), BF16),
    "window f32 no sinks walk emulated": (window_case, dict(T=41, D=16, DV=16, W=20, nsink=0, emulate_walk=True), F32),
    "hybrid f32 lizard padded": (hybrid_case, dict(padded=True), F32),
    "hybrid f32 lizard": (hybrid_case, dict(padded=False), F32),
    "model bf16 autocast lizard": (model_autocast_case, dict(), BF16),
    "lizard f32 sinks state": (lizard_case, dict(T=45, DK=16, DV=24, D=16, W=20, nsink=4, state=True), F32),
    "lizard f32 sinks state window first": (lizard_case, dict(T=45, DK=16, DV=24, D=16, W=20, nsink=4, state=True,
                                                              first=True), F32),
    "lizard bf16 sinks window first": (lizard_case, dict(T=45, DK=16, DV=16, D=32, W=20, nsink=4, first=True), BF16),
    "lizard bf16 sinks": (lizard_case, dict(T=45, DK=16, DV=16, D=32, W=20, nsink=4), BF16),
    "lizard f32 log segments padded": (lizard_case, dict(T=70, DK=20, DV=16, D=16, W=33, nsink=2, log_space=True,
                                                         seg_chunks=2, pad=5), F32),
    "lizard f32 log segments padded window first": (lizard_case, dict(T=70, DK=20, DV=16, D=16, W=33, nsink=2,
                                                                      log_space=True, seg_chunks=2, pad=5, first=True),
                                                    F32),
    # window first with segments: the normaliser's chain apart from the state's (inline off CUDA), from a state
    "lizard f32 state segments window first": (lizard_case, dict(T=70, DK=20, DV=16, D=16, W=33, nsink=2, state=True,
                                                                 seg_chunks=2, first=True), F32),
    "lizard f32 no sinks v-blocks": (lizard_case, dict(T=37, DK=16, DV=32, D=24, W=5, nsink=0), F32),
    "lizard f32 w=1": (lizard_case, dict(T=37, DK=16, DV=16, D=16, W=1, nsink=2), F32),
    # shorter than the window's cache: its state zeros first, or the given cache's last slots first
    "lizard f32 short": (lizard_case, dict(T=12, DK=16, DV=16, D=16, W=20, nsink=2), F32),
    "lizard f32 short padded": (lizard_case, dict(T=12, DK=16, DV=16, D=16, W=20, nsink=2, pad=3), F32),
    # the delta rule's scan against its twin (value columns split in blocks of 16), then the whole
    # chunk form with the Triton scan against the fp64 parallel form (T not a multiple of the chunk)
    "delta scan f32 gated": (delta_scan_case, dict(NC=3, L=20, DK=16, DV=24), F32),
    "delta scan f32 ungated": (delta_scan_case, dict(NC=2, L=16, DK=24, DV=16, gated=False, bv=None), F32),
    # the chain in segments: 4 of 3 chunks (a tree of pairs with an odd one), 2 of 1
    "delta scan f32 gated segments": (delta_scan_case, dict(NC=12, L=16, DK=16, DV=24, segments=4), F32),
    "delta scan f32 ungated segments": (delta_scan_case, dict(NC=2, L=20, DK=24, DV=16, gated=False, segments=2), F32),
    "delta f32 gated state": (delta_case, dict(T=37, DK=16, DV=24, state=True), F32),
    "delta f32 ungated": (delta_case, dict(T=37, DK=16, DV=16, gated=False), F32),
    "delta f32 extreme gates": (delta_case, dict(T=45, DK=16, DV=16, extreme=True), F32),
    "delta f32 gated state segments": (delta_case, dict(T=128, DK=16, DV=24, state=True, chunk=8, segments=4), F32),
    "delta f32 segments under autocast": (delta_case, dict(T=128, DK=16, DV=16, chunk=8, segments=4, autocast=True), F32),
    "delta bf16 gated state": (delta_case, dict(T=37, DK=16, DV=24, state=True), BF16),
    "delta f32 extra queries": (delta_extra_case, dict(T=45, DK=16, DV=24), F32),
    "delta bf16 extra queries ungated": (delta_extra_case, dict(T=45, DK=16, DV=16, gated=False), BF16),
    "delta f32 chunks cut to 64, odd widths": (delta_case, dict(T=150, DK=24, DV=40, chunk=128, state=True), F32),
    "delta product2 f32 gated state": (delta_case, dict(T=29, DK=16, DV=16, order=2, state=True, chunk=8), F32),
    "delta product2 bf16 extreme gates": (delta_case, dict(T=29, DK=16, DV=16, order=2, extreme=True, chunk=8), BF16),
    # order 3 at chunk_size 64: the scan takes chunks of 42 tokens (126 virtual ones)
    "delta product3 f32 kernel chunks": (delta_case, dict(T=100, DK=16, DV=16, order=3, chunk=64, state=True), F32),
    "delta product2 f32 segments": (delta_case, dict(T=64, DK=16, DV=16, order=2, chunk=8, segments=2), F32),
    # liza's layer takes the Triton scan and means the same with the kernels off
    "delta liza layer f32": (delta_layer_case, dict(), F32),
    "delta liza layer f32 product2": (delta_layer_case, dict(order=2), F32),
    # LoLCATs' bands: chunks wider than a key tile, a carried state, left padding, T not a multiple of C, w = 1
    "lolcats f32 padded": (lolcats_case, dict(T=45, D=16, F=16, DV=16, W=8, C=16, pad=3), F32),
    "lolcats f32 state wide": (lolcats_case, dict(T=70, D=16, F=24, DV=8, W=20, C=32, state=True), F32),
    "lolcats f32 w=1": (lolcats_case, dict(T=33, D=16, F=16, DV=16, W=1, C=16), F32),
    "lolcats bf16 state": (lolcats_case, dict(T=50, D=16, F=16, DV=16, W=8, C=16, state=True, pad=2), BF16),
    # the sparse window's live form: cached pairs read with their own q and k, a padded row, tied scores,
    # more slots than pairs, no sinks, blocks wider than a key tile
    "sparse f32 cache q and k padded": (sparse_case, dict(T=70, D=16, DV=8, W=8, M=5, C=16, nsink=2, pad=3), F32),
    "sparse f32 ties no sinks": (sparse_case, dict(T=37, D=16, DV=16, W=4, M=3, C=16, nsink=0, ties=True,
                                                   cache_qk=False), F32),
    "sparse f32 many slots wide blocks": (sparse_case, dict(T=150, D=8, DV=16, W=16, M=200, C=128, nsink=4), F32),
    "sparse layer lizard-recall f32": (sparse_layer_case, dict(), F32),
    "sparse slots f32 padded": (sparse_slots_case, dict(T=300, W=16, M=20, C=32, pad=37), F32),
    "sparse slots f32 ties, cache wider than the pairs": (sparse_slots_case, dict(T=90, W=8, M=100, C=16, ties=True),
                                                          F32),
    "sparse slots f32 padded, scan": (sparse_slots_case, dict(T=300, W=16, M=20, C=32, pad=37, scan=True), F32),
    "sparse slots f32 ties, 256 slots, scan": (sparse_slots_case, dict(T=700, W=64, M=256, C=64, ties=True, pad=9,
                                                                       B=2, H=1, scan=True), F32),
    "sparse slots bf16 ties, one slot, scan": (sparse_slots_case, dict(T=200, W=4, M=1, C=64, ties=True, pad=5,
                                                                      scan=True), BF16),
    "sparse slots bf16 ties, one slot": (sparse_slots_case, dict(T=200, W=4, M=1, C=64, ties=True, pad=5), BF16),
    # the scan's pairs in segments (3 of 256, the last shorter; 5 of 128 under a cache of 256; padding
    # longer than a segment)
    "sparse slots f32 padded, scan in segments": (sparse_slots_case, dict(T=700, W=16, M=20, C=32, pad=300,
                                                                          scan=True, segments=3), F32),
    "sparse slots f32 ties, 256 slots, scan in segments": (sparse_slots_case, dict(
        T=700, W=64, M=256, C=64, ties=True, pad=9, B=2, H=1, scan=True, segments=5), F32),
    "sparse slots bf16 ties, one slot, scan in segments": (sparse_slots_case, dict(
        T=600, W=4, M=1, C=64, ties=True, pad=5, scan=True, segments=4), BF16),
    # a window wider than the key passes' query tiles, and pairs leaving the small cache all along
    "sparse f32 wide window short stays": (sparse_case, dict(T=300, D=16, DV=16, W=100, M=4, C=32, nsink=2, pad=5),
                                           F32),
    "sparse bf16 cache q and k": (sparse_case, dict(T=70, D=16, DV=16, W=8, M=6, C=16, nsink=2, pad=2), BF16),
}


# cases held to another tolerance than their dtype's KTOL
CASE_TOL = {"model bf16 autocast lizard": 3e-2}  # bf16 autocast against fp32, not kernel against kernel


# op -> the first words of its cases' names: each op's test file (tests/ops/test_gla.py,
# test_window_attn.py, test_lizard_attn.py: the hybrid layer and the model are Lizard's;
# test_delta_fast.py; test_sparse_window.py; test_lolcats_attn.py) runs its own cases in one subprocess, ``python kernel_cases.py <op>``
CASE_OPS = {"gla": ("gla",), "window": ("window",), "lizard": ("lizard", "hybrid", "model"), "delta": ("delta",),
            "sparse": ("sparse",), "lolcats": ("lolcats",)}


def cases_of(op: str) -> list[str]:
    """The names of ``op``'s interpreter cases (a key of CASE_OPS), in INTERPRETER_CASES' order."""
    return [name for name in INTERPRETER_CASES if name.split()[0] in CASE_OPS[op]]


assert sorted(n for op in CASE_OPS for n in cases_of(op)) == sorted(INTERPRETER_CASES), "a case of no op"


def run(names: list[str], device: str) -> dict[str, dict]:
    out = {}
    for name in names:
        fn, kw, dtype = INTERPRETER_CASES[name]
        t0 = time.time()
        try:
            out[name] = {"errors": fn(device, dtype, **kw), "seconds": time.time() - t0}
        except Exception as e:  # reported, not raised: one broken case must not hide the others
            out[name] = {"exception": f"{type(e).__name__}: {e}", "seconds": time.time() - t0}
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    # arguments: ops (keys of CASE_OPS: their cases) or case names; none: every case
    names = [n for a in sys.argv[1:] for n in (cases_of(a) if a in CASE_OPS else [a])] or list(INTERPRETER_CASES)
    print(json.dumps(run(names, "cpu")))
