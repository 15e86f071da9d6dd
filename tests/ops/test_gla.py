import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import TOL, assert_rel_close, assert_state_close, count_chunk_steps
from linearize.ops.gla import GLAState, gla_chunk, gla_parallel, gla_recurrent
from kernel_cases import CASE_TOL, INTERPRETER_CASES, KTOL, cases_of, gla_case, gla_wide_values_case, rel_rms
from kernel_checks import assert_interpreter_case, _LaunchRecorder, _needs_hopper_gluon, assert_errors, needs_cuda, needs_triton

B, H, T, DK, DV = 2, 3, 37, 8, 5
GATES = ["scalar", "vector"]


@pytest.fixture(autouse=True)
def one_thread():
    """These ops are many small kernels; on a small shared CPU, intra-op threads only contend
    (the long test runs several times faster on one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hedgehog_log_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """log φ(x) for φ = softmax(xW) ⊕ softmax(-xW): what Hedgehog feeds the log-space path."""
    xw = x @ w
    return torch.cat([F.log_softmax(xw, -1), F.log_softmax(-xw, -1)], -1)


def inputs(dtype, gate="scalar", log_space=False, seed=0, T=T):
    g = torch.Generator().manual_seed(seed)
    if log_space:
        w = torch.randn(DK, DK // 2, generator=g, dtype=torch.float64)
        q = hedgehog_log_features(torch.randn(B, H, T, DK, generator=g, dtype=torch.float64), w)
        k = hedgehog_log_features(torch.randn(B, H, T, DK, generator=g, dtype=torch.float64), w)
    else:  # positive features, as a feature map would give
        q = torch.rand(B, H, T, DK, generator=g, dtype=torch.float64)
        k = torch.rand(B, H, T, DK, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    # mostly long memory (γ ≈ 0.9), with a tail of strong forgetting down to γ ≈ e^-10
    gate_shape = (B, H, T) if gate == "scalar" else (B, H, T, DK)
    log_g = F.logsigmoid(torch.randn(*gate_shape, generator=g, dtype=torch.float64) * 3 + 2)
    return q.to(dtype), k.to(dtype), v.to(dtype), log_g.to(dtype)


def initial_state(dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64)
    z = torch.rand(B, H, DK, generator=g, dtype=torch.float64) * 3
    return GLAState(S.to(dtype), z.to(dtype))


FORMS = {
    "parallel": gla_parallel,
    "chunk": lambda *a, **kw: gla_chunk(*a, chunk_size=8, **kw),
    "recurrent": gla_recurrent,
}


@pytest.mark.parametrize("gate", GATES)
def test_parallel_matches_explicit_sum(gate):
    q, k, v, log_g = inputs(torch.float64, gate)
    S0, z0 = initial_state()
    o, _ = gla_parallel(q, k, v, log_g, state=GLAState(S0, z0))
    t = 20
    gamma = log_g.exp() if gate == "vector" else log_g.exp().unsqueeze(-1).expand(B, H, T, DK)
    num = torch.zeros(B, H, DV, dtype=torch.float64)
    den = torch.zeros(B, H, 1, dtype=torch.float64)
    for s in range(t + 1):
        decay = gamma[:, :, s + 1: t + 1].prod(2)  # Π_{l=s+1..t} γ_l, per channel
        w = (q[:, :, t] * k[:, :, s] * decay).sum(-1, keepdim=True)
        num += w * v[:, :, s]
        den += w
    decay0 = gamma[:, :, : t + 1].prod(2)  # the initial state is decayed by the first token's gate too
    num += ((q[:, :, t] * decay0).unsqueeze(-2) @ S0).squeeze(-2)
    den += (q[:, :, t] * decay0 * z0).sum(-1, keepdim=True)
    assert_rel_close(o[:, :, t], num / (den + 1e-6), 1e-12)


@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["chunk", "recurrent", "parallel"])
def test_forms_agree(form, dtype, normalize, gate, log_space):
    kw = dict(normalize=normalize, log_space_features=log_space)
    state64 = initial_state()
    ref, ref_state = gla_parallel(*inputs(torch.float64, gate, log_space), state=state64, **kw)
    state_dt = torch.float64 if dtype == torch.float64 else torch.float32
    state = GLAState(*(x.to(state_dt) for x in state64))
    o, state = FORMS[form](*inputs(dtype, gate, log_space), state=state, **kw)
    assert o.dtype == dtype
    assert state.S.dtype == state.z.dtype == state_dt
    what = f"{form} {dtype} {gate} normalize={normalize} log_space={log_space}"
    assert_rel_close(o, ref, TOL[dtype], what)
    assert_state_close(state, ref_state, TOL[dtype], what)


def test_z_stays_zero_when_unnormalised():
    for form in FORMS.values():
        _, state = form(*inputs(torch.float64, "vector"), normalize=False)
        assert torch.equal(state.z, torch.zeros(B, H, DK, dtype=torch.float64))


@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("form", list(FORMS))
def test_two_piece_prefill_equals_one(form, gate, log_space):
    q, k, v, log_g = inputs(torch.float64, gate, log_space)
    kw = dict(log_space_features=log_space)
    full, full_state = FORMS[form](q, k, v, log_g, **kw)
    a, st = FORMS[form](q[:, :, :13], k[:, :, :13], v[:, :, :13], log_g[:, :, :13], **kw)
    b, st = FORMS[form](q[:, :, 13:], k[:, :, 13:], v[:, :, 13:], log_g[:, :, 13:], state=st, **kw)
    assert_rel_close(torch.cat([a, b], 2), full, 1e-12)
    assert_state_close(st, full_state, 1e-12)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunk_size_and_length_do_not_change_prefix(chunk_size, gate):
    q, k, v, log_g = inputs(torch.float64, gate, log_space=True)
    ref, _ = gla_parallel(q, k, v, log_g, log_space_features=True)
    o, _ = gla_chunk(q[:, :, :29], k[:, :, :29], v[:, :, :29], log_g[:, :, :29],
                     log_space_features=True, chunk_size=chunk_size)
    assert_rel_close(o, ref[:, :, :29], 1e-12)


@pytest.mark.parametrize("form", list(FORMS))
def test_total_length_does_not_change_prefix(form):
    q, k, v, log_g = inputs(torch.float64, "vector", log_space=True)
    full, _ = FORMS[form](q, k, v, log_g, log_space_features=True)
    o, _ = FORMS[form](q[:, :, :29], k[:, :, :29], v[:, :, :29], log_g[:, :, :29], log_space_features=True)
    assert_rel_close(o, full[:, :, :29], 1e-12)


@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("form", list(FORMS))
def test_causal(form, gate, log_space):
    q, k, v, log_g = inputs(torch.float64, gate, log_space)
    q2, k2, v2, log_g2 = inputs(torch.float64, gate, log_space, seed=7)
    for x, y in ((q, q2), (k, k2), (v, v2), (log_g, log_g2)):
        y[:, :, :21] = x[:, :, :21]  # same up to token 20, different from token 21 on
    o, _ = FORMS[form](q, k, v, log_g, log_space_features=log_space)
    o2, _ = FORMS[form](q2, k2, v2, log_g2, log_space_features=log_space)
    assert torch.equal(o[:, :, :21], o2[:, :, :21])
    assert not torch.allclose(o[:, :, 21:], o2[:, :, 21:])


def test_chunk_form_takes_ceil_t_over_c_steps():
    with count_chunk_steps() as counter:
        gla_chunk(*inputs(torch.float32, "vector"), chunk_size=8)
    assert counter == {"calls": 1, "spans": math.ceil(T / 8)}


@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("gate", GATES)
def test_gradcheck_chunk(gate, log_space):
    g = torch.Generator().manual_seed(3)
    b, h, t, dk, dv = 1, 2, 7, 4, 3
    q, k = torch.rand(2, b, h, t, dk, generator=g, dtype=torch.float64) + 0.1
    if log_space:
        q, k = q.log(), k.log()
    v = torch.randn(b, h, t, dv, generator=g, dtype=torch.float64)
    gate_shape = (b, h, t) if gate == "scalar" else (b, h, t, dk)
    log_g = -torch.rand(*gate_shape, generator=g, dtype=torch.float64) * 2
    S0 = torch.randn(b, h, dk, dv, generator=g, dtype=torch.float64)
    z0 = torch.rand(b, h, dk, generator=g, dtype=torch.float64)
    args = [x.requires_grad_() for x in (q, k, v, log_g, S0, z0)]

    def f(q, k, v, log_g, S0, z0):
        o, state = gla_chunk(q, k, v, log_g, log_space_features=log_space, state=GLAState(S0, z0),
                             chunk_size=3)
        return o, state.S, state.z

    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("gate", GATES)
def test_zero_features_as_minus_inf_give_finite_equal_gradients(gate):
    """log_space_features allows -inf (a zero feature): outputs and gradients stay finite in every form."""
    q, k, v, log_g = inputs(torch.float64, gate, log_space=True)
    q[:, :, ::3, ::2] = float("-inf")
    k[:, :, 1::4, 1::3] = float("-inf")
    k[:, :, 5] = float("-inf")  # a token with no feature at all
    grads = {}
    for name, form in FORMS.items():
        args = [x.clone().requires_grad_() for x in (q, k, v, log_g)]
        o, state = form(*args, log_space_features=True)
        assert torch.isfinite(o).all()
        (o.square().sum() + state.S.sum() + state.z.sum()).backward()
        grads[name] = [x.grad for x in args]
        assert all(torch.isfinite(gr).all() for gr in grads[name]), name
    for name in ("chunk", "recurrent"):
        for gr, ref in zip(grads[name], grads["parallel"]):
            assert_rel_close(gr, ref, 1e-10, f"{name} gradient")


def extreme_log_gates(lanes: int, T: int, g: torch.Generator) -> torch.Tensor:
    """(lanes, T) log-gates in [-20, 0] in runs of up to 4096 tokens: gates near 0 (log ≈ -20),
    near 1 (log ≈ -1e-4), exactly 1, and anywhere in between."""
    runs = 256  # about 2048 tokens each on average: far more than T = 65536 in all
    ends = torch.randint(1, 4097, (lanes, runs), generator=g).cumsum(-1)
    assert (ends[:, -1] >= T).all()
    run_of_token = torch.searchsorted(ends, torch.arange(T).expand(lanes, T).contiguous(), right=True)
    kind = torch.randint(0, 4, (lanes, runs), generator=g).gather(1, run_of_token)
    u = torch.rand(lanes, T, generator=g, dtype=torch.float64)
    choices = torch.stack([-20 + 2 * u, -1e-4 * (0.5 + u), torch.zeros_like(u), -20 * u])
    return choices.gather(0, kind.unsqueeze(0)).squeeze(0)


@pytest.mark.parametrize("gate", GATES)
def test_bf16_long_input_with_extreme_gates(gate):
    """65,536 bf16 tokens, Hedgehog-like log-features, extreme gates: finite outputs, states and
    gradients, and close to the fp64 chunk form (a quadratic reference does not fit)."""
    g = torch.Generator().manual_seed(5)
    h, t, d = 2, 65536, 16
    w = torch.randn(d, d // 2, generator=g, dtype=torch.float64)
    q = hedgehog_log_features(torch.randn(1, h, t, d, generator=g, dtype=torch.float64) * 2, w)
    k = hedgehog_log_features(torch.randn(1, h, t, d, generator=g, dtype=torch.float64) * 2, w)
    v = torch.randn(1, h, t, d, generator=g, dtype=torch.float64)
    if gate == "scalar":
        log_g = extreme_log_gates(h, t, g).reshape(1, h, t)
    else:
        log_g = extreme_log_gates(h * d, t, g).reshape(1, h, d, t).transpose(2, 3)
    bf = [x.to(torch.bfloat16) for x in (q, k, v, log_g)]

    o, state = gla_chunk(*bf, log_space_features=True)
    assert o.dtype == torch.bfloat16
    assert torch.isfinite(o).all() and torch.isfinite(state.S).all() and torch.isfinite(state.z).all()
    # Against fp64 on the same bf16-rounded inputs, only the op's own arithmetic differs: fp32
    # accumulation and the bf16 rounding of the output (<= 2^-9 relative; ~1e-3 RMS measured).
    ref, ref_state = gla_chunk(*(x.double() for x in bf), log_space_features=True)
    assert_rel_close(o, ref, TOL[torch.bfloat16], f"bf16 long {gate}")
    assert_state_close(state, ref_state, TOL[torch.float32], f"bf16 long {gate} (fp32 state)")
    # Against the unrounded fp64 inputs the rounding of the inputs counts too (~4e-3 measured).
    ref, _ = gla_chunk(q, k, v, log_g, log_space_features=True)
    assert_rel_close(o, ref, TOL[torch.bfloat16], f"bf16 long {gate} vs unrounded inputs")

    # gradients through the same extremes (a prefix keeps the backward pass quick)
    args = [x[:, :, :4096].clone().requires_grad_() for x in bf]
    o, state = gla_chunk(*args, log_space_features=True)
    (o.float().square().sum() + state.S.sum() + state.z.sum()).backward()
    for name, x in zip("q k v log_g".split(), args):
        assert torch.isfinite(x.grad).all(), f"{name}.grad is not finite"


def test_bad_inputs_raise_naming_the_value():
    q, k, v, log_g = inputs(torch.float32)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got 0"):
        gla_chunk(q, k, v, log_g, chunk_size=0)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got -3"):
        gla_chunk(q, k, v, log_g, chunk_size=-3)
    with pytest.raises(ValueError, match=r"q must be 4-D"):
        gla_parallel(q[0], k, v, log_g)
    with pytest.raises(ValueError, match=r"dtype torch.int64"):
        gla_recurrent(q, k, v.long(), log_g)
    with pytest.raises(ValueError, match=r"log_g has dtype torch.int64"):
        gla_chunk(q, k, v, log_g.long())
    shapes = r"log_g must have shape \(2, 3, 37\) or \(2, 3, 37, 8\), got \(2, 3, 36\)"
    with pytest.raises(ValueError, match=shapes):
        gla_parallel(q, k, v, log_g[:, :, 1:])
    with pytest.raises(ValueError, match=r"got \(2, 3, 37, 5\)"):
        gla_chunk(q, k, v, torch.zeros(B, H, T, DV))
    bad = GLAState(torch.zeros(B, H, DK + 1, DV), torch.zeros(B, H, DK))
    with pytest.raises(ValueError, match=r"state.S must have shape \(2, 3, 8, 5\), got \(2, 3, 9, 5\)"):
        gla_recurrent(q, k, v, log_g, state=bad)
    bad = GLAState(torch.zeros(B, H, DK, DV), torch.zeros(B, H, DV))
    with pytest.raises(ValueError, match=r"state.z must have shape \(2, 3, 8\), got \(2, 3, 5\)"):
        gla_chunk(q, k, v, log_g, state=bad)


@pytest.mark.parametrize("gate", GATES + ["none"])
def test_in_place_step_is_the_recurrent_form(gate):
    """gla_step_ (what a decoder with static buffers runs): one token on the state in place, the
    same output and state as gla_recurrent for that token (no gate: plain linear attention)."""
    from linearize.ops.gla import gla_step_

    g = torch.Generator().manual_seed(3)
    q, k = (torch.rand(B, H, 1, DK, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, 1, DV, generator=g, dtype=torch.float64)
    shape = (B, H, 1) if gate == "scalar" else (B, H, 1, DK)
    log_g = F.logsigmoid(torch.randn(*shape, generator=g, dtype=torch.float64) + 2)
    if gate == "none":
        log_g = torch.zeros(B, H, 1, dtype=torch.float64)
    st = GLAState(torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64),
                  torch.rand(B, H, DK, generator=g, dtype=torch.float64))
    o_ref, s_ref = gla_recurrent(q, k, v, log_g, state=st)
    S, z = st.S.clone(), st.z.clone()
    o = gla_step_(q[:, :, 0], k[:, :, 0], v[:, :, 0], None if gate == "none" else log_g[:, :, 0], S, z)
    assert_rel_close(o, o_ref[:, :, 0], TOL[torch.float64])
    assert_state_close(GLAState(S, z), s_ref, TOL[torch.float64])


# ----------------------------------------------------------------------------- GLA: the kernels

# CPU, Triton interpreter: this op's cases of kernel_cases.INTERPRETER_CASES, in one subprocess
# (tests/ops/conftest.py, interpreter_results)
INTERPRETER_OP = "gla"


@needs_triton
@pytest.mark.parametrize("name", cases_of(INTERPRETER_OP))
def test_interpreter_kernels_match_reference(interpreter_results, name):
    assert_interpreter_case(interpreter_results, name)


def test_sequence_split_follows_the_sweep():
    """Segments per (batch * head) at 32 heads on 132 multiprocessors (an H200), with the main
    pass's 2 V-blocks: the counts the sweeps found fastest (about 9 at B1 T32768, 1 at B4 T8192),
    none where the main pass's programs fill the GPU."""
    from linearize.ops.gla import triton as kgla

    cfg = kgla.GLALaunch()
    assert kgla._segments(2048, 64, 16 * 32, 132, cfg, v_blocks=2) == (1, 2048)
    assert kgla._segments(8192, 64, 4 * 32, 132, cfg, v_blocks=2) == (1, 8192)
    assert kgla._segments(8192, 64, 4 * 32, 132, cfg, v_blocks=1) == (2, 4096)  # 128 programs on 132
    assert kgla._segments(32768, 64, 32, 132, cfg, v_blocks=2) == (8, 4096)
    assert kgla._segments(1000, 64, 1, 132, cfg, v_blocks=2) == (2, 512)  # segments keep at least 8 chunks
    # the fused backward's programs take a multiprocessor each: whole where B x H fill half of them
    assert kgla._fused_segments(8192, 64, 4 * 32, 132, cfg) == (1, 8192)
    assert kgla._fused_segments(2048, 64, 16 * 32, 132, cfg) == (1, 2048)
    assert kgla._fused_segments(1000, 64, 66, 132, cfg) == (1, 1024)
    assert kgla._fused_segments(32768, 64, 32, 132, cfg) == (8, 4096)  # few programs: split as the passes
    assert kgla._fused_segments(8192, 64, 4 * 32, 132, dataclasses.replace(cfg, seg_chunks=16)) == (8, 1024)


