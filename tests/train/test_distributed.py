"""Training on two processes (torchrun, gloo, CPU) equals training on one with the same global
batch, for both stages; rank 0 alone writes, and its checkpoint loads in one process; a run whose
rank is killed resumes to the uninterrupted weights; bad setups are named. The two-process runs
share two torchrun launches (distributed_worker.py plays several runs in one), once per session."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

import linearize
from linearize.train import TrainConfig, run
from linearize.train import distributed

from fixtures import tiny_model_dir
from helpers import once_per_session

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


def output_settings(tiny, text_file, out) -> dict:
    return settings(tiny, text_file, out, transfer_target="output", stage2_tokens=0)


def nan_settings(tiny, text_file, out) -> dict:
    return settings(tiny, text_file, out, stage2_tokens=0)


def block_settings(four, text_file, out) -> dict:
    return settings(four, text_file, out, block_size=1, grad_accum=1, stage2_tokens=32 * 4 * 2, softmax_layers=[0])


def torchrun(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    environ = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=environ, timeout=600)


def records(out) -> list[dict]:
    return [r for r in map(json.loads, open(Path(out) / "metrics.jsonl")) if "split" in r]


def cli_flags(config: dict) -> list[str]:
    flags = []
    for key, value in config.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag if value else "--no-" + key.replace("_", "-")] if isinstance(value, bool) else [flag, str(value)]
    return flags


# The two-process runs, in the order a launch plays them (see distributed_worker.py). A launch
# costs each rank torch's and transformers' imports, so the scenarios share launches: the first
# holds every run that starts afresh and ends with the one whose rank 1 is killed; the second
# resumes the interrupted runs.
FIRST_LAUNCH = ("cli", "mismatch", "output", "nan", "block", "replicate", "nan_replicate", "bf16", "kill")
SECOND_LAUNCH = ("resume_killed", "resume_moved")


@dataclass
class Launched:
    """Each scenario's run directory, each rank's record of it, and the launch that played it
    (``{"returncode", "stderr"}``: torchrun's exit code and its stderr)."""

    dirs: dict[str, Path]
    logs: Path
    launches: dict[str, dict]
    checkpoint_before_resume: bool | None = None  # did the killed run leave a checkpoint?

    def outcomes(self, name: str) -> list[dict | None]:
        """Each rank's ``{"error", "exit"}`` for the scenario (None: that rank did not finish it)."""
        paths = [self.logs / f"{name}.rank{rank}.json" for rank in range(2)]
        return [json.loads(p.read_text()) if p.is_file() else None for p in paths]

    def said(self, name: str) -> str:
        """The scenario's stdout, rank 0's then rank 1's."""
        return "".join((self.logs / f"{name}.rank{rank}.out").read_text() for rank in range(2))

    def finished(self, name: str) -> Path:
        """The scenario's run directory, once every rank finished the scenario without an error."""
        outcomes, stderr = self.outcomes(name), self.launches[name]["stderr"]
        assert all(o is not None and o["error"] is None for o in outcomes), (outcomes, stderr[-3000:])
        return self.dirs[name]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """A tiny random Llama of four layers (block-parallel stage 1 needs three blocks)."""
    return str(tiny_model_dir(tmp_path_factory.mktemp("four") / "model", num_layers=4))


@pytest.fixture(scope="module")
def one_run(request, tiny, text_file, tmp_path_factory) -> Path:
    """``settings`` trained on one process, the reference of the two-process runs (once per session)."""
    make = lambda folder: run(TrainConfig(**settings(tiny, text_file, folder / "one")))
    return once_per_session(request, tmp_path_factory, "distributed-one-run", make) / "one"


@pytest.fixture(scope="module")
def launched(request, tiny, four, text_file, tmp_path_factory) -> Launched:
    """The two-process scenarios that this session's selected tests of this module name in their
    ``launched`` marks, played in at most two torchrun launches, once per session (the xdist
    workers share them)."""
    wanted = set()
    for item in request.session.items:
        mark = item.get_closest_marker("launched") if getattr(item, "module", None) is request.module else None
        wanted |= set(mark.args) if mark else set()
    play = lambda root: play_scenarios(sorted(wanted), root, tiny, four, text_file)
    root = once_per_session(request, tmp_path_factory, "distributed-launched", play)
    return Launched(scenario_dirs(root), root / "logs", **json.loads((root / "launches.json").read_text()))


def scenario_dirs(root: Path) -> dict[str, Path]:
    dirs = {name: root / name for name in FIRST_LAUNCH}
    dirs.update(resume_killed=dirs["kill"], resume_moved=root / "moved")
    return dirs


def play_scenarios(wanted: list[str], root: Path, tiny: str, four: str, text_file: str) -> None:
    """Launches the ``wanted`` scenarios with their run directories, logs and launches.json under ``root``."""
    dirs, logs = scenario_dirs(root), root / "logs"
    logs.mkdir()
    plans = {
        "cli": {"cli": ["train", *cli_flags(settings(tiny, text_file, dirs["cli"]))]},
        "mismatch": {"config": settings(tiny, text_file, dirs["mismatch"]), "seed_by_rank": True,
                     "expect_error": True},
        "output": {"config": output_settings(tiny, text_file, dirs["output"])},
        "nan": {"config": nan_settings(tiny, text_file, dirs["nan"]), "nan_rank1_at": 3},
        "block": {"cli": ["train", *cli_flags(block_settings(four, text_file, dirs["block"]))]},
        "replicate": {"cli": ["train", *cli_flags(settings(tiny, text_file, dirs["replicate"], shard="replicate"))]},
        "nan_replicate": {"config": nan_settings(tiny, text_file, dirs["nan_replicate"]) | {"shard": "replicate"},
                          "nan_rank1_at": 3},
        "bf16": {"config": settings(tiny, text_file, dirs["bf16"], precision="bf16")},
        # rank 1 is SIGKILLed in stage 2's third step (its 11th micro-batch; the last resume
        # state is from step 2)
        "kill": {"config": settings(tiny, text_file, dirs["kill"]), "kill_rank1_at": 11},
        "resume_killed": {"cli": ["train", "--resume", "--out", str(dirs["resume_killed"])]},
        "resume_moved": {"cli": ["train", "--resume", "--out", str(dirs["resume_moved"])]},
    }
    result = {"launches": {}}

    def launch(names: list[str]) -> None:
        if not names:
            return
        plan = root / f"plan-{names[0]}.json"
        plan.write_text(json.dumps({"logs": str(logs), "scenarios": [{"name": n, **plans[n]} for n in names]}))
        done = torchrun([str(WORKER), str(plan)])
        # (a scenario that failed, or never ran, fails the tests that read it: ``finished``)
        result["launches"].update(dict.fromkeys(names, {"returncode": done.returncode, "stderr": done.stderr}))

    launch([n for n in FIRST_LAUNCH if n in wanted])
    if "kill" in wanted:
        result["checkpoint_before_resume"] = (dirs["kill"] / "linearize.json").exists()
    if "resume_moved" in wanted:
        interrupt_one_process_run(TrainConfig(**settings(tiny, text_file, dirs["resume_moved"])))
    launch([n for n in SECOND_LAUNCH if n in wanted])
    (root / "launches.json").write_text(json.dumps(result))


def interrupt_one_process_run(config: TrainConfig) -> None:
    """``config`` run on one process until its 11th micro-batch (stage 2's third step), where a
    KeyboardInterrupt stops it: the resume state is from stage 2's step 2."""
    from linearize.train import loop as loop_module

    real, calls = loop_module.batch_indices, [0]

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 11:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop_module, "batch_indices", dying)
        with pytest.raises(KeyboardInterrupt):
            run(config)


