"""Probe: the GLA forward (no grad) at chunk 128 and 32 and other launch settings against the default,
on one CUDA GPU in bf16 at B16 T2048 (32 heads, 128 features, v 128), plain (GLA alone) and
normalised (Lizard mode). Writes the median ms of each and its relative error against the default.

    PYTHONPATH=src python3 scripts/gla_chunk_probe.py OUT.json

Result of one H200: docs/results/kernels-h200-chunk-probe.json (every candidate lost).
"""

import dataclasses
import json
import sys

import torch
import triton

from linearize.bench.kernels import _shape_inputs
from linearize.ops.gla import triton as kgla

CANDIDATES = (dict(), dict(chunk=128, fwd_warps=8), dict(chunk=128, fwd_warps=8, fwd_stages=1),
              dict(chunk=128, fwd_warps=8, fwd_bv=32), dict(chunk=128, fwd_warps=4),
              dict(chunk=32, fwd_warps=4), dict(chunk=64, fwd_warps=4, fwd_stages=1))


def main(out: str) -> None:
    x = _shape_inputs(16, 2048, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
    rows, base = [], {}
    for mode, names, norm in (("plain", ("fq", "fk", "v", "log_g"), False),
                              ("lizard", ("lq", "lk", "v", "log_g"), True)):
        ins = [x[n] for n in names]
        for cand in CANDIDATES:
            cfg = dataclasses.replace(kgla.CONFIG, **cand)
            try:
                with torch.no_grad():
                    def forward(cfg=cfg):
                        return kgla.gla_chunk_triton(*ins, normalize=norm, config=cfg)[0]
                    o = forward().float()
                    base.setdefault(mode, o)  # the first candidate is the default config
                    err = float((o - base[mode]).norm() / base[mode].norm())
                    ms = triton.testing.do_bench(forward, warmup=25, rep=200, return_mode="median")
                row = {"mode": mode, "config": cand, "fwd_ms": round(ms, 4), "rel_err_vs_default": err}
            except Exception as e:  # a config that does not compile or run is a result too
                row = {"mode": mode, "config": cand, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
