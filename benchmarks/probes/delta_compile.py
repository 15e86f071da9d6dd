"""Probe (issue 42): where does the delta rule's chunk algebra (``ops.delta.chunk``'s ``chunk_prep``:
A, the chunks' inverses, W, U0, Kd; ``chunk_read``: the reads and the output; the scan between them
on its Triton kernels) spend its time, and do the inverse's kernel or torch.compile shorten the gated
delta rule and the training steps of lizard-gdn (the shipped student's base) and liza? One GPU, one
process, side by side:

1. ``delta_rule_chunk`` forward + backward at lizard-gdn's shapes (9 heads of 64, chunks of 64, a
   decay and betas), bf16 inputs: medians of CUDA-event times with the inverses on the kernel
   ("eager"), by torch's batched triangular solve ("torch inverse") and compiled, and their largest
   output difference from "eager";
2. ``bench train``'s cells (graphed step, compiled feature maps) for lizard-gdn and liza, stage 2,
   the same three ways.

    PYTHONPATH=src python3 benchmarks/probes/delta_compile.py --out OUT.json [--cells 8x2048 1x16384] [--skip-model] [--profile]
"""

from __future__ import annotations

import torch
from probe_common import cells_parser, kernel_table, parse_shape, probe_record, timed

from linearize.ops.delta import chunk as delta_chunk
from linearize.ops.delta import delta_rule_chunk
from linearize.ops.delta import triton as delta_triton

EAGER = (delta_chunk.chunk_prep, delta_chunk.chunk_read)
KERNEL_INVERSE = delta_triton.unit_lower_inverse_triton


def compiled(on: bool) -> None:
    if on:
        delta_chunk.chunk_prep = torch.compile(EAGER[0], dynamic=False)
        delta_chunk.chunk_read = torch.compile(EAGER[1], dynamic=False)
    else:
        delta_chunk.chunk_prep, delta_chunk.chunk_read = EAGER


def op_times(B: int, T: int, rounds: int = 10, profile: bool = False) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    H, D = 9, 64
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, T, D, generator=g, device="cuda"), dim=-1).bfloat16()
            for _ in range(2))
    v = torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16()
    beta = torch.rand(B, H, T, generator=g, device="cuda").bfloat16()
    log_alpha = -torch.rand(B, H, T, generator=g, device="cuda") * 0.1
    out, outputs = {"B": B, "T": T}, {}
    for name, on in (("eager", False), ("torch inverse", False), ("compiled", True)):
        compiled(on)
        delta_triton.unit_lower_inverse_triton = delta_chunk.inverse_torch if name == "torch inverse" \
            else KERNEL_INVERSE
        xs = [t.clone().requires_grad_(True) for t in (q, k, v, beta, log_alpha)]

        def run():
            o, _ = delta_rule_chunk(*xs[:4], log_alpha=xs[4], chunk_size=64)
            o.float().sum().backward()
            return o.detach().float()

        outputs[name] = run()
        out[name] = timed(run, rounds)
        if profile:
            out[f"profile_{name}"] = kernel_table(run)
            print(out[f"profile_{name}"], flush=True)
    compiled(False)
    delta_triton.unit_lower_inverse_triton = KERNEL_INVERSE
    out["max_abs_diff"] = {n: float((o - outputs["eager"]).abs().max()) for n, o in outputs.items()}
    return out


def model_cells(cells: list[tuple[int, int]], save) -> list[dict]:
    from linearize.bench.train import our_kernel_names, run_cell

    rows, kw = [], dict(steps=5, warmup=2, device=torch.device("cuda"), layers=None, ours=our_kernel_names())
    for B, T in cells:
        for method in ("lizard-gdn", "liza"):
            for variant in ("eager", "torch inverse", "compiled"):
                compiled(variant == "compiled")
                if variant == "torch inverse":
                    delta_triton.unit_lower_inverse_triton = delta_chunk.inverse_torch
                try:
                    cell = run_cell("smollm2-135m-random", T, method, "stage2", "kernels", batch_size=B, graph=True, **kw)
                finally:
                    compiled(False)
                    delta_triton.unit_lower_inverse_triton = KERNEL_INVERSE
                cell["delta_variant"] = variant
                rows.append(cell)
                save(rows)
                print({k: cell.get(k) for k in ("seq_len", "method", "delta_variant", "step_ms_median", "tokens_per_s",
                                                "status", "graph_failed")}, flush=True)
    return rows


def main() -> None:
    a = cells_parser(["8x2048", "1x16384"], "the op's CUDA kernels, one forward + backward, each way").parse_args()
    cells = [parse_shape(c) for c in a.cells]
    result, save = probe_record(a.out)
    for B, T in cells:
        result["op"].append(op_times(B, T, profile=a.profile))
        print({k: v for k, v in result["op"][-1].items() if not k.startswith("profile")}, flush=True)
        save()
    if not a.skip_model:
        model_cells(cells, save)


if __name__ == "__main__":
    main()
