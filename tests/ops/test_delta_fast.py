"""The delta rule's fast path: the chunk form batched over chunks (``ops.delta.chunk.chunk_form``)
around one sequential scan, in torch (``scan_torch``) or on the Triton kernels
(``ops.delta.triton``), which ``delta_rule_chunk`` / ``delta_product_chunk`` pick on CUDA."""

import pytest
import torch
import torch.nn.functional as F

from helpers import TOL, assert_rel_close
from kernel_cases import KTOL, cases_of, delta_case, delta_layer_case
from kernel_checks import assert_errors, assert_interpreter_case, needs_cuda, needs_triton
from linearize.ops import delta as D
from linearize.ops.delta.chunk import chunk_form, delta_applies, scan_torch
from linearize.ops.delta.naive import virtual_log_alpha, virtual_sequence


def _inputs(T, DK=5, DV=4, B=2, H=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, DK, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, H, T, DK, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    beta = 0.1 + 0.9 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    la = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64) + 2)
    la[:, :, 3] = float("-inf")  # alpha = 0 inside the first chunk
    S0 = 0.5 * torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, beta, la, S0)]


@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 7, 64])
def test_batched_chunk_form_equals_parallel_reference(order, gated, chunk_size):
    """All chunks at once (T = 23: a short last chunk, or one chunk longer than T), from a given
    state, with or without a decay, for the delta rule and DeltaProduct of order 2 (fp64)."""
    q, k, v, beta, la, S0 = _inputs(23)
    la = la if gated else None
    st = D.DeltaProductState(S0, torch.zeros(2, 2, order - 1, 5, dtype=torch.float64),
                             torch.zeros(2, 2, order - 1, 4, dtype=torch.float64))
    ref, ref_st = D.delta_product_parallel(q, k, v, beta, order=order, state=st, log_alpha=la)
    kv, vv, bv = virtual_sequence(k, v, beta, st, order, 1e-6)
    o, S = chunk_form(q, kv, vv, bv, S0, order, chunk_size, virtual_log_alpha(la, order))
    assert_rel_close(o, ref, TOL[torch.float64], "o")
    assert_rel_close(S, ref_st.S, TOL[torch.float64], "S")


@pytest.mark.parametrize("order", [1, 2])
def test_extra_queries_read_the_same_memory(order):
    """``extra_queries``: their reads equal a second call with them as the queries (the same prep and
    scan), carry no gradient, and leave o, the state and the gradients of the first read as they are."""
    q, k, v, beta, la, S0 = _inputs(23)
    q2 = torch.randn_like(q)
    call = lambda queries, **kw: D.delta_product_chunk(queries, k, v, beta, order=order, log_alpha=la,  # noqa: E731
                                                       state=D.DeltaProductState(S0, k[:, :, :order - 1],
                                                                                 v[:, :, :order - 1]),
                                                       chunk_size=7, **kw)
    qa = q.clone().requires_grad_(True)
    o, st, extra = call(qa, extra_queries=q2)
    ref, ref_st = call(q)
    assert torch.equal(o.detach(), ref) and torch.equal(st.S, ref_st.S)
    assert_rel_close(extra, call(q2)[0], TOL[torch.float64], "extra")
    assert not extra.requires_grad
    (dq,) = torch.autograd.grad(o.sum(), qa)
    qb = q.clone().requires_grad_(True)
    (ref_dq,) = torch.autograd.grad(call(qb)[0].sum(), qb)
    assert torch.equal(dq, ref_dq)
    with pytest.raises(ValueError, match=r"extra_queries must have q's shape \(2, 2, 23, 5\) and dtype torch.float64"):
        call(q, extra_queries=q2[:, :, :5])


def test_batched_chunk_form_gradcheck():
    """DeltaProduct of order 2 with a decay (alpha = 0 at one token) and an initial state, three
    chunks of which the last is short: gradients through the batched solve, the scan and the reads."""
    q, k, v, beta, la, S0 = _inputs(7, DK=3, DV=2, B=1, H=1)
    la = la.clamp_min(-3.0)  # gradcheck steps both ways around every value; -inf has no neighbours

    def fn(q, k, v, beta, la, S0):
        st = D.DeltaProductState(S0, torch.zeros(1, 1, 1, 3, dtype=torch.float64),
                                 torch.zeros(1, 1, 1, 2, dtype=torch.float64))
        kv, vv, bv = virtual_sequence(k, v, beta, st, 2, 1e-6)
        return chunk_form(q, kv, vv, bv, S0, 2, 3, virtual_log_alpha(la, 2))

    args = tuple(x.clone().requires_grad_(True) for x in (q, k, v, beta, la, S0))
    assert torch.autograd.gradcheck(fn, args)


