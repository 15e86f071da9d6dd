"""Perplexity against position: does a model keep improving with context, and beyond its teacher's?

On long documents (each cut to ``length`` tokens; shorter ones are skipped, so every position
averages the same documents) every token's loss is computed once, then averaged in log-spaced
buckets of its position in its document. A linearized student reads each document in one pass
carrying its state (chunked prefill in pieces, constant memory for its linear layers); a softmax
teacher reads it whole up to its context and in sliding windows beyond it (``perplexity.
model_token_nll``), so past its context each token still sees at least ``window - stride`` earlier
tokens. Writes ``ppl_position.json`` with the curves, ``.png`` and ``.md`` drawn from it.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Sequence

import torch

from ..data.sources import load_documents
from ..models.loading import (check_model_name, context_length, is_linearized, load_model, model_label,
                              trained_context)
from ..records import environment, markdown_table, new_figure, save_png, write_outputs
from .perplexity import model_token_nll

STEM = "ppl_position"


def position_buckets(length: int, count: int) -> list[tuple[int, int]]:
    """Log-spaced ``[start, end)`` ranges covering positions 1..length-1 (position p is the p-th
    token of a document, predicted from the p before it): at most ``count`` ranges, the first
    ones merged where the log spacing would give empty ones."""
    for name, value in (("length", length), ("count", count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if length < 2:
        raise ValueError(f"length must be at least 2 tokens (position 0 is never scored), got {length}")
    edges = sorted({1, length} | {round(math.exp(math.log(length) * i / count)) for i in range(1, count)})
    return list(zip(edges[:-1], edges[1:]))


def bucket_curve(token_nll: Sequence[torch.Tensor], buckets: Sequence[tuple[int, int]]) -> list[dict]:
    """The mean loss per bucket over all documents.

    token_nll: per document, (T_d - 1,) NLL of its tokens 1..T_d-1 (entry i is position i + 1).
    Returns per bucket {"start", "end", "tokens", "nll", "ppl"} (tokens: how many were averaged)."""
    curve = []
    for start, end in buckets:
        parts = [nll[start - 1:end - 1] for nll in token_nll]
        values = torch.cat(parts).double() if parts else torch.zeros(0, dtype=torch.float64)
        mean = values.mean().item() if values.numel() else math.nan
        curve.append({"start": start, "end": end, "tokens": values.numel(), "nll": mean,
                      "ppl": math.exp(mean) if values.numel() else math.nan})
    return curve


def long_documents(data: str, tokenizer, length: int, documents: int, text_field: str | None) -> list[list[int]]:
    """The first ``documents`` documents of ``data`` with at least ``length`` tokens, each cut to
    ``length``. ``data`` is read from its front only as far as needed: first ``documents x length``
    tokens, then 8x and 64x that while too few long documents have turned up."""
    budget, read = documents * length, []
    for factor in (1, 8, 64):
        read = load_documents(data, tokenizer, text_field=text_field or "text", max_tokens=budget * factor)
        found = [list(doc)[:length] for doc in read if len(doc) >= length][:documents]
        if len(found) == documents or sum(len(d) for d in read) < budget * factor:  # enough, or all of it read
            break
    if not found:
        longest = max(len(d) for d in read)
        raise ValueError(f"no document of {data!r} has {length} tokens (the longest of the {len(read)} read has "
                         f"{longest}); give longer documents or a smaller --length")
    return found


def run_ppl_position(models: Sequence[str], data: str, out_dir: str | Path, *, length: int = 16384,
                     documents: int = 4, buckets: int = 12, window: int | None = None, stride: int | None = None,
                     piece: int = 4096, text_field: str | None = None, device: str | None = None,
                     dtype: torch.dtype | None = None) -> dict:
    """Perplexity in log-spaced position buckets for each model on the same long documents of ``data``;
    writes ppl_position.json, .png and .md into ``out_dir`` and returns the JSON's content."""
    from tqdm.auto import tqdm

    if not models:
        raise ValueError("give at least one model (a checkpoint directory or a teacher name)")
    for name in models:
        check_model_name(str(name))
    for name, value in (("length", length), ("piece", piece), ("window", window), ("stride", stride)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
            raise ValueError(f"{name} must be an integer >= 2, got {value!r}")
    if isinstance(documents, bool) or not isinstance(documents, int) or documents < 1:
        raise ValueError(f"documents must be a positive integer, got {documents!r}")
    ranges = position_buckets(length, buckets)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None and str(device).startswith("cuda"):
        dtype = torch.bfloat16
    results, docs = [], None
    for name in models:
        model, tokenizer = load_model(name, device=device, dtype=dtype)
        if tokenizer is None:
            raise ValueError(f"model {name} has no tokenizer files; perplexity on text needs one")
        these = long_documents(data, tokenizer, length, documents, text_field)
        if docs is None:
            docs = these
        elif these != docs:
            raise ValueError(f"model {name} tokenizes the text differently from {models[0]}; "
                             "their curves would not be comparable")
        start = time.perf_counter()
        nlls = []
        with tqdm(total=len(docs) * length, desc=f"ppl by position {name}", unit="tok") as bar:
            for doc in docs:
                nll, how = model_token_nll(model, torch.tensor(doc)[None], window, stride, piece, bar)
                nlls.append(nll)
        mean = torch.cat(nlls).double().mean().item()
        results.append({"model": name, "label": model_label(name, model), "linearized": is_linearized(model),
                        "context_length": context_length(model), "trained_context": trained_context(name, model),
                        "how": how, "nll": mean, "ppl": math.exp(mean), "seconds": time.perf_counter() - start,
                        "curve": bucket_curve(nlls, ranges)})
        del model
    out = {"data": data, "length": length, "documents": len(docs), "models": results,
           "environment": environment(device)}
    write_outputs(out_dir, STEM, out, position_markdown, position_figure)
    return out


def position_markdown(data: dict) -> str:
    models = data["models"]
    rows = []
    for i, bucket in enumerate(models[0]["curve"]):
        rows.append([f"{bucket['start']}-{bucket['end'] - 1}", bucket["tokens"]]
                    + [_fmt(m["curve"][i]["ppl"]) for m in models])
    rows.append(["all", sum(b["tokens"] for b in models[0]["curve"])] + [_fmt(m["ppl"]) for m in models])
    env = data["environment"]
    reads = "; ".join(f"{m['label']}: {m['how']}" for m in models)
    return "\n".join([f"# Perplexity by position on {data['data']}", "",
                      f"{data['documents']} document{'s' if data['documents'] != 1 else ''} of {data['length']} tokens; each token's loss averaged over "
                      f"the documents in log-spaced buckets of its position. {reads}.", "",
                      markdown_table(["positions", "tokens"] + [m["label"] for m in models], rows), "",
                      f"Device: {env['device']}; torch {env['torch']}. Command: `{env['command']}`", ""])


def _fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def position_figure(data: dict, path: Path) -> None:
    fig, ax = new_figure((7.5, 4.5))
    softmax_contexts = set()
    for m in data["models"]:
        points = [(math.sqrt(b["start"] * (b["end"] - 1)) if b["end"] - 1 > b["start"] else b["start"], b["ppl"])
                  for b in m["curve"] if b["ppl"] is not None]
        style = dict(marker="o", markersize=3, linewidth=1.4)
        if not m["linearized"]:
            style.update(linestyle="--", color="#404040")
            if m["context_length"] and m["context_length"] < data["length"]:
                softmax_contexts.add(m["context_length"])
        ax.plot([x for x, _ in points], [y for _, y in points], label=m["label"], **style)
    for ctx in sorted(softmax_contexts):
        ax.axvline(ctx, color="#999999", linestyle=":", linewidth=1)
        ax.text(ctx, 0.98, f" context {ctx}", transform=ax.get_xaxis_transform(), fontsize=7, va="top", color="#666666")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("position in the document (tokens)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(f"Perplexity by position: {data['documents']} documents of {data['length']} tokens from "
                 f"{Path(str(data['data'])).name}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save_png(fig, path)
