"""The sparse-window state, its checks, and the one span step every form runs (see the package).

State (``SparseWindowState``), with w the window and M the cache size:
  k (B, H, w, Dk), v (B, H, w, Dv)                    the last w pairs, positions pos - w .. pos - 1
                                                      (the window's w - 1 plus the pair leaving it)
  cache_k (B, H, M, Dk), cache_v (B, H, M, Dv)        the cached pairs, in no particular order
  cache_score (B, H, M), cache_pos (B, H, M) int64    their scores and positions (-1: an empty slot)
  pos (B,) int64                                      tokens seen (negative at left padding)
Positions below 0 are padding or before the sequence: never seen, never cached.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import common
from ..window_attn.naive import check_sinks, check_softcap, sink_softmax_attend, visible


class SparseWindowState(NamedTuple):
    k: torch.Tensor
    v: torch.Tensor
    cache_k: torch.Tensor
    cache_v: torch.Tensor
    cache_score: torch.Tensor
    cache_pos: torch.Tensor
    pos: torch.Tensor


def fresh_state(B: int, H: int, Dk: int, Dv: int, window: int, cache_size: int, *, dtype: torch.dtype,
                device=None, pos: Optional[torch.Tensor] = None) -> SparseWindowState:
    """An empty state; ``pos`` (B,) int64 starts each row at minus its left padding (default 0)."""
    common.check_positive_int("window", window)
    common.check_positive_int("cache_size", cache_size)
    z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    if pos is None:
        pos = torch.zeros(B, dtype=torch.int64, device=device)
    return SparseWindowState(z(B, H, window, Dk), z(B, H, window, Dv), z(B, H, cache_size, Dk), z(B, H, cache_size, Dv), z(B, H, cache_size),
                             torch.full((B, H, cache_size), -1, dtype=torch.int64, device=device), pos)


def check_inputs(q, k, v, score, window, cache_size, sink_logits, sink_k, sink_v, state):
    """Validate everything; returns (compute dtype, state in the compute dtype)."""
    B, H, T, Dk, Dv = common.check_qkv(q, k, v)
    common.check_positive_int("window", window)
    common.check_positive_int("cache_size", cache_size)
    common.check_float("score", score)
    if tuple(score.shape) != (B, H, T):
        raise ValueError(f"score must have shape (B, H, T) = {(B, H, T)}, got {tuple(score.shape)}")
    check_sinks(H, Dk, Dv, sink_logits, sink_k, sink_v)
    sinks = [x for x in (sink_logits, sink_k, sink_v) if x is not None]
    dt = common.compute_dtype(q, k, v, *sinks)
    if state is None:
        return dt, fresh_state(B, H, Dk, Dv, window, cache_size, dtype=dt, device=q.device)
    if not isinstance(state, SparseWindowState):
        raise ValueError(f"state must be a SparseWindowState or None, got {type(state).__name__}")
    w, M = window, cache_size
    shapes = {"k": (B, H, w, Dk), "v": (B, H, w, Dv), "cache_k": (B, H, M, Dk),
              "cache_v": (B, H, M, Dv), "cache_score": (B, H, M), "cache_pos": (B, H, M), "pos": (B,)}
    for name, shape in shapes.items():
        common.check_state_tensor(name, getattr(state, name), shape)
    for name in ("cache_pos", "pos"):
        if getattr(state, name).dtype != torch.int64:
            raise ValueError(f"state.{name} must have dtype torch.int64, got {getattr(state, name).dtype}")
    fl = lambda x: x.to(dt)  # noqa: E731
    return dt, SparseWindowState(fl(state.k), fl(state.v), fl(state.cache_k), fl(state.cache_v),
                                 fl(state.cache_score), state.cache_pos, state.pos)


def beats(score: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``(..., N, N)`` bool: pair i ranks above pair j, by score and then by position (newer first).
    score, pos: (..., N). A strict total order on distinct positions."""
    si, sj = score[..., :, None], score[..., None, :]
    return (si > sj) | ((si == sj) & (pos[..., :, None] > pos[..., None, :]))


