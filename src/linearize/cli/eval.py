"""``linearize eval ...``: passkey, needle, perplexity, lm-eval, the transfer report, LION embeddings.
Parsers and handlers only; the work is in ``linearize.eval``."""

from __future__ import annotations

from .args import (
    add_command, argtype, check_models, common_flags, finish, optional, parse_int, parse_int_list, parse_layers,
    parse_list, resolved_device,
)


def cmd_eval_passkey(args) -> int:
    check_models(args)
    from ..eval.passkey import run_passkey

    run_passkey(args.model, args.out, fmt=args.format, lengths=args.lengths, depths=args.depths,
                samples=args.samples, seed=args.seed, train_length=args.train_length,
                max_new_tokens=args.max_new_tokens, device=resolved_device(args.device))
    return finish(args.out, "passkey")


def cmd_eval_needle(args) -> int:
    check_models(args)
    from ..eval.needle import run_needle

    run_needle(args.model, args.haystack, args.out, kinds=args.kinds, lengths=args.lengths, depths=args.depths,
               samples=args.samples, distractors=args.distractors, seed=args.seed,
               haystack_tokens=args.haystack_tokens, text_field=args.text_field, train_length=args.train_length,
               max_new_tokens=args.max_new_tokens, device=resolved_device(args.device))
    return finish(args.out, "needle")


def cmd_eval_ppl(args) -> int:
    check_models(args)
    from ..eval.perplexity import run_ppl

    run_ppl(args.model, args.data, args.out, max_tokens=args.max_tokens, window=args.window, stride=args.stride,
            text_field=args.text_field, device=resolved_device(args.device))
    return finish(args.out, "ppl")


def cmd_eval_ppl_position(args) -> int:
    check_models(args)
    from ..eval.ppl_position import STEM, run_ppl_position

    run_ppl_position(args.model, args.data, args.out, length=args.length, documents=args.documents,
                     buckets=args.buckets, window=args.window, stride=args.stride, piece=args.piece,
                     text_field=args.text_field, device=resolved_device(args.device))
    return finish(args.out, STEM)


def cmd_eval_report(args) -> int:
    if len(args.model) != 1:
        raise ValueError(f"eval report takes one linearized checkpoint (--model DIR), got {len(args.model)}")
    check_models(args)
    from ..eval.report import run_report

    run_report(args.model[0], args.data, args.out, rows=args.rows, seq_len=args.seq_len, layers=args.layers,
               heads=args.heads, map_tokens=args.map_tokens, device=resolved_device(args.device),
               text_field=args.text_field)
    return finish(args.out, "report")


def cmd_eval_lm_eval(args) -> int:
    check_models(args)
    run = optional("linearize.eval.lm_eval_run", "run_lm_eval", "lm-eval", "pip install 'linearize[eval]'")
    run(args.model, args.tasks, args.data_dir, args.out, limit=args.limit, device=resolved_device(args.device),
        batch_size=args.batch_size, num_fewshot=args.num_fewshot)
    return finish(args.out, "lm_eval")


def cmd_eval_embed(args) -> int:
    if len(args.model) != 1:
        raise ValueError(f"eval embed takes one LION checkpoint (--model DIR), got {len(args.model)}")
    check_models(args)
    from ..eval.embed import run_embed_eval

    kwargs = {"lengths": tuple(args.lengths)} if args.lengths else {}
    run_embed_eval(args.model[0], args.data, args.out, sentences=args.sentences, timing=not args.no_timing,
                   device=resolved_device(args.device), **kwargs)
    return finish(args.out, "embed")


