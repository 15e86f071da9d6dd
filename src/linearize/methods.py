"""Named recipes: each method is a choice of layer pieces (see docs/design.md), one dataclass.

A method never carries private math: ``layers.hybrid.HybridAttention`` runs every causal method
from an ``AttentionConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .layers.lion import LionConfig

FEATURE_MAPS = ("hedgehog", "t2r", "silu_l2")
GLOBAL_RULES = ("linear", "gated", "delta")
LOCAL_RULES = ("none", "window", "terraced", "softmax")
COMBINES = ("sum", "shared_norm", "mu")
GATES = ("sigmoid", "mamba2", "gla", "pool")
SINK_KINDS = ("logits", "kv")


@dataclass
class AttentionConfig:
    """Everything that defines a linearized attention layer. Overrides of ``convert`` land here."""

    global_rule: str = "gated"          # linear | gated | delta
    feature_map: str = "hedgehog"       # hedgehog | t2r | silu_l2 (delta rule: L2-normalised SiLU)
    feature_dim: int | None = None      # F; None = head_dim
    feature_init: str = "identity"
    gate: str | None = "sigmoid"        # for global_rule == "gated"
    gate_init: tuple[float, float] = (0.95, 0.99)
    local_rule: str = "window"          # none | window | terraced | softmax (full, cache grows)
    window: int = 128
    sinks: int = 4
    sink_kind: str = "logits"           # logits (Lizard v2) | kv (Lizard v1)
    combine: str = "sum"                # sum: y_g + alpha*y_w | shared_norm: LoLCATs | mu: (1-mu) y_w + mu y_g
    rope_global: bool = False           # RoPE on the linear branch's q/k (Lizard: off; LoLCATs: on)
    rope_window: bool = True
    delta_order: int = 1                # DeltaProduct order n (1 = delta rule)
    mu: float = 0.5                     # liza mixing weight (a buffer, set by the training schedule)
    alpha_init: float = 1.0             # Lizard's per-head window weight
    window_factor_init: float = 0.0     # LoLCATs' per-head mixing logit (sigmoid(0) = 0.5)
    chunk_size: int = 64
    keep_native_sliding: bool = False   # leave a model's own sliding-window layers as they are
    trainable: bool = True              # False: the new modules are fixed (liger), stage 1 has nothing to learn

    def validate(self) -> "AttentionConfig":
        def one_of(name, allowed):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")

        one_of("global_rule", GLOBAL_RULES)
        one_of("feature_map", FEATURE_MAPS)
        one_of("local_rule", LOCAL_RULES)
        one_of("combine", COMBINES)
        one_of("sink_kind", SINK_KINDS)
        one_of("gate", GATES + (None,))
        if self.global_rule == "gated" and self.gate is None:
            raise ValueError(f"global_rule 'gated' needs a gate, one of {GATES}")
        if self.global_rule != "gated" and self.gate is not None:
            raise ValueError(f"gate {self.gate!r} applies only to global_rule 'gated', not {self.global_rule!r}")
        for name in ("keep_native_sliding", "trainable", "rope_global", "rope_window"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        lo_hi = self.gate_init
        if not (isinstance(lo_hi, tuple) and len(lo_hi) == 2 and all(isinstance(x, (int, float)) for x in lo_hi)):
            raise ValueError(f"gate_init must be a pair (lo, hi) of gamma values in (0, 1), got {lo_hi!r}")
        for name in ("window", "chunk_size", "delta_order"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be a non-negative int, got {self.sinks!r}")
        if self.feature_dim is not None and (not isinstance(self.feature_dim, int) or self.feature_dim <= 0):
            raise ValueError(f"feature_dim must be a positive int or None, got {self.feature_dim!r}")
        if self.global_rule == "delta" and self.feature_map != "silu_l2":
            raise ValueError(f"global_rule 'delta' needs feature_map 'silu_l2', got {self.feature_map!r}")
        if self.feature_map == "silu_l2" and self.global_rule != "delta":
            raise ValueError(f"feature_map 'silu_l2' is the delta rule's; global_rule is {self.global_rule!r}")
        if self.combine == "shared_norm" and (self.global_rule != "linear" or self.local_rule not in ("window", "terraced")):
            raise ValueError("combine 'shared_norm' (LoLCATs) needs global_rule 'linear' and a window local_rule, "
                             f"got {self.global_rule!r} and {self.local_rule!r}")
        if self.combine == "mu" and self.local_rule == "none":
            raise ValueError("combine 'mu' mixes a softmax branch with the linear one; local_rule is 'none'")
        if not 0.0 <= float(self.mu) <= 1.0:
            raise ValueError(f"mu must be in [0, 1], got {self.mu!r}")
        return self

    def with_overrides(self, **overrides) -> "AttentionConfig":
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown override(s) {unknown}; allowed: {sorted(names)}")
        if "gate_init" in overrides:
            overrides["gate_init"] = tuple(overrides["gate_init"])
        return dataclasses.replace(self, **overrides).validate()


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    config: AttentionConfig | LionConfig = field(default_factory=AttentionConfig)  # LionConfig: encoders


_METHODS: dict[str, Method] = {m.name: m for m in [
    Method("lizard", "Lizard: RoPE-free gated linear attention (Hedgehog, sigmoid gate) + window 128 with 4 sink logits, y = y_gate + alpha * y_window",
           AttentionConfig()),
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


def method_config(method: str, **overrides) -> AttentionConfig | LionConfig:
    if method not in _METHODS:
        raise ValueError(f"unknown method {method!r}; available: {sorted(_METHODS)}")
    return _METHODS[method].config.with_overrides(**overrides)
