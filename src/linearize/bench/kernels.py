"""``bench kernels``: attention kernels side by side on one GPU, in one run.

For each shape (B, T) at H heads of width D (bf16 by default), forward and forward+backward of

  sdpa causal          torch SDPA, causal softmax (FlashAttention on the GPU): the teacher's cost
  fla simple_gla       fla.ops.simple_gla.chunk_simple_gla (scalar gates), where fla imports
  fla gla              fla.ops.gla.chunk_gla (per-channel gates), where fla imports
  torch gla (ours)     ops.gla.gla_chunk, gated linear attention alone on fla simple_gla's inputs
                       (positive features, scalar log-gates, unnormalised)
  triton gla (ours)    ops.gla.triton.gla_chunk_triton on the same inputs, as a user gets it: on Hopper
                       the whole backward is one Gluon kernel (ops.gla.gluon, bwd_fused)
  triton gla two-pass bwd (ours)  the same with GLALaunch(gluon_fused_bwd=False): the Triton
                       reverse state pass, then the Gluon chunk pass (the default until 2026-11-26)
  triton gla passes (ours)  the same with KernelSettings(gluon=False): Triton passes only
  torch lizard (ours)  Lizard's whole attention (normalised gated branch on Hedgehog features
                       + window 128 with 4 sink logits + y_g + alpha * y_w), LINEARIZE_KERNELS=0; its
                       inference forward returns the states (a prefill), its training step none (as the
                       model's layers run it without a cache: return_state=False)
  triton lizard (ours) the same through the kernels (ops.lizard_attn.lizard_attention), as a user
                       gets it: on Hopper the forward is the fused Gluon kernel (ops.lizard_attn.gluon;
                       in training it also stores what the backward reads), the window's backward is
                       the walking Gluon kernel (ops.window_attn.gluon) and the gated backward the one
                       fused Gluon kernel (ops.gla.gluon)
  triton lizard two-pass bwd (ours)  the same with GLALaunch(gluon_fused_bwd=False) and
                       WindowLaunch(gluon_bwd_walk=False) (a LizardPlan): the backward of the defaults
                       until 2026-11-26 (the window kernel of one program per chunk, the Triton
                       reverse state pass, the Gluon chunk pass)
  triton lizard passes (ours)  the same with KernelSettings(gluon=False): Triton passes only
  torch lolcats (ours) LoLCATs' attention (ops.lolcats_attn.lolcats_attn_chunk: Hedgehog linear terms
                       and a softmax window under one normaliser, at the method's window of 64, all
                       chunks at once in torch; no kernel of its own), on Lizard's features and heads
  torch delta (ours)   the gated delta rule (ops.delta.delta_rule_chunk: liza's global branch with a
                       decay) on unit keys, beta in (0, 1) and the GLA rows' log-gates, chunks of 64,
                       LINEARIZE_KERNELS=0 (the chunk form's scan in torch)
  triton delta (ours)  the same with the scan on the Triton kernels (ops.delta.triton), as a user gets it

Each cell is timed with ``triton.testing.do_bench`` (L2 flushed between runs) and reported as
median and mean ms, with the peak extra memory of one call; a method that refuses to run (fla's
gated backward on Hopper, say) is recorded with its error. The triton/torch pairs are also
checked against each other (relative RMS of the outputs) so a fast wrong kernel cannot pass.

Writes ``kernels.json`` (everything), ``kernels.md`` (a table with the GPU, versions and the
command) and ``kernels.png`` (grouped bars, log scale) into ``out_dir``; the first two after every
shape as well (marked partial until the last), so that a run cut short keeps what it timed, and a
line a cell goes to stdout as it is timed. With ``--host`` each cell also gets its GPU time alone (a
CUDA graph) and the host's time per call: on an H100 the three shapes then take over 4 minutes.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict as dataclasses_asdict, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..ops.backend.dispatch import kernels_switched
from ..records import environment, write_json, write_text_atomically

DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((16, 2048), (4, 8192), (1, 32768))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
METHODS = ("sdpa causal", "fla simple_gla", "fla gla", "torch gla (ours)", "triton gla (ours)",
           "triton gla two-pass bwd (ours)", "triton gla passes (ours)", "torch lizard (ours)", "triton lizard (ours)",
           "triton lizard two-pass bwd (ours)", "triton lizard passes (ours)", "torch lolcats (ours)",
           "torch delta (ours)", "triton delta (ours)")
PASSES = ("fwd", "fwd+bwd")


def _check_args(shapes, dtype, reps, heads, head_dim, feature_dim, window, sinks) -> list[tuple[int, int]]:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    for name, value in (("reps", reps), ("heads", heads), ("head_dim", head_dim), ("feature_dim", feature_dim),
                        ("window", window), ("sinks", sinks)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    out = []
    for shape in shapes:
        if (not isinstance(shape, (tuple, list)) or len(shape) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape)):
            raise ValueError(f"each shape must be a pair (B, T) of positive ints, got {shape!r}")
        out.append((int(shape[0]), int(shape[1])))
    if not out:
        raise ValueError("shapes must not be empty")
    return out


def _time(fn: Callable[[], object], reps: int, grad_to_none=None) -> dict:
    """median and mean ms over at least ``reps`` timed calls (do_bench, L2 flushed), peak extra MiB."""
    from triton.testing import do_bench

    fn()  # compile / autotune / warm up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 3, 1e-3)
    times = do_bench(fn, warmup=max(25, int(3 * estimate)), rep=max(100, int(math.ceil(reps * estimate))),
                     grad_to_none=grad_to_none, return_mode="all")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return {"median_ms": statistics.median(times), "mean_ms": statistics.fmean(times), "runs": len(times),
            "peak_extra_mib": round(peak, 1)}


def _graph_replay(fn: Callable[[], object], grad_to_none=None) -> Callable[[], None]:
    """fn captured once as a CUDA graph (after warm-up calls on a side stream, as capture asks);
    returns the replay: the same GPU work with no host code between its kernels."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _clear(grad_to_none)
            fn()
    torch.cuda.current_stream().wait_stream(side)
    _clear(grad_to_none)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _clear(grad_to_none) -> None:
    for t in grad_to_none or ():
        t.grad = None


