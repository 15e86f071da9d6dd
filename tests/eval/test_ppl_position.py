"""Perplexity by position: the bucketed curves equal a direct computation, the files are written."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import linearize
from fixtures import tiny_model_dir
from linearize.cli import main
from linearize.eval.ppl_position import bucket_curve, long_documents, position_buckets, run_ppl_position
from linearize.models.convert import linearized_layers
from linearize.models.loading import load_model
from linearize.models.teacher import load_teacher

torch.set_num_threads(1)

LENGTH = 160


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("teacher") / "tiny", num_layers=2))


@pytest.fixture(scope="module")
def student_dir(teacher_dir, tmp_path_factory):
    model, _ = load_teacher(teacher_dir)
    linearize.convert(model, "lizard", window=16)
    torch.manual_seed(0)
    with torch.no_grad():  # away from the untrained init, as training would
        for m in linearized_layers(model):
            for p in m.hybrid.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return str(linearize.save(model, tmp_path_factory.mktemp("student") / "ck"))


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    """Three long documents and a short one (skipped: too short for LENGTH tokens)."""
    from linearize.data.sources import shakespeare_plays

    plays = shakespeare_plays()
    path = tmp_path_factory.mktemp("books") / "books.jsonl"
    records = [plays[0][:3000], "A short note.", plays[1][:3000], plays[2][:3000]]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in records))
    return str(path)


def direct_curve(name, docs, buckets):
    """Every token's loss from one full forward per document (no cache, no windows), then each
    bucket's mean over the (document, position) pairs whose position falls in it."""
    model, _ = load_model(name)
    losses = []  # (position, loss)
    with torch.no_grad():
        for doc in docs:
            ids = torch.tensor(doc)[None]
            logits = model(ids).logits[0, :-1]
            nll = F.cross_entropy(logits.float(), ids[0, 1:], reduction="none")
            losses += [(p + 1, nll[p].item()) for p in range(len(doc) - 1)]
    out = []
    for start, end in buckets:
        inside = [loss for p, loss in losses if start <= p < end]
        out.append((len(inside), sum(inside) / len(inside)))
    return out


def test_curves_equal_a_direct_computation_and_the_files_are_written(teacher_dir, student_dir, books, tmp_path):
    out = tmp_path / "eval"
    result = run_ppl_position([teacher_dir, student_dir], books, out, length=LENGTH, documents=2, buckets=5,
                              piece=48, device="cpu")
    _, tokenizer = load_teacher(teacher_dir)
    docs = long_documents(books, tokenizer, LENGTH, 2, None)
    assert len(docs) == 2 and all(len(d) == LENGTH for d in docs)
    buckets = position_buckets(LENGTH, 5)
    saved = json.loads((out / "ppl_position.json").read_text())
    assert saved["documents"] == 2 and saved["length"] == LENGTH
    teacher, student = saved["models"]
    assert not teacher["linearized"] and student["linearized"] and "pieces of 48" in student["how"]
    for m, name in ((teacher, teacher_dir), (student, student_dir)):
        assert [(b["start"], b["end"]) for b in m["curve"]] == buckets
        for b, (count, mean) in zip(m["curve"], direct_curve(name, docs, buckets)):
            assert b["tokens"] == count
            # the student's chunked prefill with its state against its full forward: equal up to fp32 order
            assert b["nll"] == pytest.approx(mean, rel=1e-4, abs=1e-4), (m["label"], b)
            assert b["ppl"] == pytest.approx(math.exp(b["nll"]))
        assert sum(b["tokens"] for b in m["curve"]) == 2 * (LENGTH - 1)
    assert result["models"][1]["curve"] == student["curve"]
    assert (out / "ppl_position.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "ppl_position.md").read_text()
    assert "2 documents of 160 tokens" in md and f"{student['ppl']:.3f}" in md


def test_a_teacher_beyond_its_window_reads_sliding_windows(teacher_dir, books, tmp_path):
    """Past the window each token keeps at least window - stride tokens of context: the curve is
    still defined everywhere, and equal to the whole-document one inside the first window."""
    whole = run_ppl_position([teacher_dir], books, tmp_path / "a", length=LENGTH, documents=1, buckets=6, device="cpu")
    slid = run_ppl_position([teacher_dir], books, tmp_path / "b", length=LENGTH, documents=1, buckets=6,
                            window=64, stride=32, device="cpu")
    assert "sliding window 64, stride 32" in slid["models"][0]["how"]
    for a, b in zip(whole["models"][0]["curve"], slid["models"][0]["curve"]):
        assert a["tokens"] == b["tokens"] and math.isfinite(b["nll"])
        if a["end"] <= 64:
            assert b["nll"] == pytest.approx(a["nll"], rel=1e-5)


def test_buckets_are_log_spaced_and_cover_every_scored_position():
    buckets = position_buckets(16384, 14)
    assert buckets[0][0] == 1 and buckets[-1][1] == 16384
    assert all(a[1] == b[0] for a, b in zip(buckets, buckets[1:])) and all(s < e for s, e in buckets)
    assert len(buckets) == 14 and buckets[-1] == (round(16384 ** (13 / 14)), 16384)
    assert position_buckets(4, 10) == [(1, 2), (2, 3), (3, 4)]  # empty log ranges merged away
    for bad in (0, 1, True, 2.5):
        with pytest.raises(ValueError, match="length"):
            position_buckets(bad, 4)
    with pytest.raises(ValueError, match="count must be a positive integer, got 0"):
        position_buckets(100, 0)
    curve = bucket_curve([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0])], [(1, 2), (2, 4)])
    assert [(b["tokens"], b["nll"]) for b in curve] == [(2, 3.0), (2, 2.5)]


def test_too_short_documents_and_the_cli(teacher_dir, books, tmp_path, capsys):
    _, tokenizer = load_teacher(teacher_dir)
    with pytest.raises(ValueError, match=r"no document of .* has 100000 tokens \(the longest of the 4 read has"):
        long_documents(books, tokenizer, 100_000, 1, None)
    assert main(["eval", "ppl-position", "--model", teacher_dir, "--data", books, "--length", "64", "--documents", "1",
                 "--buckets", "3", "--out", str(tmp_path / "cli"), "--device", "cpu"]) == 0
    said = capsys.readouterr().out
    assert "wrote" in said and "ppl_position.png" in said
    assert {p.name for p in (tmp_path / "cli").iterdir()} == {"ppl_position.json", "ppl_position.png", "ppl_position.md"}


def test_plain_ppl_reads_jsonl_text_without_a_text_field_flag(teacher_dir, books, tmp_path):
    from linearize.eval.perplexity import run_ppl

    result = run_ppl([teacher_dir], books, tmp_path / "ppl", max_tokens=64, device="cpu")
    assert result["tokens"] == 64 and math.isfinite(result["models"][0]["ppl"])