@pytest.mark.launched("cli", "replicate")
@pytest.mark.parametrize("scenario", ["cli", "replicate"])
def test_two_processes_train_as_one_for_both_stages(one_run, launched, scenario):
    """FSDP2 on CPU ranks (``shard`` auto) and whole copies with gradients averaged (``replicate``)."""
    one, two = one_run, launched.finished(scenario)
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
    assert launched.said(scenario).count(str(two)) == 1  # rank 0 alone prints the run directory


@pytest.mark.launched("bf16")
def test_two_processes_under_bf16_autocast_train_as_one(tiny, text_file, tmp_path, launched):
    """Under bf16 autocast the sharded ranks gather the decoder layers in bf16; both stages reach the
    one-process run's losses within bf16 noise, and its weights within a third of their size (Adam
    turns bf16 rounding of small gradients into whole steps: LoRA's B, from zero, ends 11% apart)."""
    one = tmp_path / "one"
    run(TrainConfig(**settings(tiny, text_file, one, precision="bf16")))
    two = launched.finished("bf16")
    a, b = records(one), records(two)
    assert [(r["stage"], r["split"], r["step"]) for r in a] == [(r["stage"], r["split"], r["step"]) for r in b]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=2e-2), (x, y)
    wa, wb = load_file(str(one / "adapter.safetensors")), load_file(str(two / "adapter.safetensors"))
    assert set(wa) == set(wb)
    for k in wa:
        apart, moved = (wb[k] - wa[k]).float().norm(), wa[k].float().norm()
        assert apart <= 0.3 * moved + 1e-6, (k, float(apart), float(moved))


