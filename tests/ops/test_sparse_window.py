"""The sparse window (window + sinks + a bounded cache of the worst-recalled pairs): every form
against a brute-force reference that picks each query's cache by sorting, and the state's bounds."""

import math

import pytest
import torch

from helpers import count_chunk_steps
from kernel_cases import cases_of
from kernel_checks import assert_interpreter_case, needs_cuda, needs_triton
from linearize.ops.sparse_window import (
    SparseWindowState, chunk, fresh_state, sparse_window_attn_chunk, sparse_window_attn_parallel,
    sparse_window_attn_recurrent,
)
from linearize.ops.sparse_window import live
from linearize.ops.sparse_window.live import cache_until

B, H, D = 2, 3, 8


def shifted(pair_score, w):
    """The op's score input: at query t, the score of the pair leaving the window then (t - w)."""
    return torch.cat([torch.full_like(pair_score[..., :w], -7.0), pair_score], -1)[..., : pair_score.shape[-1]]


def shifted_keys(pair_k, w):
    """``shifted`` for keys (B, H, T, D): at query t, the key of the pair leaving then."""
    return torch.cat([torch.zeros_like(pair_k[:, :, :w]), pair_k], 2)[:, :, : pair_k.shape[2]]


def inputs(T, seed=0, ties=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(3))
    score = torch.randint(0, 3, (B, H, T), generator=g).to(dtype) if ties else torch.rand(B, H, T, generator=g, dtype=dtype)
    sinks = torch.randn(H, 2, generator=g, dtype=dtype)
    return q, k, v, score, sinks


def reference(q, k, v, score, sinks, w, M, cache_q=None, cache_k=None):
    """Query t: softmax over the sink logits, keys t-w < s <= t, and the M pairs s <= t - w with the
    largest (score, s), found by sorting; score[s] is pair s's own. A cached pair s scores
    cache_q[t] . cache_k[s] when those are given (cache_k[s]: pair s's own), else q[t] . k[s]."""
    Bq, Hq, T, d = q.shape
    cache_q = q if cache_q is None else cache_q
    cache_k = k if cache_k is None else cache_k
    out = torch.zeros_like(v)
    for b in range(Bq):
        for h in range(Hq):
            for t in range(T):
                old = sorted(range(0, max(t - w + 1, 0)), key=lambda s: (score[b, h, s].item(), s), reverse=True)
                near = list(range(max(t - w + 1, 0), t + 1))
                keys = near + old[:M]
                logits = torch.stack([q[b, h, t] @ k[b, h, s] / math.sqrt(d) for s in near]
                                     + [cache_q[b, h, t] @ cache_k[b, h, s] / math.sqrt(d) for s in old[:M]])
                allz = torch.cat([logits, sinks[h]])
                p = torch.softmax(allz, 0)[: len(keys)]
                out[b, h, t] = p @ v[b, h, keys]
    return out


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("w,M", [(3, 2), (4, 5), (2, 1)])
def test_every_form_equals_the_sorting_reference(w, M, ties):
    T = 17
    q, k, v, score, sinks = inputs(T, ties=ties)
    ref = reference(q, k, v, score, sinks, w, M)
    kw = {"window": w, "cache_size": M, "sink_logits": sinks}
    given = shifted(score, w)
    outs = {"parallel": sparse_window_attn_parallel(q, k, v, given, **kw)[0],
            "recurrent": sparse_window_attn_recurrent(q, k, v, given, **kw)[0]}
    for C in (1, 3, 5, 64):
        outs[f"chunk {C}"] = sparse_window_attn_chunk(q, k, v, given, chunk_size=C, **kw)[0]
        outs[f"live {C}"] = sparse_window_attn_chunk(q, k, v, given, chunk_size=C, form="live", **kw)[0]
    for name, o in outs.items():
        torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("w,M", [(3, 2), (4, 5)])
