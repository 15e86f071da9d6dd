"""Command line: ``linearize <command>``.

    linearize methods                      the methods and what each one is
    linearize convert ...                  swap a model's attention, save the untrained conversion
    linearize train ...                    two-stage training (attention transfer, then LoRA)
    linearize generate ...                 complete prompts with a teacher or a linearized checkpoint
    linearize eval passkey|ppl|lm-eval|report|embed   evaluations (see cli_eval)
    linearize bench kernels|generate|train GPU benchmarks
    linearize demo                         the main job on the bundled teacher

Errors from the library (bad values, missing files) are printed as ``linearize: error: ...`` on
stderr with exit status 2, like argparse's own usage errors; no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import math
import re
import shlex
import sys
import textwrap
from pathlib import Path

from . import __version__

EXIT_USAGE = 2
DEVICE_HELP = "auto (CUDA if available, else CPU), cpu, cuda or cuda:N (default: %(default)s)"


# ---------------------------------------------------------------------------- value parsers
# Each raises ValueError with a message naming the bad value; ``_argtype`` turns that into an
# argparse error (exit 2, usage on stderr).


def _argtype(fn):
    def parse(text):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = fn.__name__
    return parse


# One meaning everywhere, token counts and context lengths alike: binary, as context lengths are
# (8K = 8192, the teacher's context; 2M tokens = 2,097,152).
_SUFFIX = {"k": 2**10, "K": 2**10, "m": 2**20, "M": 2**20, "g": 2**30, "G": 2**30}
SUFFIX_HELP = "K = 1024, M = 1024^2"


def parse_int(text) -> int:
    """An integer: ``100000``, ``100_000``, ``1e5``, ``100k`` (102,400), ``2M`` (2,097,152); the
    suffixes are binary (``SUFFIX_HELP``)."""
    if isinstance(text, bool):
        raise ValueError(f"expected an integer, got {text!r}")
    if isinstance(text, int):
        return text
    if isinstance(text, float):
        if text.is_integer():
            return int(text)
        raise ValueError(f"expected an integer, got {text!r}")
    s = str(text).strip()
    scale = 1
    if s and s[-1] in _SUFFIX:
        s, scale = s[:-1], _SUFFIX[s[-1]]
    try:
        return int(s) * scale
    except ValueError:
        pass
    try:
        value = float(s) * scale
    except ValueError:
        raise ValueError(f"expected an integer (e.g. 100000, 1e5, 100K; K = 1024), got {text!r}") from None
    if not math.isfinite(value) or not value.is_integer():
        raise ValueError(f"expected an integer, got {text!r}")
    return int(value)


def parse_optional_int(text) -> int | None:
    """An integer, or ``none``."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("none", "null", "")):
        return None
    return parse_int(text)


def parse_float(text) -> float:
    if isinstance(text, bool):
        raise ValueError(f"expected a number, got {text!r}")
    if isinstance(text, (int, float)):
        return text
    try:
        return float(str(text).strip())
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def parse_bool(text) -> bool:
    if isinstance(text, bool):
        return text
    s = str(text).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def parse_softmax_layers(text):
    """Layers kept as softmax attention: ``0,5,9`` (indices), ``0.25`` (a fraction of the layers,
    spread evenly), ``none``. A single integer such as ``3`` is one index; ``1.0`` is the fraction."""
    if text is None:
        return None
    if isinstance(text, bool):
        raise ValueError(f"softmax_layers must be layer indices such as 0,5,9 or a fraction such as 0.25, got {text!r}")
    if isinstance(text, float):
        return text
    if isinstance(text, int):
        return [text]
    if isinstance(text, (list, tuple)):
        return [parse_int(i) if not isinstance(i, bool) and isinstance(i, (int, str)) else _bad_layers(text)
                for i in text]
    s = str(text).strip()
    if s.lower() in ("none", "null", ""):
        return None
    s = s.removeprefix("[").removesuffix("]")
    if "," in s or re.fullmatch(r"\s*\d+\s*", s):
        parts = [p.strip() for p in s.split(",") if p.strip()]
        if not parts or not all(re.fullmatch(r"\d+", p) for p in parts):
            _bad_layers(text)
        return [int(p) for p in parts]
    try:
        return float(s)
    except ValueError:
        _bad_layers(text)


