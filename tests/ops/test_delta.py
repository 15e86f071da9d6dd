import math

import pytest
import torch

from helpers import TOL, assert_rel_close, assert_state_close, count_chunk_steps
from linearize.ops.delta import (
    DeltaProductState, DeltaState, delta_product_chunk, delta_product_parallel, delta_product_recurrent,
    delta_rule_chunk, delta_rule_parallel, delta_rule_recurrent, finite_differences, l2_renormalize,
)

B, H, T, DK, DV = 2, 3, 37, 8, 5
EPS = 1e-6


def inputs(dtype, seed=0, T=T, beta_order=None, B=B, H=H, DK=DK, DV=DV):
    """q, k, v, beta as the LiZA layer gives them: unit keys, beta in (0.1, 1).

    beta_order=n gives a per-virtual-token beta (B, H, T, n)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, DK, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, H, T, DK, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    shape = (B, H, T) if beta_order is None else (B, H, T, beta_order)
    beta = 0.1 + 0.9 * torch.rand(*shape, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)


# An op configuration: (order or None for the plain delta rule, per-virtual-token beta?)
CONFIGS = {
    "rule": (None, False),
    "product1": (1, False),
    "product2": (2, False),
    "product2-vbeta": (2, True),
    "product3": (3, False),
    "product3-vbeta": (3, True),
}


def form(name, config, chunk_size=8):
    """The op function for a form name and a config, taking (q, k, v, beta, state=...)."""
    order, _ = CONFIGS[config]
    if order is None:
        fns = {"parallel": delta_rule_parallel, "recurrent": delta_rule_recurrent,
               "chunk": lambda *a, **kw: delta_rule_chunk(*a, chunk_size=chunk_size, **kw)}
        return fns[name]
    fns = {"parallel": delta_product_parallel, "recurrent": delta_product_recurrent,
           "chunk": lambda *a, **kw: delta_product_chunk(*a, chunk_size=chunk_size, **kw)}
    return lambda *a, **kw: fns[name](*a, order=order, **kw)


def config_inputs(config, dtype, **kw):
    order, per_virtual = CONFIGS[config]
    return inputs(dtype, beta_order=order if per_virtual else None, **kw)


def cut(xs, s0, s1):
    return tuple(x[:, :, s0:s1] for x in xs)


# ------------------------------------------------------------------------------------------
# the reference against the rule written out


def test_parallel_matches_explicit_update():
    q, k, v, beta = inputs(torch.float64, B=1, H=2, T=9, DK=4, DV=3)
    S0 = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    o, state = delta_rule_parallel(q, k, v, beta, state=DeltaState(S0))
    for h in range(2):
        S = S0[0, h].clone()
        for t in range(9):
            kt, vt = k[0, h, t], v[0, h, t]
            S = S + beta[0, h, t] * torch.outer(kt, vt - S.T @ kt)
            assert_rel_close(o[0, h, t], S.T @ q[0, h, t], 1e-12, f"o[{h},{t}]")
        assert_rel_close(state.S[0, h], S, 1e-12)


def test_delta_product_parallel_matches_explicit_update():
    """Order 2, per-virtual-token beta: virtual tokens (k_t, v_t), (k_t - k_{t-1} renormalised, v_t - v_{t-1})."""
    q, k, v, beta = inputs(torch.float64, B=1, H=1, T=7, DK=4, DV=3, beta_order=2)
    o, state = delta_product_parallel(q, k, v, beta, order=2)
    S = torch.zeros(4, 3, dtype=torch.float64)
    k_before, v_before = torch.zeros(4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for t in range(7):
        dk = k[0, 0, t] - k_before
        virtual = [(k[0, 0, t], v[0, 0, t]), (dk / (dk.dot(dk) + EPS).sqrt(), v[0, 0, t] - v_before)]
        for m, (km, vm) in enumerate(virtual):
            S = S + beta[0, 0, t, m] * torch.outer(km, vm - S.T @ km)
        assert_rel_close(o[0, 0, t], S.T @ q[0, 0, t], 1e-12, f"o[{t}]")
        k_before, v_before = k[0, 0, t], v[0, 0, t]
    assert_rel_close(state.S[0, 0], S, 1e-12)
    assert torch.equal(state.k_prev[0, 0, 0], k[0, 0, -1]) and torch.equal(state.v_prev[0, 0, 0], v[0, 0, -1])


@pytest.mark.parametrize("name", ["parallel", "chunk", "recurrent"])
def test_order_one_is_the_delta_rule(name):
    q, k, v, beta = inputs(torch.float64)
    o, state = form(name, "rule")(q, k, v, beta)
    for b in (beta, beta.unsqueeze(-1)):  # shared and per-virtual-token beta are the same at order 1
        o1, state1 = form(name, "product1")(q, k, v, b)
        assert torch.equal(o1, o) and torch.equal(state1.S, state.S)
        assert state1.k_prev.shape == (B, H, 0, DK) and state1.v_prev.shape == (B, H, 0, DV)


@pytest.mark.parametrize("prev", [False, True])
def test_virtual_tokens_are_hand_written_differences(prev):
    x = torch.randn(2, 3, 6, 4, dtype=torch.float64)
    p = torch.randn(2, 3, 2, 4, dtype=torch.float64) if prev else torch.zeros(2, 3, 2, 4, dtype=torch.float64)
    xs = torch.cat([p, x], dim=2)  # xs[:, :, t + 2] = x_t, x_{-1} = p[:, :, 1], x_{-2} = p[:, :, 0]

    def at(t):
        return xs[:, :, t + 2]

    d3 = finite_differences(x, p, 3)
    d2 = finite_differences(x, p[:, :, 1:], 2)
    assert d3.shape == (2, 3, 6, 3, 4) and d2.shape == (2, 3, 6, 2, 4)
    for t in range(6):
        first = at(t) - at(t - 1)
        second = at(t) - 2 * at(t - 1) + at(t - 2)
        assert torch.equal(d2[:, :, t, 0], at(t)) and torch.equal(d3[:, :, t, 0], at(t))
        torch.testing.assert_close(d2[:, :, t, 1], first, rtol=0, atol=1e-14)
        torch.testing.assert_close(d3[:, :, t, 1], first, rtol=0, atol=1e-14)
        torch.testing.assert_close(d3[:, :, t, 2], second, rtol=0, atol=1e-14)


def test_renormalisation_keeps_zero_and_is_smooth():
    x = torch.stack([torch.zeros(4, dtype=torch.float64), torch.tensor([3.0, 0, 4, 0], dtype=torch.float64)])
    x.requires_grad_(True)
    y = l2_renormalize(x, 1e-6)
    assert torch.equal(y[0].detach(), torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(y[1].detach(), x[1].detach() / math.sqrt(25 + 1e-6), rtol=1e-15, atol=0)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


# ------------------------------------------------------------------------------------------
# invariants


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_forms_agree(config, name, dtype):
    ref, ref_state = form("parallel", config)(*config_inputs(config, torch.float64))
    o, state = form(name, config)(*config_inputs(config, dtype))
    assert o.dtype == dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    assert all(x.dtype == compute for x in state)
    assert_rel_close(o, ref, TOL[dtype], f"{name} {dtype}")
    assert_state_close(state, ref_state, TOL[dtype])


@pytest.mark.parametrize("split", [1, 13])
@pytest.mark.parametrize("name", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("config", ["rule", "product2-vbeta", "product3"])
def test_two_piece_prefill_equals_one(config, name, split):
    # split=1 leaves fewer tokens than order-1 in the first piece: the history must pad with zeros.
    x = config_inputs(config, torch.float64)
    fn = form(name, config)
    full, full_state = fn(*x)
    a, st = fn(*cut(x, 0, split))
    b, st = fn(*cut(x, split, T), state=st)
    assert_rel_close(torch.cat([a, b], 2), full, 1e-12)
    assert_state_close(st, full_state, 1e-12)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@pytest.mark.parametrize("config", ["rule", "product3-vbeta"])
def test_chunk_size_and_length_do_not_change_prefix(config, chunk_size):
    x = config_inputs(config, torch.float64)
    ref, _ = form("parallel", config)(*x)
    o, _ = form("chunk", config, chunk_size=chunk_size)(*cut(x, 0, 29))
    assert_rel_close(o, ref[:, :, :29], 1e-12)


@pytest.mark.parametrize("name", ["chunk", "parallel"])
@pytest.mark.parametrize("config", ["rule", "product3-vbeta"])
def test_causal(config, name):
    q, k, v, beta = config_inputs(config, torch.float64)
    fn = form(name, config)
    o, _ = fn(q, k, v, beta)
    k2, v2, beta2 = k.clone(), v.clone(), beta.clone()
    k2[:, :, 21:] = torch.nn.functional.normalize(torch.randn_like(k2[:, :, 21:]), dim=-1)
    v2[:, :, 21:] = torch.randn_like(v2[:, :, 21:])
    beta2[:, :, 21:] = torch.rand_like(beta2[:, :, 21:])
    o2, _ = fn(q, k2, v2, beta2)
    assert torch.equal(o[:, :, :21], o2[:, :, :21])
    assert not torch.allclose(o[:, :, 21:], o2[:, :, 21:])


@pytest.mark.parametrize("config", ["rule", "product3"])
def test_chunk_form_takes_ceil_t_over_c_steps(config):
    with count_chunk_steps() as counter:
        form("chunk", config)(*config_inputs(config, torch.float32))
    assert counter == {"calls": 1, "spans": math.ceil(T / 8)}


@pytest.mark.parametrize("config", ["rule", "product2-vbeta"])
def test_chunk_gradcheck(config):
    # two chunks, the second one short: gradients must flow through the carried state
    q, k, v, beta = config_inputs(config, torch.float64, B=1, H=1, T=5, DK=3, DV=2)
    order, _ = CONFIGS[config]
    S0 = 0.5 * torch.randn(1, 1, 3, 2, dtype=torch.float64)
    if order is None:
        def fn(q, k, v, beta, S0):
            o, st = delta_rule_chunk(q, k, v, beta, state=DeltaState(S0), chunk_size=3)
            return o, st.S
        extra = ()
    else:
        k_prev = torch.nn.functional.normalize(torch.randn(1, 1, order - 1, 3, dtype=torch.float64), dim=-1)
        v_prev = torch.randn(1, 1, order - 1, 2, dtype=torch.float64)
        extra = (k_prev, v_prev)

        def fn(q, k, v, beta, S0, k_prev, v_prev):
            st0 = DeltaProductState(S0, k_prev, v_prev)
            o, st = delta_product_chunk(q, k, v, beta, order=order, state=st0, chunk_size=3)
            return o, st.S
    args = tuple(x.clone().requires_grad_(True) for x in (q, k, v, beta, S0, *extra))
    assert torch.autograd.gradcheck(fn, args)


def test_bad_inputs_raise_naming_the_value():
    q, k, v, beta = inputs(torch.float32)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got 0"):
        delta_rule_chunk(q, k, v, beta, chunk_size=0)
    with pytest.raises(ValueError, match=r"q must be 4-D"):
        delta_rule_parallel(q[0], k, v, beta)
    with pytest.raises(ValueError, match=r"dtype torch.int64"):
        delta_product_parallel(q, k.long(), v, beta, order=2)
    with pytest.raises(ValueError, match=r"beta must have shape \(2, 3, 37\), got \(2, 3, 37, 1\)"):
        delta_rule_recurrent(q, k, v, beta.unsqueeze(-1))
    with pytest.raises(ValueError, match=r"beta must have shape \(2, 3, 37\) or \(2, 3, 37, 2\), got \(2, 3, 37, 3\)"):
        delta_product_chunk(q, k, v, beta.unsqueeze(-1).expand(B, H, T, 3), order=2)
    for order in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"order must be a positive int, got {order!r}"):
            delta_product_recurrent(q, k, v, beta, order=order)
    with pytest.raises(ValueError, match=r"eps must be a positive finite number, got 0"):
        delta_product_parallel(q, k, v, beta, order=2, eps=0)
    bad = DeltaState(torch.zeros(B, H, DK + 1, DV))
    with pytest.raises(ValueError, match=r"state.S must have shape \(2, 3, 8, 5\), got \(2, 3, 9, 5\)"):
        delta_rule_chunk(q, k, v, beta, state=bad)
    _, order2 = delta_product_parallel(q, k, v, beta, order=2)
    with pytest.raises(ValueError, match=r"state.k_prev must have shape \(2, 3, 2, 8\), got \(2, 3, 1, 8\)"):
        delta_product_chunk(q, k, v, beta, order=3, state=order2)
    with pytest.raises(ValueError, match=r"state must be a DeltaProductState or None, got DeltaState"):
        delta_product_recurrent(q, k, v, beta, order=2, state=DeltaState(torch.zeros(B, H, DK, DV)))
    with pytest.raises(ValueError, match=r"state must be a DeltaState or None, got DeltaProductState"):
        delta_rule_parallel(q, k, v, beta, state=order2)
