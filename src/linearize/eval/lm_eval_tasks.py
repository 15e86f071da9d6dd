"""lm-eval task configs that read PIQA, ARC, HellaSwag, WinoGrande and MMLU from a local folder.

The configs ship in ``linearize/eval/tasks/`` (YAML in lm-eval's own format, prompts and metrics
as lm-eval's built-in tasks); the data does not. The folder they read has this layout (the one of
the development splits in ``shared/data/evaldev``; a full copy in the same layout works unchanged)::

    piqa.jsonl            goal, sol1, sol2, label (0/1)                           acc
    arc_easy.jsonl        query ("Question: ..."), choices, gold (index)          acc
    arc_challenge.jsonl   query, choices, gold                                    acc_norm
    hellaswag.jsonl       query (activity label + context), choices, gold         acc_norm
    winogrande.jsonl      sentence (with "_"), option1, option2, answer ("1"/"2") acc (partial scoring)
    mmlu/dev/<subject>_dev.csv   headerless: question, A, B, C, D, answer letter  the 5-shot exemplars
    mmlu/val/<subject>_val.csv   same                                             acc, 5-shot

Task names are our own (``linearize_piqa``, ..., ``linearize_mmlu``) so they never clash with
lm-eval's; ``TASKS`` maps the short aliases (``piqa``, ``arc_easy``, ...) to them.
``linearize_mmlu`` is a group over the subjects whose ``mmlu/val`` file exists (each subject
5-shot from its own ``mmlu/dev`` file); its acc is the size-weighted mean, as lm-eval's mmlu.

How the folder reaches the configs: ``render_tasks(data_dir)`` writes, into a temporary folder,
one small YAML per task that includes the shipped config and names the folder in
``dataset_kwargs``, plus one per MMLU subject found and the MMLU group. That folder is the
``include_path`` lm-eval reads (``task_manager(data_dir)`` builds the TaskManager). The shipped
configs load their rows through ``custom_dataset`` (``tasks/loaders.py`` -> the ``load_*``
functions below), which read the files directly, without the datasets cache; a missing file is a
FileNotFoundError naming it. Used without rendering (lm-eval pointed at ``tasks/`` itself), the
loaders read the folder from ``$LINEARIZE_EVAL_DATA``.
"""

from __future__ import annotations

import atexit
import csv
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

DATA_ENV = "LINEARIZE_EVAL_DATA"
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
MMLU_TEMPLATE = TASKS_DIR / "_linearize_mmlu_template_yaml"  # no .yaml suffix: lm-eval does not index it
MMLU_GROUP = "linearize_mmlu"
MMLU_TASK_PREFIX = "linearize_mmlu_"


@dataclass(frozen=True)
class TaskSpec:
    alias: str       # what `linearize eval lm-eval --tasks` accepts
    name: str        # the lm-eval task (or group) name
    file: str        # the file (or, for MMLU, the folder) it reads, relative to the data folder
    metric: str      # the headline metric, as the papers report it
    chance: float    # accuracy of a uniform guess
    title: str


TASKS: dict[str, TaskSpec] = {s.alias: s for s in (
    TaskSpec("piqa", "linearize_piqa", "piqa.jsonl", "acc", 0.5, "PIQA"),
    TaskSpec("arc_easy", "linearize_arc_easy", "arc_easy.jsonl", "acc", 0.25, "ARC-Easy"),
    TaskSpec("arc_challenge", "linearize_arc_challenge", "arc_challenge.jsonl", "acc_norm", 0.25, "ARC-Challenge"),
    TaskSpec("hellaswag", "linearize_hellaswag", "hellaswag.jsonl", "acc_norm", 0.25, "HellaSwag"),
    TaskSpec("winogrande", "linearize_winogrande", "winogrande.jsonl", "acc", 0.5, "WinoGrande"),
    TaskSpec("mmlu", MMLU_GROUP, "mmlu", "acc", 0.25, "MMLU (5-shot)"),
)}
BY_NAME = {s.name: s for s in TASKS.values()}

_FIELDS = {  # required fields of each JSONL file
    "piqa": ("goal", "sol1", "sol2", "label"),
    "arc_easy": ("query", "choices", "gold"),
    "arc_challenge": ("query", "choices", "gold"),
    "hellaswag": ("query", "choices", "gold"),
    "winogrande": ("sentence", "option1", "option2", "answer"),
}
_LAYOUT_HINT = "the layout is the one of shared/data/evaldev (see linearize.eval.lm_eval_tasks)"


