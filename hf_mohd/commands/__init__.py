"""Subcommands of `hf-mohd`; each module exposes `register(subparsers)` (see `hf_mohd/cli.py`), which adds its
commands with `add_command` (a command's help is its run function's docstring); an old command name kept for one
release is added with `add_deprecated_alias`.

Keep imports of heavy optional packages inside the command function so that `hf-mohd --help` stays fast.

Errors: a command refuses bad input by raising `CommandError(kind, where, message)`; `hf_mohd.cli.main` prints it as
the one line `error: <where>: <message>` on stderr (no traceback unless `--debug` or `HF_MOHD_DEBUG=1`) and exits
with `EXIT_STATUS[kind]`. The checks commands share before loading anything are here: `check_model_folder`,
`check_weights`, `read_config_json`, `read_text_file`, `read_json_file`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys


# One exit status per kind of bad input (docs/bad-input.md lists them).
EXIT_STATUS = {
    "failed": 1,  # the input was read, but a check the command ran failed (convert --verify)
    "usage": 2,  # a bad option or option value (argparse's own errors too)
    "missing": 3,  # a path that does not exist
    "wrong_type": 4,  # not what the command takes: a file for a folder, a folder of another model type, no weights
    "damaged": 5,  # a file that cannot be read: truncated / garbage weights, invalid JSON / YAML, unreadable or empty
    "config": 6,  # a config field (config.json, training YAML) missing, of the wrong type, out of range or unsupported
    "hub": 7,  # the Hub cannot be reached (or refuses the request)
    "exists": 8,  # the output exists (pass --overwrite)
}


class CommandError(Exception):
    """Bad input of a command: `kind` (a key of `EXIT_STATUS`), `where` (the path, option or field at fault, or None
    when `message` names it) and `message` (what was wrong and what was expected)."""

    def __init__(self, kind: str, where: str | os.PathLike | None, message: str):
        if kind not in EXIT_STATUS:
            raise ValueError(f"`kind` must be one of {list(EXIT_STATUS)}, got {kind!r}.")
        self.kind, self.where, self.message = kind, None if where is None else os.fspath(where), str(message)
        super().__init__(self.line())

    @property
    def status(self) -> int:
        """The exit status of this kind of error."""
        return EXIT_STATUS[self.kind]

    def line(self) -> str:
        """`error: <where>: <message>` on one line (the message alone when it already names `where`)."""
        message = " ".join(self.message.split())
        if self.where is None or self.where in message:
            return f"error: {message}"
        return f"error: {self.where}: {message}"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's help, with "(default: X)" after each option's help where the default says something (not None,
    False, an empty list or string, or an argparse sentinel; 0 is shown): `ArgumentDefaultsHelpFormatter` without
    its noise on flags."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        default = action.default
        says_nothing = default is None or default is False or default is argparse.SUPPRESS or default in ([], "")
        if "%(default)" in help_text or says_nothing:
            return help_text
        if action.option_strings and action.nargs != 0:  # inside the closing full stop: "Text (default: X)."
            stripped = help_text.rstrip()
            period = "." if stripped.endswith(".") else ""
            help_text = stripped.removesuffix(".") + " (default: %(default)s)" + period
        return help_text


def add_command(subparsers, name: str, run, **parser_options) -> argparse.ArgumentParser:
    """Adds the subcommand `name`, which calls `run(args)` (returning the exit status), and returns its parser.

    The one-line help shown in the parent's command list is the first paragraph of `run`'s docstring, the `--help`
    description the rest (none for a one-paragraph docstring); argparse folds their white space. Each option's
    help ends with its default where that says something (`DefaultsHelpFormatter`). `parser_options` go to
    `add_parser` (e.g. `formatter_class`).
    """
    summary, _, details = inspect.cleandoc(run.__doc__ or "").partition("\n\n")
    parser_options.setdefault("formatter_class", DefaultsHelpFormatter)
    parser = subparsers.add_parser(name, help=summary, description=details or None, **parser_options)
    parser.set_defaults(func=run)
    return parser


def add_deprecated_alias(subparsers, name: str, run, replacement: str, old: str | None = None, **parser_options):
    """Adds `name`, an old command name kept for one release, which calls `run(args)` as the command `replacement`
    (e.g. "hf-mohd export gguf") does, and returns its parser (give it the same arguments). `old`: the old command
    in full (default "hf-mohd NAME"), for the note.

    Its help says "Deprecated alias of `replacement`", then `run`'s docstring. Errors are the command's own (same
    lines, same exit statuses); after a successful run one `note:` line on stderr names the replacement.
    """
    summary, _, details = inspect.cleandoc(run.__doc__ or "").partition("\n\n")
    notice = f"Deprecated alias of `{replacement}` (kept for one release)."
    old = old or f"hf-mohd {name}"

    def aliased(args) -> int:
        status = run(args)
        if not status:
            print(f"note: `{old}` is a deprecated alias of `{replacement}`; use that.", file=sys.stderr)
        return status

    description = f"{notice} {summary}" + (f"\n\n{details}" if details else "")
    parser_options.setdefault("formatter_class", DefaultsHelpFormatter)
    parser = subparsers.add_parser(name, help=notice, description=description, **parser_options)
    parser.set_defaults(func=aliased)
    return parser


def looks_local(name: str) -> bool:
    """Whether a model name is meant as a local path: it exists, or it is absolute, starts with ./ ../ or ~, or has
    more than one "/" (no Hub id has). Other names may be Hub ids."""
    return os.path.exists(os.path.expanduser(name)) or name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


def _expected(label: str, model_types) -> str:
    if not model_types:
        return label
    return f"{label} (model_type {' or '.join(repr(t) for t in model_types)})"


def read_config_json(path: str | os.PathLike, label: str = "a config.json file or a model folder holding one") -> dict:
    """The JSON object of a config.json, or of the config.json inside the folder `path`.

    Raises:
        CommandError: missing (no such path), wrong_type (a folder without config.json), damaged (not valid JSON, not a
            JSON object); each message names the path and says what was expected (`label`).
    """
    path = os.path.expanduser(os.fspath(path))
    if not os.path.exists(path):
        raise CommandError("missing", path, f"does not exist; expected {label} (nothing is downloaded).")
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config_file):
        raise CommandError("wrong_type", path, f"has no config.json; expected {label}.")
    try:
        with open(config_file, encoding="utf-8") as handle:
            values = json.load(handle)
    except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CommandError(
            "damaged", config_file, f"not valid JSON ({error}); expected a JSON object of config fields."
        ) from error
    if not isinstance(values, dict):
        raise CommandError(
            "damaged", config_file, f"expected a JSON object of config fields, got {type(values).__name__}."
        )
    return values


def check_model_folder(
    path: str | os.PathLike,
    model_types: tuple[str, ...] | None = None,
    *,
    label: str = "a model folder written by save_pretrained",
    gguf_file: str | None = None,
    weights: bool = True,
) -> dict:
    """Checks a local model folder before anything loads it, and returns its config.json as a dict ({} with
    `gguf_file`).

    Checked in this order: the folder exists and is a folder; with `gguf_file`, that file is in it (and nothing
    else); config.json is a JSON object; its `model_type` is one of `model_types` (any when None); a model type
    transformers knows (hf-mohd's included) loads with its config class, which checks every field; the weights are
    safetensors (the shards of `model.safetensors.index.json`, or `*.safetensors`) and each has a complete header
    whose tensors' bytes the file covers (`check_weights`; with `weights=False` the caller runs it later, e.g.
    after a check of the config that must fail before the weights are read).

    Raises:
        CommandError: missing (no such folder or GGUF file), wrong_type (a file, no config.json, another model type,
            no safetensors weights or only pickled ones), damaged (config.json or a weights file unreadable,
            truncated or garbage, a shard index naming absent shards), config (a field the config class refuses).
            Each message names the file and what was expected (`label`, and the model types).
    """
    expected = _expected(label, model_types)
    folder = os.path.expanduser(os.fspath(path))
    if not os.path.exists(folder):
        raise CommandError("missing", folder, f"does not exist; expected {expected}.")
    if not os.path.isdir(folder):
        raise CommandError("wrong_type", folder, f"is a file, not a model folder; expected {expected}.")
    if gguf_file:
        if not os.path.isfile(os.path.join(folder, gguf_file)):
            raise CommandError("missing", os.path.join(folder, gguf_file), "does not exist; expected a GGUF file.")
        return {}
    config = read_config_json(folder, expected)
    config_file = os.path.join(folder, "config.json")
    model_type = config.get("model_type")
    if model_types and model_type not in model_types:
        raise CommandError("wrong_type", config_file, f"model_type is {model_type!r}; expected {expected}.")
    _check_config_fields(folder, config_file, model_type)
    if weights:
        check_weights(folder)
    return config


def _check_config_fields(folder: str, config_file: str, model_type) -> None:
    """A config of a model type transformers knows loads with its class (which checks every field)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import hf_mohd  # noqa: F401  (registers the model types)

    if model_type not in CONFIG_MAPPING:
        return
    try:
        AutoConfig.from_pretrained(folder)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as error:
        message = " ".join(str(error).split())
        raise CommandError("config", config_file, f"not a valid {model_type} config ({message}).") from error


