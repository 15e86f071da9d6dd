"""linearize: convert pretrained Transformers into subquadratic linear-attention models."""

__version__ = "0.1.0"

from .methods import methods  # noqa: E402
from .models.adapters import ArchAdapter, register_adapter, supported_architectures  # noqa: E402
from .models.checkpoint import load, save  # noqa: E402
from .models.convert import convert  # noqa: E402
from .models.teacher import load_teacher  # noqa: E402

__all__ = ["ArchAdapter", "convert", "load", "load_teacher", "methods", "register_adapter", "save",
           "supported_architectures"]


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
