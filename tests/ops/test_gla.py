import math

import pytest
import torch
import torch.nn.functional as F

from helpers import TOL, assert_rel_close, assert_state_close, count_chunk_steps
from linearize.ops.gla import GLAState, gla_chunk, gla_parallel, gla_recurrent

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
