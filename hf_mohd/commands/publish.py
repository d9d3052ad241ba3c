"""`hf-mohd publish`: upload a saved MoHD / LatentMoE folder to the Hub with code files, tokenizer and a model card."""

from . import CommandError, add_command, check_model_folder, read_json_file


def register(subparsers) -> None:
    parser = add_command(subparsers, "publish", run)
    parser.add_argument("folder", help="A save_pretrained folder of a MoHD or LatentMoE model (with its tokenizer).")
    parser.add_argument("repo_id", help="Target repository, namespace/name (created if missing).")
    parser.add_argument("--base-model", action="append", help="Hub id of the base model (repeatable).")
    parser.add_argument("--dataset", action="append", help="Training data: Hub id or description (repeatable).")
    parser.add_argument("--eval-results", help="lm-eval results JSON (the CLI's --output_path file) for the card.")
    parser.add_argument("--training", help="JSON object of training settings to list in the card.")
    parser.add_argument("--notes", help="Free text for the card's Notes section.")
    parser.add_argument("--keep-readme", action="store_true", help="Upload the folder's README.md as the card.")
    parser.add_argument("--private", action="store_true", default=None, help="Create the repository private.")
    parser.add_argument("--revision", help="Branch to commit to (default: main).")
    parser.add_argument("--create-pr", action="store_true", help="Open a pull request instead of committing.")
    parser.add_argument("--commit-message", default="Upload model with hf-mohd", help="The Hub commit's message.")
    parser.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT or huggingface.co).")


def _hub_errors() -> tuple[type[Exception], ...]:
    """The exceptions of an unreachable (or refusing) Hub: offline mode, connection and timeout errors of
    huggingface_hub's HTTP client, and its HTTP errors."""
    import importlib

    from huggingface_hub.errors import HfHubHTTPError

    errors = [ConnectionError, TimeoutError, HfHubHTTPError]
    for client in ("httpx2", "httpx"):  # the HTTP client huggingface_hub uses (its name changed across versions)
        try:
            errors.append(importlib.import_module(client).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def run(args) -> int:
    """Upload a saved model folder to the Hub (safetensors, config with auto_map, code, tokenizer, model card).

    Everything local is checked before the Hub is contacted; bad input prints `error: <path or option>: <what was
    expected>`: no such FOLDER or --eval-results file (exit status 3), a FOLDER that is not a MoHD or LatentMoE
    folder (4), truncated or garbage weights or an --eval-results file that is not JSON (5), a config field out of
    range (6), a Hub that cannot be reached or refuses the upload (7), a --training value that is not a JSON
    object (2).
    """
    import json

    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError

    from hf_mohd.hub import publish

    check_model_folder(
        args.folder, ("mohd", "latent_moe"), label="a MoHD or LatentMoE folder saved by save_pretrained"
    )
    card_kwargs = None
    if not args.keep_readme:
        card_kwargs = {"base_model": args.base_model, "datasets": args.dataset, "notes": args.notes}
        if args.eval_results:
            card_kwargs["eval_results"] = read_json_file(args.eval_results, "--eval-results", "lm-eval results JSON")
        if args.training:
            try:
                card_kwargs["training"] = json.loads(args.training)
            except ValueError as error:
                raise CommandError("usage", "--training", f"expected a JSON object ({error}).") from error
            if not isinstance(card_kwargs["training"], dict):
                raise CommandError("usage", "--training", f"expected a JSON object, got {args.training!r}.")
    endpoint = args.endpoint or constants.ENDPOINT
    try:
        info = publish(
            args.folder,
            args.repo_id,
            card_kwargs=card_kwargs,
            private=args.private,
            revision=args.revision,
            create_pr=args.create_pr,
            commit_message=args.commit_message,
            endpoint=args.endpoint,
        )
    except HFValidationError as error:  # before _hub_errors: a ValueError, not a network error
        raise CommandError(
            "usage", args.repo_id, f"not a repository id ({error}); expected namespace/name."
        ) from error
    except _hub_errors() as error:
        message = " ".join(str(error).split())
        raise CommandError(
            "hub", endpoint, f"cannot reach the Hub or it refused the upload ({type(error).__name__}: {message})."
        ) from error
    except ValueError as error:  # `prepare_files`: a config field or model card value (the message names it)
        raise CommandError("config", None, str(error)) from error
    print(info.pr_url or info.commit_url)
    return 0
