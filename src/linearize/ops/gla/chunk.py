"""Chunked gated linear attention: quadratic inside a chunk, gated state carried between chunks.

Shapes: q, k (B, H, T, Dk); v (B, H, T, Dv); log_g (B, H, T) or (B, H, T, Dk); o (B, H, T, Dv).

Lizard's factorisation with chunk-local references, so that no factor is ever above 1. With b the
cumulative log-gate counted from the chunk start (b_start = 0, b_end its last value):

    inter-chunk  Q̃_t = φ(q_t) e^{b_t - b_start}   reads the state carried into the chunk
                 K̃_s = φ(k_s) e^{b_end - b_s}     folds the chunk into the next state
    intra-chunk  A_ts = Σ_f φq_t[f] φk_s[f] e^{b_t[f] - b_s[f]},  s <= t, masked before the exp

With log-space features the decays join the exponents instead, Q̃ = exp(log q + b_t - b_start): one
exp per entry, as in Lizard. A global pair e^{b_t}, e^{-b_s} is never formed (one overflows exactly
where the other underflows), and cumulative gates never leave a chunk, so their precision does not
degrade with T.
Per-channel gates cannot be split into a (t, s) product inside a chunk; the direct differences
take a (B, H, C, C, Dk) tensor per chunk, fine for this torch path at moderate chunk sizes.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .naive import GLAState, check_inputs, feature


def _decayed(x: torch.Tensor, log_decay: torch.Tensor, log_space_features: bool) -> torch.Tensor:
    """φ(x) e^{log_decay} with log_decay <= 0; for log-features the decay joins the exponent."""
    return (x + log_decay).exp() if log_space_features else x * log_decay.exp()


def _intra_weights(
    qc: torch.Tensor, kc: torch.Tensor, b: torch.Tensor, vector_gate: bool, log_space_features: bool,
) -> torch.Tensor:
    """A (B, H, C, C): gated query-key weights inside one chunk, zero above the diagonal."""
    C = qc.shape[2]
    causal = torch.ones(C, C, dtype=torch.bool, device=qc.device).tril()
    # Mask with -inf before the exp: above the diagonal b_t - b_s >= 0 may overflow, and an inf
    # masked afterwards would still poison the gradient with inf * 0.
    diff = (b.unsqueeze(3) - b.unsqueeze(2)).masked_fill(~causal.unsqueeze(-1), float("-inf"))
    if not vector_gate:
        return (feature(qc, log_space_features) @ feature(kc, log_space_features).transpose(-1, -2)) \
            * diff.squeeze(-1).exp()
    if log_space_features:
        return (qc.unsqueeze(3) + kc.unsqueeze(2) + diff).exp().sum(-1)
    return torch.einsum("bhtf,bhsf,bhtsf->bhts", qc, kc, diff.exp())


def gla_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, *, normalize: bool = True,
    log_space_features: bool = False, state: Optional[GLAState] = None, chunk_size: int = 64,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, GLAState]:
    dt, vector_gate, (S, z) = check_inputs(q, k, v, log_g, state)
    T = q.shape[2]
    # A trailing channel axis of 1 for scalar gates lets one code path serve both kinds.
    lg = log_g.to(dt) if vector_gate else log_g.to(dt).unsqueeze(-1)  # (B, H, T, Dk|1)
    outs = []
    for s0, s1 in common.chunk_spans(T, chunk_size):
        qc, kc, vc = q[:, :, s0:s1].to(dt), k[:, :, s0:s1].to(dt), v[:, :, s0:s1].to(dt)
        b = lg[:, :, s0:s1].cumsum(2)  # (B, H, C, Dk|1), relative to the chunk start, <= 0
        b_end = b[:, :, -1:]  # (B, H, 1, Dk|1)
        q_tilde = _decayed(qc, b, log_space_features)
        k_tilde = _decayed(kc, b_end - b, log_space_features)
        a = _intra_weights(qc, kc, b, vector_gate, log_space_features)
        num = q_tilde @ S + a @ vc
        if normalize:
            den = q_tilde @ z.unsqueeze(-1) + a.sum(-1, keepdim=True)
            outs.append(common.normalize_output(num, den, eps))
            z = b_end[:, :, 0].exp() * z + k_tilde.sum(2)
        else:
            outs.append(num)
        # the chunk's total decay scales row f of the carried state
        S = b_end.transpose(-1, -2).exp() * S + k_tilde.transpose(-1, -2) @ vc
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), GLAState(S, z)
