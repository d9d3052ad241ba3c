#!/usr/bin/env python
"""SmolLM2-135M carved into a LatentMoE (`hf-mohd convert latent-moe --carve`), healed by distillation.

The carvings are `experiments.smollm2.carve`'s best granularity, N = 128 routed experts per layer with the shared
third of each FFN (f = 1/3, `router_gate="unit"`, routers fitted on 4,096 tokens of the first 8 Wikipedia articles,
the default calibration text of `hf_mohd.conversion.latent_moe.carve`), at K = 80 (75% of each FFN active) and K = 32 (50%).
Healing: `hf-mohd train`'s trainer with a `distill` section (KL to the dense teacher at T = 1, no LM loss) and
`model.trainable: ffn`: only the feed-forward sublayers train (shared and routed experts and the routers; a unit
gate, s - s.detach() + 1, passes a router the straight-through gradient of its K selected scores only); attention,
norms and embeddings stay the dense model's. AdamW at 2e-4, warmup 16 steps, cosine to 0.1 x at the arm's budget
(128k, 256k or 1M tokens), 4 x 256 tokens per step, the `dense_masked` experts kernel
(`model.experts_implementation`: with K = 80 of 128 experts the grouped kernel copies each token 80 times per
layer and holds the copies for backward), on the multi-source healing text of
`experiments.smollm2.healing_corpus` (`--corpus-dir`: Wikipedia without its first and last 8 articles, An Anarchist
FAQ, the Python documentation, Brown), disjoint from the calibration and every held-out text.

Every model is measured on the five held-out sources of `experiments.smollm2.held_out_sources` (4,096 tokens each;
the KJV bible never seen) at its K and, for the healed arms, with every expert active (K = N: the training-free
carving is then the dense model exactly, so this shows how far healing moved the whole function).

Every stage resumes (finished parts are read back from `--work-dir`, training resumes from its last checkpoint):

    python -m experiments.smollm2.heal_carved prepare               # the two carvings, training-free numbers
    python -m experiments.smollm2.heal_carved train carved75_128k   # one arm of ARMS; two may run side by side
    python -m experiments.smollm2.heal_carved lm-eval carved75_128k # also dense or a carving; 500 documents per task
    python -m experiments.smollm2.heal_carved report                # results/smollm2_carved_healing.json

The dense teacher folder is `experiments.smollm2.heal`'s (`--teacher`, made by `heal prepare`).
"""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

from experiments.smollm2 import MODEL_CARDS_DIR, RESULTS_DIR, heal
from experiments.smollm2 import evaluate_perplexity as ep
from experiments.smollm2.held_out_sources import source_windows
from hf_mohd.atomic_folder import write_json_atomically
from hf_mohd.evaluation.perplexity import perplexity


logger = logging.getLogger("experiments.smollm2.heal_carved")
K = 1024
NUM_EXPERTS = 128
SHARED_FRACTION = 1 / 3
CALIBRATION_TOKENS = 4096
LM_EVAL_LIMIT = 500  # documents per task, the same for every model
# carving -> (K of NUM_EXPERTS, share of each FFN active)
CARVINGS = {"carved75": (80, "75%"), "carved50": (32, "50%")}
# arm -> (carving, trainable, peak lr, budget tokens)
ARMS = {
    "carved75_128k": ("carved75", "ffn", 2e-4, 128 * K),
    "carved50_128k": ("carved50", "ffn", 2e-4, 128 * K),
    "carved75_256k": ("carved75", "ffn", 2e-4, 256 * K),
    "carved50_256k": ("carved50", "ffn", 2e-4, 256 * K),
    "carved75_1m": ("carved75", "ffn", 2e-4, 1024 * K),
    "carved50_1m": ("carved50", "ffn", 2e-4, 1024 * K),
}


def measure(model, windows: dict[str, torch.Tensor], every_expert: bool) -> dict:
    """Held-out perplexity per source at the model's K and, with `every_expert`, at K = N (the same weights)."""
    from hf_mohd.conversion.latent_moe.routers import every_expert_active

    result = {"target": {s: perplexity(model, w, 4, desc=f"K {s}") for s, w in windows.items()}}
    if every_expert:
        with every_expert_active(model):
            result["every_expert_active"] = {s: perplexity(model, w, 4, desc=f"K=N {s}") for s, w in windows.items()}
    return result


