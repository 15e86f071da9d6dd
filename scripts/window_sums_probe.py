"""The window backward's partial sums of d alpha and d sink_logits (``window._win_bwd_delta_kernel``
from the dy . o rows the walking kernel leaves, then ``_win_head_sums_kernel``) at several block
lengths and warp counts, side by side: median ms of the two kernels (do_bench), and the sums'
largest difference from the default's.

    python scripts/window_sums_probe.py --out OUT [--shape 16x2048 ...] [--rounds 5]

Writes OUT/window-sums.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from triton.testing import do_bench

from linearize.ops.window_attn import triton as kwin
from probe_common import write_rows

H, NSINK = 32, 4
VARIANTS = [(1024, 4), (2048, 4), (2048, 8), (4096, 8)]  # (rows a program, warps); the first is the default


def sums(delta, lse, sinks, alpha, B: int, T: int, BM: int, warps: int):
    nmb = -(-T // BM)
    BS = kwin.pow2(NSINK)
    dsink = torch.empty(B * H, nmb, BS, device="cuda")
    dalpha = torch.empty(B * H, nmb, device="cuda")
    kwin._win_bwd_delta_kernel[(nmb, B * H)](delta, delta, lse, sinks, alpha, delta, dsink, dalpha, T, H, NSINK, nmb,
                                             DV=128, BDV=128, BM=BM, BS=BS, HAS_SINK=True, HAS_ALPHA=True,
                                             FROM_O=False, num_warps=warps)
    return kwin._sink_alpha_grads(dsink, dalpha, sinks, alpha, B, H, nmb, NSINK, BS)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", action="append", default=None)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    rows = []
    for B, T in [tuple(int(v) for v in s.split("x")) for s in a.shape or ["16x2048", "1x32768"]]:
        g = torch.Generator(device="cuda").manual_seed(0)
        delta = torch.randn(B * H, T, generator=g, device="cuda")
        lse = torch.randn(B * H, T, generator=g, device="cuda") + 5
        sinks, alpha = torch.randn(H, NSINK, generator=g, device="cuda"), torch.rand(H, generator=g, device="cuda")
        ref = sums(delta, lse, sinks, alpha, B, T, *VARIANTS[0])
        times = {v: [] for v in VARIANTS}
        for _ in range(a.rounds):
            for v in VARIANTS:
                times[v].append(do_bench(lambda v=v: sums(delta, lse, sinks, alpha, B, T, *v), warmup=25, rep=100,
                                         return_mode="median"))
        for v in VARIANTS:
            got = sums(delta, lse, sinks, alpha, B, T, *v)
            diff = max((x - y).abs().max().item() / y.abs().max().item() for x, y in zip(got, ref))
            rows.append(dict(B=B, T=T, rows=v[0], warps=v[1], median_ms=statistics.median(times[v]), ms=times[v],
                             rel_diff_vs_default=diff))
            print(rows[-1], flush=True)
    print(write_rows(a.out, "window-sums.json", "scripts/window_sums_probe.py", rows))


if __name__ == "__main__":
    main()
