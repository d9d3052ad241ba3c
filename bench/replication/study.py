"""Replication study past the n-gram regime: MoHD vs dense with matched baselines, learning-rate sweeps, 3 seeds.

The first round of replication runs (`runner.py`, 0.1-0.2 M activated parameters, 409,600 tokens) ended between
the unigram and the bigram reference lines, so it compared early optimisation speed, not capacity. This study uses
a width-128 base (4 layers, 8 heads of 16, SwiGLU FFN 384, tied embeddings, vocabulary 2,048) trained on 2,048,000
tokens (1,000 steps x 16 sequences x 128 tokens, 2.2 epochs of the 931,072-token training split), and scores every
run against both reference lines (`reference.py`) on the same tokens.

Data: the runner's corpus, fixed document split and tokenizer (`runner.prepare_data`). The 11 held-out articles
are cut in two disjoint halves: the *validation* set (articles 0, 2, 4, ...) chooses the learning rates, the
*verdict* set (articles 1, 3, 5, ...) scores every comparison. The trainer gets a JSONL of the training articles
only (`eval_fraction` 0), so every seed trains on the same packed blocks in a seeded order; a seed changes the
initialisation and the block order.

Protocol (fixed before the runs):
1. Learning-rate sweep, seed 0, over `LR_GRID` (extended by factors of 2 while the best rate is at an edge, at
   most twice: `sweep_grid`) for each family that has its own sweep (dense, MoHD compression 50%,
   MoHD expansion x2); the rate with the lowest validation loss is the family's rate. The sweep run at the chosen
   rate is that arm's seed 0 (it was selected on the validation set, which the verdicts never read).
2. Every arm at its family's rate with `SEEDS`; dense baselines use the dense rate.
3. Noise: the pooled standard deviation of the verdict losses over all arms (`verdicts.pooled_sd`); each comparison
   gets a 95% interval and a two-sided p-value, "keeps quality" claims an equivalence test (TOST) with margin
   `MARGIN`; Holm's correction runs over every p-value of the study.
4. A comparison is a verdict only where both arms end at least `REGIME_GAP` nats below the bigram reference of the
   verdict set; otherwise it is reported as "in the n-gram regime".

Arms (parameters and FLOPs from the package's accounting, printed into the results):
- `dense`: the base Llama.
- `mohd_compression_50`, `mohd_expansion_x2`: the project's presets on the base (16 sub-dimensions, 6 shared and 2
  routed active; expansion at width 256 with the base's attention heads and FFN).
- `dense_at_c50_active`: dense at the compression model's activated decoder parameters (width 96, 6 heads of 16,
  FFN 256: 443,232 vs 439,424).
- `dense_at_x2_flops`: dense at the expansion model's forward FLOPs per token (width 128, FFN 592).
- `dense_at_x2_params`: dense at the expansion model's total parameters (width 256, 8 heads of 16, FFN 384: the
  expansion model with every sub-dimension active, less its routers).
- `dense_at_x2_embedding`: the expansion model's 256-wide embedding and LM head around a dense decoder of width 128
  (MoHD with the same 8 of 16 blocks for every token: 8 shared, `num_routed_sub_dims_per_tok=0`, no router, no group
  fusion, no activation scaling; the other 8 blocks carry the embedding to the final norm), which separates the wider
  decoder from the wider embedding. Added after the ablations; it is the last job of the queue.

Second budget, ablations of the compression model at its learning rate (`ABLATIONS`): attention-only vs FFN-only
sparsity at nearly equal removed activated parameters (32,768 vs 36,864 per layer), the shared fraction (25, 50, 75%
of the active blocks) with both gate forms, and the model without activation scaling (whose constant factor on the
output projections changes Adam's effective step, a confound of every MoHD-vs-dense comparison).

Every run is resumable (trainer checkpoints every 250 steps; a finished run keeps its `summary.json`), and several
workers may share the queue (`--workers 2` starts two processes of one torch thread each; a lock file per run keeps
them apart). `--scale K` multiplies the training tokens by K (results and runs get a `_xK` suffix): the same suite at
10x is `python -m bench.replication.study --scale 10 --threads 8` on a CUDA machine (the trainer picks the device).

Other studies on the same data, budget, queue and statistics define a `Suite` (their arms, jobs, sweeps and
comparisons) and call `main(suite)`: `study_latentmoe.py` is the LatentMoE part.

    nice -n 10 python -m bench.replication.study --workers 2      # train what is missing, then write the results
    python -m bench.replication.study --report                    # results JSON, plots, table from what exists
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.replication import runner, verdicts
from hf_mohd.atomic_folder import write_json_atomically, write_text_atomically


HERE = Path(__file__).resolve().parent


RESULTS = HERE.parent / "results" / "replication"
BASE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
BUDGET = {"seq_len": 128, "micro_batch_size": 16, "max_steps": 1000, "warmup_steps": 50, "save_every": 250}
LR_GRID = (1.5e-3, 3e-3, 6e-3)
MAX_EXTENSIONS = 2  # extra rates beyond an edge of LR_GRID (see `sweep_grid`)
SEEDS = (0, 1, 2)
MARGIN = 0.05  # nats/token: "keeps quality" means the verdict losses differ by less than this (perplexity within 5%)
REGIME_GAP = 0.1  # nats/token below the bigram reference for a comparison to count as a verdict


@dataclass(frozen=True)
class Arm:
    """One model of the study: `family` names the learning-rate sweep whose rate it uses.

    `architecture` is None while it depends on a run that has not finished (the arm is pending); `seeds` None means
    the study's `SEEDS` (a measurement run such as a proxy model may have fewer).
    """

    family: str
    architecture: dict | None
    description: str
    seeds: tuple | None = None


def _dense(**overrides) -> dict:
    return {"model_type": "llama", **BASE, **overrides}


def _mohd(preset: str, **overrides) -> dict:
    from hf_mohd.models.configuration_mohd import MoHDConfig

    fields = MoHDConfig.preset_fields(preset, BASE["hidden_size"], BASE["num_attention_heads"], BASE["head_dim"])
    return {"model_type": "mohd", **BASE, **fields, "sparse_implementation": "masked", **overrides}


def _ablation(description: str, **overrides) -> Arm:
    """An ablation of the compression model: its learning rate, one or two fields changed."""
    return Arm("mohd_compression_50", _mohd("compression_50", **overrides), description)


ARMS = {
    "dense": Arm("dense", _dense(), "Llama, width 128, FFN 384"),
    "mohd_compression_50": Arm("mohd_compression_50", _mohd("compression_50"), "MoHD compression_50 (8 of 16 active)"),
    "mohd_expansion_x2": Arm("mohd_expansion_x2", _mohd("expansion_x2"), "MoHD expansion_x2 (width 256, 8 of 16)"),
    "dense_at_c50_active": Arm(
        "dense",
        _dense(hidden_size=96, num_attention_heads=6, intermediate_size=256),
        "Llama at compression_50's activated decoder parameters (width 96, FFN 256)",
    ),
    "dense_at_x2_flops": Arm(
        "dense", _dense(intermediate_size=592), "Llama at expansion_x2's FLOPs per token (width 128, FFN 592)"
    ),
    "dense_at_x2_params": Arm(
        "dense",
        _dense(hidden_size=256),
        "Llama at expansion_x2's total parameters (width 256, 8 heads of 16, FFN 384)",
    ),
    # expansion_x2's 256-wide embedding and LM head around a dense decoder of width 128: MoHD with the same 8 of
    # 16 blocks for every token (8 shared, k = 0: no router), no group fusion and no activation scaling, so the other
    # 8 blocks carry the embedding straight to the final norm and the LM head. It separates the wider decoder from the
    # wider embedding. Its decoder is dense, so it takes the dense family's rate, as the other dense baselines.
    "dense_at_x2_embedding": Arm(
        "dense",
        _mohd(
            "expansion_x2",
            num_shared_sub_dims=8,
            num_routed_sub_dims_per_tok=0,
            group_fusion="none",
            activation_scaling="none",
        ),
        "dense decoder of width 128 inside expansion_x2's 256-wide embedding and LM head (8 of 16 blocks static)",
    ),
}
# Ablations of the compression model (the second budget). Attention-only vs FFN-only at (nearly) equal removed
# activated parameters per layer: attention holds 4 D^2 = 65,536 weights and the FFN 3 D I = 147,456, so attention
# at 8 of 16 blocks removes 32,768 and the FFN at 12 of 16 blocks 36,864.
ABLATIONS = {
    "c50_attention_only": _ablation("attention sparse at 8 of 16 blocks, FFN dense", sparse_modules=["attention"]),
    "c50_ffn_only_12of16": _ablation(
        "FFN sparse at 12 of 16 blocks (9 shared + 3 routed), attention dense",
        sparse_modules=["ffn"],
        num_shared_sub_dims=9,
        num_routed_sub_dims_per_tok=3,
    ),
    "c50_shared25": _ablation(
        "2 shared + 6 routed, softmax gate", num_shared_sub_dims=2, num_routed_sub_dims_per_tok=6
    ),
    "c50_shared50": _ablation(
        "4 shared + 4 routed, softmax gate", num_shared_sub_dims=4, num_routed_sub_dims_per_tok=4
    ),
    "c50_normalized_shared25": _ablation(
        "2 shared + 6 routed, normalized gate",
        num_shared_sub_dims=2,
        num_routed_sub_dims_per_tok=6,
        routed_gate="normalized",
    ),
    "c50_normalized_shared50": _ablation(
        "4 shared + 4 routed, normalized gate",
        num_shared_sub_dims=4,
        num_routed_sub_dims_per_tok=4,
        routed_gate="normalized",
    ),
    "c50_normalized": _ablation("6 shared + 2 routed, normalized gate", routed_gate="normalized"),
    "c50_no_scaling": _ablation("compression_50 without activation scaling", activation_scaling="none"),
}
ARMS.update(ABLATIONS)
SWEPT = ("dense", "mohd_compression_50", "mohd_expansion_x2")
# Comparisons: (name, arm a, arm b, claim, equivalence margin or None). diff = loss(a) - loss(b).
COMPARISONS = (
    (
        "compression_vs_dense",
        "mohd_compression_50",
        "dense",
        "compression at 50% active keeps dense quality (MoHD, arXiv 2412.05644 abstract)",
        MARGIN,
    ),
    (
        "compression_vs_dense_at_active",
        "mohd_compression_50",
        "dense_at_c50_active",
        "compression beats a dense model of its activated parameters",
        None,
    ),
    ("expansion_vs_dense", "mohd_expansion_x2", "dense", "expansion x2 improves on dense (MoHD abstract)", None),
    (
        "expansion_vs_dense_at_flops",
        "mohd_expansion_x2",
        "dense_at_x2_flops",
        "expansion x2 improves on dense at equal FLOPs per token",
        None,
    ),
    (
        "expansion_vs_dense_at_params",
        "mohd_expansion_x2",
        "dense_at_x2_params",
        "expansion x2 keeps the quality of dense at equal total parameters",
        MARGIN,
    ),
    (
        "expansion_vs_dense_at_embedding",
        "mohd_expansion_x2",
        "dense_at_x2_embedding",
        "expansion x2 improves on a dense decoder given only its wider embedding and LM head (width, not embedding)",
        None,
    ),
    (
        "dense_at_embedding_vs_dense",
        "dense_at_x2_embedding",
        "dense",
        "the wider embedding and LM head alone change the dense model's loss",
        None,
    ),
    (
        "attention_only_vs_ffn_only",
        "c50_attention_only",
        "c50_ffn_only_12of16",
        "attention is more sensitive to sparsity than the FFN (MoHD rebuttal): attention-only sparsity is worse",
        None,
    ),
    (
        "shared75_vs_25_softmax",
        "mohd_compression_50",
        "c50_shared25",
        "75% shared is best (rebuttal), softmax gate",
        None,
    ),
    (
        "shared75_vs_50_softmax",
        "mohd_compression_50",
        "c50_shared50",
        "75% shared is best (rebuttal), softmax gate",
        None,
    ),
    (
        "shared75_vs_25_normalized",
        "c50_normalized",
        "c50_normalized_shared25",
        "75% shared is best (rebuttal), normalized gate",
        None,
    ),
    (
        "shared75_vs_50_normalized",
        "c50_normalized",
        "c50_normalized_shared50",
        "75% shared is best (rebuttal), normalized gate",
        None,
    ),
    (
        "scaling_vs_none",
        "mohd_compression_50",
        "c50_no_scaling",
        "activation scaling alpha = N / (N_s + k) helps (rebuttal Lemma 1)",
        None,
    ),
    (
        "no_scaling_vs_dense",
        "c50_no_scaling",
        "dense",
        "compression without activation scaling keeps dense quality (the step-size confound removed)",
        MARGIN,
    ),
)


def _suffix(scale: int) -> str:
    return "" if scale == 1 else f"_x{scale}"


def runs_dir(scale: int) -> Path:
    return runner.REPO / "runs" / f"replication_v2{_suffix(scale)}"


def run_dir(scale: int, arm: str, lr: float, seed: int) -> Path:
    return runs_dir(scale) / arm / f"lr{lr:g}_s{seed}"


# ----------------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------------


def data(scale: int) -> dict:
    """Training JSONL (training articles only) and the validation / verdict blocks (cached as .pt)."""
    import torch
    from transformers import AutoTokenizer

    from hf_mohd.training.data import pack, split_documents

    info = runner.prepare_data()
    folder = runs_dir(scale) / "data"
    folder.mkdir(parents=True, exist_ok=True)
    train_path, blocks_path = folder / "train.jsonl", folder / "held_out_blocks.pt"
    if not (train_path.exists() and blocks_path.exists()):
        texts = runner._texts_of(Path(info["corpus"]))
        train_texts, eval_texts = split_documents(texts, runner.EVAL_FRACTION, runner.SPLIT_SEED)
        tokenizer = AutoTokenizer.from_pretrained(info["tokenizer"])
        seq_len = BUDGET["seq_len"]
        blocks = {
            "validation": pack(eval_texts[0::2], tokenizer, seq_len),
            "verdict": pack(eval_texts[1::2], tokenizer, seq_len),
            "train": pack(train_texts, tokenizer, seq_len),
        }
        torch.save(blocks, blocks_path)
        write_text_atomically(train_path, "".join(json.dumps({"text": text}) + "\n" for text in train_texts))
    blocks = torch.load(blocks_path)
    return {"info": info, "train_path": str(train_path), "blocks": blocks}


def references(scale: int) -> dict:
    """Unigram and Kneser-Ney bigram losses of the training blocks on the validation and verdict sets."""
    from bench.replication import reference

    path = runs_dir(scale) / "data" / "references.json"
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    loaded = data(scale)
    blocks = {name: value.numpy() for name, value in loaded["blocks"].items()}
    vocab = runner.BUDGET["vocab_size"]
    out = {
        name: {
            "predicted_tokens": int(blocks[name][:, 1:].size),
            "unigram_add_one": reference.unigram_loss(blocks["train"], blocks[name], vocab),
            "bigram_kneser_ney": reference.bigram_loss(blocks["train"], blocks[name], vocab),
        }
        for name in ("validation", "verdict")
    }
    out["train_tokens"] = int(blocks["train"].size)
    path.write_text(json.dumps(out, indent=1), encoding="utf-8")
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------------------


def train_config(scale: int, arm: str, lr: float, seed: int, loaded: dict, arms: dict | None = None):
    """The `TrainConfig` of one run of `arms` (default: this study's `ARMS`) on the study's data and budget."""
    from hf_mohd.training import train_config_from_dict

    arms = ARMS if arms is None else arms

    steps = BUDGET["max_steps"] * scale
    values = {
        "output_dir": str(run_dir(scale, arm, lr, seed)),
        "max_steps": steps,
        "micro_batch_size": BUDGET["micro_batch_size"],
        "seed": seed,
        "log_every": max(1, steps // 50),
        "eval_every": 0,
        "save_every": BUDGET["save_every"] * scale,
        "keep_checkpoints": 1,
        "resume": "auto",
        "progress_bar": False,
        "save_final": False,
        "mixed_precision": "no",
        "router_aux_loss": True,
        "optim": {"lr": lr, "warmup_steps": BUDGET["warmup_steps"] * scale},
        "model": {"architecture": arms[arm].architecture, "tokenizer": loaded["info"]["tokenizer"]},
        "data": {"path": loaded["train_path"], "seq_len": BUDGET["seq_len"], "eval_fraction": 0.0},
    }
    return train_config_from_dict(values, source=f"study:{arm}")


def run_one(
    scale: int,
    arm: str,
    lr: float,
    seed: int,
    arms: dict | None = None,
    post_train: Callable[[object, dict], dict] | None = None,
) -> dict:
    """Train (or resume) one run, score it on the validation and verdict sets, write its `summary.json`.

    `arms` defaults to this study's `ARMS`; `post_train(model, loaded)`, when given, measures the trained model
    (e.g. its intrinsic-dimension profile) and its dict is merged into the summary.
    """
    import resource

    from hf_mohd.evaluation.perplexity import evaluate_perplexity
    from hf_mohd.models.accounting import parameter_counts
    from hf_mohd.training import train

    arms = ARMS if arms is None else arms
    loaded = data(scale)
    config = train_config(scale, arm, lr, seed, loaded, arms)
    folder = Path(config.output_dir)
    load_before, cpu_before = os.getloadavg()[0], time.process_time()
    result = train(config)
    losses = {
        name: evaluate_perplexity(result.model, loaded["blocks"][name], 32)[0] for name in ("validation", "verdict")
    }
    extra = post_train(result.model, loaded) if post_train is not None else {}
    with open(folder / "log.jsonl", encoding="utf-8") as handle:
        log = [json.loads(line) for line in handle]
    summary = {
        "arm": arm,
        "lr": lr,
        "seed": seed,
        "architecture": arms[arm].architecture,
        "params": parameter_counts(result.model),
        "steps": result.steps,
        "tokens": result.tokens,
        "validation_loss": losses["validation"],
        "verdict_loss": losses["verdict"],
        "train_curve": [{"step": r["step"], "tokens": r["tokens"], "loss": r["loss"]} for r in log if "loss" in r],
        # CPU time of this call only (training since the last resume, plus the two evaluations).
        "cpu_seconds_this_process": time.process_time() - cpu_before,
        "wall_seconds_this_process": result.seconds,
        "loadavg_1min_start_end": [load_before, os.getloadavg()[0]],
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "machine": _machine(),
        **extra,
    }
    write_json_atomically(folder / "summary.json", summary, indent=1)
    return summary


def _machine() -> dict:
    """CPU model, cores, load average, library versions (`bench.common.machine_description`)."""
    from bench import common

    return common.machine_description()


def summary_of(scale: int, arm: str, lr: float, seed: int) -> dict | None:
    path = run_dir(scale, arm, lr, seed) / "summary.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def sweep_grid(scale: int, family: str, base: tuple = LR_GRID) -> list[float]:
    """The family's learning-rate grid: `base`, extended by a factor of 2 beyond an edge while the lowest validation
    loss sits at that edge (at most `MAX_EXTENSIONS` extra rates), so the chosen rate is an interior minimum of the
    sweep or the grid says it is not."""
    grid = list(base)
    while True:
        done = {lr: summary_of(scale, family, lr, 0) for lr in grid}
        if any(summary is None for summary in done.values()) or len(grid) >= len(base) + MAX_EXTENSIONS:
            return grid
        best = min(grid, key=lambda lr: done[lr]["validation_loss"])
        if best == grid[0]:
            grid.insert(0, grid[0] / 2)
        elif best == grid[-1]:
            grid.append(grid[-1] * 2)
        else:
            return grid


def chosen_lr(scale: int, family: str, base: tuple = LR_GRID) -> float | None:
    """The family's learning rate: lowest validation loss of its seed-0 sweep over `sweep_grid(scale, family, base)`
    (None until that sweep is complete)."""
    grid = sweep_grid(scale, family, base)
    sweep = {lr: summary_of(scale, family, lr, 0) for lr in grid}
    if any(s is None for s in sweep.values()):
        return None
    return min(grid, key=lambda lr: sweep[lr]["validation_loss"])


def jobs(scale: int) -> list[tuple[str, float | None, int]]:
    """Every run in priority order; `lr` None means "the family's rate, once its sweep is done"."""
    order = []
    for family in ("dense", "mohd_compression_50"):
        order += [(family, lr, 0) for lr in sweep_grid(scale, family)]
    for arm in ("dense", "mohd_compression_50", "dense_at_c50_active"):
        order += [(arm, None, seed) for seed in SEEDS]
    order += [("mohd_expansion_x2", lr, 0) for lr in sweep_grid(scale, "mohd_expansion_x2")]
    for arm in ("mohd_expansion_x2", "dense_at_x2_flops", "dense_at_x2_params"):
        order += [(arm, None, seed) for seed in SEEDS]
    for seed in SEEDS:  # the second budget, seed-major so that every ablation has a first seed early
        order += [(arm, None, seed) for arm in ABLATIONS]
    order += [("dense_at_x2_embedding", None, seed) for seed in SEEDS]  # added after the ablations had run
    return order


def _lock(path: Path) -> bool:
    """Takes the run's lock file (atomic create); a lock whose process is gone is taken over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        owner = int(path.read_text())
        os.kill(owner, 0)
        return False
    except (FileNotFoundError, ValueError):
        pass
    except ProcessLookupError:
        path.unlink(missing_ok=True)
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(descriptor, str(os.getpid()).encode())
    os.close(descriptor)
    return True


def worker(scale: int, suite: "Suite | None" = None) -> None:
    """Runs jobs until none is left: the first ready, unlocked job in priority order each time.

    A job is ready when its rate is known (its family's sweep is done) and its arm's architecture is (a pending arm
    waits for the run it depends on). The suite's arms are rebuilt at every pass, so such an arm becomes ready as soon
    as that run has finished, in any worker.
    """
    suite = MOHD if suite is None else suite
    while True:
        pending, started = 0, False
        arms = suite.arms(scale)
        for arm, lr, seed in suite.jobs(scale):
            rate = lr if lr is not None else chosen_lr(scale, arms[arm].family, suite.lr_grid)
            if rate is not None and summary_of(scale, arm, rate, seed) is not None:
                continue
            pending += 1
            if rate is None or arms[arm].architecture is None:
                continue
            lock = run_dir(scale, arm, rate, seed) / "worker.lock"
            if not _lock(lock):
                continue
            try:
                if summary_of(scale, arm, rate, seed) is None:
                    print(f"== {arm} lr {rate:g} seed {seed} (pid {os.getpid()})", flush=True)
                    s = run_one(scale, arm, rate, seed, arms, suite.post_train.get(arm))
                    print(f"   validation {s['validation_loss']:.4f} verdict {s['verdict_loss']:.4f}", flush=True)
            finally:
                lock.unlink(missing_ok=True)
            started = True
            break
        if pending == 0:
            return
        if not started:
            time.sleep(30)


@dataclass(frozen=True)
class Suite:
    """A set of arms sharing this study's data, budget, queue and statistics (one runner for every study module).

    `arms(scale)` returns the arms (rebuilt at each worker pass, so an arm may depend on a finished run); `jobs(scale)`
    the runs in priority order as (arm, lr or None for the family's rate, seed); `swept` the families with a sweep
    over `lr_grid`; `comparisons` as `COMPARISONS`; `post_train[arm](model, loaded)` a measurement merged into that
    arm's summaries; `extend(scale, results)` adds fields to the results JSON and returns extra markdown. `name` is
    the results' file stem, `script` the module (`python -m` name) run by `--workers` processes.
    """

    name: str
    title: str
    script: str
    arms: Callable[[int], dict]
    jobs: Callable[[int], list]
    swept: tuple
    comparisons: tuple
    lr_grid: tuple = LR_GRID
    post_train: dict = field(default_factory=dict)
    extend: Callable[[int, dict], str] | None = None


MOHD = Suite(
    name="study_v2",
    title="MoHD vs dense past the n-gram regime (width-128 base, 2.05M tokens, 3 seeds)",
    script="bench.replication.study",
    arms=lambda scale: ARMS,
    jobs=jobs,
    swept=SWEPT,
    comparisons=COMPARISONS,
)


# ----------------------------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------------------------


def accounting_of(arm: str, arms: dict | None = None) -> dict:
    """Total and activated decoder parameters and forward FLOPs per token (`model_accounting`, at the mean context of
    a training sequence) of an arm; LatentMoE arms add their routed-expert parameters and all-to-all scalars per token
    (summed over layers). A pending arm (no architecture yet) gets None values."""
    from transformers import LlamaConfig

    from hf_mohd.models.accounting import model_accounting
    from hf_mohd.models.configuration_latent_moe import LatentMoEConfig
    from hf_mohd.models.configuration_mohd import MoHDConfig

    architecture = (ARMS if arms is None else arms)[arm].architecture
    if architecture is None:
        return dict.fromkeys(("total_params", "activated_decoder_params", "flops_per_token"))
    fields = {k: v for k, v in architecture.items() if k != "model_type"}
    fields["vocab_size"] = runner.BUDGET["vocab_size"]
    classes = {"mohd": MoHDConfig, "latent_moe": LatentMoEConfig}
    config = classes.get(architecture["model_type"], LlamaConfig)(**fields)
    acc = model_accounting(config, context_length=(BUDGET["seq_len"] + 1) // 2)
    out = {
        "total_params": acc.total_params,
        "activated_decoder_params": acc.activated_decoder_params,
        "flops_per_token": acc.flops_per_token,
    }
    if architecture["model_type"] == "latent_moe":
        out["routed_expert_params"] = sum(layer.routed_expert_params for layer in acc.layers)
        out["mixer_params"] = sum(layer.mixer_params for layer in acc.layers)
        out["all_to_all_scalars"] = acc.all_to_all_scalars
    return out


def report(scale: int, suite: "Suite | None" = None) -> dict:
    """Results JSON (`<suite.name><suffix>.json`, default `study_v2`), plot (`.png`) and markdown tables (`.md`), from
    every finished run; `suite.extend(scale, results)` may add fields and returns extra markdown."""
    suite = MOHD if suite is None else suite
    grid = suite.lr_grid
    refs = references(scale)
    bigram = refs["verdict"]["bigram_kneser_ney"]
    sweeps = {
        family: {
            f"{lr:g}": (summary_of(scale, family, lr, 0) or {}).get("validation_loss")
            for lr in sweep_grid(scale, family, grid)
        }
        for family in suite.swept
    }
    rates = {family: chosen_lr(scale, family, grid) for family in suite.swept}
    suite_arms = suite.arms(scale)
    arms, groups, wanted = {}, {}, {}
    for name, arm in suite_arms.items():
        rate = rates[arm.family]
        wanted[name] = arm.seeds or SEEDS
        runs = [s for s in (summary_of(scale, name, rate, seed) for seed in wanted[name]) if s] if rate else []
        losses = [r["verdict_loss"] for r in runs]
        if losses:
            groups[name] = losses
        arms[name] = {
            "description": arm.description,
            "family": arm.family,
            "lr": rate,
            "seeds_done": [r["seed"] for r in runs],
            "verdict_loss_per_seed": losses,
            "verdict_loss_mean": statistics.fmean(losses) if losses else None,
            "below_bigram_by": bigram - statistics.fmean(losses) if losses else None,
            "accounting": accounting_of(name, suite_arms),
            "cpu_seconds": [r["cpu_seconds_this_process"] for r in runs],
            "load_average_1min_start_end": [r["loadavg_1min_start_end"] for r in runs],
        }
    complete = {name: values for name, values in groups.items() if len(values) == len(wanted[name])}
    out = {
        "title": suite.title,
        "scale": scale,
        # the machine writing the report; each run's summary.json records its own (runs before this field: the same
        # 2-core Intel Xeon, training only, never during a timing)
        "machine_of_report": _machine(),
        "status": "complete" if len(complete) == len(suite_arms) else "partial",
        "command": f"nice -n 10 python -m {suite.script} --workers 2" + ("" if scale == 1 else f" --scale {scale}"),
        "base_shape": BASE,
        "budget": {
            **BUDGET,
            "vocab_size": runner.BUDGET["vocab_size"],
            "tokens_per_run": BUDGET["max_steps"] * scale * BUDGET["micro_batch_size"] * BUDGET["seq_len"],
        },
        "lr_grid": list(grid),
        "lr_sweep_validation_loss": sweeps,
        "chosen_lr": rates,
        "references": refs,
        "margin": MARGIN,
        "regime_gap": REGIME_GAP,
        "arms": arms,
        "comparisons": {},
    }
    if complete and sum(len(v) - 1 for v in complete.values()) > 0:
        sd, df = verdicts.pooled_sd(complete)
        out["pooled_sd"], out["pooled_df"] = sd, df
        for name in complete:
            arms[name]["verdict_loss_ci95"] = verdicts.arm_interval(complete[name], sd, df)
        tests, pvalues = {}, {}
        for key, a, b, claim, margin in suite.comparisons:
            if a not in complete or b not in complete:
                continue
            result = verdicts.difference(a, b, complete, sd, df, margin)
            tests[key] = {"claim": claim, **result.as_dict()}
            pvalues[f"{key}:difference"] = result.p
            if margin is not None:
                pvalues[f"{key}:equivalence"] = result.tost_p
        adjusted = verdicts.holm(pvalues)
        for key, test in tests.items():
            test["holm_p"] = adjusted[f"{key}:difference"]
            test["holm_tost_p"] = adjusted.get(f"{key}:equivalence")
            in_regime = all(statistics.fmean(complete[arm]) <= bigram - REGIME_GAP for arm in (test["a"], test["b"]))
            test["verdict"] = _wording(test, in_regime)
        out["comparisons"] = tests
        out["holm_family"] = sorted(pvalues)
    extra = suite.extend(scale, out) if suite.extend is not None else ""
    path = RESULTS / f"{suite.name}{_suffix(scale)}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    plot(out, path.with_suffix(".png"))
    text = table(out) + (f"\n\n{extra}" if extra else "")
    path.with_suffix(".md").write_text(text + "\n", encoding="utf-8")
    print(text)
    print(f"wrote {path}")
    return out


def _wording(test: dict, in_regime: bool) -> str:
    """The verdict phrase the numbers allow (alpha 0.05 after Holm)."""
    if not in_regime:
        return "no verdict: an arm ends less than 0.1 nats below the bigram reference"
    if test["holm_p"] < 0.05:
        return "lower loss (significant)" if test["diff"] < 0 else "higher loss (significant)"
    if test["holm_tost_p"] is not None and test["holm_tost_p"] < 0.05:
        return f"equivalent within {test['margin']} nats"
    return "no detectable difference (neither a difference nor equivalence is shown)"


def _count(value: int | None) -> str:
    return "pending" if value is None else f"{value:,}"


def table(results: dict) -> str:
    refs = results["references"]["verdict"]
    lines = [
        f"Reference lines on the verdict set: unigram {refs['unigram_add_one']:.3f}, "
        f"bigram {refs['bigram_kneser_ney']:.3f} (verdicts need <= {refs['bigram_kneser_ney'] - REGIME_GAP:.3f}).",
        f"Chosen learning rates: {results['chosen_lr']}; pooled sd "
        f"{results.get('pooled_sd', float('nan')):.4f} ({results.get('pooled_df', 0)} df).",
        "",
        "| sweep (seed 0) | validation loss by learning rate | chosen |",
        "|---|---|---|",
    ]
    for family, sweep in results["lr_sweep_validation_loss"].items():
        cells = ", ".join(f"{lr}: {'running' if loss is None else f'{loss:.4f}'}" for lr, loss in sweep.items())
        chosen = results["chosen_lr"][family]
        lines.append(f"| {family} | {cells} | {'pending' if chosen is None else f'{chosen:g}'} |")
    lines += [
        "",
        "| arm | lr | seeds | verdict loss (mean, 95% CI) | below bigram | activated decoder params | FLOPs/token |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, arm in results["arms"].items():
        if arm["verdict_loss_mean"] is None:
            rate = "pending" if arm["lr"] is None else f"{arm['lr']:g}"
            lines.append(
                f"| {name} | {rate} | 0 | not run | | {_count(arm['accounting']['activated_decoder_params'])} | "
                f"{_count(arm['accounting']['flops_per_token'])} |"
            )
            continue
        ci = arm.get("verdict_loss_ci95")
        ci_text = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
        lines.append(
            f"| {name} | {arm['lr']:g} | {len(arm['seeds_done'])} | {arm['verdict_loss_mean']:.3f}{ci_text} | "
            f"{arm['below_bigram_by']:.3f} | {arm['accounting']['activated_decoder_params']:,} | "
            f"{arm['accounting']['flops_per_token']:,} |"
        )
    if results["comparisons"]:
        lines += [
            "",
            "| comparison | diff (a - b) | 95% CI | p (Holm) | equivalence p (Holm) | verdict |",
            "|---|---|---|---|---|---|",
        ]
        for key, test in results["comparisons"].items():
            tost = "" if test["holm_tost_p"] is None else f"{test['holm_tost_p']:.2g}"
            lines.append(
                f"| {key} | {test['diff']:+.3f} | [{test['ci95'][0]:+.3f}, {test['ci95'][1]:+.3f}] | "
                f"{test['holm_p']:.2g} | {tost} | {test['verdict']} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for family, sweep in results["lr_sweep_validation_loss"].items():
        points = [(float(lr), loss) for lr, loss in sweep.items() if loss is not None]
        if points:
            left.plot(*zip(*points, strict=True), "o-", label=family)
    left.set(xscale="log", xlabel="learning rate", ylabel="validation loss (nats/token)", title="Sweep (seed 0)")
    names = [n for n, a in results["arms"].items() if a["verdict_loss_mean"] is not None]
    for index, name in enumerate(names):
        arm = results["arms"][name]
        ci = arm.get("verdict_loss_ci95")
        error = [[arm["verdict_loss_mean"] - ci[0]], [ci[1] - arm["verdict_loss_mean"]]] if ci else None
        right.errorbar([index], [arm["verdict_loss_mean"]], yerr=error, fmt="o", capsize=4)
        right.plot([index] * len(arm["verdict_loss_per_seed"]), arm["verdict_loss_per_seed"], "x", color="grey")
    refs = results["references"]["verdict"]
    right.axhline(refs["bigram_kneser_ney"], color="red", ls="--", label="Kneser-Ney bigram")
    right.axhline(refs["bigram_kneser_ney"] - REGIME_GAP, color="red", ls=":", label="bigram - 0.1 (verdict line)")
    right.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=7)
    right.set(ylabel="verdict-set loss (nats/token)", title="Arms: mean, 95% CI (pooled), seeds (x)")
    right.text(0.01, 0.02, f"unigram reference {refs['unigram_add_one']:.2f}", transform=right.transAxes, fontsize=7)
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(f"{results['title']} [{results['status']}]", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(suite: "Suite | None" = None, description: str | None = None) -> None:
    """The command line of a suite (default: this study): train what is missing with `--workers`, then report."""
    suite = MOHD if suite is None else suite
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=1, help="worker processes sharing the queue (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    parser.add_argument("--scale", type=int, default=1, help="multiply the training tokens (default 1)")
    parser.add_argument("--report", action="store_true", help="only write the results from the finished runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scale < 1 or args.workers < 1 or args.threads < 1:
        parser.error("--scale, --workers and --threads must be positive integers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.report:
        report(args.scale, suite)
        return
    import torch

    torch.set_num_threads(args.threads)
    if args.worker or args.workers == 1:
        data(args.scale)
        references(args.scale)
        worker(args.scale, suite)
        if not args.worker:
            report(args.scale, suite)
        return
    data(args.scale)
    references(args.scale)
    command = [
        sys.executable,
        "-m",
        suite.script,
        "--worker",
        "--scale",
        str(args.scale),
        "--threads",
        str(args.threads),
    ]
    processes = [subprocess.Popen(command, cwd=runner.REPO) for _ in range(args.workers)]  # where `bench` imports
    codes = [process.wait() for process in processes]
    if any(codes):
        raise SystemExit(f"a worker failed (exit codes {codes}); rerun the same command to resume")
    report(args.scale, suite)


if __name__ == "__main__":
    main()
