"""Loss curves as PNG from the metrics JSONL that the training loop writes.

One JSON object per line. Records with a ``split`` ("train" or "val") are measurements; records
without one (``{"event": "nonfinite", ...}``) are events and are ignored here::

    {"stage": "stage1", "split": "train", "step": 12, "tokens": 6144, "loss": 0.12, "lr": 0.01, "layer_mse": [...]}
    {"stage": "stage1", "split": "val",   "step": 12, "tokens": 6144, "loss": 0.11, "layer_mse": [...]}
    {"stage": "stage2", "split": "train", "step": 40, "tokens": 20480, "loss": 3.1, "ce": 3.1, "kl": 0.0}
    {"stage": "stage2", "split": "val",   "step": 40, "tokens": 20480, "loss": 3.0, "ppl": 20.1}

Block-wise stage 1 names its stages ``stage1-block0``, ``stage1-block1``, ..., each counting steps
from 0, and its records carry ``layers`` (the layer index of each ``layer_mse`` entry).

``plot_metrics`` writes, for the records that exist,
  stage1_layer_mse.png  validation MSE of each layer against step (train records if there is no val);
  stage1_loss.png       stage-1 train and validation loss against step;
  stage2_loss.png       stage-2 train and validation loss against step.
Figures come from ``linearize.records`` (``new_figure``: no pyplot, no global backend state;
``save_png``: written to a temporary name and then renamed, so a reader never sees half a file).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..records import new_figure, save_png

LAYER_MSE_PNG = "stage1_layer_mse.png"
STAGE1_LOSS_PNG = "stage1_loss.png"
STAGE2_LOSS_PNG = "stage2_loss.png"


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics JSONL file, in order.

    Blank lines are skipped, and so is a malformed *last* line (a run killed mid-write leaves a
    truncated one). A malformed line anywhere else is an error naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file {path} does not exist")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == last:
                break  # truncated by a killed run
            raise ValueError(f"{path}, line {i + 1}: not valid JSON ({e})") from None
        if not isinstance(record, dict):
            if i == last:
                break
            raise ValueError(f"{path}, line {i + 1}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def plot_metrics(metrics_path: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Write the loss-curve PNGs for ``metrics_path`` into ``out_dir``; returns the paths written.

    Only the figures whose records exist are written (a run without stage 1 gets no stage-1
    figures; a file with only events gets none). An empty metrics file is a ValueError, a missing
    one a FileNotFoundError, both naming the file.

    Block-wise stage 1 (stages ``stage1-block0``, ``stage1-block1``, ... each counting its own
    steps, records naming their ``layers``) is drawn as one run: the blocks one after another on
    the step axis, separated by dotted lines, each layer_mse entry under its own layer.
    """
    metrics_path = Path(metrics_path)
    records = read_metrics(metrics_path)
    if not records:
        raise ValueError(f"metrics file {metrics_path} is empty: nothing to plot")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    written = []
    stage1, stage2 = _segments(records, "stage1"), _segments(records, "stage2")
    mse = _layer_points(stage1, "val")
    split = "validation"
    if not mse:
        mse, split = _layer_points(stage1, "train"), "train"
    if mse:
        written.append(save_png(_layer_mse_figure(mse, split, stage1), out_dir / LAYER_MSE_PNG))
    if any(_has_loss(seg.train) or _has_loss(seg.val) for seg in stage1):
        written.append(save_png(_loss_figure(stage1, "Stage 1: attention transfer", "attention-transfer loss (MSE)",
                                          log=True), out_dir / STAGE1_LOSS_PNG))
    if any(_has_loss(seg.train) or _has_loss(seg.val) for seg in stage2):
        written.append(save_png(_loss_figure(stage2, "Stage 2: LoRA", "loss", log=False), out_dir / STAGE2_LOSS_PNG))
    return written


class _Segment:
    """The records of one stage name (``stage1``, ``stage1-block2``, ...), its steps shifted by
    ``offset`` so that segments follow each other on one axis."""

    def __init__(self, name: str, offset: float, train: list[dict], val: list[dict]):
        self.name, self.offset, self.train, self.val = name, offset, train, val


