"""``linearize bench ...``: attention kernels, generation, a training step.
Parsers and handlers only; the work is in ``linearize.bench``."""

from __future__ import annotations

from .args import (
    add_command, argtype, common_flags, finish, optional, overrides, parse_int, parse_int_list, parse_list, parse_set,
    resolved_device,
)


def cmd_bench_kernels(args) -> int:
    run = optional("linearize.bench.kernels", "run_kernel_bench", "kernel benchmark")
    run(args.out, host=args.host)
    return finish(args.out, "kernels")


def cmd_bench_generate(args) -> int:
    run = optional("linearize.bench.generate", "run_generate_bench", "generation benchmark")
    kwargs = {"models": tuple(args.model)} if args.model else {}
    if args.contexts:
        kwargs["contexts"] = tuple(args.contexts)
    run(args.out, batch_size=args.batch_size, device=resolved_device(args.device), **kwargs)
    return finish(args.out, "generate")


def cmd_bench_train(args) -> int:
    from ..bench.train import run_train_bench

    kwargs = {"models": tuple(args.model)} if args.model else {}
    if args.seq_lens:
        kwargs["seq_lens"] = tuple(args.seq_lens)
    if args.methods:
        kwargs["methods"] = tuple(args.methods)
    if args.graphs:
        bad = [g for g in args.graphs if g not in ("eager", "graph")]
        if bad:
            raise ValueError(f"--graphs takes eager, graph or both, got {', '.join(bad)}")
        kwargs["graphs"] = tuple(g == "graph" for g in args.graphs)
    run_train_bench(args.out, batch_size=args.batch_size, steps=args.steps, device=resolved_device(args.device),
                    layers=args.layers, overrides=overrides(args.set), **kwargs)
    return finish(args.out, "train")


def add_parser(sub) -> None:
    be = add_command(sub, "bench", "benchmarks: attention kernels, generation, training",
                     "Side-by-side benchmarks on a GPU; each writes NAME.json, NAME.png and NAME.md into --out.")
    besub = be.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    p = add_command(besub, "kernels", "attention kernels: SDPA, fla, our torch path, our Triton kernels",
                    "Forward and forward+backward time of softmax SDPA, fla (where installed), our torch path and our "
                    "Triton kernels over B16 T2048, B4 T8192 and B1 T32768 (32 heads, head_dim 128, bf16).",
                    "examples:\n  linearize bench kernels --out docs/results")
    p.add_argument("--host", action="store_true",
                   help="also time each cell as a CUDA graph (the GPU alone) and the host's time per call")
    common_flags(p, "runs/bench", models=False)
    p.set_defaults(func=cmd_bench_kernels)

    p = add_command(besub, "generate", "decode throughput and memory of teacher and student vs context",
                    "Decode throughput and peak memory of teacher and Lizard student from 1K to 128K context at batch 16.",
                    "examples:\n  linearize bench generate --out docs/results --model llama3-8b-random")
    p.add_argument("--model", action="append", metavar="NAME", help="model shapes to run (default: all)")
    p.add_argument("--contexts", type=argtype(parse_int_list), default=None, metavar="N,N,...",
                   help="context lengths, K = 1024 as everywhere (default: 1K..128K)")
    p.add_argument("--batch-size", type=argtype(parse_int), default=16, metavar="N", help="(default: %(default)s)")
    common_flags(p, "runs/bench", models=False)
    p.set_defaults(func=cmd_bench_generate)

    p = add_command(besub, "train", "training step of teacher and students: our kernels vs the torch path",
                    "One optimizer step of linearize train (stage 1, stage 2; bf16 autocast on CUDA) on random tokens, "
                    "timed for the teacher + LoRA and for each student stage with the attention on our kernels and on "
                    "the torch path, side by side. Weights do not change the speed: random-weight shapes serve.",
                    "examples:\n  linearize bench train --out docs/results\n"
                    "  linearize bench train --model llama3-8b-random --layers 4 --seq-lens 2K --batch-size 4")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="model shapes (default: smollm2-135m-random); see bench generate")
    p.add_argument("--methods", type=argtype(parse_list), default=None, metavar="M,M,...",
                   help="causal methods (default: lizard)")
    p.add_argument("--seq-lens", type=argtype(parse_int_list), default=None, metavar="N,N,...",
                   help="sequence lengths, K = 1024 as everywhere (default: 1K,2K)")
    p.add_argument("--batch-size", type=argtype(parse_int), default=8, metavar="N", help="(default: %(default)s)")
    p.add_argument("--steps", type=argtype(parse_int), default=10, metavar="N",
                   help="timed steps per cell, after 3 warm-up steps (default: %(default)s)")
    p.add_argument("--layers", type=argtype(parse_int), default=None, metavar="N",
                   help="keep the first N layers of each shape (default: all)")
    p.add_argument("--graphs", type=argtype(parse_list), default=None, metavar="eager,graph",
                   help="the teacher's and the kernels' steps eagerly and/or as CUDA graphs (default: both on CUDA)")
    p.add_argument("--set", action="append", type=argtype(parse_set), metavar="KEY=VALUE",
                   help="an AttentionConfig setting for every student, as in linearize train (e.g. feature_dim=128)")
    common_flags(p, "runs/bench", models=False)
    p.set_defaults(func=cmd_bench_train)

