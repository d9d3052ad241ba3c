"""`hf-mohd` command line: one subcommand per module in `hf_mohd/commands/`.

Each command module defines `register(subparsers)`, which adds its parser and sets `func` (called with the parsed
arguments, returning an exit code). Commands are discovered, so adding one never edits this file.
"""

import argparse
import importlib
import pkgutil
import sys

from . import commands


DESCRIPTION = (
    "MoHD and LatentMoE sparse Transformers for Hugging Face: train, convert, evaluate, shape, publish. "
    "`hf-mohd COMMAND --help` describes each command."
)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="hf-mohd", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
