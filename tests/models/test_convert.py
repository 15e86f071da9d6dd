"""The conversion layer end to end: ``linearize.convert`` on tiny random models of every supported
architecture, with every method.

Tolerance: fp32 throughout; logits compared with an absolute tolerance of ``ATOL = 1e-4`` (the
tiny models' logits are O(5); the observed differences are ~1e-5 or less). Token sequences from
greedy decoding must be identical.

Most tests use ``SMALL`` (window 4, chunk 8) so that windows slide and chunk boundaries are crossed
inside 24-token inputs; a few run the methods' defaults on longer inputs.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import fixtures
import linearize
from linearize.methods import AttentionConfig, method_config
from linearize.models.attention import LinearizedAttention
from linearize.models.cache import StateLayer, cache_bytes

ATOL = 1e-4
SMALL = {"window": 4, "chunk_size": 8}
ARCHS = list(fixtures.ARCHS)
# the causal methods (LION's encoder methods have their own tests in test_lion_encoder.py)
METHODS = sorted(m for m in linearize.methods() if isinstance(method_config(m), AttentionConfig))
# Method variants whose state differs from the defaults (more cache paths through HF's machinery).
VARIANTS = [
    ("lizard", {"sink_kind": "kv"}),
    ("lizard", {"gate": "mamba2"}),
    ("lizard", {"gate": "gla"}),
    ("lolcats", {"local_rule": "terraced"}),
    ("liza", {"delta_order": 2}),
    ("liza", {"local_rule": "softmax"}),
    ("lizard-gdn", {"feature_map": "hedgehog"}),
    ("lizard-gdn", {"delta_order": 2, "gate": "sigmoid", "beta": "pool"}),
    ("lizard", {"sparse_cache": 3}),
    ("lizard-gdn", {"sparse_cache": 3}),
    ("liza", {"sparse_cache": 2}),
]
T = 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The CI machine's 2 cores are shared; torch's default thread pool thrashes there."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tokens(B=2, L=T, seed=0):
    return torch.randint(3, fixtures.VOCAB, (B, L), generator=torch.Generator().manual_seed(seed))


def converted(arch="llama", method="lizard", *, small=True, num_layers=2, **kw):
    model = fixtures.ARCHS[arch](num_layers=num_layers)
    return linearize.convert(model, method, **({**SMALL, **kw} if small else kw))


def variant_id(v):
    method, kw = v
    return method + "".join(f"-{k}={val}" for k, val in kw.items())


@torch.no_grad()
def logits(model, ids, **kw):
    return model(ids, **kw).logits


@torch.no_grad()
def pieces_logits(model, ids, pieces):
    """Logits of ``ids`` fed in pieces of the given lengths through one cache."""
    assert sum(pieces) == ids.shape[1]
    out, cache, start = [], None, 0
    for n in pieces:
        res = model(ids[:, start:start + n], past_key_values=cache, use_cache=True)
        cache = res.past_key_values
        out.append(res.logits)
        start += n
    return torch.cat(out, 1), cache


def assert_close(a, b, what=""):
    assert a.shape == b.shape, f"{what}: {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = (a - b).abs().max().item()
    assert err <= ATOL, f"{what}: max |diff| {err:.2e} > {ATOL:.0e}"


def greedy(model, ids, n=6, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


# ------------------------------------------------------------------ cached decode = full forward

DECODE_PIECES = [10, 5] + [1] * (T - 15)  # prefill, a multi-token piece on a warm cache, then steps


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_decode_equals_full_forward(arch, method):
    model = converted(arch, method)
    ids = tokens()
    full = logits(model, ids)
    dec, cache = pieces_logits(model, ids, DECODE_PIECES)
    assert_close(dec, full, f"{arch}/{method} cached vs full")
    assert cache.get_seq_length() == T
    assert all(isinstance(layer, StateLayer) for layer in cache.layers)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_cached_decode_equals_full_forward_variants(variant):
    method, kw = variant
    model = converted("llama", method, **kw)
    ids = tokens()
    dec, _ = pieces_logits(model, ids, DECODE_PIECES)
    assert_close(dec, logits(model, ids), variant_id(variant))


@pytest.mark.parametrize("arch,kw", [
    ("llama", {"softmax_layers": [0]}),
    ("llama", {"softmax_layers": [1]}),
    ("mistral", {"softmax_layers": [1]}),
    ("gemma2", {"softmax_layers": [1]}),
    ("gemma2", {"keep_native_sliding": True}),
    ("gemma3", {"keep_native_sliding": True}),
    ("qwen3", {"softmax_layers": [0]}),
    ("phi3_partial", {"softmax_layers": [0]}),
], ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
def test_cached_decode_equals_full_forward_hybrid(arch, kw):
    """Kept softmax layers (HF's own cache layers, native sliding windows of 8 < T) beside ours."""
    model = converted(arch, "lizard", **kw)
    ids = tokens()
    dec, cache = pieces_logits(model, ids, DECODE_PIECES)
    assert_close(dec, logits(model, ids), f"{arch} {kw}")
    kept = model.linearize_spec["softmax_layers"]
    assert kept
    assert [not isinstance(layer, StateLayer) for layer in cache.layers] == [i in kept for i in range(len(cache.layers))]


def test_cached_decode_with_default_settings_on_a_longer_input():
    """The shipped defaults (window 128 / 64, chunk 64) with a prompt longer than window and chunk."""
    ids = tokens(B=1, L=300)
    for method in METHODS:
        model = converted("llama", method, small=False)
        dec, _ = pieces_logits(model, ids, [200, 37] + [1] * 63)
        assert_close(dec, logits(model, ids), f"{method} defaults")


# ------------------------------------------------------------------ prefix independence, causality


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_logits_independent_of_length_and_causal(arch, method):
    model = converted(arch, method)
    ids = tokens()
    P = 13  # not a multiple of the chunk size
    changed = ids.clone()
    changed[:, P:] = tokens(B=2, L=T - P, seed=7)
    assert not torch.equal(changed, ids)
    full = logits(model, ids)
    assert_close(logits(model, ids[:, :P]), full[:, :P], "prefix alone vs inside a longer input")
    other = logits(model, changed)
    assert_close(other[:, :P], full[:, :P], "changing later tokens changed earlier logits")
    assert (other[:, P:] - full[:, P:]).abs().max() > 1e-2  # and the later tokens do matter


# ------------------------------------------------------------------ left padding


def padded_batch(lengths=(21, 5, 13), seed=3):
    L = max(lengths)
    seqs = [tokens(B=1, L=n, seed=seed + i) for i, n in enumerate(lengths)]
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, L - s.shape[1]:] = s[0]
        mask[i, L - s.shape[1]:] = 1
    return seqs, ids, mask


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_batch_equals_each_sequence_alone(arch, method):
    model = converted(arch, method)
    seqs, ids, mask = padded_batch()  # 16 and 8 pad tokens: a whole chunk (8), more than the window (4)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = logits(model, ids, attention_mask=mask, position_ids=position_ids)
    for i, s in enumerate(seqs):
        n = s.shape[1]
        assert_close(batch[i, -n:], logits(model, s)[0], f"row {i} padded vs alone")
    # generate derives the positions itself; the continuations must match too
    new = 5
    out = greedy(model, ids, new, attention_mask=mask)
    for i, s in enumerate(seqs):
        assert torch.equal(out[i, -new:], greedy(model, s, new)[0, -new:]), f"row {i}: generate padded vs alone"


