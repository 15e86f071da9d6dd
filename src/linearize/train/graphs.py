"""A training micro-batch's forward and backward replayed as one CUDA graph.

A small model's step is bound by the host: SmolLM2-135M's stage-2 step queues some 15,000 kernels
(its 30 layers' projections, feature maps, gates, norms, casts and their backward), and Python
queues them more slowly than the GPU runs them. Captured once, the whole forward and backward of
a micro-batch is one graph launch; the optimizer step (clipping, the non-finite check, AdamW)
stays eager, a handful of foreach kernels.

What the graph needs from the step, and what ``GraphedStep`` checks or arranges:

- static shapes: one graph per batch signature (names, shapes, dtypes), a few at most, each
  captured the first time its signature comes; beyond ``MAX_GRAPHS`` a batch runs eagerly;
- no read of a device value on the host during the forward or backward (``.item()``, ``bool(t)``):
  the stages' losses return their extras as tensors, read after the replay, and the model's "is
  anything padded?" shortcuts (``ops.common.known_all_true``) keep the mask while capturing. A batch
  without padding is given no attention mask (the fast path of an unpadded batch); one with
  padding keeps it, and gets a graph of its own (its signature differs);
- gradients in place: the graph adds its gradients into each parameter's ``.grad``, allocated once
  before the capture; the loop zeroes them in place (``zero_grad(set_to_none=False)``), so that the
  graph's writes always land in the tensors the optimizer reads;
- its inputs copied into the graph's own input tensors before each replay; the graphs of a stage
  share one memory pool (they never run at once).

A capture that fails (an op that cannot be captured) is reported once and the stage goes on
eagerly; the eager step is the reference, and the graphed one computes the same kernels.

Beside the graph, ``compile_attention_modules`` compiles the new attention's small modules (feature
maps, gates) with ``torch.compile``: each is a projection and a few elementwise ops in fp32 whose
forward and backward inductor fuses into a few kernels (the attention op itself stays as it is);
``cache_frozen_casts`` keeps the frozen projections' weights cast once for autocast (which re-casts
every weight that needs no gradient at every use: about a thousand kernels a step on SmolLM2).
"""

from __future__ import annotations

import types
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import gc_paused

MAX_GRAPHS = 4  # batch signatures captured per stage; a stage's rows rarely have more than one


def _signature(batch: dict) -> tuple:
    return tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in batch.items() if torch.is_tensor(v)))


