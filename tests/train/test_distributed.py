"""Training on two processes (torchrun, gloo, CPU) equals training on one with the same global
batch, for both stages; rank 0 alone writes, and its checkpoint loads in one process; a run whose
rank is killed resumes to the uninterrupted weights; bad setups are named."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import linearize
from linearize.train import TrainConfig, run
from linearize.train import distributed

from fixtures import tiny_model_dir

torch.set_num_threads(1)

WORKER = Path(__file__).with_name("distributed_worker.py")
SRC = Path(linearize.__file__).resolve().parents[1]


def settings(tiny, text_file, out, **kw) -> dict:
    """Both stages, 3 optimizer steps each of 2 micro-batches of 4 rows; split packing, so the
    ranks' shares of a micro-batch hold different numbers of real tokens."""
    base = dict(model=tiny, data=text_file, out=str(out), seq_len=32, batch_size=4, grad_accum=2,
                stage1_tokens=32 * 4 * 2 * 3, stage2_tokens=32 * 4 * 2 * 3, eval_every=2, save_every=2, val_rows=4,
                progress=False, warmup_steps=0, stage1_lr=1e-2, stage2_lr=1e-2, device="cpu",
                packing="split")
    return {**base, **kw}


def torchrun(args: list[str], nproc: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    environ = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, env=environ, timeout=300)


def worker(config: dict, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return torchrun([str(WORKER), json.dumps(config), *extra], env=env)


def records(out) -> list[dict]:
    return [r for r in map(json.loads, open(Path(out) / "metrics.jsonl")) if "split" in r]


def cli_flags(config: dict) -> list[str]:
    flags = []
    for key, value in config.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag if value else "--no-" + key.replace("_", "-")] if isinstance(value, bool) else [flag, str(value)]
    return flags


@pytest.fixture(scope="module")
def two_runs(tiny, text_file, tmp_path_factory):
    """The same config on one process (``run``) and on two (``torchrun -m linearize.cli train``)."""
    root = tmp_path_factory.mktemp("runs")
    one = run(TrainConfig(**settings(tiny, text_file, root / "one")))
    done = torchrun(["-m", "linearize.cli", "train", *cli_flags(settings(tiny, text_file, root / "two"))])
    assert done.returncode == 0, done.stderr[-3000:]
    return one, root / "two", done


def test_two_processes_train_as_one_for_both_stages(two_runs):
    one, two, done = two_runs
    a, b = records(one), records(two)  # rank 0 alone wrote: no record twice
    assert [(r["stage"], r["split"], r["step"]) for r in a] == [(r["stage"], r["split"], r["step"]) for r in b]
    assert {r["stage"] for r in b} == {"stage1", "stage2"} and len(b) == 12
    for x, y in zip(a, b):
        assert x.get("tokens") == y.get("tokens")  # every rank's tokens counted once
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7), (x, y)
        if "layer_mse" in x:
            assert y["layer_mse"] == pytest.approx(x["layer_mse"], rel=1e-5, abs=1e-8)
    wa, wb = load_file(str(one / "adapter.safetensors")), load_file(str(two / "adapter.safetensors"))
    assert set(wa) == set(wb) and any("lora_" in k for k in wa) and any(".hybrid." in k for k in wa)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)
    summary, alone = (json.loads((out / "summary.json").read_text()) for out in (two, one))
    assert summary["processes"] == 2 and len(summary["stages"][0]["ranks"]) == 2
    for key in ("teacher_val_loss", "stage1_val_loss", "student_val_loss"):
        assert summary[key] == pytest.approx(alone[key], rel=1e-5), key
    assert done.stdout.count(str(two)) == 1  # rank 0 alone prints the run directory


