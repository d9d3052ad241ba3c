#!/usr/bin/env python
"""Convert SmolLM2-135M to MoHD, heal it by distillation, and measure perplexity and lm-eval accuracy on the way.

Every stage is resumable: rerun the same command after an interruption and it continues where it stopped (finished
parts are read back from `--work-dir`, training resumes from its last checkpoint).

    python -m experiments.smollm2.heal prepare            # teacher folder, text files, the two converted students
    python -m experiments.smollm2.heal train mohd75_all   # one healing arm (see ARMS); two arms may run side by side
    python -m experiments.smollm2.heal lm-eval dense      # lm-eval of the dense model or of a student / healed arm
    python -m experiments.smollm2.heal report             # experiments/smollm2/results/smollm2_healing.json + .png

Text (all from the Wikipedia sample of the PyPI `gensim` wheel, `hf_mohd.corpora` layout "lines" as in
`evaluate_perplexity`): the first 8 articles calibrate the PCA rotation and fit the routers, the last 8 are the
held-out perplexity text (the same 4,096 tokens as `evaluate_perplexity`), and every article in between is healing
text, so the three are disjoint. lm-eval's documents come from the offline tasks of `hf_mohd/evaluation/tasks/`, not
from Wikipedia.

Students: `hf-mohd convert mohd TEACHER --preset compression_75|compression_50 --rotate pca --routers fitted
--activation-scaling none --routed-gate normalized`, the best arm of `experiments/smollm2/results/
smollm2_perplexity_rotation.json`. Healing: `hf-mohd train`'s trainer with a `distill` section (KL to the dense teacher
at T=1, no LM loss), AdamW with warmup and cosine decay over the arm's whole budget, sequences of 256 tokens, 4 per
step (1,024 tokens). A curve's intermediate points are checkpoints of one run (whose schedule spans the whole budget);
the 64k comparison of trainable choices uses separate runs whose schedules end at 64k.
"""

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

from experiments.smollm2 import MODEL_CARDS_DIR, RESULTS_DIR
from experiments.smollm2 import evaluate_perplexity as ep
from hf_mohd.atomic_folder import write_folder_atomically, write_json_atomically, write_text_atomically
from hf_mohd.evaluation.perplexity import perplexity


logger = logging.getLogger("experiments.smollm2.heal")
TOKENS_PER_STEP = 4 * 256
K = 1024
# name -> (preset, trainable, peak lr, healing tokens, evaluation points in tokens)
ARMS = {
    "mohd75_all": ("compression_75", "all", 2e-4, 512 * K, (64 * K, 256 * K, 512 * K)),
    "mohd50_all": ("compression_50", "all", 2e-4, 256 * K, (64 * K, 256 * K)),
    "mohd75_all_64k": ("compression_75", "all", 2e-4, 64 * K, (64 * K,)),
    "mohd75_lora_64k": ("compression_75", "lora", 1e-3, 64 * K, (64 * K,)),
}
STUDENTS = {"compression_75": "mohd75", "compression_50": "mohd50"}
LM_EVAL_TASKS = ["arc_easy", "piqa", "hellaswag", "lambada"]


def read_json(path: Path, default):
    return json.loads(path.read_text()) if path.exists() else default


def cpu_seconds() -> float:
    return time.process_time()


def run_healing(values: dict) -> dict:
    """Run the trainer on the config dict `values` (resuming from its newest checkpoint) and return the fields every
    healing runner records with an arm: its settings (without `output_dir`), this process's training CPU and wall
    seconds, whether it resumed (a resumed process trained only the steps after its checkpoint, so its seconds are a
    part of the arm's), and the last training log line."""
    from hf_mohd.training import latest_checkpoint, train, train_config_from_dict

    out = Path(values["output_dir"])
    resumed = out.exists() and latest_checkpoint(str(out)) is not None
    started, wall = cpu_seconds(), time.time()
    result = train(train_config_from_dict(values))
    return {
        "settings": {k: v for k, v in values.items() if k != "output_dir"},
        "train_cpu_seconds_this_process": round(cpu_seconds() - started, 1),
        "train_wall_seconds_this_process": round(time.time() - wall, 1),
        "resumed": resumed,
        "last_train_log": result.train_log[-1] if result.train_log else None,
    }


