"""Lizard's inference forward on Hopper, timed several ways in one run: the whole call
(``lizard_attention`` under no_grad, as the kernel bench times it) and the fused Gluon kernel
alone (``lizard_gluon.lizard_fwd_fused``), the current kernel file beside other versions of it.

    python scripts/lizard_fwd_ab.py --out OUT [--shape 16x2048 ...] [--rounds 5] [--alt NAME=FILE ...]

The bench's inputs (``bench.kernels._shape_inputs``: bf16, 32 heads, widths 128, window 128, 4
sinks). Rounds alternate the versions; each cell is the median over rounds of do_bench's median
(L2 flushed between calls). Writes OUT/lizard-fwd-ab.json.
"""

from __future__ import annotations

import json
import statistics

import torch
from triton.testing import do_bench

from linearize.bench.kernels import _shape_inputs
from linearize.ops.lizard_attn import gluon as lizard_gluon
from linearize.ops.lizard_attn.fused import lizard_attention
from probe_common import alt_modules, probe_args, write_rows


def main() -> None:
    a = probe_args("lizard_gluon.py", ["16x2048", "4x8192"], 5)
    mods = alt_modules(lizard_gluon, a.alt)
    rows = []
    for B, T in a.shapes:
        x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
        scale = 128 ** -0.5

        def whole():
            with torch.no_grad():
                lizard_attention(x["lq"], x["lk"], x["v"], x["log_g"], x["q"], x["k"], x["alpha"], window=128,
                                 sink_logits=x["sinks"])

        def kernel(mod):
            return lambda: mod.lizard_fwd_fused(x["lq"], x["lk"], x["v"], x["log_g"], x["q"], x["k"], x["alpha"],
                                                x["sinks"], window=128, scale=scale, eps=1e-6)

        cells = {"lizard_attention (whole call)": whole, **{f"fused kernel: {n}": kernel(m) for n, m in mods.items()}}
        ms = {n: [] for n in cells}
        for _ in range(a.rounds):
            for n, fn in cells.items():
                ms[n].append(do_bench(fn, warmup=10, rep=100, return_mode="median"))
        for n in cells:
            rows.append({"B": B, "T": T, "cell": n, "median_ms": statistics.median(ms[n]), "ms": ms[n]})
            print(json.dumps(rows[-1]), flush=True)
    write_rows(a.out, "lizard-fwd-ab.json", "scripts/lizard_fwd_ab.py", rows)


if __name__ == "__main__":
    main()
