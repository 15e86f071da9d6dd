"""Window geometry, window state, the sink softmax, and the parallel (quadratic) reference.

Shapes: ``q, k: (B, H, T, Dk)``, ``v: (B, H, T, Dv)``, ``sink_logits: (H, m)``,
``sink_k: (H, m, Dk)``, ``sink_v: (H, m, Dv)``, output ``(B, H, T, Dv)``.

Soft-capping (Gemma 2's ``attn_logit_softcapping``): with ``softcap = c`` every query-key logit
becomes ``c * tanh(q.k*scale / c)`` after scaling and before masking and the softmax; this holds
for the window keys and for v1 sink keys (``q.sk_j*scale`` is a query-key logit too), but not
for the v2 sink logits t_j, which are learned values. ``softcap=None`` leaves the logits as
they are (bit for bit the uncapped computation).

Positions are absolute: ``state.pos (B,)`` counts the tokens seen before the input, so input
token i of batch row b sits at ``pos[b] + i``. The state caches the last ``L`` keys/values before
the input, at positions ``pos - L .. pos - 1``; a slot at a negative position is empty and never
visible. A fresh state is therefore zeros with ``pos = 0``, and a caller may start a row at a
negative ``pos`` so that its left padding lands on negative positions and is never seen.

The geometry here (``cache_len``, ``seen``, ``visible``, ``key_positions``, ``keep_last``) is
shared with ``lolcats_attn``: one definition of which keys a query sees.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import common


class WindowState(NamedTuple):
    """k: (B, H, L, Dk), v: (B, H, L, Dv) = the last L keys/values; pos: (B,) int64 = tokens seen."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor


# ----------------------------------------------------------------------------- geometry


def check_window(window: object, terraced: object) -> int:
    """Validate the window settings; returns the cache length L."""
    common.check_positive_int("window", window)
    if not isinstance(terraced, bool):
        raise ValueError(f"terraced must be a bool, got {terraced!r}")
    return cache_len(window, terraced)


def cache_len(window: int, terraced: bool) -> int:
    """Keys a query can see besides those of the current input, i.e. the cache length.

    Standard: the w - 1 keys before the query. Terraced: the query's own block up to itself
    plus the whole previous block, at most 2w - 1 keys before it (at the block's last query).
    """
    return 2 * window - 1 if terraced else window - 1