def split_articles():
    """(calibration, healing, held-out) lists of (title, text): first 8, the middle, last 8 articles."""
    titles, texts = ep.wikipedia_articles(10**6, first=True)
    articles = list(zip(titles, texts, strict=True))
    calibration, healing, held_out = articles[:8], articles[8:-8], articles[-8:]
    assert {t for t, _ in held_out} == set(ep.wikipedia_articles(8)[0]), "held-out text differs from the evaluation's"
    assert not ({t for t, _ in calibration} | {t for t, _ in held_out}) & {t for t, _ in healing}
    return calibration, healing, held_out


def held_out_windows(tokenizer) -> torch.Tensor:
    _, _, held_out = split_articles()
    return ep.token_windows(tokenizer, [x for _, x in held_out], 256, 4096)


def prepare(work: Path) -> None:
    """Teacher folder (the dense LLaMA, fp32 safetensors + tokenizer), text files, and the converted students."""
    from hf_mohd.cli import main as cli
    from hf_mohd.conversion import load_dense_llama

    work.mkdir(parents=True, exist_ok=True)
    info = read_json(work / "prepare.json", {})
    teacher = work / "teacher"
    if not (teacher / "config.json").exists():
        started = cpu_seconds()
        source = load_dense_llama(ep.default_source(), dtype=torch.float32)
        llama = source.build_llama()  # `load_dense_llama` drops the GGUF loader's quantization_config
        with write_folder_atomically(teacher) as staging:
            llama.save_pretrained(staging)
            source.tokenizer.save_pretrained(staging)
        info["teacher"] = {"source": source.description, "cpu_seconds": round(cpu_seconds() - started, 1)}
    calibration, healing, held_out = split_articles()
    write_text_atomically(work / "calibration.txt", "\n\n".join(x for _, x in calibration))
    write_text_atomically(work / "healing.jsonl", "".join(json.dumps({"text": text}) + "\n" for _, text in healing))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mohd  # noqa: F401

    tokenizer = AutoTokenizer.from_pretrained(teacher)
    info["text"] = {
        "calibration_articles": [t for t, _ in calibration],
        "held_out_articles": [t for t, _ in held_out],
        "healing_articles": len(healing),
        "healing_tokens": sum(len(tokenizer(x, add_special_tokens=False)["input_ids"]) for _, x in healing),
    }
    for preset, name in STUDENTS.items():
        if (work / name / "config.json").exists():
            continue
        started = cpu_seconds()
        code = cli(
            ["convert", "mohd", str(teacher), str(work / name), "--preset", preset, "--rotate", "pca"]
            + ["--routers", "fitted", "--calibration-text", str(work / "calibration.txt")]
            + ["--activation-scaling", "none", "--routed-gate", "normalized", "--overwrite", "--quiet"]
        )
        if code:
            sys.exit(f"hf-mohd convert mohd failed for {preset} (exit code {code})")
        info[name] = {"cpu_seconds": round(cpu_seconds() - started, 1)}
    windows = held_out_windows(tokenizer)
    info["held_out_tokens"] = int(windows.numel())
    for name in ("teacher", *STUDENTS.values()):
        if name not in info.get("perplexity", {}):
            model = AutoModelForCausalLM.from_pretrained(str(work / name), dtype=torch.float32).eval()
            info.setdefault("perplexity", {})[name] = perplexity(model, windows, 4, desc=name)
            logger.info("%s: held-out perplexity %.3f", name, info["perplexity"][name])
            del model
    info["machine"] = ep.machine()
    write_json_atomically(work / "prepare.json", info)
    logger.info("prepared %s: %s", work, info["text"])