def add_parser(sub) -> None:
    ev = add_command(sub, "eval", "evaluate teachers and students: passkey, needle, perplexity (and by position), lm-eval, transfer report",
                     "Evaluate models side by side. Each command writes NAME.json, NAME.png (drawn from the JSON) and "
                     "NAME.md into --out and prints the Markdown table.")
    evsub = ev.add_subparsers(dest="eval_command", metavar="EVAL", required=True)

    p = add_command(evsub, "passkey", "passkey retrieval over context lengths x depths, as heatmaps",
                    "Greedy passkey retrieval, exact match, over a grid of context lengths by depth of the asked key. "
                    "classic: one 5-digit pass key in repeated filler (zero-shot). lizard: five passkeys of 5-8 words, one "
                    "asked; fine-tune on it first (linearize train --data passkey:LENGTH) and pass --train-length.",
                    """\
                    examples:
                      linearize eval passkey --model smollm2-135m --model runs/lizard --lengths 1K,2K,4K,8K,16K,32K
                      linearize eval passkey --format lizard --model runs/teacher-ft --model runs/lizard-ft \\
                          --train-length 2048 --lengths 2K,4K,8K --depths 5 --samples 10""")
    common_flags(p, "runs/eval")
    p.add_argument("--format", choices=("classic", "lizard"), default="classic", help="(default: %(default)s)")
    p.add_argument("--lengths", type=argtype(parse_int_list), default=[1024, 2048, 4096, 8192, 16384, 32768],
                   metavar="N,N,...", help="context lengths in tokens, K = 1024 as everywhere (default: 1K..32K)")
    p.add_argument("--depths", type=argtype(parse_int), default=5, metavar="N",
                   help="depths from 0%% to 100%% (default: %(default)s)")
    p.add_argument("--samples", type=argtype(parse_int), default=5, metavar="N",
                   help="examples per (length, depth) cell (default: %(default)s)")
    p.add_argument("--train-length", type=argtype(parse_int), default=None, metavar="N",
                   help="the length the models were fine-tuned at, marked on the heatmaps")
    p.add_argument("--max-new-tokens", type=argtype(parse_int), default=None, metavar="N",
                   help="tokens generated per answer (default: 8 classic, 32 lizard)")
    p.add_argument("--seed", type=argtype(parse_int), default=0, metavar="N", help="(default: %(default)s)")
    p.set_defaults(func=cmd_eval_passkey)

    p = add_command(evsub, "needle", "needles (numbers, words, sentences) in natural text, length x depth heatmaps",
                    "Needles hidden in natural text: in each example one needle (a secret number, a magic word or a "
                    "note's sentence) and --distractors needles of the same kind with other keys sit at sentence "
                    "boundaries of a window of --haystack text cut to the context length; the prompt asks for the one "
                    "needle's value. Greedy; correct when the answer's first line holds the asked value (numbers: "
                    "exact digits; words and sentences: case-insensitive whole words) and no distractor's value.",
                    """\
                    examples:
                      linearize eval needle --model smollm2-135m --model runs/lizard \\
                          --haystack ../shared/data/mix/gutenberg_books.jsonl.xz --lengths 1K,2K,4K,8K,16K
                      linearize eval needle --model runs/lizard --haystack notes/ --kinds number,word --samples 5""")
    common_flags(p, "runs/eval")
    p.add_argument("--haystack", required=True, metavar="PATH",
                   help="natural text: a .txt/.md/.json/.jsonl file (plain or .gz/.xz/.bz2), a folder of them, "
                        "or 'shakespeare'")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the text field of JSON/JSONL records (default: %(default)s)")
    p.add_argument("--haystack-tokens", type=argtype(parse_int), default=None, metavar="N",
                   help="tokens of haystack text to read (default: 4x the longest length, at least 64K)")
    p.add_argument("--kinds", type=argtype(parse_list), default=["number", "word", "sentence"], metavar="K,K,...",
                   help="needle kinds: number, word, sentence (default: all three)")
    p.add_argument("--lengths", type=argtype(parse_int_list), default=[1024, 2048, 4096, 8192, 16384],
                   metavar="N,N,...", help="context lengths in tokens, K = 1024 as everywhere (default: 1K..16K)")
    p.add_argument("--depths", type=argtype(parse_int), default=5, metavar="N",
                   help="depths from 0%% to 100%% (default: %(default)s)")
    p.add_argument("--samples", type=argtype(parse_int), default=2, metavar="N",
                   help="examples per kind per (length, depth) cell (default: %(default)s)")
    p.add_argument("--distractors", type=argtype(parse_int), default=3, metavar="N",
                   help="other needles of the same kind per example (default: %(default)s)")
    p.add_argument("--train-length", type=argtype(parse_int), default=None, metavar="N",
                   help="the length the models were trained at, marked on the heatmaps")
    p.add_argument("--max-new-tokens", type=argtype(parse_int), default=None, metavar="N",
                   help="tokens generated per answer (default: 12 numbers and words, 32 sentences)")
    p.add_argument("--seed", type=argtype(parse_int), default=0, metavar="N", help="(default: %(default)s)")
    p.set_defaults(func=cmd_eval_needle)

    p = add_command(evsub, "ppl", "perplexity on any text source",
                    "Perplexity on the same token stream for every model: linearized models read it in one pass carrying "
                    "their state; softmax models in sliding windows of their context (--window, --stride).",
                    """\
                    examples:
                      linearize eval ppl --model smollm2-135m --model smollm2-135m-lizard --data shakespeare
                      linearize eval ppl --model smollm2-135m --model runs/lizard --data ../shared/data/wiki_demo.txt
                      linearize eval ppl --model runs/lizard --data notes/ --max-tokens 32K""")
    common_flags(p, "runs/eval")
    p.add_argument("--data", required=True, metavar="PATH",
                   help="a JSON/JSONL/text file or folder, 'shakespeare', or a HF dataset name")
    p.add_argument("--text-field", default=None, metavar="NAME", help="the text field of JSON/JSONL records")
    p.add_argument("--max-tokens", type=argtype(parse_int), default=16384, metavar="N",
                   help="tokens of text to score (default: %(default)s)")
    p.add_argument("--window", type=argtype(parse_int), default=None, metavar="N",
                   help="softmax models: window length (default: the model's context)")
    p.add_argument("--stride", type=argtype(parse_int), default=None, metavar="N",
                   help="softmax models: window step (default: half the window)")
    p.set_defaults(func=cmd_eval_ppl)

    p = add_command(evsub, "ppl-position", "perplexity against position in long documents, teacher and student",
                    "Each token's loss on long documents (cut to --length tokens; shorter ones are skipped), averaged "
                    "over the documents in log-spaced buckets of its position, one curve per model: does the model keep "
                    "improving with context, and beyond the teacher's? Linearized models read each document in one "
                    "pass carrying their state (pieces of --piece tokens, constant memory); softmax models whole up to "
                    "their context and in sliding windows beyond it (--window, --stride).",
                    """\
                    examples:
                      linearize eval ppl-position --model smollm2-135m --model runs/lizard \\
                          --data ../shared/data/mix/gutenberg_books.jsonl.xz --length 32K --documents 4""")
    common_flags(p, "runs/eval")
    p.add_argument("--data", required=True, metavar="PATH",
                   help="long held-out text: a JSON/JSONL/text file (plain or compressed) or folder, or a HF dataset name")
    p.add_argument("--text-field", default=None, metavar="NAME", help="the text field of JSON/JSONL records")
    p.add_argument("--length", type=argtype(parse_int), default=16384, metavar="N",
                   help="tokens per document; documents shorter than this are skipped (default: 16K)")
    p.add_argument("--documents", type=argtype(parse_int), default=4, metavar="N",
                   help="documents averaged (default: %(default)s)")
    p.add_argument("--buckets", type=argtype(parse_int), default=12, metavar="N",
                   help="log-spaced position buckets, at most (default: %(default)s)")
    p.add_argument("--piece", type=argtype(parse_int), default=4096, metavar="N",
                   help="linearized models: tokens per prefill piece (default: %(default)s)")
    p.add_argument("--window", type=argtype(parse_int), default=None, metavar="N",
                   help="softmax models: window length (default: the model's context)")
    p.add_argument("--stride", type=argtype(parse_int), default=None, metavar="N",
                   help="softmax models: window step (default: half the window)")
    p.set_defaults(func=cmd_eval_ppl_position)

    p = add_command(evsub, "lm-eval", "the papers' lm-eval tasks from local files",
                    "Run PIQA, ARC-Easy, ARC-Challenge, HellaSwag, WinoGrande and 5-shot MMLU through lm-eval, reading the "
                    "data from --data-dir (the layout of ../shared/data/evaldev: piqa.jsonl, arc_easy.jsonl, "
                    "arc_challenge.jsonl, hellaswag.jsonl, winogrande.jsonl, mmlu/dev/*.csv, mmlu/val/*.csv).",
                    """\
                    examples:
                      linearize eval lm-eval --model smollm2-135m --model runs/lizard --data-dir ../shared/data/evaldev \\
                          --tasks piqa,arc_easy,arc_challenge,hellaswag,winogrande,mmlu --limit 100""")
    common_flags(p, "runs/eval")
    p.add_argument("--tasks", type=argtype(parse_list), default=None, metavar="T,T,...",
                   help="piqa, arc_easy, arc_challenge, hellaswag, winogrande, mmlu, comma-separated, or all "
                        "(default: all)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="the folder holding the task files (default: $LINEARIZE_EVAL_DATA)")
    p.add_argument("--limit", type=argtype(parse_int), default=None, metavar="N",
                   help="at most N examples per task, per subject for MMLU (default: all)")
    p.add_argument("--num-fewshot", type=argtype(parse_int), default=None, metavar="N",
                   help="override the tasks' shots (default: 0, MMLU 5)")
    p.add_argument("--batch-size", type=argtype(parse_int), default=8, metavar="N", help="(default: %(default)s)")
    p.set_defaults(func=cmd_eval_lm_eval)

    p = add_command(evsub, "report", "attention-transfer report: per-layer MSE and attention maps",
                    "For a linearized checkpoint on held-out text: each layer's attention MSE against the teacher's "
                    "softmax (trained and untrained conversion) and teacher vs student attention weights for a few heads.",
                    """\
                    examples:
                      linearize eval report --model runs/lizard --data ../shared/data/wiki_demo.txt --layers 0,14,29""")
    common_flags(p, "runs/eval")
    p.add_argument("--data", required=True, metavar="PATH", help="held-out text (as for train --data)")
    p.add_argument("--text-field", default=None, metavar="NAME", help="the text field of JSON/JSONL records")
    p.add_argument("--rows", type=argtype(parse_int), default=8, metavar="N", help="(default: %(default)s)")
    p.add_argument("--seq-len", type=argtype(parse_int), default=256, metavar="N", help="(default: %(default)s)")
    p.add_argument("--layers", type=argtype(parse_layers), default=None, metavar="I,J,...",
                   help="layers whose attention maps to draw (default: first, middle, last)")
    p.add_argument("--heads", type=argtype(parse_int), default=2, metavar="N",
                   help="heads per layer to draw (default: %(default)s)")
    p.add_argument("--map-tokens", type=argtype(parse_int), default=64, metavar="N",
                   help="tokens shown in the attention maps (default: %(default)s)")
    p.set_defaults(func=cmd_eval_report)

    p = add_command(evsub, "embed", "LION encoders: embedding agreement with the teacher, and attention cost",
                    "For a LION encoder checkpoint (linearize train --method lion-s --model minilm-l6 ...): cosine similarity "
                    "between teacher and student sentence embeddings and nearest-neighbour agreement on held-out sentences, "
                    "beside the same figures for the untrained conversion; and the time and extra memory of each LION form "
                    "against SDPA softmax from 512 to 32K tokens.",
                    """\
                    examples:
                      linearize eval embed --model runs/lion-minilm --data ../shared/data/wiki_demo.txt --sentences 500""")
    common_flags(p, "runs/eval")
    p.add_argument("--data", required=True, metavar="PATH", help="local text (held-out sentences are taken from it)")
    p.add_argument("--sentences", type=argtype(parse_int), default=1000, metavar="N", help="(default: %(default)s)")
    p.add_argument("--lengths", type=argtype(parse_int_list), default=None, metavar="N,N,...",
                   help="sequence lengths for the timing table, K = 1024 as everywhere (default: 512..32K)")
    p.add_argument("--no-timing", action="store_true", help="skip the attention timing table")
    p.set_defaults(func=cmd_eval_embed)

