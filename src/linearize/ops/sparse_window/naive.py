"""The sparse-window state, its checks, and the one span step every form runs (see the package).

State (``SparseWindowState``), with w the window and M the cache size:
  k (B, H, w, Dk), v (B, H, w, Dv)                    the last w pairs, positions pos - w .. pos - 1
                                                      (the window's w - 1 plus the pair leaving it)
  cache_k (B, H, M, Dk), cache_v (B, H, M, Dv)        the cached pairs, in no particular order
  cache_score (B, H, M), cache_pos (B, H, M) int64    their scores and positions (-1: an empty slot)
  pos (B,) int64                                      tokens seen (negative at left padding)
Positions below 0 are padding or before the sequence: never seen, never cached.
Every form computes in the compute dtype (fp32 at least) and returns the state's pairs (k, v, cache_k,
cache_v) in the dtypes of the inputs they are copies of (``stored``): nothing is lost, and a bf16
model's decode state is half the bytes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

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


def check_inputs(q, k, v, score, window, cache_size, sink_logits, sink_k, sink_v, state, cache_q=None, leave_k=None):
    """Validate everything; returns (compute dtype, state in the compute dtype)."""
    B, H, T, Dk, Dv = common.check_qkv(q, k, v)
    for name, x in (("cache_q", cache_q), ("leave_k", leave_k)):
        if x is not None:
            common.check_float(name, x)
            if tuple(x.shape) != tuple(q.shape):
                raise ValueError(f"{name} must have q's shape (B, H, T, Dk) = {tuple(q.shape)}, got {tuple(x.shape)}")
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


def stored(state: SparseWindowState, k: torch.Tensor, v: torch.Tensor,
           leave_k: Optional[torch.Tensor] = None) -> SparseWindowState:
    """``state`` as kept between calls: its pairs in the dtypes they came in (the window's keys in
    k's, the cached keys in ``leave_k``'s or k's, values in v's), the scores and positions as they are."""
    ck = k if leave_k is None else leave_k
    return state._replace(k=state.k.to(k.dtype), v=state.v.to(v.dtype), cache_k=state.cache_k.to(ck.dtype),
                          cache_v=state.cache_v.to(v.dtype))


def ranks(score: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``(..., N)`` permutation listing the pairs best first: by score, then newer first (a strict
    total order on distinct positions). score, pos: (..., N)."""
    newer = torch.argsort(pos, dim=-1, descending=True, stable=True)
    by_score = torch.argsort(score.gather(-1, newer), dim=-1, descending=True, stable=True)
    return newer.gather(-1, by_score)


def span_step(q, k, v, score, state: SparseWindowState, *, window: int, scale: float, sink_logits, sink_k,
              sink_v, softcap, cache_q=None, leave_k=None) -> tuple[torch.Tensor, SparseWindowState]:
    """Queries of one span (B, H, C, D), all in the compute dtype, against sinks + window + cache.

    The candidates a query of this span can see are the cached pairs and the C pairs that leave
    the window during the span (positions pos - w .. pos + C - 1 - w, the first C of the held
    pairs followed by the span's), ``score[c]`` being that of the pair leaving at query c; query t
    ranks those with position <= t - w and keeps the top M.
    ``cache_q`` (B, H, C, Dk) reads the cache instead of q, and ``leave_k[c]`` is the key the pair
    leaving at query c enters the cache with instead of its window key (both None: q and k).
    Work O(C (M + C) log(M + C) + C (M + w + C) D)."""
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
    # a candidate is a member where fewer than M visible ones rank above it: counted best first, O(C (M + C))
    order = ranks(cand_score, cand_pos)[:, :, None, :].expand_as(left)   # (B, H, C, M + C)
    seen = left.gather(-1, order)
    above = torch.cumsum(seen.to(torch.int32), -1) - seen.to(torch.int32)
    member = torch.zeros_like(left).scatter(-1, order, seen & (above < M))

    near = near.expand(B, H, C, w + C)
    if cache_q is None and leave_k is None:  # a pair leaving the window is attended with its window key
        mask = torch.cat([member[..., :M], near | F.pad(member[..., M:], (0, w))], -1)
        o = sink_softmax_attend(q, torch.cat([state.cache_k, keys], 2), torch.cat([state.cache_v, values], 2), mask,
                                scale, sink_logits, sink_k, sink_v, softcap)
        leaving = keys[:, :, :C]
    else:
        # two queries in one softmax: [q, cache_q] against [window key, 0] and [0, cache key] gives
        # each part its own dot product (sink keys, padded like window keys, see q)
        leaving = keys[:, :, :C] if leave_k is None else leave_k
        cache_q = q if cache_q is None else cache_q
        d = q.shape[-1]
        far = F.pad(torch.cat([state.cache_k, leaving], 2), (d, 0))
        keys2 = torch.cat([far, F.pad(keys, (0, d))], 2)
        values2 = torch.cat([state.cache_v, values[:, :, :C], values], 2)
        sk = None if sink_k is None else F.pad(sink_k.to(q.dtype), (0, d))
        o = sink_softmax_attend(torch.cat([q, cache_q], -1), keys2, values2, torch.cat([member, near], -1), scale,
                                sink_logits, sk, sink_v, softcap)

    # the cache after the span = the last query's members, gathered into the M slots
    last = member[:, :, -1]                                                # (B, H, M + C)
    idx = torch.argsort((~last).to(torch.int8), dim=-1, stable=True)[..., :M]
    kept = last.gather(-1, idx)
    gather = lambda x: x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))  # noqa: E731
    cand_k, cand_v = torch.cat([state.cache_k, leaving], 2), torch.cat([state.cache_v, values[:, :, :C]], 2)
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
    cache_q: Optional[torch.Tensor] = None, leave_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, SparseWindowState]:
    """The whole input as one span: O(T (M + w + T)) memory, the reference for short inputs."""
    dt, state = check_inputs(q, k, v, score, window, cache_size, sink_logits, sink_k, sink_v, state, cache_q, leave_k)
    scale, softcap = common.softmax_scale(scale, q.shape[-1]), check_softcap(softcap)
    cast = lambda x: None if x is None else x.to(dt)  # noqa: E731
    o, new = span_step(q.to(dt), k.to(dt), v.to(dt), score.to(dt), state, window=window, scale=scale,
                       sink_logits=sink_logits, sink_k=sink_k, sink_v=sink_v, softcap=softcap,
                       cache_q=cast(cache_q), leave_k=cast(leave_k))
    return o.to(v.dtype), stored(new, k, v, leave_k)
