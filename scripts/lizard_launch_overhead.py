"""How long Lizard's attention keeps the CPU busy per call, beside how long it keeps the GPU busy.

    python scripts/lizard_launch_overhead.py --out OUT [--shape 16x2048 ...] [--calls 20] [--rounds 5]
        [--config NAME=FIELD=VALUE[;FIELD=VALUE] ...]

A benchmark that starts each call on an idle GPU (do_bench: the cache flush before each call
gives the CPU a head start of about its length) counts every microsecond of Python the call
spends before its main kernel is queued. Here the GPU is first held busy (``torch.cuda._sleep``)
so that ``--calls`` calls are only queued, and the CPU time per call is the wall time of queueing
them; the GPU time is do_bench's median, and again for the call captured once as a CUDA graph
and replayed (the same GPU work with no host code between its kernels). Calls: the whole op in
inference (no_grad), the op's training step (forward with autograd and backward), and the fused
forward kernel alone (``lizard_gluon.lizard_fwd_fused``). Bench inputs
(``bench.kernels._shape_inputs``).
Writes OUT/lizard-launch-overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Optional

import torch
from triton.testing import do_bench

from linearize.bench.kernels import _graph_replay, _host_us, _shape_inputs
from linearize.ops.lizard_attn import gluon as lizard_gluon
from linearize.ops.lizard_attn.fused import lizard_attention
from lizard_train_ab import _variant
from probe_common import write_rows

NAMES = ("lq", "lk", "v", "log_g", "q", "k", "alpha", "sinks")


def cpu_us(fn, calls: int) -> float:
    """Microseconds of CPU per call of fn, queued behind a GPU kept busy (so none of them waits): the
    bench's ``_host_us`` after a warm-up call, the GPU held about a second at the H100's clock."""
    fn()
    return _host_us(fn, calls=calls, sleep_cycles=2_000_000_000)


def infer(x: dict, config=None) -> None:
    """The op in inference (no_grad) on the bench's inputs ``x``."""
    with torch.no_grad():
        lizard_attention(*[x[n] for n in NAMES[:7]], window=128, sink_logits=x["sinks"], config=config)


def fused_forward(x: dict, out=None) -> None:
    """The fused forward kernel alone (``lizard_gluon.lizard_fwd_fused``) on the bench's inputs,
    y into ``out`` if given."""
    lizard_gluon.lizard_fwd_fused(*[x[n] for n in NAMES[:7]], x["sinks"], window=128, scale=128 ** -0.5, eps=1e-6,
                                  out=out)


def lizard_calls(B: int, T: int, configs: Optional[dict] = None) -> dict:
    """name -> a call of Lizard's attention on the bench's inputs at (B, T): the op in inference,
    its training step (grads cleared after; one per LizardKernelConfig of ``configs``, by name,
    else the defaults'), the fused forward kernel alone."""
    x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
    leaves = [x[n].detach().requires_grad_() for n in NAMES]

    def train(config=None, op_kw=None):
        lizard_attention(*leaves[:7], window=128, sink_logits=leaves[7], config=config,
                         **(op_kw or {}))[0].backward(x["dy"])
        for t in leaves:
            t.grad = None

    calls = {"op, inference": lambda: infer(x)}
    for name, (cfg, op_kw) in (configs or {"": (None, None)}).items():
        calls["op, training step" + (f" ({name})" if name else "")] = lambda cfg=cfg, kw=op_kw: train(cfg, kw)
    calls["fused forward kernel"] = lambda: fused_forward(x)
    return calls


def config_args(specs: list[str]) -> Optional[dict]:
    """--config NAME=FIELD=VALUE[;FIELD=VALUE] ... (LizardKernelConfig's fields, or ``op.`` keywords of
    lizard_attention, parsed as lizard_train_ab.py's --variant) -> {NAME: (LizardKernelConfig, keywords)},
    or None if none."""
    out = {}
    for spec in specs:
        name, (cfg, gla_changes, window_changes, op_kw) = _variant(spec)
        if gla_changes or window_changes:
            raise SystemExit(f"--config takes LizardKernelConfig fields and op. keywords only, got {spec!r}")
        out[name] = (cfg, op_kw)
    return out or None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", action="append", default=None, help="BxT (repeatable; default 16x2048, 4x8192)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--config", action="append", default=[],
                   help="NAME=FIELD=VALUE[;...]: a training step under that LizardKernelConfig (repeatable)")
    a = p.parse_args()
    os.environ["LINEARIZE_KERNELS"] = "1"
    rows = []
    for B, T in [tuple(int(v) for v in s.split("x")) for s in a.shape or ["16x2048", "4x8192"]]:
        calls = lizard_calls(B, T, config_args(a.config))
        for name, fn in calls.items():
            cpu = [cpu_us(fn, a.calls) for _ in range(a.rounds)]
            gpu = [do_bench(fn, warmup=10, rep=100, return_mode="median") for _ in range(a.rounds)]
            row = {"B": B, "T": T, "call": name, "cpu_us_per_call": statistics.median(cpu), "cpu_us": cpu,
                   "do_bench_ms": statistics.median(gpu), "do_bench": gpu}
            try:  # the same GPU work without the host: replayed as one CUDA graph
                replay = _graph_replay(fn)
                g = [do_bench(replay, warmup=10, rep=100, return_mode="median") for _ in range(a.rounds)]
                row.update(graph_ms=statistics.median(g), graph=g)
            except Exception as e:  # (a capture refused: say why, keep the rest)
                row["graph_error"] = f"{type(e).__name__}: {e}"[:500]
                torch.cuda.synchronize()
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
        del calls
        torch.cuda.empty_cache()
    write_rows(a.out, "lizard-launch-overhead.json", "scripts/lizard_launch_overhead.py", rows)


if __name__ == "__main__":
    main()
