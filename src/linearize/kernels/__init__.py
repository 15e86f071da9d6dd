"""Optional fast backends behind the op signatures; the torch ops always exist and mean the same.

Entry points (each dispatches by itself, see ``dispatch``):

- ``gla_chunk``: ``ops.gla.gla_chunk``; Triton when the gates are scalar (B, H, T), q/k/v share a
  dtype among bf16/fp16/fp32 with Dk, Dv <= 128, and the tensors are on CUDA. An initial state
  is supported (forward and backward) and the final state comes back, so prefill with a carried
  state stays on the kernels.
- ``window_attn_chunk``: ``ops.window_attn.window_attn_chunk``; Triton for a standard window
  with v2 sink logits (or none), no soft-cap, and a state that is None or fresh
  (``fresh_state=True``: the caller promises ``pos <= 0``, i.e. only left padding; a carried
  cache goes to torch).
- ``window_attn_sum``: Lizard's ``y_global + alpha_h * y_window`` with the combine fused into
  the window kernel; None when the kernels do not apply (the caller keeps its own path).
- ``lizard_attention`` (in ``lizard``): the whole Lizard attention, gated branch + window + combine.

``LINEARIZE_KERNELS=0`` forces the torch path everywhere.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.gla import GLAState
from ..ops.gla import gla_chunk as _gla_chunk_torch
from ..ops.window_attn import WindowState
from ..ops.window_attn import window_attn_chunk as _window_chunk_torch
from .dispatch import ENV_SWITCH, kernels_enabled, on_kernel_device

__all__ = ["ENV_SWITCH", "gla_applies", "gla_chunk", "kernels_enabled", "window_applies", "window_attn_chunk",
           "window_attn_sum"]


def _is_tensor(*xs) -> bool:
    return all(isinstance(x, torch.Tensor) for x in xs)


def gla_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor,
                state: Optional[GLAState] = None) -> bool:
    """Whether ``gla_chunk`` would run on the Triton kernels for these inputs."""
    if not kernels_enabled() or not _is_tensor(q, k, v, log_g):
        return False
    tensors = [q, k, v, log_g] + ([state.S, state.z] if state is not None and _is_tensor(*state) else [])
    if state is not None and len(tensors) != 6:
        return False
    if not on_kernel_device(*tensors) or q.dim() != 4 or v.dim() != 4 or log_g.dim() != 3:
        return False
    from . import gla as _gla
    return _gla.supports(q, k, v, log_g)


def gla_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, *, normalize: bool = True,
    log_space_features: bool = False, state: Optional[GLAState] = None, chunk_size: int = 64,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, GLAState]:
    """``ops.gla.gla_chunk`` (same signature and result), on the Triton kernels when they apply.

    The kernels use their own chunk size; ``chunk_size`` is validated and used by the torch path
    (the result does not depend on it).
    """
    if gla_applies(q, k, v, log_g, state):
        from ..ops.common import check_positive_int
        from .gla import gla_chunk_triton
        check_positive_int("chunk_size", chunk_size)
        return gla_chunk_triton(q, k, v, log_g, normalize=normalize, log_space_features=log_space_features,
                                state=state, eps=eps)
    return _gla_chunk_torch(q, k, v, log_g, normalize=normalize, log_space_features=log_space_features,
                            state=state, chunk_size=chunk_size, eps=eps)


def window_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, terraced: bool = False,
                   softcap: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
                   sink_k: Optional[torch.Tensor] = None, state: Optional[WindowState] = None,
                   fresh_state: bool = False) -> bool:
    """Whether the window kernels would run for these inputs (a given state must be fresh)."""
    if not kernels_enabled() or not _is_tensor(q, k, v) or q.dim() != 4 or v.dim() != 4:
        return False
    if state is not None and not (fresh_state and isinstance(state, WindowState) and _is_tensor(*state)):
        return False
    extra = [sink_logits] if isinstance(sink_logits, torch.Tensor) else []
    extra += [state.pos] if state is not None else []
    if not on_kernel_device(q, k, v, *extra):
        return False
    from . import window as _window
    return _window.supports(q, k, v, terraced=terraced, softcap=softcap, sink_logits=sink_logits, sink_k=sink_k)


def window_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, terraced: bool = False,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[WindowState] = None, softcap: Optional[float] = None, chunk_size: int = 64,
    fresh_state: bool = False,
) -> tuple[torch.Tensor, WindowState]:
    """``ops.window_attn.window_attn_chunk`` (same result), on the Triton kernels when they apply.

    ``fresh_state=True`` promises that ``state`` was just made for this input (``pos <= 0``:
    its cache is never visible), which lets the kernels take it without a device sync.
    """
    if window_applies(q, k, v, terraced=terraced, softcap=softcap, sink_logits=sink_logits, sink_k=sink_k,
                      state=state, fresh_state=fresh_state):
        from ..ops.common import check_positive_int
        from .window import window_attn_triton
        check_positive_int("chunk_size", chunk_size)
        return window_attn_triton(q, k, v, window=window, scale=scale, sink_logits=sink_logits, state=state)
    return _window_chunk_torch(q, k, v, window=window, terraced=terraced, scale=scale, sink_logits=sink_logits,
                               sink_k=sink_k, sink_v=sink_v, state=state, softcap=softcap, chunk_size=chunk_size)


def window_attn_sum(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y_global: torch.Tensor, alpha: torch.Tensor, *,
    window: int, terraced: bool = False, scale: Optional[float] = None,
    sink_logits: Optional[torch.Tensor] = None, sink_k: Optional[torch.Tensor] = None,
    sink_v: Optional[torch.Tensor] = None, state: Optional[WindowState] = None,
    softcap: Optional[float] = None, chunk_size: int = 64, fresh_state: bool = False,
) -> Optional[tuple[torch.Tensor, WindowState]]:
    """Lizard's ``y = y_global + alpha[h] * window_attn(q, k, v)`` (B, H, T, Dv) in the dtype of
    v, with the combine fused into the window kernel; None when the kernels do not apply."""
    if not (window_applies(q, k, v, terraced=terraced, softcap=softcap, sink_logits=sink_logits, sink_k=sink_k,
                           state=state, fresh_state=fresh_state)
            and _is_tensor(y_global, alpha) and on_kernel_device(q, y_global, alpha)):
        return None
    from ..ops.common import check_positive_int
    from .window import window_attn_triton
    check_positive_int("chunk_size", chunk_size)
    return window_attn_triton(q, k, v, window=window, scale=scale, sink_logits=sink_logits, state=state,
                              y_global=y_global, alpha=alpha)