def _bad_layers(text):
    raise ValueError(f"softmax_layers must be layer indices such as 0,5,9 or a fraction such as 0.25, got {text!r}")


def parse_list(text) -> list[str] | None:
    """A comma list such as ``q_proj,v_proj``; ``none`` or ``default`` for the default."""
    if text is None:
        return None
    if isinstance(text, (list, tuple)):
        return [str(t) for t in text]
    s = str(text).strip()
    if s.lower() in ("none", "null", "default", ""):
        return None
    items = [p.strip() for p in s.removeprefix("[").removesuffix("]").split(",") if p.strip()]
    if not items:
        raise ValueError(f"expected a comma-separated list, got {text!r}")
    return items


def parse_yaml_value(text):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{text!r} is not a valid YAML value ({' '.join(str(e).split())})") from None


def parse_set(text) -> tuple[str, object]:
    """``KEY=VALUE``, the value parsed as YAML: ``window=64``, ``gate=mamba2``,
    ``gate_init=[0.9,0.99]``, ``feature_dim=null``."""
    key, sep, value = str(text).partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ValueError(f"--set takes KEY=VALUE (e.g. window=64), got {text!r}")
    return key, parse_yaml_value(value)


def parse_device(text) -> str:
    s = str(text).strip()
    if s in ("auto", "cpu", "mps") or re.fullmatch(r"cuda(:\d+)?", s):
        return s
    raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {text!r}")


def _overrides(pairs) -> dict:
    return dict(pairs or [])


# ---------------------------------------------------------------------------- train settings


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

_METAVARS = {"int": "N", "float": "X", "optional_int": "N|none", "softmax_layers": "0,5,9|FRACTION",
             "list": "A,B,...", "yaml": "VALUE"}


def _train_fields():
    from .train.config import TrainConfig

    return [f for f in dataclasses.fields(TrainConfig) if _field_kind(f) != "dict"]


# Help for the TrainConfig fields that carry no comment in its source.
_EXTRA_HELP = {
    "out": "run directory: checkpoint, metrics.jsonl, loss curves, resume state",
    "softmax_layers": "layers kept as softmax attention: indices (0,5,9) or a fraction of the layers (0.25)",
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
    from .train.config import TrainConfig

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
    from .methods import methods
    from .train import config as C

    return {"method": tuple(methods()), "packing": C.PACKING, "transfer_target": C.TRANSFER_TARGETS,
            "lr_schedule": C.LR_SCHEDULES, "mu_schedule": C.MU_SCHEDULES, "precision": C.PRECISIONS}


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
            group.add_argument(flag, dest=f.name, type=_argtype(parse), default=argparse.SUPPRESS,
                               metavar=_METAVAR_OVERRIDES.get(f.name) or _METAVARS.get(kind, f.name.split("_")[-1].upper()),
                               choices=choices.get(f.name), help=text)


def load_config_file(path) -> dict:
    """Settings from a YAML or JSON file: a mapping of TrainConfig fields (dashes or underscores).

    String values of numeric fields are parsed like flags (PyYAML reads ``1e-4`` as a string).
    Errors name the file: missing, malformed, not a mapping, unknown keys, bad values.
    """
    import yaml

    from .train.config import TrainConfig

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
    from .train.config import TrainConfig
    from .train.run import read_run_config

    saved = read_run_config(out) or {}
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in saved.items() if k in names}


