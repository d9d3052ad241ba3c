#!/usr/bin/env python
"""Held-out perplexity of the SmolLM2 models on every real source, not only Wikipedia.

The held-out files are `experiments.smollm2.healing_corpus`'s (`--corpus-dir`, default `runs/healing_corpus`):
Wikipedia (the same 8 articles as every committed result), An Anarchist FAQ, the Python documentation, the Brown
corpus, and the KJV bible, which no calibration or healing text ever came from. Each source gives its first 4,096
tokens in windows of 256 (`evaluate_perplexity.token_windows`; the tokenizer of the dense teacher).

The models (whatever exists; the rest is skipped and listed): the dense teacher and the students and healed arms of
`experiments.smollm2.ladder` (`--work-dir`), and the SmolLM2 carvings at N = 128 (`hf_mohd.conversion.latent_moe.carve`,
fitted routers, 75% and 50% of each FFN active, 4,096 calibration tokens as in `experiments.smollm2.carve`).
Resumable: each (model, source) is written as soon as it is measured.

    python -m experiments.smollm2.held_out_sources
"""

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch

from experiments.smollm2 import RESULTS_DIR, heal
from experiments.smollm2 import evaluate_perplexity as ep
from hf_mohd.atomic_folder import write_json_atomically
from hf_mohd.evaluation.perplexity import perplexity


logger = logging.getLogger("experiments.smollm2.held_out_sources")
SOURCES = ("wikipedia", "anarchist_faq", "python_docs", "brown", "kjv")
LADDER_MODELS = {
    "dense": "teacher",
    "mohd75u (unit gates, training-free)": "mohd75u",
    "mohd75ub (per-layer budgets, training-free)": "mohd75ub",
    "mohd50u (unit gates, training-free)": "mohd50u",
    "mohd50ub (per-layer budgets, training-free)": "mohd50ub",
    "unit_64k": "runs/ladder_unit_64k/final",
    "unit_nested_64k": "runs/ladder_unit_nested_64k/final",
    "unit_nested_compensated_64k": "runs/ladder_unit_nested_compensated_64k/final",
    "unit_nested_budgets_64k": "runs/ladder_unit_nested_budgets_64k/final",
    "unit_nested_hidden_64k": "runs/ladder_unit_nested_hidden_64k/final",
}
CARVINGS = {"carved N=128 75% fitted": 80, "carved N=128 50% fitted": 32}  # name -> K of 128 (shared third)


def source_windows(corpus: Path, tokenizer) -> dict[str, torch.Tensor]:
    """source -> (rows, 256) token ids of the first 4,096 tokens of its held-out file in `corpus`/held_out/; exits
    naming the file when one is missing."""
    windows = {}
    for source in SOURCES:
        path = corpus / "held_out" / f"{source}.txt"
        if not path.exists():
            sys.exit(f"{path}: missing; run python -m experiments.smollm2.healing_corpus first.")
        windows[source] = ep.token_windows(tokenizer, [path.read_text(encoding="utf-8")], 256, 4096)
    return windows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/heal_smollm2"))
    parser.add_argument("--corpus-dir", type=Path, default=Path("runs/healing_corpus"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "smollm2_held_out_sources.json")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mohd  # noqa: F401
    from hf_mohd.conversion import carve_llama, load_dense_llama
    from hf_mohd.conversion.calibration import calibration_ids as read_calibration

    windows = source_windows(args.corpus_dir, AutoTokenizer.from_pretrained(args.work_dir / "teacher"))
    report = heal.read_json(args.output, None) or {
        "command": "python -m experiments.smollm2.held_out_sources",
        "held_out": {s: {"file": f"held_out/{s}.txt", "tokens": int(w.numel())} for s, w in windows.items()},
        "corpus": "experiments/smollm2/results/healing_corpus.json (kjv: never used for healing or calibration)",
        "perplexity": {},
        "skipped": [],
    }

    def measure(name: str, load) -> None:
        done = report["perplexity"].setdefault(name, {})
        if all(source in done for source in SOURCES):
            return
        model = load().eval()
        for source in SOURCES:
            if source not in done:
                started = time.time()
                done[source] = perplexity(model, windows[source], 4, desc=f"{name} {source}")
                logger.info("%s on %s: %.3f (%.0f s)", name, source, done[source], time.time() - started)
                report["machine"] = ep.machine()
                write_json_atomically(args.output, report)
        del model

    for name, folder in LADDER_MODELS.items():
        path = args.work_dir / folder
        if not (path / "config.json").exists():
            report["skipped"] = sorted({*report["skipped"], name})
            continue
        measure(name, lambda path=path: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32))
    source = load_dense_llama(ep.default_source(), dtype=torch.float32)
    calibration_ids, _ = read_calibration(source, max_tokens=4096, window=256)
    for name, k in CARVINGS.items():
        measure(
            name,
            lambda k=k: carve_llama(
                source, calibration_ids, num_experts=128, num_experts_per_tok=k, shared_fraction=1 / 3
            )[0],
        )
    report["skipped"] = [name for name in report["skipped"] if name not in report["perplexity"]]
    write_json_atomically(args.output, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
