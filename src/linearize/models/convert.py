"""``convert``: swap a causal LM's attention modules for linearized ones, in place."""

from __future__ import annotations

import dataclasses
import math
from numbers import Integral, Real

from torch import nn

from ..methods import method_config
from .adapters import adapter_for
from .attention import ATTN_IMPLEMENTATION, LinearizedAttention


AUTO = "auto"


def auto_softmax_count(spec) -> int | None:
    """K of a ``"auto:K"`` softmax_layers spec (the K layers with the largest stage-1 transfer
    error stay softmax; ``linearize train`` measures them); None for any other spec.

    A malformed ``auto`` spec (``auto``, ``auto:x``, ``auto:0``) is a ValueError naming it."""
    if not isinstance(spec, str) or not spec.strip().lower().startswith(AUTO):
        return None
    _, sep, count = spec.strip().partition(":")
    try:
        k = int(count.strip()) if sep else None
    except ValueError:
        k = None
    if k is None or k <= 0:
        raise ValueError(f"softmax_layers {spec!r}: write auto:K with K a positive integer, the number of layers "
                         "kept as softmax (those with the largest stage-1 transfer error), e.g. auto:2")
    return k


def check_auto_count(k: int, candidates: int) -> None:
    """``auto:K`` must leave at least one of the ``candidates`` linearizable layers linear."""
    if k >= candidates:
        raise ValueError(f"softmax_layers auto:{k} keeps {k} layers as softmax, but the model has only {candidates} "
                         f"layers that can be linearized; K must be at most {candidates - 1}")


def resolve_softmax_layers(spec, num_layers: int) -> list[int]:
    """Layer indices kept as softmax: a list of ints, or a fraction in [0, 1] spread evenly."""
    if spec is None:
        return []
    if auto_softmax_count(spec) is not None:
        raise ValueError(f"softmax_layers {spec!r} is chosen by measure during training (linearize train runs "
                         "stage 1 with every layer linear, then keeps the K worst as softmax); conversion alone "
                         "takes layer indices or a fraction")
    if isinstance(spec, Real) and not isinstance(spec, (bool, Integral)):
        if not 0.0 <= spec <= 1.0:
            raise ValueError(f"softmax_layers as a fraction must be in [0, 1], got {spec!r}")
        n = round(spec * num_layers)
        return sorted({math.floor((i + 0.5) * num_layers / n) for i in range(n)}) if n else []
    try:
        indices = sorted({int(i) for i in spec if isinstance(i, Integral) and not isinstance(i, bool)})
        if len(indices) != len(set(spec)):
            raise TypeError
    except TypeError:
        raise ValueError(f"softmax_layers must be a list of layer indices or a fraction, got {spec!r}") from None
    bad = [i for i in indices if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"softmax_layers {bad} out of range for a model with {num_layers} layers (0..{num_layers - 1})")
    return indices


def native_sliding_layers(model_config, num_layers: int) -> set[int]:
    """Layers that use the model's own sliding window: those ``layer_types`` marks (Gemma 2/3,
    Qwen2/3), or every layer where the config has a ``sliding_window`` and no ``layer_types``
    (Mistral, Phi-3 apply one window to all layers)."""
    layer_types = getattr(model_config, "layer_types", None)
    if layer_types:
        return {i for i, t in enumerate(layer_types) if t == "sliding_attention"}
    if getattr(model_config, "sliding_window", None) is not None and getattr(model_config, "use_sliding_window", True):
        return set(range(num_layers))
    return set()


def convert(model: nn.Module, method: str, *, softmax_layers=None, **overrides) -> nn.Module:
    """Swap the attention of ``model`` (a HF causal LM) for ``method`` in place and return it.

    ``softmax_layers``: layer indices (or a fraction such as 0.5) kept as the original attention.
    ``overrides``: fields of ``methods.AttentionConfig`` (window, sinks, feature_dim, gate, ...).
    Encoders (BERT family) and the ``lion-*`` methods go to ``models.encoder.convert_encoder``
    (overrides are then fields of ``layers.lion.LionConfig``).
    """
    from .encoder import convert_encoder, is_encoder_model, is_lion_method

    if is_lion_method(method) or is_encoder_model(model):
        return convert_encoder(model, method, softmax_layers=softmax_layers, **overrides)
    if getattr(model, "linearize_spec", None) is not None:
        raise ValueError("this model is already converted (linearize_spec is set); convert a fresh teacher")
    adapter = adapter_for(model)
    config = method_config(method, **overrides)
    layers = adapter.layers(model)
    kept = resolve_softmax_layers(softmax_layers, len(layers))
    if config.keep_native_sliding:
        kept = sorted(set(kept) | native_sliding_layers(model.config, len(layers)))
    for i, layer in enumerate(layers):
        if i in kept:
            continue
        attn = getattr(layer, adapter.attention_attr)
        far = adapter.rope_at(model, i, config.sparse_distance) if config.sparse_far_rope else None
        setattr(layer, adapter.attention_attr, LinearizedAttention(attn, adapter, config, model.config, far))
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    model.linearize_spec = {
        "method": method,
        "overrides": dict(overrides),
        "config": dataclasses.asdict(config),
        "softmax_layers": kept,
    }
    return model


def linearized_layers(model: nn.Module) -> list[LinearizedAttention]:
    return [m for m in model.modules() if isinstance(m, LinearizedAttention)]


def linearizable_layers(model: nn.Module, method: str, **overrides) -> list[int]:
    """The layers ``convert(model, method, **overrides)`` would linearize with no softmax_layers
    (every layer, less the native sliding ones when the method keeps them)."""
    layers = adapter_for(model).layers(model)
    native = native_sliding_layers(model.config, len(layers)) if method_config(method, **overrides).keep_native_sliding \
        else set()
    return [i for i in range(len(layers)) if i not in native]


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """{layer index: the attention module of that decoder layer}, e.g. the teacher's before ``convert``
    (``keep_softmax`` puts such modules back)."""
    adapter = adapter_for(model)
    return {i: getattr(layer, adapter.attention_attr) for i, layer in enumerate(adapter.layers(model))}


def keep_softmax(model: nn.Module, layers, teacher_attention: dict[int, nn.Module]) -> nn.Module:
    """Switch the converted ``layers`` of ``model`` back to the teacher's softmax attention, in place.

    ``teacher_attention``: ``attention_modules(model)`` taken before ``convert`` (the linearized
    modules share their projections, so nothing is copied). The checkpoint then records these
    layers among ``softmax_layers`` and reloads with softmax exactly there."""
    adapter = adapter_for(model)
    decoder = adapter.layers(model)
    for i in layers:
        current = getattr(decoder[i], adapter.attention_attr)
        if not isinstance(current, LinearizedAttention):
            raise ValueError(f"layer {i} is not linearized; linearized layers: "
                             f"{sorted(m.layer_idx for m in linearized_layers(model))}")
        if i not in teacher_attention:
            raise ValueError(f"no teacher attention module given for layer {i}")
        setattr(decoder[i], adapter.attention_attr, teacher_attention[i])
    spec = model.linearize_spec
    spec["softmax_layers"] = sorted(set(spec["softmax_layers"]) | {int(i) for i in layers})
    return model
