#!/usr/bin/env python
"""Healing that keeps the dense function, on SmolLM2-135M: the levers one at a time at a fixed budget, then the best
recipe's curve.

Builds on `experiments.smollm2.heal` (its teacher, text split, held-out windows and 75% / 50% conversions) and adds:

- students converted with `--routed-gate unit` (the router only selects, so every block active is the dense source
  exactly), and copies of each student with dropped-block compensation fitted on the calibration text
  (`hf_mohd.conversion.mohd.compensation`), whose training-free gain `prepare` records;
- a ladder of healing arms at 75%, each adding one lever to the previous one (see `ARMS`): unit gates, nested
  healing at the target k and at full activation (`distill.active_sub_dims`), a gradual schedule, compensation,
  uneven budgets, intermediate (residual-stream) distillation;
- uneven budgets (`budgets`): each unit-gate student with every layer and sublayer kind at its own k, allocated by
  `hf_mohd.conversion.mohd.budgets` on the calibration text under the per-token parameter budget of its uniform k (from
  each sublayer's residual-stream error, and again from the model's output KL), and the held-out perplexity of the
  result, training-free; and (`sides`) the same students with only one side of each
  sublayer sparse (`sparse_sides` "input": it reads only the active blocks; "output": it writes only them);
- the curve (`CURVE`): the best 256k arm's recipe (lowest geometric mean of its held-out perplexity over the five
  sources at the target k) at 1M and 2M tokens at 75%, and at 256k and 1M tokens on the 50% student of the same kind;
- the unit-gate students, with and without compensation, under oracle routing (`oracle`: per token the top-k blocks
  by the dense rotated model's input energy), the upper bound of what a router can give them training-free;
- for every healed arm, the held-out perplexity at the target k and of the same weights with every block active;
  and for a healed arm named to `breakdown`, with every block active in one part of the network only (one sublayer
  kind, or a third of the layers): where the loss that healing leaves sits.

The 64k arms heal on heal's Wikipedia text and are measured on its 4,096 held-out Wikipedia tokens. The 256k arms
and the curve heal on the multi-source text of `experiments.smollm2.healing_corpus` (`--corpus-dir`: Wikipedia
without its first and last 8 articles, An Anarchist FAQ, the Python documentation, Brown) and are measured on its
five held-out sources (4,096 tokens each; the KJV bible never seen), as are the dense teacher and the training-free
students (`sources`, the curve's 0-token points).

Every stage resumes (finished parts are read back from `--work-dir`, training resumes from its last checkpoint).
The report keeps what `--output` already records and the work folder lacks (measured in an earlier work folder,
possibly on another machine), and the curve's recipe counts those recorded arms too. A curve point healed with a
recipe that is no longer the best heals anew when trained again: its files move to `--work-dir`/off_recipe/RECIPE/
(`retire`), and the report keeps its superseded rows under "off_recipe":

    python -m experiments.smollm2.ladder ladder                   # the whole 256k ladder: every stage below, in order
    python -m experiments.smollm2.ladder curve                    # the whole curve (after the 256k ladder)
    python -m experiments.smollm2.ladder prepare                  # heal's prepare, then the unit and compensated students
    python -m experiments.smollm2.ladder budgets                  # the budgeted students (after prepare; an
                                                                  # allocation the report records is reused)
    python -m experiments.smollm2.ladder sides                    # one sparse side, training-free
    python -m experiments.smollm2.ladder oracle                   # unit-gate students with oracle routing
    python -m experiments.smollm2.ladder sources                  # dense and students on the five held-out sources
    python -m experiments.smollm2.ladder train unit_nested_256k   # one arm of ARMS or CURVE; two may run side by side
    python -m experiments.smollm2.ladder train curve50_256k --recipe unit_nested_budgets_256k  # beside the last arm
    python -m experiments.smollm2.ladder lm-eval curve75_1m       # also dense or any arm; 500 documents per task
    python -m experiments.smollm2.ladder breakdown curve50_256k   # a healed arm with one part at full activation
    python -m experiments.smollm2.ladder report                   # experiments/smollm2/results/smollm2_healing_ladder.json

The recipe of every arm is heal's 64k arm (`mohd75_all_64k`: AdamW at 2e-4, warmup 16 steps, cosine to 0.1 x at the
budget, 4 x 256 tokens per step, KL to the teacher at T = 1, all weights train) with only the arm's lever changed.
"""

import argparse
import copy
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from experiments.smollm2 import MODEL_CARDS_DIR, RESULTS_DIR, heal
from experiments.smollm2 import evaluate_perplexity as ep
from experiments.smollm2.held_out_sources import source_windows
from hf_mohd.atomic_folder import write_folder_atomically, write_json_atomically
from hf_mohd.conversion.mohd.budgets import BUDGET_ERRORS
from hf_mohd.evaluation.perplexity import perplexity


logger = logging.getLogger("experiments.smollm2.ladder")
# 1,024 tokens (a token budget of "64k" is 64 * KI_TOKENS); K means experts or blocks per token elsewhere
KI_TOKENS = 1024
# student -> (preset, routed gate, dropped-block compensation); "mohd75" / "mohd50" are heal's (normalized gates)
STUDENTS = {
    "mohd75u": ("compression_75", "unit", False),
    "mohd50u": ("compression_50", "unit", False),
    "mohd75c": ("compression_75", "normalized", True),
    "mohd50c": ("compression_50", "normalized", True),
    "mohd75uc": ("compression_75", "unit", True),
    "mohd50uc": ("compression_50", "unit", True),
}
# budgeted student -> (the unit-gate student it is allocated from, the allocation's error measure) (`budgets`):
# "residual", each sublayer's local residual-stream error; "output", the model's output KL with only that sublayer
# lowered (`hf_mohd.conversion.mohd.budgets`, `BUDGET_ERRORS`)
BUDGETED = {
    "mohd75ub": ("mohd75u", "residual"),
    "mohd50ub": ("mohd50u", "residual"),
    "mohd75ubo": ("mohd75u", "output"),
    "mohd50ubo": ("mohd50u", "output"),
}
BUDGET_CALIBRATION_ROWS = 16  # 16 x 256 = 4,096 tokens of heal's calibration text


class Arm(NamedTuple):
    """One healing arm: the student it starts from, its levers and budget, and its text (`corpus`: the multi-source
    healing text and the five held-out sources; otherwise heal's Wikipedia healing text and held-out tokens)."""

    student: str
    nested: bool  # nested healing: the loss at the target k plus the loss at full activation
    schedule: float  # share of the budget over which k goes from full activation to the target (cubic); 0: none
    budget: int  # tokens
    hidden: float  # weight of the per-layer residual-stream distillation; 0: logits only
    corpus: bool = False


