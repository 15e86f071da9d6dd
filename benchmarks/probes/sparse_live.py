"""The sparse window's live form (every span at once) against its span loop, on one GPU, in one process.

1. The op, forward + backward: the span loop, the live form on its Triton kernels and on batched torch
   (with --compiled, under torch.compile too), at lizard-recall's settings (window 128, 256 cached pairs read with
   their own q and k, 4 sink logits, 9 heads of 64): medians of CUDA-event times, and the largest
   difference between the two forms' outputs.
2. lizard-recall's training step as ``linearize train`` runs it (``bench train``'s cells: CUDA graph,
   compiled feature maps), stage 1 and stage 2, with the live form on its Triton kernels, on batched
   torch, and with the span loop, beside lizard-gdn (no cache) and the teacher + LoRA.

    python benchmarks/probes/sparse_live.py --out OUT.json [--cells 8x2048 4x4096] [--skip-model] [--profile] [--compiled]
        [--alt NAME=FILE]   (another ops/sparse_window/triton.py, e.g. an earlier commit's, timed as "live C64 NAME")
    python benchmarks/probes/sparse_live.py --out OUT.json --cells 8x2048 2x8192 1x16384 --selection
        (the selection's kernels alone: where the scan, in one piece or in segments, overtakes counting all pairs)
"""

from __future__ import annotations

import torch
from probe_common import alt_modules, cells_parser, kernel_table, parse_shape, probe_record, timed

from linearize.ops.sparse_window import chunk, live, sparse_window_attn_chunk
from linearize.ops.sparse_window import triton as sparse_triton

H, D, W, M, SINKS = 9, 64, 128, 256, 4


def op_times(B: int, T: int, rounds: int = 10, profile: bool = False, compiled: bool = False,
             alts: dict | None = None) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = lambda: torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16()  # noqa: E731
    leaves = [x() for _ in range(5)] + [torch.zeros(H, SINKS, device="cuda")]
    score = torch.rand(B, H, T, device="cuda", generator=g)
    out = {"B": B, "T": T}
    outputs = {}
    eager, compiled = live.live_attend, torch.compile(live.live_attend, dynamic=False)
    forms = [("spans C256", "spans", 256), ("live C64", "live", 64), ("live C128", "live", 128),
             ("live C64 torch", "live", 64), ("live C128 torch", "live", 128)]
    kernel_switch, kernels = chunk.live_kernel_applies, sparse_triton.sparse_live_triton
    alts = {n: m for n, m in (alts or {}).items() if n != "current"}
    for name, form, C in (forms + ([("live C64 compiled", "live", 64)] if compiled else [])
                          + [(f"live C64 {n}", "live", 64) for n in alts]):
        sparse_triton.sparse_live_triton = alts[name[9:]].sparse_live_triton if name[9:] in alts else kernels
        xs = [t.clone().requires_grad_(True) for t in leaves]
        chunk.live_attend = compiled if name.endswith("compiled") else eager
        torch_only = name.endswith("torch") or name.endswith("compiled")
        chunk.live_kernel_applies = (lambda *a: False) if torch_only else kernel_switch

        def run():
            q, k, v, cq, lk, sinks = xs
            o, _ = sparse_window_attn_chunk(q, k, v, score, window=W, cache_size=M, sink_logits=sinks,
                                            cache_q=cq, leave_k=lk, chunk_size=C, form=form)
            o.float().sum().backward()
            return o

        outputs[name] = run().float()
        out[name] = timed(run, rounds)
        if name == "live C64" and profile:
            out["profile_live"] = kernel_table(run)
            print(out["profile_live"], flush=True)
    chunk.live_attend, chunk.live_kernel_applies, sparse_triton.sparse_live_triton = eager, kernel_switch, kernels
    ref = outputs["spans C256"]
    out["max_abs_diff_vs_spans"] = {n: float((o.detach() - ref.detach()).abs().max()) for n, o in outputs.items()}
    return out


