"""Sliding-window softmax attention with sinks (Lizard's anchor window).

Query t (absolute position) sees key s iff s <= t and, for window w,
    standard:  t - w < s                    (the w most recent keys, itself included)
    terraced:  s // w >= t // w - 1         (its own w-block up to t plus the previous block)

    o_t = [sum_{s visible} e^{q_t.k_s*scale} v_s + sum_j e^{q_t.sk_j*scale} sv_j]
          / [sum_{s visible} e^{q_t.k_s*scale} + sum_j e^{q_t.sk_j*scale} + sum_j e^{t_j}]

v1 sinks ``sink_k (H, m, Dk)``, ``sink_v (H, m, Dv)``: key/value vectors every query attends to.
v2 sinks ``sink_logits (H, m)``: logits t_j with zero values (denominator only). Either, both or
none. ``softcap=c`` caps every query-key logit (window and sink keys, not sink logits) to
c * tanh(logit / c), as Gemma 2 does; None leaves them alone. The state is the last L = w - 1
(standard) or 2w - 1 (terraced) keys/values plus ``pos``, so it never grows with T.
Layout: see ``ops.common`` and ``naive``.
"""

from .chunk import window_attn_chunk
from .naive import WindowState, cache_len, check_softcap, soft_cap, visible, window_attn_parallel
from .recurrent import window_attn_recurrent

__all__ = ["WindowState", "cache_len", "check_softcap", "soft_cap", "visible", "window_attn_chunk",
           "window_attn_parallel", "window_attn_recurrent"]
