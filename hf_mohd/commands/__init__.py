"""Subcommands of `hf-mohd`; each module exposes `register(subparsers)` (see `hf_mohd/cli.py`), which adds its
commands with `add_command` (a command's help is its run function's docstring).

Keep imports of heavy optional packages inside the command function so that `hf-mohd --help` stays fast.
"""

import argparse
import inspect
import sys


def add_command(subparsers, name: str, run, **parser_options) -> argparse.ArgumentParser:
    """Adds the subcommand `name`, which calls `run(args)` (returning the exit status), and returns its parser.

    The one-line help shown in the parent's command list is the first paragraph of `run`'s docstring, the `--help`
    description the rest (none for a one-paragraph docstring); argparse folds their white space. `parser_options`
    go to `add_parser` (e.g. `formatter_class`).
    """
    summary, _, details = inspect.cleandoc(run.__doc__ or "").partition("\n\n")
    parser = subparsers.add_parser(name, help=summary, description=details or None, **parser_options)
    parser.set_defaults(func=run)
    return parser


def fail(where: str, error: Exception) -> int:
    """Prints `error: <where>: <message>` on stderr (the message alone when it already names `where`) and returns the
    exit status 1: a bad input gets one line that names the file or option, not a traceback."""
    message = str(error)
    print(f"error: {message}" if where in message else f"error: {where}: {message}", file=sys.stderr)
    return 1
