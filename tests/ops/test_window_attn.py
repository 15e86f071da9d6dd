import math
import re

import pytest
import torch

from helpers import TOL, assert_rel_close, assert_state_close, capped, count_chunk_steps, window_of
from linearize.ops.window_attn import (
    WindowState, cache_len, window_attn_chunk, window_attn_parallel, window_attn_recurrent,
)
from kernel_cases import CASE_TOL, INTERPRETER_CASES, KTOL, cases_of, window_case
from kernel_checks import assert_interpreter_case, _gluon_spy, _LaunchRecorder, assert_errors, needs_cuda, needs_triton

B, H, T, DK, DV = 2, 3, 37, 8, 5
M_LOGITS, M_KV = 2, 3
# Standard w = 5 (cache 4); terraced w = 4 (blocks of 4, cache 7): both well inside T.
WINDOWS = {False: 5, True: 4}
SINKS = ["none", "logits", "kv", "both"]
# Scores are ~N(0, 1) here, so a cap of 1.5 changes them a lot; None is the uncapped op.
SOFTCAPS = [None, 1.5]


def inputs(dtype, seed=0, T=T, B=B):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, DK, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sinks(kind, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = {}
    if kind in ("logits", "both"):
        out["sink_logits"] = torch.randn(H, M_LOGITS, generator=g, dtype=torch.float64).to(dtype)
    if kind in ("kv", "both"):
        out["sink_k"] = torch.randn(H, M_KV, DK, generator=g, dtype=torch.float64).to(dtype)
        out["sink_v"] = torch.randn(H, M_KV, DV, generator=g, dtype=torch.float64).to(dtype)
    return out


FORMS = {
    "parallel": window_attn_parallel,
    "chunk": lambda *a, **kw: window_attn_chunk(*a, chunk_size=8, **kw),
    "recurrent": window_attn_recurrent,
}


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("terraced", [False, True])
def test_parallel_matches_explicit_softmax(terraced, softcap):
    """The reference, by hand; with a soft-cap on the query-key logits (window and sink keys),
    never on the learned sink logits."""
    q, k, v = inputs(torch.float64)
    sk = sinks("both")
    w = WINDOWS[terraced]
    o, _ = window_attn_parallel(q, k, v, window=w, terraced=terraced, softcap=softcap, **sk)
    scale = 1 / math.sqrt(DK)
    for t in (0, 2, 4, 7, 20, 23, T - 1):
        win = window_of(t, w, terraced)
        logits = torch.cat([
            sk["sink_logits"][None].expand(B, H, M_LOGITS),
            capped(torch.einsum("bhd,hmd->bhm", q[:, :, t], sk["sink_k"]) * scale, softcap),
            capped(torch.einsum("bhd,bhsd->bhs", q[:, :, t], k[:, :, win]) * scale, softcap),
        ], dim=-1)
        values = torch.cat([
            torch.zeros(B, H, M_LOGITS, DV, dtype=torch.float64),  # v2 sinks carry no value
            sk["sink_v"][None].expand(B, H, M_KV, DV),
            v[:, :, win],
        ], dim=2)
        ref = torch.einsum("bhs,bhsd->bhd", torch.softmax(logits, -1), values)
        assert_rel_close(o[:, :, t], ref, 1e-12, f"t={t}")


def test_cache_length():
    assert cache_len(5, False) == 4 and cache_len(4, True) == 7 and cache_len(1, False) == 0


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("sink", SINKS)
@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["chunk", "recurrent", "parallel"])
def test_forms_agree(form, dtype, terraced, sink, softcap):
    kw = dict(window=WINDOWS[terraced], terraced=terraced, softcap=softcap)
    ref, ref_state = window_attn_parallel(*inputs(torch.float64), **kw, **sinks(sink))
    o, state = FORMS[form](*inputs(dtype), **kw, **sinks(sink, dtype))
    assert o.dtype == dtype
    assert state.k.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert state.pos.dtype == torch.int64
    assert_rel_close(o, ref, TOL[dtype], f"{form} {dtype}")
    assert_state_close(state, ref_state, TOL[dtype])
    assert state.pos.tolist() == [T] * B


