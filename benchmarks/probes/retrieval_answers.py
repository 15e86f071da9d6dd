"""Does a model retrieve, and how nearly? Per model (and per sparse-cache size for students): the
teacher-forced NLL of the answer tokens and the greedy exact match, on held-out examples of the
training formats (key-value lists, one fact in natural text) and of the classic pass key, at one
context length.

    PYTHONPATH=src python3 benchmarks/probes/retrieval_answers.py MODEL... --haystack FILE
        [--length 1024] [--examples 3] [--cache 0,64] [--score relative|error] [--formats kv,facts,classic]

MODEL is ``smollm2-135m`` (the bundled teacher), a checkpoint folder or a bundled student's name;
``--cache`` sizes other than 0 load a student with LoLA's sparse cache added, without training
(``checkpoint.load(overrides={"sparse_cache": M})``). The NLL moves before exact match does: a
student that answers with the right kind of token but a wrong digit is closer than one that does not.
"""

from __future__ import annotations

import argparse
import random

import torch

FORMATS = ("kv", "facts", "classic")


def make_examples(tokenizer, haystack, length: int, count: int, formats, seed: int = 11) -> list[tuple[str, object]]:
    """``count`` examples of each format, the asked value at depths 0.1, 0.5, 0.9 in turn."""
    from linearize.data.passkey import make_classic_passkey_example
    from linearize.data.retrieval import make_fact_example, make_kv_example

    rng, out = random.Random(seed), []
    for i in range(count):
        depth = (0.1, 0.5, 0.9)[i % 3]
        for fmt in formats:
            if fmt == "kv":
                out.append((fmt, make_kv_example(rng, tokenizer, length, depth=depth)))
            elif fmt == "facts":
                out.append((fmt, make_fact_example(rng, tokenizer, haystack, length, asked=1, distractors=0,
                                                   depth=depth)))
            else:
                out.append((fmt, make_classic_passkey_example(rng, tokenizer, length, depth=depth)))
    return out


def answer_nll(model, tokenizer, prompt: str, answer: str) -> float:
    """Mean NLL of ``" " + answer``'s tokens after ``prompt``, teacher-forced."""
    p = tokenizer(prompt)["input_ids"]
    a = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p + a])).logits[0, len(p) - 1:-1].float()
    return torch.nn.functional.cross_entropy(logits, torch.tensor(a)).item()


def score(model, tokenizer, examples) -> dict[str, dict]:
    """Per format: mean answer NLL, exact matches, and each (expected, generated) pair."""
    from linearize.eval.passkey import answer_matches, greedy_continuation

    model.eval()
    out: dict[str, dict] = {}
    for fmt, ex in examples:
        got = greedy_continuation(model, tokenizer, ex.prompt, 12)
        row = out.setdefault(fmt, {"nll": [], "hits": 0, "answers": []})
        row["nll"].append(answer_nll(model, tokenizer, ex.prompt, ex.answer))
        row["hits"] += answer_matches(got, ex.answer)
        row["answers"].append((ex.answer, got.strip()[:24]))
    for row in out.values():
        row["nll"] = sum(row["nll"]) / len(row["nll"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--haystack", required=True, help="natural text for the facts (a file or folder)")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--examples", type=int, default=3, help="examples of each format")
    parser.add_argument("--cache", default="0", help="sparse-cache sizes for students, e.g. 0,64,256")
    parser.add_argument("--score", default="relative", help="the cache's sparse_score: relative | error (LoLA's)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    formats = args.formats.split(",")
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"--formats: unknown {bad}; allowed: {', '.join(FORMATS)}")
    torch.set_num_threads(max(1, torch.get_num_threads()))

    import linearize
    from linearize.data.needle import load_haystack
    from linearize.models.checkpoint import load
    from linearize.models.teacher import load_teacher

    examples = None
    for name in args.models:
        for size in [int(s) for s in args.cache.split(",")] if name != "smollm2-135m" else [0]:
            if name == "smollm2-135m":
                model, tok = load_teacher(name)
            elif size:
                model, tok = load(name, overrides={"sparse_cache": size, "sparse_score": args.score})
            else:
                model, tok = linearize.load(name)
            if examples is None:
                hay = load_haystack(args.haystack, tok, max_tokens=200_000)
                examples = make_examples(tok, hay, args.length, args.examples, formats)
            result = score(model, tok, examples)
            label = name + (f" + cache {size} ({args.score})" if size else "")
            print(label + ": " + "; ".join(f"{f} NLL {r['nll']:.2f}, {r['hits']}/{len(r['answers'])}"
                                           for f, r in result.items()), flush=True)
            for f, r in result.items():
                print(f"  {f}: " + ", ".join(f"{want} -> {got!r}" for want, got in r["answers"]), flush=True)


if __name__ == "__main__":
    main()
