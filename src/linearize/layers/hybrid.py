"""The one hybrid attention that runs every causal method: combine(global branch, local branch).

Inputs are the teacher's projected heads, already expanded for GQA:
``q, k: (B, H, T, d)`` without RoPE, ``q_rope, k_rope`` the same after RoPE, ``v: (B, H, T, d)``,
``x: (B, T, hidden)`` the layer input (for gates) and ``valid: (B, T)`` bool or None (False at
padding). Output ``(B, H, T, d)`` before the output projection, plus the new state.

  global  linear | gated (Lizard) | delta (TPTT's delta rule / DeltaProduct; with a scalar gate,
          the gated delta rule of Gated DeltaNet)
  local   none | window | terraced | softmax (full, its cache grows)
  combine sum: y_g + alpha_h * y_w (Lizard) | shared_norm: one normaliser (LoLCATs, its own op)
          | mu: (1 - mu) * y_w + mu * y_g (TPTT's memory as gate)

Sparse cache (LoLA, ``sparse_cache = M > 0``, beside a sliding window): when pair s leaves the
window (at query t = s + w) it is scored by its self-recall error against the global state of
that step (the global op run once more, with the key features of the pairs leaving as queries):
``sparse_score`` "relative", ||v_s - read(S_t, phi(k_s))|| / ||v_s||, the share of the value the
memory has lost, or "error", LoLA's ||v_s - read(S_t, phi(k_s))||, which also ranks a value by its
norm (on repeated text, large-norm filler the memory half-forgets between repeats outranks a rare
key); the M highest-scoring pairs so far are attended exactly, in the window's softmax
(``ops.sparse_window``). Training-free: it adds no parameters. LoLA also rescores
its cache at every step, a sequential, path-dependent rule no chunk form could reproduce; a score
fixed when given makes the cache the top M of a growing set, the same for every split of the
input, so prefill in any pieces and cached decode equal the full forward. The state carries the
last w key features and values for the scoring. ``sparse_distance = D`` reads every cached pair as
if D tokens back ((R_D q) . k, k without RoPE; the caller passes R_D q as ``q_far``): LoLA's own
distances soon pass any the teacher was trained on.

Padding: keys and values at padding are zeroed for the linear branches (and their gates set to
1), and left padding is put at negative window positions, so a padded row gets exactly the
outputs it gets alone. The state is a dict of op states; nothing in it grows with T except the
full-softmax local branch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import known_all_true
from ..ops.delta import delta_product_chunk, delta_product_recurrent
from ..ops.gla import gla_chunk, gla_recurrent
from ..ops.linear_attn import linear_attn_chunk, linear_attn_recurrent
from ..ops.lolcats_attn import LolcatsState, lolcats_attn_chunk, lolcats_attn_recurrent
from ..ops.lizard_attn import lizard_attention_fused
from ..ops.sparse_window import fresh_state as fresh_sparse_state
from ..ops.sparse_window import sparse_window_attn_chunk, sparse_window_attn_recurrent
from ..ops.window_attn import (
    WindowState, cache_len, check_softcap, soft_cap, window_attn_chunk, window_attn_recurrent, window_attn_sum,
)
from .feature_maps import HedgehogFeatureMap, T2RFeatureMap
from .gates import GLAGate, Mamba2Gate, PoolGate, SigmoidGate
from .sinks import Sinks

FEATURE_MAPS = ("hedgehog", "t2r", "silu_l2")
GLOBAL_RULES = ("linear", "gated", "delta")
LOCAL_RULES = ("none", "window", "terraced", "softmax")
COMBINES = ("sum", "shared_norm", "mu")
GATES = ("sigmoid", "mamba2", "gla", "pool")
SCALAR_GATES = ("sigmoid", "mamba2")  # one decay per head: what the delta rule's log_alpha takes
BETAS = ("pool", "linear")
SPARSE_SCORES = ("relative", "error")
SPARSE_SPAN = 256  # queries per span of the sparse window's chunk form, at the least
SINK_KINDS = ("logits", "kv")


@dataclass
class AttentionConfig:
    """Everything that defines a linearized attention layer. Overrides of ``convert`` land here."""

    global_rule: str = "gated"          # linear | gated | delta
    feature_map: str = "hedgehog"       # hedgehog | t2r | silu_l2 (delta rule: L2-normalised SiLU)
    feature_dim: int | None = None      # F; None = head_dim
    feature_init: str = "identity"
    gate: str | None = "sigmoid"        # gated: any of GATES; delta: a scalar gate = Gated DeltaNet's decay
    gate_init: tuple[float, float] = (0.95, 0.99)
    local_rule: str = "window"          # none | window | terraced | softmax (full, cache grows)
    window: int = 128
    sinks: int = 4
    sink_kind: str = "logits"           # logits (Lizard v2) | kv (Lizard v1)
    combine: str = "sum"                # sum: y_g + alpha*y_w | shared_norm: LoLCATs | mu: (1-mu) y_w + mu y_g
    rope_global: bool = False           # RoPE on the linear branch's q/k (Lizard: off; LoLCATs: on)
    rope_window: bool = True
    delta_order: int = 1                # DeltaProduct order n (1 = delta rule)
    beta: str = "pool"                  # delta write strength: pool (TPTT, of k) | linear (sigmoid(w.x + c) per head)
    delta_norm: bool = True             # RMSNorm on the delta rule's output (TPTT); off keeps the values' scale
    mu: float = 0.5                     # liza mixing weight (a buffer, set by the training schedule)
    alpha_init: float = 1.0             # Lizard's per-head window weight
    window_factor_init: float = 0.0     # LoLCATs' per-head mixing logit (sigmoid(0) = 0.5)
    chunk_size: int = 64
    sparse_cache: int = 0               # LoLA: M exact pairs the global memory recalls worst, beside the window (0: off)
    sparse_score: str = "relative"      # the recall error that ranks them: ||v - read|| / ||v|| (relative) | ||v - read|| (error, LoLA's)
    sparse_distance: int | None = None  # RoPE distance cached pairs are read at (ReRoPE-like, the same at any length); None: their own (LoLA's)
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
        one_of("beta", BETAS)
        one_of("sparse_score", SPARSE_SCORES)
        if self.global_rule == "gated" and self.gate is None:
            raise ValueError(f"global_rule 'gated' needs a gate, one of {GATES}")
        if self.global_rule == "linear" and self.gate is not None:
            raise ValueError(f"gate {self.gate!r} applies only to global_rules 'gated' and 'delta', not 'linear'")
        if self.global_rule == "delta" and self.gate not in SCALAR_GATES + (None,):
            raise ValueError(f"global_rule 'delta' takes one decay per head: gate must be one of "
                             f"{SCALAR_GATES} or None, got {self.gate!r}")
        if self.global_rule != "delta" and (self.beta != "pool" or self.delta_norm is not True):
            raise ValueError(f"beta and delta_norm apply only to global_rule 'delta', not {self.global_rule!r} "
                             f"(got beta={self.beta!r}, delta_norm={self.delta_norm!r})")
        for name in ("keep_native_sliding", "trainable", "rope_global", "rope_window", "delta_norm"):
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
        if isinstance(self.sparse_cache, bool) or not isinstance(self.sparse_cache, int) or self.sparse_cache < 0:
            raise ValueError(f"sparse_cache must be a non-negative int, got {self.sparse_cache!r}")
        d = self.sparse_distance
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise ValueError(f"sparse_distance must be a non-negative int or None, got {d!r}")
        if self.sparse_cache and (self.local_rule != "window" or self.combine == "shared_norm"):
            raise ValueError("sparse_cache extends a sliding window's softmax: it needs local_rule 'window' and "
                             f"combine 'sum' or 'mu', got {self.local_rule!r} and {self.combine!r}")
        if self.feature_dim is not None and (not isinstance(self.feature_dim, int) or self.feature_dim <= 0):
            raise ValueError(f"feature_dim must be a positive int or None, got {self.feature_dim!r}")
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

    @property
    def sparse_far_rope(self) -> bool:
        """The cache reads its pairs with q rotated to position ``sparse_distance`` (RoPE'd windows only)."""
        return bool(self.sparse_cache) and self.sparse_distance is not None and self.rope_window

    def with_overrides(self, **overrides) -> "AttentionConfig":
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown override(s) {unknown}; allowed: {sorted(names)}")
        if "gate_init" in overrides:
            overrides["gate_init"] = tuple(overrides["gate_init"])
        return dataclasses.replace(self, **overrides).validate()


BETA_POOL = 3  # TPTT: beta_t = sigmoid of a causal average of the last 3 keys


def _unit_keys(fq, fk, valid, unit: bool):
    """Features unit-normalised where ``unit`` (the delta rule's write is a projection only for
    unit keys), padding keys zeroed."""
    if unit:
        fq, fk = F.normalize(fq, dim=-1), F.normalize(fk, dim=-1)
    if valid is not None:
        fk = fk.masked_fill(~valid[:, None, :, None], 0.0)
    return fq, fk


def _pooled_beta(k, k_hist):
    """TPTT's beta (B, H, T): sigmoid of the channel mean of a causal 3-token average of k, and the
    key history to carry (``k_hist`` None: zeros, a fresh state)."""
    if k_hist is None:
        k_hist = k.new_zeros(*k.shape[:2], BETA_POOL - 1, k.shape[-1])
    k_ext = torch.cat([k_hist.to(k.dtype), k], dim=2)
    pooled = k_ext.unfold(2, BETA_POOL, 1).mean(-1)  # (B, H, T, d)
    return torch.sigmoid(pooled.float().mean(-1)), k_ext[:, :, -(BETA_POOL - 1):]


def _silu_delta_operands(q, k, valid, k_hist, pool: bool):
    """Unit SiLU features of q, k and, for a pooled beta (``pool``), beta and the key history
    (``k_hist`` None: zeros, a fresh state)."""
    fq, fk = _unit_keys(F.silu(q), F.silu(k), valid, True)
    return (fq, fk, *_pooled_beta(fk, k_hist)) if pool else (fq, fk, None, k_hist)


def _output_norm(y, out_dtype):
    """TPTT's RMSNorm of the delta rule's output, in fp32 at least (fp64 stays fp64)."""
    return F.rms_norm(y.to(torch.promote_types(y.dtype, torch.float32)), (y.shape[-1],)).to(out_dtype)


def _mu_mix(y_g, y_w, mu, norm: bool, out_dtype):
    """LiZA's (1 - mu) y_w + mu y_g, y_g normed first where ``norm``."""
    if norm:
        y_g = _output_norm(y_g, out_dtype)
    return ((1 - mu) * y_w + mu * y_g).to(out_dtype)


def _recall_score(v_out, recall, relative: bool):
    """The sparse cache's score of each leaving pair (B, H, T): ||v - recall||, over ||v|| where
    ``relative``, in fp32 at least."""
    acc = torch.promote_types(v_out.dtype, torch.float32)
    v_out = v_out.to(acc)
    score = (v_out - recall.to(acc)).norm(dim=-1)
    return score / v_out.norm(dim=-1).clamp_min(torch.finfo(acc).tiny) if relative else score


_COMPILED: dict = {}


def _compiled(fn):
    """``fn`` compiled once per process and shared by every layer (its guards are on the tensors,
    not on a module)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


class HybridAttention(nn.Module):
    def __init__(self, config: AttentionConfig, num_heads: int, head_dim: int, hidden_size: int,
                 scale: float | None = None, softcap: float | None = None):
        super().__init__()
        self.config = config = config.validate()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = scale  # the teacher's softmax scale (Gemma's query_pre_attn_scalar, ...)
        # the teacher's logit soft-cap (Gemma 2's attn_logit_softcapping) for every softmax part
        self.softcap = check_softcap(softcap)
        F_dim = config.feature_dim or head_dim
        if config.feature_map == "hedgehog":
            self.phi_q = HedgehogFeatureMap(num_heads, head_dim, F_dim, config.feature_init)
            self.phi_k = HedgehogFeatureMap(num_heads, head_dim, F_dim, config.feature_init)
            gate_channels = F_dim // 2
        elif config.feature_map == "t2r":
            self.phi_q = T2RFeatureMap(num_heads, head_dim, F_dim, config.feature_init)
            self.phi_k = T2RFeatureMap(num_heads, head_dim, F_dim, config.feature_init)
            gate_channels = F_dim
        if config.gate is not None:
            self.gate = {
                "sigmoid": lambda: SigmoidGate(hidden_size, num_heads, config.gate_init),
                "mamba2": lambda: Mamba2Gate(hidden_size, num_heads, config.gate_init),
                "gla": lambda: GLAGate(hidden_size, num_heads, gate_channels, init_gamma=config.gate_init),
                "pool": lambda: PoolGate(gate_channels),
            }[config.gate]()
        has_window = config.local_rule in ("window", "terraced")
        if has_window and config.sinks and config.combine != "shared_norm":
            self.sinks = Sinks(num_heads, config.sinks, head_dim, config.sink_kind)
        if config.beta == "linear":  # Gated DeltaNet's beta_t = sigmoid(w_h . x_t + c_h), starting at 1/2
            self.beta_proj = SigmoidGate(hidden_size, num_heads, (0.5, 0.5))
        if config.combine == "sum" and config.local_rule != "none":
            self.alpha = nn.Parameter(torch.full((num_heads,), float(config.alpha_init)))
        if config.combine == "shared_norm":
            self.window_factor = nn.Parameter(torch.full((num_heads,), float(config.window_factor_init)))
        if config.combine == "mu":
            self.register_buffer("mu", torch.tensor(float(config.mu)), persistent=False)
        if not config.trainable:
            self.requires_grad_(False)
        # the parameterless elementwise work around the ops (features, beta, the mix) as compiled
        # functions: set by the training step's compile (train.graphs.compile_attention_modules)
        self.compile_glue = False

    # ------------------------------------------------------------------ pieces

    def _glue(self, fn):
        """``fn``, one of the parameterless glue functions above, compiled where ``compile_glue``."""
        return _compiled(fn) if self.compile_glue else fn

    def _window_kwargs(self) -> dict:
        c = self.config
        kw = {"window": c.window, "terraced": c.local_rule == "terraced", "scale": self.scale,
              "softcap": self.softcap}
        if hasattr(self, "sinks"):
            kw.update(self.sinks.op_kwargs())
        return kw

    def _fresh_window_state(self, like: torch.Tensor, valid: torch.Tensor | None):
        """A window state whose rows start at minus their left padding."""
        B, H, _, d = like.shape
        L = cache_len(self.config.window, self.config.local_rule == "terraced")
        pos = torch.zeros(B, dtype=torch.long, device=like.device)
        if valid is not None:
            pos = -(valid.long().cumsum(1) == 0).sum(1)  # leading padding
        z = like.new_zeros(B, H, L, d, dtype=torch.float32 if like.dtype != torch.float64 else like.dtype)
        return z, pos

    def _global_features(self, q, k, x, valid):
        """Features for the global branch, padding rows zeroed. Hedgehog hands the gated op plain
        features (exponentiated in fp32, then rounded): in bf16 that is more accurate than
        rounding log-features (an absolute error of 2^-9 |log phi| is a relative error of phi),
        and the op's decays are row scales <= 1, so plain features cannot overflow."""
        c = self.config
        if c.feature_map == "silu_l2":
            fq, fk = F.silu(q), F.silu(k)
        else:
            fq, fk = self.phi_q(q), self.phi_k(k)
        return _unit_keys(fq, fk, valid, c.global_rule == "delta")

    def _log_gates(self, k, x, valid):
        c = self.config
        log_g = self.gate(k) if c.gate == "pool" else self.gate(x)
        if log_g.dim() == 4 and c.feature_map == "hedgehog":
            log_g = torch.cat([log_g, log_g], dim=-1)  # one gate per channel, shared by the +/- halves
        if valid is not None:
            mask = ~valid[:, None, :] if log_g.dim() == 3 else ~valid[:, None, :, None]
            log_g = log_g.masked_fill(mask, 0.0)
        return log_g

    def _beta(self, k, x, k_hist):
        """beta (B, H, T) in (0, 1) and the key history to carry. ``pool``: sigmoid(mean over
        channels of the causal 3-token average of k) (TPTT); ``linear``: sigmoid(w_h . x_t + c_h)."""
        if self.config.beta == "linear":
            return self.beta_proj(x).exp(), k_hist
        return _pooled_beta(k, k_hist)

    def _delta_operands(self, gq, gk, x, valid, k_hist):
        """fq, fk, beta and the key history for the delta rule (``k_hist`` None: a fresh state).
        SiLU features and a pooled beta are elementwise work over every token: with
        ``compile_glue``, one compiled function."""
        c = self.config
        if c.feature_map != "silu_l2":
            fq, fk = self._global_features(gq, gk, x, valid)
            return (fq, fk, *self._beta(fk, x, k_hist))
        fn = self._glue(_silu_delta_operands)
        fq, fk, beta, k_hist = fn(gq, gk, valid, k_hist, c.beta == "pool")
        if c.beta == "linear":
            beta = self.beta_proj(x).exp()
        return fq, fk, beta, k_hist

    @property
    def _norm_in_mix(self) -> bool:
        """Whether the delta rule's output norm runs in LiZA's mix (one compiled function for both)
        rather than right after the rule: with combine "mu" and a local branch to mix with."""
        c = self.config
        return c.global_rule == "delta" and c.delta_norm and c.combine == "mu" and c.local_rule != "none"

    def _mix(self, y_g, y_w, out_dtype):
        """The branches combined (``combine`` sum or mu), liza's output norm of the delta rule's part
        included where ``_norm_in_mix``."""
        c = self.config
        if c.combine == "mu":
            fn = self._glue(_mu_mix)
            return fn(y_g, y_w, self.mu, self._norm_in_mix, out_dtype)
        return (y_g + self.alpha[:, None, None].to(y_g.dtype) * y_w).to(out_dtype)

    # ------------------------------------------------------------------ forward

    def forward(self, q, k, v, q_rope, k_rope, x, state: dict | None = None,
                valid: torch.Tensor | None = None, need_state: bool = True,
                q_far: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """y (B, H, T, d) and the state to continue from. ``need_state`` False: the caller keeps no state
        (a training step, attention transfer), so the kernels may skip writing it and the returned
        dict may lack entries; y is the same. ``q_far`` (B, H, T, d): q with RoPE at position
        ``sparse_distance`` (the caller has the rotary tables; at distance 0, q will do)."""
        c = self.config
        step = state is not None and q.shape[2] == 1  # decoding: the recurrent forms
        state = dict(state or {})
        if valid is not None and known_all_true(valid):
            valid = None
        v_lin = v if valid is None else v.masked_fill(~valid[:, None, :, None], 0.0)
        gq, gk = (q_rope, k_rope) if c.rope_global else (q, k)
        lq, lk = (q_rope, k_rope) if c.rope_window else (q, k)
        chunk = {"chunk_size": c.chunk_size}

        if c.combine == "shared_norm":
            fq, fk = self._global_features(gq, gk, x, valid)
            if "local" not in state:  # a fresh state, only to start left-padded rows at negative positions
                zeros, pos = self._fresh_window_state(lk, valid)
                B, H, L, _ = zeros.shape
                Fd = fk.shape[-1]
                state["local"] = LolcatsState(zeros.new_zeros(B, H, Fd, v.shape[-1]), zeros.new_zeros(B, H, Fd),
                                              zeros, zeros.new_zeros(B, H, L, Fd), zeros.clone(), pos)
            fn = lolcats_attn_recurrent if step else lolcats_attn_chunk
            kw = {} if step else chunk
            y, state["local"] = fn(lq, lk, v_lin, fq, fk, torch.sigmoid(self.window_factor), window=c.window,
                                   terraced=c.local_rule == "terraced", scale=self.scale, softcap=self.softcap,
                                   state=state["local"], **kw)
            return y, state

        # global branch; `read(queries)` runs the same op from the same state with other queries
        # (the sparse cache's recall of the leaving pairs; given as `recall` where computed already)
        g0 = state.get("global")
        recall = behind = None
        if c.global_rule == "delta":
            fq, fk, beta, k_hist = self._delta_operands(gq, gk, x, valid, state.get("k_hist"))
            if k_hist is not None:
                state["k_hist"] = k_hist
            log_alpha = self._log_gates(k, x, valid) if c.gate is not None else None
            fn = delta_product_recurrent if step else delta_product_chunk
            read = lambda queries, fn=fn: fn(queries, fk, v_lin, beta, order=c.delta_order, state=g0,  # noqa: E731
                                      log_alpha=log_alpha, **({} if step else chunk))
            if c.sparse_cache and not step:
                # the cache's scores read the memory with the leaving keys: one prep and scan for both reads
                behind = self._behind_history(fk, k, state)
                y_g, state["global"], recall = delta_product_chunk(
                    fq, fk, v_lin, beta, order=c.delta_order, state=g0, log_alpha=log_alpha,
                    extra_queries=behind[0][:, :, :fk.shape[2]], **chunk)
            else:
                y_g, state["global"] = read(fq)
            if c.delta_norm and not self._norm_in_mix:
                y_g = _output_norm(y_g, v.dtype)
        else:
            fq, fk = self._global_features(gq, gk, x, valid)
            if c.global_rule == "gated":
                log_g = self._log_gates(k, x, valid)
                if not c.sparse_cache:
                    lizard = self._lizard_one_op(fq, fk, v, log_g, lq, lk, state, step, valid, need_state)
                    if lizard is not None:
                        return lizard
                # ops.gla.gla_chunk picks the backend: the kernels on CUDA where they apply, else torch
                fn = gla_recurrent if step else gla_chunk
                read = lambda queries, fn=fn: fn(queries, fk, v_lin, log_g, state=g0,  # noqa: E731
                                          **({} if step else chunk))
            else:
                fn = linear_attn_recurrent if step else linear_attn_chunk
                read = lambda queries, fn=fn: fn(queries, fk, v_lin, state=g0, **({} if step else chunk))  # noqa: E731
            y_g, state["global"] = read(fq)

        if c.local_rule == "none":
            return y_g, state

        # local branch
        if c.local_rule == "softmax":
            y_w, state["local"] = self._full_softmax(lq, lk, v, state.get("local"), valid)
        elif c.sparse_cache:
            y_w = self._sparse_window(q, k, lq, lk, v, v_lin, fk, read, state, valid, step, q_far, recall, behind)
        else:
            fresh = "local" not in state  # a new state: pos <= 0, so its cache is never visible
            if fresh:
                zeros, pos = self._fresh_window_state(lk, valid)
                state["local"] = WindowState(zeros, zeros.new_zeros(*zeros.shape[:3], v.shape[-1]), pos)
            if not step and c.combine == "sum":  # Lizard: the Triton window kernel with the combine fused
                fused = window_attn_sum(lq, lk, v, y_g, self.alpha, state=state["local"],
                                        fresh_state=fresh, **self._window_kwargs(), **chunk)
                if fused is not None:
                    y, state["local"] = fused
                    if valid is not None:  # padding queries get no window part, as below
                        y = torch.where(valid[:, None, :, None], y, y_g.to(y.dtype))
                    return y.to(v.dtype), state
            fn = window_attn_recurrent if step else functools.partial(window_attn_chunk, fresh_state=fresh)
            y_w, state["local"] = fn(lq, lk, v, state=state["local"], **self._window_kwargs(),
                                     **({} if step else chunk))
            if valid is not None:  # padding queries see no keys; give them zeros, not NaN
                y_w = y_w.masked_fill(~valid[:, None, :, None], 0.0)

        return self._mix(y_g, y_w, v.dtype), state

    def _behind_history(self, fk, k, state: dict) -> tuple:
        """The sparse cache's leaving parts, fk and (with ``sparse_distance``) k (B, H, T, .), each
        behind the last w of its tokens before this call (the state's "leaving", in the same order;
        zeros for a fresh state): (B, H, w + T, .) each."""
        c = self.config
        parts = (fk,) + ((k,) if c.sparse_far_rope else ())
        hist = state.get("leaving") or tuple(x.new_zeros(*x.shape[:2], c.window, x.shape[-1]) for x in parts)
        return tuple(torch.cat([h, x], 2) for h, x in zip(hist, parts))

    def _sparse_window(self, q, k, lq, lk, v, v_lin, fk, read, state: dict, valid, step: bool, q_far,
                       recall: torch.Tensor | None = None, behind: tuple | None = None):
        """Window + sinks + the sparse cache (``ops.sparse_window``); updates ``state`` ("local", and
        "leaving": the last w key features, and keys without RoPE when ``sparse_distance`` is set;
        the last w values are the window's, in "local") and returns y_w. The pair leaving the window
        at query t is scored by the global memory's self-recall error ||v_{t-w} - read(S_t, phi(k_{t-w}))||
        (the raw read: before any output norm), divided by ||v_{t-w}|| when ``sparse_score`` is "relative";
        ``recall``: that read where the global branch made it already, else ``read`` makes it;
        ``behind``: ``_behind_history`` where the global branch made it already."""
        c = self.config
        w, T = c.window, fk.shape[2]
        local = state.get("local")
        fresh = local is None
        fk_ext, *k_ext = behind if behind is not None else self._behind_history(fk, k, state)
        state["leaving"] = tuple(x[:, :, T:] for x in (fk_ext, *k_ext))
        # the leaving values are the window's own (the op's state holds the last w; they differ from
        # v_lin only at left padding, whose pairs are never cached, so their scores go unread)
        v_held = v_lin.new_zeros(*v_lin.shape[:2], w, v_lin.shape[-1]) if fresh else local.v.to(v_lin.dtype)
        v_ext = torch.cat([v_held, v_lin], 2)
        # A cached pair is read as if sparse_distance back: (R_D q) . k without RoPE, the same at any
        # context length, where its own distance would soon pass any the teacher was trained on.
        far = {}
        if c.sparse_far_rope:
            if q_far is None and c.sparse_distance:
                raise ValueError(f"sparse_distance={c.sparse_distance} needs q_far, q with RoPE at that position")
            far = {"cache_q": q if q_far is None else q_far, "leave_k": k_ext[0][:, :, :T]}
        with torch.no_grad():  # the selection is a ranking: no gradient flows through the scores
            if recall is None:
                recall, _ = read(fk_ext[:, :, :T])
            fn = self._glue(_recall_score)
            # (relative: the share of the value lost, whatever its norm)
            score = fn(v_ext[:, :, :T].to(torch.promote_types(v.dtype, torch.float32)), recall,
                       c.sparse_score == "relative")
        if fresh:  # rows start at minus their left padding, as the window's
            _, pos = self._fresh_window_state(lk, valid)
            B, H, _, d = lk.shape
            local = fresh_sparse_state(B, H, d, v.shape[-1], c.window, c.sparse_cache,
                                       dtype=torch.float64 if lk.dtype == torch.float64 else torch.float32,
                                       device=lk.device, pos=pos)
        kw = {k: val for k, val in self._window_kwargs().items() if k != "terraced"}
        if step:
            y_w, local = sparse_window_attn_recurrent(lq, lk, v, score, cache_size=c.sparse_cache, state=local,
                                                      **far, **kw)
        else:
            # its forms are equal at any span length; a fresh state runs every span at once (the live
            # form, blocks of chunk_size queries), a carried one loops, and there a span is a few dozen
            # small kernels: long spans
            span = c.chunk_size if fresh else max(c.chunk_size, SPARSE_SPAN)
            y_w, local = sparse_window_attn_chunk(lq, lk, v, score, cache_size=c.sparse_cache, state=local,
                                                  chunk_size=span, fresh_state=fresh, **far, **kw)
        state["local"] = local
        if valid is not None:  # padding queries see no keys; give them zeros, not NaN
            y_w = y_w.masked_fill(~valid[:, None, :, None], 0.0)
        return y_w

    def _lizard_one_op(self, fq, fk, v, log_g, lq, lk, state: dict, step: bool, valid,
                       need_state: bool = True) -> tuple | None:
        """Lizard (gated + window with v2 sinks, summed) as the kernels' one op (both branches and
        the combine) for a prefill without padding whose window starts fresh, where the op says its
        kernels apply (``lizard_attention_fused``); None elsewhere. Without ``need_state`` the op
        writes no state and ``state`` is returned as it came."""
        c = self.config
        wkw = self._window_kwargs()
        if (step or valid is not None or "local" in state or c.local_rule != "window" or c.combine != "sum"
                or wkw["softcap"] is not None or "sink_k" in wkw):
            return None
        sinks = wkw.get("sink_logits")
        out = lizard_attention_fused(fq, fk, v, log_g, lq, lk, self.alpha, window=c.window, sink_logits=sinks,
                                     scale=self.scale, state=state.get("global"), return_state=need_state)
        if out is None:
            return None
        y, g_state, w_state = out
        if need_state:
            state["global"], state["local"] = g_state, w_state
        return y.to(v.dtype), state

    def _full_softmax(self, q, k, v, cache, valid):
        """Full causal softmax (liza's optional branch): the cache keeps every key, by design."""
        if cache is not None:
            k_all, v_all, valid_all = cache
            k, v = torch.cat([k_all, k], 2), torch.cat([v_all, v], 2)
        else:
            valid_all = None
        T, S = q.shape[2], k.shape[2]
        valid_now = valid if valid is not None else torch.ones(q.shape[0], T, dtype=torch.bool, device=q.device)
        keys_valid = valid_now if valid_all is None else torch.cat([valid_all, valid_now], 1)
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        mask = causal[None, None] & keys_valid[:, None, None, :]
        if self.softcap is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        else:  # SDPA cannot soft-cap: explicit scores, capped, masked and normalised in fp32
            scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
            acc = torch.float64 if q.dtype == torch.float64 else torch.float32
            scores = soft_cap(q.to(acc) @ k.to(acc).transpose(-1, -2) * scale, self.softcap)
            # a row that sees no key (a left-padding query) is zeroed below; keep it finite here
            scores = scores.masked_fill(~(mask | ~mask.any(-1, keepdim=True)), float("-inf"))
            y = (scores.softmax(-1) @ v.to(acc)).to(v.dtype)
        y = y.masked_fill(~valid_now[:, None, :, None], 0.0)
        return y, (k, v, keys_valid)
