"""Two-stage linearization training: attention transfer (stage 1), then LoRA (stage 2)."""

from .config import TrainConfig
from .run import run

__all__ = ["TrainConfig", "run"]
