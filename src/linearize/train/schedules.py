"""Learning-rate schedules (cosine with warmup, reduce-on-plateau, constant) and TPTT's mu schedule."""

from __future__ import annotations

import math

import torch

MU_LOW, MU_HIGH = 0.01, 0.5  # TPTT: memory-as-gate weight ramps from 0.01 to 0.5


def cosine_with_warmup(step: int, total: int, warmup: int, floor: float = 0.1) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine from 1 down to ``floor``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, kind: str, total_steps: int, warmup: int,
                   patience: int, factor: float):
    """A torch scheduler; ``plateau`` is stepped with the validation loss, the others every step."""
    if kind == "cosine":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_with_warmup(s, total_steps, warmup))
    if kind == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=factor, patience=patience)
    if kind == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    raise ValueError(f"lr_schedule must be one of ('cosine', 'plateau', 'constant'), got {kind!r}")


def mu_at(step: int, kind: str, steps: int, constant: float = MU_HIGH) -> float:
    """liza's mixing weight mu at an optimizer step.

    constant: ``constant`` throughout; ramp: 0.01 -> 0.5 linearly over ``steps`` steps, then 0.5
    (TPTT's callback); cyclic: a triangle wave between 0.01 and 0.5 with period 2 * ``steps``;
    switch: 0.01 for ``steps`` steps, then 0.5.
    """
    if kind == "constant":
        return float(constant)
    if kind == "ramp":
        return MU_LOW + (MU_HIGH - MU_LOW) * min(1.0, step / steps)
    if kind == "cyclic":
        phase = (step % (2 * steps)) / steps
        return MU_LOW + (MU_HIGH - MU_LOW) * (phase if phase <= 1 else 2 - phase)
    if kind == "switch":
        return MU_LOW if step < steps else MU_HIGH
    raise ValueError(f"mu_schedule must be one of ('constant', 'ramp', 'cyclic', 'switch'), got {kind!r}")
