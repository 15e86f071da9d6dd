"""Chunked LoLCATs hybrid, all chunks at once: no loop along time.

The input is cut into NC = ceil(T / C) chunks (the last one zero-padded). Chunk j's queries see

- its band: the L + C keys [cache ++ input][jC : jC + L + C], i.e. the L keys before the chunk and
  the chunk itself (a strided ``unfold`` view), split by the rule into window and linear terms;
- S_j, z_j: the linear state of every key before the band, S_j = S + sum_{i < j} fk_i^T v_i over
  the chunk-sized blocks that have left the band (an exclusive cumulative sum over chunks).

That is exactly what a loop over chunks with a cache of L keys computes, chunk for chunk; here the
bands are scored with batched matmuls over (B, H, NC, C, L + C), so autograd records a fixed
number of ops whatever T is; where the kernels run, one Triton kernel each way scores the bands in
registers instead (``triton.py``; the per-chunk states stay torch). The per-chunk states are summed
in the compute dtype (fp32 for bf16 inputs; a bf16 running sum would drift over long T).

Memory kept for backward, in the compute dtype (4 bytes in fp32), per token and head: about
(L + C)(Dk + F + Dv) / C (the bands, copied by the matmuls) + 3 (L + C) (masked scores, their exp,
the weights; one more with a softcap) + Dk + 2 F + 2 Dv + F Dv / C (q, fq, the folded fk and v,
the output, S_j). The per-chunk states alone are B H NC F (Dv + 1) numbers. Shapes: see ``naive``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from ..backend.dispatch import kernels_enabled, on_kernel_device
from ..window_attn.naive import check_softcap, key_positions
from .naive import LolcatsState, check_inputs, foldable, hybrid_combine, split_keys


def band_kernel_applies(q, k, v, fq, fk, dt: torch.dtype, terraced: bool, softcap, C: int) -> bool:
    """The bands on the Triton kernels (``triton.py``): where the kernels run (``backend.dispatch``),
    for 16-bit q, k, v and features (a model under autocast), computing in fp32 with tf32 products
    (see ``triton.py``; fp32 inputs keep the torch path's fp32 products), for a standard window
    without soft-cap, chunks of a power of two >= 16 and widths <= 256."""
    half = all(x.dtype in (torch.bfloat16, torch.float16) for x in (q, k, v, fq, fk))
    return (half and dt == torch.float32 and not terraced and softcap is None and C >= 16 and C & (C - 1) == 0
            and max(q.shape[-1], fq.shape[-1], v.shape[-1]) <= 256 and kernels_enabled()
            and on_kernel_device(q, k, v, fq, fk))


def lolcats_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor,
    window_factor: torch.Tensor, *, window: int, terraced: bool = False, scale: Optional[float] = None,
    state: Optional[LolcatsState] = None, eps: float = 1e-6, softcap: Optional[float] = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, LolcatsState]:
    """o (B, H, T, Dv) and the state after the input; ``chunk_size`` C (any positive int) sets the
    band width L + C and the number of per-chunk states, not the result (up to rounding)."""
    dt, L, state = check_inputs(q, k, v, fq, fk, window_factor, window, terraced, state)
    scale = common.softmax_scale(scale, q.shape[-1])
    softcap = check_softcap(softcap)
    C = common.check_positive_int("chunk_size", chunk_size)
    B, H, T, Dv = v.shape
    if T == 0:
        return v.new_zeros(v.shape), state
    NC = -(-T // C)
    pad = NC * C - T

    def joined(cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[cache ++ input ++ zero padding]: (B, H, L + NC * C, D)."""
        parts = [cache, x.to(dt)] + ([cache.new_zeros(B, H, pad, x.shape[-1])] if pad else [])
        return torch.cat(parts, dim=2)

    def chunks(x: torch.Tensor) -> torch.Tensor:
        """The input in chunks: (B, H, NC, C, D)."""
        x = x.to(dt)
        if pad:
            x = torch.cat([x, x.new_zeros(B, H, pad, x.shape[-1])], dim=2)
        return x.view(B, H, NC, C, x.shape[-1])

    def bands(x: torch.Tensor) -> torch.Tensor:
        """Chunk j's band of a joined tensor: (B, H, NC, L + C, D), a view."""
        return x.unfold(2, L + C, C).transpose(-1, -2)

    keys, fkeys, values = joined(state.k, k), joined(state.fk, fk), joined(state.v, v)
    k_pos = key_positions(state.pos, L, NC * C)  # (B, L + NC * C)

    # keys [0, T) of the joined sequence leave the cache during this call; block j of them lies
    # before chunk j's band. Padding and positions past T stay out of the state.
    leaving = foldable(k_pos[:, :NC * C]) & (torch.arange(NC * C, device=k_pos.device) < T)
    fk_out = fkeys[:, :, :NC * C].masked_fill(~leaving[:, None, :, None], 0.0).view(B, H, NC, C, -1)
    v_out = values[:, :, :NC * C].view(B, H, NC, C, Dv)
    S_blocks, z_blocks = fk_out.transpose(-1, -2) @ v_out, fk_out.sum(3)  # (B, H, NC, F, Dv), (B, H, NC, F)
    # S_j = S + blocks 0 .. j-1, built contiguous (it is what the matmul below keeps for backward)
    S_j = torch.cat([state.S[:, :, None], S_blocks[:, :, :-1]], dim=2).cumsum(2)
    z_j = torch.cat([state.z[:, :, None], z_blocks[:, :, :-1]], dim=2).cumsum(2)

    if band_kernel_applies(q, k, v, fq, fk, dt, terraced, softcap, C):
        from .triton import lolcats_band_triton
        o = lolcats_band_triton(q.to(dt), fq.to(dt), keys, fkeys, values, k_pos, S_j, z_j, window_factor.to(dt),
                                window=window, L=L, C=C, scale=scale, eps=eps)
    else:
        band_pos = k_pos.unfold(1, L + C, C).reshape(B * NC, L + C)
        win, older = (m.view(B, NC, C, L + C)[:, None]
                      for m in split_keys(band_pos[:, L:], band_pos, window, terraced))
        o = hybrid_combine(chunks(q), chunks(fq), bands(keys), bands(fkeys), bands(values), win, older,
                           S_j, z_j, window_factor.to(dt), scale, eps, softcap)
        o = o.reshape(B, H, NC * C, Dv)[:, :, :T]
    cache = (x[:, :, T:T + L].clone() for x in (keys, fkeys, values))  # the last L of [cache ++ input]
    S, z = S_j[:, :, -1] + S_blocks[:, :, -1], z_j[:, :, -1] + z_blocks[:, :, -1]
    return o.to(v.dtype), LolcatsState(S, z, *cache, state.pos + T)
