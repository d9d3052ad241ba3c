"""Shared runner of the replication comparisons (items 2-4 of bench/results/REPLICATION.md).

Every comparison script defines its variants as functions `seed -> TrainConfig` (built with `train_config` below)
and calls `run_comparison`. All runs of all comparisons share:

- the corpus: the English Wikipedia sample of the PyPI `gensim` wheel, as loaded by the main demo
  (`hf_mohd.corpora.wikipedia_corpus`, layout "paragraphs");
- one fixed document-level split (10% of the articles held out, chosen with `SPLIT_SEED`) and one byte-level BPE
  tokenizer trained on the training articles. The trainer cuts its held-out split with the *run* seed
  (`hf_mohd.training.data.split_documents`); to keep the held-out articles and the packed training blocks identical
  across seeds without touching the library, the runner writes one JSONL per seed whose article order makes the
  trainer's seeded split return exactly the fixed split (checked after writing). A seed therefore changes only the
  weight initialisation and the order of the training blocks;
- the tiny training budget of `BUDGET` (same tokens for every run of a comparison), fp32 on CPU, one torch thread;
  held-out loss on the first `eval_batches` x `micro_batch_size` held-out blocks (the same tokens for every run).

A run whose `summary.json` already exists under `runs/replication/<comparison>/<variant>_s<seed>/` is reused (pass
`--force` to retrain); the results JSON and the loss-curve PNG are rebuilt from all summaries every time.
"""

import argparse
import json
import math
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hf_mohd.atomic_folder import write_text_atomically


HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RESULTS = HERE.parent / "results" / "replication"
RUNS = REPO / "runs" / "replication"
SPLIT_SEED = 1234
EVAL_FRACTION = 0.1

# The tiny dense base shape every comparison derives its models from (LLaMA: SwiGLU FFN, RoPE, tied embeddings).
BASE = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
# Training budget of every run (tokens = max_steps * micro_batch_size * seq_len).
BUDGET = {
    "vocab_size": 2048,
    "seq_len": 128,
    "micro_batch_size": 16,
    "max_steps": 200,
    "lr": 3e-3,
    "warmup_steps": 20,
    "eval_points": 4,
    "eval_batches": 20,
}


def _texts_of(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle]


def prepare_data() -> dict:
    """Corpus, fixed split and tokenizer (built once under runs/replication/data; returns paths and provenance)."""
    from hf_mohd.corpora import wikipedia_corpus
    from hf_mohd.training.data import pack, split_documents, train_bpe_tokenizer

    folder = RUNS / "data"
    info_path = folder / "data_info.json"
    if info_path.exists():
        return json.loads(info_path.read_text(encoding="utf-8"))
    corpus, provenance = wikipedia_corpus(str(folder))
    texts = _texts_of(Path(corpus))
    train_texts, eval_texts = split_documents(texts, EVAL_FRACTION, SPLIT_SEED)
    tokenizer = train_bpe_tokenizer(train_texts, BUDGET["vocab_size"])
    tokenizer_dir = folder / "tokenizer"
    tokenizer.save_pretrained(str(tokenizer_dir))
    info = {
        "corpus": corpus,
        "provenance": provenance,
        "tokenizer": str(tokenizer_dir),
        "split_seed": SPLIT_SEED,
        "eval_fraction": EVAL_FRACTION,
        "articles_train": len(train_texts),
        "articles_held_out": len(eval_texts),
        "train_tokens_packed": int(pack(train_texts, tokenizer, BUDGET["seq_len"]).numel()),
        "held_out_tokens_packed": int(pack(eval_texts, tokenizer, BUDGET["seq_len"]).numel()),
    }
    write_text_atomically(info_path, json.dumps(info, indent=1))
    return info


def seeded_corpus(seed: int) -> str:
    """JSONL whose article order makes `split_documents(..., EVAL_FRACTION, seed)` return the fixed split."""
    from hf_mohd.training.data import split_documents

    info = prepare_data()
    path = RUNS / "data" / f"enwiki_seed{seed}.jsonl"
    texts = _texts_of(Path(info["corpus"]))
    train_texts, eval_texts = split_documents(texts, EVAL_FRACTION, SPLIT_SEED)
    if not path.exists():
        n, n_eval = len(texts), len(eval_texts)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        slots: list[str | None] = [None] * n
        for position, text in zip(sorted(order[:n_eval]), eval_texts, strict=True):
            slots[position] = text
        for position, text in zip(sorted(order[n_eval:]), train_texts, strict=True):
            slots[position] = text
        with open(path, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps({"text": text}) + "\n" for text in slots)
    check_train, check_eval = split_documents(_texts_of(path), EVAL_FRACTION, seed)
    if check_train != train_texts or check_eval != eval_texts:
        raise AssertionError(f"{path}: the seeded split does not reproduce the fixed split")
    return str(path)