# each distinct setting compiles its own kernels (seconds each), so the GPU matrix is kept to the
# settings users run (Lizard: bf16 normalised log-features; fla's: bf16 unnormalised plain) plus fp32
GPU_GLA = {
    "f32 norm log": dict(normalize=True, log_space=True),
    "bf16 norm log": dict(normalize=True, log_space=True),
    "bf16 norm plain": dict(normalize=True, log_space=False),
    "bf16 unnorm plain": dict(normalize=False, log_space=False),
}


@needs_cuda
@pytest.mark.parametrize("T", [77, 1000])
@pytest.mark.parametrize("name", list(GPU_GLA))
def test_gpu_gla_matches_reference(name, T):
    dtype = torch.float32 if name.startswith("f32") else torch.bfloat16
    err = gla_case("cuda", dtype, T=T, DK=128, DV=128, B=2, H=3, chunk=None, **GPU_GLA[name])
    assert_errors(err, KTOL[dtype], f"gla {name} T={T}")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_gla_values_wider_than_the_kernels_run_in_blocks(dtype):
    """Gemma-3's heads of 256 with features of 128: gla_chunk runs the values in two blocks of 128
    columns on the kernels and matches the fp64 reference, from a state, forward and backward."""
    err = gla_wide_values_case("cuda", dtype, T=1000, DK=128, DV=256, B=2, H=4)
    assert_errors(err, KTOL[dtype], f"gla wide values {dtype}")