# --------------------------------------------------------------------------- names and files

def resolve_tasks(names: Iterable[str] | str | None) -> list[TaskSpec]:
    """Task specs for aliases (``piqa``) or lm-eval names (``linearize_piqa``), comma-separated or
    not, in order, without repeats; ``None`` or ``all`` means all six."""
    if names is None:
        return list(TASKS.values())
    if isinstance(names, str):
        names = [names]
    out: list[TaskSpec] = []
    for item in names:
        for name in str(item).split(","):
            name = name.strip()
            if not name:
                continue
            if name == "all":
                specs = list(TASKS.values())
            elif name in TASKS:
                specs = [TASKS[name]]
            elif name in BY_NAME:
                specs = [BY_NAME[name]]
            else:
                raise ValueError(f"unknown task {name!r}; available: {', '.join(TASKS)} or all "
                                 f"(lm-eval names: {', '.join(BY_NAME)})")
            out += [s for s in specs if s not in out]
    if not out:
        raise ValueError(f"no task given; available: {', '.join(TASKS)} or all")
    return out


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    """The data folder: the argument, else ``$LINEARIZE_EVAL_DATA``; it must exist."""
    if data_dir is None or str(data_dir) == "":
        data_dir = os.environ.get(DATA_ENV) or None
    if data_dir is None:
        raise ValueError(f"no data folder for the linearize_* tasks: pass --data-dir DIR (or set {DATA_ENV}); "
                         + _LAYOUT_HINT)
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"data folder {path} does not exist ({_LAYOUT_HINT})")
    return path.resolve()


def mmlu_subjects(data_dir: str | os.PathLike) -> list[str]:
    """The subjects with an ``mmlu/val/<subject>_val.csv`` file, sorted."""
    val = Path(data_dir) / "mmlu" / "val"
    return sorted(p.name[: -len("_val.csv")] for p in val.glob("*_val.csv")) if val.is_dir() else []


def required_files(spec: TaskSpec, data_dir: str | os.PathLike) -> list[Path]:
    """The files a task reads (for MMLU: a val and a dev file per subject found)."""
    root = Path(data_dir)
    if spec.alias != "mmlu":
        return [root / spec.file]
    subjects = mmlu_subjects(root)
    if not subjects:
        return [root / "mmlu" / "val" / "<subject>_val.csv"]
    return [root / "mmlu" / split / f"{s}_{split}.csv" for s in subjects for split in ("val", "dev")]


def check_data(data_dir: str | os.PathLike | None, tasks: Iterable[TaskSpec]) -> Path:
    """Fail before any model loads when a task's file is missing; returns the resolved folder."""
    root = resolve_data_dir(data_dir)
    for spec in tasks:
        missing = [p for p in required_files(spec, root) if not p.is_file()]
        if missing:
            shown = ", ".join(str(p) for p in missing[:3]) + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
            raise FileNotFoundError(f"task {spec.alias} ({spec.name}) needs {shown}, which does not exist; "
                                    + _LAYOUT_HINT)
    return root


# --------------------------------------------------------------------------- reading the files

def _read_jsonl(path: Path, fields: tuple[str, ...]) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist ({_LAYOUT_HINT})")
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {i}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {i}: expected a JSON object, got {type(row).__name__}")
            lacking = [k for k in fields if k not in row]
            if lacking:
                raise ValueError(f"{path}, line {i}: missing field(s) {', '.join(lacking)} "
                                 f"(expected {', '.join(fields)})")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} has no rows")
    return rows


def _check_choice_rows(path: Path, rows: list[dict]) -> None:
    for i, row in enumerate(rows, 1):
        choices, gold = row["choices"], row["gold"]
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
            raise ValueError(f"{path}, row {i}: choices must be a list of at least 2 strings, got {choices!r}")
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
            raise ValueError(f"{path}, row {i}: gold must be an index into choices (0..{len(choices) - 1}), got {gold!r}")


def _as_dataset(splits: dict[str, list[dict]]):
    import datasets

    return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})


def _data_root(data_dir) -> Path:
    return resolve_data_dir(data_dir)


