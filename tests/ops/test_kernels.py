"""The Triton kernels (linearize.ops.*.triton, .gluon) against the torch reference.

Three groups:
- CPU, always: dispatch (env switch, CPU tensors take the torch path), input validation.
- CPU, Triton interpreter: every case of ``kernel_cases.INTERPRETER_CASES`` (gated linear attention
  fp32/bf16, normalised or not, plain or log-space features, extreme gates, initial state,
  sequence segments, T not a multiple of the chunk; window with sinks, padding, fused combine;
  the hybrid layer with kernels on vs off) in ONE subprocess with TRITON_INTERPRET=1, which
  must be set before Triton decorates the kernels. About 30 s on 2 cores.
- CUDA, when a GPU is present: the same comparisons at real widths (128) and lengths, the launch
  configs users get, a 64K-token bf16 run with extreme gates, and the hybrid layer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_cases import CASE_TOL, INTERPRETER_CASES, KTOL, gla_case, hybrid_case, lizard_case, rel_rms, window_case

HERE = Path(__file__).resolve().parents[1]  # tests/, where kernel_cases.py lives
CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def assert_errors(errors: dict, tol: float, what: str) -> None:
    bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= tol}
    assert not bad, f"{what}: over {tol:.0e}: {bad} (all: { {k: f'{v:.1e}' for k, v in errors.items()} })"


# ----------------------------------------------------------------------------- CPU, always


def test_env_switch_and_cpu_tensors_take_the_torch_path(monkeypatch):
    from linearize.ops import gla as gla_op
    from linearize.ops import window_attn as window_op
    from linearize.ops.backend import dispatch
    from linearize.ops.gla.chunk import gla_chunk
    from linearize.ops.window_attn.chunk import window_attn_chunk

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for off in ("0", "false", "off"):
        monkeypatch.setenv("LINEARIZE_KERNELS", off)
        assert not dispatch.kernels_enabled()
    monkeypatch.setenv("LINEARIZE_KERNELS", "1")
    assert dispatch.kernels_enabled() == dispatch.triton_available()
    g = torch.Generator().manual_seed(0)
    q, k = torch.rand(2, 1, 2, 9, 8, generator=g)
    v = torch.randn(1, 2, 9, 5, generator=g)
    log_g = -torch.rand(1, 2, 9, generator=g)
    assert not gla_op.gla_applies(q, k, v, log_g)  # CPU tensors, no interpreter
    o, st = gla_op.gla_chunk(q, k, v, log_g, chunk_size=4)
    ref, ref_st = gla_chunk(q, k, v, log_g, chunk_size=4)
    assert torch.equal(o, ref) and torch.equal(st.S, ref_st.S)
    w, ws = window_op.window_attn_chunk(q, k, q, window=3, sink_logits=torch.zeros(2, 4))
    ref_w, _ = window_attn_chunk(q, k, q, window=3, sink_logits=torch.zeros(2, 4))
    assert torch.equal(w, ref_w)
    assert window_op.window_attn_sum(q, k, q, q, torch.ones(2), window=3) is None


@needs_triton
def test_bad_inputs_raise_naming_the_value():
    from linearize.ops.gla.triton import gla_chunk_triton
    from linearize.ops.window_attn.triton import window_attn_triton

    q = torch.rand(1, 2, 9, 8)
    v = torch.randn(1, 2, 9, 5)
    with pytest.raises(ValueError, match=r"scalar log_g \(B, H, T\).*got log_g \(1, 2, 9, 8\)"):
        gla_chunk_triton(q, q, v, -torch.rand(1, 2, 9, 8))
    with pytest.raises(ValueError, match=r"log_g must have shape \(1, 2, 9\) or \(1, 2, 9, 8\), got \(1, 2, 8\)"):
        gla_chunk_triton(q, q, v, -torch.rand(1, 2, 8))
    with pytest.raises(ValueError, match=r"one dtype among bf16/fp16/fp32.*q torch.float64"):
        gla_chunk_triton(q.double(), q.double(), v.double(), -torch.rand(1, 2, 9))
    with pytest.raises(ValueError, match=r"Dk, Dv <= 128.*Dk=200"):
        gla_chunk_triton(torch.rand(1, 2, 9, 200), torch.rand(1, 2, 9, 200), v, -torch.rand(1, 2, 9))
    with pytest.raises(ValueError, match=r"eps must be a non-negative number, got -1"):
        gla_chunk_triton(q, q, v, -torch.rand(1, 2, 9), eps=-1)
    with pytest.raises(ValueError, match=r"alpha must have shape \(2,\), got \(3,\)"):
        window_attn_triton(q, q, v, window=4, y_global=torch.zeros(1, 2, 9, 5), alpha=torch.ones(3))
    with pytest.raises(ValueError, match=r"y_global and alpha must be given together"):
        window_attn_triton(q, q, v, window=4, y_global=torch.zeros(1, 2, 9, 5))
    with pytest.raises(ValueError, match=r"window must be a positive int, got 0"):
        window_attn_triton(q, q, v, window=0)
    with pytest.raises(ValueError, match=r"sink_logits must have shape \(H, m\) = \(2, m\), got \(3, 4\)"):
        window_attn_triton(q, q, v, window=4, sink_logits=torch.zeros(3, 4))


@needs_triton
def test_tensor_descriptors_only_where_tma_allows_them():
    """TMA needs 16-byte row strides and bases and a unit last stride; anything else keeps the
    pointer loads (the interpreter cases run both paths against the reference)."""
    from linearize.ops.gla.triton import GLALaunch, _tma

    on, off = GLALaunch(), GLALaunch(tma=False)
    x = torch.zeros(2, 3, 64, 128, dtype=torch.bfloat16)
    assert _tma(on, x, x) and not _tma(off, x, x)
    assert not _tma(on, x, torch.zeros(2, 3, 64, 20, dtype=torch.bfloat16))  # 40-byte rows
    assert _tma(on, torch.zeros(2, 3, 64, 20))  # 80-byte fp32 rows
    assert not _tma(on, x.flatten()[1:1 + 2 * 3 * 64 * 64].view(2, 3, 64, 64))  # base 2 bytes past 16
    assert not _tma(on, x.transpose(2, 3))  # last stride not 1


def test_sequence_split_follows_the_sweep():
    """Segments per (batch * head) at 32 heads on 132 multiprocessors (an H200), with the main
    pass's 2 V-blocks: the counts the sweeps found fastest (about 9 at B1 T32768, 1 at B4 T8192),
    none where the main pass's programs fill the GPU."""
    from linearize.ops.gla import triton as kgla

    cfg = kgla.GLALaunch()
    assert kgla._segments(2048, 64, 16 * 32, 132, cfg, v_blocks=2) == (1, 2048)
    assert kgla._segments(8192, 64, 4 * 32, 132, cfg, v_blocks=2) == (1, 8192)
    assert kgla._segments(8192, 64, 4 * 32, 132, cfg, v_blocks=1) == (2, 4096)  # 128 programs on 132
    assert kgla._segments(32768, 64, 32, 132, cfg, v_blocks=2) == (8, 4096)
    assert kgla._segments(1000, 64, 1, 132, cfg, v_blocks=2) == (2, 512)  # segments keep at least 8 chunks
    # the fused backward's programs take a multiprocessor each: whole where B x H fill half of them
    assert kgla._fused_segments(8192, 64, 4 * 32, 132, cfg) == (1, 8192)
    assert kgla._fused_segments(2048, 64, 16 * 32, 132, cfg) == (1, 2048)
    assert kgla._fused_segments(1000, 64, 66, 132, cfg) == (1, 1024)
    assert kgla._fused_segments(32768, 64, 32, 132, cfg) == (8, 4096)  # few programs: split as the passes
    assert kgla._fused_segments(8192, 64, 4 * 32, 132, dataclasses.replace(cfg, seg_chunks=16)) == (8, 1024)