def load(folder: Path):
    """A carved model for evaluation, with the `dense_masked` experts kernel (the same function as the grouped one,
    tested; at K = 80 or K = N of 128 experts it runs a 4 x 256 window several times faster)."""
    from transformers import AutoModelForCausalLM

    import hf_mohd  # noqa: F401

    return AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, experts_implementation="dense_masked"
    ).eval()


def prepare(work: Path, teacher: Path, corpus: Path) -> None:
    """The two carvings (saved folders) and their training-free held-out perplexity, and the dense model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mohd  # noqa: F401
    from hf_mohd.conversion import convert_carved_latent_moe

    if not (teacher / "config.json").exists():
        sys.exit(f"{teacher}: no teacher folder; run python -m experiments.smollm2.heal prepare first.")
    work.mkdir(parents=True, exist_ok=True)
    path = work / "prepare.json"
    info = heal.read_json(path, {})
    windows = source_windows(corpus, AutoTokenizer.from_pretrained(teacher))
    if "dense" not in info:
        model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
        info["dense"] = measure(model, windows, every_expert=False)["target"]
        write_json_atomically(path, info)
    for name, (k, _) in CARVINGS.items():
        folder = work / name
        if not (folder / "config.json").exists():
            started = heal.cpu_seconds()
            convert_carved_latent_moe(
                teacher, folder, num_experts=NUM_EXPERTS, num_experts_per_tok=k, shared_fraction=SHARED_FRACTION,
                calibration_tokens=CALIBRATION_TOKENS, calibration_window=256, overwrite=True,
            )  # fmt: skip
            info.setdefault(name, {})["carve_cpu_seconds"] = round(heal.cpu_seconds() - started, 1)
        if "perplexity" not in info.setdefault(name, {}):
            model = load(folder)
            # with every expert active a training-free carving is the dense model exactly (tested), so only K
            info[name]["perplexity"] = measure(model, windows, every_expert=False)
            info[name]["machine"] = ep.machine()
            write_json_atomically(path, info)
            logger.info("%s: %s", name, info[name]["perplexity"])
            del model


def train_arm(work: Path, arm: str, teacher: Path, corpus: Path) -> None:
    """Heal one arm to its budget, then measure it (at K and K = N) on every held-out source."""
    from transformers import AutoTokenizer

    carving, trainable, lr, budget = ARMS[arm]
    path = work / f"{arm}.json"
    if path.exists():
        logger.info("%s: done (%s)", arm, path)
        return
    if not (work / carving / "config.json").exists():
        sys.exit(f"{work / carving}: missing; run the prepare stage first.")
    out = work / "runs" / arm
    values = {
        "output_dir": str(out),
        "model": {"init_from": str(work / carving), "trainable": trainable, "experts_implementation": "dense_masked"},
        "data": {"path": str(corpus / "healing.jsonl"), "eval_fraction": 0.0, "seq_len": 256},
        "optim": {"lr": lr, "warmup_steps": 16, "weight_decay": 0.0, "min_lr_ratio": 0.1},
        "distill": {"teacher": str(teacher), "kl_weight": 1.0, "temperature": 1.0, "lm_weight": 0.0},
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
    model = load(out / "final")
    record = {
        "arm": arm,
        "carving": carving,
        "tokens": budget,
        "perplexity": measure(
            model, source_windows(corpus, AutoTokenizer.from_pretrained(teacher)), every_expert=True
        ),
        **training,
        "machine": ep.machine(),
    }
    write_json_atomically(path, record)
    logger.info("%s: %s", arm, record["perplexity"])


def lm_eval_model(work: Path, name: str, teacher: Path, limit: int) -> None:
    """lm-eval of `name` (dense, a carving of CARVINGS or an arm of ARMS) at its K, into `work`/lm_eval_NAME_LIMIT.json
    (`heal.run_lm_eval`: resumable per task, per-document scores for the paired comparison with dense)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "dense":
        folder = teacher
    elif name in CARVINGS:
        folder = work / name
    else:
        folder = work / "runs" / name / "final"
    if not (folder / "config.json").exists():
        sys.exit(f"{folder}: missing; run the stage that makes it first.")

    def load_model():
        if name == "dense":
            return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        return load(folder)

    tokenizer = AutoTokenizer.from_pretrained(teacher)
    heal.run_lm_eval(work / f"lm_eval_{name}_{limit}.json", name, limit, load_model, tokenizer)


def report(work: Path, output: Path, cards_dir: Path | None = None) -> dict:
    """The dense, training-free and healed numbers in one JSON, with ratios to dense per source; missing arms listed.

    An arm or lm-eval row that `work` does not hold but `output` already records (measured in an earlier work folder,
    possibly on another machine) is kept as recorded, so that a long arm can run in a fresh work folder without
    losing the others; the model card is written from the best 75% arm whose run folder `work` holds.
    `cards_dir`: where the rendered model card goes (None: beside `output`; the command's default is
    model_cards/)."""
    earlier = heal.read_json(output, {})
    prepared = heal.read_json(work / "prepare.json", None)
    if prepared is None or "dense" not in prepared:
        sys.exit(f"{work}: run the prepare stage first.")
    dense = prepared["dense"]

    def ratios(values: dict) -> dict:
        return {source: values[source] / dense[source] for source in values}

    carvings = {}
    for name, (k, active) in CARVINGS.items():
        if "perplexity" in prepared.get(name, {}):
            ppl = prepared[name]["perplexity"]
            carvings[name] = {
                "num_experts": NUM_EXPERTS,
                "num_experts_per_tok": k,
                "ffn_active": active,
                "perplexity": ppl,
                "ratio_to_dense": {key: ratios(values) for key, values in ppl.items()},
            }
    arms, missing = {}, []
    for arm, (carving, trainable, lr, budget) in ARMS.items():
        found = heal.read_json(work / f"{arm}.json", None)
        if found is None:
            if arm in earlier.get("arms", {}):
                arms[arm] = earlier["arms"][arm]
            else:
                missing.append(arm)
            continue
        ppl = found["perplexity"]
        arms[arm] = {
            "carving": carving,
            "trainable": trainable,
            "lr": lr,
            "budget_tokens": budget,
            "perplexity": ppl,
            "ratio_to_dense": {key: ratios(values) for key, values in ppl.items()},
            "train_cpu_seconds": found["train_cpu_seconds_this_process"],
            "resumed": found["resumed"],
            "load_average_after": found["machine"]["load_average"],
        }
    names = ["dense", *CARVINGS, *ARMS]
    lm_eval = heal.lm_eval_table(work, names, LM_EVAL_LIMIT, earlier.get("lm_eval", {}))
    missing += [
        f"lm-eval {name} ({LM_EVAL_LIMIT} docs)" for name in names if f"{name} ({LM_EVAL_LIMIT} docs)" not in lm_eval
    ]
    result = {
        "command": "python -m experiments.smollm2.heal_carved prepare|train ARM|lm-eval NAME|report",
        "complete": not missing,
        "missing": missing,
        "held_out": "experiments/smollm2/results/smollm2_held_out_sources.json's windows: 4,096 tokens per source",
        "dense_perplexity": dense,
        "carvings": carvings,
        "arms": arms,
        "lm_eval": lm_eval,
        "machine": ep.machine(),
        "torch_threads_per_run": 1,
    }
    write_json_atomically(output, result)
    best = next(
        (arm for arm in ("carved75_1m", "carved75_256k", "carved75_128k") if (work / "runs" / arm / "final").is_dir()),
        None,
    )
    if best is not None:
        model_card(work, result, best).save((cards_dir or output.parent) / "smollm2_carved75_healed_model_card.md")
    return result


SPEED_RESULT = Path(__file__).resolve().parents[2] / "bench" / "results" / "amd_epyc_zen5" / "carved_speed_n128.json"


def speed_text() -> str:
    """One paragraph of the 75% carving's speed against dense from `bench.bench_carved`'s N = 128 run ("" without
    it)."""
    if not SPEED_RESULT.exists():
        return ""
    found = json.loads(SPEED_RESULT.read_text(encoding="utf-8"))
    line = next(line for line in found["summary"] if line.startswith("carved_75%"))
    cells = dict(part.strip().split(" ", 1) for part in line.split(";")[1:])
    return (
        f"\n\nSpeed against the dense model in the same run (fp32, 1 torch thread, {found['machine']['cpu_model']}, "
        f"experts kernel `gather`): prefill of 4 x 512 tokens {cells['prefill_4x512']}, greedy decoding at batch 1 "
        f"{cells['decode_b1']}, at batch 4 {cells['decode_b4']}."
    )


