"""The HF-facing linearized attention: the teacher's projections + ``HybridAttention``.

It takes the place of a decoder layer's attention module and keeps the teacher's child modules
under their own names, so parameter names (and LoRA targets) do not change. Registered as the
attention implementation ``"linearize"``, whose mask function hands layers the plain 2-D padding
mask instead of building a T x T mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..layers.hybrid import HybridAttention
from ..methods import AttentionConfig
from .adapters import ArchAdapter
from ..ops.common import known_all_true
from .cache import state_layer

ATTN_IMPLEMENTATION = "linearize"


@dataclass
class TransferRecorder:
    """Collects each layer's MSE(student, teacher) over the valid tokens of one forward pass.

    It fills the ``transfer`` slot of ``LinearizedAttention`` (and of LION's encoder attention):
    stage 1 (``train.transfer``) and the transfer report (``eval.report``) set it."""

    target: str = "heads"  # heads: (B, T, H, d) before o_proj | output: (B, T, hidden) after it
    losses: dict[int, torch.Tensor] = field(default_factory=dict)

    def record(self, layer_idx: int, student: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor | None) -> None:
        """student, teacher: (B, T, ...) in the same layout; valid: (B, T) bool or None."""
        err = (student.float() - teacher.float()).pow(2).flatten(2).mean(-1)  # (B, T)
        if valid is None:
            self.losses[layer_idx] = err.mean()
        else:  # (a masked mean, not err[valid], which would read the mask on the host)
            self.losses[layer_idx] = (err * valid).sum() / valid.sum().clamp_min(1)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class LinearizedAttention(nn.Module):
    def __init__(self, attn: nn.Module, adapter: ArchAdapter, config: AttentionConfig, model_config,
                 rope_far: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``rope_far``: the (cos, sin) tables at position ``config.sparse_distance``, where it is set."""
        super().__init__()
        for name, child in attn.named_children():  # q_proj, k_proj, v_proj, o_proj, qkv_proj, q_norm, k_norm
            self.add_module(name, child)
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.num_heads = model_config.num_attention_heads
        self.num_kv_heads = getattr(model_config, "num_key_value_heads", None) or self.num_heads
        self.adapter = adapter
        self.rotary = adapter.rotary_fn(attn)
        # the teacher's logit soft-cap (Gemma 2; None elsewhere) and its own native window, if any
        self.softcap = getattr(attn, adapter.softcap_attr, None) if adapter.softcap_attr else None
        self.sliding_window = getattr(attn, "sliding_window", None)
        self.hybrid = HybridAttention(config, self.num_heads, self.head_dim, model_config.hidden_size,
                                      scale=float(attn.scaling), softcap=self.softcap)
        ref = next(attn.parameters())
        self.hybrid.to(device=ref.device, dtype=ref.dtype)
        if rope_far is not None:  # rebuilt with the layer, never saved
            self.register_buffer("far_cos", rope_far[0].to(ref.device), persistent=False)
            self.register_buffer("far_sin", rope_far[1].to(ref.device), persistent=False)

    def heads(self, hidden_states: torch.Tensor, position_embeddings):
        """q, k, v without RoPE and q, k with RoPE, all (B, H, T, d) with KV heads expanded, and q
        with RoPE at position ``sparse_distance`` (for the sparse cache; None where not set)."""
        q, k, v = self.adapter.project(self, hidden_states, self.num_heads, self.num_kv_heads, self.head_dim)
        cos, sin = position_embeddings
        q_rope, k_rope = self.rotary(q, k, cos, sin)
        # Under autocast with fp32 weights (how training runs), the fp32 RoPE tables promote q and k
        # to fp32 while v stays in the autocast dtype; the kernels take one dtype (without this the
        # window branch fell back to torch's chunk loop), and SDPA casts them down anyway.
        q_rope, k_rope = q_rope.to(v.dtype), k_rope.to(v.dtype)
        q_far = None
        if hasattr(self, "far_cos"):
            q_far = self.rotary(q, q, self.far_cos, self.far_sin)[0].to(v.dtype)
        g = self.num_heads // self.num_kv_heads
        return q, _repeat_kv(k, g), _repeat_kv(v, g), q_rope, _repeat_kv(k_rope, g), q_far

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        B, T, _ = hidden_states.shape
        q, k, v, q_rope, k_rope, q_far = self.heads(hidden_states, position_embeddings)
        valid = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"a linearized model takes a 2-D padding mask (B, S), got shape {tuple(attention_mask.shape)}")
            valid = attention_mask[:, -T:].bool()
        if self.transfer is not None:
            return self._transfer_forward(q, k, v, q_rope, k_rope, hidden_states, valid, q_far), None
        layer = state_layer(past_key_values, self.layer_idx) if past_key_values is not None else None
        # (no cache, as in training: the kernels need not write the state)
        y, state = self.hybrid(q, k, v, q_rope, k_rope, hidden_states, layer.state if layer else None, valid,
                               need_state=layer is not None, q_far=q_far)
        if layer is not None:
            layer.set_state(state, T)
        return self._output(y, hidden_states.dtype), None

    transfer = None  # a TransferRecorder while stage 1 (or the transfer report) runs

    def _output(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, H, T, d) heads -> (B, T, hidden) through the output projection."""
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1).to(dtype))

    def teacher_heads(self, q_rope, k_rope, v, valid) -> torch.Tensor:
        """The teacher's own softmax attention on these heads, (B, H, T, d): SDPA, no T x T scores."""
        mask = None if valid is None else valid.long()
        y = softmax_attention(self, q_rope, k_rope, v, mask, scaling=self.hybrid.scale,
                              sliding_window=self.sliding_window, softcap=self.softcap)[0]
        return y.transpose(1, 2)

    def _transfer_forward(self, q, k, v, q_rope, k_rope, x, valid, q_far=None) -> torch.Tensor:
        """Stage 1: record MSE(student, teacher) for this layer and pass the teacher's output on
        (teacher forcing), so each layer learns from the teacher's hidden states."""
        with torch.no_grad():
            y_teacher = self.teacher_heads(q_rope, k_rope, v, valid)
            out_teacher = self._output(y_teacher, x.dtype)
        y_student, _ = self.hybrid(q, k, v, q_rope, k_rope, x, None, valid, need_state=False, q_far=q_far)
        if self.transfer.target == "output":
            self.transfer.record(self.layer_idx, self._output(y_student, x.dtype), out_teacher, valid)
        else:
            self.transfer.record(self.layer_idx, y_student.transpose(1, 2), y_teacher.transpose(1, 2), valid)
        return out_teacher