def model_cells(cells: list[tuple[int, int]], save, forms: tuple[str, ...]) -> list[dict]:
    from linearize.bench.train import our_kernel_names, run_cell

    ours, dev, rows = our_kernel_names(), torch.device("cuda"), []
    forms_of = lambda method: forms if method == "lizard-recall" else ("-",)  # noqa: E731
    kw = dict(steps=5, warmup=2, device=dev, layers=None, ours=ours)
    real, kernel_switch = chunk.on_gpu, chunk.live_kernel_applies
    for B, T in cells:
        rows.append(run_cell("smollm2-135m-random", T, "lizard", "teacher", "kernels", batch_size=B, **kw))
        save(rows)
        for method in ("lizard-gdn", "lizard-recall"):
            for stage in ("stage1", "stage2"):
                forms = forms_of(method)
                for form in forms:
                    chunk.on_gpu = real if form != "spans" else (lambda x: False)
                    chunk.live_kernel_applies = kernel_switch if form == "live" else (lambda *a: False)
                    try:
                        cell = run_cell("smollm2-135m-random", T, method, stage, "kernels", batch_size=B,
                                        graph=True, **kw)
                    finally:
                        chunk.on_gpu, chunk.live_kernel_applies = real, kernel_switch
                    cell["sparse_form"] = form
                    rows.append(cell)
                    save(rows)  # a call cut short keeps the cells done
                    print({k: cell.get(k) for k in ("seq_len", "method", "stage", "sparse_form", "step_ms_median",
                                                    "tokens_per_s", "peak_allocated_bytes", "status")}, flush=True)
    return rows


def selection_times(B: int, T: int, rounds: int = 10) -> dict:
    """The selection alone (``cache_until_triton``): every pair against every pair (O(P^2)), the
    scan (O(P (M + 128)), one program per batch*head) and the scan in the segments it picks, the
    same j_s asserted; CUDA-event medians."""
    g = torch.Generator(device="cuda").manual_seed(0)
    P = T - W
    score = torch.rand(B, H, P, device="cuda", generator=g)
    candidate = torch.ones(B, P, dtype=torch.bool, device="cuda")
    out, results = {"B": B, "T": T, "P": P}, {}
    for name, scan, segments in (("all pairs", False, None), ("scan", True, 1), ("scan in segments", True, None)):
        run = lambda scan=scan, segments=segments: sparse_triton.cache_until_triton(  # noqa: E731
            score, candidate, M, scan=scan, segments=segments)
        results[name] = run()
        out[name] = timed(run, rounds)["fwd_bwd_ms_median"]
    out["segments"] = sparse_triton._selection_segments(P, B * H, torch.cuda.get_device_properties(0).multi_processor_count)
    out["equal"] = all(torch.equal(results["all pairs"], r) for r in results.values())
    print(out, flush=True)
    return out


def main() -> None:
    p = cells_parser(["8x2048", "4x4096"], "the live form's CUDA kernels, one forward + backward")
    p.add_argument("--forms", nargs="+", default=["live", "live-torch", "spans"],
                   help="lizard-recall's step on the live form's kernels, its batched torch, the span loop")
    p.add_argument("--compiled", action="store_true",
                   help="also the live form under torch.compile (its backward crashed inductor's CPU code once)")
    p.add_argument("--alt", action="append", default=[], help="NAME=FILE: another ops/sparse_window/triton.py")
    p.add_argument("--selection", action="store_true",
                   help="only the selection's two kernels (all pairs vs scan) at the cells, then stop")
    a = p.parse_args()
    alts = alt_modules(sparse_triton, a.alt)
    cells = [parse_shape(c) for c in a.cells]
    result, save = probe_record(a.out)
    if a.selection:
        result["selection"] = [selection_times(B, T) for B, T in cells]
        save()
        return
    for B, T in cells:
        result["op"].append(op_times(B, T, profile=a.profile, compiled=a.compiled, alts=alts))
        print({k: v for k, v in result["op"][-1].items() if k != "profile_live"}, flush=True)
        save()
    if not a.skip_model:
        save(model_cells(cells, save, tuple(a.forms)))


if __name__ == "__main__":
    main()
