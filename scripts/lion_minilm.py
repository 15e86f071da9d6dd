"""The LION MiniLM results run: convert the bundled all-MiniLM-L6-v2 to LION, train both stages on
local text on the CPU, evaluate on held-out sentences and time the attention forms, and record
docs/results/lion-minilm.{md,json,png}.

    .venv/bin/python scripts/lion_minilm.py --method lion-s \\
        --data /work/shared/data/wiki_demo.txt,/work/shared/data/c4_demo.jsonl --out runs/lion-minilm-s

Everything it measures comes from the library (``linearize.train.encoder.run_encoder`` and
``linearize.eval.embed.run_embed_eval``); this file only picks the settings, times the training
and writes the record. ``--resume`` continues a killed run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from linearize.eval.common import environment, markdown_table, write_outputs
from linearize.eval.embed import DEFAULT_LENGTHS, embed_figure, embed_markdown, run_embed_eval
from linearize.train import TrainConfig
from linearize.train.encoder import run_encoder

TARGETS = {"nn_agreement": 0.9, "mean_cosine": 0.95, "train_minutes": 30.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="lion-s", choices=["lion-lit", "lion-d", "lion-s"])
    p.add_argument("--data", default="shakespeare")
    p.add_argument("--out", default="runs/lion-minilm")
    p.add_argument("--results", default="docs/results", help="where lion-minilm.{md,json,png} go ('' = nowhere)")
    p.add_argument("--stem", default="lion-minilm")
    p.add_argument("--threads", type=int, default=1, help="torch threads for training and timing")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--stage1-tokens", type=int, default=150_000)
    p.add_argument("--stage2-tokens", type=int, default=350_000)
    p.add_argument("--stage1-lr", type=float, default=1e-2)
    p.add_argument("--stage2-lr", type=float, default=3e-3)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--distill", type=float, default=1.0, help="weight of the hidden-state term in stage 2")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--val-sentences", type=int, default=256)
    p.add_argument("--eval-sentences", type=int, default=1000)
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    config = TrainConfig(
        method=args.method, model="minilm-l6", data=args.data, out=args.out, seq_len=args.seq_len,
        val_rows=args.val_sentences, batch_size=args.batch_size, stage1_tokens=args.stage1_tokens,
        stage2_tokens=args.stage2_tokens, stage1_lr=args.stage1_lr, stage2_lr=args.stage2_lr,
        lora_rank=args.lora_rank, lora_alpha=2.0 * args.lora_rank, distill=args.distill,
        overrides={"chunk_size": args.chunk_size},
        eval_every=50, save_every=50, device="cpu", progress=True)
    wall, cpu = time.perf_counter(), time.process_time()
    run_encoder(config, resume=args.resume)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    summary = json.loads((Path(args.out) / "summary.json").read_text())

    lengths = [int(n) for n in args.lengths.split(",") if n]
    data = run_embed_eval(args.out, args.data, Path(args.out) / "eval", sentences=args.eval_sentences,
                          timing=not args.no_timing, lengths=lengths, threads=args.threads)
    data["training"] = {"wall_minutes": wall / 60, "cpu_minutes": cpu / 60, "threads": args.threads,
                        "resumed": args.resume, "config": config.to_dict(), "summary": summary}
    data["targets"] = TARGETS
    data["environment"] = environment("cpu")
    data["environment"]["command"] = " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])
    if args.results:
        write_outputs(args.results, args.stem, data, results_markdown, embed_figure)
    return 0


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def results_markdown(data: dict) -> str:
    trained = next(r for r in data["quality"] if r["model"] == "trained")
    untrained = next(r for r in data["quality"] if r["model"] == "untrained")
    t, tg = data["training"], data["targets"]
    stages = {s["stage"]: s for s in t["summary"]["stages"]}
    c = t["config"]
    lines = [f"# LION on all-MiniLM-L6-v2: {data['method']}", "",
             f"Command (CPU, {t['threads']} torch thread(s)): `{data['environment']['command']}`", "",
             f"Machine: {data['environment']['device']}, shared with other jobs; torch {data['environment']['torch']}. "
             f"Training (teacher embeddings, stage 1, stage 2, checkpoint): **{t['wall_minutes']:.1f} min wall**, "
             f"{t['cpu_minutes']:.1f} min CPU" + (" (resumed run: wall time of the last part only)" if t["resumed"] else "")
             + ".", "",
             f"Data: `{data['data']}`, sentences of 5-64 words; ~10% held out by a hash of the text and never trained "
             f"on. Stage 1 (attention transfer, {stages.get('stage1', {}).get('steps', 0)} steps of "
             f"{c['batch_size']} sentences, lr {c['stage1_lr']:g}): LION heads vs the encoder's own softmax heads, "
             f"teacher-forced. Stage 2 ({stages.get('stage2', {}).get('steps', 0)} steps, lr {c['stage2_lr']:g}): "
             f"LoRA rank {c['lora_rank']} on query/key/value/dense + the LION parameters, loss 1 - cos(student, "
             f"teacher) on the pooled, L2-normalised sentence embeddings + {c['distill']:g} x the summed relative MSE "
             "of every layer's hidden states against the teacher's.", "",
             "Stage times: " + ", ".join(f"{name} {s['steps']} steps in {s['seconds'] / 60:.1f} min"
                                         for name, s in stages.items()) + ".", "",
             "## Targets", "",
             markdown_table(["target", "measured", ""], [
                 [f"NN agreement >= {tg['nn_agreement']}", f"{trained['nn_agreement']:.3f} "
                  f"(untrained {untrained['nn_agreement']:.3f})", _met(trained["nn_agreement"] >= tg["nn_agreement"])],
                 [f"mean cosine >= {tg['mean_cosine']}", f"{trained['mean_cosine']:.4f} "
                  f"(untrained {untrained['mean_cosine']:.4f})", _met(trained["mean_cosine"] >= tg["mean_cosine"])],
                 [f"CPU training < {tg['train_minutes']:g} min", f"{t['wall_minutes']:.1f} min wall",
                  _met(t["wall_minutes"] < tg["train_minutes"])],
                 ["chunk faster than SDPA at 16K", _chunk_vs_sdpa(data.get("cost"), 16384),
                  _met(_chunk_wins(data["cost"], 16384)) if _measured(data.get("cost"), 16384) else "not measured"],
             ]), ""]
    body = embed_markdown(data).split("\n", 1)[1]  # the eval's own tables, under this page's title
    lines += ["## Held-out evaluation (`linearize.eval.embed`)", body.replace("## One attention", "### One attention")]
    lines += ["## Positions beyond 512", "",
              "MiniLM (like BERT) adds a learned absolute position embedding per token, with 512 of them. The "
              "converted encoder runs any length: LION itself needs no positions, and with the default "
              "`positions=\"clamp\"` tokens past 511 reuse the last position embedding (ids 0..511, 511, 511, ...), "
              "so the first 512 tokens are embedded exactly as the teacher embeds them; `positions=\"error\"` "
              "refuses longer inputs instead. The timing table above is one attention layer on random q/k/v, "
              "where positions play no part.", ""]
    return "\n".join(lines)


def _measured(cost: dict | None, n: int) -> bool:
    try:
        i = [r["tokens"] for r in cost["forms"]["sdpa"]].index(n)
        return "ms" in cost["forms"]["sdpa"][i] and "ms" in cost["forms"]["chunk"][i]
    except (KeyError, TypeError, ValueError):
        return False


def _chunk_wins(cost: dict, n: int) -> bool:
    try:
        i = [r["tokens"] for r in cost["forms"]["sdpa"]].index(n)
        return cost["forms"]["chunk"][i]["ms"] < cost["forms"]["sdpa"][i]["ms"]
    except (KeyError, ValueError):
        return False


def _chunk_vs_sdpa(cost: dict | None, n: int) -> str:
    if not _measured(cost, n):
        return "not measured"
    try:
        i = [r["tokens"] for r in cost["forms"]["sdpa"]].index(n)
        return f"chunk {cost['forms']['chunk'][i]['ms']:.0f} ms vs SDPA {cost['forms']['sdpa'][i]['ms']:.0f} ms"
    except (KeyError, ValueError):
        return "not measured"


if __name__ == "__main__":
    sys.exit(main())
