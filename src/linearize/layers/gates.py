"""Log-space forget gates for gated linear attention (Lizard, Table 3), log gamma <= 0.

Input x: (B, T, hidden) (the layer input after the block's norm); output log gamma:
(B, H, T) for scalar gates, (B, H, T, C) for per-channel gates (C channels; with Hedgehog the
layer shares them between the + and - halves).

  sigmoid  log g = logsigmoid(x . w_h + c_h)                 Lizard's default, one scalar per head
  mamba2   log g = -softplus(x . w_h + c_h) * exp(a_h)
  gla      log g = logsigmoid(x W1 W2 + c) / 16              rank 16, per channel (GLA paper)
  pool     log g = logsigmoid(avgpool_d->C(k)) / 16          parameter-free, per channel (Liger)

Initialisation (ours; the papers are silent): projections start at 0 (sigmoid, mamba2) or small
random (gla, so both factors get gradients), and the biases are set so that every head starts with
long memory, gamma_h spread evenly over ``init_gamma`` = (0.95, 0.99) across heads, never 0.5,
so the gated branch starts out close to plain linear attention with a mild recency bias.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import check_positive_int

GLA_TEMPERATURE = 16.0


def head_gammas(num_heads: int, init_gamma: tuple[float, float]) -> torch.Tensor:
    """Per-head decay values spread evenly over ``init_gamma = (lo, hi)`` (float64)."""
    lo, hi = init_gamma
    if not (0.0 < lo <= hi < 1.0):
        raise ValueError(f"init_gamma must be (lo, hi) with 0 < lo <= hi < 1, got {init_gamma!r}")
    return torch.linspace(lo, hi, num_heads, dtype=torch.float64)


def logit(p: torch.Tensor) -> torch.Tensor:
    """The inverse of the sigmoid: a gate bias whose sigmoid is ``p``."""
    return (p / (1 - p)).log()


def _check_input(x: torch.Tensor, hidden_size: int) -> None:
    if x.dim() != 3 or x.shape[-1] != hidden_size:
        raise ValueError(f"gate input must be (B, T, {hidden_size}), got {tuple(x.shape)}")


def _head_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """w_h . x_t + c_h as (B, H, T) from x (B, T, D), weight (H, D), bias (H,). A product over the
    last axis transposed afterwards, so that x's gradient comes back in x's layout: an einsum to
    (B, H, T) returned it transposed, (D, T) in memory, and every later sum with the residual
    stream's gradient read it strided."""
    return (F.linear(x, weight.to(x.dtype)) + bias.to(x.dtype)).transpose(1, 2)


class SigmoidGate(nn.Module):
    """Lizard's gate: one scalar per head, log g = logsigmoid(w_h . x + c_h)."""

    per_channel = False

    def __init__(self, hidden_size: int, num_heads: int, init_gamma: tuple[float, float] = (0.95, 0.99)):
        super().__init__()
        self.hidden_size, self.num_heads = check_positive_int("hidden_size", hidden_size), check_positive_int("num_heads", num_heads)
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size))
        self.bias = nn.Parameter(logit(head_gammas(num_heads, init_gamma)).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.hidden_size)
        logits = _head_logits(x, self.weight, self.bias)
        return F.logsigmoid(logits.float())


class Mamba2Gate(nn.Module):
    """log g = -softplus(w_h . x + c_h) * exp(a_h): Mamba-2's data-dependent step size."""

    per_channel = False

    def __init__(self, hidden_size: int, num_heads: int, init_gamma: tuple[float, float] = (0.95, 0.99)):
        super().__init__()
        self.hidden_size, self.num_heads = check_positive_int("hidden_size", hidden_size), check_positive_int("num_heads", num_heads)
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size))
        # a_h = 0 and softplus(c_h) = -log gamma_h: inverse softplus of the initial step size.
        step = -head_gammas(num_heads, init_gamma).log()
        self.bias = nn.Parameter((step.expm1()).log().float())
        self.log_a = nn.Parameter(torch.zeros(num_heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.hidden_size)
        logits = _head_logits(x, self.weight, self.bias)
        return -F.softplus(logits.float()) * self.log_a.exp()[:, None]


class GLAGate(nn.Module):
    """Per-channel low-rank gate of GLA: log g = logsigmoid(x W1 W2 + c) / 16, C channels per head."""

    per_channel = True

    def __init__(self, hidden_size: int, num_heads: int, channels: int, rank: int = 16,
                 init_gamma: tuple[float, float] = (0.95, 0.99)):
        super().__init__()
        self.hidden_size, self.num_heads = check_positive_int("hidden_size", hidden_size), check_positive_int("num_heads", num_heads)
        self.channels, self.rank = check_positive_int("channels", channels), check_positive_int("rank", rank)
        self.down = nn.Parameter(torch.randn(hidden_size, rank) / math.sqrt(hidden_size))
        self.up = nn.Parameter(torch.randn(rank, num_heads * channels) * 1e-2)
        # gamma = sigmoid(c)^(1/16)  =>  c = logit(gamma^16)
        gammas = head_gammas(num_heads, init_gamma).repeat_interleave(channels)
        self.bias = nn.Parameter(logit(gammas ** GLA_TEMPERATURE).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.hidden_size)
        B, T, _ = x.shape
        logits = (x @ self.down.to(x.dtype)) @ self.up.to(x.dtype) + self.bias.to(x.dtype)
        log_g = F.logsigmoid(logits.float()) / GLA_TEMPERATURE
        return log_g.view(B, T, self.num_heads, self.channels).transpose(1, 2)


class PoolGate(nn.Module):
    """Liger's parameter-free gate: log g = logsigmoid(avgpool(k)) / 16, pooling head_dim -> C channels.

    Takes the keys (B, H, T, d) (before any feature map) instead of x.
    """

    per_channel = True

    def __init__(self, channels: int):
        super().__init__()
        self.channels = check_positive_int("channels", channels)

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        if k.dim() != 4:
            raise ValueError(f"pool gate input must be keys (B, H, T, d), got {tuple(k.shape)}")
        B, H, T, d = k.shape
        pooled = F.adaptive_avg_pool1d(k.float().reshape(B * H * T, 1, d), self.channels)
        return F.logsigmoid(pooled).view(B, H, T, self.channels) / GLA_TEMPERATURE


GATES = {"sigmoid": SigmoidGate, "mamba2": Mamba2Gate, "gla": GLAGate, "pool": PoolGate}