def test_a_two_rank_checkpoint_loads_in_one_process(two_runs):
    one, two, _ = two_runs
    ids = torch.randint(0, 1000, (2, 24))
    with torch.no_grad():
        logits = [linearize.load(out)[0](input_ids=ids).logits for out in (one, two)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("softmax_layers", [None, [1]])
def test_teacher_attention_gives_the_teachers_logits(tiny, softmax_layers):
    """Several processes take the teacher's validation loss from the converted, sharded model (no
    second copy of the weights): with ``teacher_attention`` its logits are the teacher's."""
    from linearize.train.transfer import teacher_attention

    model, _ = linearize.load_teacher(tiny)
    ids = torch.randint(0, 1000, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # a padded row
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        linearize.convert(model, "lizard", softmax_layers=softmax_layers)
        with teacher_attention(model):
            got = model(input_ids=ids, attention_mask=mask).logits
        student = model(input_ids=ids, attention_mask=mask).logits  # and afterwards the student again
    torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1, :17], expected[1, :17], rtol=1e-4, atol=1e-4)
    assert (student - expected).abs().max() > 1e-3


def test_ranks_with_different_settings_are_named(tiny, text_file, tmp_path):
    done = worker(settings(tiny, text_file, tmp_path / "run"), env={"SEED_BY_RANK": "1"})
    assert done.returncode != 0
    assert "rank 1 has seed=1 where rank 0 has seed=0" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_batch_the_processes_cannot_split_is_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"batch_size 3 does not divide across 2 processes.*multiple of 2"):
        distributed.setup(TrainConfig(batch_size=3, device="cpu"))


def test_a_missing_backend_is_named(monkeypatch):
    monkeypatch.setattr(distributed.dist, "is_nccl_available", lambda: False)
    with pytest.raises(ValueError, match=r"'nccl' backend that cuda ranks need is not available.*--device cpu"):
        distributed.backend_for(torch.device("cuda", 0))
    assert distributed.backend_for(torch.device("cpu")) == "gloo"


@pytest.mark.slow
def test_a_killed_rank_resumes_to_the_uninterrupted_weights(two_runs, tiny, text_file, tmp_path):
    """Rank 1 is SIGKILLed in stage 2's third step (its 11th micro-batch; the last resume state is
    from step 2); ``--resume`` on two processes ends with the uninterrupted run's weights."""
    _, whole, _ = two_runs
    config = settings(tiny, text_file, tmp_path / "resumed")
    killed = worker(config, env={"KILL_RANK1_AT": "11"})
    assert killed.returncode != 0 and "Signal 9 (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    assert not (tmp_path / "resumed" / "linearize.json").exists()
    resumed = torchrun(["-m", "linearize.cli", "train", "--resume", "--out", str(tmp_path / "resumed")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout
    assert "stage1: finished before the interruption; skipped" in said and "stage2: resuming at step 2 of 3" in said
    a, b = load_file(str(whole / "adapter.safetensors")), load_file(str(tmp_path / "resumed" / "adapter.safetensors"))
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    steps = lambda out: [(r["stage"], r["step"], r["loss"]) for r in records(out)]
    assert steps(whole) == steps(tmp_path / "resumed")


@pytest.mark.slow
def test_block_parallel_stage1_equals_sequential(text_file, tmp_path):
    """--block-size 1 on four layers, layer 0 kept softmax, and two ranks: rank 0 trains blocks 0
    and 2 (layers 1 and 3) while rank 1 trains block 1, from block inputs shared through files (the
    first block's too: layer 0's output); every block ends where the one-process sequential run's
    does, and stage 2 (data parallel) goes on from there."""
    four = str(tiny_model_dir(tmp_path / "model", num_layers=4))
    config = settings(four, text_file, tmp_path / "one", block_size=1, grad_accum=1, stage2_tokens=32 * 4 * 2,
                      softmax_layers=[0])
    one = run(TrainConfig(**config))
    done = torchrun(["-m", "linearize.cli", "train", *cli_flags({**config, "out": str(tmp_path / "two")})])
    assert done.returncode == 0, done.stderr[-3000:]
    two = tmp_path / "two"
    a, b = records(one), records(two)
    assert [(r["stage"], r["split"], r["step"]) for r in a] == [(r["stage"], r["split"], r["step"]) for r in b]
    assert {r["stage"] for r in b} == {f"stage1-block{i}" for i in range(3)} | {"stage2"}
    for x, y in zip(a, b):
        if x["stage"].startswith("stage1"):  # the same computations, block by block
            assert (x["loss"], x["layer_mse"], x["tokens"]) == (y["loss"], y["layer_mse"], y["tokens"]), (x, y)
        else:
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x, y)
    wa, wb = load_file(str(one / "adapter.safetensors")), load_file(str(two / "adapter.safetensors"))
    for k in wa:
        if ".hybrid." in k:
            assert torch.equal(wa[k], wb[k]), k
        else:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)
    assert not (two / "state" / "block_inputs").exists()  # the shared block inputs are removed
    assert not list((two / "state").glob("metrics-*"))  # the blocks' own logs are merged