def load_student(work: Path, arm: str, checkpoint: Path | None = None):
    """The arm's student with the weights of `checkpoint` (an Accelerate state folder) or of its `final/` folder."""
    from transformers import AutoModelForCausalLM

    import hf_mohd  # noqa: F401

    if arm in STUDENTS.values():  # an unhealed conversion
        return AutoModelForCausalLM.from_pretrained(str(work / arm), dtype=torch.float32).eval()
    preset, trainable = ARMS[arm][:2]
    base = AutoModelForCausalLM.from_pretrained(str(work / STUDENTS[preset]), dtype=torch.float32)
    final = work / "runs" / arm / "final"
    if trainable == "lora":
        from peft import PeftModel

        assert checkpoint is None, "LoRA arms are evaluated from final/"
        return PeftModel.from_pretrained(base, final).merge_and_unload().eval()
    if checkpoint is None:
        return AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    from safetensors.torch import load_file

    state = load_file(checkpoint / "model.safetensors")
    missing, unexpected = base.load_state_dict(state, strict=False)
    tied = set(getattr(base, "all_tied_weights_keys", {}) or {})
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    return base.eval()


def train_arm(work: Path, arm: str) -> None:
    """Heal one arm to its budget, stopping at each evaluation point to measure held-out perplexity."""
    from transformers import AutoTokenizer

    from hf_mohd.training import train, train_config_from_dict
    from hf_mohd.training.trainer import latest_checkpoint

    preset, trainable, lr, budget, points = ARMS[arm]
    out = work / "runs" / arm
    results_path = work / f"curve_{arm}.json"
    curve = read_json(results_path, {"arm": arm, "points": {}})
    tokenizer = AutoTokenizer.from_pretrained(work / "teacher")
    windows = held_out_windows(tokenizer)
    max_steps = budget // TOKENS_PER_STEP
    values = {
        "output_dir": str(out),
        "model": {
            "init_from": str(work / STUDENTS[preset]),
            "trainable": trainable,
            "lora_rank": 16,
            "lora_alpha": 32,
        },
        "data": {"path": str(work / "healing.jsonl"), "eval_fraction": 0.0, "seq_len": 256},
        "optim": {"lr": lr, "warmup_steps": 16, "weight_decay": 0.0, "min_lr_ratio": 0.1},
        "distill": {"teacher": str(work / "teacher"), "kl_weight": 1.0, "temperature": 1.0, "lm_weight": 0.0},
        "max_steps": max_steps,
        "micro_batch_size": 4,
        "mixed_precision": "no",
        "router_aux_loss": False,
        "log_every": 8,
        "save_every": 32,
        "keep_checkpoints": 1,
        "progress_bar": False,
    }
    curve["settings"] = {k: v for k, v in values.items() if k != "output_dir"}
    for number, point in enumerate(points):
        step = point // TOKENS_PER_STEP
        previous_step = points[number - 1] // TOKENS_PER_STEP if number else 0
        if str(point) in curve["points"]:
            continue
        started, wall = cpu_seconds(), time.time()
        latest = latest_checkpoint(str(out)) if out.exists() else None
        done = int(latest.rsplit("_", 1)[1]) if latest else 0
        last_log = None
        # the CPU time of this process covers the segment only when it trained the whole segment
        whole_segment = done <= previous_step
        if done < step:
            result = train(train_config_from_dict({**values, "stop_after_steps": step - done}))
            assert result.steps == step, (result.steps, step)
            last_log = result.train_log[-1] if result.train_log else None
        train_cpu = cpu_seconds() - started
        checkpoint = None if step == max_steps else Path(latest_checkpoint(str(out)))
        model = load_student(work, arm, checkpoint)
        ppl = perplexity(model, windows, 4, desc=f"{arm} {point}")
        curve["points"][str(point)] = {
            "step": step,
            "perplexity": ppl,
            # CPU seconds of this process (1 torch thread) since the previous point; from the logged throughput
            # when the segment was trained by an earlier, interrupted process
            "train_cpu_seconds": (
                round(train_cpu, 1) if last_log and whole_segment else logged_seconds(out, step - previous_step, step)
            ),
            "train_cpu_seconds_source": (
                "process_time" if last_log and whole_segment else "log.jsonl tokens_per_s (resumed)"
            ),
            "train_wall_seconds": round(time.time() - wall, 1),
            "last_train_log": last_log,
            "machine": ep.machine(),
        }
        write_json_atomically(results_path, curve)
        logger.info("%s after %d tokens: held-out perplexity %.3f", arm, point, ppl)
        del model


