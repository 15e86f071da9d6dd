"""``bench train`` on CPU with a tiny model: the step it times is ``linearize train``'s (the same
parameters train, the loss falls), the figures follow from the timings, the files are written from
the JSON, and bad settings are refused by name. On CUDA: the kernels backend runs our kernels, and
its first loss matches the torch path's."""

from __future__ import annotations

import json
import os

import pytest
import torch

import linearize
from linearize.bench.train import our_kernel_names, run_train_bench
from linearize.bench.generate import build_model
from linearize.models.lora import add_lora, lora_parameters
from linearize.train.transfer import make_blocks, trainable_attention_parameters

B, T = 2, 32


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_train")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = run_train_bench(out, models=("tiny-random",), seq_lens=(T,), methods=("lizard",), batch_size=B,
                               steps=3, warmup=1, device="cpu")
    finally:
        torch.set_num_threads(n)
    return out, data


def _cell(data, stage):
    return next(c for c in data["cells"] if c["stage"] == stage)


def test_bench_train_writes_every_cell_from_the_json(run):
    out, data = run
    saved = json.loads((out / "train.json").read_text())
    assert [(c["stage"], c["backend"]) for c in saved["cells"]] == [
        ("teacher", "torch"), ("stage1", "torch"), ("stage2", "torch")]
    assert all(c["status"] == "ok" for c in saved["cells"])
    assert (out / "train.png").stat().st_size > 0
    md = (out / "train.md").read_text()
    assert "teacher + LoRA (SDPA)" in md and "lizard stage1" in md and "lizard stage2" in md
    for c in saved["cells"]:
        assert len(c["step_ms"]) == 3
        assert c["step_ms_median"] == pytest.approx(sorted(c["step_ms"])[1])
        assert c["tokens_per_s"] == pytest.approx(B * T / (c["step_ms_median"] / 1e3))


def test_bench_train_steps_train_what_linearize_train_trains(run):
    _, data = run
    student = linearize.convert(build_model("tiny-random", torch.float32, "cpu")[0], "lizard")
    block = make_blocks(student, None)[0]
    assert _cell(data, "stage1")["trained_parameters"] == sum(
        p.numel() for p in trainable_attention_parameters(student, block))
    add_lora(student)
    assert _cell(data, "stage2")["trained_parameters"] == sum(p.numel() for p in lora_parameters(student))
    teacher = build_model("tiny-random", torch.float32, "cpu")[0]
    add_lora(teacher)
    assert _cell(data, "teacher")["trained_parameters"] == sum(p.numel() for p in lora_parameters(teacher))
    # four steps on one batch at stage 1's default rate: the transfer loss falls
    s1 = _cell(data, "stage1")
    assert s1["loss_last"] < s1["loss_first"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(backends=("kernels",)), "'kernels' backend runs on CUDA only"),
    (dict(methods=("lion-s",)), "encoder-only methods \\['lion-s'\\]"),
    (dict(methods=("lizzard",)), "unknown or encoder-only methods \\['lizzard'\\]"),
    (dict(models=("smollm2-135m",), layers=2), "name smollm2-135m-random instead"),
    (dict(layers=3), "layers must be an integer from 1 to 2"),
    (dict(steps=0), "steps must be an integer >= 1, got 0"),
    (dict(seq_lens=(1,)), "seq_lens must be integers >= 2"),
    (dict(backends=("fast",)), "unknown backends \\['fast'\\]"),
    (dict(graphs=(True,)), "CUDA graphs run on CUDA only"),
    (dict(graphs=()), "graphs must be False, True or both"),
])
def test_bench_train_refuses_bad_settings(tmp_path, kwargs, message):
    args = dict(models=("tiny-random",), seq_lens=(T,), device="cpu", steps=1, warmup=0) | kwargs
    with pytest.raises(ValueError, match=message):
        run_train_bench(tmp_path, **args)
    assert not (tmp_path / "train.json").exists()


def test_mfu_counts_the_steps_matrix_products(run):
    from linearize.bench.train import matmul_parameters, peak_flops, step_flops_per_token

    model = build_model("tiny-random", torch.float32, "cpu")[0]
    cfg = model.config
    d, f, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f  # q, o; k, v; gate, up, down
    assert matmul_parameters(model) == (L * per_layer + V * d, L * per_layer)
    add_lora(model)  # the adapters' own weights are no part of the model's products
    assert matmul_parameters(model) == (L * per_layer + V * d, L * per_layer)
    assert step_flops_per_token("stage2", 10, 7) == 40 and step_flops_per_token("stage1", 10, 7) == 14
    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989.4e12
    assert peak_flops("cpu (2 cores)") is None
    _, data = run
    for c in data["cells"]:  # on the CPU: FLOP/s from the median step, no MFU
        assert c["model_tflops"] == pytest.approx(
            step_flops_per_token(c["stage"], *matmul_parameters(model)) * c["tokens_per_s"] / 1e12)
        assert c["mfu"] is None


