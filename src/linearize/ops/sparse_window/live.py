"""The chunk form from a fresh state, all spans at once: each pair's stay in the cache as an interval.

From a fresh state (empty cache, the window's pairs before the start) the pair at index s
(position pos0 + s) leaves the window at query s + w with the score ``score[s + w]``. Under the
package's top-M rule it is a member at query t iff s <= t - w and fewer than M candidates s' <= t - w
rank above it. That count only grows with t, so membership is one interval per pair:

    member(t, s)  <=>  s <= t - w < j_s,   j_s = min{ j >= s : #{s' <= j ranking above s} >= M }

(j_s = s: never cached; j_s = T - w: still cached at the end). With the j_s known, query block
[t0, t0 + C) sees at most M + C - 1 live pairs (the members at t0 and those entering during the
block), so every block batches into one (B, H, T/C, C, (M + C) + (w + C)) softmax with autograd
through plain gathers and matmuls: no sequential loop and no per-span ranking. Work: the j_s are
O(T^2) comparisons (without gradients, in blocks of rows: the selection is a ranking), the blocks'
lists O(T^2 / C), the attention O(T (M + w + C) D).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..window_attn.naive import sink_softmax, soft_cap
from .naive import SparseWindowState

COMPARE_ELEMENTS = 1 << 27  # (rows x pairs x B x H) compared at once while finding the j_s


@torch.no_grad()
def cache_until(pair_score: torch.Tensor, candidate: torch.Tensor, cache_size: int) -> torch.Tensor:
    """``(B, H, P)`` int32: j_s for pairs s = 0 .. P - 1 (see the module).

    ``pair_score (B, H, P)``: pair s's score; ``candidate (B, P)`` bool: False for pairs that are
    never cached (left padding). A pair ranks above s by a larger score, ties by a larger index."""
    B, H, P = pair_score.shape
    idx = torch.arange(P, device=pair_score.device, dtype=torch.int32)
    rows = max(1, COMPARE_ELEMENTS // max(1, B * H * P))
    out = []
    for r0 in range(0, P, rows):
        r = slice(r0, min(P, r0 + rows))
        mine = pair_score[:, :, r, None]                                        # (B, H, R, 1)
        other = pair_score[:, :, None, :]                                       # (B, H, 1, P)
        above = (other > mine) | ((other == mine) & (idx > idx[r, None]))       # (B, H, R, P)
        above &= candidate[:, None, None, :]
        # the count is non-decreasing along j: the first j where it reaches M is how many stay below M
        first = (above.cumsum(-1, dtype=torch.int32) < cache_size).sum(-1, dtype=torch.int32)
        out.append(torch.maximum(first, idx[r]))
    until = torch.cat(out, -1) if out else idx.expand(B, H, 0)
    return torch.where(candidate[:, None, :], until, idx)


def pair_keys(k: torch.Tensor, leave_k: torch.Tensor | None, window: int) -> torch.Tensor:
    """``(B, H, P, Dk)``: the key each pair s < P = T - w is cached with (``leave_k`` is aligned
    with the query at which the pair leaves, s + w)."""
    P = max(k.shape[2] - window, 0)
    return k[:, :, :P] if leave_k is None else leave_k[:, :, window:]


def live_attend(q, k, v, cache_q, leave_k, until, pos0, sink_logits, sink_k, sink_v, *, window: int,
                cache_size: int, scale: float, softcap, block: int) -> torch.Tensor:
    """Every query block at once (see the module). q, k (B, H, T, Dk), v (B, H, T, Dv), cache_q and
    leave_k as the op takes them (None: q, k), until (B, H, P) the j_s, pos0 (B,) the first
    position; all floats in the compute dtype. Returns o (B, H, T, Dv)."""
    B, H, T, Dk = q.shape
    cache_q, cache_k = q if cache_q is None else cache_q, pair_keys(k, leave_k, window)
    Dv, w, C, P = v.shape[-1], window, block, cache_k.shape[2]
    nb = -(-T // C)
    Tq = nb * C
    dev = q.device
    blocks = lambda x: F.pad(x, (0, 0, 0, Tq - T)).view(B, H, nb, C, x.shape[-1])  # noqa: E731
    t = torch.arange(Tq, device=dev).view(nb, C)                                      # query indices
    first = t[:, 0]                                                                  # (nb,)

    # window: block b's queries see indices b C - w + 1 .. b C + C - 1 (w + C keys from b C - w)
    s_win = first[:, None] - w + torch.arange(w + C, device=dev)                    # (nb, w + C)
    band = lambda x: F.pad(x, (0, 0, w, Tq - T)).unfold(2, w + C, C).transpose(-1, -2)  # noqa: E731
    ok_pos = (pos0[:, None, None] + s_win >= 0) & (s_win >= 0) & (s_win < T)        # (B, nb, w + C)
    near = ((s_win[:, None, :] <= t[:, :, None]) & (s_win[:, None, :] > t[:, :, None] - w))[None] & ok_pos[:, :, None]
    win_scores = blocks(q) @ band(k).transpose(-1, -2) * scale                       # (B, H, nb, C, w + C)
    win_scores = soft_cap(win_scores, softcap).masked_fill(~near[:, None], float("-inf"))
    win_values = band(v)

    # cache: the pairs live somewhere in the block, at most M + C - 1, gathered block by block
    K = min(cache_size + C - 1, P)
    s = torch.arange(P, device=dev)
    alive = ((s <= first[:, None] + C - 1 - w)[None, None] & (until[:, :, None, :] > first[:, None] - w)
             & (s < until)[:, :, None, :])                                          # (B, H, nb, P)
    pick = torch.argsort((~alive).to(torch.int8), dim=-1, stable=True)[..., :K]     # live ones first
    live = alive.gather(-1, pick)
    # by indexing: its backward adds into (B, H, P, D), where a gather from an expanded view would
    # fill (B, H, nb, P, D) and sum it
    rows = torch.arange(B, device=dev)[:, None, None, None], torch.arange(H, device=dev)[None, :, None, None]
    gather = lambda x: x[rows[0], rows[1], pick]  # noqa: E731
    pair_until = gather(until)                                                       # (B, H, nb, K)
    tw = t[None, None, :, :, None] - w                                              # (1, 1, nb, C, 1)
    member = live[..., None, :] & (pick[..., None, :] <= tw) & (tw < pair_until[..., None, :])
    cache_scores = blocks(cache_q) @ gather(cache_k).transpose(-1, -2) * scale      # (B, H, nb, C, K)
    cache_scores = soft_cap(cache_scores, softcap).masked_fill(~member, float("-inf"))

    scores = torch.cat([cache_scores, win_scores], -1)
    values = torch.cat([gather(v[:, :, :P]), win_values], -2)
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
