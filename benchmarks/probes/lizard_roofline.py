"""Lizard's attention in training against its memory floor, in one run: the bytes each pass must
move, the time the GPU takes to copy as many bytes, and the time the kernels take.

    python benchmarks/probes/lizard_roofline.py --out OUT [--shape 16x2048 ...] [--rounds 5]

Inputs as the kernel bench's (``bench.kernels._shape_inputs``: bf16, 32 heads, widths 128, window
128, 4 sinks), the default kernels on Hopper (the fused training forward keeping no o_g, the
walking window backward forming D, the fused gated backward taking dy . o_g from y). ``traffic``
counts the bytes of every tensor a pass reads or writes, each once: the floor of a pass that
reads its inputs and writes its outputs once. The copy bandwidth is that of ``Tensor.copy_`` over
1 GiB on the same GPU (bytes read + written); ``floor_ms`` = bytes / that bandwidth. Times are
medians over rounds of do_bench's median (L2 flushed between calls): the training forward, the
whole step, and the backward as their difference; the inference forward too. The forward's
count of what it keeps for the backward is checked against the memory it allocates.
Writes OUT/lizard-roofline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from triton.testing import do_bench

from linearize.bench.kernels import _shape_inputs
from linearize.ops.gla import triton as kgla
from linearize.ops.lizard_attn.fused import lizard_attention
from probe_common import write_rows

NAMES = ("lq", "lk", "v", "log_g", "q", "k", "alpha", "sinks")
CHUNK = 64


def traffic(B: int, H: int, T: int, D: int = 128, F: int = 128, DV: int = 128, elem: int = 2,
            og_kept: bool = False) -> dict:
    """Bytes each pass reads and writes (each tensor once), by tensor: {pass: {"read": {name: bytes},
    "write": {...}}}. Per-token fp32 rows (log_g, lse, den, dy . o_w, d log_g) count 4 bytes a
    token; the gated states (S and z entering every chunk and leaving the last) as stored, and the
    op's final state outputs (fp32). ``og_kept``: the forward keeps o_g and the gated backward
    reads it instead of y and dy . o_w (where that backward walks in segments; the pre-pass of
    each segment after the first is not counted)."""
    tok = B * H * T
    row = lambda w: tok * w * elem  # a (B, H, T, w) tensor of the compute dtype
    f32 = tok * 4
    nst = B * H * (T // CHUNK + 1)
    states = {"S states": nst * F * DV * elem, "z states": nst * F * 4}
    final = {"final S, z (fp32)": B * H * (F * DV + F) * 4}  # the op's state outputs
    out = {
        "inference fwd": {"read": {"q_w": row(D), "k_w": row(D), "v": row(DV), "phi_q": row(F), "phi_k": row(F),
                                   "log_g": f32},
                          "write": {"y": row(DV), **final}},
        "training fwd": {"read": {"q_w": row(D), "k_w": row(D), "v": row(DV), "phi_q": row(F), "phi_k": row(F),
                                  "log_g": f32},
                         "write": {"y": row(DV), "o_w": row(DV), **states, "lse": f32, "den": f32, **final}},
        "window bwd": {"read": {"q_w": row(D), "k_w": row(D), "v": row(DV), "dy": row(DV), "o_w": row(DV),
                                "lse": f32, "dy . o_w (sums)": f32, "lse (sums)": f32},
                       "write": {"dq_w": row(D), "dk_w": row(D), "dv_w": row(DV), "dy . o_w": f32}},
        "gated bwd": {"read": {"phi_q": row(F), "phi_k": row(F), "v": row(DV), "dy": row(DV),
                               **({"o_g": row(DV)} if og_kept else {"y": row(DV), "dy . o_w": f32}),
                               "dv_w": row(DV), **states, "log_g": f32, "den": f32},
                      "write": {"dphi_q": row(F), "dphi_k": row(F), "dv": row(DV), "d log_g": f32}},
    }
    if og_kept:
        out["training fwd"]["write"]["o_g"] = row(DV)
    return out


def total(t: dict) -> int:
    return sum(sum(t[k].values()) for k in ("read", "write"))


def copy_tbps(nbytes: int = 2 ** 30, rounds: int = 5) -> float:
    """Device-to-device copy bandwidth (TB/s, bytes read + written), median over rounds."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = statistics.median(do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
                           for _ in range(rounds))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", action="append", default=None, help="BxT (repeatable; default 16x2048, 4x8192, "
                                                                    "1x32768)")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shape or ["16x2048", "4x8192", "1x32768"]]
    os.environ["LINEARIZE_KERNELS"] = "1"
    H = 32
    bw = copy_tbps(rounds=a.rounds)
    rows = [{"what": "copy bandwidth", "tbps": bw}]
    print(json.dumps(rows[-1]), flush=True)
    for B, T in shapes:
        x = _shape_inputs(B, T, H, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
        leaves = [x[n].detach().requires_grad_() for n in NAMES]

        def op():
            return lizard_attention(*leaves[:7], window=128, sink_logits=leaves[7])[0]

        def step():
            op().backward(x["dy"])

        def infer():
            with torch.no_grad():
                op()

        # what the training forward keeps (y and the intermediates), against the count
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = op()
        kept = torch.cuda.memory_allocated() - base
        del y
        ms = {"inference fwd": [], "training fwd": [], "fwd+bwd": []}
        for _ in range(a.rounds):
            ms["inference fwd"].append(do_bench(infer, warmup=10, rep=100, return_mode="median"))
            ms["training fwd"].append(do_bench(op, warmup=10, rep=100, return_mode="median"))
            ms["fwd+bwd"].append(do_bench(step, warmup=10, rep=100, grad_to_none=leaves, return_mode="median"))
        med = {k: statistics.median(v) for k, v in ms.items()}
        og_kept = kgla.fused_bwd_segments(leaves[0], leaves[1], leaves[2], False, kgla.LAUNCH) != 1
        t = traffic(B, H, T, og_kept=og_kept)
        passes = {"inference fwd": (med["inference fwd"], total(t["inference fwd"])),
                  "training fwd": (med["training fwd"], total(t["training fwd"])),
                  "bwd (step - training fwd)": (med["fwd+bwd"] - med["training fwd"],
                                                total(t["window bwd"]) + total(t["gated bwd"])),
                  "fwd+bwd": (med["fwd+bwd"], sum(total(t[k]) for k in ("training fwd", "window bwd", "gated bwd")))}
        counted = sum(v for k, v in t["training fwd"]["write"].items() if not k.startswith("final"))
        rows.append({"B": B, "T": T, "what": "training forward's kept bytes", "allocated": kept, "counted": counted,
                     "og_kept": og_kept})
        print(json.dumps(rows[-1]), flush=True)
        for name, (m, nbytes) in passes.items():
            rows.append({"B": B, "T": T, "pass": name, "median_ms": m, "gbytes": nbytes / 1e9,
                         "achieved_tbps": nbytes / (m * 1e-3) / 1e12, "floor_ms": nbytes / (bw * 1e12) * 1e3,
                         **({"ms": ms[name]} if name in ms else {})})
            print(json.dumps(rows[-1]), flush=True)
        rows.append({"B": B, "T": T, "what": "bytes by pass and tensor", "traffic": t})
        del x, leaves
        torch.cuda.empty_cache()
    write_rows(a.out, "lizard-roofline.json", "benchmarks/probes/lizard_roofline.py", rows)


if __name__ == "__main__":
    main()