ARMS = {
    "unit_64k": Arm("mohd75u", False, 0.0, 64 * KI_TOKENS, 0.0),
    "unit_nested_64k": Arm("mohd75u", True, 0.0, 64 * KI_TOKENS, 0.0),
    "unit_nested_schedule_64k": Arm("mohd75u", True, 0.25, 64 * KI_TOKENS, 0.0),
    "unit_nested_compensated_64k": Arm("mohd75uc", True, 0.0, 64 * KI_TOKENS, 0.0),
    "unit_nested_budgets_64k": Arm("mohd75ub", True, 0.0, 64 * KI_TOKENS, 0.0),
    "unit_nested_hidden_64k": Arm("mohd75u", True, 0.0, 64 * KI_TOKENS, 1.0),
    # the same ladder at 256k tokens on the multi-source text, from the best 64k student (per-layer budgets) on: each
    # arm adds one lever
    "unit_256k": Arm("mohd75u", False, 0.0, 256 * KI_TOKENS, 0.0, corpus=True),
    "unit_nested_256k": Arm("mohd75u", True, 0.0, 256 * KI_TOKENS, 0.0, corpus=True),
    "unit_nested_budgets_256k": Arm("mohd75ub", True, 0.0, 256 * KI_TOKENS, 0.0, corpus=True),
    "unit_nested_budgets_schedule_256k": Arm("mohd75ub", True, 0.25, 256 * KI_TOKENS, 0.0, corpus=True),
    "unit_nested_budgets_hidden_256k": Arm("mohd75ub", True, 0.0, 256 * KI_TOKENS, 1.0, corpus=True),
    # the best arm so far with its budgets allocated on the output KL instead of the residual-stream error
    "unit_nested_output_budgets_hidden_256k": Arm("mohd75ubo", True, 0.0, 256 * KI_TOKENS, 1.0, corpus=True),
}
LADDER_256K = [name for name, arm in ARMS.items() if arm.corpus]
# curve point -> (activation, budget tokens): the best 256k recipe, on the student of the same kind at that
# activation; the 75% curve's 256k point is the best ladder arm itself
CURVE = {
    "curve75_1m": ("75", 1024 * KI_TOKENS),
    "curve75_2m": ("75", 2048 * KI_TOKENS),
    "curve50_256k": ("50", 256 * KI_TOKENS),
    "curve50_1m": ("50", 1024 * KI_TOKENS),
}
# the training-free students measured on the five sources (the curve's 0-token points are those of its recipe)
SOURCE_STUDENTS = ("mohd75u", "mohd75ub", "mohd75ubo", "mohd50u", "mohd50ub", "mohd50ubo")
LM_EVAL_LIMIT = 500  # documents per task, the same for every model (and as experiments.smollm2.heal_carved)
BASELINE = ("mohd75_all_64k", "heal's recipe: normalized gates, target k only, no schedule, no compensation")
# where a healed model's remaining loss sits: one part of the network at full activation (k = N_r), the rest at its
# own k; a part is (layer index, sublayer kind, number of layers) -> whether the sublayer belongs to it
BREAKDOWN = {
    "attention": lambda layer, sublayer, layers: sublayer == "attention",
    "ffn": lambda layer, sublayer, layers: sublayer == "ffn",
    "first third of the layers": lambda layer, sublayer, layers: 3 * layer < layers,
    "middle third of the layers": lambda layer, sublayer, layers: layers <= 3 * layer < 2 * layers,
    "last third of the layers": lambda layer, sublayer, layers: 3 * layer >= 2 * layers,
}


def calibration_ids(work: Path, tokenizer) -> torch.Tensor:
    """(rows, 256) token ids of heal's calibration text (the first 8 articles), at most 16,384 tokens: the text and
    window the conversions' routers were fitted on."""
    text = (work / "calibration.txt").read_text(encoding="utf-8")
    return ep.token_windows(tokenizer, [text], 256, 16384)


def prepare(work: Path) -> None:
    """heal's prepare, then the unit-gate students and the compensated copies, with their held-out perplexity."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mohd  # noqa: F401
    from hf_mohd.cli import main as cli
    from hf_mohd.conversion.mohd.compensation import fit_dropped_block_compensation

    heal.prepare(work)
    info = heal.read_json(work / "ladder_prepare.json", {})
    tokenizer = AutoTokenizer.from_pretrained(work / "teacher")
    windows = heal.held_out_windows(tokenizer)
    for name, (preset, gate, compensated) in STUDENTS.items():
        folder = work / name
        if not (folder / "config.json").exists():
            started = heal.cpu_seconds()
            base = heal.STUDENTS[preset] if gate == "normalized" else f"{heal.STUDENTS[preset]}u"
            if not compensated:
                code = cli(
                    ["convert", "mohd", str(work / "teacher"), str(folder), "--preset", preset, "--rotate", "pca"]
                    + ["--routers", "fitted", "--calibration-text", str(work / "calibration.txt")]
                    + ["--activation-scaling", "none", "--routed-gate", gate, "--overwrite", "--quiet"]
                )
                if code:
                    sys.exit(f"hf-mohd convert mohd failed for {name} (exit code {code})")
                info[name] = {"cpu_seconds": round(heal.cpu_seconds() - started, 1)}
            else:  # heal's student (or the unit one) with its compensation fitted on the calibration text
                model = AutoModelForCausalLM.from_pretrained(
                    str(work / base), dtype=torch.float32, dropped_block_compensation=True
                )
                fit = fit_dropped_block_compensation(model, calibration_ids(work, tokenizer))
                with write_folder_atomically(folder) as staging:
                    model.save_pretrained(staging)
                    tokenizer.save_pretrained(staging)
                info[name] = {"fit": fit, "from": base, "cpu_seconds": round(heal.cpu_seconds() - started, 1)}
                del model
        if "perplexity" not in info.setdefault(name, {}):
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            info[name]["perplexity"] = perplexity(model, windows, 4, desc=name)
            logger.info("%s: held-out perplexity %.3f", name, info[name]["perplexity"])
            if gate == "unit" and "perplexity_full_activation" not in info[name]:
                model.set_active_sub_dims(model.config.num_routed_sub_dims)
                info[name]["perplexity_full_activation"] = perplexity(model, windows, 4, desc=f"{name} full")
            del model
            info["machine"] = ep.machine()
            write_json_atomically(work / "ladder_prepare.json", info)


def budgets(work: Path, output: Path | None = None) -> None:
    """The budgeted students (`BUDGETED`): allocation on the first `BUDGET_CALIBRATION_ROWS` rows of the calibration
    text, saved with the allocation, and their held-out perplexity next to the uniform student's. An output-KL
    allocation resumes from `WORK/NAME.allocation_progress.json` after an interruption. An allocation that `output`
    (the report) already records for the same student and error measure, measured in an earlier work folder, is
    applied as recorded instead of measured again (the output-KL allocations take 2-3 CPU-hours here), and the
    student's active parameters must then equal the recorded count."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mohd  # noqa: F401
    from hf_mohd.conversion.mohd.budgets import BudgetAllocation, allocate_routed_sub_dims, apply_routed_budgets

    path = work / "ladder_budgets.json"
    info = heal.read_json(path, {})
    earlier = heal.read_json(output, {}).get("students", {}) if output is not None else {}
    tokenizer = AutoTokenizer.from_pretrained(work / "teacher")
    windows = heal.held_out_windows(tokenizer)
    calibration = calibration_ids(work, tokenizer)[:BUDGET_CALIBRATION_ROWS]
    for name, (base, error) in BUDGETED.items():
        if name in info:
            continue
        started = heal.cpu_seconds()
        model = AutoModelForCausalLM.from_pretrained(str(work / base), dtype=torch.float32).eval()
        uniform_active = model.config.num_active_parameters()
        k = model.config.num_routed_sub_dims_per_tok
        record = earlier.get(name, {})
        reused = (
            record.get("from") == base and record.get("allocation_error", "residual") == error and "budgets" in record
        )
        progress = None
        if reused:
            allocation = BudgetAllocation.from_budgets(model, record["budgets"], error, record["allocation_tokens"])
            logger.info("%s: the allocation %s records", name, output)
        else:
            # the output measure takes hours here: its running sums survive an interrupted run (removed once recorded)
            progress = work / f"{name}.allocation_progress.json" if error == "output" else None
            allocation = allocate_routed_sub_dims(model, calibration, k, error=error, progress=progress)
        apply_routed_budgets(model, allocation)
        if reused and model.config.num_active_parameters() != record["active_parameters"]:
            sys.exit(
                f"{name}: the recorded allocation in {output} gives {model.config.num_active_parameters():,} active "
                f"parameters here against {record['active_parameters']:,} recorded; is {work / base} the same student?"
            )
        with write_folder_atomically(work / name) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
        info[name] = {
            "from": base,
            "allocation": allocation.as_dict(),
            **({"allocation_recorded_in": output.name} if reused else {}),
            "active_parameters": model.config.num_active_parameters(),
            "uniform_active_parameters": uniform_active,
            "allocation_cpu_seconds": round(heal.cpu_seconds() - started, 1),
            "perplexity": perplexity(model, windows, 4, desc=name),
            "machine": ep.machine(),
        }
        logger.info("%s: held-out perplexity %.3f", name, info[name]["perplexity"])
        write_json_atomically(path, info)
        if progress is not None:
            progress.unlink(missing_ok=True)
        del model