@pytest.mark.parametrize("arch,kw", [
    ("llama", {"softmax_layers": [0]}),
    ("gemma2", {"keep_native_sliding": True}),
    ("mistral", {"softmax_layers": [1]}),
    ("llama", {"local_rule": "softmax", "method": "liza"}),
    ("llama", {"sparse_cache": 3}),
    ("llama", {"sparse_cache": 3, "method": "lizard-gdn"}),
    ("llama", {"sparse_cache": 3, "sparse_distance": 5, "method": "lizard-gdn"}),
], ids=["llama-hybrid", "gemma2-native", "mistral-hybrid", "liza-full-softmax", "sparse-cache", "gdn-sparse-cache",
        "gdn-sparse-cache-distance"])
def test_left_padded_batch_hybrid(arch, kw):
    kw = dict(kw)
    model = converted(arch, kw.pop("method", "lizard"), **kw)
    seqs, ids, mask = padded_batch()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = logits(model, ids, attention_mask=mask, position_ids=position_ids)
    out = greedy(model, ids, 5, attention_mask=mask)
    for i, s in enumerate(seqs):
        assert_close(batch[i, -s.shape[1]:], logits(model, s)[0], f"row {i}")
        assert torch.equal(out[i, -5:], greedy(model, s, 5)[0, -5:])


