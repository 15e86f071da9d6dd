"""Stage 1, attention transfer: each linearized layer learns to reproduce its teacher's attention.

Teacher-forced and layer-wise (LoLCATs, Lizard): inside every ``LinearizedAttention`` the teacher's
softmax output (SDPA) and the student's output (the chunked form) are computed on the same q/k/v,
their MSE is recorded, and the *teacher's* output flows on, so layer i always sees the teacher's
hidden states and its loss depends only on its own parameters. Only the new modules train; the
projections are frozen, so no graph is kept outside the student branches.

Blocks: the linearized layers are trained ``block_size`` decoder layers at a time; a block's inputs
(the teacher's hidden states entering its first layer) are computed once, kept on the CPU, and
the layers before the block are skipped while it trains (LoLCATs' recipe for 70B/405B). With no
block size, one block covers the whole model and its inputs are just the embeddings.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ..models.adapters import adapter_for
from ..models.attention import TransferRecorder
from ..models.convert import linearized_layers


class _StopForward(Exception):
    """Raised after a block's last layer: nothing beyond it is needed."""


class _Skip(nn.Module):
    """Stands in for a decoder layer before the block: its input passes through untouched."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


@dataclass(frozen=True)
class Block:
    start: int  # first decoder layer
    end: int    # one past the last decoder layer
    layers: tuple[int, ...]  # the linearized layers in [start, end)


def make_blocks(model: nn.Module, block_size: int | None) -> list[Block]:
    """Blocks of ``block_size`` consecutive decoder layers that hold at least one linearized
    layer; ``None`` = one block up to the last linearized layer."""
    linear = sorted(m.layer_idx for m in linearized_layers(model))
    if not linear:
        return []
    if block_size is None:
        return [Block(0, linear[-1] + 1, tuple(linear))]
    blocks = []
    for start in range(0, linear[-1] + 1, block_size):
        inside = tuple(i for i in linear if start <= i < start + block_size)
        if inside:
            blocks.append(Block(start, min(start + block_size, linear[-1] + 1), inside))
    return blocks


# The global memory's decay gate and write strength: what decides how long anything stays recallable.
MEMORY_MODULES = ("gate", "beta_proj")


def trainable_attention_parameters(model: nn.Module, block: Block | None = None, *,
                                   memory: bool = True) -> list[nn.Parameter]:
    """The new modules' parameters (all blocks when ``block`` is None); ``memory`` False leaves out
    those of ``MEMORY_MODULES``."""
    params = []
    for m in linearized_layers(model):
        if block is None or m.layer_idx in block.layers:
            if m.hybrid.config.trainable:  # liger's pooled gate has nothing to learn
                params += [p for name, p in m.hybrid.named_parameters()
                           if memory or name.split(".")[0] not in MEMORY_MODULES]
    return params


def freeze_all_but(model: nn.Module, params: list[nn.Parameter]) -> None:
    keep = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


@contextlib.contextmanager
def transfer_mode(model: nn.Module, target: str, block: Block, block_inputs: torch.Tensor | None = None,
                  capture: list | None = None):
    """Run ``model`` forward in transfer mode for one block; yields the recorder.

    ``block_inputs``: (B, T, hidden) hidden states entering layer ``block.start`` (None when the
    block starts at the embeddings). ``capture``: if a list, the block's output hidden states
    are appended to it. The forward raises ``_StopForward`` after the block's last layer; call
    it through ``run_block``.
    """
    recorder = TransferRecorder(target)
    adapter = adapter_for(model)
    layers = adapter.layers(model)
    attention = {m.layer_idx: m for m in linearized_layers(model)}
    saved = {i: layers[i] for i in range(block.start)}
    handles = []
    try:
        for i in block.layers:
            attention[i].transfer = recorder
        for i in range(block.start):
            layers[i] = _Skip()
        if block_inputs is not None:
            def swap_input(module, args, kwargs):
                return (block_inputs.to(args[0].dtype),) + tuple(args[1:]), kwargs
            handles.append(layers[block.start].register_forward_pre_hook(swap_input, with_kwargs=True))

        def stop(module, args, output):
            if capture is not None:
                capture.append((output[0] if isinstance(output, tuple) else output).detach())
            raise _StopForward

        handles.append(layers[block.end - 1].register_forward_hook(stop))
        yield recorder
    finally:
        for h in handles:
            h.remove()
        for i, layer in saved.items():
            layers[i] = layer
        for i in block.layers:
            attention[i].transfer = None


@contextlib.contextmanager
def teacher_attention(model: nn.Module):
    """Run the converted ``model`` as its teacher: every linearized layer passes its softmax
    teacher's output on (the transfer path over all layers, nothing cut short), so the logits are
    the teacher's without a second copy of its weights."""
    recorder = TransferRecorder("heads")
    layers = linearized_layers(model)
    try:
        for m in layers:
            m.transfer = recorder
        yield
    finally:
        for m in layers:
            m.transfer = None


def run_block(model: nn.Module, batch: dict, target: str, block: Block, block_inputs: torch.Tensor | None = None,
              capture: list | None = None) -> dict[int, torch.Tensor]:
    """One teacher-forced forward over ``block``: {layer index: MSE} (differentiable)."""
    with transfer_mode(model, target, block, block_inputs, capture) as recorder:
        try:
            # (no mask: no padding, as a CUDA graph gets it)
            model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
        except _StopForward:
            if not torch.is_grad_enabled() and hasattr(model, "reset_iter_state"):
                # FSDP2: a forward cut short leaves the iteration open, and no backward will close it
                model.reset_iter_state()
    return recorder.losses


def choose_softmax_layers(errors: dict[int, float], k: int) -> list[int]:
    """The ``k`` layers with the largest transfer error, sorted by index (equal errors: the lower
    index first). ``errors``: {layer index: MSE(student, teacher)} after stage 1."""
    if not 0 < k < len(errors):
        raise ValueError(f"cannot keep {k} of {len(errors)} measured layers as softmax: K must be in 1..{len(errors) - 1}")
    ranked = sorted(errors, key=lambda i: (-errors[i], i))
    return sorted(ranked[:k])


__all__ = ["MEMORY_MODULES", "Block", "choose_softmax_layers", "freeze_all_but", "make_blocks", "run_block", "teacher_attention",
           "trainable_attention_parameters", "transfer_mode"]
