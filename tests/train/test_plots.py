"""Loss-curve PNGs from a metrics JSONL (linearize.train.plots)."""

from __future__ import annotations

import json
import math

import pytest

from linearize.train.plots import (LAYER_MSE_PNG, STAGE1_LOSS_PNG, STAGE2_LOSS_PNG, plot_metrics,
                                   read_metrics)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
N_LAYERS = 6


def stage1_records(steps=8, val=True):
    out = []
    for step in range(1, steps + 1):
        mse = [0.5 * (layer + 1) / step for layer in range(N_LAYERS)]
        out.append({"stage": "stage1", "split": "train", "step": step, "tokens": 512 * step,
                    "loss": sum(mse) / N_LAYERS, "lr": 0.01, "layer_mse": mse, "time": 0.1 * step})
        if val and step % 2 == 0:
            out.append({"stage": "stage1", "split": "val", "step": step, "tokens": 512 * step,
                        "loss": 0.9 * sum(mse) / N_LAYERS, "layer_mse": [0.9 * m for m in mse]})
    return out


def stage2_records(steps=8):
    out = []
    for step in range(1, steps + 1):
        out.append({"stage": "stage2", "split": "train", "step": step, "tokens": 512 * step,
                    "loss": 4.0 - 0.2 * step, "ce": 4.0 - 0.2 * step, "kl": 0.0, "lr": 1e-4})
        if step % 4 == 0:
            out.append({"stage": "stage2", "split": "val", "step": step, "tokens": 512 * step,
                        "loss": 3.9 - 0.2 * step, "ppl": math.exp(3.9 - 0.2 * step)})
    return out


def write_jsonl(path, records, tail: str = ""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    assert len(data) > 5_000, f"{path.name} is suspiciously small ({len(data)} bytes)"
    from matplotlib.image import imread

    image = imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.01, f"{path.name} is blank"


def test_all_three_figures_from_both_stages(tmp_path):
    events = [{"event": "stage_start", "stage": "stage1"}, {"event": "nonfinite", "stage": "stage2", "step": 5}]
    metrics = write_jsonl(tmp_path / "metrics.jsonl", events[:1] + stage1_records() + stage2_records() + events[1:])
    written = plot_metrics(metrics, tmp_path / "plots")
    assert sorted(p.name for p in written) == sorted([LAYER_MSE_PNG, STAGE1_LOSS_PNG, STAGE2_LOSS_PNG])
    for p in written:
        assert p.parent == tmp_path / "plots"
        assert_png(p)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(p.name for p in written), \
        "temporary files left behind"


def test_only_the_figures_whose_records_exist(tmp_path):
    metrics = write_jsonl(tmp_path / "m2.jsonl", stage2_records())
    written = plot_metrics(metrics, tmp_path / "s2")
    assert [p.name for p in written] == [STAGE2_LOSS_PNG]
    assert sorted(p.name for p in (tmp_path / "s2").iterdir()) == [STAGE2_LOSS_PNG]

    metrics = write_jsonl(tmp_path / "m1.jsonl", stage1_records())
    written = plot_metrics(metrics, tmp_path / "s1")
    assert sorted(p.name for p in written) == sorted([LAYER_MSE_PNG, STAGE1_LOSS_PNG])

    # events only: nothing to plot, and no error (a run whose stages were both skipped)
    metrics = write_jsonl(tmp_path / "ev.jsonl", [{"event": "nonfinite", "stage": "stage2", "step": 1}])
    assert plot_metrics(metrics, tmp_path / "ev") == []


def test_layer_mse_falls_back_to_train_records(tmp_path):
    metrics = write_jsonl(tmp_path / "m.jsonl", stage1_records(val=False))
    written = plot_metrics(metrics, tmp_path)
    assert sorted(p.name for p in written) == sorted([LAYER_MSE_PNG, STAGE1_LOSS_PNG])
    for p in written:
        assert_png(p)


def test_many_layers_and_odd_values(tmp_path):
    """30 layers (a colour bar instead of a legend), a zero and a NaN loss, a single val point."""
    records = []
    for step in range(1, 5):
        records.append({"stage": "stage1", "split": "val", "step": step,
                        "layer_mse": [0.0 if layer == 3 else 1.0 / (step + layer) for layer in range(30)]})
    records.append({"stage": "stage2", "split": "train", "step": 1, "loss": float("nan")})
    records.append({"stage": "stage2", "split": "train", "step": 2, "loss": 3.0})
    records.append({"stage": "stage2", "split": "val", "step": 2, "loss": 2.9})
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in records) + "\n")  # json writes NaN
    written = plot_metrics(metrics, tmp_path)
    assert sorted(p.name for p in written) == sorted([LAYER_MSE_PNG, STAGE2_LOSS_PNG])
    for p in written:
        assert_png(p)