def sides(work: Path) -> None:
    """The unit-gate students with one sparse side (`sparse_sides`), training-free: held-out perplexity and the
    parameters a token reads, next to both sides sparse."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mohd  # noqa: F401

    path = work / "ladder_sides.json"
    info = heal.read_json(path, {})
    windows = heal.held_out_windows(AutoTokenizer.from_pretrained(work / "teacher"))
    for student in ("mohd75u", "mohd50u"):
        for side in ("input", "output"):
            key = f"{student} {side}"
            if key in info:
                continue
            model = AutoModelForCausalLM.from_pretrained(str(work / student), dtype=torch.float32, sparse_sides=side)
            info[key] = {
                "student": student,
                "sparse_sides": side,
                "perplexity": perplexity(model.eval(), windows, 4, desc=key),
                "active_parameters": model.config.num_active_parameters(),
                "machine": ep.machine(),
            }
            logger.info("%s: held-out perplexity %.3f", key, info[key]["perplexity"])
            write_json_atomically(path, info)
            del model


def oracle(work: Path) -> None:
    """The unit-gate students, with and without fitted compensation, with oracle routing: per token and sublayer the
    top-k routed blocks by the energy of the dense rotated model's input (`oracle_routing_record`, replayed), on the
    held-out Wikipedia windows. The rotation is rebuilt as the conversion made it (`rotate_llama` on the same
    calibration tokens) and checked against the student's embedding."""
    from transformers import AutoModelForCausalLM

    import hf_mohd  # noqa: F401
    from experiments.smollm2.routing_analysis import oracle_routing_record
    from hf_mohd.conversion import load_dense_llama, rotate_llama
    from hf_mohd.conversion.calibration import calibration_token_ids

    path = work / "ladder_oracle.json"
    info = heal.read_json(path, {})
    names = [name for name, (_, gate, _) in STUDENTS.items() if gate == "unit"]
    if all(name in info for name in names):
        return
    source = load_dense_llama(work / "teacher", dtype=torch.float32)
    rotated, _ = rotate_llama(source, calibration_token_ids(source, work / "calibration.txt"))
    windows = heal.held_out_windows(source.tokenizer)
    batches = [windows[i : i + 4] for i in range(0, windows.shape[0], 4)]
    embedding = rotated.build_llama().get_input_embeddings().weight
    for name in names:
        if name in info:
            continue
        model = AutoModelForCausalLM.from_pretrained(str(work / name), dtype=torch.float32).eval()
        miss = (embedding - model.get_input_embeddings().weight).abs().max().item()
        if miss > 1e-4:
            sys.exit(f"{work / name}: the rebuilt rotation misses its embedding by {miss:.2e}; not the same basis.")
        records = [oracle_routing_record(rotated, batch, model.config) for batch in batches]
        info[name] = {
            "perplexity_oracle": perplexity(model, windows, 4, routing_records=records, desc=f"{name} oracle"),
            "rotation_embedding_max_difference": miss,
            "machine": ep.machine(),
        }
        write_json_atomically(path, info)
        logger.info("%s: oracle routing, held-out perplexity %.3f", name, info[name]["perplexity_oracle"])
        del model


