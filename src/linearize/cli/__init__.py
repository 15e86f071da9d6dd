"""Command line: ``linearize <command>``.

    linearize methods                      the methods and what each one is
    linearize convert ...                  swap a model's attention, save the untrained conversion
    linearize train ...                    two-stage training (attention transfer, then LoRA)
    linearize generate ...                 complete prompts with a teacher or a linearized checkpoint
    linearize eval passkey|ppl|lm-eval|report|embed   evaluations (cli.eval)
    linearize bench kernels|generate|train GPU benchmarks (cli.bench)
    linearize demo                         the main job on the bundled teacher (cli.demo)

One module per command, each a parser and a thin handler over the library; shared argument types
(K and M suffixes) in ``cli.args``. Nothing in the library imports ``cli``.

Errors from the library (bad values, missing files) are printed as ``linearize: error: ...`` on
stderr with exit status 2, like argparse's own usage errors; no traceback.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from .. import __version__
from . import bench, convert, demo, generate, train
from . import eval as evaluate
from .args import Formatter, fill

EXIT_USAGE = 2


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; with ``command`` given, the training flags (which import the trainer and so
    transformers, seconds) are built only when that command is ``train``."""
    parser = argparse.ArgumentParser(
        prog="linearize", formatter_class=Formatter,
        description=fill("Convert a pretrained Transformer LLM into a subquadratic linear-attention model, "
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
    convert.add_parsers(sub)
    train.add_parser(sub, command)
    generate.add_parser(sub)
    evaluate.add_parser(sub)
    bench.add_parser(sub)
    demo.add_parser(sub)
    return parser


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