def train_config(comparison: str, variant: str, architecture: dict, seed: int, **overrides):
    """The `TrainConfig` of one run: `architecture` (a `model.architecture` dict) on the shared data and budget."""
    from hf_mohd.training import train_config_from_dict

    info = prepare_data()
    steps = overrides.pop("max_steps", BUDGET["max_steps"])
    values = {
        "output_dir": str(RUNS / comparison / f"{variant}_s{seed}"),
        "max_steps": steps,
        "micro_batch_size": BUDGET["micro_batch_size"],
        "seed": seed,
        "log_every": max(1, steps // 40),
        "eval_every": max(1, steps // BUDGET["eval_points"]),
        "eval_batches": BUDGET["eval_batches"],
        "save_every": 0,
        "keep_checkpoints": 1,
        "resume": "never",
        "progress_bar": False,
        "save_final": False,
        "mixed_precision": "no",
        "optim": {"lr": BUDGET["lr"], "warmup_steps": BUDGET["warmup_steps"]},
        "model": {"architecture": architecture, "tokenizer": info["tokenizer"]},
        "data": {"path": seeded_corpus(seed), "seq_len": BUDGET["seq_len"], "eval_fraction": EVAL_FRACTION},
    }
    values.update(overrides)
    return train_config_from_dict(values, source=f"{comparison}:{variant}")


def dense_architecture(**overrides) -> dict:
    return {"model_type": "llama", **BASE, **overrides}


def run_one(config, force: bool = False) -> dict:
    """Train one config (or reuse its summary); returns the summary dict."""
    from hf_mohd.models.accounting import parameter_counts
    from hf_mohd.training import train

    summary_path = Path(config.output_dir) / "summary.json"
    if summary_path.exists() and not force:
        return json.loads(summary_path.read_text(encoding="utf-8"))
    load_before = os.getloadavg()[0]
    cpu_before = time.process_time()
    result = train(config)
    cpu_seconds = time.process_time() - cpu_before
    with open(Path(config.output_dir) / "log.jsonl", encoding="utf-8") as handle:
        log = [json.loads(line) for line in handle]
    tokens_at = {r["step"]: r["tokens"] for r in log if "tokens" in r}
    per_step = result.tokens / result.steps
    evals = [
        {"step": r["step"], "tokens": tokens_at.get(r["step"], r["step"] * per_step), "eval_loss": r["eval_loss"]}
        for r in log
        if "eval_loss" in r
    ]
    # The trainer logs the final evaluation twice when eval_every divides max_steps: keep one per step.
    evals = list({e["step"]: e for e in evals}.values())
    summary = {
        "variant": Path(config.output_dir).name,
        "seed": config.seed,
        "architecture": config.model.architecture,
        "params": parameter_counts(result.model),
        "steps": result.steps,
        "tokens": result.tokens,
        "final_eval_loss": result.eval_loss,
        "final_eval_perplexity": result.eval_perplexity,
        "final_train_loss": [r for r in log if "loss" in r][-1]["loss"],
        "eval_curve": evals,
        "train_curve": [{"step": r["step"], "tokens": r["tokens"], "loss": r["loss"]} for r in log if "loss" in r],
        "wall_seconds": result.seconds,
        "cpu_seconds": cpu_seconds,
        "loadavg_1min_start_end": [load_before, os.getloadavg()[0]],
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    write_text_atomically(summary_path, json.dumps(summary, indent=1))  # its presence marks the run done
    return summary


def _spread(values: list[float]) -> float | None:
    """Seed-to-seed spread: max - min over seeds (None with one seed)."""
    return max(values) - min(values) if len(values) > 1 else None


def aggregate(comparison: str, variants: dict, seeds: dict, summaries: dict, baseline: str, meta: dict) -> dict:
    """Results JSON: per variant mean final held-out loss, per-seed values, spread; differences to `baseline`."""
    table = {}
    for name in variants:
        runs = [summaries[(name, s)] for s in seeds[name] if (name, s) in summaries]
        if not runs:
            table[name] = {"done": False, "seeds": []}
            continue
        losses = [r["final_eval_loss"] for r in runs]
        table[name] = {
            "done": True,
            "seeds": [r["seed"] for r in runs],
            "final_eval_loss_per_seed": losses,
            "final_eval_loss_mean": statistics.fmean(losses),
            "final_eval_loss_spread": _spread(losses),
            "final_eval_perplexity_mean": math.exp(statistics.fmean(losses)),
            "params": runs[0]["params"],
            "tokens": runs[0]["tokens"],
            "wall_seconds": [r["wall_seconds"] for r in runs],
            "cpu_seconds": [r["cpu_seconds"] for r in runs],
        }
    base = table.get(baseline, {})
    for name, row in table.items():
        if not row["done"] or not base.get("done"):
            continue
        common = sorted(set(row["seeds"]) & set(base["seeds"]))
        paired = [
            summaries[(name, s)]["final_eval_loss"] - summaries[(baseline, s)]["final_eval_loss"] for s in common
        ]
        row["diff_vs_baseline"] = {
            "baseline": baseline,
            "mean_loss_diff": row["final_eval_loss_mean"] - base["final_eval_loss_mean"],
            "paired_diff_per_seed": dict(zip(map(str, common), paired, strict=True)),
            "baseline_seed_spread": base["final_eval_loss_spread"],
            "variant_seed_spread": row["final_eval_loss_spread"],
            "perplexity_ratio": math.exp(row["final_eval_loss_mean"] - base["final_eval_loss_mean"]),
        }
    return {
        "comparison": comparison,
        "baseline": baseline,
        **meta,
        "data": prepare_data(),
        "budget": BUDGET,
        "base_shape": BASE,
        "variants": table,
        "runs": {f"{n}_s{s}": summaries[(n, s)] for (n, s) in sorted(summaries)},
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = [n for n, row in results["variants"].items() if row["done"]]
    for index, name in enumerate(names):
        colour = colours[index % len(colours)]
        for seed_index, seed in enumerate(results["variants"][name]["seeds"]):
            run = results["runs"][f"{name}_s{seed}"]
            style = "-" if seed_index == 0 else "--"
            label = f"{name} (seed {seed})"
            train = run["train_curve"]
            left.plot([r["tokens"] / 1e6 for r in train], [r["loss"] for r in train], style, color=colour, label=label)
            evals = run["eval_curve"]
            right.plot(
                [r["tokens"] / 1e6 for r in evals], [r["eval_loss"] for r in evals], style + "o", color=colour, ms=3
            )
    left.set(xlabel="training tokens (M)", ylabel="train loss (nats/token)", title="Training loss")
    right.set(xlabel="training tokens (M)", ylabel="held-out loss (nats/token)", title="Held-out loss")
    finals = [r["final_eval_loss"] for r in results["runs"].values()]
    if finals:
        right.set_ylim(min(finals) - 0.1, min(finals) + 1.2)
    for axis in (left, right):
        axis.grid(alpha=0.3)
    left.legend(fontsize=7)
    figure.suptitle(results["title"], fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", nargs="*", default=None, help="variants to train now (others: reuse if present)")
    parser.add_argument("--seeds", nargs="*", type=int, default=None, help="seeds to train now (default: all)")
    parser.add_argument("--force", action="store_true", help="retrain runs whose summary exists")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help=f"optimizer steps per run instead of {BUDGET['max_steps']} (a larger budget): runs go to "
        "runs/replication_<N>steps/ and results to <comparison>_<N>steps.json/.png",
    )
    return parser.parse_args()


def run_comparison(
    comparison: str,
    title: str,
    variants: dict[str, Callable[[int], object]],
    seeds: dict[str, list[int]],
    baseline: str,
    meta: dict | None = None,
) -> dict:
    """Train (or reuse) every requested variant x seed, then write `<comparison>.json` and `<comparison>.png`.

    Args:
        comparison: name of the result files and of the run folder.
        title: plot title.
        variants: name -> function(seed) -> TrainConfig.
        seeds: name -> seeds of that variant.
        baseline: the variant differences are reported against.
        meta: extra fields of the results JSON (claim, command, notes).
    """
    global RUNS
    args = arguments(title)
    suffix = ""
    if args.max_steps and args.max_steps != BUDGET["max_steps"]:
        BUDGET["max_steps"] = args.max_steps
        BUDGET["warmup_steps"] = max(1, args.max_steps // 10)
        suffix = f"_{args.max_steps}steps"
        RUNS = REPO / "runs" / f"replication{suffix}"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    summaries = {}
    # Seed-major order: every variant's first seed is trained before any second seed.
    order = sorted(((seed, index, name) for index, name in enumerate(variants) for seed in seeds[name]))
    for seed, _, name in order:
        config = variants[name](seed)
        wanted = (args.only is None or name in args.only) and (args.seeds is None or seed in args.seeds)
        summary_path = Path(config.output_dir) / "summary.json"
        if wanted:
            print(f"== {comparison}: {name} seed {seed}", flush=True)
            summaries[(name, seed)] = run_one(config, force=args.force)
            s = summaries[(name, seed)]
            print(
                f"   held-out loss {s['final_eval_loss']:.4f}, wall {s['wall_seconds']:.0f} s, "
                f"cpu {s['cpu_seconds']:.0f} s",
                flush=True,
            )
        elif summary_path.exists():
            summaries[(name, seed)] = json.loads(summary_path.read_text(encoding="utf-8"))
    results = aggregate(comparison, variants, seeds, summaries, baseline, {"title": title, **(meta or {})})
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{comparison}{suffix}.json"
    write_text_atomically(out, json.dumps(results, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    for name, row in results["variants"].items():
        if not row["done"]:
            print(f"{name:28s} not run")
            continue
        spread = row["final_eval_loss_spread"]
        diff = row.get("diff_vs_baseline", {}).get("mean_loss_diff")
        print(
            f"{name:28s} loss {row['final_eval_loss_mean']:.4f} (seeds {row['seeds']}, spread "
            f"{'n/a' if spread is None else f'{spread:.4f}'}) diff vs {baseline}: "
            f"{'n/a' if diff is None else f'{diff:+.4f}'}  activated {row['params']['activated_decoder']:,} "
            f"total {row['params']['total']:,}"
        )
    print(f"wrote {out}")
    return results