BREAKDOWN = {
    "as healed": {},
    "every sub-dimension active (k = N_r)": "all",
    "attention sparse, FFN dense": {"sparse_modules": ["attention"]},
    "FFN sparse, attention dense": {"sparse_modules": ["ffn"]},
}


def breakdown(work: Path, arm: str) -> None:
    """Where the healed model's remaining loss comes from: the weights of its newest checkpoint (or final/) evaluated
    with every sub-dimension active (the weights alone, no sparsity), and with only one sublayer kind sparse (the
    other computed densely by the same weights: a plain LLaMA sublayer, its router and group fusion left out), on the
    held-out text."""
    from transformers import AutoTokenizer

    from hf_mohd.training.trainer import latest_checkpoint

    out = work / "runs" / arm
    final = out / "final"
    latest = latest_checkpoint(str(out))
    source = final if (final / "config.json").exists() else Path(latest)
    healed = load_student(work, arm, None if source == final else source)
    state = healed.state_dict()
    windows = held_out_windows(AutoTokenizer.from_pretrained(work / "teacher"))
    path = work / f"breakdown_{arm}.json"
    result = {"arm": arm, "weights": str(source), "perplexity": {}, "machine": None}
    for label, overrides in BREAKDOWN.items():
        config = healed.config
        if overrides == "all":
            overrides = {"num_routed_sub_dims_per_tok": config.num_routed_sub_dims}
        model = type(healed)(type(config).from_dict({**config.to_dict(), **overrides})) if overrides else healed
        if overrides:
            missing, unexpected = model.load_state_dict(state, strict=False)
            assert not missing and all(".sub_dims." in key for key in unexpected), (missing, unexpected)
        result["perplexity"][label] = perplexity(model.eval(), windows, 4, desc=label)
        logger.info("%s %s: %.3f", arm, label, result["perplexity"][label])
    result["machine"] = ep.machine()
    write_json_atomically(path, result)


def logged_seconds(out: Path, steps: int, last_step: int) -> float:
    """Training seconds of the `steps` optimizer steps ending at `last_step`, from the throughput in log.jsonl."""
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "tokens_per_s" in r and last_step - steps < r["step"] <= last_step]
    seconds, previous = 0.0, last_step - steps
    for record in sorted(records, key=lambda r: r["step"]):
        seconds += (record["step"] - previous) * TOKENS_PER_STEP / record["tokens_per_s"]
        previous = record["step"]
    return round(seconds, 1)


