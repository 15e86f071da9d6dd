"""Learnable feature maps phi, one per head: (B, H, T, d) -> (B, H, T, F).

Hedgehog (LoLCATs, Lizard): phi(x) = softmax(x W) ++ softmax(-x W), softmax over the F/2 features,
W per head of shape (d, F/2), so F counts both halves. The log-softmax and the exp run in fp32
and the features are rounded once, to the input's dtype; ``log_features`` returns log phi (the
ops also take log-features, ``log_space_features=True``).

T2R: phi(x) = relu(x W + b).

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


FEATURE_MAPS = {"hedgehog": HedgehogFeatureMap, "t2r": T2RFeatureMap}