def test_the_cache_read_with_its_own_queries_and_keys(w, M):
    """``cache_q`` reads the cache and ``leave_k`` (shifted like the score) is what a leaving pair
    is cached with (the layer's RoPE-free cache): every form equals the reference, and passing q
    and the shifted k themselves changes nothing."""
    T = 17
    q, k, v, score, sinks = inputs(T, seed=5)
    g = torch.Generator().manual_seed(6)
    cq, ck = torch.randn(q.shape, generator=g, dtype=q.dtype), torch.randn(k.shape, generator=g, dtype=k.dtype)
    ref = reference(q, k, v, score, sinks, w, M, cache_q=cq, cache_k=ck)
    kw = {"window": w, "cache_size": M, "sink_logits": sinks, "cache_q": cq, "leave_k": shifted_keys(ck, w)}
    given = shifted(score, w)
    outs = {"parallel": sparse_window_attn_parallel(q, k, v, given, **kw),
            "recurrent": sparse_window_attn_recurrent(q, k, v, given, **kw)}
    for C in (1, 3, 64):
        outs[f"chunk {C}"] = sparse_window_attn_chunk(q, k, v, given, chunk_size=C, **kw)
        outs[f"live {C}"] = sparse_window_attn_chunk(q, k, v, given, chunk_size=C, form="live", **kw)
    for name, (o, st) in outs.items():
        torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12, msg=name)
        kept = st.cache_pos[0, 0].clamp_min(0)
        torch.testing.assert_close(st.cache_k[0, 0], ck[0, 0, kept] * (st.cache_pos[0, 0, :, None] >= 0), msg=name)
    same = sparse_window_attn_chunk(q, k, v, given, window=w, cache_size=M, sink_logits=sinks, chunk_size=3,
                                    cache_q=q, leave_k=shifted_keys(k, w))[0]
    torch.testing.assert_close(same, reference(q, k, v, score, sinks, w, M), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("C", [3, 64])
def test_chunk_gradients_equal_the_sorting_reference(C, recompute):
    """Training with the cache on (stage 2) backpropagates through the chunk form: its gradients
    for q, k, v and the sink logits are the brute-force reference's (the selection has none),
    with the spans recomputed in backward or kept."""
    w, M, T = 3, 2, 13
    q, k, v, score, sinks = inputs(T, seed=3)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    weight = torch.randn(v.shape, generator=torch.Generator().manual_seed(4), dtype=v.dtype)
    o = sparse_window_attn_chunk(*leaves[:3], shifted(score, w), window=w, cache_size=M, sink_logits=leaves[3],
                                 chunk_size=C, recompute=recompute)[0]
    grads = torch.autograd.grad((o * weight).sum(), leaves)
    ref = reference(*ref_leaves[:3], score, ref_leaves[3], w, M)
    ref_grads = torch.autograd.grad((ref * weight).sum(), ref_leaves)
    for name, g, r in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10, msg=name)


def saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while ``fn`` runs."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_recompute_keeps_only_the_inputs_for_backward():
    """Kept, every span's gathered cache and softmax stay alive until backward (O(T (M + w) (D + C))
    bytes); recomputed, autograd keeps no more than the inputs and, from a fresh state (the live
    form), each pair's last query in the cache (4 bytes a pair and head), whatever the length."""
    w, M, T, D = 8, 16, 256, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, T, D, generator=g, requires_grad=True) for _ in range(3))
    score, sinks = torch.rand(2, 3, T, generator=g), torch.zeros(3, 2, requires_grad=True)
    run = lambda recompute: sparse_window_attn_chunk(  # noqa: E731
        q, k, v, score, window=w, cache_size=M, sink_logits=sinks, chunk_size=16, recompute=recompute)
    inputs_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, score, sinks))
    kept, recomputed = saved_bytes(lambda: run(False)), saved_bytes(lambda: run(True))
    assert recomputed <= inputs_bytes + 2 * 3 * T * 4 + 4096, (recomputed, inputs_bytes)
    assert kept > 5 * inputs_bytes, (kept, inputs_bytes)