@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("window", [1, 2, 50])
def test_extreme_windows(window, terraced):
    """Empty or one-slot caches, and a window longer than the input (= full causal softmax)."""
    q, k, v = inputs(torch.float64)
    kw = dict(window=window, terraced=terraced)
    ref, ref_state = window_attn_parallel(q, k, v, **kw)
    for form in (lambda *a, **kw: window_attn_chunk(*a, chunk_size=3, **kw), window_attn_recurrent):
        o, state = form(q, k, v, **kw)
        assert_rel_close(o, ref, 1e-12)
        assert_state_close(state, ref_state, 1e-12)
    if window == 1 and not terraced:  # each query sees only itself
        assert_rel_close(ref, v, 1e-15)
    if window == 50:
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2) / math.sqrt(DK)).masked_fill(~causal, -math.inf)
        assert_rel_close(ref, torch.softmax(scores, -1) @ v, 1e-12)


@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 5, 8, 64])
def test_chunk_size_and_length_do_not_change_prefix(chunk_size, terraced):
    q, k, v = inputs(torch.float64)
    kw = dict(window=WINDOWS[terraced], terraced=terraced, **sinks("both"))
    ref, _ = window_attn_parallel(q, k, v, **kw)
    o, _ = window_attn_chunk(q[:, :, :29], k[:, :, :29], v[:, :, :29], chunk_size=chunk_size, **kw)
    assert_rel_close(o, ref[:, :, :29], 1e-12)


@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
def test_causal(form, terraced):
    q, k, v = inputs(torch.float64)
    kw = dict(window=WINDOWS[terraced], terraced=terraced, **sinks("both"))
    o, _ = FORMS[form](q, k, v, **kw)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, :, 21:] = torch.randn_like(x[:, :, 21:])
    o2, _ = FORMS[form](q2, k2, v2, **kw)
    assert torch.equal(o[:, :, :21], o2[:, :, :21])
    assert not torch.allclose(o[:, :, 21:], o2[:, :, 21:])


# Splits inside the first window (state partly empty), inside a block, on a block boundary
# (terraced w = 4) and late in the sequence.
@pytest.mark.parametrize("split", [2, 13, 16, 30])
@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
def test_two_piece_prefill_equals_one(form, terraced, split):
    q, k, v = inputs(torch.float64)
    kw = dict(window=WINDOWS[terraced], terraced=terraced, **sinks("both"))
    full, full_state = FORMS[form](q, k, v, **kw)
    a, st = FORMS[form](q[:, :, :split], k[:, :, :split], v[:, :, :split], **kw)
    b, st = FORMS[form](q[:, :, split:], k[:, :, split:], v[:, :, split:], state=st, **kw)
    assert_rel_close(torch.cat([a, b], 2), full, 1e-12)
    assert_state_close(st, full_state, 1e-12)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("terraced", [False, True])
def test_chunk_prefill_then_recurrent_decode_equals_full_forward(terraced, softcap):
    q, k, v = inputs(torch.float64)
    kw = dict(window=WINDOWS[terraced], terraced=terraced, softcap=softcap, **sinks("both"))
    full, full_state = window_attn_parallel(q, k, v, **kw)
    a, st = window_attn_chunk(q[:, :, :22], k[:, :, :22], v[:, :, :22], chunk_size=6, **kw)
    outs = [a]
    for t in range(22, T):
        o, st = window_attn_recurrent(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, **kw)
        outs.append(o)
    assert_rel_close(torch.cat(outs, 2), full, 1e-12)
    assert_state_close(st, full_state, 1e-12)


