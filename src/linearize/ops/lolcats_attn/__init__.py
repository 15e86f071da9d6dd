"""LoLCATs hybrid: softmax over a sliding window plus linear attention for everything older,
under one shared normaliser.

    y_t = [sum_{s in win(t)} f e^{q_t.k_s*scale - c_t} v_s + sum_{s older} (fq_t.fk_s) v_s]
          / ([the same without v_s] + eps),        c_t = max_{s in win(t)} q_t.k_s*scale

The window is standard (the w most recent keys) or terraced (own w-block plus the previous one),
exactly as in ``window_attn``. ``softcap=c`` caps the window logits (c_t included) to
c * tanh(logit / c), as Gemma 2 does; the linear terms are unchanged. State: the linear state
S, z of keys older than the cache, plus the window cache (k, fk, v of L = w - 1 or 2w - 1 slots)
and ``pos``; it never grows with T.
Layout and shapes: see ``naive``.
"""

from .chunk import lolcats_attn_chunk
from .naive import LolcatsState, lolcats_attn_parallel
from .recurrent import lolcats_attn_recurrent

__all__ = ["LolcatsState", "lolcats_attn_chunk", "lolcats_attn_parallel", "lolcats_attn_recurrent"]