# ------------------------------------------------------------------ kept layers are the teacher's


@pytest.mark.parametrize("arch", ARCHS)
def test_all_layers_kept_reproduces_the_teacher(arch):
    """Every layer kept: only the attention implementation changes ("linearize"'s softmax path, with
    its own masks, soft-capping, native sliding windows); the logits must be the teacher's, padded too."""
    teacher = fixtures.ARCHS[arch]()
    model = linearize.convert(fixtures.ARCHS[arch](), "lizard", softmax_layers=1.0)
    assert model.config._attn_implementation == "linearize"
    assert not any(isinstance(m, LinearizedAttention) for m in model.modules())
    ids = tokens()
    assert_close(logits(model, ids), logits(teacher, ids), "all kept vs teacher")
    seqs, ids, mask = padded_batch()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    got = logits(model, ids, attention_mask=mask, position_ids=position_ids)
    for i, s in enumerate(seqs):
        assert_close(got[i, -s.shape[1]:], logits(teacher, s)[0], f"row {i}")


@pytest.mark.parametrize("arch", ARCHS)
def test_liza_with_mu_0_is_the_teachers_attention(arch):
    """LiZA with mu = 0 is its softmax branch alone. With that branch seeing every token (a window
    longer than the input, or full softmax) it must reproduce the teacher exactly: this checks the
    adapter (fused qkv, biases, QK-norm before RoPE, partial rotary, GQA, the teacher's scale)."""
    ids = tokens()
    for kw, L in [({"window": 64, "keep_native_sliding": True}, T),
                  ({"local_rule": "softmax", "keep_native_sliding": True}, T),
                  ({"window": 64}, fixtures.SLIDING_WINDOW)]:  # every layer converted, input within native windows
        teacher = fixtures.ARCHS[arch]()
        model = linearize.convert(fixtures.ARCHS[arch](), "liza", mu=0.0, **kw)
        assert any(isinstance(m, LinearizedAttention) for m in model.modules()) or arch == "mistral"
        assert_close(logits(model, ids[:, :L]), logits(teacher, ids[:, :L]), f"{kw}")


# ------------------------------------------------------------------ Gemma 2's logit soft-capping

STRONG_CAP = 5.0  # the fixture's 50 already matters (~7e-3 on logits); 5 bites much harder


def gemma2_capped(softcap):
    """The gemma2 fixture (same weights) with ``attn_logit_softcapping = softcap`` (None: no cap)."""
    model = fixtures.gemma2()
    model.config.attn_logit_softcapping = softcap
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = softcap
    return model


def test_gemma2_softcap_matters_for_the_teacher():
    """Guard for the tests below: without the cap the teacher's logits move far beyond ATOL."""
    ids = tokens()
    ref = logits(gemma2_capped(None), ids)
    for cap, least in [(fixtures.gemma2().config.attn_logit_softcapping, 1e-3), (STRONG_CAP, 1e-1)]:
        assert (logits(gemma2_capped(cap), ids) - ref).abs().max() > least, cap


