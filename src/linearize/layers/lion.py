"""LION attention for encoders: feature maps + decay + the bidirectional op (``ops.lion``).

Inputs are the teacher's projected heads ``q, k, v: (B, H, T, d)``, the layer input
``x: (B, T, hidden)`` (for the selective gate) and ``valid: (B, T)`` bool or None; the output is
``(B, H, T, d)`` before the output projection.

  lit  no decay: full linear attention (M = 1)
  d    a fixed decay per head, λ_h = sigmoid(a_h), a_h learnable: M_ij = λ_h^{|i-j|}
  s    a selective gate per token and head, a_t = sigmoid(w_h . x_t + c_h) (``layers.gates.SigmoidGate``)

Feature maps are those of ``layers.feature_maps`` (Hedgehog by default, separate for q and k),
positive so that the scaled form (each row divided by its sum) is a proper average like the
softmax it replaces. Hedgehog's default width here is F = 2d (each half as wide as the head), so
its identity initialisation keeps every query/key coordinate; with F = d (the causal methods'
default) the identity drops half of them, and on MiniLM stage 1 ended with a 30% higher transfer
MSE (docs/results/lion-minilm.md).

Initialisation (ours): the feature maps start at the identity-like map; λ_h and the gate start
spread evenly over ``decay_init`` = (0.95, 0.99) across heads with the gate's input weights at 0,
so -d and -s start as mildly local versions of -lit and every head keeps long memory.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import check_positive_int, compute_dtype, softmax_scale
from ..ops.lion import lion_chunk, lion_parallel, lion_recurrent
from .feature_maps import FEATURE_MAP_INITS, HedgehogFeatureMap, T2RFeatureMap
from .gates import SigmoidGate, _head_gammas, _logit

LION_VARIANTS = ("lit", "d", "s")
LION_FORMS = ("chunk", "parallel", "recurrent")
LION_FEATURE_MAPS = ("hedgehog", "t2r")
POSITION_POLICIES = ("clamp", "error")


@dataclass
class LionConfig:
    """Everything that defines a LION layer; overrides of ``convert(model, "lion-*", ...)`` land here."""

    variant: str = "s"                         # lit | d | s
    feature_map: str = "hedgehog"              # hedgehog | t2r
    feature_dim: int | None = None             # F; None = 2 * head_dim for Hedgehog (F/2 = d), head_dim for T2R
    feature_init: str = "identity"
    scaled: bool = True                        # divide each row by its sum (the softmax-like form)
    decay_init: tuple[float, float] = (0.95, 0.99)  # initial λ_h (d) / a_t (s), spread over the heads
    form: str = "chunk"                        # which of the three equivalent forms the layer runs
    chunk_size: int = 64
    eps: float = 1e-6
    positions: str = "clamp"                   # inputs longer than the teacher's absolute positions:
    #                                            clamp = tokens past the last position reuse it; error = refuse
    sinks: int = 0                             # the first `sinks` tokens ([CLS]) get exact softmax scores
    window: int = 0                            # so do the tokens within `window` positions on either side

    def validate(self) -> "LionConfig":
        for name, allowed in (("variant", LION_VARIANTS), ("feature_map", LION_FEATURE_MAPS),
                              ("feature_init", FEATURE_MAP_INITS), ("form", LION_FORMS),
                              ("positions", POSITION_POLICIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.scaled, bool):
            raise ValueError(f"scaled must be a bool, got {self.scaled!r}")
        check_positive_int("chunk_size", self.chunk_size)
        if not (isinstance(self.sinks, int) and not isinstance(self.sinks, bool) and self.sinks >= 0):
            raise ValueError(f"sinks must be an int >= 0 (how many leading tokens get exact softmax), got {self.sinks!r}")
        if not (isinstance(self.window, int) and not isinstance(self.window, bool) and self.window >= 0):
            raise ValueError(f"window must be an int >= 0 (exact softmax within that distance), got {self.window!r}")
        if self.feature_dim is not None:
            check_positive_int("feature_dim", self.feature_dim)
            if self.feature_map == "hedgehog" and self.feature_dim % 2:
                raise ValueError(f"feature_dim counts both Hedgehog halves and must be even, got {self.feature_dim}")
        lo_hi = self.decay_init
        if not (isinstance(lo_hi, tuple) and len(lo_hi) == 2 and all(isinstance(x, (int, float)) for x in lo_hi)
                and 0.0 < lo_hi[0] <= lo_hi[1] < 1.0):
            raise ValueError(f"decay_init must be a pair (lo, hi) with 0 < lo <= hi < 1, got {lo_hi!r}")
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            raise ValueError(f"eps must be a non-negative number, got {self.eps!r}")
        return self

    def with_overrides(self, **overrides) -> "LionConfig":
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown override(s) {unknown}; allowed: {sorted(names)}")
        if "decay_init" in overrides and isinstance(overrides["decay_init"], list):
            overrides["decay_init"] = tuple(overrides["decay_init"])
        return dataclasses.replace(self, **overrides).validate()


class LionAttention(nn.Module):
    """One LION layer's new parts: φ_q, φ_k, and the decay of its variant."""

    def __init__(self, config: LionConfig, num_heads: int, head_dim: int, hidden_size: int,
                 scale: float | None = None):
        super().__init__()
        self.config = config = config.validate()
        self.num_heads, self.head_dim = check_positive_int("num_heads", num_heads), check_positive_int("head_dim", head_dim)
        self.hidden_size = check_positive_int("hidden_size", hidden_size)
        maps = {"hedgehog": HedgehogFeatureMap, "t2r": T2RFeatureMap}
        feature_dim = config.feature_dim or (2 * head_dim if config.feature_map == "hedgehog" else head_dim)
        self.phi_q = maps[config.feature_map](num_heads, head_dim, feature_dim, config.feature_init)
        self.phi_k = maps[config.feature_map](num_heads, head_dim, feature_dim, config.feature_init)
        if config.variant == "d":
            self.decay_logit = nn.Parameter(_logit(_head_gammas(num_heads, config.decay_init)).float())
        elif config.variant == "s":
            self.gate = SigmoidGate(hidden_size, num_heads, config.decay_init)
        if config.sinks or config.window:
            self.scale = softmax_scale(scale, head_dim)
            # log of the attention mass that the non-sink keys would get under softmax (per query
            # token and head), estimated from the token; starts at log 32, about a sentence's worth of
            # keys with score 0
            self.rest_logit = nn.Linear(hidden_size, num_heads)
            nn.init.zeros_(self.rest_logit.weight)
            nn.init.constant_(self.rest_logit.bias, math.log(32.0))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor | None:
        """None (lit), log λ_h (H,) (d) or log a_t (B, H, T) (s), all <= 0, in fp32."""
        if self.config.variant == "d":
            return F.logsigmoid(self.decay_logit.float())
        if self.config.variant == "s":
            return self.gate(x)
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                valid: torch.Tensor | None = None, form: str | None = None) -> torch.Tensor:
        """(B, H, T, d) heads -> (B, H, T, d) LION output; ``form`` overrides ``config.form``."""
        form = self.config.form if form is None else form
        if form not in LION_FORMS:
            raise ValueError(f"form must be one of {LION_FORMS}, got {form!r}")
        kw = {"valid": valid, "scaled": self.config.scaled, "eps": self.config.eps}
        if form == "chunk":
            kw["chunk_size"] = self.config.chunk_size
        op = {"chunk": lion_chunk, "parallel": lion_parallel, "recurrent": lion_recurrent}[form]
        if not (self.config.sinks or self.config.window):
            y, _ = op(self.phi_q(q), self.phi_k(k), v, self.log_decay(x), **kw)
            return y
        return self._with_exact(op, kw, q, k, v, x, valid)

    def _with_exact(self, op, kw, q, k, v, x, valid) -> torch.Tensor:
        """Exact softmax scores for the first n tokens (sinks) and for the tokens within w of the
        query (window), LION for the rest, mixed as softmax would mix them:

            y_i = Σ_{j exact} π_ij v_j + π_i,rest LION_i(keys >= n)
            π_i = softmax([q_i.k_j * scale for the exact j], r_i)

        The exact keys keep the teacher's own scores (BERT heads put much of their mass on [CLS]
        and on the previous or next token, which symmetric decays cannot single out). The rest
        enter as one pseudo-key whose logit r_i, a linear function of the token, stands for the
        log of their softmax mass: φq.φk is normalised per query and says nothing about it.
        LION runs its scaled form over every key but the sinks (window keys included).
        """
        B, H, T, _ = q.shape
        n, w = min(self.config.sinks, T), self.config.window
        fk = self.phi_k(k)
        fk = torch.cat([torch.zeros_like(fk[:, :, :n]), fk[:, :, n:]], dim=2)
        rest, _ = op(self.phi_q(q), fk, v, self.log_decay(x), **kw)
        acc = compute_dtype(q)
        qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
        keep = torch.ones(B, T, dtype=torch.bool, device=q.device) if valid is None else valid
        logits, values = [], []
        if n:  # (B, H, T, n) against the first n keys
            logits.append((qa @ ka[:, :, :n].transpose(-1, -2) * self.scale).masked_fill(~keep[:, None, None, :n],
                                                                                        float("-inf")))
        if w:  # (B, H, T, 2w + 1) against keys i - w .. i + w; outside [n, T) or padding: no key
            win = torch.nn.functional.pad(torch.stack([ka, va], 0), (0, 0, w, w)).unfold(3, 2 * w + 1, 1)
            j = torch.arange(T, device=q.device)[:, None] + torch.arange(-w, w + 1, device=q.device)
            ok = (j >= n) & (j < T)
            ok = ok & F.pad(keep, (w, w)).unfold(1, 2 * w + 1, 1)                       # (B, T, 2w + 1)
            logits.append(torch.einsum("bhtd,bhtdw->bhtw", qa, win[0]).mul(self.scale)
                          .masked_fill(~ok[:, None], float("-inf")))
            values.append(win[1])
        r = self.rest_logit(x.to(self.rest_logit.weight.dtype)).to(acc).transpose(1, 2).unsqueeze(-1)
        pi = torch.softmax(torch.cat(logits + [r], dim=-1), dim=-1)
        y = pi[..., -1:] * rest.to(acc)
        if n:
            y = y + pi[..., :n] @ va[:, :, :n]
        if w:
            y = y + torch.einsum("bhtw,bhtdw->bhtd", pi[..., n:-1], values[0])
        if valid is not None:  # a padded query reads nothing, as in the ops
            y = y * valid[:, None, :, None]
        return y.to(v.dtype)

    def extra_repr(self) -> str:
        c = self.config
        return f"variant={c.variant}, feature_map={c.feature_map}, scaled={c.scaled}, form={c.form}"
