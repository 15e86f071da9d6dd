"""The chunk form from a fresh state, all spans at once: each pair's stay in the cache as an interval.

From a fresh state (empty cache, the window's pairs before the start) the pair at index s
(position pos0 + s) leaves the window at query s + w with the score ``score[s + w]``. Under the
package's top-M rule it is a member at query t iff s <= t - w and fewer than M candidates s' <= t - w
rank above it. That count only grows with t, so membership is one interval per pair:

    member(t, s)  <=>  s <= t - w < j_s,   j_s = min{ j >= s : #{s' <= j ranking above s} >= M }

(j_s = s: never cached; j_s = T - w: still cached at the end). With the j_s known, query block
[t0, t0 + C) sees at most M + C live pairs (at most M cached before t0, and the C that leave the
window during the block), so every block batches into one (B, H, T/C, C, (M + C) + (w + C)) softmax
with autograd through plain gathers and matmuls: no sequential loop and no per-span ranking. Work:
the j_s a scan of O(T (M + 256)) comparisons of ranks (without gradients: the selection is a
ranking), the blocks' lists O(T^2 / C) comparisons in bounded memory, the attention O(T (M + w + C) D).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import common
from ..window_attn.naive import sink_softmax, soft_cap
from .naive import SparseWindowState

SCAN_BLOCK = 256  # pairs a step of ``cache_until``'s scan
SLOT_ENTRIES = 1 << 26  # (block, pair) comparisons ``old_slots`` holds at once
NEVER = -(1 << 30)  # the j_s of a pair that is not there (padding of a band): t - w < NEVER for no t


@torch.no_grad()
def pair_ranks(pair_score: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """``(B, H, P)`` int32: each pair's rank, 0 the best (ties: the newer pair); a pair that is no
    candidate ranks P (after every candidate), so that "s' ranks above s" is one comparison of ranks."""
    B, H, P = pair_score.shape
    idx = torch.arange(P, device=pair_score.device)
    newer = idx.flip(0).expand(B, H, P)
    order = newer.gather(-1, torch.argsort(pair_score.gather(-1, newer), dim=-1, descending=True, stable=True))
    rank = torch.empty_like(order).scatter_(-1, order, idx.expand(B, H, P))
    # in int32: the (B, H, M + K, K) counts of the scan are its largest tensors
    return torch.where(candidate[:, None, :], rank, P).int()


@torch.no_grad()
def cache_until(pair_score: torch.Tensor, candidate: torch.Tensor, cache_size: int) -> torch.Tensor:
    """``(B, H, P)`` int32: j_s for pairs s = 0 .. P - 1 (see the module).

    ``pair_score (B, H, P)``: pair s's score; ``candidate (B, P)`` bool: False for pairs that are
    never cached (left padding). A pair ranks above s by a larger score, ties by a larger index.

    A scan over blocks of pairs, carrying the M best pairs so far (the cache): a pair ranked above
    a member is a member too, so a member's count of pairs above it is counted within the cache, and
    a new pair's up to M the same way; within the block the counts grow pair by pair. O(P (M + K))
    comparisons for blocks of K pairs, none of them kept for a gradient."""
    B, H, P = pair_score.shape
    M, dev = cache_size, pair_score.device
    idx = torch.arange(P, device=dev)
    rank = pair_ranks(pair_score, candidate)
    until = torch.full((B, H, P + 1), P, dtype=torch.long, device=dev)  # slot P: where empty slots write
    kept_rank = torch.full((B, H, M), P + 1, dtype=torch.int32, device=dev)  # empty: below every pair
    kept_idx = torch.full((B, H, M), P, dtype=torch.long, device=dev)
    for p0, p1 in common.chunk_spans(P, SCAN_BLOCK):  # the one sequential loop: ceil(P / 256) steps
        pairs = idx[p0:p1]
        ranks = torch.cat([kept_rank, rank[:, :, pairs]], -1)                      # (B, H, M + K)
        who = torch.cat([kept_idx, pairs.expand(B, H, -1)], -1)
        before = (kept_rank[:, :, None, :] < ranks[..., None]).sum(-1, keepdim=True, dtype=torch.int32)  # above
        count = before + (rank[:, :, None, pairs] < ranks[..., None]).cumsum(-1, dtype=torch.int32)  # through j
        out = (count >= M) & (pairs >= who[..., None])                             # out of the cache at j
        first = torch.where(out.any(-1), pairs[out.to(torch.int8).argmax(-1)], P)
        until.scatter_(-1, who, torch.where(first < P, first, until.gather(-1, who)))
        kept_rank, pick = ranks.topk(M, dim=-1, largest=False, sorted=False)
        kept_idx = who.gather(-1, pick)
    until = until[..., :P].to(torch.int32)
    return torch.where(candidate[:, None, :], until, idx.to(torch.int32))


def pair_keys(k: torch.Tensor, leave_k: torch.Tensor | None, window: int) -> torch.Tensor:
    """``(B, H, P, Dk)``: the key each pair s < P = T - w is cached with (``leave_k`` is aligned
    with the query at which the pair leaves, s + w)."""
    P = max(k.shape[2] - window, 0)
    return k[:, :, :P] if leave_k is None else leave_k[:, :, window:]


@torch.no_grad()
def old_slots(until: torch.Tensor, T: int, window: int, cache_size: int, block: int) -> torch.Tensor:
    """``(B, H, ceil(T / block), M)`` int64: for each query block b, the pairs s < b C - w still cached
    at its first query (j_s > b C - w; at most M), in position order, then P (an empty slot). They are
    compacted by counting (a pair's slot is how many such pairs come before it), the rest thrown into
    a spare slot: no sort. Blocks are taken in groups of at most ``SLOT_ENTRIES`` (block, pair)
    comparisons, so memory stays O(T M / C + SLOT_ENTRIES) at any length (the comparisons, T^2 / C,
    are cheap beside the attention)."""
    B, H, P = until.shape
    w, M, C, dev = window, cache_size, block, until.device
    nb = -(-T // C)
    pick = torch.full((B, H, nb, M + 1), P, dtype=torch.long, device=dev)
    group = max(1, SLOT_ENTRIES // max(1, B * H * P))
    for b0 in range(0, nb, group):
        b1 = min(nb, b0 + group)
        first = torch.arange(b0, b1, device=dev) * C
        n = min(P, max(0, (b1 - 1) * C - w))  # only pairs before the group's last block start can be old
        s = torch.arange(n, device=dev)
        old = (s < first[:, None] - w)[None, None] & (until[:, :, None, :n] > first[:, None] - w)  # (B, H, g, n)
        slot = torch.where(old, old.cumsum(-1, dtype=torch.int32) - 1, M).long()
        pick[:, :, b0:b1].scatter_(-1, slot, s.expand(B, H, b1 - b0, n))
    return pick[..., :M]


def live_attend(q, k, v, cache_q, leave_k, until, pos0, sink_logits, sink_k, sink_v, *, window: int,
                cache_size: int, scale: float, softcap, block: int) -> torch.Tensor:
    """Every query block at once (see the module). q, k (B, H, T, Dk), v (B, H, T, Dv), cache_q and
    leave_k as the op takes them (None: q, k), until (B, H, P) the j_s, pos0 (B,) the first
    position; all floats in the compute dtype. Returns o (B, H, T, Dv).

    Block b (queries t0 = b C .. t0 + C - 1) attends, in one softmax with the sinks:
      old     the pairs s < t0 - w still cached at t0 (at most M: compacted into M slots)
      new     the pairs t0 - w .. t0 - w + C - 1, which leave the window during the block (a band)
      window  the keys t0 - w .. t0 + C - 1 (a band)"""
    B, H, T, Dk = q.shape
    cache_q, cache_k = q if cache_q is None else cache_q, pair_keys(k, leave_k, window)
    Dv, w, C, P, M = v.shape[-1], window, block, cache_k.shape[2], cache_size
    nb = -(-T // C)
    Tq = nb * C
    dev = q.device
    blocks = lambda x: F.pad(x, (0, 0, 0, Tq - T)).view(B, H, nb, C, x.shape[-1])  # noqa: E731
    t = torch.arange(Tq, device=dev).view(nb, C)                                      # query indices
    first = t[:, 0]                                                                  # (nb,)
    tw = t[None, None, :, :, None] - w                                               # (1, 1, nb, C, 1)

    def band(x: torch.Tensor, front: int, size: int, fill=0) -> torch.Tensor:
        """(B, H, nb, size, ...): x's rows b C - front .. b C - front + size - 1 (``fill`` outside)."""
        lead = x.new_full((*x.shape[:2], front, *x.shape[3:]), fill)
        tail = x.new_full((*x.shape[:2], max(0, Tq + size - C - front - x.shape[2]), *x.shape[3:]), fill)
        rows = torch.cat([lead, x, tail], 2).unfold(2, size, C)[:, :, :nb]         # (B, H, nb, ..., size)
        return rows.movedim(-1, 3)

    # window: query t sees t - w < s <= t, at positions >= 0
    s_win = first[:, None] - w + torch.arange(w + C, device=dev)                    # (nb, w + C)
    ok_pos = (pos0[:, None, None] + s_win >= 0) & (s_win >= 0) & (s_win < T)        # (B, nb, w + C)
    near = ((s_win[:, None, :] <= t[:, :, None]) & (s_win[:, None, :] > t[:, :, None] - w))[None] & ok_pos[:, :, None]
    win_scores = blocks(q) @ band(k, w, w + C).transpose(-1, -2) * scale             # (B, H, nb, C, w + C)
    win_scores = soft_cap(win_scores, softcap).masked_fill(~near[:, None], float("-inf"))

    # new: pair s is cached at t while s <= t - w < j_s
    s_new = (first[:, None] - w + torch.arange(C, device=dev))[None, None, :, None, :]  # (1, 1, nb, 1, C)
    new_until = band(until, w, C, NEVER)[..., None, :]                               # (B, H, nb, 1, C)
    new_member = (s_new <= tw) & (tw < new_until)
    new_scores = blocks(cache_q) @ band(cache_k, w, C).transpose(-1, -2) * scale    # (B, H, nb, C, C)

    # old: the pairs cached before the block, in M slots
    pick = old_slots(until, T, w, M, C).reshape(B, H, nb * M)
    gather = lambda x, fill=0: F.pad(x, (0, 0, 0, 1), value=fill).gather(  # noqa: E731
        2, pick[..., None].expand(-1, -1, -1, x.shape[-1])).view(B, H, nb, M, x.shape[-1])
    old_until = gather(until[..., None], NEVER)[..., 0][..., None, :]              # (B, H, nb, 1, M)
    old_scores = blocks(cache_q) @ gather(cache_k).transpose(-1, -2) * scale        # (B, H, nb, C, M)

    cache_scores = soft_cap(torch.cat([old_scores, new_scores], -1), softcap)
    cache_scores = cache_scores.masked_fill(~torch.cat([(tw < old_until).expand(-1, -1, -1, C, -1), new_member.expand(
        B, H, -1, C, -1)], -1), float("-inf"))
    scores = torch.cat([cache_scores, win_scores], -1)
    values = torch.cat([gather(v[:, :, :P]), band(v[:, :, :P], w, C), band(v, w, w + C)], -2)
    o = sink_softmax(scores, values, blocks(q), scale, sink_logits, sink_k, sink_v, softcap)
    return o.reshape(B, H, Tq, Dv)[:, :, :T]


def final_state(k, v, cache_k, score, until, state: SparseWindowState, window: int) -> SparseWindowState:
    """The state after the input, as the span step leaves it: the last w pairs, and the pairs
    still cached at the last query in position order, then empty slots. ``state`` is fresh."""
    B, H, T, _ = k.shape
    M, P = state.cache_k.shape[2], cache_k.shape[2]
    # live at query T - 1 (t - w = P - 1 < j_s), then M empty stand-ins, so that M slots always fill
    member = F.pad(until == P, (0, M))
    idx = torch.argsort((~member).to(torch.int8), dim=-1, stable=True)[..., :M]        # (B, H, M)
    kept = member.gather(-1, idx)
    rows = torch.arange(B, device=k.device)[:, None, None], torch.arange(H, device=k.device)[None, :, None]
    # indexing keeps only the indices for backward (a gather would keep its whole input)
    take = lambda x: F.pad(x, (0, 0, 0, M))[rows[0], rows[1], idx] * kept[..., None]  # noqa: E731
    pair_pos = (state.pos[:, None] + torch.arange(P + M, device=k.device))[:, None].expand(B, H, P + M)
    keys, values = torch.cat([state.k, k], 2), torch.cat([state.v, v], 2)
    return SparseWindowState(
        keys[:, :, -window:], values[:, :, -window:], take(cache_k), take(v[:, :, :P]),
        F.pad(score[:, :, window:], (0, M)).gather(-1, idx) * kept,
        torch.where(kept, pair_pos.gather(-1, idx), -1), state.pos + T)