def span_step(q, k, v, score, state: SparseWindowState, *, window: int, scale: float, sink_logits, sink_k,
              sink_v, softcap) -> tuple[torch.Tensor, SparseWindowState]:
    """Queries of one span (B, H, C, D), all in the compute dtype, against sinks + window + cache.

    The candidates a query of this span can see are the cached pairs and the C pairs that leave
    the window during the span (positions pos - w .. pos + C - 1 - w, the first C of the held
    pairs followed by the span's), ``score[c]`` being that of the pair leaving at query c; query t
    ranks those with position <= t - w and keeps the top M.
    Work O(C (M + C)^2 + C (M + w + C) D)."""
    B, H, C, _ = q.shape
    w, M = window, state.cache_k.shape[2]
    keys = torch.cat([state.k, k], 2)                       # (B, H, w + C, Dk), positions pos - w ..
    values = torch.cat([state.v, v], 2)
    k_pos = state.pos[:, None] + torch.arange(-w, C, device=q.device)     # (B, w + C)
    q_pos = k_pos[:, w:]                                                   # (B, C)
    near = visible(q_pos, k_pos, w, False)                                 # (B, 1, C, w + C)

    new_pos = k_pos[:, None, :C].expand(B, H, C)
    cand_pos = torch.cat([state.cache_pos, new_pos], 2)                    # (B, H, M + C)
    cand_score = torch.cat([state.cache_score, score], 2)
    left = (cand_pos[:, :, None, :] >= 0) & (cand_pos[:, :, None, :] <= q_pos[:, None, :, None] - w)
    above = left.to(q.dtype) @ beats(cand_score, cand_pos).to(q.dtype)     # (B, H, C, M + C): how many rank above
    member = left & (above < M)

    mask = torch.cat([member[..., :M], near.expand(B, H, C, w + C)
                      | torch.nn.functional.pad(member[..., M:], (0, w))], -1)
    o = sink_softmax_attend(q, torch.cat([state.cache_k, keys], 2), torch.cat([state.cache_v, values], 2), mask,
                            scale, sink_logits, sink_k, sink_v, softcap)

    # the cache after the span = the last query's members, gathered into the M slots
    last = member[:, :, -1]                                                # (B, H, M + C)
    idx = torch.argsort((~last).to(torch.int8), dim=-1, stable=True)[..., :M]
    kept = last.gather(-1, idx)
    gather = lambda x: x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))  # noqa: E731
    cand_k, cand_v = torch.cat([state.cache_k, keys[:, :, :C]], 2), torch.cat([state.cache_v, values[:, :, :C]], 2)
    new = SparseWindowState(
        keys[:, :, C:], values[:, :, C:],
        gather(cand_k) * kept[..., None], gather(cand_v) * kept[..., None],
        cand_score.gather(-1, idx) * kept, torch.where(kept, cand_pos.gather(-1, idx), -1), state.pos + C)
    return o, new


def sparse_window_attn_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score: torch.Tensor, *, window: int, cache_size: int,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[SparseWindowState] = None, softcap: Optional[float] = None,
) -> tuple[torch.Tensor, SparseWindowState]:
    """The whole input as one span: O(T (M + T)^2) work, the reference for short inputs."""
    dt, state = check_inputs(q, k, v, score, window, cache_size, sink_logits, sink_k, sink_v, state)
    scale, softcap = common.softmax_scale(scale, q.shape[-1]), check_softcap(softcap)
    o, state = span_step(q.to(dt), k.to(dt), v.to(dt), score.to(dt), state, window=window, scale=scale,
                         sink_logits=sink_logits, sink_k=sink_k, sink_v=sink_v, softcap=softcap)
    return o.to(v.dtype), state