@pytest.mark.parametrize("method,kw", [
    ("liza", {"mu": 0.0, "window": 64, "keep_native_sliding": True}),
    ("liza", {"mu": 0.0, "local_rule": "softmax", "keep_native_sliding": True}),
    ("liza", {"mu": 0.0, "window": 64}),
    ("lolcats", {"window": 64, "keep_native_sliding": True}),  # window >= T: no linear terms
    ("lolcats", {"window": 64}),
], ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
def test_gemma2_strong_softcap_window_branch_is_the_teachers_attention(method, kw):
    """With a window covering the input, the linearized layers' softmax part alone (LiZA mu = 0;
    LoLCATs, whose linear terms are then empty and whose factor f cancels up to eps) must be the
    teacher's capped attention, next to kept native-sliding softmax layers or with every layer
    converted (inputs within the native window of 8)."""
    ids = tokens()
    L = T if kw.get("keep_native_sliding") else fixtures.SLIDING_WINDOW
    teacher = gemma2_capped(STRONG_CAP)
    model = linearize.convert(gemma2_capped(STRONG_CAP), method, **kw)
    layers = [m for m in model.modules() if isinstance(m, LinearizedAttention)]
    assert layers and all(m.softcap == STRONG_CAP == m.hybrid.softcap for m in layers)
    assert_close(logits(model, ids[:, :L]), logits(teacher, ids[:, :L]), f"{method} {kw}")
    seqs, padded, mask = padded_batch()
    if L == T:  # and a left-padded batch through the capped branches
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        got = logits(model, padded, attention_mask=mask, position_ids=position_ids)
        for i, s in enumerate(seqs):
            assert_close(got[i, -s.shape[1]:], logits(teacher, s)[0], f"{method} {kw} row {i}")


@pytest.mark.parametrize("method", METHODS)
def test_gemma2_softcap_reaches_every_method(method):
    """Every linearized layer takes the teacher's cap (and its native window); methods with a
    softmax part change with it, pure linear methods do not; the capped model stays consistent."""
    ids = tokens()
    capped = converted("gemma2", method)
    model_cap = capped.config.attn_logit_softcapping
    uncapped = linearize.convert(gemma2_capped(None), method, **SMALL)
    layers = [m for m in capped.modules() if isinstance(m, LinearizedAttention)]
    assert len(layers) == 2
    assert [m.sliding_window for m in layers] == [fixtures.SLIDING_WINDOW, None]  # sliding, then full
    assert all(m.softcap == model_cap == m.hybrid.softcap for m in layers)
    assert all(m.softcap is None and m.hybrid.softcap is None
               for m in uncapped.modules() if isinstance(m, LinearizedAttention))
    diff = (logits(capped, ids) - logits(uncapped, ids)).abs().max().item()
    if layers[0].hybrid.config.local_rule == "none":
        assert diff == 0.0, f"{method}: no softmax part, yet the cap changed the logits"
    else:
        assert diff > 1e-3, f"{method}: the cap does not reach the softmax part ({diff:.1e})"
    dec, _ = pieces_logits(capped, ids, DECODE_PIECES)
    assert_close(dec, logits(capped, ids), f"{method} capped: cached vs full")


def test_linearized_attention_without_softcap_records_none():
    model = converted("llama", "lizard")
    layers = [m for m in model.modules() if isinstance(m, LinearizedAttention)]
    assert layers and all(m.softcap is None and m.hybrid.softcap is None for m in layers)


# ------------------------------------------------------------------ generate


@pytest.mark.parametrize("variant", [(m, {}) for m in METHODS] + VARIANTS + [("lizard", {"softmax_layers": [0]})],
                         ids=variant_id)
def test_generate_with_and_without_cache_and_beams(variant):
    method, kw = variant
    model = converted("llama", method, **kw)
    ids = tokens(L=12)
    cached = greedy(model, ids, 8)
    assert cached.shape == (2, 20)
    assert torch.equal(cached, greedy(model, ids, 8, use_cache=False))
    # beam search works (the cache reorders our states) and agrees with the uncached search
    beams = greedy(model, ids, 6, num_beams=2, num_return_sequences=2)
    assert beams.shape == (4, 18)
    assert torch.equal(beams, greedy(model, ids, 6, num_beams=2, num_return_sequences=2, use_cache=False))


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_with_and_without_cache_per_arch(arch):
    model = converted(arch, "lizard")
    ids = tokens(L=12)
    assert torch.equal(greedy(model, ids, 8), greedy(model, ids, 8, use_cache=False))


def test_sampling_with_a_fixed_seed():
    model = converted("llama", "lizard")
    ids = tokens(L=12)

    def sample(seed, **kw):
        torch.manual_seed(seed)
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=10, do_sample=True, top_k=20, pad_token_id=0, **kw)

    a = sample(1)
    assert a.shape == (2, 22) and int(a.max()) < fixtures.VOCAB
    assert torch.equal(a, sample(1)), "same seed, different samples"
    assert torch.equal(a, sample(1, use_cache=False)), "cache changed the sampled tokens"
    assert not torch.equal(a, sample(2)), "the seed has no effect: not sampling"


