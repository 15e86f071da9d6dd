#!/usr/bin/env bash
# Nsight Compute on one Lizard training step (benchmarks/probes/ncu_lizard_step.py), on a GPU machine with ncu
# (the device's Firecracker machines; not gVisor):
#
#   benchmarks/probes/ncu_lizard.sh OUT [NAME] [SHAPE] [KERNELS]
#
# profiles the three kernels of the step (KERNELS: an ncu regex of kernel names; default the fused
# forward, the fused gated backward and the walking window backward) with every section (--set full)
# at the GPU's own clocks, and writes OUT/NAME-details.txt (each kernel's sections), OUT/NAME-raw.csv
# (every metric) and OUT/NAME-source.csv.gz (per SASS instruction: issue and stall samples).
set -euo pipefail
OUT_DIR=$1
NAME=${2:-step}
SHAPE=${3:-16x2048}
KERNELS=${4:-_lizard_fwd_kernel|_gla_bwd_fused_kernel|_win_bwd_walk_kernel}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
mkdir -p "$OUT_DIR"
REP=/tmp/ncu-$NAME
"$NCU" --clock-control none --profile-from-start off --set full --import-source no -k "regex:$KERNELS" -f -o "$REP" \
    python3 "$(dirname "$0")/ncu_lizard_step.py" --shape "$SHAPE"
"$NCU" -i "$REP.ncu-rep" --page details --print-units base > "$OUT_DIR/$NAME-details.txt"
"$NCU" -i "$REP.ncu-rep" --page raw --csv > "$OUT_DIR/$NAME-raw.csv"
"$NCU" -i "$REP.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT_DIR/$NAME-source.csv.gz" || true
