"""The command line, end to end on a tiny random Llama (tests/fixtures.tiny_model_dir)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fixtures
import linearize
from linearize import cli
from linearize.cli import demo as cli_demo
from linearize.cli import train as cli_train
from linearize.cli.args import parse_int, parse_int_list
from linearize.models.checkpoint import ADAPTER_FILE, META_FILE
from linearize.train.config import TrainConfig

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog, and then"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(fixtures.tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory) -> str:
    """An untrained lizard conversion of the tiny model, written by the CLI."""
    out = tmp_path_factory.mktemp("conv") / "lizard"
    assert cli.main(["convert", "--model", tiny, "--method", "lizard", "--out", str(out), "--set", "window=8"]) == 0
    return str(out)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def parse_train(*argv) -> TrainConfig:
    return cli_train.train_config_from_args(cli.build_parser().parse_args(["train", *map(str, argv)]))


# ---------------------------------------------------------------------------- help


def test_console_script_help_and_error_in_a_subprocess(tmp_path):
    exe = Path(sys.executable).parent / "linearize"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "linearize.cli"]
    result = subprocess.run(command + ["--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for name in ("methods", "convert", "train", "generate", "demo"):
        assert name in result.stdout

    missing = tmp_path / "no-such-model"
    result = subprocess.run([sys.executable, "-m", "linearize.cli", "convert", "--model", str(missing),
                             "--method", "lizard", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("linearize: error:") and str(missing) in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_no_command_prints_help(capsys):
    code, out, _ = run_cli(capsys)
    assert code == 0 and "usage: linearize" in out and "convert" in out


def test_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and linearize.__version__ in out


HELP_FLAGS = {
    "methods": ["--verbose"],
    "convert": ["--model", "--method", "--out", "--softmax-layers", "--set", "--merged", "--overwrite"],
    "train": ["--config", "--set", "--resume"] + ["--" + f.name.replace("_", "-")
                                                  for f in dataclasses.fields(TrainConfig) if f.name != "overrides"]
             + ["--no-progress"],
    "generate": ["--model", "--prompt", "--max-new-tokens", "--temperature", "--top-p", "--seed", "--chat",
                 "--device"],
    "demo": ["--out", "--device"],
}


@pytest.mark.parametrize("command", list(HELP_FLAGS))
def test_every_command_has_help(capsys, command):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    assert f"usage: linearize {command}" in out and "examples:" in out
    for flag in HELP_FLAGS[command]:
        assert flag in out, f"{command} --help does not mention {flag}"


# ---------------------------------------------------------------------------- methods


def test_methods_lists_every_method(capsys):
    code, out, _ = run_cli(capsys, "methods")
    assert code == 0
    lines = out.splitlines()
    for name, description in linearize.methods().items():
        assert any(line.startswith(name + " ") and description in line for line in lines), name
    code, out, _ = run_cli(capsys, "methods", "-v")
    assert code == 0 and "window=128" in out and "gate=sigmoid" in out


# ---------------------------------------------------------------------------- convert


def test_convert_matches_python_conversion(capsys, tiny, tmp_path):
    out = tmp_path / "ck"
    torch.manual_seed(0)
    code, stdout, err = run_cli(capsys, "convert", "--model", tiny, "--method", "lizard", "--out", out,
                                "--softmax-layers", "1", "--set", "window=8", "--set", "gate_init=[0.9,0.99]",
                                "--set", "rope_window=false")
    assert code == 0, err
    assert str(out) in stdout and "KiB" in stdout and ADAPTER_FILE in stdout

    meta = json.loads((out / META_FILE).read_text())
    assert meta["method"] == "lizard" and meta["softmax_layers"] == [1]
    assert meta["overrides"] == {"window": 8, "gate_init": [0.9, 0.99], "rope_window": False}
    assert meta["config"]["window"] == 8 and meta["config"]["rope_window"] is False

    loaded, tokenizer = linearize.load(out)
    assert tokenizer is not None
    torch.manual_seed(0)
    reference, _ = linearize.load_teacher(tiny)
    linearize.convert(reference, "lizard", softmax_layers=[1], window=8, gate_init=(0.9, 0.99), rope_window=False)
    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_convert_default_init_is_deterministic_and_seeded_init_matches(capsys, tiny, tmp_path):
    """lizard's default initialisation does not depend on the RNG; t2r's does, and a seed fixes it."""
    from safetensors.torch import load_file

    def convert(method, seed, name):
        torch.manual_seed(seed)
        assert run_cli(capsys, "convert", "--model", tiny, "--method", method, "--out", tmp_path / name)[0] == 0
        return load_file(str(tmp_path / name / ADAPTER_FILE))

    a, b = convert("lizard", 0, "a"), convert("lizard", 1, "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    c = convert("t2r", 3, "c")
    torch.manual_seed(3)
    reference, _ = linearize.load_teacher(tiny)
    linearize.convert(reference, "t2r")
    state = reference.state_dict()
    assert all(torch.equal(c[k], state[k]) for k in c)


def test_convert_merged(capsys, tiny, tmp_path):
    out = tmp_path / "merged"
    code, stdout, err = run_cli(capsys, "convert", "--model", tiny, "--method", "lolcats", "--out", out,
                                "--softmax-layers", "0.5", "--merged")
    assert code == 0, err
    assert "merged" in stdout and (out / "model.safetensors").is_file()
    model, tokenizer = linearize.load(out)
    assert tokenizer is not None and model.linearize_spec["softmax_layers"] == [1]


@pytest.mark.parametrize("args, named", [
    (["--method", "nope"], "nope"),
    (["--method", "lizard", "--set", "bogus_key=1"], "bogus_key"),
    (["--method", "lizard", "--set", "window=-3"], "-3"),
    (["--method", "lizard", "--set", "gate=sideways"], "sideways"),
    (["--method", "lizard", "--set", "window"], "KEY=VALUE"),
    (["--method", "lizard", "--softmax-layers", "7"], "[7]"),
    (["--method", "lizard", "--softmax-layers", "0,x"], "0,x"),
    (["--method", "lizard", "--softmax-layers", "1.5"], "1.5"),
])
def test_convert_bad_input_exits_2_and_writes_nothing(capsys, tiny, tmp_path, args, named):
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "convert", "--model", tiny, "--out", out, *args)
    assert code == 2
    assert named in err and "error" in err and "Traceback" not in err
    assert not out.exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir()), "temporary directory left behind"


def test_convert_missing_model_dir(capsys, tmp_path):
    missing = tmp_path / "nowhere" / "model"
    code, _, err = run_cli(capsys, "convert", "--model", missing, "--method", "lizard", "--out", tmp_path / "out")
    assert code == 2 and str(missing) in err and err.startswith("linearize: error:")
    assert not (tmp_path / "out").exists()
    code, _, err = run_cli(capsys, "convert", "--model", "not-a-teacher", "--method", "lizard", "--out", tmp_path / "o")
    assert code == 2 and "not-a-teacher" in err and "smollm2-135m" in err


def test_convert_refuses_to_replace_a_foreign_directory(capsys, tiny, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _, err = run_cli(capsys, "convert", "--model", tiny, "--method", "lizard", "--out", out)
    assert code == 2 and "refusing" in err and str(out) in err
    assert (out / "notes.txt").read_text() == "keep me"


def _snapshot(folder: Path) -> dict:
    """Every file under ``folder``: its bytes, mtime and mode."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_mode)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _finished_run(converted: str, folder: Path) -> Path:
    """What ``linearize train`` leaves in its --out (train/run.py): a checkpoint and the run's files."""
    import shutil

    from linearize.train.run import CONFIG_FILE

    shutil.copytree(converted, folder)
    (folder / "state").mkdir()
    (folder / CONFIG_FILE).write_text(json.dumps(TrainConfig(out=str(folder)).to_dict()))
    (folder / "metrics.jsonl").write_text('{"stage": "stage2", "split": "val", "step": 4, "loss": 2.5}\n')
    (folder / "summary.json").write_text(json.dumps({"student_val_loss": 2.5, "teacher_val_loss": 2.4}))
    for name in ("stage1_layer_mse.png", "stage1_loss.png", "stage2_loss.png"):
        (folder / name).write_bytes(b"\x89PNG\r\n\x1a\n" + name.encode())
    (folder / "state" / "stage2.pt").write_bytes(b"resume state")
    return folder


