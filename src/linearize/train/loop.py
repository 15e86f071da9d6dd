"""The optimisation loop both stages share: AdamW, schedules, clipping, accumulation, bf16
autocast, validation and early stopping, non-finite skips, metrics, and exact resume.

Resume is exact on CPU with a fixed seed: the batch order is a pure function of (seed, stage,
micro-batch index), and the resume state holds the trained parameters, the optimizer, the
scheduler, the RNG states and the loop counters, written atomically every ``save_every`` steps
(``torch.save``, read back with ``weights_only=True``).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
import warnings
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import nn

from .config import TrainConfig
from .graphs import GraphedStep
from .schedules import make_scheduler

if TYPE_CHECKING:
    from .distributed import Parallel


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class Stage:
    """One optimisation problem: what trains, on which loss, for how long."""

    name: str                                             # "stage1", "stage1-block2", "stage2"
    params: dict[str, nn.Parameter]                       # trainable, by name (resume state keys)
    loss_fn: Callable[[dict], tuple[torch.Tensor, dict]]  # batch -> (loss, extra float metrics)
    eval_fn: Callable[[], tuple[float, dict]] | None      # -> (validation loss, extra metrics)
    steps: int
    lr: float
    before_step: Callable[[int], None] | None = None      # e.g. liza's mu schedule
    graphable: bool = False                               # loss_fn reads no device value: CUDA graphs may run it
    loss_tokens: Callable[[dict], int] | None = None      # tokens the loss averages over: weighs the ranks' shares


@dataclass
class LoopState:
    step: int = 0              # optimizer steps taken (skipped steps included)
    tokens: int = 0
    seconds: float = 0.0       # training time, validation excluded
    best_val: float = math.inf
    bad_evals: int = 0
    nonfinite: int = 0         # skipped steps in total
    nonfinite_streak: int = 0
    done: bool = False
    stopped_early: bool = False


class MetricsLog:
    """Append-only JSONL; on resume, records a killed run wrote after its last save are dropped."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def truncate_after(self, stage: str, step: int) -> None:
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the kill
            if rec.get("stage") == stage and rec.get("step", 0) > step:
                continue
            kept.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)


def batch_indices(micro: int, batch_size: int, num_rows: int, seed: int, stage: str) -> list[int]:
    """Rows of micro-batch ``micro``: consecutive slices of per-epoch seeded permutations."""
    out = []
    start = micro * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_rows)
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(stage.encode()) + epoch)
        perm = torch.randperm(num_rows, generator=g)
        take = min(batch_size - len(out), num_rows - offset)
        out += perm[offset:offset + take].tolist()
    return out


def resolve_device(name: str) -> torch.device:
    """'auto' = CUDA when available, else the CPU; an unavailable CUDA is named, not left to fail later."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available (use --device cpu)")
    return torch.device(name)


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """The dtype the run's products take under autocast (bf16), or None (no autocast: fp32)."""
    return torch.bfloat16 if precision == "bf16" or (precision == "auto" and device.type == "cuda") else None


def autocast(device: torch.device, precision: str):
    dtype = autocast_dtype(device, precision)
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def _save_state(path: Path, stage: Stage, optimizer, scheduler, loop: LoopState, best: dict | None,
                parallel: Parallel | None = None) -> None:
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    if parallel is not None:  # gathered whole: the one-process format, written by rank 0 alone
        state = {"params": parallel.full_tensors(stage.params), "optimizer": parallel.full_optimizer_state(optimizer),
                 "best": None if best is None else parallel.full_tensors(best), "rng": parallel.gather_rng(rng)}
        if not parallel.writer:
            return
    else:
        state = {"params": {n: p.detach().cpu().clone() for n, p in stage.params.items()},
                 "optimizer": optimizer.state_dict(), "best": best, "rng": rng}
    state.update(scheduler=scheduler.state_dict(), loop=asdict(loop))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_params(stage_params: dict[str, nn.Parameter], saved: dict[str, torch.Tensor]) -> None:
    if set(saved) != set(stage_params):
        raise ValueError(f"resume state does not match the model: {len(saved)} saved tensors for "
                         f"{len(stage_params)} trainable parameters (was the run's config changed?)")
    with torch.no_grad():
        for n, p in stage_params.items():
            p.copy_(saved[n].to(p.device, p.dtype))