def sources(work: Path, corpus: Path) -> None:
    """The dense teacher and the training-free students (`SOURCE_STUDENTS`, the curve's 0-token points among them)
    on the five held-out sources, at their k and with every block active, into `work`/ladder_sources.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mohd  # noqa: F401

    path = work / "ladder_sources.json"
    info = heal.read_json(path, {})
    windows = source_windows(corpus, AutoTokenizer.from_pretrained(work / "teacher"))
    for name in ("teacher", *SOURCE_STUDENTS):
        if name in info:
            continue
        if not (work / name / "config.json").exists():
            sys.exit(f"{work / name}: missing; run the prepare and budgets stages first.")
        model = AutoModelForCausalLM.from_pretrained(str(work / name), dtype=torch.float32).eval()
        if name == "teacher":
            info[name] = {s: perplexity(model, w, 4, desc=f"dense {s}") for s, w in windows.items()}
        else:
            info[name] = evaluate(model, windows)
        info["machine"] = ep.machine()
        write_json_atomically(path, info)
        logger.info("%s: %s", name, info[name])
        del model


def evaluate(model, windows: torch.Tensor | dict[str, torch.Tensor]) -> dict:
    """Held-out perplexity at the model's k (each sublayer's) and with every block active (the same weights): one
    number for one set of windows, {source: number} for a dict of them."""

    def measure(label: str) -> float | dict[str, float]:
        if isinstance(windows, dict):
            return {s: perplexity(model, w, 4, desc=f"{label} {s}") for s, w in windows.items()}
        return perplexity(model, windows, 4, desc=label)

    result = {"target": measure("own k")}
    model.set_active_sub_dims(model.config.num_routed_sub_dims)
    result["full_activation"] = measure("k=N_r")
    model.set_active_sub_dims(None)
    return result


def geometric_mean(values: dict[str, float]) -> float:
    return math.exp(sum(math.log(v) for v in values.values()) / len(values))


def arm_records(work: Path, output: Path | None = None) -> dict[str, dict]:
    """256k ladder arm -> its record, for every arm healed in `work` or, failing that, recorded in `output` (the
    report of an earlier work folder)."""
    recorded = heal.read_json(output, {}).get("arms", {}) if output is not None else {}
    records = {arm: heal.read_json(work / f"ladder_{arm}.json", None) or recorded.get(arm) for arm in LADDER_256K}
    return {arm: record for arm, record in records.items() if record is not None}


def best_arm(records: dict[str, dict]) -> str | None:
    """The 256k ladder arm with the lowest geometric mean of its held-out perplexity over the five sources at its
    target k, among `records` (arm -> a record with `perplexity.target`); None while an arm is missing."""
    if any(arm not in records for arm in LADDER_256K):
        return None
    return min(LADDER_256K, key=lambda arm: geometric_mean(records[arm]["perplexity"]["target"]))


def best_recipe(work: Path, output: Path | None = None, chosen: str | None = None) -> str:
    """The 256k ladder arm with the lowest geometric mean of its held-out perplexity over the five sources at its
    target k (`best_arm` of `arm_records`). With the ladder unfinished, `chosen` (an arm of the ladder) stands in for it, so that
    a curve point can heal beside the last ladder arm; the report leaves out a point whose recipe turns out not to be
    the best.

    Raises:
        SystemExit: an arm is not healed and no recipe is chosen; or `chosen` is not a 256k ladder arm, or the
            finished ladder names another arm as the best.
    """
    if chosen is not None and chosen not in LADDER_256K:
        sys.exit(f"--recipe {chosen}: expected an arm of the 256k ladder ({', '.join(LADDER_256K)})")
    records = arm_records(work, output)
    best = best_arm(records)
    if best is not None:
        if chosen is not None and chosen != best:
            sys.exit(f"--recipe {chosen}: the finished 256k ladder names {best} as the best recipe")
        return best
    missing = [arm for arm in LADDER_256K if arm not in records]
    if chosen is None:
        sys.exit(
            f"the curve starts from the best 256k arm; heal these first: {', '.join(missing)} "
            "(or name the recipe with --recipe ARM to heal a curve point beside them)"
        )
    logger.info("the 256k ladder lacks %s; healing with the chosen recipe %s", ", ".join(missing), chosen)
    return chosen


def resolve(work: Path, name: str, output: Path | None = None, chosen: str | None = None) -> tuple[Arm, str | None]:
    """The arm named `name` (of ARMS, or a CURVE point built from the best 256k recipe, `best_recipe`) and its
    recipe (None for ARMS)."""
    if name in ARMS:
        return ARMS[name], None
    activation, budget = CURVE[name]
    recipe = best_recipe(work, output, chosen)
    arm = ARMS[recipe]
    return arm._replace(student=arm.student.replace("75", activation, 1), budget=budget), recipe


def train_arm(work: Path, name: str, corpus: Path, output: Path | None = None, chosen: str | None = None) -> None:
    """Heal one arm (of ARMS or CURVE) to its budget (heal's 64k recipe, its cosine schedule ending at the arm's
    budget, with the arm's levers), then evaluate it. A CURVE point takes its recipe from `resolve` (`output`: the
    report whose recorded arms count; `chosen`: the recipe while the ladder is unfinished), so even a finished point
    needs a resolvable recipe; a point healed, or checkpointed, with another recipe is retired (`retire`) and heals
    anew."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_mohd.training import train_config_from_dict

    path = work / f"ladder_{name}.json"
    arm, recipe = resolve(work, name, output, chosen)
    recorded = heal.read_json(path, None)
    if recorded is not None and (recipe is None or recorded.get("recipe") == recipe):
        logger.info("%s: done (%s)", name, path)
        return
    if not (work / arm.student / "config.json").exists():
        sys.exit(f"{work / arm.student}: missing; run the prepare and budgets stages first.")
    text = corpus / "healing.jsonl" if arm.corpus else work / "healing.jsonl"
    if not text.exists():
        sys.exit(f"{text}: missing; run python -m experiments.smollm2.healing_corpus first.")
    if recorded is not None:
        retire(work, name, recorded.get("recipe") or "unrecorded")
    config = json.loads((work / arm.student / "config.json").read_text())
    target, full = config["num_routed_sub_dims_per_tok"], config["num_sub_dims"] - config["num_shared_sub_dims"]
    distill = {"teacher": str(work / "teacher"), "kl_weight": 1.0, "temperature": 1.0, "lm_weight": 0.0}
    if arm.nested:
        distill["active_sub_dims"] = [target, full]
    if arm.hidden:
        distill["hidden_weight"] = arm.hidden
    if arm.schedule:
        distill.update(schedule_fraction=arm.schedule, schedule_curve="cubic")
        distill.setdefault("active_sub_dims", [target])
    out = work / "runs" / f"ladder_{name}"
    values = {
        "output_dir": str(out),
        # the masked strategy: the same function and gradients as gather, fewer and larger products per step (the
        # 64k arms ran on gather)
        "model": {"init_from": str(work / arm.student), "trainable": "all", "sparse_implementation": "masked"},
        "data": {"path": str(text), "eval_fraction": 0.0, "seq_len": 256},
        "optim": {"lr": 2e-4, "warmup_steps": 16, "weight_decay": 0.0, "min_lr_ratio": 0.1},
        "distill": distill,
        "max_steps": arm.budget // heal.TOKENS_PER_STEP,
        "micro_batch_size": 4,
        "mixed_precision": "no",
        "router_aux_loss": False,
        "log_every": 8,
        "save_every": 16,
        "keep_checkpoints": 1,
        "progress_bar": False,
    }
    started = checkpointed_recipe(out) if recipe is not None else None
    if started is not None and started != recipe_of(train_config_from_dict(values).to_dict()):
        # checkpoints of another recipe, not yet evaluated (no record)
        retire(work, name, f"unrecorded_from_{started[0]}")
    training = heal.run_healing(values)
    tokenizer = AutoTokenizer.from_pretrained(work / "teacher")
    windows = source_windows(corpus, tokenizer) if arm.corpus else heal.held_out_windows(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(out / "final"), dtype=torch.float32).eval()
    record = {
        "arm": name,
        **({"recipe": recipe} if recipe else {}),
        "student": arm.student,
        "tokens": arm.budget,
        "perplexity": evaluate(model, windows),
        **training,
        "torch_threads_this_process": torch.get_num_threads(),
        "machine": ep.machine(),
    }
    write_json_atomically(path, record)
    logger.info("%s: %s", name, record["perplexity"])