@pytest.mark.parametrize("grad_mode", [True, False])
def test_forwards_store_for_a_backward_only_when_one_can_run(monkeypatch, grad_mode):
    """The per-chunk states (GLA) and the window's own output (fused into y_g + alpha y_w) exist only
    for a backward; under torch.no_grad none runs, even for inputs that require grad (what autograd's
    needs_input_grad reports). Checked at the point where the kernels' drivers get the flag."""
    from linearize.ops.gla import triton as kgla
    from linearize.ops.window_attn import triton as kwin

    seen = {}

    class Stop(Exception):
        pass

    def record(name, position):
        def fake(*args):
            seen[name] = args[position]
            raise Stop
        return fake

    monkeypatch.setattr(kgla, "_fwd", record("gla", 10))
    monkeypatch.setattr(kwin, "_fwd", record("window", 9))
    q, k, v = (torch.rand(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    log_g = torch.full((1, 2, 8), -0.1, requires_grad=True)
    with torch.set_grad_enabled(grad_mode):
        with pytest.raises(Stop):
            kgla.gla_chunk_triton(q, k, v, log_g)
        with pytest.raises(Stop):
            kwin.window_attn_triton(q, k, v, window=4, y_global=torch.zeros_like(v), alpha=torch.ones(2))
    assert seen == {"gla": grad_mode, "window": grad_mode}


def test_tuning_picks_the_reverse_pass_block_per_mode():
    """The backward's reverse-pass V-block is tuned apart for the unnormalised pass (GLA alone,
    the plain rows) and the normalised one (Lizard's, the Lizard rows): with 8 warps a sweep found
    64 faster for the first and 128 for the second, so one setting for both cost one of them. The
    rows here are made up to make the two picks differ."""
    from linearize.bench import kernels as kb
    from linearize.ops.gla import triton as kgla
    from linearize.ops.window_attn import triton as kwin

    jobs = kb._tune_jobs([(16, 2048)])
    bwd = {(mode, json.dumps(c, sort_keys=True)) for kind, mode, _, c in jobs if kind == "gla bwd"}
    assert all(("dstate_bv" in c) == (mode == "plain") and ("dstate_bv_norm" in c) == (mode == "lizard")
               for mode, c in ((m, json.loads(c)) for m, c in bwd))

    def row(kind, mode, config, fwd, fwd_bwd):
        return {"kind": kind, "mode": mode, "B": 16, "T": 2048, "config": config,
                "fwd": {"median_ms": fwd}, "fwd+bwd": {"median_ms": fwd_bwd}}

    rows = [row("gla bwd", "plain", {"par_warps": 8, "dstate_bv": 128}, 0.6, 2.55),
            row("gla bwd", "plain", {"par_warps": 4, "dstate_bv": 64}, 0.6, 2.48),
            row("gla bwd", "lizard", {"par_warps": 8, "dstate_bv_norm": 128}, 0.9, 3.45),
            row("gla bwd", "lizard", {"par_warps": 4, "dstate_bv_norm": 64}, 0.9, 4.03)]
    chosen = kb.pick_tuned(rows)
    assert chosen["gla_bwd"] == {"dstate_bv": 64, "par_warps": 8, "dstate_bv_norm": 128}
    tuned = chosen["gla_launch"]
    assert (tuned.dstate_bv, tuned.dstate_bv_norm, tuned.par_warps) == (64, 128, 8)
    assert chosen["window_launch"] == kwin.LAUNCH  # (no window rows: the defaults)
    assert kgla.LAUNCH == kgla.GLALaunch()  # the module's defaults are left alone


def test_bench_rejects_bad_arguments(tmp_path):
    from linearize.bench.kernels import run_kernel_bench

    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'fp16'\], got 'fp8'"):
        run_kernel_bench(tmp_path, dtype="fp8")
    with pytest.raises(ValueError, match=r"each shape must be a pair \(B, T\) of positive ints, got \(16, 0\)"):
        run_kernel_bench(tmp_path, shapes=[(16, 0)])
    with pytest.raises(ValueError, match=r"reps must be a positive int, got 0"):
        run_kernel_bench(tmp_path, reps=0)
    with pytest.raises(ValueError, match=r"unknown methods \['nope'\]"):
        run_kernel_bench(tmp_path, methods=["nope"])
    if not CUDA:
        with pytest.raises(ValueError, match=r"needs a CUDA device"):
            run_kernel_bench(tmp_path)


def _bench_result(**extra) -> dict:
    """A bench result of one method at two shapes, as ``run_kernel_bench`` returns it; ``extra`` goes
    into every cell."""
    env = dict(gpu="NVIDIA H200", torch="2.11", cuda="13.0", triton="3.6.0", fla="0.6.0", python="3.12",
               command="bench", date="2026-11-27")
    cell = dict(median_ms=2.5, mean_ms=2.6, runs=100, peak_extra_mib=10.0, **extra)
    shape = lambda B, T: {"B": B, "T": T, "tokens": B * T, "rel_rms_vs_torch": {},  # noqa: E731
                          "cells": {"triton lizard (ours)": {"fwd": dict(cell), "fwd+bwd": dict(cell)}}}
    return dict(env=env, dtype="bf16", heads=32, head_dim=128, feature_dim=128, window=128, sinks=4, reps=10,
                shapes=[shape(16, 2048), shape(4, 8192)])


def test_bench_markdown_host_split():
    """bench kernels' table of GPU time alone and host time per call: there where the cells carry
    them (``host=True``), a refused capture written as such, and no such table otherwise."""
    from linearize.bench.kernels import render_markdown

    md = render_markdown(_bench_result(graph_ms=2.4567, host_us=1834.4))
    assert "GPU time alone (the call replayed as a CUDA graph" in md
    assert "| triton lizard (ours) | fwd+bwd | 2.457 / 1834 | 2.457 / 1834 |" in md
    md = render_markdown(_bench_result(graph_error="RuntimeError: capture refused", host_us=90.0))
    assert "| triton lizard (ours) | fwd | no graph / 90 | no graph / 90 |" in md
    md = render_markdown(_bench_result())
    assert "GPU time alone" not in md and "| triton lizard (ours) | fwd+bwd | 2.500 / 2.600 |" in md


def test_bench_keeps_each_shape_as_it_is_timed(monkeypatch, tmp_path, capsys):
    """run_kernel_bench writes kernels.json and kernels.md after every shape (a run cut short, by a
    time limit say, keeps what it timed, marked partial) and prints a line a cell; a whole run is
    marked complete. Off CUDA, with the timing stood in for."""
    from linearize.bench import kernels as kb

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kb, "_env", lambda command: dict(gpu="stand-in", torch="t", cuda="c", triton="tr", fla="f",
                                                         python="p", command=command, date="d"))
    monkeypatch.setattr(kb, "_shape_inputs", lambda B, T, *a: {"B": B, "T": T})
    monkeypatch.setattr(kb, "_methods", lambda x, window, fla, *launches: {"triton lizard (ours)": (lambda: None, [], None)})
    timed = []

    def cell(fn, reps, grad_to_none=None, host=False):
        timed.append(fn)
        if len(timed) > 2:
            raise KeyboardInterrupt  # the run stopped while timing the second shape
        return dict(median_ms=1.0 + len(timed), mean_ms=1.5, runs=10, peak_extra_mib=1.0)

    monkeypatch.setattr(kb, "_cell", cell)
    with pytest.raises(KeyboardInterrupt):
        kb.run_kernel_bench(tmp_path, shapes=[(1, 64), (2, 64)], methods=["triton lizard (ours)"])
    saved = json.loads((tmp_path / "kernels.json").read_text())
    assert saved["complete"] is False and saved["shapes_planned"] == [[1, 64], [2, 64]]
    assert [(s["B"], s["T"]) for s in saved["shapes"]] == [(1, 64)]
    assert saved["shapes"][0]["cells"]["triton lizard (ours)"]["fwd+bwd"]["median_ms"] == 3.0
    assert "**Partial:** 1 of 2 shapes timed" in (tmp_path / "kernels.md").read_text()
    assert not list(tmp_path.glob(".*.tmp"))
    out = capsys.readouterr().out
    assert "bench kernels: B1 T64 triton lizard (ours) fwd: 2.000 / 1.500 ms (median / mean)" in out
    timed.clear()
    monkeypatch.setattr(kb, "_cell", lambda fn, reps, grad_to_none=None, host=False: dict(
        median_ms=1.0, mean_ms=1.0, runs=10, peak_extra_mib=1.0))
    monkeypatch.setattr(kb, "plot_kernel_bench", lambda result, path: None)
    res = kb.run_kernel_bench(tmp_path, shapes=[(1, 64), (2, 64)], methods=["triton lizard (ours)"])
    saved = json.loads((tmp_path / "kernels.json").read_text())
    assert res["complete"] is True and saved["complete"] is True and len(saved["shapes"]) == 2
    assert "Partial" not in (tmp_path / "kernels.md").read_text()


def test_cli_bench_kernels_host_flag(monkeypatch, tmp_path):
    """``linearize bench kernels --host`` hands host=True to the bench (off by default)."""
    from linearize import cli
    from linearize.bench import kernels as kb

    seen = []

    def fake_bench(out, **kw):
        seen.append(kw)
        (tmp_path / "kernels.md").write_text("table\n")
        return {}

    monkeypatch.setattr(kb, "run_kernel_bench", fake_bench)
    for argv, host in ((["bench", "kernels", "--out", str(tmp_path)], False),
                       (["bench", "kernels", "--out", str(tmp_path), "--host"], True)):
        cli.main(argv)
        assert seen[-1] == {"host": host}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_bench_host_split(tmp_path):
    """run_kernel_bench(host=True) on a small shape: every cell carries the GPU time of its call as a
    CUDA graph and the host's time per call; at B1 T256 the host's work outweighs the GPU's, so the
    graph replay reads less than do_bench's median, and the host time is the larger."""
    from linearize.bench.kernels import run_kernel_bench

    res = run_kernel_bench(tmp_path, shapes=[(1, 256)], reps=5, methods=["triton lizard (ours)"], host=True)
    for p in ("fwd", "fwd+bwd"):
        cell = res["shapes"][0]["cells"]["triton lizard (ours)"][p]
        assert "graph_error" not in cell, cell
        assert 0 < cell["graph_ms"] < cell["median_ms"], cell
        assert cell["host_us"] / 1000 > cell["graph_ms"], cell
    assert "GPU time alone" in (tmp_path / "kernels.md").read_text()


# ----------------------------------------------------------------------------- CPU, Triton interpreter


@pytest.fixture(scope="module")
def interpreter_results():
    """All interpreter cases in one subprocess (one Triton import, one torch start-up)."""
    env = dict(os.environ, TRITON_INTERPRET="1", LINEARIZE_KERNELS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(HERE / "kernel_cases.py")], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("name", list(INTERPRETER_CASES))
def test_interpreter_kernels_match_reference(interpreter_results, name):
    result = interpreter_results[name]
    assert "exception" not in result, result.get("exception")
    dtype = INTERPRETER_CASES[name][2]
    # the hybrid case compares kernels on vs off in fp32: tight
    assert_errors(result["errors"], CASE_TOL.get(name, KTOL[dtype]), name)


# ----------------------------------------------------------------------------- CUDA


# each distinct setting compiles its own kernels (seconds each), so the GPU matrix is kept to the
# settings users run (Lizard: bf16 normalised log-features; fla's: bf16 unnormalised plain) plus fp32
GPU_GLA = {
    "f32 norm log": dict(normalize=True, log_space=True),
    "bf16 norm log": dict(normalize=True, log_space=True),
    "bf16 norm plain": dict(normalize=True, log_space=False),
    "bf16 unnorm plain": dict(normalize=False, log_space=False),
}


@needs_cuda
@pytest.mark.parametrize("T", [77, 1000])
@pytest.mark.parametrize("name", list(GPU_GLA))
def test_gpu_gla_matches_reference(name, T):
    dtype = torch.float32 if name.startswith("f32") else torch.bfloat16
    err = gla_case("cuda", dtype, T=T, DK=128, DV=128, B=2, H=3, chunk=None, **GPU_GLA[name])
    assert_errors(err, KTOL[dtype], f"gla {name} T={T}")


@needs_cuda
@pytest.mark.parametrize("variant, dtype", [("state+segments", torch.float32), ("state+segments", torch.bfloat16),
                                            ("extreme+segments", torch.bfloat16), ("dims 100x72", torch.bfloat16)])
def test_gpu_gla_state_segments_extremes_dims(variant, dtype):
    kw = dict(normalize=True, log_space=True, T=700, DK=128, DV=128, B=1, H=2, chunk=None)
    if "state" in variant:
        kw["state"] = True
    if "segments" in variant:
        kw["seg_chunks"] = 3  # 3 x 64 tokens per segment: 4 segments, the last one partial
    if "extreme" in variant:
        kw["extreme"] = True
    if variant.startswith("dims"):
        kw["DK"], kw["DV"] = (int(x) for x in variant.split()[1].split("x"))
        kw["state"] = True
    err = gla_case("cuda", dtype, **kw)
    assert_errors(err, KTOL[dtype], f"gla {variant} {dtype}")


@needs_cuda
@pytest.mark.parametrize("variant, dtype", [("sinks fused padded", torch.float32),
                                            ("sinks fused padded", torch.bfloat16), ("no sinks", torch.bfloat16),
                                            ("short", torch.bfloat16), ("w=1", torch.bfloat16),
                                            ("sinks fused padded kv 64x32", torch.bfloat16),
                                            ("sinks fused padded kv 32x32", torch.bfloat16)])
def test_gpu_window_matches_reference(variant, dtype):
    kw = dict(T=333, D=128, DV=128, W=128, nsink=4, bm=None)
    if " kv " in variant:  # the dk/dv pass's blocks of other tune candidates (the default is 32 x 64)
        kv_bm, kv_bn = (int(x) for x in variant.split()[-1].split("x"))
        kw["kv"] = dict(kv_bm=kv_bm, kv_bn=kv_bn)
    if variant == "no sinks":
        kw["nsink"] = 0
    if "fused" in variant:
        kw["fuse"] = True
    if "padded" in variant:
        kw["pad"] = 17
    if variant == "short":
        kw["T"] = 50
    if variant == "w=1":
        kw["W"] = 1
    err = window_case("cuda", dtype, **kw)
    assert_errors(err, KTOL[dtype], f"window {variant} {dtype}")


