"""``eval embed``: how close a LION encoder's sentence embeddings stay to its teacher's, and what
each LION form costs against softmax attention as inputs grow.

Quality, on held-out sentences (``train.encoder.load_sentences(data, split="test")``: the ~10% of
sentences that training never sees, fixed by a hash of their text):

- mean (and minimum) cosine similarity between the student's and the teacher's embeddings
  (mean pooling + L2 normalisation, the sentence-transformers recipe of all-MiniLM-L6-v2);
- nearest-neighbour agreement: for each sentence, is its nearest other sentence (cosine) under the
  student the one the teacher picks? (over the ``sentences`` held-out sentences);

for the trained checkpoint and, always beside it, the same conversion untrained (fresh feature
maps and decays, no LoRA, seed 0).

Cost (``timing=True``): one attention layer of the model's shape (batch 1, its heads and head
size) at lengths from 512 to 32K tokens, no gradient, for each LION form (the layer's feature
maps, decay and op) against SDPA softmax on the same q/k/v. Each (form, length) runs in a fresh
Python process: "extra memory" is its peak resident memory while the layer runs minus the
resident memory just before (inputs allocated; the output counts as extra), read from
``/proc/self/status`` after resetting the peak (Linux); time is the median of repeated calls after
one warm-up call. The parallel form is skipped where its T x T tensors would pass
``memory_limit_gb``.

Writes ``embed.json``, ``embed.png`` (drawn from the JSON as read back) and ``embed.md``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from ..data.sentences import load_sentences
from ..models.checkpoint import load, read_meta
from ..models.convert import convert
from ..models.encoder import embed, lion_layers, nn_agreement
from ..models.lora import merge_lora
from ..models.teacher import load_teacher
from ..records import environment, markdown_table, new_figure, save_png, write_outputs
from .layer_cost import measure_layer

STEM = "embed"
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
FORMS = ("sdpa", "parallel", "recurrent", "chunk")


# ------------------------------------------------------------------------------------ quality


def embedding_quality(student: torch.Tensor, teacher: torch.Tensor) -> dict:
    """Cosine and nearest-neighbour agreement of two (N, D) embedding sets, row i = sentence i, with
    the agreement's binomial standard error over the N sentences (``nn_agreement_se``, see ``agreement_se``)."""
    cos = torch.nn.functional.cosine_similarity(student.double(), teacher.double(), dim=-1)
    nn = nn_agreement(student, teacher)
    return {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()), "nn_agreement": nn,
            "nn_agreement_se": agreement_se(nn, student.shape[0])}


def agreement_se(agreement: float, sentences: int) -> float:
    """sqrt(p (1 - p) / N): the standard error of an agreement p measured on N sentences, as if each
    sentence were an independent trial. A sentence's neighbours come from the same sample, so this
    is a guide to how much another sample of N sentences could move the figure, not a bound."""
    return math.sqrt(max(agreement * (1 - agreement), 0.0) / sentences)


def agreement_text(row: dict, sentences: int) -> str:
    """'0.878 ± 0.010' (records written before the standard error was stored get it computed)."""
    se = row.get("nn_agreement_se", agreement_se(row["nn_agreement"], sentences))
    return f"{row['nn_agreement']:.3f} ± {se:.3f}"


def _untrained_like(meta: dict, device):
    model, _ = load_teacher(meta["base"]["name"], device=device)
    torch.manual_seed(0)
    return convert(model, meta["method"], softmax_layers=meta["softmax_layers"], **meta["overrides"])


# ------------------------------------------------------------------------------------ cost


def _measure_in_subprocess(spec: dict, timeout: float) -> dict:
    # (layer_cost imports torch and the LION layer alone: transformers would take seconds per process)
    code = ("import json, sys; from linearize.eval.layer_cost import measure_layer; "
            "spec = json.loads(sys.argv[1]); print('RESULT ' + json.dumps(measure_layer(**spec)))")
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"skipped": f"took longer than {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"skipped": f"failed: {tail[0][:200]}"}
    return json.loads(lines[-1][len("RESULT "):])


def parallel_bytes(length: int, heads: int) -> int:
    """What the parallel form's (1, H, T, T) fp32 tensors take at their peak (about four alive)."""
    return 4 * 4 * heads * length * length


