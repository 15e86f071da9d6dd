"""Where the host time of Lizard's training step goes, piece by piece: each piece queued ``--calls``
times behind a GPU held busy (``lizard_launch_overhead.cpu_us``), so that the wall time is host
work only. Pieces: the training step (forward with autograd, backward), the forward alone, the
window's backward and the gated one alone (on one forward's intermediates), the fused forward
kernel alone, one plain torch kernel, one small Triton kernel launch, stream forks and joins and
a trivial autograd backward, for scale; and the training step by stage (the forward, the
backward() call, the op's own backward function inside it), with the defaults and without the
backward's side stream (LizardKernelConfig.overlap_bwd=False).

    python scripts/lizard_host_split.py --out OUT [--shape 16x2048] [--calls 20] [--rounds 5]

Writes OUT/lizard-host-split.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from lizard_bwd_split_probe import _backward_inputs, _gated, _plan, _window
from lizard_launch_overhead import NAMES, cpu_us, fused_forward
from linearize.bench.kernels import _shape_inputs
from linearize.ops.window_attn import triton as kwin
from linearize.ops.lizard_attn.fused import lizard_attention
from probe_common import host_probe_parser, parse_shape, write_rows


def _step_breakdown(leaves: list, dy: torch.Tensor, calls: int, rounds: int, config=None, name: str = "") -> dict:
    """The training step's host time by stage, queued behind a sleeping GPU: the forward call, the
    backward() call and, inside it, the op's own backward function, the gradients cleared, the
    graph freed. Medians over rounds of the mean microseconds per step."""
    from linearize.ops.lizard_attn import fused as kliz

    inside = []
    run = kliz._LizardFunction.backward

    def timed(ctx, *grads):
        t0 = time.perf_counter()
        out = run(ctx, *grads)
        inside.append(time.perf_counter() - t0)
        return out

    kliz._LizardFunction.backward = staticmethod(timed)
    try:
        stages = {k: [] for k in ("forward", "backward() call", "op's backward function", "grads cleared",
                                  "graph freed", "whole step")}
        for _ in range(rounds + 1):
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)
            acc = dict.fromkeys(stages, 0.0)
            inside.clear()
            for _ in range(calls):
                t0 = time.perf_counter()
                y = lizard_attention(*leaves[:7], window=128, sink_logits=leaves[7], config=config)[0]
                t1 = time.perf_counter()
                y.backward(dy)
                t2 = time.perf_counter()
                for t in leaves:
                    t.grad = None
                t3 = time.perf_counter()
                del y
                t4 = time.perf_counter()
                for k, d in zip(stages, (t1 - t0, t2 - t1, 0.0, t3 - t2, t4 - t3, t4 - t0)):
                    acc[k] += d
            acc["op's backward function"] = sum(inside)
            torch.cuda.synchronize()
            for k in stages:
                stages[k].append(acc[k] / calls * 1e6)
        return dict(piece="training step by stage" + (f" ({name})" if name else ""), **{k: statistics.median(v[1:]) for k, v in stages.items()})
    finally:
        kliz._LizardFunction.backward = staticmethod(run)


def main() -> None:
    a = host_probe_parser(calls=20).parse_args()
    os.environ["LINEARIZE_KERNELS"] = "1"
    B, T = parse_shape(a.shape)
    x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
    leaves = [x[n].detach().requires_grad_() for n in NAMES]
    bwd = _backward_inputs(B, T)
    small = torch.zeros(1024, device="cuda")
    sums = bwd["lse"].new_empty(B * 32, 2, 4)

    def step():
        lizard_attention(*leaves[:7], window=128, sink_logits=leaves[7])[0].backward(x["dy"])
        for t in leaves:
            t.grad = None

    def forward():
        lizard_attention(*leaves[:7], window=128, sink_logits=leaves[7])

    xs = torch.zeros(1024, device="cuda", requires_grad=True)

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    def no_threads(fn):
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                fn()
        return run

    def trivial_backward():
        xs.mul(2).sum().backward()
        xs.grad = None

    def function_backward():
        Identity.apply(xs).sum().backward()
        xs.grad = None

    main_s, side_s = torch.cuda.current_stream(), torch.cuda.Stream()
    e1, e2 = torch.cuda.Event(), torch.cuda.Event()

    def fork_join_new():
        side_s.wait_stream(main_s)
        main_s.wait_stream(side_s)

    def fork_join_cached():
        e1.record(main_s)
        side_s.wait_event(e1)
        e2.record(side_s)
        main_s.wait_event(e2)

    def stream_context():
        with torch.cuda.stream(side_s):
            pass

    pieces = {
        "stream fork and join, new events (wait_stream)": fork_join_new,
        "stream fork and join, two events made once": fork_join_cached,
        "one event made once, recorded": lambda: e1.record(main_s),
        "torch.cuda.stream(side) entered and left": stream_context,
        "training step": step,
        "training step, autograd multithreading off": no_threads(step),
        "a trivial backward (x * 2).sum()": trivial_backward,
        "a trivial backward, multithreading off": no_threads(trivial_backward),
        "a Python autograd.Function's backward": function_backward,
        "training forward": forward,
        "window backward (kwin._bwd)": lambda: _window(bwd),
        "gated backward (bwd_states, bwd_chunks)": lambda: _gated(bwd, _plan(bwd), _window(bwd)),
        "fused forward kernel alone": lambda: fused_forward(x),
        "one torch kernel (add_)": lambda: small.add_(1),
        "one small Triton kernel (head sums)": lambda: kwin._sink_alpha_grads(sums, sums[:, :, 0], bwd["sinks"],
                                                                            bwd["alpha"], B, 32, 2, 4, 4),
    }
    from linearize.ops.lizard_attn.fused import LizardKernelConfig

    rows = []
    for name, cfg in (("defaults", None), ("overlap_bwd=False", LizardKernelConfig(overlap_bwd=False))):
        rows.append(_step_breakdown(leaves, x["dy"], a.calls, a.rounds, cfg, name))
        print(json.dumps(rows[-1]), flush=True)
    for name, fn in pieces.items():
        us = [cpu_us(fn, a.calls) for _ in range(a.rounds)]
        rows.append(dict(B=B, T=T, piece=name, cpu_us_median=statistics.median(us), cpu_us=us))
        print(json.dumps(rows[-1]), flush=True)
    print("(the gated backward's row includes a window backward: subtract that row)")
    write_rows(a.out, "lizard-host-split.json", "scripts/lizard_host_split.py", rows)


if __name__ == "__main__":
    main()