def lm_eval_arm(work: Path, arm: str, limit: int, checkpoint: bool = False) -> None:
    """lm-eval of a healing arm (`run_lm_eval`), written to `work`/lm_eval_LABEL_LIMIT.json. With `checkpoint`, the
    arm's newest training checkpoint is evaluated instead of its `final/` folder (a run still under way), and its
    held-out perplexity is recorded with it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_mohd.training.trainer import latest_checkpoint

    label, weights = arm, None
    if checkpoint:
        weights = Path(latest_checkpoint(str(work / "runs" / arm)))
        step = int(weights.name.rsplit("_", 1)[1])
        label = f"{arm} at {step * TOKENS_PER_STEP} tokens"
    tokenizer = AutoTokenizer.from_pretrained(work / "teacher")

    def load():
        if arm == "dense":
            return AutoModelForCausalLM.from_pretrained(str(work / "teacher"), dtype=torch.float32).eval()
        return load_student(work, arm, weights)

    extra = {}
    if checkpoint:
        extra["held_out_perplexity"] = lambda model: perplexity(model, held_out_windows(tokenizer), 4, desc=label)
    run_lm_eval(work / f"lm_eval_{label.replace(' ', '_')}_{limit}.json", label, limit, load, tokenizer, extra)


def run_lm_eval(path: Path, label: str, limit: int, load, tokenizer, extra=None) -> None:
    """lm-eval (offline ARC-Easy, PIQA, HellaSwag, LAMBADA; the first `limit` documents of each) of the model that
    `load()` returns, with per-document scores, one task at a time into `path`: each finished task is written at
    once, so an interrupted run keeps what it did and a rerun does only what is missing. `extra` maps a field to a
    function of the model whose value is recorded once with the results."""
    from hf_mohd.evaluation.harness import evaluate

    done = read_json(path, {"arm": label, "limit": limit, "results": {}, "per_doc": {}, "cpu_seconds": {}})
    todo = [task for task in LM_EVAL_TASKS if f"offline_{task}" not in done["results"]]
    if not todo:
        return
    model = load()
    for field, measure in (extra or {}).items():
        if field not in done:
            done[field] = measure(model)
    for task in todo:
        started = cpu_seconds()
        results = evaluate(model, tokenizer, tasks=[task], limit=limit, batch_size=8, log_samples=True)
        for name, samples in results["samples"].items():
            metric = "acc_norm" if "acc_norm" in samples[0] else "acc"
            scores = [float(s[metric]) for s in sorted(samples, key=lambda s: s["doc_id"])]
            done["per_doc"][name] = {"metric": metric, "scores": scores}
        for name, values in results["results"].items():
            done["results"][name] = {k: v for k, v in values.items() if isinstance(v, int | float)}
        done["cpu_seconds"][task] = round(cpu_seconds() - started, 1)
        done["machine"] = ep.machine()
        write_json_atomically(path, done)
        logger.info("%s %s: %s", label, task, done["results"][f"offline_{task}"])


def lm_eval_rows(paths: list[Path], reference: dict | None) -> dict:
    """ "LABEL (LIMIT docs)" -> accuracy per task (points), mean, and, against `reference` (the dense model's
    `run_lm_eval` file, the same documents), the paired difference and its standard error; runs under 100
    documents (smoke runs) are left out."""
    rows = {}
    for path in sorted(paths):
        found = read_json(path, None)
        if found["limit"] < 100:
            continue  # smoke runs
        row = {"documents": found["limit"], "cpu_seconds_per_task": found["cpu_seconds"], "tasks": {}}
        if "held_out_perplexity" in found:  # a checkpoint of a run still under way
            row["held_out_perplexity"] = found["held_out_perplexity"]
        for task, doc in found["per_doc"].items():
            scores = doc["scores"]
            entry = {"metric": doc["metric"], "accuracy_points": 100 * sum(scores) / len(scores)}
            if reference is not None and found["arm"] != "dense" and task in reference["per_doc"]:
                diff, stderr = paired(scores, reference["per_doc"][task]["scores"])
                entry.update(minus_dense_points=diff, paired_stderr_points=stderr)
            row["tasks"][task] = entry
        row["mean_accuracy_points"] = sum(e["accuracy_points"] for e in row["tasks"].values()) / len(row["tasks"])
        rows[f"{found['arm']} ({found['limit']} docs)"] = row
    return rows


def lm_eval_table(work: Path, names: list[str], limit: int, earlier: dict) -> dict:
    """`lm_eval_rows` of the `run_lm_eval` files `work`/lm_eval_NAME_LIMIT.json that exist, against the dense
    model's (`work`/lm_eval_dense_LIMIT.json), with the rows of `earlier` (a report's "lm_eval", measured in an
    earlier work folder) that `work` does not hold kept as recorded."""
    paths = [work / f"lm_eval_{name}_{limit}.json" for name in names]
    rows = lm_eval_rows(
        [path for path in paths if path.exists()], read_json(work / f"lm_eval_dense_{limit}.json", None)
    )
    return {**{row: found for row, found in earlier.items() if row not in rows}, **rows}


def healing_datasets() -> list[str]:
    """The model-card `datasets` entries of the multi-source healing text (`experiments.smollm2.healing_corpus`'s
    committed record): each healing source with its licence."""
    corpus = json.loads((RESULTS_DIR / "healing_corpus.json").read_text(encoding="utf-8"))
    return [
        f"{source['description']}; licence: {source['licence'].split(' (')[0]}"
        for source in corpus["sources"].values()
        if source["role"] == "healing"
    ]


def perplexity_table(dense: dict, rows: list[tuple[str, dict, dict]]) -> str:
    """A Markdown table of held-out perplexity per source: one row per (name, {source: perplexity}, {source: ratio
    to dense}), the sources as `dense`'s keys."""
    table = "| | " + " | ".join(dense) + " |\n|---|" + "---|" * len(dense) + "\n"
    return table + "\n".join(
        f"| {name} | " + " | ".join(f"{ppl[s]:.1f} ({ratio[s]:.2f}x)" for s in dense) + " |"
        for name, ppl, ratio in rows
    )