def recipe_of(values: dict) -> tuple[str, int, dict]:
    """What makes a healing run's recipe, from its trainer config (`values` as `train_arm` builds them, or a run's
    saved `train_config.json`): the student's folder name, the steps, and the distillation settings with the
    teacher's folder name; paths count by name only, so a work folder reached by another path keeps its runs."""
    distill = dict(values["distill"])
    distill["teacher"] = Path(distill["teacher"]).name
    return Path(values["model"]["init_from"]).name, values["max_steps"], distill


def checkpointed_recipe(out: Path) -> tuple[str, int, dict] | None:
    """`recipe_of` the run in `out` when it holds a checkpoint to resume (its `train_config.json`, every field
    filled in; the new run's values are compared after the trainer fills theirs the same way), else None."""
    from hf_mohd.training import latest_checkpoint

    saved = out / "train_config.json"
    if latest_checkpoint(str(out)) is None or not saved.exists():
        return None
    return recipe_of(json.loads(saved.read_text(encoding="utf-8")))


def retire(work: Path, name: str, label: str) -> None:
    """Move what the curve point `name` holds from another recipe (`label`: that recipe, or the student its
    unevaluated checkpoints start from) into `work`/off_recipe/`label`/ under the same relative paths, so that the
    point heals anew with the current recipe and nothing measured is lost: its record, run folder (checkpoints and
    final model), lm-eval file and breakdown.

    Raises:
        SystemExit: one of those paths already exists under `work`/off_recipe/`label`/ (the point was retired from
            that recipe before); the message names it.
    """
    target = work / "off_recipe" / label
    # the record last: it marks the point as healed, so a retire cut short is finished by the next one
    relatives = [
        f"runs/ladder_{name}",
        f"lm_eval_{name}_{LM_EVAL_LIMIT}.json",
        f"ladder_breakdown_{name}.json",
        f"ladder_{name}.json",
    ]
    present = [relative for relative in relatives if (work / relative).exists()]
    for relative in present:
        if (target / relative).exists():
            sys.exit(f"{target / relative}: already exists; move it away to retire {work / relative} there.")
    for relative in present:
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        os.replace(work / relative, target / relative)
    logger.warning("%s: healed with %s, not the current recipe; moved %s to %s", name, label, present, target)


def healed_folder(work: Path, name: str) -> Path:
    """The saved final model of the healed arm `name`; exits naming the command that heals it when it is missing."""
    folder = work / "runs" / f"ladder_{name}" / "final"
    if not (folder / "config.json").exists():
        sys.exit(f"{folder}: missing; heal the arm first (python -m experiments.smollm2.ladder train {name}).")
    return folder


def lm_eval_model(work: Path, name: str) -> None:
    """lm-eval of `name` (dense, or a healed arm of ARMS or CURVE) at its k into `work`/lm_eval_NAME_500.json
    (`heal.run_lm_eval`: resumable per task, per-document scores for the paired comparison with dense)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mohd  # noqa: F401

    folder = work / "teacher" if name == "dense" else healed_folder(work, name)
    tokenizer = AutoTokenizer.from_pretrained(work / "teacher")
    heal.run_lm_eval(
        work / f"lm_eval_{name}_{LM_EVAL_LIMIT}.json",
        name,
        LM_EVAL_LIMIT,
        lambda: AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval(),
        tokenizer,
    )


def breakdown(work: Path, name: str, corpus: Path) -> None:
    """Where the healed model `name` (a 256k arm or a curve point) loses what remains: its held-out perplexity on the
    five sources with every block active (k = N_r) in one part of the network (`BREAKDOWN`: one sublayer kind, or both
    sublayers of a third of the layers) and every other sublayer at its own k, into `work`/ladder_breakdown_NAME.json,
    resuming part by part. The gap a part closes against the model as healed is what that part's sparsity still
    costs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mohd  # noqa: F401
    from hf_mohd.models.modeling_mohd import MoHDSubDimensions

    folder = healed_folder(work, name)
    path = work / f"ladder_breakdown_{name}.json"
    result = heal.read_json(path, {"arm": name, "perplexity": {}})
    todo = [part for part in BREAKDOWN if part not in result["perplexity"]]
    if not todo:
        logger.info("%s: breakdown done (%s)", name, path)
        return
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    windows = source_windows(corpus, AutoTokenizer.from_pretrained(work / "teacher"))
    config, layers = model.config, model.config.num_hidden_layers
    routed = [
        module for module in model.modules() if isinstance(module, MoHDSubDimensions) and module.router is not None
    ]
    for part in todo:
        for module in routed:
            full = BREAKDOWN[part](module.layer_idx, module.sublayer, layers)
            own = config.routed_sub_dims_per_tok(module.layer_idx, module.sublayer)
            module.set_top_k(config.num_routed_sub_dims if full else own)
        result["perplexity"][part] = {s: perplexity(model, w, 4, desc=f"{part} {s}") for s, w in windows.items()}
        result["machine"] = ep.machine()
        result["torch_threads_this_process"] = torch.get_num_threads()
        write_json_atomically(path, result)
        logger.info("%s, %s at full activation: %s", name, part, result["perplexity"][part])


def breakdown_rows(work: Path, arms: dict, dense: dict) -> dict:
    """arm -> {part: its perplexity per source, ratio to dense and their geometric mean} for every finished
    breakdown of a healed arm in `work` (`breakdown`), the part's share of the gap to dense that it closes included."""
    rows = {}
    for name in arms:
        found = heal.read_json(work / f"ladder_breakdown_{name}.json", None)
        if found is None or set(found["perplexity"]) != set(BREAKDOWN):
            continue
        healed = geometric_mean(arms[name]["ratio_to_dense"]["target"])
        parts = {}
        for part, ppl in found["perplexity"].items():
            ratio = ratios(ppl, dense)
            mean = geometric_mean(ratio)
            # the share of log(healed / dense) that this part at full activation removes
            closed = math.log(healed / mean) / math.log(healed) if healed > 1 else None
            parts[part] = {
                "perplexity": ppl,
                "ratio_to_dense": ratio,
                "geometric_mean_ratio_to_dense": mean,
                "share_of_log_gap_closed": closed,
            }
        rows[name] = {
            "parts": parts,
            "at_own_k": healed,
            "torch_threads": found.get("torch_threads_this_process"),
            "machine": found.get("machine"),
        }
    return rows


