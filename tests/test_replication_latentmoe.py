"""The arms of the LatentMoE study (bench/replication/study_latentmoe.py): the allocation controls are the mirror and
the swap of the ID-guided allocation, and every compared arm keeps the matched cost (hand-computed values and the
library's `allocate_two_regime` as the oracle)."""

import pytest

from bench.replication import study_latentmoe as lmoe
from hf_mohd.models.accounting import layer_fields, mixer_accounting, model_accounting
from hf_mohd.shaping import allocate_two_regime


VOCAB = 2048


def _config(architecture: dict) -> dict:
    return {**architecture, "vocab_size": VOCAB}


def _latents(architecture: dict) -> list[int]:
    config = _config(architecture)
    return [layer_fields(config, i)["moe_latent_size"] for i in range(config["num_hidden_layers"])]


@pytest.mark.parametrize("split", [1, 3, 6])
def test_reversed_allocations_are_the_swap_and_the_mirror_of_the_id_guided_one(split):
    narrow, wide = lmoe.regime_shapes()
    n, w = narrow.moe_latent_size, wide.moe_latent_size
    regimes = lmoe.allocation_regimes(split)
    latents = {name: _latents(lmoe.layered(sequence)) for name, sequence in regimes.items()}
    guided = [n] * split + [w] * (8 - split)
    assert latents["id_guided"] == guided
    assert latents["reversed"] == [w] * split + [n] * (8 - split)
    assert latents["mirrored"] == guided[::-1]
    assert latents["uniform_narrow"] == [n] * 8 and latents["uniform_wide"] == [w] * 8
    # The ID-guided arm is the library's allocation at that split, layer by layer.
    library = allocate_two_regime(lmoe.proxy_architecture(), [0.0] * 9, split=split, multiple=lmoe.ALLOCATION_MULTIPLE)
    ours = _config(lmoe.layered(regimes["id_guided"]))
    theirs = _config(library.config)
    for i in range(8):
        mine, reference = layer_fields(ours, i), layer_fields(theirs, i)
        assert {k: mine[k] for k in narrow.fields()} == {k: reference[k] for k in narrow.fields()}
    # Same layers in another order: the mirrored model has exactly the ID-guided model's totals.
    totals = {name: model_accounting(_config(lmoe.layered(seq))) for name, seq in regimes.items()}
    assert totals["mirrored"].total_params == totals["id_guided"].total_params
    assert totals["mirrored"].flops_per_token == totals["id_guided"].flops_per_token
    # Every layer of every arm within the library's 5% of the uniform square layer (params, FLOPs, all-to-all).
    square = mixer_accounting({k: v for k, v in lmoe.proxy_architecture().items() if k != "model_type"})
    for accounting in totals.values():
        for layer in accounting.layers:
            assert abs(layer.mixer_params / square["params"] - 1) <= 0.05
            assert abs(layer.mixer_flops / square["flops"] - 1) <= 0.05
            assert abs(layer.all_to_all_scalars / square["all_to_all_scalars"] - 1) <= 0.05


def test_alpha_arm_and_shape_sweep_keep_the_routed_cost_of_the_standard_moe():
    """Standard: 3 N D m = 3 * 8 * 128 * 128 = 393,216 routed weights per layer and 2 K D = 512 all-to-all scalars;
    alpha = 4: 3 * 32 * 32 * 128 and 2 * 8 * 32, the same numbers; the shape sweep keeps l m = 4096 at N = 32."""
    standard = model_accounting(_config(lmoe.standard_moe()))
    alpha = model_accounting(_config(lmoe.alpha_transformed()))
    assert [layer.routed_expert_params for layer in standard.layers] == [393_216] * 4
    assert [layer.routed_expert_params for layer in alpha.layers] == [393_216] * 4
    assert standard.all_to_all_scalars == alpha.all_to_all_scalars == 4 * 512
    assert alpha.flops_per_token == pytest.approx(standard.flops_per_token, rel=1e-3)
    for divisor in lmoe.SHAPE_DIVISORS:
        fields = lmoe.shape(128 // divisor)
        assert fields["moe_latent_size"] * fields["moe_intermediate_size"] == 4096
        swept = model_accounting(_config(fields))
        assert swept.layers[0].routed_expert_params == 393_216
        assert swept.flops_per_token == pytest.approx(alpha.flops_per_token, rel=1e-3)
        assert swept.all_to_all_scalars == 4 * 2 * 8 * (128 // divisor)