class GraphedStep:
    """``loss_fn``'s forward and backward for one micro-batch, captured per batch signature.

    ``loss_fn(batch) -> (loss, extras)`` must read no device value on the host; ``extras`` maps
    names to tensors (or plain Python values that do not change between batches). ``__call__``
    returns (loss, extras) as detached tensors after adding ``loss * scale * weight``'s gradients
    into the parameters' ``.grad`` (``weight`` a per-call number, a device scalar the graphs read),
    or None where the batch must run eagerly (a new signature beyond
    ``MAX_GRAPHS``, or after a failed capture)."""

    def __init__(self, loss_fn: Callable[[dict], tuple[torch.Tensor, dict]], params: list[nn.Parameter],
                 autocast_ctx: Callable[[], object], scale: float, device: torch.device):
        self.loss_fn, self.params, self.autocast_ctx = loss_fn, params, autocast_ctx
        self.scale, self.device = scale, device
        self.weight: torch.Tensor | None = None  # made at the first call (on the device)
        self.graphs: dict[tuple, tuple] = {}
        self.failed: str | None = None
        self.pool = None  # the graphs' shared memory pool (made at the first capture)

    @staticmethod
    def _graph_inputs(batch: dict) -> dict:
        """The batch without its attention mask where nothing is padded (a CPU tensor: no device sync)."""
        mask = batch.get("attention_mask")
        if mask is not None and bool(mask.all()):
            return {k: v for k, v in batch.items() if k != "attention_mask"}
        return dict(batch)

    def __call__(self, batch: dict, weight: float = 1.0):
        """``batch`` on the CPU, as the loop makes it."""
        if self.failed is not None:
            return None
        if self.weight is None:
            self.weight = torch.ones((), dtype=torch.float32, device=self.device)
        self.weight.fill_(weight)
        inputs = self._graph_inputs(batch)
        key = _signature(inputs)
        if key not in self.graphs:
            if len(self.graphs) >= MAX_GRAPHS:
                return None
            try:
                self.graphs[key] = self._capture(inputs)
            except Exception as e:  # noqa: BLE001 - an op that cannot be captured: the stage runs eagerly
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if str(e) else type(e).__name__
                warnings.warn(f"CUDA graph capture of the training step failed ({self.failed}); training eagerly",
                              RuntimeWarning, stacklevel=2)
                torch.cuda.synchronize(self.device)
                return None
        graph, static_in, loss, extras = self.graphs[key]
        for k, v in inputs.items():
            static_in[k].copy_(v, non_blocking=True)
        graph.replay()
        # the graph's outputs are overwritten by its next replay: copies for the caller
        return loss.detach().clone(), {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in extras.items()}

    def _capture(self, inputs: dict):
        for p in self.params:  # the graph accumulates into these very tensors
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads_before = [p.grad.clone() for p in self.params]
        static_in = {k: v.to(self.device).clone() for k, v in inputs.items()}
        # warm-up on a side stream, as CUDA graphs ask: lazy initialisation (cuBLAS workspaces, Triton
        # and Gluon compilation, the kernels' side streams) must not happen inside the capture
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward_backward(static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up's blocks: the graph allocates from a pool of its own
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with gc_paused(), torch.cuda.graph(graph, pool=self.pool):
            loss, extras = self._forward_backward(static_in)
        # the warm-up and the capture added gradients of their own: the caller's are restored
        with torch.no_grad():
            torch._foreach_copy_([p.grad for p in self.params], grads_before)
        return graph, static_in, loss, extras

    def _forward_backward(self, batch: dict):
        with self.autocast_ctx():
            loss, extras = self.loss_fn(batch)
        grads = torch.autograd.grad(loss * self.scale * self.weight, self.params, allow_unused=True)
        with torch.no_grad():
            pairs = [(p.grad, g) for p, g in zip(self.params, grads) if g is not None]
            if pairs:
                torch._foreach_add_([a for a, _ in pairs], [g.to(a.dtype) for a, g in pairs])
        return loss.detach(), extras


# Compiled variants one training run needs of each feature map / gate forward (they share one code
# object across layers): grad mode on or off (training, validation) x parameters trainable or not
# (stage 1, stage 2) x input needing a gradient or not (LoRA on q, k) x input layout (a transposed
# view, or contiguous after RoPE) x batch width (Rows.batch's trim buckets). torch's default of 8
# was used up within a run, after which the maps ran eagerly.
RECOMPILE_LIMIT = 64


def compile_attention_modules(model: nn.Module) -> int:
    """Compile, in place (``nn.Module.compile``: the state dict keeps its keys), the feature maps,
    gates and beta projections of every linearized layer of ``model``, and switch on the layers'
    compiled glue (their parameterless elementwise work: ``HybridAttention.compile_glue``); returns
    how many modules were compiled. Raises torch's recompile limit to at least ``RECOMPILE_LIMIT``."""
    import torch._dynamo

    from ..models.convert import linearized_layers

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    count = 0
    for layer in linearized_layers(model):
        layer.hybrid.compile_glue = True
        for name in ("phi_q", "phi_k", "gate", "beta_proj"):
            module = getattr(layer.hybrid, name, None)
            if isinstance(module, nn.Module) and any(True for _ in module.parameters()):
                module.compile()
                count += 1
    return count


def _cast_once_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``, except that under autocast a weight that needs no gradient is cast to
    autocast's dtype once and kept (recast when it is moved or changed in place): the same product
    autocast would form, without a cast kernel at every call. Elsewhere, the plain forward."""
    w = self.weight
    if w.requires_grad or not torch.is_autocast_enabled(x.device.type):
        return F.linear(x, w, self.bias)
    dtype = torch.get_autocast_dtype(x.device.type)
    key = (w.device, w.data_ptr(), w._version, dtype)
    if self._cast_key != key:
        self._cast_weight, self._cast_key = w.detach().to(dtype), key
    return F.linear(x.to(dtype), self._cast_weight, None if self.bias is None else self.bias.to(dtype))


def cache_frozen_casts(model: nn.Module) -> int:
    """Every ``nn.Linear`` of ``model`` (peft's base layers included) keeps its weight cast for
    autocast while it is frozen (``_cast_once_forward``): the teacher's projections and LM head in
    both stages. Costs one copy of those weights in the autocast dtype. Returns how many it set."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and "_cast_key" not in vars(module):
            module._cast_key, module._cast_weight = None, None
            module.forward = types.MethodType(_cast_once_forward, module)
            count += 1
    return count
