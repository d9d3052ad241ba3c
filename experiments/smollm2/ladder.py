#!/usr/bin/env python
"""Healing that keeps the dense function, on SmolLM2-135M: the levers one at a time, at a fixed budget.

Builds on `experiments.smollm2.heal` (its teacher, text split, held-out windows and 75% / 50% conversions) and adds:

- students converted with `--routed-gate unit` (the router only selects, so every block active is the dense source
  exactly), and copies of each student with dropped-block compensation fitted on the calibration text
  (`hf_mohd.conversion.compensation`), whose training-free gain `prepare` records;
- a ladder of healing arms at 75%, each adding one lever to the previous one (see `ARMS`): unit gates, nested
  healing at the target k and at full activation (`distill.active_sub_dims`), a gradual schedule, compensation;
- uneven budgets (`budgets`): each unit-gate student with every layer and sublayer kind at its own k, allocated by
  `hf_mohd.conversion.budgets` on the calibration text under the per-token parameter budget of its uniform k, and the
  held-out perplexity of the result, training-free; and (`sides`) the same students with only one side of each
  sublayer sparse (`sparse_sides` "input": it reads only the active blocks; "output": it writes only them);
- for every healed arm, the held-out perplexity at the target k and of the same weights with every block active.

Every stage resumes (finished parts are read back from `--work-dir`, training resumes from its last checkpoint):

    python -m experiments.smollm2.ladder prepare                  # heal's prepare, then the unit and compensated students
    python -m experiments.smollm2.ladder budgets                  # the budgeted students (after prepare)
    python -m experiments.smollm2.ladder sides                    # one sparse side, training-free
    python -m experiments.smollm2.ladder train unit_nested_64k    # one arm of ARMS (64k or 256k); two may run side by side
    python -m experiments.smollm2.ladder report                   # experiments/smollm2/results/smollm2_healing_ladder.json

The recipe of every arm is heal's 64k arm (`mohd75_all_64k`: AdamW at 2e-4, warmup 16 steps, cosine to 0.1 x at the
budget, 4 x 256 tokens per step, KL to the teacher at T = 1, all weights train) with only the arm's lever changed.
"""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

from experiments.smollm2 import RESULTS_DIR, heal
from experiments.smollm2 import evaluate_perplexity as ep
from hf_mohd.atomic_folder import write_folder_atomically, write_json_atomically
from hf_mohd.evaluation.perplexity import perplexity


logger = logging.getLogger("experiments.smollm2.ladder")
K = 1024
# student -> (preset, routed gate, dropped-block compensation); "mohd75" / "mohd50" are heal's (normalized gates)
STUDENTS = {
    "mohd75u": ("compression_75", "unit", False),
    "mohd50u": ("compression_50", "unit", False),
    "mohd75c": ("compression_75", "normalized", True),
    "mohd50c": ("compression_50", "normalized", True),
    "mohd75uc": ("compression_75", "unit", True),
    "mohd50uc": ("compression_50", "unit", True),
}
# budgeted student -> the unit-gate student it is allocated from (`budgets`)
BUDGETED = {"mohd75ub": "mohd75u", "mohd50ub": "mohd50u"}
BUDGET_CALIBRATION_ROWS = 16  # 16 x 256 = 4,096 tokens of heal's calibration text
# arm -> (student, nested healing at full activation, schedule fraction, budget tokens, hidden_weight); each adds
# one lever to the nested arm
ARMS = {
    "unit_64k": ("mohd75u", False, 0.0, 64 * K, 0.0),
    "unit_nested_64k": ("mohd75u", True, 0.0, 64 * K, 0.0),
    "unit_nested_schedule_64k": ("mohd75u", True, 0.25, 64 * K, 0.0),
    "unit_nested_compensated_64k": ("mohd75uc", True, 0.0, 64 * K, 0.0),
    "unit_nested_budgets_64k": ("mohd75ub", True, 0.0, 64 * K, 0.0),
    "unit_nested_hidden_64k": ("mohd75u", True, 0.0, 64 * K, 1.0),
    # the same ladder at 256k tokens, from the best 64k student (per-layer budgets) on: each arm adds one lever
    "unit_256k": ("mohd75u", False, 0.0, 256 * K, 0.0),
    "unit_nested_256k": ("mohd75u", True, 0.0, 256 * K, 0.0),
    "unit_nested_budgets_256k": ("mohd75ub", True, 0.0, 256 * K, 0.0),
    "unit_nested_budgets_schedule_256k": ("mohd75ub", True, 0.25, 256 * K, 0.0),
    "unit_nested_budgets_hidden_256k": ("mohd75ub", True, 0.0, 256 * K, 1.0),
}
BASELINE = ("mohd75_all_64k", "heal's recipe: normalized gates, target k only, no schedule, no compensation")


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
    from hf_mohd.conversion.compensation import fit_dropped_block_compensation

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


