"""Lizard attention on the GPU: the orders and stream overlaps of ``kernels.lizard.LizardKernelConfig``
side by side, in one run.

    python3 scripts/lizard_order_probe.py OUT.json [--shapes 16x2048,4x8192,1x32768]
        [--configs window_first:overlap_fwd:overlap_bwd:side_priority,...]   (window_first "a": auto;
        a config "two": one_op=False, the two autograd ops of the code before 805d262)

For each shape, the inputs of ``linearize bench kernels`` (bf16, 32 heads, head dim 128, 128 Hedgehog
features, window 128, 4 sink logits); each cell is the median ms of do_bench (L2 flushed), forward
under torch.no_grad and forward+backward, for the first config first and last (two figures for
the baseline) and each other config between; every output is compared with the first config's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="16x2048,4x8192,1x32768")
    ap.add_argument("--configs", default="two,0:0:0:-1,0:1:1:-1,1:1:1:-1,a:1:1:-1")
    a = ap.parse_args(argv)
    from linearize.bench.kernels import _cell, _fwd_bwd, _shape_inputs
    from linearize.ops.lizard_attn.fused import LizardKernelConfig, lizard_attention

    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    configs = []
    for c in a.configs.split(","):
        if c == "two":
            configs.append(LizardKernelConfig(one_op=False))
            continue
        first, ofwd, obwd, prio = c.split(":")
        configs.append(LizardKernelConfig(window_first=None if first == "a" else bool(int(first)),
                                          overlap_fwd=bool(int(ofwd)), overlap_bwd=bool(int(obwd)),
                                          side_priority=int(prio)))
    configs.append(configs[0])
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": []}
    for B, T in shapes:
        x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
        leaves = [x[n].detach().requires_grad_() for n in ("lq", "lk", "v", "q", "k", "log_g", "alpha", "sinks")]
        lq, lk, lv, wq, wk, lg, la, ls = leaves
        ref = None
        for cfg in configs:
            def fwd(cfg=cfg):
                return lizard_attention(lq, lk, lv, lg, wq, wk, la, window=128, sink_logits=ls, config=cfg)[0]
            row = {"B": B, "T": T, "config": cfg.__dict__.copy()}
            try:
                with torch.no_grad():
                    y = fwd().float()
                    if ref is None:
                        ref = y
                    row["rel_rms_vs_first"] = ((y - ref).norm() / ref.norm()).item()
                    row["fwd"] = _cell(fwd, 10)
                row["fwd+bwd"] = _cell(_fwd_bwd(fwd, x["dy"]), 10, grad_to_none=leaves)
            except Exception as e:  # a config that fails to compile or run is recorded
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            res["rows"].append(row)
            f = row.get("fwd", {}).get("median_ms"), row.get("fwd+bwd", {}).get("median_ms")
            print(B, T, cfg, f, row.get("rel_rms_vs_first"), row.get("error", ""), flush=True)
        del x, leaves
        torch.cuda.empty_cache()
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
