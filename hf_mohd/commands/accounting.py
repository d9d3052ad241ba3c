"""`hf-mohd accounting`: total / activated parameters and FLOPs per token of a saved config (MoHD, LatentMoE or
LLaMA), or of a MoHD preset of a LLaMA config (`hf_mohd.models.accounting.model_accounting`)."""

import json

from . import CommandError, add_command, read_config_json


def register(subparsers) -> None:
    parser = add_command(subparsers, "accounting", run)
    parser.add_argument("config", help="Path to a config.json (or a model folder) of MoHD, LatentMoE or LLaMA.")
    parser.add_argument("--preset", help="Apply a MoHD preset (e.g. compression_50) to a LLaMA config first.")
    parser.add_argument(
        "--context-length", type=int, default=2048, help="Keys per query for the attention-score FLOPs (default 2048)."
    )


def run(args) -> int:
    """Parameter and FLOP accounting of a config.json (MoHD, LatentMoE, LLaMA) or a MoHD preset of a LLaMA one.

    Bad input prints `error: <path>: <what was expected>`: a path that does not exist (exit status 3), a folder
    without config.json or a `--preset` on a config that is not LLaMA (4), a config.json that is not a JSON object
    (5), a config that does not load (6), an unknown preset (2).
    """
    from huggingface_hub.errors import StrictDataclassFieldValidationError
    from transformers import AutoConfig

    import hf_mohd  # noqa: F401  (registers model types)
    from hf_mohd.models.accounting import model_accounting
    from hf_mohd.models.configuration_mohd import MoHDConfig

    path = args.config
    read_config_json(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, StrictDataclassFieldValidationError) as error:
        raise CommandError("config", path, f"not a loadable config ({error})") from error
    if args.preset:
        if config.model_type != "llama":
            raise CommandError(
                "wrong_type",
                path,
                f"--preset applies to a LLaMA config; this config has model_type {config.model_type!r}",
            )
        try:
            config = MoHDConfig.from_llama_config(config, args.preset)
        except ValueError as error:
            raise CommandError("usage", path, str(error)) from error
    try:
        accounting = model_accounting(config, args.context_length)
    except ValueError as error:
        raise CommandError("config", path, str(error)) from error
    print(json.dumps(accounting.as_dict(), indent=2))
    return 0
