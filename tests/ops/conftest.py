"""Fixtures of the kernel tests that several op files share (test_gla.py, test_window_attn.py,
test_lizard_attn.py, test_delta_fast.py): the Triton interpreter's results of a file's own cases,
and the spies on the Gluon launchers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import once_per_session
from kernel_checks import _gluon_spy

TESTS = Path(__file__).resolve().parents[1]  # tests/, where kernel_cases.py lives


@pytest.fixture(scope="module")
def interpreter_results(request, tmp_path_factory):
    """The interpreter cases of the test module's op (its ``INTERPRETER_OP``, a key of
    kernel_cases.CASE_OPS) in one subprocess (one Triton import, one torch start-up): each op file
    runs its own cases, none twice, and once per session (xdist workers that share a module's
    cases share their results)."""
    op = request.module.INTERPRETER_OP

    def interpret(folder: Path) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1", LINEARIZE_KERNELS="1", CUDA_VISIBLE_DEVICES="")
        proc = subprocess.run([sys.executable, str(TESTS / "kernel_cases.py"), op], cwd=TESTS, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
        (folder / "results.json").write_text(proc.stdout.strip().splitlines()[-1])

    folder = once_per_session(request, tmp_path_factory, f"interpreter-{op}", interpret)
    return json.loads((folder / "results.json").read_text())


@pytest.fixture
def gluon_chunk_calls(monkeypatch):
    """The calls of the Gluon chunk pass (kernels/gla_gluon.py) while the test runs."""
    return _gluon_spy(monkeypatch, "gla.gluon", "bwd_chunks", "dv_add")


@pytest.fixture
def gluon_fused_calls(monkeypatch):
    """The calls of the fused Gluon backward (kernels/gla_gluon.py, bwd_fused) while the test runs,
    by their segment length in chunks."""
    return _gluon_spy(monkeypatch, "gla.gluon", "bwd_fused", "seg_chunks")


@pytest.fixture
def gluon_window_calls(monkeypatch):
    """The calls of the Gluon window backward (kernels/window_gluon.py) while the test runs."""
    return _gluon_spy(monkeypatch, "window_attn.gluon", "bwd", "window")

