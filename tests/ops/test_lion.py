"""LION ops: parallel = bidirectional RNN = chunkwise, the mask convention, padding, gradients, errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import TOL, assert_rel_close, assert_state_close, count_chunk_steps
from linearize.ops.lion import LionState, lion_chunk, lion_mask, lion_parallel, lion_recurrent

B, H, T, FD, DV = 2, 3, 29, 6, 5

FORMS = {
    "parallel": lion_parallel,
    "recurrent": lion_recurrent,
    "chunk": lambda *a, **kw: lion_chunk(*a, chunk_size=kw.pop("chunk_size", 8), **kw),
}


def inputs(dtype=torch.float64, seed=0, T=T, B=B):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, H, T, FD, generator=g, dtype=torch.float64)  # positive, as feature maps give
    k = torch.rand(B, H, T, FD, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def decay(variant, dtype=torch.float64, seed=1, T=T, B=B):
    """log_a for each variant: None, log λ_h (H,), or per-token log gates (B, H, T) over a wide range."""
    g = torch.Generator().manual_seed(seed)
    if variant == "lit":
        return None
    if variant == "d":
        return F.logsigmoid(torch.randn(H, generator=g, dtype=torch.float64) + 2).to(dtype)
    return F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64) * 2 + 1).to(dtype)


def padding(T=T):
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, T - 7:] = False          # right padding
    valid[1, :3] = False              # left padding
    valid[1, 10:13] = False           # and a hole in the middle
    return valid


def explicit_mask(log_a, T, b=0):
    """M written out with Python products: the convention of docs/design.md, entry by entry."""
    M = torch.ones(H, T, T, dtype=torch.float64)
    if log_a is None:
        return M
    a = log_a.double().exp()
    a = a.view(H, 1).expand(H, T) if a.dim() == 1 else a[b]
    for h in range(H):
        for i in range(T):
            for j in range(T):
                if i > j:
                    M[h, i, j] = math.prod(a[h, j + 1:i + 1].tolist())  # Π_{k=j+1..i}: the query's gate is in
                elif i < j:
                    M[h, i, j] = math.prod(a[h, i:j].tolist())          # Π_{k=i..j-1}: the key's gate is not
    return M


@pytest.mark.parametrize("variant", ["lit", "d", "s"])
def test_mask_matches_explicit_products(variant):
    t = 9
    log_a = decay(variant, T=t)
    M = lion_mask(log_a, t, batch_size=B, dtype=torch.float64)
    for b in range(B):
        ref = explicit_mask(log_a, t, b)
        assert torch.allclose(M[min(b, M.shape[0] - 1)].expand_as(ref), ref, atol=1e-14, rtol=1e-12)
    if variant == "d":  # the fixed decay is the Toeplitz λ^{|i-j|}
        lam = log_a.exp()
        assert torch.allclose(M[0, :, 2, 7], lam ** 5) and torch.allclose(M[0, :, 7, 2], lam ** 5)


def test_parallel_is_the_scaled_masked_attention():
    q, k, v = inputs()
    log_a = decay("s")
    o, _ = lion_parallel(q, k, v, log_a)
    ou, _ = lion_parallel(q, k, v, log_a, scaled=False)
    for b in (0, 1):
        w = torch.einsum("htf,hsf->hts", q[b], k[b]) * explicit_mask(log_a, T, b)
        assert_rel_close(ou[b], w @ v[b], 1e-12, "unscaled")
        assert_rel_close(o[b], (w @ v[b]) / (w.sum(-1, keepdim=True) + 1e-6), 1e-12, "scaled")


@pytest.mark.parametrize("scaled", [True, False])
def test_rnn_counts_the_diagonal_once(scaled):
    """The RNN equals attention under the explicit mask, and not the naive sum of two causal
    recurrences (whose mask has 2 on the diagonal)."""
    q, k, v = inputs()
    log_a = decay("s")
    o, _ = lion_recurrent(q, k, v, log_a, scaled=scaled)
    for b in (0, 1):
        M = explicit_mask(log_a, T, b)
        for mask, same in ((M, True), (M + torch.eye(T, dtype=M.dtype), False)):
            w = torch.einsum("htf,hsf->hts", q[b], k[b]) * mask
            ref = w @ v[b] / ((w.sum(-1, keepdim=True) + 1e-6) if scaled else 1)
            err = (o[b] - ref).abs().max().item()
            assert (err < 1e-12) == same, f"mask with diagonal {mask[0, 0, 0].item()}: max error {err:.2e}"


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("variant", ["lit", "d", "s"])
@pytest.mark.parametrize("form", ["recurrent", "chunk", "parallel"])
def test_forms_agree(form, variant, dtype, scaled, pad):
    valid = padding() if pad else None
    ref, ref_state = lion_parallel(*inputs(), decay(variant), valid=valid, scaled=scaled)
    log_a = decay(variant, dtype)
    o, state = FORMS[form](*inputs(dtype), log_a, valid=valid, scaled=scaled)
    assert o.dtype == dtype and isinstance(state, LionState)
    assert state.S_f.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_rel_close(o, ref, TOL[dtype], f"{form} {variant} {dtype}")
    assert_state_close(state, ref_state, TOL[dtype])


def test_bf16_inputs_keep_fp32_accuracy():
    q, k, v = (x.to(torch.bfloat16) for x in inputs())
    ref, _ = lion_parallel(q.double(), k.double(), v.double(), decay("s"))
    o, _ = lion_chunk(q, k, v, decay("s", torch.bfloat16), chunk_size=8)
    assert o.dtype == torch.bfloat16
    assert_rel_close(o, ref, TOL[torch.bfloat16])


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@pytest.mark.parametrize("variant", ["d", "s"])
def test_chunk_size_does_not_change_the_result(chunk_size, variant):
    q, k, v = inputs()
    ref, ref_state = lion_parallel(q, k, v, decay(variant), valid=padding())
    o, state = lion_chunk(q, k, v, decay(variant), valid=padding(), chunk_size=chunk_size)
    assert_rel_close(o, ref, 1e-12)
    assert_state_close(state, ref_state, 1e-12)


def test_states_are_the_sequence_decayed_to_each_end():
    q, k, v = inputs()
    log_a = decay("s")
    _, st = lion_chunk(q, k, v, log_a, chunk_size=7)
    a = log_a.exp()
    to_end = torch.stack([a[:, :, j + 1:].prod(-1) for j in range(T)], -1)   # Π_{k=j+1..T} a_k
    from_start = torch.stack([a[:, :, :j].prod(-1) for j in range(T)], -1)  # Π_{k<j} a_k
    assert_rel_close(st.S_f, torch.einsum("bht,bhtf,bhtd->bhfd", to_end, k, v), 1e-12)
    assert_rel_close(st.S_b, torch.einsum("bht,bhtf,bhtd->bhfd", from_start, k, v), 1e-12)
    assert_rel_close(st.z_b, torch.einsum("bht,bhtf->bhf", from_start, k), 1e-12)


@pytest.mark.parametrize("variant", ["lit", "d", "s"])
@pytest.mark.parametrize("form", ["recurrent", "chunk", "parallel"])
def test_padding_never_reaches_a_state_or_a_gate(form, variant):
    """A padded row gives each real token what it gets with the padding removed, whatever the
    padding holds (NaN included); padded positions output 0."""
    q, k, v = inputs()
    log_a = decay(variant)
    valid = padding()
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[~valid[:, None, :, None].expand_as(x)] = float("nan")
    if variant == "s":
        log_a = log_a.clone()
        log_a[~valid[:, None, :].expand_as(log_a)] = -1e3  # a gate that would wipe any state
    o, state = FORMS[form](q2, k2, v2, log_a, valid=valid)
    assert torch.isfinite(o).all()
    assert (o[~valid[:, None, :, None].expand_as(o)] == 0).all()
    for b in range(B):
        keep = valid[b]
        sub = lambda x: x[b:b + 1, :, keep]  # noqa: E731
        la = None if log_a is None else (log_a if log_a.dim() == 1 else log_a[b:b + 1, :, keep])
        alone, st_alone = lion_parallel(sub(q), sub(k), sub(v), la)
        assert_rel_close(o[b:b + 1, :, keep], alone, 1e-12, f"row {b}")
        assert_state_close(LionState(*(s[b:b + 1] for s in state)), st_alone, 1e-12)


def test_chunk_form_takes_two_sweeps_of_ceil_t_over_c_chunks():
    q, k, v = inputs()
    with count_chunk_steps() as counter:
        lion_chunk(q, k, v, decay("s"), chunk_size=8)
    assert counter == {"calls": 1, "spans": math.ceil(T / 8)}


@pytest.mark.parametrize("variant", ["d", "s"])
@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_gradients_match_the_parallel_form(form, variant):
    def grads(fn):
        q, k, v = (x.requires_grad_() for x in inputs())
        log_a = decay(variant).requires_grad_()
        o, st = fn(q, k, v, log_a, valid=padding())
        (o.pow(2).sum() + st.S_f.sum() + st.z_b.sum()).backward()
        return q.grad, k.grad, v.grad, log_a.grad

    for name, g, g_ref in zip("qkv", grads(FORMS[form]), grads(lion_parallel)):
        assert g.abs().sum() > 0, f"no gradient reaches {name}"
        assert_rel_close(g, g_ref, 1e-10, f"grad {name}")
    g_a = grads(FORMS[form])[3]
    assert g_a.abs().sum() > 0 and torch.isfinite(g_a).all(), "no gradient reaches the decay"
    assert_rel_close(g_a, grads(lion_parallel)[3], 1e-10, "grad log_a")


def test_long_input_with_extreme_gates_stays_finite_in_bf16():
    """Invariant 7: 64K tokens, log gates anywhere in [-20, 0], bf16 inputs: no inf/NaN."""
    T_long, g = 65536, torch.Generator().manual_seed(0)
    q, k = (torch.rand(1, 1, T_long, 4, generator=g).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 1, T_long, 4, generator=g).to(torch.bfloat16)
    log_a = -20 * torch.rand(1, 1, T_long, generator=g) ** 4  # mostly near 0, some near -20
    o, state = lion_chunk(q, k, v, log_a, chunk_size=1024)
    assert torch.isfinite(o).all() and all(torch.isfinite(s).all() for s in state)
    # the same around a hard reset: gates of e^-20 cut the sequence, so the two halves decouple
    log_a[..., 1000] = -20.0
    o2, _ = lion_chunk(q[..., :1100, :], k[..., :1100, :], v[..., :1100, :], log_a[..., :1100], chunk_size=64)
    assert torch.isfinite(o2).all()


@pytest.mark.parametrize("bad, message", [
    (dict(log_a=torch.zeros(H + 1)), r"log_a must be None .* got \(4,\)"),
    (dict(log_a=torch.zeros(B, H, T + 1)), r"got \(2, 3, 30\)"),
    (dict(log_a=torch.full((H,), 0.5)), r"log_a must be <= 0 .* maximum of 0.5"),
    (dict(log_a=torch.full((H,), float("-inf"))), r"log_a must be finite .* 3 non-finite"),
    (dict(valid=torch.ones(B, T + 1, dtype=torch.bool)), r"valid must have shape \(2, 29\) .* got \(2, 30\)"),
    (dict(valid=torch.zeros(B, T)), r"valid must be a bool .* got dtype torch.float32"),
    (dict(valid=torch.full((B, T), 2)), r"valid must hold only 0 and 1, got \[2\]"),
    (dict(valid=[[1] * T] * B), r"valid must be a \(B, T\) bool tensor or None, got list"),
])
@pytest.mark.parametrize("form", list(FORMS))
def test_bad_decay_or_mask_is_named(form, bad, message):
    q, k, v = inputs(torch.float32)
    kwargs = {"log_a": None, "valid": None, **bad}
    with pytest.raises(ValueError, match=message):
        FORMS[form](q, k, v, kwargs.pop("log_a"), **kwargs)


def test_integer_padding_mask_is_accepted():
    q, k, v = inputs()
    a, _ = lion_chunk(q, k, v, decay("s"), valid=padding().long())
    b, _ = lion_chunk(q, k, v, decay("s"), valid=padding())
    assert torch.equal(a, b)


# ----------------------------------------------------------------------- asymmetric decays (ours)


def explicit_two_sided_mask(log_a, log_a_back, T, b=0):
    """Keys left of the query take the products of ``log_a``'s gates, keys right of it those of
    ``log_a_back``, with the same index ranges as ``explicit_mask``."""
    lower, upper = explicit_mask(log_a, T, b), explicit_mask(log_a_back, T, b)
    return torch.where(torch.ones(T, T, dtype=torch.bool).tril(), lower, upper)


@pytest.mark.parametrize("variant", ["d", "s"])
def test_two_sided_mask_takes_each_sides_own_decays(variant):
    t = 9
    log_a, log_b = decay(variant, T=t), decay(variant, T=t, seed=5)
    M = lion_mask(log_a, t, batch_size=B, dtype=torch.float64, log_a_back=log_b)
    for b in range(B):
        ref = explicit_two_sided_mask(log_a, log_b, t, b)
        assert torch.allclose(M[min(b, M.shape[0] - 1)].expand_as(ref), ref, atol=1e-14, rtol=1e-12)
    same = lion_mask(log_a, t, batch_size=B, dtype=torch.float64, log_a_back=log_a)
    assert torch.allclose(same, lion_mask(log_a, t, batch_size=B, dtype=torch.float64), atol=1e-15)
    assert not torch.allclose(M, same)  # the right side really changed


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("variant", ["d", "s"])
@pytest.mark.parametrize("form", ["recurrent", "chunk", "parallel"])
def test_forms_agree_with_two_sided_decays(form, variant, scaled, pad):
    """Each form against attention under the explicit two-sided mask, states included."""
    valid = padding() if pad else None
    q, k, v = inputs()
    log_a, log_b = decay(variant), decay(variant, seed=5)
    o, state = FORMS[form](q, k, v, log_a, valid=valid, scaled=scaled, log_a_back=log_b)
    for b in range(B):
        keep = valid[b] if pad else torch.ones(T, dtype=torch.bool)
        sub = lambda x: x[b, :, keep]  # noqa: E731
        la, lb = ((x if x.dim() == 1 else x[b:b + 1, :, keep]) for x in (log_a, log_b))
        M = explicit_two_sided_mask(la, lb, int(keep.sum()))
        w = torch.einsum("htf,hsf->hts", sub(q), sub(k)) * M
        ref = w @ sub(v) / ((w.sum(-1, keepdim=True) + 1e-6) if scaled else 1)
        assert_rel_close(o[b, :, keep], ref, 1e-12, f"{form} row {b}")
    _, ref_state = lion_parallel(q, k, v, log_a, valid=valid, scaled=scaled, log_a_back=log_b)
    assert_state_close(state, ref_state, 1e-12)
    _, st_sym = lion_parallel(q, k, v, log_a, valid=valid, scaled=scaled)
    assert_rel_close(state.S_f, st_sym.S_f, 1e-12)  # left-to-right state: log_a's decays alone
    assert not torch.allclose(state.S_b, st_sym.S_b)


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_two_sided_gradients_match_the_parallel_form(form):
    def grads(fn):
        q, k, v = (x.requires_grad_() for x in inputs())
        log_a, log_b = decay("s").requires_grad_(), decay("s", seed=5).requires_grad_()
        o, st = fn(q, k, v, log_a, valid=padding(), log_a_back=log_b)
        (o.pow(2).sum() + st.S_f.sum() + st.z_b.sum()).backward()
        return q.grad, k.grad, v.grad, log_a.grad, log_b.grad

    for name, g, g_ref in zip(["q", "k", "v", "log_a", "log_a_back"], grads(FORMS[form]), grads(lion_parallel)):
        assert g.abs().sum() > 0, f"no gradient reaches {name}"
        assert_rel_close(g, g_ref, 1e-10, f"grad {name}")


@pytest.mark.parametrize("log_a, log_b, message", [
    (None, torch.zeros(H), r"log_a_back .* needs log_a .* lion-lit has no decay"),
    (torch.zeros(H), torch.zeros(B, H, T), r"log_a_back must have log_a's shape \(3,\), got \(2, 3, 29\)"),
    (torch.zeros(H), torch.full((H,), 0.5), r"log_a_back must be <= 0 .* maximum of 0.5"),
])
@pytest.mark.parametrize("form", list(FORMS))
def test_bad_back_decay_is_named(form, log_a, log_b, message):
    q, k, v = inputs(torch.float32)
    with pytest.raises(ValueError, match=message):
        FORMS[form](q, k, v, log_a, log_a_back=log_b)


# ------------------------------------------- feature maps applied by the op, keys left out of the sums


class CountingMap(torch.nn.Module):
    """A positive learnable feature map (B, H, C, d) -> (B, H, C, 2d) that records how many tokens
    each call saw: the ops must never apply it to more than one chunk (block) at a time without
    autograd, where the F-wide features of the whole input would be extra memory that grows with T."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(FD, FD, generator=g, dtype=torch.float64) / FD ** 0.5)
        self.calls = []

    def forward(self, x):
        self.calls.append(x.shape[2])
        y = x @ self.weight.to(x.dtype)
        return torch.cat([y.softmax(-1), (-y).softmax(-1)], -1)


