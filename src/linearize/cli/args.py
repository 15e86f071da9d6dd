"""What every command shares: value parsers (K and M suffixes), help texts, the help formatter.

Each parser raises ValueError with a message naming the bad value; ``argtype`` turns that into an
argparse error (exit 2, usage on stderr). The same parsers read config files (``cli.train``).
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import textwrap
from pathlib import Path

DEVICE_HELP = "auto (CUDA if available, else CPU), cpu, cuda or cuda:N (default: %(default)s)"
MODEL_HELP = ("a linearize checkpoint directory, the bundled trained student (smollm2-135m-lizard), a bundled "
              "teacher (smollm2-135m) or a local HF model directory; repeat to compare several side by side")


# ---------------------------------------------------------------------------- value parsers


def argtype(fn):
    """An argparse ``type`` from a parser raising ValueError: the message becomes argparse's error."""
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
    spread evenly), ``auto:K`` (chosen by measure in training), ``none``. A single integer such as
    ``3`` is one index; ``1.0`` is the fraction."""
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
    if s.lower().startswith("auto"):
        from ..models.convert import auto_softmax_count

        return f"auto:{auto_softmax_count(s)}"  # names a malformed auto:K
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
    raise ValueError(f"softmax_layers must be layer indices such as 0,5,9, a fraction such as 0.25 or auto:K, "
                     f"got {text!r}")


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


def overrides(pairs) -> dict:
    """The ``--set KEY=VALUE`` pairs as a dict (empty when none were given)."""
    return dict(pairs or [])


def parse_int_list(text) -> list[int]:
    """``1024,2048,4K`` -> [1024, 2048, 4096]: positive integers, suffixes as in ``parse_int``."""
    values = []
    for part in str(text).split(","):
        try:
            n = parse_int(part)
        except ValueError:
            raise ValueError(f"expected comma-separated token counts such as 1024,2048,4K, got {text!r}") from None
        if n <= 0:
            raise ValueError(f"token counts must be positive, got {part.strip()!r} in {text!r}")
        values.append(n)
    return values


def parse_layers(text) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers takes comma-separated layer indices such as 0,14,29, got {text!r}") from None


# ---------------------------------------------------------------------------- help


class Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=34, width=100)


def fill(text: str) -> str:
    return "\n\n".join(textwrap.fill(part, 100) for part in text.split("\n\n"))


def add_command(sub, name: str, help: str, description: str, epilog: str = ""):
    """A subcommand parser with the CLI's formatter: ``description`` filled to 100 columns, ``epilog`` dedented."""
    return sub.add_parser(name, help=help, description=fill(description),
                          epilog=textwrap.dedent(epilog).strip() or None, formatter_class=Formatter)


SET_HELP = ("an AttentionConfig setting, repeatable; VALUE is parsed as YAML: window=64, gate=mamba2, "
            "gate_init=[0.9,0.99], feature_dim=null (see `linearize methods -v` for the settings)")


def method_names() -> list[str]:
    from ..methods import methods

    return list(methods())


def method_name(text: str) -> str:
    """argparse ``type`` of ``--method``: a known method's name."""
    if text not in method_names():
        raise argparse.ArgumentTypeError(f"unknown method {text!r}; available: {', '.join(method_names())}")
    return text


def resolved_device(name: str) -> str:
    """``auto`` -> ``cuda`` if available, else ``cpu``; other names as given (checked)."""
    from ..train.loop import resolve_device

    return str(resolve_device(name))


# ---------------------------------------------------------------------------- measurement commands
# (eval and bench: each writes NAME.json, NAME.png drawn from the JSON, and NAME.md into --out)


def check_models(args) -> None:
    """Every --model named, checked before an evaluation imports its heavy modules, so a mistyped
    path fails at once rather than after the first model's evaluation."""
    from ..models.loading import check_model_name

    for name in args.model:
        check_model_name(name)


def finish(out: Path, stem: str) -> int:
    """Print the Markdown a measurement wrote and what it wrote."""
    md = Path(out) / f"{stem}.md"
    print(md.read_text())
    print(f"wrote {out}/{stem}.json, {stem}.png, {stem}.md")
    return 0


def optional(module: str, name: str, what: str, hint: str = ""):
    """A function from a module that needs an optional dependency, with a clear error if it is missing."""
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module or not e.name.startswith("linearize")):
            raise ValueError(f"the {what} needs {e.name!r}, which is not installed" + (f" ({hint})" if hint else "")) \
                from None
        raise


def common_flags(p: argparse.ArgumentParser, out: str, models: bool = True) -> None:
    """--model (unless ``models`` is False), --out and --device."""
    if models:
        p.add_argument("--model", required=True, action="append", metavar="DIR_OR_NAME", help=MODEL_HELP)
    p.add_argument("--out", default=out, metavar="DIR", help="output directory (default: %(default)s)")
    p.add_argument("--device", type=argtype(parse_device), default="auto", metavar="DEVICE", help=DEVICE_HELP)

