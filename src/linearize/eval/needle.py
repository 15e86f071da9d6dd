"""Needles in natural text over a grid of context lengths by depth, for teachers and students.

Examples come from ``linearize.data.needle``: in each, one needle (a secret number, a magic word
or a note's sentence) and ``distractors`` needles of the same kind with other keys are hidden in a
window of natural text (a local file or folder, e.g. ``../shared/data/mix/gutenberg_books.jsonl.xz``,
read through ``linearize.data.sources``), and the prompt asks for the one needle's value.

Cell (length, depth) holds ``samples`` examples of each kind; example ``n`` of kind ``k`` in a cell
is drawn from ``random.Random(f"{seed}:needle:{k}:{length}:{depth_index}:{n}")``, so every model
with the same tokenizer sees the same prompts. Answers are greedy continuations
(``models.generate.generate_text``), scored by ``data.needle.needle_correct``: the asked value in
the first line, no distractor's value.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Sequence

import torch

from ..data.needle import (
    KINDS, Haystack, NeedleExample, check_haystack_source, load_haystack_texts, make_needle_example, needle_correct,
    prepare_haystack,
)
from ..models.generate import generate_text
from ..models.loading import is_linearized, load_model, model_label, trained_context
from ..records import environment, markdown_table, write_outputs
from .passkey import check_lengths, depth_grid, mean_by_length, retrieval_heatmap

STEM = "needle"
DEFAULT_MAX_NEW_TOKENS = {"number": 12, "word": 12, "sentence": 32}
MIN_HAYSTACK_TOKENS = 65536


def check_kinds(kinds: Sequence[str]) -> list[str]:
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise ValueError(f"unknown needle kind(s) {', '.join(map(repr, bad)) or 'none given'}; "
                         f"available: {', '.join(KINDS)}")
    return list(dict.fromkeys(kinds))


def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The greedy continuation of ``prompt`` as it stands (no special tokens added)."""
    return generate_text(model, tokenizer, prompt, max_new_tokens=max_new_tokens, add_special_tokens=False)


def make_example(haystack: Haystack, tokenizer, kind: str, length: int, depth: float, distractors: int,
                 rng: random.Random) -> NeedleExample:
    return make_needle_example(haystack, tokenizer, length, depth, rng, kind=kind, distractors=distractors)


def evaluate_model(model, tokenizer, haystack: Haystack, kinds: list[str], lengths: list[int],
                   depths: list[float], samples: int, distractors: int, seed: int,
                   max_new_tokens: dict[str, int], progress=None) -> dict:
    """Accuracy per (depth, length) cell over all kinds, the same per kind, and every example."""
    accuracy = [[0.0] * len(lengths) for _ in depths]
    by_kind = {k: [[0.0] * len(lengths) for _ in depths] for k in kinds}
    examples = []
    for j, length in enumerate(lengths):
        for i, depth in enumerate(depths):
            for kind in kinds:
                correct = 0
                for n in range(samples):
                    ex = make_example(haystack, tokenizer, kind, length, depth, distractors,
                                      random.Random(f"{seed}:needle:{kind}:{length}:{i}:{n}"))
                    output = greedy_continuation(model, tokenizer, ex.prompt, max_new_tokens[kind])
                    ok = needle_correct(output, ex.answer, ex.distractors, kind)
                    correct += ok
                    examples.append({"length": length, "depth": depth, "kind": kind, "sample": n,
                                     "prompt_tokens": ex.length, "position": ex.positions[ex.asked],
                                     "key": ex.key, "answer": ex.answer, "distractors": ex.distractors,
                                     "output": output, "correct": ok})
                    if progress is not None:
                        progress.update(1)
                by_kind[kind][i][j] = correct / samples
            accuracy[i][j] = sum(by_kind[k][i][j] for k in kinds) / len(kinds)
    return {"accuracy": accuracy, "by_kind": by_kind, "examples": examples}