@pytest.mark.launched("cli")
def test_a_two_rank_checkpoint_loads_in_one_process(one_run, launched):
    one, two = one_run, launched.finished("cli")
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


@pytest.mark.launched("mismatch")
def test_ranks_with_different_settings_are_named(launched):
    for outcome in launched.outcomes("mismatch"):  # every rank refuses
        assert outcome is not None and outcome["error"] is not None, launched.launches["mismatch"]["stderr"][-3000:]
        assert "rank 1 has seed=1 where rank 0 has seed=0" in outcome["error"], outcome["error"][-3000:]
    assert not launched.dirs["mismatch"].exists()  # refused before anything was written


def test_a_batch_the_processes_cannot_split_is_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"batch_size 3 does not divide across 2 processes.*multiple of 2"):
        distributed.setup(TrainConfig(batch_size=3, device="cpu"))


def test_shard_modes(tiny):
    """``auto`` shards CPU ranks (they share one host's memory); an explicit mode is kept; a bad one is named."""
    model, _ = linearize.load_teacher(tiny)
    for shard, expected in (("auto", "fsdp"), ("replicate", "replicate"), ("fsdp", "fsdp")):
        parallel = distributed.Parallel(0, 2, torch.device("cpu"))
        assert parallel.choose_mode(TrainConfig(shard=shard, device="cpu"), [model]) == expected
        assert parallel.replicated == (expected == "replicate")
    with pytest.raises(ValueError, match=r"shard must be one of .*'replicate'.*got 'ddp'"):
        TrainConfig(shard="ddp").validate()


