"""One Lizard training step (forward with autograd, then backward) for Nsight Compute to profile.

The step runs twice first (compiling every kernel), then once between cudaProfilerStart/Stop, so
that ``ncu --profile-from-start off`` sees exactly one launch of each kernel. The bench's inputs
(``bench.kernels._shape_inputs``: bf16, 32 heads, widths 128, window 128, 4 sinks). For example
(on the GPU machine; ``benchmarks/probes/ncu_lizard.sh`` runs this and writes the reports):

    ncu --clock-control none --profile-from-start off --set full \\
        -k regex:'_lizard_fwd_kernel|_gla_bwd_fused_kernel|_win_bwd_walk_kernel' \\
        -o OUT/step python benchmarks/probes/ncu_lizard_step.py --shape 16x2048
"""

from __future__ import annotations

import argparse

import torch

from linearize.bench.kernels import _shape_inputs
from linearize.ops.lizard_attn.fused import lizard_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="16x2048", help="BxT")
    a = p.parse_args()
    B, T = (int(s) for s in a.shape.split("x"))
    x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
    leaves = [x[n].detach().requires_grad_() for n in ("lq", "lk", "v", "log_g", "q", "k", "alpha", "sinks")]
    lq, lk, v, lg, q, k, alpha, sinks = leaves

    def step():
        y = lizard_attention(lq, lk, v, lg, q, k, alpha, window=128, sink_logits=sinks)[0]
        y.backward(x["dy"])
        for t in leaves:
            t.grad = None

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
