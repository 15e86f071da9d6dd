"""``linearize eval ...`` and ``linearize bench ...``: the measurement commands.

Each writes NAME.json, NAME.png (drawn from the JSON) and NAME.md into ``--out`` and prints the
Markdown summary. Parsers and handlers only; the work is in ``linearize.eval`` and
``linearize.bench``.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from .cli import DEVICE_HELP, _argtype, _sub, parse_device, parse_int, parse_list

MODEL_HELP = ("a linearize checkpoint directory, a bundled teacher (smollm2-135m) or a local HF model "
              "directory; repeat to compare several side by side")


def parse_int_list(text) -> list[int]:
    """``1024,2048,4K`` -> [1024, 2048, 4096]: positive integers, suffixes as in ``parse_int``."""
    values = []
    for part in str(text).split(","):
        try:
            n = parse_int(part)
        except ValueError:
            raise ValueError(f"expected comma-separated token counts such as 1024,2048,4K, got {text!r}") from None
        if n <= 0:
            raise ValueError(f"token counts must be positive, got {part.strip()!r} in {text!r}")
        values.append(n)
    return values


def parse_layers(text) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers takes comma-separated layer indices such as 0,14,29, got {text!r}") from None


def _device(args) -> str:
    from .train.loop import resolve_device

    return str(resolve_device(args.device))


def _check_models(args) -> None:
    """Every --model named, checked before an evaluation imports its heavy modules, so a mistyped
    path fails at once rather than after the first model's evaluation."""
    from .models.loading import check_model_name

    for name in args.model:
        check_model_name(name)


def _finish(out: Path, stem: str) -> int:
    md = Path(out) / f"{stem}.md"
    print(md.read_text())
    print(f"wrote {out}/{stem}.json, {stem}.png, {stem}.md")
    return 0


def cmd_eval_passkey(args) -> int:
    _check_models(args)
    from .eval.passkey import run_passkey

    run_passkey(args.model, args.out, fmt=args.format, lengths=args.lengths, depths=args.depths,
                samples=args.samples, seed=args.seed, train_length=args.train_length,
                max_new_tokens=args.max_new_tokens, device=_device(args))
    return _finish(args.out, "passkey")


def cmd_eval_ppl(args) -> int:
    _check_models(args)
    from .eval.perplexity import run_ppl

    run_ppl(args.model, args.data, args.out, max_tokens=args.max_tokens, window=args.window, stride=args.stride,
            text_field=args.text_field, device=_device(args))
    return _finish(args.out, "ppl")


def cmd_eval_report(args) -> int:
    if len(args.model) != 1:
        raise ValueError(f"eval report takes one linearized checkpoint (--model DIR), got {len(args.model)}")
    _check_models(args)
    from .eval.report import run_report

    run_report(args.model[0], args.data, args.out, rows=args.rows, seq_len=args.seq_len, layers=args.layers,
               heads=args.heads, map_tokens=args.map_tokens, device=_device(args), text_field=args.text_field)
    return _finish(args.out, "report")


def cmd_eval_lm_eval(args) -> int:
    _check_models(args)
    run = _optional("linearize.eval.lm_eval_run", "run_lm_eval", "lm-eval", "pip install 'linearize[eval]'")
    run(args.model, args.tasks, args.data_dir, args.out, limit=args.limit, device=_device(args),
        batch_size=args.batch_size, num_fewshot=args.num_fewshot)
    return _finish(args.out, "lm_eval")


def cmd_eval_embed(args) -> int:
    if len(args.model) != 1:
        raise ValueError(f"eval embed takes one LION checkpoint (--model DIR), got {len(args.model)}")
    _check_models(args)
    from .eval.embed import run_embed_eval

    kwargs = {"lengths": tuple(args.lengths)} if args.lengths else {}
    run_embed_eval(args.model[0], args.data, args.out, sentences=args.sentences, timing=not args.no_timing,
                   device=_device(args), **kwargs)
    return _finish(args.out, "embed")


def cmd_bench_kernels(args) -> int:
    run = _optional("linearize.bench.kernels", "run_kernel_bench", "kernel benchmark")
    run(args.out, host=args.host)
    return _finish(args.out, "kernels")