def _segments(records: list[dict], stage: str) -> list[_Segment]:
    names = []
    for r in records:
        name = r.get("stage")
        if isinstance(name, str) and (name == stage or name.startswith(stage + "-")) and name not in names:
            names.append(name)
    segments, offset = [], 0.0
    for name in names:
        rows = [r for r in records if r.get("stage") == name and not math.isnan(_number(r.get("step")))]
        train = [r for r in rows if r.get("split") == "train"]
        val = [r for r in rows if r.get("split") == "val"]
        if not train and not val:
            continue
        segments.append(_Segment(name, offset, train, val))
        offset += max(_number(r["step"]) for r in train + val)
    return segments


def _layer_points(segments: list[_Segment], split: str) -> dict[int, list[tuple[float, float]]]:
    """layer index -> [(step on the shared axis, mse)], from the records of ``split``."""
    points: dict[int, list[tuple[float, float]]] = {}
    for seg in segments:
        for r in seg.val if split == "val" else seg.train:
            mse = r.get("layer_mse")
            if not isinstance(mse, list) or not mse:
                continue
            layers = r.get("layers")
            if not (isinstance(layers, list) and len(layers) == len(mse)
                    and all(not math.isnan(_number(i)) for i in layers)):
                layers = range(len(mse))
            x = seg.offset + _number(r["step"])
            for layer, value in zip(layers, mse):
                y = _number(value)
                if not math.isnan(y):
                    points.setdefault(int(round(_number(layer))), []).append((x, y))
    return {layer: sorted(p) for layer, p in sorted(points.items())}


def _number(value) -> float:
    if isinstance(value, bool):
        return math.nan
    try:
        x = float(value)
    except (TypeError, ValueError):
        return math.nan
    return x if math.isfinite(x) else math.nan


def _has_loss(records: list[dict]) -> bool:
    return any(not math.isnan(_number(r.get("loss"))) for r in records)


def _series(records: list[dict], key: str, offset: float = 0.0) -> tuple[list[float], list[float]]:
    points = sorted((offset + _number(r["step"]), _number(r.get(key))) for r in records)
    points = [(s, y) for s, y in points if not math.isnan(y)]
    return [s for s, _ in points], [y for _, y in points]


def _use_log(ax, values: list[float]) -> None:
    if values and all(v > 0 for v in values):
        ax.set_yscale("log")


def _mark_blocks(ax, segments: list[_Segment]) -> str:
    """Dotted lines between block segments; the x label that goes with them."""
    if len(segments) <= 1:
        return "optimizer step"
    for seg in segments[1:]:
        ax.axvline(seg.offset, color="0.6", linestyle=":", linewidth=1)
    return f"optimizer step ({len(segments)} blocks, one after another)"


def _layer_mse_figure(points: dict[int, list[tuple[float, float]]], split: str, segments: list[_Segment]):
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    fig, ax = new_figure()
    n_layers = max(points) + 1
    cmap = colormaps["viridis"]
    norm = Normalize(vmin=0, vmax=max(n_layers - 1, 1))
    values = []
    for layer, pts in points.items():
        xs, ys = zip(*pts)
        values.extend(ys)
        ax.plot(xs, ys, color=cmap(norm(layer)), marker="o" if len(xs) == 1 else None,
                linewidth=1.2, label=f"layer {layer}")
    _use_log(ax, values)
    ax.set_xlabel(_mark_blocks(ax, segments))
    ax.set_ylabel(f"{split} attention MSE")
    ax.set_title(f"Stage 1: per-layer attention-transfer MSE ({split})")
    ax.grid(True, which="major", alpha=0.3)
    if len(points) <= 10:
        ax.legend(fontsize="small", ncols=2)
    else:
        fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="layer")
    return fig


def _loss_figure(segments: list[_Segment], title: str, ylabel: str, log: bool):
    fig, ax = new_figure()
    values, labelled = [], set()
    for seg in segments:
        tx, ty = _series(seg.train, "loss", seg.offset)
        if tx:
            ax.plot(tx, ty, color="tab:blue", linewidth=1.2, marker="." if len(tx) == 1 else None,
                    label=None if "train" in labelled else "train")
            labelled.add("train")
            values.extend(ty)
        vx, vy = _series(seg.val, "loss", seg.offset)
        if vx:
            ax.plot(vx, vy, color="tab:orange", linestyle="--", linewidth=0.8, marker="o", markersize=5,
                    label=None if "val" in labelled else "validation")
            labelled.add("val")
            values.extend(vy)
    if log:
        _use_log(ax, values)
    ax.set_xlabel(_mark_blocks(ax, segments))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig
