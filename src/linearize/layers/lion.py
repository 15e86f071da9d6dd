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
MSE (docs/results/lion-minilm.md). ``feature_map="taylor"`` takes Based's second-order kernel
1 + u + u^2/2 on learned maps of q and k (u starts as the softmax's own scaled score): alone it
transfers worse than Hedgehog (it cannot form the sharp peaks of BERT heads), but beside exact
keys, which take those peaks, it is the closer fit to the smooth rest (docs/results/lion-minilm.md).
The parallel form computes its kernel from u (``feature_maps.pairwise``); the chunk and recurrent
forms carry its 1 + d + d(d+1)/2 features. ``feature_map="taylor+hedgehog"`` puts both side by side,
weighted per head (the kernels add: the polynomial for the smooth bulk, Hedgehog for peaks).

Exact keys (ours, off by default; ``sinks`` / ``window``): BERT heads put much of their mass
on [CLS] (35-70% in MiniLM's layers 1-4) and on the previous or next token (one layer-0 head
94% on the previous one), which a positive feature map with symmetric decays cannot single out.
With ``sinks=n`` the first n tokens, and with ``window=w`` the tokens within w of the query, keep
the teacher's exact scores q.k * scale; LION covers every other key, and one softmax mixes the
two, LION entering as a pseudo-key with a learned logit (``LionAttention._with_exact``). That is
Lizard's and LoLCATs' recipe (exact attention where it is sharp, linear attention elsewhere)
made bidirectional; time and state stay linear in length (2w + 1 + n exact scores per token).

Asymmetric decays (ours, off by default; ``asymmetric``): LION's mask decays keys left and right
of the query alike, but many BERT heads look one way: in MiniLM's layers 1-3, heads put 80-98% of
the mass that falls outside [CLS] and the ±2 neighbours on one side (64 wiki sentences). With
``asymmetric`` the keys on the right get decays of their own (a second per-head λ for d, a second
gate for s; ``log_a_back`` of the ops), which start equal to the left ones.

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
from ..ops.lion.naive import gate_cumsums, lion_mask, token_log_gates
from .feature_maps import FEATURE_MAP_INITS, FEATURE_MAPS, kernel_terms, pairwise
from .gates import SigmoidGate, head_gammas, logit

LION_VARIANTS = ("lit", "d", "s")
LION_FORMS = ("auto", "chunk", "parallel", "recurrent")
# "auto": the parallel form up to this many tokens, the chunk form beyond. On 2 CPU threads (12
# heads of 32, lion-s, 1024 tokens per call) the parallel form ran a layer 1.1-2.5x faster than the
# chunk form up to 128 tokens (forward, and forward + backward; pure or with exact keys), and
# slower from 256 on: 1.1-2.4x at 256, 1.8-12x beyond (benchmarks/probes/lion_forms_short.py,
# docs/results/lion-forms-short.md).
AUTO_PARALLEL_MAX = 128
LION_FEATURE_MAPS = ("hedgehog", "t2r", "taylor", "taylor+hedgehog")
POSITION_POLICIES = ("clamp", "error")


@dataclass
class LionConfig:
    """Everything that defines a LION layer; overrides of ``convert(model, "lion-*", ...)`` land here."""

    variant: str = "s"                         # lit | d | s
    feature_map: str = "hedgehog"              # hedgehog | t2r | taylor | taylor+hedgehog
    feature_dim: int | None = None             # F; None = 2 * head_dim for Hedgehog (F/2 = d), head_dim for T2R,
    #                                            1 + d + d(d+1)/2 for Taylor (its projection keeps all d);
    #                                            for taylor+hedgehog the Hedgehog part's F (None: 2 * head_dim)
    feature_init: str = "identity"
    scaled: bool = True                        # divide each row by its sum (the softmax-like form)
    decay_init: tuple[float, float] = (0.95, 0.99)  # initial λ_h (d) / a_t (s), spread over the heads
    form: str = "auto"                         # which of the three equivalent forms the layer runs
    #                                            (auto: parallel up to AUTO_PARALLEL_MAX tokens, else chunk)
    chunk_size: int = 64
    eps: float = 1e-6
    positions: str = "clamp"                   # inputs longer than the teacher's absolute positions:
    #                                            clamp = tokens past the last position reuse it; error = refuse
    sinks: int = 0                             # the first `sinks` tokens ([CLS]) get exact softmax scores
    window: int = 0                            # so do the tokens within `window` positions on either side
    asymmetric: bool = False                   # d / s: separate decays for keys left and right of the query

    def validate(self) -> "LionConfig":
        for name, allowed in (("variant", LION_VARIANTS), ("feature_map", LION_FEATURE_MAPS),
                              ("feature_init", FEATURE_MAP_INITS), ("form", LION_FORMS),
                              ("positions", POSITION_POLICIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.scaled, bool):
            raise ValueError(f"scaled must be a bool, got {self.scaled!r}")
        if not isinstance(self.asymmetric, bool):
            raise ValueError(f"asymmetric must be a bool, got {self.asymmetric!r}")
        if self.asymmetric and self.variant == "lit":
            raise ValueError("asymmetric decays need a decay: variant 'd' or 's', not 'lit'")
        check_positive_int("chunk_size", self.chunk_size)
        if not (isinstance(self.sinks, int) and not isinstance(self.sinks, bool) and self.sinks >= 0):
            raise ValueError(f"sinks must be an int >= 0 (how many leading tokens get exact softmax), "
                             f"got {self.sinks!r}")
        if not (isinstance(self.window, int) and not isinstance(self.window, bool) and self.window >= 0):
            raise ValueError(f"window must be an int >= 0 (exact softmax within that distance), "
                             f"got {self.window!r}")
        if self.feature_dim is not None:
            check_positive_int("feature_dim", self.feature_dim)
            if self.feature_map in ("hedgehog", "taylor+hedgehog") and self.feature_dim % 2:
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
        feature_dim = config.feature_dim or {"hedgehog": 2 * head_dim, "t2r": head_dim}.get(config.feature_map)
        self.phi_q = FEATURE_MAPS[config.feature_map](num_heads, head_dim, feature_dim, config.feature_init)
        self.phi_k = FEATURE_MAPS[config.feature_map](num_heads, head_dim, feature_dim, config.feature_init)
        feature_dim = self.phi_q.feature_dim
        if config.variant == "d":
            self.decay_logit = nn.Parameter(logit(head_gammas(num_heads, config.decay_init)).float())
            if config.asymmetric:  # starts equal to the left decay: the symmetric mask
                self.decay_logit_back = nn.Parameter(self.decay_logit.detach().clone())
        elif config.variant == "s":
            self.gate = SigmoidGate(hidden_size, num_heads, config.decay_init)
            if config.asymmetric:
                self.gate_back = SigmoidGate(hidden_size, num_heads, config.decay_init)
        if config.sinks or config.window:
            self.scale = softmax_scale(scale, head_dim)
            # the log of the softmax mass of the keys LION covers, per query token and head:
            # r_i = w_h.x_i + c_h + γ_h log(LION's row sum over them). The row sum counts the keys
            # (each adds about 4/F with Hedgehog, 1 with Taylor), which the token alone cannot; γ
            # starts at 1 and c at minus the log of that, so r starts at the log of their number,
            # as for keys of score 0.
            self.rest_logit = nn.Linear(hidden_size, num_heads)
            nn.init.zeros_(self.rest_logit.weight)
            unit = {"taylor": 1.0, "taylor+hedgehog": 2.0}.get(config.feature_map, 4.0 / feature_dim)
            nn.init.constant_(self.rest_logit.bias, -math.log(unit))
            self.rest_count_scale = nn.Parameter(torch.ones(num_heads))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor | None:
        """None (lit), log λ_h (H,) (d) or log a_t (B, H, T) (s), all <= 0, in fp32: the decays of
        the keys left of the query (all keys unless ``asymmetric``)."""
        if self.config.variant == "d":
            return F.logsigmoid(self.decay_logit.float())
        if self.config.variant == "s":
            return self.gate(x)
        return None

    def log_decay_back(self, x: torch.Tensor) -> torch.Tensor | None:
        """With ``asymmetric``, the decays of the keys right of the query (``log_decay``'s shape);
        else None (the ops then use ``log_decay`` for both sides)."""
        if not self.config.asymmetric:
            return None
        if self.config.variant == "d":
            return F.logsigmoid(self.decay_logit_back.float())
        return self.gate_back(x)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                valid: torch.Tensor | None = None, form: str | None = None) -> torch.Tensor:
        """(B, H, T, d) heads -> (B, H, T, d) LION output; ``form`` overrides ``config.form``."""
        form = self.config.form if form is None else form
        if form not in LION_FORMS:
            raise ValueError(f"form must be one of {LION_FORMS}, got {form!r}")
        if form == "auto":
            form = "parallel" if q.shape[2] <= AUTO_PARALLEL_MAX else "chunk"
        exact = bool(self.config.sinks or self.config.window)
        if exact and form == "parallel":
            return self._with_exact_parallel(q, k, v, x, valid)
        kw = {"valid": valid, "scaled": self.config.scaled, "eps": self.config.eps}
        if form == "chunk":
            kw["chunk_size"] = self.config.chunk_size
        op = {"chunk": lion_chunk, "parallel": lion_parallel, "recurrent": lion_recurrent}[form]
        kw.update(log_a_back=self.log_decay_back(x), phi_q=self.phi_q, phi_k=self.phi_k)
        if not exact:
            y, _ = op(q, k, v, self.log_decay(x), **kw)
            return y
        return self._with_exact(op, kw, q, k, v, x, valid)

    def _with_exact(self, op, kw, q, k, v, x, valid) -> torch.Tensor:
        """Exact softmax scores for the first n tokens (sinks) and for the tokens within w of the
        query (window), LION for the rest, mixed as softmax would mix them:

            y_i = Σ_{j in E_i} π_ij v_j + π_i,rest LION_i(keys not in E_i)
            π_i = softmax([q_i.k_j * scale for j in E_i], r_i)

        The exact keys E_i keep the teacher's own scores (BERT heads put much of their mass on
        [CLS] and on the previous or next token, which symmetric decays cannot single out). The
        rest enter as one pseudo-key whose logit r_i (see ``__init__``) stands for the log of
        their softmax mass: φq.φk is normalised per query, so LION's weights alone cannot say it.
        LION_i(rest) is LION's scaled form over the other keys: one unscaled call with v extended
        by a column of ones (numerator and row sum together, sink keys zeroed), less the window
        keys' own terms M_ij φq_i.φk_j [v_j, 1], computed in the compute dtype (fp32 at least).
        """
        B, H, T, Dv = v.shape
        n, w = min(self.config.sinks, T), self.config.window
        acc = compute_dtype(q)
        keep = torch.ones(B, T, dtype=torch.bool, device=q.device) if valid is None else valid
        v1 = torch.cat([v.to(acc), torch.ones_like(v[..., :1], dtype=acc)], dim=-1)
        log_a = self.log_decay(x)
        not_sink = (torch.arange(T, device=q.device) >= n).expand(B, T)
        lin, _ = op(q, k, v1, log_a, **{**kw, "scaled": False, "key_valid": not_sink})  # (B, H, T, Dv + 1)
        lg = token_log_gates(log_a, valid, B, T, acc) if w else None
        if lg is not None:  # M_ij = e^{b_i - b_j} (j < i), e^{c_j - c_i} (j > i), as ops.lion's mask
            b, c = gate_cumsums(lg, token_log_gates(kw["log_a_back"], valid, B, T, acc))
        ka_sink, va_sink = k[:, :, :n].to(acc), v[:, :, :n].to(acc)
        rest_keys = keep[:, n:].sum(-1, keepdim=True)                                  # (B, 1)
        y = v.new_empty(B, H, T, Dv, dtype=acc)
        # The mix is local (the sinks, and w keys on either side): a chunk of queries at a time, with
        # its keys and a halo of w on each side (0 past either end), so that beyond LION's lin only
        # y spans the input.
        for s0 in range(0, T, self.config.chunk_size):
            s1 = min(s0 + self.config.chunk_size, T)
            C = s1 - s0
            qa = q[:, :, s0:s1].to(acc)
            logits = []
            if n:  # (B, H, C, n) against the first n keys
                logits.append((qa @ ka_sink.transpose(-1, -2) * self.scale).masked_fill(~keep[:, None, None, :n],
                                                                                       float("-inf")))
            lin_c = lin[:, :, s0:s1]
            if w:  # (B, H, C, 2w + 1) against keys i - w .. i + w
                halo = _halo(s0, s1, w, T)
                near = lambda t, e, dim=2: t.narrow(dim, e, C)  # noqa: E731  (offset e - w of each query)
                keep_h = halo(keep, 1)
                first = torch.arange(s0 - w, s1 + w, device=q.device) >= n
                ok = torch.stack([near(keep_h & first, e, 1) for e in range(2 * w + 1)], dim=-1)  # (B, C, 2w + 1)
                ka_h, v1_h = halo(k, 2).to(acc), halo(v1, 2)
                logits.append(torch.stack([(qa * near(ka_h, e)).sum(-1) for e in range(2 * w + 1)], dim=-1)
                              .mul(self.scale).masked_fill(~ok[:, None], float("-inf")))
                pairs = self._window_pairs(q, k, s0, s1, w, acc) * ok[:, None]         # (B, H, C, 2w + 1)
                if lg is not None:
                    b_h, c_h = halo(b, 2), halo(c, 2)
                for e in range(2 * w + 1):  # less the window keys' own LION terms
                    a = pairs[..., e]
                    if lg is not None and e != w:
                        a = a * (b[:, :, s0:s1] - near(b_h, e) if e < w
                                 else near(c_h, e) - c[:, :, s0:s1]).clamp_max(0.0).exp()
                    lin_c = lin_c - a.unsqueeze(-1) * near(v1_h, e)
            # A query whose keys are all exact has no rest; the subtraction leaves rounding noise
            # there, which must not be read: count the rest's keys exactly and drop the pseudo-key.
            has_rest = rest_keys > (ok.sum(-1) if w else 0)                              # (B, C)
            den = lin_c[..., Dv:].clamp_min(0.0) + self.config.eps
            rest = (lin_c[..., :Dv] / den).masked_fill(~has_rest[:, None, :, None], 0.0)
            r = self._rest_logit(x[:, s0:s1], den, has_rest, keep[:, s0:s1])
            pi = torch.softmax(torch.cat(logits + [r], dim=-1), dim=-1)
            y_c = pi[..., -1:] * rest
            if n:
                y_c = y_c + pi[..., :n] @ va_sink
            if w:
                va_h = v1_h[..., :Dv]
                for e in range(2 * w + 1):
                    y_c = y_c + pi[..., n + e, None] * near(va_h, e)
            y[:, :, s0:s1] = y_c
        if valid is not None:  # a padded query reads nothing, as in the ops
            y = y * valid[:, None, :, None]
        return y.to(v.dtype)

    def _window_pairs(self, q: torch.Tensor, k: torch.Tensor, s0: int, s1: int, w: int,
                      acc: torch.dtype) -> torch.Tensor:
        """phi_q(q_i) . phi_k(k_{i+o}) for the queries i in [s0, s1) and o = -w..w, (B, H, s1 - s0, 2w + 1)
        in ``acc`` (keys past either end count as zero vectors), from ``kernel_terms`` on those queries
        and their keys with a halo of w (Taylor maps from their d-wide projections: no F-wide products)."""
        halo = _halo(s0, s1, w, q.shape[2])
        total = 0
        for a, b, f in kernel_terms(self.phi_q, self.phi_k, q[:, :, s0:s1], k[:, :, max(s0 - w, 0):s1 + w]):
            b = halo(b, 2, cut=False)
            u = torch.stack([(a * b.narrow(2, e, s1 - s0)).sum(-1) for e in range(2 * w + 1)], dim=-1)
            total = total + (u if f is None else f(u))
        return total

    def _rest_logit(self, x: torch.Tensor, den: torch.Tensor, has_rest: torch.Tensor,
                    keep: torch.Tensor) -> torch.Tensor:
        """The rest pseudo-key's logit r (B, H, T, 1) from LION's row sum over the rest ``den``
        (B, H, T, 1, eps included): w_h.x + c_h + γ_h log den. -inf where a query has no rest,
        except at padded queries (output 0 anyway), so that no row of the softmax is all -inf
        (NaN, also in the backward)."""
        r = self.rest_logit(x.to(self.rest_logit.weight.dtype)).to(den.dtype).transpose(1, 2).unsqueeze(-1) \
            + self.rest_count_scale.to(den.dtype).view(-1, 1, 1) * den.log()
        return r.masked_fill((~has_rest & keep)[:, None, :, None], float("-inf"))

    def _with_exact_parallel(self, q, k, v, x, valid) -> torch.Tensor:
        """``_with_exact`` with (B, H, T, T) tensors, as ``lion_parallel`` computes LION: the rest's
        weights M_ij φq_i.φk_j over the keys that are neither sinks nor in the window, and the exact
        keys' scores, masked per (query, key) pair. Quadratic in T, but a few batched products
        instead of the recurrences and a loop over the window's offsets: the fast form for short
        inputs (sentences), and a second, independent computation of the same mix for the tests."""
        B, H, T, Dv = v.shape
        n, w = min(self.config.sinks, T), self.config.window
        acc = compute_dtype(q)
        keep = torch.ones(B, T, dtype=torch.bool, device=q.device) if valid is None else valid
        idx = torch.arange(T, device=q.device)
        near = (idx[:, None] - idx[None, :]).abs() <= w if w else torch.zeros(T, T, dtype=torch.bool, device=q.device)
        exact = (idx < n)[None, :] | near                                                    # (T, T)
        exact_ok = exact & keep[:, None, :]                                                   # (B, T, T)
        rest_ok = ~exact & keep[:, None, :]
        M = lion_mask(self.log_decay(x), T, valid, batch_size=B, dtype=acc, device=q.device,
                      log_a_back=self.log_decay_back(x))
        a = pairwise(self.phi_q, self.phi_k, q, k).to(acc) * M * rest_ok[:, None]
        va = v.to(acc)
        den = a.sum(-1, keepdim=True) + self.config.eps                                      # (B, H, T, 1)
        has_rest = rest_ok.any(-1)                                                            # (B, T)
        rest = ((a @ va) / den).masked_fill(~has_rest[:, None, :, None], 0.0)
        r = self._rest_logit(x, den, has_rest, keep)
        logits = (q.to(acc) @ k.to(acc).transpose(-1, -2) * self.scale).masked_fill(~exact_ok[:, None], float("-inf"))
        pi = torch.softmax(torch.cat([logits, r], dim=-1), dim=-1)
        y = pi[..., :T] @ va + pi[..., T:] * rest
        if valid is not None:  # a padded query reads nothing, as in the ops
            y = y * valid[:, None, :, None]
        return y.to(v.dtype)

    def extra_repr(self) -> str:
        c = self.config
        exact = f", sinks={c.sinks}, window={c.window}" if c.sinks or c.window else ""
        exact += ", asymmetric=True" if c.asymmetric else ""
        return f"variant={c.variant}, feature_map={c.feature_map}, scaled={c.scaled}, form={c.form}{exact}"


def _halo(s0: int, s1: int, w: int, T: int):
    """For the tokens [s0, s1) of a length-T axis: t -> t's tokens s0 - w .. s1 + w - 1 along ``dim``,
    zero (False) past either end; with ``cut=False`` t holds tokens max(s0 - w, 0) .. already."""
    lo, hi = max(s0 - w, 0), min(s1 + w, T)

    def take(t: torch.Tensor, dim: int, cut: bool = True) -> torch.Tensor:
        t = t.narrow(dim, lo, hi - lo) if cut else t
        pad = [0, 0] * (t.dim() - 1 - dim) + [lo - (s0 - w), s1 + w - hi]
        return F.pad(t, pad)

    return take
