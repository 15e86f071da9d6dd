"""Does Lizard's inference forward depend on where its inputs lie in GPU memory? The bench's
inputs are made again after a padding allocation of each size, and the whole call
(``lizard_attention`` under no_grad) is timed at each; also the five inputs' base addresses
modulo 2 MiB and their distances, to correlate. With ``--y-offsets``, instead: the inputs made
once, the fused kernel (``lizard_gluon.lizard_fwd_fused``) timed writing y into one buffer at each
offset (KiB; y stays contiguous), with y's distance from each input.

    python scripts/lizard_fwd_placement.py --out OUT [--shape 16x2048] [--pads 0,1,2,3,...] (MiB)
    python scripts/lizard_fwd_placement.py --out OUT [--shape 16x2048] --y-offsets 0,64,128,... (KiB)
    python scripts/lizard_fwd_placement.py --out OUT [--shape 16x2048] --modes [--rounds 8]

``--modes``: the inputs made once, rounds alternating four calls: the whole op (``lizard_attention``
under no_grad) as it runs, the op without its side streams (``LizardKernelConfig(overlap_fwd=False)``:
the window's state copied on the op's own stream), and the fused kernel alone with y new at each
call or in one buffer kept across calls; each round's median is kept, to see which call varies.

Writes OUT/lizard-fwd-placement.json.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from triton.testing import do_bench

from linearize.bench.kernels import _shape_inputs
from lizard_launch_overhead import fused_forward, infer
from probe_common import write_rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="16x2048")
    p.add_argument("--pads", default="0,1,2,3,5,8,13,21,34,55,89,144")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--y-offsets", default=None)
    p.add_argument("--modes", action="store_true")
    a = p.parse_args()
    B, T = (int(v) for v in a.shape.split("x"))
    if a.y_offsets is not None:
        y_offsets(a, B, T)
        return
    if a.modes:
        modes(a, B, T)
        return
    rows = []
    for pad_mib in (int(v) for v in a.pads.split(",")):
        torch.cuda.empty_cache()
        pad = torch.empty(pad_mib * 2 ** 20 + 1, dtype=torch.uint8, device="cuda")
        x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
        ms = [do_bench(lambda: infer(x), warmup=10, rep=100, return_mode="median") for _ in range(a.rounds)]
        names = ("q", "k", "v", "lq", "lk")
        base = {n: x[n].data_ptr() for n in names}
        rows.append({"B": B, "T": T, "pad_mib": pad_mib, "median_ms": statistics.median(ms), "ms": ms,
                     "base_mod_2mib": {n: base[n] % 2 ** 21 for n in names},
                     "offsets_from_q_mib": {n: (base[n] - base["q"]) / 2 ** 20 for n in names}})
        print(json.dumps(rows[-1]), flush=True)
        del x, pad
    write_rows(a.out, "lizard-fwd-placement.json", "scripts/lizard_fwd_placement.py", rows)


def modes(a, B: int, T: int) -> None:
    from linearize.ops.lizard_attn.fused import LizardKernelConfig

    x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
    kept = torch.empty_like(x["v"])
    calls = {"op": lambda: infer(x), "op, one stream": lambda: infer(x, LizardKernelConfig(overlap_fwd=False)),
             "kernel, y new": lambda: fused_forward(x), "kernel, y kept": lambda: fused_forward(x, kept)}
    ms = {k: [] for k in calls}
    for _ in range(a.rounds):
        for k, f in calls.items():
            ms[k].append(do_bench(f, warmup=10, rep=100, return_mode="median"))
    rows = [{"B": B, "T": T, "call": k, "median_ms": statistics.median(v), "ms": v} for k, v in ms.items()]
    for r in rows:
        print(json.dumps(r), flush=True)
    write_rows(a.out, "lizard-fwd-modes.json", "scripts/lizard_fwd_placement.py", rows)


def y_offsets(a, B: int, T: int) -> None:
    x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
    offs = [int(v) for v in a.y_offsets.split(",")]
    n = x["v"].numel()
    buf = torch.empty(n + (max(offs) * 1024) // 2 + 1, dtype=torch.bfloat16, device="cuda")
    names = ("q", "k", "v", "lq", "lk")
    rows = []
    for off in offs:
        y = buf[off * 512: off * 512 + n].view(x["v"].shape)  # (512 bf16 = 1 KiB)
        ms = [do_bench(lambda: fused_forward(x, y), warmup=10, rep=100, return_mode="median") for _ in range(a.rounds)]
        rows.append({"B": B, "T": T, "y_offset_kib": off, "median_ms": statistics.median(ms), "ms": ms,
                     "y_mod_2mib_kib": (y.data_ptr() % 2 ** 21) / 1024,
                     "y_minus_input_mib": {k: (y.data_ptr() - x[k].data_ptr()) / 2 ** 20 for k in names}})
        print(json.dumps(rows[-1]), flush=True)
    write_rows(a.out, "lizard-fwd-y-offsets.json", "scripts/lizard_fwd_placement.py", rows)


if __name__ == "__main__":
    main()
