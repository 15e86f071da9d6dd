"""LoLCATs hybrid state, inputs, the shared-normaliser math, and the parallel (quadratic) reference.

Shapes: ``q, k: (B, H, T, Dk)`` raw (already RoPE'd) for the softmax terms, ``fq, fk: (B, H, T, F)``
non-negative features for the linear terms, ``v: (B, H, T, Dv)``, ``window_factor: (H,)`` the
factor f in (0, 1) (the layer applies the sigmoid), output ``(B, H, T, Dv)``.

    y_t = [sum_{s in win(t)} f e^{q_t.k_s*scale - c_t} v_s + sum_{s older} (fq_t.fk_s) v_s]
          / ([the same without v_s] + eps),        c_t = max_{s in win(t)} q_t.k_s*scale

With ``softcap`` c (Gemma 2's ``attn_logit_softcapping``) every window logit q_t.k_s*scale above,
c_t included, reads c * tanh(q_t.k_s*scale / c); the linear terms are unchanged. ``softcap=None``
is the uncapped computation, bit for bit.

"older" = 0 <= s <= t and not in the window. c_t belongs to the model: the linear terms are not
scaled by e^{-c_t}, so it is not a removable stabiliser; every form computes it over exactly the
window's scores and it stays differentiable.

The window geometry and its cache (positions, ``pos``, empty negative slots) are those of
``window_attn``. The state adds S, z: the linear state of every key older than the cache, which is
older than the window for any query still to come.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import common
from ..window_attn.naive import (
    check_pos, check_softcap, check_window, keep_last, key_positions, seen, soft_cap, visible,
)


class LolcatsState(NamedTuple):
    """S: (B, H, F, Dv), z: (B, H, F) = sums of fk_s v_s^T and fk_s over keys older than the cache;
    k: (B, H, L, Dk), fk: (B, H, L, F), v: (B, H, L, Dv) = the last L keys; pos: (B,) int64."""

    S: torch.Tensor
    z: torch.Tensor
    k: torch.Tensor
    fk: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor


def check_inputs(q, k, v, fq, fk, window_factor, window, terraced, state: Optional[LolcatsState]):
    """Validate everything; returns (compute dtype, cache length L, state in the compute dtype)."""
    B, H, T, Dk, Dv = common.check_qkv(q, k, v)
    L = check_window(window, terraced)
    for name, x in (("fq", fq), ("fk", fk)):
        common.check_float(name, x)
        if x.dim() != 4 or tuple(x.shape[:3]) != (B, H, T):
            raise ValueError(f"{name} must have shape (B, H, T, F) = ({B}, {H}, {T}, F), "
                             f"got {tuple(x.shape)}")
    if fq.shape != fk.shape:
        raise ValueError(f"fq and fk must have the same shape, got {tuple(fq.shape)} and {tuple(fk.shape)}")
    F = fq.shape[-1]
    common.check_float("window_factor", window_factor)
    if tuple(window_factor.shape) != (H,):
        raise ValueError(f"window_factor must have shape (H,) = ({H},), got {tuple(window_factor.shape)}")
    dt = common.compute_dtype(q, k, v, fq, fk, window_factor)
    if state is None:
        zeros = lambda *shape: q.new_zeros(*shape, dtype=dt)  # noqa: E731
        state = LolcatsState(zeros(B, H, F, Dv), zeros(B, H, F), zeros(B, H, L, Dk), zeros(B, H, L, F),
                             zeros(B, H, L, Dv), torch.zeros(B, dtype=torch.int64, device=q.device))
    else:
        for name, shape in (("S", (B, H, F, Dv)), ("z", (B, H, F)), ("k", (B, H, L, Dk)),
                            ("fk", (B, H, L, F)), ("v", (B, H, L, Dv))):
            common.check_state_tensor(name, getattr(state, name), shape)
        check_pos(state.pos, B)
        state = LolcatsState(*(x.to(dt) for x in state[:5]), state.pos)
    return dt, L, state


def hybrid_attend(
    q: torch.Tensor, fq: torch.Tensor, keys: torch.Tensor, fkeys: torch.Tensor, values: torch.Tensor,
    q_pos: torch.Tensor, k_pos: torch.Tensor, S: torch.Tensor, z: torch.Tensor, f: torch.Tensor,
    window: int, terraced: bool, scale: float, eps: float, softcap: Optional[float] = None,
) -> torch.Tensor:
    """Queries (B, H, Tq, .) at ``q_pos (B, Tq)`` against keys (B, H, Tk, .) at ``k_pos (B, Tk)``
    and the linear state S, z of everything older than those keys; all in the compute dtype.

    Each key is a window term, a linear term or invisible (future / empty slot), by the rule.
    ``softcap`` (already validated) caps the window logits before c_t and the exp.
    """
    win, older = split_keys(q_pos, k_pos, window, terraced)
    return hybrid_combine(q, fq, keys, fkeys, values, win, older, S, z, f, scale, eps, softcap)


def split_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int,
               terraced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule: ``(win, older)``, each ``(B, 1, Tq, Tk)`` bool, for queries at ``q_pos (B, Tq)`` and
    keys at ``k_pos (B, Tk)``: window (softmax) terms, and seen keys outside the window (linear
    terms). Keys in neither are invisible (future or empty slots)."""
    win = visible(q_pos, k_pos, window, terraced)
    return win, seen(q_pos, k_pos) & ~win


def hybrid_combine(
    q: torch.Tensor, fq: torch.Tensor, keys: torch.Tensor, fkeys: torch.Tensor, values: torch.Tensor,
    win: torch.Tensor, older: torch.Tensor, S: torch.Tensor, z: torch.Tensor, f: torch.Tensor,
    scale: float, eps: float, softcap: Optional[float] = None,
) -> torch.Tensor:
    """The shared-normaliser sum, for any leading dims ``(B, H, *N)`` (``*N`` empty, or the chunk
    axis of the chunk form): q (B, H, *N, Tq, Dk), fq (B, H, *N, Tq, F), keys (B, H, *N, Tk, Dk),
    fkeys (B, H, *N, Tk, F), values (B, H, *N, Tk, Dv), win / older bool broadcasting to
    (B, H, *N, Tq, Tk) (see ``split_keys``), S (B, H, *N, F, Dv), z (B, H, *N, F), f (H,);
    returns (B, H, *N, Tq, Dv).
    """
    scores = soft_cap(q @ keys.transpose(-1, -2) * scale, softcap).masked_fill(~win, -math.inf)
    c = scores.amax(-1, keepdim=True)  # differentiable: part of the model, see the module docstring
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))  # rows with an empty window
    weights = f.view(-1, *(1,) * (scores.dim() - 2)) * torch.exp(scores - c)  # 0 outside the window
    weights = torch.where(older, fq @ fkeys.transpose(-1, -2), weights)  # older keys: the linear terms
    num = weights @ values + fq @ S
    den = weights.sum(-1, keepdim=True) + fq @ z.unsqueeze(-1)
    return common.normalize_output(num, den, eps)


def foldable(k_pos: torch.Tensor) -> torch.Tensor:
    """Which keys at ``k_pos (B, Tk)`` may fold into S, z: ``(B, Tk)`` bool. Empty slots and padding
    (negative positions) never do."""
    return k_pos >= 0


def fold_leaving(S: torch.Tensor, z: torch.Tensor, fkeys: torch.Tensor, values: torch.Tensor,
                 k_pos: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the first n of [cache ++ new] keys, which leave the cache, into S and z."""
    fk_out = fkeys[:, :, :n].masked_fill(~foldable(k_pos[:, :n])[:, None, :, None], 0.0)
    return S + fk_out.transpose(-1, -2) @ values[:, :, :n], z + fk_out.sum(2)


def lolcats_attn_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor,
    window_factor: torch.Tensor, *, window: int, terraced: bool = False, scale: Optional[float] = None,
    state: Optional[LolcatsState] = None, eps: float = 1e-6, softcap: Optional[float] = None,
) -> tuple[torch.Tensor, LolcatsState]:
    """The hybrid from the full (T, L + T) score matrices over [cache ++ input], split by the rule."""
    dt, L, state = check_inputs(q, k, v, fq, fk, window_factor, window, terraced, state)
    scale = common.softmax_scale(scale, q.shape[-1])
    softcap = check_softcap(softcap)
    T = q.shape[2]
    keys = torch.cat([state.k, k.to(dt)], dim=2)
    fkeys = torch.cat([state.fk, fk.to(dt)], dim=2)
    values = torch.cat([state.v, v.to(dt)], dim=2)
    k_pos = key_positions(state.pos, L, T)
    if T == 0:
        o = v.new_zeros(v.shape, dtype=dt)
    else:
        o = hybrid_attend(q.to(dt), fq.to(dt), keys, fkeys, values, k_pos[:, L:], k_pos, state.S, state.z,
                          window_factor.to(dt), window, terraced, scale, eps, softcap)
    S, z = fold_leaving(state.S, state.z, fkeys, values, k_pos, T)
    new_state = LolcatsState(S, z, keep_last(keys, L), keep_last(fkeys, L), keep_last(values, L),
                             state.pos + T)
    return o.to(v.dtype), new_state
