"""Learnable feature maps phi, one per head: (B, H, T, d) -> (B, H, T, F).

Hedgehog (LoLCATs, Lizard): phi(x) = softmax(x W) ++ softmax(-x W), softmax over the F/2 features,
W per head of shape (d, F/2), so F counts both halves. The log-softmax and the exp run in fp32
and the features are rounded once, to the input's dtype; ``log_features`` returns log phi (the
ops also take log-features, ``log_space_features=True``).

T2R: phi(x) = relu(x W + b).

Taylor (Based's second-order kernel, with a learned map): y = x W, W per head (d, p), and a
learned scale s per head, phi(x) = [1, sqrt(s) y, s y_i y_j (i < j), s y_i^2 / sqrt(2)], so that
for two such maps phi_q(q) . phi_k(k) = 1 + u + u^2 / 2 with u = sqrt(s_q s_k) (q W_q).(k W_k):
the first terms of exp(u), positive everywhere (its minimum is 1/2, at u = -1). F = 1 + p +
p (p + 1) / 2 grows with p^2 (561 for p = 32), but the parallel form needs no features: it
takes the kernel from u directly (``pairwise``), at the cost of one (T x T) product.

Initialisation ``"identity"``: W = the (d, F/2) (resp. (d, F)) rectangular identity, so at the
start phi only re-weights the teacher's own query/key coordinates (LoLCATs' identity init when
F/2 = d); ``"random"``: N(0, 1/d) entries.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import check_positive_int, compute_dtype

FEATURE_MAP_INITS = ("identity", "random")


def _init_weight(num_heads: int, in_dim: int, out_dim: int, init: str) -> torch.Tensor:
    if init == "identity":
        return torch.eye(in_dim, out_dim).expand(num_heads, in_dim, out_dim).clone()
    if init == "random":
        return torch.randn(num_heads, in_dim, out_dim) / math.sqrt(in_dim)
    raise ValueError(f"init must be one of {FEATURE_MAP_INITS}, got {init!r}")


def _project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(B, H, T, d) @ (H, d, n) -> (B, H, T, n), checking the head count and width."""
    if x.dim() != 4 or x.shape[1] != weight.shape[0] or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"expected input (B, {weight.shape[0]}, T, {weight.shape[1]}), got {tuple(x.shape)}")
    return torch.einsum("bhtd,hdn->bhtn", x, weight.to(x.dtype))


