"""Tests of benchmarks/lion_minilm.py, the script behind docs/results/lion-minilm.*: it re-renders
its record from JSON alone (a fresh clone has no run directories). Not part of `make test` (pytest's
testpaths is tests/); run them with

    PYTHONPATH=src python -m pytest -q benchmarks/test_lion_minilm.py
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lion_minilm():
    return _load("lion_minilm")


def test_stage2_trend_reads_the_run_and_falls_back_to_the_record(lion_minilm, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"stage": "stage2", "split": "val", "step": s, "mean_cosine": c, "nn_agreement": n}
            for s, c, n in ((0, 0.98, 0.70), (50, 0.99, 0.80))]
    rows.insert(1, {"stage": "stage2", "split": "train", "step": 10, "loss": 0.1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"training": {"config": {"out": str(run)}}, "stage2_trend": "kept sentence"}
    text = lion_minilm._stage2_trend(data)
    assert "step 0: 0.980 / 0.70, step 50: 0.990 / 0.80" in text and "train" not in text
    # the run directory gone: the sentence the record kept, not an empty one
    data["training"]["config"]["out"] = str(tmp_path / "missing")
    assert lion_minilm._stage2_trend(data) == "kept sentence"
    del data["stage2_trend"]
    assert lion_minilm._stage2_trend(data) == ""


def test_the_recorded_lion_page_keeps_its_stage2_trend():
    """The committed record carries the trend its Markdown shows, so a re-render in a clone keeps it."""
    root = ROOT / "docs" / "results"
    data = json.loads((root / "lion-minilm.json").read_text())
    assert data["stage2_trend"].startswith("Over stage 2 the validation cosine / agreement")
    assert data["stage2_trend"] in (root / "lion-minilm.md").read_text()


def test_retime_measures_the_checkpoints_layer_again_and_the_page_says_so(lion_minilm, tmp_path, monkeypatch):
    """``--retime``: the timing table of a record's checkpoint, measured with the code as it is, from the
    checkpoint's own LION settings, with the command and date the page then quotes."""
    import linearize
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    model = linearize.convert(BertModel(config).eval(), "lion-s", chunk_size=8, sinks=1, window=2)
    linearize.save(model, tmp_path / "ckpt", merged=True)  # loads without a base model
    monkeypatch.setattr("sys.argv", ["benchmarks/lion_minilm.py", "--retime", "x.json"])
    cost = lion_minilm.retime(str(tmp_path / "ckpt"), [24], threads=1)
    assert (cost["heads"], cost["head_dim"], cost["chunk_size"], cost["sinks"], cost["window"]) == (2, 16, 8, 1, 2)
    for form, rows in cost["forms"].items():
        assert [r["tokens"] for r in rows] == [24] and rows[0]["ms"] > 0, (form, rows)
    assert cost["remeasured"]["command"] == ".venv/bin/python benchmarks/lion_minilm.py --retime x.json"
    assert "measured again after the training run" in lion_minilm._retimed({"cost": cost})
    assert lion_minilm._retimed({"cost": {"forms": {}}}) == ""