@needs_cuda
@pytest.mark.parametrize("variant, dtype", [("plain", torch.bfloat16), ("plain first", torch.bfloat16),
                                            ("plain state first", torch.float32),
                                            ("log segments padded first", torch.bfloat16),
                                            ("log segments padded", torch.bfloat16),
                                            ("plain state segments first one stream", torch.bfloat16),
                                            ("short first", torch.bfloat16)])
def test_gpu_lizard_one_op_matches_reference(variant, dtype):
    """lizard_attention as one op, in both orders ("first": the window kernel first, the gated
    main pass combining, the other gated passes on a second stream; else the gated forward first),
    the backwards on two streams unless "one stream", at Lizard's widths: 128 features, head dim
    128, window 128, 4 sink logits."""
    kw = dict(T=1000, DK=128, DV=128, D=128, W=128, nsink=4, chunk=None, B=2, H=3,
              log_space="log" in variant, state="state" in variant, overlap="one stream" not in variant,
              first="first" in variant)
    if "segments" in variant:
        kw["seg_chunks"] = 3
    if "padded" in variant:
        kw["pad"] = 17
    if variant.startswith("short"):
        kw["T"] = 50
    err = lizard_case("cuda", dtype, **kw)
    assert_errors(err, KTOL[dtype], f"lizard {variant} {dtype}")


def _needs_hopper_gluon():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fused Gluon forward is for Hopper (sm_90)")
    pytest.importorskip("triton.experimental.gluon")


@needs_cuda
@pytest.mark.parametrize("variant", ["plain", "segments 4", "segments 8", "state", "no sinks", "window 100",
                                     "T=64", "fp16", "model layout", "model layout segments 4"])
def test_gpu_lizard_fused_forward_matches_reference(variant):
    """The fused Gluon forward (kernels/lizard_gluon.py), as lizard_attention runs it in inference
    on Hopper, against the fp64 reference: y, the gated state and the window state, at Lizard's
    widths (128 features, head dim 128, window 128 with 4 sink logits unless the variant says),
    with sequence segments (each one's entering state from the pre-pass and scan), an initial
    state, no sinks, a window of 100, one chunk, fp16, and q_w, k_w, v in a model's layout
    ((B, T, H, D) projections seen as (B, H, T, D): no copy, read in place)."""
    from kernel_cases import lizard_fused_case

    _needs_hopper_gluon()
    kw = dict(T=1024, W=128, nsink=4)
    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    if "segments" in variant:
        kw["segments"] = int(variant.split()[-1])
    kw["bthd"] = variant.startswith("model layout")
    kw.update(state=variant == "state", nsink=0 if variant == "no sinks" else 4,
              W=100 if variant == "window 100" else 128, T=64 if variant == "T=64" else kw["T"])
    err = lizard_fused_case(dtype, **kw)
    assert_errors(err, KTOL[dtype], f"lizard fused {variant}")


@needs_cuda
@pytest.mark.parametrize("variant", ["plain", "norm", "state", "norm segments", "fp16", "model layout", "T=64"])
def test_gpu_gla_fused_forward_matches_reference(variant):
    """GLA's fused Gluon forward (gla_gluon.fwd_fused), as gla_chunk_triton runs it in inference on
    Hopper, against the fp64 reference: o and the final state, unnormalised (fla's inputs) and
    normalised, from an initial state (the state's z passes through where unnormalised), in four
    sequence segments (each one's entering state from the pre-pass and scan), fp16, q, k, v in a
    model's layout, one chunk; and where too few (batch x head) pairs fill the GPU, the Triton
    passes run instead."""
    from kernel_cases import gla_fused_case

    _needs_hopper_gluon()
    kw = dict(T=64 if variant == "T=64" else 1024, normalize=variant.startswith("norm"), state=variant == "state",
              bthd=variant == "model layout")
    if "segments" in variant:
        kw["segments"] = 4
    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    err = gla_fused_case(dtype, **kw)
    assert_errors(err, KTOL[dtype], f"gla fused forward {variant}")
    if variant == "plain":  # one (batch x head) pair over 4096 tokens: the Triton passes' segments
        from linearize.ops.gla import gluon as gla_gluon
        from linearize.ops.gla.triton import gla_chunk_triton

        x = [torch.rand(1, 1, 4096, 128, device="cuda").bfloat16() for _ in range(3)]
        calls = []
        run = gla_gluon.fwd_fused
        gla_gluon.fwd_fused = lambda *a, **k: calls.append(1) or run(*a, **k)
        try:
            with torch.no_grad():
                gla_chunk_triton(*x, -torch.rand(1, 1, 4096, device="cuda"), normalize=False)
        finally:
            gla_gluon.fwd_fused = run
        assert calls == []


def _spy(monkeypatch, module, name: str, key: str) -> list:
    """Calls of ``module.name`` while the test runs (it still runs), each recorded by its keyword ``key``."""
    calls, run = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(k[key]) or run(*a, **k))
    return calls


def _gluon_spy(monkeypatch, module: str, name: str, key: str) -> list:
    """``_spy`` on a launcher of the Gluon module ``linearize.ops.<module>``; skips off Hopper."""
    import importlib

    _needs_hopper_gluon()
    return _spy(monkeypatch, importlib.import_module(f"linearize.ops.{module}"), name, key)


@pytest.fixture
def gluon_chunk_calls(monkeypatch):
    """The calls of the Gluon chunk pass (kernels/gla_gluon.py) while the test runs."""
    return _gluon_spy(monkeypatch, "gla.gluon", "bwd_chunks", "dv_add")


@needs_cuda
@pytest.mark.parametrize("variant", ["unnorm", "norm", "norm fp16", "norm state segments", "model layout",
                                     "model layout norm", "T=64", "extreme gates"])
def test_gpu_gla_gluon_chunk_pass_matches_reference(variant, gluon_chunk_calls):
    """The backward's chunk pass as the Gluon kernel (what gla_chunk_triton runs on Hopper where
    its scope holds) against the fp64 reference: every gradient, unnormalised (fla's inputs) and
    normalised, bf16 and fp16, from an initial state with sequence segments, q, k, v in a model's
    layout, one chunk, gates near 0 and 1."""
    dtype = torch.float16 if "fp16" in variant else torch.bfloat16
    kw = dict(normalize="norm" in variant.split(), log_space=False, T=64 if variant == "T=64" else 1024,
              DK=128, DV=128, B=2, H=3, chunk=None, bthd=variant.startswith("model layout"),
              gla_cfg=dict(gluon_fused_bwd=False))  # the two-pass backward (the fused one is the default)
    if "state" in variant:
        kw.update(state=True, seg_chunks=5)
    if variant == "extreme gates":
        kw.update(extreme=True, normalize=True)
    err = gla_case("cuda", dtype, **kw)
    assert gluon_chunk_calls == [False], gluon_chunk_calls
    assert_errors(err, KTOL[dtype], f"gla gluon chunk pass {variant}")


@pytest.fixture
def gluon_fused_calls(monkeypatch):
    """The calls of the fused Gluon backward (kernels/gla_gluon.py, bwd_fused) while the test runs,
    by their segment length in chunks."""
    return _gluon_spy(monkeypatch, "gla.gluon", "bwd_fused", "seg_chunks")


@needs_cuda
@pytest.mark.parametrize("variant", ["unnorm", "norm", "norm fp16", "norm state segments", "unnorm segments",
                                     "model layout norm", "T=64", "T=128", "extreme gates"])
def test_gpu_gla_gluon_fused_backward_matches_reference(variant, gluon_fused_calls):
    """The whole gated backward as ONE Gluon kernel (GLALaunch.gluon_fused_bwd: the reverse
    state pass and the chunk pass fused, dS in registers) against the fp64 reference: every
    gradient, unnormalised and normalised, fp16, from an initial state with sequence segments (the
    last one shorter: 16 chunks in segments of 5), q, k, v in a model's layout, one and two chunks
    (the prefetch's edges), gates near 0 and 1."""
    dtype = torch.float16 if "fp16" in variant else torch.bfloat16
    T = {"T=64": 64, "T=128": 128}.get(variant, 1024)
    kw = dict(normalize="norm" in variant.split(), log_space=False, T=T, DK=128, DV=128, B=2, H=3, chunk=None,
              bthd=variant.startswith("model layout"), gla_cfg=dict(gluon_fused_bwd=True))
    if "segments" in variant:
        kw.update(state="state" in variant, seg_chunks=5)
    if variant == "extreme gates":
        kw.update(extreme=True, normalize=True)
    err = gla_case("cuda", dtype, **kw)
    assert_errors(err, KTOL[dtype], f"gla gluon fused backward {variant}")
    # without fixed segments, the host splits the sequence by its rule for this kernel (few programs
    # here: 2 x 3 heads, so the 16 chunks of T=1024 go in two segments of 8 on a 132-SM H100/H200)
    from linearize.ops.gla import triton as kgla
    from linearize.ops.backend.dispatch import device_sms

    cuda = torch.empty(0, device="cuda")
    auto = kgla._fused_segments(T, 64, 2 * 3, device_sms(cuda), kgla.GLALaunch())[1] // 64
    assert gluon_fused_calls == [5 if "segments" in variant else auto], gluon_fused_calls


@needs_cuda
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("T", [1024, 960, 64])
def test_gpu_gla_gluon_fused_backward_paired_states(normalize, T):
    """The fused backward from the states of even chunks only (``paired``: each odd chunk's state
    formed from the even one's before it and that chunk's keys and values) gives the gradients it
    gives from every chunk's state, within bf16 rounding: an even and an odd number of chunks (the
    walk then starts on an odd chunk or an even one), and one chunk."""
    from linearize.ops.gla import triton as kgla
    from linearize.ops.gla import gluon as gla_gluon

    _needs_hopper_gluon()
    B, H, D = 2, 3, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k = (torch.softmax(torch.randn(B, H, T, D, generator=g, device="cuda"), -1).bfloat16() for _ in range(2))
    v, do = (torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16() for _ in range(2))
    log_g = torch.nn.functional.logsigmoid(torch.randn(B, H, T, generator=g, device="cuda") + 3)
    NC = T // 64
    cfg = kgla.GLALaunch(gluon_fused_bwd=True, seg_chunks=NC)
    o, den, _, _, segs, sc, zc = kgla._fwd(q, k, v, log_g, None, None, normalize, False, 1e-6, cfg, True)
    keep = list(range(0, NC, 2)) + [NC]  # even chunks' states and the last one
    sc_paired = sc[:, keep].contiguous()
    assert sc_paired.shape[1] == gla_gluon.state_slots(NC, True)
    grads = []
    for paired, sc_x in ((False, sc), (True, sc_paired)):
        p = kgla.bwd_states(q, k, v, log_g, o, den, sc_x, zc, do, None, None, False, normalize, False, 1e-6, segs,
                            cfg, paired=paired)
        assert p.fused and p.paired == paired and p.seg_chunks == NC
        grads.append(kgla.bwd_chunks(q, k, v, log_g, p, normalize, False, 1e-6, cfg)[:4])
    for name, a, b in zip(("dq", "dk", "dv", "dlog_g"), *grads):
        assert torch.isfinite(b).all(), name
        assert rel_rms(b.float(), a.float()) < 1e-2, (name, rel_rms(b.float(), a.float()))
    if NC > 1:  # every chunk's states are not what a paired backward takes
        with pytest.raises(ValueError, match="states"):
            gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None,
                                *(torch.empty_like(x) for x in (q, k, v)), torch.empty(B * H, T, device="cuda"), None,
                                None, seg_chunks=NC, normalize=normalize, eps=1e-6, dv_add=False, paired=True)