@pytest.mark.parametrize("sink", ["none", "both"])
@pytest.mark.parametrize("terraced", [False, True])
@pytest.mark.parametrize("form", list(FORMS))
def test_left_padding_via_negative_pos(form, terraced, sink):
    """Row 0 carries 3 padding tokens at positions -3..-1: its real tokens get what they get alone."""
    pad = 3
    kw = dict(window=WINDOWS[terraced], terraced=terraced, **sinks(sink))
    q, k, v = inputs(torch.float64, T=T + pad)
    alone0, st0 = FORMS[form](q[:1, :, pad:], k[:1, :, pad:], v[:1, :, pad:], **kw)
    alone1, st1 = FORMS[form](q[1:], k[1:], v[1:], **kw)
    L = cache_len(kw["window"], terraced)
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64)  # noqa: E731
    start = WindowState(zeros(2, H, L, DK), zeros(2, H, L, DV), torch.tensor([-pad, 0]))
    o, st = FORMS[form](q, k, v, state=start, **kw)
    assert torch.isfinite(o).all()
    assert_rel_close(o[:1, :, pad:], alone0, 1e-12)
    assert_rel_close(o[1:], alone1, 1e-12)
    assert st.pos.tolist() == [T, T + pad]
    assert_rel_close(st.k[:1], st0.k, 1e-12)
    if sink == "none":  # a padding query sees nothing at all: exactly zero, not NaN
        assert torch.equal(o[:1, :, :pad], torch.zeros_like(o[:1, :, :pad]))


def test_empty_input_keeps_state():
    q, k, v = inputs(torch.float64)
    _, st = window_attn_chunk(q, k, v, window=5)
    for form in FORMS.values():
        o, st2 = form(q[:, :, :0], k[:, :, :0], v[:, :, :0], window=5, state=st)
        assert o.shape == (B, H, 0, DV)
        assert_state_close(st2, st, 0.0)


def test_chunk_form_takes_ceil_t_over_c_steps():
    with count_chunk_steps() as counter:
        window_attn_chunk(*inputs(torch.float32), window=5, chunk_size=8)
    assert counter == {"calls": 1, "spans": math.ceil(T / 8)}


@pytest.mark.parametrize("sink", SINKS)
@pytest.mark.parametrize("form", list(FORMS))
def test_softcap_large_is_no_cap_and_small_changes_the_output(form, sink):
    q, k, v = inputs(torch.float64)
    kw = dict(window=WINDOWS[False], **sinks(sink))
    ref, ref_state = FORMS[form](q, k, v, **kw)
    none, _ = FORMS[form](q, k, v, softcap=None, **kw)
    assert torch.equal(none, ref)  # None is the default, bit for bit
    big, big_state = FORMS[form](q, k, v, softcap=1e6, **kw)
    assert_rel_close(big, ref, 1e-10)  # c tanh(x / c) = x - x^3 / (3 c^2) + ...
    assert_state_close(big_state, ref_state, 0.0)  # the cache holds raw keys/values
    small, _ = FORMS[form](q, k, v, softcap=1.0, **kw)
    assert torch.isfinite(small).all()
    assert (small - ref).abs().max() > 1e-2


@pytest.mark.parametrize("terraced", [False, True])
def test_gradcheck_chunk(terraced):
    g = torch.Generator().manual_seed(3)
    Bs, Hs, Ts, Dk, Dv, m = 1, 2, 7, 3, 2, 2
    shapes = ((Bs, Hs, Ts, Dk), (Bs, Hs, Ts, Dk), (Bs, Hs, Ts, Dv), (Hs, m), (Hs, m, Dk), (Hs, m, Dv))
    args = [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True) for shape in shapes]

    def fn(q, k, v, sink_logits, sink_k, sink_v, softcap=None):
        return window_attn_chunk(q, k, v, window=2, terraced=terraced, chunk_size=3, sink_logits=sink_logits,
                                 sink_k=sink_k, sink_v=sink_v, softcap=softcap)[0]

    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradcheck(lambda *a: fn(*a, softcap=1.5), args)