def test_assisted_generation_is_refused_clearly():
    """A recurrent state cannot be cropped, so HF's assisted decoding must fail with our message."""
    model = converted("llama", "lizard")
    assistant = converted("llama", "hedgehog")
    with pytest.raises(ValueError, match="cannot be cropped"):
        greedy(model, tokens(B=1, L=12), 6, assistant_model=assistant)  # HF: batch 1 only


# ------------------------------------------------------------------ constant memory


def reachable_bytes(cache) -> int:
    """Bytes of every distinct tensor reachable from ``cache`` (through attributes, dicts, sequences)."""
    seen, total, todo = set(), 0, [cache]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type, nn.Module)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo.extend(obj)
        elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return total


@torch.no_grad()
def bytes_after(model, L, decode=3):
    """cache_bytes after an L-token prompt and after ``decode`` more steps (all must agree in kind)."""
    ids = tokens(B=1, L=L + decode, seed=L)
    cache = model(ids[:, :L], use_cache=True).past_key_values
    after_prompt = cache_bytes(cache)
    assert sum(after_prompt.values()) == reachable_bytes(cache), "cache_bytes misses tensors"
    for t in range(L, L + decode):
        cache = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).past_key_values
    after_decode = cache_bytes(cache)
    assert sum(after_decode.values()) == reachable_bytes(cache), "cache_bytes misses tensors"
    return after_prompt, after_decode


CONSTANT = [(m, {}) for m in METHODS] + [v for v in VARIANTS if v[1].get("local_rule") != "softmax"]


@pytest.mark.parametrize("variant", CONSTANT, ids=variant_id)
def test_cache_bytes_constant_in_prompt_length(variant):
    method, kw = variant
    model = converted("llama", method, small=False, **kw)  # the real defaults: window 128 / 64
    short, short_dec = bytes_after(model, 512)
    long, long_dec = bytes_after(model, 4096)
    assert short["softmax"] == 0 and short["linear"] > 0
    assert short == long == short_dec == long_dec


def test_cache_bytes_full_softmax_liza_grows():
    model = converted("llama", "liza", small=False, local_rule="softmax")
    (short, short_dec), (long, long_dec) = bytes_after(model, 512), bytes_after(model, 4096)
    assert short["softmax"] == long["softmax"] == 0
    per_token = (long["linear"] - short["linear"]) / (4096 - 512)
    assert per_token > 0
    assert short_dec["linear"] - short["linear"] == 3 * per_token  # grows linearly, by the same step