def ratios(values: float | dict, dense: float | dict) -> float | dict:
    """`values` over the dense perplexity: one number (Wikipedia) or per source."""
    if isinstance(values, dict):
        return {source: values[source] / dense[source] for source in values}
    return values / dense


def arm_row(found: dict, arm: Arm, dense: float | dict) -> dict:
    ppl = found["perplexity"]
    row = {
        "student": arm.student,
        "nested_full_activation": arm.nested,
        "schedule_fraction": arm.schedule,
        "hidden_weight": arm.hidden,
        "budget_tokens": arm.budget,
        "text": "multi-source healing corpus, five held-out sources" if arm.corpus else "heal's Wikipedia text",
        "perplexity": ppl,
        "ratio_to_dense": {key: ratios(values, dense) for key, values in ppl.items()},
        "train_cpu_seconds": found["train_cpu_seconds_this_process"],
        "load_average_after": found["machine"]["load_average"],
        "cpu": found["machine"].get("cpu"),
    }
    if isinstance(ppl["target"], dict):
        row["geometric_mean_ratio_to_dense"] = {key: geometric_mean(v) for key, v in row["ratio_to_dense"].items()}
    if "resumed" in found:
        row["resumed"] = found["resumed"]
    if "recipe" in found:
        row["recipe"] = found["recipe"]
    return row


def report(work: Path, output: Path, cards_dir: Path | None = None) -> dict:
    """Gather the students' training-free numbers, every finished arm and curve point and the lm-eval rows into one
    JSON; missing parts are listed. A student, arm or lm-eval row that `work` does not hold but `output` already
    records (measured in an earlier work folder, possibly on another machine) is kept as recorded.
    `cards_dir`: where the rendered model card goes (None: beside `output`; the command's default is
    model_cards/)."""
    earlier = heal.read_json(output, {})
    prepared = heal.read_json(work / "prepare.json", None)
    ladder = heal.read_json(work / "ladder_prepare.json", None)
    if prepared is None or ladder is None:
        sys.exit(f"{work}: run the prepare stage first.")
    dense = prepared["perplexity"]["teacher"]
    students = {
        name: {"perplexity": prepared["perplexity"][name], "ratio_to_dense": prepared["perplexity"][name] / dense}
        for name in heal.STUDENTS.values()
    }
    for name in STUDENTS:
        if name in ladder and "perplexity" in ladder[name]:
            found = ladder[name]
            students[name] = {
                key: found[key] for key in ("perplexity", "perplexity_full_activation", "fit") if key in found
            }
            students[name]["ratio_to_dense"] = found["perplexity"] / dense
    budgeted = heal.read_json(work / "ladder_budgets.json", {})
    for name, found in budgeted.items():
        students[name] = {
            "from": found["from"],
            "perplexity": found["perplexity"],
            "ratio_to_dense": found["perplexity"] / dense,
            "uniform_perplexity": students.get(found["from"], {}).get("perplexity"),
            "active_parameters": found["active_parameters"],
            "uniform_active_parameters": found["uniform_active_parameters"],
            "budgets": found["allocation"]["budgets"],
            "allocation_error": found["allocation"].get("error", "residual"),
            "allocation_tokens": found["allocation"]["tokens"],
        }
    for name, found in heal.read_json(work / "ladder_oracle.json", {}).items():
        if name in students:
            students[name]["perplexity_oracle"] = found["perplexity_oracle"]
            students[name]["ratio_to_dense_oracle"] = found["perplexity_oracle"] / dense
    for key, found in heal.read_json(work / "ladder_sides.json", {}).items():
        students[key] = {
            "perplexity": found["perplexity"],
            "ratio_to_dense": found["perplexity"] / dense,
            "sparse_sides": found["sparse_sides"],
            "active_parameters": found["active_parameters"],
        }
    # a student measured here replaces its recorded numbers, and keeps those this folder did not measure (oracle)
    students = {**earlier.get("students", {}), **students}
    students = {name: {**earlier.get("students", {}).get(name, {}), **found} for name, found in students.items()}
    measured = heal.read_json(work / "ladder_sources.json", {})
    dense_sources = measured.get("teacher") or earlier.get("dense_perplexity_per_source")
    sources = {
        name: {
            "perplexity": measured[name],
            "ratio_to_dense": {k: ratios(v, dense_sources) for k, v in measured[name].items()},
        }
        for name in SOURCE_STUDENTS
        if name in measured
    }
    sources = {**{k: v for k, v in earlier.get("students_per_source", {}).items() if k not in sources}, **sources}
    arms, missing = {}, []
    for name in [*ARMS, *CURVE]:
        found = heal.read_json(work / f"ladder_{name}.json", None)
        if found is None:
            if name in earlier.get("arms", {}):
                arms[name] = earlier["arms"][name]
            else:
                missing.append(name)
            continue
        if name in ARMS:
            arm = ARMS[name]
        else:
            arm = ARMS[found["recipe"]]._replace(student=found["student"], budget=CURVE[name][1])
        if arm.corpus and dense_sources is None:
            sys.exit(f"{work}: run the sources stage first (the dense model on the five held-out sources).")
        arms[name] = arm_row(found, arm, dense_sources if arm.corpus else dense)
    curve = {}
    best = best_arm(arms)
    # a curve point healed with a chosen recipe before the ladder finished counts only once that recipe is the best
    off_best = {name: arms[name]["recipe"] for name in CURVE if name in arms and arms[name]["recipe"] != best}
    missing += [
        f"{name} (healed with {recipe}; "
        + (f"the best recipe is {best})" if best else "the 256k ladder is unfinished)")
        for name, recipe in off_best.items()
    ]
    for activation in ("75", "50"):
        points = []
        student = None
        if best is not None:
            student = ARMS[best].student.replace("75", activation, 1)
            if student in sources:
                points.append({"tokens": 0, "arm": student, **sources[student]})
        arms_here = [(CURVE[n][1], n) for n in CURVE if CURVE[n][0] == activation]
        if activation == "75" and best is not None:
            arms_here.append((ARMS[best].budget, best))
        for tokens, name in sorted(arms_here):
            if name in arms and name not in off_best:
                row = arms[name]
                points.append(
                    {
                        "tokens": tokens,
                        "arm": name,
                        "perplexity": row["perplexity"],
                        "ratio_to_dense": row["ratio_to_dense"],
                    }
                )
        for point in points:
            point["geometric_mean_ratio_to_dense"] = {k: geometric_mean(v) for k, v in point["ratio_to_dense"].items()}
        curve[f"{activation}%"] = {"student": student, "points": points}
    off_recipe, earlier_lm_eval, earlier_breakdowns = superseded(earlier, arms)
    breakdowns = {**earlier_breakdowns, **breakdown_rows(work, arms, dense_sources)}
    names = ["dense", *ARMS, *CURVE]
    lm_eval = heal.lm_eval_table(work, names, LM_EVAL_LIMIT, earlier_lm_eval)
    for name in CURVE:
        # rows measured here belong to the record here (`retire` moves them together), else to the recorded arm: the
        # arms loop above took this folder's record first
        here = arms.get(name, {}).get("recipe")
        for table, key in ((lm_eval, f"{name} ({LM_EVAL_LIMIT} docs)"), (breakdowns, name)):
            if key in table:
                table[key].setdefault("recipe", here)
    # the final model of each activation: its healed curve point with the most tokens (the largest planned one until
    # one is healed)
    finals = ["dense"]
    for activation in ("75", "50"):
        healed = [point["arm"] for point in curve[f"{activation}%"]["points"] if point["tokens"]]
        planned = [name for name in CURVE if CURVE[name][0] == activation]
        finals.append(healed[-1] if healed else max(planned, key=lambda name: CURVE[name][1]))
    missing += [f"lm-eval {n} ({LM_EVAL_LIMIT} docs)" for n in finals if f"{n} ({LM_EVAL_LIMIT} docs)" not in lm_eval]
    result = {
        "command": "python -m experiments.smollm2.ladder ladder|curve|prepare|budgets|sides|oracle|sources|train ARM|"
        "lm-eval NAME|breakdown ARM|report",
        "complete": not missing,
        "missing": missing,
        "dense_perplexity": dense,
        "dense_perplexity_per_source": dense_sources,
        "held_out_tokens": prepared["held_out_tokens"],
        "students": students,
        "students_per_source": sources,
        "baseline": {
            "arm": BASELINE[0],
            "recipe": BASELINE[1],
            "points": (
                heal.read_json(RESULTS_DIR / "smollm2_healing.json", {}).get("healing", {}).get(BASELINE[0]) or {}
            ).get("points"),
            "source": "experiments/smollm2/results/smollm2_healing.json (an earlier run on another CPU; the held-out "
            "text and the recipe are the same, and perplexity depends on the CPU only through rounding)",
        },
        "arms": arms,
        "best_256k_recipe": best,
        "curve": curve,
        "lm_eval": lm_eval,
        "breakdown": breakdowns,
        "off_recipe": off_recipe,
        "machine": ep.machine(),
    }
    write_json_atomically(output, result)
    if any(found["points"] for found in curve.values()):
        plot(result, output.with_suffix(".png"))
    card = model_card(work, result)
    if card is not None:
        card.save((cards_dir or output.parent) / "smollm2_mohd75_ladder_model_card.md")
    return result


