"""The gated delta rule: the delta-rule op (and DeltaProduct) with a decay log_alpha (B, H, T).

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
"""

import contextlib
import time

import pytest
import torch

from helpers import TOL, assert_rel_close, assert_state_close, rel_rms
from linearize.ops.delta import (
    DeltaProductState, DeltaState, delta_product_chunk, delta_product_parallel, delta_product_recurrent,
    delta_rule_chunk, delta_rule_parallel, delta_rule_recurrent,
)

B, H, T, DK, DV = 2, 2, 37, 6, 4
EPS = 1e-6
NEG_INF = float("-inf")


def inputs(dtype, seed=0, T=T, B=B, H=H, DK=DK, DV=DV, beta_order=None, gates="mixed"):
    """q, k, v, beta as the layers give them (unit keys, beta in (0.1, 1)) and log_alpha.

    gates: "mixed" (near 0, moderate, exactly 0, exactly -20 and uniform in [-20, 0] side by side),
    "inf" (mixed with some -inf, alpha = 0), "zero" or "-20" (that value at every position)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, DK, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, H, T, DK, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    shape = (B, H, T) if beta_order is None else (B, H, T, beta_order)
    beta = 0.1 + 0.9 * torch.rand(*shape, generator=g, dtype=torch.float64)
    if gates == "zero":
        la = torch.zeros(B, H, T, dtype=torch.float64)
    elif gates == "-20":
        la = torch.full((B, H, T), -20.0, dtype=torch.float64)
    else:
        kind = torch.randint(0, 5, (B, H, T), generator=g)
        u = torch.rand(B, H, T, generator=g, dtype=torch.float64)
        choices = torch.stack([-1e-3 * u, -2.0 * u, torch.zeros_like(u), torch.full_like(u, -20.0), -20.0 * u])
        la = choices.gather(0, kind.unsqueeze(0)).squeeze(0)
        if gates == "inf":
            la[torch.rand(B, H, T, generator=g) < 0.1] = NEG_INF
    return tuple(x.to(dtype) for x in (q, k, v, beta, la))


# (order or None for the plain delta rule, per-virtual-token beta?)
CONFIGS = {"rule": (None, False), "product2-vbeta": (2, True), "product3": (3, False)}


def form(name, config, chunk_size=5):
    """The op for a form and config, called as fn(q, k, v, beta, log_alpha, state=...)."""
    order, _ = CONFIGS[config]
    if order is None:
        fns = {"parallel": delta_rule_parallel, "recurrent": delta_rule_recurrent,
               "chunk": lambda *a, **kw: delta_rule_chunk(*a, chunk_size=chunk_size, **kw)}
        extra = {}
    else:
        fns = {"parallel": delta_product_parallel, "recurrent": delta_product_recurrent,
               "chunk": lambda *a, **kw: delta_product_chunk(*a, chunk_size=chunk_size, **kw)}
        extra = {"order": order}

    def fn(q, k, v, beta, log_alpha, **kw):
        return fns[name](q, k, v, beta, log_alpha=log_alpha, **extra, **kw)
    return fn


def config_inputs(config, dtype, **kw):
    order, per_virtual = CONFIGS[config]
    return inputs(dtype, beta_order=order if per_virtual else None, **kw)


def cut(xs, s0, s1):
    return tuple(x[:, :, s0:s1] for x in xs)


@contextlib.contextmanager
def one_thread():
    """Tiny ops on a shared 2-core machine run far faster single-threaded (no spinning threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------
# the reference against the rule written out


def test_parallel_matches_explicit_gated_update():
    q, k, v, beta, la = inputs(torch.float64, B=1, H=2, T=11, DK=4, DV=3, gates="inf")
    S0 = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    o, state = delta_rule_parallel(q, k, v, beta, state=DeltaState(S0), log_alpha=la)
    for h in range(2):
        S = S0[0, h].clone()
        for t in range(11):
            kt, vt, bt = k[0, h, t], v[0, h, t], beta[0, h, t]
            S = la[0, h, t].exp() * (torch.eye(4, dtype=torch.float64) - bt * torch.outer(kt, kt)) @ S \
                + bt * torch.outer(kt, vt)
            assert_rel_close(o[0, h, t], S.T @ q[0, h, t], 1e-12, f"o[{h},{t}]")
        assert_rel_close(state.S[0, h], S, 1e-12)


def test_delta_product_decays_once_per_real_token():
    """Order 2: S <- alpha_t S, then the two virtual updates, then the read."""
    q, k, v, beta, la = inputs(torch.float64, B=1, H=1, T=8, DK=4, DV=3, beta_order=2)
    o, state = delta_product_parallel(q, k, v, beta, order=2, log_alpha=la)
    S = torch.zeros(4, 3, dtype=torch.float64)
    k_before, v_before = torch.zeros(4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for t in range(8):
        dk = k[0, 0, t] - k_before
        virtual = [(k[0, 0, t], v[0, 0, t]), (dk / (dk.dot(dk) + EPS).sqrt(), v[0, 0, t] - v_before)]
        S = la[0, 0, t].exp() * S
        for m, (km, vm) in enumerate(virtual):
            S = S + beta[0, 0, t, m] * torch.outer(km, vm - S.T @ km)
        assert_rel_close(o[0, 0, t], S.T @ q[0, 0, t], 1e-12, f"o[{t}]")
        k_before, v_before = k[0, 0, t], v[0, 0, t]
    assert_rel_close(state.S[0, 0], S, 1e-12)


# ------------------------------------------------------------------------------------------
# invariants


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_forms_agree(config, name, dtype):
    ref, ref_state = form("parallel", config)(*config_inputs(config, torch.float64))
    o, state = form(name, config)(*config_inputs(config, dtype))  # chunk size 5 does not divide 37
    assert o.dtype == dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    assert all(x.dtype == compute for x in state)
    tol = 1e-2 if dtype == torch.bfloat16 else TOL[dtype]
    assert_rel_close(o, ref, tol, f"{name} {dtype}")
    assert_state_close(state, ref_state, tol)


@pytest.mark.parametrize("gates", ["inf", "zero", "-20"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_chunk_sizes_and_extreme_gates_agree(chunk_size, dtype, gates):
    """Every chunk size (1, dividing T or not, longer than T) and gates of 0, -20 or -inf everywhere."""
    q, k, v, beta, la = inputs(torch.float64, T=33, gates=gates)
    ref, ref_state = delta_rule_recurrent(q, k, v, beta, log_alpha=la)
    q, k, v, beta, la = inputs(dtype, T=33, gates=gates)
    o, state = delta_rule_chunk(q, k, v, beta, log_alpha=la, chunk_size=chunk_size)
    tol = 1e-2 if dtype == torch.bfloat16 else TOL[dtype]
    assert_rel_close(o, ref, tol, f"chunk {chunk_size} {dtype}")
    assert_state_close(state, ref_state, tol)


@pytest.mark.parametrize("name", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_no_decay_is_the_delta_rule(config, name):
    q, k, v, beta, _ = config_inputs(config, torch.float64)
    fn = form(name, config)
    plain, plain_state = fn(q, k, v, beta, None)
    order, _ = CONFIGS[config]
    if order is None:
        untouched = {"parallel": delta_rule_parallel, "recurrent": delta_rule_recurrent,
                     "chunk": lambda *a: delta_rule_chunk(*a, chunk_size=5)}[name](q, k, v, beta)
    else:
        untouched = {"parallel": delta_product_parallel, "recurrent": delta_product_recurrent,
                     "chunk": lambda *a, **kw: delta_product_chunk(*a, chunk_size=5, **kw)}[name](
                         q, k, v, beta, order=order)
    assert torch.equal(plain, untouched[0]) and all(torch.equal(a, b) for a, b in zip(plain_state, untouched[1]))
    zero, zero_state = fn(q, k, v, beta, torch.zeros(B, H, T, dtype=torch.float64))
    assert_rel_close(zero, plain, 1e-14)
    assert_state_close(zero_state, plain_state, 1e-14)
    gated, _ = fn(q, k, v, beta, torch.full((B, H, T), -0.5, dtype=torch.float64))
    assert rel_rms(gated, plain) > 1e-2  # the decay is not ignored


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@pytest.mark.parametrize("config", ["rule", "product3"])
def test_prefix_does_not_depend_on_length_or_chunk_size(config, chunk_size):
    x = config_inputs(config, torch.float64, gates="inf")
    ref, _ = form("parallel", config)(*x)
    for t in (1, 20, 29):
        o, _ = form("chunk", config, chunk_size=chunk_size)(*cut(x, 0, t))
        assert_rel_close(o, ref[:, :, :t], 1e-12, f"first {t} tokens")
    p, _ = form("parallel", config)(*cut(x, 0, 29))
    assert_rel_close(p, ref[:, :, :29], 1e-12, "parallel on a prefix")


@pytest.mark.parametrize("name", ["chunk", "parallel", "recurrent"])
def test_causal(name):
    q, k, v, beta, la = inputs(torch.float64)
    fn = form(name, "rule")
    o, _ = fn(q, k, v, beta, la)
    k2, v2, beta2, la2 = k.clone(), v.clone(), beta.clone(), la.clone()
    k2[:, :, 21:] = torch.nn.functional.normalize(torch.randn_like(k2[:, :, 21:]), dim=-1)
    v2[:, :, 21:] = torch.randn_like(v2[:, :, 21:])
    beta2[:, :, 21:] = torch.rand_like(beta2[:, :, 21:])
    la2[:, :, 21:] = -torch.rand_like(la2[:, :, 21:])
    o2, _ = fn(q, k2, v2, beta2, la2)
    torch.testing.assert_close(o[:, :, :21], o2[:, :, :21], rtol=1e-13, atol=1e-13)
    assert not torch.allclose(o[:, :, 21:], o2[:, :, 21:])


@pytest.mark.parametrize("split", [1, 13])
@pytest.mark.parametrize("name", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("config", ["rule", "product3"])
def test_two_piece_prefill_equals_one(config, name, split):
    x = config_inputs(config, torch.float64, gates="inf")
    fn = form(name, config)
    full, full_state = fn(*x)
    a, st = fn(*cut(x, 0, split))
    assert type(st) is type(full_state) and all(s.shape == f.shape for s, f in zip(st, full_state))
    b, st = fn(*cut(x, split, T), state=st)
    assert_rel_close(torch.cat([a, b], 2), full, 1e-12)
    assert_state_close(st, full_state, 1e-12)


@pytest.mark.parametrize("config", ["rule", "product2-vbeta"])
def test_decode_after_chunk_prefill_equals_full_forward(config):
    x = config_inputs(config, torch.float32)
    full, full_state = form("parallel", config)(*config_inputs(config, torch.float64))
    outs, st = [], None
    o, st = form("chunk", config, chunk_size=8)(*cut(x, 0, 30))
    outs.append(o)
    for t in range(30, T):
        o, st = form("recurrent", config)(*cut(x, t, t + 1), state=st)
        outs.append(o)
    assert_rel_close(torch.cat(outs, 2), full, TOL[torch.float32])
    assert_state_close(st, full_state, TOL[torch.float32])


@pytest.mark.parametrize("gate", [-20.0, NEG_INF])
@pytest.mark.parametrize("name", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("config", ["rule", "product3"])
def test_full_decay_forgets_the_past(config, name, gate):
    """log alpha = -20 (or -inf) at t0: what came before t0 no longer reaches outputs from t0 on."""
    t0 = 17
    q, k, v, beta, la = config_inputs(config, torch.float64)
    la = la.clamp_min(-1.0)  # no other strong decay, so the test is about t0 alone
    fn = form(name, config)
    g = torch.Generator().manual_seed(7)
    k2, v2, beta2 = k.clone(), v.clone(), beta.clone()
    k2[:, :, :t0] = torch.nn.functional.normalize(torch.randn(k2[:, :, :t0].shape, generator=g, dtype=k.dtype), dim=-1)
    v2[:, :, :t0] = 3 * torch.randn(v2[:, :, :t0].shape, generator=g, dtype=v.dtype)
    beta2[:, :, :t0] = torch.rand(beta2[:, :, :t0].shape, generator=g, dtype=beta.dtype)
    S0 = DeltaState(torch.randn(B, H, DK, DV, generator=g, dtype=torch.float64))
    if CONFIGS[config][0] is not None:  # DeltaProduct: only k_{t0-n+1..t0-1} enter t0's differences
        S0 = DeltaProductState(S0.S, *form("parallel", config)(q, k, v, beta, la)[1][1:])
        k2[:, :, t0 - 2:t0], v2[:, :, t0 - 2:t0] = k[:, :, t0 - 2:t0], v[:, :, t0 - 2:t0]
    gated, no_gate = la.clone(), la.clone()
    gated[:, :, t0], no_gate[:, :, t0] = gate, 0.0
    o, _ = fn(q, k, v, beta, gated, state=S0)
    o2, _ = fn(q, k2, v2, beta2, gated, state=S0)
    assert (o[:, :, t0:] - o2[:, :, t0:]).abs().max() <= 1e-6
    assert not torch.allclose(o[:, :, :t0], o2[:, :, :t0])
    o, _ = fn(q, k, v, beta, no_gate, state=S0)
    o2, _ = fn(q, k2, v2, beta2, no_gate, state=S0)
    assert (o[:, :, t0:] - o2[:, :, t0:]).abs().max() > 1e-2  # without the decay the past is still there


# ------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("name", ["chunk", "parallel"])
@pytest.mark.parametrize("config", ["rule", "product2-vbeta"])
def test_gradcheck(config, name):
    # chunk: two chunks, the second one short, so gradients flow through the carried state
    q, k, v, beta, _ = config_inputs(config, torch.float64, B=1, H=1, T=5, DK=3, DV=2)
    # away from 0, since gradcheck steps both ways and a positive log alpha is rejected
    la = torch.tensor([[[-0.1, -2.0, -0.05, -5.0, -0.7]]], dtype=torch.float64)
    S0 = 0.5 * torch.randn(1, 1, 3, 2, dtype=torch.float64)
    order, _ = CONFIGS[config]
    fn0 = form(name, config, chunk_size=3)
    if order is None:
        def fn(q, k, v, beta, la, S0):
            o, st = fn0(q, k, v, beta, la, state=DeltaState(S0))
            return o, st.S
    else:
        k_prev = torch.nn.functional.normalize(torch.randn(1, 1, order - 1, 3, dtype=torch.float64), dim=-1)
        v_prev = torch.randn(1, 1, order - 1, 2, dtype=torch.float64)

        def fn(q, k, v, beta, la, S0):
            o, st = fn0(q, k, v, beta, la, state=DeltaProductState(S0, k_prev, v_prev))
            return o, st.S
    args = tuple(x.clone().requires_grad_(True) for x in (q, k, v, beta, la, S0))
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("name", ["chunk", "parallel", "recurrent"])
def test_gradients_finite_with_extreme_gates(name):
    """-inf and -20 gates: the backward never forms inf * 0 or -inf - (-inf)."""
    q, k, v, beta, la = (x.requires_grad_(True) for x in inputs(torch.float32, gates="inf"))
    o, st = form(name, "rule", chunk_size=8)(q, k, v, beta, la)
    (o.square().sum() + st.S.square().sum()).backward()
    for x in (q, k, v, beta, la):
        assert torch.isfinite(x.grad).all()
    assert la.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------
# long inputs


def test_bf16_64k_tokens_extreme_gates_stay_finite_and_close_to_fp32():
    """65536 tokens: 16K with alpha = 1, 16K with log alpha = -20, 32K mixed (0, -20, uniform in
    [-20, 0]); bf16 inputs against an fp32 run of the same (unrounded) inputs, and the fp32 run
    against fp64, so the fp32 state does not drift over the length."""
    n = 65536
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, n, 16, generator=g)
    k = torch.nn.functional.normalize(torch.randn(1, 1, n, 16, generator=g), dim=-1)
    v = torch.randn(1, 1, n, 16, generator=g)
    beta = 0.1 + 0.9 * torch.rand(1, 1, n, generator=g)
    la = -20.0 * torch.rand(1, 1, n, generator=g)
    pick = torch.rand(1, 1, n, generator=g)
    la[pick < 0.3] = 0.0
    la[(pick >= 0.3) & (pick < 0.6)] = -20.0
    la[..., : n // 4] = 0.0
    la[..., n // 4: n // 2] = -20.0
    x32 = (q, k, v, beta, la)
    start = time.perf_counter()
    with one_thread():
        o16, s16 = delta_rule_chunk(*(x.bfloat16() for x in x32[:4]), log_alpha=la.bfloat16())
        o32, s32 = delta_rule_chunk(*x32[:4], log_alpha=la)
        o64, _ = delta_rule_chunk(*(x.double() for x in x32[:4]), log_alpha=la.double())
    assert time.perf_counter() - start < 60
    assert o16.dtype == torch.bfloat16 and s16.S.dtype == torch.float32
    assert torch.isfinite(o16).all() and torch.isfinite(s16.S).all()
    for part in (slice(0, n // 4), slice(n // 4, n // 2), slice(n // 2, n)):
        assert_rel_close(o16[:, :, part], o32[:, :, part], 1e-2, f"bf16 vs fp32, tokens {part}")
        assert_rel_close(o32[:, :, part], o64[:, :, part], 1e-5, f"fp32 vs fp64, tokens {part}")
    assert_rel_close(s16.S, s32.S, 1e-2)


# ------------------------------------------------------------------------------------------
# input checks


def test_bad_log_alpha_raises_naming_the_value():
    q, k, v, beta, la = inputs(torch.float32)
    for bad_value, shown in ((0.5, "0.5"), (float("nan"), "nan"), (float("inf"), "inf")):
        bad = la.clone()
        bad[1, 0, 3] = bad_value
        for fn in (delta_rule_parallel, delta_rule_chunk, delta_rule_recurrent):
            with pytest.raises(ValueError, match=rf"log_alpha must be <= 0 .* got {shown}"):
                fn(q, k, v, beta, log_alpha=bad)
        for fn in (delta_product_parallel, delta_product_chunk, delta_product_recurrent):
            with pytest.raises(ValueError, match=rf"log_alpha must be <= 0 .* got {shown}"):
                fn(q, k, v, beta, order=2, log_alpha=bad)
    with pytest.raises(ValueError, match=r"log_alpha must have shape \(2, 2, 37\), got \(2, 2, 36\)"):
        delta_rule_chunk(q, k, v, beta, log_alpha=la[:, :, 1:])
    with pytest.raises(ValueError, match=r"log_alpha must have shape \(2, 2, 37\), got \(2, 2, 37, 6\)"):
        delta_rule_recurrent(q, k, v, beta, log_alpha=la.unsqueeze(-1).expand(B, H, T, DK))
    with pytest.raises(ValueError, match=r"log_alpha has dtype torch.int64"):
        delta_product_parallel(q, k, v, beta, order=2, log_alpha=la.long())
    with pytest.raises(ValueError, match=r"log_alpha must be a torch.Tensor, got float"):
        delta_rule_parallel(q, k, v, beta, log_alpha=-1.0)
    # -inf (alpha = 0: the state is cleared before the token's update) and 0 (alpha = 1) are allowed
    for value in (NEG_INF, 0.0):
        o, st = delta_rule_chunk(q, k, v, beta, log_alpha=torch.full((B, H, T), value))
        assert torch.isfinite(o).all() and torch.isfinite(st.S).all()