def test_unit_lower_inverse_is_the_inverse_and_its_gradient():
    """(I + N)^-1 from the strictly lower part of N (what is on or above the diagonal is not read),
    and the backward -T^T dT T^T against finite differences."""
    from linearize.ops.delta.chunk import unit_lower_inverse

    g = torch.Generator().manual_seed(2)
    N = torch.randn(3, 5, 5, generator=g, dtype=torch.float64)
    want = torch.linalg.inv(torch.eye(5, dtype=torch.float64) + N.tril(-1))
    torch.testing.assert_close(unit_lower_inverse(N), want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(unit_lower_inverse, (N.tril(-1).requires_grad_(True),))
    grad, = torch.autograd.grad(unit_lower_inverse(N.requires_grad_(True)).sum(), N)
    assert torch.equal(grad.triu(), torch.zeros_like(grad))  # nothing flows to what is not read


def test_torch_scan_gradcheck():
    g = torch.Generator().manual_seed(1)
    W, Kd = (0.5 * torch.randn(1, 2, 3, 4, 3, generator=g, dtype=torch.float64) for _ in range(2))
    U0 = torch.randn(1, 2, 3, 4, 2, generator=g, dtype=torch.float64)
    total = torch.rand(1, 2, 3, generator=g, dtype=torch.float64)
    S0 = torch.randn(1, 2, 3, 2, generator=g, dtype=torch.float64)
    args = tuple(x.requires_grad_(True) for x in (W, U0, Kd, total, S0))
    assert torch.autograd.gradcheck(scan_torch, args)


@needs_triton
def test_fast_path_applies_only_where_the_kernels_run(monkeypatch):
    """The Triton scan is picked for bf16/fp16/fp32 inputs of widths <= 128 on a kernel device
    (the CPU counts only under the interpreter), with kernels enabled; fp64 and wider heads keep
    the torch scan."""
    q, k, v, beta, la, S0 = _inputs(8, dtype=torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not delta_applies(q, k, v, beta, la, (S0,))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert delta_applies(q, k, v, beta, la, (S0,)) and delta_applies(q.bfloat16(), k, v.half(), beta, None)
    assert not delta_applies(q.double(), k, v, beta, la, (S0,))
    assert not delta_applies(q, k, v, beta, la, (S0.double(),))
    wide = torch.zeros(2, 2, 8, 129)
    assert not delta_applies(wide, wide, v, beta, la)
    assert delta_applies(q, k, v, beta, la, order=128) and not delta_applies(q, k, v, beta, la, order=129)
    monkeypatch.setenv("LINEARIZE_KERNELS", "0")
    assert not delta_applies(q, k, v, beta, la, (S0,))


def test_kernel_chunks_hold_at_most_128_virtual_tokens():
    from linearize.ops.delta.chunk import kernel_chunk

    assert [kernel_chunk(64, n) for n in (1, 2, 3, 4, 128)] == [64, 64, 42, 32, 1]
    assert kernel_chunk(8, 3) == 8 and kernel_chunk(300, 1) == 128


@needs_triton
def test_triton_scan_rejects_bad_block():
    from linearize.ops.delta.triton import delta_scan_triton

    W = torch.zeros(1, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="bv must be a power of two >= 16, got 24"):
        delta_scan_triton(W, W, W, None, torch.zeros(1, 1, 16, 16), bv=24)


@needs_triton
def test_the_scan_splits_values_finer_only_where_multiprocessors_would_idle():
    from linearize.ops.delta.triton import _blocks

    bv = lambda rows, Dv=64, given=None: _blocks(64, 64, Dv, given, rows, 132)[2]  # noqa: E731
    assert bv(9) == 16 and bv(65) == 16  # 1 x 9 heads (18 programs at 32 columns); 130 < 132
    assert bv(66) == 32 and bv(72) == 32  # 8 x 9 heads: 144 programs at 32 columns
    assert bv(9, Dv=16) == 16 and bv(9, given=32) == 32 and bv(200, Dv=128) == 32
    assert _blocks(8, 16, 16, None, 1, 132)[:2] == (32, 32)  # chunks and keys: MIN_TILE


@needs_triton
def test_the_scan_runs_in_segments_only_for_few_long_rows():
    from linearize.ops.delta.triton import _segments

    assert _segments(256, 36, 132) == 4  # 1 x 16K, 9 heads in value blocks of 16: 144 programs
    assert _segments(256, 18, 132) == 8 and _segments(512, 9, 132) == 16
    assert _segments(32, 144, 132) == 1  # 8 x 2K: enough programs already
    assert _segments(48, 9, 132) == 1  # 16 chunks a segment at most 3 segments: not worth two passes
    assert _segments(250, 9, 132) == 1  # no power of two above 2 divides the chunks


# the Triton scan against its torch twin, and the chunk forms on the kernels against the fp64
# parallel form, under the interpreter (tests/ops/conftest.py, interpreter_results)
INTERPRETER_OP = "delta"


@needs_triton
@pytest.mark.parametrize("name", cases_of(INTERPRETER_OP))
def test_interpreter_kernels_match_reference(interpreter_results, name):
    assert_interpreter_case(interpreter_results, name)


GPU_DELTA = {  # name -> delta_case arguments: liza's shapes (chunks of 64, DeltaProduct 2), odd widths
    "rule 128x128": dict(DK=128, DV=128),
    "rule ungated 64x64": dict(DK=64, DV=64, gated=False),
    "product2 64x64": dict(DK=64, DV=64, order=2),
    "rule 100x72": dict(DK=100, DV=72),
}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(GPU_DELTA))
def test_gpu_delta_fast_path_matches_reference(name, dtype):
    """The public chunk ops on CUDA take the kernels (the delta rule's whole chunk form, DeltaProduct's
    scan and inverses: asserted by the case) and match the fp64 parallel form, forward and backward, at T = 2048 with extreme gates (alpha = 0, log -20,
    exactly 1, near 1) and an initial state."""
    err = delta_case("cuda", dtype, T=2048, B=2, H=2, chunk=64, state=True,
                     extreme=GPU_DELTA[name].get("gated", True), **GPU_DELTA[name])
    assert_errors(err, KTOL[dtype], f"delta {name} {dtype}")


@needs_cuda
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("T", [5, 37, 100])
@pytest.mark.parametrize("D", [16, 32])
def test_gpu_narrow_heads_and_short_rows_match_reference(D, T, gated):
    """Heads of 16 (the tiny test models') and rows shorter than a chunk or not a whole number of
    chunks: the kernels' tiles of 16 faulted on an H200 (illegal memory access) where 32 ran; they
    now stay at least MIN_TILE wide, masked."""
    err = delta_case("cuda", torch.float32, T=T, B=2, H=4, chunk=64, state=True, gated=gated, DK=D, DV=D)
    assert_errors(err, KTOL[torch.float32], f"delta {D}x{D} T={T}")


@needs_cuda
@pytest.mark.parametrize("bv, segments", [(16, None), (32, None), (16, 4), (32, 8)])
def test_gpu_scan_in_value_blocks_matches_the_torch_scan(bv, segments):
    """The scan with its values split in blocks of ``bv`` columns (16: more programs for few long
    rows) and its chain in ``segments`` equals scan_torch, outputs and gradients, at 64 x 64 over
    40 chunks."""
    from linearize.ops.delta.chunk import scan_torch
    from linearize.ops.delta.triton import delta_scan_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    W, Kd = (0.1 * torch.randn(1, 9, 40, 64, 64, generator=g, device="cuda") for _ in range(2))
    U0 = torch.randn(1, 9, 40, 64, 64, generator=g, device="cuda")
    total = torch.rand(1, 9, 40, generator=g, device="cuda")
    S0 = torch.randn(1, 9, 64, 64, generator=g, device="cuda")
    ins = [x.requires_grad_(True) for x in (W, U0, Kd, total, S0)]
    ref = scan_torch(*[x.double() for x in ins])
    out = delta_scan_triton(*ins, bv=bv, segments=segments)
    w = [torch.randn(x.shape, generator=g, device="cuda", dtype=torch.float64) for x in ref]
    grads_ref = torch.autograd.grad(sum((r * c).sum() for r, c in zip(ref, w)), ins)
    grads = torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(out, w)), ins)
    for name, a, b in zip(("U", "S_c", "S_final") + ("dW", "dU0", "dKd", "dtotal", "dS0"),
                          list(out) + list(grads), list(ref) + list(grads_ref)):
        assert_rel_close(a.double(), b, 1e-4, name)