def train_config_from_args(args: argparse.Namespace):
    """The TrainConfig of ``linearize train``: defaults < (with ``--resume``, the run's recorded
    settings) < ``--config`` file < flags; ``--set`` overrides are merged over the file's
    ``overrides``. Validated (bad values are named)."""
    from .train.config import TrainConfig

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
    sets = _overrides(getattr(args, "set", None))
    if sets:
        base = values.get("overrides") or {}
        if not isinstance(base, dict):
            raise ValueError(f"overrides in {config_file} must be a mapping of AttentionConfig fields, got {base!r}")
        values["overrides"] = {**base, **sets}
    try:
        return TrainConfig.from_dict(values)
    except TypeError as e:  # a value of a type the validation does not expect
        raise ValueError(f"bad training setting: {e}") from None


# ---------------------------------------------------------------------------- commands


def cmd_methods(args) -> int:
    from .methods import method_config, methods

    names = methods()
    width = max(map(len, names))
    for name, description in names.items():
        print(f"{name:<{width}}  {description}")
        if args.verbose:
            config = dataclasses.asdict(method_config(name))
            print(textwrap.indent(textwrap.fill(", ".join(f"{k}={v}" for k, v in config.items()), 96),
                                  " " * (width + 2)))
    return 0


def _check_out_dir(out: Path, overwrite: bool = False) -> None:
    """Before loading anything: refuse an --out that is a file, one that holds a training run or
    another checkpoint (unless --overwrite; ``checkpoint.check_out_dir``, the check ``save`` makes
    too), and a non-empty folder of other files."""
    from .models.checkpoint import check_out_dir, directory_contents

    check_out_dir(out, overwrite, label=f"--out {out}", overwrite_hint="pass --overwrite to replace it",
                  other_hint="choose another --out")
    if out.is_dir() and any(out.iterdir()) and not directory_contents(out):
        raise ValueError(f"--out {out} exists, is not empty and is not a linearize checkpoint; "
                         "refusing to replace it (choose another directory)")