def superseded(earlier: dict, arms: dict) -> tuple[dict, dict, dict]:
    """Split `earlier` (the report being replaced) by the recipe each curve point now holds in `arms`: returns the
    "off_recipe" record (point -> recipe -> {"arm", "lm_eval", "breakdown"}: `earlier`'s, plus the recorded arm row
    that `arms` replaced and the recorded lm-eval and breakdown rows of another recipe), and `earlier`'s lm-eval and
    breakdown tables without those rows, each kept curve row tagged with its recipe. A recorded row without a
    recipe (reported before rows carried one) belongs to the recorded arm's."""
    off = copy.deepcopy(earlier.get("off_recipe", {}))
    lm_eval, breakdowns = dict(earlier.get("lm_eval", {})), dict(earlier.get("breakdown", {}))
    for name in CURVE:
        now = arms.get(name, {}).get("recipe")
        before = earlier.get("arms", {}).get(name)
        was = (before or {}).get("recipe") or "unrecorded"
        if before is not None and before.get("recipe") != now:
            off.setdefault(name, {}).setdefault(was, {})["arm"] = before
        for kind, table, key in (
            ("lm_eval", lm_eval, f"{name} ({LM_EVAL_LIMIT} docs)"),
            ("breakdown", breakdowns, name),
        ):
            if key not in table:
                continue
            row = {"recipe": was, **table[key]}
            if row["recipe"] == now:
                table[key] = row
            else:
                off.setdefault(name, {}).setdefault(row["recipe"], {})[kind] = row
                del table[key]
    return off, lm_eval, breakdowns


def final_point(result: dict, activation: str) -> dict | None:
    """The healed point of `activation`'s curve with the most tokens (None before one is healed)."""
    healed = [point for point in result["curve"][f"{activation}%"]["points"] if point["tokens"]]
    return healed[-1] if healed else None


