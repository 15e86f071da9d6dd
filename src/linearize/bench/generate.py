"""``bench generate``: decode throughput and peak memory of a teacher and its linearized student.

For each model shape and context length L, one decode step at batch B is timed for

  teacher  the unconverted model over a preallocated static KV cache of L (+ the timed steps)
           tokens per layer: each step writes its key/value at a device-side slot and attends with
           torch SDPA over the buffer under a validity mask, the query heads of each KV group laid
           out as query rows (no repeated K/V), one CUDA graph per step (``TeacherDecoder``);
  student  the same weights after ``linearize.convert(model, method)``: fp32 recurrent state plus a
           ring buffer of the last ``window`` keys/values per KV head, one fused Triton kernel per
           layer where it applies, one CUDA graph per step (``StudentDecoder``).

Both sides also run a few eager steps first (reported as ``eager_*``). Throughput is B over the
median step time; peak memory is ``torch.cuda.max_memory_allocated`` from the moment the cache or
state exists (weights + cache/state + the step's activations); the cache/state bytes are reported
separately. A cell whose KV cache does not fit in the device's free memory is recorded as
``does_not_fit`` with the bytes it needs (an out-of-memory error while running is caught and
recorded the same way).

Prefill: decode cost at context L depends only on the sizes of the cache/state, not on their
values. ``prefill="synthetic"`` (the default) fills the teacher's KV cache with random keys and
values for L tokens and gives the student a random state of the sizes a real prefill leaves, at
position L. ``prefill="real"`` runs the model over L random tokens first (chunk forms for the
student), affordable only for small models and contexts. The outputs say which ran.

Model names: ``smollm2-135m`` (the bundled weights), ``<shape>-random`` for a random-weight
LlamaConfig of a known shape (``smollm2-135m``, ``llama3-8b``, ``tiny``), and ``llama3-8b``
(no weights are bundled: always random). Weights do not change decode speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from ..records import environment, markdown_table, new_figure, save_png, write_json, write_outputs
from .common import cleanup, is_oom, sync

STEM = "generate"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

SHAPES = {
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, head_dim=64),
    "llama3-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                      rope_theta=500000.0, tie_word_embeddings=False, head_dim=128),
    # Gemma 3 (the bundled gemma3-270m's shape): heads of 256, five sliding-window layers to each global one
    "gemma3-270m": dict(arch="gemma3", num_hidden_layers=18, hidden_size=640, num_attention_heads=4,
                        num_key_value_heads=1, intermediate_size=2048, vocab_size=262144,
                        max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True, head_dim=256,
                        sliding_window=512, query_pre_attn_scalar=256),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=128, max_position_embeddings=8192,
                 rope_theta=10000.0, tie_word_embeddings=False, head_dim=16),
}
BUNDLED = ("smollm2-135m",)
TEACHER_HOW = ("static KV cache (preallocated, model dtype); 'masked': SDPA (fused kernels only) over the whole buffer "
               "under a validity mask, the query heads of each KV group as query rows (no repeated K/V), CUDA graph; "
               "'sliced': SDPA over the filled slots only with GQA in the kernel (flash), eager (shapes change per "
               "step); the teacher's throughput is the better of the two (best_tokens_per_s)")
STUDENT_HOW = ("fp32 recurrent state + ring buffer of the last `window` keys/values per KV head (model dtype), "
               "updated in place; two fused Triton kernels per layer on CUDA ('fused': per row and head RoPE, "
               "features, gate, z, ring and window softmax; per row, head and value block the state update and "
               "readout), torch ops otherwise ('torch')")
SHARED_HOW = ("both sides run the HF model's own embedding, projections, MLPs and LM head; on CUDA both replace "
              "HF's Llama RMSNorm (eight kernels) by one Triton kernel")


def resolve_model_name(name: str) -> tuple[str, str]:
    """``(shape, weights)`` for a bench model name; weights is "bundled" or "random"."""
    if not isinstance(name, str):
        raise ValueError(f"a model name must be a string, got {name!r}")
    if name.endswith("-random") and name[:-len("-random")] in SHAPES:
        return name[:-len("-random")], "random"
    if name in BUNDLED:
        return name, "bundled"
    if name in SHAPES:
        return name, "random"
    allowed = sorted(set(BUNDLED) | set(SHAPES) | {f"{s}-random" for s in SHAPES})
    raise ValueError(f"unknown bench model {name!r}; allowed: {', '.join(allowed)}")


def check_layers(name: str, layers: int | None) -> tuple[str, str]:
    """``resolve_model_name(name)``, after checking that ``layers`` (None: all) can slice that model."""
    shape, weights = resolve_model_name(name)
    if layers is not None:
        most = SHAPES[shape]["num_hidden_layers"]
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= most:
            raise ValueError(f"layers must be an integer from 1 to {most} (the layers of {shape}), got {layers!r}")
        if weights == "bundled":
            raise ValueError(f"layers={layers} keeps a slice of a random-weight shape; "
                             f"name {shape}-random instead of the bundled {name}")
    return shape, weights


def build_model(name: str, dtype: torch.dtype, device: str | torch.device, layers: int | None = None):
    """The teacher for a bench name, in eval mode on ``device``: ``(model, info)``. ``layers``: keep
    the first N layers of a random-weight shape (a slice of a model too large to train whole)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape, weights = check_layers(name, layers)
    if weights == "bundled":
        from ..models.teacher import load_teacher

        model, _ = load_teacher(name, dtype=dtype, device=device)
    else:
        spec = dict(SHAPES[shape])
        if layers is not None:
            spec["num_hidden_layers"] = layers
        theta = spec.pop("rope_theta")
        if spec.pop("arch", "llama") == "gemma3":
            from transformers import Gemma3ForCausalLM, Gemma3TextConfig

            n = spec["num_hidden_layers"]
            config = Gemma3TextConfig(
                **spec, layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": theta},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                pad_token_id=0, bos_token_id=2, eos_token_id=1)
            model_cls = Gemma3ForCausalLM
        else:
            config = LlamaConfig(**spec, rope_parameters={"rope_type": "default", "rope_theta": theta},
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2)
            model_cls = LlamaForCausalLM
        previous = torch.get_default_dtype()
        torch.manual_seed(0)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):  # built in place: an 8B model never exists on the CPU
                model = model_cls(config)
        finally:
            torch.set_default_dtype(previous)
        model.eval()
    cfg = model.config
    info = {"name": name, "shape": shape, "weights": weights,
            "config": {k: getattr(cfg, k, None) for k in (
                "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")},
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            "parameters": sum(p.numel() for p in model.parameters()),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "weight_bytes_read_per_step": _weights_read(model)}
    return model, info


