"""`hf-mohd publish`: upload a saved MoHD / LatentMoE folder to the Hub with code files, tokenizer and a model card."""

import json

from . import add_command


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
    parser.add_argument("--commit-message", default="Upload model with hf-mohd")
    parser.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT or huggingface.co).")


def run(args) -> int:
    """Upload a saved model folder to the Hub (safetensors, config with auto_map, code, tokenizer, model card)."""
    from hf_mohd.hub import publish

    card_kwargs = None
    if not args.keep_readme:
        card_kwargs = {"base_model": args.base_model, "datasets": args.dataset, "notes": args.notes}
        if args.eval_results:
            with open(args.eval_results) as f:
                card_kwargs["eval_results"] = json.load(f)
        if args.training:
            card_kwargs["training"] = json.loads(args.training)
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
    print(info.pr_url or info.commit_url)
    return 0
