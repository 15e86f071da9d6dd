import math
import re

import pytest
import torch

from kernel_cases import cases_of
from kernel_checks import assert_interpreter_case, needs_cuda, needs_triton
from helpers import TOL, assert_rel_close, assert_state_close, capped, count_chunk_steps, window_of
from linearize.ops.lolcats_attn import (
    LolcatsState, lolcats_attn_chunk, lolcats_attn_parallel, lolcats_attn_recurrent,
)
from linearize.ops.window_attn import cache_len

B, H, T, DK, DV, F = 2, 3, 37, 8, 5, 6
# Standard w = 5 (cache 4); terraced w = 4 (blocks of 4, cache 7): both well inside T.
WINDOWS = {False: 5, True: 4}
# Scores are ~N(0, 1) here, so a cap of 1.5 changes them a lot; None is the uncapped op.
SOFTCAPS = [None, 1.5]


def inputs(dtype, seed=0, T=T, B=B):
    """(q, k, v, fq, fk, window_factor); features non-negative, as a feature map gives them."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, DK, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    # features scaled so the linear terms weigh about as much as the window's
    fq, fk = (torch.rand(B, H, T, F, generator=g, dtype=torch.float64) * 0.5 for _ in range(2))
    f = torch.sigmoid(torch.randn(H, generator=g, dtype=torch.float64))
    return tuple(x.to(dtype) for x in (q, k, v, fq, fk, f))


def cut(args, s0, s1):
    """The time slice [s0, s1) of the per-token inputs; the window factor is per head."""
    return tuple(x[:, :, s0:s1] for x in args[:5]) + (args[5],)


FORMS = {
    "parallel": lolcats_attn_parallel,
    "chunk": lambda *a, **kw: lolcats_attn_chunk(*a, chunk_size=8, **kw),
    "recurrent": lolcats_attn_recurrent,
}


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("terraced", [False, True])
def test_parallel_matches_explicit_sum(terraced, softcap):
    """The reference, by hand; a soft-cap acts on the window logits (and so on c_t) only."""
    q, k, v, fq, fk, f = inputs(torch.float64)
    w, eps = WINDOWS[terraced], 1e-6
    o, _ = lolcats_attn_parallel(q, k, v, fq, fk, f, window=w, terraced=terraced, eps=eps, softcap=softcap)
    for t in (0, 3, 4, 7, 20, 23, T - 1):
        win = window_of(t, w, terraced)
        older = [s for s in range(t + 1) if s not in win]
        scores = capped(torch.einsum("bhd,bhsd->bhs", q[:, :, t], k[:, :, win]) / math.sqrt(DK), softcap)
        a = f[None, :, None] * torch.exp(scores - scores.max(-1, keepdim=True).values)
        lin = torch.einsum("bhf,bhsf->bhs", fq[:, :, t], fk[:, :, older])
        num = (torch.einsum("bhs,bhsd->bhd", a, v[:, :, win])
               + torch.einsum("bhs,bhsd->bhd", lin, v[:, :, older]))
        den = a.sum(-1, keepdim=True) + lin.sum(-1, keepdim=True)
        assert_rel_close(o[:, :, t], num / (den + eps), 1e-12, f"t={t}")


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["chunk", "recurrent", "parallel"])
def test_forms_agree(form, dtype, terraced, softcap):
    kw = dict(window=WINDOWS[terraced], terraced=terraced, softcap=softcap)
    ref, ref_state = lolcats_attn_parallel(*inputs(torch.float64), **kw)
    o, state = FORMS[form](*inputs(dtype), **kw)
    assert o.dtype == dtype
    assert state.S.dtype == state.k.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_rel_close(o, ref, TOL[dtype], f"{form} {dtype}")
    assert_state_close(state, ref_state, TOL[dtype])
    assert state.pos.tolist() == [T] * B


@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("window", [1, 2, 50])
def test_extreme_windows(window, terraced):
    """Empty or one-slot caches, and a window longer than the input (no linear terms at all)."""
    args = inputs(torch.float64)
    kw = dict(window=window, terraced=terraced)
    ref, ref_state = lolcats_attn_parallel(*args, **kw)
    for form in (lambda *a, **kw: lolcats_attn_chunk(*a, chunk_size=3, **kw), lolcats_attn_recurrent):
        o, state = form(*args, **kw)
        assert_rel_close(o, ref, 1e-12)
        assert_state_close(state, ref_state, 1e-12)
    if window == 50:  # f cancels up to eps: causal softmax attention (eps / f ~ 1e-5 relative)
        q, k, v = args[:3]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2) / math.sqrt(DK)).masked_fill(~causal, -math.inf)
        assert_rel_close(ref, torch.softmax(scores, -1) @ v, 1e-5)
        assert torch.equal(ref_state.S, torch.zeros_like(ref_state.S))  # nothing left the cache


@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 5, 8, 64])
def test_chunk_size_and_length_do_not_change_prefix(chunk_size, terraced):
    args = inputs(torch.float64)
    kw = dict(window=WINDOWS[terraced], terraced=terraced)
    ref, _ = lolcats_attn_parallel(*args, **kw)
    o, _ = lolcats_attn_chunk(*cut(args, 0, 29), chunk_size=chunk_size, **kw)
    assert_rel_close(o, ref[:, :, :29], 1e-12)


@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
def test_causal(form, terraced):
    args = inputs(torch.float64)
    kw = dict(window=WINDOWS[terraced], terraced=terraced)
    o, _ = FORMS[form](*args, **kw)
    changed = tuple(x.clone() for x in args)
    for x in changed[:5]:
        x[:, :, 21:] = torch.rand_like(x[:, :, 21:])
    o2, _ = FORMS[form](*changed, **kw)
    assert torch.equal(o[:, :, :21], o2[:, :, :21])
    assert not torch.allclose(o[:, :, 21:], o2[:, :, 21:])


# Splits inside the first window (cache partly empty), inside a block, on a block boundary
# (terraced w = 4) and late in the sequence.
@pytest.mark.parametrize("split", [2, 13, 16, 30])
@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
def test_two_piece_prefill_equals_one(form, terraced, split):
    args = inputs(torch.float64)
    kw = dict(window=WINDOWS[terraced], terraced=terraced)
    full, full_state = FORMS[form](*args, **kw)
    a, st = FORMS[form](*cut(args, 0, split), **kw)
    b, st = FORMS[form](*cut(args, split, T), state=st, **kw)
    assert_rel_close(torch.cat([a, b], 2), full, 1e-12)
    assert_state_close(st, full_state, 1e-12)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("terraced", [False, True])
def test_chunk_prefill_then_recurrent_decode_equals_full_forward(terraced, softcap):
    args = inputs(torch.float64)
    kw = dict(window=WINDOWS[terraced], terraced=terraced, softcap=softcap)
    full, full_state = lolcats_attn_parallel(*args, **kw)
    a, st = lolcats_attn_chunk(*cut(args, 0, 22), chunk_size=6, **kw)
    outs = [a]
    for t in range(22, T):
        o, st = lolcats_attn_recurrent(*cut(args, t, t + 1), state=st, **kw)
        outs.append(o)
    assert_rel_close(torch.cat(outs, 2), full, 1e-12)
    assert_state_close(st, full_state, 1e-12)


@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
def test_left_padding_via_negative_pos(form, terraced):
    """Row 0 carries 3 padding tokens at positions -3..-1: they reach neither window nor S/z."""
    pad = 3
    kw = dict(window=WINDOWS[terraced], terraced=terraced)
    args = inputs(torch.float64, T=T + pad)
    alone0, st0 = FORMS[form](*(x[:1, :, pad:] for x in args[:5]), args[5], **kw)
    alone1, st1 = FORMS[form](*(x[1:] for x in args[:5]), args[5], **kw)
    L = cache_len(kw["window"], terraced)
    z = lambda *shape: torch.zeros(*shape, dtype=torch.float64)  # noqa: E731
    start = LolcatsState(z(2, H, F, DV), z(2, H, F), z(2, H, L, DK), z(2, H, L, F), z(2, H, L, DV),
                         torch.tensor([-pad, 0]))
    o, st = FORMS[form](*args, state=start, **kw)
    assert torch.equal(o[:1, :, :pad], torch.zeros_like(o[:1, :, :pad]))  # padding queries see nothing
    assert_rel_close(o[:1, :, pad:], alone0, 1e-12)
    assert_rel_close(o[1:], alone1, 1e-12)
    assert st.pos.tolist() == [T, T + pad]
    assert_rel_close(st.S[:1], st0.S, 1e-12)
    assert_rel_close(st.z[:1], st0.z, 1e-12)


def test_empty_input_keeps_state():
    args = inputs(torch.float64)
    _, st = lolcats_attn_chunk(*args, window=5)
    for form in FORMS.values():
        o, st2 = form(*cut(args, 0, 0), window=5, state=st)
        assert o.shape == (B, H, 0, DV)
        assert_state_close(st2, st, 0.0)


def graph_nodes(out: torch.Tensor) -> int:
    """The number of autograd nodes behind ``out``."""
    seen_, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen_:
            continue
        seen_.add(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return len(seen_)


@pytest.mark.parametrize("terraced", [False, True])
def test_chunk_form_has_no_loop_along_time(terraced):
    """No sequential steps, and an autograd graph of a fixed size: what keeps the GPU busy."""
    counts = []
    for length in (256, 1024):
        args = [x.requires_grad_() for x in inputs(torch.float32, T=length, B=1)]
        with count_chunk_steps() as counter:
            o, st = lolcats_attn_chunk(*args, window=WINDOWS[terraced], terraced=terraced, chunk_size=16)
        assert counter == {"calls": 0, "spans": 0}
        counts.append(graph_nodes(o.sum() + st.S.sum()))
    assert counts[0] == counts[1] < 200, counts


def start_state(seed=5, pos=(-3, 11), terraced=False):
    """A carried state: random S, z and cache (its slots at negative positions are empty and must
    not matter), row 0 still in its left padding, row 1 mid-sequence at a position that is not a
    multiple of the window or of any chunk size used."""
    g = torch.Generator().manual_seed(seed)
    L = cache_len(WINDOWS[terraced], terraced)
    r = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return LolcatsState(r(B, H, F, DV) - 0.5, r(B, H, F), r(B, H, L, DK) - 0.5, r(B, H, L, F) * 0.5,
                        r(B, H, L, DV) - 0.5, torch.tensor(pos))


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 8, 64])
@pytest.mark.parametrize("length", [3, 37])
def test_chunk_equals_parallel_with_carried_state(length, chunk_size, terraced, softcap):
    """Outputs, final state and every gradient (inputs, factor, and the carried state) in fp64;
    T = 3 is shorter than the window, 37 no multiple of any chunk size but 1."""
    kw = dict(window=WINDOWS[terraced], terraced=terraced, softcap=softcap)
    results = []
    for form in (lolcats_attn_parallel, lambda *a, **k: lolcats_attn_chunk(*a, chunk_size=chunk_size, **k)):
        args = [x.requires_grad_() for x in inputs(torch.float64, T=length)]
        st = start_state(terraced=terraced)
        st = st._replace(**{n: getattr(st, n).requires_grad_() for n in st._fields[:5]})
        o, out = form(*args, state=st, **kw)
        loss = (o * torch.linspace(-1, 1, DV, dtype=torch.float64)).sum() + out.S.square().sum() + \
            out.z.sum() + out.k.sum() + out.fk.sum() + out.v.sum()
        grads = torch.autograd.grad(loss, args + list(st[:5]))
        results.append((o, out, grads))
    (ref, ref_state, ref_grads), (o, state, grads) = results
    assert_rel_close(o, ref, 1e-12)
    assert_state_close(state, ref_state, 1e-12)
    assert state.pos.tolist() == [-3 + length, 11 + length]
    for name, g, rg in zip("q k v fq fk f S z cache_k cache_fk cache_v".split(), grads, ref_grads):
        assert_rel_close(g, rg, 1e-11, name)


@pytest.mark.parametrize("terraced", [False, True])
def test_gradcheck_chunk_with_state(terraced):
    """gradcheck through a carried state in and out, T a multiple of no chunk."""
    Bs, Hs, Ts, Dk, Dv, Fs, w = 2, 2, 7, 3, 2, 4, 2
    L = cache_len(w, terraced)
    g = torch.Generator().manual_seed(4)
    r = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    args = [r(Bs, Hs, Ts, Dk) - 0.5, r(Bs, Hs, Ts, Dk) - 0.5, r(Bs, Hs, Ts, Dv) - 0.5, r(Bs, Hs, Ts, Fs) + 0.1,
            r(Bs, Hs, Ts, Fs) + 0.1, r(Hs), r(Bs, Hs, Fs, Dv), r(Bs, Hs, Fs) + 0.1, r(Bs, Hs, L, Dk),
            r(Bs, Hs, L, Fs) + 0.1, r(Bs, Hs, L, Dv)]
    args = [x.requires_grad_() for x in args]
    pos = torch.tensor([-1, 5])

    def fn(*a):
        o, st = lolcats_attn_chunk(*a[:6], window=w, terraced=terraced, chunk_size=3, softcap=1.5,
                                   state=LolcatsState(*a[6:], pos))
        return (o,) + tuple(st[:5])

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.slow
@pytest.mark.parametrize("terraced", [False, True])
def test_bf16_long_sequence_stays_close_to_fp64(terraced):
    """T = 4096 in bf16 (states summed in fp32 over 64 chunks) against the fp64 parallel reference,
    on the exact inputs and on their bf16 roundings (which leaves only the computation's error)."""
    length, w = 4096, 64
    args = tuple(x[:, :1] for x in inputs(torch.float64, T=length, B=1)[:5]) + (inputs(torch.float64)[5][:1],)
    kw = dict(window=w, terraced=terraced)
    o, st = lolcats_attn_chunk(*(x.bfloat16() for x in args), **kw)
    assert o.dtype == torch.bfloat16 and st.S.dtype == torch.float32
    ref, ref_state = lolcats_attn_parallel(*args, **kw)
    # bf16 rounding of the inputs alone is ~2.5e-3 here
    assert_rel_close(o, ref, 5e-3)
    assert_rel_close(st.S, ref_state.S, 5e-3)
    ref, ref_state = lolcats_attn_parallel(*(x.bfloat16().double() for x in args), **kw)
    assert_rel_close(o, ref, 3e-3)  # the output's own bf16 rounding
    # the state sums in fp32: a running bf16 sum of these 64 chunk blocks is off by ~1e-2
    assert_rel_close(st.S, ref_state.S, 1e-6)
    assert_rel_close(st.z, ref_state.z, 1e-6)


@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
def test_softcap_large_is_no_cap_and_small_changes_the_output(form, terraced):
    args = inputs(torch.float64)
    kw = dict(window=WINDOWS[terraced], terraced=terraced)
    ref, ref_state = FORMS[form](*args, **kw)
    none, _ = FORMS[form](*args, softcap=None, **kw)
    assert torch.equal(none, ref)  # None is the default, bit for bit
    big, big_state = FORMS[form](*args, softcap=1e6, **kw)
    assert_rel_close(big, ref, 1e-10)  # c tanh(x / c) = x - x^3 / (3 c^2) + ...
    assert_state_close(big_state, ref_state, 0.0)  # S, z and the cache never see the cap
    small, _ = FORMS[form](*args, softcap=1.0, **kw)
    assert torch.isfinite(small).all()
    assert (small - ref).abs().max() > 1e-2


def test_softcap_leaves_the_linear_terms_alone():
    """Window 1 with terraced=False: the only window term is the key itself, whose capped logit
    sets c_t, so its weight is f for any cap: the output does not depend on the cap at all."""
    args = inputs(torch.float64)
    ref, _ = lolcats_attn_parallel(*args, window=1)
    for cap in (0.5, 1.0, 3.0):
        o, _ = lolcats_attn_parallel(*args, window=1, softcap=cap)
        assert_rel_close(o, ref, 1e-13)


@pytest.mark.parametrize("terraced", [False, True])
def test_gradcheck_chunk(terraced):
    g = torch.Generator().manual_seed(3)
    Bs, Hs, Ts, Dk, Dv, Fs = 1, 2, 7, 3, 2, 4
    q, k = (torch.randn(Bs, Hs, Ts, Dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(Bs, Hs, Ts, Dv, generator=g, dtype=torch.float64)
    # features kept away from 0 so that finite differences stay in the non-negative domain
    fq, fk = (torch.rand(Bs, Hs, Ts, Fs, generator=g, dtype=torch.float64) + 0.1 for _ in range(2))
    f = torch.sigmoid(torch.randn(Hs, generator=g, dtype=torch.float64))
    args = [x.requires_grad_() for x in (q, k, v, fq, fk, f)]

    def fn(*a, softcap=None):
        return lolcats_attn_chunk(*a, window=2, terraced=terraced, chunk_size=3, softcap=softcap)[0]

    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradcheck(lambda *a: fn(*a, softcap=1.5), args)


@pytest.mark.parametrize("terraced", [False, True])
def test_state_size_does_not_depend_on_length(terraced):
    shapes = []
    for length in (50, 500):
        args = tuple(x[:1, :1] for x in inputs(torch.float32, T=length)[:5]) + (torch.full((1,), 0.5),)
        for form in (lolcats_attn_chunk, lolcats_attn_recurrent):
            _, st = form(*args, window=WINDOWS[terraced], terraced=terraced)
            shapes.append([tuple(x.shape) for x in st])
    assert all(s == shapes[0] for s in shapes)
    L = cache_len(WINDOWS[terraced], terraced)
    assert shapes[0] == [(1, 1, F, DV), (1, 1, F), (1, 1, L, DK), (1, 1, L, F), (1, 1, L, DV), (1,)]


def test_bad_inputs_raise_naming_the_value():
    q, k, v, fq, fk, f = args = inputs(torch.float32)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match=rf"window must be a positive int, got {bad!r}"):
            lolcats_attn_parallel(*args, window=bad)
    with pytest.raises(ValueError, match=r"terraced must be a bool, got 1"):
        lolcats_attn_chunk(*args, window=4, terraced=1)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got 0"):
        lolcats_attn_chunk(*args, window=4, chunk_size=0)
    with pytest.raises(ValueError, match=r"window_factor must have shape \(H,\) = \(3,\), got \(1, 3\)"):
        lolcats_attn_recurrent(q, k, v, fq, fk, f[None], window=4)
    msg = r"fk must have shape \(B, H, T, F\) = \(2, 3, 37, F\), got \(2, 3, 36, 6\)"
    with pytest.raises(ValueError, match=msg):
        lolcats_attn_chunk(q, k, v, fq, fk[:, :, 1:], f, window=4)
    with pytest.raises(ValueError, match=r"fq and fk must have the same shape"):
        lolcats_attn_parallel(q, k, v, fq, fk[..., 1:], f, window=4)
    _, st = lolcats_attn_chunk(*args, window=5)  # cache of 4
    with pytest.raises(ValueError, match=r"state.k must have shape \(2, 3, 5, 8\), got \(2, 3, 4, 8\)"):
        lolcats_attn_recurrent(*args, window=6, state=st)
    with pytest.raises(ValueError, match=r"state.S must have shape \(2, 3, 5, 5\), got \(2, 3, 6, 5\)"):
        lolcats_attn_parallel(q, k, v, fq[..., 1:], fk[..., 1:], f, window=5, state=st)
    with pytest.raises(ValueError, match=r"state.pos must have dtype torch.int64, got torch.float32"):
        lolcats_attn_chunk(*args, window=5, state=st._replace(pos=st.pos.float()))
    for bad in (0, -1.0, math.inf, math.nan, False, "5.0", torch.tensor(5.0)):
        for form in FORMS.values():
            with pytest.raises(ValueError, match=r"softcap must be a positive finite number or None, got "
                               + re.escape(repr(bad))):
                form(*args, window=5, softcap=bad)


@pytest.mark.slow
def test_chunk_form_compiles_as_one_graph():
    """torch.compile captures the whole op (fullgraph: no graph break, no data-dependent control
    flow) and its compiled forward and backward equal eager. aot_eager traces what inductor would
    get, forward and backward, without its minutes of C++ compilation on a CPU."""
    args = [x.requires_grad_() for x in inputs(torch.float64)]
    st = start_state()

    def fn(*a):
        o, out = lolcats_attn_chunk(*a, window=5, chunk_size=8, softcap=1.5, state=st)
        return o, out.S, out.z

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(*args), fn(*args)
    for x, y in zip(got, want):
        assert_rel_close(x, y, 1e-13)
    weights = torch.linspace(-1, 1, DV, dtype=torch.float64)
    loss = lambda r: (r[0] * weights).sum() + r[1].square().sum() + r[2].sum()  # noqa: E731
    for g, r in zip(torch.autograd.grad(loss(got), args), torch.autograd.grad(loss(want), args)):
        assert_rel_close(g, r, 1e-12)


def hedgehog_inputs(length, device, seed=0):
    """Inputs shaped as LoLCATs trains them (D = 64, F = 128 Hedgehog features: two softmax halves)."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=torch.float64)  # noqa: E731
    q, k, v = r(1, 2, length, 64), r(1, 2, length, 64), r(1, 2, length, 64)
    fq, fk = (torch.cat([torch.softmax(x, -1), torch.softmax(-x, -1)], -1) for x in (r(1, 2, length, 64),
                                                                                    r(1, 2, length, 64)))
    return q, k, v, fq, fk, torch.sigmoid(r(2))


# the bands' Triton kernels under the interpreter (tests/ops/conftest.py, interpreter_results)
INTERPRETER_OP = "lolcats"


@needs_triton
@pytest.mark.parametrize("name", cases_of(INTERPRETER_OP))
def test_interpreter_kernels_match_the_parallel_form(interpreter_results, name):
    assert_interpreter_case(interpreter_results, name)


@needs_cuda
def test_gpu_bf16_at_16k_tokens_stays_close_to_fp64():
    """On the GPU (cumsum as a parallel scan, the bands on the Triton kernels) at T = 16384: bf16
    output, state and gradients against the fp64 chunk form (itself equal to the parallel reference,
    tests above) on the same bf16-rounded inputs; what is left is bf16 rounding of o and the
    gradients, and no drift of S."""
    args = [x.bfloat16().requires_grad_() for x in hedgehog_inputs(16384, "cuda")]
    ref_args = [x.detach().double().requires_grad_() for x in args]
    dy = torch.randn(1, 2, 16384, 64, device="cuda", dtype=torch.float64).bfloat16()
    ref, ref_state = lolcats_attn_chunk(*ref_args, window=64)
    o, st = lolcats_attn_chunk(*args, window=64)
    assert_rel_close(o, ref, 3e-3)
    assert_rel_close(st.S, ref_state.S, 1e-6)
    assert_rel_close(st.z, ref_state.z, 1e-6)
    want = torch.autograd.grad(ref, ref_args, dy.double())
    got = torch.autograd.grad(o, args, dy)
    for name, g, w in zip(("q", "k", "v", "fq", "fk", "f"), got, want):
        assert_rel_close(g, w, 1e-2 if name == "f" else 5e-3, name)


@needs_cuda
def test_gpu_inductor_compile_equals_eager():
    args = [x.float().requires_grad_() for x in hedgehog_inputs(1000, "cuda")]
    fn = lambda *a: lolcats_attn_chunk(*a, window=64, softcap=30.0)[0]  # noqa: E731
    torch._dynamo.reset()
    got, want = torch.compile(fn, fullgraph=True)(*args), fn(*args)
    assert_rel_close(got, want, 1e-5)
    for g, w in zip(torch.autograd.grad(got.square().sum(), args), torch.autograd.grad(want.square().sum(), args)):
        assert_rel_close(g, w, 1e-4)
