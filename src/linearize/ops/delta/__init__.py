"""The delta rule (DeltaNet), the gated delta rule (Gated DeltaNet) and DeltaProduct, the global
rule of LiZA / TPTT and the decaying global memory for recall.

Gated delta rule, per head, with keys L2-normalised by the caller, beta_t in [0, 1] and a decay
alpha_t = exp(log_alpha_t) in [0, 1]:

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T         (Dk x Dv)
        = alpha_t S_{t-1} + beta_t k_t (v_t - alpha_t S_{t-1}^T k_t)^T
    o_t = S_t^T q_t                                                      (read after the update)

The write replaces what the state held for k_t instead of adding to it, and the decay lets the
state forget. ``log_alpha=None`` (the default) is alpha = 1, the plain delta rule, computed exactly
as without a decay; log_alpha = -inf (alpha = 0) clears the state before token t's update.

DeltaProduct of order n runs the same rule over n virtual tokens per real token, t-major and
m-minor, and reads o_t after the n-th one. The virtual tokens are finite differences of the raw
keys and values,

    x_t^(m) = sum_{j=0..m} (-1)^j C(m, j) x_{t-j}        m = 0..n-1, x in {k, v},

with x before the sequence start taken from the carried state (zeros at the very start); the
differenced keys (m >= 1) are renormalised, see ``l2_renormalize``. Order 1 is the delta rule.
With a decay, alpha_t applies once per real token, to the state before its first virtual update.

Layout: q, k (B, H, T, Dk), v (B, H, T, Dv), beta (B, H, T) or, for DeltaProduct only,
(B, H, T, n) per virtual token; log_alpha (B, H, T) or None, every value in [-inf, 0] (positive
values and NaN are rejected); outputs (B, H, T, Dv) in v's dtype; states in the compute dtype of
``ops.common`` (fp32, or fp64 when an input is fp64), the same shapes with or without a decay.
Every op has a parallel (reference), chunk and recurrent form with one meaning; the chunk form
takes every decay factor as exp of a within-chunk segment sum of log_alpha, never above 1, so
bf16 inputs with any gates in [-inf, 0] give no inf/NaN.

The chunk form computes every chunk at once in batched torch around one sequential scan of the
small state (``chunk``); ``delta_rule_chunk`` / ``delta_product_chunk`` run on the Triton kernels
(``triton``: forward and backward, one autograd Function) when ``delta_applies``: the whole chunk
form for the (gated) delta rule, the scan and the chunks' inverses for DeltaProduct
(bf16/fp16/fp32 inputs, Dk, Dv <= 128, on CUDA, kernels enabled: see ``ops.backend``), else in
torch (``chunk.scan_torch``), which means the same. Triton is imported only when the kernels run.
"""

from .chunk import delta_applies, delta_product_chunk, delta_rule_chunk
from .naive import (
    DeltaProductState, DeltaState, delta_product_parallel, delta_rule_parallel, finite_differences,
    l2_renormalize,
)
from .recurrent import delta_product_recurrent, delta_rule_recurrent

__all__ = [
    "DeltaProductState", "DeltaState", "delta_applies", "delta_product_chunk", "delta_product_parallel",
    "delta_product_recurrent", "delta_rule_chunk", "delta_rule_parallel", "delta_rule_recurrent",
    "finite_differences", "l2_renormalize",
]
