"""Parallel LION (masked full linear attention), the mask builder and the shared input checks.

Shapes: q, k (B, H, T, F); v (B, H, T, Dv); log_a None | (H,) | (B, H, T); log_a_back None or
log_a's shape; valid (B, T) or None; o (B, H, T, Dv). This form builds (B, H, T, T) tensors: a
reference for test sizes and short inputs, not a way to run long ones (``lion_chunk`` is).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from .. import common

LION_KINDS = ("lit", "d", "s")  # no decay | fixed per-head decay (H,) | selective per-token (B, H, T)


class LionState(NamedTuple):
    """The two boundary states, in the compute dtype.

    S_f (B, H, F, Dv) = Σ_j (Π_{k=j+1..T} a_k) k_j v_j^T   forward recurrence after the last token
    z_f (B, H, F)     = Σ_j (Π_{k=j+1..T} a_k) k_j
    S_b (B, H, F, Dv) = Σ_j (Π_{k=1..j-1} a_k) k_j v_j^T   backward recurrence at the first token
    z_b (B, H, F)     = Σ_j (Π_{k=1..j-1} a_k) k_j
    """

    S_f: torch.Tensor
    z_f: torch.Tensor
    S_b: torch.Tensor
    z_b: torch.Tensor


def decay_kind(log_a: Optional[torch.Tensor]) -> str:
    """'lit', 'd' or 's' from the shape of a checked ``log_a``."""
    return "lit" if log_a is None else ("d" if log_a.dim() == 1 else "s")


def check_log_a(log_a: Optional[torch.Tensor], B: int, H: int, T: int) -> None:
    """``log_a`` is None, (H,) or (B, H, T), finite and <= 0 (a decay in (0, 1])."""
    if log_a is None:
        return
    common.check_float("log_a", log_a)
    if tuple(log_a.shape) not in ((H,), (B, H, T)):
        raise ValueError(f"log_a must be None (lion-lit), shape ({H},) (lion-d: log of a fixed decay per head) "
                         f"or ({B}, {H}, {T}) (lion-s: log of a per-token gate), got {tuple(log_a.shape)}")
    if log_a.numel() and not bool(torch.isfinite(log_a).all()):
        raise ValueError("log_a must be finite (a decay in (0, 1]); it holds "
                         f"{int((~torch.isfinite(log_a)).sum())} non-finite value(s)")
    if log_a.numel() and bool((log_a > 0).any()):
        raise ValueError(f"log_a must be <= 0 (a decay in (0, 1]), got a maximum of {float(log_a.max())!r}")


def check_log_a_back(log_a_back: Optional[torch.Tensor], log_a: Optional[torch.Tensor], B: int, H: int,
                     T: int) -> None:
    """``log_a_back`` (the right-to-left decays) is None or has ``log_a``'s shape and range."""
    if log_a_back is None:
        return
    if log_a is None:
        raise ValueError("log_a_back (decays of the right-to-left direction) needs log_a (those of the "
                         "left-to-right direction); lion-lit has no decay")
    common.check_float("log_a_back", log_a_back)
    if log_a_back.shape != log_a.shape:
        raise ValueError(f"log_a_back must have log_a's shape {tuple(log_a.shape)}, got {tuple(log_a_back.shape)}")
    try:
        check_log_a(log_a_back, B, H, T)
    except ValueError as e:
        raise ValueError(str(e).replace("log_a", "log_a_back", 1)) from None


def check_valid(valid: Optional[torch.Tensor], B: int, T: int) -> Optional[torch.Tensor]:
    """The padding mask as (B, T) bool (True = a real token), or None; 0/1 integers are accepted."""
    if valid is None:
        return None
    if not isinstance(valid, torch.Tensor):
        raise ValueError(f"valid must be a (B, T) bool tensor or None, got {type(valid).__name__}")
    if tuple(valid.shape) != (B, T):
        raise ValueError(f"valid must have shape ({B}, {T}) (B, T), got {tuple(valid.shape)}")
    if valid.dtype == torch.bool:
        return valid
    if valid.is_floating_point() or valid.is_complex():
        raise ValueError(f"valid must be a bool (or 0/1 integer) padding mask, got dtype {valid.dtype} "
                         "(an additive float mask is not a padding mask)")
    bad = valid[(valid != 0) & (valid != 1)]
    if bad.numel():
        raise ValueError(f"valid must hold only 0 and 1, got {sorted(set(bad.unique().tolist()))[:5]}")
    return valid.bool()


FeatureMap = Callable[[torch.Tensor], torch.Tensor]
"""(B, H, C, d) -> (B, H, C, F): a feature map the ops apply to q or k themselves, a span of tokens
at a time (``phi_q`` / ``phi_k``), so that the chunk and recurrent forms never hold the F-wide
features of the whole input (the Taylor map's F is 561 for heads of 32)."""


def check_inputs(q, k, v, log_a, valid, log_a_back=None, phi_q=None, phi_k=None, key_valid=None):
    """Validate everything; returns (compute dtype, valid as bool or None, the mask of the keys
    that enter the sums as bool or None: ``valid`` and ``key_valid`` together)."""
    B, H, T, _, _ = common.check_qkv(q, k, v)
    check_log_a(log_a, B, H, T)
    check_log_a_back(log_a_back, log_a, B, H, T)
    valid = check_valid(valid, B, T)
    for name, phi in (("phi_q", phi_q), ("phi_k", phi_k)):
        if phi is not None and not callable(phi):
            raise ValueError(f"{name} must be None (q, k are features already) or a callable (B, H, C, d) -> "
                             f"(B, H, C, F), got {type(phi).__name__}")
    if (phi_q is None) != (phi_k is None):
        raise ValueError("phi_q and phi_k go together: give both feature maps (q and k raw) or neither "
                         "(q and k are features already)")
    try:
        key_valid = check_valid(key_valid, B, T)
    except ValueError as e:
        raise ValueError(str(e).replace("valid", "key_valid", 1)) from None
    keys = key_valid if valid is None else (valid if key_valid is None else valid & key_valid)
    dt = common.compute_dtype(q, k, v, *[x for x in (log_a, log_a_back) if x is not None])
    return dt, valid, keys


def span_features(x: torch.Tensor, phi: Optional[FeatureMap], keep: Optional[torch.Tensor], s0: int, s1: int,
                  dt: torch.dtype) -> torch.Tensor:
    """Tokens [s0, s1) of q, k or v (B, H, T, D) in the compute dtype, through ``phi`` if given,
    and 0 where ``keep`` (B, T) is False: padding never reaches a state (NaN there is cleared too)."""
    x = x[:, :, s0:s1]
    x = (x if phi is None else phi(x)).to(dt)
    return x if keep is None else x.masked_fill(~keep[:, None, s0:s1, None], 0.0)


def feature_width(k: torch.Tensor, phi: Optional[FeatureMap]) -> int:
    """F: k's last axis, or what ``phi`` makes of it (asked on no tokens)."""
    return k.shape[-1] if phi is None else phi(k[:, :, :0]).shape[-1]


def records_graph(tensors, phi: Optional[FeatureMap]) -> bool:
    """Whether autograd may record the op: grad mode on and an input that requires grad, or a
    feature map (whose parameters the op cannot see)."""
    return torch.is_grad_enabled() and (phi is not None or any(
        t is not None and t.requires_grad for t in tensors))


def span_qkv(q, k, v, valid, keys, dt, phi_q=None, phi_k=None, s0: int = 0, s1: Optional[int] = None):
    """q and k features and v of tokens [s0, s1) (default: the whole input), masked, as
    ``span_features`` gives them: padding (``valid``) zeroes all three, left-out keys (``keys``) k."""
    s1 = q.shape[2] if s1 is None else s1
    return (span_features(q, phi_q, valid, s0, s1, dt), span_features(k, phi_k, keys, s0, s1, dt),
            span_features(v, None, valid, s0, s1, dt))


def token_log_gates(log_a, valid, B: int, T: int, dt) -> Optional[torch.Tensor]:
    """Per-token log gates (B, H, T), 0 at padding (a = 1: the decay passes padding unchanged);
    None for lit."""
    if log_a is None:
        return None
    lg = log_a.to(dt)
    if lg.dim() == 1:
        lg = lg.view(1, -1, 1).expand(B, -1, T)
    if valid is not None:
        lg = lg.masked_fill(~valid[:, None, :], 0.0)
    return lg


