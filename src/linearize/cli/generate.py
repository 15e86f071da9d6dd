"""``linearize generate``: complete prompts with ``models.generate.generate_text``."""

from __future__ import annotations

import json
import math

from .args import DEVICE_HELP, add_command, argtype, parse_device, parse_float, parse_int, resolved_device


def cmd_generate(args) -> int:
    from ..models.loading import check_model_name

    check_model_name(args.model)  # before transformers' import (seconds) and any loading
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    from ..models.generate import EmptyPromptError, generate_text
    from ..models.loading import load_model

    model, tokenizer = load_model(args.model, device=resolved_device(args.device))
    if tokenizer is None:
        raise ValueError(f"model {args.model} has no tokenizer (no tokenizer files in the directory); "
                         "generate needs one: save the tokenizer next to the weights")
    if args.chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--chat: the tokenizer of {args.model} has no chat template")
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {args.model} has neither a pad nor an eos token; cannot batch prompts")
    try:
        completions = generate_text(model, tokenizer, list(args.prompt), max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                    seed=args.seed, chat=args.chat)
    except EmptyPromptError as e:
        raise ValueError(f"--prompt {', '.join(map(str, e.positions))}: empty prompt (no tokens); give some text") \
            from None

    for i, (prompt, completion) in enumerate(zip(args.prompt, completions)):
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": completion}, ensure_ascii=False))
        else:
            if i:
                print()
            print(f">>> {prompt}")
            print(completion)
    return 0


def add_parser(sub) -> None:
    p = add_command(sub, "generate", "complete prompts with a teacher or a linearized checkpoint",
                    "Complete one or more prompts, batched with left padding, and print only the new text of each. "
                    "--model is a linearize checkpoint directory (it holds linearize.json), the bundled trained "
                    "student (smollm2-135m-lizard), a bundled teacher, a local HF model directory or a hub id.",
                    """\
                    examples:
                      linearize generate --model smollm2-135m-lizard --chat --prompt "What is the capital of France?"
                      linearize generate --model runs/lizard --chat --prompt "Write a haiku about rain."
                      linearize generate --model smollm2-135m --prompt "Once upon a time" --prompt "The sea" \\
                          --max-new-tokens 32 --temperature 0.7 --top-p 0.9 --seed 1""")
    p.add_argument("--model", required=True, metavar="DIR_OR_NAME", help="checkpoint directory, bundled student or teacher")
    p.add_argument("--prompt", required=True, action="append", metavar="TEXT", help="a prompt; repeatable")
    p.add_argument("--max-new-tokens", type=argtype(parse_int), default=64, metavar="N",
                   help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=argtype(parse_float), default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=argtype(parse_float), default=1.0, metavar="P",
                   help="nucleus sampling mass when sampling (default: %(default)s)")
    p.add_argument("--top-k", type=argtype(parse_int), default=0, metavar="K",
                   help="top-k filter when sampling; 0 = off (default: %(default)s)")
    p.add_argument("--seed", type=argtype(parse_int), default=0, metavar="N",
                   help="random seed for sampling (default: %(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--device", type=argtype(parse_device), default="auto", metavar="DEVICE", help=DEVICE_HELP)
    p.add_argument("--json", action="store_true", help='print one JSON line {"prompt", "completion"} per prompt')
    p.set_defaults(func=cmd_generate)
