"""Probe (issue 42): the delta rule's whole chunk form on its kernels (``ops.delta.triton``'s prep,
scan and read, forward and backward: "chunk kernels") against the batched-torch chunk algebra around
the scan's kernel ("scan kernels", what ran before), for the gated delta rule and the training steps
of lizard-gdn (the shipped student's base) and liza, beside Lizard's step. One GPU, one process:

1. ``delta_rule_chunk`` forward + backward at lizard-gdn's shapes (9 heads of 64, chunks of 64, a
   decay and betas), bf16 inputs: medians of CUDA-event times both ways, and the largest output
   difference between them;
2. ``bench train``'s cells (graphed step, compiled feature maps), stage 2: lizard, then lizard-gdn
   and liza both ways.

    PYTHONPATH=src python3 benchmarks/probes/delta_compile.py --out OUT.json [--cells 8x2048 1x16384] [--skip-model] [--profile] [--sweep-warps] [--sweep-scan]

``--sweep-warps``: the op (chunk kernels) again with each chunk kernel's warps set to 2, 4, 8 and 16 in
turn, the others at their defaults (``ops.delta.triton.CHUNK_WARPS``). ``--sweep-scan``: the op again
with the scan's value columns per program (BV) and its chain's segments (G) varied (the scan walks
T / 64 chunks one after another: at one long row it is a chain of latencies on B * H * Dv / BV
programs, or on G times as many, twice, in segments).
"""

from __future__ import annotations

import torch
from probe_common import cells_parser, kernel_table, parse_shape, probe_record, timed

from linearize.ops.delta import chunk as delta_chunk
from linearize.ops.delta import delta_rule_chunk
from linearize.ops.delta import triton as delta_triton

CHUNK_KERNELS = delta_triton.delta_chunk_triton


def scan_kernels(q, k, v, beta, log_alpha, S0, chunk_size, extra_queries=None):
    """The chunk form as it ran before the chunk kernels: batched torch around the scan's kernel."""
    f32 = torch.float32
    la = None if log_alpha is None else log_alpha.to(f32)
    xq = None if extra_queries is None else extra_queries.to(f32)
    o, S, *extra = delta_chunk.chunk_form(q.to(f32), k.to(f32), v.to(f32), beta.to(f32), S0, 1,
                                          delta_chunk.kernel_chunk(chunk_size, 1), la, delta_triton.delta_scan_triton,
                                          delta_triton.unit_lower_inverse_triton, xq)
    return o.to(v.dtype), S, extra[0].to(v.dtype) if extra else None


def use(variant: str) -> None:
    delta_triton.delta_chunk_triton = scan_kernels if variant == "scan kernels" else CHUNK_KERNELS


VARIANTS = ("chunk kernels", "scan kernels")


def op_inputs(B: int, T: int) -> list[torch.Tensor]:
    """q, k, v, beta (bf16) and log alpha (fp32) at lizard-gdn's shapes (9 heads of 64), the same each call."""
    g = torch.Generator(device="cuda").manual_seed(0)
    H, D = 9, 64
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, T, D, generator=g, device="cuda"), dim=-1).bfloat16()
            for _ in range(2))
    v = torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16()
    beta = torch.rand(B, H, T, generator=g, device="cuda").bfloat16()
    return [q, k, v, beta, -torch.rand(B, H, T, generator=g, device="cuda") * 0.1]


def op_run(xs: list[torch.Tensor]):
    """One forward + backward of the gated delta rule on ``xs`` (``op_inputs``, requiring grad); the output."""
    def run():
        for x in xs:
            x.grad = None
        o, _ = delta_rule_chunk(*xs[:4], log_alpha=xs[4], chunk_size=64)
        o.float().sum().backward()
        return o.detach().float()

    return run


def op_times(B: int, T: int, rounds: int = 10, profile: bool = False) -> dict:
    inputs = op_inputs(B, T)
    out, outputs, grads = {"B": B, "T": T}, {}, {}
    for name in VARIANTS:
        use(name)
        xs = [t.clone().requires_grad_(True) for t in inputs]
        run = op_run(xs)
        outputs[name] = run()
        grads[name] = [x.grad.float() for x in xs]
        out[name] = timed(run, rounds)
        if profile:
            out[f"profile_{name}"] = kernel_table(run)
            print(out[f"profile_{name}"], flush=True)
    use("chunk kernels")
    ref = VARIANTS[1]
    out["max_abs_diff_vs_scan_kernels"] = {"o": float((outputs[VARIANTS[0]] - outputs[ref]).abs().max())}
    for n, a, b in zip(("dq", "dk", "dv", "dbeta", "dlog_alpha"), grads[VARIANTS[0]], grads[ref]):
        out["max_abs_diff_vs_scan_kernels"][n] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    return out


