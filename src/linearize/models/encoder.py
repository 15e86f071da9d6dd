"""Encoders (BERT family) converted to LION: the adapter, ``LionSelfAttention``, conversion and
sentence embeddings.

``convert(model, "lion-lit" | "lion-d" | "lion-s")`` on a ``BertModel`` (the bundled
``minilm-l6`` sentence encoder, or any BERT checkpoint) replaces each layer's
``attention.self`` by a ``LionSelfAttention`` that keeps the teacher's ``query``, ``key`` and
``value`` projections under their own names (so parameter names, the base fingerprint and LoRA
targets do not change) and adds a ``layers.lion.LionAttention`` under ``.lion``. The output
projection (``attention.output.dense``) and everything after it stay as they are. Kept softmax
layers (``softmax_layers``) run bidirectional SDPA from the 2-D padding mask.

The model's attention implementation becomes ``"linearize_encoder"``, whose mask function hands
every layer the plain (B, T) padding mask (no T x T mask is built).

Positions beyond the teacher's absolute position table (512 for BERT and MiniLM): LION needs no
positions (-d and -s have their decay masks), but the embeddings still add one learned absolute
position per token. With ``positions="clamp"`` (the default) tokens past the table reuse its last
entry (position ids 0, 1, ..., 511, 511, 511, ...), so any length runs and the first 512 tokens
are embedded exactly as the teacher embeds them; ``positions="error"`` refuses such inputs
instead. Explicit ``position_ids`` are passed through untouched.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..layers.lion import LionAttention, LionConfig
from ..methods import method_config, methods
from ..ops.lion.naive import check_valid
from .attention import padding_mask_only

ENCODER_ATTN_IMPLEMENTATION = "linearize_encoder"


@dataclass(frozen=True)
class EncoderAdapter:
    """Where a BERT-family encoder keeps its layers, self-attention and embeddings."""

    family: str
    layers_path: str = "encoder.layer"
    attention_path: str = "attention.self"  # from one layer to the module LION replaces
    embeddings_path: str = "embeddings"

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers_path)

    def embeddings(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.embeddings_path)


_ENCODER_ADAPTERS: dict[str, EncoderAdapter] = {"bert": EncoderAdapter("bert")}


def lion_methods() -> list[str]:
    return sorted(m for m in methods() if m.startswith("lion-"))


def is_lion_method(method: object) -> bool:
    return isinstance(method, str) and method.startswith("lion-")


def is_encoder_model(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in _ENCODER_ADAPTERS and not getattr(config, "is_decoder", False)


def encoder_adapter_for(model: nn.Module) -> EncoderAdapter:
    if not is_encoder_model(model):
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"LION methods convert encoders; {type(model).__name__} (model_type {model_type!r}) is not "
                         f"one: supported encoders: {sorted(_ENCODER_ADAPTERS)} (a BertModel such as 'minilm-l6')")
    if not hasattr(model, "encoder") or not hasattr(model, "embeddings"):
        raise ValueError(f"convert takes the bare encoder (BertModel), got {type(model).__name__}; "
                         "pass its .bert (or load it with AutoModel)")
    return _ENCODER_ADAPTERS[model.config.model_type]


def _padding_mask(attention_mask: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """(B, T) bool from the mask the "linearize_encoder" implementation hands layers."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[-1] != T:
        raise ValueError(f"a LION encoder layer takes a 2-D padding mask (B, {T}), got shape {tuple(attention_mask.shape)}")
    return check_valid(attention_mask, attention_mask.shape[0], T)  # bool, or names what is wrong


def bidirectional_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                          scale: float, dropout: float = 0.0) -> torch.Tensor:
    """The teacher's attention: softmax over every valid key, (B, H, T, d) -> (B, H, T, d) via SDPA."""
    mask = None if valid is None else valid[:, None, None, :]
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout)
    return torch.nan_to_num(y, nan=0.0) if valid is not None else y  # a row with no valid key gives NaN


