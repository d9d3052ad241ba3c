"""`hf-mohd accounting`: total / activated parameters and FLOPs per token of a saved config (MoHD, LatentMoE or
LLaMA), or of a MoHD preset of a LLaMA config (`hf_mohd.models.accounting.model_accounting`)."""

import json

from . import add_command


def register(subparsers) -> None:
    parser = add_command(subparsers, "accounting", run)
    parser.add_argument("config", help="Path to a config.json (or a model folder) of MoHD, LatentMoE or LLaMA.")
    parser.add_argument("--preset", help="Apply a MoHD preset (e.g. compression_50) to a LLaMA config first.")
    parser.add_argument("--context-length", type=int, default=2048, help="Context length for attention FLOPs.")


def run(args) -> int:
    """Parameter and FLOP accounting of a config.json (MoHD, LatentMoE, LLaMA) or a MoHD preset of a LLaMA one."""
    from transformers import AutoConfig

    import hf_mohd  # noqa: F401  (registers model types)
    from hf_mohd.models.accounting import model_accounting
    from hf_mohd.models.configuration_mohd import MoHDConfig

    config = AutoConfig.from_pretrained(args.config)
    if args.preset:
        config = MoHDConfig.from_llama_config(config, args.preset)
    print(json.dumps(model_accounting(config, args.context_length).as_dict(), indent=2))
    return 0
