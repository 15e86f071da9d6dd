"""Tests of the kept probes in benchmarks/probes/ (CPU only; the GPU parts skip without Triton).
Not part of `make test` (pytest's testpaths is tests/); run them with

    PYTHONPATH=src python -m pytest -q benchmarks/probes/test_probes.py
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# the Nsight Compute table ncu_stalls reads: an H100 run of tree 331351f, removed from docs/results/
# in the tree after this commit (it is read back from git)
NCU_RECORD = "0d8611a:docs/results/ncu-lizard-step-h100-331351f-source.csv.gz"


def _load_probe(name: str):
    """A probe, which imports its neighbour probe_common as its folder's own."""
    sys.path.insert(0, str(HERE))
    try:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(HERE))


def test_probe_alt_modules_load_kernel_copies_with_relative_imports(tmp_path):
    """benchmarks/probes/probe_common.alt_modules: a copy of a kernel file (relative imports and all) loads
    beside the current module, as the GPU probes' --alt NAME=FILE needs; a bad spec is refused by
    name."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.window_attn import gluon as window_gluon

    common = _load_probe("probe_common")
    copy = tmp_path / "window_gluon_copy.py"
    copy.write_text(Path(window_gluon.__file__).read_text().replace("WIDTH = 128", "WIDTH = 128  # the copy"))
    mods = common.alt_modules(window_gluon, [f"copy={copy}"])
    assert list(mods) == ["current", "copy"] and mods["current"] is window_gluon
    assert mods["copy"] is not window_gluon and mods["copy"].__file__ == str(copy)
    assert mods["copy"].walk_segments(4, 64, 132) == window_gluon.walk_segments(4, 64, 132)
    with pytest.raises(SystemExit, match="NAME=FILE"):
        common.alt_modules(window_gluon, [str(copy)])
    with pytest.raises(SystemExit, match="missing.py"):
        common.alt_modules(window_gluon, [f"x={tmp_path / 'missing.py'}"])


def test_train_ab_variants_pass_their_settings_to_their_own_call():
    """benchmarks/probes/lizard_train_ab: a variant's fields make its KernelSettings, passed to that
    variant's op only (the op keeps them for its backward); fields prefixed op. are the op's own
    keywords; a spec without NAME= is refused."""
    pytest.importorskip("triton")
    from linearize.ops.backend import KernelSettings, current_settings

    ab = _load_probe("lizard_train_ab")
    name, cfg = ab._variant("a=og_from_y=False;gluon=False;op.return_state=False")
    assert name == "a" and cfg == (KernelSettings(og_from_y=False, gluon=False), {"return_state": False})
    seen = []
    ab.lizard_attention = lambda *a, settings, return_state=True, **k: seen.append(
        (settings.og_from_y, settings.gluon, return_state)) or (None,)
    ab._run(cfg, [None] * 8)
    assert seen == [(False, False, False)] and current_settings() == KernelSettings()
    with pytest.raises(SystemExit, match="NAME=FIELD=VALUE"):
        ab._variant("og_from_y")


def test_roofline_traffic_counts_the_tensors_the_passes_move():
    """benchmarks/probes/lizard_roofline.traffic: a forward reads exactly the bench's inputs (their bytes
    summed); the training forward writes y, o_w and the states the fused kernel allocates
    (NC + 1 per batch x head); the backward reads what the forward kept plus dy, and writes one
    gradient per input it reads; with o_g kept, it is written once more and read instead of y;
    every count is linear in B and affine in T."""
    import torch

    from linearize.bench.kernels import _shape_inputs

    rl = _load_probe("lizard_roofline")
    B, H, T = 2, 3, 128
    x = _shape_inputs(B, H=H, T=T, D=128, Fd=128, sinks=4, dt=torch.bfloat16, dev=torch.device("cpu"), seed=0)
    t = rl.traffic(B, H, T)
    inputs = sum(x[n].nbytes for n in ("q", "k", "v", "lq", "lk", "log_g"))
    assert sum(t["inference fwd"]["read"].values()) == sum(t["training fwd"]["read"].values()) == inputs
    w = t["training fwd"]["write"]
    assert w["S states"] == B * H * (T // 64 + 1) * 128 * 128 * 2 and w["o_w"] == w["y"] == x["v"].nbytes
    assert t["gated bwd"]["read"]["S states"] == w["S states"]
    assert t["window bwd"]["read"]["dy"] == x["dy"].nbytes
    assert set(t["gated bwd"]["write"]) == {"dphi_q", "dphi_k", "dv", "d log_g"}
    kept = rl.traffic(B, H, T, og_kept=True)  # o_g kept: written once more, read instead of y
    assert rl.total(kept["training fwd"]) - rl.total(t["training fwd"]) == x["v"].nbytes
    assert "o_g" in kept["gated bwd"]["read"] and "y" not in kept["gated bwd"]["read"]
    for k in t:
        assert rl.total(rl.traffic(2 * B, H, T)[k]) == 2 * rl.total(t[k])
        f = [rl.total(rl.traffic(B, H, n * T)[k]) for n in (1, 2, 3)]
        assert f[1] - f[0] == f[2] - f[1] > 0  # affine in T (the last state and the outputs' once per pair)


def test_ncu_stalls_reads_the_recorded_profile(capsys, tmp_path):
    """benchmarks/probes/ncu_stalls.py on the committed Nsight Compute record of the fused gated backward
    (the record gla-fused-bwd-ncu-h100.md of commit 0d8611a quotes these): the samples add up, the two partitions
    take half each, and the worker (state) partition's two longest waits are on dd_ready and on the
    window's dv (barriers 6 and 2 of the 8 at 0x37a00)."""
    ncu = _load_probe("ncu_stalls")
    got = subprocess.run(["git", "-C", str(ROOT), "show", NCU_RECORD], capture_output=True)
    if got.returncode != 0:
        pytest.skip(f"git cannot show {NCU_RECORD} here")
    path = str(tmp_path / "step-source.csv.gz")
    Path(path).write_bytes(got.stdout)
    kernels = ncu.load(path)
    assert set(kernels) == {"_lizard_fwd_kernel", "_win_bwd_walk_kernel", "_gla_bwd_fused_kernel"}
    rows = kernels["_gla_bwd_fused_kernel"]
    assert sum(int(r[ncu.SAMPLES] or 0) for r in rows) == 133150
    ncu.report("_gla_bwd_fused_kernel", rows, top=3)
    out = capsys.readouterr().out
    assert "worker partition 49.1%, default partition 50.0%" in out
    assert "mbarrier wait at 0x5c50 (worker partition, barrier [R5+URZ+0x37a30]): 5.8%" in out
    assert "mbarrier wait at 0x5e20 (worker partition, barrier [R5+URZ+0x37a10]): 7.6%" in out
    with pytest.raises(SystemExit, match="no kernel 'nope'"):
        import sys

        argv, sys.argv = sys.argv, ["ncu_stalls.py", path, "--kernel", "nope"]
        try:
            ncu.main()
        finally:
            sys.argv = argv