def read_state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def optimizer_step(stage: Stage, params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                   batches: Iterable[dict], config: TrainConfig, device: torch.device,
                   graphed: "GraphedStep | None" = None,
                   parallel: Parallel | None = None) -> tuple[float, dict, bool, int]:
    """One optimizer step of ``stage`` over ``batches`` (its micro-batches, moved to ``device`` one at a
    time): the gradients zeroed, accumulated under autocast, clipped, applied. A non-finite loss or
    gradient norm skips the update. ``graphed``: the stage's forward and backward as CUDA graphs
    (``graphs.GraphedStep``) for the micro-batches they take; the others run eagerly. The loss and
    its extras are read back once, after the last micro-batch. With ``parallel``
    (``distributed.Parallel``), ``batches`` are this rank's shares and the results are the whole
    micro-batches'. Returns (mean loss, the loss function's extras, finite, tokens)."""
    # with graphs the gradients stay the same tensors (the graphs write into them)
    optimizer.zero_grad(set_to_none=graphed is None)
    losses, extras_list, weights, finite, tokens = [], [], [], True, 0
    replicated = parallel is not None and parallel.replicated
    if replicated:  # each rank's share of every micro-batch weighed up front: one collective a step
        batches = list(batches)
        shares = parallel.token_weights([float(_loss_tokens(stage, b)) for b in batches])
    for j, batch in enumerate(batches):
        tokens += int(batch["attention_mask"].sum())  # (on the CPU, where the rows are)
        weight = shares[j] if replicated else 1.0
        out = graphed(batch, weight) if graphed is not None else None
        if out is None:
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with autocast(device, config.precision):
                loss, extra = stage.loss_fn(batch)
            if parallel is not None and not replicated:  # FSDP: every rank skips together, each weighed by its share
                weight, finite = parallel.weigh(loss, _loss_tokens(stage, batch))
            elif not bool(torch.isfinite(loss)):  # (skips the backward of a loss that is already lost)
                finite = False
            if not finite:
                break
            (loss * weight / config.grad_accum).backward()
            out = loss.detach(), extra
        losses.append(out[0])
        extras_list.append(out[1])
        weights.append(weight)
    # one read of the device for the whole step
    values = torch.stack([x.float() for x in losses]).tolist() if losses else []
    finite = finite and all(math.isfinite(x) for x in values)
    if replicated:  # (every rank learns whether all were finite)
        finite = parallel.average_gradients(params, finite)
    total, extras = 0.0, {}
    if finite:
        total = sum(x * w for x, w in zip(values, weights)) / config.grad_accum
        for extra, w in zip(extras_list, weights):
            for k, v in extra.items():
                extras[k] = _accumulate(extras.get(k), _host(v), config.grad_accum, w)
    if parallel is not None:
        total, extras, tokens = parallel.reduce_metrics(total, extras, tokens)
        if not finite:
            parallel.reset()
    if finite and config.clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, config.clip)
        finite = bool(torch.isfinite(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=graphed is None)
    return total, extras, finite, tokens


def _loss_tokens(stage: Stage, batch: dict) -> float:
    """What ``stage``'s loss on ``batch`` averages over (1 where the stage does not say): a rank's share."""
    return stage.loss_tokens(batch) if stage.loss_tokens else 1


def _host(value):
    """An extra of a loss function as a Python value (tensors read back: 0-d a float, else a list)."""
    if torch.is_tensor(value):
        return value.item() if value.dim() == 0 else value.tolist()
    return value


def fit(stage: Stage, rows, config: TrainConfig, device: torch.device, state_path: Path,
        metrics: MetricsLog, resume: bool, extra_batch: Callable[[list[int], dict], dict] | None = None,
        parallel: Parallel | None = None) -> dict:
    """Train ``stage`` to completion (or early stop); returns a summary of the run.

    ``rows``: a ``data.Rows``; ``extra_batch(indices, batch)`` may add tensors (block inputs).
    ``parallel``: a ``distributed.Parallel`` when several processes train ``stage`` together
    (each takes its share of every micro-batch; ``metrics`` is rank 0's alone).
    """
    speaks = parallel is None or parallel.writer
    params = list(stage.params.values())
    optimizer = torch.optim.AdamW(params, lr=stage.lr, weight_decay=config.weight_decay)
    scheduler = make_scheduler(optimizer, config.lr_schedule, stage.steps, config.warmup_steps,
                               config.plateau_patience, config.plateau_factor)
    loop, best = LoopState(), None
    if resume and state_path.is_file():
        saved = read_state(state_path)
        if parallel is not None:  # saved whole: each rank takes its shards
            saved["params"] = parallel.local_tensors(stage.params, saved["params"])
            saved["optimizer"] = parallel.local_optimizer_state(optimizer, saved["optimizer"])
            saved["best"] = None if saved["best"] is None else parallel.local_tensors(stage.params, saved["best"])
            saved["rng"] = parallel.own_rng(saved["rng"])
        load_params(stage.params, saved["params"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        loop = LoopState(**saved["loop"])
        best = saved["best"]
        torch.set_rng_state(saved["rng"]["torch"])
        random.setstate(_as_python_rng_state(saved["rng"]["python"]))
        if saved["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["rng"]["cuda"])
        metrics.truncate_after(stage.name, loop.step)
        # said with or without progress bars: a resumed run is otherwise silent until its next step
        if speaks:
            print(f"{stage.name}: " + ("finished before the interruption; skipped" if loop.done else
                  f"resuming at step {loop.step} of {stage.steps} from {state_path}"), flush=True)
    if loop.done:
        return _summary(stage, loop, device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    from tqdm.auto import tqdm

    # (not with FSDP: its collectives inside a capture are untested; replicated ranks capture
    # only their own forward and backward, the gradients are averaged outside the graphs)
    replicated = parallel is not None and parallel.replicated
    graphed = step_graphs(stage, params, config, device) if parallel is None or replicated else None
    if replicated:
        parallel.sync_params(params)
    bar = tqdm(total=stage.steps, initial=loop.step, desc=stage.name, disable=not (config.progress and speaks),
               dynamic_ncols=True, leave=True)
    if loop.step == 0 and stage.eval_fn is not None:
        _evaluate(stage, loop, metrics, scheduler, config, update=False)
    while loop.step < stage.steps:
        if stage.before_step is not None:
            stage.before_step(loop.step)
        started = time.perf_counter()

        def micro_batches(step=loop.step):
            for j in range(config.grad_accum):
                indices = batch_indices(step * config.grad_accum + j, config.batch_size, len(rows), config.seed,
                                        stage.name)
                if parallel is not None:
                    indices = parallel.local_rows(indices)
                batch = rows.batch(indices)
                yield extra_batch(indices, batch) if extra_batch is not None else batch

        total, extras, finite, tokens = optimizer_step(stage, params, optimizer, micro_batches(), config, device,
                                                       graphed, parallel)
        if finite:
            loop.nonfinite_streak = 0
        else:
            loop.nonfinite += 1
            loop.nonfinite_streak += 1
            metrics.write({"event": "nonfinite", "stage": stage.name, "step": loop.step + 1})
        if config.lr_schedule != "plateau":  # the schedule follows the step count, skipped steps included
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                scheduler.step()
        loop.step += 1
        loop.tokens += tokens
        loop.seconds += time.perf_counter() - started
        if finite:
            metrics.write({"stage": stage.name, "split": "train", "step": loop.step, "tokens": loop.tokens,
                           "loss": total, "lr": optimizer.param_groups[0]["lr"], "time": round(loop.seconds, 3),
                           **extras})
            bar.set_postfix(loss=f"{total:.4g}", refresh=False)
        bar.update(1)
        if loop.nonfinite_streak >= config.max_nonfinite:
            bar.close()
            raise NonFiniteLossError(
                f"{stage.name}: the loss or its gradient was not finite for {loop.nonfinite_streak} steps in a row "
                f"(step {loop.step}; {loop.nonfinite} skipped in all). Lower the learning rate ({stage.lr:g}) "
                f"or use precision 'fp32'; the last resume state is {state_path}")
        last = loop.step == stage.steps
        if stage.eval_fn is not None and (loop.step % config.eval_every == 0 or last):
            best = _evaluate(stage, loop, metrics, scheduler, config, update=True, best=best)
            if loop.stopped_early:
                last = True
        if last:
            if best is not None:  # early stopping keeps the best weights seen
                load_params(stage.params, best)
            loop.done = True
        if last or loop.step % config.save_every == 0:
            _save_state(state_path, stage, optimizer, scheduler, loop, best, parallel)
        if last:
            break
    bar.close()
    return _summary(stage, loop, device)


def step_graphs(stage: Stage, params: list[nn.Parameter], config: TrainConfig,
                device: torch.device) -> GraphedStep | None:
    """The stage's micro-batches as CUDA graphs (``graphs.GraphedStep``), where the config asks for
    them (``cuda_graph``), the device is CUDA and the stage's loss allows it; else None (eager)."""
    if not (config.cuda_graph and device.type == "cuda" and stage.graphable):
        return None
    return GraphedStep(stage.loss_fn, params, lambda: autocast(device, config.precision), 1.0 / config.grad_accum,
                       device)


def _evaluate(stage, loop, metrics, scheduler, config, update: bool, best=None):
    val, extra = stage.eval_fn()
    metrics.write({"stage": stage.name, "split": "val", "step": loop.step, "tokens": loop.tokens, "loss": val, **extra})
    if not update:
        return best
    if config.lr_schedule == "plateau":
        scheduler.step(val)
    if val < loop.best_val:
        loop.best_val, loop.bad_evals = val, 0
        if config.early_stop_patience:
            # (shards stay where they are: the best weights of every rank together)
            best = {n: p.detach().clone() if hasattr(p, "full_tensor") else p.detach().cpu().clone()
                    for n, p in stage.params.items()}
    else:
        loop.bad_evals += 1
        if config.early_stop_patience and loop.bad_evals >= config.early_stop_patience:
            loop.stopped_early = True
            metrics.write({"event": "early_stop", "stage": stage.name, "step": loop.step, "best_val": loop.best_val})
    return best


def _accumulate(old, new, parts: int, weight: float = 1.0):
    if isinstance(new, list) and new and isinstance(new[0], int):  # labels (layer indices), not values
        return new
    if isinstance(new, list):
        new = [x * weight / parts for x in new]
        return new if old is None else [a + b for a, b in zip(old, new)]
    return new * weight / parts + (old or 0.0)


def _as_python_rng_state(state):
    """random.setstate wants (int, tuple, None-or-float): lists come back from some loaders."""
    version, internal, gauss = state
    return version, tuple(internal), gauss


def _summary(stage: Stage, loop: LoopState, device: torch.device) -> dict:
    summary = {"stage": stage.name, "steps": loop.step, "tokens": loop.tokens, "seconds": round(loop.seconds, 2),
               "tokens_per_s": round(loop.tokens / loop.seconds, 1) if loop.seconds else None,
               "best_val": None if math.isinf(loop.best_val) else loop.best_val,
               "nonfinite_steps": loop.nonfinite, "stopped_early": loop.stopped_early}
    if device.type == "cuda":
        summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return summary