def _host_us(fn: Callable[[], object], grad_to_none=None, calls: int = 20,
             sleep_cycles: int = 1_000_000_000) -> float:
    """The host's time per call of fn in microseconds: ``calls`` calls queued behind a GPU held busy
    for ``sleep_cycles`` (``torch.cuda._sleep``; the default about half a second at 2 GHz, longer than
    the queueing), so that none waits for the GPU and the wall time is the host's alone."""
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    for _ in range(calls):
        _clear(grad_to_none)
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _host_split(fn: Callable[[], object], reps: int, grad_to_none=None) -> dict:
    """Where a cell's time comes from: ``graph_ms``, the median of the call replayed as a CUDA graph
    (its GPU time alone), and ``host_us``, the host's time per call (median of 3 rounds). A call whose
    host time exceeds its GPU time leaves the GPU waiting, and do_bench then reads the host's."""
    from triton.testing import do_bench

    out: dict = {"host_us": round(statistics.median(_host_us(fn, grad_to_none) for _ in range(3)), 1)}
    try:
        replay = _graph_replay(fn, grad_to_none)
        out["graph_ms"] = do_bench(replay, warmup=25, rep=max(100, reps), return_mode="median")
    except Exception as e:  # a capture refused (some library's op): say why, keep the rest
        torch.cuda.synchronize()
        out["graph_error"] = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
    _clear(grad_to_none)
    return out


def _cell(fn: Callable[[], object], reps: int, grad_to_none=None, host: bool = False) -> dict:
    try:
        cell = _time(fn, reps, grad_to_none)
        if host:
            cell.update(_host_split(fn, reps, grad_to_none))
        return cell
    except Exception as e:  # recorded, not raised: one refusing method must not stop the others
        torch.cuda.synchronize()
        msg = f"{type(e).__name__}: {e}".strip().splitlines()
        return {"error": msg[0][:300] if msg else type(e).__name__}
    finally:
        torch.cuda.empty_cache()