def plot(result: dict, path: Path) -> None:
    """The curve: geometric mean over the five sources of the ratio to dense, at the target k and with every block
    active, against healing tokens, one colour per activation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for (activation, found), colour in zip(result["curve"].items(), ("tab:blue", "tab:orange"), strict=True):
        points = found["points"]
        if not points:
            continue
        tokens = [point["tokens"] / (KI_TOKENS * KI_TOKENS) for point in points]
        for key, style, label in (("target", "-o", "at its k"), ("full_activation", "--s", "every block active")):
            axis.plot(
                tokens,
                [point["geometric_mean_ratio_to_dense"][key] for point in points],
                style,
                color=colour,
                label=f"MoHD {activation} {label}",
            )
    axis.axhline(1.0, color="black", linewidth=0.8, label="dense SmolLM2-135M")
    axis.set_yscale("log")
    axis.set_xlabel("healing tokens (M)")
    axis.set_ylabel("held-out perplexity / dense (geometric mean, 5 sources)")
    axis.set_title(f"SmolLM2-135M MoHD healing\nrecipe {result['best_256k_recipe']}", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def model_card(work: Path, result: dict):
    """The model card of the final healed 75% model (`final_point`): the conversion, the per-layer budgets, the
    healing recipe, held-out perplexity on the five sources along the curve and lm-eval with paired differences to
    dense; None before a 75% point is healed or when `work` lacks its run folder."""
    final = final_point(result, "75")
    if final is None or not (work / "runs" / f"ladder_{final['arm']}" / "final").is_dir():
        return None
    arm = result["arms"][final["arm"]]
    dense = result["dense_perplexity_per_source"]
    rows = [("dense SmolLM2-135M", dense, {s: 1.0 for s in dense})]
    student = result["students_per_source"].get(arm["student"])
    if student is not None:
        rows.append(("converted, training-free", student["perplexity"]["target"], student["ratio_to_dense"]["target"]))
    for point in (point for point in result["curve"]["75%"]["points"] if point["tokens"]):
        rows.append(
            (f"healed {point['tokens']:,} tokens", point["perplexity"]["target"], point["ratio_to_dense"]["target"])
        )
    rows.append(
        (
            "healed, every block active",
            final["perplexity"]["full_activation"],
            final["ratio_to_dense"]["full_activation"],
        )
    )
    allocation = result["students"].get(arm["student"], {})
    if arm["student"] in BUDGETED and "budgets" not in allocation:
        sys.exit(f"{arm['student']}: no allocation recorded for this budgeted student; run the budgets stage first.")
    budgets = (
        " Then every layer and sublayer kind got its own k (`per_layer_config`), allocated greedily on "
        f"{allocation['allocation_tokens']:,} calibration tokens from "
        f"{BUDGET_ERRORS[allocation['allocation_error']]} at every k, under the per-token parameter budget of the "
        "uniform k (`hf_mohd.conversion.mohd.budgets`; TEAL's greedy, arXiv 2408.14690)."
        if "budgets" in allocation
        else ""
    )
    levers = ["KL to the dense model at T = 1, no LM loss"]
    if arm["nested_full_activation"]:
        levers.append("nested: the loss at the target k plus the loss with every block active, each step")
    if arm["schedule_fraction"]:
        levers.append(f"k from full activation to the target over the first {arm['schedule_fraction']:.0%} (cubic)")
    if arm["hidden_weight"]:
        levers.append(f"residual-stream distillation at weight {arm['hidden_weight']}")
    notes = (
        "Converted from SmolLM2-135M-Instruct with `hf-mohd convert mohd --preset compression_75 --rotate pca "
        "--routers fitted --activation-scaling none --routed-gate unit`, calibration text the first 8 articles of the "
        "gensim Wikipedia sample (16,384 tokens): every block active, it is the dense model exactly."
        + budgets
        + f"\n\nHealed by distillation for {final['tokens']:,} tokens of a multi-source text (English Wikipedia "
        "without the calibration and held-out articles, An Anarchist FAQ, the Python documentation, the Brown "
        f"corpus; recipe `{final['arm'] if final['arm'] in ARMS else arm['recipe']}`): "
        + "; ".join(levers)
        + "; all weights trainable, AdamW at peak lr 2e-4, warmup 16 steps, cosine to 0.1x, 4 x 256 tokens per step."
        "\n\nHeld-out perplexity, 4,096 tokens of each source (none in the calibration or healing text; the KJV "
        "bible's source never seen), with the ratio to the dense model:\n\n"
        + heal.perplexity_table(dense, rows)
        + heal.lm_eval_sentence(result["lm_eval"].get(f"{final['arm']} ({LM_EVAL_LIMIT} docs)"), LM_EVAL_LIMIT)
        + breakdown_sentence(result.get("breakdown", {}).get(final["arm"]))
        + ("" if result["complete"] else "\n\nPartial: " + "; ".join(result["missing"]) + ".")
    )
    training = {
        "teacher": "SmolLM2-135M-Instruct (dense, fp32)",
        "objective": "; ".join(levers),
        "trainable": "all",
        "peak_learning_rate": 2e-4,
        "tokens": final["tokens"],
        "hardware": f"{arm.get('cpu') or result['machine']['cpu']} (CPU)",
    }
    return heal.healed_card(
        work / "runs" / f"ladder_{final['arm']}" / "final",
        f"SmolLM2-135M-MoHD75-{final['arm']}",
        heal.read_json(work / f"lm_eval_{final['arm']}_{LM_EVAL_LIMIT}.json", None),
        training,
        notes,
        heal.healing_datasets(),
    )


def breakdown_sentence(row: dict | None) -> str:
    """The card's paragraph on where the loss remains (a `breakdown_rows` row; empty without one)."""
    if row is None:
        return ""
    parts = ", ".join(
        f"{'FFN' if part == 'ffn' else part} {found['geometric_mean_ratio_to_dense']:.2f}x"
        for part, found in row["parts"].items()
    )
    return (
        "\n\nWhere the loss remains: with every block active in one part of the network and every other sublayer at "
        f"its own k, the geometric mean over the five sources of the ratio to dense is {parts} (as healed: "
        f"{row['at_own_k']:.2f}x). A part that makes it worse was never trained in that mix: healing trains the own "
        "k everywhere and every block everywhere."
    )


def main(argv=None) -> int:
    stages = (
        "ladder",
        "curve",
        "prepare",
        "budgets",
        "sides",
        "oracle",
        "sources",
        "train",
        "lm-eval",
        "breakdown",
        "report",
    )
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=stages)
    parser.add_argument(
        "arm", nargs="?", choices=["dense", *ARMS, *CURVE], help="train: an arm of ARMS or CURVE; lm-eval: also dense."
    )
    parser.add_argument("--work-dir", type=Path, default=Path("runs/heal_smollm2"))
    parser.add_argument("--corpus-dir", type=Path, default=Path("runs/healing_corpus"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1).")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "smollm2_healing_ladder.json")
    parser.add_argument(
        "--cards-dir",
        type=Path,
        default=MODEL_CARDS_DIR,
        help="report: folder of the rendered model card (default: model_cards/).",
    )
    parser.add_argument(
        "--recipe",
        choices=LADDER_256K,
        help="train of a curve point before the 256k ladder is finished: the ladder arm whose recipe it heals with "
        "(the report leaves the point out unless that arm turns out the best).",
    )
    args = parser.parse_args(argv)
    if args.recipe is not None and not (args.stage == "train" and args.arm in CURVE):
        parser.error("--recipe goes with train of a curve point")
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    work, corpus = args.work_dir, args.corpus_dir
    if args.stage == "ladder":
        prepare(work)
        budgets(work, args.output)
        sides(work)
        oracle(work)
        sources(work, corpus)
        for name in LADDER_256K:
            train_arm(work, name, corpus)
        report(work, args.output, args.cards_dir)
    elif args.stage == "curve":
        sources(work, corpus)
        for name in CURVE:
            train_arm(work, name, corpus, args.output)
        report(work, args.output, args.cards_dir)
    elif args.stage == "prepare":
        prepare(work)
    elif args.stage == "budgets":
        budgets(work, args.output)
    elif args.stage == "sides":
        sides(work)
    elif args.stage == "oracle":
        oracle(work)
    elif args.stage == "sources":
        sources(work, corpus)
    elif args.stage == "train":
        if args.arm not in {*ARMS, *CURVE}:
            parser.error(f"train needs an arm of ARMS or CURVE, got {args.arm!r}")
        train_arm(work, args.arm, corpus, args.output, args.recipe)
    elif args.stage == "lm-eval":
        if args.arm is None:
            parser.error("lm-eval needs a model name (dense or an arm)")
        lm_eval_model(work, args.arm)
    elif args.stage == "breakdown":
        if args.arm not in CURVE and not (args.arm in ARMS and ARMS[args.arm].corpus):
            parser.error(
                f"breakdown needs a 256k arm of ARMS or a point of CURVE (five held-out sources), got {args.arm!r}"
            )
        breakdown(work, args.arm, corpus)
    else:
        report(work, args.output, args.cards_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
