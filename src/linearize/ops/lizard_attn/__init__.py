"""Lizard's attention as one op: gated linear attention + sliding window with v2 sinks, summed.

    y = gla(phi_q, phi_k, v, log_g) + alpha_h * window(q_w, k_w, v; sink_logits)

``lizard_attention`` (in ``fused``) is the public op and picks the backend: the fused kernels on
CUDA where ``one_op_applies``, else the branches' own ops (``ops.gla``, ``ops.window_attn``) and a
torch combine, the same computation ``layers.hybrid.HybridAttention`` runs for Lizard.
``lizard_attention_fused`` is the one op alone, None where it does not apply (for a caller with a
torch path of its own). Both take ``settings`` (``ops.backend.KernelSettings``).

Its decode step (one new token per row: the recurrent gated step and the window over a ring
buffer) is ``decode``'s Triton kernel; ``lizard_step_launcher()`` gives its launcher, or None
without Triton (the caller then runs the torch recurrent forms, ``ops.gla.gla_recurrent`` and
``ops.window_attn.window_attn_recurrent``). ``decode`` is imported only when asked for, so
importing this package never imports Triton.
"""

from __future__ import annotations

import torch

from .fused import lizard_attention, lizard_attention_fused, one_op_applies

__all__ = ["fused_norms_ok", "launch_rmsnorm", "lizard_attention", "lizard_attention_fused", "lizard_step_applies",
           "lizard_step_launcher", "one_op_applies"]


def lizard_step_applies(device: torch.device, dtype: torch.dtype, *, feature_map: str, softcap, sink_kind) -> bool:
    """Whether the fused Triton decode step (``lizard_step_launcher``) runs a layer's step: on CUDA,
    bf16/fp16/fp32, Hedgehog features, no soft-cap, sink logits or no sinks (``sink_kind`` "logits"
    or None), and a usable Triton. The decoder asks this; where it says no, the ops' torch steps
    (``ops.gla.gla_step_``, ``ops.window_attn.window_ring_step_``) run."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and feature_map == "hedgehog" and softcap is None and sink_kind in (None, "logits")
            and lizard_step_launcher() is not None)


def lizard_step_launcher():
    """The fused Lizard decode step's launcher (``decode.launch_lizard_step``), or None without a
    usable Triton."""
    from .decode import lizard_step_launcher as launcher

    return launcher()


def fused_norms_ok(device: torch.device) -> bool:
    """Whether a decoder may swap HF's RMSNorms for the one-kernel norm (on CUDA with Triton,
    unless ``LINEARIZE_DECODE_NORM=0``)."""
    if device.type != "cuda":
        return False
    from .decode import fused_norms_ok as ok

    return ok(device)


def launch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama RMSNorm as one Triton kernel (see ``decode.launch_rmsnorm``)."""
    from .decode import launch_rmsnorm as launch

    return launch(x, weight, eps)
