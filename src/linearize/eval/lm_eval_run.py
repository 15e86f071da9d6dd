"""``linearize eval lm-eval``: teachers and students on the same lm-eval tasks, side by side.

Every model is scored through lm-eval itself (``simple_evaluate`` with the ``linearize`` model
class and the task configs of ``lm_eval_tasks``) on the tasks read from a local data folder, and
the headline metric of each task (acc; acc_norm for ARC-Challenge and HellaSwag; MMLU's 5-shot
acc, weighted by subject size) goes into one table. Writes ``lm_eval.json`` (every metric, its
standard error, the example counts), ``lm_eval.png`` (grouped bars per task with the chance
level marked) and ``lm_eval.md``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import subprocess
import sys
import time
from numbers import Integral, Real
from pathlib import Path
from typing import Sequence

import torch

from ..models.loading import check_model_name, is_checkpoint, model_label
from ..records import environment, markdown_table, new_figure, save_png, write_outputs
from .lm_eval_tasks import TASKS, TaskSpec, check_data, resolve_tasks, task_manager

STEM = "lm_eval"


def _check_limit(limit):
    """None, a count >= 1 (an integral float is a count) or a fraction in (0, 1)."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, Real):
        raise ValueError(f"limit must be a number of examples (>= 1) or a fraction in (0, 1), got {limit!r}")
    if isinstance(limit, Integral) or float(limit).is_integer():
        if limit < 1:
            raise ValueError(f"limit must be a number of examples (>= 1) or a fraction in (0, 1), got {limit!r}")
        return int(limit)
    if not 0 < limit < 1:
        raise ValueError(f"limit must be a number of examples (>= 1) or a fraction in (0, 1), got {limit!r}")
    return float(limit)


def _quiet_git_commit_hash():
    """lm-eval's ``get_git_commit_hash`` (the commit of the working directory, recorded in its
    results) with git's stderr discarded: the same command and fallback, the same result."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):  # not a repository, or no git
        return get_commit_from_path(os.getcwd())


@contextlib.contextmanager
def quiet_git():
    """Within the block, lm-eval looks up the working directory's git commit without letting git
    print ``fatal: not a git repository`` on the terminal outside a repository (lm-eval runs
    ``git describe`` with its stderr inherited). Only git's own stderr is discarded."""
    patched = []
    try:
        from lm_eval import evaluator
        from lm_eval.loggers import utils as logger_utils
    except Exception:  # a different lm-eval layout: leave it as it is
        evaluator = logger_utils = None
    for module in (evaluator, logger_utils):
        if module is not None and callable(getattr(module, "get_git_commit_hash", None)):
            patched.append((module, module.get_git_commit_hash))
            module.get_git_commit_hash = _quiet_git_commit_hash
    try:
        yield
    finally:
        for module, original in patched:
            module.get_git_commit_hash = original


def _task_result(spec: TaskSpec, res: dict) -> dict:
    """One task's numbers from lm-eval's results dict."""
    row = res["results"][spec.name]
    metrics, stderrs = {}, {}
    for key, value in row.items():
        if not key.endswith(",none") or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        name = key[: -len(",none")]
        if name.endswith("_stderr"):
            stderrs[name[: -len("_stderr")]] = float(value)
        else:
            metrics[name] = float(value)
    if spec.metric not in metrics:
        raise RuntimeError(f"lm-eval returned no {spec.metric} for {spec.name} (got {', '.join(metrics) or 'nothing'})")
    subtasks = res.get("group_subtasks", {}).get(spec.name) or [spec.name]
    n_samples = res.get("n-samples", {})
    n = sum(int(n_samples.get(t, {}).get("effective", 0)) for t in subtasks)
    out = {"metric": spec.metric, "value": metrics[spec.metric], "stderr": stderrs.get(spec.metric),
           "metrics": metrics, "stderrs": stderrs, "n": n, "num_fewshot": res.get("n-shot", {}).get(spec.name)}
    if subtasks != [spec.name]:  # MMLU: acc per subject
        out["subtasks"] = {res["results"][t].get("alias", t).strip(" -"): res["results"][t].get(f"{spec.metric},none")
                           for t in subtasks if t in res["results"]}
        out["num_fewshot"] = res.get("n-shot", {}).get(subtasks[0], out["num_fewshot"])
    return out