@pytest.mark.parametrize("terraced", [False, True])
def test_state_size_does_not_depend_on_length(terraced):
    shapes = []
    for length in (50, 500):
        q, k, v = (x[:1, :1] for x in inputs(torch.float32, T=length))
        for form in (window_attn_chunk, window_attn_recurrent):
            _, st = form(q, k, v, window=WINDOWS[terraced], terraced=terraced)
            shapes.append([tuple(x.shape) for x in st])
    assert all(s == shapes[0] for s in shapes)
    L = cache_len(WINDOWS[terraced], terraced)
    assert shapes[0] == [(1, 1, L, DK), (1, 1, L, DV), (1,)]


def test_bad_inputs_raise_naming_the_value():
    q, k, v = inputs(torch.float32)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"window must be a positive int, got {bad!r}"):
            window_attn_parallel(q, k, v, window=bad)
    with pytest.raises(ValueError, match=r"terraced must be a bool, got 'yes'"):
        window_attn_chunk(q, k, v, window=4, terraced="yes")
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got 0"):
        window_attn_chunk(q, k, v, window=4, chunk_size=0)
    with pytest.raises(ValueError, match=r"sink_logits must have shape \(H, m\) = \(3, m\), got \(4, 2\)"):
        window_attn_recurrent(q, k, v, window=4, sink_logits=torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"sink_k must have shape \(H, m, Dk\) = \(3, m, 8\), got \(3, 2, 7\)"):
        window_attn_chunk(q, k, v, window=4, sink_k=torch.zeros(3, 2, 7), sink_v=torch.zeros(3, 2, 5))
    with pytest.raises(ValueError, match=r"sink_v must have shape \(H, m, Dv\) = \(3, 2, 5\), got \(3, 3, 5\)"):
        window_attn_parallel(q, k, v, window=4, sink_k=torch.zeros(3, 2, 8), sink_v=torch.zeros(3, 3, 5))
    with pytest.raises(ValueError, match=r"sink_k and sink_v must be given together"):
        window_attn_parallel(q, k, v, window=4, sink_k=torch.zeros(3, 2, DK))
    _, st = window_attn_chunk(q, k, v, window=5)  # cache of 4
    with pytest.raises(ValueError, match=r"state.k must have shape \(2, 3, 5, 8\), got \(2, 3, 4, 8\)"):
        window_attn_recurrent(q, k, v, window=6, state=st)
    with pytest.raises(ValueError, match=r"state.k must have shape \(2, 3, 9, 8\), got \(2, 3, 4, 8\)"):
        window_attn_parallel(q, k, v, window=5, terraced=True, state=st)
    with pytest.raises(ValueError, match=r"state.pos must have dtype torch.int64, got torch.int32"):
        window_attn_chunk(q, k, v, window=5, state=st._replace(pos=st.pos.int()))
    with pytest.raises(ValueError, match=r"state.pos must have shape \(2,\), got \(1,\)"):
        window_attn_chunk(q, k, v, window=5, state=st._replace(pos=st.pos[:1]))
    with pytest.raises(ValueError, match=r"scale must be a positive finite number, got -1.0"):
        window_attn_chunk(q, k, v, window=5, scale=-1.0)
    for bad in (0, 0.0, -2.0, math.inf, math.nan, True, "50", torch.tensor(50.0)):
        for form in FORMS.values():
            with pytest.raises(ValueError, match=r"softcap must be a positive finite number or None, got "
                               + re.escape(repr(bad))):
                form(q, k, v, window=5, softcap=bad)


