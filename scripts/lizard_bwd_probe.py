"""Where Lizard's backward spends its time, each pass alone (issue 6's training targets).

    python scripts/lizard_bwd_probe.py --out OUT [--shapes 16x2048,1x32768] [--rounds 3]

On one GPU, at the bench's settings (bf16, 32 heads, widths 128, window 128, 4 sinks): the window's
backward (the Triton dq + dk/dv passes against the Gluon kernel, and the Gluon path's two launches
alone), the gated backward's reverse state pass and its chunk pass (Triton against Gluon), and the
whole op's forward + backward on one stream and two. Medians of ``do_bench`` (ms), ``--rounds``
rounds alternating the variants. Writes OUT/lizard-bwd-probe.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch
from triton.testing import do_bench

from linearize.bench.kernels import _env, _shape_inputs
from linearize.ops.gla import triton as kgla
from linearize.ops.lizard_attn import fused as kliz
from linearize.ops.window_attn import triton as kwin
from linearize.ops.window_attn import gluon as window_gluon

KERNELS = ["gla/triton.py", "gla/gluon.py", "window_attn/triton.py", "window_attn/gluon.py", "lizard_attn/fused.py",
           "lizard_attn/gluon.py"]


def _variants(B: int, T: int) -> dict:
    x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
    q, k, v, fq, fk, lg, alpha, sinks, dy = (x[n] for n in ("q", "k", "v", "lq", "lk", "log_g", "alpha", "sinks", "dy"))
    scale = 128 ** -0.5
    W = 128
    o, _, lse = kwin._fwd(q, k, v, sinks, None, None, None, W, scale, True, kwin.CONFIG)
    win_triton = replace(kwin.CONFIG, gluon_bwd=False)
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    nmb = T // 64
    delta = torch.empty(B * 32, T, device="cuda")
    dsink = torch.empty(B * 32, nmb, 4, device="cuda")
    dalpha = torch.empty(B * 32, nmb, device="cuda")

    def delta_pass():
        kwin._win_bwd_delta_kernel[(nmb, B * 32)](o, dy, lse, sinks, alpha, delta, dsink, dalpha, T, 32, 4, nmb,
                                                  DV=128, BDV=128, BM=64, BS=4, HAS_SINK=True, HAS_ALPHA=True,
                                                  num_warps=4)

    delta_pass()

    gcfg = kgla.CONFIG
    o_g, den, S_T, z_T, segs, sc, zc = kgla._fwd(fq, fk, v, lg, None, None, True, False, 1e-6, gcfg, True)
    states = lambda: kgla.bwd_states(fq, fk, v, lg, o_g, den, sc, zc, dy, None, None, False, True, False, 1e-6,  # noqa
                                     segs, gcfg)
    p = states()
    gla_triton = replace(gcfg, gluon_bwd=False)

    leaves = [t.detach().requires_grad_() for t in (fq, fk, v, lg, q, k, alpha, sinks)]

    def lizard(cfg):
        def run():
            for t in leaves:
                t.grad = None
            y = kliz.lizard_attention(*leaves[:7], window=W, sink_logits=leaves[7], config=cfg)[0]
            y.backward(dy)
        return run

    return {
        "window bwd, triton passes": lambda: kwin._bwd(q, k, v, sinks, None, o, lse, alpha, dy, W, scale, win_triton),
        "window bwd, gluon path": lambda: kwin._bwd(q, k, v, sinks, None, o, lse, alpha, dy, W, scale, kwin.CONFIG),
        "window bwd, delta pre-pass alone": delta_pass,
        "window bwd, gluon kernel alone": lambda: window_gluon.bwd(q, k, v, dy, lse, delta, alpha, dq, dk, dv,
                                                                   window=W, scale=scale),
        "gla bwd, reverse state pass (normalised)": states,
        "gla bwd, chunk pass triton": lambda: kgla.bwd_chunks(fq, fk, v, lg, p, True, False, 1e-6, gla_triton),
        "gla bwd, chunk pass gluon": lambda: kgla.bwd_chunks(fq, fk, v, lg, p, True, False, 1e-6, gcfg),
        "lizard fwd+bwd, two streams": lizard(kliz.LizardKernelConfig()),
        "lizard fwd+bwd, one stream": lizard(kliz.LizardKernelConfig(overlap_bwd=False)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="16x2048,1x32768")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    src = Path(kgla.__file__).parent.parent  # linearize/ops
    res = {"env": _env("python scripts/lizard_bwd_probe.py " + f"--shapes {a.shapes} --rounds {a.rounds}"),
           "kernel_sha256": {n: hashlib.sha256((src / n).read_bytes()).hexdigest()[:16] for n in KERNELS},
           "shapes": {}}
    for shape in a.shapes.split(","):
        B, T = (int(s) for s in shape.split("x"))
        fns = _variants(B, T)
        times: dict = {n: [] for n in fns}
        for _ in range(a.rounds):
            for n, fn in fns.items():
                times[n].append(do_bench(fn, warmup=25, rep=200, return_mode="median"))
        res["shapes"][shape] = {n: {"median_ms": round(statistics.median(t), 4), "rounds": [round(x, 4) for x in t]}
                                for n, t in times.items()}
        for n, r in res["shapes"][shape].items():
            print(f"B{B} T{T}  {n:45s} {r['median_ms']:.3f}  {r['rounds']}", flush=True)
        del fns
        torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "lizard-bwd-probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
