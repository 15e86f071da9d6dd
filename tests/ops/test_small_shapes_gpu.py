"""Some of each op's interpreter cases again, on a CUDA GPU: heads of 8 to 24, rows of a few dozen
tokens, padding, partial blocks. There a kernel's tiles reach past its tensors, masked; the
interpreter does not see an access out of bounds, a GPU faults on one (the delta rule's kernels did
at heads of 16). The cases that emulate a Gluon kernel on the CPU are not here (the real kernels
take widths of 128); the delta rule's small shapes are in test_delta_fast.py."""

from __future__ import annotations

import pytest

from kernel_cases import CASE_TOL, INTERPRETER_CASES, KTOL
from kernel_checks import assert_errors, needs_cuda

CASES = ["gla bf16 norm log", "gla f32 norm log state+segments", "window bf16 sinks fused",
         "window f32 no sinks padded", "lizard bf16 sinks", "lizard f32 log segments padded",
         "sparse f32 cache q and k padded", "sparse f32 ties no sinks", "lolcats f32 padded", "lolcats bf16 state"]


def test_the_cases_exist_and_emulate_nothing():
    assert all(name in INTERPRETER_CASES and "emulated" not in name for name in CASES)


@needs_cuda
@pytest.mark.parametrize("name", CASES)
def test_gpu_small_shapes_match_reference(name):
    fn, kw, dtype = INTERPRETER_CASES[name]
    assert_errors(fn("cuda", dtype, **kw), CASE_TOL.get(name, KTOL[dtype]), f"{name} on CUDA")
