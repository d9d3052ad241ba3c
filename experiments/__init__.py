"""Experiments of the repository (not shipped in the wheel): each a module run from the repository root with
`python -m experiments.<name>.<module>`, importing `hf_mohd` and each other by absolute imports.

- `experiments.smollm2`: SmolLM2-135M converted to MoHD and carved into LatentMoE, training-free and healed; the
  committed results are in `experiments/smollm2/results/`.
"""
