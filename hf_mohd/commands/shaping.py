"""Shaping and allocation commands of arXiv 2610.14644 (docs/design.md section 4): `hf-mohd alpha-transform`,
`propose-shape`, `intrinsic-dim` and `allocate` (the accounting of a shape is `hf-mohd accounting`).

Every command reads local files only. Bad input raises `CommandError` (one line `error: <path or option>: ...`,
see `hf_mohd.commands`): a missing file exits with 3, a file of the wrong kind with 4, an unreadable one with 5; a
config whose fields the command cannot use (e.g. `hidden_size` not divisible by --alpha) with 6, and option values
that cannot be met without a config (propose-shape --product) with 2.
"""

import argparse
import functools
import json
import os
import sys

from . import CommandError, add_command, check_model_folder, read_config_json, read_json_file, read_text_file


def register(subparsers) -> None:
    p = _command(subparsers, "alpha-transform", run_alpha_transform)
    p.add_argument("config", help="config.json (or folder) of a standard MoE (moe_latent_size unset).")
    p.add_argument("--alpha", type=float, required=True, help="Compression factor (4 in Nemotron 3).")
    p.add_argument(
        "--output", help="Where to write the new config, a .json file or else a folder (default: print it)."
    )

    p = _command(subparsers, "propose-shape", run_propose_shape)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--product", type=int, help="Target l*m.")
    source.add_argument("--config", help="LatentMoE config.json (or folder): target = l*m of --layer.")
    p.add_argument("--layer", type=int, default=0, help="Layer of --config to read l and m from.")
    p.add_argument(
        "--max-aspect-deviation",
        type=float,
        default=0.4,
        help="Bound on |l/m - 1|; 0.4 is the near-square plateau of arXiv 2610.14644 section 3.2.",
    )
    p.add_argument("--multiple", type=int, default=64, help="Alignment of l and m.")
    p.add_argument("--max-latent-size", type=int, help="Upper bound on l (with --config: hidden_size).")
    p.add_argument("--product-tolerance", type=float, default=0.05, help="Accepted relative error of l*m.")
    p.add_argument("--top", type=int, default=5, help="How many ranked shapes to print.")

    p = _command(subparsers, "intrinsic-dim", run_intrinsic_dim)
    p.add_argument("model", help="Local model folder (AutoModelForCausalLM).")
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--text-file", help="UTF-8 text; non-empty paragraphs (blank-line separated) are sequences.")
    inputs.add_argument("--input-ids", help="JSON file holding a list of token-id lists.")
    p.add_argument("--tokenizer", help="Tokenizer folder for --text-file (when omitted: the model folder).")
    p.add_argument("--gguf-file", help="GGUF file inside the model folder to load (transformers dequantises it).")
    p.add_argument("--max-length", type=int, default=512, help="Tokens per sequence of --text-file.")
    p.add_argument("--max-tokens", type=int, default=20000, help="Pool of non-padding tokens.")
    p.add_argument("--num-samples", type=int, default=5000, help="Tokens kept at random from the pool.")
    p.add_argument("--batch-size", type=int, default=8, help="Sequences per forward pass.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the token sample.")
    p.add_argument("--discard-fraction", type=float, default=0.1, help="Largest r2/r1 ratios left out of the fit.")
    p.add_argument("--trust-remote-code", action="store_true", help="Allow model code from the folder.")
    p.add_argument("--output", help="Write the profile as JSON (a .json file, else a folder) for `hf-mohd allocate`.")

    p = _command(subparsers, "allocate", run_allocate)
    p.add_argument("config", help="Uniform LatentMoE config.json (or folder).")
    p.add_argument("--profile", required=True, help="JSON from `hf-mohd intrinsic-dim`, or a JSON list of IDs.")
    p.add_argument("--output-dir", required=True, help="Folder for config.json, allocation.json, id_profile.png.")
    p.add_argument("--split", type=int, help="First wide layer (overrides the profile's split).")
    p.add_argument("--tolerance", type=float, default=0.05, help="Relative per-layer budget.")
    p.add_argument(
        "--max-aspect-deviation",
        type=float,
        default=0.3,
        help="Bound on |l/m - 1| of both regimes; 0.3 is the allocation's 'up to 30%%' of arXiv 2610.14644 "
        "section 4.2.",
    )
    p.add_argument("--multiple", type=int, default=64, help="Alignment of l and m.")
    p.add_argument("--shared-multiple", type=int, help="Alignment of m_s (when omitted: --multiple).")
    p.add_argument("--narrow-latent-size", type=int, help="Force l of the shallow regime.")
    p.add_argument("--wide-latent-size", type=int, help="Force l of the deep regime.")


