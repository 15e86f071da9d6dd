"""``softmax_layers="auto:K"``: after stage 1 the K layers with the largest transfer error go back to
the teacher's softmax attention; the choice is recorded, survives a resume and a reload."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import linearize
from linearize.models.attention import LinearizedAttention
from linearize.models.checkpoint import read_meta
from linearize.models.convert import auto_softmax_count, convert
from linearize.train import TrainConfig, run
from linearize.train import loop as loop_module
from linearize.train.transfer import choose_softmax_layers

import fixtures
from fixtures import tiny_model_dir

torch.set_num_threads(1)

LOUD = (1, 3)  # the layers whose transfer error the fixture makes largest


@pytest.fixture(scope="module")
def loud(tmp_path_factory):
    """A 4-layer tiny Llama whose layers 1 and 3 carry values 10x larger and an output projection
    10x smaller: the teacher computes the same function, but those layers' attention outputs (the
    "heads" transfer target) are 10x larger, so the student's MSE there is 100x what it would be."""
    from transformers import AutoModelForCausalLM

    directory = tiny_model_dir(tmp_path_factory.mktemp("loud") / "model", num_layers=4)
    model = AutoModelForCausalLM.from_pretrained(directory)
    ids = torch.randint(0, 500, (1, 24))
    before = model(ids).logits
    with torch.no_grad():
        for i in LOUD:
            attn = model.model.layers[i].self_attn
            attn.v_proj.weight.mul_(10.0)
            attn.o_proj.weight.div_(10.0)
    torch.testing.assert_close(model(ids).logits, before, atol=1e-4, rtol=1e-4)  # the same teacher
    model.save_pretrained(directory)
    return str(directory)


def small(model, data, out, **kw) -> TrainConfig:
    base = dict(model=model, data=data, out=str(out), seq_len=32, batch_size=2, stage1_tokens=32 * 2 * 4,
                stage2_tokens=32 * 2 * 3, eval_every=2, save_every=2, val_rows=4, progress=False, warmup_steps=0,
                stage1_lr=1e-2, stage2_lr=1e-2, softmax_layers="auto:2", transfer_target="heads")
    return TrainConfig(**{**base, **kw})


def choice_event(out):
    events = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("event") == "softmax_layers_chosen"]
    assert len(events) == 1, events
    return events[0]


def test_auto_keeps_the_layers_with_the_largest_transfer_error(loud, text_file, tmp_path):
    out = run(small(loud, text_file, tmp_path / "run"))
    event = choice_event(out)
    errors = {int(i): e for i, e in event["errors"].items()}
    assert sorted(errors) == [0, 1, 2, 3]  # every layer measured, all linear during stage 1
    assert event["layers"] == list(LOUD) and event["k"] == 2
    assert min(errors[i] for i in LOUD) > max(errors[i] for i in (0, 2))
    # stage 1 trained all four layers; stage 2 and the checkpoint have softmax exactly in the chosen two
    stage1 = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("stage") == "stage1" and "split" in r]
    assert stage1[-1]["layers"] == [0, 1, 2, 3]
    meta = read_meta(out)
    assert meta["softmax_layers"] == list(LOUD)
    assert meta["training"]["softmax_layers_auto"] == {k: event[k] for k in ("k", "layers", "errors")}
    assert json.loads((out / "summary.json").read_text())["softmax_layers_auto"]["layers"] == list(LOUD)
    assert json.loads((out / "config.json").read_text())["softmax_layers"] == "auto:2"
    assert not any(".layers.1." in k or ".layers.3." in k for k in load_file(str(out / "adapter.safetensors"))
                   if ".hybrid." in k)
    model, _ = linearize.load(out)
    kinds = [isinstance(layer.self_attn, LinearizedAttention) for layer in model.model.layers]
    assert kinds == [True, False, True, False]
    assert model.linearize_spec["softmax_layers"] == list(LOUD)


@pytest.mark.slow  # two runs, ~10 s
def test_a_resumed_auto_run_reuses_its_choice_and_reaches_the_same_weights(loud, text_file, tmp_path, monkeypatch):
    whole = run(small(loud, text_file, tmp_path / "whole"))
    calls = {"n": 0}
    real = loop_module.batch_indices

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:  # inside stage 2 (stage 1 takes 4 micro-batches)
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "batch_indices", dying)
    with pytest.raises(KeyboardInterrupt):
        run(small(loud, text_file, tmp_path / "resumed"))
    monkeypatch.setattr(loop_module, "batch_indices", real)
    resumed = run(small(loud, text_file, tmp_path / "resumed"), resume=True)
    assert choice_event(resumed)["layers"] == choice_event(whole)["layers"] == list(LOUD)
    a, b = load_file(str(whole / "adapter.safetensors")), load_file(str(resumed / "adapter.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_choose_softmax_layers_ranks_by_error_and_breaks_ties_by_index():
    errors = {0: 0.1, 2: 0.5, 4: 0.2, 5: 0.5, 7: 0.05}
    assert choose_softmax_layers(errors, 1) == [2]
    assert choose_softmax_layers(errors, 3) == [2, 4, 5]
    with pytest.raises(ValueError, match="cannot keep 5 of 5"):
        choose_softmax_layers(errors, 5)


@pytest.mark.parametrize("spec,message", [
    ("auto:0", r"'auto:0'.*positive integer"),
    ("auto:x", r"'auto:x'.*positive integer"),
    ("auto", r"'auto'.*auto:K"),
    ("auto:-1", r"'auto:-1'"),
])
def test_bad_auto_specs_are_named(spec, message, tmp_path):
    from linearize.cli.args import parse_softmax_layers

    with pytest.raises(ValueError, match=message):
        parse_softmax_layers(spec)
    with pytest.raises(ValueError, match=message):
        run(TrainConfig(softmax_layers=spec, out=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


def test_auto_needs_a_stage1_and_a_layer_left_linear(loud, text_file, tmp_path):
    with pytest.raises(ValueError, match="stage1_tokens is 0"):
        run(small(loud, text_file, tmp_path / "a", stage1_tokens=0))
    with pytest.raises(ValueError, match=r"auto:4 keeps 4 layers.*only 4 layers.*at most 3"):
        run(small(loud, text_file, tmp_path / "b", softmax_layers="auto:4"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="chosen by measure during training"):
        convert(fixtures.llama(), "lizard", softmax_layers="auto:1")


def test_auto_in_flags_and_config_files(tmp_path):
    from linearize.cli.args import parse_softmax_layers
    from linearize.cli.train import load_config_file

    assert parse_softmax_layers("auto:3") == parse_softmax_layers(" AUTO:3 ") == "auto:3"
    assert auto_softmax_count("auto:3") == 3 and auto_softmax_count([0, 2]) is None
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("method: lizard\nsoftmax_layers: auto:2\n")
    assert TrainConfig.from_dict(load_config_file(recipe)).softmax_layers == "auto:2"