def cmd_bench_generate(args) -> int:
    run = _optional("linearize.bench.generate", "run_generate_bench", "generation benchmark")
    kwargs = {"models": tuple(args.model)} if args.model else {}
    if args.contexts:
        kwargs["contexts"] = tuple(args.contexts)
    run(args.out, batch_size=args.batch_size, device=_device(args), **kwargs)
    return _finish(args.out, "generate")


def cmd_bench_train(args) -> int:
    from .bench.train import run_train_bench

    kwargs = {"models": tuple(args.model)} if args.model else {}
    if args.seq_lens:
        kwargs["seq_lens"] = tuple(args.seq_lens)
    if args.methods:
        kwargs["methods"] = tuple(args.methods)
    run_train_bench(args.out, batch_size=args.batch_size, steps=args.steps, device=_device(args), layers=args.layers,
                    **kwargs)
    return _finish(args.out, "train")


def _optional(module: str, name: str, what: str, hint: str = ""):
    """A function from a module that needs an optional dependency, with a clear error if it is missing."""
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module or not e.name.startswith("linearize")):
            raise ValueError(f"the {what} needs {e.name!r}, which is not installed" + (f" ({hint})" if hint else "")) \
                from None
        raise


def _common(p: argparse.ArgumentParser, out: str, models: bool = True) -> None:
    if models:
        p.add_argument("--model", required=True, action="append", metavar="DIR_OR_NAME", help=MODEL_HELP)
    p.add_argument("--out", default=out, metavar="DIR", help="output directory (default: %(default)s)")
    p.add_argument("--device", type=_argtype(parse_device), default="auto", metavar="DEVICE", help=DEVICE_HELP)