def run_needle(models: Sequence[str], haystack: str | Path, out_dir: str | Path, *,
               kinds: Sequence[str] = KINDS, lengths: Sequence[int] = (1024, 2048, 4096, 8192, 16384),
               depths: int = 5, samples: int = 2, distractors: int = 3, seed: int = 0,
               haystack_tokens: int | None = None, text_field: str = "text", train_length: int | None = None,
               max_new_tokens: int | None = None, device: str | None = None,
               dtype: torch.dtype | None = None) -> dict:
    """Evaluate each model on the grid; write needle.json, needle.png (heatmaps) and needle.md.

    ``haystack``: a local text/JSON/JSONL file (plain or .gz/.xz/.bz2), a folder of them, or
    ``shakespeare``; ``haystack_tokens`` of it are read (default: 4x the longest length, at least
    64K). ``samples``: examples per kind per cell. ``max_new_tokens``: one value for every kind
    (default: 12 for numbers and words, 32 for sentences)."""
    from tqdm.auto import tqdm

    if not models:
        raise ValueError("give at least one model (a checkpoint directory or a teacher name)")
    source = check_haystack_source(haystack)
    kinds, lengths, grid = check_kinds(kinds), check_lengths(lengths), depth_grid(depths)
    for name, value in (("samples", samples), ("max_new_tokens", max_new_tokens),
                        ("haystack_tokens", haystack_tokens), ("train_length", train_length)):
        if (value is not None or name == "samples") and (isinstance(value, bool) or not isinstance(value, int)
                                                          or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(distractors, bool) or not isinstance(distractors, int) or distractors < 0:
        raise ValueError(f"distractors must be a non-negative integer, got {distractors!r}")
    budget = haystack_tokens or max(4 * lengths[-1], MIN_HAYSTACK_TOKENS)
    new_tokens = {k: max_new_tokens or DEFAULT_MAX_NEW_TOKENS[k] for k in kinds}
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None and str(device).startswith("cuda"):
        dtype = torch.bfloat16

    results, texts, prepared = [], None, {}
    total = len(lengths) * len(grid) * len(kinds) * samples
    for name in models:
        model, tokenizer = load_model(name, device=device, dtype=dtype)
        if tokenizer is None:
            raise ValueError(f"model {name} has no tokenizer files; the needle eval needs one")
        if texts is None:
            texts = load_haystack_texts(source, tokenizer, max_tokens=budget, text_field=text_field)
        key = (getattr(tokenizer, "name_or_path", ""), len(tokenizer))
        if key not in prepared:
            prepared[key] = prepare_haystack(texts, tokenizer)
            for kind in kinds:  # a length too short, or a haystack too small, fails before any generation
                for depth in (grid[0], grid[-1]):
                    make_example(prepared[key], tokenizer, kind, lengths[0], depth, distractors, random.Random(seed))
                make_example(prepared[key], tokenizer, kind, lengths[-1], grid[-1], distractors, random.Random(seed))
        start = time.perf_counter()
        with tqdm(total=total, desc=f"needle {name}", unit="ex") as bar:
            scores = evaluate_model(model, tokenizer, prepared[key], kinds, lengths, grid, samples, distractors,
                                    seed, new_tokens, bar)
        results.append({"model": name, "label": model_label(name, model), "linearized": is_linearized(model),
                        "context_length": trained_context(name, model), "seconds": time.perf_counter() - start,
                        **scores})
        del model
    data = {"haystack": source, "haystack_tokens": budget, "kinds": kinds, "lengths": lengths, "depths": grid,
            "samples": samples, "distractors": distractors, "seed": seed, "train_length": train_length,
            "max_new_tokens": new_tokens, "models": results, "environment": environment(device)}
    write_outputs(out_dir, STEM, data, needle_markdown, needle_figure)
    return data


def mean_by_kind(model_result: dict, kind: str) -> float:
    grid = model_result["by_kind"][kind]
    cells = [a for row in grid for a in row]
    return sum(cells) / len(cells)


def needle_markdown(data: dict) -> str:
    names = [m["label"] for m in data["models"]]
    rows = [[length, *(f"{mean_by_length(m)[j]:.0%}" for m in data["models"])]
            for j, length in enumerate(data["lengths"])]
    kind_rows = [[kind, *(f"{mean_by_kind(m, kind):.0%}" for m in data["models"])] for kind in data["kinds"]]
    notes = [f"- {m['label']}: trained context {m['context_length'] or 'unknown'} tokens"
             + ("" if m["linearized"] else " (softmax teacher: RoPE positions beyond it were never trained)")
             for m in data["models"]]
    if data.get("train_length"):
        notes.append(f"- fine-tuned on rows of {data['train_length']} tokens")
    env = data["environment"]
    return "\n".join([
        "# Needles in natural text", "",
        f"Accuracy over {len(data['depths'])} depths x {len(data['kinds'])} kinds ({', '.join(data['kinds'])}) x "
        f"{data['samples']} samples per length, {data['distractors']} distractors per example, greedy; haystack "
        f"`{data['haystack']}`. Correct: the asked value in the answer's first line, no distractor's value.", "",
        markdown_table(["context (tokens)", *names], rows), "",
        markdown_table(["needle kind", *names], kind_rows), "", *notes, "",
        f"Device: {env['device']}; torch {env['torch']}. Command: `{env['command']}`", ""])


def needle_figure(data: dict, path: Path) -> None:
    """One heatmap per model, depth by length (mean over kinds), green (1) to red (0); dashed
    lines mark the training length and the model's trained context."""
    retrieval_heatmap(data, path, ylabel="depth of the asked needle", colorbar="accuracy",
                      title=f"Needles in natural text ({', '.join(data['kinds'])}; {data['distractors']} distractors)")
