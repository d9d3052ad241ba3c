"""`hf-mohd convert`: turn a dense LLaMA checkpoint (safetensors folder or GGUF file) into MoHD or LatentMoE.

`hf-mohd convert mohd SOURCE OUTPUT --preset compression_50` and `hf-mohd convert latent-moe SOURCE OUTPUT ...`
(`--carve` splits the dense FFNs into experts instead of upcycling them).

The commands only parse arguments: the work, every check included, is `hf_mohd.conversion.convert_mohd` /
`convert_latent_moe` (docs/design.md section 6); a `ConversionError` is raised as a `CommandError` of its `kind`
(one line `error: ...`, exit status 2 bad options, 3 missing source, 4 not a LLaMA checkpoint, 5 damaged file,
6 bad config.json field, 8 existing output, 1 failed --verify; see `hf_mohd.commands.EXIT_STATUS`).
"""

from __future__ import annotations

import argparse
import functools
import logging


# Choices are repeated here (not imported) so that `hf-mohd --help` does not import torch or transformers.
MOHD_PRESETS = ("full", "compression_50", "compression_75")
DTYPES = ("float32", "bfloat16", "float16")


def _add_common_arguments(parser: argparse.ArgumentParser, exact_model: str) -> None:
    """Arguments both families take; `exact_model` says, in --verify's help, which converted model equals the source."""
    parser.add_argument(
        "source", help="Dense LLaMA checkpoint: a local folder (config.json + safetensors) or a .gguf file."
    )
    parser.add_argument("output", help="Folder to write (weights, config + code, tokenizer, model card).")
    parser.add_argument("--gguf-file", help="Name of a GGUF file inside the SOURCE folder.")
    parser.add_argument(
        "--dtype", choices=DTYPES, help="dtype of the converted weights (default: the source's; GGUF -> float32)."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the freshly initialised weights.")
    parser.add_argument("--base-model", help="Hub id of the source model, for the model card's `base_model`.")
    parser.add_argument(
        "--verify",
        action="store_true",
        help=f"Before writing, check {exact_model} against the source LLaMA's logits on random tokens; fail if they "
        "differ by more than --atol.",
    )
    parser.add_argument(
        "--atol",
        type=float,
        default=1e-4,
        help="Tolerance of --verify: the largest absolute logit difference allowed.",
    )
    parser.add_argument(
        "--perplexity-json",
        nargs="+",
        help="Perplexity results to quote in the model card's table: JSON files, each with the `command` that made "
        "it and, per model, its `perplexity` on each held-out source.",
    )
    parser.add_argument("--overwrite", action="store_true", help="Replace OUTPUT if it exists.")
    parser.add_argument("--max-shard-size", default="5GB", help="Largest safetensors shard.")
    parser.add_argument("-q", "--quiet", action="store_true", help="Only warnings and errors.")


def add_mohd_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of LLaMA -> MoHD (of `hf-mohd convert mohd`)."""
    _add_common_arguments(
        parser,
        "the model at full activation (every sub-dimension active); with --rotate the check runs in float64, the "
        "same rotation applied to a float64 copy of the source",
    )
    parser.add_argument(
        "--preset",
        choices=MOHD_PRESETS + ("none",),
        default="full",
        help="full: every sub-dimension shared, exact, with activation scaling and group fusion off; "
        "compression_50 / compression_75: 8 or 12 of 16 sub-dimensions active (6 or 9 shared, 2 or 3 routed), the "
        "options below at MoHDConfig's defaults unless given; none: give the three counts below.",
    )
    parser.add_argument(
        "--num-sub-dims", type=int, help="N, sub-dimensions; must divide hidden_size (default: the preset's)."
    )
    parser.add_argument(
        "--num-shared-sub-dims", type=int, help="N_s, always-active sub-dimensions (default: the preset's)."
    )
    parser.add_argument(
        "--num-routed-sub-dims-per-tok", type=int, help="k, routed sub-dimensions per token (default: the preset's)."
    )
    parser.add_argument(
        "--activation-scaling",
        choices=("inverse_active", "none"),
        help="Scale active outputs by N / active, or not (default: none with --preset full, else inverse_active).",
    )
    parser.add_argument(
        "--routed-gate",
        choices=("softmax", "normalized", "unit"),
        help="Input gate of a routed block: softmax, its router probability; normalized, the probabilities scaled "
        "to sum to k; unit, exactly 1 with the router trained straight-through, so that with every block active "
        "the model equals the source (default: softmax).",
    )
    parser.add_argument(
        "--group-fusion",
        choices=("mix", "none"),
        help="Identity-initialised N x N block mixer, or none (default: none with --preset full, else mix).",
    )
    parser.add_argument(
        "--sparse-modules", nargs="+", choices=("attention", "ffn"), help="Sublayers to sparsify (default: both)."
    )
    parser.add_argument(
        "--sparse-implementation",
        choices=("gather", "sorted", "masked"),
        help="Execution strategy: gather reads only the active blocks' weights; sorted, the same with the (token, "
        "block) pairs of many tokens sorted into one grouped product per side (no atomics); masked multiplies at "
        "full width and zeroes the rest (default: gather).",
    )
    parser.add_argument(
        "--dropped-block-compensation",
        action="store_true",
        default=None,
        help="Add each skipped routed block's mean contribution back (FLAP-style bias compensation per block), fitted "
        "on the calibration text after the routers and budgets; needs --calibration-text.",
    )
    parser.add_argument(
        "--channel-order",
        choices=("original", "importance"),
        default="original",
        help="original: blocks are the source's consecutive hidden channels; importance: channels sorted by "
        "weight mass first, so the shared blocks hold the heaviest ones, the same function at full activation.",
    )
    parser.add_argument(
        "--rotate",
        choices=("none", "pca"),
        default="none",
        help="pca: fold the RMSNorm weights and rotate the residual stream into the PCA basis of the calibration "
        "hidden states (one global orthogonal Q, SliceGPT arXiv 2401.15024 section 3; exact at full activation; the "
        "LM head is untied from the embedding). Needs --calibration-text.",
    )
    parser.add_argument(
        "--routers",
        choices=("random", "fitted"),
        default="random",
        help="random: N(0, initializer_range^2) with --seed; fitted: ridge regression of each routed "
        "block's log input energy on the calibration text, which --calibration-text gives.",
    )
    parser.add_argument(
        "--calibration-text",
        help="UTF-8 text file of calibration text for --rotate pca / --routers fitted (keep it disjoint from "
        "evaluation text), tokenized with the source tokenizer.",
    )
    parser.add_argument("--calibration-tokens", type=int, default=16384, help="Calibration tokens used at most.")
    parser.add_argument("--calibration-window", type=int, default=256, help="Tokens per calibration row.")
    parser.add_argument(
        "--routed-budgets",
        choices=("uniform", "greedy", "greedy_output"),
        default="uniform",
        help="uniform: every sublayer at k; greedy: each layer and sublayer kind its own k, allocated on "
        "the calibration text under the parameter budget of k everywhere from each sublayer's residual-stream "
        "error; greedy_output: the same from the model's output KL with only that sublayer lowered (slower; "
        "the same command run again after an interruption resumes it from .OUTPUT.allocation_progress.json "
        "beside the output folder); both need --calibration-text.",
    )
    parser.set_defaults(func=run_mohd)
    return parser


def add_latent_moe_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of LLaMA -> LatentMoE upcycling (`hf-mohd convert latent-moe`)."""
    _add_common_arguments(parser, "the model as converted (with --carve: every expert active, at full width)")
    parser.add_argument("--num-experts", type=int, default=8, help="N, routed experts per layer.")
    parser.add_argument("--num-experts-per-tok", type=int, default=2, help="K, routed experts per token.")
    parser.add_argument(
        "--moe-intermediate-size",
        type=int,
        help="m, routed expert width (default: intermediate_size / num_experts, the slices of the dense FFN).",
    )
    parser.add_argument(
        "--moe-latent-size", type=int, help="l, latent width of the routed experts (default: hidden_size / 4)."
    )
    parser.add_argument(
        "--expert-init",
        choices=("slices", "random"),
        help="slices: routed experts start from slices of the dense FFN, projected to the latent width; "
        "random: N(0, initializer_range^2). Either way fc2_latent_proj is zero, so the output equals the source's "
        "(default: slices).",
    )
    parser.add_argument(
        "--router-score-func",
        choices=("softmax", "sigmoid"),
        default="softmax",
        help="Router scores: softmax, balanced by the aux loss, or sigmoid as in DeepSeek-V3 and Nemotron-H, "
        "balanced by a selection bias.",
    )
    parser.add_argument(
        "--dense-layers",
        type=int,
        nargs="+",
        default=[],
        help="Layer indices kept dense, their FFN copied as is (default: none).",
    )
    carving = parser.add_argument_group(
        "carving (--carve)",
        "Split each dense FFN (weights unchanged at full width) into a shared expert (the neurons of highest mean "
        "|act(gate x) * up x| on calibration text) and --num-experts routed experts of equal width (balanced "
        "spherical k-means of the other neurons' activation patterns), full width (or --latent-size), unit gates "
        "(router_gate='unit'), routers fitted by least squares on the calibration text (MoEfication arXiv "
        "2110.01786, CMoE arXiv 2502.04416). Exact at --num-experts-per-tok = --num-experts (at full width). Not "
        "combinable with --moe-intermediate-size, --moe-latent-size (use --latent-size), --expert-init, "
        "--dense-layers.",
    )
    carving.add_argument("--carve", action="store_true", help="Carve the dense FFNs instead of upcycling them.")
    carving.add_argument(
        "--shared-fraction",
        type=float,
        help="Share of the FFN neurons in the shared expert, in [0, 1); the rest must split into --num-experts "
        "equal experts (default: 0.25).",
    )
    carving.add_argument(
        "--latent-size",
        type=int,
        help="l, latent width of the routed experts, 1 <= l <= hidden_size, saved as moe_latent_size: per layer "
        "fc1_latent_proj / fc2_latent_proj = the top-l PCA directions of the FFN input on the calibration text "
        "(uncentred), the routed experts' rows read and write in that basis; router and shared expert stay full "
        "width (LatentMoE arXiv 2601.18089). l = hidden_size is the full-width carve; l < hidden_size is not exact, "
        "so it does not go with --verify (default: full width).",
    )
    carving.add_argument(
        "--calibration-text",
        help="UTF-8 text file for the partition, the latent basis and the router fit; keep it disjoint from "
        "evaluation text (default: the first 8 articles of the gensim Wikipedia sample, whose last 8 are the "
        "evaluations' held-out text).",
    )
    carving.add_argument("--calibration-tokens", type=int, help="Calibration tokens used at most (default: 8192).")
    carving.add_argument("--calibration-window", type=int, help="Tokens per calibration row (default: 256).")
    parser.set_defaults(func=run_latent_moe)
    return parser


def register(subparsers) -> None:
    from . import DefaultsHelpFormatter

    parser = subparsers.add_parser(
        "convert", help="Convert a dense LLaMA checkpoint (safetensors folder or GGUF) to MoHD or LatentMoE."
    )
    families = parser.add_subparsers(dest="family", metavar="FAMILY", required=True)
    add_mohd_arguments(
        families.add_parser(
            "mohd",
            help="LLaMA -> MoHD: exact at full activation, then the chosen sparsity.",
            formatter_class=DefaultsHelpFormatter,
        )
    )
    add_latent_moe_arguments(
        families.add_parser(
            "latent-moe",
            help="LLaMA -> LatentMoE upcycling: dense FFN -> shared expert, latent up-projection zero.",
            formatter_class=DefaultsHelpFormatter,
        )
    )


def configure_logging(quiet: bool = False) -> None:
    """Progress lines on stderr: `hf_mohd.conversion` at INFO (WARNING with --quiet)."""
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("hf_mohd").setLevel(logging.WARNING if quiet else logging.INFO)


# Arguments whose dest is the keyword of `convert_mohd` / `convert_latent_moe` they are passed as.
COMMON_OPTIONS = (
    "seed",
    "verify",
    "atol",
    "gguf_file",
    "base_model",
    "perplexity_json",
    "overwrite",
    "max_shard_size",
)
MOHD_OPTIONS = (
    "channel_order",
    "routers",
    "calibration_text",
    "calibration_tokens",
    "calibration_window",
    "routed_budgets",
    "num_sub_dims",  # the sparsity fields (`SPARSITY_FIELDS` that are arguments); None: the preset's
    "num_shared_sub_dims",
    "num_routed_sub_dims_per_tok",
    "activation_scaling",
    "routed_gate",
    "group_fusion",
    "sparse_modules",
    "sparse_implementation",
    "dropped_block_compensation",
)
LATENT_MOE_OPTIONS = (
    "expert_init",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_latent_size",
    "router_score_func",
    "dense_layers",
)
# `latent-moe --carve`: arguments of `convert_carved_latent_moe`, and those that only one of the two ways takes.
CARVE_OPTIONS = (
    "num_experts",
    "num_experts_per_tok",
    "router_score_func",
    "shared_fraction",
    "latent_size",
    "calibration_text",
    "calibration_tokens",
    "calibration_window",
)
CARVE_ONLY = ("shared_fraction", "latent_size", "calibration_text", "calibration_tokens", "calibration_window")
UPCYCLE_ONLY = ("moe_intermediate_size", "moe_latent_size", "expert_init", "dense_layers")


def _options(args, names) -> dict:
    """{name: args.name} for `names` plus `COMMON_OPTIONS`, and the --dtype name as a torch dtype."""
    import torch

    options = {name: getattr(args, name) for name in (*COMMON_OPTIONS, *names)}
    options["dtype"] = getattr(torch, args.dtype) if args.dtype else None
    return options


def _conversion_command(run):
    """Wraps a `run_*(args)`: progress logging set up first (`configure_logging`); a `ConversionError` (bad input, a
    failed --verify) is raised as a `CommandError` of the same `kind` (its message names the file or option)."""

    @functools.wraps(run)
    def wrapped(args) -> int:
        configure_logging(args.quiet)
        from hf_mohd.conversion import ConversionError

        from . import CommandError

        try:
            return run(args)
        except ConversionError as err:
            raise CommandError(getattr(err, "kind", "usage"), None, str(err)) from err

    return wrapped


def mohd_options(args) -> dict:
    """The keyword arguments of `convert_mohd(args.source, args.output, **mohd_options(args))` for the arguments
    `add_mohd_arguments` parsed (`hf-mohd convert mohd`, `conversion/convert_llama_to_mohd.py`)."""
    options = _options(args, MOHD_OPTIONS)
    options["preset"] = None if args.preset == "none" else args.preset
    options["rotation"] = None if args.rotate == "none" else args.rotate
    return options


def latent_moe_options(args) -> tuple:
    """(convert, options) for the arguments `add_latent_moe_arguments` parsed (`hf-mohd convert latent-moe`,
    `conversion/convert_llama_to_latent_moe.py`): `convert(args.source, args.output, **options)` carves
    (`convert_carved_latent_moe`, with --carve) or upcycles (`convert_latent_moe`).

    Raises:
        ConversionError: an option of the other way given (--carve with an upcycling option, or a carving option
            without --carve).
    """
    from hf_mohd.conversion import ConversionError, convert_carved_latent_moe, convert_latent_moe

    def given(names):
        return ["--" + name.replace("_", "-") for name in names if getattr(args, name) not in (None, [])]

    if args.carve:
        if given(UPCYCLE_ONLY):
            raise ConversionError(
                f"{given(UPCYCLE_ONLY)} do not apply to --carve (experts cut from the FFN; a latent width is "
                "--latent-size)."
            )
        options = {name: value for name, value in _options(args, CARVE_OPTIONS).items() if value is not None}
        return convert_carved_latent_moe, options
    if given(CARVE_ONLY):
        raise ConversionError(f"{given(CARVE_ONLY)} apply only with --carve.")
    options = _options(args, LATENT_MOE_OPTIONS)
    options["expert_init"] = options["expert_init"] or "slices"
    return convert_latent_moe, options


@_conversion_command
def run_mohd(args) -> int:
    from hf_mohd.conversion import convert_mohd

    convert_mohd(args.source, args.output, **mohd_options(args))
    return 0


@_conversion_command
def run_latent_moe(args) -> int:
    convert, options = latent_moe_options(args)
    convert(args.source, args.output, **options)
    return 0