def read_task_rows(alias: str, data_dir: str | os.PathLike | None) -> list[dict]:
    """The rows of a JSONL task, checked and normalised (what the lm-eval task scores)."""
    if alias not in _FIELDS:
        raise ValueError(f"read_task_rows takes one of {', '.join(_FIELDS)}, got {alias!r}")
    path = _data_root(data_dir) / TASKS[alias].file
    rows = _read_jsonl(path, _FIELDS[alias])
    if alias == "piqa":
        for i, row in enumerate(rows, 1):
            if row["label"] not in (0, 1) or isinstance(row["label"], bool):
                raise ValueError(f"{path}, row {i}: label must be 0 or 1, got {row['label']!r}")
        return [{k: row[k] for k in _FIELDS[alias]} for row in rows]
    if alias == "winogrande":
        out = []
        for i, row in enumerate(rows, 1):
            answer = str(row["answer"]).strip()
            if answer not in ("1", "2"):
                raise ValueError(f"{path}, row {i}: answer must be \"1\" or \"2\", got {row['answer']!r}")
            if "_" not in row["sentence"]:
                raise ValueError(f"{path}, row {i}: sentence has no blank (\"_\"): {row['sentence']!r}")
            out.append({"sentence": row["sentence"], "option1": str(row["option1"]), "option2": str(row["option2"]),
                        "answer": answer})
        return out
    _check_choice_rows(path, rows)
    if alias == "hellaswag":
        return [{"query": hellaswag_preprocess(r["query"]), "choices": [hellaswag_preprocess(c) for c in r["choices"]],
                 "gold": r["gold"]} for r in rows]
    return [{"query": r["query"], "choices": list(r["choices"]), "gold": r["gold"]} for r in rows]


def read_mmlu_csv(path: Path) -> list[dict]:
    """Rows of a headerless MMLU CSV (question, A, B, C, D, answer letter) as
    ``{"question", "choices", "answer"}`` with the answer as an index."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist ({_LAYOUT_HINT})")
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for i, rec in enumerate(csv.reader(f), 1):
            if not rec or all(not c.strip() for c in rec):
                continue
            if len(rec) != 6:
                raise ValueError(f"{path}, record {i}: expected 6 columns (question, A, B, C, D, answer), got {len(rec)}")
            letter = rec[5].strip().upper()
            if letter not in ("A", "B", "C", "D"):
                raise ValueError(f"{path}, record {i}: answer must be A, B, C or D, got {rec[5]!r}")
            rows.append({"question": rec[0], "choices": rec[1:5], "answer": "ABCD".index(letter)})
    if not rows:
        raise ValueError(f"{path} has no rows")
    return rows


# --------------------------------------------------------------------------- custom_dataset targets
# lm-eval calls these with the task's metadata (which includes the model's arguments) and
# dataset_kwargs as keyword arguments: everything but data_dir / subject is ignored.

def load_piqa(data_dir=None, **_):
    return _as_dataset({"test": read_task_rows("piqa", data_dir)})


def load_arc_easy(data_dir=None, **_):
    return _as_dataset({"test": read_task_rows("arc_easy", data_dir)})


def load_arc_challenge(data_dir=None, **_):
    return _as_dataset({"test": read_task_rows("arc_challenge", data_dir)})


def load_hellaswag(data_dir=None, **_):
    return _as_dataset({"test": read_task_rows("hellaswag", data_dir)})


def load_winogrande(data_dir=None, **_):
    return _as_dataset({"test": read_task_rows("winogrande", data_dir)})


def load_mmlu(data_dir=None, subject=None, **_):
    """One subject: ``test`` from mmlu/val, ``dev`` (the 5-shot exemplars) from mmlu/dev."""
    if not subject:
        raise ValueError("an MMLU subject task needs dataset_kwargs.subject")
    root = _data_root(data_dir) / "mmlu"
    return _as_dataset({"test": read_mmlu_csv(root / "val" / f"{subject}_val.csv"),
                        "dev": read_mmlu_csv(root / "dev" / f"{subject}_dev.csv")})


# --------------------------------------------------------------------------- prompt pieces

def hellaswag_preprocess(text: str) -> str:
    """lm-eval's HellaSwag clean-up (WikiHow's bracket artefacts); a no-op on clean text."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def winogrande_gold_index(doc: dict) -> int:
    """WinoGrande is scored by partial evaluation: each option fills the blank and forms a
    context, the rest of the sentence is the continuation scored; the gold context wins."""
    return {"1": 0, "2": 1}[str(doc["answer"]).strip()]