def carving_notes(folder: Path) -> str:
    """The carving paragraph `hf-mohd convert latent-moe --carve` wrote into `folder`/README.md's Notes section."""
    text = (folder / "README.md").read_text(encoding="utf-8")
    notes = text.split("## Notes", 1)[1].split("\n## ", 1)[0]
    return next(paragraph for paragraph in notes.split("\n\n") if paragraph.strip().startswith("Carved"))


def model_card(work: Path, result: dict, arm: str):
    """The model card of a healed carving: the carving's choices, the healing, held-out perplexity on the five
    sources (training-free, healed, healed with every expert active) and lm-eval with paired differences to dense."""
    found = result["arms"][arm]
    carving = result["carvings"][found["carving"]]
    dense = result["dense_perplexity"]
    rows = [
        ("dense SmolLM2-135M", dense, {s: 1.0 for s in dense}),
        ("carved, training-free", carving["perplexity"]["target"], carving["ratio_to_dense"]["target"]),
        (
            f"healed {found['budget_tokens']:,} tokens",
            found["perplexity"]["target"],
            found["ratio_to_dense"]["target"],
        ),
        (
            "healed, every expert active",
            found["perplexity"]["every_expert_active"],
            found["ratio_to_dense"]["every_expert_active"],
        ),
    ]
    table = heal.perplexity_table(dense, rows)
    eval_text = heal.lm_eval_sentence(result["lm_eval"].get(f"{arm} ({LM_EVAL_LIMIT} docs)"), LM_EVAL_LIMIT)
    notes = (
        carving_notes(work / found["carving"])
        + "\n\n"
        + f"Healed by distillation from the dense model (KL at T = 1, no LM loss) for {found['budget_tokens']:,} "
        "tokens of a multi-source text (English Wikipedia without the calibration and held-out articles, An Anarchist "
        "FAQ, the Python documentation, the Brown corpus), AdamW at peak lr "
        f"{found['lr']}, warmup 16 steps, cosine to 0.1x; only the FFN sublayers (experts, shared expert, routers) "
        "trained.\n\nHeld-out perplexity, 4,096 tokens of each source (none in the calibration or healing text; the "
        "KJV bible's source never seen), with the ratio to the dense model:\n\n"
        + table
        + eval_text
        + speed_text()
        + ("" if result["complete"] else "\n\nPartial: " + "; ".join(result["missing"]) + ".")
    )
    training = {
        "teacher": "SmolLM2-135M-Instruct (dense, fp32)",
        "objective": "KL(teacher || student) at T = 1",
        "trainable": found["trainable"],
        "peak_learning_rate": found["lr"],
        "tokens": found["budget_tokens"],
        "hardware": f"{result['machine']['cpu']}, 1 torch thread",
    }
    return heal.healed_card(
        work / "runs" / arm / "final",
        f"SmolLM2-135M-{arm}",
        heal.read_json(work / f"lm_eval_{arm}_{LM_EVAL_LIMIT}.json", None),
        training,
        notes,
        heal.healing_datasets(),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("prepare", "train", "lm-eval", "report"))
    parser.add_argument(
        "arm",
        nargs="?",
        choices=["dense", *CARVINGS, *ARMS],
        help="train: an arm of ARMS; lm-eval: also dense or a carving.",
    )
    parser.add_argument("--work-dir", type=Path, default=Path("runs/heal_carved"))
    parser.add_argument("--teacher", type=Path, default=Path("runs/heal_smollm2/teacher"))
    parser.add_argument("--corpus-dir", type=Path, default=Path("runs/healing_corpus"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1).")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "smollm2_carved_healing.json")
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
        prepare(args.work_dir, args.teacher, args.corpus_dir)
    elif args.stage == "train":
        if args.arm not in ARMS:
            parser.error(f"train needs an arm of {list(ARMS)}, got {args.arm!r}")
        train_arm(args.work_dir, args.arm, args.teacher, args.corpus_dir)
    elif args.stage == "lm-eval":
        if args.arm is None:
            parser.error("lm-eval needs a model name")
        lm_eval_model(args.work_dir, args.arm, args.teacher, LM_EVAL_LIMIT)
    else:
        print(json.dumps(report(args.work_dir, args.output, args.cards_dir)["arms"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