@pytest.mark.parametrize("sinks", ["none", "logits", "kv"])
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_ring_step_is_the_recurrent_form(sinks, softcap):
    """window_ring_step_ (a decoder's static ring buffer, query heads grouped over shared KV heads):
    token by token, the outputs of window_attn_recurrent on the KV heads repeated per query head."""
    from linearize.ops.window_attn import window_ring_step_

    g = torch.Generator().manual_seed(4)
    Hkv, G, D, w, n = 2, 3, 8, 5, 9
    Hq = Hkv * G
    q = torch.randn(B, Hq, n, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, n, D, generator=g, dtype=torch.float64) for _ in range(2))
    kw = {}
    if sinks == "logits":
        kw = dict(sink_logits=torch.randn(Hq, M_LOGITS, generator=g, dtype=torch.float64))
    elif sinks == "kv":
        kw = dict(sink_k=torch.randn(Hq, M_KV, D, generator=g, dtype=torch.float64),
                  sink_v=torch.randn(Hq, M_KV, D, generator=g, dtype=torch.float64))
    ref, _ = window_attn_recurrent(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), window=w,
                                   softcap=softcap, **kw)
    ring_k, ring_v = (torch.zeros(B, Hkv, w, D, dtype=torch.float64) for _ in range(2))
    outs = []
    for t in range(n):
        pos = torch.full((B,), t)
        outs.append(window_ring_step_(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], ring_k, ring_v, pos,
                                      softcap=softcap, dtype=torch.float64, **kw))
    assert_rel_close(torch.cat(outs, 2), ref, TOL[torch.float64])


# ----------------------------------------------------------------------------- window: the kernels

# CPU, Triton interpreter: this op's cases of kernel_cases.INTERPRETER_CASES, in one subprocess
# (tests/ops/conftest.py, interpreter_results)
INTERPRETER_OP = "window"


@needs_triton
@pytest.mark.parametrize("name", cases_of(INTERPRETER_OP))
def test_interpreter_kernels_match_reference(interpreter_results, name):
    assert_interpreter_case(interpreter_results, name)


@needs_cuda
@pytest.mark.parametrize("variant, dtype", [("sinks fused padded", torch.float32),
                                            ("sinks fused padded", torch.bfloat16), ("no sinks", torch.bfloat16),
                                            ("short", torch.bfloat16), ("w=1", torch.bfloat16),
                                            ("sinks fused padded kv 64x32", torch.bfloat16),
                                            ("sinks fused padded kv 32x32", torch.bfloat16)])
def test_gpu_window_matches_reference(variant, dtype):
    kw = dict(T=333, D=128, DV=128, W=128, nsink=4, bm=None)
    if " kv " in variant:  # the dk/dv pass's blocks of other tune candidates (the default is 32 x 64)
        kv_bm, kv_bn = (int(x) for x in variant.split()[-1].split("x"))
        kw["kv"] = dict(kv_bm=kv_bm, kv_bn=kv_bn)
    if variant == "no sinks":
        kw["nsink"] = 0
    if "fused" in variant:
        kw["fuse"] = True
    if "padded" in variant:
        kw["pad"] = 17
    if variant == "short":
        kw["T"] = 50
    if variant == "w=1":
        kw["W"] = 1
    err = window_case("cuda", dtype, **kw)
    assert_errors(err, KTOL[dtype], f"window {variant} {dtype}")


@needs_cuda
@pytest.mark.parametrize("variant", ["sinks fused", "no sinks", "sinks", "window 100", "window 129",
                                     "window 1 sinks", "T=64", "fp16 sinks fused", "model layout sinks fused"])
def test_gpu_window_gluon_backward_matches_reference(variant, gluon_window_calls):
    """The window's backward as the Gluon kernel (what window_attn_triton and Lizard's op run on
    Hopper where its scope holds) against the fp64 reference: dq, dk, dv, d sinks, and with the
    combine fused d y_g and d alpha; windows of 1 to 129, one chunk, fp16, a model's layout. (A
    window of 1 takes sinks: without them each row's one probability is exactly 1, dq and dk are
    exactly 0, and any rounding of dy . v against D is an infinite relative error: that case
    failed once on the H200 with differences of 1e-4.)"""
    dtype = torch.float16 if variant.startswith("fp16") else torch.bfloat16
    W = int(variant.split()[1]) if variant.startswith("window") else 128
    kw = dict(T=64 if variant == "T=64" else 1024, D=128, DV=128, W=W, nsink=4 if "sinks" in variant else 0,
              fuse="fused" in variant, bm=None, bthd=variant.startswith("model layout"),
              kv=dict(gluon_bwd_walk=False))  # the kernel of one program per chunk (walking is the default)
    err = window_case("cuda", dtype, **kw)
    assert gluon_window_calls == [W], gluon_window_calls
    assert_errors(err, KTOL[dtype], f"window gluon backward {variant}")