def run_lm_eval(models: Sequence[str], tasks: Sequence[str] | str | None, data_dir, out_dir, *,
                limit: int | float | None = None, device: str | None = None, batch_size: int | str = 8,
                num_fewshot: int | None = None, dtype: str | None = None, max_length: int | None = None) -> dict:
    """Evaluate every model on every task through lm-eval; write lm_eval.json/.png/.md to ``out_dir``.

    ``models``: checkpoint directories or teacher names (``smollm2-135m``); ``tasks``: aliases
    (``piqa arc_easy arc_challenge hellaswag winogrande mmlu``, ``all``, or None for all) or the
    ``linearize_*`` names; ``data_dir``: the folder in the evaldev layout (None: $LINEARIZE_EVAL_DATA);
    ``limit``: examples per task (per subject for MMLU), or a fraction; ``num_fewshot``: overrides
    the tasks' own (0, and 5 for MMLU). Returns the dict written to lm_eval.json.
    """
    import lm_eval

    if isinstance(models, str) or not models:
        raise ValueError("give at least one model (a checkpoint directory or a teacher name) as a list")
    for name in models:
        if not is_checkpoint(name):
            check_model_name(name)
    specs = resolve_tasks(tasks)
    root = check_data(data_dir, specs)
    limit = _check_limit(limit)
    if num_fewshot is not None and (isinstance(num_fewshot, bool) or not isinstance(num_fewshot, Integral)
                                    or num_fewshot < 0):
        raise ValueError(f"num_fewshot must be an integer >= 0, got {num_fewshot!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")

    from .harness import LinearizeLM

    manager = task_manager(root)
    results = []
    for k, name in enumerate(models, 1):
        print(f"lm-eval: model {k}/{len(models)} {name}: {', '.join(s.alias for s in specs)}"
              + (f" (limit {limit})" if limit is not None else ""), file=sys.stderr, flush=True)
        start = time.perf_counter()
        lm = LinearizeLM(path=name, device=device, dtype=dtype or "auto", batch_size=batch_size, max_length=max_length)
        with quiet_git():
            res = lm_eval.simple_evaluate(model=lm, tasks=[s.name for s in specs], task_manager=manager, limit=limit,
                                          num_fewshot=num_fewshot, log_samples=False)
        if res is None:  # pragma: no cover - only on a non-zero rank
            raise RuntimeError("lm-eval returned no results")
        results.append({"model": name, "label": model_label(name), "linearized": lm.linearized,
                        "dtype": str(next(lm.model.parameters()).dtype).replace("torch.", ""),
                        "max_length": lm.max_length, "seconds": time.perf_counter() - start,
                        "results": {s.alias: _task_result(s, res) for s in specs}})
        del lm, res
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    data = {"data_dir": str(root), "limit": limit, "num_fewshot": num_fewshot,
            "tasks": [{"alias": s.alias, "name": s.name, "title": s.title, "metric": s.metric, "chance": s.chance}
                      for s in specs],
            "models": results, "lm_eval_version": getattr(lm_eval, "__version__", None),
            "environment": environment(device)}
    write_outputs(out_dir, STEM, data, lm_eval_markdown, lm_eval_figure)
    return data


def _cell(r: dict | None) -> str | None:
    if r is None or r.get("value") is None:
        return None
    se = r.get("stderr")
    return f"{r['value']:.3f}" + (f" ± {se:.3f}" if se is not None and math.isfinite(se) else "")


