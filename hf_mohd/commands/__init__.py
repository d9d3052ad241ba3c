"""Subcommands of `hf-mohd`; each module exposes `register(subparsers)` (see `hf_mohd/cli.py`).

Keep imports of heavy optional packages inside the command function so that `hf-mohd --help` stays fast.
"""
