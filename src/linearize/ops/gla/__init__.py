"""Causal gated linear attention (GLA), Lizard's form, normalised or not.

    S_t = γ_t ⊙ S_{t-1} + k_t v_t^T       (Dk x Dv; a per-channel γ scales row f)
    z_t = γ_t ⊙ z_{t-1} + k_t             (Dk)
    o_t = q_t^T S_t  [/ (q_t^T z_t + eps) when normalised]

so key s reaches query t with weight Π_{l=s+1..t} γ_l = exp(b_t - b_s), b = cumsum(log γ).
Gates come in log space, ``log_g = log γ <= 0``, one per head ``(B, H, T)`` or one per channel
``(B, H, T, Dk)``. q and k are features, given either as they are or, with
``log_space_features=True``, as log-features (the feature is exp(q), exp(k); -inf means a zero
feature). Layout: see ``ops.common``.

``gla_chunk`` is the public op and the one place that picks a backend: the Triton/Gluon kernels
(``triton``, ``gluon``) when ``gla_applies`` (scalar gates (B, H, T), q/k/v in one dtype among
bf16/fp16/fp32 with Dk, Dv <= 128, on CUDA, kernels enabled: see ``ops.backend``), else the torch
chunk form (``chunk.gla_chunk``), which always exists and means the same. Triton is imported only
when the kernels run.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backend.dispatch import all_tensors, kernels_enabled, on_kernel_device
from ..backend.settings import KernelSettings

from .chunk import gla_chunk as gla_chunk_torch
from .naive import GLAState, gla_parallel
from .recurrent import gla_recurrent, gla_step_

__all__ = ["GLAState", "gla_applies", "gla_chunk", "gla_chunk_torch", "gla_parallel", "gla_recurrent", "gla_step_"]


def gla_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor,
                state: Optional[GLAState] = None) -> bool:
    """Whether ``gla_chunk`` would run on the Triton kernels for these inputs."""
    if not kernels_enabled() or not all_tensors(q, k, v, log_g):
        return False
    tensors = [q, k, v, log_g] + ([state.S, state.z] if state is not None and all_tensors(*state) else [])
    if state is not None and len(tensors) != 6:
        return False
    if not on_kernel_device(*tensors) or q.dim() != 4 or v.dim() != 4 or log_g.dim() != 3:
        return False
    from . import triton as _gla
    return _gla.supports(q, k, v, log_g)


def gla_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, *, normalize: bool = True,
    log_space_features: bool = False, state: Optional[GLAState] = None, chunk_size: int = 64,
    eps: float = 1e-6, settings: Optional[KernelSettings] = None,
) -> tuple[torch.Tensor, GLAState]:
    """Chunked GLA: ``chunk.gla_chunk`` (same signature and result), on the Triton kernels when they apply.

    The kernels use their own chunk size (``KernelSettings.chunk``); ``chunk_size`` is validated and
    used by the torch path (the result does not depend on it). ``settings``: the kernels' user
    settings (default ``ops.backend.current_settings()``).
    """
    if gla_applies(q, k, v, log_g, state):
        from ..common import check_positive_int
        from .triton import gla_chunk_triton
        check_positive_int("chunk_size", chunk_size)
        return gla_chunk_triton(q, k, v, log_g, normalize=normalize, log_space_features=log_space_features,
                                state=state, eps=eps, settings=settings)
    return gla_chunk_torch(q, k, v, log_g, normalize=normalize, log_space_features=log_space_features,
                            state=state, chunk_size=chunk_size, eps=eps)