def test_cache_bytes_hybrid_softmax_grows_linear_constant():
    model = converted("llama", "lizard", small=False, softmax_layers=[0])
    (short, short_dec), (long, long_dec) = bytes_after(model, 512), bytes_after(model, 4096)
    assert short["linear"] == long["linear"] == short_dec["linear"] == long_dec["linear"] > 0
    cfg = model.config
    kv_per_token = 2 * cfg.num_key_value_heads * 16 * 4  # keys + values, KV heads, head_dim 16, fp32
    assert short["softmax"] == 512 * kv_per_token
    assert long["softmax"] == 4096 * kv_per_token
    assert long_dec["softmax"] == (4096 + 3) * kv_per_token


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral"])
def test_cache_bytes_constant_with_native_sliding_layers_kept(arch):
    """Kept native sliding layers hold a bounded window in HF's cache: still constant memory."""
    model = converted(arch, "lizard", small=False, keep_native_sliding=True)
    a, _ = bytes_after(model, 64)
    b, _ = bytes_after(model, 512)
    assert a == b
    assert a["softmax"] > 0


# ------------------------------------------------------------------ which layers are converted


def originals(model):
    return [layer.self_attn for layer in model.model.layers]


def assert_kept_exactly(model, before, kept):
    after = originals(model)
    for i, (old, new) in enumerate(zip(before, after)):
        if i in kept:
            assert new is old, f"layer {i} should keep its original attention"
        else:
            assert isinstance(new, LinearizedAttention), f"layer {i} should be converted"
            assert new.q_proj is old.q_proj if hasattr(old, "q_proj") else new.qkv_proj is old.qkv_proj
    assert model.linearize_spec["softmax_layers"] == sorted(kept)


@pytest.mark.parametrize("spec,expected", [([0, 2], {0, 2}), ([3], {3}), ([], set()), (None, set()),
                                           (0.5, None), (0.0, set()), (1.0, {0, 1, 2, 3})])
def test_softmax_layers_keep_exactly_those_modules(spec, expected):
    model = fixtures.llama(num_layers=4)
    before = originals(model)
    linearize.convert(model, "lizard", softmax_layers=spec)
    kept = set(model.linearize_spec["softmax_layers"])
    if expected is None:  # a fraction: that many layers, spread out (not all at one end)
        assert len(kept) == 2 and kept not in ({0, 1}, {2, 3})
    else:
        assert kept == expected
    assert_kept_exactly(model, before, kept)


@pytest.mark.parametrize("arch,expected", [("gemma2", {0, 2}), ("gemma3", {0, 2}), ("mistral", {0, 1, 2, 3}),
                                           ("llama", set()), ("qwen3", set())])
def test_keep_native_sliding(arch, expected):
    model = fixtures.ARCHS[arch](num_layers=4)
    before = originals(model)
    linearize.convert(model, "lizard", keep_native_sliding=True)
    assert_kept_exactly(model, before, expected)


def test_keep_native_sliding_unions_with_softmax_layers():
    model = fixtures.gemma2(num_layers=4)
    before = originals(model)
    linearize.convert(model, "lizard", keep_native_sliding=True, softmax_layers=[1])
    assert_kept_exactly(model, before, {0, 1, 2})


def test_convert_keeps_parameter_names_and_returns_the_model():
    model = fixtures.phi3()
    names = {n for n, _ in model.named_parameters()}
    assert linearize.convert(model, "lizard") is model
    new = {n for n, _ in model.named_parameters()}
    assert names <= new  # the teacher's parameters keep their names (LoRA targets)
    assert any(".hybrid." in n for n in new - names)


# ------------------------------------------------------------------ errors


def test_unknown_method_lists_the_available_ones():
    with pytest.raises(ValueError, match="unknown method 'nope'") as e:
        linearize.convert(fixtures.llama(), "nope")
    for m in METHODS:
        assert m in str(e.value)