def budgets(work: Path) -> None:
    """The budgeted students (`BUDGETED`): allocation on the first `BUDGET_CALIBRATION_ROWS` rows of the calibration
    text, saved with the allocation, and their held-out perplexity next to the uniform student's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mohd  # noqa: F401
    from hf_mohd.conversion.budgets import allocate_routed_sub_dims, apply_routed_budgets

    path = work / "ladder_budgets.json"
    info = heal.read_json(path, {})
    tokenizer = AutoTokenizer.from_pretrained(work / "teacher")
    windows = heal.held_out_windows(tokenizer)
    calibration = calibration_ids(work, tokenizer)[:BUDGET_CALIBRATION_ROWS]
    for name, base in BUDGETED.items():
        if name in info:
            continue
        started = heal.cpu_seconds()
        model = AutoModelForCausalLM.from_pretrained(str(work / base), dtype=torch.float32).eval()
        uniform_active = model.config.num_active_parameters()
        allocation = allocate_routed_sub_dims(model, calibration, model.config.num_routed_sub_dims_per_tok)
        apply_routed_budgets(model, allocation)
        with write_folder_atomically(work / name) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
        allocation_seconds = round(heal.cpu_seconds() - started, 1)
        info[name] = {
            "from": base,
            "allocation": allocation.as_dict(),
            "active_parameters": model.config.num_active_parameters(),
            "uniform_active_parameters": uniform_active,
            "allocation_cpu_seconds": allocation_seconds,
            "perplexity": perplexity(model, windows, 4, desc=name),
            "machine": ep.machine(),
        }
        logger.info("%s: held-out perplexity %.3f", name, info[name]["perplexity"])
        write_json_atomically(path, info)
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


def evaluate(model, windows) -> dict:
    """Held-out perplexity at the model's k (each sublayer's) and with every block active (the same weights)."""
    result = {"target": perplexity(model, windows, 4, desc="own k")}
    model.set_active_sub_dims(model.config.num_routed_sub_dims)
    result["full_activation"] = perplexity(model, windows, 4, desc="k=N_r")
    model.set_active_sub_dims(None)
    return result


def train_arm(work: Path, arm: str) -> None:
    """Heal one arm to its budget (heal's 64k recipe, its cosine schedule ending at the arm's budget, with the arm's
    levers), then evaluate it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student, nested, schedule, budget, hidden = ARMS[arm]
    path = work / f"ladder_{arm}.json"
    if path.exists():
        logger.info("%s: done (%s)", arm, path)
        return
    config = json.loads((work / student / "config.json").read_text())
    target, full = config["num_routed_sub_dims_per_tok"], config["num_sub_dims"] - config["num_shared_sub_dims"]
    distill = {"teacher": str(work / "teacher"), "kl_weight": 1.0, "temperature": 1.0, "lm_weight": 0.0}
    if nested:
        distill["active_sub_dims"] = [target, full]
    if hidden:
        distill["hidden_weight"] = hidden
    if schedule:
        distill.update(schedule_fraction=schedule, schedule_curve="cubic")
        distill.setdefault("active_sub_dims", [target])
    out = work / "runs" / f"ladder_{arm}"
    values = {
        "output_dir": str(out),
        "model": {"init_from": str(work / student), "trainable": "all"},
        "data": {"path": str(work / "healing.jsonl"), "eval_fraction": 0.0, "seq_len": 256},
        "optim": {"lr": 2e-4, "warmup_steps": 16, "weight_decay": 0.0, "min_lr_ratio": 0.1},
        "distill": distill,
        "max_steps": budget // heal.TOKENS_PER_STEP,
        "micro_batch_size": 4,
        "mixed_precision": "no",
        "router_aux_loss": False,
        "log_every": 8,
        "save_every": 16,
        "keep_checkpoints": 1,
        "progress_bar": False,
    }
    training = heal.run_healing(values)
    tokenizer = AutoTokenizer.from_pretrained(work / "teacher")
    model = AutoModelForCausalLM.from_pretrained(str(out / "final"), dtype=torch.float32).eval()
    record = {
        "arm": arm,
        "student": student,
        "tokens": budget,
        "perplexity": evaluate(model, heal.held_out_windows(tokenizer)),
        **training,
        "machine": ep.machine(),
    }
    write_json_atomically(path, record)
    logger.info("%s: %s", arm, record["perplexity"])


