"""A bundled student's name as --model: the commands open the package's checkpoint folder, and a
student that is not installed is refused by name, with how to get it, before anything loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import fixtures
from linearize import cli
from linearize.models.students import BUNDLED_STUDENTS, BundledStudent

PROSE = ("The river ran past the mill and under the old stone bridge, where the children of the village "
         "gathered every evening to watch the boats come home with their nets full of silver fish. ") * 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(root, teacher dir)``: a tiny Lizard student in ``root/tiny-lizard``."""
    tmp = tmp_path_factory.mktemp("names")
    teacher = fixtures.tiny_model_dir(tmp / "teacher")
    fixtures.tiny_student_dir(tmp / "root" / "tiny-lizard", teacher)
    return tmp / "root", str(teacher)


@pytest.fixture
def registered(tiny, monkeypatch):
    root, teacher = tiny
    monkeypatch.setitem(BUNDLED_STUDENTS, "tiny-lizard", BundledStudent("tiny-lizard", teacher, "lizard", root=root))
    return root / "tiny-lizard"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_by_name_is_generate_by_folder(registered, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = [run_cli(capsys, "generate", "--model", model, "--prompt", "Once upon a time", "--max-new-tokens", 6,
                    "--device", "cpu", "--json") for model in ("tiny-lizard", registered)]
    assert [code for code, _, _ in runs] == [0, 0], runs[0][2]
    assert runs[0][1] == runs[1][1] and json.loads(runs[0][1])["completion"]


@pytest.mark.slow  # two evaluations end to end: ~10 s on a 2-core CPU
def test_eval_ppl_and_report_take_a_student_by_name(registered, capsys, tmp_path):
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    data = ["--data", text, "--device", "cpu"]
    code, _, err = run_cli(capsys, "eval", "ppl", "--model", "tiny-lizard", "--model", registered, *data,
                           "--max-tokens", 200, "--out", tmp_path / "ppl")
    assert code == 0, err
    by_name, by_folder = json.loads((tmp_path / "ppl" / "ppl.json").read_text())["models"]
    assert by_name["label"] == by_folder["label"] == "lizard (tiny-lizard)"
    assert by_name["linearized"] and by_name["ppl"] == by_folder["ppl"]

    code, _, err = run_cli(capsys, "eval", "report", "--model", "tiny-lizard", *data, "--rows", 2,
                           "--seq-len", 32, "--layers", 0, "--out", tmp_path / "report")
    assert code == 0, err
    assert json.loads((tmp_path / "report" / "report.json").read_text())["label"] == "lizard (tiny-lizard)"


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["eval", "ppl", "--data", "shakespeare", "--out", "out"],
                                  ["eval", "passkey", "--out", "out"],
                                  ["eval", "report", "--data", "shakespeare", "--out", "out"]])
def test_a_missing_student_is_refused_by_name_before_loading(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(BUNDLED_STUDENTS, "gone-lizard",
                        BundledStudent("gone-lizard", "smollm2-135m", "lizard", root=tmp_path / "none"))
    split = 2 if argv[0] == "eval" else 1
    code, _, err = run_cli(capsys, *argv[:split], "--model", "gone-lizard", *argv[split:], "--device", "cpu")
    assert code == 2 and "Traceback" not in err
    assert "the bundled student 'gone-lizard' is not installed" in err and "pip install -e ." in err
    assert not (tmp_path / "out").exists()


def test_the_shipped_students_name_is_refused_before_transformers_is_imported_when_absent(tmp_path):
    """From a shell, a missing bundled student is named without paying for transformers' import."""
    script = ("import sys; from linearize.models import students; from linearize.cli import main; "
              f"students.BUNDLED_STUDENTS['smollm2-135m-lizard'] = students.BundledStudent("
              f"'smollm2-135m-lizard', 'smollm2-135m', 'lizard', root={str(tmp_path)!r}); "
              "code = main(['generate', '--model', 'smollm2-135m-lizard', '--prompt', 'hi']); "
              "print(code, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "2 False", (proc.stdout, proc.stderr[-2000:])
    assert "the bundled student 'smollm2-135m-lizard' is not installed" in proc.stderr
