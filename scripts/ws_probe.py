"""Warp-specialised (Triton autoWS on Hopper) kernel variants against the current kernels, one
process per variant, on the GPU.

    python3 scripts/ws_probe.py OUT.json [--shapes 16x2048,1x32768] [--window-configs bm:bn:stages,...]

Whichever ``linearize`` is on PYTHONPATH is timed (the repository's kernels, or a variant tree);
the variant's own switches come from the environment (recorded in the output). Cells: the window
branch with the Lizard combine (``window_attn_triton`` with y_global and alpha), the gated op
normalised (Lizard's) and plain (fla simple_gla's inputs), and the whole Lizard attention in both
forward orders; median ms of do_bench (L2 flushed), forward under no_grad and forward+backward.
Correctness: every method's output and gradients at B2 H4 T1024 (B1 H2 T192 with --device cpu,
under TRITON_INTERPRET=1, and no timing) against the torch path of the
same package (kernels off), as the largest relative error over the tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="16x2048,1x32768")
    ap.add_argument("--window-configs", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip", default="", help="comma-separated cell names to leave out")
    a = ap.parse_args(argv)
    import linearize
    from linearize.bench.kernels import _cell, _fwd_bwd, _shape_inputs, _with_kernels
    from linearize.ops.window_attn import triton as kwin
    from linearize.ops.gla.triton import gla_chunk_triton
    from linearize.ops.lizard_attn.fused import LizardKernelConfig, lizard_attention
    from linearize.ops.gla.chunk import gla_chunk
    from linearize.ops.window_attn.chunk import window_attn_chunk

    res = {"gpu": torch.cuda.get_device_name() if a.device == "cuda" else a.device, "torch": torch.__version__,
           "command": " ".join(sys.argv), "package": os.path.dirname(linearize.__file__),
           "LINEARIZE_WS": os.environ.get("LINEARIZE_WS"),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": [], "check": {}}
    skip = set(filter(None, a.skip.split(",")))

    def methods(x):
        def lv(*names):
            return [x[n].detach().requires_grad_() for n in names]
        wq, wk, wv, yg = lv("q", "k", "v", "dy")
        wa, ws = lv("alpha", "sinks")
        lq, lk, gv, lg = lv("lq", "lk", "v", "log_g")
        fq, fk, fv, fg = lv("fq", "fk", "v", "log_g")
        zq, zk, zv, zwq, zwk, zg, za, zs = lv("lq", "lk", "v", "q", "k", "log_g", "alpha", "sinks")
        out = {
            "window fused": (lambda: kwin.window_attn_triton(wq, wk, wv, window=128, sink_logits=ws, y_global=yg,
                                                             alpha=wa)[0], [wq, wk, wv, yg, wa, ws]),
            "gla norm": (lambda: gla_chunk_triton(lq, lk, gv, lg, normalize=True)[0], [lq, lk, gv, lg]),
            "gla plain": (lambda: gla_chunk_triton(fq, fk, fv, fg, normalize=False)[0], [fq, fk, fv, fg]),
        }
        for name, first in (("lizard gated-first", False), ("lizard auto", None)):
            cfg = LizardKernelConfig(window_first=first)
            out[name] = (lambda cfg=cfg: lizard_attention(zq, zk, zv, zg, zwq, zwk, za, window=128, sink_logits=zs,
                                                          config=cfg)[0], [zq, zk, zv, zg, zwq, zwk, za, zs])
        return {k: v for k, v in out.items() if k not in skip}

    # correctness against the torch path of the same package
    small = (2, 1024) if a.device == "cuda" else (1, 192)
    x = _shape_inputs(*small, 4 if a.device == "cuda" else 2, 128, 128, 4, torch.bfloat16, torch.device(a.device), 1)
    refs = {
        "window fused": lambda wq, wk, wv, yg, wa, ws: yg + wa[:, None, None] * window_attn_chunk(
            wq, wk, wv, window=128, sink_logits=ws)[0],
        "gla norm": lambda q, k, v, g: gla_chunk(q, k, v, g, normalize=True)[0],
        "gla plain": lambda q, k, v, g: gla_chunk(q, k, v, g, normalize=False)[0],
    }
    for name, (fn, leaves) in methods(x).items():
        try:
            y = fn()
            gs = torch.autograd.grad(y.float().mul(x["dy"].float()).sum(), leaves, allow_unused=True)
            ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
            if name in refs:
                yr = refs[name](*ref_leaves)
            else:
                yr = _with_kernels("0", lambda: lizard_attention(
                    *ref_leaves[:7], window=128, sink_logits=ref_leaves[7])[0])()
            grs = torch.autograd.grad(yr.float().mul(x["dy"].float()).sum(), ref_leaves, allow_unused=True)
            errs = [_rel(y, yr)] + [_rel(g, r) for g, r in zip(gs, grs) if g is not None and r is not None]
            res["check"][name] = errs
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is recorded
            res["check"][name] = f"{type(e).__name__}: {e}"[:400]
        print("check", name, res["check"][name], flush=True)

    if a.device != "cuda":
        print(json.dumps(res["check"]))
        return
    wcfgs = [None] + [tuple(int(v) for v in c.split(":")) for c in a.window_configs.split(",") if c]
    for s in a.shapes.split(","):
        B, T = (int(v) for v in s.split("x"))
        x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device(a.device), 0)
        ms = methods(x)
        for name, (fn, leaves) in ms.items():
            for wc in wcfgs if name.startswith("window") else [None]:
                old = kwin.set_config(bm=wc[0], bn=wc[1], fwd_stages=wc[2], bwd_stages=wc[2]) if wc else None
                row = {"B": B, "T": T, "method": name, "window_config": wc}
                try:
                    with torch.no_grad():
                        row["fwd"] = _cell(fn, 10)
                    row["fwd+bwd"] = _cell(_fwd_bwd(fn, x["dy"]), 10, grad_to_none=leaves)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                if old is not None:
                    kwin.CONFIG = old
                res["rows"].append(row)
                print(B, T, name, wc, row.get("fwd", {}).get("median_ms"), row.get("fwd+bwd", {}).get("median_ms"),
                      row.get("error", ""), flush=True)
        del x, ms
        torch.cuda.empty_cache()
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
