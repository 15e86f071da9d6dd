"""Probe (issue 42): LoLCATs' band kernels (``ops.lolcats_attn.triton``) against the chunk form's batched
torch, forward + backward of ``lolcats_attn_chunk`` at SmolLM2's shapes (9 heads of 64, Hedgehog
features of 128, window 64, chunks of 64; bf16 inputs, fp32 compute), one GPU, side by side: the torch
path, and the kernels at each precision of their fp32 products (``FP32_PRECISION``) and warp count.
Medians of CUDA-event times, and each one's largest output difference from the torch path.

    PYTHONPATH=src python3 benchmarks/probes/lolcats_band.py --out OUT.json [--cells 8x2048 1x16384] [--profile]

``--profile``: the CUDA kernels of one forward + backward of the default (the kernels at the shipped
precision and warps) and of the torch path.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from probe_common import kernel_table, timed

from linearize.ops.lolcats_attn import chunk as lolcats_chunk
from linearize.ops.lolcats_attn import triton as lolcats_triton

APPLIES = lolcats_chunk.band_kernel_applies
DEFAULT = (lolcats_triton.FP32_PRECISION, dict(lolcats_triton.LAUNCH))
VARIANTS = [("torch", None, None)] + [(f"{prec} w{nw}", prec, nw) for prec in ("ieee", "tf32x3", "tf32")
                                        for nw in (4, 8)]


def use(prec, warps) -> None:
    if prec is None:
        lolcats_chunk.band_kernel_applies = lambda *a, **k: False
        return
    lolcats_chunk.band_kernel_applies = APPLIES
    lolcats_triton.FP32_PRECISION = prec
    lolcats_triton.LAUNCH = dict(num_warps=warps, num_stages=1)


def cell(B: int, T: int, rounds: int, profile: bool = False) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    H, D, F, W = 9, 64, 128, 64
    x = lambda d: torch.randn(B, H, T, d, generator=g, device="cuda").bfloat16()  # noqa: E731
    q, k, v = x(D), x(D), x(D)
    fq, fk = (torch.softmax(x(F).float(), -1).bfloat16() for _ in range(2))
    factor = torch.full((H,), 0.5, device="cuda")
    out, ref = {"B": B, "T": T}, None
    for name, prec, warps in VARIANTS:
        use(prec, warps)
        xs = [t.clone().requires_grad_(True) for t in (q, k, v, fq, fk, factor)]

        def run():
            o, _ = lolcats_chunk.lolcats_attn_chunk(*xs, window=W, chunk_size=64)
            o.float().sum().backward()
            return o.detach().float()

        try:
            o = run()
            out[name] = timed(run, rounds)
            ref = o if ref is None else ref
            out[name]["max_abs_diff_vs_torch"] = float((o - ref).abs().max())
            if profile and (prec is None or (prec, warps) == (DEFAULT[0], DEFAULT[1]["num_warps"])):
                out[name]["profile"] = kernel_table(run)
                print(out[name]["profile"], flush=True)
        except Exception as e:  # noqa: BLE001 (a variant that fails to compile is a result too)
            out[name] = {"error": repr(e)[:300]}
        print(name, {k: v for k, v in out[name].items() if k not in ("ms", "profile")}, flush=True)
    lolcats_chunk.band_kernel_applies = APPLIES
    lolcats_triton.FP32_PRECISION, lolcats_triton.LAUNCH = DEFAULT[0], dict(DEFAULT[1])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cells", nargs="+", default=["8x2048"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    rows = [cell(*(int(v) for v in c.split("x")), a.rounds, a.profile) for c in a.cells]
    Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