class LionSelfAttention(nn.Module):
    """Takes the place of ``BertSelfAttention``: the teacher's q/k/v projections + LION.

    forward(hidden_states (B, T, hidden), attention_mask (B, T) or None) -> ((B, T, H*d), None),
    the same contract as the module it replaces (the output projection follows in BertSelfOutput).
    """

    transfer = None  # a models.attention.TransferRecorder while stage 1 runs

    def __init__(self, attn: nn.Module, config: LionConfig, model_config, layer_idx: int):
        super().__init__()
        self.query, self.key, self.value = attn.query, attn.key, attn.value
        self.num_heads = model_config.num_attention_heads
        self.head_dim = model_config.hidden_size // self.num_heads
        self.scaling = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        self.layer_idx = layer_idx
        self.lion = LionAttention(config, self.num_heads, self.head_dim, model_config.hidden_size, self.scaling)
        ref = attn.query.weight
        self.lion.to(device=ref.device, dtype=ref.dtype)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, hidden) -> q, k, v (B, H, T, d)."""
        B, T, _ = x.shape
        return tuple(p(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
                     for p in (self.query, self.key, self.value))

    def merge(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, H, T, d) -> (B, T, H*d)."""
        B, _, T, _ = y.shape
        return y.transpose(1, 2).reshape(B, T, -1).to(dtype)

    def teacher_heads(self, q, k, v, valid) -> torch.Tensor:
        """The replaced softmax attention on these heads (dropout off), (B, H, T, d)."""
        return bidirectional_softmax(q, k, v, valid, self.scaling)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, form: str | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
        valid = _padding_mask(attention_mask, hidden_states.shape[1])
        q, k, v = self.heads(hidden_states)
        if self.transfer is not None:
            return self._transfer_forward(q, k, v, hidden_states, valid), None
        y = self.lion(q, k, v, hidden_states, valid, form=form)
        return self.merge(y, hidden_states.dtype), None

    def _transfer_forward(self, q, k, v, x, valid) -> torch.Tensor:
        """Stage 1: record MSE(LION heads, softmax heads) and pass the teacher's output on."""
        with torch.no_grad():
            y_teacher = self.teacher_heads(q, k, v, valid)
        y_student = self.lion(q, k, v, x, valid)
        self.transfer.record(self.layer_idx, y_student.transpose(1, 2), y_teacher.transpose(1, 2), valid)
        return self.merge(y_teacher, x.dtype)


def encoder_softmax_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Kept softmax layers under "linearize_encoder": bidirectional SDPA from the 2-D padding mask."""
    valid = None if attention_mask is None else _padding_mask(attention_mask, key.shape[2])
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    y = bidirectional_softmax(query, key, value, valid, scale, dropout if module.training else 0.0)
    return y.transpose(1, 2).contiguous(), None


AttentionInterface.register(ENCODER_ATTN_IMPLEMENTATION, encoder_softmax_attention)
AttentionMaskInterface.register(ENCODER_ATTN_IMPLEMENTATION, padding_mask_only)


def _position_policy(module: nn.Module, args, kwargs):
    """Forward pre-hook on the embeddings: inputs longer than the position table (see the module
    docstring) get clamped position ids, or a clear error."""
    ref = kwargs.get("input_ids")
    ref = kwargs.get("inputs_embeds") if ref is None else ref
    if ref is None or kwargs.get("position_ids") is not None:
        return None
    T, limit = ref.shape[1], module.position_embeddings.num_embeddings
    if T <= limit:
        return None
    if module.linearize_positions == "error":
        raise ValueError(f"input of {T} tokens is longer than the encoder's {limit} absolute positions "
                         "(convert with positions='clamp' to run it, positions past the table reusing the last one)")
    kwargs["position_ids"] = torch.arange(T, device=ref.device).clamp_(max=limit - 1).unsqueeze(0)
    return args, kwargs


def convert_encoder(model: nn.Module, method: str, *, softmax_layers=None, **overrides) -> nn.Module:
    """Swap the self-attention of a BERT-family encoder for LION (``method`` = lion-lit | lion-d | lion-s)
    in place and return it. ``softmax_layers``: layer indices (or a fraction) kept as softmax;
    ``overrides``: fields of ``layers.lion.LionConfig`` (feature_map, chunk_size, form, positions, ...)."""
    from .convert import resolve_softmax_layers

    if getattr(model, "linearize_spec", None) is not None:
        raise ValueError("this model is already converted (linearize_spec is set); convert a fresh teacher")
    if not is_lion_method(method):
        if method in methods():
            raise ValueError(f"method {method!r} is for causal LMs; an encoder converts with one of {lion_methods()}")
        raise ValueError(f"unknown method {method!r}; encoders convert with one of {lion_methods()}")
    config = method_config(method, **overrides)
    expected = method.removeprefix("lion-")
    if config.variant != expected:
        raise ValueError(f"variant {config.variant!r} contradicts method {method!r}; use lion-{config.variant} instead")
    adapter = encoder_adapter_for(model)
    layers = adapter.layers(model)
    kept = resolve_softmax_layers(softmax_layers, len(layers))
    for i, layer in enumerate(layers):
        if i in kept:
            continue
        parent_path, _, child = adapter.attention_path.rpartition(".")
        parent = layer.get_submodule(parent_path) if parent_path else layer
        setattr(parent, child, LionSelfAttention(getattr(parent, child), config, model.config, i))
    model.config._attn_implementation = ENCODER_ATTN_IMPLEMENTATION
    embeddings = adapter.embeddings(model)
    embeddings.linearize_positions = config.positions
    embeddings.register_forward_pre_hook(_position_policy, with_kwargs=True)
    model.linearize_spec = {
        "method": method,
        "overrides": dict(overrides),
        "config": dataclasses.asdict(config),
        "softmax_layers": kept,
    }
    return model


def lion_layers(model: nn.Module) -> list[LionSelfAttention]:
    return [m for m in model.modules() if isinstance(m, LionSelfAttention)]


def lion_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The new parameters (feature maps, decays, gates): what stage 1 trains."""
    return [p for m in lion_layers(model) for p in m.lion.parameters()]