@needs_cuda
@pytest.mark.parametrize("variant", ["sinks fused", "no sinks", "window 100", "window 1 sinks", "T=64", "T=128",
                                     "T=192", "T=1216 sinks", "T=4096 fp16 sinks", "model layout sinks fused",
                                     "pre-pass sinks fused", "pre-pass T=1216 sinks", "pre-pass T=128",
                                     "scores sinks fused", "scores T=64", "scores T=128", "scores T=192",
                                     "scores T=1216 sinks", "scores T=4096 fp16 sinks", "scores window 1 sinks",
                                     "scores window 100", "scores model layout sinks fused"])
def test_gpu_window_gluon_walk_backward_matches_reference(variant, monkeypatch):
    """The window's backward as the walking Gluon kernel (WindowLaunch.gluon_bwd_walk: one
    program per segment of chunks, two rings of tile slots) against the fp64 reference: dq, dk,
    dv, d sinks, with the combine fused d y_g and d alpha; one, two and three chunks (the rings'
    edges), two segments of 10 and 9 chunks, eight segments in fp16, windows of 1 and 100, a
    model's layout. D formed in the kernel (the default), "scores": in the kernel from its scores
    (o not given: what Lizard's op runs, KernelSettings.ow_from_scores), or, "pre-pass", by the
    delta pass."""
    calls = _gluon_spy(monkeypatch, "window_attn.gluon", "bwd", "walk")
    own = not variant.startswith("pre-pass")
    scores = variant.startswith("scores")
    variant = variant.removeprefix("pre-pass ").removeprefix("scores ")
    dtype = torch.float16 if "fp16" in variant else torch.bfloat16
    W = int(variant.split()[1]) if variant.startswith("window") else 128
    T = int(variant.split()[0][2:]) if variant.startswith("T=") else 1024
    kw = dict(T=T, D=128, DV=128, W=W, nsink=4 if "sinks" in variant or variant.startswith("window 1 ") else 0,
              fuse="fused" in variant, bm=None, bthd=variant.startswith("model layout"),
              kv=dict(gluon_bwd_walk=True, gluon_walk_delta=own))
    from linearize.ops.window_attn import gluon as window_gluon

    bwd, seen = window_gluon.bwd, []

    def spy(*a, **k):
        seen.append(k.get("o") is not None)
        if scores:  # the window op keeps o: the kernel is told to form D from its scores instead
            k = {**k, "o": None, "scores_delta": k.get("o") is not None}
        return bwd(*a, **k)

    monkeypatch.setattr(window_gluon, "bwd", spy)
    err = window_case("cuda", dtype, **kw)
    assert calls == [True] and seen == [own], (calls, seen)
    assert_errors(err, KTOL[dtype], f"window gluon walk backward {variant} (D {'own' if own else 'pre-pass'})")


