"""Causal gated linear attention (GLA), Lizard's form, normalised or not.

    S_t = γ_t ⊙ S_{t-1} + k_t v_t^T       (Dk x Dv; a per-channel γ scales row f)
    z_t = γ_t ⊙ z_{t-1} + k_t             (Dk)
    o_t = q_t^T S_t  [/ (q_t^T z_t + eps) when normalised]

so key s reaches query t with weight Π_{l=s+1..t} γ_l = exp(b_t - b_s), b = cumsum(log γ).
Gates come in log space, ``log_g = log γ <= 0``, one per head ``(B, H, T)`` or one per channel
``(B, H, T, Dk)``. q and k are features, given either as they are or, with
``log_space_features=True``, as log-features (the feature is exp(q), exp(k); -inf means a zero
feature). Layout: see ``ops.common``.
"""

from .chunk import gla_chunk
from .naive import GLAState, gla_parallel
from .recurrent import gla_recurrent

__all__ = ["GLAState", "gla_chunk", "gla_parallel", "gla_recurrent"]
