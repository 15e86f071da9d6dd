"""linearize: convert pretrained Transformers into subquadratic linear-attention models."""

__version__ = "0.1.0"

from .methods import methods  # noqa: E402
from .models.adapters import ArchAdapter, register_adapter, supported_architectures  # noqa: E402
from .models.checkpoint import load, save  # noqa: E402
from .models.convert import convert  # noqa: E402
from .models.teacher import load_teacher  # noqa: E402

__all__ = ["ArchAdapter", "convert", "load", "load_teacher", "methods", "register_adapter", "save",
           "supported_architectures"]