def _weights_read(model) -> int:
    """Weight bytes a decode step reads: every parameter, except an untied input embedding (one row)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight is not emb:
        total -= emb.numel() * emb.element_size()
    return total


# ---------------------------------------------------------------------------------- timing


def _time_steps(dec, n: int) -> list[float]:
    """Seconds of each of ``n`` decode steps (CUDA events on CUDA)."""
    times = []
    if dec.device.type == "cuda":
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dec.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(n):
            t = time.perf_counter()
            dec.step()
            times.append(time.perf_counter() - t)
    return times


def _summary(times: list[float], batch: int) -> dict:
    med = statistics.median(times)
    return {"step_ms_median": med * 1e3, "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3,
            "tokens_per_s": batch / med, "steps_timed": len(times)}


def _free_memory(device: torch.device, budget: int | None, used: int) -> int | None:
    """Bytes a new cache may take: the emulated budget minus what is in use, or the CUDA free memory."""
    if budget is not None:
        return budget - used
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def _run_cell(dec, device, batch, eager_steps, warmup, timed, graph, eager_first=True) -> dict:
    """Eager steps, then (CUDA) capture + warm-up replays + timed replays; returns the timings."""
    res = {}
    if eager_first:
        eager = _time_steps(dec, eager_steps + 1)[1:]  # the first eager step compiles/initialises
        res.update({f"eager_{k}": v for k, v in _summary(eager, batch).items()})
    if graph:
        t = time.perf_counter()
        dec.capture()  # one more real step, eagerly, then the capture
        sync(device)
        res["capture_s"] = time.perf_counter() - t
        _time_steps(dec, warmup)
        res.update(_summary(_time_steps(dec, timed), batch))
        res["mode"] = "cuda_graph"
    else:
        res.update(_summary(_time_steps(dec, timed), batch))
        res["mode"] = "eager"
    return res


def _steps_needed(eager_steps, warmup, timed, graph) -> int:
    """Tokens a cell writes: the first, the eager steps, the teacher's sliced steps, capture, warm-up, timed."""
    return 1 + (eager_steps + 1) + (timed + 1) + (1 + warmup if graph else 0) + timed + 1


