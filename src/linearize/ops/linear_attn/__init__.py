"""Causal linear attention, normalised or not.

    S_t = S_{t-1} + k_t v_t^T            (Dk x Dv)
    z_t = z_{t-1} + k_t                  (Dk)
    o_t = q_t^T S_t  [/ (q_t^T z_t + eps) when normalised]

q and k are already feature-mapped (non-negative when normalised). Layout: see ``ops.common``.
"""

from .chunk import linear_attn_chunk
from .naive import LinearAttnState, linear_attn_parallel
from .recurrent import linear_attn_recurrent

__all__ = ["LinearAttnState", "linear_attn_chunk", "linear_attn_parallel", "linear_attn_recurrent"]
