"""Passkey retrieval over a grid of context lengths by depth, for teachers and students.

Two formats (examples from ``linearize.data.passkey``, the generator the training data uses):

- ``classic``: one 5-digit pass key in "The grass is green. ..." filler, asked for at the end
  (zero-shot for an instruct teacher);
- ``lizard``: five passkeys of 5-8 words at random depths, one of them asked (Lizard's Figure 4
  format; models are fine-tuned on it at one training length first, e.g. with
  ``linearize train --data passkey:LENGTH``).

Cell (length, depth) holds ``samples`` examples; example ``i`` of a cell is drawn from
``random.Random(f"{seed}:{format}:{length}:{depth_index}:{i}")``, so every model sees the same
prompts. Answers are greedy continuations, scored by exact match (``answer_matches``).
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Sequence

import torch

from ..data.passkey import PasskeyExample, make_classic_passkey_example, make_passkey_example
from ..models.generate import generate_text
from ..models.loading import is_linearized, load_model, model_label, trained_context
from ..records import environment, markdown_table, new_figure, save_png, write_outputs

FORMATS = ("classic", "lizard")
STEM = "passkey"
_WORD = re.compile(r"[A-Za-z0-9']+")


def answer_matches(generated: str, answer: str) -> bool:
    """Exact match: the first words of the continuation are the answer's words, in order.

    Words are runs of letters, digits and apostrophes, so quotes, punctuation and spacing around
    the answer do not count, but a wrong, missing or extra word inside the answer does; case counts.
    """
    want = _WORD.findall(answer)
    got = _WORD.findall(generated)
    return bool(want) and got[:len(want)] == want


def depth_grid(depths: int) -> list[float]:
    """``depths`` evenly spaced depths from 0 (start) to 1 (end)."""
    if isinstance(depths, bool) or not isinstance(depths, int) or depths < 1:
        raise ValueError(f"depths must be a positive integer (the number of depths from 0 to 1), got {depths!r}")
    return [0.5] if depths == 1 else [i / (depths - 1) for i in range(depths)]


def check_lengths(lengths: Sequence[int]) -> list[int]:
    lengths = list(lengths)
    bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < 64]
    if not lengths or bad:
        raise ValueError(f"lengths must be context lengths of at least 64 tokens, got {bad or lengths!r}")
    return sorted(set(lengths))


def make_example(fmt: str, tokenizer, length: int, depth: float, rng: random.Random) -> PasskeyExample:
    if fmt == "classic":
        return make_classic_passkey_example(rng, tokenizer, length, depth)
    if fmt == "lizard":
        return make_passkey_example(rng, tokenizer, length, asked_depth=depth)
    raise ValueError(f"unknown passkey format {fmt!r}; available: {', '.join(FORMATS)}")


def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The greedy continuation of ``prompt`` as it stands (no special tokens added): on CUDA a
    linearized model decodes through a CUDA graph, the same tokens (``models.generate``)."""
    return generate_text(model, tokenizer, prompt, max_new_tokens=max_new_tokens, add_special_tokens=False)


def evaluate_model(model, tokenizer, fmt: str, lengths: list[int], depths: list[float], samples: int,
                   seed: int, max_new_tokens: int, progress=None) -> dict:
    """Accuracy per (depth, length) cell and every example's prompt length, answer and output."""
    accuracy = [[0.0] * len(lengths) for _ in depths]
    examples = []
    for j, length in enumerate(lengths):
        for i, depth in enumerate(depths):
            correct = 0
            for n in range(samples):
                ex = make_example(fmt, tokenizer, length, depth, random.Random(f"{seed}:{fmt}:{length}:{i}:{n}"))
                output = greedy_continuation(model, tokenizer, ex.prompt, max_new_tokens)
                ok = answer_matches(output, ex.answer)
                correct += ok
                examples.append({"length": length, "depth": depth, "sample": n, "answer": ex.answer,
                                 "output": output, "correct": ok})
                if progress is not None:
                    progress.update(1)
            accuracy[i][j] = correct / samples
    return {"accuracy": accuracy, "examples": examples}


