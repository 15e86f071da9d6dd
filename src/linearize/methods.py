"""Named recipes: each method is a choice of layer pieces (see docs/design.md), one dataclass.

A method never carries private math: ``layers.hybrid.HybridAttention`` runs every causal method
from an ``AttentionConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# AttentionConfig lives beside the layer it configures; re-exported here as part of the public API
from .layers.hybrid import (  # noqa: F401
    COMBINES, FEATURE_MAPS, GATES, GLOBAL_RULES, LOCAL_RULES, SINK_KINDS, AttentionConfig,
)
from .layers.lion import LionConfig


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    config: AttentionConfig | LionConfig = field(default_factory=AttentionConfig)  # LionConfig: encoders
    # TrainConfig settings the method needs to learn what it is for (a recipe, not a layer piece):
    # ``TrainConfig.from_dict`` (the CLI, config files) uses them where a setting is not given
    train: dict = field(default_factory=dict)


_GDN = dict(global_rule="delta", feature_map="silu_l2", gate="mamba2", beta="linear", delta_norm=False)


_METHODS: dict[str, Method] = {m.name: m for m in [
    Method("lizard", "Lizard: RoPE-free gated linear attention (Hedgehog, sigmoid gate) + window 128 with 4 sink logits, y = y_gate + alpha * y_window",
           AttentionConfig()),
    Method("lizard-gdn", "Lizard with a gated delta-rule global branch (Gated DeltaNet: L2-normalised SiLU features, "
           "beta = sigmoid(w.x + c) per head, mamba2 decay per head) + window 128 with 4 sink logits, "
           "y = y_delta + alpha * y_window",
           AttentionConfig(**_GDN)),
    # Memory kept open in stage 1: matching the teacher on ordinary text, stage 1 learns to close it.
    # The cache must be trained in (untrained, it finds pass keys at 1K only), and its pairs read at a
    # RoPE distance the teacher knows (at their own, it breaks from 16K): docs/results/recall-recipe-h200.md
    Method("lizard-recall", "lizard-gdn + LoLA's sparse cache: per head, the 256 key/value pairs the delta memory "
           "recalls worst, kept exactly and read as if 1024 tokens back (retrieval beyond the window at constant "
           "memory); trains with the memory open in stage 1 and the attention trained in stage 2",
           AttentionConfig(**_GDN, gate_init=(0.99, 0.9999), sparse_cache=256, sparse_distance=1024),
           train={"stage1_memory": False, "stage2_attention": True}),
    Method("lolcats", "LoLCATs: Hedgehog linear attention + sliding window 64 under one shared normaliser",
           AttentionConfig(global_rule="linear", gate=None, window=64, sinks=0, combine="shared_norm", rope_global=True)),
    Method("liza", "TPTT LiZA: delta-rule linear branch beside window-truncated softmax, mixed by mu (memory as gate)",
           AttentionConfig(global_rule="delta", feature_map="silu_l2", gate=None, window=64, sinks=0, combine="mu", rope_global=True)),
    Method("hedgehog", "Hedgehog: pure linear attention with Hedgehog feature maps (no window)",
           AttentionConfig(global_rule="linear", gate=None, local_rule="none", sinks=0, rope_global=True)),
    Method("t2r", "T2R: pure linear attention with ReLU feature maps (no window)",
           AttentionConfig(global_rule="linear", feature_map="t2r", gate=None, local_rule="none", sinks=0, rope_global=True)),
    Method("liger", "Liger: gated linear attention with the parameter-free pooled gate on the teacher's own keys + window 64",
           AttentionConfig(gate="pool", window=64, sinks=0, rope_global=True, trainable=False)),
    # LION (encoders such as BERT / MiniLM): bidirectional full linear attention = a bidirectional RNN
    Method("lion-lit", "LION-lit (encoders): full bidirectional linear attention, Hedgehog features, row-scaled; "
           "parallel = bidirectional RNN = chunkwise",
           LionConfig(variant="lit")),
    Method("lion-d", "LION-d (encoders): full linear attention with a fixed decay mask lambda_h^|i-j| per head, "
           "lambda_h = sigmoid(a_h) learnable",
           LionConfig(variant="d")),
    Method("lion-s", "LION-s (encoders): full linear attention with a selective mask from per-token gates "
           "a_t = sigmoid(w.x_t + b)",
           LionConfig(variant="s")),
]}


def methods() -> dict[str, str]:
    """Method name -> one-line description."""
    return {name: m.description for name, m in _METHODS.items()}


def _method(method: str) -> Method:
    if method not in _METHODS:
        raise ValueError(f"unknown method {method!r}; available: {sorted(_METHODS)}")
    return _METHODS[method]


def method_config(method: str, **overrides) -> AttentionConfig | LionConfig:
    return _method(method).config.with_overrides(**overrides)


def method_training(method: str) -> dict:
    """The TrainConfig settings ``method`` trains with where none are given (often none)."""
    return dict(_method(method).train)


__all__ = ["COMBINES", "FEATURE_MAPS", "GATES", "GLOBAL_RULES", "LOCAL_RULES", "SINK_KINDS", "AttentionConfig", "Method",
           "method_config", "method_training", "methods"]
