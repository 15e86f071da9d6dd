"""Perplexity of teachers and students on the same token stream from any text source.

The documents of a source (``linearize.data.sources.load_documents``: a local JSON/JSONL/text
file or folder, ``shakespeare``, a HF dataset name where a network exists) are joined with EOS
into one stream of at most ``max_tokens`` tokens. Every token after the first is scored once:

- a linearized model reads the stream in pieces of ``piece`` tokens carrying its state, so each
  token is conditioned on everything before it (its memory is constant, whatever the length);
- a softmax model reads it in sliding windows of ``window`` tokens (default: its trained context)
  moved by ``stride``; each window scores only its last ``stride`` tokens (the first window all
  of them), so a token is conditioned on at least ``window - stride`` earlier ones.

Both give ppl = exp(mean negative log-likelihood over the same tokens).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..data.sources import load_documents
from ..models.loading import check_model_name, context_length, is_linearized, load_model, model_label
from ..records import environment, markdown_table, new_figure, save_png, write_outputs

STEM = "ppl"


def token_stream(documents: list[list[int]], eos_id: int | None, max_tokens: int) -> torch.Tensor:
    """The documents joined (EOS between them) and cut to ``max_tokens``: (1, T) int64."""
    ids: list[int] = []
    for doc in documents:
        if ids and eos_id is not None:
            ids.append(eos_id)
        ids.extend(doc)
        if len(ids) >= max_tokens:
            break
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s); perplexity needs at least 2")
    return torch.tensor(ids[:max_tokens], dtype=torch.long)[None]


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (1, n, V), targets (1, n) -> (n,) fp32 NLL per token, on the CPU."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="none").cpu()


@torch.no_grad()
def stream_token_nll(model, ids: torch.Tensor, piece: int = 4096, progress=None) -> torch.Tensor:
    """NLL of tokens 1..T-1 of ``ids`` (1, T), as (T-1,), for a stateful model reading ``ids`` in
    pieces of ``piece`` tokens with its cache (constant memory for linearized layers)."""
    cache, parts = None, []
    device = next(model.parameters()).device
    last_logits = None
    for start in range(0, ids.shape[1], piece):
        chunk = ids[:, start:start + piece].to(device)
        out = model(chunk, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits
        if last_logits is not None:  # the previous piece's last position predicts this piece's first token
            logits = torch.cat([last_logits, logits], dim=1)
            targets = chunk
        else:
            targets = chunk[:, 1:]
        parts.append(_token_nll(logits[:, :targets.shape[1]], targets))
        last_logits = out.logits[:, -1:]
        if progress is not None:
            progress.update(chunk.shape[1])
    return torch.cat(parts)


@torch.no_grad()
def sliding_token_nll(model, ids: torch.Tensor, window: int, stride: int, progress=None) -> torch.Tensor:
    """NLL of tokens 1..T-1 of ``ids`` (1, T), as (T-1,), in windows of ``window`` tokens moved by
    ``stride``: each token is scored once, with at least ``window - stride`` tokens before it
    (all of them inside the first window)."""
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in 1..window ({window}), got {stride}")
    device = next(model.parameters()).device
    T = ids.shape[1]
    parts, done = [], 1  # tokens [0, done) are scored (token 0 never is)
    start = 0
    while done < T:
        end = min(start + window, T)
        logits = model(ids[:, start:end].to(device)).logits  # position i predicts token start + i + 1
        first = done  # score tokens first..end-1
        parts.append(_token_nll(logits[:, first - start - 1:end - start - 1], ids[:, first:end].to(device)))
        if progress is not None:
            progress.update(end - first)
        done = end
        # the next window keeps at least one token of context before its first scored token
        start = max(0, min(start + stride, T - window, done - 1))
    return torch.cat(parts)


def stream_nll(model, ids: torch.Tensor, piece: int = 4096, progress=None) -> tuple[float, int]:
    """(sum of NLL, tokens scored) of ``stream_token_nll``."""
    nll = stream_token_nll(model, ids, piece, progress)
    return nll.double().sum().item(), nll.numel()


def sliding_nll(model, ids: torch.Tensor, window: int, stride: int, progress=None) -> tuple[float, int]:
    """(sum of NLL, tokens scored) of ``sliding_token_nll``."""
    nll = sliding_token_nll(model, ids, window, stride, progress)
    return nll.double().sum().item(), nll.numel()


def model_token_nll(model, ids: torch.Tensor, window: int | None, stride: int | None, piece: int,
                    progress=None) -> tuple[torch.Tensor, str]:
    """(NLL of tokens 1..T-1 of ``ids`` as (T-1,), how it was read): a linearized model in one pass
    carrying its state, a softmax model in sliding windows (default: its context, half of it as stride)."""
    if is_linearized(model):
        return stream_token_nll(model, ids, piece, progress), f"one pass carrying state (pieces of {piece} tokens)"
    window = min(window or context_length(model) or 2048, ids.shape[1])
    stride = min(stride or max(1, window // 2), window)
    return sliding_token_nll(model, ids, window, stride, progress), f"sliding window {window}, stride {stride}"


def model_nll(model, ids: torch.Tensor, window: int | None, stride: int | None, piece: int, progress=None) -> dict:
    nll, how = model_token_nll(model, ids, window, stride, piece, progress)
    mean = nll.double().mean().item()
    return {"nll": mean, "ppl": math.exp(mean), "tokens": nll.numel(), "how": how}


def run_ppl(models: Sequence[str], data: str, out_dir: str | Path, *, max_tokens: int = 16384,
            window: int | None = None, stride: int | None = None, piece: int = 4096, text_field: str | None = None,
            device: str | None = None, dtype: torch.dtype | None = None) -> dict:
    """Perplexity of each model on ``data``; writes ppl.json, ppl.png and ppl.md."""
    from tqdm.auto import tqdm

    if not models:
        raise ValueError("give at least one model (a checkpoint directory or a teacher name)")
    for name in models:  # a mistyped path among several: said before the first model is evaluated
        check_model_name(str(name))
    for name, value in (("max_tokens", max_tokens), ("piece", piece), ("window", window), ("stride", stride)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
            raise ValueError(f"{name} must be an integer >= 2, got {value!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None and str(device).startswith("cuda"):
        dtype = torch.bfloat16
    results, stream_ids = [], None
    for name in models:
        model, tokenizer = load_model(name, device=device, dtype=dtype)
        if tokenizer is None:
            raise ValueError(f"model {name} has no tokenizer files; perplexity on text needs one")
        documents = load_documents(data, tokenizer, text_field=text_field or "text", max_tokens=max_tokens)  # reads no further
        ids = token_stream(documents, tokenizer.eos_token_id, max_tokens)
        if stream_ids is None:
            stream_ids = ids
        elif not torch.equal(ids, stream_ids):
            raise ValueError(f"model {name} tokenizes the text differently from {models[0]}; "
                             "perplexities would not be comparable")
        start = time.perf_counter()
        with tqdm(total=ids.shape[1], desc=f"ppl {name}", unit="tok") as bar:
            r = model_nll(model, ids, window, stride, piece, bar)
        results.append({"model": name, "label": model_label(name, model), "linearized": is_linearized(model),
                        "context_length": context_length(model), "seconds": time.perf_counter() - start, **r})
        del model
    data_out = {"data": data, "tokens": int(stream_ids.shape[1]), "models": results, "environment": environment(device)}
    write_outputs(out_dir, STEM, data_out, ppl_markdown, ppl_figure)
    return data_out


def ppl_markdown(data: dict) -> str:
    rows = [[m["label"], f"{m['ppl']:.3f}", f"{m['nll']:.4f}", m["tokens"], m["how"]] for m in data["models"]]
    env = data["environment"]
    return "\n".join([f"# Perplexity on {data['data']}", "",
                      f"{data['tokens']} tokens; every token after the first scored once.", "",
                      markdown_table(["model", "perplexity", "NLL / token", "tokens scored", "how"], rows), "",
                      f"Device: {env['device']}; torch {env['torch']}. Command: `{env['command']}`", ""])


def ppl_figure(data: dict, path: Path) -> None:
    models = data["models"]
    fig, ax = new_figure((1.5 + 1.1 * len(models), 3.6))
    colors = ["#1a9641" if m["linearized"] else "#404040" for m in models]
    bars = ax.bar(range(len(models)), [m["ppl"] for m in models], color=colors)
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(models)), [m["label"] for m in models], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(f"Perplexity on {Path(str(data['data'])).name} ({data['tokens']} tokens)", fontsize=9)
    save_png(fig, path)