@pytest.mark.parametrize("cut", [1, 6, 9])
def test_pieces_with_carried_state_equal_one_piece(cut):
    T = 20
    q, k, v, score, sinks = inputs(T, seed=1)
    score = shifted(score, 4)
    kw = {"window": 4, "cache_size": 3, "sink_logits": sinks}
    one, s_one = sparse_window_attn_chunk(q, k, v, score, chunk_size=4, **kw)
    a, st = sparse_window_attn_chunk(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], score[:, :, :cut], chunk_size=4, **kw)
    b, s_two = sparse_window_attn_recurrent(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], score[:, :, cut:], state=st, **kw)
    torch.testing.assert_close(torch.cat([a, b], 2), one, rtol=1e-12, atol=1e-12)
    # the same pairs in the cache (slots may be in another order)
    order = lambda s: torch.sort(s.cache_pos, -1).values  # noqa: E731
    assert torch.equal(order(s_one), order(s_two))


def test_cache_is_bounded_and_holds_the_top_scores():
    T, w, M = 300, 8, 5
    q, k, v, score, _ = inputs(T, seed=2)
    score[:, :, T - w] = 2.0  # the best pair of all, but still in the window (it leaves at query T)
    _, st = sparse_window_attn_chunk(q, k, v, shifted(score, w), window=w, cache_size=M, chunk_size=32)
    assert st.cache_k.shape == (B, H, M, D) and st.k.shape == (B, H, w, D)
    for b in range(B):
        for h in range(H):
            best = torch.topk(score[b, h, : T - w], M).indices  # candidates: positions <= T - 1 - w
            assert sorted(st.cache_pos[b, h].tolist()) == sorted(best.tolist())
            torch.testing.assert_close(st.cache_v[b, h][st.cache_pos[b, h].argsort()], v[b, h, best.sort().values])
    # fewer candidates than slots: the rest stay empty
    _, st = sparse_window_attn_chunk(q[:, :, :10], k[:, :, :10], v[:, :, :10], shifted(score[:, :, :10], w),
                                     window=w, cache_size=M)
    assert ((st.cache_pos >= 0).sum(-1) == 10 - w).all()
    assert (st.cache_v[st.cache_pos < 0] == 0).all()


def test_left_padding_is_never_cached_or_seen():
    """A row whose first tokens are padding (positions below 0) gives the outputs it gives alone."""
    T, pad, w, M = 15, 6, 3, 2
    q, k, v, score, sinks = inputs(T, seed=3)
    alone = sparse_window_attn_chunk(q[:, :, pad:], k[:, :, pad:], v[:, :, pad:], shifted(score[:, :, pad:], w),
                                     window=w, cache_size=M, sink_logits=sinks, chunk_size=4)[0]
    pos = torch.full((B,), -pad, dtype=torch.int64)
    st = fresh_state(B, H, D, D, w, M, dtype=torch.float64, pos=pos)
    score = score.clone()
    score[:, :, :pad] = 1e9  # padding that would win every slot, were it a candidate
    padded = sparse_window_attn_chunk(q, k, v, shifted(score, w), window=w, cache_size=M, sink_logits=sinks,
                                      state=st, chunk_size=4)[0]
    torch.testing.assert_close(padded[:, :, pad:], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block", [256, 3, 1])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("w,M,T", [(3, 2, 30), (5, 4, 7), (8, 3, 6), (2, 40, 25)])
def test_each_pairs_stay_in_the_cache_is_the_interval_the_sorting_rule_gives(w, M, T, ties, block, monkeypatch):
    """``cache_until``: pair s is a member at query t (the top M of the pairs s' <= t - w by
    (score, s), found by sorting) exactly when s <= t - w < j_s; left padding is never a member;
    the same whatever the scan's block (the cache carried from block to block)."""
    monkeypatch.setattr(live, "SCAN_BLOCK", block)
    _, _, _, score, _ = inputs(T, seed=7, ties=ties)
    P, pad = max(T - w, 0), 2
    candidate = (torch.arange(P) >= torch.tensor([0, pad])[:, None])             # row 1: two pads
    until = cache_until(score[:, :, :P], candidate, M)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                old = [s for s in range(P) if s <= t - w and candidate[b, s]]
                top = set(sorted(old, key=lambda s: (score[b, h, s].item(), s), reverse=True)[:M])
                members = {s for s in range(P) if s <= t - w < until[b, h, s]}
                assert members == top, (b, h, t)


def grads_of(run, leaves, seed=9):
    o, st = run(*leaves)
    weight = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=o.dtype)
    return o, st, torch.autograd.grad((o * weight).sum(), leaves, allow_unused=True)


