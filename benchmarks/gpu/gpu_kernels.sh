#!/usr/bin/env bash
# The Triton kernels on a GPU machine: tests, launch-config sweep, benchmark.
#
#   benchmarks/gpu/gpu_kernels.sh test  [OUT]   the GPU tests (marked gpu) of tests/ops/ (kernels vs torch reference:
#                                        test_gla.py, test_window_attn.py, test_lizard_attn.py, test_backend.py),
#                                        tests/bench/test_kernels_bench.py and tests/models/test_decode.py
#                                        (Triton decode step, CUDA graphs)
#   benchmarks/gpu/gpu_kernels.sh tune  [OUT]   time the candidate launch configs (bench/kernels.py *_CANDIDATES)
#   benchmarks/gpu/gpu_kernels.sh bench [OUT]   the side-by-side benchmark: OUT/kernels.{json,md,png}
#   benchmarks/gpu/gpu_kernels.sh all   [OUT]   test, then bench
#   benchmarks/gpu/gpu_kernels.sh tunetest [OUT]  test and tune (compiling side by side, timing alone)
#   benchmarks/gpu/gpu_kernels.sh full  [OUT]   test, tune, then bench with the fastest tuned configs
#   benchmarks/gpu/gpu_kernels.sh h200  [OUT]   on an H200 only (elsewhere exit 3 at once, costing no time): the bench with
#                                        --host over SDPA, fla, our GLA and Lizard (OUT/kernels.*), then where
#                                        the Lizard step's GPU time goes (OUT/profile/); issue 6's last target
#   benchmarks/gpu/gpu_kernels.sh newbwd [OUT]  the GPU tests of the two one-kernel backwards (gla_gluon.bwd_fused,
#                                        the walking window backward), then, if they pass, the bench of the
#                                        defaults beside the two-pass backward they replaced, and SDPA
#
# OUT defaults to $OUT (the device tool's output folder) or runs/bench. BENCH_REPS (default 20): the
# least timed calls per bench cell; TUNED=path/tune.json: bench with the fastest configs of a tune run.
# Optional extras, if a folder device_carry_k/ is present (git-ignored; made on the dev machine by
# benchmarks/gpu/device_carry.sh, and carried to the device with the call):
#   device_carry_k/whl/*.whl  installed with pip --no-deps into /tmp/site (fla_core, einops)
#   device_carry_k/py/        pure-Python packages put on PYTHONPATH (pytest, pluggy, iniconfig)
# Each kernel record in docs/results/ (its index: docs/results/README.md) names the mode and the command it came from.
set -euo pipefail
WHAT=${1:-all}
cd "$(dirname "$0")/../.."
OUT_DIR=${2:-${OUT:-runs/bench}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
EXTRA=""
if [ -d device_carry_k/whl ] && ls device_carry_k/whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site device_carry_k/whl/*.whl \
        && EXTRA=/tmp/site
fi
[ -d device_carry_k/py ] && EXTRA="${EXTRA:+$EXTRA:}$PWD/device_carry_k/py"
export PYTHONPATH="$PWD/src:$PWD/tests${EXTRA:+:$EXTRA}${PYTHONPATH:+:$PYTHONPATH}"
NPROC=$(nproc)

run_tests() {
    # Compilation dominates: split the GPU tests over several processes (the GPU work is small).
    # TEST_FILTER narrows the kernel tests (a pytest -k expression, with -m gpu).
    { python3 -m pytest -q --co tests/ops tests/bench/test_kernels_bench.py -m gpu ${TEST_FILTER:+-k "$TEST_FILTER"} 2>/dev/null
      [ -n "${TEST_FILTER:-}" ] || python3 -m pytest -q --co tests/models/test_decode.py -m gpu 2>/dev/null; } \
        | grep '::' > /tmp/gpu_tests.txt || true
    local n=$(( NPROC / 2 > 1 ? NPROC / 2 : 1 ))
    rm -f /tmp/gpu_tests_part_*
    split -n "r/$n" /tmp/gpu_tests.txt /tmp/gpu_tests_part_
    local pids=()
    for f in /tmp/gpu_tests_part_*; do
        [[ "$f" == *.log ]] && continue
        mapfile -t ids < "$f"  # test ids may hold spaces
        # a kernel whose barriers deadlock would hang its process: bound each one (TEST_TIMEOUT seconds)
        timeout "${TEST_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider "${ids[@]}" > "$f.log" 2>&1 & pids+=($!)
    done
    local rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    cat /tmp/gpu_tests_part_*.log | tee "$OUT_DIR/gpu_tests.log" | grep -E "passed|failed|Error|error|assert" | tail -40
    return $rc
}

tune_compile() {
    # fill Triton's cache from several processes (compilation is single-threaded per kernel)
    local n=$(( NPROC / 2 > 1 ? NPROC / 2 : 1 )) pids=()
    for i in $(seq 0 $((n - 1))); do
        python3 -m linearize.bench.kernels tune --out "$OUT_DIR" --compile-only --part "$i" --parts "$n" & pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || true; done
}

run_tune() {
    tune_compile
    python3 -m linearize.bench.kernels tune --out "$OUT_DIR"  # timed in one process, nothing else running
}

run_bench() {
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT_DIR/gpu.txt"
    python3 -m linearize.bench.kernels bench --out "$OUT_DIR" --reps "${BENCH_REPS:-20}" ${TUNED:+--tuned "$TUNED"}
}

case "$WHAT" in
    test) run_tests ;;
    tune) run_tune ;;
    bench) run_bench ;;
    h200)
        nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUT_DIR/gpu.txt"
        grep -q H200 "$OUT_DIR/gpu.txt" || { echo "not an H200"; exit 3; }
        python3 -m linearize.bench.kernels bench --host --out "$OUT_DIR" --reps "${BENCH_REPS:-10}" \
            --methods "sdpa causal,fla simple_gla,triton gla (ours),triton lizard (ours)"
        python3 -m linearize.bench.kernels profile --out "$OUT_DIR/profile" --shapes 16x2048 \
            --methods "triton lizard (ours)" ;;
    all) run_tests; run_bench ;;
    newbwd)
        if TEST_FILTER="fused_backward or walk" run_tests; then
            nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT_DIR/gpu.txt"
            python3 -m linearize.bench.kernels bench --out "$OUT_DIR" --reps "${BENCH_REPS:-10}" --methods \
                "sdpa causal,triton gla (ours),triton gla two-pass bwd (ours),triton lizard (ours),triton lizard two-pass bwd (ours)"
        else
            echo "NEW BACKWARD KERNELS FAILED THEIR GPU TESTS: no bench"
        fi ;;
    full)  # tests and the sweep's compilation side by side, the sweep's timing, then the bench with its best configs
        run_tests > "$OUT_DIR/tests.out" 2>&1 & tp=$!
        tune_compile
        wait "$tp" || echo "SOME GPU TESTS FAILED"
        grep -E "passed|failed|Error|assert" "$OUT_DIR/tests.out" | tail -30
        python3 -m linearize.bench.kernels tune --out "$OUT_DIR"
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT_DIR/gpu.txt"
        python3 -m linearize.bench.kernels bench --out "$OUT_DIR" --reps "${BENCH_REPS:-20}" --tuned "$OUT_DIR/tune.json" ;;
    tunetest)  # tests and the sweep's compilation side by side, then the timing alone
        run_tests > "$OUT_DIR/tests.out" 2>&1 & tp=$!
        tune_compile
        wait "$tp" || echo "SOME GPU TESTS FAILED"
        cat "$OUT_DIR/tests.out"
        python3 -m linearize.bench.kernels tune --out "$OUT_DIR" ;;
    *) echo "usage: $0 test|tune|bench|all|tunetest|full|newbwd [OUT]" >&2; exit 2 ;;
esac
