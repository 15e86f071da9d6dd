"""Training on several processes: ``torchrun --nproc-per-node N -m linearize.cli train ...``.

Data parallel, in one of two modes (``config.shard``):

- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``): every decoder layer, every new
  attention module, the (untied) embeddings and head, and the rest of the model are sharded across
  the ranks, frozen teacher weights included, so each rank holds 1/N of the weights, gradients and
  optimizer state between uses, and each stage gathers only what its forward and backward use
  (``Parallel.stage_layout``). For a model that does not fit one GPU.
- ``replicate``: each rank holds the whole model and runs the one-device step (CUDA graphs,
  compiled feature maps); after a step's micro-batches one all-reduce averages the trainable
  parameters' gradients. For a model that fits: nothing is gathered per layer, nothing is
  host-bound that one device is not. ``auto`` picks it on CUDA for a model that takes at most
  1/8 of a GPU's memory.

Each rank takes its own slice of every global micro-batch (``config.batch_size`` rows in all,
``batch_size / N`` per rank); the loss on each rank is weighed by its share of the micro-batch's
tokens, so the averaged gradient is the one-process gradient of the whole micro-batch, and the
losses recorded are the whole micro-batch's. Mixed precision is what one device does (autocast
over fp32 weights).

Rank 0 alone writes the metrics, curves, resume state and checkpoint; these are gathered in full
and have the one-process format, so a run written by N ranks resumes or loads on any number.
CUDA ranks use NCCL, CPU ranks gloo (how the tests run). ``setup`` is what ``train.run`` calls:
with one process it returns None and nothing here is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..models.adapters import adapter_for
from ..models.checkpoint import ADDED_MARKERS
from ..models.convert import linearized_layers
from .config import TrainConfig

# Settings that may differ between the ranks of one run (they change nothing the ranks compute).
RANK_LOCAL_SETTINGS = ("progress",)


def launched_world_size() -> int:
    """Processes in this run: the process group's size, else torchrun's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an integer, got {value!r}") from None


def check_batch_split(config: TrainConfig, world_size: int) -> None:
    """The global micro-batch (``batch_size`` rows) must split evenly across the ranks."""
    if config.batch_size % world_size:
        raise ValueError(f"batch_size {config.batch_size} does not divide across {world_size} processes: the "
                         f"global batch is split evenly, so use a multiple of {world_size} (e.g. "
                         f"{world_size * max(1, config.batch_size // world_size)}) or another --nproc-per-node")


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA ranks, gloo for CPU ranks; a backend missing from this PyTorch build is named."""
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"training on several processes runs on cuda or cpu, got device {str(device)!r}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_available():
        raise ValueError("this PyTorch build has no torch.distributed, so it cannot train on several processes")
    if not (dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()):
        raise ValueError(f"the {backend!r} backend that {device.type} ranks need is not available in this PyTorch "
                         f"build (torch {torch.__version__}); install a build with it or use --device "
                         f"{'cpu' if backend == 'nccl' else 'cuda'}")
    return backend


def rank_device(config: TrainConfig, local_rank: int) -> torch.device:
    """Rank ``local_rank``'s device: ``cuda:LOCAL_RANK`` (one GPU per process) or the CPU."""
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if name != "cuda":
            raise ValueError(f"with several processes each rank uses cuda:LOCAL_RANK; pass --device cuda "
                             f"(or auto), not {config.device!r}")
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available (use --device cpu)")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible")
        return torch.device("cuda", local_rank)
    if name != "cpu":
        raise ValueError(f"training on several processes runs on cuda or cpu, got device {config.device!r}")
    return torch.device("cpu")