def key_mask():
    keys = torch.ones(B, T, dtype=torch.bool)
    keys[:, 0] = False   # a sink, as layers.lion leaves [CLS] out of LION's sums
    keys[1, 20:23] = False
    return keys


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("variant", ["lit", "d", "s"])
@pytest.mark.parametrize("form", list(FORMS))
def test_feature_maps_applied_by_the_op_match_features_given(form, variant, pad, grad):
    """phi_q / phi_k with raw q, k = the same op on phi(q), phi(k) made beforehand, with keys
    outside ``key_valid`` zeroed by hand; with and without autograd (the op then makes the
    features per chunk, and the maps see no more than a chunk's (block's) tokens)."""
    from linearize.ops.lion.recurrent import FEATURE_BLOCK

    valid = padding() if pad else None
    q, k, v = inputs(seed=3)
    log_a = decay(variant)
    phi_q, phi_k = CountingMap(1), CountingMap(2)
    with torch.set_grad_enabled(grad):
        o, state = FORMS[form](q, k, v, log_a, valid=valid, phi_q=phi_q, phi_k=phi_k, key_valid=key_mask())
    seen = phi_q.calls + phi_k.calls
    with torch.no_grad():
        fk = phi_k(k).masked_fill(~key_mask()[:, None, :, None], 0.0)
        ref, ref_state = lion_parallel(phi_q(q), fk, v, log_a, valid=valid)
    assert_rel_close(o, ref, 1e-12, form)
    assert_state_close(state, ref_state, 1e-12)
    assert o.requires_grad == grad
    most = {"parallel": T, "chunk": 8 if not grad else T, "recurrent": FEATURE_BLOCK if not grad else T}[form]
    assert 0 < max(seen) <= most, seen


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_gradients_reach_the_feature_maps_the_op_applies(form):
    def grads(fn):
        phi_q, phi_k = CountingMap(1), CountingMap(2)
        q, k, v = (x.requires_grad_() for x in inputs(seed=3))
        log_a = decay("s").requires_grad_()
        o, st = fn(q, k, v, log_a, valid=padding(), phi_q=phi_q, phi_k=phi_k, key_valid=key_mask())
        (o.pow(2).sum() + st.S_f.sum() + st.z_b.sum()).backward()
        return q.grad, k.grad, v.grad, log_a.grad, phi_q.weight.grad, phi_k.weight.grad

    for name, g, g_ref in zip(["q", "k", "v", "log_a", "phi_q", "phi_k"], grads(FORMS[form]), grads(lion_parallel)):
        assert g.abs().sum() > 0, f"no gradient reaches {name}"
        assert_rel_close(g, g_ref, 1e-10, f"grad {name}")


