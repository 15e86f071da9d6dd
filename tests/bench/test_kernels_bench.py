"""``linearize bench kernels`` (linearize.bench.kernels): argument checks, the tune picks, the
markdown tables, partial runs, the CLI's --host flag, the Triton-only methods' settings; on
CUDA, the host/GPU split of a small run."""

from __future__ import annotations

import json

import pytest
import torch

from kernel_checks import CUDA


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


def test_bench_lolcats_cell_is_the_lolcats_op_at_the_methods_window():
    """The "torch lolcats (ours)" cell runs ops.lolcats_attn.lolcats_attn_chunk on the shape's inputs at
    LoLCATs' window, and its leaves take gradients."""
    from linearize.bench import kernels as bk
    from linearize.methods import method_config
    from linearize.ops.lolcats_attn import lolcats_attn_chunk

    x = bk._shape_inputs(1, 80, 2, 8, 8, 2, torch.float32, torch.device("cpu"), 0)
    forward, leaves, dy = bk._methods(x, 4, None)["torch lolcats (ours)"]
    want, _ = lolcats_attn_chunk(x["q"], x["k"], x["v"], x["lq"], x["lk"], torch.sigmoid(x["factor"]),
                                 window=method_config("lolcats").window)
    y = forward()
    assert torch.equal(y, want)
    y.backward(dy)
    assert all(leaf.grad is not None and torch.isfinite(leaf.grad).all() for leaf in leaves)


def test_bench_delta_methods_compute_the_gated_delta_rule():
    """bench kernels' delta rows time the gated delta rule on their inputs (both rows fall back to
    the torch scan on the CPU): their outputs equal the parallel form's."""
    from linearize.bench import kernels as bk
    from linearize.ops.delta import delta_rule_parallel

    x = bk._shape_inputs(1, 70, 2, 8, 8, 2, torch.float32, torch.device("cpu"), 0)
    table = bk._methods(x, 4, None)
    ref, _ = delta_rule_parallel(x["delta_q"], x["delta_k"], x["v"], x["delta_beta"], log_alpha=x["log_g"])
    for name in ("torch delta (ours)", "triton delta (ours)"):
        forward, leaves, grad = table[name]
        out = forward()
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5, name
        assert len(leaves) == 5 and grad.shape == out.shape