def winogrande_contexts(doc: dict) -> list[str]:
    blank = doc["sentence"].index("_")
    return [doc["sentence"][:blank] + option for option in (doc["option1"], doc["option2"])]


def winogrande_continuation(doc: dict) -> str:
    blank = doc["sentence"].index("_")
    return doc["sentence"][blank + 1:].strip()


def mmlu_description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


# --------------------------------------------------------------------------- rendering

_RENDERED: list[Path] = []


class _QuietCustomDataset(logging.Filter):
    """lm-eval logs, for every task that loads through ``custom_dataset``, a hint about
    ``--metadata`` that does not apply to ours (57 of them for MMLU): drop it for linearize_* tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not (msg.startswith("linearize_") and "Custom kwargs can be passed" in msg)


def _quiet_lm_eval() -> None:
    logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _QuietCustomDataset) for f in logger.filters):
        logger.addFilter(_QuietCustomDataset())


def _cleanup() -> None:
    for path in _RENDERED:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_cleanup)


def render_tasks(data_dir: str | os.PathLike | None, dest: str | os.PathLike | None = None) -> Path:
    """Write the include folder lm-eval reads for ``data_dir``; returns it.

    One YAML per task that includes the shipped config and names the folder, one per MMLU subject
    found in ``mmlu/val`` and the ``linearize_mmlu`` group over them. ``data_dir=None`` writes the
    five single tasks without a folder (their loaders then read ``$LINEARIZE_EVAL_DATA``) and no MMLU.
    Without ``dest`` a temporary folder is used, removed when the process exits.
    """
    import yaml

    _quiet_lm_eval()
    root = resolve_data_dir(data_dir) if data_dir is not None else None
    if dest is None:
        out = Path(tempfile.mkdtemp(prefix="linearize-lm-eval-tasks-"))
        _RENDERED.append(out)
    else:
        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
    kwargs = {"data_dir": str(root)} if root is not None else {}

    def write(name: str, cfg: dict) -> None:
        (out / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True), encoding="utf-8")

    for spec in TASKS.values():
        if spec.alias == "mmlu":
            continue
        cfg = {"include": str(TASKS_DIR / f"{spec.name}.yaml"), "task": spec.name}
        if kwargs:
            cfg["dataset_kwargs"] = dict(kwargs)
        write(spec.name, cfg)
    subjects = mmlu_subjects(root) if root is not None else []
    for subject in subjects:
        write(MMLU_TASK_PREFIX + subject, {
            "include": str(MMLU_TEMPLATE), "task": MMLU_TASK_PREFIX + subject, "task_alias": subject,
            "description": mmlu_description(subject), "dataset_kwargs": {**kwargs, "subject": subject}})
    if subjects:
        write(MMLU_GROUP, {"group": MMLU_GROUP, "group_alias": "mmlu",
                           "task": [MMLU_TASK_PREFIX + s for s in subjects],
                           "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],
                           "metadata": {"version": 1.0}})
    return out


def task_manager(data_dir: str | os.PathLike | None, *, include_defaults: bool = False,
                 include_path: str | os.PathLike | list | None = None, metadata: dict | None = None):
    """An lm-eval ``TaskManager`` that knows the ``linearize_*`` tasks reading ``data_dir``.

    ``include_defaults=True`` also indexes lm-eval's own tasks (about 10 s); ``include_path``
    adds folders of your own::

        import linearize, lm_eval
        from linearize.eval.lm_eval_tasks import task_manager
        lm_eval.simple_evaluate(model="linearize", model_args="path=runs/lizard",
                                tasks=["linearize_piqa", "linearize_mmlu"],
                                task_manager=task_manager("data/evaldev"))
    """
    from lm_eval.tasks import TaskManager

    extra = [] if include_path is None else list(include_path) if isinstance(include_path, (list, tuple)) else [include_path]
    paths = [str(render_tasks(data_dir)), *(str(p) for p in extra)]
    return TaskManager(include_path=paths, include_defaults=include_defaults, metadata=metadata)