def report(work: Path, output: Path) -> dict:
    """Gather the students' training-free numbers and every finished arm into one JSON; missing arms are listed. An
    arm that `work` does not hold but `output` already records (healed in an earlier work folder, possibly on another
    machine) is kept as recorded."""
    earlier = heal.read_json(output, {}).get("arms", {})
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
            "allocation_tokens": found["allocation"]["tokens"],
        }
    for key, found in heal.read_json(work / "ladder_sides.json", {}).items():
        students[key] = {
            "perplexity": found["perplexity"],
            "ratio_to_dense": found["perplexity"] / dense,
            "sparse_sides": found["sparse_sides"],
            "active_parameters": found["active_parameters"],
        }
    arms, missing = {}, []
    for arm, (student, nested, schedule, budget, hidden) in ARMS.items():
        found = heal.read_json(work / f"ladder_{arm}.json", None)
        if found is None:
            if arm in earlier:
                arms[arm] = earlier[arm]
            else:
                missing.append(arm)
            continue
        ppl = found["perplexity"]
        arms[arm] = {
            "student": student,
            "nested_full_activation": nested,
            "schedule_fraction": schedule,
            "hidden_weight": hidden,
            "budget_tokens": budget,
            "perplexity": ppl,
            "ratio_to_dense": {key: value / dense for key, value in ppl.items()},
            "train_cpu_seconds": found["train_cpu_seconds_this_process"],
            "load_average_after": found["machine"]["load_average"],
        }
    baseline = heal.read_json(RESULTS_DIR / "smollm2_healing.json", {}).get("healing", {}).get(BASELINE[0])
    result = {
        "command": "python -m experiments.smollm2.ladder prepare|budgets|sides|train ARM|report",
        "complete": not missing,
        "missing": missing,
        "dense_perplexity": dense,
        "held_out_tokens": prepared["held_out_tokens"],
        "students": students,
        "baseline": {
            "arm": BASELINE[0],
            "recipe": BASELINE[1],
            "points": baseline and baseline["points"],
            "source": "experiments/smollm2/results/smollm2_healing.json (an earlier run on another CPU; the held-out "
            "text and the recipe are the same, and perplexity depends on the CPU only through rounding)",
        },
        "arms": arms,
        "machine": ep.machine(),
        "torch_threads_per_run": 1,
    }
    write_json_atomically(output, result)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("prepare", "budgets", "sides", "train", "report"))
    parser.add_argument("arm", nargs="?", choices=list(ARMS), help="train: an arm of ARMS.")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/heal_smollm2"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1).")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "smollm2_healing_ladder.json")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    if args.stage == "prepare":
        prepare(args.work_dir)
    elif args.stage == "budgets":
        budgets(args.work_dir)
    elif args.stage == "sides":
        sides(args.work_dir)
    elif args.stage == "train":
        if args.arm is None:
            parser.error("train needs an arm")
        train_arm(args.work_dir, args.arm)
    else:
        report(args.work_dir, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
