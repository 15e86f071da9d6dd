"""The whole Lizard attention in one call: gated linear attention + sliding window with sinks.

    y = gla(phi_q, phi_k, v, log_g) + alpha_h * window(q_w, k_w, v; sink_logits)

Shapes: phi_q, phi_k (B, H, T, F) features (what the Lizard layer passes: Hedgehog's, rounded
once from fp32), or log-features with ``log_space_features``; v (B, H, T, Dv); log_g (B, H, T);
q_w, k_w (B, H, T, D) the window's queries/keys (RoPE already applied by the caller); alpha (H,);
sink_logits (H, m) or None.
Returns y (B, H, T, Dv) in the dtype of v, the gated branch's state and the window's state.

On CUDA with the kernels enabled this is the gated kernel followed by the window kernel with
the combine fused into its epilogue; elsewhere the torch ops and a torch combine, which is the
same computation ``layers.hybrid.HybridAttention`` runs for Lizard without padding.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.gla import GLAState
from ..ops.window_attn import WindowState
from ..ops.window_attn import window_attn_chunk as _window_chunk_torch
from . import gla_chunk, window_attn_sum


def lizard_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor,
    q_w: torch.Tensor, k_w: torch.Tensor, alpha: torch.Tensor, *, window: int = 128,
    sink_logits: Optional[torch.Tensor] = None, scale: Optional[float] = None, normalize: bool = True,
    log_space_features: bool = False, state: Optional[GLAState] = None, chunk_size: int = 64,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, GLAState, WindowState]:
    """Lizard's attention output and the two branch states (see the module docstring)."""
    y_g, g_state = gla_chunk(phi_q, phi_k, v, log_g, normalize=normalize, log_space_features=log_space_features,
                             state=state, chunk_size=chunk_size, eps=eps)
    fused = window_attn_sum(q_w, k_w, v, y_g, alpha, window=window, scale=scale, sink_logits=sink_logits,
                            chunk_size=chunk_size)
    if fused is not None:
        y, w_state = fused
        return y, g_state, w_state
    H = q_w.shape[1] if q_w.dim() == 4 else None
    if not isinstance(alpha, torch.Tensor) or tuple(alpha.shape) != (H,):
        got = tuple(alpha.shape) if isinstance(alpha, torch.Tensor) else type(alpha).__name__
        raise ValueError(f"alpha must have shape ({H},), got {got}")
    y_w, w_state = _window_chunk_torch(q_w, k_w, v, window=window, scale=scale, sink_logits=sink_logits,
                                       chunk_size=chunk_size)
    y = y_g + alpha[:, None, None].to(y_g.dtype) * y_w
    return y.to(v.dtype), g_state, w_state