@pytest.mark.parametrize("method,kw,match", [
    ("lizard", {"windw": 64}, r"unknown override\(s\) \['windw'\].*window"),
    ("lizard", {"window": 0}, "window must be a positive int, got 0"),
    ("lizard", {"window": True}, "window must be a positive int, got True"),
    ("lizard", {"gate": "foo"}, r"gate must be one of \('sigmoid'.*got 'foo'"),
    ("lizard", {"chunk_size": -1}, "chunk_size must be a positive int"),
    ("lizard", {"sinks": -1}, "sinks must be a non-negative int"),
    ("lizard", {"feature_dim": 15}, "must be even, got 15"),
    ("lizard", {"local_rule": "global"}, "local_rule must be one of"),
    ("liza", {"mu": 1.5}, r"mu must be in \[0, 1\], got 1.5"),
    ("hedgehog", {"feature_map": "silu_l2"}, "silu_l2"),
])
def test_bad_override_is_rejected_and_model_left_untouched(method, kw, match):
    model = fixtures.llama()
    before = originals(model)
    with pytest.raises(ValueError, match=match):
        linearize.convert(model, method, **kw)
    assert originals(model) == before and getattr(model, "linearize_spec", None) is None
    assert model.config._attn_implementation != "linearize"
    linearize.convert(model, method)  # still convertible


def test_bad_gate_rejected_for_every_method():
    with pytest.raises(ValueError, match="gate must be one of"):
        linearize.convert(fixtures.llama(), "lolcats", gate="foo")
    with pytest.raises(ValueError, match="gate 'sigmoid' applies only to global_rules 'gated' and 'delta', not 'linear'"):
        linearize.convert(fixtures.llama(), "hedgehog", gate="sigmoid")
    with pytest.raises(ValueError, match=r"gate_init must be a pair .* got \(0.5,\)"):
        linearize.convert(fixtures.llama(), "lizard", gate_init=(0.5,))
    with pytest.raises(ValueError, match="keep_native_sliding must be a bool, got 'yes'"):
        linearize.convert(fixtures.llama(), "lizard", keep_native_sliding="yes")


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'") as e:
        linearize.convert(fixtures.gpt2(), "lizard")
    for name in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"):
        assert name in str(e.value)
    assert sorted(linearize.supported_architectures()) == linearize.supported_architectures()


def test_converting_twice_is_refused():
    model = converted("llama", "lizard")
    with pytest.raises(ValueError, match="already converted"):
        linearize.convert(model, "lolcats")
    assert model.linearize_spec["method"] == "lizard"


@pytest.mark.parametrize("spec,match", [
    ([2], r"softmax_layers \[2\] out of range for a model with 2 layers"),
    ([-1], r"softmax_layers \[-1\] out of range"),
    ([0, 5], r"\[5\] out of range"),
    (1.5, r"fraction must be in \[0, 1\], got 1.5"),
    (-0.1, r"fraction must be in \[0, 1\]"),
    (1, "must be a list of layer indices or a fraction, got 1"),
    (["a"], "must be a list of layer indices or a fraction"),
    ([True], "must be a list of layer indices or a fraction"),
])
def test_softmax_layers_out_of_range(spec, match):
    model = fixtures.llama()
    before = originals(model)
    with pytest.raises(ValueError, match=match):
        linearize.convert(model, "lizard", softmax_layers=spec)
    assert originals(model) == before and getattr(model, "linearize_spec", None) is None


# ------------------------------------------------------------------ the bundled teacher

TEACHER_ATOL = 5e-3  # SmolLM2's logits span ~+-35 and its residual stream reaches ~3e4, so fp32
                     # rounding reaches ~2e-3 on logits (fp64 agrees to 1e-13: rounding, not math)


@pytest.fixture(scope="module")
def teacher():
    """The bundled SmolLM2-135M, loaded once; tests convert deep copies and leave it pristine."""
    return linearize.load_teacher()


def chat_ids(tokenizer, text):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


