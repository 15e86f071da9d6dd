#!/usr/bin/env bash
# Builds device_carry_k/ (git-ignored) for benchmarks/gpu/gpu_kernels.sh on a GPU machine without internet
# or these packages: the fla-core and einops wheels (the bench's fla rows; installed there with
# pip --no-deps) and pytest with its pure-Python dependencies, unpacked (put on PYTHONPATH there).
# Takes them from the pip index this machine has; about 3 MB in all, so it travels with a device call.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
DL=$(mktemp -d)
rm -rf device_carry_k
mkdir -p device_carry_k/whl device_carry_k/py
"$PY" -m pip download -q --no-deps -d device_carry_k/whl fla-core==0.6.0 einops 2>&1 | grep -v '^WARNING' || true
"$PY" -m pip download -q --no-deps -d "$DL" pytest pluggy iniconfig packaging 2>&1 | grep -v '^WARNING' || true
for w in "$DL"/*.whl; do "$PY" -m zipfile -e "$w" device_carry_k/py; done
rm -rf "$DL"
ls device_carry_k/whl device_carry_k/py
du -sh device_carry_k