@pytest.mark.slow
def test_output_target_on_two_processes_equals_one(tiny, text_file, tmp_path):
    """transfer_target "output": stage 1's loss goes back through the frozen output projection,
    whose sharded weight must stay gathered until backward."""
    config = settings(tiny, text_file, tmp_path / "one", transfer_target="output", stage2_tokens=0)
    one = run(TrainConfig(**config))
    done = worker({**config, "out": str(tmp_path / "two")})
    assert done.returncode == 0, done.stderr[-3000:]
    for x, y in zip(records(one), records(tmp_path / "two"), strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-9), (x, y)
    wa, wb = load_file(str(one / "adapter.safetensors")), load_file(str(tmp_path / "two" / "adapter.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)


def test_encoders_refuse_several_processes(monkeypatch, tmp_path):
    from linearize.train.encoder import run_encoder

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"encoder methods train on one process; 'lion-s' was launched on 2"):
        run_encoder(TrainConfig(method="lion-s", out=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_one_process_run_resumes_on_two(two_runs, tiny, text_file, tmp_path, monkeypatch):
    """The resume state has the one-process format whoever wrote it: a run interrupted on one
    process (in stage 2, last saved at its step 2) finishes on two with the one-process weights."""
    from linearize.train import loop as loop_module

    one, _, _ = two_runs
    real, calls = loop_module.batch_indices, [0]

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 11:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "batch_indices", dying)
    with pytest.raises(KeyboardInterrupt):
        run(TrainConfig(**settings(tiny, text_file, tmp_path / "moved")))
    resumed = torchrun(["-m", "linearize.cli", "train", "--resume", "--out", str(tmp_path / "moved")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "stage2: resuming at step 2 of 3" in resumed.stdout
    a, b = load_file(str(one / "adapter.safetensors")), load_file(str(tmp_path / "moved" / "adapter.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    assert [(r["stage"], r["step"]) for r in records(one)] == [(r["stage"], r["step"]) for r in records(tmp_path / "moved")]


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_skips_the_step_on_all(tiny, text_file, tmp_path, monkeypatch):
    """Rank 1's loss is NaN in the first micro-batch of step 2: every rank skips that step (none
    waits in a collective the others left), as one process skips it when its micro-batch's loss is NaN."""
    import sys as _sys

    run_module = importlib.import_module("linearize.train.run")
    _sys.path.insert(0, str(WORKER.parent))
    from distributed_worker import nan_at_call

    config = settings(tiny, text_file, tmp_path / "one", stage2_tokens=0)
    monkeypatch.setattr(run_module, "transfer_loss", nan_at_call(run_module.transfer_loss, 3))
    one = run(TrainConfig(**config))
    done = worker({**config, "out": str(tmp_path / "two")}, env={"NAN_RANK1_AT": "3"})
    assert done.returncode == 0, done.stderr[-3000:]
    events = lambda out: [r for r in map(json.loads, open(Path(out) / "metrics.jsonl")) if r.get("event")]
    assert events(one) == events(tmp_path / "two") == [{"event": "nonfinite", "stage": "stage1", "step": 2}]
    assert [r["step"] for r in records(tmp_path / "two") if r["split"] == "train"] == [1, 3]
    wa, wb = load_file(str(one / "adapter.safetensors")), load_file(str(tmp_path / "two" / "adapter.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)