def test_student_memory_reads_the_initial_decay_of_an_untrained_conversion():
    """A fresh lizard conversion: gates start at gamma spread over (0.95, 0.99) with zero weights, so
    every token decays alike and the memory lengths are 1 / -log(gamma) per head."""
    import math

    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures import llama

    import linearize

    probe = _load_probe("student_memory")
    model = llama(num_layers=2)
    linearize.convert(model, "lizard")
    rows = probe.memory_profile(model.eval(), torch.randint(0, 100, (1, 64)))
    heads = len(rows[0]["memory"])
    want = [1 / -math.log(0.95 + (0.99 - 0.95) * h / (heads - 1)) for h in range(heads)]
    assert [r["layer"] for r in rows] == [0, 1]
    for r in rows:
        assert r["memory"] == pytest.approx(want, rel=1e-4) and "beta" not in r and len(r["alpha"]) == heads



def test_retrieval_answers_nll_reads_the_answer_tokens():
    """retrieval_answers.answer_nll scores exactly the answer's tokens after the prompt: ~0 for a
    model whose logits at each position put the next token of the sequence first (it looks ahead:
    teacher forcing), log(vocab) for a uniform one, and large for one that is always wrong there.
    make_examples: each format's asked value is in its prompt (once; the classic pass key states it twice)."""
    import math
    from types import SimpleNamespace

    from linearize.data.needle import prepare_haystack
    from linearize.models.teacher import load_teacher

    probe = _load_probe("retrieval_answers")
    _, tok = load_teacher("smollm2-135m")
    vocab = len(tok)

    class Oracle(torch.nn.Module):
        def __init__(self, shift: int):
            super().__init__()
            self.shift = shift

        def forward(self, input_ids):
            nxt = torch.roll(input_ids, -1, dims=1) + self.shift
            return SimpleNamespace(logits=30.0 * torch.nn.functional.one_hot(nxt % vocab, vocab).float())

    prompt, answer = "The code of the blue door is", "48213"
    assert probe.answer_nll(Oracle(0), tok, prompt, answer) < 1e-6
    assert probe.answer_nll(Oracle(1), tok, prompt, answer) > 25
    uniform = lambda input_ids: SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], vocab))  # noqa: E731
    assert probe.answer_nll(uniform, tok, prompt, answer) == pytest.approx(math.log(vocab), rel=1e-5)

    text = " ".join(f"Sentence number {w} goes here." for w in ("one", "two", "three", "four", "five") * 60)
    hay = prepare_haystack([text], tok)
    examples = probe.make_examples(tok, hay, 512, 2, probe.FORMATS)
    assert [f for f, _ in examples] == list(probe.FORMATS) * 2
    for fmt, ex in examples:
        assert ex.prompt.count(ex.answer) == (2 if fmt == "classic" else 1), fmt