def test_our_kernel_names_are_the_kernels_modules():
    names = our_kernel_names()  # what a profiler lists: the kernels of the Triton and Gluon modules
    assert {"_gla_fwd_kernel", "_win_fwd_kernel", "_win_bwd_delta_kernel", "_lizard_state_kernel",
            "_rmsnorm_kernel", "_gla_bwd_fused_kernel", "_lizard_fwd_kernel", "_win_bwd_walk_kernel"} <= names
    assert not any("sdpa" in n or "flash" in n for n in names)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bench_train_kernels_backend_runs_our_kernels(tmp_path):
    data = run_train_bench(tmp_path, models=("tiny-random",), seq_lens=(128,), methods=("lizard",), batch_size=2,
                           steps=2, warmup=0, device="cuda")
    by = {(c["stage"], c["backend"]): c for c in data["cells"] if not c["graph"]}
    graphed = {c["stage"]: c for c in data["cells"] if c["graph"]}
    assert set(graphed) == {"teacher", "stage1", "stage2"}
    assert all(c["status"] == "ok" and "graph_failed" not in c for c in graphed.values())
    for stage in ("stage1", "stage2"):
        assert graphed[stage]["loss_first"] == pytest.approx(by[stage, "kernels"]["loss_first"], rel=2e-2)
        assert by[stage, "kernels"]["our_launches"] > 0
        assert by[stage, "torch"]["our_launches"] == 0
        # the same first step on the same weights and batch: the kernels' loss is the torch path's
        assert by[stage, "kernels"]["loss_first"] == pytest.approx(by[stage, "torch"]["loss_first"], rel=2e-2)


def test_cli_bench_train(tmp_path, capsys):
    from linearize import cli

    out = tmp_path / "b"
    assert cli.main(["bench", "train", "--model", "tiny-random", "--seq-lens", "32", "--methods", "lizard",
                     "--batch-size", "2", "--steps", "1", "--device", "cpu", "--out", str(out)]) == 0
    data = json.loads((out / "train.json").read_text())
    assert data["settings"]["seq_lens"] == [32] and data["settings"]["batch_size"] == 2
    assert [c["stage"] for c in data["cells"]] == ["teacher", "stage1", "stage2"]
    assert "lizard stage2" in capsys.readouterr().out
    assert cli.main(["bench", "train", "--model", "tiny-random", "--layers", "9", "--device", "cpu",
                     "--out", str(tmp_path / "c")]) == 2
    assert "layers must be an integer from 1 to 2" in capsys.readouterr().err


def test_bench_train_method_with_nothing_to_transfer(tmp_path):
    # liger's attention has no parameters of its own: stage 1 has nothing to train, stage 2 runs
    data = run_train_bench(tmp_path, models=("tiny-random",), seq_lens=(T,), methods=("liger",), batch_size=B,
                           steps=1, warmup=0, device="cpu")
    status = {c["stage"]: c["status"] for c in data["cells"]}
    assert status == {"teacher": "ok", "stage1": "nothing_to_train", "stage2": "ok"}
    assert "| liger stage1 | torch | no | nothing to train |" in (tmp_path / "train.md").read_text()


def test_kernels_switched_restores_the_switch(monkeypatch):
    from linearize.ops.backend.dispatch import ENV_SWITCH, kernels_enabled, kernels_switched

    monkeypatch.delenv(ENV_SWITCH, raising=False)
    with kernels_switched(False):
        assert not kernels_enabled()
        with kernels_switched(True):
            assert kernels_enabled()
        assert not kernels_enabled()
    assert ENV_SWITCH not in os.environ
    monkeypatch.setenv(ENV_SWITCH, "off")
    with pytest.raises(RuntimeError):
        with kernels_switched(True):
            raise RuntimeError("inside")
    assert os.environ[ENV_SWITCH] == "off"


def test_bench_train_converts_with_the_overrides_and_builds_gemma3(tmp_path):
    """``overrides`` reach the students (a feature width changes stage 1's trained parameters and
    is recorded), and the Gemma-3 shape builds with its sliding/global pattern."""
    from linearize.bench.train import make_stage

    model = build_model("gemma3-270m-random", torch.float32, "cpu", layers=6)[0]
    assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert model.config.head_dim == 256
    small = build_model("tiny-random", torch.float32, "cpu")[0]
    _, params, _ = make_stage(small, "stage1", "lizard", torch.device("cpu"), {"feature_dim": 8})
    assert small.model.layers[0].self_attn.hybrid.phi_q.feature_dim == 8
    default = build_model("tiny-random", torch.float32, "cpu")[0]
    _, params_default, _ = make_stage(default, "stage1", "lizard", torch.device("cpu"))
    assert sum(p.numel() for p in params) != sum(p.numel() for p in params_default)
    data = run_train_bench(tmp_path, models=("tiny-random",), seq_lens=(16,), methods=("lizard",), batch_size=1,
                           steps=1, warmup=0, device="cpu", overrides={"feature_dim": 8})
    assert data["settings"]["overrides"] == {"feature_dim": 8}
    assert all(c["status"] == "ok" for c in data["cells"])
