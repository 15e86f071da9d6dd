"""LION: full (bidirectional) linear attention with decay masks, and its equivalent bidirectional RNN.

    Y = scale((Q K^T) ⊙ M) V          Q = φ(q), K = φ(k) already feature-mapped (>= 0 when scaled)

``scale`` divides each row by its sum (the scaled form, ``scaled=True``) or is the identity.
The mask M comes from the decay ``log_a``:

    None          lit  M_ij = 1
    (H,)          d    M_ij = λ_h^{|i-j|},  log_a = log λ_h (a fixed decay per head)
    (B, H, T)     s    M_ij = Π_{k=j+1..i} a_k (i > j),  Π_{k=i..j-1} a_k (i < j),  M_ii = 1

(the query's gate is in the product, the key's is not; ``d`` is ``s`` with every a_k = λ_h).
``log_a_back`` (ours, optional, ``log_a``'s shape): separate decays for the keys right of the
query (the upper triangle, the backward recurrence), so a head can look mostly left or mostly
right; None keeps LION's symmetric mask. Every entry of ``log_a`` must be finite and <= 0. The
mask is built in log space as forward-lower + backward-upper - I, masked before the exp, so
nothing overflows.

Layout: ``q, k: (B, H, T, F)``, ``v: (B, H, T, Dv)``, output ``(B, H, T, Dv)`` in the dtype of
``v``; states and accumulation in fp32 (fp64 for fp64 inputs). ``valid: (B, T)`` bool (or 0/1
integers), False at padding, or None.

Feature maps and left-out keys (every form): ``phi_q`` / ``phi_k``, callables (B, H, C, d) ->
(B, H, C, F), make the op take the raw heads as q and k and apply the maps itself; the chunk and
recurrent forms then do it a chunk (block) of tokens at a time without autograd, so no F-wide
tensor spans the input. ``key_valid: (B, T)`` leaves keys out of every sum (their features count
as 0) while their tokens still query and decay: the exact sinks of ``layers.lion`` use it.

Padding never reaches a state or a gate: at padding, q, k and v are zeroed (``masked_fill``, so
even NaN there is cleared) and a_t is set to 1, so every valid token gets exactly the output it
gets in the sequence with the padding removed, wherever the padding sits; padded positions
output 0.

Three forms with one result (``lion_parallel``, ``lion_recurrent``, ``lion_chunk``):

* parallel: the masked T x T attention above, the reference (``lion_mask`` builds M);
* recurrent: the bidirectional RNN
      S^F_t = a_t S^F_{t-1} + k_t v_t^T,   S^B_t = a_t S^B_{t+1} + k_t v_t^T   (both include t)
      y_t = q_t^T (S^F_t + S^B_t - k_t v_t^T) / q_t^T (z^F_t + z^B_t - k_t)
  so the diagonal counts once (z: the same recurrences over k_t);
* chunk: quadratic inside a chunk of C tokens (the full masked block), a forward state carried
  left to right and a backward state carried right to left between chunks; every decay factor
  is a product of gates inside one chunk (<= 1). Extra memory beyond the output does not grow
  with T: O(B H (C^2 + F Dv)) plus one row sum per token.

Each returns ``(o, LionState)``: the forward state after the last token and the backward state
at the first token (the whole sequence, decayed to each end).
"""

from .chunk import lion_chunk
from .naive import LION_KINDS, LionState, lion_mask, lion_parallel
from .recurrent import lion_recurrent

__all__ = ["LION_KINDS", "LionState", "lion_chunk", "lion_mask", "lion_parallel", "lion_recurrent"]
