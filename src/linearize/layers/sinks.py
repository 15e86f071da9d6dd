"""Attention sinks of Lizard's anchor window, per head.

v2 ``logits``: m learnable logits t_j with zero values; they only add e^{t_j} to the window's
softmax denominator (attention mass can go "nowhere"). Initialised at 0, i.e. each sink weighs
like a key with score 0.
v1 ``kv``: m learnable key/value vectors that every query attends to, without RoPE; keys start
at 0 (score 0) and values at small random, so both receive gradients from the first step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.common import check_positive_int

SINK_KINDS = ("logits", "kv")


class Sinks(nn.Module):
    def __init__(self, num_heads: int, num_sinks: int, head_dim: int, kind: str = "logits"):
        super().__init__()
        if kind not in SINK_KINDS:
            raise ValueError(f"sink kind must be one of {SINK_KINDS}, got {kind!r}")
        check_positive_int("num_heads", num_heads)
        check_positive_int("num_sinks", num_sinks)
        check_positive_int("head_dim", head_dim)
        self.kind = kind
        if kind == "logits":
            self.logits = nn.Parameter(torch.zeros(num_heads, num_sinks))
        else:
            self.keys = nn.Parameter(torch.zeros(num_heads, num_sinks, head_dim))
            self.values = nn.Parameter(torch.randn(num_heads, num_sinks, head_dim) * 0.02)

    def op_kwargs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for the window-attention op."""
        if self.kind == "logits":
            return {"sink_logits": self.logits}
        return {"sink_k": self.keys, "sink_v": self.values}