def add_eval_parser(sub) -> None:
    ev = _sub(sub, "eval", "evaluate teachers and students: passkey, perplexity, lm-eval, transfer report",
              "Evaluate models side by side. Each command writes NAME.json, NAME.png (drawn from the JSON) and "
              "NAME.md into --out and prints the Markdown table.")
    evsub = ev.add_subparsers(dest="eval_command", metavar="EVAL", required=True)

    p = _sub(evsub, "passkey", "passkey retrieval over context lengths x depths, as heatmaps",
             "Greedy passkey retrieval, exact match, over a grid of context lengths by depth of the asked key. "
             "classic: one 5-digit pass key in repeated filler (zero-shot). lizard: five passkeys of 5-8 words, one "
             "asked; fine-tune on it first (linearize train --data passkey:LENGTH) and pass --train-length.",
             """\
             examples:
               linearize eval passkey --model smollm2-135m --model runs/lizard --lengths 1K,2K,4K,8K,16K,32K
               linearize eval passkey --format lizard --model runs/teacher-ft --model runs/lizard-ft \\
                   --train-length 2048 --lengths 2K,4K,8K --depths 5 --samples 10""")
    _common(p, "runs/eval")
    p.add_argument("--format", choices=("classic", "lizard"), default="classic", help="(default: %(default)s)")
    p.add_argument("--lengths", type=_argtype(parse_int_list), default=[1024, 2048, 4096, 8192, 16384, 32768],
                   metavar="N,N,...", help="context lengths in tokens, K = 1024 as everywhere (default: 1K..32K)")
    p.add_argument("--depths", type=_argtype(parse_int), default=5, metavar="N",
                   help="depths from 0%% to 100%% (default: %(default)s)")
    p.add_argument("--samples", type=_argtype(parse_int), default=5, metavar="N",
                   help="examples per (length, depth) cell (default: %(default)s)")
    p.add_argument("--train-length", type=_argtype(parse_int), default=None, metavar="N",
                   help="the length the models were fine-tuned at, marked on the heatmaps")
    p.add_argument("--max-new-tokens", type=_argtype(parse_int), default=None, metavar="N",
                   help="tokens generated per answer (default: 8 classic, 32 lizard)")
    p.add_argument("--seed", type=_argtype(parse_int), default=0, metavar="N", help="(default: %(default)s)")
    p.set_defaults(func=cmd_eval_passkey)

    p = _sub(evsub, "ppl", "perplexity on any text source",
             "Perplexity on the same token stream for every model: linearized models read it in one pass carrying "
             "their state; softmax models in sliding windows of their context (--window, --stride).",
             """\
             examples:
               linearize eval ppl --model smollm2-135m --model runs/lizard --data ../shared/data/wiki_demo.txt
               linearize eval ppl --model runs/lizard --data notes/ --max-tokens 32K""")
    _common(p, "runs/eval")
    p.add_argument("--data", required=True, metavar="PATH",
                   help="a JSON/JSONL/text file or folder, 'shakespeare', or a HF dataset name")
    p.add_argument("--text-field", default=None, metavar="NAME", help="the text field of JSON/JSONL records")
    p.add_argument("--max-tokens", type=_argtype(parse_int), default=16384, metavar="N",
                   help="tokens of text to score (default: %(default)s)")
    p.add_argument("--window", type=_argtype(parse_int), default=None, metavar="N",
                   help="softmax models: window length (default: the model's context)")
    p.add_argument("--stride", type=_argtype(parse_int), default=None, metavar="N",
                   help="softmax models: window step (default: half the window)")
    p.set_defaults(func=cmd_eval_ppl)

    p = _sub(evsub, "lm-eval", "the papers' lm-eval tasks from local files",
             "Run PIQA, ARC-Easy, ARC-Challenge, HellaSwag, WinoGrande and 5-shot MMLU through lm-eval, reading the "
             "data from --data-dir (the layout of ../shared/data/evaldev: piqa.jsonl, arc_easy.jsonl, "
             "arc_challenge.jsonl, hellaswag.jsonl, winogrande.jsonl, mmlu/dev/*.csv, mmlu/val/*.csv).",
             """\
             examples:
               linearize eval lm-eval --model smollm2-135m --model runs/lizard --data-dir ../shared/data/evaldev \\
                   --tasks piqa,arc_easy,arc_challenge,hellaswag,winogrande,mmlu --limit 100""")
    _common(p, "runs/eval")
    p.add_argument("--tasks", type=_argtype(parse_list), default=None, metavar="T,T,...",
                   help="piqa, arc_easy, arc_challenge, hellaswag, winogrande, mmlu, comma-separated, or all "
                        "(default: all)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="the folder holding the task files (default: $LINEARIZE_EVAL_DATA)")
    p.add_argument("--limit", type=_argtype(parse_int), default=None, metavar="N",
                   help="at most N examples per task, per subject for MMLU (default: all)")
    p.add_argument("--num-fewshot", type=_argtype(parse_int), default=None, metavar="N",
                   help="override the tasks' shots (default: 0, MMLU 5)")
    p.add_argument("--batch-size", type=_argtype(parse_int), default=8, metavar="N", help="(default: %(default)s)")
    p.set_defaults(func=cmd_eval_lm_eval)

    p = _sub(evsub, "report", "attention-transfer report: per-layer MSE and attention maps",
             "For a linearized checkpoint on held-out text: each layer's attention MSE against the teacher's "
             "softmax (trained and untrained conversion) and teacher vs student attention weights for a few heads.",
             """\
             examples:
               linearize eval report --model runs/lizard --data ../shared/data/wiki_demo.txt --layers 0,14,29""")
    _common(p, "runs/eval")
    p.add_argument("--data", required=True, metavar="PATH", help="held-out text (as for train --data)")
    p.add_argument("--text-field", default=None, metavar="NAME", help="the text field of JSON/JSONL records")
    p.add_argument("--rows", type=_argtype(parse_int), default=8, metavar="N", help="(default: %(default)s)")
    p.add_argument("--seq-len", type=_argtype(parse_int), default=256, metavar="N", help="(default: %(default)s)")
    p.add_argument("--layers", type=_argtype(parse_layers), default=None, metavar="I,J,...",
                   help="layers whose attention maps to draw (default: first, middle, last)")
    p.add_argument("--heads", type=_argtype(parse_int), default=2, metavar="N",
                   help="heads per layer to draw (default: %(default)s)")
    p.add_argument("--map-tokens", type=_argtype(parse_int), default=64, metavar="N",
                   help="tokens shown in the attention maps (default: %(default)s)")
    p.set_defaults(func=cmd_eval_report)

    p = _sub(evsub, "embed", "LION encoders: embedding agreement with the teacher, and attention cost",
             "For a LION encoder checkpoint (linearize train --method lion-s --model minilm-l6 ...): cosine similarity "
             "between teacher and student sentence embeddings and nearest-neighbour agreement on held-out sentences, "
             "beside the same figures for the untrained conversion; and the time and extra memory of each LION form "
             "against SDPA softmax from 512 to 32K tokens.",
             """\
             examples:
               linearize eval embed --model runs/lion-minilm --data ../shared/data/wiki_demo.txt --sentences 500""")
    _common(p, "runs/eval")
    p.add_argument("--data", required=True, metavar="PATH", help="local text (held-out sentences are taken from it)")
    p.add_argument("--sentences", type=_argtype(parse_int), default=1000, metavar="N", help="(default: %(default)s)")
    p.add_argument("--lengths", type=_argtype(parse_int_list), default=None, metavar="N,N,...",
                   help="sequence lengths for the timing table, K = 1024 as everywhere (default: 512..32K)")
    p.add_argument("--no-timing", action="store_true", help="skip the attention timing table")
    p.set_defaults(func=cmd_eval_embed)


def add_bench_parser(sub) -> None:
    be = _sub(sub, "bench", "benchmarks: attention kernels, generation, training",
              "Side-by-side benchmarks on a GPU; each writes NAME.json, NAME.png and NAME.md into --out.")
    besub = be.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    p = _sub(besub, "kernels", "attention kernels: SDPA, fla, our torch path, our Triton kernels",
             "Forward and forward+backward time of softmax SDPA, fla (where installed), our torch path and our "
             "Triton kernels over B16 T2048, B4 T8192 and B1 T32768 (32 heads, head_dim 128, bf16).",
             "examples:\n  linearize bench kernels --out docs/results")
    p.add_argument("--host", action="store_true",
                   help="also time each cell as a CUDA graph (the GPU alone) and the host's time per call")
    _common(p, "runs/bench", models=False)
    p.set_defaults(func=cmd_bench_kernels)

    p = _sub(besub, "generate", "decode throughput and memory of teacher and student vs context",
             "Decode throughput and peak memory of teacher and Lizard student from 1K to 128K context at batch 16.",
             "examples:\n  linearize bench generate --out docs/results --model llama3-8b-random")
    p.add_argument("--model", action="append", metavar="NAME", help="model shapes to run (default: all)")
    p.add_argument("--contexts", type=_argtype(parse_int_list), default=None, metavar="N,N,...",
                   help="context lengths, K = 1024 as everywhere (default: 1K..128K)")
    p.add_argument("--batch-size", type=_argtype(parse_int), default=16, metavar="N", help="(default: %(default)s)")
    _common(p, "runs/bench", models=False)
    p.set_defaults(func=cmd_bench_generate)

    p = _sub(besub, "train", "training step of teacher and students: our kernels vs the torch path",
             "One optimizer step of linearize train (stage 1, stage 2; bf16 autocast on CUDA) on random tokens, "
             "timed for the teacher + LoRA and for each student stage with the attention on our kernels and on "
             "the torch path, side by side. Weights do not change the speed: random-weight shapes serve.",
             "examples:\n  linearize bench train --out docs/results\n"
             "  linearize bench train --model llama3-8b-random --layers 4 --seq-lens 2K --batch-size 4")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="model shapes (default: smollm2-135m-random); see bench generate")
    p.add_argument("--methods", type=_argtype(parse_list), default=None, metavar="M,M,...",
                   help="causal methods (default: lizard)")
    p.add_argument("--seq-lens", type=_argtype(parse_int_list), default=None, metavar="N,N,...",
                   help="sequence lengths, K = 1024 as everywhere (default: 1K,2K)")
    p.add_argument("--batch-size", type=_argtype(parse_int), default=8, metavar="N", help="(default: %(default)s)")
    p.add_argument("--steps", type=_argtype(parse_int), default=10, metavar="N",
                   help="timed steps per cell, after 3 warm-up steps (default: %(default)s)")
    p.add_argument("--layers", type=_argtype(parse_int), default=None, metavar="N",
                   help="keep the first N layers of each shape (default: all)")
    _common(p, "runs/bench", models=False)
    p.set_defaults(func=cmd_bench_train)

