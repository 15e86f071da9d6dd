"""What the kernel tests of several op files share (tests/ops/test_gla.py, test_window_attn.py,
test_lizard_attn.py, test_backend.py; tests/bench/test_kernels_bench.py): the CUDA and Triton
skips, the error check of a kernel case, and the spies and stand-ins of the Gluon launchers.
The fixtures built on them are in tests/ops/conftest.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def needs_cuda(fn):
    """A GPU test: marked ``gpu`` (benchmarks/gpu/gpu_kernels.sh selects them with ``-m gpu``) and
    skipped where no CUDA GPU is."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")(fn))


def assert_errors(errors: dict, tol: float, what: str) -> None:
    bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= tol}
    assert not bad, f"{what}: over {tol:.0e}: {bad} (all: { {k: f'{v:.1e}' for k, v in errors.items()} })"


def assert_interpreter_case(results: dict, name: str) -> None:
    """One case of ``kernel_cases.INTERPRETER_CASES`` as the interpreter subprocess ran it: no exception,
    every error within its dtype's tolerance (``CASE_TOL`` where a case is tighter, e.g. the hybrid
    case comparing kernels on vs off in fp32)."""
    from kernel_cases import CASE_TOL, INTERPRETER_CASES, KTOL

    result = results[name]
    assert "exception" not in result, result.get("exception")
    assert_errors(result["errors"], CASE_TOL.get(name, KTOL[INTERPRETER_CASES[name][2]]), name)


def _needs_hopper_gluon():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fused Gluon forward is for Hopper (sm_90)")
    pytest.importorskip("triton.experimental.gluon")


def _spy(monkeypatch, module, name: str, key: str) -> list:
    """Calls of ``module.name`` while the test runs (it still runs), each recorded by its keyword ``key``."""
    calls, run = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(k[key]) or run(*a, **k))
    return calls


def _gluon_spy(monkeypatch, module: str, name: str, key: str) -> list:
    """``_spy`` on a launcher of the Gluon module ``linearize.ops.<module>``; skips off Hopper."""
    import importlib

    _needs_hopper_gluon()
    return _spy(monkeypatch, importlib.import_module(f"linearize.ops.{module}"), name, key)


class _LaunchRecorder:
    """Stands in for a Gluon kernel on CPU: ``kernel[grid](*args, **constexprs)`` records the call,
    so that a launcher's host side (shapes, views, descriptors, the arguments it computes) runs
    without a GPU."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))