def warps_sweep(B: int, T: int, rounds: int = 10) -> dict:
    """The op's forward + backward (chunk kernels) with one kernel's warps changed at a time."""
    run = op_run([t.requires_grad_(True) for t in op_inputs(B, T)])
    default = dict(delta_triton.CHUNK_WARPS)
    out = {"B": B, "T": T, "default": default, "default_ms": timed(run, rounds)["fwd_bwd_ms_median"]}
    for kernel in default:
        for warps in (2, 4, 8, 16):
            delta_triton.CHUNK_WARPS[kernel] = warps
            try:
                out[f"{kernel} {warps}"] = timed(run, rounds)["fwd_bwd_ms_median"]
            except Exception as e:  # a launch that does not fit (registers, shared memory)
                out[f"{kernel} {warps}"] = f"{type(e).__name__}: {str(e)[:120]}"
            finally:
                delta_triton.CHUNK_WARPS.update(default)
    print(out, flush=True)
    return out


def scan_sweep(B: int, T: int, rounds: int = 10) -> dict:
    """The op's forward + backward (chunk kernels) with the scan's value columns per program (BV)
    and its chain's segments varied (segments that do not divide the chunks are skipped)."""
    run = op_run([t.requires_grad_(True) for t in op_inputs(B, T)])
    blocks, segments = delta_triton._blocks, delta_triton._segments
    out = {"B": B, "T": T, "default_ms": timed(run, rounds)["fwd_bwd_ms_median"]}
    NC = -(-T // 64)
    for bv in (16, 32):
        for G in (1, 2, 4, 8, 16):
            if NC % G:
                continue

            def pick(L, Dk, Dv, _bv, rows, sms, bv=bv):
                BL, BK, _, warps, stages = blocks(L, Dk, Dv, bv, rows, sms)
                return BL, BK, bv, warps, stages
            delta_triton._blocks, delta_triton._segments = pick, lambda *a, G=G: G
            try:
                run()  # compiles this variant
                out[f"bv{bv} G{G}"] = timed(run, rounds)["fwd_bwd_ms_median"]
            except Exception as e:  # a launch that does not fit (registers, shared memory)
                out[f"bv{bv} G{G}"] = f"{type(e).__name__}: {str(e)[:120]}"
            finally:
                delta_triton._blocks, delta_triton._segments = blocks, segments
    print(out, flush=True)
    return out


def model_cells(cells: list[tuple[int, int]], save) -> list[dict]:
    from linearize.bench.train import our_kernel_names, run_cell

    rows, kw = [], dict(steps=5, warmup=2, device=torch.device("cuda"), layers=None, ours=our_kernel_names())
    for B, T in cells:
        runs = [("lizard", "chunk kernels")] + [(m, v) for m in ("lizard-gdn", "liza") for v in VARIANTS]
        for method, variant in runs:
            use(variant)
            try:
                cell = run_cell("smollm2-135m-random", T, method, "stage2", "kernels", batch_size=B, graph=True, **kw)
            finally:
                use("chunk kernels")
            cell["delta_variant"] = variant
            rows.append(cell)
            save(rows)
            print({k: cell.get(k) for k in ("seq_len", "method", "delta_variant", "step_ms_median", "tokens_per_s",
                                            "status", "graph_failed")}, flush=True)
    return rows


def main() -> None:
    parser = cells_parser(["8x2048", "1x16384"], "the op's CUDA kernels, one forward + backward, each way")
    parser.add_argument("--sweep-warps", action="store_true", help="each chunk kernel's warps in turn (see above)")
    parser.add_argument("--sweep-scan", action="store_true", help="the scan's BV and segments (see above)")
    a = parser.parse_args()
    cells = [parse_shape(c) for c in a.cells]
    result, save = probe_record(a.out)
    for B, T in cells:
        result["op"].append(op_times(B, T, profile=a.profile))
        print({k: v for k, v in result["op"][-1].items() if not k.startswith("profile")}, flush=True)
        if a.sweep_warps:
            result["op"][-1]["warps"] = warps_sweep(B, T)
        if a.sweep_scan:
            result["op"][-1]["scan"] = scan_sweep(B, T)
        save()
    if not a.skip_model:
        model_cells(cells, save)


if __name__ == "__main__":
    main()
