"""Sliding-window softmax with sinks plus a bounded sparse cache of exact key/value pairs (LoLA).

Every pair gets a score when it leaves the window (query t no longer sees s = t - w), given by
the caller with query t: how badly the layer's linear memory recalls it then (``HybridAttention``
passes ||v_s - read(S_t, phi(k_s))||, LoLA's self-recall error against the state at that step,
by default divided by ||v_s||).
From then on it is a candidate for the cache. Query t attends, in one softmax with the window and
the sinks,

    cache(t) = the M candidates s <= t - w with the largest (score_s, s)   (ties: the newer pair)

so the cache is the top M of a set that only grows, under a fixed total order (a score, once
given, is never revised: LoLA rescores its cache at every step, a sequential rule). That makes the
rule causal and order-free: top-M(all candidates) = top-M(top-M(earlier ones) + newer ones), so a
pair that drops out never returns, the state needs only the M kept pairs, and every span length
(parallel, chunk, one token) selects the same pairs. Memory is constant: the last w pairs (the
window plus the pair leaving it) and the M cached pairs with their scores and positions.

    o_t = [sum_{s in win(t) + cache(t)} e^{q_t.k_s*scale} v_s + sum_j e^{q_t.sk_j*scale} sv_j]
          / [the same without values + sum_j e^{t_j}]

A pair may be read from the cache with other vectors than in the window: ``cache_q`` (B, H, T, Dk)
reads the cache instead of q, and ``leave_k`` (B, H, T, Dk), aligned like the score, is the key the
pair leaving at query t is cached with (the layer passes q rotated to a fixed RoPE distance and
the key without RoPE, so a cached pair reads the same however far back it is).

Layout as ``window_attn``: q, k (B, H, T, Dk), v (B, H, T, Dv), score (B, H, T) with score[t] that
of the pair leaving at query t (position t - w; ignored where that is before the start); sinks, scale
and soft-cap as there (``window_attn.sink_softmax_attend`` does the softmax). Cache selection is
per head (each head has its own memory, so its own scores).
"""

from .chunk import sparse_window_attn_chunk
from .naive import SparseWindowState, fresh_state, sparse_window_attn_parallel
from .recurrent import sparse_window_attn_recurrent

__all__ = ["SparseWindowState", "fresh_state", "sparse_window_attn_chunk", "sparse_window_attn_parallel",
           "sparse_window_attn_recurrent"]