# ---------------------------------------------------------------------------------- cells


def _teacher_cell(model, info, L, *, batch, device, prefill, steps, eager_steps, warmup, timed, graph,
                  budget, seed) -> dict:
    from .teacher_decode import TeacherDecoder

    cfg = model.config
    Hkv = cfg.num_key_value_heads
    elem = next(model.parameters()).element_size()
    max_len = -(-(L + steps) // 16) * 16
    kv_bytes = 2 * cfg.num_hidden_layers * batch * Hkv * max_len * info["head_dim"] * elem
    context_kv = 2 * cfg.num_hidden_layers * batch * Hkv * L * info["head_dim"] * elem
    cell = {"context": L, "prefill": prefill, "cache": "static KV cache", "cache_bytes": kv_bytes,
            "context_cache_bytes": context_kv}
    used = torch.cuda.memory_allocated(device) if device.type == "cuda" else info["weight_bytes"]
    free = _free_memory(device, budget, used)
    if free is not None and kv_bytes > free:
        return {**cell, "status": "does_not_fit", "needed_bytes": info["weight_bytes"] + kv_bytes,
                "available_bytes": free + used,
                "reason": f"KV cache {kv_bytes / 1e9:.1f} GB > free {free / 1e9:.1f} GB (weights {info['weight_bytes'] / 1e9:.2f} GB loaded)"}
    dec = None
    try:
        dec = TeacherDecoder(model, batch, steps, max_len)
        if prefill == "real":
            ids = torch.randint(3, cfg.vocab_size, (batch, L), generator=torch.Generator().manual_seed(seed)).to(device)
            logits = dec.prefill(ids)
            dec.start(logits.float().argmax(-1), dec.pos)
        else:
            dec.load_synthetic(L, seed=seed)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        # the masked step eagerly, then the sliced (flash, eager-only) step, then the masked step in a graph
        eager = _time_steps(dec, eager_steps + 1)[1:]
        res = {f"eager_{k}": v for k, v in _summary(eager, batch).items()}
        dec.attention = "sliced"
        try:
            res.update({f"sliced_{k}": v for k, v in _summary(_time_steps(dec, timed + 1)[1:], batch).items()})
        except Exception as e:  # noqa: BLE001 - recorded; the masked step still runs
            if is_oom(e):
                raise
            res["sliced_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        dec.attention = "masked"
        res.update(_run_cell(dec, device, batch, 0, warmup, timed, graph, eager_first=False))
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        cell.update(status="ok", **res, peak_allocated_bytes=peak, allocated_before_steps_bytes=allocated,
                    bytes_per_step=info["weight_bytes_read_per_step"] + context_kv)
        best = max([("masked " + cell["mode"], cell["tokens_per_s"])]
                   + ([("sliced eager", cell["sliced_tokens_per_s"])] if "sliced_tokens_per_s" in cell else []),
                   key=lambda x: x[1])
        cell["best_mode"], cell["best_tokens_per_s"] = best
        _bandwidth(cell)
        return cell
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        return {**cell, "status": "does_not_fit", "needed_bytes": info["weight_bytes"] + kv_bytes,
                "reason": f"out of memory: {str(e).splitlines()[0][:200]}"}
    finally:
        if dec is not None:
            dec.release()
        del dec
        cleanup(device)


def _student_cell(model, info, L, *, batch, device, prefill, steps, eager_steps, warmup, timed, graph,
                  kernel, budget, seed) -> dict:
    from ..models.decode import StudentDecoder

    cell = {"context": L, "prefill": prefill, "cache": "recurrent state + ring buffer"}
    dec = None
    try:
        dec = StudentDecoder(model, batch, steps, kernel=kernel)
        if prefill == "real":
            ids = torch.randint(3, model.config.vocab_size, (batch, L),
                                generator=torch.Generator().manual_seed(seed)).to(device)
            logits = dec.prefill(ids, chunk_size=4096)
            dec.start(logits.float().argmax(-1), dec.pos)
        else:
            dec.load_synthetic(L, seed=seed)
        sync(device)
        state = dec.state_bytes()
        cell["cache_bytes"] = cell["context_cache_bytes"] = state
        used = torch.cuda.memory_allocated(device) if device.type == "cuda" else info["weight_bytes"] + state
        if budget is not None and used > budget:
            return {**cell, "status": "does_not_fit", "needed_bytes": used, "available_bytes": budget,
                    "reason": f"weights + state {used / 1e9:.2f} GB > {budget / 1e9:.2f} GB"}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        res = _run_cell(dec, device, batch, eager_steps, warmup, timed, graph)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        cell.update(status="ok", kernel=dec.kernel, **res, peak_allocated_bytes=peak,
                    allocated_before_steps_bytes=allocated,
                    bytes_per_step=info["weight_bytes_read_per_step"] + dec.step_bytes())
        _bandwidth(cell)
        return cell
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        return {**cell, "status": "does_not_fit", "reason": f"out of memory: {str(e).splitlines()[0][:200]}"}
    finally:
        if dec is not None:
            dec.release()
        del dec
        cleanup(device)


def _bandwidth(cell: dict) -> None:
    """Bytes the step must read (weights + cache/state) over the median step time."""
    cell["achieved_GBps"] = cell["bytes_per_step"] / (cell["step_ms_median"] / 1e3) / 1e9
    if "sliced_step_ms_median" in cell:
        cell["sliced_achieved_GBps"] = cell["bytes_per_step"] / (cell["sliced_step_ms_median"] / 1e3) / 1e9


# ---------------------------------------------------------------------------------- the run


def _check_args(models, contexts, batch_size, new_tokens, dtype, device, prefill, use_cuda_graph, kernel):
    if not models:
        raise ValueError("give at least one model")
    for m in models:
        resolve_model_name(m)
    if not contexts or any(isinstance(c, bool) or not isinstance(c, int) or c <= 0 for c in contexts):
        raise ValueError(f"contexts must be positive ints, got {contexts!r}")
    for name, value in (("batch_size", batch_size), ("new_tokens", new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if prefill not in ("synthetic", "real"):
        raise ValueError(f"prefill must be 'synthetic' or 'real', got {prefill!r}")
    if not (use_cuda_graph is True or use_cuda_graph is False or use_cuda_graph == "auto"):
        raise ValueError(f"use_cuda_graph must be True, False or 'auto', got {use_cuda_graph!r}")
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel must be 'auto', 'triton' or 'torch', got {kernel!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but CUDA is not available here; use device='cpu'")
    return dev


def run_generate_bench(out_dir, models: Sequence[str] = ("smollm2-135m", "llama3-8b"),
                       contexts: Sequence[int] = (1024, 4096, 16384, 32768, 65536, 131072),
                       batch_size: int = 16, new_tokens: int = 16, dtype: str = "bf16", device: str = "cuda",
                       *, method: str = "lizard", prefill: str = "synthetic", eager_steps: int = 3,
                       warmup_steps: int = 3, use_cuda_graph="auto", kernel: str = "auto",
                       device_memory_bytes: int | None = None, seed: int = 0, command: str | None = None) -> dict:
    """Time decoding of teacher and student side by side; write generate.{json,png,md} to ``out_dir``.

    ``new_tokens``: timed decode steps per cell (median reported). ``device_memory_bytes``
    emulates a device of that capacity (cells whose weights + cache exceed it do not fit); by
    default CUDA's free memory decides. Returns the data written to generate.json.
    """
    import linearize

    contexts = list(contexts)
    dev = _check_args(models, contexts, batch_size, new_tokens, dtype, device, prefill, use_cuda_graph, kernel)
    torch_dtype = DTYPES[dtype]
    graph = dev.type == "cuda" and use_cuda_graph is not False
    if use_cuda_graph is True and dev.type != "cuda":
        raise ValueError("use_cuda_graph=True needs device='cuda'")
    steps = _steps_needed(eager_steps, warmup_steps, new_tokens, graph)
    common = dict(batch=batch_size, device=dev, prefill=prefill, steps=steps, eager_steps=eager_steps,
                  warmup=warmup_steps, timed=new_tokens, graph=graph, budget=device_memory_bytes, seed=seed)
    results = []
    for name in models:
        t0 = time.perf_counter()
        model, info = build_model(name, torch_dtype, dev)
        teacher = [_teacher_cell(model, info, L, **common) for L in contexts]
        linearize.convert(model, method)
        info["student_parameters"] = sum(p.numel() for p in model.parameters())
        student = [_student_cell(model, info, L, kernel=kernel, **common) for L in contexts]
        ratios = []
        for t, s in zip(teacher, student):
            r = {"context": t["context"]}
            if t["status"] == "ok" and s["status"] == "ok":
                r["student_over_teacher"] = s["tokens_per_s"] / t["best_tokens_per_s"]
                r["student_over_teacher_same_mode"] = s["tokens_per_s"] / t["tokens_per_s"]
                r["eager_student_over_teacher"] = s["eager_tokens_per_s"] / t["eager_tokens_per_s"]
                r["traffic_bound"] = t["bytes_per_step"] / s["bytes_per_step"]
            ratios.append(r)
        results.append({**info, "method": method, "seconds": time.perf_counter() - t0,
                        "teacher": {"how": TEACHER_HOW, "cells": teacher},
                        "student": {"how": STUDENT_HOW, "cells": student}, "ratios": ratios})
        del model
        cleanup(dev)

    env = environment(dev, command)
    data = {"benchmark": "generate",
            "settings": {"models": list(models), "contexts": contexts, "batch_size": batch_size, "dtype": dtype,
                         "device": str(dev), "method": method, "prefill": prefill, "timed_steps": new_tokens,
                         "eager_steps": eager_steps, "warmup_steps": warmup_steps, "cuda_graph": graph,
                         "kernel": kernel, "device_memory_bytes": device_memory_bytes, "seed": seed},
            "notes": _notes(prefill, graph),
            "models": results, "environment": env}
    data["targets"] = evaluate_targets(data)
    write_outputs(out_dir, STEM, data, generate_markdown, generate_figure)
    return data


def _notes(prefill: str, graph: bool) -> list[str]:
    notes = [
        f"teacher: {TEACHER_HOW}; {'one CUDA graph per step' if graph else 'eager steps'}.",
        f"student: {STUDENT_HOW}; {'one CUDA graph per step' if graph else 'eager steps'}.",
        f"{SHARED_HOW}.",
        "eager_* fields: the same step modules run eagerly (no graph), timed before the capture.",
        "tokens_per_s = batch / median step time; peak_allocated_bytes = torch.cuda.max_memory_allocated after the "
        "cache/state was built (weights + cache/state + step activations); cache_bytes = the cache/state alone "
        "(the teacher's buffer is rounded up to hold the timed steps; context_cache_bytes = exactly `context` tokens).",
        "bytes_per_step = weights a step reads + the teacher's KV for `context` tokens, or the student's state read and "
        "written + ring read; achieved_GBps = bytes_per_step / median step time; traffic_bound = teacher bytes / student bytes.",
    ]
    if prefill == "synthetic":
        notes.append("prefill: synthetic. The teacher's KV cache holds random keys/values for `context` tokens and the "
                     "student a random state of the sizes a real prefill leaves, at position `context`: decode cost "
                     "depends on the sizes only (tests check that a real prefill leaves the same state sizes).")
    else:
        notes.append("prefill: real (the model's own forward over random tokens; chunk forms for the student).")
    return notes


# ---------------------------------------------------------------------------------- targets


def evaluate_targets(data: dict) -> dict:
    """The issue's targets, checked against what ran (None where a needed cell is missing)."""
    out = {}
    for m in data["models"]:
        t_ok = [c for c in m["teacher"]["cells"] if c["status"] == "ok"]
        s_ok = [c for c in m["student"]["cells"] if c["status"] == "ok"]
        entry = {}
        peaks = [c["peak_allocated_bytes"] for c in s_ok if c.get("peak_allocated_bytes")]
        if len(peaks) >= 2:
            spread = max(peaks) / min(peaks) - 1
            entry["student_peak_spread"] = spread
            entry["student_memory_flat_within_5pct"] = spread <= 0.05
        states = {c["cache_bytes"] for c in s_ok}
        entry["student_state_bytes_constant"] = len(states) <= 1
        tpeaks = [(c["context"], c.get("peak_allocated_bytes")) for c in t_ok if c.get("peak_allocated_bytes")]
        if len(tpeaks) >= 2:
            entry["teacher_memory_grows"] = tpeaks[-1][1] > tpeaks[0][1]
        for r in m["ratios"]:
            if r["context"] == 32768 and "student_over_teacher" in r:
                entry["ratio_at_32k"] = r["student_over_teacher"]
                entry["ratio_at_32k_at_least_4x"] = r["student_over_teacher"] >= 4.0
        last_t = {c["context"]: c for c in m["teacher"]["cells"]}.get(131072)
        last_s = {c["context"]: c for c in m["student"]["cells"]}.get(131072)
        if last_t and last_s:
            entry["at_128k_student_runs_teacher_does_not_fit"] = (
                last_s["status"] == "ok" and last_t["status"] == "does_not_fit")
        out[m["name"]] = entry
    return out


# ---------------------------------------------------------------------------------- outputs


def _gb(x) -> float | None:
    return None if x is None else x / 1e9


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def generate_markdown(data: dict) -> str:
    env, st = data["environment"], data["settings"]
    lines = [f"# Decode throughput and memory: teacher vs {st['method']} student", "",
             f"Device: {env['device']}; torch {env['torch']} (CUDA {env.get('cuda')}), transformers "
             f"{env.get('transformers')}, triton {env.get('triton')}, python {env['python']}.",
             f"Command: `{env['command']}`", "",
             f"Batch {st['batch_size']}, {st['dtype']}, median of {st['timed_steps']} timed decode steps "
             f"(after {st['eager_steps']} eager and {st['warmup_steps']} warm-up steps), prefill: {st['prefill']}.", ""]
    lines += [f"- {n}" for n in data["notes"]]
    for m in data["models"]:
        lines += ["", f"## {m['name']} ({m['weights']} weights, {m['parameters'] / 1e9:.3g}B parameters, "
                      f"{m['config']['num_hidden_layers']} layers, {m['config']['num_attention_heads']} heads / "
                      f"{m['config']['num_key_value_heads']} KV heads)", ""]
        rows = []
        ratios = {r["context"]: r for r in m["ratios"]}
        for t, s in zip(m["teacher"]["cells"], m["student"]["cells"]):
            r = ratios.get(t["context"], {})

            def tps(c):
                return c.get("best_tokens_per_s", c["tokens_per_s"]) if c["status"] == "ok" else "does not fit"

            def peak(c):
                if c["status"] == "ok":
                    return _gb(c.get("peak_allocated_bytes"))
                return f"needs {_gb(c['needed_bytes']):.1f}" if c.get("needed_bytes") else "does not fit"

            rows.append([_k(t["context"]), tps(t), tps(s), r.get("student_over_teacher"), r.get("traffic_bound"),
                         t.get("tokens_per_s"), t.get("sliced_tokens_per_s"), t.get("eager_tokens_per_s"),
                         s.get("eager_tokens_per_s"),
                         peak(t), peak(s), _gb(t.get("context_cache_bytes")), _gb(s.get("cache_bytes")),
                         max(t.get("achieved_GBps") or 0, t.get("sliced_achieved_GBps") or 0) or None,
                         s.get("achieved_GBps"),
                         f"{t.get('best_mode', '–')} / {s.get('mode', '–')} ({s.get('kernel', '–')})"])
        lines.append(markdown_table(
            ["context", "teacher tok/s (best)", "student tok/s", "student / teacher", "traffic bound",
             "teacher masked tok/s", "teacher sliced eager tok/s", "teacher masked eager tok/s", "student eager tok/s",
             "teacher peak GB", "student peak GB", "teacher KV GB", "student state GB", "teacher GB/s (best)",
             "student GB/s", "mode (teacher best / student)"], rows))
    lines += ["", "## Targets", ""]
    for name, entry in data.get("targets", {}).items():
        for k, v in entry.items():
            lines.append(f"- {name}: {k} = {v:.3g}" if isinstance(v, float) else f"- {name}: {k} = {v}")
    return "\n".join(lines) + "\n"


def generate_figure(data: dict, path: Path) -> None:
    """Throughput (left) and peak memory (right) against context, log x, teacher dashed, student solid."""
    fig, (ax_t, ax_m) = new_figure((12, 4.6), ncols=2)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    # peak allocation where it was measured (CUDA); the cache/state bytes otherwise (CPU)
    key = "peak_allocated_bytes" if any(c.get("peak_allocated_bytes") for m in data["models"]
                                        for side in ("teacher", "student") for c in m[side]["cells"]) else "cache_bytes"
    for i, m in enumerate(data["models"]):
        color = colors[i % len(colors)]
        for side, style, marker in (("teacher", "--", "o"), ("student", "-", "s")):
            cells = m[side]["cells"]
            ok = [c for c in cells if c["status"] == "ok"]
            label = f"{m['name']} {side}"
            ax_t.plot([c["context"] for c in ok], [c.get("best_tokens_per_s", c["tokens_per_s"]) for c in ok],
                      style, marker=marker,
                      color=color, label=label)
            mem = [c for c in ok if c.get(key)]
            ax_m.plot([c["context"] for c in mem], [c[key] / 1e9 for c in mem], style,
                      marker=marker, color=color, label=label)
            nofit = [c for c in cells if c["status"] == "does_not_fit" and c.get("needed_bytes")]
            if nofit:
                ax_m.plot([c["context"] for c in nofit], [c["needed_bytes"] / 1e9 for c in nofit], "x",
                          color=color, markersize=9, label=f"{m['name']} {side}: needed, does not fit")
    total = data["environment"].get("device_memory_bytes") or data["settings"].get("device_memory_bytes")
    if total:
        ax_m.axhline(total / 1e9, color="0.4", linestyle=":", linewidth=1, label="device memory")
    contexts = data["settings"]["contexts"]
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [_k(c) for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in (ax_t, ax_m):
        if any(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
            ax.set_yscale("log")
    ax_t.set_ylabel(f"decode tokens/s (batch {data['settings']['batch_size']})")
    ax_m.set_ylabel("peak memory while decoding (GB)" if key == "peak_allocated_bytes"
                    else "KV cache / state (GB)")
    ax_t.legend(fontsize=7)
    ax_m.legend(fontsize=6)
    fig.suptitle(f"Decode: teacher vs {data['settings']['method']} student, {data['settings']['dtype']}, "
                 f"{data['environment']['device']}", fontsize=10)
    save_png(fig, path)


def profile_decode(name: str, context: int = 32768, batch_size: int = 16, dtype: str = "bf16",
                   device: str = "cuda", steps: int = 5, method: str = "lizard", top: int = 20) -> dict:
    """Where a decode step's time goes: CUDA kernels of graph replays (eager steps where the
    profiler sees no kernels inside graphs), summed by name, per step, for teacher and student."""
    import linearize
    from torch.profiler import ProfilerActivity, profile

    from ..models.decode import StudentDecoder
    from .teacher_decode import TeacherDecoder

    dev = torch.device(device)
    model, info = build_model(name, DTYPES[dtype], dev)
    out = {"model": name, "context": context, "batch_size": batch_size}
    for side in ("teacher", "student"):
        n = 2 + 1 + 3 + 2 * steps + 2
        if side == "teacher":
            dec = TeacherDecoder(model, batch_size, n, context + n)
        else:
            linearize.convert(model, method)
            dec = StudentDecoder(model, batch_size, n)
        dec.load_synthetic(context)
        _time_steps(dec, 2)
        graph = dev.type == "cuda"
        if graph:
            dec.capture()
        _time_steps(dec, 3)
        step_ms = statistics.median(_time_steps(dec, steps)) * 1e3
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                dec.step()
            sync(dev)
        kernels: dict[str, list[float]] = {}
        for evt in prof.events():
            if str(getattr(evt, "device_type", "")).endswith("CUDA"):
                k = kernels.setdefault(evt.name, [0.0, 0])
                k[0] += evt.time_range.elapsed_us()
                k[1] += 1
        rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])
        out[side] = {"step_ms": step_ms, "mode": dec.mode, "kernel": getattr(dec, "kernel", None),
                     "kernel_ms_per_step": sum(v[0] for v in kernels.values()) / steps / 1e3,
                     "kernels_per_step": sum(v[1] for v in kernels.values()) / steps,
                     "top": [{"name": k[:120], "us_per_step": v[0] / steps, "calls_per_step": v[1] / steps}
                             for k, v in rows[:top]]}
        dec.release()
        del dec
        cleanup(dev)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m linearize.bench.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "llama3-8b"])
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 16384, 32768, 65536, 131072])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefill", default="synthetic", choices=["synthetic", "real"])
    p.add_argument("--kernel", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--profile", type=int, metavar="CONTEXT",
                   help="instead of the bench: profile one decode step per model at this context")
    args = p.parse_args(argv)
    if args.profile:
        results = [profile_decode(m, args.profile, args.batch_size, args.dtype, args.device) for m in args.models]
        write_json(Path(args.out) / "profile.json", results, indent=1)
        for r in results:
            for side in ("teacher", "student"):
                d = r[side]
                print(f"== {r['model']} {side} @ {r['context']}: step {d['step_ms']:.2f} ms ({d['mode']}, "
                      f"{d['kernel']}), kernels {d['kernel_ms_per_step']:.2f} ms in {d['kernels_per_step']:.0f} launches")
                for k in d["top"]:
                    print(f"   {k['us_per_step']:9.1f} us  {k['calls_per_step']:6.1f}x  {k['name']}")
        return 0
    command = "python -m linearize.bench.generate " + " ".join(sys.argv[1:] if argv is None else argv)
    data = run_generate_bench(args.out, args.models, args.contexts, args.batch_size, args.new_tokens, args.dtype,
                              args.device, prefill=args.prefill, kernel=args.kernel, command=command)
    print(generate_markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