# ---------------------------------------------------------------------- the "linearize" implementation


def padding_mask_only(attention_mask=None, **kwargs):
    """Mask function: the 2-D padding mask as it is (None when nothing is padded)."""
    if attention_mask is not None and attention_mask.dim() == 2 and known_all_true(attention_mask.bool()):
        return None
    return attention_mask


def softmax_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, **kwargs):
    """Kept softmax layers under the "linearize" implementation: SDPA (eager math for soft-capping)
    with causal, sliding-window and padding masks built from the 2-D mask."""
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    B, _, Tq, _ = query.shape
    Tk = key.shape[2]
    plain_causal = (attention_mask is None and softcap is None and Tq == Tk
                    and (sliding_window is None or sliding_window >= Tk))
    if plain_causal:  # the common training/prefill case: let SDPA pick a flash kernel, no mask tensor
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             dropout_p=dropout if module.training else 0.0)
        return out.transpose(1, 2).contiguous(), None
    total = attention_mask.shape[1] if attention_mask is not None else Tk
    q_pos = torch.arange(total - Tq, total, device=query.device)
    k_pos = torch.arange(total - Tk, total, device=query.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < sliding_window)
    mask = mask[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -Tk:].bool()
    if softcap is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             dropout_p=dropout if module.training else 0.0)
    else:
        scores = (query @ key.transpose(-1, -2)) * scaling
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1, dtype=torch.float32).to(query.dtype) @ value
    # rows with no visible key (padding queries) come out NaN: zero them
    out = torch.nan_to_num(out, nan=0.0)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, softmax_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask_only)