class HedgehogFeatureMap(nn.Module):
    """phi(x) = [softmax(xW) ++ softmax(-xW)] per head; F = feature_dim (even) counts both halves."""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int | None = None, init: str = "identity"):
        super().__init__()
        feature_dim = head_dim if feature_dim is None else feature_dim
        check_positive_int("num_heads", num_heads)
        check_positive_int("head_dim", head_dim)
        if check_positive_int("feature_dim", feature_dim) % 2:
            raise ValueError(f"feature_dim counts both Hedgehog halves and must be even, got {feature_dim}")
        self.num_heads, self.head_dim, self.feature_dim = num_heads, head_dim, feature_dim
        self.weight = nn.Parameter(_init_weight(num_heads, head_dim, feature_dim // 2, init))

    def _log_phi(self, x: torch.Tensor) -> torch.Tensor:
        xw = _project(x, self.weight).to(compute_dtype(x))  # fp32 even for bf16 inputs
        return torch.cat([F.log_softmax(xw, dim=-1), F.log_softmax(-xw, dim=-1)], dim=-1)

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        """log phi(x): (B, H, T, d) -> (B, H, T, F), every entry <= 0."""
        return self._log_phi(x).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """phi(x) (B, H, T, F) in the dtype of x, exponentiated before rounding."""
        return self._log_phi(x).exp().to(x.dtype)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}"


class T2RFeatureMap(nn.Module):
    """phi(x) = relu(x W + b) per head (T2R; LoLCATs' cheaper baseline)."""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int | None = None, init: str = "identity"):
        super().__init__()
        feature_dim = head_dim if feature_dim is None else feature_dim
        check_positive_int("num_heads", num_heads)
        check_positive_int("head_dim", head_dim)
        check_positive_int("feature_dim", feature_dim)
        self.num_heads, self.head_dim, self.feature_dim = num_heads, head_dim, feature_dim
        self.weight = nn.Parameter(_init_weight(num_heads, head_dim, feature_dim, init))
        self.bias = nn.Parameter(torch.zeros(num_heads, 1, feature_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(_project(x, self.weight) + self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}"


def taylor_feature_dim(p: int) -> int:
    """F of the Taylor map for a projection width p: 1 + p + p (p + 1) / 2."""
    return 1 + p + p * (p + 1) // 2


class TaylorFeatureMap(nn.Module):
    """phi(x) = [1, sqrt(s) y, s y_i y_j (i < j), s y_i^2 / sqrt 2], y = x W (see the module doc).

    ``feature_dim`` None takes p = head_dim (W starts at the identity and s at 1/sqrt(head_dim), so
    that u starts at the softmax's own scaled score q.k / sqrt(d)); otherwise it must be
    ``taylor_feature_dim(p)`` for some p >= 1."""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int | None = None, init: str = "identity"):
        super().__init__()
        check_positive_int("num_heads", num_heads)
        check_positive_int("head_dim", head_dim)
        if feature_dim is None:
            p = head_dim
        else:
            check_positive_int("feature_dim", feature_dim)
            p = next(n for n in range(1, feature_dim + 1) if taylor_feature_dim(n) >= feature_dim)
            if taylor_feature_dim(p) != feature_dim:
                raise ValueError(f"the Taylor map's feature_dim is 1 + p + p(p+1)/2 for its projection width p, "
                                 f"e.g. {', '.join(str(taylor_feature_dim(n)) for n in (4, 8, 16, 32))}; "
                                 f"got {feature_dim}")
        self.num_heads, self.head_dim, self.proj_dim = num_heads, head_dim, p
        self.feature_dim = taylor_feature_dim(p)
        self.weight = nn.Parameter(_init_weight(num_heads, head_dim, p, init))
        self.log_scale = nn.Parameter(torch.full((num_heads,), -0.5 * math.log(head_dim)))
        # where y_i^2 lands in the quadratic block, which holds y_i y_i.. y_i y_p-1 for each i in turn
        self.register_buffer("_diag", torch.tensor([i * p - i * (i - 1) // 2 for i in range(p)]), persistent=False)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W in the compute dtype: (B, H, T, d) -> (B, H, T, p)."""
        return _project(x.to(compute_dtype(x)), self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        s = self.log_scale.exp().to(y.dtype).view(-1, 1, 1)
        ys = s * y
        # p slices of y_i * (s y)_{i..} beat a gather of index pairs by 2-3x on the CPU (F-wide tensors)
        quad = torch.cat([y[..., i:i + 1] * ys[..., i:] for i in range(self.proj_dim)], dim=-1)
        diag = torch.ones(quad.shape[-1], dtype=y.dtype, device=y.device).index_fill_(0, self._diag, 2 ** -0.5)
        return torch.cat([torch.ones_like(y[..., :1]), s.sqrt() * y, quad * diag], dim=-1).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, proj_dim={self.proj_dim}, "
                f"feature_dim={self.feature_dim}")


def taylor_kernel(u: torch.Tensor) -> torch.Tensor:
    """1 + u + u^2 / 2: what two Taylor maps' features multiply to, u = sqrt(s_q s_k) y_q . y_k."""
    return 1.0 + u + 0.5 * u * u


def taylor_factors(phi_q: TaylorFeatureMap, phi_k: TaylorFeatureMap, q: torch.Tensor,
                   k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sqrt(s_q s_k) y_q, y_k), both (B, H, T, p) in the compute dtype: u is their dot product,
    for every pair (``pairwise``) or for chosen pairs, without the F-wide features."""
    yq, yk = phi_q.project(q), phi_k.project(k)
    s = (0.5 * (phi_q.log_scale + phi_k.log_scale)).exp().to(yq.dtype).view(-1, 1, 1)
    return s * yq, yk


class TaylorHedgehogFeatureMap(nn.Module):
    """phi(x) = [e^{a/2} phi_T(x), e^{c/2} phi_H(x)]: a Taylor map and a Hedgehog map side by side,
    weighted per head (a, c learned), so that two such maps multiply to the sum of the two kernels

        phi_q(q) . phi_k(k) = w_T (1 + u + u^2 / 2) + w_H phi_Hq(q) . phi_Hk(k),   w = e^{(a_q + a_k) / 2}, ...

    The polynomial fits the smooth bulk of a head's weights but cannot peak; Hedgehog's softmax
    features can. ``feature_dim`` is the Hedgehog part's F_H (default 2 d, as LION's Hedgehog);
    F = taylor_feature_dim(d) + F_H. The Hedgehog weight starts at F_H / 4, where its typical
    product (about 4 / F_H for spread features) is about 1, as the polynomial's is."""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int | None = None, init: str = "identity"):
        super().__init__()
        self.taylor = TaylorFeatureMap(num_heads, head_dim, None, init)
        self.hedgehog = HedgehogFeatureMap(num_heads, head_dim, 2 * head_dim if feature_dim is None else feature_dim,
                                           init)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.feature_dim = self.taylor.feature_dim + self.hedgehog.feature_dim
        self.log_weight = nn.Parameter(torch.tensor([0.0, math.log(self.hedgehog.feature_dim / 4)]).repeat(num_heads, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = (0.5 * self.log_weight).exp().to(compute_dtype(x)).view(-1, 1, 1, 2)
        return torch.cat([self.taylor(x) * half[..., 0], self.hedgehog(x) * half[..., 1]], dim=-1).to(x.dtype)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}"


def kernel_terms(phi_q: nn.Module, phi_k: nn.Module, q: torch.Tensor, k: torch.Tensor) -> list:
    """phi_q(q_i) . phi_k(k_j) as a sum of terms f(a_i . b_j), a list of (a, b, f) with a, b
    (B, H, T, n) in the compute dtype: for Taylor maps their d-wide factors and the polynomial
    (``taylor_factors``), which spares the F-wide products; for Taylor + Hedgehog maps one term
    per part, weighted; for other maps the features and f = None (the identity)."""
    if isinstance(phi_q, TaylorFeatureMap) and isinstance(phi_k, TaylorFeatureMap):
        return [(*taylor_factors(phi_q, phi_k, q, k), taylor_kernel)]
    if isinstance(phi_q, TaylorHedgehogFeatureMap) and isinstance(phi_k, TaylorHedgehogFeatureMap):
        acc = compute_dtype(q)
        w = (0.5 * (phi_q.log_weight + phi_k.log_weight)).exp().to(acc)  # (H, 2)
        (a, b, poly), = kernel_terms(phi_q.taylor, phi_k.taylor, q, k)
        hq, hk = (f(x).to(acc) * w[:, 1].sqrt().view(-1, 1, 1) for f, x in ((phi_q.hedgehog, q), (phi_k.hedgehog, k)))
        return [(a, b, lambda u: w[:, 0].view(-1, *[1] * (u.dim() - 2)) * poly(u)), (hq, hk, None)]
    acc = compute_dtype(q)
    return [(phi_q(q).to(acc), phi_k(k).to(acc), None)]


def pairwise(phi_q: nn.Module, phi_k: nn.Module, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """phi_q(q) . phi_k(k) for every pair, (B, H, T, d) x2 -> (B, H, T, T) in the compute dtype,
    from ``kernel_terms`` (Taylor maps without their F-wide features)."""
    out = 0
    for a, b, f in kernel_terms(phi_q, phi_k, q, k):
        u = a @ b.transpose(-1, -2)
        out = out + (u if f is None else f(u))
    return out


FEATURE_MAPS = {"hedgehog": HedgehogFeatureMap, "t2r": T2RFeatureMap, "taylor": TaylorFeatureMap,
                "taylor+hedgehog": TaylorHedgehogFeatureMap}
