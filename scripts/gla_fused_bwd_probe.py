"""Where the fused gated backward (``gla_gluon.bwd_fused``) waits: cycles per chunk in each phase of
its two partitions, from a profiling build (clock64 between marks), beside its time.

    python scripts/gla_fused_bwd_probe.py --out OUT [--shape 16x2048] [--alt NAME=FILE ...]

On one Hopper GPU, bf16, 32 heads, widths 128, one segment per (batch x head): GLA's case
(unnormalised, nothing to add into dv) and Lizard's (normalised, adding into the window's dv).
The inputs are random (the kernel's time does not depend on their values). ``--alt`` adds other
versions of kernels/gla_gluon.py (a copy of the file, edited) timed in the same run, rounds
alternating between versions. Writes OUT/gla-fused-bwd-probe.json.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from linearize.ops.gla import gluon as gla_gluon
from probe_common import alt_modules, write_rows

# the partitions' phases (see the kernel's NPROF counters)
PHASES = {"chunk": ["wait tiles", "wait o", "wait dS", "wait dv", "wait S", "work dphi_k", "work dphi_q, dlog_g",
                    "work dd (dn, dd before 2026-11-26b)"],
          "state": ["wait dS copy read", "wait S (unused since b2ebf19)",
                    "wait S slot", "wait tiles, dv to add", "wait dd", "work dv",
                    "work dS copy", "work dS update, <dS, S>"]}


def inputs(B: int, T: int, H: int = 32, D: int = 128) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    NC = T // 64

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    return dict(q=rnd(B, H, T, D).abs(), k=rnd(B, H, T, D).abs(), v=rnd(B, H, T, D), o=rnd(B, H, T, D),
                log_g=F.logsigmoid(rnd(B, H, T, dtype=torch.float32) + 4),
                den=rnd(B * H, T, dtype=torch.float32).abs() + 1,
                sc=rnd(B * H, NC + 1, D, D), zc=rnd(B * H, NC + 1, D, dtype=torch.float32).abs(), do=rnd(B, H, T, D),
                dq=rnd(B, H, T, D), dk=rnd(B, H, T, D), dv=rnd(B, H, T, D),
                dlog_g=torch.zeros(B * H, T, device="cuda"), NC=NC)


def run(x: dict, normalize: bool, dv_add: bool, prof=None, mod=gla_gluon) -> None:
    mod.bwd_fused(x["q"], x["k"], x["v"], x["log_g"], x["o"], x["den"], x["sc"], x["zc"], x["do"], None, None,
                        x["dq"], x["dk"], x["dv"], x["dlog_g"], None, None, seg_chunks=x["NC"], normalize=normalize,
                        eps=1e-6, dv_add=dv_add, prof=prof)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="16x2048")
    p.add_argument("--alt", action="append", default=[], help="NAME=FILE: another gla_gluon.py to time beside")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    B, T = (int(v) for v in a.shape.split("x"))
    mods = alt_modules(gla_gluon, a.alt)
    x = inputs(B, T)
    rows = []
    for case, normalize, dv_add in (("gla", False, False), ("lizard", True, True)):
        ms = {name: [] for name in mods}
        for r in range(a.rounds):
            for name, mod in mods.items():
                print(f"{case} {name} round {r}", flush=True)
                ms[name].append(do_bench(lambda: run(x, normalize, dv_add, mod=mod), warmup=5, rep=50))
        for name, mod in mods.items():
            print(f"{case} {name} profile", flush=True)
            width = getattr(mod, "PROF_WIDTH", 16)  # (16: one state partition, in earlier versions)
            prof = torch.zeros(B * 32, width, dtype=torch.int64, device="cuda")
            run(x, normalize, dv_add, prof, mod=mod)
            torch.cuda.synchronize()
            per = (prof.double().mean(0) / x["NC"]).tolist()
            row = {"case": case, "version": name, "B": B, "T": T, "median_ms": statistics.median(ms[name]),
                   "ms": ms[name],
                   "cycles_per_chunk": {"chunk": {k: round(v) for k, v in zip(PHASES["chunk"], per[:8]) if k != "-"},
                                        **{f"state {h}" if width > 16 else "state":
                                           {k: round(v) for k, v in zip(PHASES["state"], per[8 + 8 * h:16 + 8 * h])}
                                           for h in range((width - 8) // 8)}}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_rows(a.out, "gla-fused-bwd-probe.json", "scripts/gla_fused_bwd_probe.py", rows)


if __name__ == "__main__":
    main()