@needs_cuda
def test_gpu_one_long_row_runs_the_scan_in_segments_and_matches_reference():
    """One row of 4,096 tokens, 9 heads of 64 (liza's 16K cell, shorter): on a GPU of 132
    multiprocessors the scan runs in 4 segments (``_segments``), and the whole chunk form equals
    the fp64 parallel form, outputs and gradients."""
    from linearize.ops.delta import triton as kdelta

    real, chosen = kdelta._segments, []
    kdelta._segments = lambda *a: chosen.append(real(*a)) or chosen[-1]
    try:
        err = delta_case("cuda", torch.float32, T=4096, B=1, H=9, chunk=64, state=True, DK=64, DV=64)
    finally:
        kdelta._segments = real
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert chosen and all(g == 4 for g in chosen) if sms >= 72 else chosen, (chosen, sms)
    assert_errors(err, KTOL[torch.float32], "delta 1 x 9 x 4096")


def test_chunk_form_ignores_autocast():
    """Under bf16 autocast (how models train) the chunk form still computes in fp32: the same
    output and state as without autocast, for fp32 inputs."""
    q, k, v, beta, la, S0 = _inputs(40, DK=8, DV=8, dtype=torch.float32)
    ref, ref_st = D.delta_rule_chunk(q, k, v, beta, log_alpha=la, state=D.DeltaState(S0), chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, st = D.delta_rule_chunk(q, k, v, beta, log_alpha=la, state=D.DeltaState(S0), chunk_size=16)
    assert o.dtype == torch.float32
    assert torch.allclose(o, ref, rtol=0, atol=1e-6) and torch.allclose(st.S, ref_st.S, rtol=0, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("order", [1, 2])
def test_gpu_liza_layer_same_with_kernels_on_and_off(order):
    """liza's layer (fp32, 1000 tokens in chunks of 8) takes the kernels on CUDA and gives the
    torch path's output, state and input gradients."""
    err = delta_layer_case("cuda", torch.float32, order=order, T=1000)
    assert_errors(err, KTOL[torch.float32], f"liza layer order {order}")