def lm_eval_sentence(row: dict | None, limit: int) -> str:
    """One paragraph of an `lm_eval_rows` row: accuracy per task with its paired difference to dense ("" for
    None)."""
    if row is None:
        return ""
    return (
        f"\n\nlm-eval, the first {limit} documents of each task (acc_norm where the task has it), difference to the "
        "dense model on the same documents with its paired standard error: "
        + "; ".join(
            f"{task.removeprefix('offline_')} {e['accuracy_points']:.1f} ({e['minus_dense_points']:+.1f} "
            f"± {e['paired_stderr_points']:.1f})"
            for task, e in row["tasks"].items()
        )
        + f"; mean {row['mean_accuracy_points']:.1f} points."
    )


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean difference a - b in percentage points and its paired standard error."""
    n = min(len(a), len(b))
    diffs = [100 * (x - y) for x, y in zip(a[:n], b[:n], strict=True)]
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return mean, math.sqrt(var / n)


def report(work: Path, output: Path, cards_dir: Path | None = None) -> dict:
    """Gather every finished part into one JSON (and a plot next to it); unfinished parts are listed as missing.
    `cards_dir`: where the rendered model card goes (None: beside `output`; the command's default is model_cards/)."""
    prepared = read_json(work / "prepare.json", None)
    if prepared is None:
        sys.exit(f"{work}/prepare.json is missing: run the prepare stage first.")
    dense = prepared["perplexity"]["teacher"]
    curves, missing = {}, []
    for arm, (preset, trainable, lr, budget, points) in ARMS.items():
        curve = read_json(work / f"curve_{arm}.json", {"points": {}})
        unhealed = prepared["perplexity"][STUDENTS[preset]]
        rows = [{"tokens": 0, "perplexity": unhealed, "ratio_to_dense": unhealed / dense, "train_cpu_seconds": 0.0}]
        for number, point in enumerate(points):
            if str(point) not in curve["points"]:
                missing.append(f"{arm} at {point} tokens")
                continue
            done = curve["points"][str(point)]
            seconds = done["train_cpu_seconds"]
            if done.get("train_cpu_seconds_source", "process_time") != "process_time":
                previous = points[number - 1] // TOKENS_PER_STEP if number else 0
                seconds = logged_seconds(work / "runs" / arm, done["step"] - previous, done["step"])
            rows.append(
                {
                    "tokens": point,
                    "perplexity": done["perplexity"],
                    "ratio_to_dense": done["perplexity"] / dense,
                    "train_cpu_seconds": seconds,
                    "train_cpu_seconds_source": done.get("train_cpu_seconds_source", "process_time"),
                    "load_average_after": done["machine"]["load_average"],
                }
            )
        curves[arm] = {
            "preset": preset,
            "trainable": trainable,
            "peak_lr": lr,
            "budget_tokens": budget,
            "schedule": f"warmup 16 steps, cosine to 0.1 x peak at {budget} tokens",
            "points": rows,
        }
    lm_eval = lm_eval_rows(list(work.glob("lm_eval_*_*.json")), read_json(work / "lm_eval_dense_500.json", None))
    for arm, limit in (("dense", 500), ("mohd75", 200), ("mohd50", 200), ("mohd75_all", 500), ("mohd50_all", 500)):
        found = read_json(work / f"lm_eval_{arm}_{limit}.json", {"results": {}})
        for task in LM_EVAL_TASKS:
            if f"offline_{task}" not in found["results"]:
                missing.append(f"lm-eval {arm} {task} ({limit} docs)")
    breakdowns = {p.stem.removeprefix("breakdown_"): read_json(p, None) for p in sorted(work.glob("breakdown_*.json"))}
    result = {
        "command": "python -m experiments.smollm2.heal prepare|train ARM|lm-eval ARM|breakdown ARM|report",
        "complete": not missing,
        "missing": missing,
        "teacher": prepared["teacher"]["source"],
        "text": prepared["text"],
        "held_out_tokens": prepared["held_out_tokens"],
        "conversion": {
            "flags": "--rotate pca --routers fitted --activation-scaling none --routed-gate normalized",
            "cpu_seconds": {name: prepared[name]["cpu_seconds"] for name in STUDENTS.values()},
        },
        "distillation": "KL(teacher || student) at T=1, kl_weight 1, lm_weight 0; AdamW, weight decay 0, 4 x 256 tokens",
        "dense_perplexity": dense,
        "healing": curves,
        "lm_eval": lm_eval,
        "breakdown": breakdowns,
        "machine": ep.machine(),
        "torch_threads_per_run": 1,
    }
    write_json_atomically(output, result)
    plot(result, output.with_suffix(".png"))
    card_path = (cards_dir or output.parent) / "smollm2_mohd75_healed_model_card.md"
    model_card(work, result, "mohd75_all").save(card_path)
    return result


def model_card(work: Path, result: dict, arm: str):
    """The model card of a healed arm: every conversion and healing choice, the perplexity curve, lm-eval."""
    curve = result["healing"][arm]
    found = read_json(work / f"lm_eval_{arm}_500.json", None)
    rows = "\n".join(
        f"| {p['tokens']:,} | {p['perplexity']:.2f} | {p['ratio_to_dense']:.2f}x | {p['train_cpu_seconds']:,.0f} |"
        for p in curve["points"]
    )
    notes = (
        f"Converted from SmolLM2-135M-Instruct ({result['teacher']}) with `hf-mohd convert mohd --preset "
        f"{curve['preset']} {result['conversion']['flags']}`, calibration text: the first 8 articles of the gensim "
        f"Wikipedia sample ({', '.join(result['text']['calibration_articles'])}). Healed by distillation "
        f"({result['distillation']}; trainable: {curve['trainable']}; peak lr {curve['peak_lr']}, "
        f"{curve['schedule']}) on the {result['text']['healing_articles']} articles between them and the held-out "
        f"ones ({result['text']['healing_tokens']:,} tokens; the budget repeats them about "
        f"{curve['budget_tokens'] / result['text']['healing_tokens']:.2f} times).\n\n"
        f"Held-out perplexity ({result['held_out_tokens']:,} tokens of the last 8 articles; dense model: "
        f"{result['dense_perplexity']:.2f}), 1 torch thread per run on an {result['machine']['cpu']}:\n\n"
        "| healing tokens | perplexity | vs dense | training seconds (1 thread) |\n|---|---|---|---|\n"
        + rows
        + ("" if result["complete"] else "\n\nPartial: " + "; ".join(result["missing"]) + ".")
    )
    training = {
        "teacher": "SmolLM2-135M-Instruct (dense, fp32)",
        "objective": result["distillation"],
        "trainable": curve["trainable"],
        "peak_learning_rate": curve["peak_lr"],
        "schedule": curve["schedule"],
        "tokens": curve["budget_tokens"],
        "hardware": f"{result['machine']['cpu']}, 1 torch thread",
    }
    return healed_card(
        work / STUDENTS[curve["preset"]],
        None,
        found,
        training,
        notes,
        ["English Wikipedia sample of the gensim wheel (CC BY-SA), distinct articles for each use"],
    )


def healed_card(
    folder: Path, title: str | None, lm_eval_file: dict | None, training: dict, notes: str, datasets: list[str]
):
    """The `hf_mohd.model_card.render_model_card` card of a model healed from SmolLM2-135M-Instruct: the config saved
    in `folder`, titled `title` (None: the folder's own name), with `lm_eval_file`'s results (a `run_lm_eval` file;
    None or empty: no eval results), the `training` record, `notes` and the healing `datasets`."""
    from transformers import AutoConfig

    import hf_mohd  # noqa: F401
    from hf_mohd.model_card import render_model_card

    config = AutoConfig.from_pretrained(folder)
    if title is not None:
        config.name_or_path = title  # the card's title, not the run folder's name
    return render_model_card(
        config,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        datasets=datasets,
        eval_results={"results": lm_eval_file["results"]} if lm_eval_file and lm_eval_file["results"] else None,
        training=training,
        notes=notes,
        language="en",
    )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for arm, curve in result["healing"].items():
        points = curve["points"]
        if len(points) < 2:
            continue
        axis.plot([p["tokens"] / K for p in points], [p["perplexity"] for p in points], marker="o", label=arm)
    axis.axhline(result["dense_perplexity"], color="black", linestyle="--", label="dense SmolLM2-135M")
    axis.axhline(1.25 * result["dense_perplexity"], color="grey", linestyle=":", label="1.25 x dense")
    axis.set_yscale("log")
    axis.set_xlabel("healing tokens (thousands)")
    axis.set_ylabel(f"held-out perplexity ({result['held_out_tokens']} tokens)")
    axis.set_title("SmolLM2-135M -> MoHD, healed by distillation" + ("" if result["complete"] else " (partial)"))
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("prepare", "train", "lm-eval", "breakdown", "report"))
    parser.add_argument("arm", nargs="?", help="train: an arm of ARMS; lm-eval: dense, mohd75, mohd50 or an arm.")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/heal_smollm2"))
    parser.add_argument("--limit", type=int, default=500, help="lm-eval documents per task (default 500).")
    parser.add_argument("--checkpoint", action="store_true", help="lm-eval: the arm's newest checkpoint, not final/.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1).")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "smollm2_healing.json")
    parser.add_argument(
        "--cards-dir",
        type=Path,
        default=MODEL_CARDS_DIR,
        help="report: folder of the rendered model card (default: model_cards/).",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    if args.stage == "prepare":
        prepare(args.work_dir)
    elif args.stage == "train":
        train_arm(args.work_dir, args.arm)
    elif args.stage == "lm-eval":
        lm_eval_arm(args.work_dir, args.arm, args.limit, args.checkpoint)
    elif args.stage == "breakdown":
        breakdown(args.work_dir, args.arm)
    else:
        report(args.work_dir, args.output, args.cards_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