@needs_cuda
@pytest.mark.parametrize("variant, dtype", [("state+segments", torch.float32), ("state+segments", torch.bfloat16),
                                            ("extreme+segments", torch.bfloat16), ("dims 100x72", torch.bfloat16)])
def test_gpu_gla_state_segments_extremes_dims(variant, dtype):
    kw = dict(normalize=True, log_space=True, T=700, DK=128, DV=128, B=1, H=2, chunk=None)
    if "state" in variant:
        kw["state"] = True
    if "segments" in variant:
        kw["seg_chunks"] = 3  # 3 x 64 tokens per segment: 4 segments, the last one partial
    if "extreme" in variant:
        kw["extreme"] = True
    if variant.startswith("dims"):
        kw["DK"], kw["DV"] = (int(x) for x in variant.split()[1].split("x"))
        kw["state"] = True
    err = gla_case("cuda", dtype, **kw)
    assert_errors(err, KTOL[dtype], f"gla {variant} {dtype}")


@needs_cuda
@pytest.mark.parametrize("variant", ["plain", "norm", "state", "norm segments", "fp16", "model layout", "T=64"])
def test_gpu_gla_fused_forward_matches_reference(variant):
    """GLA's fused Gluon forward (gla_gluon.fwd_fused), as gla_chunk_triton runs it in inference on
    Hopper, against the fp64 reference: o and the final state, unnormalised (fla's inputs) and
    normalised, from an initial state (the state's z passes through where unnormalised), in four
    sequence segments (each one's entering state from the pre-pass and scan), fp16, q, k, v in a
    model's layout, one chunk; and where too few (batch x head) pairs fill the GPU, the Triton
    passes run instead."""
    from kernel_cases import gla_fused_case

    _needs_hopper_gluon()
    kw = dict(T=64 if variant == "T=64" else 1024, normalize=variant.startswith("norm"), state=variant == "state",
              bthd=variant == "model layout")
    if "segments" in variant:
        kw["segments"] = 4
    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    err = gla_fused_case(dtype, **kw)
    assert_errors(err, KTOL[dtype], f"gla fused forward {variant}")
    if variant == "plain":  # one (batch x head) pair over 4096 tokens: the Triton passes' segments
        from linearize.ops.gla import gluon as gla_gluon
        from linearize.ops.gla.triton import gla_chunk_triton

        x = [torch.rand(1, 1, 4096, 128, device="cuda").bfloat16() for _ in range(3)]
        calls = []
        run = gla_gluon.fwd_fused
        gla_gluon.fwd_fused = lambda *a, **k: calls.append(1) or run(*a, **k)
        try:
            with torch.no_grad():
                gla_chunk_triton(*x, -torch.rand(1, 1, 4096, device="cuda"), normalize=False)
        finally:
            gla_gluon.fwd_fused = run
        assert calls == []