def _command(subparsers, name: str, run) -> argparse.ArgumentParser:
    """`add_command` with `run`'s `ValueError`s turned into `CommandError`s."""
    return add_command(subparsers, name, _guard(run))


def _guard(func):
    """`func(args)`, a `ValueError` of the shaping functions raised as a `CommandError`: "config" naming
    `args.config` (its fields do not allow what the options ask), or "usage" when the command has no config."""

    @functools.wraps(func)
    def wrapped(args) -> int:
        try:
            return func(args)
        except ValueError as error:
            config = getattr(args, "config", None)
            raise CommandError("config" if config else "usage", config, str(error)) from error

    return wrapped


def _write_json(data, output: str, default_name: str) -> str:
    path = output if output.endswith(".json") and not os.path.isdir(output) else os.path.join(output, default_name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
    return path


def run_alpha_transform(args) -> int:
    """Turn a standard MoE config into a LatentMoE one: l = D/alpha, N' = alpha N, K' = alpha K.

    The alpha-transform of arXiv 2610.14644 section 2: at fixed expert width m, l = D / alpha, N' = alpha N,
    K' = alpha K keep the routed path's parameters, compute and all-to-all payload.
    """
    from hf_mohd.shaping.config_io import alpha_transform_summary
    from hf_mohd.shaping.shapes import alpha_transform

    alpha = int(args.alpha) if float(args.alpha).is_integer() else args.alpha
    before = read_config_json(args.config)
    after = alpha_transform(before, alpha)
    if args.output:
        path = _write_json(after, args.output, "config.json")
        print(f"wrote {path}", file=sys.stderr)
        for name, (old, new) in alpha_transform_summary(before, after).items():
            print(f"{name}: {old:,} -> {new:,}", file=sys.stderr)
    else:
        print(json.dumps(after, indent=2, sort_keys=True))
    return 0


def run_propose_shape(args) -> int:
    """Near-square expert shapes (l, m) at a fixed per-expert budget l*m.

    Ranks aligned (l, m) with l*m near the target and |l/m - 1| within the bound (arXiv 2610.14644 sections 3.1-3.2; the
    local-rank ceiling is q = min(l, m)).
    """
    from hf_mohd.models.accounting import layer_fields
    from hf_mohd.shaping.shapes import propose_shapes

    max_latent = args.max_latent_size
    if args.config:
        fields = layer_fields(read_config_json(args.config), args.layer)
        width = fields["moe_latent_size"] or fields["hidden_size"]
        if not fields["moe_intermediate_size"]:
            raise ValueError(f"layer {args.layer}: `moe_intermediate_size` is not set in {args.config}.")
        product = width * fields["moe_intermediate_size"]
        max_latent = max_latent or fields["hidden_size"]
        print(f"target l*m = {width} * {fields['moe_intermediate_size']} = {product:,} (layer {args.layer})")
    else:
        product = args.product
    shapes = propose_shapes(
        product,
        max_aspect_deviation=args.max_aspect_deviation,
        multiple=args.multiple,
        max_latent_size=max_latent,
        product_tolerance=args.product_tolerance,
    )
    if not shapes:
        raise ValueError(
            f"no (l, m) within {args.product_tolerance:.0%} of l*m = {product} with |l/m - 1| <= "
            f"{args.max_aspect_deviation} and multiples of {args.multiple}; relax --product-tolerance, "
            "--max-aspect-deviation or --multiple."
        )
    print(f"{'l':>6} {'m':>6} {'l*m':>10} {'error':>8} {'|l/m-1|':>8} {'q=min(l,m)':>10}")
    for shape in shapes[: args.top]:
        print(
            f"{shape.latent_size:>6} {shape.intermediate_size:>6} {shape.product:>10,} {shape.product_error:>8.2%} "
            f"{shape.aspect_deviation:>8.3f} {shape.rank_ceiling:>10}"
        )
    return 0


def run_intrinsic_dim(args) -> int:
    """TwoNN intrinsic dimension at every block boundary of a local causal LM.

    Collects hidden states at each block boundary (entering each block; the last before the final norm) for a random
    sample of non-padding tokens and estimates their TwoNN intrinsic dimension (Facco et al. 2017; arXiv 2610.14644
    section 4.1). Works for any transformers causal LM.
    """
    import torch
    from transformers import AutoModelForCausalLM

    import hf_mohd  # noqa: F401  (registers the model types)
    from hf_mohd.shaping.intrinsic_dimension import (
        collect_hidden_states,
        intrinsic_dimension_profile,
        tokenize_texts,
    )

    check_model_folder(args.model, label="a local model folder (AutoModelForCausalLM)", gguf_file=args.gguf_file)
    if args.input_ids:
        sequences = read_json_file(args.input_ids, "--input-ids", "a JSON list of token-id lists")
        if not isinstance(sequences, list) or not all(isinstance(s, list) for s in sequences):
            raise CommandError("damaged", args.input_ids, "expected a JSON list of token-id lists (--input-ids).")
    else:
        from transformers import AutoTokenizer

        from hf_mohd.evaluation.harness import TOKENIZER_FILES

        texts = [chunk.strip() for chunk in read_text_file(args.text_file, "--text-file").split("\n\n")]
        gguf = {"gguf_file": args.gguf_file} if args.gguf_file and not args.tokenizer else {}
        source = args.tokenizer or args.model
        if args.tokenizer and not os.path.exists(args.tokenizer):
            raise CommandError("missing", args.tokenizer, "does not exist; expected a folder with tokenizer files.")
        if (
            not gguf
            and os.path.isdir(source)
            and not any(os.path.isfile(os.path.join(source, n)) for n in TOKENIZER_FILES)
        ):
            raise CommandError(
                "wrong_type",
                source,
                f"has no tokenizer files (expected one of {list(TOKENIZER_FILES)}); pass --tokenizer.",
            )
        tokenizer = AutoTokenizer.from_pretrained(source, **gguf)
        sequences = tokenize_texts(tokenizer, [text for text in texts if text], args.max_length)
    gguf = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        args.model, trust_remote_code=args.trust_remote_code, dtype=torch.float32, **gguf
    ).eval()
    hidden = collect_hidden_states(
        model,
        sequences,
        max_tokens=args.max_tokens,
        num_samples=args.num_samples,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    profile, duplicates = intrinsic_dimension_profile(hidden, args.discard_fraction, return_duplicates=True)
    result = {
        "model": args.model,
        "num_boundaries": len(profile),
        "num_samples": hidden.shape[1],
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "discard_fraction": args.discard_fraction,
        "intrinsic_dimension": profile,
        "dropped_duplicates": duplicates,
    }
    for idx, (value, dropped) in enumerate(zip(profile, duplicates, strict=True)):
        note = f"  ({dropped} points with an identical twin left out)" if dropped else ""
        print(f"boundary {idx:>3}: {value:8.2f}{note}")
    if args.output:
        path = _write_json(result, args.output, "id_profile.json")
        print(f"wrote {path}", file=sys.stderr)
    return 0


def run_allocate(args) -> int:
    """ID-guided two-regime per-layer LatentMoE config (narrow shallow prefix, wide rest) with a plot.

    Splits at the steepest rise of the ID profile in the first two thirds of depth and gives the prefix a narrow and the
    rest a wide near-square expert shape, each keeping per-layer parameters, activated FLOPs and all-to-all volume
    within the tolerance of the uniform config (arXiv 2610.14644 section 4.2). Writes config.json (per_layer_config),
    allocation.json and id_profile.png.
    """
    from hf_mohd.shaping.allocation import allocate_two_regime, write_allocation

    expected = "a JSON list of IDs or an object with an `intrinsic_dimension` list"
    config = read_config_json(args.config)
    profile = read_json_file(args.profile, "--profile", expected)
    if isinstance(profile, dict):
        profile = profile.get("intrinsic_dimension")
    if not isinstance(profile, list):
        raise CommandError("damaged", args.profile, f"expected {expected} (--profile).")
    allocation = allocate_two_regime(
        config,
        profile,
        split=args.split,
        tolerance=args.tolerance,
        max_aspect_deviation=args.max_aspect_deviation,
        multiple=args.multiple,
        shared_multiple=args.shared_multiple,
        narrow_latent_size=args.narrow_latent_size,
        wide_latent_size=args.wide_latent_size,
    )
    paths = write_allocation(allocation, args.output_dir)
    summary = allocation.summary()
    print(f"split: layers < {allocation.split} narrow, the rest wide (profile block {allocation.proxy_split})")
    for regime in ("uniform", "narrow", "wide"):
        shape = summary[regime]
        line = (
            f"{regime:>7}: l={shape['moe_latent_size']} m={shape['moe_intermediate_size']} "
            f"N={shape['num_experts']} K={shape['num_experts_per_tok']} m_s={shape['moe_shared_expert_intermediate_size']}"
        )
        if regime != "uniform":
            line += "  " + " ".join(f"{k} {v:+.2%}" for k, v in summary["deviations"][regime].items())
        print(line)
    for name in ("config", "allocation", "plot"):
        print(f"wrote {paths[name]}")
    return 0