def test_convert_refuses_a_finished_training_run_and_changes_nothing(capsys, monkeypatch, tiny, converted, tmp_path):
    """issue 40: `convert --out runs/x` over a trained run exited 0 and replaced its adapter. It is
    refused before any model is loaded, naming the folder and what it holds; every byte stays."""
    import time

    import linearize.models.teacher as teacher

    run = _finished_run(converted, tmp_path / "runs" / "x")
    before = _snapshot(run)
    real_load = teacher.load_teacher
    monkeypatch.setattr(teacher, "load_teacher", lambda *a, **k: pytest.fail("loaded a model before refusing"))
    start = time.perf_counter()
    code, stdout, err = run_cli(capsys, "convert", "--model", tiny, "--method", "hedgehog", "--out", run)
    assert time.perf_counter() - start < 5
    assert code == 2 and stdout == "" and "Traceback" not in err
    assert err.strip() == (f"linearize: error: --out {run} holds a training run (config.json, metrics.jsonl, "
                           "summary.json, state/, stage1_layer_mse.png, stage1_loss.png, ... 1 more) and a checkpoint "
                           f"({META_FILE}, {ADAPTER_FILE}); pass --overwrite to replace it, or choose another --out")
    assert _snapshot(run) == before, "a refused convert changed the run"
    assert sorted(p.name for p in run.parent.iterdir()) == ["x"], "a temporary folder was left"

    # an untrained checkpoint alone is refused the same way
    code, _, err = run_cli(capsys, "convert", "--model", tiny, "--method", "lizard", "--out", converted)
    assert code == 2 and f"--out {converted} holds a checkpoint ({META_FILE}, {ADAPTER_FILE});" in err

    monkeypatch.setattr(teacher, "load_teacher", real_load)
    code, stdout, err = run_cli(capsys, "convert", "--model", tiny, "--method", "hedgehog", "--out", run, "--overwrite")
    assert code == 0, err
    assert json.loads((run / META_FILE).read_text())["method"] == "hedgehog"
    after = _snapshot(run)
    assert after[ADAPTER_FILE][0] != before[ADAPTER_FILE][0]
    kept = {k: v for k, v in before.items() if k not in (META_FILE, ADAPTER_FILE)}
    assert {k: after[k] for k in kept} == kept, "--overwrite replaces the checkpoint only"