def test_gluon_window_backward_launch_host_side(monkeypatch):
    """window_gluon.bwd up to its launch, on CPU: the grid, scales and constexprs, and its refusal
    of layouts TMA cannot read."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.window_attn import gluon as window_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(window_gluon, "_win_bwd_kernel", rec)
    B, H, T, D = 2, 3, 192, 128
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    k = k.transpose(1, 2).contiguous().transpose(1, 2)  # a model's layout
    lse, delta = torch.zeros(B * H, T), torch.zeros(B * H, T)
    dq, dk, dv = (torch.empty(B, H, T, D, dtype=torch.bfloat16) for _ in range(3))
    window_gluon.bwd(q, k, v, dy, lse, delta, torch.ones(H), dq, dk, dv, window=100, scale=0.125)
    (grid, args, kw), = rec.calls
    assert grid == (T // 64, B * H)
    assert kw == dict(MODEL_LAYOUT=0b010, HAS_ALPHA=True, W=100, C=64, D=D, DV=D, num_warps=4)
    assert args[-2] == pytest.approx(0.125 * 1.4426950408889634) and args[-1] == 0.125
    with pytest.raises(ValueError, match="outside its scope"):
        window_gluon.bwd(q, k, v.transpose(2, 3), dy, lse, delta, None, dq, dk, dv, window=100, scale=0.125)


@pytest.mark.parametrize("T, D_from", [(64, "pre-pass"), (1216, "pre-pass"), (1216, "o"), (1216, "scores")])
def test_gluon_window_walk_backward_launch_host_side(T, D_from, monkeypatch):
    """window_gluon.bwd with walk=True up to its launch, on CPU: the grid (segments x batch*heads,
    the last segment shorter), the segment length, dk's, dv's and dq's tiles (they leave by TMA),
    the constexprs (OWN_DELTA where o is given
    or scores_delta, D_SCORES with the latter); o, scores_delta and prof refused with the
    one-chunk kernel, o with scores_delta refused, o of another shape and prof of another size
    refused by name."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.window_attn import gluon as window_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(window_gluon, "_win_bwd_walk_kernel", rec)
    B, H, D = 1, 2, 128
    g = torch.Generator().manual_seed(0)
    q, k, v, dy, o = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(5))
    lse, delta = torch.zeros(B * H, T), torch.zeros(B * H, T)
    dq, dk, dv = (torch.empty(B, H, T, D, dtype=torch.bfloat16) for _ in range(3))
    window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, walk=True, sms=132,
                     o=o if D_from == "o" else None, scores_delta=D_from == "scores")
    (grid, args, kw), = rec.calls
    nseg, seg_chunks = (1, 1) if T == 64 else (2, 10)  # 19 chunks: segments of 10 and 9
    assert grid == (nseg, B * H) and args[14] == seg_chunks
    assert args[10] is (o if D_from == "o" else dy)
    assert [a.base.data_ptr() for a in args[7:10]] == [x.data_ptr() for x in (dk, dv, dq)]  # out by TMA
    assert kw == dict(MODEL_LAYOUT=0, HAS_ALPHA=False, W=128, C=64, D=D, DV=D, OWN_DELTA=D_from != "pre-pass",
                      D_SCORES=D_from == "scores", NPROF=0, num_warps=4)
    assert args[-2] == pytest.approx(0.125 * 1.4426950408889634) and args[-1] == 0.125
    with pytest.raises(ValueError, match="walking kernel"):
        window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, o=o)
    with pytest.raises(ValueError, match="walking kernel"):
        window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, scores_delta=True)
    with pytest.raises(ValueError, match="not both"):
        window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, walk=True, o=o,
                         scores_delta=True)
    with pytest.raises(ValueError, match=r"o must be contiguous \(1, 2, %d, 128\)" % T):
        window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, walk=True,
                         o=o[..., :64])
    with pytest.raises(ValueError, match=r"prof must be \(%d, 16\), got \(3, 16\)" % (nseg * B * H * 2)):
        window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, walk=True,
                         prof=torch.zeros(3, 16, dtype=torch.int64))


def test_window_walk_segment_rule():
    """walk_segments: doubled while batch x heads leave multiprocessors idle, segments at least 8 chunks."""
    from linearize.ops.window_attn.gluon import walk_segments

    assert [walk_segments(B * 32, T // 64, 132) for B, T in ((16, 2048), (4, 8192), (1, 32768))] == [1, 2, 8]
    assert walk_segments(2, 16, 132) == 2 and walk_segments(2, 15, 132) == 1 and walk_segments(1, 1, 132) == 1