@needs_cuda
@pytest.mark.parametrize("variant", ["unnorm", "norm", "norm fp16", "norm state segments", "model layout",
                                     "model layout norm", "T=64", "extreme gates"])
def test_gpu_gla_gluon_chunk_pass_matches_reference(variant, gluon_chunk_calls):
    """The backward's chunk pass as the Gluon kernel (what gla_chunk_triton runs on Hopper where
    its scope holds) against the fp64 reference: every gradient, unnormalised (fla's inputs) and
    normalised, bf16 and fp16, from an initial state with sequence segments, q, k, v in a model's
    layout, one chunk, gates near 0 and 1."""
    dtype = torch.float16 if "fp16" in variant else torch.bfloat16
    kw = dict(normalize="norm" in variant.split(), log_space=False, T=64 if variant == "T=64" else 1024,
              DK=128, DV=128, B=2, H=3, chunk=None, bthd=variant.startswith("model layout"),
              gla_cfg=dict(gluon_fused_bwd=False))  # the two-pass backward (the fused one is the default)
    if "state" in variant:
        kw.update(state=True, seg_chunks=5)
    if variant == "extreme gates":
        kw.update(extreme=True, normalize=True)
    err = gla_case("cuda", dtype, **kw)
    assert gluon_chunk_calls == [False], gluon_chunk_calls
    assert_errors(err, KTOL[dtype], f"gla gluon chunk pass {variant}")