def test_rewriting_replaces_the_figures(tmp_path):
    metrics = write_jsonl(tmp_path / "metrics.jsonl", stage2_records(4))
    (first,) = plot_metrics(metrics, tmp_path)
    before = first.read_bytes()
    write_jsonl(metrics, stage2_records(12))
    (second,) = plot_metrics(metrics, tmp_path)
    assert second == first and second.read_bytes() != before
    assert_png(second)


def test_truncated_last_line_is_tolerated(tmp_path):
    records = stage1_records(4) + stage2_records(4)
    metrics = write_jsonl(tmp_path / "metrics.jsonl", records, tail='{"stage": "stage2", "split": "tr')
    assert read_metrics(metrics) == records
    assert len(plot_metrics(metrics, tmp_path)) == 3


def test_blank_lines_are_skipped(tmp_path):
    records = stage2_records(2)
    path = tmp_path / "m.jsonl"
    path.write_text("\n" + json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n\n")
    assert read_metrics(path) == records


def test_malformed_line_in_the_middle_is_an_error(tmp_path):
    records = stage2_records(4)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(records[0]) + "\n{oops\n" + json.dumps(records[1]) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2"):
        read_metrics(path)
    path.write_text(json.dumps(records[0]) + "\n[1, 2]\n" + json.dumps(records[1]) + "\n")
    with pytest.raises(ValueError, match=r"line 2: expected a JSON object"):
        read_metrics(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        plot_metrics(tmp_path / "nope.jsonl", tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_metrics(tmp_path / "nope.jsonl")


def test_empty_file_is_named(tmp_path):
    for text in ("", "\n\n", '{"stage": "stage1", "spl'):  # empty, blank, only a truncated line
        path = tmp_path / "empty.jsonl"
        path.write_text(text)
        with pytest.raises(ValueError, match="empty.jsonl"):
            plot_metrics(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def blockwise_records(blocks=((0, 1), (2, 3)), steps=4):
    """Block-wise stage 1 as the loop writes it: one stage name per block, steps from 0 in each,
    ``layers`` naming the layer of each layer_mse entry (train records average them into floats)."""
    out = []
    for b, layers in enumerate(blocks):
        name = f"stage1-block{b}"
        for step in range(0, steps + 1):
            mse = [0.1 * (layer + 1) / (step + 1) for layer in layers]
            if step:
                out.append({"stage": name, "split": "train", "step": step, "loss": sum(mse), "layer_mse": mse,
                            "layers": [float(layer) for layer in layers]})
            if step % 2 == 0:
                out.append({"stage": name, "split": "val", "step": step, "loss": sum(mse), "layer_mse": mse,
                            "layers": list(layers)})
    return out


def test_blockwise_stage1_is_one_run_with_each_layer_in_place(tmp_path):
    from linearize.train.plots import _layer_points, _segments

    records = blockwise_records() + stage2_records(4)
    metrics = write_jsonl(tmp_path / "metrics.jsonl", records)
    written = plot_metrics(metrics, tmp_path)
    assert sorted(p.name for p in written) == sorted([LAYER_MSE_PNG, STAGE1_LOSS_PNG, STAGE2_LOSS_PNG])
    for p in written:
        assert_png(p)

    segments = _segments(records, "stage1")
    assert [(s.name, s.offset) for s in segments] == [("stage1-block0", 0.0), ("stage1-block1", 4.0)]
    points = _layer_points(segments, "val")
    assert sorted(points) == [0, 1, 2, 3], "layer_mse entries must land on the layers the records name"
    assert [x for x, _ in points[0]] == [0, 2, 4] and [x for x, _ in points[2]] == [4, 6, 8]
    assert points[3][0] == (4.0, pytest.approx(0.4))
    assert sorted(_layer_points(segments, "train")) == [0, 1, 2, 3]
