"""Recurrent sliding-window softmax with sinks: one token at a time over the fixed-size cache."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import common
from .naive import (
    WindowState, check_inputs, check_softcap, keep_last, key_positions, sink_softmax_attend, soft_cap, visible,
)


def window_attn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, terraced: bool = False,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[WindowState] = None, softcap: Optional[float] = None,
) -> tuple[torch.Tensor, WindowState]:
    dt, L, state = check_inputs(q, k, v, window, terraced, sink_logits, sink_k, sink_v, state)
    scale = common.softmax_scale(scale, q.shape[-1])
    softcap = check_softcap(softcap)
    cache_k, cache_v, pos = state
    outs = []
    for t in range(q.shape[2]):
        keys = torch.cat([cache_k, k[:, :, t:t + 1].to(dt)], dim=2)  # (B, H, L + 1, Dk)
        values = torch.cat([cache_v, v[:, :, t:t + 1].to(dt)], dim=2)
        k_pos = key_positions(pos, L, 1)
        # standard windows see every filled slot; terraced ones may not (previous block only)
        mask = visible(k_pos[:, L:], k_pos, window, terraced)
        outs.append(sink_softmax_attend(q[:, :, t:t + 1].to(dt), keys, values, mask, scale,
                                        sink_logits, sink_k, sink_v, softcap))
        cache_k, cache_v, pos = keys[:, :, 1:], values[:, :, 1:], pos + 1
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), WindowState(cache_k, cache_v, pos)


def window_ring_step_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor,
    pos: torch.Tensor, *, scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One decoding step of a standard window over a ring buffer, the ring written in place.

    The decoding form for static buffers (no cache shifted each step): q (B, H, 1, D) the new query,
    k (B, Hkv, 1, D) and v (B, Hkv, 1, Dv) its key and value, one per KV head (H = G * Hkv query heads
    share each, grouped as query rows: no repeated keys); ring_k (B, Hkv, w, D) and ring_v
    (B, Hkv, w, Dv) the last w keys and values, slot p mod w holding position p; pos (B,) the new
    token's position. Writes k and v into slot pos mod w, then attends over the slots holding
    positions 0..pos, with the sinks as ``window_attn_recurrent`` (sink_logits (H, m); sink_k
    (H, m, D) and sink_v (H, m, Dv)) and ``softcap``, in ``dtype``. Returns (B, H, 1, Dv) in v's
    dtype: for a window of w keys, ``window_attn_recurrent``'s output for that token."""
    B, H, _, d = q.shape
    Hkv, w = ring_k.shape[1], ring_k.shape[2]
    G = H // Hkv
    dt = dtype
    slot = (pos % w).view(B, 1, 1, 1)
    ring_k.scatter_(2, slot.expand(B, Hkv, 1, ring_k.shape[-1]), k.to(ring_k.dtype))
    ring_v.scatter_(2, slot.expand(B, Hkv, 1, ring_v.shape[-1]), v.to(ring_v.dtype))
    j = torch.arange(w, device=pos.device)
    slot_pos = pos[:, None] - torch.remainder(pos[:, None] - j, w)  # (B, w)
    mask = (slot_pos >= 0)[:, None, None, :]  # (B, 1, 1, w)
    scale = scale if scale is not None else d ** -0.5
    qg = q.reshape(B, Hkv, G, d).to(dt)
    scores = soft_cap(qg @ ring_k.to(dt).transpose(-1, -2) * scale, softcap).masked_fill(~mask, -math.inf)
    cmax = scores.amax(-1, keepdim=True)
    if sink_k is not None:
        sk = sink_k.to(dt).reshape(Hkv, G, -1, d)
        sink_scores = soft_cap((qg.unsqueeze(-2) @ sk.transpose(-1, -2)).squeeze(-2) * scale, softcap)
        cmax = torch.maximum(cmax, sink_scores.amax(-1, keepdim=True))
    elif sink_logits is not None:
        logits = sink_logits.to(dt).reshape(1, Hkv, G, -1)
        cmax = torch.maximum(cmax, logits.amax(-1, keepdim=True))
    cmax = torch.where(torch.isfinite(cmax), cmax, torch.zeros_like(cmax))
    p = torch.exp(scores - cmax)
    num, den = p @ ring_v.to(dt), p.sum(-1, keepdim=True)
    if sink_k is not None:
        ps = torch.exp(sink_scores - cmax)
        num = num + (ps.unsqueeze(-2) @ sink_v.to(dt).reshape(Hkv, G, -1, sink_v.shape[-1])).squeeze(-2)
        den = den + ps.sum(-1, keepdim=True)
    elif sink_logits is not None:
        den = den + torch.exp(logits - cmax).sum(-1, keepdim=True)
    y = num / torch.where(den > 0, den, torch.ones_like(den))
    return y.reshape(B, H, 1, -1).to(v.dtype)