# ------------------------------------------------------------------------------ sentence embeddings


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, D) hidden states -> (B, D): the mean over real tokens (sentence-transformers' pooling)."""
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


def sentence_embeddings(model: nn.Module, batch: dict, normalize: bool = True) -> torch.Tensor:
    """Pooled (and L2-normalised) embeddings (B, D) of a tokenized batch, differentiable.

    all-MiniLM-L6-v2's recipe: mean pooling over the last hidden states, then L2 normalisation.
    """
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                token_type_ids=batch.get("token_type_ids"))
    e = mean_pool(out.last_hidden_state, batch["attention_mask"]).float()
    return F.normalize(e, dim=-1) if normalize else e


@torch.no_grad()
def embed(model: nn.Module, tokenizer, sentences: Sequence[str], *, batch_size: int = 64, max_length: int = 256,
          device: torch.device | str | None = None, normalize: bool = True) -> torch.Tensor:
    """Sentence embeddings (N, D) in fp32 on the CPU, in the order of ``sentences``.

    Sentences are batched by length (less padding) and truncated to ``max_length`` tokens
    (256: all-MiniLM-L6-v2's own limit).
    """
    if isinstance(sentences, str) or not all(isinstance(s, str) for s in sentences):
        raise ValueError("sentences must be a sequence of strings")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    out = torch.empty(len(sentences), model.config.hidden_size)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = tokenizer([sentences[i] for i in idx], padding=True, truncation=True, max_length=max_length,
                          return_tensors="pt")
        batch = {k: v.to(device) for k, v in batch.items()}
        out[idx] = sentence_embeddings(model, batch, normalize).cpu()
    model.train(was_training)
    return out


def nn_agreement(student: torch.Tensor, teacher: torch.Tensor) -> float:
    """Share of rows whose nearest neighbour (cosine, itself excluded) is the same for both (N, D)."""
    def nearest(e):
        e = F.normalize(e.double(), dim=-1)
        sim = e @ e.T
        sim.fill_diagonal_(-math.inf)
        return sim.argmax(-1)

    if student.shape[0] < 2:
        raise ValueError(f"nearest-neighbour agreement needs at least 2 sentences, got {student.shape[0]}")
    return float((nearest(student) == nearest(teacher)).double().mean())