def lm_eval_markdown(data: dict) -> str:
    models, tasks = data["models"], data["tasks"]
    labels = [m["label"] for m in models]
    rows = []
    for t in tasks:
        first = models[0]["results"].get(t["alias"], {}) if models else {}
        shots = first.get("num_fewshot")
        title = t["title"] if t["alias"] == "mmlu" or not shots else f"{t['title']} ({shots}-shot)"
        rows.append([title, t["metric"], first.get("n"), t["chance"],
                     *[_cell(m["results"].get(t["alias"])) for m in models]])
    if len(tasks) > 1:
        means = []
        for m in models:
            values = [m["results"].get(t["alias"], {}).get("value") for t in tasks]
            means.append(f"{sum(values) / len(values):.3f}" if all(v is not None for v in values) else None)
        rows.append(["mean of the tasks above", "", None, None, *means])
    env = data["environment"]
    limit = data.get("limit")
    lines = [f"# lm-eval on {data['data_dir']}", "",
             "Headline metric per task (acc; acc_norm for ARC-Challenge and HellaSwag; MMLU 5-shot acc, "
             "weighted by subject size), ± its standard error; n = examples scored"
             + (f" (limit {limit} per task, per subject for MMLU)" if limit is not None else "") + ".", "",
             markdown_table(["task", "metric", "n", "chance", *labels], rows), ""]
    for m in models:
        lines.append(f"- {m['label']}: {'linearized' if m['linearized'] else 'softmax attention'}, {m['dtype']}, "
                     f"{m['seconds']:.0f} s")
    lines += ["", f"Device: {env['device']}; torch {env['torch']}; lm-eval {data.get('lm_eval_version')}. "
                  f"Command: `{env['command']}`", ""]
    return "\n".join(lines)


def lm_eval_figure(data: dict, path: Path) -> None:
    models, tasks = data["models"], data["tasks"]
    fig, ax = new_figure((2.0 + 1.0 * len(tasks) * max(1, len(models)) ** 0.5 + 0.3 * len(models), 4.0))
    width = 0.8 / max(1, len(models))
    palette = ["#1a9641", "#2b83ba", "#d7191c", "#fdae61", "#7b3294", "#008837", "#e66101"]
    students = 0
    for j, m in enumerate(models):
        if m["linearized"]:
            color, students = palette[students % len(palette)], students + 1
        else:
            color = "#404040" if j == 0 else "#969696"
        xs, ys, es = [], [], []
        for i, t in enumerate(tasks):
            r = m["results"].get(t["alias"])
            if r is None or r.get("value") is None:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(r["value"])
            es.append(r["stderr"] if r.get("stderr") is not None else 0.0)
        bars = ax.bar(xs, ys, width * 0.92, yerr=es, capsize=2, color=color, label=m["label"],
                      error_kw={"elinewidth": 0.8, "ecolor": "0.2"})
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    from matplotlib import patheffects

    for i, t in enumerate(tasks):  # dark dashes with a white edge: visible on bars and on white
        ax.hlines(t["chance"], i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1.2, zorder=3,
                  label="chance" if i == 0 else None,
                  path_effects=[patheffects.withStroke(linewidth=2.8, foreground="white")])
    ax.set_xticks(range(len(tasks)), [f"{t['title']}\n{t['metric']}" for t in tasks], fontsize=8)
    top = max([r["value"] for m in models for r in m["results"].values() if r.get("value") is not None] + [0.5])
    ax.set_ylim(0, min(1.0, top + 0.15) if top < 0.85 else 1.05)
    ax.set_ylabel("accuracy")
    limit = data.get("limit")
    ax.set_title(f"lm-eval on {Path(str(data['data_dir'])).name}" + (f" (limit {limit})" if limit is not None else ""),
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper right", ncols=min(3, len(models) + 1))
    save_png(fig, path)


__all__ = ["STEM", "TASKS", "lm_eval_figure", "lm_eval_markdown", "run_lm_eval"]