def seen(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Keys at or before each query that are not empty slots (padding): ``(B, 1, Tq, Tk)`` bool."""
    s = k_pos[:, None, None, :]
    return (s <= q_pos[:, None, :, None]) & (s >= 0)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, terraced: bool) -> torch.Tensor:
    """Which keys each query sees in its softmax window: ``(B, 1, Tq, Tk)`` bool.

    ``q_pos (B, Tq)`` and ``k_pos (B, Tk)`` are absolute positions. Key s is visible to query t
    iff 0 <= s <= t and, standard: t - w < s; terraced: s // w >= t // w - 1.
    """
    t = q_pos[:, None, :, None]
    s = k_pos[:, None, None, :]
    if terraced:
        # floor division, so negative positions (padding) fall into their own negative blocks
        near = torch.div(s, window, rounding_mode="floor") >= torch.div(t, window, rounding_mode="floor") - 1
    else:
        near = s > t - window
    return near & seen(q_pos, k_pos)


def key_positions(pos: torch.Tensor, L: int, n: int) -> torch.Tensor:
    """Positions ``(B, L + n)`` of [L cache slots ++ n new keys]: ``pos - L .. pos + n - 1``."""
    return pos[:, None] + torch.arange(-L, n, device=pos.device)


def keep_last(x: torch.Tensor, L: int) -> torch.Tensor:
    """The last L entries along time (dim 2); spelled out because ``x[:, :, -0:]`` is all of x."""
    return x[:, :, x.shape[2] - L:]


def check_softcap(softcap: object) -> Optional[float]:
    """None, or a positive finite number (returned as a float)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
            math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    return float(softcap)


def soft_cap(scores: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)``; the scores themselves when ``softcap`` is None."""
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def check_pos(pos: object, B: int) -> None:
    common.check_state_tensor("pos", pos, (B,))
    if pos.dtype != torch.int64:
        raise ValueError(f"state.pos must have dtype torch.int64, got {pos.dtype}")


# ----------------------------------------------------------------------------- inputs


def check_sinks(
    H: int, Dk: int, Dv: int, sink_logits: Optional[torch.Tensor],
    sink_k: Optional[torch.Tensor], sink_v: Optional[torch.Tensor],
) -> None:
    if sink_logits is not None:
        common.check_float("sink_logits", sink_logits)
        if sink_logits.dim() != 2 or sink_logits.shape[0] != H:
            raise ValueError(f"sink_logits must have shape (H, m) = ({H}, m), got {tuple(sink_logits.shape)}")
    if (sink_k is None) != (sink_v is None):
        raise ValueError("sink_k and sink_v must be given together (or neither), "
                         f"got sink_k={'None' if sink_k is None else 'a tensor'}, "
                         f"sink_v={'None' if sink_v is None else 'a tensor'}")
    if sink_k is not None:
        common.check_float("sink_k", sink_k)
        common.check_float("sink_v", sink_v)
        if sink_k.dim() != 3 or sink_k.shape[0] != H or sink_k.shape[2] != Dk:
            raise ValueError(f"sink_k must have shape (H, m, Dk) = ({H}, m, {Dk}), got {tuple(sink_k.shape)}")
        if tuple(sink_v.shape) != (H, sink_k.shape[1], Dv):
            raise ValueError(f"sink_v must have shape (H, m, Dv) = ({H}, {sink_k.shape[1]}, {Dv}), "
                             f"got {tuple(sink_v.shape)}")


def check_inputs(q, k, v, window, terraced, sink_logits, sink_k, sink_v, state: Optional[WindowState]):
    """Validate everything; returns (compute dtype, cache length L, state in the compute dtype)."""
    B, H, T, Dk, Dv = common.check_qkv(q, k, v)
    L = check_window(window, terraced)
    check_sinks(H, Dk, Dv, sink_logits, sink_k, sink_v)
    sinks = [x for x in (sink_logits, sink_k, sink_v) if x is not None]
    dt = common.compute_dtype(q, k, v, *sinks)
    if state is None:
        state = WindowState(q.new_zeros(B, H, L, Dk, dtype=dt), q.new_zeros(B, H, L, Dv, dtype=dt),
                            torch.zeros(B, dtype=torch.int64, device=q.device))
    else:
        common.check_state_tensor("k", state.k, (B, H, L, Dk))
        common.check_state_tensor("v", state.v, (B, H, L, Dv))
        check_pos(state.pos, B)
        state = WindowState(state.k.to(dt), state.v.to(dt), state.pos)
    return dt, L, state


# ----------------------------------------------------------------------------- the math


def sink_softmax_attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
    sink_logits: Optional[torch.Tensor], sink_k: Optional[torch.Tensor], sink_v: Optional[torch.Tensor],
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """softmax over [sink logits, sink-key scores, visible window scores] applied to [0, sink_v, v].

    q (B, H, Tq, Dk), keys (B, H, Tk, Dk), values (B, H, Tk, Dv), mask (B, 1, Tq, Tk); all in
    the compute dtype. A query that sees nothing (a padding position, without sinks) gets 0.
    ``softcap`` (already validated) caps the window and sink-key scores, not the sink logits.
    """
    scores = soft_cap(q @ keys.transpose(-1, -2) * scale, softcap).masked_fill(~mask, -math.inf)
    return sink_softmax(scores, values, q, scale, sink_logits, sink_k, sink_v, softcap)


def sink_softmax(
    scores: torch.Tensor, values: torch.Tensor, q: torch.Tensor, scale: float,
    sink_logits: Optional[torch.Tensor], sink_k: Optional[torch.Tensor], sink_v: Optional[torch.Tensor],
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """``sink_softmax_attend`` from the scores: ``scores (B, H, ..., Tq, Tk)`` already scaled, capped
    and masked (-inf), ``values (B, H, ..., Tk, Dv)``, ``q (B, H, ..., Tq, Dk)`` for the sink keys;
    any number of batch dimensions after the heads."""
    dt = q.dtype
    H, extra = q.shape[1], q.dim() - 4  # dims between the heads and the queries
    kv_sinks = sink_k is not None and sink_k.shape[1] > 0
    logit_sinks = sink_logits is not None and sink_logits.shape[1] > 0
    # The stabiliser cancels out of the softmax, so no gradient needs to flow through it; it
    # includes the sinks so that a large sink logit cannot overflow the denominator.
    c = scores.detach().amax(-1, keepdim=True)
    if kv_sinks:
        # (B, H, ..., Tq, m), no positions; query-key logits, so capped like the window's
        per_head = lambda x: x.to(dt).view(H, *([1] * extra), *x.shape[1:])  # noqa: E731
        sink_scores = soft_cap(q @ per_head(sink_k).transpose(-1, -2) * scale, softcap)
        c = torch.maximum(c, sink_scores.detach().amax(-1, keepdim=True))
    if logit_sinks:
        logits = sink_logits.to(dt).view(1, H, *([1] * extra), 1, -1)  # (1, H, ..., 1, m)
        c = torch.maximum(c, logits.detach().amax(-1, keepdim=True))
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))  # rows that see nothing
    p = torch.exp(scores - c)
    num, den = p @ values, p.sum(-1, keepdim=True)
    if kv_sinks:
        ps = torch.exp(sink_scores - c)
        num = num + ps @ per_head(sink_v)
        den = den + ps.sum(-1, keepdim=True)
    if logit_sinks:
        den = den + torch.exp(logits - c).sum(-1, keepdim=True)  # zero values: denominator only
    return num / torch.where(den > 0, den, torch.ones_like(den))


def window_attn_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, terraced: bool = False,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[WindowState] = None, softcap: Optional[float] = None,
) -> tuple[torch.Tensor, WindowState]:
    """Sliding-window softmax with sinks, from the full masked (T, L + T) score matrix.

    o_t = [sum_{s visible} e^{q_t.k_s*scale} v_s + sum_j e^{q_t.sk_j*scale} sv_j]
          / [the same without values + sum_j e^{t_j}]
    with v1 sinks (sk_j, sv_j) = (sink_k, sink_v) and v2 sink logits t_j = sink_logits; with
    ``softcap`` c each q.k*scale above reads c * tanh(q.k*scale / c).
    """
    dt, L, state = check_inputs(q, k, v, window, terraced, sink_logits, sink_k, sink_v, state)
    scale = common.softmax_scale(scale, q.shape[-1])
    softcap = check_softcap(softcap)
    T = q.shape[2]
    keys = torch.cat([state.k, k.to(dt)], dim=2)
    values = torch.cat([state.v, v.to(dt)], dim=2)
    k_pos = key_positions(state.pos, L, T)
    mask = visible(k_pos[:, L:], k_pos, window, terraced)
    if T == 0:
        o = v.new_zeros(v.shape, dtype=dt)
    else:
        o = sink_softmax_attend(q.to(dt), keys, values, mask, scale, sink_logits, sink_k, sink_v, softcap)
    new_state = WindowState(keep_last(keys, L), keep_last(values, L), state.pos + T)
    return o.to(v.dtype), new_state
