"""Item 2: dense Llama vs MoHD compression (50% of the width active) vs MoHD expansion (x2 width, same activated).

Claim (MoHD, arXiv 2412.05644, abstract and rebuttal): at equal training tokens, compression keeps about 99% of
the dense model's quality and expansion improves on it. Models from the tiny base shape of `runner.BASE` with the
project's presets (`MOHD_PRESETS`, docs/design.md section 3): compression_50 = width d, 16 sub-dimensions, 6 shared + 2
routed active; expansion_x2 = width 2d, 16 sub-dimensions of 2d/16, 6 shared + 2 routed active (activated width d).
Two seeds each; plus one seed of a dense Llama at the expanded width (128), the model expansion x2 approximates.

    nice -n 19 python -m bench.replication.mohd_vs_dense
"""

from bench.replication import runner


COMPARISON = "mohd_vs_dense"
SEEDS = [0, 1]


def mohd_architecture(preset: str, **overrides) -> dict:
    """A MoHD `model.architecture` dict of one of the paper's presets, built from the dense base shape."""
    from hf_mohd.models.configuration_mohd import MoHDConfig

    base = runner.BASE
    return {
        "model_type": "mohd",
        **base,
        **MoHDConfig.preset_fields(preset, base["hidden_size"], base["num_attention_heads"], base.get("head_dim")),
        # Same numbers as "gather" (tested in tests/models), and faster at this tiny width (4-wide sub-dimensions).
        "sparse_implementation": "masked",
        **overrides,
    }


def dense(seed: int):
    return runner.train_config(COMPARISON, "llama_dense", runner.dense_architecture(), seed)


def compression_50(seed: int):
    return runner.train_config(COMPARISON, "mohd_compression_50", mohd_architecture("compression_50"), seed)


def expansion_x2(seed: int):
    return runner.train_config(COMPARISON, "mohd_expansion_x2", mohd_architecture("expansion_x2"), seed)


def dense_width128(seed: int):
    """Reference, not a matched baseline: the dense Llama at the expanded width (8 heads of 16, FFN 384), i.e. what
    MoHD expansion x2 approximates at half the activated decoder parameters."""
    architecture = runner.dense_architecture(hidden_size=128, num_attention_heads=8, intermediate_size=384)
    return runner.train_config(COMPARISON, "llama_dense_width128", architecture, seed)


VARIANTS = {
    "llama_dense": dense,
    "mohd_compression_50": compression_50,
    "mohd_expansion_x2": expansion_x2,
    "llama_dense_width128": dense_width128,
}


if __name__ == "__main__":
    runner.run_comparison(
        COMPARISON,
        "Item 2: dense Llama vs MoHD compression 50% vs MoHD expansion x2 (equal training tokens)",
        VARIANTS,
        {name: SEEDS if name != "llama_dense_width128" else [0] for name in VARIANTS},
        baseline="llama_dense",
        meta={
            "claim": "MoHD: compression keeps ~99% of dense quality; expansion x2 improves on dense (arXiv 2412.05644)",
            "command": "nice -n 19 python -m bench.replication.mohd_vs_dense",
        },
    )
