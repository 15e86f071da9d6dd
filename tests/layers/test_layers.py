import math

import pytest
import torch
import torch.nn.functional as F

from linearize.layers import (
    GATES, GLAGate, HedgehogFeatureMap, Mamba2Gate, PoolGate, SigmoidGate, Sinks, T2RFeatureMap,
)
from linearize.ops.gla.chunk import gla_chunk
from linearize.ops.window_attn.chunk import window_attn_chunk

B, H, T, D, HIDDEN = 2, 3, 11, 8, 24


def x_heads(seed=0):
    return torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(seed))


def x_hidden(seed=1):
    return torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_hedgehog_identity_init_is_softmax_of_both_signs():
    fm = HedgehogFeatureMap(H, D)  # F = D, so F/2 = D/2 columns of the identity
    x = x_heads()
    xw = x[..., : D // 2]
    expected = torch.cat([xw.softmax(-1), (-xw).softmax(-1)], -1)
    torch.testing.assert_close(fm(x), expected)
    fm_full = HedgehogFeatureMap(H, D, feature_dim=2 * D)  # F/2 = d: exactly LoLCATs' identity init
    torch.testing.assert_close(fm_full(x), torch.cat([x.softmax(-1), (-x).softmax(-1)], -1))


def test_hedgehog_log_features_are_log_of_features_and_halves_normalised():
    fm = HedgehogFeatureMap(H, D, feature_dim=12, init="random")
    x = x_heads().to(torch.float64)
    fm = fm.double()
    log_phi = fm.log_features(x)
    assert log_phi.shape == (B, H, T, 12) and (log_phi <= 0).all()
    torch.testing.assert_close(log_phi.exp(), fm(x))
    torch.testing.assert_close(fm(x)[..., :6].sum(-1), torch.ones(B, H, T, dtype=torch.float64))
    # bf16 inputs keep the log-softmax in fp32 and come back in bf16
    assert fm.float().log_features(x.bfloat16()).dtype == torch.bfloat16


def test_t2r_identity_init_is_relu():
    fm = T2RFeatureMap(H, D)
    x = x_heads()
    torch.testing.assert_close(fm(x), torch.relu(x))


def test_taylor_features_multiply_to_the_second_order_kernel_and_pairwise_skips_them():
    """phi_q(q).phi_k(k) = 1 + u + u^2/2 with u = sqrt(s_q s_k) (q W_q).(k W_k), for trained-looking
    (random) maps of two different scales; ``pairwise`` gives the same matrix from u alone."""
    from linearize.layers.feature_maps import TaylorFeatureMap, pairwise, taylor_feature_dim

    torch.manual_seed(0)
    fk = TaylorFeatureMap(H, D, feature_dim=taylor_feature_dim(5), init="random").double()
    fq = TaylorFeatureMap(H, D, feature_dim=taylor_feature_dim(5), init="random").double()
    with torch.no_grad():
        fq.log_scale.copy_(torch.linspace(-2.0, 0.5, H))
        fk.log_scale.copy_(torch.linspace(0.3, -1.0, H))
    q, k = x_heads(0).double(), x_heads(1).double()
    assert fq(q).shape == (B, H, T, 1 + 5 + 15)
    s = (0.5 * (fq.log_scale + fk.log_scale)).exp().view(H, 1, 1)
    yq, yk = (torch.einsum("bhtd,hde->bhte", x, m.weight) for x, m in ((q, fq), (k, fk)))
    u = yq @ yk.transpose(-1, -2) * s
    kernel = 1 + u + u * u / 2
    torch.testing.assert_close(fq(q) @ fk(k).transpose(-1, -2), kernel, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pairwise(fq, fk, q, k), kernel, rtol=1e-12, atol=1e-12)
    assert (kernel >= 0.5 - 1e-12).all()


def test_taylor_identity_init_starts_at_the_softmax_scaled_score():
    from linearize.layers.feature_maps import TaylorFeatureMap

    fq, fk = TaylorFeatureMap(H, D), TaylorFeatureMap(H, D)
    assert fq.feature_dim == 1 + D + D * (D + 1) // 2
    q, k = x_heads(0).double(), x_heads(1).double()
    u = q @ k.transpose(-1, -2) / D ** 0.5
    torch.testing.assert_close(fq.double()(q) @ fk.double()(k).transpose(-1, -2), 1 + u + u * u / 2)


def test_taylor_feature_dim_must_be_a_taylor_width():
    from linearize.layers.feature_maps import TaylorFeatureMap

    with pytest.raises(ValueError, match=r"1 \+ p \+ p\(p\+1\)/2 .*got 20"):
        TaylorFeatureMap(H, D, feature_dim=20)


def test_taylor_hedgehog_features_multiply_to_the_weighted_sum_of_both_kernels():
    """phi_q(q).phi_k(k) = w_T (1 + u + u^2/2) + w_H phi_Hq(q).phi_Hk(k), w = e^{(a_q + a_k)/2} per
    head and part, for random maps and weights; ``pairwise`` gives the same from u and the Hedgehog
    features alone; at the start the Hedgehog part weighs F_H / 4."""
    from linearize.layers.feature_maps import TaylorHedgehogFeatureMap, pairwise

    torch.manual_seed(0)
    fq, fk = (TaylorHedgehogFeatureMap(H, D, feature_dim=12, init="random").double() for _ in range(2))
    assert fq.feature_dim == 1 + D + D * (D + 1) // 2 + 12
    assert torch.allclose(fq.log_weight[:, 1].exp(), torch.full((H,), 3.0, dtype=torch.float64))
    with torch.no_grad():
        for m in (fq, fk):
            m.log_weight.normal_(0, 1)
            m.taylor.log_scale.normal_(-1, 0.3)
    q, k = x_heads(0).double(), x_heads(1).double()
    w = (0.5 * (fq.log_weight + fk.log_weight)).exp()
    u = (q @ fq.taylor.weight) @ (k @ fk.taylor.weight).transpose(-1, -2) \
        * (0.5 * (fq.taylor.log_scale + fk.taylor.log_scale)).exp().view(H, 1, 1)
    hedgehog = fq.hedgehog(q) @ fk.hedgehog(k).transpose(-1, -2)
    kernel = w[:, 0].view(H, 1, 1) * (1 + u + u * u / 2) + w[:, 1].view(H, 1, 1) * hedgehog
    torch.testing.assert_close(fq(q) @ fk(k).transpose(-1, -2), kernel, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pairwise(fq, fk, q, k), kernel, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gate_name", ["sigmoid", "mamba2"])
def test_scalar_gates_start_with_long_memory_spread_over_heads(gate_name):
    gate = GATES[gate_name](HIDDEN, H, init_gamma=(0.95, 0.99))
    log_g = gate(x_hidden())
    assert log_g.shape == (B, H, T) and log_g.dtype == torch.float32
    expected = torch.linspace(0.95, 0.99, H)[None, :, None].expand(B, H, T)
    torch.testing.assert_close(log_g.exp(), expected)


def test_gla_gate_per_channel_near_its_initial_memory():
    gate = GLAGate(HIDDEN, H, channels=5)
    log_g = gate(x_hidden())
    assert log_g.shape == (B, H, T, 5) and (log_g <= 0).all()
    gamma = log_g.exp()
    assert ((gamma > 0.9) & (gamma < 0.999)).all()


def test_pool_gate_is_parameter_free_and_pools_keys():
    gate = PoolGate(channels=4)
    assert list(gate.parameters()) == []
    k = x_heads()
    log_g = gate(k)
    assert log_g.shape == (B, H, T, 4)
    expected = torch.nn.functional.logsigmoid(k.view(B, H, T, 4, 2).mean(-1)) / 16
    torch.testing.assert_close(log_g, expected)


def _assert_all_grads_nonzero(module):
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{type(module).__name__}.{name} has no gradient"


@pytest.mark.parametrize("fm_cls", [HedgehogFeatureMap, T2RFeatureMap])
@pytest.mark.parametrize("gate_name", list(GATES))
def test_every_parameter_gets_a_gradient_through_the_gated_op(fm_cls, gate_name):
    torch.manual_seed(0)
    fq, fk = fm_cls(H, D, init="random"), fm_cls(H, D, init="random")
    channels = D // 2 if fm_cls is HedgehogFeatureMap else D
    gate = {"sigmoid": lambda: SigmoidGate(HIDDEN, H), "mamba2": lambda: Mamba2Gate(HIDDEN, H),
            "gla": lambda: GLAGate(HIDDEN, H, channels), "pool": lambda: PoolGate(channels)}[gate_name]()
    q, k, v = x_heads(0), x_heads(1), x_heads(2)
    log_g = gate(k) if gate_name == "pool" else gate(x_hidden())
    if log_g.dim() == 4 and fm_cls is HedgehogFeatureMap:
        log_g = torch.cat([log_g, log_g], -1)  # one gate per channel, shared by the two halves
    o, _ = gla_chunk(fq(q), fk(k), v, log_g, chunk_size=4)
    o.square().sum().backward()
    for m in (fq, fk, gate):
        _assert_all_grads_nonzero(m)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("gate_cls", [SigmoidGate, Mamba2Gate])
def test_head_gates_give_their_formula_and_a_gradient_in_the_inputs_layout(gate_cls, batch):
    """w_h . x + c_h per head (the formula as an einsum), and the gradient that reaches the hidden
    states has their layout, at one row too (an einsum's was transposed there, and every later sum
    with the residual stream's gradient read it strided)."""
    torch.manual_seed(0)
    gate = gate_cls(HIDDEN, H)
    with torch.no_grad():
        gate.weight.normal_()
    x = torch.randn(batch, 16, HIDDEN, requires_grad=True)
    h = x * 1.0  # (not a leaf: its gradient arrives as the gate's backward made it)
    seen = []
    h.register_hook(lambda g: seen.append(g.stride()))
    log_g = gate(h)
    logits = torch.einsum("btd,hd->bht", x.detach(), gate.weight.detach()) + gate.bias.detach()[:, None]
    ref = F.logsigmoid(logits) if gate_cls is SigmoidGate else -F.softplus(logits) * gate.log_a.detach().exp()[:, None]
    torch.testing.assert_close(log_g, ref, rtol=1e-6, atol=1e-6)
    log_g.square().sum().backward()
    assert seen == [h.stride()]


@pytest.mark.parametrize("kind", ["logits", "kv"])
def test_sinks_get_gradients_through_the_window_op(kind):
    sinks = Sinks(H, 4, D, kind=kind)
    q, k, v = x_heads(0), x_heads(1), x_heads(2)
    o, _ = window_attn_chunk(q, k, v, window=3, chunk_size=4, **sinks.op_kwargs())
    o.square().sum().backward()
    _assert_all_grads_nonzero(sinks)


def test_bad_layer_settings_raise_naming_the_value():
    with pytest.raises(ValueError, match="must be even, got 7"):
        HedgehogFeatureMap(H, D, feature_dim=7)
    with pytest.raises(ValueError, match=r"init must be one of \('identity', 'random'\), got 'ones'"):
        T2RFeatureMap(H, D, init="ones")
    with pytest.raises(ValueError, match=r"init_gamma must be .* got \(0.5, 1.0\)"):
        SigmoidGate(HIDDEN, H, init_gamma=(0.5, 1.0))
    with pytest.raises(ValueError, match=r"sink kind must be one of \('logits', 'kv'\), got 'vectors'"):
        Sinks(H, 4, D, kind="vectors")
    with pytest.raises(ValueError, match=r"num_sinks must be a positive int, got 0"):
        Sinks(H, 0, D)
    with pytest.raises(ValueError, match=r"gate input must be \(B, T, 24\), got \(2, 11, 23\)"):
        SigmoidGate(HIDDEN, H)(torch.zeros(B, T, HIDDEN - 1))
    with pytest.raises(ValueError, match=r"expected input \(B, 3, T, 8\), got \(2, 4, 11, 8\)"):
        HedgehogFeatureMap(H, D)(torch.zeros(B, H + 1, T, D))


@pytest.mark.parametrize("method", ["lizard", "lolcats", "liza", "hedgehog", "t2r", "liger", "lizard-gdn"])
def test_hybrid_attention_parameters_all_receive_gradients(method):
    from linearize.layers.hybrid import HybridAttention
    from linearize.methods import method_config

    torch.manual_seed(0)
    cfg = method_config(method, window=4, chunk_size=4, **({"sink_kind": "kv"} if method == "lizard" else {}))
    layer = HybridAttention(cfg, H, D, HIDDEN)
    q, k, v = (t.requires_grad_() for t in (x_heads(0), x_heads(1), x_heads(2)))
    y, state = layer(q, k, v, q * 0.9, k * 1.1, x_hidden())
    assert y.shape == (B, H, T, D) and torch.isfinite(y).all()
    y.square().sum().backward()
    trainable = [p for p in layer.parameters() if p.requires_grad]
    # liger (frozen maps, parameter-free gate) and liza (parameter-free features and beta) have
    # nothing to learn before LoRA; every other method's parameters all learn
    assert (len(trainable) == 0) == (method in ("liger", "liza"))
    _assert_all_grads_nonzero(layer)
    assert all(t.grad.abs().sum() > 0 for t in (q, k, v))  # and the teacher's projections (LoRA) learn


def test_state_is_asked_for_only_where_a_cache_keeps_it(monkeypatch):
    """The linearized model asks its layers for their state only with a cache (need_state): a forward
    with use_cache=False (a training step) does not, a cached one does; Lizard's layer hands
    that on to lizard_attention's return_state, and y does not depend on it."""
    import fixtures
    import linearize
    from linearize.ops.lizard_attn import fused as kliz
    from linearize.layers import hybrid

    torch.manual_seed(0)
    model = linearize.convert(fixtures.ARCHS["llama"](), "lizard", window=4, chunk_size=8).eval()
    asked, returned = [], []
    forward = hybrid.HybridAttention.forward
    monkeypatch.setattr(hybrid.HybridAttention, "forward",
                        lambda self, *a, need_state=True, **k: asked.append(need_state) or forward(
                            self, *a, need_state=need_state, **k))
    # the layer's one-op path runs on CUDA only: stand in for it here, recording what it is asked
    real = kliz.lizard_attention

    def op(*a, return_state=True, **k):  # (the two branches' own ops, as off CUDA)
        returned.append(return_state)
        return real(*a, return_state=return_state, **k)

    monkeypatch.setattr(hybrid, "lizard_attention_fused", op)  # the layer calls the op's public names
    ids = torch.randint(3, fixtures.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y_train = model(input_ids=ids, use_cache=False).logits
        assert asked == [False, False] and returned == [False, False]
        y_cached = model(input_ids=ids, use_cache=True).logits
    assert asked[2:] == [True, True] and returned[2:] == [True, True]
    assert torch.equal(y_train, y_cached)
    # the op itself (its torch path here): the same y, and no state, without return_state
    fq, fk = (torch.softmax(torch.randn(B, H, T, D), -1) for _ in range(2))
    v, qw, kw = (torch.randn(B, H, T, D) for _ in range(3))
    lg = torch.nn.functional.logsigmoid(torch.randn(B, H, T) + 4)
    y, g, w = real(fq, fk, v, lg, qw, kw, torch.ones(H), window=4, chunk_size=4)
    y2, g2, w2 = real(fq, fk, v, lg, qw, kw, torch.ones(H), window=4, chunk_size=4, return_state=False)
    assert g is not None and w is not None and (g2, w2) == (None, None) and torch.equal(y, y2)


# ------------------------------------------------------------------ one layer: pieces and steps = one forward

def _layer_inputs(T_, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T_, D, generator=g, dtype=dtype) for _ in range(3))
    return q, k, v, q.flip(-1), k.flip(-1), torch.randn(B, T_, HIDDEN, generator=g, dtype=dtype)


def _run_pieces(layer, inputs, cuts):
    """The layer's output fed in pieces [0, c1), [c1, c2), ... with its state carried between them."""
    T_ = inputs[0].shape[2]
    bounds = [0, *cuts, T_]
    ys, state = [], None
    for s, e in zip(bounds[:-1], bounds[1:]):
        sl = [t[:, :, s:e] for t in inputs[:5]] + [inputs[5][:, s:e]]
        y, state = layer(*sl, state=state)
        ys.append(y)
    return torch.cat(ys, 2), state


LAYER_CASES = [("lizard", {}), ("liza", {}), ("lizard-gdn", {}), ("lizard-gdn", {"feature_map": "hedgehog"}),
               ("lizard-gdn", {"delta_order": 2, "gate": "sigmoid"}), ("lizard", {"sparse_cache": 3}),
               ("lizard-gdn", {"sparse_cache": 2}), ("lizard-gdn", {"sparse_cache": 2, "sparse_distance": 0}),
               ("liza", {"sparse_cache": 3}), ("t2r", {"local_rule": "window", "sparse_cache": 3})]


@pytest.mark.parametrize("method,kw", LAYER_CASES, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k}={v}" for k, v in x.items()) or "defaults")
def test_layer_prefill_in_pieces_and_token_steps_equal_one_forward(method, kw):
    """Two-piece prefill = one piece, and prefill + token-by-token decode = the full forward."""
    from linearize.layers.hybrid import HybridAttention
    from linearize.methods import method_config

    torch.manual_seed(0)
    layer = HybridAttention(method_config(method, window=4, chunk_size=4, **kw), H, D, HIDDEN).double()
    with torch.no_grad():
        for p in layer.parameters():  # away from the initialisation, so gates and betas vary per token
            p.add_(torch.randn_like(p) * 0.3)
    inputs = _layer_inputs(23, dtype=torch.float64)
    with torch.no_grad():
        full, _ = _run_pieces(layer, inputs, [])
        two, _ = _run_pieces(layer, inputs, [9])
        steps, _ = _run_pieces(layer, inputs, [10, *range(11, 23)])
    # fp64 ops; the gates and betas are computed in fp32 by design, hence not 1e-12
    torch.testing.assert_close(two, full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(steps, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["liza", "lizard-gdn", "lizard-recall"])
def test_the_compiled_glue_equals_the_eager_one(method):
    """compile_glue (the training step's compiled features, pooled beta, LiZA's normed mix and the
    sparse cache's recall scores): the same outputs, state and gradients as eagerly, on padded
    rows, in two pieces. Inductor on CPU; the layer's parameters moved off their initialisation so
    that beta and the gates vary."""
    from linearize.layers import hybrid

    torch.manual_seed(0)
    kw = {"sparse_cache": 3, "sparse_distance": None} if method == "lizard-recall" else {}
    layer = hybrid.HybridAttention(hybrid_config(method, **kw), H, D, HIDDEN)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    inputs = _layer_inputs(19, seed=3)
    valid = torch.ones(B, 19, dtype=torch.bool)
    valid[1, :5] = False  # a left-padded row

    def run(compiled: bool):
        layer.compile_glue = compiled
        xs = [t.clone().requires_grad_() for t in inputs]
        y1, state = layer(*[t[:, :, :11] for t in xs[:5]], xs[5][:, :11], valid=valid[:, :11])
        y2, state = layer(*[t[:, :, 11:] for t in xs[:5]], xs[5][:, 11:], state=state, valid=valid[:, 11:])
        y = torch.cat([y1, y2], 2)
        (y.square() * torch.linspace(0.5, 1.5, 19)[:, None]).sum().backward()
        return y.detach(), state["global"].S.detach(), [t.grad for t in xs] + [p.grad.clone() for p in
                                                                                layer.parameters()]

    y_eager, S_eager, g_eager = run(False)
    layer.zero_grad()
    y_comp, S_comp, g_comp = run(True)
    assert hybrid._COMPILED, "the compiled functions ran"
    assert method != "lizard-recall" or hybrid._recall_score in hybrid._COMPILED
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(S_comp, S_eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_comp, g_eager):  # (fp32 sums in another order: 1e-5 of the largest gradient)
        assert (a is None) == (b is None)  # (liza does not read the hidden states)
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def hybrid_config(method, **kw):
    from linearize.methods import method_config

    return method_config(method, window=4, chunk_size=4, **kw)


@pytest.mark.parametrize("method,kw", [c for c in LAYER_CASES if "sparse_cache" in c[1]],
                         ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
def test_sparse_layer_on_the_live_form_equals_the_span_loop(method, kw, monkeypatch):
    """A GPU runs a fresh sparse window's spans all at once (``ops.sparse_window`` live form), a CPU
    loops over them: the layer's outputs, its state and every parameter gradient agree, with a
    left-padded row (the inputs' gradients too: liza learns nothing in its attention)."""
    from linearize.layers.hybrid import HybridAttention
    from linearize.methods import method_config
    from linearize.ops.sparse_window import chunk

    torch.manual_seed(0)
    layer = HybridAttention(method_config(method, window=4, chunk_size=4, **kw), H, D, HIDDEN).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    inputs = _layer_inputs(23, dtype=torch.float64)
    valid = torch.ones(B, 23, dtype=torch.bool)
    valid[1, :5] = False

    def run(gpu):
        monkeypatch.setattr(chunk, "on_gpu", lambda x: gpu)
        layer.zero_grad()
        xs = [t.clone().requires_grad_(True) for t in inputs]
        y, state = layer(*xs, valid=valid)
        (y * torch.linspace(-1, 1, D, dtype=y.dtype)).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        grads.update({f"input {i}": t.grad for i, t in enumerate(xs)})
        return y.detach(), state["local"], grads

    y_live, st_live, g_live = run(True)
    y_loop, st_loop, g_loop = run(False)
    torch.testing.assert_close(y_live, y_loop, rtol=1e-9, atol=1e-9)
    for field, a, b in zip(st_live._fields, st_live, st_loop):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=field)
    assert g_live.keys() == g_loop.keys()
    for name in g_live:
        torch.testing.assert_close(g_live[name], g_loop[name], rtol=1e-8, atol=1e-8, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("log_alpha_bias", [-20.0, 20.0])
def test_gated_delta_layer_bf16_long_input_extreme_gates_finite(log_alpha_bias):
    """Decays at both ends (alpha = exp(-softplus(20)) ~ 0 and ~1), betas at both ends: no inf/NaN in bf16."""
    from linearize.layers.hybrid import HybridAttention
    from linearize.methods import method_config

    torch.manual_seed(0)
    layer = HybridAttention(method_config("lizard-gdn", window=16), H, D, HIDDEN)
    with torch.no_grad():
        layer.gate.bias.fill_(-log_alpha_bias)  # mamba2: log alpha = -softplus(bias)
        layer.beta_proj.bias.copy_(torch.tensor([-30.0, 0.0, 30.0]))
    layer = layer.to(torch.bfloat16)
    T_ = 8192
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, T_, D, generator=g).mul(8).to(torch.bfloat16) for _ in range(3))
    x = torch.randn(1, T_, HIDDEN, generator=g).mul(8).to(torch.bfloat16)
    with torch.no_grad():
        y, state = layer(q, k, v, q, k, x)
    assert torch.isfinite(y).all() and torch.isfinite(state["global"].S).all()


def test_gated_delta_settings_are_checked():
    from linearize.methods import method_config

    with pytest.raises(ValueError, match=r"one decay per head: gate must be one of \('sigmoid', 'mamba2'\) or None, got 'gla'"):
        method_config("lizard-gdn", gate="gla")
    with pytest.raises(ValueError, match=r"apply only to global_rule 'delta', not 'gated' \(got beta='linear'"):
        method_config("lizard", beta="linear")
    with pytest.raises(ValueError, match=r"beta must be one of \('pool', 'linear'\), got 'x'"):
        method_config("lizard-gdn", beta="x")


@pytest.mark.slow  # ~5 s on a quiet CPU
@torch.no_grad()
@pytest.mark.parametrize("distance", [None, 0])
def test_sparse_cache_state_bytes_identical_at_1k_and_32k_tokens(distance):
    """Window + sparse cache + global state: the same tensors, shapes and bytes after 1K and 32K tokens,
    and the cache is full (M pairs) with positions that have left the window; also with the cache
    read at a fixed distance (its state also holds the last w keys without RoPE)."""
    from linearize.layers.hybrid import HybridAttention
    from linearize.methods import method_config
    from linearize.models.cache import iter_tensors

    torch.manual_seed(0)
    M, w = 4, 16
    layer = HybridAttention(method_config("lizard", window=w, sparse_cache=M, chunk_size=64, sparse_distance=distance),
                            1, D, HIDDEN)
    sizes = []
    for T_ in (1024, 32768):
        g = torch.Generator().manual_seed(T_)
        q, k, v = (torch.randn(1, 1, T_, D, generator=g) for _ in range(3))
        _, state = layer(q, k, v, q, k, torch.randn(1, T_, HIDDEN, generator=g))
        sizes.append([(tuple(t.shape), t.dtype) for t in iter_tensors(state)])
        pos = state["local"].cache_pos
        assert pos.shape == (1, 1, M) and (pos >= 0).all() and (pos <= T_ - 1 - w).all()
    assert sizes[0] == sizes[1]
    assert sum(math.prod(s) * torch.empty(0, dtype=d).element_size() for s, d in sizes[0]) == sum(
        math.prod(s) * torch.empty(0, dtype=d).element_size() for s, d in sizes[1])


def test_sparse_cache_settings_are_checked():
    from linearize.methods import method_config

    with pytest.raises(ValueError, match="sparse_cache must be a non-negative int, got -1"):
        method_config("lizard", sparse_cache=-1)
    with pytest.raises(ValueError, match="needs local_rule 'window' and combine 'sum' or 'mu', got 'window' and 'shared_norm'"):
        method_config("lolcats", sparse_cache=4)


@torch.no_grad()
def test_sparse_cache_keeps_the_pair_the_memory_recalls_worst_and_reads_it_exactly():
    """One pair whose value the gated memory cannot give back (an outlier, far larger than the
    rest) is cached when it leaves the window by LoLA's absolute error; a query for its key long
    after reads its value through the cache, and not without it. (The relative score is the same
    error over the value's norm, checked below; it ranks this outlier by the share it lost.)"""
    from linearize.layers.hybrid import HybridAttention
    from linearize.methods import method_config

    torch.manual_seed(0)
    T_, at = 40, 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, T_, D, generator=g) for _ in range(3))
    x = torch.randn(1, T_, HIDDEN, generator=g)
    v[0, 0, at] = 20.0  # far from every other value: the memory's read of its key averages it away
    q[0, 0, -1] = 10 * k[0, 0, at]  # the last query asks for it
    outs = {}
    for M in (0, 2):
        layer = HybridAttention(method_config("lizard", window=4, sinks=0, sparse_cache=M, sparse_score="error"),
                                1, D, HIDDEN)
        y, state = layer(q, k, v, q, k, x)
        outs[M] = y[0, 0, -1]
        if M:
            assert at in state["local"].cache_pos[0, 0].tolist()
    assert (outs[2] - 20.0).abs().max() < 1.5  # y = y_global (small) + alpha * (the cached value, read exactly)
    assert outs[0].abs().max() < 3  # without the cache, the window and the blurred memory have lost it


