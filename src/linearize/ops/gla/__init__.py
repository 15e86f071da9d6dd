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
bf16/fp16/fp32 with Dk, Dv <= 128, on CUDA, kernels enabled: see ``ops.backend``; wider values in
blocks of 128 columns, each on the kernels), else the torch chunk form (``chunk.gla_chunk``), which
always exists and means the same. Triton is imported only when the kernels run.
"""

from __future__ import annotations

import warnings
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


VALUE_BLOCK = 128  # the widest values the kernels take (``triton.MAX_DIM``)


def _columns(state: Optional[GLAState], c0: int, c1: int) -> Optional[GLAState]:
    """The state of value columns c0 .. c1 - 1 (the normaliser z is every block's)."""
    return None if state is None else GLAState(state.S[..., c0:c1], state.z)


def _value_blocks(q, k, v, log_g, state) -> list[tuple[int, int]]:
    """Column ranges of v of at most VALUE_BLOCK where the kernels apply to each (values wider
    than they take, keys within it), else []."""
    if v.dim() != 4 or v.shape[-1] <= VALUE_BLOCK or (state is not None and not all_tensors(*state)):
        return []
    Dv = v.shape[-1]
    blocks = [(c0, min(c0 + VALUE_BLOCK, Dv)) for c0 in range(0, Dv, VALUE_BLOCK)]
    c0, c1 = blocks[0]
    return blocks if gla_applies(q, k, v[..., c0:c1], log_g, _columns(state, c0, c1)) else []


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
    kw = dict(normalize=normalize, log_space_features=log_space_features, eps=eps)
    if gla_applies(q, k, v, log_g, state):
        from ..common import check_positive_int
        from .triton import gla_chunk_triton
        check_positive_int("chunk_size", chunk_size)
        return gla_chunk_triton(q, k, v, log_g, state=state, settings=settings, **kw)
    blocks = _value_blocks(q, k, v, log_g, state)
    if blocks:
        # values wider than the kernels take (Gemma's heads of 256): their columns never mix, so
        # blocks of columns run on the kernels, each with the whole keys, and join exactly
        outs = [gla_chunk(q, k, v[..., c0:c1], log_g, state=_columns(state, c0, c1), chunk_size=chunk_size,
                          settings=settings, **kw) for c0, c1 in blocks]
        return (torch.cat([o for o, _ in outs], -1),
                GLAState(torch.cat([st.S for _, st in outs], -1), outs[0][1].z))
    if q.is_cuda and kernels_enabled() and q.shape[-1] > VALUE_BLOCK:
        warnings.warn(f"gla_chunk: features of width {q.shape[-1]} are wider than the kernels take ({VALUE_BLOCK}); "
                      f"the torch chunk form runs instead, several times slower (a student with feature_dim <= "
                      f"{VALUE_BLOCK} runs on the kernels)", stacklevel=2)
    return gla_chunk_torch(q, k, v, log_g, state=state, chunk_size=chunk_size, **kw)
