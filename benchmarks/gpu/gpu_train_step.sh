#!/usr/bin/env bash
# The training step on a GPU machine: the GPU tests of the graphed step, then `bench train` side by side
# (teacher + LoRA and the students' stages, eager and as CUDA graphs) at the issue's cells.
#
#   benchmarks/gpu/gpu_train_step.sh [OUT] [METHODS]   METHODS: comma list (default lizard)
#
# Cells: SmolLM2-135M (random weights) B8 T2048 and B1 T16384, and the first 4 layers of Llama-3-8B B4 T2048.
# Optional pytest from device_carry_k/py (see gpu_kernels.sh). BENCH_STEPS (default 8) timed steps per cell;
# GRAPHS=graph times only linearize train's default (graphed) step; CELLS picks cells (default all three:
# smollm2-2k,smollm2-16k,llama3-8b-4l). The GPU tests include the ops whose kernels the methods take
# (LoLCATs' bands, the sparse window's live form).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${1:-${OUT:-runs/bench}}
METHODS=${2:-lizard}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
EXTRA=""
[ -d device_carry_k/py ] && EXTRA="$PWD/device_carry_k/py"
export PYTHONPATH="$PWD/src:$PWD/tests${EXTRA:+:$EXTRA}${PYTHONPATH:+:$PYTHONPATH}"
STEPS=${BENCH_STEPS:-8}
if [ -z "${SKIP_TESTS:-}" ]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/train/test_graphs.py tests/bench/test_bench_train.py \
        tests/ops/test_lolcats_attn.py tests/ops/test_sparse_window.py > "$OUT_DIR/gpu_tests.log" 2>&1 || true
    tail -5 "$OUT_DIR/gpu_tests.log"
fi
set +e
CELLS=${CELLS:-smollm2-2k,smollm2-16k,llama3-8b-4l}
bench() { local name=$1; shift
          [[ ",$CELLS," == *",$name,"* ]] || return 0
          python3 -m linearize.bench.train --backends kernels --steps "$STEPS" --warmup 2 ${GRAPHS:+--graphs $GRAPHS} \
              --methods ${METHODS//,/ } --out "$OUT_DIR/$name" "$@" > "$OUT_DIR/$name.log" 2>&1
          echo "bench $name $* -> exit $?"; grep -v "bench train:" "$OUT_DIR/$name.log" | tail -30; }
bench smollm2-2k --models smollm2-135m-random --seq-lens 2048 --batch-size 8
bench smollm2-16k --models smollm2-135m-random --seq-lens 16384 --batch-size 1
bench llama3-8b-4l --models llama3-8b-random --layers 4 --seq-lens 2048 --batch-size 4
