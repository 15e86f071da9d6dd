"""Stage 2's low-rank adapters: peft LoRA injected in place, so the model stays a plain HF model
(``generate`` and the state cache work unchanged) and the checkpoint records how to rebuild it."""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from .adapters import adapter_for


def default_lora_targets(model: nn.Module) -> list[str]:
    """The attention projections: q, k, v, o (or the fused qkv and o)."""
    adapter = adapter_for(model)
    return [adapter.fused_qkv, "o_proj"] if adapter.fused_qkv else ["q_proj", "k_proj", "v_proj", "o_proj"]


def add_lora(model: nn.Module, *, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             targets: list[str] | None = None) -> dict:
    """Inject LoRA into ``model`` (in place); only the LoRA weights stay trainable.

    Returns the settings, also stored as ``model.linearize_lora`` for ``save``/``load``.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if getattr(model, "linearize_lora", None) is not None:
        raise ValueError("this model already has LoRA adapters (linearize_lora is set)")
    targets = list(targets or default_lora_targets(model))
    check_lora_targets(model, targets)
    settings = {"rank": int(rank), "alpha": float(alpha), "dropout": float(dropout), "targets": targets}
    config = LoraConfig(r=settings["rank"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                        target_modules=targets, bias="none")
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model.linearize_lora = settings
    return settings


def check_lora_targets(model: nn.Module, targets: list[str]) -> None:
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ValueError(f"lora_targets {missing} name no module of this model; "
                         f"projections it has: {sorted(n for n in names if n.endswith('proj'))}")


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter into its base projection and put the plain layer back (in place)."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    model.linearize_lora = None
    return model


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if "lora_" in name]


@contextmanager
def lora_disabled(model: nn.Module):
    """Run ``model`` with its LoRA adapters switched off: the teacher's own projections."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    try:
        for m in layers:
            m.enable_adapters(False)
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)