@pytest.mark.parametrize("case", ["logits", "kv sinks", "softcap", "cache q and k", "left padding", "short"])
@pytest.mark.parametrize("C", [1, 4, 16])
def test_the_live_form_equals_the_span_loop(case, C):
    """From a fresh state the chunk form runs all spans at once (the live form): outputs, every
    field of the final state and every gradient are the span loop's (the same state, not said
    to be fresh), with sinks of both kinds, soft-capping, a cache read with its own q and k, left
    padding, and inputs shorter than the window or the cache; decoding on from either state agrees."""
    w, M, T = (6, 9, 5) if case == "short" else (4, 3, 23)
    q, k, v, score, sinks = inputs(T, seed=11)
    g = torch.Generator().manual_seed(12)
    extra = lambda *shape: torch.randn(*shape, generator=g, dtype=q.dtype)  # noqa: E731
    leaves = {"q": q, "k": k, "v": v}
    if case == "kv sinks":
        leaves.update(sink_k=extra(H, 2, D), sink_v=extra(H, 2, D))
    else:
        leaves["sink_logits"] = sinks
    if case == "cache q and k":
        leaves.update(cache_q=extra(B, H, T, D), leave_k=extra(B, H, T, D))
    pos = torch.tensor([0, -3]) if case == "left padding" else torch.zeros(B, dtype=torch.int64)
    kw = {"window": w, "cache_size": M, "chunk_size": C, "softcap": 2.0 if case == "softcap" else None}
    names = list(leaves)

    def run(form, *xs):
        st = fresh_state(B, H, D, D, w, M, dtype=torch.float64, pos=pos)
        x = dict(zip(names, xs))
        return sparse_window_attn_chunk(x.pop("q"), x.pop("k"), x.pop("v"), score, state=st, fresh_state=True,
                                        form=form, **x, **kw)

    with count_chunk_steps() as steps:
        live = grads_of(lambda *xs: run("live", *xs), [t.clone().requires_grad_(True) for t in leaves.values()])
    assert steps["spans"] == (1 if T > w else 0)  # the selection's scan, in blocks of 256 pairs
    loop = grads_of(lambda *xs: run("spans", *xs), [t.clone().requires_grad_(True) for t in leaves.values()])
    torch.testing.assert_close(live[0], loop[0], rtol=1e-12, atol=1e-12)
    for field in SparseWindowState._fields:
        torch.testing.assert_close(getattr(live[1], field), getattr(loop[1], field), rtol=1e-12, atol=1e-12,
                                   msg=field)
    for name, a, b in zip(names, live[2], loop[2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    nxt = inputs(3, seed=13)
    rest = {n: x[:, :, :3] for n, x in leaves.items() if n in ("cache_q", "leave_k")}
    step = lambda st: sparse_window_attn_recurrent(  # noqa: E731
        *nxt[:3], nxt[3], state=st, window=w, cache_size=M, softcap=kw["softcap"], **rest,
        **{n: leaves[n] for n in ("sink_logits", "sink_k", "sink_v") if n in leaves})[0]
    torch.testing.assert_close(step(live[1]), step(loop[1]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", ["parallel", "recurrent", "spans", "live"])
def test_the_state_keeps_its_pairs_in_the_inputs_dtypes(form):
    """From bf16 inputs every form returns the state's pairs in bf16 (half the bytes of the fp32 it
    computes in) holding exactly what an fp32 run of the same values holds, scores in fp32; decoding
    on from either state gives the same outputs."""
    T, w, M = 29, 4, 3
    q, k, v, score, sinks = inputs(T, seed=15, dtype=torch.float32)
    g = torch.Generator().manual_seed(16)
    cq, lk = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)
    half = [x.bfloat16() for x in (q, k, v, cq, lk)]
    kw = {"window": w, "cache_size": M, "sink_logits": sinks}

    def run(xs):
        a, b, c, d, e = xs
        extra = {"cache_q": d, "leave_k": e}
        if form == "parallel":
            return sparse_window_attn_parallel(a, b, c, score, **kw, **extra)
        if form == "recurrent":
            return sparse_window_attn_recurrent(a, b, c, score, **kw, **extra)
        return sparse_window_attn_chunk(a, b, c, score, chunk_size=8, form=form, **kw, **extra)

    o16, st16 = run(half)
    o32, st32 = run([x.float() for x in half])
    assert o16.dtype == torch.bfloat16
    for field in ("k", "v", "cache_k", "cache_v"):
        assert getattr(st16, field).dtype == torch.bfloat16, field
        assert torch.equal(getattr(st16, field).float(), getattr(st32, field)), field
    assert st16.cache_score.dtype == torch.float32 and torch.equal(st16.cache_score, st32.cache_score)
    nxt = [x[:, :, :2].bfloat16() for x in inputs(2, seed=17, dtype=torch.float32)[:3]]
    step = lambda st, xs: sparse_window_attn_recurrent(  # noqa: E731
        *xs, score[:, :, :2], state=st, cache_q=xs[0], leave_k=xs[1], **kw)[0]
    assert torch.equal(step(st16, nxt), step(st32, [x.float() for x in nxt]).bfloat16())


def test_the_form_is_picked_by_device_length_and_state(monkeypatch):
    """None picks the live form on a GPU from a fresh state up to ``TORCH_LIVE_MAX`` tokens (in
    batched torch), else the span loop; both give the sorting reference's outputs."""
    T, C, w, M = 20, 4, 3, 2
    q, k, v, score, sinks = inputs(T, seed=14)
    kw = {"window": w, "cache_size": M, "sink_logits": sinks, "chunk_size": C}
    ref = reference(q, k, v, score, sinks, w, M)
    given = shifted(score, w)
    for device_type, limit, state, spans in (("cpu", T, None, T // C), ("cuda", T, None, 1),  # 1: the scan
                                             ("cuda", T - 1, None, T // C), ("cuda", T, "carried", T // C)):
        monkeypatch.setattr(chunk, "TORCH_LIVE_MAX", limit)
        monkeypatch.setattr(chunk, "on_gpu", lambda x, d=device_type: d == "cuda")
        st = fresh_state(B, H, D, D, w, M, dtype=torch.float64) if state else None
        with count_chunk_steps() as steps:
            o = sparse_window_attn_chunk(q, k, v, given, state=st, **kw)[0]
        assert steps["spans"] == spans, (device_type, limit, state)
        torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)


def test_the_live_form_on_its_kernels_has_no_length_limit(monkeypatch):
    """Past ``TORCH_LIVE_MAX`` the live form still pays where its kernels run (their memory is linear
    in T); not on the CPU, and not in batched torch."""
    q = torch.zeros(1, 1, 40, 8)
    monkeypatch.setattr(chunk, "TORCH_LIVE_MAX", 32)
    for gpu, kernels, pays in ((True, True, True), (True, False, False), (False, True, False)):
        monkeypatch.setattr(chunk, "on_gpu", lambda x, g=gpu: g)
        assert chunk.live_pays(q, kernels) == pays, (gpu, kernels)
    monkeypatch.setattr(chunk, "on_gpu", lambda x: True)
    assert chunk.live_pays(q[:, :, :32], False)


def test_old_slots_in_groups_of_blocks_are_the_same(monkeypatch):
    """The blocks' slot lists, built a few blocks at a time (bounded memory at any length), equal the
    lists built at once; each block lists the pairs cached at its first query, in position order."""
    from linearize.ops.sparse_window import live

    g = torch.Generator().manual_seed(3)
    T, w, M, C = 70, 5, 4, 8
    score = torch.randn(2, 3, T - w, generator=g)
    until = live.cache_until(score, torch.ones(2, T - w, dtype=torch.bool), M)
    whole = live.old_slots(until, T, w, M, C)
    for entries in (1, 2 * 3 * (T - w) * 3):  # one block a group; three blocks a group
        monkeypatch.setattr(live, "SLOT_ENTRIES", entries)
        assert torch.equal(live.old_slots(until, T, w, M, C), whole)
    for b in range(whole.shape[2]):
        t0 = b * C
        cached = [[[s for s in range(T - w) if s < t0 - w < until[i, h, s]] for h in range(3)] for i in range(2)]
        for i in range(2):
            for h in range(3):
                want = cached[i][h] + [T - w] * (M - len(cached[i][h]))
                assert whole[i, h, b].tolist() == want, (i, h, b)


def test_the_live_kernels_take_only_blocks_a_tile_can_hold(monkeypatch):
    """The kernels' query block is a tile's rows: a power of two of at least 16; other blocks (and
    mixed dtypes) keep the live form's batched torch."""
    monkeypatch.setattr(chunk, "kernels_enabled", lambda: True)
    monkeypatch.setattr(chunk, "on_kernel_device", lambda *xs: True)
    q = torch.zeros(1, 1, 4, 8)
    assert chunk.live_kernel_applies(q, q, q, None, None, None, None, None, 64)
    for block in (8, 48, 100):
        assert not chunk.live_kernel_applies(q, q, q, None, None, None, None, None, block), block
    assert not chunk.live_kernel_applies(q, q, q.double(), None, None, None, None, None, 64)


# the live form's Triton kernels under the interpreter (tests/ops/conftest.py, interpreter_results)
INTERPRETER_OP = "sparse"


@needs_triton
@pytest.mark.parametrize("name", cases_of(INTERPRETER_OP))
def test_interpreter_kernels_match_the_span_loop(interpreter_results, name):
    assert_interpreter_case(interpreter_results, name)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_live_form_equals_the_span_loop(dtype):
    """On CUDA at a training shape (T = 1024, window 64, 128 cached pairs read with their own q and
    k, tied scores): the form the chunk op picks there (live, on its Triton kernels) gives the span
    loop's outputs and gradients (the loop computes in fp32, the kernels from the inputs' dtype)."""
    Bg, Hg, T, Dg, w, M = 2, 3, 1024, 64, 64, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    x = lambda *shape: torch.randn(*shape, generator=g, device="cuda").to(dtype)  # noqa: E731
    leaves = [x(Bg, Hg, T, Dg) for _ in range(5)] + [torch.randn(Hg, 2, device="cuda")]
    score = torch.randint(0, 50, (Bg, Hg, T), device="cuda", generator=g).float()
    weight = x(Bg, Hg, T, Dg).float()

    def run(form):
        xs = [t.clone().requires_grad_(True) for t in leaves]
        q, k, v, cq, lk, sinks = xs
        o, st = sparse_window_attn_chunk(q, k, v, score, window=w, cache_size=M, sink_logits=sinks, cache_q=cq,
                                         leave_k=lk, chunk_size=64 if form else 256, form=form)
        grads = torch.autograd.grad((o.float() * weight).sum(), xs)
        return o.float(), st, grads

    live, loop = run(None), run("spans")
    bf16 = dtype == torch.bfloat16  # (the kernels round the output to bf16: one ulp is 4e-3 at 1)
    torch.testing.assert_close(live[0], loop[0], rtol=2e-2 if bf16 else 1e-5, atol=1e-2 if bf16 else 1e-5)
    assert torch.equal(torch.sort(live[1].cache_pos, -1).values, torch.sort(loop[1].cache_pos, -1).values)
    for name, a, b in zip(("q", "k", "v", "cache_q", "leave_k", "sinks"), live[2], loop[2]):
        scale = b.float().abs().max().clamp_min(1e-6)
        assert ((a.float() - b.float()).abs().max() / scale) < (2e-2 if dtype == torch.bfloat16 else 1e-5), name


@needs_cuda
@pytest.mark.parametrize("scan, segments", [(False, None), (True, 1), (True, None)],
                         ids=["all pairs", "scan", "scan in segments"])
def test_gpu_selection_kernels_equal_the_torch_scan(scan, segments):
    """On CUDA at an evaluation's length (8K tokens, window 128, 256 pairs, tied scores, left padding):
    every pair's j_s (by either kernel; the scan in one piece or in the segments it picks for 6 rows)
    and every query block's slots equal the torch scan's, exactly."""
    from kernel_cases import sparse_slots_case

    err = sparse_slots_case("cuda", torch.float32, T=8192, W=128, M=256, C=128, pad=300, ties=True, scan=scan,
                            segments=segments)
    assert max(err.values()) == 0.0, err


@needs_triton
def test_the_selection_scan_runs_in_segments_only_for_few_long_rows():
    from linearize.ops.sparse_window.triton import _selection_segments

    assert _selection_segments(16256, 9, 132) == 16  # 1 x 16K, 9 heads: 144 programs of 1,024 pairs
    assert _selection_segments(8064, 18, 132) == 8 and _selection_segments(8064, 6, 132) == 8
    assert _selection_segments(16256, 144, 132) == 1  # enough rows already
    assert _selection_segments(1000, 1, 132) == 1  # a segment of fewer than 4 blocks of 128


@needs_triton
def test_the_cache_pass_tiles_pairs_by_stay_then_position():
    """``cache_tiles``: a permutation of the pairs, grouped by the power of two of their stay in the
    cache, each group in position order; on a real selection it is not the position order (one long
    stay no longer drags its 63 neighbours through every later query block)."""
    from linearize.ops.sparse_window import live
    from linearize.ops.sparse_window.triton import cache_tiles

    g = torch.Generator().manual_seed(0)
    until = live.cache_until(torch.rand(2, 3, 500, generator=g), torch.ones(2, 500, dtype=torch.bool), 16)
    tiles = cache_tiles(until).long()
    assert cache_tiles(until).dtype == torch.int32
    assert torch.equal(tiles.sort(-1).values, torch.arange(500).expand(2, 3, 500))
    stay = (until.long() - torch.arange(500)).gather(-1, tiles)
    group = torch.floor(torch.log2(stay.double() + 1))
    assert (group.diff(dim=-1) >= 0).all()
    same = group.diff(dim=-1) == 0
    assert (tiles.diff(dim=-1)[same] > 0).all()
    assert not torch.equal(tiles, torch.arange(500).expand(2, 3, 500))


def test_bad_inputs_are_named():
    q, k, v, score, _ = inputs(5)
    with pytest.raises(ValueError, match=r"score must have shape \(B, H, T\) = \(2, 3, 5\), got \(2, 3, 4\)"):
        sparse_window_attn_chunk(q, k, v, score[..., :4], window=2, cache_size=2)
    with pytest.raises(ValueError, match=r"leave_k must have q's shape \(B, H, T, Dk\) = \(2, 3, 5, 8\), got \(2, 3, 4, 8\)"):
        sparse_window_attn_chunk(q, k, v, score, window=2, cache_size=2, leave_k=k[:, :, :4])
    with pytest.raises(ValueError, match=r"form must be one of \('spans', 'live'\) or None, got 'fast'"):
        sparse_window_attn_chunk(q, k, v, score, window=2, cache_size=2, form="fast")
    carried = fresh_state(B, H, D, D, 2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="form='live' needs a fresh state"):
        sparse_window_attn_chunk(q, k, v, score, window=2, cache_size=2, state=carried, form="live")
    with pytest.raises(ValueError, match="cache_size must be a positive int, got 0"):
        sparse_window_attn_chunk(q, k, v, score, window=2, cache_size=0)
    st = fresh_state(B, H, D, D, 2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"state.cache_k must have shape \(2, 3, 2, 8\), got \(2, 3, 3, 8\)"):
        sparse_window_attn_chunk(q, k, v, score, window=2, cache_size=2, state=st)
    with pytest.raises(ValueError, match="state must be a SparseWindowState or None, got tuple"):
        sparse_window_attn_chunk(q, k, v, score, window=2, cache_size=3, state=tuple(st))
    assert isinstance(st, SparseWindowState)