@needs_cuda
@pytest.mark.parametrize("variant", ["plain", "state", "segments", "fp16", "walk", "walk segments",
                                     "walk one segment", "walk one segment state fp16", "walk one segment og kept",
                                     "walk one segment ow from scores", "walk segments ow from scores",
                                     "walk one segment paired states"])
def test_gpu_lizard_one_op_gluon_fused_backward_matches_reference(variant, gluon_fused_calls, gluon_window_calls,
                                                                  monkeypatch):
    """Lizard's one op in training on Hopper with the gated backward as the one fused Gluon kernel
    (adding its dv into the window's) after the Gluon window backward: y, both states and every
    gradient against the fp64 reference; also from an initial state, with the backward's own
    sequence segments (one (batch x head) pair: four segments), fp16, and with the window's
    backward as the walking kernel too. With the walking kernel and the gated backward in one
    segment the forward keeps no o_g (the gated backward takes dy . o_g from y and the window's
    dy . o_w: KernelSettings.og_from_y), unless told not to ("og kept"); told to, no o_w
    either (the walking kernel forms dy . o_w from its scores: ow_from_scores), also in segments.
    Told to ("paired states"), with the gated backward in one segment, the forward keeps the gated
    state of even chunks only (KernelSettings.paired_states). The backward reads the gates'
    sums within chunks that the fused forward kept (``bl``)."""
    from linearize.ops.gla import gluon as gla_gluon
    from linearize.ops.window_attn import triton as kwin

    sides = _spy(monkeypatch, gla_gluon, "bwd_fused", "side_dot")
    paired = _spy(monkeypatch, gla_gluon, "bwd_fused", "paired")
    bls = _spy(monkeypatch, gla_gluon, "bwd_fused", "bl")
    from linearize.ops.window_attn import gluon as window_gluon

    walk_kw, wbwd = [], window_gluon.bwd
    monkeypatch.setattr(window_gluon, "bwd", lambda *a, **k: (walk_kw.append(k) if k.get("walk") else None,
                                                              wbwd(*a, **k))[1])
    kw = dict(T=1024, DK=128, DV=128, D=128, W=128, nsink=4, chunk=None, B=2, H=3, state="state" in variant,
              gla_cfg=dict(gluon_fused_bwd=True), lizard_cfg={})
    if "walk segments" in variant or variant == "segments":
        kw.update(T=2048, B=1, H=2)
    if "one segment" in variant:  # (B x H = 6 pairs would walk two segments each)
        kw["seg_chunks"] = 16
    if variant.endswith("og kept"):
        kw["lizard_cfg"] = dict(og_from_y=False)
    if variant.endswith("ow from scores"):
        kw["lizard_cfg"] = dict(ow_from_scores=True)
    if variant.endswith("paired states"):
        kw["lizard_cfg"] = dict(paired_states=True)
    dtype = torch.float16 if "fp16" in variant else torch.bfloat16
    kw["lizard_cfg"]["window"] = kwin.WindowLaunch(gluon_bwd_walk=variant.startswith("walk"))
    err = lizard_case("cuda", dtype, **kw)
    assert len(gluon_fused_calls) == 1 and gluon_window_calls == [128], (gluon_fused_calls, gluon_window_calls)
    og_from_y = "one segment" in variant and not variant.endswith("og kept")
    assert [x is not None for x in sides] == [og_from_y], variant
    assert paired == [variant.endswith("paired states")], (variant, paired)
    assert len(bls) == 1 and bls[0] is not None  # the gates' sums the fused forward read, not formed again
    walk_o = [k["o"] is not None for k in walk_kw]
    assert walk_o == ([not variant.endswith("ow from scores")] if variant.startswith("walk") else []), (variant, walk_o)
    if variant == "segments":
        assert gluon_fused_calls[0] < 32, gluon_fused_calls
    assert_errors(err, KTOL[dtype], f"lizard gluon fused backward {variant}")


@needs_cuda
@pytest.mark.parametrize("variant", ["plain", "state", "segments 4", "no sinks", "window 100", "triton forward",
                                     "fp16"])
def test_gpu_lizard_one_op_gluon_training_matches_reference(variant, gluon_chunk_calls, gluon_window_calls,
                                                            monkeypatch):
    """Lizard's one op in training on Hopper, every kernel in Gluon: the fused forward storing what
    the backward reads, the window's backward, and the gated chunk pass adding its dv into the
    window's (T a multiple of 64, Lizard's widths); y, both states and every gradient against the
    fp64 reference. Also from an initial state, with the forward in sequence segments, without
    sinks, a window of 100, fp16, and with the Triton forward passes before the Gluon backward."""
    from linearize.ops.lizard_attn import gluon as lizard_gluon
    from linearize.ops.window_attn import triton as kwin

    calls = _spy(monkeypatch, lizard_gluon, "lizard_fwd_fused", "store")
    W = 100 if variant == "window 100" else 128
    kw = dict(T=1024, DK=128, DV=128, D=128, W=W, nsink=0 if variant == "no sinks" else 4, chunk=None, B=2, H=3,
              state=variant == "state")
    if variant.startswith("segments"):
        kw.update(T=2048, B=1, H=2, lizard_cfg=dict(fused_segments=int(variant.split()[1])))
    if variant == "triton forward":
        kw["lizard_cfg"] = dict(fused_train=False)
    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    # the gated chunk pass and the window kernel of one program per chunk, not the defaults (the
    # fused gated backward and the walking window backward: test_gpu_lizard_one_op_gluon_fused_backward_*)
    kw["gla_cfg"] = dict(gluon_fused_bwd=False)
    kw["lizard_cfg"] = {**kw.get("lizard_cfg", {}), "window": kwin.WindowLaunch(gluon_bwd_walk=False)}
    err = lizard_case("cuda", dtype, **kw)
    assert calls == ([] if variant == "triton forward" else [True]), calls
    assert gluon_chunk_calls == [True] and gluon_window_calls == [W], (gluon_chunk_calls, gluon_window_calls)
    assert_errors(err, KTOL[dtype], f"lizard gluon training {variant}")


@pytest.fixture
def gluon_window_calls(monkeypatch):
    """The calls of the Gluon window backward (kernels/window_gluon.py) while the test runs."""
    return _gluon_spy(monkeypatch, "window_attn.gluon", "bwd", "window")


@needs_cuda
@pytest.mark.parametrize("variant", ["sinks fused", "no sinks", "sinks", "window 100", "window 129",
                                     "window 1 sinks", "T=64", "fp16 sinks fused", "model layout sinks fused"])
def test_gpu_window_gluon_backward_matches_reference(variant, gluon_window_calls):
    """The window's backward as the Gluon kernel (what window_attn_triton and Lizard's op run on
    Hopper where its scope holds) against the fp64 reference: dq, dk, dv, d sinks, and with the
    combine fused d y_g and d alpha; windows of 1 to 129, one chunk, fp16, a model's layout. (A
    window of 1 takes sinks: without them each row's one probability is exactly 1, dq and dk are
    exactly 0, and any rounding of dy . v against D is an infinite relative error: that case
    failed once on the H200 with differences of 1e-4.)"""
    dtype = torch.float16 if variant.startswith("fp16") else torch.bfloat16
    W = int(variant.split()[1]) if variant.startswith("window") else 128
    kw = dict(T=64 if variant == "T=64" else 1024, D=128, DV=128, W=W, nsink=4 if "sinks" in variant else 0,
              fuse="fused" in variant, bm=None, bthd=variant.startswith("model layout"),
              kv=dict(gluon_bwd_walk=False))  # the kernel of one program per chunk (walking is the default)
    err = window_case("cuda", dtype, **kw)
    assert gluon_window_calls == [W], gluon_window_calls
    assert_errors(err, KTOL[dtype], f"window gluon backward {variant}")


@needs_cuda
@pytest.mark.parametrize("variant", ["sinks fused", "no sinks", "window 100", "window 1 sinks", "T=64", "T=128",
                                     "T=192", "T=1216 sinks", "T=4096 fp16 sinks", "model layout sinks fused",
                                     "pre-pass sinks fused", "pre-pass T=1216 sinks", "pre-pass T=128",
                                     "scores sinks fused", "scores T=64", "scores T=128", "scores T=192",
                                     "scores T=1216 sinks", "scores T=4096 fp16 sinks", "scores window 1 sinks",
                                     "scores window 100", "scores model layout sinks fused"])
def test_gpu_window_gluon_walk_backward_matches_reference(variant, monkeypatch):
    """The window's backward as the walking Gluon kernel (WindowLaunch.gluon_bwd_walk: one
    program per segment of chunks, two rings of tile slots) against the fp64 reference: dq, dk,
    dv, d sinks, with the combine fused d y_g and d alpha; one, two and three chunks (the rings'
    edges), two segments of 10 and 9 chunks, eight segments in fp16, windows of 1 and 100, a
    model's layout. D formed in the kernel (the default), "scores": in the kernel from its scores
    (o not given: what Lizard's op runs, KernelSettings.ow_from_scores), or, "pre-pass", by the
    delta pass."""
    calls = _gluon_spy(monkeypatch, "window_attn.gluon", "bwd", "walk")
    own = not variant.startswith("pre-pass")
    scores = variant.startswith("scores")
    variant = variant.removeprefix("pre-pass ").removeprefix("scores ")
    dtype = torch.float16 if "fp16" in variant else torch.bfloat16
    W = int(variant.split()[1]) if variant.startswith("window") else 128
    T = int(variant.split()[0][2:]) if variant.startswith("T=") else 1024
    kw = dict(T=T, D=128, DV=128, W=W, nsink=4 if "sinks" in variant or variant.startswith("window 1 ") else 0,
              fuse="fused" in variant, bm=None, bthd=variant.startswith("model layout"),
              kv=dict(gluon_bwd_walk=True, gluon_walk_delta=own))
    from linearize.ops.window_attn import gluon as window_gluon

    bwd, seen = window_gluon.bwd, []

    def spy(*a, **k):
        seen.append(k.get("o") is not None)
        if scores:  # the window op keeps o: the kernel is told to form D from its scores instead
            k = {**k, "o": None, "scores_delta": k.get("o") is not None}
        return bwd(*a, **k)

    monkeypatch.setattr(window_gluon, "bwd", spy)
    err = window_case("cuda", dtype, **kw)
    assert calls == [True] and seen == [own], (calls, seen)
    assert_errors(err, KTOL[dtype], f"window gluon walk backward {variant} (D {'own' if own else 'pre-pass'})")