def _shell_flags(softmax_layers, overrides: dict) -> str:
    """``--softmax-layers ... --set KEY=VALUE ...`` as the user gave them, quoted for a shell."""
    def text(value) -> str:
        if isinstance(value, bool) or value is None:
            return json.dumps(value)
        if isinstance(value, (list, tuple, dict)):
            return json.dumps(value, separators=(",", ":"))
        return str(value)

    flags = []
    if softmax_layers is not None:
        flags.append("--softmax-layers " + shlex.quote(text(softmax_layers).strip("[]")))
    flags += ["--set " + shlex.quote(f"{k}={text(v)}") for k, v in overrides.items()]
    return "".join(" " + f for f in flags)


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cmd_convert(args) -> int:
    from .methods import method_config
    from .models.loading import check_model_name

    overrides = _overrides(args.set)
    method_config(args.method, **overrides)  # bad method or override: fail before loading anything
    out = Path(args.out)
    _check_out_dir(out, args.overwrite)  # before loading: a refusal is quick and changes nothing
    check_model_name(args.model)
    from .models.checkpoint import save
    from .models.convert import convert, linearized_layers
    from .models.teacher import load_teacher

    model, tokenizer = load_teacher(args.model)
    convert(model, args.method, softmax_layers=args.softmax_layers, **overrides)
    save(model, out, merged=args.merged, tokenizer=tokenizer, overwrite=args.overwrite)

    n_layers = len(linearized_layers(model))
    kept = model.linearize_spec["softmax_layers"]
    new_params = sum(p.numel() for name, p in model.named_parameters() if ".hybrid." in name)
    files = sorted(p for p in out.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print(f"converted {args.model} with {args.method}: {n_layers} of {n_layers + len(kept)} attention layers linearized"
          + (f", softmax kept in layers {kept}" if kept else "")
          + f"; {new_params:,} new parameters (untrained)")
    print(f"saved {'merged ' if args.merged else ''}checkpoint to {out} ({human_size(total)}):")
    for p in files:
        print(f"  {p.name:<24} {human_size(p.stat().st_size):>10}")
    print(f"load it with linearize.load({str(out)!r}); train it with: linearize train --method {args.method} "
          f"--model {shlex.quote(str(args.model))}{_shell_flags(args.softmax_layers, overrides)} --out DIR")
    return 0


def _train_runner():
    """``linearize.train.run`` (the function), imported only when training."""
    try:
        from . import train as train_pkg

        run = getattr(train_pkg, "run", None)
        if not callable(run):
            run = importlib.import_module(f"{__package__}.train.run").run
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith(f"{__package__}.train"):
            raise ValueError("training is not available in this installation "
                             f"(module {e.name} is missing)") from None
        raise
    return run


def cmd_train(args) -> int:
    config = train_config_from_args(args)
    if str(config.method).startswith("lion-"):  # encoders: LION's own two stages (sentence embeddings)
        from .train.encoder import run_encoder as run
    else:
        run = _train_runner()
    try:
        out = Path(run(config, resume=args.resume))
    except RuntimeError as e:
        if type(e).__name__ != "NonFiniteLossError":  # training diverged: a message, not a traceback
            raise
        print(f"linearize: training stopped: {e}", file=sys.stderr)
        return 1
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and not list(out.glob("*.png")):  # the loop normally plots; make sure
        from .train.plots import plot_metrics

        try:
            plot_metrics(metrics, out)
        except ValueError as e:
            print(f"linearize: warning: no loss curves: {e}", file=sys.stderr)
    print(out)  # the run directory: checkpoint, metrics.jsonl, curves
    return 0


def cmd_generate(args) -> int:
    from .models.loading import check_model_name

    check_model_name(args.model)  # before transformers' import (seconds) and any loading
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    import torch
    from transformers import GenerationConfig

    from .models.loading import load_model
    from .train.loop import resolve_device

    device = str(resolve_device(args.device))

    model, tokenizer = load_model(args.model, device=device)
    if tokenizer is None:
        raise ValueError(f"model {args.model} has no tokenizer (no tokenizer files in the directory); "
                         "generate needs one: save the tokenizer next to the weights")
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"--chat: the tokenizer of {args.model} has no chat template")
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in args.prompt]
        add_special = False  # the template already holds them
    else:
        texts, add_special = list(args.prompt), True

    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError(f"the tokenizer of {args.model} has neither a pad nor an eos token; cannot batch prompts")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special)
    empty = [i + 1 for i, n in enumerate(batch["attention_mask"].sum(dim=1).tolist()) if n == 0]
    if empty:
        raise ValueError(f"--prompt {', '.join(map(str, empty))}: empty prompt (no tokens); give some text")
    batch = {k: v.to(device) for k, v in batch.items()}

    defaults = model.generation_config
    eos = defaults.eos_token_id if defaults.eos_token_id is not None else tokenizer.eos_token_id
    sample = args.temperature > 0
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=sample, pad_token_id=pad_id,
                           eos_token_id=eos, bos_token_id=defaults.bos_token_id)
    if sample:
        gen.temperature, gen.top_p, gen.top_k = args.temperature, args.top_p, args.top_k
    torch.manual_seed(args.seed)
    with torch.no_grad():
        if device.startswith("cuda") and getattr(model, "linearize_spec", None) is not None \
                and (not sample or (args.top_p == 1.0 and args.top_k == 0)):
            from .models.decode import fast_generate  # static state buffers + a CUDA graph per step

            out = fast_generate(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, eos_token_id=eos, pad_token_id=pad_id)
        else:
            out = model.generate(**batch, generation_config=gen)
    new = out[:, batch["input_ids"].shape[1]:].cpu()
    completions = [tokenizer.decode(row, skip_special_tokens=True) for row in new]

    for i, (prompt, completion) in enumerate(zip(args.prompt, completions)):
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": completion}, ensure_ascii=False))
        else:
            if i:
                print()
            print(f">>> {prompt}")
            print(completion)
    return 0


