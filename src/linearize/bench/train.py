"""``bench train``: the training step of a teacher and of its linearized students, on our kernels and
on the torch path, side by side in one process.

For each model, sequence length and method, one optimizer step at batch B is timed for

  teacher  stage 2 on the unconverted model (softmax SDPA) with the same LoRA adapters: what
           fine-tuning the teacher itself costs, the baseline;
  stage1   the student's attention transfer over all layers at once (the teacher's attention for
           the targets, the student's, their MSE; only the new attention parameters train);
  stage2   the student with LoRA on q, k, v and o: next-token loss;

each student stage on our kernels where they apply (``kernels``, the default dispatch) and on the
torch path (``torch``, ``LINEARIZE_KERNELS=0``). On CUDA the teacher and the kernels' cells run
twice: eagerly, and as ``linearize train`` runs by default there (``graph``: each micro-batch's
forward and backward replayed as a CUDA graph, the feature maps and gates compiled:
``train.graphs``). A step is ``linearize train``'s own: ``train.loop.optimizer_step`` over ``train.run``'s losses (fp32 weights, bf16
autocast on CUDA, AdamW at the stage's default rate, clipping, the loss read back every step), on
one batch of random tokens. tokens_per_s = B * T / the median step; peak memory is
``torch.cuda.max_memory_allocated`` over the warm-up and timed steps (weights, optimizer state,
activations, a graph's pool).
x teacher = this step's time over the teacher + LoRA step's, eager (as fine-tuning the teacher
runs by default) and graphed. MFU = model FLOPs per second over the card's dense bf16 peak, with the
model FLOPs of the step's matrix products (attention excluded, so that teacher and students are
counted alike): 4 N per token for the teacher and stage 2 (forward, and the backward through frozen
weights; N the parameters of the linear layers and the output head) and 2 N' for stage 1 (the
decoder layers' forward; its backward runs through the small attention modules only). On CUDA one
more step runs under the profiler: the sum of its kernels' durations against the step's wall time
tells a GPU-bound step from a host-bound one, and the time in our Triton and Gluon kernels is
reported apart.

Model names as in ``bench generate`` (weights do not change the speed); ``layers`` keeps the first N
layers of a random-weight shape (a slice of Llama-3-8B trains where the whole model would not fit).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from ..records import environment, markdown_table, new_figure, save_png, write_outputs
from ..ops.backend.dispatch import kernels_switched
from .common import cleanup, is_oom, sync
from .generate import build_model, check_layers

STEM = "train"
BACKENDS = ("kernels", "torch")
TOP_KERNELS = 25  # the profiled step's kernels listed, most launched first
KERNEL_MODULES = ("gla.triton", "window_attn.triton", "lizard_attn.fused", "gla.gluon", "window_attn.gluon",
                  "lizard_attn.gluon", "lizard_attn.decode", "delta.triton", "sparse_window.triton",
                  "lolcats_attn.triton")


def our_kernel_names() -> set[str]:
    """The names of the Triton and Gluon kernels of the ops' GPU backends (as a profiler lists them)."""
    import importlib

    names = set()
    for mod in KERNEL_MODULES:
        try:
            m = importlib.import_module(f"linearize.ops.{mod}")
        except ImportError:  # a Triton without Gluon
            continue
        names |= {n for n, obj in vars(m).items() if type(obj).__name__ in ("JITFunction", "GluonJITFunction")}
    return names


# dense bf16 peak FLOP/s by card (the vendors' figures without sparsity), for MFU
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "GH200": 989.4e12, "A100": 312e12}


def peak_flops(device_name: str | None) -> float | None:
    """The card's dense bf16 peak in FLOP/s, or None for a card not in ``PEAK_BF16``."""
    for key in sorted(PEAK_BF16, key=len, reverse=True):
        if device_name and key in device_name:
            return PEAK_BF16[key]
    return None


