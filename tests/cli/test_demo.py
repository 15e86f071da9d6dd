"""End to end: ``linearize.cli.demo.run_demo`` on a tiny random Llama (the bundled tokenizer)."""

from __future__ import annotations

import json
import re
import time

import pytest

from fixtures import tiny_model_dir
from linearize.cli.demo import run_demo

CONTEXTS = (64, 256)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", num_layers=2)


@pytest.fixture(autouse=True)
def few_plays(monkeypatch):
    """Training reads 3 of the plays instead of all 38: tokenizing them all takes ~9 s per run."""
    import importlib

    mixture = importlib.import_module("linearize.data.mixture")  # where training reads its sources
    real = mixture.load_documents
    monkeypatch.setattr(mixture, "load_documents", lambda source, tok, **kw: real(source, tok, **kw, max_documents=3))


def _demo(out, tiny_dir, **kwargs):
    args = dict(out=str(out), device="cpu", model=str(tiny_dir), seq_len=64, stage1_steps=4, stage2_steps=2,
                contexts=CONTEXTS, max_new_tokens=5, prompts=["What is the capital of France?", "Hi!"])
    return run_demo(**{**args, **kwargs})


def _parse_size(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def test_demo_end_to_end_and_resume(tmp_path, tiny_dir, capsys, monkeypatch):
    out = tmp_path / "demo"
    assert _demo(out, tiny_dir) == 0
    text = capsys.readouterr().out

    for heading in ("linearize demo", "Training", "transfer MSE", "Teacher vs student",
                    "Decode memory", "What a few CPU minutes can and cannot do", "Done in"):
        assert heading in text, heading

    # the MSE table: one row per layer (the tiny model has 2), before > 0, ratio = after / before
    rows = re.findall(r"^\s*(\d+)\s+([\d.e+-]+)\s+([\d.e+-]+)\s+([\d.]+)\s*$", text, re.M)
    assert [int(r[0]) for r in rows] == [0, 1]
    for _, before, after, ratio in rows:
        assert float(before) > 0 and float(ratio) == pytest.approx(float(after) / float(before), rel=0.02, abs=2e-3)
    assert re.search(r"MSE fell in \d of 2 layers", text)
    assert "stage1_layer_mse.png" in text

    # the answers: one block per prompt, teacher and student side by side, and the perplexities
    assert "[1] What is the capital of France?" in text and "[2] Hi!" in text
    assert text.count("teacher" + " " * 10) >= 2
    assert re.search(r"validation perplexity .*teacher [\d.]+, .*student after stage 2 [\d.]+", text)

    # the memory table: the student's state is flat, the teacher's cache grows with the context
    table = re.findall(r"^\s*([\d,]+) \| +([\d.]+ \w+) \| +([\d.]+ \w+) \| +([\d.]+)x$", text, re.M)
    assert [int(n.replace(",", "")) for n, *_ in table] == list(CONTEXTS)
    teacher = [_parse_size(t) for _, t, _, _ in table]
    student = [s for _, _, s, _ in table]
    assert student[0] == student[1]
    assert teacher[1] / teacher[0] == pytest.approx(4.0, rel=0.01)
    assert "at every context length" in text and "grows linearly" in text
    assert "linearize train --method lizard" in text and "--device cuda" in text

    # the run directory: what train.run writes
    for name in ("config.json", "metrics.jsonl", "summary.json", "linearize.json"):
        assert (out / name).is_file(), name
    metrics = (out / "metrics.jsonl").read_text()

    # a second call with the same settings reuses the run: no retraining, metrics not duplicated
    started = time.perf_counter()
    assert _demo(out, tiny_dir) == 0
    again = capsys.readouterr().out
    assert (out / "metrics.jsonl").read_text() == metrics
    assert "already done" in again and "Decode memory" in again
    assert "shipped with linearize" not in again  # no bundled student of this teacher
    assert time.perf_counter() - started < 60  # no training: loads, answers, memory

    # a bundled student of the teacher is shown beside it: here the run's own checkpoint, registered
    # as one, so its numbers must be the demo student's
    from linearize.models.students import BUNDLED_STUDENTS, BundledStudent

    monkeypatch.setitem(BUNDLED_STUDENTS, "demo", BundledStudent("demo", str(tiny_dir), "lizard", root=tmp_path))
    assert _demo(out, tiny_dir) == 0
    shown = capsys.readouterr().out
    assert "the trained student shipped with linearize (demo) beside the teacher" in shown
    section = shown.split("The trained student shipped with linearize: demo")[1].split("What a few CPU minutes")[0]
    assert "[1] What is the capital of France?" in section and "[2] Hi!" in section
    assert re.search(r"^  teacher +\| demo$", section, re.M)
    summary = json.loads((out / "summary.json").read_text())
    assert (f"teacher {summary['teacher_val_ppl']:.1f}, this demo's student {summary['student_val_ppl']:.1f}, "
            f"demo {summary['student_val_ppl']:.1f}") in section  # the same rows, the same model
    shipped = re.findall(r"^\s*([\d,]+) \| +([\d.]+ \w+) \| +([\d.]+ \w+) \| +([\d.]+)x$", section, re.M)
    assert [int(n.replace(",", "")) for n, *_ in shipped] == [CONTEXTS[0], CONTEXTS[-1]]
    assert [(t, s) for _, t, s, _ in shipped] == [(t, s) for _, t, s, _ in table]  # as measured for the student
    assert "linearize generate --model demo --chat" in shown

    # a run stopped before its checkpoint and summary were written resumes instead of starting over
    from linearize.cli.demo import _train_config, train

    (out / "summary.json").unlink()
    (out / "linearize.json").unlink()
    train(_train_config(str(out), "cpu", str(tiny_dir), 64, 2, 4, 2))
    assert "resuming" in capsys.readouterr().out
    assert (out / "metrics.jsonl").read_text() == metrics  # nothing trained twice
    assert (out / "summary.json").is_file() and (out / "linearize.json").is_file()


def test_demo_refuses_a_different_run(tmp_path, tiny_dir, capsys):
    from linearize.cli.demo import _train_config

    out = tmp_path / "other"
    out.mkdir()
    other = _train_config(str(out), "cpu", str(tiny_dir), 128, 2, 4, 2)  # seq_len 128, not 64
    (out / "config.json").write_text(json.dumps(other.to_dict()))
    assert _demo(out, tiny_dir) == 2
    err = capsys.readouterr().err
    assert "holds a different run" in err and "seq_len" in err and "rm -r" in err and "--out" in err
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # nothing written

    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    assert _demo(stray, tiny_dir) == 2
    err = capsys.readouterr().err
    assert "holds no linearize run" in err and "--out" in err and "rm -r" not in err


def test_demo_rejects_bad_arguments(tmp_path, tiny_dir):
    with pytest.raises(ValueError, match="contexts"):
        _demo(tmp_path / "x", tiny_dir, contexts=())
    with pytest.raises(ValueError, match="stage1_steps"):
        _demo(tmp_path / "x", tiny_dir, stage1_steps=0)
    with pytest.raises(ValueError, match="prompts"):
        _demo(tmp_path / "x", tiny_dir, prompts=[""])
    assert not (tmp_path / "x").exists()