@needs_cuda
@pytest.mark.parametrize("variant", ["unnorm", "norm", "norm fp16", "norm state segments", "unnorm segments",
                                     "model layout norm", "T=64", "T=128", "extreme gates"])
def test_gpu_gla_gluon_fused_backward_matches_reference(variant, gluon_fused_calls):
    """The whole gated backward as ONE Gluon kernel (GLALaunch.gluon_fused_bwd: the reverse
    state pass and the chunk pass fused, dS in registers) against the fp64 reference: every
    gradient, unnormalised and normalised, fp16, from an initial state with sequence segments (the
    last one shorter: 16 chunks in segments of 5), q, k, v in a model's layout, one and two chunks
    (the prefetch's edges), gates near 0 and 1."""
    dtype = torch.float16 if "fp16" in variant else torch.bfloat16
    T = {"T=64": 64, "T=128": 128}.get(variant, 1024)
    kw = dict(normalize="norm" in variant.split(), log_space=False, T=T, DK=128, DV=128, B=2, H=3, chunk=None,
              bthd=variant.startswith("model layout"), gla_cfg=dict(gluon_fused_bwd=True))
    if "segments" in variant:
        kw.update(state="state" in variant, seg_chunks=5)
    if variant == "extreme gates":
        kw.update(extreme=True, normalize=True)
    err = gla_case("cuda", dtype, **kw)
    assert_errors(err, KTOL[dtype], f"gla gluon fused backward {variant}")
    # without fixed segments, the host splits the sequence by its rule for this kernel (few programs
    # here: 2 x 3 heads, so the 16 chunks of T=1024 go in two segments of 8 on a 132-SM H100/H200)
    from linearize.ops.gla import triton as kgla
    from linearize.ops.backend.dispatch import device_sms

    cuda = torch.empty(0, device="cuda")
    auto = kgla._fused_segments(T, 64, 2 * 3, device_sms(cuda), kgla.GLALaunch())[1] // 64
    assert gluon_fused_calls == [5 if "segments" in variant else auto], gluon_fused_calls


