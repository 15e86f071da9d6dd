"""The walking window backward (``window_gluon._win_bwd_walk_kernel``): its time with D from the
delta pre-pass against D formed in the kernel (``WindowKernelConfig.gluon_walk_delta``), and
where each partition's cycles go (a profiling build's clock64 counters), in one run.

    python scripts/window_walk_probe.py --out OUT [--shape 16x2048 ...] [--rounds 3] [--alt NAME=FILE ...]

On one Hopper GPU, bf16, 32 heads, widths 128, window 128, 4 sinks, alpha per head; q, k, v, dy
random, o and lse from the window's forward. Times ``window._bwd`` whole (pre-pass, kernel, sums),
median of do_bench's per-round medians, the versions alternating round by round. ``--alt`` adds
other versions of kernels/window_gluon.py (a copy of the file, edited; D in the kernel) timed in
the same run. Writes OUT/window-walk-probe.json.
"""

from __future__ import annotations

import json
from dataclasses import replace
import statistics

import torch
from triton.testing import do_bench

from linearize.ops.window_attn import triton as kwin
from linearize.ops.window_attn import gluon as window_gluon
from probe_common import alt_modules, probe_args, write_rows

PHASES = ["wait tiles", "wait slot free, load", "score MMAs", "elementwise", "accumulate MMAs", "store",
          "D (dq partition)", "other"]
VERSIONS = {"D from the pre-pass": dict(gluon_walk_delta=False), "D in the kernel": dict(gluon_walk_delta=True)}


def inputs(B: int, T: int, H: int = 32, D: int = 128, W: int = 128) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dy = (torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16() for _ in range(4))
    sinks = torch.randn(H, 4, generator=g, device="cuda")
    alpha = torch.rand(H, generator=g, device="cuda") + 0.5
    scale = D ** -0.5
    o, _, lse = kwin._fwd(q, k, v, sinks, None, None, None, W, scale, True, kwin.CONFIG)
    return dict(q=q, k=k, v=v, dy=dy, sinks=sinks, alpha=alpha, o=o, lse=lse, W=W, scale=scale)


def run(x: dict, cfg, mod=window_gluon) -> None:
    old = kwin._gluon_bwd
    kwin._gluon_bwd = lambda *a: mod  # this version of the kernel (the inputs are in its scope)
    try:
        kwin._bwd(x["q"], x["k"], x["v"], x["sinks"], None, x["o"], x["lse"], x["alpha"], x["dy"], x["W"], x["scale"],
                  cfg)
    finally:
        kwin._gluon_bwd = old


def phases(x: dict, own: bool, mod=window_gluon) -> dict:
    """Cycles per chunk in each phase of each partition (mean over programs)."""
    B, H, T, D = x["q"].shape
    nc = T // 64
    nseg = mod.walk_segments(B * H, nc, torch.cuda.get_device_properties(0).multi_processor_count)
    seg = -(-nc // nseg)
    programs = -(-nc // seg) * B * H
    prof = torch.zeros(programs * 2, 16, dtype=torch.int64, device="cuda")
    delta = torch.empty(B * H, T, device="cuda")
    if not own:  # D as the pre-pass leaves it
        delta = (x["alpha"][None, :, None] * (x["dy"].float() * x["o"].float()).sum(-1)).reshape(B * H, T)
    dq, dk, dv = (torch.empty_like(x["q"]) for _ in range(3))
    mod.bwd(x["q"], x["k"], x["v"], x["dy"], x["lse"], delta, x["alpha"], dq, dk, dv, window=x["W"],
                     scale=x["scale"], walk=True, sms=torch.cuda.get_device_properties(0).multi_processor_count,
                     o=x["o"] if own else None, prof=prof)
    torch.cuda.synchronize()
    per = (prof.double().view(programs, 2, 16)[..., :8].mean(0) / seg).tolist()
    return {part: {k: round(v) for k, v in zip(PHASES, per[i])} for i, part in enumerate(("dq", "dk dv"))}


def main() -> None:
    a = probe_args("window_gluon.py", ["16x2048", "4x8192", "1x32768"], 3)
    versions = {name: (window_gluon, kw) for name, kw in VERSIONS.items()}
    alts = alt_modules(window_gluon, a.alt)
    versions.update({name: (mod, dict(gluon_walk_delta=True)) for name, mod in alts.items() if name != "current"})
    rows = []
    for B, T in a.shapes:
        x = inputs(B, T)
        cfgs = {name: (mod, replace(kwin.CONFIG, gluon_bwd=True, gluon_bwd_walk=True, **kw))
                for name, (mod, kw) in versions.items()}
        ms = {name: [] for name in cfgs}
        for r in range(a.rounds):
            for name, (mod, cfg) in cfgs.items():
                ms[name].append(do_bench(lambda: run(x, cfg, mod), warmup=5, rep=50, return_mode="median"))
        for name, (mod, cfg) in cfgs.items():
            row = {"B": B, "T": T, "version": name, "median_ms": statistics.median(ms[name]), "ms": ms[name],
                   "cycles_per_chunk": phases(x, cfg.gluon_walk_delta, mod)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_rows(a.out, "window-walk-probe.json", "scripts/window_walk_probe.py", rows)


if __name__ == "__main__":
    main()