def run_passkey(models: Sequence[str], out_dir: str | Path, *, fmt: str = "classic",
                lengths: Sequence[int] = (1024, 2048, 4096, 8192, 16384, 32768), depths: int = 5,
                samples: int = 5, seed: int = 0, train_length: int | None = None,
                max_new_tokens: int | None = None, device: str | None = None,
                dtype: torch.dtype | None = None) -> dict:
    """Evaluate each model on the grid; write passkey.json, passkey.png (heatmaps) and passkey.md."""
    from tqdm.auto import tqdm

    if fmt not in FORMATS:
        raise ValueError(f"unknown passkey format {fmt!r}; available: {', '.join(FORMATS)}")
    if not models:
        raise ValueError("give at least one model (a checkpoint directory or a teacher name)")
    lengths, grid = check_lengths(lengths), depth_grid(depths)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive integer, got {samples!r}")
    if train_length is not None and (not isinstance(train_length, int) or train_length < 1):
        raise ValueError(f"train_length must be a positive number of tokens, got {train_length!r}")
    max_new_tokens = max_new_tokens or (8 if fmt == "classic" else 32)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None and str(device).startswith("cuda"):
        dtype = torch.bfloat16

    results = []
    total = len(lengths) * len(grid) * samples
    for name in models:
        model, tokenizer = load_model(name, device=device, dtype=dtype)
        if tokenizer is None:
            raise ValueError(f"model {name} has no tokenizer files; passkey needs one")
        start = time.perf_counter()
        with tqdm(total=total, desc=f"passkey {fmt} {name}", unit="ex") as bar:
            scores = evaluate_model(model, tokenizer, fmt, lengths, grid, samples, seed, max_new_tokens, bar)
        results.append({"model": name, "label": model_label(name, model), "linearized": is_linearized(model),
                        "context_length": trained_context(name, model), "seconds": time.perf_counter() - start,
                        **scores})
        del model
    data = {"format": fmt, "lengths": lengths, "depths": grid, "samples": samples, "seed": seed,
            "train_length": train_length, "max_new_tokens": max_new_tokens, "models": results,
            "environment": environment(device)}
    write_outputs(out_dir, STEM, data, passkey_markdown, passkey_figure)
    return data


def mean_by_length(model_result: dict) -> list[float]:
    acc = model_result["accuracy"]
    return [sum(row[j] for row in acc) / len(acc) for j in range(len(acc[0]))]


def passkey_markdown(data: dict) -> str:
    names = [m["label"] for m in data["models"]]
    rows = [[length, *(f"{mean_by_length(m)[j]:.0%}" for m in data["models"])]
            for j, length in enumerate(data["lengths"])]
    notes = [f"- {m['label']}: trained context {m['context_length'] or 'unknown'} tokens"
             + ("" if m["linearized"] else " (softmax teacher: RoPE positions beyond it were never trained)")
             for m in data["models"]]
    if data.get("train_length"):
        notes.append(f"- fine-tuned on passkey examples of {data['train_length']} tokens")
    env = data["environment"]
    return "\n".join([
        f"# Passkey retrieval ({data['format']} format)", "",
        f"Exact-match accuracy over {len(data['depths'])} depths x {data['samples']} samples per length, "
        f"greedy, {data['max_new_tokens']} new tokens.", "",
        markdown_table(["context (tokens)", *names], rows), "", *notes, "",
        f"Device: {env['device']}; torch {env['torch']}. Command: `{env['command']}`", ""])


def passkey_figure(data: dict, path: Path) -> None:
    """One heatmap per model, depth by length, green (1) to red (0); dashed lines mark the
    training length and the teacher's trained context."""
    retrieval_heatmap(data, path, ylabel="depth of the asked key", colorbar="exact-match accuracy",
                      title=f"Passkey retrieval, {data['format']} format")


def retrieval_heatmap(data: dict, path: Path, *, ylabel: str, colorbar: str, title: str) -> None:
    """Depth-by-length accuracy of each model (``data["models"][i]["accuracy"]``, rows = depths), one
    panel per model, green (1) to red (0), with dashed lines at the training length and each model's
    trained context: the figure of every retrieval eval (passkey, needle)."""
    from matplotlib.colors import LinearSegmentedColormap

    models, lengths, depths = data["models"], data["lengths"], data["depths"]
    fig, axes = new_figure((1.2 + 0.75 * len(lengths) * len(models) + 1.2, 3.6), ncols=len(models))
    axes = [axes] if len(models) == 1 else list(axes)
    cmap = LinearSegmentedColormap.from_list("retrieval", ["#d7191c", "#fdae61", "#ffffbf", "#a6d96a", "#1a9641"])
    image = None
    for ax, m in zip(axes, models):
        image = ax.imshow(m["accuracy"], cmap=cmap, vmin=0, vmax=1, aspect="auto", origin="upper")
        for i, row in enumerate(m["accuracy"]):
            for j, a in enumerate(row):
                ax.text(j, i, f"{a:.0%}" if a < 1 else "1", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [_k(n) for n in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(m["label"], fontsize=9)
        for value, style, what in ((data.get("train_length"), "--", "train"), (m["context_length"], ":", "context")):
            if value:
                x = _position(lengths, value)
                if x is not None:
                    ax.axvline(x, color="black", linestyle=style, linewidth=1.2, label=f"{what} {_k(value)}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="lower left")
    axes[0].set_ylabel(ylabel)
    fig.colorbar(image, ax=axes, label=colorbar, shrink=0.8)
    fig.suptitle(title, fontsize=10)
    save_png(fig, path)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _position(lengths: list[int], value: int) -> float | None:
    """The x of a line just right of the longest length <= ``value``: everything left of it fits
    within ``value``. None when ``value`` is outside the grid."""
    if value < lengths[0] or value > lengths[-1]:
        return None
    return max(j for j, n in enumerate(lengths) if n <= value) + 0.5