@needs_cuda
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("T", [1024, 960, 64])
def test_gpu_gla_gluon_fused_backward_paired_states(normalize, T):
    """The fused backward from the states of even chunks only (``paired``: each odd chunk's state
    formed from the even one's before it and that chunk's keys and values) gives the gradients it
    gives from every chunk's state, within bf16 rounding: an even and an odd number of chunks (the
    walk then starts on an odd chunk or an even one), and one chunk."""
    from linearize.ops.gla import triton as kgla
    from linearize.ops.gla import gluon as gla_gluon

    _needs_hopper_gluon()
    B, H, D = 2, 3, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k = (torch.softmax(torch.randn(B, H, T, D, generator=g, device="cuda"), -1).bfloat16() for _ in range(2))
    v, do = (torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16() for _ in range(2))
    log_g = torch.nn.functional.logsigmoid(torch.randn(B, H, T, generator=g, device="cuda") + 3)
    NC = T // 64
    cfg = kgla.GLALaunch(gluon_fused_bwd=True, seg_chunks=NC)
    o, den, _, _, segs, sc, zc = kgla._fwd(q, k, v, log_g, None, None, normalize, False, 1e-6, cfg, True)
    keep = list(range(0, NC, 2)) + [NC]  # even chunks' states and the last one
    sc_paired = sc[:, keep].contiguous()
    assert sc_paired.shape[1] == gla_gluon.state_slots(NC, True)
    grads = []
    for paired, sc_x in ((False, sc), (True, sc_paired)):
        p = kgla.bwd_states(q, k, v, log_g, o, den, sc_x, zc, do, None, None, False, normalize, False, 1e-6, segs,
                            cfg, paired=paired)
        assert p.fused and p.paired == paired and p.seg_chunks == NC
        grads.append(kgla.bwd_chunks(q, k, v, log_g, p, normalize, False, 1e-6, cfg)[:4])
    for name, a, b in zip(("dq", "dk", "dv", "dlog_g"), *grads):
        assert torch.isfinite(b).all(), name
        assert rel_rms(b.float(), a.float()) < 1e-2, (name, rel_rms(b.float(), a.float()))
    if NC > 1:  # every chunk's states are not what a paired backward takes
        with pytest.raises(ValueError, match="states"):
            gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None,
                                *(torch.empty_like(x) for x in (q, k, v)), torch.empty(B * H, T, device="cuda"), None,
                                None, seg_chunks=NC, normalize=normalize, eps=1e-6, dv_add=False, paired=True)