@dataclass
class Parallel:
    """This process's place in a data-parallel run, and the collectives the loop needs."""

    rank: int
    world_size: int
    device: torch.device
    owns_group: bool = False                    # run() started the process group, so it ends it
    roots: list = field(default_factory=list)   # the sharded models (for resets after a skipped step)
    mesh: object = None
    mode: str = "fsdp"                          # "fsdp" or "replicate" (``choose_mode``)

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole model (``mode == "replicate"``)."""
        return self.mode == "replicate"

    def choose_mode(self, config: TrainConfig, models: list[nn.Module]) -> str:
        """``config.shard``, with ``auto`` resolved: replicate on CUDA where ``models`` (the
        student, and a distillation teacher) take at most 1/8 of this rank's GPU memory, else fsdp.
        Every rank decides alike (rank 0's GPU decides)."""
        mode = config.shard
        if mode == "auto" and self.device.type != "cuda":
            mode = "fsdp"  # CPU ranks share one host's memory
        elif mode == "auto":
            size = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
            fits = size <= torch.cuda.get_device_properties(self.device).total_memory / 8
            mode = self.all_objects("replicate" if fits else "fsdp")[0]
        self.mode = mode
        return mode

    @property
    def writer(self) -> bool:
        """Rank 0 writes every file of the run."""
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # ----------------------------------------------------------------------------------- data

    def local_rows(self, indices: list[int]) -> list[int]:
        """This rank's consecutive share of a global micro-batch's row ``indices``."""
        per = len(indices) // self.world_size
        return indices[self.rank * per:(self.rank + 1) * per]

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        """Rank ``src``'s values of ``tensors`` (plain, not sharded) to every rank, in place."""
        for t in tensors:
            dist.broadcast(t.data, src=src)

    def all_objects(self, value) -> list:
        """Every rank's ``value`` (picklable), by rank."""
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, value)
        return everyone

    def shared_tensors(self, paths: list, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """Tensors of ``shape`` mapped from files at ``paths`` (created by rank 0) that all ranks of
        this host read and write: the page cache holds what fits, the disk the rest."""
        numel = 1
        for n in shape:
            numel *= n
        size = numel * torch.empty((), dtype=dtype).element_size()
        if self.writer:
            for path in paths:
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as f:
                    f.truncate(size)
        self.barrier()
        return [torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape) for path in paths]

    # ------------------------------------------------------------------------------ the model

    def shard(self, model: nn.Module, gather_dtype: torch.dtype | None = None) -> nn.Module:
        """FSDP2 over ``model`` in place: each new attention module, then each decoder layer, then
        (untied) the input embeddings and the output head, then the rest (final norm; tied
        embeddings) are their own units; each unit's shards go to this rank's device (from the CPU:
        the whole model is never on one GPU).

        ``gather_dtype`` (the run's autocast dtype, bf16, or None): the decoder layers and the head
        are gathered and used in it, half of fp32's bytes on the wire, where autocast would cast
        their products' weights anyway; their gradients are reduced and kept in fp32 and their
        inputs (the residual stream) left in fp32. The rest stays fp32: the embeddings, whose output
        starts the residual stream, and the new attention modules (their gates and sinks take part
        in fp32 sums; they are small). The embeddings and the head are units of their own so that
        each is gathered only where it is used (stage 1 never uses the head) and not kept gathered
        through the step, as the root unit's weights are."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.mesh is None:
            self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        # the new modules return views (heads transposed); nothing changes them in place
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPHybridAttention\) returned a view")
        # The new modules are units of their own: stage 1 trains them with the layers around them
        # frozen, and its loss reaches them without passing through the layer's output.
        for m in linearized_layers(model):
            fully_shard(m.hybrid, mesh=self.mesh)
        policy = MixedPrecisionPolicy() if gather_dtype is None else MixedPrecisionPolicy(
            param_dtype=gather_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for layer in adapter_for(model).layers(model):
            fully_shard(layer, mesh=self.mesh, mp_policy=policy)
        embed, head = _embeddings(model)
        if embed is not None:
            fully_shard(embed, mesh=self.mesh)
        if head is not None:
            fully_shard(head, mesh=self.mesh, mp_policy=policy)
        fully_shard(model, mesh=self.mesh)
        self.roots.append(model)
        return model

    def stage_layout(self, model: nn.Module, target: str | None) -> None:
        """Which units a stage's backward gathers; call it once the stage has frozen what it does
        not train. ``target``: stage 1's transfer target, None for stage 2. "output": each decoder
        layer's weights stay gathered from forward to backward, as its loss goes back through the
        frozen output projection and not through the layer's output, where FSDP would gather them
        again. "heads": backward needs no decoder layer's weights, only the new modules' (units of
        their own), so no layer is gathered in backward: by default the backward of layer l's new
        module prefetches the unit before it in forward (layer l-1), which then stays gathered to
        the end of the backward. Stage 2 gathers every layer in backward. The input embeddings
        are gathered in backward only where something of theirs trains (else the first new
        module's backward would prefetch them). (Replicated: nothing is gathered.)"""
        if self.replicated:
            return
        for layer in adapter_for(model).layers(model):
            layer.set_reshard_after_forward(target != "output")
            layer.set_unshard_in_backward(target != "heads")
        embed = _embeddings(model)[0]
        if embed is not None:
            embed.set_unshard_in_backward(any(p.requires_grad for p in embed.parameters()))

    def reset(self) -> None:
        """After a forward with no backward (a skipped step): FSDP's iteration state starts afresh."""
        for root in self.roots:
            root.reset_iter_state()

    # ----------------------------------------------------------------------------- the step

    def weigh(self, loss: torch.Tensor, tokens: int) -> tuple[float, bool]:
        """(weight of this rank's loss, whether every rank's loss is finite) for one micro-batch.

        FSDP averages gradients over ranks; weight = N * tokens / all ranks' tokens makes that
        average the gradient of the loss over the whole micro-batch. All ranks skip together."""
        t = torch.tensor([float(tokens), 0.0 if bool(torch.isfinite(loss.detach())) else 1.0],
                         dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        total, bad = t.tolist()
        return self._share(tokens, total), bad == 0

    def _share(self, tokens: float, total: float) -> float:
        """The weight of a rank's loss over ``tokens`` of a micro-batch's ``total``: N * tokens / total."""
        return self.world_size * tokens / total if total > 0 else 1.0

    def token_weights(self, tokens: list[float]) -> list[float]:
        """Replicated: the weights of this rank's losses for a step's micro-batches (one
        collective, before the step): ``N * tokens / all ranks' tokens`` each, as ``weigh``."""
        t = torch.tensor(tokens, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return [self._share(n, total) for n, total in zip(tokens, t.tolist())]

    def average_gradients(self, params: list[nn.Parameter], finite: bool) -> bool:
        """Replicated: every rank's gradients of ``params`` averaged in place (one collective over
        one flat buffer); returns whether every rank's step was finite, so that all skip together."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([_flat(grads), grads[0].new_zeros(1, dtype=torch.float32)])
        if not finite:
            flat[-1] = 1.0
        dist.all_reduce(flat)
        flat /= self.world_size
        _copy_back(flat[:-1], grads)  # in place: a graph's gradients stay the tensors it writes
        for p, g in zip(params, grads):
            p.grad = g
        return bool(flat[-1] == 0)

    def sync_params(self, params: list[nn.Parameter]) -> None:
        """Replicated: rank 0's values of ``params`` on every rank (one collective)."""
        if not params:
            return
        flat = _flat([p.detach() for p in params])
        dist.broadcast(flat, src=0)
        _copy_back(flat, params)

    def reduce_metrics(self, total: float, extras: dict, tokens: int) -> tuple[float, dict, int]:
        """The whole micro-batches' mean loss and extras (each rank's already weighed) and the
        tokens of all ranks. Integer lists (layer indices) are labels, kept as they are."""
        keys = [k for k, v in extras.items() if not _is_label(v)]
        flat = [total, float(tokens)]
        for k in keys:
            flat += list(extras[k]) if isinstance(extras[k], list) else [extras[k]]
        t = torch.tensor(flat, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        values = t.tolist()
        total, tokens, pos, out = values[0] / self.world_size, int(round(values[1])), 2, dict(extras)
        for k in keys:
            n = len(extras[k]) if isinstance(extras[k], list) else 1
            part = [v / self.world_size for v in values[pos:pos + n]]
            out[k] = part if isinstance(extras[k], list) else part[0]
            pos += n
        return total, out, tokens

    # --------------------------------------------------------------------- full state <-> shards

    def full_tensors(self, tensors: dict) -> dict:
        """``{name: tensor}`` with every sharded tensor gathered whole, on the CPU (all ranks call)."""
        return {n: full_tensor(t) for n, t in tensors.items()}

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's ``state_dict`` as one process would hold it (gathered; all ranks call)."""
        sd = optimizer.state_dict()
        return {"state": {i: {k: full_tensor(v) if torch.is_tensor(v) else v for k, v in s.items()}
                          for i, s in sd["state"].items()},
                "param_groups": sd["param_groups"]}

    def local_tensors(self, like: dict[str, nn.Parameter], full: dict) -> dict:
        """Full tensors as shards placed like the parameters in ``like`` (no communication)."""
        return {n: shard_like(full[n], like[n]) if n in like else full[n] for n in full}

    def local_optimizer_state(self, optimizer: torch.optim.Optimizer, full: dict) -> dict:
        """A one-process optimizer ``state_dict`` cut into this rank's shards."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {}
        for i, s in full["state"].items():
            p = params[int(i)]
            state[i] = {k: shard_like(v, p) if torch.is_tensor(v) and v.shape == p.shape else v
                        for k, v in s.items()}
        return {"state": state, "param_groups": full["param_groups"]}

    def gather_rng(self, rng: dict) -> dict:
        """Rank 0's RNG states (the one-process format) plus every rank's under ``"ranks"``."""
        ranks = [None] * self.world_size
        dist.all_gather_object(ranks, rng)
        return {**ranks[0], "ranks": ranks}

    def own_rng(self, rng: dict) -> dict:
        """This rank's RNG states from a saved state (rank 0's when the run had another size)."""
        ranks = rng.get("ranks")
        if ranks and len(ranks) == self.world_size:
            return ranks[self.rank]
        return {k: v for k, v in rng.items() if k != "ranks"}

    def added_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The new modules' and LoRA's tensors (what a checkpoint holds), whole, on the CPU."""
        return {k: full_tensor(v) for k, v in model.state_dict().items() if any(m in k for m in ADDED_MARKERS)}


def _embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(input embeddings, output head) to shard as units of their own: both None when they share
    their weight (one unit, the root, holds it) or the model has no such modules."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or head is None or head.weight is embed.weight:
        return None, None
    return embed, head


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` as one fp32 vector, one after the other (for one collective)."""
    return torch.cat([t.reshape(-1).float() for t in tensors])


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """``_flat``'s inverse: each tensor's part of ``flat`` copied into it, in place."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (DTensor) gathered whole, or a plain one as it is; detached, on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` cut like ``param`` (a DTensor: its mesh and placements); plain ``param``: as is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full.to(param.to_local().device, param.dtype), param.device_mesh, param.placements,
                             src_data_rank=None)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (a gradient norm) as a plain tensor; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def config_digest(config: TrainConfig) -> str:
    values = {k: v for k, v in config.to_dict().items() if k not in RANK_LOCAL_SETTINGS}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def check_same_config(config: TrainConfig, world_size: int) -> None:
    """Every rank must run the same settings; the differing ones and their ranks are named."""
    mine = {k: v for k, v in config.to_dict().items() if k not in RANK_LOCAL_SETTINGS}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (config_digest(config), mine))
    if len({digest for digest, _ in everyone}) == 1:
        return
    first = everyone[0][1]
    diffs = []
    for rank, (_, theirs) in enumerate(everyone[1:], start=1):
        for key in sorted(set(first) | set(theirs)):
            if first.get(key) != theirs.get(key):
                diffs.append(f"rank {rank} has {key}={theirs.get(key)!r} where rank 0 has {key}={first.get(key)!r}")
    raise ValueError("the ranks of this run have different settings: " + "; ".join(diffs[:8])
                     + " (launch every rank with the same config and flags)")


def setup(config: TrainConfig) -> Parallel | None:
    """Join (or start) the process group of a ``torchrun`` launch; None with a single process.

    Checks, naming what is wrong: the batch splits evenly across the ranks, the backend exists,
    every rank has the same settings."""
    world = launched_world_size()
    if world <= 1:
        return None
    check_batch_split(config, world)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = rank_device(config, local_rank)
    backend = backend_for(device)
    owns = False
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        owns = True
    parallel = Parallel(dist.get_rank(), dist.get_world_size(), device, owns)
    try:
        check_same_config(config, parallel.world_size)
    except ValueError:
        if owns:
            dist.destroy_process_group()
        raise
    return parallel


def _is_label(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], int)

