"""Thin per-architecture adapters: where the attention modules are and how to get q, k, v.

HF's v5 attention modules share one shape (q/k/v/o projections or a fused ``qkv_proj``, optional
``q_norm``/``k_norm``, ``scaling``, ``head_dim``), and each modeling file has its own
``apply_rotary_pos_emb`` (partial rotary included). An adapter names what differs; most
families need nothing beyond the defaults. ``register_adapter`` adds an architecture.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class ArchAdapter:
    """How linearize finds and reads one family's attention.

    layers_path: dotted path from the CausalLM to the decoder layer list.
    attention_attr: the attention module's attribute name on a decoder layer.
    fused_qkv: name of a fused q/k/v projection (Phi-3's ``qkv_proj``), or None.
    rotary: ``(q, k, cos, sin) -> (q, k)``; None = the modeling module's ``apply_rotary_pos_emb``.
    softcap_attr: the attention attribute holding a logit soft-cap the teacher applies (Gemma 2), or
        None where the modeling code has the attribute but never applies it (Gemma 3).
    """

    family: str
    layers_path: str = "model.layers"
    attention_attr: str = "self_attn"
    fused_qkv: str | None = None
    rotary: Callable | None = None
    softcap_attr: str | None = "attn_logit_softcapping"

    def layers(self, model: nn.Module) -> nn.ModuleList:
        obj = model
        for part in self.layers_path.split("."):
            obj = getattr(obj, part)
        return obj

    def rotary_fn(self, attn: nn.Module) -> Callable:
        if self.rotary is not None:
            return self.rotary
        fn = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
        if fn is None:
            raise ValueError(f"{type(attn).__name__}'s module has no apply_rotary_pos_emb; "
                             "register an adapter with rotary=...")
        return fn

    def rope_at(self, model: nn.Module, layer_idx: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables, (1, 1, rotary dim), that the model's rotary embedding gives layer
        ``layer_idx`` at ``position`` (its scaling included; per layer type where it has several)."""
        owner = model  # the decoder that holds the layers holds the rotary embedding
        for part in self.layers_path.split(".")[:-1]:
            owner = getattr(owner, part)
        rotary = getattr(owner, "rotary_emb", None)
        if rotary is None:
            raise ValueError(f"{type(owner).__name__} has no rotary_emb; sparse_distance needs the model's RoPE")
        ref = next(iter(rotary.buffers()), None)
        x = torch.zeros(1, 1, 1, device=None if ref is None else ref.device)
        pos = torch.tensor([[position]], device=x.device)
        if getattr(rotary, "layer_types", None):  # Gemma 3: one table per layer type (sliding, full)
            return rotary(x, pos, owner.config.layer_types[layer_idx])
        return rotary(x, pos)

    def project(self, attn: nn.Module, x: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
        """x (B, T, hidden) -> q (B, H, T, d), k and v (B, Hkv, T, d), QK-norm applied if the model has it."""
        B, T, _ = x.shape
        if self.fused_qkv:
            qkv = getattr(attn, self.fused_qkv)(x)
            q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q, k, v = (t.view(B, T, -1, head_dim) for t in (q, k, v))
        if getattr(attn, "q_norm", None) is not None:  # Qwen3, Gemma 3: norm per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


_ADAPTERS: dict[str, ArchAdapter] = {}


def register_adapter(model_type: str | tuple[str, ...], adapter: ArchAdapter) -> None:
    """Register (or replace) the adapter for HF ``config.model_type`` value(s)."""
    if not isinstance(adapter, ArchAdapter):
        raise ValueError(f"adapter must be an ArchAdapter, got {type(adapter).__name__}")
    for name in (model_type,) if isinstance(model_type, str) else model_type:
        _ADAPTERS[name] = adapter


def supported_architectures() -> list[str]:
    return sorted(_ADAPTERS)


def adapter_for(model: nn.Module) -> ArchAdapter:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _ADAPTERS:
        raise ValueError(f"unsupported architecture {model_type!r}; supported: {', '.join(supported_architectures())} "
                         "(linearize.register_adapter adds one)")
    return _ADAPTERS[model_type]


register_adapter("llama", ArchAdapter("llama"))
register_adapter("mistral", ArchAdapter("mistral"))
register_adapter(("qwen2", "qwen3"), ArchAdapter("qwen"))
register_adapter("phi3", ArchAdapter("phi3", fused_qkv="qkv_proj"))
register_adapter("gemma2", ArchAdapter("gemma"))
# Gemma 3 keeps attn_logit_softcapping in its config and module but its attention never passes it on
register_adapter("gemma3_text", ArchAdapter("gemma3", softcap_attr=None))