def attention_cost(lion: dict, *, heads: int, head_dim: int, hidden: int, lengths: Sequence[int] = DEFAULT_LENGTHS,
                   forms: Sequence[str] = FORMS, threads: int | None = None, memory_limit_gb: float = 4.0,
                   timeout: float = 600.0, progress: bool = True) -> dict:
    """{form: [result per length]} for one attention layer (see the module docstring)."""
    bad = [f for f in forms if f not in FORMS]
    if bad:
        raise ValueError(f"forms must be among {FORMS}, got {bad}")
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be positive ints, got {list(lengths)!r}")
    threads = threads or torch.get_num_threads()
    results = {}
    for form in forms:
        results[form] = []
        for n in lengths:
            if form == "parallel" and parallel_bytes(n, heads) > memory_limit_gb * 2**30:
                r = {"skipped": f"needs about {parallel_bytes(n, heads) / 2**30:.0f} GiB (> {memory_limit_gb:g})"}
            else:
                spec = {"form": form, "length": n, "heads": heads, "head_dim": head_dim, "hidden": hidden,
                        "lion": None if form == "sdpa" else lion, "threads": threads}
                r = _measure_in_subprocess(spec, timeout)
            results[form].append({"tokens": n, **r})
            if progress:
                print(f"  {form:>9} {n:>6} tokens: {_cell(r)}", flush=True)
    return {"forms": results, "threads": threads, "batch": 1, "heads": heads, "head_dim": head_dim}


