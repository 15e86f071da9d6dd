"""Chunked LION: the full masked block inside each chunk, two states carried between chunks.

Shapes: q, k (B, H, T, F) (or (B, H, T, d) with ``phi_q`` / ``phi_k``); v (B, H, T, Dv);
log_a None | (H,) | (B, H, T); valid, key_valid (B, T) or None; o (B, H, T, Dv).

For a chunk [s0, s1) with chunk-local cumulative log gates b_t = Σ_{s0<=k<=t} log a_k (inclusive),
c_t = b_t - log a_t (exclusive) and b_end = b_{s1-1}, every factor below is <= 1:

    intra    (q k^T ⊙ M_chunk) v         M_chunk = the LION mask of the chunk's own gates
    forward  e^{b_t} q_t^T S^F           S^F: every key left of the chunk, decayed to s0 - 1
    backward e^{b_end - c_t} q_t^T S^B   S^B: every key right of the chunk, decayed to s1
    S^F <- e^{b_end} S^F + Σ_s e^{b_end - b_s} k_s v_s^T        (left to right)
    S^B <- e^{b_end} S^B + Σ_s e^{c_s} k_s v_s^T                (right to left)

(e^{b_end - c_t} = Π_{k=t..s1-1} a_k: the query's own gate is in, as in the mask.) With
``log_a_back`` the backward sweep's b_end and c (and the intra mask's upper triangle) come from
those gates instead. The forward sweep keeps each chunk's intra + forward reads; the backward
sweep adds its reads and writes the chunk's output. Without autograd the forward reads go where
the output will be and are overwritten by it, so extra memory is O(B H (C^2 + F Dv)) plus one
row sum and two gate sums per token. Given feature maps (``phi_q`` / ``phi_k``, q and k then the raw heads),
it makes a chunk's features when a sweep reaches it, twice in all, so no F-wide tensor spans the
input either; under autograd, which keeps every chunk's features for the backward anyway, it
makes them once for the whole input.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .naive import (FeatureMap, LionState, check_inputs, feature_width, records_graph, selective_mask, span_qkv,
                    token_log_gates)


def lion_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_a: Optional[torch.Tensor] = None, *,
    valid: Optional[torch.Tensor] = None, scaled: bool = True, chunk_size: int = 64, eps: float = 1e-6,
    log_a_back: Optional[torch.Tensor] = None, phi_q: Optional[FeatureMap] = None,
    phi_k: Optional[FeatureMap] = None, key_valid: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, LionState]:
    dt, valid, keys = check_inputs(q, k, v, log_a, valid, log_a_back, phi_q, phi_k, key_valid)
    B, H, T, _ = q.shape
    Dv, out_dtype = v.shape[-1], v.dtype
    F = feature_width(k, phi_k)
    lg = token_log_gates(log_a, valid, B, T, dt)
    lg_back = lg if log_a_back is None else token_log_gates(log_a_back, valid, B, T, dt)
    spans = common.chunk_spans(T, chunk_size)
    # Writing the output in place keeps inference memory flat; autograd needs out-of-place pieces.
    in_place = not records_graph((q, k, v, log_a, log_a_back), phi_q)
    if not in_place:  # autograd keeps every chunk's features anyway: make them once, not once per sweep
        q, k, v = span_qkv(q, k, v, valid, keys, dt, phi_q, phi_k)
        phi_q = phi_k = valid = keys = None

    def chunk(s0: int, s1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunk's q and k features and v, masked; without autograd made here, for this chunk alone."""
        return span_qkv(q, k, v, valid, keys, dt, phi_q, phi_k, s0, s1)

    S_f, z_f = v.new_zeros(B, H, F, Dv, dtype=dt), v.new_zeros(B, H, F, dtype=dt)
    reads = []  # per chunk: (decays or None, num, den) after the intra and forward terms
    if in_place:  # num goes where the chunk's output will, den into one row sum per token
        out = v.new_empty(B, H, T, Dv, dtype=dt)
        dens = v.new_empty(B, H, T, 1, dtype=dt) if scaled else None
    for s0, s1 in spans:
        qc, kc, vc = chunk(s0, s1)
        weights = qc @ kc.transpose(-1, -2)  # (B, H, C, C)
        if lg is None:
            decays, q_fwd, k_fwd = None, qc, kc
            b_end = None
        else:
            lc, lcb = lg[:, :, s0:s1], lg_back[:, :, s0:s1]
            b = lc.cumsum(-1)
            b_end = b[:, :, -1:]
            bb = b if lg_back is lg else lcb.cumsum(-1)
            weights = weights * selective_mask(lc, lcb)
            decays = (bb[:, :, -1:], bb - lcb)  # the backward sweep's: its total and exclusive cumsum
            q_fwd = qc * b.exp().unsqueeze(-1)
            k_fwd = kc * (b_end - b).exp().unsqueeze(-1)
        num = weights @ vc + q_fwd @ S_f
        den = weights.sum(-1, keepdim=True) + q_fwd @ z_f.unsqueeze(-1) if scaled else None
        if in_place:
            out[:, :, s0:s1] = num
            num = out[:, :, s0:s1]
            if scaled:
                dens[:, :, s0:s1] = den
                den = dens[:, :, s0:s1]
        reads.append((decays, num, den))
        if b_end is not None:
            S_f, z_f = b_end.exp().unsqueeze(-1) * S_f, b_end.exp() * z_f
        S_f = S_f + k_fwd.transpose(-1, -2) @ vc
        z_f = z_f + k_fwd.sum(2)

    S_b, z_b = torch.zeros_like(S_f), torch.zeros_like(z_f)
    pieces = [None] * len(spans)
    for i in range(len(spans) - 1, -1, -1):
        s0, s1 = spans[i]
        (decays, num, den), reads[i] = reads[i], None
        qc, kc, vc = chunk(s0, s1)
        if decays is None:
            q_bwd, k_bwd = qc, kc
        else:
            b_end, c = decays
            q_bwd = qc * (b_end - c).exp().unsqueeze(-1)
            k_bwd = kc * c.exp().unsqueeze(-1)
        num = num + q_bwd @ S_b
        o = common.normalize_output(num, den + q_bwd @ z_b.unsqueeze(-1), eps) if scaled else num
        if in_place:
            out[:, :, s0:s1] = o
        else:
            pieces[i] = o
        if decays is not None:
            S_b, z_b = b_end.exp().unsqueeze(-1) * S_b, b_end.exp() * z_b
        S_b = S_b + k_bwd.transpose(-1, -2) @ vc
        z_b = z_b + k_bwd.sum(2)
    if not in_place:
        out = torch.cat(pieces, 2) if pieces else v
    return out.to(out_dtype), LionState(S_f, z_f, S_b, z_b)
