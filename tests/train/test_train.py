"""Two-stage training: transfer lowers the per-layer MSE, LoRA lowers the validation loss, resume is
exact, non-finite steps are skipped and counted, schedules, and clear errors with nothing left behind."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import linearize
from linearize.data import pack
from linearize.train import TrainConfig, run
from linearize.train import loop as loop_module
from linearize.train.loop import MetricsLog, NonFiniteLossError, Stage, fit
from linearize.train.schedules import cosine_with_warmup, mu_at
from linearize.train.transfer import Block, make_blocks, run_block

torch.set_num_threads(1)


def small(tiny, text_file, out, **kw) -> TrainConfig:
    base = dict(model=tiny, data=text_file, out=str(out), seq_len=32, batch_size=2, stage1_tokens=32 * 2 * 6,
                stage2_tokens=32 * 2 * 6, eval_every=3, save_every=2, val_rows=4, progress=False, warmup_steps=0)
    return TrainConfig(**{**base, **kw})


def val_records(out, stage):
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [r for r in recs if r.get("stage") == stage and r.get("split") == "val"]


# ----------------------------------------------------------------------------------- the stages


def test_stage1_lowers_every_layer_and_stage2_lowers_validation_loss(tiny, text_file, tmp_path, capsys):
    out = run(small(tiny, text_file, tmp_path / "run", stage1_lr=1e-2, stage2_lr=1e-2, softmax_layers=[1]))
    s1 = val_records(out, "stage1")
    assert s1[0]["layers"] == [0, 2]  # the kept softmax layer has nothing to transfer
    assert all(after < before for before, after in zip(s1[0]["layer_mse"], s1[-1]["layer_mse"])), s1
    s2 = val_records(out, "stage2")
    assert s2[-1]["loss"] < s2[0]["loss"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["student_val_loss"] == pytest.approx(s2[-1]["loss"], rel=1e-6)
    assert {p.name for p in out.glob("*.png")} == {"stage1_layer_mse.png", "stage1_loss.png", "stage2_loss.png"}
    model, _ = linearize.load(out)
    assert model.linearize_lora["rank"] == 8 and model.linearize_spec["softmax_layers"] == [1]
    # the verdict block, printed with progress off too: both stages against the teacher, and the ratio
    printed = capsys.readouterr().out
    ratio = summary["student_val_ppl"] / summary["teacher_val_ppl"]
    assert summary["val_ppl_ratio"] == pytest.approx(ratio)
    assert "verdict on 4 held-out rows" in printed and "student after stage 1" in printed
    stage2_line = next(line for line in printed.splitlines() if "student after stage 2" in line)
    assert stage2_line.split()[-1] == f"{ratio:.2f}x"
    assert f"{summary['stage1_val_loss']:.3f}" in printed
    # the checkpoint says what it was trained on: evals report its row length as its trained context
    from linearize.models.checkpoint import read_meta
    from linearize.models.loading import trained_context

    assert read_meta(out)["training"]["seq_len"] == 32
    assert trained_context(str(out)) == 32
    linearize.save(model, tmp_path / "copy")  # the loaded model's save keeps it
    assert trained_context(str(tmp_path / "copy")) == 32 and trained_context("smollm2-135m") is None


def _summary(teacher: float, student: float, stage1: float = 9.0) -> dict:
    return {"teacher_val_loss": teacher, "stage1_val_loss": stage1, "student_val_loss": student,
            "val_rows": 16, "val_tokens": 8192, "stages": [{"stage": "stage1"}, {"stage": "stage2"}]}


@pytest.mark.parametrize("student, words", [
    (math.log(63.0 * 127), ["far from its teacher", "--stage1-tokens", "--stage1-lr 0.03", "--stage2-lr 0.003"]),
    (math.log(63.0 * 1.3), ["close to its teacher (1.30x"]),
    (math.log(63.0 * 1.02), ["matches its teacher"]),
    (math.log(60.0), ["at or below the teacher's"]),
])
def test_verdict_names_the_ratio_and_what_to_try(student, words):
    from linearize.train.run import verdict

    text = verdict(_summary(math.log(63.0), student), TrainConfig())
    rows = {line.split()[0] + " " + line.split()[-1] for line in text.splitlines()[2:5]}
    assert "teacher 1.00x" in rows and f"student {math.exp(student) / 63.0:.2f}x" in rows, text
    for w in words:
        assert w in text, text
    assert verdict({"teacher_val_loss": None}, TrainConfig(val_fraction=0.0)).startswith("verdict: no validation rows")


@pytest.mark.parametrize("target", ["heads", "output"])
def test_transfer_loss_is_zero_for_the_teachers_own_attention(tiny, target):
    """liza with mu = 0 and a window longer than the input is exactly softmax attention, so the
    recorded MSE is ~0: the teacher and student sides of the transfer loss line up."""
    model, _ = linearize.load_teacher(tiny)
    linearize.convert(model, "liza", mu=0.0, window=64)
    ids = torch.randint(0, 1000, (2, 40))
    losses = run_block(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, target,
                       make_blocks(model, None)[0])
    assert sorted(losses) == [0, 1, 2]
    assert max(v.item() for v in losses.values()) < 1e-10


def test_block_inputs_are_the_teachers_hidden_states(tiny):
    """Teacher forcing: the hidden states leaving a block in transfer mode are the teacher's."""
    model, _ = linearize.load_teacher(tiny)
    ids = torch.randint(0, 1000, (2, 24))
    outputs = []
    hooks = [layer.register_forward_hook(lambda m, a, o: outputs.append(o)) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    linearize.convert(model, "lizard")
    captured = []
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        run_block(model, batch, "heads", Block(0, 2, (0, 1)), capture=captured)
        run_block(model, batch, "heads", Block(2, 3, (2,)), block_inputs=captured[0], capture=captured)
    torch.testing.assert_close(captured[0], outputs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(captured[1], outputs[2], rtol=1e-5, atol=1e-5)


def test_blockwise_transfer_lowers_every_layer(tiny, text_file, tmp_path):
    out = run(small(tiny, text_file, tmp_path / "run", block_size=1, stage1_lr=1e-2, stage2_tokens=0))
    for b in range(3):
        recs = val_records(out, f"stage1-block{b}")
        assert recs[0]["layers"] == [b]
        assert recs[-1]["layer_mse"][0] < recs[0]["layer_mse"][0]
    assert (out / "stage1_layer_mse.png").is_file()


def test_methods_without_attention_parameters_skip_stage1(tiny, text_file, tmp_path):
    out = run(small(tiny, text_file, tmp_path / "run", method="liza", mu_steps=4))
    events = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert any(e.get("event") == "stage1_skipped" for e in events)
    assert not val_records(out, "stage1")
    meta = json.loads((out / "linearize.json").read_text())
    assert meta["overrides"]["mu"] == pytest.approx(0.5)  # the ramp ended at 0.5 and the checkpoint keeps it
    model, _ = linearize.load(out)
    assert all(float(m.hybrid.mu) == pytest.approx(0.5) for m in linearize.models.convert.linearized_layers(model))


def test_distillation_adds_a_kl_term(tiny, text_file, tmp_path):
    out = run(small(tiny, text_file, tmp_path / "run", stage1_tokens=0, distill=0.5))
    train = [json.loads(line) for line in open(out / "metrics.jsonl")]
    kls = [r["kl"] for r in train if r.get("stage") == "stage2" and r.get("split") == "train"]
    assert kls and all(k > 0 for k in kls)


def _memory_and_rest(model) -> tuple[dict, dict]:
    """A student's memory parameters (decay gate, write strength) and its other attention parameters,
    by name."""
    from linearize.train.transfer import MEMORY_MODULES

    memory, rest = {}, {}
    for m in linearize.models.convert.linearized_layers(model):
        for name, p in m.hybrid.named_parameters():
            (memory if name.split(".")[0] in MEMORY_MODULES else rest)[f"{m.layer_idx}.{name}"] = p.detach().clone()
    return memory, rest


def _trained(out) -> tuple[dict, dict]:
    return _memory_and_rest(linearize.load(out)[0])


@pytest.fixture(scope="module")
def fresh_gdn(tiny):
    """The parameters a lizard-gdn conversion of the tiny model starts from (its init is deterministic)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    return _memory_and_rest(linearize.models.convert.convert(model, "lizard-gdn"))


def test_stage1_can_leave_the_memory_as_initialised(tiny, text_file, tmp_path, fresh_gdn):
    init_memory, init_rest = fresh_gdn
    kw = dict(method="lizard-gdn", stage2_tokens=0, stage1_lr=1e-2)
    kept, trained = _trained(run(small(tiny, text_file, tmp_path / "kept", stage1_memory=False, **kw)))
    assert kept.keys() == init_memory.keys() and len(kept) == 3 * 5  # 3 layers x (gate w, b, log_a; beta w, b)
    assert all(torch.equal(kept[n], init_memory[n]) for n in kept)
    assert any(not torch.equal(trained[n], init_rest[n]) for n in trained)  # the window weight, the sinks
    memory, _ = _trained(run(small(tiny, text_file, tmp_path / "default", **kw)))
    assert all(not torch.equal(memory[n], init_memory[n]) for n in memory if not n.endswith("log_a"))


@pytest.mark.parametrize("train_attention", [False, True])
def test_stage2_trains_the_attention_modules_only_when_asked(tiny, text_file, tmp_path, fresh_gdn, train_attention):
    out = run(small(tiny, text_file, tmp_path / "run", method="lizard-gdn", stage1_tokens=0, stage2_lr=1e-2,
                    stage2_attention=train_attention))
    memory, rest = _trained(out)
    init = {**fresh_gdn[0], **fresh_gdn[1]}
    changed = {n for n, p in {**memory, **rest}.items() if not torch.equal(p, init[n])}
    if train_attention:
        assert {n for n in memory if n.endswith("gate.bias") or n.startswith(tuple(f"{i}.beta" for i in range(3)))} <= changed
        assert any(n.endswith("alpha") for n in changed)
    else:
        assert not changed


# ------------------------------------------------------------------------------------- resume


def _short_notes(path, n: int = 80) -> str:
    """A JSONL file of documents far shorter than a row (about ten tokens each)."""
    path.write_text("\n".join(json.dumps({"text": f"Note {i}: {i} is {i % 7} mod 7."}) for i in range(n)))
    return str(path)


# micro-batches: inside stage 1 / inside stage 2; on prose (long documents) or with short notes that
# "pack" puts several to a row
@pytest.mark.parametrize("kill_at,short_docs", [(4, False), (11, False), (4, True)])
def test_resume_reaches_the_uninterrupted_weights(tiny, text_file, tmp_path, monkeypatch, kill_at, short_docs,
                                                  capsys):
    config = dict(stage1_lr=1e-2, stage2_lr=1e-2, lr_schedule="cosine", warmup_steps=2)
    if short_docs:
        from transformers import AutoTokenizer

        from linearize.train.run import _rows

        config.update(packing="pack", data=f"{_short_notes(tmp_path / 'notes.jsonl')}:0.5,{text_file}:0.5")
        tok = AutoTokenizer.from_pretrained(tiny)
        rows, _ = _rows(small(tiny, text_file, tmp_path / "probe", **config).validate(), tok)
        ends = ((rows.input_ids == tok.eos_token_id) & rows.attention_mask).sum(1)
        assert rows.fill > 0.9 and ends.max() > 1  # full rows, several documents in some
    whole = run(small(tiny, text_file, tmp_path / "whole", **config))

    calls = {"n": 0}
    real = loop_module.batch_indices

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == kill_at:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "batch_indices", dying)
    with pytest.raises(KeyboardInterrupt):
        run(small(tiny, text_file, tmp_path / "resumed", **config))
    assert not (tmp_path / "resumed" / "linearize.json").exists()
    monkeypatch.setattr(loop_module, "batch_indices", real)
    capsys.readouterr()
    resumed = run(small(tiny, text_file, tmp_path / "resumed", **config), resume=True)
    said = capsys.readouterr().out  # progress is off, and the resume still says what it does
    assert said.startswith(f"resuming {tmp_path / 'resumed'}: loading"), said
    if kill_at == 4:  # killed in stage 1 at its 4th step; the last resume state was saved after step 2
        assert "stage1: resuming at step 2 of 6" in said, said
    else:  # killed in stage 2: stage 1 had finished
        assert "stage1: finished before the interruption; skipped" in said and "stage2: resuming at step" in said

    a, b = load_file(str(whole / "adapter.safetensors")), load_file(str(resumed / "adapter.safetensors"))
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    steps = lambda out: [(r["stage"], r["step"]) for r in map(json.loads, open(out / "metrics.jsonl")) if "split" in r]
    assert steps(whole) == steps(resumed)  # no duplicated records from the killed run


def test_resume_refuses_changed_settings_and_missing_runs(tiny, text_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        run(small(tiny, text_file, tmp_path / "none"), resume=True)
    out = run(small(tiny, text_file, tmp_path / "run", stage1_tokens=0, stage2_tokens=64))
    with pytest.raises(ValueError, match=r"stage2_lr"):
        run(small(tiny, text_file, out, stage1_tokens=0, stage2_tokens=64, stage2_lr=1e-3), resume=True)
    with pytest.raises(ValueError, match="not empty.*--resume"):
        run(small(tiny, text_file, out, stage1_tokens=0, stage2_tokens=64))


# ---------------------------------------------------------------------------------- non-finite


def _toy_stage(bad_steps: set[int], steps: int = 6):
    layer = torch.nn.Linear(4, 1)
    calls = {"step": 0}

    def loss_fn(batch):
        x = batch["input_ids"].float()[:, :4]
        loss = layer(x).pow(2).mean()
        return (loss * float("nan") if calls["step"] in bad_steps else loss), {}

    def before_step(step):
        calls["step"] = step

    return layer, Stage("toy", dict(layer.named_parameters()), loss_fn, None, steps, 1e-2, before_step)


def _toy_rows():
    return pack([list(range(1, 40)), list(range(50, 90))], 8, "split", min_tokens=4)


def test_a_non_finite_loss_skips_the_step_and_is_counted(tmp_path):
    layer, stage = _toy_stage({1, 3})
    before = {}

    def snapshot(step):
        before[step] = layer.weight.detach().clone()

    inner = stage.before_step
    stage.before_step = lambda s: (inner(s), snapshot(s))
    summary = fit(stage, _toy_rows(), TrainConfig(progress=False, val_fraction=0.0), torch.device("cpu"),
                  tmp_path / "toy.pt", MetricsLog(tmp_path / "m.jsonl"), resume=False)
    assert summary["nonfinite_steps"] == 2 and summary["steps"] == 6
    assert torch.equal(before[1], before[2]) and torch.equal(before[3], before[4])  # skipped: no update
    assert not torch.equal(before[0], before[1])
    events = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [e["step"] for e in events if e.get("event") == "nonfinite"] == [2, 4]
    assert all(math.isfinite(p) for p in layer.weight.flatten().tolist())


def test_repeated_non_finite_losses_stop_training_clearly(tmp_path):
    _, stage = _toy_stage(set(range(100)), steps=50)
    with pytest.raises(NonFiniteLossError, match=r"not finite for 3 steps in a row.*learning rate"):
        fit(stage, _toy_rows(), TrainConfig(progress=False, val_fraction=0.0, max_nonfinite=3),
            torch.device("cpu"), tmp_path / "toy.pt", MetricsLog(tmp_path / "m.jsonl"), resume=False)


# ---------------------------------------------------------------------------------- schedules


def test_mu_schedules():
    assert mu_at(0, "ramp", 100) == pytest.approx(0.01) and mu_at(100, "ramp", 100) == pytest.approx(0.5)
    assert mu_at(50, "ramp", 100) == pytest.approx(0.255) and mu_at(500, "ramp", 100) == pytest.approx(0.5)
    assert mu_at(99, "switch", 100) == pytest.approx(0.01) and mu_at(100, "switch", 100) == pytest.approx(0.5)
    assert mu_at(100, "cyclic", 100) == pytest.approx(0.5) and mu_at(200, "cyclic", 100) == pytest.approx(0.01)
    assert mu_at(150, "cyclic", 100) == pytest.approx(0.255)
    assert mu_at(7, "constant", 100, constant=0.3) == 0.3
    with pytest.raises(ValueError, match="mu_schedule"):
        mu_at(0, "sawtooth", 10)


def test_cosine_warmup_shape():
    lrs = [cosine_with_warmup(s, 100, 10) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[100] == pytest.approx(0.1)


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("field,value,message", [
    ("method", "mamba", "method must be one of"),
    ("packing", "greedy", "packing must be one of"),
    ("seq_len", 0, "seq_len must be a positive integer"),
    ("stage1_lr", -1.0, "stage1_lr must be a number > 0"),
    ("val_fraction", 0.9, r"val_fraction must be a number in \[0.0, 0.5\]"),
    ("distill", 2, r"distill must be a number in \[0.0, 1.0\]"),
    ("transfer_target", "logits", "transfer_target must be one of"),
    ("overrides", {"windw": 3}, r"unknown override\(s\) \['windw'\]"),
    ("lora_targets", [], "lora_targets must be a non-empty list"),
    ("device", "tpu", "device must be"),
])
def test_bad_settings_are_named(field, value, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run(TrainConfig(**{field: value, "out": str(tmp_path / "run")}))
    assert not (tmp_path / "run").exists()


def test_missing_and_empty_data_leave_nothing_behind(tiny, text_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        run(small(tiny, str(tmp_path / "missing.txt"), tmp_path / "a"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="no text found"):
        run(small(tiny, str(tmp_path / "empty.txt"), tmp_path / "b"))
    with pytest.raises(ValueError, match="lora_targets.*gate_proj_x"):
        run(small(tiny, text_file, tmp_path / "c", lora_targets=["gate_proj_x"]))
    assert not any((tmp_path / d).exists() for d in "abc")


def test_gradient_accumulation_matches_the_larger_batch(tmp_path):
    rows = pack([list(range(1, 33)), list(range(40, 72)), list(range(80, 112)), list(range(120, 152))], 8, "split",
                min_tokens=4)
    weights = []
    for batch_size, accum in [(2, 1), (1, 2)]:
        torch.manual_seed(0)
        layer, stage = _toy_stage(set(), steps=4)
        config = TrainConfig(progress=False, val_fraction=0.0, batch_size=batch_size, grad_accum=accum, clip=0.0)
        fit(stage, rows, config, torch.device("cpu"), tmp_path / f"{accum}.pt", MetricsLog(tmp_path / "m.jsonl"), False)
        weights.append(layer.weight.detach().clone())
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-6, atol=1e-7)


def test_early_stopping_keeps_the_best_weights(tmp_path):
    layer, stage = _toy_stage(set(), steps=50)
    history = []

    def eval_fn():  # validation gets worse after the second evaluation
        history.append(layer.weight.detach().clone())
        return [3.0, 1.0, 2.0, 2.5, 2.7][min(len(history) - 1, 4)], {}

    stage.eval_fn = eval_fn
    config = TrainConfig(progress=False, eval_every=2, early_stop_patience=2, lr_schedule="constant")
    summary = fit(stage, _toy_rows(), config, torch.device("cpu"), tmp_path / "toy.pt",
                  MetricsLog(tmp_path / "m.jsonl"), resume=False)
    assert summary["stopped_early"] and summary["steps"] == 6 and summary["best_val"] == 1.0
    assert torch.equal(layer.weight, history[1])  # the weights of the best evaluation (step 2)


def test_run_on_a_weighted_mixture_with_loss_on_assistant(tiny, text_file, tmp_path, monkeypatch):
    """A whole run on a compressed chat file mixed with plain text, loss on the answers only (issue 43):
    it trains, validates on both sources, and records the spec and loss_on in its checkpoint."""
    import lzma

    chats = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                           {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(60)]
    chat = tmp_path / "chat.jsonl.xz"
    with lzma.open(chat, "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(c) for c in chats))
    spec = f"{chat}:0.5,{text_file}:0.5"
    out = run(small(tiny, text_file, tmp_path / "run", data=spec, loss_on="assistant", val_fraction=0.1))
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["student_val_loss"]) and math.isfinite(summary["teacher_val_loss"])
    assert all(math.isfinite(r["loss"]) for r in val_records(out, "stage2"))
    model, _ = linearize.load(out)
    assert model.linearize_spec["training"]["data"] == spec
    assert model.linearize_spec["training"]["loss_on"] == "assistant"
    # the same run with the loss averaged per document: stage 2's batches carry each label's weight,
    # 1 / its document's labels (a chat's answer, or a row-long piece of the prose)
    import importlib

    run_module = importlib.import_module("linearize.train.run")  # (linearize.train.run is also the function)
    seen = []

    def spy(model, batch, teacher, config):
        seen.append(batch)
        return lm_loss(model, batch, teacher, config)

    lm_loss = run_module.lm_loss
    monkeypatch.setattr(run_module, "lm_loss", spy)
    out2 = run(small(tiny, text_file, tmp_path / "run2", data=spec, loss_on="assistant", val_fraction=0.1,
                     loss_average="document"))
    assert seen and all("loss_weight" in b for b in seen)
    for b in seen:
        w, labelled = b["loss_weight"], b["labels"] != -100
        assert torch.equal(w > 0, labelled)
        assert 1.0 <= float(w.sum()) <= labelled.sum()  # at least one whole piece, at most one a token
    assert any(float(b["loss_weight"].sum()) < (b["labels"] != -100).sum() for b in seen)
    assert all(math.isfinite(r["loss"]) for r in val_records(out2, "stage2"))
    assert linearize.load(out2)[0].linearize_spec["training"]["loss_average"] == "document"


def test_a_block_after_a_softmax_layer_starts_from_its_output(tiny, text_file, tmp_path):
    """softmax_layers=[0], block_size=1: the first block is layer 1, and its inputs are the teacher's
    hidden states leaving layer 0 (not the embeddings), so its untrained loss is the one the
    whole-model transfer measures for layer 1; block 2's likewise (teacher forcing)."""
    kw = dict(softmax_layers=[0], stage1_tokens=32 * 2, stage2_tokens=0)
    whole = val_records(run(small(tiny, text_file, tmp_path / "whole", **kw)), "stage1")[0]
    out = run(small(tiny, text_file, tmp_path / "blocks", block_size=1, **kw))
    blocks = [val_records(out, f"stage1-block{b}")[0] for b in range(2)]
    assert whole["layers"] == [1, 2] and [r["layers"] for r in blocks] == [[1], [2]]
    assert [r["layer_mse"][0] for r in blocks] == pytest.approx(whole["layer_mse"], rel=1e-5)
