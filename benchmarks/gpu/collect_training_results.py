"""Gather finished training runs (their summary.json and metrics.jsonl) into one JSON and one
Markdown table: python3 benchmarks/gpu/collect_training_results.py RUN_DIR... --out DIR"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path


def run_record(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    config = json.loads((run / "config.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = {}
    for rec in metrics:
        if rec.get("split") == "val":
            val.setdefault(rec["stage"], []).append(rec)
    first_last = {stage: {"first": recs[0], "last": recs[-1]} for stage, recs in val.items()}
    return {"run": run.name, "config": config, "summary": summary, "validation": first_last}


def environment() -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def markdown(records: list[dict], env: dict) -> str:
    lines = ["# Two-stage training of SmolLM2-135M-Instruct", "",
             f"GPU: {env.get('gpu', 'none')}; torch {env['torch']}, transformers {env['transformers']}.", "",
             "| method | stage | tokens | steps | tokens/s | peak GPU memory | validation (first -> last) |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        for st in r["summary"]["stages"]:
            v = r["validation"].get(st["stage"], {})
            change = (f"{v['first']['loss']:.4g} -> {v['last']['loss']:.4g}" if v else "")
            peak = st.get("peak_memory_bytes")
            lines.append(f"| {r['run']} | {st['stage']} | {st['tokens']:,} | {st['steps']} | "
                         f"{st['tokens_per_s'] or 0:,.0f} | {peak / 2**30:.2f} GiB | {change} |" if peak else
                         f"| {r['run']} | {st['stage']} | {st['tokens']:,} | {st['steps']} | "
                         f"{st['tokens_per_s'] or 0:,.0f} | n/a | {change} |")
    lines += ["", "Validation perplexity on held-out plays (the same rows for teacher and student):", "",
              "| model | validation loss | perplexity |", "|---|---|---|"]
    if records:
        s = records[0]["summary"]
        lines.append(f"| teacher | {s['teacher_val_loss']:.4f} | {s['teacher_val_ppl']:.2f} |")
    for r in records:
        s = r["summary"]
        lines.append(f"| {r['run']} student | {s['student_val_loss']:.4f} | {s['student_val_ppl']:.2f} |")
    lines += ["", "Stage 1 validation loss is the sum over layers of the per-head MSE to the teacher's attention "
              "output; stage 2's is next-token cross-entropy.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    records = [run_record(r) for r in args.runs if (r / "summary.json").is_file()]
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "training-smollm2.json").write_text(json.dumps({"environment": env, "runs": records}, indent=2))
    (args.out / "training-smollm2.md").write_text(markdown(records, env))
    print(markdown(records, env))


if __name__ == "__main__":
    main()
