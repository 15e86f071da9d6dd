"""``linearize methods`` and ``linearize convert``: the recipes, and a teacher converted and saved untrained."""

from __future__ import annotations

import dataclasses
import json
import shlex
import textwrap
from pathlib import Path

from ..records import human_size
from .args import SET_HELP, add_command, argtype, method_name, method_names, overrides, parse_set, parse_softmax_layers


def cmd_methods(args) -> int:
    from ..methods import method_config, methods

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
    from ..models.checkpoint import check_out_dir, directory_contents

    check_out_dir(out, overwrite, label=f"--out {out}", overwrite_hint="pass --overwrite to replace it",
                  other_hint="choose another --out")
    if out.is_dir() and any(out.iterdir()) and not directory_contents(out):
        raise ValueError(f"--out {out} exists, is not empty and is not a linearize checkpoint; "
                         "refusing to replace it (choose another directory)")


def _shell_flags(softmax_layers, sets: dict) -> str:
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
    flags += ["--set " + shlex.quote(f"{k}={text(v)}") for k, v in sets.items()]
    return "".join(" " + f for f in flags)


def cmd_convert(args) -> int:
    from ..methods import method_config
    from ..models.loading import check_model_name

    settings = overrides(args.set)
    method_config(args.method, **settings)  # bad method or override: fail before loading anything
    out = Path(args.out)
    _check_out_dir(out, args.overwrite)  # before loading: a refusal is quick and changes nothing
    check_model_name(args.model)
    from ..models.checkpoint import save
    from ..models.convert import convert, linearized_layers
    from ..models.teacher import load_teacher

    model, tokenizer = load_teacher(args.model)
    convert(model, args.method, softmax_layers=args.softmax_layers, **settings)
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
          f"--model {shlex.quote(str(args.model))}{_shell_flags(args.softmax_layers, settings)} --out DIR")
    return 0


def add_parsers(sub) -> None:
    p = add_command(sub, "methods", "list the linearization methods",
                    "List the linearization methods (recipes) and what each one is.",
                    """\
                    examples:
                      linearize methods
                      linearize methods -v      # with every AttentionConfig setting of each method""")
    p.add_argument("-v", "--verbose", action="store_true", help="also print each method's settings")
    p.set_defaults(func=cmd_methods)

    p = add_command(sub, "convert", "swap a model's attention for a linear one and save it (untrained)",
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
    p.add_argument("--method", required=True, type=method_name, metavar="METHOD",
                   help="the method: " + ", ".join(method_names()))
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to write")
    p.add_argument("--softmax-layers", type=argtype(parse_softmax_layers), default=None,
                   metavar="0,5,9|FRACTION",
                   help="layers kept as softmax attention: indices (0,5,9) or a fraction of the layers (0.25)")
    p.add_argument("--set", action="append", type=argtype(parse_set), metavar="KEY=VALUE", help=SET_HELP)
    p.add_argument("--merged", action="store_true",
                   help="write a self-contained checkpoint with every weight, config and tokenizer")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint in --out even if it holds one or a training run (the run's "
                        "other files are left); without it such a directory is refused")
    p.set_defaults(func=cmd_convert)
