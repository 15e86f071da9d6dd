"""The delta rule (DeltaNet) and DeltaProduct, the global rule of LiZA / TPTT.

Delta rule, per head, with keys L2-normalised by the caller and beta_t in [0, 1]:

    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T
        = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T       (Dk x Dv)
    o_t = S_t^T q_t                                                (read after the update)

DeltaProduct of order n runs the same rule over n virtual tokens per real token, t-major and
m-minor, and reads o_t after the n-th one. The virtual tokens are finite differences of the raw
keys and values,

    x_t^(m) = sum_{j=0..m} (-1)^j C(m, j) x_{t-j}        m = 0..n-1, x in {k, v},

with x before the sequence start taken from the carried state (zeros at the very start); the
differenced keys (m >= 1) are renormalised, see ``l2_renormalize``. Order 1 is the delta rule.

Layout: q, k (B, H, T, Dk), v (B, H, T, Dv), beta (B, H, T) or, for DeltaProduct only,
(B, H, T, n) per virtual token; outputs (B, H, T, Dv) in v's dtype; states in the compute dtype
of ``ops.common``. Every op has a parallel (reference), chunk and recurrent form with one meaning.
"""

from .chunk import delta_product_chunk, delta_rule_chunk
from .naive import (
    DeltaProductState, DeltaState, delta_product_parallel, delta_rule_parallel, finite_differences,
    l2_renormalize,
)
from .recurrent import delta_product_recurrent, delta_rule_recurrent

__all__ = [
    "DeltaProductState", "DeltaState", "delta_product_chunk", "delta_product_parallel",
    "delta_product_recurrent", "delta_rule_chunk", "delta_rule_parallel", "delta_rule_recurrent",
    "finite_differences", "l2_renormalize",
]
