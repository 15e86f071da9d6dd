"""``python -m linearize.cli.lm_eval``: lm-eval's own command line, with linearize's model and tasks known.

lm-eval's command line alone cannot load a third-party model class: the class registers itself
only once ``linearize`` is imported. This module imports it, points lm-eval at the linearize_*
task configs (``--include_path``, rendered for the data folder) and hands over to lm-eval's own
``cli_evaluate``. Every lm-eval flag means what it means there; one flag is added::

    --data-dir DIR   the folder the linearize_* tasks read (layout: linearize.eval.lm_eval_tasks;
                     default $LINEARIZE_EVAL_DATA)

Example::

    python -m linearize.cli.lm_eval --model linearize --model_args path=runs/lizard \\
        --tasks linearize_piqa,linearize_arc_challenge,linearize_mmlu --data-dir data/evaldev \\
        --batch_size 16 --output_path results/

Model arguments of ``--model linearize``: see ``linearize.eval.harness``; give the device and
batch size with lm-eval's ``--device`` / ``--batch_size`` (it always passes a device, so a
``device=`` in ``--model_args`` would be given twice). Task names:
linearize_piqa, linearize_arc_easy, linearize_arc_challenge, linearize_hellaswag,
linearize_winogrande, linearize_mmlu (and its subjects, linearize_mmlu_<subject>). lm-eval's own
tasks work too, where their data can be reached.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

_DATA_FLAGS = ("--data-dir", "--data_dir")
_HELP = f"""linearize: lm-eval's command line with model=linearize and the linearize_* tasks known.
  --data-dir DIR   folder the linearize_* tasks read (default $LINEARIZE_EVAL_DATA); tasks:
                   linearize_piqa, linearize_arc_easy, linearize_arc_challenge, linearize_hellaswag,
                   linearize_winogrande, linearize_mmlu
  --model linearize --model_args path=DIR|smollm2-135m[,dtype=auto,max_length=N]
                   (device and batch size through lm-eval's own --device and --batch_size)
lm-eval's own flags follow.
"""


def _pop_option(argv: list[str], names: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """The value of the last of ``names`` (``--x V`` or ``--x=V``) and argv without it."""
    value, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in names:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise SystemExit(f"error: {arg} needs a folder")
            value, i = argv[i + 1], i + 2
            continue
        if any(arg.startswith(n + "=") for n in names):
            value, i = arg.split("=", 1)[1], i + 1
            continue
        rest.append(arg)
        i += 1
    return value, rest


def _requested_tasks(argv: list[str]) -> list[str]:
    """Task names after --tasks / -t (space or comma separated)."""
    names, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--tasks", "-t"):
            i += 1
            while i < len(argv) and not argv[i].startswith("-"):
                names += argv[i].split(",")
                i += 1
            continue
        if arg.startswith("--tasks="):
            names += arg.split("=", 1)[1].split(",")
        i += 1
    return [n.strip() for n in names if n.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    data_dir, argv = _pop_option(argv, _DATA_FLAGS)
    if not argv or "-h" in argv or "--help" in argv:
        print(_HELP)

    import linearize  # noqa: F401  (registers model=linearize with lm-eval)
    from ..eval.lm_eval_tasks import BY_NAME, MMLU_TASK_PREFIX, TASKS, check_data, render_tasks

    ours = [BY_NAME[n] if n in BY_NAME else TASKS["mmlu"] for n in _requested_tasks(argv)
            if n in BY_NAME or n.startswith(MMLU_TASK_PREFIX)]
    try:
        if ours:
            data_dir = str(check_data(data_dir, ours))
        include = render_tasks(data_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    user_include, argv = _pop_option(argv, ("--include_path",))
    if user_include:  # lm-eval's flag takes one folder: theirs goes inside ours
        for part in user_include.split(":"):
            src = Path(part).expanduser()
            if not src.is_dir():
                print(f"error: --include_path {part} is not a folder", file=sys.stderr)
                return 2
            shutil.copytree(src, include / f"user-{len(list(include.glob('user-*')))}",
                            ignore=shutil.ignore_patterns("__pycache__"))
    if argv and not ("-h" in argv or "--help" in argv):
        argv += ["--include_path", str(include)]

    from lm_eval.__main__ import cli_evaluate

    from ..eval.lm_eval_run import quiet_git

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        with quiet_git():  # no `fatal: not a git repository` from lm-eval's commit lookup
            cli_evaluate()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