def lion_attention_cost(lion, model_config, **kw) -> dict:
    """``attention_cost`` (its keyword arguments ``kw``) of one LION layer with config ``lion`` in an encoder
    of ``model_config``'s head shapes; the result also names the variant, chunk size and exact keys."""
    import dataclasses

    heads, hidden = model_config.num_attention_heads, model_config.hidden_size
    cost = attention_cost(dataclasses.asdict(lion), heads=heads, head_dim=hidden // heads, hidden=hidden, **kw)
    cost.update(variant=lion.variant, chunk_size=lion.chunk_size, sinks=lion.sinks, window=lion.window)
    return cost


def _exact_text(cost: dict) -> str:
    """', exact scores for 1 sink + a window of 2' when the layer keeps exact keys (else '')."""
    n, w = cost.get("sinks") or 0, cost.get("window") or 0
    if not (n or w):
        return ""
    parts = ([f"{n} sink(s)"] if n else []) + ([f"a window of {w} on each side"] if w else [])
    return ", exact scores for " + " + ".join(parts)


# ------------------------------------------------------------------------------------ the eval


def run_embed_eval(checkpoint: str, data: str, out_dir: str | os.PathLike, *, sentences: int = 1000,
                   batch_size: int = 64, max_length: int = 256, timing: bool = True,
                   lengths: Sequence[int] = DEFAULT_LENGTHS, forms: Sequence[str] = FORMS, threads: int | None = None,
                   memory_limit_gb: float = 4.0, device: str | None = None, progress: bool = True) -> dict:
    """Embedding quality of a LION encoder checkpoint (and of its untrained conversion) against the
    teacher on ``sentences`` held-out sentences of ``data``, and (``timing``) the cost of each LION
    form against SDPA; writes embed.json, embed.png, embed.md under ``out_dir``. Returns the data."""
    if isinstance(sentences, bool) or not isinstance(sentences, int) or sentences < 2:
        raise ValueError(f"sentences must be an int >= 2, got {sentences!r}")
    meta = read_meta(checkpoint)
    if not str(meta.get("method", "")).startswith("lion-"):
        raise ValueError(f"{checkpoint} holds a {meta.get('method')!r} model; eval embed takes a LION encoder "
                         "checkpoint (lion-lit, lion-d, lion-s)")
    device = device or "cpu"
    held_out = load_sentences(data, split="test", max_sentences=sentences)
    if len(held_out) < 2:
        raise ValueError(f"{data!r} has {len(held_out)} held-out sentence(s); need at least 2")
    log = print if progress else (lambda *a, **k: None)
    log(f"eval embed: {len(held_out)} held-out sentences of {data}")

    teacher, tokenizer = load_teacher(meta["base"]["name"], device=device)
    kw = {"batch_size": batch_size, "max_length": max_length, "device": device}
    start = time.perf_counter()
    t_emb = embed(teacher, tokenizer, held_out, **kw)
    teacher_seconds = time.perf_counter() - start
    del teacher
    rows = []
    # the trained model with its LoRA folded into the projections, as deployed: the same function,
    # and on MiniLM the unmerged adapters took a third of the embedding time
    for label, get in (("trained", lambda: merge_lora(load(checkpoint, device=device)[0])),
                       ("untrained", lambda: _untrained_like(meta, device))):
        model = get()
        start = time.perf_counter()
        s_emb = embed(model, tokenizer, held_out, **kw)
        rows.append({"model": label, "seconds": time.perf_counter() - start, **embedding_quality(s_emb, t_emb)})
        log(f"  {label}: mean cosine {rows[-1]['mean_cosine']:.4f}, NN agreement {rows[-1]['nn_agreement']:.3f}")
        if label == "trained":
            model_config = model.config
            lion_cfg = lion_layers(model)[0].lion.config if lion_layers(model) else None
        del model
    out = {"checkpoint": str(checkpoint), "method": meta["method"], "base": meta["base"]["name"], "data": data,
           "sentences": len(held_out), "max_length": max_length, "quality": rows,
           "tokens_per_sentence": None, "teacher_seconds": teacher_seconds, "environment": environment(device)}
    enc = tokenizer(held_out, truncation=True, max_length=max_length)["input_ids"]
    out["tokens_per_sentence"] = sum(map(len, enc)) / len(enc)
    if timing and lion_cfg is not None:
        log(f"attention cost, {meta['method']} vs SDPA (batch 1, {model_config.num_attention_heads} heads of "
            f"{model_config.hidden_size // model_config.num_attention_heads}):")
        out["cost"] = lion_attention_cost(lion_cfg, model_config, lengths=list(lengths), forms=forms, threads=threads,
                                          memory_limit_gb=memory_limit_gb, progress=progress)
    write_outputs(out_dir, STEM, out, embed_markdown, embed_figure)
    return out


# ------------------------------------------------------------------------------------ outputs


def _cell(r: dict) -> str:
    if "skipped" in r:
        return f"skipped ({r['skipped']})"
    mem = "" if r.get("extra_mib") is None else f" / {r['extra_mib']:.0f} MiB"
    return f"{r['ms']:.1f} ms{mem}"


def embed_markdown(data: dict) -> str:
    env = data["environment"]
    q = {r["model"]: r for r in data["quality"]}
    lines = [f"# Sentence embeddings: {data['method']} vs its teacher {data['base']}", "",
             f"{data['sentences']} held-out sentences of `{data['data']}` (never trained on; "
             f"{data['tokens_per_sentence']:.1f} tokens each on average). Cosine: between the student's and "
             "the teacher's embedding of the same sentence. NN agreement: share of sentences whose nearest other "
             "sentence is the same under student and teacher (± its binomial standard error over the sentences: "
             "how far another sample of as many sentences could move it).", "",
             markdown_table(["model", "mean cosine", "min cosine", "NN agreement", "seconds"],
                            [[f"{data['method']} {name}", r["mean_cosine"], r["min_cosine"],
                              agreement_text(r, data["sentences"]), round(r["seconds"], 1)] for name, r in q.items()]),
             ""]
    if data.get("teacher_seconds") is not None:  # records written before it was measured lack it
        lines += [f"Seconds: embedding all {data['sentences']} sentences (batches of similar length); the teacher "
                  f"{data['base']} (softmax attention) took {data['teacher_seconds']:.1f} s.", ""]
    cost = data.get("cost")
    if cost:
        forms = list(cost["forms"])
        lengths = [r["tokens"] for r in cost["forms"][forms[0]]]
        lines += [f"## One attention layer: time / extra memory (batch 1, {cost['heads']} heads of {cost['head_dim']}, "
                  f"{cost['threads']} thread(s), no gradient; LION-{cost['variant']}, chunk {cost['chunk_size']}"
                  f"{_exact_text(cost)})", "",
                  markdown_table(["tokens", *forms],
                                 [[n, *(_cell(cost["forms"][f][i]) for f in forms)] for i, n in enumerate(lengths)]),
                  ""]
        sd, ch = cost["forms"].get("sdpa"), cost["forms"].get("chunk")
        if sd and ch:
            faster = [n for n, a, b in zip(lengths, sd, ch) if "ms" in a and "ms" in b and b["ms"] < a["ms"]]
            lines += [f"The chunk form is faster than SDPA softmax at: {', '.join(map(str, faster)) or 'no length'} tokens.", ""]
    lines += [f"Device: {env['device']}; torch {env['torch']}. Command: `{env['command']}`", ""]
    return "\n".join(lines)


def embed_figure(data: dict, path: Path) -> None:
    from matplotlib.ticker import NullLocator

    cost = data.get("cost")
    fig, axes = new_figure((12.5 if cost else 5.0, 4.0), ncols=3 if cost else 1)
    axes = list(axes) if cost else [axes]
    q = data["quality"]
    ax = axes[0]
    width = 0.38
    for j, (key, label) in enumerate((("mean_cosine", "mean cosine"), ("nn_agreement", "NN agreement"))):
        bars = ax.bar([i + (j - 0.5) * width for i in range(len(q))], [r[key] for r in q], width, label=label)
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
    ax.set_xticks(range(len(q)), [r["model"] for r in q])
    ax.set_ylim(0, 1.08)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"{data['method']} vs {data['base']}, {data['sentences']} held-out sentences", fontsize=9)
    if cost:
        for ax, key, ylabel in ((axes[1], "ms", "time per layer call (ms)"), (axes[2], "extra_mib", "extra memory (MiB)")):
            for form, results in cost["forms"].items():
                pts = [(r["tokens"], r[key]) for r in results if r.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=form, linestyle="--" if form == "sdpa" else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            lengths = [r["tokens"] for r in next(iter(cost["forms"].values()))]
            ax.set_xticks(lengths, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel("tokens")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
        axes[1].set_title(f"one attention layer, batch 1, {cost['threads']} thread(s)", fontsize=9)
        axes[2].set_title("peak resident memory above the inputs", fontsize=9)
    save_png(fig, path)


__all__ = ["attention_cost", "embed_figure", "embed_markdown", "embedding_quality", "measure_layer", "run_embed_eval"]