@torch.no_grad()
@pytest.mark.parametrize("method", ["lizard", "lizard-gdn"])
def test_the_relative_sparse_score_is_the_error_over_the_leaving_values_norm(method, monkeypatch):
    """The score the layer hands the sparse-window op: with sparse_score "relative", LoLA's
    self-recall error ("error") divided by the norm of the value leaving the window at that query
    (v at t - w; before the start, where the op ignores it, zeros)."""
    import linearize.layers.hybrid as hybrid
    from linearize.methods import method_config

    seen, real = {}, hybrid.sparse_window_attn_chunk

    def spy(q, k, v, score, **kw):
        seen["score"] = score.clone()
        return real(q, k, v, score, **kw)

    monkeypatch.setattr(hybrid, "sparse_window_attn_chunk", spy)
    T_, w = 24, 4
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, T_, D, generator=g) for _ in range(3))
    x = torch.randn(1, T_, HIDDEN, generator=g)
    scores = {}
    for rule in ("error", "relative"):
        torch.manual_seed(0)
        layer = hybrid.HybridAttention(method_config(method, window=w, sparse_cache=3, sparse_score=rule), 2, D, HIDDEN)
        layer(q, k, v, q, k, x)
        scores[rule] = seen["score"]
    leaving = v.norm(dim=-1)[:, :, :T_ - w]  # query t scores the pair at t - w
    torch.testing.assert_close(scores["relative"][:, :, w:], scores["error"][:, :, w:] / leaving)
    assert not torch.equal(scores["relative"], scores["error"])


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding of x (..., T, d) at positions pos (T,)."""
    d = x.shape[-1]
    angle = pos.to(x.dtype)[:, None] / 10000 ** (torch.arange(0, d, 2, dtype=x.dtype) / d)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


@torch.no_grad()
def test_a_cache_at_a_fixed_distance_reads_the_same_however_far_back_its_pairs_are():
    """Moving the first tokens 5,000 positions further back changes nothing a query sees in its
    window (relative RoPE), only the cached pairs' distances: with sparse_distance set (every
    cached pair read as that far back) the outputs stay the same; without it (LoLA's own distances)
    they change."""
    from linearize.layers.hybrid import HybridAttention
    from linearize.methods import method_config

    T_, w, cut, dist = 40, 4, 20, 7
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, T_, D, generator=g, dtype=torch.float64) for _ in range(3))
    x = torch.randn(1, T_, HIDDEN, generator=g, dtype=torch.float64)
    near_pos = torch.arange(T_)
    far_pos = torch.where(near_pos < cut, near_pos - 5000, near_pos)
    seen = slice(cut + w - 1, None)  # queries whose window starts at or after the cut
    q_far = _rope(q, torch.full((T_,), dist))
    for distance, same in ((dist, True), (0, True), (None, False)):
        torch.manual_seed(0)
        layer = HybridAttention(method_config("lizard-gdn", window=w, sparse_cache=3, sparse_distance=distance,
                                              chunk_size=8), 2, D, HIDDEN).double()
        extra = {"q_far": q_far} if distance else {}
        near, _ = layer(q, k, v, _rope(q, near_pos), _rope(k, near_pos), x, **extra)
        far, _ = layer(q, k, v, _rope(q, far_pos), _rope(k, far_pos), x, **extra)
        assert torch.allclose(near[:, :, seen], far[:, :, seen], rtol=1e-10, atol=1e-10) == same, distance
    with pytest.raises(ValueError, match="sparse_distance=7 needs q_far"):
        layer = HybridAttention(method_config("lizard-gdn", window=w, sparse_cache=3, sparse_distance=dist), 2, D, HIDDEN)
        layer(q.float(), k.float(), v.float(), q.float(), k.float(), x.float())


def test_a_bad_sparse_score_is_named():
    from linearize.methods import method_config

    with pytest.raises(ValueError, match=r"sparse_score must be one of \('relative', 'error'\), got 'norm'"):
        method_config("lizard", sparse_cache=4, sparse_score="norm")
    with pytest.raises(ValueError, match="sparse_distance must be a non-negative int or None, got -1"):
        method_config("lizard", sparse_cache=4, sparse_distance=-1)