def test_convert_writes_files_with_the_usual_permissions(capsys, tiny, tmp_path):
    """Not 0600 (issue 40): adapter.safetensors and linearize.json get 0666 less the umask."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        for merged in ([], ["--merged"]):
            out = tmp_path / f"ck{len(merged)}"
            assert run_cli(capsys, "convert", "--model", tiny, "--method", "lizard", "--out", out, *merged)[0] == 0
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
            assert modes == dict.fromkeys(modes, 0o644), modes
    finally:
        os.umask(old)


def test_convert_hint_repeats_the_flags_given(capsys, tiny, tmp_path):
    """The closing `linearize train ...` hint carries the --softmax-layers and --set just used, quoted
    for a shell, so that copying it trains the same conversion (issue 40)."""
    import shlex

    out = tmp_path / "ck"
    code, stdout, err = run_cli(capsys, "convert", "--model", tiny, "--method", "lizard", "--out", out,
                                "--softmax-layers", "0,1", "--set", "window=8", "--set", "gate_init=[0.9,0.99]",
                                "--set", "rope_window=false", "--set", "gate=mamba2")
    assert code == 0, err
    hint = stdout.splitlines()[-1].split("train it with: ", 1)[1]
    assert hint == (f"linearize train --method lizard --model {tiny} --softmax-layers 0,1 --set window=8 "
                    "--set 'gate_init=[0.9,0.99]' --set rope_window=false --set gate=mamba2 --out DIR")
    argv = shlex.split(hint)
    assert argv[:2] == ["linearize", "train"]
    config = parse_train(*argv[2:])
    assert config.softmax_layers == [0, 1] and config.method == "lizard" and config.model == tiny
    assert config.overrides == {"window": 8, "gate_init": [0.9, 0.99], "rope_window": False, "gate": "mamba2"}
    code, stdout, _ = run_cli(capsys, "convert", "--model", tiny, "--method", "lizard", "--out", tmp_path / "f",
                              "--softmax-layers", "0.5")
    assert code == 0 and "--softmax-layers 0.5 --out DIR" in stdout.splitlines()[-1]
    assert parse_train(*shlex.split(stdout.splitlines()[-1].split("train it with: ")[1])[2:]).softmax_layers == 0.5


def test_checkpoint_missing_a_key_is_named(capsys, converted, tmp_path):
    """A linearize.json without `method` said only `linearize: error: method` (issue 40)."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    meta = json.loads((broken / META_FILE).read_text())
    del meta["method"]
    (broken / META_FILE).write_text(json.dumps(meta))
    code, _, err = run_cli(capsys, "generate", "--model", broken, "--prompt", "hi", "--device", "cpu")
    assert code == 2 and err.strip() == (f"linearize: error: corrupted checkpoint: {broken / META_FILE} has no "
                                         "'method' key (required: method, softmax_layers, overrides, base)")