def _lizard_gpu_inputs(B: int, H: int, T: int, D: int):
    """Lizard's inputs on CUDA in bf16 (softmax features, gates near 1), and the generator that made them."""
    g = torch.Generator(device="cuda").manual_seed(0)
    fq, fk = (torch.softmax(torch.randn(B, H, T, D, generator=g, device="cuda"), -1).bfloat16() for _ in range(2))
    v, qw, kw = (torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16() for _ in range(3))
    lg = torch.nn.functional.logsigmoid(torch.randn(B, H, T, generator=g, device="cuda") + 4)
    return fq, fk, v, qw, kw, lg, g


@needs_cuda
def test_gpu_lizard_fused_forward_dispatch(monkeypatch):
    """On Hopper the fused kernel runs the forward in inference (store=False) and, within the one
    autograd op, in training (store=True: the backward's intermediates); each setting turns its
    use off, and the Triton forward agrees."""
    from linearize.ops.lizard_attn import fused as kliz
    from linearize.ops.lizard_attn import gluon as lizard_gluon

    _needs_hopper_gluon()
    B, H, T, D = 1, 2, 512, 128
    fq, fk, v, qw, kw, lg, g = _lizard_gpu_inputs(B, H, T, D)
    alpha = torch.ones(H, device="cuda")
    calls = _spy(monkeypatch, lizard_gluon, "lizard_fwd_fused", "store")
    with torch.no_grad():
        y_fused = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha)[0]
        assert calls == [False]
        y_passes = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha, plan=kliz.LizardPlan(fused_fwd=False))[0]
        assert calls == [False]
    assert rel_rms(y_fused, y_passes) < 1e-2
    v.requires_grad_()
    y_train = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha)[0]
    assert calls == [False, True] and y_train.requires_grad
    y_train2 = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha, plan=kliz.LizardPlan(fused_train=False))[0]
    assert calls == [False, True] and y_train2.requires_grad
    assert rel_rms(y_train.detach(), y_train2.detach()) < 1e-2


@needs_cuda
@pytest.mark.parametrize("fused, B, H, T", [(True, 2, 3, 1024), (True, 4, 17, 256), (False, 2, 3, 1024)])
def test_gpu_lizard_without_state(fused, B, H, T, monkeypatch):
    """lizard_attention(return_state=False), as a training step or attention transfer calls it:
    (y, None, None), y and every gradient bit for bit those of the call that returns the states. On
    the fused kernel (``fused``) the inference forward is asked for no final state, nor is the
    training forward where the gated backward walks one segment (4 x 17 pairs fill half of an H100's
    multiprocessors): its backward then reads no state leaving the last chunk, which the kernel
    skips (the allocator's memory is NaN first, so a read of it would show); with segments (2 x 3)
    the training forward keeps it. On the Triton passes (fused off) the same answers."""
    from linearize.ops.gla import triton as kgla
    from linearize.ops.lizard_attn import fused as kliz
    from linearize.ops.lizard_attn import gluon as lizard_gluon

    if fused:
        _needs_hopper_gluon()
    D = 128
    fq, fk, v, qw, kw, lg, g = _lizard_gpu_inputs(B, H, T, D)
    alpha, sinks = torch.rand(H, generator=g, device="cuda") + 0.5, torch.randn(H, 4, generator=g, device="cuda")
    cfg = dict(plan=kliz.LizardPlan() if fused else kliz.LizardPlan(fused_fwd=False, fused_train=False))
    calls = _spy(monkeypatch, lizard_gluon, "lizard_fwd_fused", "final_state")
    with torch.no_grad():
        y_a, s_a, w_a = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha, sink_logits=sinks, **cfg)
        y_b, s_b, w_b = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha, sink_logits=sinks, **cfg,
                                              return_state=False)
    assert s_a is not None and w_a is not None and (s_b, w_b) == (None, None)
    assert torch.equal(y_a, y_b)
    assert calls == ([True, False] if fused else [])
    one_segment = kgla.fused_bwd_segments(fq, fk, v, False, kgla.LAUNCH) == 1
    leaves = [x.detach().requires_grad_() for x in (fq, fk, v, lg, qw, kw, alpha, sinks)]
    dy = torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16()
    out = []
    for keep in (True, False):
        torch.cuda.synchronize()
        junk = torch.full((1 << 28,), float("nan"), device="cuda")  # 1 GiB of NaN, handed back to the allocator
        del junk
        y, s, w = kliz.lizard_attention(*leaves[:7], sink_logits=leaves[7], **cfg, return_state=keep)
        assert (s is None) == (w is None) == (not keep)
        y.backward(dy)
        out.append([y.detach()] + [x.grad for x in leaves])
        for x in leaves:
            x.grad = None
    for a, b in zip(*out):
        assert torch.equal(a, b)
    assert calls == ([True, False, True, not one_segment] if fused else [])


@needs_cuda
@pytest.mark.parametrize("nseg", [1, 4])
def test_gpu_lizard_fused_training_forward(nseg, monkeypatch):
    """In training the fused forward writes, beside the state entering every chunk, the one leaving
    the last (slot NC of sc and zc: S_T rounded to sc's dtype, z_T), also in segments (the last
    one's program writes it), and the window's decode state (the last window - 1 keys and values
    in fp32), which lizard_attention hands it buffers for; with paired_states, the same states of
    even chunks and the last one only. The allocator's memory is filled with NaN first, so a slot
    left unwritten shows."""
    from linearize.ops.lizard_attn import fused as kliz
    from linearize.ops.lizard_attn import gluon as lizard_gluon

    _needs_hopper_gluon()
    B, H, T, D = 2, 3, 1024, 128
    fq, fk, v, qw, kw, lg, g = _lizard_gpu_inputs(B, H, T, D)
    alpha, sinks = torch.ones(H, device="cuda"), torch.randn(H, 4, generator=g, device="cuda")
    from linearize.ops.backend import KernelSettings

    plan = kliz.LizardPlan(fused_segments=nseg)
    cfg = kliz._run_for(KernelSettings(), plan)
    torch.cuda.synchronize()
    junk = torch.full((1 << 28,), float("nan"), device="cuda")  # 1 GiB of NaN, handed back to the allocator
    del junk
    w_state = tuple(torch.empty(B, H, 127, D, device="cuda") for _ in range(2))
    y, S_T, z_T, inter, (segs, _) = kliz._fused_forward(fq, fk, v, lg, qw, kw, alpha, sinks, None, None, None, True,
                                                       False, 128, D ** -0.5, 1e-6, cfg, store=True,
                                                       window_state=w_state)
    torch.cuda.synchronize()
    NC = T // 64
    assert segs == nseg
    assert not any(inter[n].isnan().any() for n in ("sc", "zc", "den", "lse"))
    assert torch.equal(inter["sc"][:, NC], S_T.view(B * H, D, D).bfloat16())
    assert torch.equal(inter["zc"][:, NC], z_T.view(B * H, D))
    assert torch.equal(w_state[0], kw[:, :, T - 127:].float()) and torch.equal(w_state[1], v[:, :, T - 127:].float())
    # paired: the same states, of even chunks and the last only
    _, _, _, inter2, _ = kliz._fused_forward(fq, fk, v, lg, qw, kw, alpha, sinks, None, None, None, True, False, 128,
                                             D ** -0.5, 1e-6, cfg, store=True, paired_states=True)
    torch.cuda.synchronize()
    assert inter2["sc"].shape[1] == NC // 2 + 1 and not inter2["sc"].isnan().any()
    assert torch.equal(inter2["sc"], inter["sc"][:, 0::2]) and torch.equal(inter2["zc"], inter["zc"])
    # lizard_attention in training: the kernel writes the window's state it returns
    seen = _spy(monkeypatch, lizard_gluon, "lizard_fwd_fused", "window_state")
    v.requires_grad_()
    _, _, w = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha, sink_logits=sinks, plan=plan)
    assert len(seen) == 1 and seen[0] is not None and w.k.data_ptr() == seen[0][0].data_ptr()
    assert torch.equal(w.k, kw[:, :, T - 127:].float()) and torch.equal(w.v.detach(), v[:, :, T - 127:].float())
    assert w.v.requires_grad and torch.equal(w.pos.cpu(), torch.full((B,), T))


@needs_cuda
@pytest.mark.parametrize("B, H, T, one_segment", [(2, 33, 256, True), (1, 2, 2048, False)])
def test_gpu_lizard_backward_side_stream_only_for_reverse_passes(B, H, T, one_segment, monkeypatch):
    """The backward forks its side stream (KernelSettings.side_streams) only where the gated
    backward has reverse passes to run beside the window's: not where the fused gated kernel walks
    one segment (66 (batch x head) programs), where the fork and join cost host time alone; yes
    where it walks segments (2 programs: a segment pre-pass and scan). Gradients flow either way."""
    from linearize.ops.lizard_attn import fused as kliz

    _needs_hopper_gluon()
    fq, fk, v, qw, kw, lg, g = _lizard_gpu_inputs(B, H, T, 128)
    leaves = [x.requires_grad_() for x in (fq, fk, v, lg, qw, kw)]
    alpha = torch.ones(H, device="cuda", requires_grad=True)
    wanted, run = [], kliz._side_stream

    def spy(x, w, priority, name="side"):
        if name == "side":  # (the reverse passes' stream; streams of other names are not this test's)
            wanted.append(w)
        return run(x, w, priority, name)

    monkeypatch.setattr(kliz, "_side_stream", spy)
    y = kliz.lizard_attention(*leaves, alpha, sink_logits=torch.zeros(H, 4, device="cuda"))[0]
    forward_calls = len(wanted)
    y.float().sum().backward()
    torch.cuda.synchronize()
    assert wanted[forward_calls:] == [not one_segment], wanted
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves + [alpha])


