"""linearize: convert pretrained Transformers into subquadratic linear-attention models."""

__version__ = "0.1.0"
