"""linearize: convert pretrained Transformers into subquadratic linear-attention models."""

__version__ = "0.1.0"

import importlib

from .methods import methods  # noqa: E402

# The model-level API needs transformers, whose import takes seconds: it loads on first use, so that
# the CLI can refuse a bad argument before paying for it.
_LAZY = {"ArchAdapter": "models.adapters", "register_adapter": "models.adapters",
         "supported_architectures": "models.adapters", "load": "models.checkpoint", "save": "models.checkpoint",
         "convert": "models.convert", "load_teacher": "models.teacher"}

__all__ = ["ArchAdapter", "convert", "load", "load_teacher", "methods", "register_adapter", "save",
           "supported_architectures"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _register_with_lm_eval() -> None:
    """``lm_eval.simple_evaluate(model="linearize", ...)`` works once linearize is imported: where
    lm-eval is installed, its registry gets a lazy entry (linearize.eval.harness and lm-eval's heavy
    modules load on first use; an older lm-eval, whose registry takes no lazy entries, gets the
    class itself). Without lm-eval nothing happens."""
    try:
        from lm_eval.api import registry
    except Exception:  # not installed, or broken: the rest of linearize works without it
        return
    try:
        if hasattr(getattr(registry, "model_registry", None), "register"):
            import lm_eval.models  # noqa: F401  (lm-eval's own names first: it fills only an empty registry)

            if "linearize" not in registry.model_registry:
                registry.model_registry.register("linearize", target="linearize.eval.harness:LinearizeLM")
        else:
            from .eval import harness  # noqa: F401  (registers the class on import)
    except Exception:  # a frozen or otherwise unusual registry: lm-eval's own models still work
        pass


_register_with_lm_eval()
