import math

import pytest
import torch

from helpers import TOL, assert_rel_close, assert_state_close, count_chunk_steps
from linearize.ops.linear_attn import (
    LinearAttnState, linear_attn_chunk, linear_attn_parallel, linear_attn_recurrent,
)

B, H, T, DK, DV = 2, 3, 37, 8, 5


def inputs(dtype, seed=0, T=T):
    g = torch.Generator().manual_seed(seed)
    # positive features, as a feature map would give
    q = torch.rand(B, H, T, DK, generator=g, dtype=torch.float64)
    k = torch.rand(B, H, T, DK, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, T, DV, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


FORMS = {
    "parallel": linear_attn_parallel,
    "chunk": lambda *a, **kw: linear_attn_chunk(*a, chunk_size=8, **kw),
    "recurrent": linear_attn_recurrent,
}


def test_parallel_matches_explicit_sum():
    q, k, v = inputs(torch.float64)
    o, _ = linear_attn_parallel(q, k, v)
    t = 20
    w = torch.einsum("bhd,bhsd->bhs", q[:, :, t], k[:, :, : t + 1])
    ref = torch.einsum("bhs,bhsd->bhd", w, v[:, :, : t + 1]) / (w.sum(-1, keepdim=True) + 1e-6)
    assert_rel_close(o[:, :, t], ref, 1e-12)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["chunk", "recurrent", "parallel"])
def test_forms_agree(form, dtype, normalize):
    ref, ref_state = linear_attn_parallel(*inputs(torch.float64), normalize=normalize)
    o, state = FORMS[form](*inputs(dtype), normalize=normalize)
    assert o.dtype == dtype
    assert state.S.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_rel_close(o, ref, TOL[dtype], f"{form} {dtype}")
    assert_state_close(state, ref_state, TOL[dtype])


@pytest.mark.parametrize("form", list(FORMS))
def test_two_piece_prefill_equals_one(form):
    q, k, v = inputs(torch.float64)
    full, full_state = FORMS[form](q, k, v)
    a, st = FORMS[form](q[:, :, :13], k[:, :, :13], v[:, :, :13])
    b, st = FORMS[form](q[:, :, 13:], k[:, :, 13:], v[:, :, 13:], state=st)
    assert_rel_close(torch.cat([a, b], 2), full, 1e-12)
    assert_state_close(st, full_state, 1e-12)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunk_size_and_length_do_not_change_prefix(chunk_size):
    q, k, v = inputs(torch.float64)
    ref, _ = linear_attn_parallel(q, k, v)
    o, _ = linear_attn_chunk(q[:, :, :29], k[:, :, :29], v[:, :, :29], chunk_size=chunk_size)
    assert_rel_close(o, ref[:, :, :29], 1e-12)


def test_causal():
    q, k, v = inputs(torch.float64)
    o, _ = linear_attn_chunk(q, k, v, chunk_size=8)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 21:] = torch.rand_like(k2[:, :, 21:])
    v2[:, :, 21:] = torch.randn_like(v2[:, :, 21:])
    o2, _ = linear_attn_chunk(q, k2, v2, chunk_size=8)
    assert torch.equal(o[:, :, :21], o2[:, :, :21])
    assert not torch.allclose(o[:, :, 21:], o2[:, :, 21:])


def test_chunk_form_takes_ceil_t_over_c_steps():
    with count_chunk_steps() as counter:
        linear_attn_chunk(*inputs(torch.float32), chunk_size=8)
    assert counter == {"calls": 1, "spans": math.ceil(T / 8)}


def test_bad_inputs_raise_naming_the_value():
    q, k, v = inputs(torch.float32)
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got 0"):
        linear_attn_chunk(q, k, v, chunk_size=0)
    with pytest.raises(ValueError, match=r"q must be 4-D"):
        linear_attn_parallel(q[0], k, v)
    with pytest.raises(ValueError, match=r"dtype torch.int64"):
        linear_attn_parallel(q.long(), k, v)
    bad = LinearAttnState(torch.zeros(B, H, DK + 1, DV), torch.zeros(B, H, DK))
    with pytest.raises(ValueError, match=r"state.S must have shape \(2, 3, 8, 5\), got \(2, 3, 9, 5\)"):
        linear_attn_recurrent(q, k, v, state=bad)
