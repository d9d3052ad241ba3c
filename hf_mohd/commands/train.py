"""`hf-mohd train CONFIG`: train (or resume) a causal LM from a YAML/JSON config; works under `accelerate launch`."""

from . import add_command, fail


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


def run(args) -> int:
    """Train or resume a MoHD / LatentMoE / Llama model from a YAML or JSON config (see configs/).

    Every field of the config has a default; see hf_mohd.training.config for their meaning.
    Run under `accelerate launch` for several processes. A config file that does not exist, does not parse, or has
    an invalid field (or --set), a data path that matches no file, an architecture field its config class does not
    have, or a run folder whose checkpoints were trained with another model prints `error: <config>: <what was
    expected>` (exit status 1) before training starts. A finished run is not trained or evaluated again.
    A process of a multi-process run (`WORLD_SIZE` > 1) ends through `exit_process` once training is done, which skips
    the interpreter's finalization (see there: a gloo teardown race otherwise aborts it now and then).
    """
    import json
    import os

    import yaml

    from hf_mohd.training import TrainConfigError, exit_process, train, train_config_from_dict
    from hf_mohd.training.config import load_train_config

    try:
        config = load_train_config(args.config)
        if args.set:
            with open(args.config, encoding="utf-8") as handle:
                values = yaml.safe_load(handle) or {}
            config = train_config_from_dict(apply_overrides(values, args.set), source=f"{args.config} with --set")
    except (OSError, ValueError, TypeError, yaml.YAMLError) as error:
        return fail(args.config, error)
    try:
        result = train(config)
    except TrainConfigError as error:  # found before the first step: data, tokenizer, model, run folder
        return fail(args.config, error)
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