def test_keys_left_out_still_query_and_decay():
    """A key outside ``key_valid`` adds nothing to any sum, but its token keeps its query and its
    gate: unlike padding, which drops the token whole."""
    q, k, v = inputs()
    log_a = decay("s")
    keys = key_mask()
    o, _ = lion_chunk(q, k, v, log_a, key_valid=keys, chunk_size=8)
    ref, _ = lion_parallel(q, k.masked_fill(~keys[:, None, :, None], 0.0), v, log_a)
    assert_rel_close(o, ref, 1e-12)
    padded, _ = lion_chunk(q, k, v, log_a, valid=keys, chunk_size=8)
    assert o[:, :, 0].abs().sum() > 0 and padded[:, :, 0].abs().sum() == 0
    assert not torch.allclose(o[1, :, 23:], padded[1, :, 23:])  # the left-out keys' gates still decay


@pytest.mark.parametrize("kwargs, message", [
    (dict(phi_q=lambda x: x), r"phi_q and phi_k go together"),
    (dict(phi_q="hedgehog", phi_k="hedgehog"), r"phi_q must be None .* or a callable .* got str"),
    (dict(key_valid=torch.ones(B, T + 1, dtype=torch.bool)), r"key_valid must have shape \(2, 29\) .* got \(2, 30\)"),
    (dict(key_valid=torch.ones(B, T)), r"key_valid must be a bool .* got dtype torch.float32"),
])
@pytest.mark.parametrize("form", list(FORMS))
def test_bad_feature_map_or_key_mask_is_named(form, kwargs, message):
    q, k, v = inputs(torch.float32)
    with pytest.raises(ValueError, match=message):
        FORMS[form](q, k, v, None, **kwargs)