@pytest.fixture
def one_rank(tmp_path):
    """A process group of this process alone (gloo): FSDP2 runs as on any rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_gathers_the_decoder_layers_in_the_autocast_dtype(tiny, one_rank):
    """Under bf16 autocast a decoder layer's and the (untied) head's weights are gathered and used
    in bf16 (half of fp32's bytes on the wire) while the residual stream, the embeddings and the new
    attention modules stay fp32, and the sharded weights and their gradients stay fp32. (One rank: the dtypes are the same
    on any number.)"""
    model, _ = linearize.load_teacher(tiny)
    linearize.convert(model, "lizard")
    distributed.Parallel(0, 1, torch.device("cpu")).shard(model, torch.bfloat16)
    layers, seen = model.model.layers, {}
    attn = layers[0].self_attn
    attn.q_proj.register_forward_hook(lambda m, args, out: seen.update(q_proj=m.weight.dtype))
    inner = next(m for m in attn.hybrid.modules() if m is not attn.hybrid and list(m.parameters(recurse=False)))
    inner.register_forward_hook(  # (inside the unit's forward: its weights as gathered)
        lambda m, args, out: seen.update(hybrid={p.dtype for p in m.parameters(recurse=False)}))
    layers[1].register_forward_pre_hook(lambda m, args: seen.update(residual=args[0].dtype))
    # (units of their own: a pre-hook sees their weights as gathered, a hook as resharded)
    model.lm_head.register_forward_pre_hook(lambda m, args: seen.update(head=m.weight.dtype))
    model.model.embed_tokens.register_forward_pre_hook(lambda m, args: seen.update(embeddings=m.weight.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=torch.randint(0, 100, (2, 12)))
    assert seen == {"q_proj": torch.bfloat16, "hybrid": {torch.float32}, "residual": torch.float32,
                    "head": torch.bfloat16, "embeddings": torch.float32}
    out.logits.float().square().mean().backward()
    for name, p in [("q_proj", attn.q_proj.weight), ("embeddings", model.model.embed_tokens.weight)]:
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name


@pytest.mark.parametrize("target", ["heads", "output"])
def test_each_stage_under_fsdp_gathers_only_what_its_backward_uses(tiny, one_rank, target):
    """Stage 1's backward needs the new modules' weights and, for the "output" target, the output
    projection's, kept from forward: no decoder layer is gathered in backward (FSDP's default
    prefetch gathered layer l-1 from layer l's new module and left it gathered to the end), and
    the head, never used in stage 1, is never gathered. Stage 2 gathers every layer and the head
    in backward. The frozen input embeddings are gathered in forward only, in both. The gradients
    are those of the unsharded model. Counted on one rank, where a gather is the same call as on
    N; the tiny model's head is untied (its own unit)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from linearize.train.run import transfer_loss
    from linearize.train.transfer import Block, freeze_all_but, trainable_attention_parameters

    gathers: list[tuple[str, str]] = []
    real_unshard = FSDPParamGroup.unshard

    def counting(self, async_op=False):
        idle = self._all_gather_result is None and not self.is_unsharded
        real_unshard(self, async_op)
        if idle and self._all_gather_result is not None:
            gathers.append((self._module_fqn, self._training_state.name))

    def step(loss_fn) -> tuple[list[str], list[str]]:
        """(units gathered in forward, units gathered in backward)"""
        gathers.clear()
        with mock.patch.object(FSDPParamGroup, "unshard", counting):
            loss = loss_fn()
            forward = len(gathers)
            loss.backward()
        return [f for f, _ in gathers[:forward]], [f for f, state in gathers[forward:] if state != "FORWARD"]

    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    grads, units = [], []
    for sharded in (False, True):
        torch.manual_seed(0)
        model, _ = linearize.load_teacher(tiny)
        linearize.convert(model, "lizard")
        parallel = distributed.Parallel(0, 1, torch.device("cpu"))
        if sharded:
            parallel.shard(model)
        freeze_all_but(model, trainable_attention_parameters(model))
        if sharded:
            parallel.stage_layout(model, target)
        units.append(step(lambda: transfer_loss(model, {"input_ids": ids}, target, Block(0, 3, (0, 1, 2)))[0]))
        stage2 = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
        freeze_all_but(model, stage2)
        if sharded:
            parallel.stage_layout(model, None)
        units.append(step(lambda: model(input_ids=ids).logits.square().mean()))
        grads.append({n: distributed.full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None})
    (_, _, (forward1, backward1), (forward2, backward2)) = units
    layers = {f"model.layers.{i}" for i in range(3)}
    new_modules = sorted(f"{name}.self_attn.hybrid" for name in layers)
    assert "lm_head" not in forward1 + backward1 and "model.embed_tokens" in forward1
    assert sorted(backward1) == (new_modules if target == "heads" else [])  # ("output": kept from forward)
    assert "model.embed_tokens" not in backward1 + backward2
    assert layers | {"lm_head"} <= set(backward2) and "lm_head" in forward2
    (whole, chosen) = grads
    assert whole.keys() == chosen.keys() and any("hybrid" in n for n in whole) and any("lm_head" in n for n in whole)
    for n in whole:
        torch.testing.assert_close(chosen[n], whole[n], rtol=1e-5, atol=1e-7, msg=n)


def test_compiled_feature_maps_under_fsdp_equal_eager(tiny, one_rank):
    """An FSDP rank compiles the feature maps and gates as one device does (on CUDA): inside the
    sharded units they see gathered weights; outputs and the new modules' gradients equal eager's."""
    from linearize.train.graphs import compile_attention_modules

    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model, _ = linearize.load_teacher(tiny)
        linearize.convert(model, "lizard")
        distributed.Parallel(0, 1, torch.device("cpu")).shard(model)
        if compiled:
            assert compile_attention_modules(model) > 0
        for _ in range(2):  # the second step finds the weights gathered anew
            logits = model(input_ids=ids).logits
            logits.square().mean().backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if ".hybrid." in n}
        results.append((logits.detach(), grads))
    (eager, g_eager), (comp, g_comp) = results
    torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)
    assert g_eager.keys() == g_comp.keys() and g_eager
    for n in g_eager:
        torch.testing.assert_close(g_comp[n], g_eager[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_missing_backend_is_named(monkeypatch):
    monkeypatch.setattr(distributed.dist, "is_nccl_available", lambda: False)
    with pytest.raises(ValueError, match=r"'nccl' backend that cuda ranks need is not available.*--device cpu"):
        distributed.backend_for(torch.device("cuda", 0))
    assert distributed.backend_for(torch.device("cpu")) == "gloo"


@pytest.mark.slow
@pytest.mark.launched("cli", "kill", "resume_killed")
def test_a_killed_rank_resumes_to_the_uninterrupted_weights(launched):
    """Rank 1 is SIGKILLed in stage 2's third step (its 11th micro-batch; the last resume state is
    from step 2); ``--resume`` on two processes ends with the uninterrupted run's weights."""
    whole = launched.finished("cli")
    killed = launched.launches["kill"]
    assert killed["returncode"] != 0 and "Signal 9 (SIGKILL)" in killed["stderr"], killed["stderr"][-3000:]
    assert launched.outcomes("kill")[1] is None  # rank 1 died in it
    assert launched.checkpoint_before_resume is False
    resumed = launched.finished("resume_killed")
    said = launched.said("resume_killed")
    assert "stage1: finished before the interruption; skipped" in said and "stage2: resuming at step 2 of 3" in said
    a, b = load_file(str(whole / "adapter.safetensors")), load_file(str(resumed / "adapter.safetensors"))
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    steps = lambda out: [(r["stage"], r["step"], r["loss"]) for r in records(out)]
    assert steps(whole) == steps(resumed)


@pytest.mark.slow
@pytest.mark.launched("block")
def test_block_parallel_stage1_equals_sequential(four, text_file, launched, tmp_path):
    """--block-size 1 on four layers, layer 0 kept softmax, and two ranks: rank 0 trains blocks 0
    and 2 (layers 1 and 3) while rank 1 trains block 1, from block inputs shared through files (the
    first block's too: layer 0's output); every block ends where the one-process sequential run's
    does, and stage 2 (data parallel) goes on from there."""
    one = run(TrainConfig(**block_settings(four, text_file, tmp_path / "one")))
    two = launched.finished("block")
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
@pytest.mark.launched("output")
def test_output_target_on_two_processes_equals_one(tiny, text_file, launched, tmp_path):
    """transfer_target "output": stage 1's loss goes back through the frozen output projection,
    whose sharded weight must stay gathered until backward."""
    one = run(TrainConfig(**output_settings(tiny, text_file, tmp_path / "one")))
    two = launched.finished("output")
    for x, y in zip(records(one), records(two), strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-9), (x, y)
    wa, wb = load_file(str(one / "adapter.safetensors")), load_file(str(two / "adapter.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)


def test_encoders_refuse_several_processes(monkeypatch, tmp_path):
    from linearize.train.encoder import run_encoder

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"encoder methods train on one process; 'lion-s' was launched on 2"):
        run_encoder(TrainConfig(method="lion-s", out=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.launched("resume_moved")
def test_a_one_process_run_resumes_on_two(one_run, launched):
    """The resume state has the one-process format whoever wrote it: a run interrupted on one
    process (in stage 2, last saved at its step 2) finishes on two with the one-process weights."""
    one, moved = one_run, launched.finished("resume_moved")
    assert "stage2: resuming at step 2 of 3" in launched.said("resume_moved")
    a, b = load_file(str(one / "adapter.safetensors")), load_file(str(moved / "adapter.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    assert [(r["stage"], r["step"]) for r in records(one)] == [(r["stage"], r["step"]) for r in records(moved)]


@pytest.mark.slow
@pytest.mark.launched("nan", "nan_replicate")
@pytest.mark.parametrize("scenario", ["nan", "nan_replicate"])
def test_a_non_finite_loss_on_one_rank_skips_the_step_on_all(tiny, text_file, launched, tmp_path, monkeypatch,
                                                              scenario):
    """Rank 1's loss is NaN in the first micro-batch of step 2: every rank skips that step (none
    waits in a collective the others left), as one process skips it when its micro-batch's loss is
    NaN; sharded and replicated."""
    sys.path.insert(0, str(WORKER.parent))
    from distributed_worker import nan_at_call

    run_module = importlib.import_module("linearize.train.run")
    monkeypatch.setattr(run_module, "transfer_loss", nan_at_call(run_module.transfer_loss, 3))
    one = run(TrainConfig(**nan_settings(tiny, text_file, tmp_path / "one")))
    two = launched.finished(scenario)
    events = lambda out: [r for r in map(json.loads, open(Path(out) / "metrics.jsonl")) if r.get("event")]
    assert events(one) == events(two) == [{"event": "nonfinite", "stage": "stage1", "step": 2}]
    assert [r["step"] for r in records(two) if r["split"] == "train"] == [1, 3]
    wa, wb = load_file(str(one / "adapter.safetensors")), load_file(str(two / "adapter.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)