def cmd_demo(args) -> int:
    try:
        demo = importlib.import_module(f"{__package__}.demo")
    except ModuleNotFoundError as e:
        if e.name == f"{__package__}.demo":
            print("linearize demo: the main job is not built in this installation "
                  f"(module {e.name} is missing). Nothing was run.", file=sys.stderr)
            return EXIT_USAGE
        raise
    code = demo.run_demo(out=args.out, device=args.device)
    return int(code or 0)


# ---------------------------------------------------------------------------- parser


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=34, width=100)


def _fill(text: str) -> str:
    return "\n\n".join(textwrap.fill(part, 100) for part in text.split("\n\n"))


def _sub(sub, name: str, help: str, description: str, epilog: str = ""):
    return sub.add_parser(name, help=help, description=_fill(description),
                          epilog=textwrap.dedent(epilog).strip() or None, formatter_class=_Formatter)


SET_HELP = ("an AttentionConfig setting, repeatable; VALUE is parsed as YAML: window=64, gate=mamba2, "
            "gate_init=[0.9,0.99], feature_dim=null (see `linearize methods -v` for the settings)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; with ``command`` given, the training flags (which import the trainer and so
    transformers, seconds) are built only when that command is ``train``."""
    parser = argparse.ArgumentParser(
        prog="linearize", formatter_class=_Formatter,
        description=_fill("Convert a pretrained Transformer LLM into a subquadratic linear-attention model, "
                    "train it (attention transfer, then LoRA) and generate with constant memory."),
        epilog=textwrap.dedent("""\
            examples:
              linearize methods
              linearize convert --model smollm2-135m --method lizard --out runs/lizard-untrained
              linearize train --method lizard --model smollm2-135m --data shakespeare --out runs/lizard \\
                  --stage1-tokens 200k --stage2-tokens 200k
              linearize generate --model runs/lizard --chat --prompt "What is a sonnet?"
              linearize demo

            Run `linearize COMMAND --help` for a command's settings. Counts and lengths take K and M
            suffixes, binary everywhere: K = 1024, M = 1024^2 (2M tokens = 2,097,152; 8K = 8192)."""))
    parser.add_argument("--version", action="version", version=f"linearize {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _sub(sub, "methods", "list the linearization methods",
             "List the linearization methods (recipes) and what each one is.",
             """\
             examples:
               linearize methods
               linearize methods -v      # with every AttentionConfig setting of each method""")
    p.add_argument("-v", "--verbose", action="store_true", help="also print each method's settings")
    p.set_defaults(func=cmd_methods)

    p = _sub(sub, "convert", "swap a model's attention for a linear one and save it (untrained)",
             "Load a teacher, replace its softmax attention with a method's linearized attention and "
             "save the untrained conversion as a checkpoint (only the new modules, unless --merged). "
             "An untrained conversion has forgotten how to attend: train it with `linearize train`.",
             """\
             examples:
               linearize convert --model smollm2-135m --method lizard --out runs/lizard-init
               linearize convert --model ./my-llama --method lolcats --out runs/lolcats-init \\
                   --softmax-layers 0,15 --set window=32
               linearize convert --model smollm2-135m --method lizard --out runs/x \\
                   --set gate=mamba2 --set gate_init=[0.9,0.99] --softmax-layers 0.25 --merged""")
    p.add_argument("--model", required=True, metavar="NAME_OR_DIR",
                   help="a bundled teacher (smollm2-135m), a local HF model directory, or a hub id")
    p.add_argument("--method", required=True, type=_method_name, metavar="METHOD",
                   help="the method: " + ", ".join(_method_names()))
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to write")
    p.add_argument("--softmax-layers", type=_argtype(parse_softmax_layers), default=None,
                   metavar="0,5,9|FRACTION",
                   help="layers kept as softmax attention: indices (0,5,9) or a fraction of the layers (0.25)")
    p.add_argument("--set", action="append", type=_argtype(parse_set), metavar="KEY=VALUE", help=SET_HELP)
    p.add_argument("--merged", action="store_true",
                   help="write a self-contained checkpoint with every weight, config and tokenizer")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint in --out even if it holds one or a training run (the run's "
                        "other files are left); without it such a directory is refused")
    p.set_defaults(func=cmd_convert)

    p = _sub(sub, "train", "two-stage training: attention transfer, then LoRA",
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
    p.add_argument("--set", action="append", type=_argtype(parse_set), metavar="KEY=VALUE",
                   help=SET_HELP + "; merged over the config file's `overrides`")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run from its last checkpoint in --out; the settings recorded in "
                        "the run directory are the base, so `--resume --out DIR` alone is enough")
    if command in (None, "train"):
        _add_train_flags(p)
    p.set_defaults(func=cmd_train)

    p = _sub(sub, "generate", "complete prompts with a teacher or a linearized checkpoint",
             "Complete one or more prompts, batched with left padding, and print only the new text of each. "
             "--model is a linearize checkpoint directory (it holds linearize.json), a bundled teacher, a "
             "local HF model directory or a hub id.",
             """\
             examples:
               linearize generate --model runs/lizard --chat --prompt "Write a haiku about rain."
               linearize generate --model smollm2-135m --prompt "Once upon a time" --prompt "The sea" \\
                   --max-new-tokens 32 --temperature 0.7 --top-p 0.9 --seed 1""")
    p.add_argument("--model", required=True, metavar="DIR_OR_NAME", help="checkpoint directory or teacher")
    p.add_argument("--prompt", required=True, action="append", metavar="TEXT", help="a prompt; repeatable")
    p.add_argument("--max-new-tokens", type=_argtype(parse_int), default=64, metavar="N",
                   help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=_argtype(parse_float), default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=_argtype(parse_float), default=1.0, metavar="P",
                   help="nucleus sampling mass when sampling (default: %(default)s)")
    p.add_argument("--top-k", type=_argtype(parse_int), default=0, metavar="K",
                   help="top-k filter when sampling; 0 = off (default: %(default)s)")
    p.add_argument("--seed", type=_argtype(parse_int), default=0, metavar="N",
                   help="random seed for sampling (default: %(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--device", type=_argtype(parse_device), default="auto", metavar="DEVICE", help=DEVICE_HELP)
    p.add_argument("--json", action="store_true", help='print one JSON line {"prompt", "completion"} per prompt')
    p.set_defaults(func=cmd_generate)

    from .cli_eval import add_bench_parser, add_eval_parser

    add_eval_parser(sub)
    add_bench_parser(sub)

    p = _sub(sub, "demo", "the main job: linearize the bundled SmolLM2-135M with Lizard and compare",
             "Linearize the bundled SmolLM2-135M-Instruct with Lizard on the built-in text, show each layer's "
             "transfer MSE falling, compare teacher and student answers and their decode memory.",
             """\
             examples:
               linearize demo
               linearize demo --out runs/my-demo --device cpu""")
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="run directory (default: %(default)s)")
    p.add_argument("--device", type=_argtype(parse_device), default="auto", metavar="DEVICE", help=DEVICE_HELP)
    p.set_defaults(func=cmd_demo)
    return parser


def _method_names() -> list[str]:
    from .methods import methods

    return list(methods())


def _method_name(text: str) -> str:
    if text not in _method_names():
        raise argparse.ArgumentTypeError(f"unknown method {text!r}; available: {', '.join(_method_names())}")
    return text


# ---------------------------------------------------------------------------- entry point


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    return str(e) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser(next((a for a in argv if not a.startswith("-")), ""))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse has printed them
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # output piped into e.g. `head`, which has exited
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, KeyError, OSError) as e:  # OSError includes FileNotFoundError
        print(f"linearize: error: {_message(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("linearize: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
