"""Lizard's attention in training (forward with autograd, then backward) on the GPU under several
``KernelSettings`` variants, side by side in one run: time, the training forward alone, peak
memory, and each gradient's error against our torch path in fp32.

    python benchmarks/probes/lizard_train_ab.py --out OUT [--shape 16x2048 ...] [--rounds 5]
        [--variant NAME=FIELD=VALUE[;FIELD=VALUE] ...] [--check-batch 2] [--op lizard|gla]

``--op gla``: gated linear attention alone instead, as the kernel bench times it
(``gla_chunk_triton``, unnormalised plain features; no error check).

A variant's fields are ``KernelSettings``' (passed to that variant's op), or, prefixed
``op.``, keywords of ``lizard_attention`` itself (``op.return_state=False``: a step that keeps no state). Default
variants: the defaults, and ``og kept`` (og_from_y=False: the forward stores o_g). The
bench's inputs (``bench.kernels._shape_inputs``: bf16, 32 heads, widths 128, window 128, 4 sinks).
Rounds alternate the variants; each time is the median over rounds of do_bench's median (L2
flushed between calls). Errors: relative RMS of every gradient against the torch path on the
same inputs in fp32, at the first shape's T with ``--check-batch`` rows. Writes
OUT/lizard-train-ab.json.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import statistics

import torch
from triton.testing import do_bench

from linearize.bench.kernels import _shape_inputs
from linearize.ops.gla import triton as kgla
from linearize.ops.backend import KernelSettings
from linearize.ops.lizard_attn.fused import lizard_attention
from probe_common import write_rows

NAMES = ("lq", "lk", "v", "log_g", "q", "k", "alpha", "sinks")


def _variant(spec: str) -> tuple[str, tuple]:
    """NAME=FIELD=VALUE;... -> (NAME, (KernelSettings, lizard_attention's keywords)); a field prefixed
    ``op.`` is a keyword of the op itself (e.g. ``op.return_state=False``)."""
    name, sep, fields = spec.partition("=")
    if not sep:
        raise SystemExit(f"--variant takes NAME=FIELD=VALUE[;FIELD=VALUE], got {spec!r}")
    kw, op_kw = {}, {}
    for f in filter(None, fields.split(";")):
        k, _, v = f.partition("=")
        if k.startswith("op."):
            op_kw[k[3:]] = ast.literal_eval(v)
        else:
            kw[k] = ast.literal_eval(v)
    return name, (KernelSettings(**kw), op_kw)


def _run(cfg: tuple, leaves: list, op: str = "lizard"):
    settings, op_kw = cfg  # an op keeps its forward's settings for its backward
    if op == "gla":
        return kgla.gla_chunk_triton(*leaves, normalize=False, log_space_features=False, settings=settings)[0]
    return lizard_attention(*leaves[:7], window=128, sink_logits=leaves[7], settings=settings, **op_kw)[0]


def _leaves(x: dict, dtype=None, names=NAMES) -> list:
    return [(x[n] if dtype is None or n in ("log_g", "alpha", "sinks") else x[n].to(dtype)).detach()
            .requires_grad_() for n in names]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", action="append", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variant", action="append", default=None)
    p.add_argument("--check-batch", type=int, default=2)
    p.add_argument("--op", choices=("lizard", "gla"), default="lizard")
    a = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shape or ["16x2048", "4x8192"]]
    variants = dict(_variant(s) for s in a.variant or ["default=", "og kept=og_from_y=False"])
    os.environ["LINEARIZE_KERNELS"] = "1"
    dev = torch.device("cuda")
    rows = []
    for B, T in shapes:
        x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, dev, 0)
        leaves = _leaves(x, names=("fq", "fk", "v", "log_g") if a.op == "gla" else NAMES)

        def train(cfg):
            def step():
                _run(cfg, leaves, a.op).backward(x["dy"])
            return step

        def fwd_only(cfg):
            return lambda: _run(cfg, leaves, a.op)

        ms = {(n, k): [] for n in variants for k in ("fwd+bwd", "training fwd")}
        for _ in range(a.rounds):
            for n, cfg in variants.items():
                ms[(n, "fwd+bwd")].append(do_bench(train(cfg), warmup=10, rep=100, grad_to_none=leaves,
                                                   return_mode="median"))
                ms[(n, "training fwd")].append(do_bench(fwd_only(cfg), warmup=10, rep=100, return_mode="median"))
        for n, cfg in variants.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            train(cfg)()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            for k in ("fwd+bwd", "training fwd"):
                rows.append({"op": a.op, "B": B, "T": T, "variant": n, "pass": k,
                             "median_ms": statistics.median(ms[(n, k)]),
                             "ms": ms[(n, k)], **({"peak_extra_mib": peak} if k == "fwd+bwd" else {})})
                print(json.dumps(rows[-1]), flush=True)
        del x, leaves
        torch.cuda.empty_cache()

    if a.op == "gla" or a.check_batch < 1:
        write_rows(a.out, "lizard-train-ab.json", "benchmarks/probes/lizard_train_ab.py", rows)
        return
    B, T = a.check_batch, shapes[0][1]
    x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, dev, 1)
    ref = _leaves(x, torch.float32)
    os.environ["LINEARIZE_KERNELS"] = "0"
    _run((KernelSettings(), {}), ref).backward(x["dy"].float())
    os.environ["LINEARIZE_KERNELS"] = "1"
    for n, cfg in variants.items():
        leaves = _leaves(x)
        _run(cfg, leaves).backward(x["dy"])
        err = {f"d{name}": ((g.grad.float() - r.grad).norm() / r.grad.norm()).item()
               for name, g, r in zip(NAMES, leaves, ref)}
        rows.append({"B": B, "T": T, "variant": n, "pass": "grad rel RMS vs torch fp32", **err})
        print(json.dumps(rows[-1]), flush=True)
    write_rows(a.out, "lizard-train-ab.json", "benchmarks/probes/lizard_train_ab.py", rows)


if __name__ == "__main__":
    main()