def check_weights(folder: str | os.PathLike) -> None:
    """Checks the safetensors weights of a model folder without loading them: the shards of
    `model.safetensors.index.json` (or the `*.safetensors` files) are there, and each has a complete header whose
    tensors' bytes the file covers (`hf_mohd.conversion.source.safetensors_files` and `check_safetensors`, the checks
    `hf-mohd convert` runs on its source).

    Raises:
        CommandError: wrong_type (no safetensors weights, or only pickled ones), damaged (a truncated or garbage
            file, a shard index naming absent shards); the message names the file.
    """
    from pathlib import Path

    from hf_mohd.conversion.source import ConversionError, check_safetensors, safetensors_files

    try:
        for file in safetensors_files(Path(folder)):
            check_safetensors(file)
    except ConversionError as error:
        raise CommandError(error.kind, None, str(error)) from error


def read_text_file(path: str | os.PathLike, option: str, what: str = "a UTF-8 text file") -> str:
    """The text of a UTF-8 file given with `option` (`what`: the file expected, for the messages).

    Raises:
        CommandError: missing (no such file), wrong_type (a folder), damaged (unreadable, not UTF-8, or holding no
            text but white space); the message names the file and the option.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CommandError("missing", path, f"does not exist; expected {what} ({option}).")
    if os.path.isdir(path):
        raise CommandError("wrong_type", path, f"is a folder; expected {what} ({option}).")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        raise CommandError("damaged", path, f"cannot be read as UTF-8 text ({error}) ({option}).") from error
    if not text.strip():
        raise CommandError("damaged", path, f"holds no text; expected UTF-8 text ({option}).")
    return text


def read_json_file(path: str | os.PathLike, option: str, expected: str = "JSON"):
    """The JSON value of a file given with `option`.

    Raises:
        CommandError: missing (no such file), wrong_type (a folder), damaged (unreadable or not valid JSON); the
            message names the file, the option and what was expected (`expected`).
    """
    text = read_text_file(path, option, f"a file of {expected}")
    try:
        return json.loads(text)
    except ValueError as error:
        raise CommandError("damaged", path, f"not valid JSON ({error}); expected {expected} ({option}).") from error
