"""``linearize train``: the flags are ``TrainConfig``'s fields, read from its source; a config file,
``--set`` overrides and ``--resume`` settle the rest. The work is ``linearize.train.run`` (or
``linearize.train.encoder.run_encoder`` for LION encoders)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import re
import sys
from pathlib import Path

from .args import (
    SET_HELP, SUFFIX_HELP, add_command, argtype, overrides, parse_bool, parse_float, parse_int, parse_list,
    parse_optional_int, parse_set, parse_softmax_layers, parse_yaml_value,
)


def _field_kind(field: dataclasses.Field) -> str:
    t = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    t = t.replace(" ", "")
    if field.name == "softmax_layers":
        return "softmax_layers"
    if field.name == "lora_targets" or t in ("list[str]|None", "list[str]"):
        return "list"
    return {"int": "int", "float": "float", "str": "str", "bool": "bool", "int|None": "optional_int",
            "dict": "dict"}.get(t, "yaml")


_PARSERS = {"int": parse_int, "float": parse_float, "bool": parse_bool, "optional_int": parse_optional_int,
            "softmax_layers": parse_softmax_layers, "list": parse_list, "str": str}

_METAVARS = {"int": "N", "float": "X", "optional_int": "N|none", "softmax_layers": "0,5,9|FRACTION|auto:K",
             "list": "A,B,...", "yaml": "VALUE"}


def _train_fields():
    from ..train.config import TrainConfig

    return [f for f in dataclasses.fields(TrainConfig) if _field_kind(f) != "dict"]


# Help for the TrainConfig fields that carry no comment in its source.
_EXTRA_HELP = {
    "out": "run directory: checkpoint, metrics.jsonl, loss curves, resume state",
    "seq_len": "tokens per training row",
    "val_fraction": "share of the data held out for validation",
    "seed": "random seed (data split, initialisation, order)",
    "stage1_tokens": f"training tokens for stage 1 (attention transfer); 0 skips it; 100K, 2M accepted ({SUFFIX_HELP})",
    "stage1_lr": "stage-1 learning rate",
    "stage2_tokens": "training tokens for stage 2 (LoRA); 0 skips it",
    "stage2_lr": "stage-2 learning rate",
    "lora_rank": "LoRA rank",
    "lora_alpha": "LoRA alpha",
    "lora_dropout": "LoRA dropout",
    "lora_targets": "comma list of projections to adapt, e.g. q_proj,v_proj; none = q, k, v, o",
    "distill_temperature": "temperature of the distillation loss",
    "mu_steps": "steps of the mu schedule (liza)",
    "batch_size": "rows per micro-batch",
    "grad_accum": "micro-batches per optimizer step",
    "weight_decay": "AdamW weight decay",
    "warmup_steps": "linear warmup steps of the cosine schedule",
    "plateau_factor": "LR multiplier when the plateau schedule cuts it",
    "device": "auto (CUDA if available, else CPU), cpu, cuda[:N] or mps",
    "progress": "progress bars",
}
_METAVAR_OVERRIDES = {"out": "DIR", "model": "NAME_OR_DIR", "data": "PATH_OR_NAME"}


def _field_docs() -> tuple[dict[str, str], dict[str, str]]:
    """TrainConfig's trailing comments (field -> help) and section comments (field -> section),
    read from its source so the help stays in one place. Empty if the source is unavailable."""
    from ..train.config import TrainConfig

    docs, sections, section = {}, {}, "settings"
    try:
        lines = inspect.getsource(TrainConfig).splitlines()
    except (OSError, TypeError):
        return docs, sections
    for line in lines:
        heading = re.fullmatch(r"    #\s*(.+)", line)
        if heading:
            section = heading.group(1).strip()
            continue
        m = re.match(r"    (\w+)\s*:[^=]*=.*?(?:#\s*(.*))?$", line)
        if m:
            sections[m.group(1)] = section
            if m.group(2):
                docs[m.group(1)] = m.group(2).strip()
    return docs, sections


def _choices() -> dict[str, tuple]:
    from ..methods import methods
    from ..train import config as C

    return {"method": tuple(methods()), "packing": C.PACKING, "transfer_target": C.TRANSFER_TARGETS,
            "lr_schedule": C.LR_SCHEDULES, "mu_schedule": C.MU_SCHEDULES, "precision": C.PRECISIONS,
            "loss_on": C.LOSS_ON, "loss_average": C.LOSS_AVERAGES, "shard": C.SHARDS}


def _show_default(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and value >= 10_000:
        return f"{value:_}"
    return str(value)


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    docs, sections = _field_docs()
    choices = _choices()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in _train_fields():
        section = sections.get(f.name, "settings")
        group = groups.get(section) or groups.setdefault(section, parser.add_argument_group(section))
        kind = _field_kind(f)
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        text = (docs.get(f.name) or _EXTRA_HELP.get(f.name, "")).replace("%", "%%")
        if f.name in choices:
            text = (text + "; " if text else "") + "one of " + ", ".join(choices[f.name])
        text = (text + " " if text else "") + f"(default: {_show_default(default)})".replace("%", "%%")
        if kind == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=text)
        else:
            parse = _PARSERS.get(kind, parse_yaml_value)
            group.add_argument(flag, dest=f.name, type=argtype(parse), default=argparse.SUPPRESS,
                               metavar=_METAVAR_OVERRIDES.get(f.name) or _METAVARS.get(kind, f.name.split("_")[-1].upper()),
                               choices=choices.get(f.name), help=text)


def load_config_file(path) -> dict:
    """Settings from a YAML or JSON file: a mapping of TrainConfig fields (dashes or underscores).

    String values of numeric fields are parsed like flags (PyYAML reads ``1e-4`` as a string).
    Errors name the file: missing, malformed, not a mapping, unknown keys, bad values.
    """
    import yaml

    from ..train.config import TrainConfig

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist" if not path.exists()
                                else f"config file {path} is not a file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text) if text.strip() else {}
        else:
            data = yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {path} is not valid JSON: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of settings (key: value), "
                         f"got a {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ValueError(f"config file {path}: unknown setting {key!r}; allowed: {sorted(fields)}")
        kind = _field_kind(fields[name])
        if kind in ("int", "float", "bool", "optional_int", "softmax_layers", "list") and value is not None:
            try:
                value = _PARSERS[kind](value)
            except ValueError as e:
                raise ValueError(f"config file {path}: {name}: {e}") from None
        values[name] = value
    return values


def _saved_run_config(out: Path) -> dict:
    """The settings recorded in run directory ``out`` (empty if there are none), so that
    ``linearize train --resume --out DIR`` needs no other flag."""
    from ..train.config import TrainConfig
    from ..train.run import read_run_config

    saved = read_run_config(out) or {}
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in saved.items() if k in names}


def train_config_from_args(args: argparse.Namespace):
    """The TrainConfig of ``linearize train``: defaults < (with ``--resume``, the run's recorded
    settings) < ``--config`` file < flags; ``--set`` overrides are merged over the file's
    ``overrides``. Validated (bad values are named)."""
    from ..train.config import TrainConfig

    values = {}
    config_file = getattr(args, "config", None)
    if config_file:
        values.update(load_config_file(config_file))
    for f in _train_fields():
        if f.name in vars(args):
            values[f.name] = getattr(args, f.name)
    if getattr(args, "resume", False):  # the run's own settings go under the file and the flags
        out = values.get("out", TrainConfig.out)
        values = {**_saved_run_config(Path(out)), **values, "out": out}
    sets = overrides(getattr(args, "set", None))
    if sets:
        base = values.get("overrides") or {}
        if not isinstance(base, dict):
            raise ValueError(f"overrides in {config_file} must be a mapping of AttentionConfig fields, got {base!r}")
        values["overrides"] = {**base, **sets}
    try:
        return TrainConfig.from_dict(values)
    except TypeError as e:  # a value of a type the validation does not expect
        raise ValueError(f"bad training setting: {e}") from None


def _train_runner():
    """``linearize.train.run`` (the function), imported only when training."""
    try:
        from .. import train as train_pkg

        run = getattr(train_pkg, "run", None)
        if not callable(run):
            run = importlib.import_module("linearize.train.run").run
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("linearize.train"):
            raise ValueError("training is not available in this installation "
                             f"(module {e.name} is missing)") from None
        raise
    return run


def cmd_train(args) -> int:
    config = train_config_from_args(args)
    if str(config.method).startswith("lion-"):  # encoders: LION's own two stages (sentence embeddings)
        from ..train.encoder import run_encoder as run
    else:
        run = _train_runner()
    try:
        out = Path(run(config, resume=args.resume))
    except RuntimeError as e:
        if type(e).__name__ != "NonFiniteLossError":  # training diverged: a message, not a traceback
            raise
        print(f"linearize: training stopped: {e}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 speaks and writes for the run
        return 0
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and not list(out.glob("*.png")):  # the loop normally plots; make sure
        from ..train.plots import plot_metrics

        try:
            plot_metrics(metrics, out)
        except ValueError as e:
            print(f"linearize: warning: no loss curves: {e}", file=sys.stderr)
    print(out)  # the run directory: checkpoint, metrics.jsonl, curves
    return 0


def add_parser(sub, command: str | None = None) -> None:
    """``linearize train``; its TrainConfig flags (which import the trainer and so transformers,
    seconds) are built only when ``command`` is None or ``train``."""
    p = add_command(sub, "train", "two-stage training: attention transfer, then LoRA",
                    "Linearize a teacher and train it: stage 1 teaches the new attention modules to imitate each "
                    "layer's softmax attention (attention transfer), stage 2 recovers language modelling with LoRA. "
                    "The run directory (--out) receives the checkpoint (linearize.load opens it), metrics.jsonl "
                    "and loss curves as PNG.\n\n"
                    "Settings come from the defaults, then --config FILE (YAML or JSON, keys are the flag names "
                    "with underscores), then the flags, each later one winning.",
                    """\
                    examples:
                      linearize train --method lizard --model smollm2-135m --data shakespeare --out runs/lizard \\
                          --stage1-tokens 200k --stage2-tokens 200k
                      linearize train --config recipe.yaml --lr-schedule plateau --set window=64
                      linearize train --resume --out runs/lizard     # continue a killed run with its settings

             a config file (YAML):
               method: lolcats
               model: smollm2-135m
               data: notes/
               out: runs/lolcats
               stage1_tokens: 2000000
               softmax_layers: [0, 15]
               overrides: {window: 32}""")
    p.add_argument("--config", metavar="FILE", help="settings from a YAML (.yaml/.yml) or JSON (.json) file")
    p.add_argument("--set", action="append", type=argtype(parse_set), metavar="KEY=VALUE",
                   help=SET_HELP + "; merged over the config file's `overrides`")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run from its last checkpoint in --out; the settings recorded in "
                        "the run directory are the base, so `--resume --out DIR` alone is enough")
    if command in (None, "train"):
        _add_train_flags(p)
    p.set_defaults(func=cmd_train)
