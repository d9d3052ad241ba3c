"""`hf-mohd accounting`: total / activated parameters and FLOPs per token of a saved config (MoHD, LatentMoE or
LLaMA), or of a MoHD preset of a LLaMA config (`hf_mohd.models.accounting.model_accounting`)."""

import json

from . import add_command, fail


def register(subparsers) -> None:
    parser = add_command(subparsers, "accounting", run)
    parser.add_argument("config", help="Path to a config.json (or a model folder) of MoHD, LatentMoE or LLaMA.")
    parser.add_argument("--preset", help="Apply a MoHD preset (e.g. compression_50) to a LLaMA config first.")
    parser.add_argument(
        "--context-length", type=int, default=2048, help="Keys per query for the attention-score FLOPs (default 2048)."
    )


def run(args) -> int:
    """Parameter and FLOP accounting of a config.json (MoHD, LatentMoE, LLaMA) or a MoHD preset of a LLaMA one.

    A path that is neither a config.json nor a folder holding one, a config that does not load, a `--preset` on a
    config that is not LLaMA, or an unknown preset prints `error: <path>: <what was expected>` (exit status 1).
    """
    import os

    from huggingface_hub.errors import StrictDataclassFieldValidationError
    from transformers import AutoConfig

    import hf_mohd  # noqa: F401  (registers model types)
    from hf_mohd.models.accounting import model_accounting
    from hf_mohd.models.configuration_mohd import MoHDConfig

    path = args.config
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        if not os.path.isfile(config_file) or not config_file.endswith(".json"):
            raise ValueError("expected a config.json file or a model folder holding one (nothing is downloaded)")
        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError, TypeError, StrictDataclassFieldValidationError) as error:
            raise ValueError(f"not a loadable config ({error})") from error
        if args.preset:
            if config.model_type != "llama":
                raise ValueError(
                    f"--preset applies to a LLaMA config; this config has model_type {config.model_type!r}"
                )
            config = MoHDConfig.from_llama_config(config, args.preset)
        accounting = model_accounting(config, args.context_length)
    except ValueError as error:
        return fail(path, error)
    print(json.dumps(accounting.as_dict(), indent=2))
    return 0
