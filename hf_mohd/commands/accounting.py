"""`hf-mohd accounting`: total / activated parameters, FLOPs per token and all-to-all payload of a config of either
family (MoHD, LatentMoE) or of LLaMA, or of a MoHD preset of a LLaMA config (`hf_mohd.models.accounting`).

`hf-mohd latent-accounting` is its deprecated alias (kept for one release): the same command with `--table` as the
default output.
"""

from . import CommandError, add_command, add_deprecated_alias, read_config_json


def register(subparsers) -> None:
    _arguments(add_command(subparsers, "accounting", run), "json")
    alias = add_deprecated_alias(subparsers, "latent-accounting", run, "hf-mohd accounting --table")
    _arguments(alias, "table")


def _arguments(parser, output_format: str) -> None:
    parser.add_argument(
        "config",
        help="A config.json (or the model folder holding it) of MoHD, LatentMoE or LLaMA; without `model_type`, a "
        "dict of LatentMoE / MoE fields.",
    )
    parser.add_argument("--preset", help="Apply a MoHD preset (e.g. compression_50) to a LLaMA config first.")
    parser.add_argument(
        "--context-length", type=int, default=2048, help="Keys per query for the attention-score FLOPs."
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument(
        "--json",
        dest="output_format",
        action="store_const",
        const="json",
        help="Print JSON (`ModelAccounting.as_dict`)" + (" (the default)." if output_format == "json" else "."),
    )
    output.add_argument(
        "--table",
        dest="output_format",
        action="store_const",
        const="table",
        help="Print a per-layer table and the totals" + (" (the default)." if output_format == "table" else "."),
    )
    parser.set_defaults(output_format=output_format)


def run(args) -> int:
    """Parameter, FLOP and all-to-all accounting of a config (MoHD, LatentMoE, LLaMA) or a MoHD preset of a LLaMA one.

    Reads a config.json (or the folder holding it): with a `model_type`, it is loaded with its config class (which
    checks every field); without one, its fields are read as they are (e.g. a standard MoE described by its fields).
    `--preset` first turns a LLaMA config into that MoHD preset. Per LatentMoE layer (arXiv 2610.14644 appendix B.2):
    c N l m routed + 2 D l latent + D N router + c D m_s shared parameters (c = 3 gated, 2 not), mixer FLOPs
    2 (c K l m + 2 D l + D N + c D m_s) per token, all-to-all 2 K l scalars per token (2 K D without a latent).
    Prints JSON (`--json`; the default of `accounting`) or a per-layer table (`--table`; the default of the
    deprecated alias `latent-accounting`).

    Bad input prints `error: <path>: <what was expected>`: a path that does not exist (exit status 3), a folder
    without config.json or a `--preset` on a config that is not LLaMA (4), a config.json that is not a JSON object
    (5), a config that does not load or whose fields the accounting cannot use (6), an unknown preset (2).
    """
    import json

    from huggingface_hub.errors import StrictDataclassFieldValidationError
    from transformers import AutoConfig

    import hf_mohd  # noqa: F401  (registers model types)
    from hf_mohd.models.accounting import model_accounting
    from hf_mohd.models.configuration_mohd import MoHDConfig
    from hf_mohd.shaping.config_io import format_accounting

    path = args.config
    config = read_config_json(path)
    if "model_type" in config:
        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError, TypeError, StrictDataclassFieldValidationError) as error:
            raise CommandError("config", path, f"not a loadable config ({error})") from error
    if args.preset:
        model_type = config.model_type if hasattr(config, "model_type") else None
        if model_type != "llama":
            raise CommandError(
                "wrong_type", path, f"--preset applies to a LLaMA config; this config has model_type {model_type!r}"
            )
        try:
            config = MoHDConfig.from_llama_config(config, args.preset)
        except ValueError as error:
            raise CommandError("usage", path, str(error)) from error
    try:
        accounting = model_accounting(config, args.context_length)
    except (ValueError, TypeError) as error:
        raise CommandError("config", path, str(error)) from error
    print(
        json.dumps(accounting.as_dict(), indent=2) if args.output_format == "json" else format_accounting(accounting)
    )
    return 0