def test_sparse_cache_selection_reads_the_cached_positions():
    """A cache as large as the input holds every pair that has left the window (positions up to
    T - 1 - w): key_share is 1 for a key there and 0 for one still in the window, in every head."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures import llama

    import linearize
    from linearize.models.decode import prefill_model

    probe = _load_probe("sparse_cache_selection")
    T, w = 40, 8
    model = llama(num_layers=2)
    linearize.convert(model, "lizard", window=w, sparse_cache=T)
    with torch.no_grad():
        _, cache, _ = prefill_model(model.eval(), torch.randint(0, 100, (1, T)), None, None)
    positions = probe.cached_positions(cache)
    assert len(positions) == 2
    assert probe.key_share(positions, [0, 5, T - 1 - w]).eq(1).all()
    assert probe.key_share(positions, [T - w, T - 1]).eq(0).all()
    assert probe.find([5, 1, 2, 3, 1, 2], [1, 2]) == [1, 2] and probe.find([1, 2], [3]) == []
    assert probe.find([5, 1, 2, 3, 1, 2], [1, 2], start=2) == [4, 5] and probe.find([1, 2], [1, 2], start=1) == []
    # the teacher's far attention: the keys it returns carry the largest mass of attention from
    # queries more than `window` after them and before `queries_end`, summed here by loops
    teacher, n, window, end, size = llama(num_layers=2), 12, 3, 10, 4
    ids = list(range(1, n + 1))
    top = probe.far_attention_positions(teacher, ids, size, window, end)
    with torch.no_grad():
        att = teacher(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    for layer, idx in zip(att, top):
        mass = torch.zeros(layer.shape[1], n)
        for q in range(end):
            for k in range(q - window):
                mass[:, k] += layer[0, :, q, k]
        assert idx.shape == (1, layer.shape[1], size)
        torch.testing.assert_close(mass.gather(1, idx[0]), mass.topk(size, dim=-1).values)