# ---------------------------------------------------------------------------- model names


MODEL_COMMANDS = {
    "generate": ["generate", "--prompt", "hi", "--device", "cpu"],
    "convert": ["convert", "--method", "lizard", "--out", "out"],
    "eval ppl": ["eval", "ppl", "--data", "shakespeare", "--out", "out", "--device", "cpu"],
}


def _with_model(command: str, model: str) -> list[str]:
    argv = MODEL_COMMANDS[command]
    split = 2 if argv[0] == "eval" else 1
    return argv[:split] + ["--model", model] + argv[split:]


@pytest.fixture
def no_hub(monkeypatch):
    """A hub that must not be asked: a probe fails the test."""
    import linearize.models.teacher as teacher

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(teacher, "hub_reachable", lambda *a, **k: pytest.fail("asked the hub about a local path"),
                        raising=False)


@pytest.mark.parametrize("command", list(MODEL_COMMANDS))
@pytest.mark.parametrize("model", ["runs/doesnotexist", "runs/typo/model", "./runs/lizrd", "~/no-such-linearize-model"])
def test_mistyped_local_model_path_fails_at_once(capsys, monkeypatch, tmp_path, no_hub, command, model):
    """issue 40: `--model runs/doesnotexist` was sent to the hub, retried for ~28 s and blamed the
    connection. A name that is a path (its folder exists, or ./ ~ / prefixes, or deeper than org/name)
    fails in well under 5 s naming the path and the forms a model takes."""
    import time

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "lizard").mkdir(parents=True)
    start = time.perf_counter()
    code, _, err = run_cli(capsys, *_with_model(command, model))
    assert time.perf_counter() - start < 5
    assert code == 2 and "Traceback" not in err
    assert f"model directory {model} does not exist" in err
    assert "linearize checkpoint directory" in err and "smollm2-135m" in err and "hub id" in err
    assert "huggingface.co" not in err and not (tmp_path / "out").exists()
    if model == "runs/doesnotexist":
        assert "a folder runs/ exists here, so it is read as a local path" in err
    if model == "./runs/lizrd":
        assert "did you mean runs/lizard?" in err