def _fwd_bwd(forward: Callable[[], torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    def run():
        forward().backward(grad)
    return run


def _with_kernels(flag: str, fn: Callable):
    def run(*args, **kwargs):
        with kernels_switched(flag != "0"):
            return fn(*args, **kwargs)
    return run


def _shape_inputs(B: int, T: int, H: int, D: int, Fd: int, sinks: int, dt: torch.dtype, dev: torch.device,
                  seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale

    x = {
        # the teacher's heads (SDPA) and the window's RoPE'd queries/keys
        "q": rnd(B, H, T, D).to(dt), "k": rnd(B, H, T, D).to(dt), "v": rnd(B, H, T, D).to(dt),
        # fla simple_gla's inputs: feature-mapped (positive) q, k with Fd features, scalar log-gates
        "fq": F.softmax(rnd(B, H, T, Fd), -1).to(dt), "fk": F.softmax(rnd(B, H, T, Fd), -1).to(dt),
        "log_g": F.logsigmoid(rnd(B, H, T) + 4.0),
        # Lizard: Hedgehog features (two softmax halves, fp32 then rounded, as the layer gives them)
        "lq": torch.cat([F.softmax(a, -1) for a in rnd(2, B, H, T, Fd // 2)], -1).to(dt),
        "lk": torch.cat([F.softmax(a, -1) for a in rnd(2, B, H, T, Fd // 2)], -1).to(dt),
        "alpha": torch.ones(H, device=dev) + rnd(H, scale=0.1), "sinks": rnd(H, sinks),
        "factor": rnd(H),  # LoLCATs' window factor, before its sigmoid
        "dy": rnd(B, H, T, D).to(dt),
        # the delta rule: unit keys (liza's L2-normalised features) and write strengths beta in (0, 1)
        "delta_q": F.normalize(rnd(B, H, T, D), dim=-1).to(dt),
        "delta_k": F.normalize(rnd(B, H, T, D), dim=-1).to(dt),
        "delta_beta": torch.sigmoid(rnd(B, H, T)).to(dt),
    }
    return x


def _methods(x: dict, window: int, fla, gla_launch=None,
             window_launch=None) -> dict[str, tuple[Callable[[], torch.Tensor], list, torch.Tensor]]:
    """name -> (forward returning the output, leaf tensors that take gradients, the output's gradient).
    ``gla_launch`` / ``window_launch``: the kernels' launch tables (default: the modules' ``LAUNCH``)."""
    from ..ops.backend.settings import KernelSettings
    from ..ops.gla import triton as kgla
    from ..ops.gla.triton import gla_chunk_triton
    from ..ops.lizard_attn.fused import LizardPlan, lizard_attention
    from ..ops.delta import delta_rule_chunk
    from ..ops.gla.chunk import gla_chunk
    from ..ops.lolcats_attn import lolcats_attn_chunk
    from ..methods import method_config
    from ..ops.window_attn import triton as kwin

    gl, wl = gla_launch or kgla.LAUNCH, window_launch or kwin.LAUNCH
    triton_only = KernelSettings(gluon=False)

    def leaves(*names):
        return [x[n].detach().requires_grad_() for n in names]

    out: dict = {}
    sq, sk, sv = leaves("q", "k", "v")
    dy = x["dy"]
    out["sdpa causal"] = (lambda: F.scaled_dot_product_attention(sq, sk, sv, is_causal=True), [sq, sk, sv], dy)
    if fla is not None:
        tq, tk, tv = (x[n].transpose(1, 2).contiguous().detach().requires_grad_() for n in ("fq", "fk", "v"))
        tg = x["log_g"].transpose(1, 2).contiguous().requires_grad_()
        tgv = x["log_g"].transpose(1, 2).unsqueeze(-1).expand(*tq.shape).contiguous().div(16).requires_grad_()
        dy_t = dy.transpose(1, 2).contiguous()  # fla's layout: (B, T, H, D)
        out["fla simple_gla"] = (lambda: fla["chunk_simple_gla"](tq, tk, tv, g=tg, scale=1.0)[0],
                                 [tq, tk, tv, tg], dy_t)
        out["fla gla"] = (lambda: fla["chunk_gla"](tq, tk, tv, tgv, scale=1.0)[0], [tq, tk, tv, tgv], dy_t)
    gq, gk, gv = leaves("fq", "fk", "v")
    gg = x["log_g"].detach().requires_grad_()
    kw = dict(normalize=False, log_space_features=False)
    out["torch gla (ours)"] = (lambda: gla_chunk(gq, gk, gv, gg, **kw)[0], [gq, gk, gv, gg], dy)
    out["triton gla (ours)"] = (lambda: gla_chunk_triton(gq, gk, gv, gg, launch=gl, **kw)[0], [gq, gk, gv, gg], dy)
    gla_two_pass = replace(gl, gluon_fused_bwd=False)
    out["triton gla two-pass bwd (ours)"] = (lambda: gla_chunk_triton(gq, gk, gv, gg, launch=gla_two_pass, **kw)[0],
                                             [gq, gk, gv, gg], dy)
    out["triton gla passes (ours)"] = (lambda: gla_chunk_triton(gq, gk, gv, gg, settings=triton_only, launch=gl,
                                                                **kw)[0], [gq, gk, gv, gg], dy)
    lq, lk, lv, wq, wk = leaves("lq", "lk", "v", "q", "k")
    lg, la, ls = (x[n].detach().requires_grad_() for n in ("log_g", "alpha", "sinks"))

    def lizard(settings=None, plan=LizardPlan(gla=gl, window=wl)):
        # a training step keeps no state (as the model's layers run it without a cache); an inference
        # forward is a prefill, whose state decoding continues from
        return lizard_attention(lq, lk, lv, lg, wq, wk, la, window=window, sink_logits=ls, settings=settings,
                                plan=plan, return_state=not torch.is_grad_enabled())[0]

    args = [lq, lk, lv, lg, wq, wk, la, ls]
    out["torch lizard (ours)"] = (_with_kernels("0", lizard), args, dy)
    out["triton lizard (ours)"] = (_with_kernels("1", lizard), args, dy)
    two_pass = LizardPlan(gla=replace(gl, gluon_fused_bwd=False), window=replace(wl, gluon_bwd_walk=False))
    out["triton lizard two-pass bwd (ours)"] = (_with_kernels("1", lambda: lizard(plan=two_pass)), args, dy)
    out["triton lizard passes (ours)"] = (_with_kernels("1", lambda: lizard(settings=triton_only)), args, dy)
    lf = x["factor"].detach().requires_grad_()
    lolcats_window = method_config("lolcats").window
    out["torch lolcats (ours)"] = (lambda: lolcats_attn_chunk(wq, wk, lv, lq, lk, torch.sigmoid(lf),
                                                              window=lolcats_window)[0], [wq, wk, lv, lq, lk, lf], dy)
    dq, dk, dv, db, dg = leaves("delta_q", "delta_k", "v", "delta_beta", "log_g")

    def delta():
        return delta_rule_chunk(dq, dk, dv, db, log_alpha=dg, chunk_size=64)[0]

    out["torch delta (ours)"] = (_with_kernels("0", delta), [dq, dk, dv, db, dg], dy)
    out["triton delta (ours)"] = (_with_kernels("1", delta), [dq, dk, dv, db, dg], dy)
    return out


def _env(command: str) -> dict:
    """``records.environment`` on the current GPU, plus whether fla imports (its kernels are timed)."""
    env = environment(torch.device("cuda", torch.cuda.current_device()), command)
    try:
        import fla

        env["fla"] = getattr(fla, "__version__", "unknown")
    except Exception as e:
        env["fla"] = f"not importable ({type(e).__name__})"
    return env


def _result_env(result: dict) -> dict:
    """The environment record of a result, also from a kernels.json written before ``records``
    (key ``env``, the GPU under ``gpu``)."""
    env = dict(result.get("environment") or result["env"])
    env.setdefault("device", env.get("gpu"))
    return env


def run_kernel_bench(
    out_dir: str | os.PathLike, shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES, dtype: str = "bf16",
    reps: int = 20, *, heads: int = 32, head_dim: int = 128, feature_dim: int = 128, window: int = 128,
    sinks: int = 4, methods: Optional[Sequence[str]] = None, seed: int = 0, host: bool = False,
    launches: Optional[dict] = None,
) -> dict:
    """Time every method of ``METHODS`` (or ``methods``) over ``shapes`` (B, T) and write
    kernels.json / kernels.md / kernels.png into ``out_dir``; returns the json content.

    ``reps``: the least number of timed calls per cell (do_bench times at least 100 ms).
    ``launches``: {"gla": GLALaunch, "window": WindowLaunch} to time instead of the modules' ``LAUNCH``
    (``--tuned``). ``host``: also split each cell's time into GPU and host (``_host_split``: the call replayed as a
    CUDA graph, and the host's time per call), to tell a GPU-bound reading from a host-bound one.
    Needs a CUDA device.
    """
    shapes = _check_args(shapes, dtype, reps, heads, head_dim, feature_dim, window, sinks)
    chosen = list(METHODS if methods is None else methods)
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; allowed: {list(METHODS)}")
    if not torch.cuda.is_available():
        raise ValueError("bench kernels needs a CUDA device; none is available (device: cpu)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dt, dev = DTYPES[dtype], torch.device("cuda")
    try:
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla

        fla = {"chunk_gla": chunk_gla, "chunk_simple_gla": chunk_simple_gla}
    except Exception:
        fla = None
    prog = Path(sys.argv[0]).name if sys.argv else ""
    prog = "python -m linearize.bench.kernels" if prog == "kernels.py" else prog
    command = " ".join([prog] + sys.argv[1:]) if prog else "run_kernel_bench"
    from ..ops.gla import triton as kgla
    from ..ops.window_attn import triton as kwin

    from ..ops.backend.settings import current_settings

    gla_launch = (launches or {}).get("gla", kgla.LAUNCH)
    window_launch = (launches or {}).get("window", kwin.LAUNCH)
    result = {"environment": _env(command), "settings": dataclasses_asdict(current_settings()),
              "gla_launch": dataclasses_asdict(gla_launch), "window_launch": dataclasses_asdict(window_launch), "dtype": dtype, "heads": heads, "head_dim": head_dim,
              "feature_dim": feature_dim, "window": window, "sinks": sinks, "reps": reps,
              "shapes_planned": [list(s) for s in shapes], "complete": False, "shapes": []}
    for B, T in shapes:
        x = _shape_inputs(B, T, heads, head_dim, feature_dim, sinks, dt, dev, seed)
        cells: dict = {}
        table = _methods(x, window, fla, gla_launch, window_launch)
        for name in chosen:
            if name not in table:
                cells[name] = {p: {"error": "fla is not importable"} for p in PASSES}
                continue
            forward, leaves, grad = table[name]
            with torch.no_grad():
                cells[name] = {"fwd": _cell(forward, reps, host=host)}
            cells[name]["fwd+bwd"] = _cell(_fwd_bwd(forward, grad), reps, grad_to_none=leaves, host=host)
            for p in PASSES:  # progress, a line a cell
                c = cells[name][p]
                said = c["error"] if "error" in c else f"{_fmt(c)} ms (median / mean)" + (
                    f", {_fmt_host(c)} (as a graph, ms / host us)" if host else "")
                print(f"bench kernels: B{B} T{T} {name} {p}: {said}", flush=True)
        checks = {}
        for a, b in (("triton gla (ours)", "torch gla (ours)"), ("triton lizard (ours)", "torch lizard (ours)"),
                     ("triton lizard passes (ours)", "torch lizard (ours)"),
                     ("triton delta (ours)", "torch delta (ours)")):
            if a in table and b in table and a in chosen:
                try:
                    with torch.no_grad():
                        ya, yb = table[a][0]().float(), table[b][0]().float()
                    checks[f"{a} vs {b}"] = ((ya - yb).norm() / yb.norm()).item()
                except Exception as e:
                    checks[f"{a} vs {b}"] = f"{type(e).__name__}: {e}"[:300]
        result["shapes"].append({"B": B, "T": T, "tokens": B * T, "cells": cells, "rel_rms_vs_torch": checks})
        del x, table
        torch.cuda.empty_cache()
        # each shape's cells on disk as soon as they are timed: a run cut short keeps what it measured
        _write_results(out_dir, result)
    result["complete"] = True
    _write_results(out_dir, result)
    try:
        plot_kernel_bench(result, out_dir / "kernels.png")
    except ImportError as e:  # matplotlib missing on the GPU box: plot later from kernels.json
        result["plot"] = f"not drawn ({e}); run linearize.bench.kernels.plot_kernel_bench on kernels.json"
        write_json(out_dir / "kernels.json", result, indent=1)
    return result


def _write_results(out_dir: Path, result: dict) -> None:
    """kernels.json and kernels.md from ``result`` as it stands, each written whole (a temporary file
    renamed over the old one)."""
    write_json(out_dir / "kernels.json", result, indent=1)
    write_text_atomically(out_dir / "kernels.md", render_markdown(result))


def _fmt(cell: dict) -> str:
    if "error" in cell:
        return "error"
    return f"{cell['median_ms']:.3f} / {cell['mean_ms']:.3f}"


def _fmt_host(cell: dict) -> str:
    if "host_us" not in cell:
        return "-"
    graph = f"{cell['graph_ms']:.3f}" if "graph_ms" in cell else "no graph"
    return f"{graph} / {cell['host_us']:.0f}"


def render_markdown(result: dict) -> str:
    env = _result_env(result)
    shapes = result["shapes"]
    head = [f"B{s['B']} T{s['T']}" for s in shapes]
    lines = [
        "# Attention kernels: forward and forward+backward",
        "",
        f"{env['device']}, {result['dtype']}, {result['heads']} heads, head_dim {result['head_dim']}, "
        f"{result['feature_dim']} features, window {result['window']}, {result['sinks']} sink logits. "
        f"torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, fla {env['fla']}, "
        f"python {env['python']}; {env['date']}.",
        "",
        f"Command: `{env['command']}`",
        "",
        *([f"**Partial:** {len(shapes)} of {len(result['shapes_planned'])} shapes timed; the run stopped before "
           "the rest.", ""] if not result.get("complete", True) else []),
        f"Settings: `{result.get('settings')}`; launch tables: GLA `{result.get('gla_launch')}`, "
        f"window `{result.get('window_launch')}`.",
        "",
        f"Cells: median / mean ms over >= {result['reps']} timed calls (triton.testing.do_bench, L2 flushed "
        "between calls). fwd: the forward under torch.no_grad, no backward to follow (inference); fwd+bwd: "
        "the forward with autograd (keeping what the backward reads) and the backward.",
        "",
        "| method | pass | " + " | ".join(head) + " |",
        "|---|---|" + "---|" * len(head),
    ]
    errors = {}
    for name in shapes[0]["cells"]:
        for p in PASSES:
            row = []
            for s in shapes:
                cell = s["cells"][name][p]
                row.append(_fmt(cell))
                if "error" in cell:
                    errors.setdefault((name, p), cell["error"])
            lines.append(f"| {name} | {p} | " + " | ".join(row) + " |")
    lines += ["", "Peak extra memory of one call (MiB):", "",
              "| method | pass | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for name in shapes[0]["cells"]:
        for p in PASSES:
            row = [str(s["cells"][name][p].get("peak_extra_mib", "-")) for s in shapes]
            lines.append(f"| {name} | {p} | " + " | ".join(row) + " |")
    if any("host_us" in s["cells"][n][p] for s in shapes for n in s["cells"] for p in PASSES):
        lines += ["", "GPU time alone (the call replayed as a CUDA graph, median ms) / the host's time per call "
                  "(us, queued behind a busy GPU). Where the host's time is above the GPU's, do_bench's cell "
                  "reads the host:", "", "| method | pass | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
        for name in shapes[0]["cells"]:
            for p in PASSES:
                row = [_fmt_host(s["cells"][name][p]) for s in shapes]
                lines.append(f"| {name} | {p} | " + " | ".join(row) + " |")
    if errors:
        lines += ["", "Errors:", ""] + [f"- {n}, {p}: `{e}`" for (n, p), e in errors.items()]
    lines += ["", "Kernel output vs our torch path (relative RMS, same inputs):", ""]
    for s in shapes:
        for key, val in s["rel_rms_vs_torch"].items():
            lines.append(f"- B{s['B']} T{s['T']}, {key}: " + (f"{val:.2e}" if isinstance(val, float) else str(val)))
    return "\n".join(lines) + "\n"


def plot_kernel_bench(result: dict | str | os.PathLike, out_png: str | os.PathLike) -> None:
    """Grouped bars (one group per shape, one bar per method), log-scale ms, fwd and fwd+bwd panels;
    ``result`` is the dict ``run_kernel_bench`` returns or the path of its kernels.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not isinstance(result, dict):
        result = json.loads(Path(result).read_text())
    shapes = result["shapes"]
    names = list(shapes[0]["cells"])
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    width = 0.8 / len(names)
    for ax, p in zip(axes, PASSES):
        for i, name in enumerate(names):
            vals = [s["cells"][name][p].get("median_ms", float("nan")) for s in shapes]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(shapes))]
            bars = ax.bar(xs, [v if v == v else 0 for v in vals], width, label=name)
            for xb, v in zip(xs, vals):
                if v != v:  # not run / refused: marked at the bottom of the axis
                    ax.text(xb, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=7,
                            transform=ax.get_xaxis_transform())
            del bars
        ax.set_xticks(range(len(shapes)), [f"B{s['B']} T{s['T']}" for s in shapes])
        ax.set_yscale("log")
        ax.set_title(f"{p} (median ms, lower is better)")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel("ms")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    env = _result_env(result)
    fig.suptitle(f"{env['device']}, {result['dtype']}, H={result['heads']}, d={result['head_dim']}, "
                 f"window {result['window']} + {result['sinks']} sinks; torch {env['torch']}, triton {env['triton']}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- launch-config sweep

GLA_FWD_CANDIDATES = (  # chunk 32 lost clearly in earlier sweeps
    dict(fwd_bv=64, fwd_warps=4, fwd_stages=2, den_warps=2),
    dict(fwd_bv=64, fwd_warps=4, fwd_stages=2, den_warps=4),
    dict(fwd_bv=64, fwd_warps=4, fwd_stages=2, den_warps=1),
    dict(fwd_bv=64, fwd_warps=8, fwd_stages=2, den_warps=2),
    dict(fwd_bv=128, fwd_warps=8, fwd_stages=2, den_warps=2),
    dict(fwd_bv=64, fwd_warps=4, fwd_stages=2, den_warps=2, tma=False),
    dict(fwd_bv=64, fwd_warps=4, fwd_stages=3, den_warps=2),
)  # fwd_bv=32 also lost, and with log-features crashed on the H200 (illegal address; see ops.gla.triton);
# so did a register cap and the normaliser inside the main pass (benchmarks/kernel-settings.md). Splitting
# the normaliser pass's features over programs (blocks of 64 or 32, parts of den added atomically) lost
# too (sweep3: 0.748-1.135 ms against 0.709 for Lizard's gated forward at B16 T2048)
GLA_BWD_CANDIDATES = (  # pick_tuned takes par_warps from the Lizard rows (plain features); dstate_bv
    # stands for dstate_bv_norm in the Lizard (normalised) rows
    dict(par_warps=4, par_stages=1, dstate_warps=4, dstate_bv=128),
    dict(par_warps=4, par_stages=1, dstate_warps=4, dstate_bv=64),
    dict(par_warps=4, par_stages=1, dstate_warps=8, dstate_bv=128),
    dict(par_warps=4, par_stages=1, dstate_warps=8, dstate_bv=64),
    dict(par_warps=8, par_stages=1, dstate_warps=4, dstate_bv=128),
)  # sweep3 (B16 T2048, Lizard's op / GLA alone): par_stages 2 3.363 / 2.561, dstate_stages 3 3.253 / 2.399,
# dstate_warps 2 4.162-13.36, dstate_bv 32 3.902 / 2.645: all lost to dstate_warps 4 at 128 (3.115 / 2.399)
WINDOW_CANDIDATES = (
    dict(bm=64, bn=32, fwd_warps=4, bwd_warps=4, fwd_stages=3, bwd_stages=3, kv_bm=32, kv_bn=64, kv_warps=4),
    dict(bm=64, bn=32, fwd_warps=4, bwd_warps=4, fwd_stages=3, bwd_stages=3, kv_bm=64, kv_bn=32, kv_warps=4),
    dict(bm=64, bn=32, fwd_warps=4, bwd_warps=4, fwd_stages=2, bwd_stages=2, kv_bm=32, kv_bn=64, kv_warps=4),
)  # bn 64 and bm 128 lost (fwd 0.66-0.91 ms against 0.60, H200). The dk/dv
# pass's own blocks (kv_*; the second row is the shared 64 x 32 of before), three sweeps on an H200 at B16
# T2048, fwd+bwd of the window alone: 32 x 64 with 4 warps 2.393 /
# 2.406 / 2.403 ms against 2.509 / 2.524 / 2.523; 32 x 32 2.713; 64 x 64 2.612 (4 warps) / 2.850 (8); 32 x 64
# with 2 warps 3.291 or 2 stages 2.529-2.564; 64 x 128 4.255 and 32 x 128 2.960 (8 warps); 16-row query
# blocks (2.592-2.678) also gave dk 5% off in bf16 on the GPU, right under the interpreter: not offered.
# The dq pass on blocks of its own (128 x 32 / 64 x 64 / 128 x 64 / 64 x 32 with 8 warps: 2.537-3.128) lost.
TUNE_KINDS = ("gla fwd", "gla bwd", "window", "gla seg")


def _tune_jobs(shapes, kinds: Sequence[str] = TUNE_KINDS) -> list[tuple[str, str, tuple[int, int], dict]]:
    jobs = []
    B, T = shapes[0]
    for mode in ("plain", "lizard"):
        for c in GLA_FWD_CANDIDATES:
            jobs.append(("gla fwd", mode, (B, T), c))
        for c in GLA_BWD_CANDIDATES:
            if mode == "lizard":
                c = {("dstate_bv_norm" if k == "dstate_bv" else k): v for k, v in c.items()}
            jobs.append(("gla bwd", mode, (B, T), c))
    for c in WINDOW_CANDIDATES:
        jobs.append(("window", "fused", (B, T), c))
    for shape in shapes[1:]:
        for fill in (1, 2, 4):
            jobs.append(("gla seg", "lizard", shape, dict(fill=fill)))
    return [j for j in jobs if j[0] in kinds]


def tune_kernel_configs(out_dir: str | os.PathLike, shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
                        part: int = 0, parts: int = 1, compile_only: bool = False, reps: int = 20,
                        kinds: Sequence[str] = TUNE_KINDS) -> dict:
    """Time the candidate launch configs (``*_CANDIDATES``) of the kernels at ``shapes[0]`` and the
    sequence-split fill at the other shapes (``kinds``: which of ``TUNE_KINDS``); ``compile_only``
    runs each job of partition ``part`` of ``parts`` once (to fill Triton's cache from several
    processes before timing in one). A candidate that fails (e.g. more shared memory than the GPU
    has) gets its error in place of the times."""
    unknown = sorted(set(kinds) - set(TUNE_KINDS))
    if unknown:
        raise ValueError(f"unknown tune kinds {unknown}; allowed: {list(TUNE_KINDS)}")
    import dataclasses

    from ..ops.gla import triton as kgla
    from ..ops.window_attn import triton as kwin

    dev, dt = torch.device("cuda"), torch.bfloat16
    jobs = _tune_jobs([tuple(s) for s in shapes], kinds)[part::parts]
    rows = []
    inputs: dict = {}
    for kind, mode, (B, T), cand in jobs:
        if (B, T) not in inputs:
            inputs.clear()
            torch.cuda.empty_cache()
            inputs[(B, T)] = _shape_inputs(B, T, 32, 128, 128, 4, dt, dev, 0)
        x = inputs[(B, T)]
        if kind.startswith("gla"):
            cfg = dataclasses.replace(kgla.LAUNCH, **cand)
            names = ("fq", "fk", "v", "log_g") if mode == "plain" else ("lq", "lk", "v", "log_g")
            kw = dict(normalize=mode != "plain", launch=cfg)
            leaves = [x[n].detach().requires_grad_() for n in names]

            def fwd(leaves=leaves, kw=kw):
                return kgla.gla_chunk_triton(*leaves, **kw)[0]
        else:
            cfg = dataclasses.replace(kwin.LAUNCH, **cand)
            leaves = [x[n].detach().requires_grad_() for n in ("q", "k", "v", "dy", "alpha", "sinks")]

            def fwd(leaves=leaves, cfg=cfg):
                q, k, v, yg, alpha, sinks = leaves
                return kwin.window_attn_triton(q, k, v, window=128, sink_logits=sinks, y_global=yg, alpha=alpha,
                                               launch=cfg)[0]
        if compile_only:
            try:
                fwd().backward(x["dy"])
                torch.cuda.synchronize()
            except Exception as e:
                print(f"compile {kind} {mode} {cand}: {type(e).__name__}: {e}", flush=True)
            continue
        with torch.no_grad():
            f = _cell(fwd, reps)
        fb = _cell(_fwd_bwd(fwd, x["dy"]), reps, grad_to_none=leaves)
        row = {"kind": kind, "mode": mode, "B": B, "T": T, "config": cand, "fwd": f, "fwd+bwd": fb}
        rows.append(row)
        print(f"{kind:8s} {mode:7s} B{B} T{T} {json.dumps(cand):75s} fwd {_fmt(f):>16s}  fwd+bwd {_fmt(fb):>16s}",
              flush=True)
    if not compile_only:
        write_json(Path(out_dir) / "tune.json", rows, indent=1)
    return {"rows": rows}


def pick_tuned(rows: Sequence[dict] | str | os.PathLike) -> dict:
    """The fastest candidates of a ``tune`` run (its rows or tune.json): GLA forward by the Lizard-mode
    forward, GLA backward by the Lizard-mode backward (fwd+bwd - fwd), the window by fwd+bwd, the
    split fill by the longest shape's fwd+bwd. Returns the chosen fields per sweep and, as
    ``gla_launch`` / ``window_launch``, the launch tables they make (``GLALaunch``, ``WindowLaunch``):
    ``bench kernels --tuned`` times those; to make them the defaults, write them into the modules."""
    from ..ops.gla import triton as kgla
    from ..ops.window_attn import triton as kwin

    if not isinstance(rows, (list, tuple)):
        rows = json.loads(Path(rows).read_text())

    def best(kind, key, modes=("lizard", "fused")):
        cands = [r for r in rows if r["kind"] == kind and r["mode"] in modes
                 and all("median_ms" in r[p] for p in PASSES)]
        if kind == "gla seg" and cands:  # the split matters for the fewest sequences: the last shape
            last = max(r["T"] for r in cands)
            cands = [r for r in cands if r["T"] == last]
        return min(cands, key=key)["config"] if cands else {}

    backward = lambda r: r["fwd+bwd"]["median_ms"] - r["fwd"]["median_ms"]  # noqa: E731
    plain = best("gla bwd", backward, modes=("plain",))
    chosen = {
        "gla_fwd": best("gla fwd", lambda r: r["fwd"]["median_ms"]),
        "gla_bwd": {**({"dstate_bv": plain["dstate_bv"]} if "dstate_bv" in plain else {}),
                    **best("gla bwd", backward)},
        "window": best("window", lambda r: r["fwd+bwd"]["median_ms"]),
        "gla_seg": best("gla seg", lambda r: r["fwd+bwd"]["median_ms"]),
    }
    # the Lizard rows take plain (normalised) features, so they pick the chunk pass's par_warps and
    # the normalised reverse pass's V-block; the unnormalised one comes from the plain rows;
    # the chunk pass's warps for log-features (which no layer passes now) are a module constant
    chosen["gla_launch"] = replace(kgla.LAUNCH, **chosen["gla_fwd"], **chosen["gla_bwd"], **chosen["gla_seg"])
    chosen["window_launch"] = replace(kwin.LAUNCH, **chosen["window"])
    return chosen


def profile_kernels(out_dir: str | os.PathLike, shape: tuple[int, int] = DEFAULT_SHAPES[0], reps: int = 5,
                    methods: Sequence[str] = ("triton gla (ours)", "triton lizard (ours)")) -> dict:
    """Where the time of ``methods`` goes: CUDA time per kernel (torch.profiler, mean over
    ``reps`` calls after a warm-up) for the forward and the forward+backward at ``shape``, at
    the bench's settings; writes ``profile.json`` and returns it."""
    from torch.profiler import ProfilerActivity, profile

    B, T = shape
    x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
    table = _methods(x, 128, None)
    result: dict = {"environment": _env("profile"), "B": B, "T": T, "methods": {}}
    for name in methods:
        forward, leaves, grad = table[name]
        result["methods"][name] = {}
        for pas, fn in (("fwd", forward), ("fwd+bwd", _fwd_bwd(forward, grad))):
            ctx = torch.no_grad() if pas == "fwd" else torch.enable_grad()
            with ctx:
                fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(reps):
                        # as the bench (do_bench's grad_to_none): each backward writes fresh gradients; kept
                        # gradients would add a sum per leaf to every call (profiles before 2026-11-25 show it)
                        for t in leaves:
                            t.grad = None
                        fn()
                    torch.cuda.synchronize()
            for t in leaves:
                t.grad = None
            kernels = {}
            for ev in prof.key_averages():
                us = getattr(ev, "device_time_total", None)
                if us is None:
                    us = ev.cuda_time_total
                if us > 0:
                    kernels[ev.key] = round(us / reps / 1000, 4)
            kernels = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
            result["methods"][name][pas] = kernels
            print(f"{name} {pas} B{B} T{T}: total {sum(kernels.values()):.3f} ms", flush=True)
            for k, ms in list(kernels.items())[:12]:
                print(f"  {ms:8.3f} ms  {k[:100]}", flush=True)
    write_json(Path(out_dir) / "profile.json", result, indent=1)
    return result


def _main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m linearize.bench.kernels",
                                description="kernel benchmark (bench), launch-config sweep (tune), or "
                                            "CUDA time per kernel (profile, at the first shape)")
    p.add_argument("what", choices=["bench", "tune", "profile"])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="16x2048,4x8192,1x32768", help="BxT,... (default: %(default)s)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--methods", default=None, help="comma-separated subset of: " + ", ".join(METHODS))
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--part", type=int, default=0)
    p.add_argument("--parts", type=int, default=1)
    p.add_argument("--tuned", default=None, help="bench: time the fastest launch tables of this tune.json")
    p.add_argument("--kinds", default=",".join(TUNE_KINDS), help="tune: which sweeps (default: %(default)s)")
    p.add_argument("--host", action="store_true",
                   help="bench: also time each cell as a CUDA graph (GPU alone) and the host's time per call")
    a = p.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes must look like 16x2048,4x8192, got {a.shapes!r}")
    if a.what == "tune":
        tune_kernel_configs(a.out, shapes, a.part, a.parts, a.compile_only, a.reps, kinds=a.kinds.split(","))
    elif a.what == "profile":
        profile_kernels(a.out, shapes[0], **({"methods": a.methods.split(",")} if a.methods else {}))
    else:
        if a.tuned:
            tuned = pick_tuned(a.tuned)
            launches = {"gla": tuned["gla_launch"], "window": tuned["window_launch"]}
            print("tuned launches:", json.dumps({k: dataclasses_asdict(v) for k, v in launches.items()}), flush=True)
        res = run_kernel_bench(a.out, shapes, reps=a.reps, methods=a.methods.split(",") if a.methods else None,
                               host=a.host, launches=launches if a.tuned else None)
        print(render_markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