@needs_cuda
@pytest.mark.parametrize("window_first", [False, True])
def test_gpu_lizard_one_op_streams_raise_no_warning(window_first, monkeypatch):
    """The second and third streams stay out of autograd's way: no warning of a gradient
    accumulator on another stream (which would also sync every backward), training or not; and a
    second backward through one forward says why it cannot run."""
    import warnings

    from linearize.ops.lizard_attn import fused as kliz
    from linearize.ops.lizard_attn.fused import LizardPlan, lizard_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, T, D = 1, 2, 300, 64
    fq, fk = (torch.softmax(torch.randn(B, H, T, D, generator=g, device="cuda"), -1).bfloat16() for _ in range(2))
    v, qw, kw = (torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16() for _ in range(3))
    lg = torch.nn.functional.logsigmoid(torch.randn(B, H, T, generator=g, device="cuda") + 4)
    for x in (fq, fk, v, qw, kw, lg):
        x.requires_grad_()
    alpha = torch.ones(H, device="cuda", requires_grad=True)
    plan = LizardPlan(window_first=window_first)
    calls = []
    apply = kliz._LizardFunction.apply
    monkeypatch.setattr(kliz._LizardFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            y, _, w_state = lizard_attention(fq, fk, v, lg, qw, kw, alpha, window=64, plan=plan)
            y.float().sum().backward()
        with torch.no_grad():
            y2, _, w_state2 = lizard_attention(fq, fk, v, lg, qw, kw, alpha, window=64, plan=plan)
        torch.cuda.synchronize()
    assert len(calls) == 3, "lizard_attention did not run as one op"
    assert torch.equal(y.detach(), y2) and torch.equal(w_state.k.detach(), w_state2.k)
    y, _, _ = lizard_attention(fq, fk, v, lg, qw, kw, alpha, window=64, plan=plan)
    y.float().sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward can run once per forward"):
        y.float().sum().backward()


@needs_cuda
@pytest.mark.parametrize("padded, dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_gpu_hybrid_layer_kernels_match_torch_path(padded, dtype):
    # kernels on vs off in the same dtype: the torch path is the reference
    err = hybrid_case("cuda", dtype, padded=padded, T=300)
    assert_errors(err, KTOL[dtype], f"hybrid padded={padded} {dtype}")


@needs_cuda
def test_gpu_dispatch():
    from linearize.ops import gla as gla_op
    from linearize.ops import window_attn as window_op

    q = torch.rand(1, 2, 64, 16, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 64, 16, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(1, 2, 64, device="cuda")
    assert gla_op.gla_applies(q, q, v, g)
    assert not gla_op.gla_applies(q, q, v, -torch.rand(1, 2, 64, 16, device="cuda"))  # per-channel gates
    assert not gla_op.gla_applies(q.double(), q.double(), v.double(), g)
    assert window_op.window_applies(q, q, v, sink_logits=torch.zeros(2, 4, device="cuda"))
    assert not window_op.window_applies(q, q, v, terraced=True)
    assert not window_op.window_applies(q, q, v, softcap=30.0)
    os.environ["LINEARIZE_KERNELS"] = "0"
    try:
        assert not gla_op.gla_applies(q, q, v, g)
        assert window_op.window_attn_sum(q, q, v, v, torch.ones(2, device="cuda"), window=8) is None
    finally:
        del os.environ["LINEARIZE_KERNELS"]


@needs_cuda
def test_gpu_long_bf16_extreme_gates_stay_finite():
    """64K bf16 tokens, Hedgehog-like log-features, gates in runs from log -20 to exactly 0: finite
    outputs, states and gradients, close to the torch chunk form (fp32) on the same inputs."""
    from linearize.ops.gla.triton import gla_chunk_triton
    from linearize.ops.window_attn.triton import window_attn_triton
    from linearize.ops.gla.chunk import gla_chunk

    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, d = 65536, 2, 64
    lf = lambda: torch.log_softmax(torch.randn(1, H, T, d, generator=g, device="cuda") * 2, -1)  # noqa: E731
    q, k = lf().bfloat16(), lf().bfloat16()
    v = torch.randn(1, H, T, d, generator=g, device="cuda").bfloat16()
    u = torch.rand(1, H, T, generator=g, device="cuda")
    kind = (torch.arange(T, device="cuda") // 2048) % 4
    log_g = torch.where(kind == 0, -20 + 2 * u,
                        torch.where(kind == 1, -1e-4 * u, torch.where(kind == 2, 0 * u, -20 * u)))
    args = [x.clone().requires_grad_() for x in (q, k, v, log_g)]
    o, st = gla_chunk_triton(*args, log_space_features=True)
    (o.float().square().sum() + st.S.sum() + st.z.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(st.S).all() and torch.isfinite(st.z).all()
    for name, x in zip(("q", "k", "v", "log_g"), args):
        assert torch.isfinite(x.grad).all(), f"{name}.grad is not finite"
    with torch.no_grad():
        ref, ref_st = gla_chunk(q.float(), k.float(), v.float(), log_g, log_space_features=True)
    assert rel_rms(o, ref) <= KTOL[torch.bfloat16]
    assert rel_rms(st.S, ref_st.S) <= 1e-2
    w, _ = window_attn_triton(q, k, v, window=128, sink_logits=torch.zeros(H, 4, device="cuda"))
    assert torch.isfinite(w).all()


# ----------------------------------------------------------------------------- fused forward: host side (CPU)


@pytest.mark.parametrize("layout", ["contiguous", "model", "other"])
def test_fused_forward_views_map_every_element(layout):
    """gla_gluon.view2d: the 2-D view a TMA descriptor reads, with (sb, sh, sc) such that
    element (b, h, t, d) sits at row b*sb + h*sh + t, column h*sc + d; None for other layouts."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.gla.gluon import view2d

    B, H, T, D = 2, 3, 5, 4
    base = torch.arange(B * H * T * D, dtype=torch.float32)
    if layout == "contiguous":
        x = base.view(B, H, T, D)
    elif layout == "model":
        x = base.view(B, T, H, D).transpose(1, 2)
    else:
        x = base.view(B, H, D, T).transpose(2, 3)
    got = view2d(x)
    if layout == "other":
        assert got is None
        return
    x2, (sb, sh, sc) = got
    assert x2.data_ptr() == x.data_ptr()
    for b in range(B):
        for h in range(H):
            rows = x2[b * sb + h * sh: b * sb + h * sh + T, h * sc: h * sc + D]
            assert torch.equal(rows, x[b, h])


class _LaunchRecorder:
    """Stands in for a Gluon kernel on CPU: ``kernel[grid](*args, **constexprs)`` records the call,
    so that a launcher's host side (shapes, views, descriptors, the arguments it computes) runs
    without a GPU."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


@pytest.mark.parametrize("bthd", [False, True])
def test_gla_fused_forward_launch_host_side(bthd, monkeypatch):
    """gla_gluon.fwd_fused up to its launch, on CPU: the grid (segments x batch x heads), b (the
    gates' cumulative sum within each chunk), the layout bits, the descriptors over q, k, v and a
    new contiguous o, the initial state's pointers where given."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.gla import gluon as gla_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(gla_gluon, "_gla_fwd_fused_kernel", rec)
    B, H, T, D = 2, 3, 256, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(3))
    if bthd:
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    log_g = -torch.rand(B, H, T, generator=g)
    S_in, z_in = torch.randn(B * H, 2, D, D), torch.rand(B * H, 2, D)
    o, S_T, z_T = gla_gluon.fwd_fused(q, k, v, log_g, normalize=bthd, eps=1e-6, nseg=2, S_in=S_in, z_in=z_in)
    (grid, args, kw), = rec.calls
    assert grid == (2, B * H) and kw["MODEL_LAYOUT"] == (0b111 if bthd else 0) and kw["NORM"] == bthd
    assert kw["HAS_INIT"] and args[5] is S_in and args[6] is z_in and args[7] is S_T and args[8] is z_T
    assert args[9:13] == (T, H, 128, 2)  # T, H, tokens per segment, segments
    for desc, x in zip(args[:4], (q, k, v, o)):
        assert desc.base.data_ptr() == x.data_ptr() and list(desc.block_shape) == [64, 128]
    torch.testing.assert_close(args[4].view(B, H, T // 64, 64), log_g.view(B, H, T // 64, 64).cumsum(-1))
    assert o.shape == v.shape and o.is_contiguous() and S_T.shape == (B, H, D, D) and z_T.shape == (B, H, D)


@pytest.mark.parametrize("bthd", [False, True])
def test_fused_forward_launch_host_side(bthd, monkeypatch):
    """lizard_gluon.lizard_fwd_fused up to its launch, on CPU: the grid, b (the gates' cumulative
    sum within each chunk), the layout bits, the descriptors' views, y into a caller's buffer
    (``out``; one of another shape refused), and the window's state into the caller's buffers
    (WSTATE; a buffer of another dtype refused). (A name the launcher lost
    in a cleanup, 1bac744, went unnoticed until a GPU ran it: this runs every line of it in CI.)"""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.lizard_attn import gluon as lizard_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(lizard_gluon, "_lizard_fwd_kernel", rec)
    B, H, T, D = 2, 3, 256, 128
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(5)]
    if bthd:  # q_w, k_w, v as a model's (B, T, H, D) projections
        xs[:3] = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in xs[:3]]
    log_g = -torch.rand(B, H, T, generator=g)
    fq, fk, v, qw, kw = xs[3], xs[4], xs[2], xs[0], xs[1]
    y, S_T, z_T, inter = lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), torch.zeros(H, 4),
                                                       window=128, scale=0.1, eps=1e-6, nseg=2, store=bthd)
    (grid, args, kw_), = rec.calls
    assert grid == (2, B * H) and kw_["MODEL_LAYOUT"] == (0b111 if bthd else 0) and kw_["TRAIN"] == bthd
    if bthd:  # training: the backward's intermediates, their shapes as the Triton forward's
        NC = T // 64
        assert {n: tuple(t.shape) for n, t in inter.items()} == dict(
            o_g=(B, H, T, D), o_w=(B, H, T, D), lse=(B * H, T), den=(B * H, T), sc=(B * H, NC + 1, D, D),
            zc=(B * H, NC + 1, D), bl=(B * H * T,))
        assert inter["bl"] is args[9]  # the gates' sums the kernel read, kept for the backward
        # (the state leaving the last chunk, slot NC, is the kernel's to write: test_gpu_lizard_fused_training_forward)
        assert list(args[6].shape) == [B * H * (NC + 1) * D, D] and list(args[6].block_shape) == [D, D]
        assert kw_["PAIRED"] is False
        # paired: the states of even chunks and the last one
        inter = lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), torch.zeros(H, 4), window=128,
                                              scale=0.1, eps=1e-6, nseg=2, store=True, paired_states=True)[3]
        assert inter["sc"].shape == (B * H, NC // 2 + 1, D, D) and inter["zc"].shape == (B * H, NC + 1, D)
        assert rec.calls[-1][2]["PAIRED"] is True and list(rec.calls[-1][1][6].shape) == [B * H * 3 * D, D]
        rec.calls.pop()
    else:
        assert inter is None
    b = args[9].view(B, H, T // 64, 64)
    torch.testing.assert_close(b, log_g.view(B, H, T // 64, 64).cumsum(-1))
    assert y.shape == v.shape and y.is_contiguous() and S_T.shape == (B, H, D, D) and z_T.shape == (B, H, D)
    for desc, x in zip(args[:5], xs):
        assert desc.base.data_ptr() == x.data_ptr() and list(desc.block_shape) == [64, 128]
    # y into a caller's buffer (a contiguous view at an offset of a larger one), or refused by name
    buf = torch.empty(y.numel() + 64, dtype=torch.bfloat16)
    out = buf[64:].view(y.shape)
    call = dict(window=128, scale=0.1, eps=1e-6)
    y2 = lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), None, **call, out=out)[0]
    assert y2 is out and rec.calls[-1][1][5].base.data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match=r"out must be contiguous \(2, 3, 256, 128\) torch.bfloat16"):
        lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), None, **call, out=out.transpose(2, 3))
    # the window's decode state into the caller's fp32 buffers (the last window - 1 keys, values)
    ws = (torch.empty(B, H, 127, D), torch.empty(B, H, 127, D))
    lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), None, **call, window_state=ws)
    grid_, args_, kw_ = rec.calls[-1]
    assert kw_["WSTATE"] is True and args_[20] is ws[0] and args_[21] is ws[1]
    assert rec.calls[-2][2]["WSTATE"] is False
    with pytest.raises(ValueError, match=r"window_state's v must be contiguous \(2, 3, 127, 128\) float32"):
        lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), None, **call,
                                      window_state=(ws[0], ws[1].bfloat16()))


def test_gluon_scope_checks_host_side(monkeypatch):
    """The Gluon launchers' scope checks, on CPU: off Hopper (here no CUDA device: sm_major 0) every
    one says no; told the device is Hopper, each takes in-scope inputs (bf16, widths 128, T a
    multiple of 64, contiguous or a model's (B, T, H, D) transposed) and refuses a width, a T, a
    dtype or a layout outside it."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.backend import dispatch
    from linearize.ops.gla import gluon as gla_gluon
    from linearize.ops.lizard_attn import gluon as lizard_gluon
    from linearize.ops.window_attn import gluon as window_gluon

    B, H, T, D = 2, 3, 128, 128
    x = torch.zeros(B, H, T, D, dtype=torch.bfloat16)
    model = torch.zeros(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2)
    lg, sinks = torch.zeros(B, H, T), torch.zeros(H, 4)

    def checks(q, k=None, v=None, log_g=lg):
        k, v = k if k is not None else q, v if v is not None else q
        return [gla_gluon.supports_bwd_chunks(q, k, v, 64, False), gla_gluon.supports_fwd_fused(q, k, v, log_g),
                window_gluon.supports_bwd(q, k, v, 128, None),
                lizard_gluon.supports(q, k, v, log_g, q, k, 128, sinks, None)]

    assert dispatch.sm_major(x) == 0 and checks(x) == [False] * 4
    for mod in (gla_gluon, lizard_gluon, window_gluon):
        monkeypatch.setattr(mod, "sm_major", lambda t: 9)
    assert checks(x) == [True] * 4 and checks(model, x, x) == [True] * 4
    assert checks(x[..., :64]) == [False] * 4  # width 64
    assert checks(x[:, :, :100]) == [False] * 4  # T not a multiple of 64
    assert checks(x.half(), x, x) == [False] * 4  # dtypes differ
    assert checks(x.transpose(0, 1).contiguous().transpose(0, 1)) == [False] * 4  # neither layout
    assert checks(x, log_g=lg.bfloat16())[1] is False and checks(x, log_g=lg.bfloat16())[3] is False


def test_gluon_tma_tiles_host_side():
    """gla_gluon.tma_tiles on CPU: a descriptor per tensor over its 2-D view (rows b*sb + h*sh + t),
    sharing one remembered shared-memory layout; None where a tensor is in neither layout or its
    base is not 16-byte aligned."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.gla import gluon as gla_gluon

    B, H, T, D = 2, 3, 128, 128
    x = torch.zeros(B, H, T, D, dtype=torch.bfloat16)
    model = torch.zeros(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2)
    descs, views = gla_gluon.tma_tiles([x, model], [64, 128])
    assert [tuple(d.shape) for d in descs] == [(B * H * T, D), (B * T, H * D)]
    assert [spec for _, spec in views] == [(H * T, T, 0), (T, 0, D)]
    assert all(list(d.block_shape) == [64, 128] for d in descs)
    assert descs[0].layout is descs[1].layout is gla_gluon.smem_layout((64, 128), torch.bfloat16)
    assert descs[0].layout == gla_gluon.gl.NVMMASharedLayout.get_default_for([64, 128], gla_gluon.gl.bfloat16)
    assert gla_gluon.tma_tiles([x, x.transpose(0, 1).contiguous().transpose(0, 1)], [64, 128]) is None
    unaligned = torch.zeros(B * H * T * D + 1, dtype=torch.bfloat16)[1:].view(B, H, T, D)
    assert gla_gluon.tma_readable([unaligned]) is False and gla_gluon.tma_tiles([x, unaligned], [64, 128]) is None


def test_gluon_chunk_pass_launch_host_side(monkeypatch):
    """gla_gluon.bwd_chunks up to its launch, on CPU: the grid, b, the states' 2-D views (one
    (F, Dv) tile per chunk) and the constexprs."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.gla import gluon as gla_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(gla_gluon, "_gla_bwd_chunk_kernel", rec)
    B, H, T, D = 2, 3, 192, 128
    NC = T // 64
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    log_g = -torch.rand(B, H, T, generator=g)
    f32 = dict(dtype=torch.float32)
    den, dden, dlog_g = (torch.zeros(B * H, T, **f32) for _ in range(3))
    sc = torch.zeros(B * H, NC + 1, D, D, dtype=torch.bfloat16)
    dsc = torch.zeros(B * H, NC, D, D, dtype=torch.bfloat16)
    zc, dzc, yc = torch.zeros(B * H, NC + 1, D, **f32), torch.zeros(B * H, NC, D, **f32), torch.zeros(B * H, NC, 2, **f32)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    gla_gluon.bwd_chunks(q, k, v, log_g, do, den, dden, sc, zc, dsc, dzc, yc, dq, dk, dv, dlog_g, normalize=True,
                         eps=1e-6, dv_add=True)
    (grid, args, kw), = rec.calls
    assert grid == (NC, B * H)
    assert kw == dict(MODEL_LAYOUT=0, NORM=True, DV_ADD=True, NVD=2, F=D, DV=D, C=64, num_warps=4)
    st, dst = args[4], args[5]
    assert list(st.shape) == [B * H * (NC + 1) * D, D] and list(dst.shape) == [B * H * NC * D, D]
    assert list(st.block_shape) == [D, D]
    torch.testing.assert_close(args[6].view(B, H, NC, 64), log_g.view(B, H, NC, 64).cumsum(-1))
    with pytest.raises(ValueError, match="outside its scope"):
        gla_gluon.bwd_chunks(q, k, v.transpose(2, 3), log_g, do, den, dden, sc, zc, dsc, dzc, yc, dq, dk, dv,
                             dlog_g, normalize=True, eps=1e-6, dv_add=False)


@pytest.mark.parametrize("normalize", [False, True])
def test_gluon_fused_backward_launch_host_side(normalize, monkeypatch):
    """gla_gluon.bwd_fused up to its launch, on CPU: the grid (segments x batch*heads, the last
    segment shorter), b, the states' 2-D view, which pointers it passes for each configuration,
    the constexprs, dq's and dk's tiles (they leave by TMA), its refusal of layouts TMA cannot read; with side_dot and alpha (y read as o),
    their pointers and SIDE, and its refusal where they do not fit."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.gla import gluon as gla_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(gla_gluon, "_gla_bwd_fused_kernel", rec)
    B, H, T, D = 2, 3, 320, 128
    NC = T // 64
    g = torch.Generator().manual_seed(0)
    q, k, v, do, o = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(5))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a model's layout
    log_g = -torch.rand(B, H, T, generator=g)
    f32 = dict(dtype=torch.float32)
    den, dlog_g = torch.zeros(B * H, T, **f32), torch.zeros(B * H, T, **f32)
    sc = torch.zeros(B * H, NC + 1, D, D, dtype=torch.bfloat16)
    zc = torch.zeros(B * H, NC + 1, D, **f32)
    ds_in, dz_in = torch.zeros(B * H * 3, D, D, **f32), torch.zeros(B * H * 3, D, **f32)
    dS0, dz0 = torch.zeros(B, H, D, D, **f32), torch.zeros(B, H, D, **f32)
    dq, dk, dv = (torch.empty(B, H, T, D, dtype=torch.bfloat16) for _ in range(3))
    gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g, dS0, dz0,
                        seg_chunks=2, normalize=normalize, eps=1e-6, dv_add=True)
    (grid, args, kw), = rec.calls
    assert grid == (3, B * H)  # 5 chunks in segments of 2, 2, 1
    assert kw == dict(MODEL_LAYOUT=0b001, NORM=normalize, DV_ADD=True, HAS_DS=True, STORE_DS0=True, F=D, DV=D,
                      C=64, SIDE=False, PAIRED=False, num_warps=4)
    assert args[4].base.data_ptr() == (o if normalize else do).data_ptr()
    assert args[5].base.data_ptr() == dv.data_ptr() and list(args[5].block_shape) == [64, D]  # the dv added to
    assert args[6].base.data_ptr() == dq.data_ptr() and args[7].base.data_ptr() == dk.data_ptr()  # out by TMA
    assert list(args[8].shape) == [B * H * (NC + 1) * D, D] and list(args[8].block_shape) == [D, D]
    assert args[9] is sc and args[15] is ds_in and args[20] is dS0 and args[21] is dz0
    assert (args[11] is den, args[14] is zc, args[16] is dz_in) == (normalize,) * 3
    assert args[12] is dlog_g and args[13] is dlog_g  # no side: placeholders
    assert args[22] is dlog_g and args[23:29] == (T, H, NC, 3, 2, 1e-6)  # no profile: a placeholder
    torch.testing.assert_close(args[10].view(B, H, NC, 64), log_g.view(B, H, NC, 64).cumsum(-1))
    # the gates' sums a forward kept are read as given (a tensor of another size refused)
    bl = gla_gluon.chunk_gates(log_g)
    gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g, dS0, dz0,
                        seg_chunks=2, normalize=normalize, eps=1e-6, dv_add=True, bl=bl)
    assert rec.calls.pop()[1][10] is bl
    with pytest.raises(ValueError, match=r"bl must be \(1920,\) fp32"):
        gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g, dS0, dz0,
                            seg_chunks=2, normalize=normalize, eps=1e-6, dv_add=True, bl=bl[:-64])
    with pytest.raises(ValueError, match="outside its scope"):
        gla_gluon.bwd_fused(q, k, v.transpose(2, 3), log_g, o, den, sc, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g,
                            None, None, seg_chunks=2, normalize=normalize, eps=1e-6, dv_add=False)
    with pytest.raises(ValueError, match="outside its scope"):  # segments without their entering gradients
        gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                            seg_chunks=2, normalize=normalize, eps=1e-6, dv_add=False)
    side_dot, alpha = torch.zeros(B * H, T, **f32), torch.ones(H, **f32)
    side = dict(seg_chunks=NC, eps=1e-6, dv_add=True, side_dot=side_dot, alpha=alpha)
    if not normalize:  # dd exists only normalised
        with pytest.raises(ValueError, match="side_dot takes normalize"):
            gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                                normalize=False, **side)
        return
    gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                        normalize=True, **side)
    (grid, args, kw) = rec.calls[-1]
    assert grid == (1, B * H) and kw["SIDE"] is True and args[12] is side_dot and args[13] is alpha
    with pytest.raises(ValueError, match="side_dot takes"):  # alpha per head, fp32
        gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                            normalize=True, **{**side, "alpha": torch.ones(H + 1, **f32)})
    # paired: the states of chunks 0, 2, 4 and the last (5 chunks), in a view of their own; every
    # chunk's are refused, as are odd segments
    assert gla_gluon.state_slots(NC, True) == 4 and gla_gluon.state_slots(NC, False) == NC + 1
    assert [gla_gluon.state_slots(n, True) for n in (1, 2, 3, 4)] == [2, 2, 3, 3]
    sc_p = sc[:, [0, 2, 4, 5]].contiguous()
    gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc_p, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                        normalize=True, paired=True, **side)
    (grid, args, kw) = rec.calls[-1]
    assert kw["PAIRED"] is True and args[9] is sc_p and list(args[8].shape) == [B * H * 4 * D, D]
    with pytest.raises(ValueError, match=r"sc must hold 4 states .*paired=True"):
        gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc, zc, do, None, None, dq, dk, dv, dlog_g, None, None,
                            normalize=True, paired=True, **side)
    with pytest.raises(ValueError, match="seg_chunks=1"):
        gla_gluon.bwd_fused(q, k, v, log_g, o, den, sc_p, zc, do, ds_in, dz_in, dq, dk, dv, dlog_g, None, None,
                            seg_chunks=1, normalize=True, eps=1e-6, dv_add=True, paired=True)


def test_gluon_window_backward_launch_host_side(monkeypatch):
    """window_gluon.bwd up to its launch, on CPU: the grid, scales and constexprs, and its refusal
    of layouts TMA cannot read."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.window_attn import gluon as window_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(window_gluon, "_win_bwd_kernel", rec)
    B, H, T, D = 2, 3, 192, 128
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    k = k.transpose(1, 2).contiguous().transpose(1, 2)  # a model's layout
    lse, delta = torch.zeros(B * H, T), torch.zeros(B * H, T)
    dq, dk, dv = (torch.empty(B, H, T, D, dtype=torch.bfloat16) for _ in range(3))
    window_gluon.bwd(q, k, v, dy, lse, delta, torch.ones(H), dq, dk, dv, window=100, scale=0.125)
    (grid, args, kw), = rec.calls
    assert grid == (T // 64, B * H)
    assert kw == dict(MODEL_LAYOUT=0b010, HAS_ALPHA=True, W=100, C=64, D=D, DV=D, num_warps=4)
    assert args[-2] == pytest.approx(0.125 * 1.4426950408889634) and args[-1] == 0.125
    with pytest.raises(ValueError, match="outside its scope"):
        window_gluon.bwd(q, k, v.transpose(2, 3), dy, lse, delta, None, dq, dk, dv, window=100, scale=0.125)


@pytest.mark.parametrize("T, D_from", [(64, "pre-pass"), (1216, "pre-pass"), (1216, "o"), (1216, "scores")])
def test_gluon_window_walk_backward_launch_host_side(T, D_from, monkeypatch):
    """window_gluon.bwd with walk=True up to its launch, on CPU: the grid (segments x batch*heads,
    the last segment shorter), the segment length, dk's, dv's and dq's tiles (they leave by TMA),
    the constexprs (OWN_DELTA where o is given
    or scores_delta, D_SCORES with the latter); o, scores_delta and prof refused with the
    one-chunk kernel, o with scores_delta refused, o of another shape and prof of another size
    refused by name."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.window_attn import gluon as window_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(window_gluon, "_win_bwd_walk_kernel", rec)
    B, H, D = 1, 2, 128
    g = torch.Generator().manual_seed(0)
    q, k, v, dy, o = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(5))
    lse, delta = torch.zeros(B * H, T), torch.zeros(B * H, T)
    dq, dk, dv = (torch.empty(B, H, T, D, dtype=torch.bfloat16) for _ in range(3))
    window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, walk=True, sms=132,
                     o=o if D_from == "o" else None, scores_delta=D_from == "scores")
    (grid, args, kw), = rec.calls
    nseg, seg_chunks = (1, 1) if T == 64 else (2, 10)  # 19 chunks: segments of 10 and 9
    assert grid == (nseg, B * H) and args[14] == seg_chunks
    assert args[10] is (o if D_from == "o" else dy)
    assert [a.base.data_ptr() for a in args[7:10]] == [x.data_ptr() for x in (dk, dv, dq)]  # out by TMA
    assert kw == dict(MODEL_LAYOUT=0, HAS_ALPHA=False, W=128, C=64, D=D, DV=D, OWN_DELTA=D_from != "pre-pass",
                      D_SCORES=D_from == "scores", NPROF=0, num_warps=4)
    assert args[-2] == pytest.approx(0.125 * 1.4426950408889634) and args[-1] == 0.125
    with pytest.raises(ValueError, match="walking kernel"):
        window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, o=o)
    with pytest.raises(ValueError, match="walking kernel"):
        window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, scores_delta=True)
    with pytest.raises(ValueError, match="not both"):
        window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, walk=True, o=o,
                         scores_delta=True)
    with pytest.raises(ValueError, match=r"o must be contiguous \(1, 2, %d, 128\)" % T):
        window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, walk=True,
                         o=o[..., :64])
    with pytest.raises(ValueError, match=r"prof must be \(%d, 16\), got \(3, 16\)" % (nseg * B * H * 2)):
        window_gluon.bwd(q, k, v, dy, lse, delta, None, dq, dk, dv, window=128, scale=0.125, walk=True,
                         prof=torch.zeros(3, 16, dtype=torch.int64))


def test_window_walk_segment_rule():
    """walk_segments: doubled while batch x heads leave multiprocessors idle, segments at least 8 chunks."""
    from linearize.ops.window_attn.gluon import walk_segments

    assert [walk_segments(B * 32, T // 64, 132) for B, T in ((16, 2048), (4, 8192), (1, 32768))] == [1, 2, 8]
    assert walk_segments(2, 16, 132) == 2 and walk_segments(2, 15, 132) == 1 and walk_segments(1, 1, 132) == 1


def test_fused_forward_segment_rule():
    """fused_segment_count: no split where batch x heads keep half the SMs busy; else powers of two
    up to two programs per SM, segments at least 16 chunks of 64 long (the H200 sweep's optima)."""
    from linearize.ops.backend.dispatch import fused_segment_count

    assert [fused_segment_count(B, 32, T, 132) for B, T in ((16, 2048), (4, 8192), (2, 16384), (1, 32768))] \
        == [1, 1, 4, 8]
    assert fused_segment_count(1, 1, 1 << 20, 132) == 256  # 2 * 132 // 1 rounded down to a power of two
    assert fused_segment_count(1, 32, 4096, 132) == 4  # 64 chunks: at most 4 segments of 16
    assert fused_segment_count(1, 32, 1024, 132) == 1


def test_bench_triton_only_methods_pass_triton_only_configs(monkeypatch):
    """bench kernels' "passes" methods (the Triton-only baselines beside the Gluon kernels) hand the
    ops settings with the Gluon kernels off, and its "two-pass bwd" methods launch tables with the
    one-kernel gated backward and the walking window backward off; a name reused in _methods once handed the GLA op a function instead (an
    AttributeError in every cell of the H200 bench)."""
    from linearize.bench import kernels as bk
    from linearize.ops.backend import KernelSettings, current_settings
    from linearize.ops.gla import triton as kgla
    from linearize.ops.lizard_attn import fused as kliz

    x = bk._shape_inputs(1, 64, 2, 8, 8, 2, torch.float32, torch.device("cpu"), 0)
    seen = {}
    monkeypatch.setattr(kgla, "gla_chunk_triton", lambda *a, settings=None, launch=None, **k: seen.setdefault(
        "gla", []).append((settings, launch)) or (a[2],))

    def fake_lizard(*a, settings=None, plan=None, **k):
        seen.setdefault("lizard", []).append((settings, plan))
        return (a[2],)

    monkeypatch.setattr(kliz, "lizard_attention", fake_lizard)
    table = bk._methods(x, 4, None)
    table["triton gla passes (ours)"][0]()
    table["triton lizard passes (ours)"][0]()
    settings, launch = seen["gla"][0]
    assert isinstance(settings, KernelSettings) and settings.gluon is False and isinstance(launch, kgla.GLALaunch)
    settings, plan = seen["lizard"][0]
    assert settings.gluon is False
    assert current_settings().gluon is True  # nothing global was changed
    # the two-pass methods: the same ops with the one-kernel gated backward and the walking window backward off
    table["triton gla two-pass bwd (ours)"][0]()
    table["triton lizard two-pass bwd (ours)"][0]()
    table["triton lizard (ours)"][0]()
    settings, launch = seen["gla"][1]
    assert settings is None and launch.gluon_fused_bwd is False
    (s2, two_pass), (s3, default) = seen["lizard"][1:]
    assert s2 is None and s3 is None
    assert (two_pass.gla.gluon_fused_bwd, two_pass.window.gluon_bwd_walk) == (False, False)
    assert (default.gla.gluon_fused_bwd, default.window.gluon_bwd_walk) == (True, True)


def test_gluon_kernels_import_guard(monkeypatch):
    """dispatch.gluon_kernels: the module itself; None only where Triton lacks Gluon; a misspelt
    module name raises rather than quietly turning the Gluon kernels off."""
    import builtins

    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.backend import dispatch
    from linearize.ops.gla import gluon as gla_gluon

    # (its answers are remembered per name: start from none, and leave the module's own as they were)
    monkeypatch.setattr(dispatch, "_GLUON_MODULES", {})
    assert dispatch.gluon_kernels("gla.gluon") is gla_gluon
    with pytest.raises(ImportError):
        dispatch.gluon_kernels("gla.gluon_misspelt")
    monkeypatch.delitem(sys.modules, "linearize.ops.window_attn.gluon", raising=False)
    real_import = builtins.__import__

    def no_gluon(name, *a, **k):
        if name.startswith("triton.experimental"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_gluon)
    assert dispatch.gluon_kernels("window_attn.gluon") is None


def test_kernel_settings_block_sets_and_restores():
    """One context manager sets the kernels' user settings for a block (nested blocks too) and puts
    them back, also after an error; bad names and values are refused by name; the backends' launch
    tables take chunk and gluon from the settings in force."""
    from linearize.ops.backend import KernelSettings, current_settings, kernel_settings
    from linearize.ops.backend.settings import resolve

    assert current_settings() == KernelSettings()
    with kernel_settings(gluon=False) as outer:
        assert current_settings() is outer and outer.gluon is False
        with kernel_settings(chunk=32, paired_states=True):
            assert current_settings() == KernelSettings(chunk=32, gluon=False, paired_states=True)
        assert current_settings() is outer
        with pytest.raises(RuntimeError):
            with kernel_settings(side_streams=False):
                raise RuntimeError("inside")
        assert current_settings() is outer
    assert current_settings() == KernelSettings()
    with pytest.raises(ValueError, match="unknown kernel settings.*one_op"):
        with kernel_settings(one_op=False):
            pass
    with pytest.raises(ValueError, match="chunk"):
        KernelSettings(chunk=48)
    with pytest.raises(ValueError, match="gluon"):
        KernelSettings(gluon=1)
    with pytest.raises(TypeError, match="settings"):
        resolve({"chunk": 64})
    if not _triton_importable():
        return
    from linearize.ops.gla import triton as kgla
    from linearize.ops.window_attn import triton as kwin

    with kernel_settings(chunk=32, gluon=False):
        assert (kgla.launch_for().chunk, kgla.launch_for().gluon, kwin.launch_for().gluon) == (32, False, False)
    assert kgla.launch_for() == kgla.LAUNCH and kwin.launch_for(KernelSettings(gluon=False)).gluon is False


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True
