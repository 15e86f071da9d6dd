"""Kernel-vs-reference cases, shared by tests/test_kernels.py.

Each case runs the Triton path (forward and backward) and the torch reference on the same
inputs and returns the relative RMS error of every output and gradient. The GPU tests call the
cases in process on CUDA; the CPU tests run ``python kernel_cases.py`` in a subprocess with
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


def gla_case(device: str, dtype: torch.dtype, *, normalize: bool, log_space: bool, T: int, DK: int, DV: int,
             B: int = 1, H: int = 2, state: bool = False, extreme: bool = False, seg_chunks: int | None = None,
             chunk: int | None = 16, fwd_bv: int = 16, dstate_bv: int = 128, tma: bool = True,
             seed: int = 0) -> dict[str, float]:
    """gla_chunk_triton vs gla_parallel (fp64): o, final state, and d{q, k, v, log_g, S0, z0}.
    ``chunk=None``: the module's launch config (what users get), with ``seg_chunks`` applied;
    ``dstate_bv``: the V-block of the backward's reverse pass (16 splits the test widths);
    ``tma=False``: the forward's pointer loads even where descriptors would apply."""
    import dataclasses
    from linearize.kernels import gla as kgla
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
    k_st = GLAState(*(x.float().to(dev).requires_grad_() for x in st)) if state else None
    if chunk is None:
        cfg = dataclasses.replace(kgla.CONFIG, seg_chunks=seg_chunks, tma=tma)
    else:
        cfg = kgla.GLAKernelConfig(chunk=chunk, fwd_bv=fwd_bv, seg_chunks=seg_chunks,
                                   dstate_bv=dstate_bv, dstate_bv_norm=dstate_bv, tma=tma)
    o2, s2 = kgla.gla_chunk_triton(*k_in, normalize=normalize, log_space_features=log_space, state=k_st,
                                   config=cfg)
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


def window_case(device: str, dtype: torch.dtype, *, T: int, D: int, DV: int, W: int, nsink: int,
                fuse: bool = False, pad: int | None = None, bm: int | None = 16, bn: int = 16, B: int = 2,
                H: int = 2, seed: int = 0, kv: dict | None = None) -> dict[str, float]:
    """window_attn_triton vs window_attn_parallel (fp64): output, state, d{q, k, v, sinks[, y_g, alpha]}.
    ``bm=None`` takes the module's config; ``kv`` sets the dk/dv pass's own fields (kv_bm, ...)."""
    from linearize.kernels import window as kwin
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
    k_st = WindowState(st.k.float().to(dev), st.v.float().to(dev), st.pos.to(dev)) if st is not None else None
    cfg = kwin.CONFIG if bm is None else kwin.WindowKernelConfig(bm=bm, bn=bn)
    cfg = dataclasses.replace(cfg, **(kv or {}))
    o2, s2 = kwin.window_attn_triton(kin[0], kin[1], kin[2], window=W, sink_logits=kin[5] if nsink else None,
                                     state=k_st, y_global=kin[3] if fuse else None, alpha=kin[4] if fuse else None,
                                     config=cfg)
    assert o2.dtype == dtype
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
    from linearize.kernels import gla as kgla
    from linearize.kernels import window as kwin

    calls = {"0": 0, "1": 0}
    flag = "0"
    gla_apply, win_apply = kgla._GLAFunction.apply, kwin._WindowFunction.apply

    def counting(apply):
        def run(*args):
            calls[flag] += 1
            return apply(*args)
        return run

    outs = {}
    before = os.environ.get("LINEARIZE_KERNELS")
    kgla._GLAFunction.apply, kwin._WindowFunction.apply = counting(gla_apply), counting(win_apply)
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
        if before is None:
            os.environ.pop("LINEARIZE_KERNELS", None)
        else:
            os.environ["LINEARIZE_KERNELS"] = before
    (y0, s0, p0, i0), (y1, s1, p1, i1) = outs["0"], outs["1"]
    err = {"y": rel_rms(y1, y0), "global.S": rel_rms(s1["global"].S, s0["global"].S),
           "global.z": rel_rms(s1["global"].z, s0["global"].z), "local.k": rel_rms(s1["local"].k, s0["local"].k),
           "local.v": rel_rms(s1["local"].v, s0["local"].v),
           "local.pos": 0.0 if torch.equal(s1["local"].pos, s0["local"].pos) else float("inf"),
           # both kernels ran with LINEARIZE_KERNELS=1 (gated + fused window) and none with 0
           "kernel calls": 0.0 if calls == {"0": 0, "1": 2} else float("inf")}
    for n in p0:
        err["d" + n] = rel_rms(p1[n], p0[n])
    for n, a, b in zip(("q", "k", "v", "q_rope", "k_rope", "x"), i1, i0):
        err["d" + n] = rel_rms(a, b)
    return err


# name -> (case function, kwargs, dtype); small shapes for the CPU interpreter (T not a multiple
# of the 16-token chunks, widths not powers of two, forced sequence segments)
F32, BF16 = torch.float32, torch.bfloat16
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
    "gla f32 norm plain T=1": (gla_case, dict(normalize=True, log_space=False, T=1, DK=16, DV=16, state=True), F32),
    "gla bf16 norm plain T=100 segments": (gla_case, dict(normalize=True, log_space=False, T=100, DK=16, DV=16,
                                                          seg_chunks=2, state=True), BF16),
    "window f32 sinks": (window_case, dict(T=41, D=16, DV=24, W=20, nsink=4), F32),
    "window bf16 sinks fused": (window_case, dict(T=41, D=16, DV=24, W=20, nsink=4, fuse=True), BF16),
    "window f32 no sinks padded": (window_case, dict(T=41, D=16, DV=16, W=20, nsink=0, pad=5), F32),
    "window f32 sinks fused padded w>T": (window_case, dict(T=19, D=16, DV=16, W=25, nsink=3, fuse=True, pad=4), F32),
    "window f32 w=1 bm32": (window_case, dict(T=37, D=16, DV=16, W=1, nsink=2, bm=32, bn=16), F32),
    "window f32 sinks padded kv blocks": (window_case, dict(T=75, D=16, DV=24, W=20, nsink=3, pad=5, bm=16, bn=16,
                                                            kv=dict(kv_bm=32, kv_bn=16, kv_warps=2)), F32),
    "window bf16 sinks fused kv blocks": (window_case, dict(T=75, D=16, DV=16, W=33, nsink=4, fuse=True, bm=32,
                                                            bn=16, kv=dict(kv_bm=32, kv_bn=64)), BF16),
    "hybrid f32 lizard padded": (hybrid_case, dict(padded=True), F32),
}


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
    names = sys.argv[1:] or list(INTERPRETER_CASES)
    print(json.dumps(run(names, "cpu")))
