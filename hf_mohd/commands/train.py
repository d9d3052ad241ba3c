"""`hf-mohd train CONFIG`: train (or resume) a causal LM from a YAML/JSON config; works under `accelerate launch`."""

from . import CommandError, add_command, check_model_folder, looks_local


def register(subparsers) -> None:
    parser = add_command(subparsers, "train", run)
    parser.add_argument("config", help="Path to a .yaml/.yml/.json training config.")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="Override a field, e.g. --set max_steps=50 --set optim.lr=3e-4 (VALUE is parsed as YAML).",
    )


def apply_overrides(values: dict, overrides: list[str]) -> dict:
    """Set dotted FIELD=VALUE pairs (VALUE parsed as YAML) in a nested dict."""
    import yaml

    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects FIELD=VALUE, got {item!r}.")
        key, raw = item.split("=", 1)
        target = values
        *parents, leaf = key.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = yaml.safe_load(raw)
    return values


def _load_config(args):
    """The `TrainConfig` of `args.config` with `args.set` applied.

    Raises:
        CommandError: missing (no such file), damaged (not UTF-8, empty, does not parse), usage (a --set that is not
            FIELD=VALUE with VALUE in YAML), config (a field refused); the message names the file and the field.
    """
    import yaml

    from hf_mohd.training import TrainConfigError, train_config_from_dict
    from hf_mohd.training.config import load_train_config

    try:
        config = load_train_config(args.config)
    except FileNotFoundError as error:
        raise CommandError("missing", args.config, str(error)) from error
    except TrainConfigError as error:
        raise CommandError(error.kind, args.config, str(error)) from error
    except ValueError as error:  # a field refused (the message names it)
        raise CommandError("config", args.config, str(error)) from error
    if not args.set:
        return config
    with open(args.config, encoding="utf-8") as handle:
        values = yaml.safe_load(handle) or {}
    try:
        values = apply_overrides(values, args.set)
    except (ValueError, yaml.YAMLError) as error:
        raise CommandError("usage", args.config, " ".join(str(error).split())) from error
    try:
        return train_config_from_dict(values, source=f"{args.config} with --set")
    except ValueError as error:
        raise CommandError("config", args.config, str(error)) from error


def run(args) -> int:
    """Train or resume a MoHD / LatentMoE / Llama model from a YAML or JSON config (see configs/).

    Every field of the config has a default; see hf_mohd.training.config for their meaning.
    Run under `accelerate launch` for several processes. Bad input prints one line `error: <file or field>: <what
    was expected>` before training starts: a config file, `model.init_from` folder or `data.path` that does not exist
    (exit status 3); a `model.init_from` that is a file or has no config.json or tokenizer files (4); a config file
    that is empty or does not parse, truncated or garbage `model.init_from` weights, data with no text (5); an invalid
    field (or --set value), an architecture field its config class does not have, or a run folder whose checkpoints
    were trained with another model (6); a malformed --set (2). A finished run is not trained or evaluated again.
    """
    # A process of a multi-process run (`WORLD_SIZE` > 1) ends through `exit_process` once training is done, which
    # skips the interpreter's finalization (see there: a gloo teardown race otherwise aborts it now and then).
    import json
    import os

    from hf_mohd.training import TrainConfigError, exit_process, train

    config = _load_config(args)
    init_from = config.model.init_from
    if init_from and looks_local(init_from):  # checked before any data, tokenizer or weights are read
        check_model_folder(
            init_from, label="a model folder for `model.init_from`", gguf_file=config.model.gguf_file or None
        )
    try:
        result = train(config)
    except TrainConfigError as error:  # found before the first step: data, tokenizer, model, run folder
        raise CommandError(error.kind, args.config, str(error)) from error
    summary = {
        "output_dir": result.output_dir,
        "final_model_dir": result.final_model_dir,
        "steps": result.steps,
        "tokens": result.tokens,
        "seconds": round(result.seconds, 1),
        "eval_perplexity": result.eval_perplexity,
    }
    if int(os.environ.get("RANK", "0")) == 0:  # once, under `accelerate launch` too
        print(json.dumps(summary, indent=2))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # past gloo's teardown race: a worker thread freeing tensors during finalization aborts the process
        exit_process(0)
    return 0