def gate_cumsums(lg: torch.Tensor, lg_back: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, c) from per-token log gates (B, H, T): b_t = Σ_{k<=t} log a_k, the forward gates'
    inclusive cumsum, and c_t = Σ_{k<t} log a'_k, the backward gates' exclusive one (a' = the
    gates of ``lg_back``; a' = a when it is None). M_ij = e^{b_i - b_j} below the diagonal and
    e^{c_j - c_i} above it (``selective_mask``)."""
    lb = lg if lg_back is None else lg_back
    return lg.cumsum(-1), lb.cumsum(-1) - lb


def selective_mask(lg: torch.Tensor, lg_back: Optional[torch.Tensor] = None) -> torch.Tensor:
    """M (B, H, T, T) from per-token log gates (B, H, T): forward-lower + backward-upper - I.

    With b_t = Σ_{k<=t} log a_k (forward cumsum) and c_t = Σ_{k<t} log a'_k (a' = the gates of
    ``lg_back``, the right-to-left direction; a' = a when it is None, LION's symmetric mask):
      lower (i >= j): log M_ij = b_i - b_j = Σ_{k=j+1..i} log a_k
      upper (i <= j): log M_ij = c_j - c_i = Σ_{k=i..j-1} log a'_k
    Both give 0 on the diagonal, so choosing per triangle in log space and taking one exp is the
    sum of the two triangular masks minus I. The choice comes before the exp: the other triangle's
    value is >= 0 there and may overflow, and it is never exponentiated (nor gets a gradient).
    """
    T = lg.shape[-1]
    b, c = gate_cumsums(lg, lg_back)
    lower = torch.ones(T, T, dtype=torch.bool, device=lg.device).tril()
    return torch.where(lower, b.unsqueeze(-1) - b.unsqueeze(-2), c.unsqueeze(-2) - c.unsqueeze(-1)).exp()


def lion_mask(log_a: Optional[torch.Tensor], T: int, valid: Optional[torch.Tensor] = None, *,
              batch_size: int = 1, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None,
              log_a_back: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The LION mask M, broadcastable to (B, H, T, T), in ``dtype`` (default: fp32, fp64 for fp64 ``log_a``).

    lit: ones (1, 1, T, T). d without padding: the Toeplitz λ_h^{|i-j|}, (1, H, T, T). s, or d with
    padding: ``selective_mask`` of the per-token gates (a = 1 at padding), (B, H, T, T). With
    ``log_a_back`` the upper triangle (keys right of the query) takes those decays instead.
    """
    if isinstance(T, bool) or not isinstance(T, int) or T < 0:
        raise ValueError(f"T must be a non-negative int, got {T!r}")
    B = valid.shape[0] if valid is not None else (log_a.shape[0] if log_a is not None and log_a.dim() == 3 else batch_size)
    H = 1 if log_a is None else log_a.shape[-1 if log_a.dim() == 1 else 1]
    check_log_a(log_a, B, H, T)
    check_log_a_back(log_a_back, log_a, B, H, T)
    valid = check_valid(valid, B, T)
    dt = dtype or (torch.float32 if log_a is None else common.compute_dtype(log_a))
    if log_a is None:
        return torch.ones(1, 1, T, T, dtype=dt, device=device if valid is None else valid.device)
    if log_a.dim() == 1 and valid is None:
        idx = torch.arange(T, device=log_a.device)
        dist = (idx[:, None] - idx[None, :]).to(dt)  # query - key: > 0 below the diagonal
        back = log_a if log_a_back is None else log_a_back
        log_m = torch.where(dist >= 0, dist * log_a.to(dt).view(-1, 1, 1), -dist * back.to(dt).view(-1, 1, 1))
        return log_m.exp().unsqueeze(0)
    return selective_mask(token_log_gates(log_a, valid, B, T, dt), token_log_gates(log_a_back, valid, B, T, dt))


def boundary_state(k: torch.Tensor, v: torch.Tensor, lg: Optional[torch.Tensor],
                   lg_back: Optional[torch.Tensor] = None) -> LionState:
    """The forward state after the last token and the backward state at the first token, from
    (masked, compute-dtype) k, v and per-token log gates (None for lit; ``lg_back`` those of the
    backward direction, None = ``lg``)."""
    if lg is None:
        S, z = k.transpose(-1, -2) @ v, k.sum(2)
        return LionState(S, z, S, z)
    b, c = gate_cumsums(lg, lg_back)
    to_end = (b[..., -1:] - b).exp().unsqueeze(-1)  # Π_{k=j+1..T} a_k
    from_start = c.exp().unsqueeze(-1)               # Π_{k=1..j-1} a'_k
    kf, kb = k * to_end, k * from_start
    return LionState(kf.transpose(-1, -2) @ v, kf.sum(2), kb.transpose(-1, -2) @ v, kb.sum(2))


def lion_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_a: Optional[torch.Tensor] = None, *,
    valid: Optional[torch.Tensor] = None, scaled: bool = True, eps: float = 1e-6,
    log_a_back: Optional[torch.Tensor] = None, phi_q: Optional[FeatureMap] = None,
    phi_k: Optional[FeatureMap] = None, key_valid: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, LionState]:
    """o = scale((q k^T) ⊙ M) v, with M = ``lion_mask(log_a, T, valid)``: straight from the formula.
    With ``phi_q`` / ``phi_k``, q and k are the raw heads and the features are theirs; keys where
    ``key_valid`` is False enter no sum (their queries still read, their gates still decay)."""
    dt, valid, keys = check_inputs(q, k, v, log_a, valid, log_a_back, phi_q, phi_k, key_valid)
    B, _, T, _ = q.shape
    qf, kf, vf = span_qkv(q, k, v, valid, keys, dt, phi_q, phi_k)
    if T:
        mask = lion_mask(log_a, T, valid, batch_size=B, dtype=dt, device=q.device, log_a_back=log_a_back)
        weights = (qf @ kf.transpose(-1, -2)) * mask  # (B, H, T, T)
        num = weights @ vf
        o = common.normalize_output(num, weights.sum(-1, keepdim=True), eps) if scaled else num
    else:
        o = vf
    state = boundary_state(kf, vf, token_log_gates(log_a, valid, B, T, dt),
                           token_log_gates(log_a_back, valid, B, T, dt))
    return o.to(v.dtype), state