@pytest.mark.slow
def test_teacher_answers_sensibly(teacher):
    model, tokenizer = teacher
    ids = chat_ids(tokenizer, "What is the capital of France?")
    out = greedy(model, ids, 12)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def teacher_slice(model, layers: int):
    """The bundled teacher's first ``layers`` decoder layers (real weights, tokenizer and chat template),
    its final norm and head: what the decode tests need at a fifth of the 30 layers' CPU time."""
    sliced = copy.deepcopy(model)
    sliced.model.layers = sliced.model.layers[:layers]
    sliced.config.num_hidden_layers = layers
    if getattr(sliced.config, "layer_types", None):
        sliced.config.layer_types = sliced.config.layer_types[:layers]
    return sliced


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_converted_teacher_decodes_consistently_with_constant_memory(teacher, method):
    base, tokenizer = teacher
    model = linearize.convert(teacher_slice(base, 6), method)
    assert sum(isinstance(m, LinearizedAttention) for m in model.modules()) == model.config.num_hidden_layers
    ids = chat_ids(tokenizer, "What is the capital of France? Answer briefly, then explain why.")
    full = logits(model, ids)
    dec, _ = pieces_logits(model, ids, [20] + [1] * (ids.shape[1] - 20))
    err = (dec - full).abs().max().item()
    assert err <= TEACHER_ATOL, f"cached vs full logits: {err:.2e}"

    n = 20 if method == "lizard" else 10  # uncached decoding is the slow part
    cached = greedy(model, ids, n, eos_token_id=None)
    assert cached.shape[1] == ids.shape[1] + n
    assert torch.equal(cached, greedy(model, ids, n, eos_token_id=None, use_cache=False))

    long_ids = chat_ids(tokenizer, "Tell me about Paris. " * 40)
    assert long_ids.shape[1] > 4 * ids.shape[1]
    with torch.no_grad():
        short = cache_bytes(model(ids, use_cache=True).past_key_values)
        long = cache_bytes(model(long_ids, use_cache=True).past_key_values)
    assert short == long and short["softmax"] == 0 and short["linear"] > 0


@pytest.mark.parametrize("arch", ARCHS + ["gemma3_5to1"])
def test_rope_at_a_position_is_the_models_own_table(arch):
    """``sparse_distance`` reads cached pairs with the query rotated to a fixed position: the tables
    ``ArchAdapter.rope_at`` gives are the ones the model hands each layer at that position (its
    RoPE scaling and, for Gemma 3, its sliding and full layers' own tables)."""
    from linearize.models.adapters import adapter_for

    model = getattr(fixtures, arch)()
    adapter = adapter_for(model)
    seen = {}

    def grab(i):
        def hook(module, args, kwargs):
            seen[i] = kwargs["position_embeddings"]
        return hook

    layers = adapter.layers(model)
    for i, layer in enumerate(layers):
        getattr(layer, adapter.attention_attr).register_forward_pre_hook(grab(i), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.arange(10)[None] % model.config.vocab_size)
    tables = set()
    for i in range(len(layers)):
        cos, sin = adapter.rope_at(model, i, 7)
        torch.testing.assert_close(cos, seen[i][0][:, 7:8], rtol=0, atol=0)
        torch.testing.assert_close(sin, seen[i][1][:, 7:8], rtol=0, atol=0)
        tables.add(cos.sum().item())
    if arch == "gemma3_5to1":
        assert len(tables) == 2  # sliding and full layers differ


def test_a_sparse_distance_reads_cached_pairs_with_the_query_at_that_position():
    """Converted with sparse_distance D, each layer hands its hybrid q rotated by the model's RoPE
    at position D: at D = 0 that is the plain q (a cos of 1, a sin of 0 for Llama)."""
    for distance in (0, 5):
        model = linearize.convert(fixtures.llama(), "lizard-gdn", sparse_cache=3, sparse_distance=distance, **SMALL)
        attn = linearize.models.convert.linearized_layers(model)[0]
        x = torch.randn(1, 6, model.config.hidden_size)
        cos, sin = linearize.models.adapters.adapter_for(model).rope_at(model, 0, distance)
        q, _, _, _, _, q_far = attn.heads(x, (cos.expand(1, 6, -1), sin.expand(1, 6, -1)))
        torch.testing.assert_close(q_far, attn.heads(x, (cos.expand(1, 6, -1), sin.expand(1, 6, -1)))[3])
        if distance == 0:
            torch.testing.assert_close(q_far, q)
