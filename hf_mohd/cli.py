"""`hf-mohd` command line: one subcommand per module in `hf_mohd/commands/`.

Each command module defines `register(subparsers)`, which adds its parser and sets `func` (called with the parsed
arguments, returning an exit code). Commands are discovered, so adding one never edits this file.

Bad input, one convention for every command: one line `error: <path or field>: <what was expected>` on stderr and
the exit status of its kind (`hf_mohd.commands.EXIT_STATUS`: 2 usage, 3 missing path, 4 wrong kind of input,
5 damaged file, 6 bad config field, 7 Hub unreachable, 8 output exists; 1 a failed check such as --verify). A command
raises `CommandError`; `main` prints it. `--debug` (or `HF_MOHD_DEBUG=1`) also prints the traceback.
"""

import argparse
import importlib
import os
import pkgutil
import sys
import traceback

from . import commands
from .commands import CommandError


DESCRIPTION = (
    "MoHD and LatentMoE sparse Transformers for Hugging Face: train, convert, evaluate, shape, publish. "
    "`hf-mohd COMMAND --help` describes each command."
)


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors in the one-line form of every other error (exit status 2)."""

    def error(self, message):
        self.exit(2, f"error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="hf-mohd", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="On an error, print the traceback as well as the one-line message (also: HF_MOHD_DEBUG=1).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(subparsers)
    return parser


def as_command_error(error: BaseException) -> CommandError | None:
    """`error` as a `CommandError`: itself, or an `OSError` about a named path (missing, existing output, a folder
    for a file or the reverse, no permission); None for anything else (a bug, which keeps its traceback)."""
    if isinstance(error, CommandError):
        return error
    if isinstance(error, OSError) and error.filename is not None:
        kinds = (
            (FileNotFoundError, "missing", "does not exist"),
            (FileExistsError, "exists", "exists; pass --overwrite to replace it"),
            (IsADirectoryError, "wrong_type", "is a folder, not a file"),
            (NotADirectoryError, "wrong_type", "is not a folder"),
            (PermissionError, "damaged", "cannot be read (permission denied)"),
        )
        for error_type, kind, message in kinds:
            if isinstance(error, error_type):
                return CommandError(kind, os.fsdecode(error.filename), message)
    return None


def quiet_deepspeed_on_cpu() -> None:
    """Sets `DS_ACCELERATOR=cpu` when torch sees no accelerator and the variable is unset: DeepSpeed (imported by
    Accelerate and transformers wherever it is installed) then takes the CPU it would pick anyway, without warning
    "Setting accelerator to CPU ..." on each command. A set `DS_ACCELERATOR`, or an accelerator torch sees, leaves
    DeepSpeed's own detection alone."""
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.accelerator.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    """Runs `hf-mohd` with `argv` (default: the process's arguments) and returns its exit status.

    A `CommandError` (or an `OSError` naming a path) raised by a command prints its one line on stderr and returns
    the status of its kind; any other exception propagates (a bug: its traceback is the report). Usage errors exit
    through argparse with status 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    debug = args.debug or os.environ.get("HF_MOHD_DEBUG", "") not in ("", "0")
    quiet_deepspeed_on_cpu()
    try:
        return int(args.func(args) or 0)
    except Exception as raised:
        error = as_command_error(raised)
        if error is None:
            raise
        if debug:
            traceback.print_exception(raised, file=sys.stderr)
        print(error.line(), file=sys.stderr)
        return error.status


if __name__ == "__main__":
    sys.exit(main())