def test_a_mistyped_model_path_is_refused_before_transformers_is_imported(tmp_path):
    """From a shell, importing transformers costs seconds: a bad --model must be refused before it,
    by every command that takes one (a fresh interpreter, as a user's shell gives)."""
    (tmp_path / "runs").mkdir()
    script = ("import sys; from linearize.cli import main; "
              "codes = [main(argv) for argv in ARGV]; print(codes, 'transformers' in sys.modules)")
    argvs = [_with_model(command, "runs/doesnotexist") for command in MODEL_COMMANDS]
    proc = subprocess.run([sys.executable, "-c", script.replace("ARGV", repr(argvs))], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == f"{[2] * len(argvs)} False", (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.count("model directory runs/doesnotexist does not exist") == len(argvs)


@pytest.mark.parametrize("command", list(MODEL_COMMANDS))
def test_hub_id_without_network_fails_in_seconds(capsys, monkeypatch, tmp_path, command):
    """A hub id (org/name, no local folder org/) with no network: named, with what to use instead,
    in seconds rather than after transformers' retries."""
    import time

    import linearize.models.teacher as teacher

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(teacher, "hub_reachable", lambda *a, **k: False, raising=False)
    model = "linearize-test-org/no-such-model"
    start = time.perf_counter()
    code, _, err = run_cli(capsys, *_with_model(command, model))
    assert time.perf_counter() - start < 5
    assert code == 2 and "Traceback" not in err
    assert f"model {model} is read as a Hugging Face hub id, but there is no network" in err
    assert "not in the local Hugging Face cache" in err and "smollm2-135m" in err and "local Hugging Face model directory" in err

    # HF_HUB_OFFLINE=1: no probe at all
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(teacher, "hub_reachable", lambda *a, **k: pytest.fail("probed the hub while offline"))
    code, _, err = run_cli(capsys, *_with_model(command, model))
    assert code == 2 and f"model {model} is read as a Hugging Face hub id, but HF_HUB_OFFLINE" in err


def test_hub_probe_is_bounded_and_reads_any_answer(monkeypatch):
    """hub_reachable itself, against local servers only: a closed port is unreachable at once, a
    server that answers (even 404) is reachable, one that never answers costs the timeout."""
    import http.server
    import socket
    import threading
    import time

    from huggingface_hub import constants

    from linearize.models.teacher import hub_reachable

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed}")
    start = time.perf_counter()
    assert hub_reachable(timeout=2) is False and time.perf_counter() - start < 2.6

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert hub_reachable(timeout=2) is True
    finally:
        server.shutdown()
        server.server_close()

    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        start = time.perf_counter()
        assert hub_reachable(timeout=0.5) is False
        assert time.perf_counter() - start < 1.5
    finally:
        silent.close()


def test_looks_local(monkeypatch, tmp_path):
    from linearize.models.loading import looks_local

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert not looks_local("HuggingFaceTB/SmolLM2-135M") and not looks_local("smollm2-135m")
    assert looks_local("./x") and looks_local("/abs/x") and looks_local("~/x") and looks_local("a/b/c")
    assert looks_local("a\\b") and looks_local("runs/nope")  # runs/ is a folder here


# ---------------------------------------------------------------------------- generate


def reference_completions(model, tokenizer, prompts, n):
    """Each prompt alone (no padding), greedy, as the CLI configures generation."""
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=pad, eos_token_id=eos)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            seq = model.generate(**ids, generation_config=gen)
        out.append(tokenizer.decode(seq[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    return out


def generate_json(capsys, model_dir, *extra, n=8):
    argv = ["generate", "--model", model_dir, "--max-new-tokens", n, "--device", "cpu", "--json"]
    for p in PROMPTS:
        argv += ["--prompt", p]
    code, out, err = run_cli(capsys, *argv, *extra)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    return [r["completion"] for r in rows]


def test_generate_teacher_batched_greedy_matches_each_prompt_alone(capsys, tiny):
    model, tokenizer = linearize.load_teacher(tiny)
    lengths = [len(tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert lengths[0] < lengths[1], "the prompts must differ in length to exercise left padding"
    got = generate_json(capsys, tiny)
    assert got == reference_completions(model, tokenizer, PROMPTS, 8)
    assert all(got), "empty completions"
    assert generate_json(capsys, tiny) == got, "greedy generation is not deterministic"


def test_generate_converted_checkpoint(capsys, converted):
    model, tokenizer = linearize.load(converted)
    got = generate_json(capsys, converted)
    assert got == reference_completions(model, tokenizer, PROMPTS, 8)
    # plain text output: each prompt, then its completion
    code, out, err = run_cli(capsys, "generate", "--model", converted, "--prompt", PROMPTS[0],
                             "--max-new-tokens", 8, "--device", "cpu")
    assert code == 0, err
    assert out.splitlines()[0] == f">>> {PROMPTS[0]}" and got[0] in out


def test_generate_chat_and_sampling(capsys, tiny):
    chat = generate_json(capsys, tiny, "--chat")
    assert len(chat) == 2
    a = generate_json(capsys, tiny, "--temperature", "1.0", "--top-p", "0.9", "--seed", "1", n=6)
    b = generate_json(capsys, tiny, "--temperature", "1.0", "--top-p", "0.9", "--seed", "1", n=6)
    c = generate_json(capsys, tiny, "--temperature", "1.0", "--top-p", "0.9", "--seed", "2", n=6)
    assert a == b, "same seed, different samples"
    assert a != c, "the seed has no effect"


def test_generate_without_tokenizer_is_a_clear_error(capsys, tmp_path):
    fixtures.llama().save_pretrained(tmp_path / "bare")
    code, _, err = run_cli(capsys, "generate", "--model", tmp_path / "bare", "--prompt", "hi", "--device", "cpu")
    assert code == 2 and "no tokenizer" in err and "Traceback" not in err


@pytest.mark.parametrize("args, named", [
    (["--temperature", "-1"], "-1"),
    (["--top-p", "0"], "top-p"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--device", "tpu"], "tpu"),
])
def test_generate_bad_values(capsys, tiny, args, named):
    code, _, err = run_cli(capsys, "generate", "--model", tiny, "--prompt", "hi", *args)
    assert code == 2 and named in err


def test_generate_empty_prompt_is_named(capsys, tiny):
    code, _, err = run_cli(capsys, "generate", "--model", tiny, "--prompt", "hi", "--prompt", "", "--device", "cpu")
    assert code == 2 and "--prompt 2" in err and "empty" in err


def test_generate_missing_model(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", tmp_path / "missing", "--prompt", "hi")
    assert code == 2 and "missing" in err


# ---------------------------------------------------------------------------- train settings


def test_train_defaults_and_flag_types():
    assert parse_train() == TrainConfig()
    c = parse_train("--method", "lolcats", "--stage1-tokens", "100k", "--stage2-tokens", "2e3",
                    "--lr-schedule", "plateau", "--stage2-lr", "3e-4", "--softmax-layers", "0,5,9",
                    "--lora-targets", "q_proj,v_proj", "--block-size", "2", "--early-stop-patience", "none",
                    "--no-progress", "--set", "window=32", "--set", "gate_init=[0.9,0.99]")
    assert (c.method, c.stage1_tokens, c.stage2_tokens, c.lr_schedule) == ("lolcats", 102_400, 2000, "plateau")
    assert c.stage2_lr == pytest.approx(3e-4) and c.softmax_layers == [0, 5, 9]
    assert c.lora_targets == ["q_proj", "v_proj"] and c.block_size == 2 and c.early_stop_patience is None
    assert c.progress is False and c.overrides == {"window": 32, "gate_init": [0.9, 0.99]}
    assert parse_train("--softmax-layers", "0.25").softmax_layers == 0.25
    assert parse_train("--progress").progress is True


def test_suffixes_mean_the_same_in_every_flag():
    """K and M are binary in token budgets, context lengths and token caps alike (issue 40)."""
    assert parse_int("4K") == parse_int_list("4K")[0] == 4096
    assert parse_int("2M") == 2 * 1024 * 1024 and parse_int("1.5k") == 1536
    assert parse_int_list("1K,2k,8192,1M") == [1024, 2048, 8192, 1024**2]
    assert parse_train("--stage1-tokens", "8K").stage1_tokens == parse_int_list("8K")[0]
    with pytest.raises(ValueError, match="positive"):
        parse_int_list("1K,0")


def test_train_config_file_yaml_then_flags(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("method: lolcats\nstage1_tokens: 1000\nstage2-lr: 1e-4\nlr_schedule: plateau\n"
                    "softmax_layers: [0, 1]\nlora_targets: q_proj,k_proj\nprogress: false\n"
                    "overrides: {window: 32, sinks: 2}\n")
    c = parse_train("--config", path)
    assert (c.method, c.stage1_tokens, c.lr_schedule, c.softmax_layers) == ("lolcats", 1000, "plateau", [0, 1])
    assert c.stage2_lr == pytest.approx(1e-4) and isinstance(c.stage2_lr, float)  # PyYAML reads 1e-4 as text
    assert c.lora_targets == ["q_proj", "k_proj"] and c.progress is False
    assert c.overrides == {"window": 32, "sinks": 2}
    # flags win over the file; --set merges over the file's overrides
    c = parse_train("--config", path, "--stage1-tokens", "2000", "--method", "lizard", "--progress",
                    "--set", "window=16")
    assert (c.method, c.stage1_tokens, c.lr_schedule, c.progress) == ("lizard", 2000, "plateau", True)
    assert c.overrides == {"window": 16, "sinks": 2}


def test_a_methods_recipe_fills_only_the_settings_not_given(tmp_path):
    """lizard-recall trains with its memory open in stage 1 and its attention trained in stage 2
    unless told otherwise, by a flag or a config file; other methods keep the plain defaults."""
    c = parse_train("--method", "lizard-recall")
    assert (c.stage1_memory, c.stage2_attention) == (False, True)
    assert (TrainConfig.stage1_memory, TrainConfig.stage2_attention) == (True, False)
    c = parse_train("--method", "lizard-recall", "--stage1-memory")
    assert (c.stage1_memory, c.stage2_attention) == (True, True)
    path = tmp_path / "recipe.yaml"
    path.write_text("method: lizard-recall\nstage2_attention: false\n")
    c = parse_train("--config", path)
    assert (c.stage1_memory, c.stage2_attention) == (False, False)
    c = parse_train("--method", "lizard-gdn")
    assert (c.stage1_memory, c.stage2_attention) == (True, False)
    assert TrainConfig.from_dict({"method": "lizard-recall"}).stage1_memory is False
    with pytest.raises(ValueError, match="lizard-recal'"):
        TrainConfig.from_dict({"method": "lizard-recal"})


def test_train_config_file_json(tmp_path):
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps({"method": "hedgehog", "seq_len": 128, "stage1_lr": 0.001, "block_size": None,
                                "softmax_layers": 0.5, "overrides": {"chunk_size": 32}}))
    c = parse_train("--config", path, "--seq-len", "256")
    assert (c.method, c.seq_len, c.stage1_lr, c.block_size, c.softmax_layers) == ("hedgehog", 256, 0.001, None, 0.5)
    assert c.overrides == {"chunk_size": 32}


@pytest.mark.parametrize("name, text, message", [
    ("unknown.yaml", "method: lizard\nstage3_tokens: 5\n", "stage3_tokens"),
    ("bad.yaml", "method: [lizard\n", "not valid YAML"),
    ("bad.json", '{"method": "lizard",}', "not valid JSON"),
    ("list.yaml", "- method\n- lizard\n", "mapping"),
    ("value.yaml", "seq_len: many\n", "seq_len"),
])
def test_train_config_file_errors_name_the_file(capsys, tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        parse_train("--config", path)
    assert str(path) in str(info.value)
    code, out, err = run_cli(capsys, "train", "--config", path)
    assert code == 2 and str(path) in err and message in err and "Traceback" not in err


def test_train_missing_config_file(capsys, tmp_path):
    path = tmp_path / "absent.yaml"
    with pytest.raises(FileNotFoundError, match="absent.yaml"):
        parse_train("--config", path)
    code, _, err = run_cli(capsys, "train", "--config", path)
    assert code == 2 and str(path) in err


@pytest.mark.parametrize("args, named", [
    (["--seq-len", "0"], "seq_len"),
    (["--val-fraction", "0.9"], "val_fraction"),
    (["--set", "windoww=3"], "windoww"),
    (["--device", "tpu"], "tpu"),
])
def test_train_bad_values_exit_2_before_running(capsys, monkeypatch, tmp_path, args, named):
    monkeypatch.setattr(cli_train, "_train_runner", lambda: pytest.fail("training ran with a bad config"))
    code, _, err = run_cli(capsys, "train", "--out", tmp_path / "run", *args)
    assert code == 2 and named in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("resume", [[], ["--resume"]])
def test_train_out_at_a_file_is_named_before_loading(capsys, monkeypatch, tmp_path, resume):
    """issue 40: `train --out FILE` ended in a raw `[Errno 20] Not a directory` after loading."""
    import importlib

    run_module = importlib.import_module("linearize.train.run")  # the module (linearize.train.run is also the function)
    monkeypatch.setattr(run_module, "load_teacher", lambda *a, **k: pytest.fail("loaded a model first"))
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    code, _, err = run_cli(capsys, "train", "--out", notes, "--no-progress", *resume)
    assert code == 2 and err.strip() == f"linearize: error: --out {notes} is a file, not a directory"
    code, _, err = run_cli(capsys, "train", "--out", notes / "run", "--no-progress")
    assert code == 2 and err.strip() == f"linearize: error: --out {notes / 'run'} cannot be a directory: {notes} is a file"
    assert notes.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("args, named", [
    (["--lr-schedule", "sometimes"], "sometimes"),
    (["--stage1-tokens", "lots"], "lots"),
    (["--block-size", "two"], "two"),
])
def test_train_bad_flags_are_usage_errors(capsys, args, named):
    code, _, err = run_cli(capsys, "train", *args)
    assert code == 2 and named in err and "usage:" in err


def test_train_command_calls_run_and_plots(capsys, monkeypatch, tmp_path):
    """The command's plumbing, with the training loop replaced: config in, directory out, curves beside it."""
    calls = []

    def fake_run(config, *, resume=False):
        calls.append((config, resume))
        out = Path(config.out)
        out.mkdir(parents=True)
        rows = [{"stage": "stage2", "split": "train", "step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 6)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return out

    monkeypatch.setattr(cli_train, "_train_runner", lambda: fake_run)
    out = tmp_path / "run"
    code, stdout, err = run_cli(capsys, "train", "--out", out, "--stage1-tokens", "0", "--resume")
    assert code == 0, err
    (config, resume), = calls
    assert resume is True and config.stage1_tokens == 0 and config.out == str(out)
    assert stdout.splitlines()[-1] == str(out)
    assert (out / "stage2_loss.png").is_file()


def test_train_resume_starts_from_the_runs_recorded_settings(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recorded = {**TrainConfig(method="hedgehog", seq_len=128, out="elsewhere", overrides={"chunk_size": 32}).to_dict(),
                "a_setting_from_a_newer_version": 1}
    (run_dir / "config.json").write_text(json.dumps(recorded))
    c = parse_train("--resume", "--out", run_dir, "--no-progress", "--set", "window=16")
    assert (c.method, c.seq_len, c.out, c.progress) == ("hedgehog", 128, str(run_dir), False)
    assert c.overrides == {"chunk_size": 32, "window": 16}
    assert parse_train("--out", run_dir).method == "lizard", "the recorded settings apply only with --resume"
    (run_dir / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="config.json"):
        parse_train("--resume", "--out", run_dir)


def test_train_that_diverges_reports_without_traceback(capsys, monkeypatch, tmp_path):
    from linearize.train.loop import NonFiniteLossError

    def diverging_run(config, *, resume=False):
        raise NonFiniteLossError("stage2: the loss was not finite for 5 steps in a row")

    monkeypatch.setattr(cli_train, "_train_runner", lambda: diverging_run)
    code, _, err = run_cli(capsys, "train", "--out", tmp_path / "run")
    assert code == 1 and "not finite for 5 steps" in err and "Traceback" not in err


def test_demo_calls_run_demo(capsys, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cli_demo, "run_demo", lambda out, device: calls.append((out, device)) or 0)
    assert run_cli(capsys, "demo", "--out", tmp_path / "d", "--device", "cpu")[0] == 0
    assert calls == [(str(tmp_path / "d"), "cpu")]
    monkeypatch.setattr(cli_demo, "run_demo", lambda out, device: 3)
    assert run_cli(capsys, "demo")[0] == 3


# ---------------------------------------------------------------------------- train, end to end


def test_train_end_to_end_on_the_tiny_model(capsys, tiny, tmp_path):
    data = tmp_path / "corpus.txt"
    sentences = ["The sea was calm and the sky was grey.", "A ship sailed north past the old lighthouse.",
                 "Gulls cried over the harbour at dawn.", "The keeper wrote the weather in his log."]
    data.write_text("\n\n".join(" ".join(sentences[(i + j) % 4] for j in range(6)) for i in range(60)))
    out = tmp_path / "run"
    code, stdout, err = run_cli(capsys, "train", "--model", tiny, "--method", "lizard", "--data", data,
                                "--out", out, "--seq-len", 64, "--batch-size", 2, "--stage1-tokens", 512,
                                "--stage2-tokens", 512, "--eval-every", 2, "--save-every", 2, "--val-fraction", 0.1,
                                "--val-rows", 2, "--device", "cpu", "--no-progress", "--set", "window=16")
    assert code == 0, err
    assert stdout.splitlines()[-1] == str(out)
    for name in (META_FILE, ADAPTER_FILE, "metrics.jsonl"):
        assert (out / name).is_file(), f"{name} missing from the run directory"
    assert list(out.glob("*.png")), "no loss curves"
    model, tokenizer = linearize.load(out)
    assert model.linearize_spec["method"] == "lizard" and model.linearize_spec["config"]["window"] == 16