def matmul_parameters(model) -> tuple[int, int]:
    """(all, decoder layers only): the weights of the model's linear layers and output head, the N of
    the MFU's FLOP count (embedding lookups are no products)."""
    from torch import nn

    head = model.get_output_embeddings()
    total = layers = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and m is not head and "lora_" not in name:
            total += m.weight.numel()
            layers += m.weight.numel()
    return total + (head.weight.numel() if head is not None else 0), layers


def step_flops_per_token(stage: str, n_all: int, n_layers: int) -> int:
    """Model FLOPs a token costs in this stage's step (see the module docstring)."""
    return 2 * n_layers if stage == "stage1" else 4 * n_all


def random_batch(vocab: int, batch_size: int, seq_len: int, seed: int = 0) -> dict:
    """A batch of random tokens on the CPU, where ``linearize train``'s rows are (the step moves it)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch_size, seq_len), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def make_stage(model, stage: str, method: str, device: torch.device, overrides: dict | None = None):
    """(Stage, params, config) for one cell; converts ``model`` (in place, with the method's
    ``overrides``) for the student stages, as ``linearize train`` does."""
    import linearize

    from ..models.lora import add_lora, lora_parameters
    from ..train.config import TrainConfig
    from ..train.graphs import cache_frozen_casts
    from ..train.loop import Stage
    from ..train.run import lm_loss, transfer_loss
    from ..train.transfer import freeze_all_but, make_blocks, trainable_attention_parameters

    config = TrainConfig(method=method, progress=False)
    if stage != "teacher":
        linearize.convert(model, method, **(overrides or {}))  # (the new modules on their layers' device)
    for p in model.parameters():
        p.requires_grad_(False)
    cache_frozen_casts(model)  # (as linearize train: the frozen projections cast once for autocast)
    if stage == "stage1":
        block = make_blocks(model, None)[0]
        params = trainable_attention_parameters(model, block)
        freeze_all_but(model, params)
        model.eval()  # as stage 1 runs: the teacher path as at inference
        return Stage("stage1", {}, lambda b: transfer_loss(model, b, config.transfer_target, block), None, 0,
                     config.stage1_lr, graphable=True), params, config
    add_lora(model, rank=config.lora_rank, alpha=config.lora_alpha, targets=config.lora_targets)
    model.to(device)
    params = lora_parameters(model)
    model.train()
    return Stage("stage2", {}, lambda b: lm_loss(model, b, None, config), None, 0, config.stage2_lr,
                 graphable=True), params, config


def _profile_step(step, device: torch.device, ours: set[str]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    wall = time.perf_counter() - t
    total = mine = 0.0
    launches = mine_launches = 0
    by_name: dict[str, list] = {}
    for evt in prof.events():
        if not str(getattr(evt, "device_type", "")).endswith("CUDA"):
            continue
        us = evt.time_range.elapsed_us()
        total += us
        launches += 1
        k = by_name.setdefault(evt.name, [0.0, 0])
        k[0] += us
        k[1] += 1
        if evt.name in ours:
            mine += us
            mine_launches += 1
    def table(key):
        top = sorted(by_name.items(), key=key)[:TOP_KERNELS]
        return [{"name": n[:160], "launches": c, "ms": us / 1e3} for n, (us, c) in top]

    return {"profiled_step_ms": wall * 1e3, "gpu_kernel_ms": total / 1e3, "gpu_launches": launches,
            "our_kernel_ms": mine / 1e3, "our_launches": mine_launches,
            "top_kernels_by_launches": table(lambda kv: -kv[1][1]), "top_kernels_by_time": table(lambda kv: -kv[1][0])}


def run_cell(name: str, seq_len: int, method: str, stage: str, backend: str, *, batch_size: int, steps: int,
             warmup: int, device: torch.device, layers: int | None, ours: set[str], graph: bool = False,
             overrides: dict | None = None) -> dict:
    """One (model, T, method, stage, backend, graph) cell: the timed steps' medians, memory, losses."""
    from ..train.graphs import compile_attention_modules
    from ..train.loop import optimizer_step, step_graphs

    cell = {"model": name, "seq_len": seq_len, "method": None if stage == "teacher" else method, "stage": stage,
            "backend": backend, "graph": graph, "batch_size": batch_size}
    model = None
    try:
        model, _ = build_model(name, torch.float32, device, layers=layers)
        with kernels_switched(backend == "kernels"):
            st, params, config = make_stage(model, stage, method, device, overrides)
            if not params:  # a method whose attention has nothing to learn (liger) skips stage 1
                cell.update(status="nothing_to_train")
                return cell
            optimizer = torch.optim.AdamW(params, lr=st.lr, weight_decay=config.weight_decay)
            batch = random_batch(model.config.vocab_size, batch_size, seq_len)
            graphed = None
            if graph:  # linearize train's default step on CUDA: graphed, the small modules compiled
                graphed = step_graphs(st, params, config, device)
                compile_attention_modules(model)
            n_all, n_layers = matmul_parameters(model)
            losses = []

            def step():
                loss, _, finite, _ = optimizer_step(st, params, optimizer, [batch], config, device, graphed)
                losses.append(loss if finite else float("nan"))

            sync(device)
            if device.type == "cuda":  # (from before the warm-up: a graph's memory is taken at its capture)
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(warmup):
                step()
            sync(device)
            times = []
            for _ in range(steps):
                sync(device)
                t = time.perf_counter()
                step()
                sync(device)
                times.append(time.perf_counter() - t)
            if graphed is not None and graphed.failed:
                cell["graph_failed"] = graphed.failed  # (the steps ran eagerly)
            med = statistics.median(times)
            flops = step_flops_per_token(stage, n_all, n_layers) * batch_size * seq_len / med
            peak = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else None)
            cell.update(status="ok", step_ms_median=med * 1e3, step_ms=[x * 1e3 for x in times],
                        tokens_per_s=batch_size * seq_len / med, trained_parameters=sum(p.numel() for p in params),
                        loss_first=losses[0], loss_last=losses[-1], steps_timed=steps, warmup_steps=warmup,
                        model_tflops=flops / 1e12, mfu=None if peak is None else flops / peak)
            if device.type == "cuda":
                cell["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
                cell.update(_profile_step(step, device, ours))
    except Exception as e:  # noqa: BLE001 - an OOM is a result; anything else is re-raised
        if not is_oom(e):
            raise
        cell.update(status="does_not_fit", error=str(e).splitlines()[0][:200])
    finally:
        del model
        cleanup(device)
    return cell


def _check_args(models, seq_lens, methods, backends, batch_size, steps, warmup, device, layers) -> torch.device:
    from ..methods import methods as known_methods
    from ..models.encoder import is_lion_method

    for m in models:
        check_layers(m, layers)
    for name, value, least in (("batch_size", batch_size, 1), ("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if not seq_lens or any(isinstance(t, bool) or not isinstance(t, int) or t < 2 for t in seq_lens):
        raise ValueError(f"seq_lens must be integers >= 2, got {list(seq_lens)!r}")
    causal = [m for m in known_methods() if not is_lion_method(m)]
    bad = [m for m in methods if m not in causal]
    if not methods or bad:
        raise ValueError(f"unknown or encoder-only methods {bad or list(methods)!r}; allowed: {', '.join(causal)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but CUDA is not available")
    bad = [b for b in backends if b not in BACKENDS]
    if not backends or bad:
        raise ValueError(f"unknown backends {bad or list(backends)!r}; allowed: {', '.join(BACKENDS)}")
    if "kernels" in backends and dev.type != "cuda":
        raise ValueError(f"the 'kernels' backend runs on CUDA only (device {device!r}); use backends=('torch',)")
    return dev


def _check_graphs(graphs: Sequence[bool], device: torch.device) -> tuple[bool, ...]:
    if not graphs or any(not isinstance(g, bool) for g in graphs) or len(set(graphs)) != len(graphs):
        raise ValueError(f"graphs must be False, True or both, each once, got {list(graphs)!r}")
    if True in graphs and device.type != "cuda":
        raise ValueError(f"CUDA graphs run on CUDA only (device {str(device)!r}); use graphs=(False,)")
    return tuple(graphs)


def run_train_bench(out_dir, models: Sequence[str] = ("smollm2-135m-random",), seq_lens: Sequence[int] = (1024, 2048),
                    methods: Sequence[str] = ("lizard",), batch_size: int = 8, steps: int = 10, warmup: int = 3,
                    device: str = "cuda", *, backends: Sequence[str] | None = None, layers: int | None = None,
                    graphs: Sequence[bool] | None = None, command: str | None = None,
                    overrides: dict | None = None) -> dict:
    """Time the training steps side by side; write train.{json,png,md} to ``out_dir`` after every cell
    (a run cut short keeps what it timed). ``backends``: default both on CUDA, ``("torch",)`` elsewhere;
    ``graphs``: the teacher's and the kernels' cells eager (False) and graphed (True), default both on
    CUDA, ``(False,)`` elsewhere (the torch path's cells run eagerly); ``overrides``: AttentionConfig
    settings for every student (``linearize train --set``), e.g. ``{"feature_dim": 128}``."""
    cuda = str(device).startswith("cuda")
    if backends is None:
        backends = BACKENDS if cuda else ("torch",)
    if graphs is None:
        graphs = (False, True) if cuda else (False,)
    dev = _check_args(models, seq_lens, methods, backends, batch_size, steps, warmup, device, layers)
    graphs = _check_graphs(graphs, dev)
    ours = our_kernel_names() if dev.type == "cuda" else set()
    env = environment(dev, command)
    plan = [(m, t, "teacher", None, "torch", g) for m in models for t in seq_lens for g in graphs]
    plan += [(m, t, s, meth, b, g) for m in models for t in seq_lens for meth in methods
             for s in ("stage1", "stage2") for b in backends for g in (graphs if b == "kernels" else (False,))]
    plan.sort(key=lambda c: (models.index(c[0]), c[1]))
    data = {"benchmark": "train",
            "settings": {"models": list(models), "seq_lens": list(seq_lens), "methods": list(methods),
                         "backends": list(backends), "graphs": list(graphs), "batch_size": batch_size,
                         "steps": steps, "warmup": warmup, "device": str(dev), "layers": layers,
                         "overrides": dict(overrides or {})},
            "notes": __doc__.split("\n\n", 1)[1].strip(), "cells": [], "environment": env}
    from tqdm.auto import tqdm

    for name, T, stage, method, backend, graph in tqdm(plan, desc="bench train", dynamic_ncols=True):
        data["cells"].append(run_cell(name, T, method or methods[0], stage, backend, batch_size=batch_size,
                                      steps=steps, warmup=warmup, device=dev, layers=layers, ours=ours,
                                      graph=graph, overrides=overrides))
        write_outputs(out_dir, STEM, data, train_markdown, train_figure)
    return data


def _find(cells, **keys) -> dict | None:
    for c in cells:
        if all(c.get(k) == v for k, v in keys.items()) and c.get("status") == "ok":
            return c
    return None


def train_markdown(data: dict) -> str:
    s, env = data["settings"], data["environment"]
    lines = [f"# Training step: teacher vs linearized students, kernels vs torch path, eager vs CUDA graph\n",
             f"{env.get('device')}; torch {env.get('torch')}, triton {env.get('triton')}, transformers "
             f"{env.get('transformers')}. Batch {s['batch_size']}, median of {s['steps']} timed steps after "
             f"{s['warmup']} warm-up steps" + (f"; the first {s['layers']} layers" if s.get("layers") else "")
             + (f"; students converted with {s['overrides']}" if s.get("overrides") else "") + ".\n",
             f"Command: `{env.get('command')}`\n"]
    cells = data["cells"]
    for name in s["models"]:
        lines.append(f"## {name}\n")
        rows = []
        for c in (c for c in cells if c["model"] == name):
            label = "teacher + LoRA (SDPA)" if c["stage"] == "teacher" else f"{c['method']} {c['stage']}"
            graph = "yes" if c.get("graph") and not c.get("graph_failed") else ("failed" if c.get("graph") else "no")
            if c["status"] != "ok":
                rows.append([c["seq_len"], label, c["backend"], graph, c["status"].replace("_", " ")] + [None] * 8)
                continue
            torch_cell = _find(cells, model=name, seq_len=c["seq_len"], method=c["method"], stage=c["stage"],
                               backend="torch")
            vs_torch = torch_cell["step_ms_median"] / c["step_ms_median"] if torch_cell and c["backend"] != "torch" \
                else None
            vs_teacher = []
            for g in (False, True):
                teacher = _find(cells, model=name, seq_len=c["seq_len"], stage="teacher", graph=g)
                vs_teacher.append(c["step_ms_median"] / teacher["step_ms_median"] if teacher else None)
            peak = c.get("peak_allocated_bytes")
            mfu = c.get("mfu")
            rows.append([c["seq_len"], label, c["backend"], graph, c["step_ms_median"], c["tokens_per_s"],
                         *vs_teacher, None if mfu is None else f"{100 * mfu:.1f}%", vs_torch,
                         None if peak is None else peak / 2**30, c.get("gpu_kernel_ms"), c.get("our_kernel_ms")])
        lines.append(markdown_table(["T", "step", "attention", "CUDA graph", "step ms", "tokens/s",
                                     "x teacher eager", "x teacher graphed", "MFU", "speed-up over torch path",
                                     "peak GiB", "GPU kernels ms", "ours ms"], rows))
        lines.append("")
    lines.append("x teacher eager / graphed: this step's time over the teacher + LoRA step's, eager and graphed "
                 "(below 1: faster than fine-tuning the teacher). MFU: model FLOPs (the step's matrix products, "
                 "attention excluded; see the notes) per second over the card's dense bf16 peak. Speed-up over torch "
                 "path: the torch path's step time over this one's (same stage). GPU kernels ms: the summed "
                 "durations of one profiled step's kernels; where it is well below the step, the host is the bound. "
                 "ours ms: the part in linearize's Triton and Gluon kernels.\n")
    return "\n".join(lines)


def _label(cell: dict) -> str:
    graph = " graph" if cell.get("graph") else ""
    return ("teacher" if cell["stage"] == "teacher" else f"{cell['method']} {cell['stage']} {cell['backend']}") + graph


def train_figure(data: dict, path: Path) -> None:
    s = data["settings"]
    fig, axes = new_figure(figsize=(7.5, 3.5 * len(s["models"])), nrows=len(s["models"]))
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    for ax, name in zip(axes, s["models"]):
        cells = [c for c in data["cells"] if c["model"] == name]
        labels = sorted({_label(c) for c in cells}, key=lambda x: (x != "teacher", x))
        width = 0.8 / max(len(labels), 1)
        for i, label in enumerate(labels):
            ys = []
            for T in s["seq_lens"]:
                c = next((c for c in cells if c["seq_len"] == T and c.get("status") == "ok" and _label(c) == label),
                         None)
                ys.append(c["tokens_per_s"] if c else 0.0)
            ax.bar([j + i * width for j in range(len(s["seq_lens"]))], ys, width, label=label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(s["seq_lens"]))], [str(T) for T in s["seq_lens"]])
        ax.set_xlabel("sequence length")
        ax.set_ylabel(f"training tokens/s (batch {s['batch_size']})")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"Training step, {data['environment'].get('device')}", fontsize=10)
    save_png(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m linearize.bench.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-random"])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--methods", nargs="+", default=["lizard"])
    p.add_argument("--backends", nargs="+", default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--graphs", nargs="+", choices=("eager", "graph"), default=None,
                   help="the teacher's and the kernels' cells eagerly and/or as CUDA graphs (default: both on CUDA)")
    args = p.parse_args(argv)
    command = "python -m linearize.bench.train " + " ".join(sys.argv[1:] if argv is None else argv)
    data = run_train_bench(args.out, args.models, args.seq_lens, args.methods, args.batch_size, args.steps,
                           args.warmup, args.device, backends=args.backends, layers=args.layers,
                           graphs=None if args.graphs is None else tuple(g == "graph" for g in args.graphs),
                           command=command)
    print(train_markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