@needs_cuda
def test_gpu_long_bf16_extreme_gates_stay_finite():
    """64K bf16 tokens, Hedgehog-like log-features, gates in runs from log -20 to exactly 0: finite
    outputs, states and gradients, close to the torch chunk form (fp32) on the same inputs."""
    from linearize.ops.gla.triton import gla_chunk_triton
    from linearize.ops.window_attn.triton import window_attn_triton
    from linearize.ops.gla.chunk import gla_chunk

    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, d = 65536, 2, 64
    lf = lambda: torch.log_softmax(torch.randn(1, H, T, d, generator=g, device="cuda") * 2, -1)  # noqa: E731
    q, k = lf().bfloat16(), lf().bfloat16()
    v = torch.randn(1, H, T, d, generator=g, device="cuda").bfloat16()
    u = torch.rand(1, H, T, generator=g, device="cuda")
    kind = (torch.arange(T, device="cuda") // 2048) % 4
    log_g = torch.where(kind == 0, -20 + 2 * u,
                        torch.where(kind == 1, -1e-4 * u, torch.where(kind == 2, 0 * u, -20 * u)))
    args = [x.clone().requires_grad_() for x in (q, k, v, log_g)]
    o, st = gla_chunk_triton(*args, log_space_features=True)
    (o.float().square().sum() + st.S.sum() + st.z.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(st.S).all() and torch.isfinite(st.z).all()
    for name, x in zip(("q", "k", "v", "log_g"), args):
        assert torch.isfinite(x.grad).all(), f"{name}.grad is not finite"
    with torch.no_grad():
        ref, ref_st = gla_chunk(q.float(), k.float(), v.float(), log_g, log_space_features=True)
    assert rel_rms(o, ref) <= KTOL[torch.bfloat16]
    assert rel_rms(st.S, ref_st.S) <= 1e-2
    w, _ = window_attn_triton(q, k, v, window=128, sink_logits=torch.zeros(H, 4, device="cuda"))
    assert torch.isfinite(w).all()


@pytest.mark.parametrize("layout", ["contiguous", "model", "other"])
def test_fused_forward_views_map_every_element(layout):
    """gla_gluon.view2d: the 2-D view a TMA descriptor reads, with (sb, sh, sc) such that
    element (b, h, t, d) sits at row b*sb + h*sh + t, column h*sc + d; None for other layouts."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.gla.gluon import view2d

    B, H, T, D = 2, 3, 5, 4
    base = torch.arange(B * H * T * D, dtype=torch.float32)
    if layout == "contiguous":
        x = base.view(B, H, T, D)
    elif layout == "model":
        x = base.view(B, T, H, D).transpose(1, 2)
    else:
        x = base.view(B, H, D, T).transpose(2, 3)
    got = view2d(x)
    if layout == "other":
        assert got is None
        return
    x2, (sb, sh, sc) = got
    assert x2.data_ptr() == x.data_ptr()
    for b in range(B):
        for h in range(H):
            rows = x2[b * sb + h * sh: b * sb + h * sh + T, h * sc: h * sc + D]
            assert torch.equal(rows, x[b, h])


@pytest.mark.parametrize("bthd", [False, True])
def test_gla_fused_forward_launch_host_side(bthd, monkeypatch):
    """gla_gluon.fwd_fused up to its launch, on CPU: the grid (segments x batch x heads), b (the
    gates' cumulative sum within each chunk), the layout bits, the descriptors over q, k, v and a
    new contiguous o, the initial state's pointers where given."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.gla import gluon as gla_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(gla_gluon, "_gla_fwd_fused_kernel", rec)
    B, H, T, D = 2, 3, 256, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(3))
    if bthd:
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    log_g = -torch.rand(B, H, T, generator=g)
    S_in, z_in = torch.randn(B * H, 2, D, D), torch.rand(B * H, 2, D)
    o, S_T, z_T = gla_gluon.fwd_fused(q, k, v, log_g, normalize=bthd, eps=1e-6, nseg=2, S_in=S_in, z_in=z_in)
    (grid, args, kw), = rec.calls
    assert grid == (2, B * H) and kw["MODEL_LAYOUT"] == (0b111 if bthd else 0) and kw["NORM"] == bthd
    assert kw["HAS_INIT"] and args[5] is S_in and args[6] is z_in and args[7] is S_T and args[8] is z_T
    assert args[9:13] == (T, H, 128, 2)  # T, H, tokens per segment, segments
    for desc, x in zip(args[:4], (q, k, v, o)):
        assert desc.base.data_ptr() == x.data_ptr() and list(desc.block_shape) == [64, 128]
    torch.testing.assert_close(args[4].view(B, H, T // 64, 64), log_g.view(B, H, T // 64, 64).cumsum(-1))
    assert o.shape == v.shape and o.is_contiguous() and S_T.shape == (B, H, D, D) and z_T.shape == (B, H, D)


def test_gluon_chunk_pass_launch_host_side(monkeypatch):
    """gla_gluon.bwd_chunks up to its launch, on CPU: the grid, b, the states' 2-D views (one
    (F, Dv) tile per chunk) and the constexprs."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.gla import gluon as gla_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(gla_gluon, "_gla_bwd_chunk_kernel", rec)
    B, H, T, D = 2, 3, 192, 128
    NC = T // 64
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    log_g = -torch.rand(B, H, T, generator=g)
    f32 = dict(dtype=torch.float32)
    den, dden, dlog_g = (torch.zeros(B * H, T, **f32) for _ in range(3))
    sc = torch.zeros(B * H, NC + 1, D, D, dtype=torch.bfloat16)
    dsc = torch.zeros(B * H, NC, D, D, dtype=torch.bfloat16)
    zc, dzc, yc = torch.zeros(B * H, NC + 1, D, **f32), torch.zeros(B * H, NC, D, **f32), torch.zeros(B * H, NC, 2, **f32)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    gla_gluon.bwd_chunks(q, k, v, log_g, do, den, dden, sc, zc, dsc, dzc, yc, dq, dk, dv, dlog_g, normalize=True,
                         eps=1e-6, dv_add=True)
    (grid, args, kw), = rec.calls
    assert grid == (NC, B * H)
    assert kw == dict(MODEL_LAYOUT=0, NORM=True, DV_ADD=True, NVD=2, F=D, DV=D, C=64, num_warps=4)
    st, dst = args[4], args[5]
    assert list(st.shape) == [B * H * (NC + 1) * D, D] and list(dst.shape) == [B * H * NC * D, D]
    assert list(st.block_shape) == [D, D]
    torch.testing.assert_close(args[6].view(B, H, NC, 64), log_g.view(B, H, NC, 64).cumsum(-1))
    with pytest.raises(ValueError, match="outside its scope"):
        gla_gluon.bwd_chunks(q, k, v.transpose(2, 3), log_g, do, den, dden, sc, zc, dsc, dzc, yc, dq, dk, dv,
                             dlog_g, normalize=True, eps=1e-6, dv_add=False)


@pytest.mark.parametrize("normalize", [False, True])
def test_gluon_fused_backward_launch_host_side(normalize, monkeypatch):
    """gla_gluon.bwd_fused up to its launch, on CPU: the grid (segments x batch*heads, the last
    segment shorter), b, the states' 2-D view, which pointers it passes for each configuration,
    the constexprs, dq's and dk's tiles (they leave by TMA), its refusal of layouts TMA cannot read; with side_dot and alpha (y read as o),
    their pointers and SIDE, and its refusal where they do not fit."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.gla import gluon as gla_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(gla_gluon, "_gla_bwd_fused_kernel", rec)
    B, H, T, D = 2, 3, 320, 128
    NC = T // 64
    g = torch.Generator().manual_seed(0)
    q, k, v, do, o = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(5))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a model's layout
    log_g = -torch.rand(B, H, T, generator=g)
    f32 = dict(dtype=torch.float32)
    den, dlog_g = torch.zeros(B * H, T, **f32), torch.zeros(B * H, T, **f32)
    sc = torch.zeros(B * H, NC + 1, D, D, dtype=torch.bfloat16)
    zc = torch.zeros(B * H, NC + 1, D, **f32)
    ds_in, dz_in = torch.zeros(B * H * 3, D, D, **f32), torch.zeros(B * H * 3, D, **f32)
    dS0, dz0 = torch.zeros(B, H, D, D, **f32), torch.zeros(B, H, D, **f32)
    dq, dk, dv = (torch.empty(B, H, T, D, dtype=torch.bfloat16) for _ in range(3))
    gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g, dS0, dz0,
                        seg_chunks=2, normalize=normalize, eps=1e-6, dv_add=True)
    (grid, args, kw), = rec.calls
    assert grid == (3, B * H)  # 5 chunks in segments of 2, 2, 1
    assert kw == dict(MODEL_LAYOUT=0b001, NORM=normalize, DV_ADD=True, HAS_DS=True, STORE_DS0=True, F=D, DV=D,
                      C=64, SIDE=False, PAIRED=False, num_warps=4)
    assert args[4].base.data_ptr() == (o if normalize else do).data_ptr()
    assert args[5].base.data_ptr() == dv.data_ptr() and list(args[5].block_shape) == [64, D]  # the dv added to
    assert args[6].base.data_ptr() == dq.data_ptr() and args[7].base.data_ptr() == dk.data_ptr()  # out by TMA
    assert list(args[8].shape) == [B * H * (NC + 1) * D, D] and list(args[8].block_shape) == [D, D]
    assert args[9] is sc and args[15] is ds_in and args[20] is dS0 and args[21] is dz0
    assert (args[11] is den, args[14] is zc, args[16] is dz_in) == (normalize,) * 3
    assert args[12] is dlog_g and args[13] is dlog_g  # no side: placeholders
    assert args[22] is dlog_g and args[23:29] == (T, H, NC, 3, 2, 1e-6)  # no profile: a placeholder
    torch.testing.assert_close(args[10].view(B, H, NC, 64), log_g.view(B, H, NC, 64).cumsum(-1))
    # the gates' sums a forward kept are read as given (a tensor of another size refused)
    bl = gla_gluon.chunk_gates(log_g)
    gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g, dS0, dz0,
                        seg_chunks=2, normalize=normalize, eps=1e-6, dv_add=True, bl=bl)
    assert rec.calls.pop()[1][10] is bl
    with pytest.raises(ValueError, match=r"bl must be \(1920,\) fp32"):
        gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g, dS0, dz0,
                            seg_chunks=2, normalize=normalize, eps=1e-6, dv_add=True, bl=bl[:-64])
    with pytest.raises(ValueError, match="outside its scope"):
        gla_gluon.bwd_fused(q, k, v.transpose(2, 3), log_g, o, den, sc, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g,
                            None, None, seg_chunks=2, normalize=normalize, eps=1e-6, dv_add=False)
    with pytest.raises(ValueError, match="outside its scope"):  # segments without their entering gradients
        gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                            seg_chunks=2, normalize=normalize, eps=1e-6, dv_add=False)
    side_dot, alpha = torch.zeros(B * H, T, **f32), torch.ones(H, **f32)
    side = dict(seg_chunks=NC, eps=1e-6, dv_add=True, side_dot=side_dot, alpha=alpha)
    if not normalize:  # dd exists only normalised
        with pytest.raises(ValueError, match="side_dot takes normalize"):
            gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                                normalize=False, **side)
        return
    gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                        normalize=True, **side)
    (grid, args, kw) = rec.calls[-1]
    assert grid == (1, B * H) and kw["SIDE"] is True and args[12] is side_dot and args[13] is alpha
    with pytest.raises(ValueError, match="side_dot takes"):  # alpha per head, fp32
        gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                            normalize=True, **{**side, "alpha": torch.ones(H + 1, **f32)})
    # paired: the states of chunks 0, 2, 4 and the last (5 chunks), in a view of their own; every
    # chunk's are refused, as are odd segments
    assert gla_gluon.state_slots(NC, True) == 4 and gla_gluon.state_slots(NC, False) == NC + 1
    assert [gla_gluon.state_slots(n, True) for n in (1, 2, 3, 4)] == [2, 2, 3, 3]
    sc_p = sc[:, [0, 2, 4, 5]].contiguous()
    gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc_p, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                        normalize=True, paired=True, **side)
    (grid, args, kw) = rec.calls[-1]
    assert kw["PAIRED"] is True and args[9] is sc_p and list(args[8].shape) == [B * H * 4 * D, D]
    with pytest.raises(ValueError, match=r"sc must hold 4 states .*paired=True"):
        gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                            normalize=True, paired=True, **side)
    with pytest.raises(ValueError, match="seg_chunks=1"):
        gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc_p, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g, None, None,
                            seg_chunks=1, normalize=True, eps=1e-6, dv_add=True, paired=True)
