"""Shaping and allocation tools (arXiv 2610.14644, docs/design.md section 4) against oracles: hand-computed counts, the
parameters LatentMoE actually builds, `skdim.id.TwoNN`, data of known intrinsic dimension, a plain forward pass of
a LLaMA model, and the accounting of the written config."""

import importlib.util
import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch

from hf_mohd.cli import main as cli_main
from hf_mohd.models.accounting import (
    all_to_all_scalars,
    attention_params,
    latent_projection_params,
    layer_accounting,
    mlp_params,
    model_accounting,
    moe_activated_flops,
    routed_expert_params,
    router_params,
    shared_expert_params,
)
from hf_mohd.shaping import (
    allocate_two_regime,
    alpha_transform,
    collect_hidden_states,
    find_split,
    intrinsic_dimension_profile,
    nearest_neighbour_distances,
    propose_shape,
    propose_shapes,
    twonn,
    write_allocation,
)


HAS_LATENT_MOE = importlib.util.find_spec("hf_mohd.models.configuration_latent_moe") is not None

# A small config: D = 64, H = 4, H_kv = 2 (head_dim 16), l = 16, m = 32, N = 8, K = 2, m_s = 48; layer 1 dense
# (I = 128), layer 2 a standard MoE (no latent), layer 3 smaller (N = 4, K = 1, no shared expert). Only fields of
# `PER_LAYER_FIELDS` vary per layer, as `LatentMoEConfig` requires (`mlp_gated` is one value for the whole model).
DICT_CONFIG = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 32,
    "moe_latent_size": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_shared_expert_intermediate_size": 48,
    "mlp_gated": True,
    "mixer_type": "moe",
    "tie_word_embeddings": False,
    "per_layer_config": {
        "1": {"mixer_type": "mlp"},
        "2": {"moe_latent_size": None},
        "3": {"num_experts": 4, "num_experts_per_tok": 1, "moe_shared_expert_intermediate_size": 0},
    },
}


# ---------------------------------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------------------------------


def test_component_formulas_match_hand_counts():
    # attention: q 64x64, k and v 64x32 each, o 64x64 -> 4096 + 2048 + 2048 + 4096
    assert attention_params(64, 4, 2) == 12288
    assert attention_params(64, 4, 2, attention_bias=True) == 12288 + 128 + 64
    assert routed_expert_params(8, 32, 64, 16, True) == 3 * 8 * 16 * 32 == 12288
    assert routed_expert_params(8, 32, 64, None, False) == 2 * 8 * 64 * 32
    assert latent_projection_params(64, 16) == 2048 and latent_projection_params(64, None) == 0
    assert router_params(64, 8) == 512
    assert shared_expert_params(64, 48) == 9216 and shared_expert_params(64, None) == 0
    assert mlp_params(64, 128, False) == 2 * 64 * 128
    # biases: gate and up I each (up only when not gated), down D
    assert mlp_params(64, 128, True, True) == 3 * 64 * 128 + 2 * 128 + 64
    assert mlp_params(64, 128, False, True) == 2 * 64 * 128 + 128 + 64
    assert latent_projection_params(64, 16, mlp_bias=True) == 2048 + 16 + 64
    assert shared_expert_params(64, 48, mlp_bias=True) == 9216 + 2 * 48 + 64
    assert shared_expert_params(64, 0, mlp_bias=True) == 0
    # FLOPs = 2 x MACs, MACs 3 K l m + 2 D l + D N + 3 D m_s = 3072 + 2048 + 512 + 9216
    assert moe_activated_flops(64, 32, 8, 2, 16, 48) == 2 * 14848
    assert moe_activated_flops(64, 32, 8, 2, None, 0, False) == 2 * (2 * 2 * 64 * 32 + 512)
    assert all_to_all_scalars(64, 2, 16) == 64 and all_to_all_scalars(64, 2) == 256


def test_layer_and_model_accounting_of_a_dict_config():
    layers = model_accounting(DICT_CONFIG).layers
    latent, dense, standard, small = layers
    assert latent.total_params == 12288 + 12288 + 2048 + 512 + 9216 + 128
    assert latent.activated_params == 12288 + 3 * 2 * 16 * 32 + 2048 + 512 + 9216 + 128
    assert (latent.mixer_flops, latent.all_to_all_scalars) == (2 * 14848, 64)
    assert dense.mixer_type == "mlp" and dense.total_params == 12288 + 3 * 64 * 128 + 128
    assert (dense.mixer_flops, dense.all_to_all_scalars) == (2 * 3 * 64 * 128, 0)
    assert standard.routed_expert_params == 3 * 8 * 64 * 32 and standard.latent_projection_params == 0
    assert (standard.mixer_flops, standard.all_to_all_scalars) == (2 * (3 * 2 * 64 * 32 + 512 + 9216), 2 * 2 * 64)
    # N = 4, K = 1, m_s = 0: routed 3 * 4 * 16 * 32, router 64 * 4, latent projections 2 * 64 * 16, no shared expert
    assert small.total_params == 12288 + 6144 + 2048 + 256 + 128
    assert small.activated_params == 12288 + 3 * 1 * 16 * 32 + 2048 + 256 + 128
    assert (small.shared_expert_params, small.mixer_flops, small.all_to_all_scalars) == (
        0,
        2 * (1536 + 2048 + 256),
        32,
    )
    total = model_accounting(DICT_CONFIG)
    assert total.total_params == sum(layer.total_params for layer in layers) + 64 + 2 * 100 * 64
    assert total.all_to_all_scalars == 64 + 0 + 256 + 32
    # non-gated experts and shared expert (`mlp_gated=False`, global): c = 2
    assert total.flops_per_token == sum(layer.activated_flops for layer in layers) + 2 * 100 * 64
    assert total.activated_params == sum(layer.activated_params for layer in layers) + 64 + 100 * 64
    ungated = model_accounting({**DICT_CONFIG, "mlp_gated": False}).layers[0]
    assert ungated.routed_expert_params == 2 * 8 * 16 * 32 and ungated.shared_expert_params == 2 * 64 * 48
    with_context = layer_accounting(DICT_CONFIG, 0, context_length=10)
    assert with_context.attention_flops == 2 * (12288 + 2 * 4 * 16 * 10)
    # `mlp_bias` (one value for the model): dense MLP, shared expert and latent projections gain their biases
    biased = model_accounting({**DICT_CONFIG, "mlp_bias": True}).layers
    assert biased[0].total_params == latent.total_params + (16 + 64) + (2 * 48 + 64)
    assert biased[1].total_params == dense.total_params + 2 * 128 + 64
    assert biased[2].total_params == standard.total_params + 2 * 48 + 64
    assert [b.mixer_flops for b in biased] == [layer.mixer_flops for layer in layers]  # biases add no FLOPs


@pytest.mark.parametrize(
    "overrides",
    [
        {"mlp_gated": False},
        {"hidden_size": 32},
        {"num_attention_heads": 2},
        {"attention_bias": True},
        {"skip": ["mlp"]},
    ],
)
def test_accounting_rejects_per_layer_overrides_the_config_rejects(overrides):
    from hf_mohd.models.configuration_latent_moe import LatentMoEConfig

    fields = {k: v for k, v in DICT_CONFIG.items() if k != "per_layer_config"}
    with pytest.raises(ValueError, match=r"per_layer_config\[3\]` overrides") as from_config:
        LatentMoEConfig(**fields, per_layer_config={3: overrides})
    for per_layer in ({"3": overrides}, {3: overrides}):
        with pytest.raises(ValueError) as from_accounting:
            model_accounting({**fields, "per_layer_config": per_layer})
        assert str(from_accounting.value) == str(from_config.value)
    # every layer's fields are checked, not only the layer asked for
    with pytest.raises(ValueError, match=r"per_layer_config\[3\]` overrides"):
        layer_accounting({**fields, "per_layer_config": {"3": overrides}}, 0)


def test_dict_fixture_is_a_valid_latent_moe_config():
    from hf_mohd.models.configuration_latent_moe import LatentMoEConfig

    config = LatentMoEConfig.from_dict(DICT_CONFIG)
    assert [layer.num_experts for layer in config.per_layer_config] == [8, 8, 8, 4]
    assert model_accounting(config).as_dict() == model_accounting(DICT_CONFIG).as_dict()


def test_accounting_errors_name_layer_and_field():
    bad = json.loads(json.dumps(DICT_CONFIG))
    bad["per_layer_config"]["3"]["num_experts_per_tok"] = 9
    with pytest.raises(ValueError, match=r"layer 3: `num_experts_per_tok` must be at most `num_experts` \(4\)"):
        model_accounting(bad)
    bad["per_layer_config"]["3"] = {"mixer_type": "attention"}
    with pytest.raises(ValueError, match="layer 3: `mixer_type` must be one of"):
        model_accounting(bad)
    with pytest.raises(ValueError, match="`moe_latent_size` must be a positive integer"):
        latent_projection_params(64, 0)
    with pytest.raises(ValueError, match="`layer_idx` must be an integer in"):
        layer_accounting(DICT_CONFIG, 4)
    with pytest.raises(ValueError, match="`per_layer_config` must map layer indices"):
        model_accounting({**DICT_CONFIG, "per_layer_config": {"first": {"num_experts": 4}}})


@pytest.mark.skipif(not HAS_LATENT_MOE, reason="LatentMoE model not built yet")
@pytest.mark.parametrize("gated", [True, False])
def test_accounting_matches_parameters_actually_built(gated):
    from hf_mohd.models.configuration_latent_moe import LatentMoEConfig
    from hf_mohd.models.modeling_latent_moe import LatentMoEForCausalLM

    fields = {k: v for k, v in DICT_CONFIG.items() if k != "per_layer_config"}
    fields.update(mlp_gated=gated, hidden_act="silu" if gated else "relu2")
    per_layer = {
        1: {"mixer_type": "mlp"},
        2: {"moe_latent_size": None},
        3: {"num_experts": 4, "num_experts_per_tok": 1, "moe_shared_expert_intermediate_size": 0},
    }
    config = LatentMoEConfig(**fields, per_layer_config=per_layer)
    model = LatentMoEForCausalLM(config)
    built = sum(p.numel() for p in model.parameters())
    as_dict = {**fields, "per_layer_config": {str(k): v for k, v in per_layer.items()}}
    assert built == model_accounting(config).total_params == model_accounting(as_dict).total_params
    for idx, layer in enumerate(model.model.layers):
        assert sum(p.numel() for p in layer.parameters()) == layer_accounting(config, idx).total_params, idx
    # the config as serialised (`to_dict`, what config.json holds) gives the same numbers
    assert model_accounting(config.to_dict()).as_dict() == model_accounting(config).as_dict()


# ---------------------------------------------------------------------------------------------------------------------
# alpha-transform and shapes
# ---------------------------------------------------------------------------------------------------------------------

STANDARD = {
    "vocab_size": 1000,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "moe_intermediate_size": 128,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_shared_expert_intermediate_size": 256,
    "mlp_gated": True,
}


def _routed_terms(layer):
    """(routed params, routed FLOPs, all-to-all) of one layer: what the alpha-transform must keep."""
    others = layer.latent_projection_params + layer.router_params + layer.shared_expert_params
    return layer.routed_expert_params, layer.mixer_flops - 2 * others, layer.all_to_all_scalars


@pytest.mark.parametrize("alpha", [2, 4, 0.5])
def test_alpha_transform_keeps_routed_params_compute_and_communication(alpha):
    config = {**STANDARD, "per_layer_config": {"2": {"mixer_type": "mlp"}, "4": {"num_experts": 32}}}
    out = alpha_transform(config, alpha)
    assert out["moe_latent_size"] == 512 / alpha and out["num_experts"] == 16 * alpha
    assert out["num_experts_per_tok"] == 4 * alpha and out["moe_intermediate_size"] == 128
    assert out["per_layer_config"]["4"]["num_experts"] == 32 * alpha
    before, after = model_accounting(config), model_accounting(out)
    for old, new in zip(before.layers, after.layers, strict=True):
        assert old.mixer_type == new.mixer_type
        assert _routed_terms(old) == _routed_terms(new), old.layer_idx
        if new.mixer_type == "moe":
            assert new.latent_projection_params == 2 * 512 * (512 / alpha)


def test_alpha_transform_of_fields_and_config_objects():
    assert alpha_transform({"hidden_size": 4096, "num_experts": 128, "num_experts_per_tok": 6}, 4) == {
        "hidden_size": 4096,
        "num_experts": 512,
        "num_experts_per_tok": 24,
        "moe_latent_size": 1024,
    }
    if HAS_LATENT_MOE:
        from hf_mohd.models.configuration_latent_moe import LatentMoEConfig

        out = alpha_transform(LatentMoEConfig(**STANDARD), 4)
        assert isinstance(out, LatentMoEConfig)
        assert (out.moe_latent_size, out.num_experts, out.num_experts_per_tok) == (128, 64, 16)


def test_alpha_transform_errors():
    with pytest.raises(ValueError, match=r"`hidden_size` \(512\) must be divisible by alpha \(3\)"):
        alpha_transform(STANDARD, 3)
    with pytest.raises(ValueError, match=r"alpha \(2.5\) times `num_experts_per_tok` \(3\) must be an integer"):
        alpha_transform({"hidden_size": 640, "num_experts": 16, "num_experts_per_tok": 3}, 2.5)
    with pytest.raises(ValueError, match="`moe_latent_size` must be None, got 128"):
        alpha_transform({**STANDARD, "moe_latent_size": 128}, 2)
    with pytest.raises(ValueError, match="`alpha` must be a positive number"):
        alpha_transform(STANDARD, 0)


def test_shape_proposer_bounds_alignment_and_ranking():
    # Appendix C.2 of arXiv 2610.14644 fixes l m ~ 393,216: 512 x 768 is exact and within |l/m - 1| <= 0.4.
    best = propose_shape(393216)
    assert (best.latent_size, best.intermediate_size, best.rank_ceiling) == (512, 768, 512)
    for bound in (0.4, 0.2, 0.05):
        shapes = propose_shapes(393216, max_aspect_deviation=bound)
        assert shapes, bound
        for shape in shapes:
            assert shape.latent_size % 64 == 0 and shape.intermediate_size % 64 == 0
            assert shape.aspect_deviation <= bound + 1e-12 and abs(shape.product_error) <= 0.05
        errors = [abs(s.product_error) for s in shapes]
        assert errors == sorted(errors)
    assert propose_shape(393216, max_aspect_deviation=0.2).as_dict()["product"] == 576 * 704
    assert propose_shape(393216, max_aspect_deviation=0.05).latent_size == 640
    for multiple in (64, 32):
        square = propose_shape(65536, multiple=multiple)
        assert (square.latent_size, square.intermediate_size, square.aspect_deviation) == (256, 256, 0.0)
    assert all(s.latent_size <= 256 for s in propose_shapes(393216, max_latent_size=256, product_tolerance=1.0))
    with pytest.raises(ValueError, match="No \\(l, m\\) with l m within 5% of 1000"):
        propose_shape(1000)
    with pytest.raises(ValueError, match="`multiple` must be a positive integer"):
        propose_shapes(4096, multiple=0)


# ---------------------------------------------------------------------------------------------------------------------
# TwoNN
# ---------------------------------------------------------------------------------------------------------------------


def _gaussian_in_50d(n=2000, dim=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=generator, dtype=torch.float64) @ torch.randn(
        dim, 50, generator=generator, dtype=torch.float64
    )


def _sphere_in_10d(n=2000, seed=1):
    """Uniform points on the unit 2-sphere (a 2-D manifold), rotated into 10 dimensions."""
    generator = torch.Generator().manual_seed(seed)
    points = torch.randn(n, 3, generator=generator, dtype=torch.float64)
    points = points / points.norm(dim=1, keepdim=True)
    rotation, _ = torch.linalg.qr(torch.randn(10, 10, generator=generator, dtype=torch.float64))
    return points @ rotation[:3]


@pytest.mark.parametrize("discard_fraction", [0.1, 0.25, 0.5])
def test_twonn_equals_skdim(discard_fraction):
    skdim = pytest.importorskip("skdim")
    for data in (_gaussian_in_50d(n=1000), _sphere_in_10d(n=800), torch.randn(500, 8, dtype=torch.float64)):
        reference = skdim.id.TwoNN(discard_fraction=discard_fraction).fit(data.numpy()).dimension_
        assert twonn(data, discard_fraction) == pytest.approx(reference, rel=1e-9)


def test_twonn_drops_duplicates_like_skdim():
    skdim = pytest.importorskip("skdim")
    data = torch.cat([_sphere_in_10d(n=400), _sphere_in_10d(n=400)[:5]])
    with pytest.warns(UserWarning, match="Dropping 10 points"):
        ours = twonn(data)
    with pytest.warns(UserWarning):
        reference = skdim.id.TwoNN().fit(data.numpy()).dimension_
    assert ours == pytest.approx(reference, rel=1e-9)


def test_neighbour_distances_are_exact_for_near_duplicates():
    # Large offsets plus near-duplicates: the |a|^2 + |b|^2 - 2ab shortcut alone (what scikit-learn, hence skdim,
    # uses) loses r1 ~ 1e-5 entirely here; the exact re-measurement must match brute force.
    generator = torch.Generator().manual_seed(0)
    points = torch.randn(300, 50, generator=generator, dtype=torch.float64) * 30 + 100
    points = torch.cat([points, points[:30] + 1e-6 * torch.randn(30, 50, generator=generator, dtype=torch.float64)])
    brute = torch.cdist(points, points, compute_mode="donot_use_mm_for_euclid_dist")
    brute.fill_diagonal_(math.inf)
    expected = torch.topk(brute, 2, dim=1, largest=False).values
    r1, r2 = nearest_neighbour_distances(points, chunk_size=64)
    torch.testing.assert_close(r1, expected[:, 0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(r2, expected[:, 1], rtol=1e-9, atol=1e-12)
    assert r1[:30].max() < 1e-4 and r1[:30].min() > 0


def test_twonn_recovers_known_dimensions():
    assert twonn(_gaussian_in_50d()) == pytest.approx(5.0, abs=0.5)
    assert twonn(_sphere_in_10d()) == pytest.approx(2.0, abs=0.25)
    positions = torch.rand(1000, 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert twonn(positions * torch.randn(1, 7, dtype=torch.float64)) == pytest.approx(1.0, abs=0.15)  # a segment
    assert math.isfinite(twonn(_sphere_in_10d(n=300), discard_fraction=0.0))


def test_twonn_rejects_bad_input():
    with pytest.raises(ValueError, match=r"`points` must be a 2-D \(n, p\) array"):
        twonn(torch.zeros(10))
    with pytest.raises(ValueError, match="`discard_fraction` must be in"):
        twonn(torch.randn(10, 3), discard_fraction=1.0)
    with pytest.raises(ValueError, match="finite"):
        twonn(torch.full((10, 3), math.nan))


# ---------------------------------------------------------------------------------------------------------------------
# Hidden states of any causal LM
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=211,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def test_collect_hidden_states_matches_a_plain_forward(tiny_llama):
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 211, (length,), generator=generator).tolist() for length in (20, 7, 33, 12, 25)]
    states, positions = collect_hidden_states(
        tiny_llama, sequences, max_tokens=80, num_samples=30, batch_size=2, seed=3, return_positions=True
    )
    assert states.shape == (4, 30, 32) and len(positions) == 30
    pooled = [(s, p) for s, seq in enumerate(sequences) for p in range(len(seq))][:80]
    assert set(positions) <= set(pooled)  # only the first 80 tokens are in the pool
    assert "tie_last_hidden_states" not in tiny_llama.config.to_dict()  # restored
    with torch.no_grad():
        for column, (seq_idx, pos) in enumerate(positions):
            out = tiny_llama(torch.tensor([sequences[seq_idx]]), output_hidden_states=True)
            for boundary in range(3):  # entering blocks 0, 1, 2
                torch.testing.assert_close(states[boundary, column], out.hidden_states[boundary][0, pos])
            # the last boundary is before the final norm: normalising it gives the post-norm output
            normed = tiny_llama.model.norm(states[3, column])
            torch.testing.assert_close(normed, out.hidden_states[3][0, pos], rtol=1e-5, atol=1e-5)
            assert not torch.allclose(states[3, column], out.hidden_states[3][0, pos])


def test_collect_hidden_states_ignores_padding_and_is_seeded(tiny_llama):
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, 211, (length,), generator=generator).tolist() for length in (9, 14, 5)]
    left_padded = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.zeros(3, 14, dtype=torch.long)
    for row, seq in enumerate(sequences):
        left_padded[row, 14 - len(seq) :] = torch.tensor(seq)
        mask[row, 14 - len(seq) :] = 1
    from_lists = collect_hidden_states(tiny_llama, sequences, num_samples=12, seed=5)
    from_tensor = collect_hidden_states(tiny_llama, left_padded, mask, num_samples=12, seed=5)
    torch.testing.assert_close(from_lists, from_tensor)
    other_seed = collect_hidden_states(tiny_llama, sequences, num_samples=12, seed=6)
    assert not torch.equal(from_lists, other_seed)
    everything = collect_hidden_states(tiny_llama, sequences, num_samples=1000)
    assert everything.shape[1] == 28  # fewer tokens than samples: all of them
    with pytest.raises(ValueError, match="no non-padding token"):
        collect_hidden_states(tiny_llama, torch.ones(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="`num_samples` must be a positive integer"):
        collect_hidden_states(tiny_llama, sequences, num_samples=0)
    profile = intrinsic_dimension_profile(everything)
    assert len(profile) == 4 and all(math.isfinite(v) and v > 0 for v in profile)


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=211, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(config).eval(), lambda model: model.transformer.ln_f


def _tiny_latent_moe():
    if not HAS_LATENT_MOE:
        pytest.skip("LatentMoE model not built yet")
    from hf_mohd.models.configuration_latent_moe import LatentMoEConfig
    from hf_mohd.models.modeling_latent_moe import LatentMoEForCausalLM

    fields = {k: v for k, v in DICT_CONFIG.items() if k != "per_layer_config"}
    model = LatentMoEForCausalLM(
        LatentMoEConfig(**{**fields, "vocab_size": 211}, per_layer_config={1: {"mixer_type": "mlp"}})
    )
    return model.eval(), lambda model: model.model.norm


@pytest.mark.parametrize("build", [_tiny_gpt2, _tiny_latent_moe], ids=["gpt2", "latent_moe"])
def test_collect_hidden_states_of_other_architectures(build):
    torch.manual_seed(0)
    model, final_norm = build()
    sequences = [list(range(3, 30)), list(range(40, 52))]
    states, positions = collect_hidden_states(model, sequences, num_samples=10, return_positions=True)
    assert states.shape == (model.config.num_hidden_layers + 1, 10, model.config.hidden_size)
    with torch.no_grad():
        for column, (seq_idx, pos) in enumerate(positions):
            out = model(torch.tensor([sequences[seq_idx]]), output_hidden_states=True)
            torch.testing.assert_close(states[0, column], out.hidden_states[0][0, pos])
            normed = final_norm(model)(states[-1, column])
            torch.testing.assert_close(normed, out.hidden_states[-1][0, pos], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Allocation
# ---------------------------------------------------------------------------------------------------------------------

# Uniform LatentMoE from alpha = 4: D = 256, l = 64, m = 64, N = 64, K = 16, m_s = 128.
UNIFORM = alpha_transform(
    {
        "vocab_size": 128,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "moe_intermediate_size": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_shared_expert_intermediate_size": 128,
        "mlp_gated": True,
    },
    4,
)
PROFILE = [3.0, 4.0, 11.0, 13.0, 14.0, 12.0, 9.0]  # 6 blocks + the last boundary: steepest rise into block 2


def test_find_split():
    assert find_split(PROFILE[:-1]) == 2
    assert find_split([1, 2, 3, 4, 5, 30]) == 1  # the rise into block 5 is outside the first two thirds
    assert find_split([1, 5, 9, 9.5]) == 1  # ties go to the shallower split
    with pytest.raises(ValueError, match="does not rise"):
        find_split([5, 4, 3, 2])


def test_allocation_keeps_per_layer_budgets_and_writes_config_and_plot(tmp_path):
    allocation = allocate_two_regime(UNIFORM, PROFILE, multiple=16)
    assert allocation.split == 2 and allocation.layer_regimes == ("narrow",) * 2 + ("wide",) * 4
    narrow, wide, uniform = allocation.narrow, allocation.wide, allocation.uniform
    assert narrow.moe_latent_size < uniform.moe_latent_size < wide.moe_latent_size
    assert narrow.num_experts_per_tok > uniform.num_experts_per_tok > wide.num_experts_per_tok
    for shape in (narrow, wide):
        assert shape.aspect_deviation <= 0.3 and shape.moe_latent_size % 16 == 0
        assert shape.moe_intermediate_size % 16 == 0
        assert shape.num_experts / shape.num_experts_per_tok == pytest.approx(4, rel=0.05)
    # Oracle: the accounting of the written config, layer by layer, against the uniform config.
    before, after = model_accounting(UNIFORM), model_accounting(allocation.config)
    for old, new in zip(before.layers, after.layers, strict=True):
        assert new.mixer_params == pytest.approx(old.mixer_params, rel=0.05)
        assert new.mixer_flops == pytest.approx(old.mixer_flops, rel=0.05)
        assert new.all_to_all_scalars == pytest.approx(old.all_to_all_scalars, rel=0.05)
    assert after.total_params == pytest.approx(before.total_params, rel=0.05)
    assert [layer.latent_projection_params // 512 for layer in after.layers] == [narrow.moe_latent_size] * 2 + [
        wide.moe_latent_size
    ] * 4

    paths = write_allocation(allocation, str(tmp_path))
    with open(paths["plot"], "rb") as handle:
        header = handle.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width > 200 and height > 200
    with open(paths["config"]) as handle:
        written = json.load(handle)
    assert model_accounting(written).as_dict() == after.as_dict()
    assert json.load(open(paths["allocation"]))["split"] == 2
    if HAS_LATENT_MOE:
        from hf_mohd.models.configuration_latent_moe import LatentMoEConfig
        from hf_mohd.models.modeling_latent_moe import LatentMoEForCausalLM

        config = LatentMoEConfig.from_pretrained(str(tmp_path))
        assert config.per_layer_config[0].moe_latent_size == narrow.moe_latent_size
        assert config.per_layer_config[5].num_experts == wide.num_experts
        model = LatentMoEForCausalLM(config)
        assert sum(p.numel() for p in model.parameters()) == after.total_params


def test_allocation_maps_proxy_depth_and_reports_infeasible_bounds():
    deeper = {**UNIFORM, "num_hidden_layers": 12}
    allocation = allocate_two_regime(deeper, PROFILE, multiple=16)
    assert (allocation.proxy_split, allocation.split) == (2, 4)  # 2/6 of the proxy depth -> 4/12
    assert allocate_two_regime(UNIFORM, PROFILE, multiple=16, split=4).layer_regimes.count("narrow") == 4
    with pytest.raises(ValueError, match="No narrow shape .* multiples of 64"):
        allocate_two_regime(UNIFORM, PROFILE)  # l = 64 cannot shrink on a 64 grid
    with pytest.raises(ValueError, match="allocation needs a LatentMoE base"):
        allocate_two_regime({**UNIFORM, "moe_latent_size": None}, PROFILE)
    with pytest.raises(ValueError, match="`split` must be an integer in \\[1, 5\\]"):
        allocate_two_regime(UNIFORM, PROFILE, multiple=16, split=6)
    with pytest.raises(ValueError, match="layer 3: allocation starts from a uniform config, but `num_experts`"):
        allocate_two_regime({**UNIFORM, "per_layer_config": {"3": {"num_experts": 32}}}, PROFILE, multiple=16)


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def test_cli_commands(tmp_path, capsys, tiny_llama):
    standard = tmp_path / "standard.json"
    standard.write_text(json.dumps(STANDARD))
    assert cli_main(["accounting", str(standard)]) == 0
    assert json.loads(capsys.readouterr().out)["total_params"] == model_accounting(STANDARD).total_params

    assert cli_main(["alpha-transform", str(standard), "--alpha", "4", "--output", str(tmp_path / "latent")]) == 0
    written = json.loads((tmp_path / "latent" / "config.json").read_text())
    assert written == alpha_transform(STANDARD, 4)
    assert cli_main(["alpha-transform", str(standard), "--alpha", "3"]) == 6  # a config field the option cannot use
    assert f"error: {standard}: global config: `hidden_size` (512) must be divisible by alpha (3)" in (
        capsys.readouterr().err
    )

    assert cli_main(["propose-shape", "--product", "393216", "--top", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["512", "768"]

    tiny_llama.save_pretrained(tmp_path / "llama")
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([list(range(3, 40)), list(range(50, 90))]))
    profile_path = tmp_path / "profile.json"
    assert (
        cli_main(
            ["intrinsic-dim", str(tmp_path / "llama"), "--input-ids", str(ids), "--num-samples", "50"]
            + ["--output", str(profile_path)]
        )
        == 0
    )
    profile = json.loads(profile_path.read_text())
    assert profile["num_boundaries"] == 4 and profile["num_samples"] == 50
    assert profile["dropped_duplicates"][1:] == [0, 0, 0]  # only embeddings of repeated tokens can coincide
    hidden = collect_hidden_states(tiny_llama, json.loads(ids.read_text()), num_samples=50)
    assert profile["intrinsic_dimension"] == pytest.approx(intrinsic_dimension_profile(hidden), rel=1e-6)

    uniform = tmp_path / "uniform.json"
    uniform.write_text(json.dumps(UNIFORM))
    (tmp_path / "p.json").write_text(json.dumps({"intrinsic_dimension": PROFILE}))
    args = ["allocate", str(uniform), "--profile", str(tmp_path / "p.json"), "--output-dir", str(tmp_path / "out")]
    assert cli_main(args + ["--multiple", "16"]) == 0
    assert (tmp_path / "out" / "id_profile.png").is_file() and (tmp_path / "out" / "config.json").is_file()
    capsys.readouterr()
    assert cli_main(args) == 6
    assert f"error: {uniform}: No narrow shape" in capsys.readouterr().err


def test_cli_accounting_of_a_latent_moe_and_a_mohd_folder(tmp_path, capsys):
    """`hf-mohd accounting` (JSON, and `--table`) reads a saved folder of either family:
    the numbers are the config's own accounting, and the total is what the built model holds."""
    from hf_mohd import MoHDConfig, MoHDForCausalLM
    from hf_mohd.models.configuration_latent_moe import LatentMoEConfig
    from hf_mohd.models.modeling_latent_moe import LatentMoEForCausalLM

    latent = LatentMoEConfig.from_dict({**DICT_CONFIG, "mlp_bias": True})
    mohd = MoHDConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_sub_dims=8,
    )
    for name, config, model_class in (("latent", latent, LatentMoEForCausalLM), ("mohd", mohd, MoHDForCausalLM)):
        config.save_pretrained(tmp_path / name)
        assert cli_main(["accounting", str(tmp_path / name), "--context-length", "10"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed == json.loads(json.dumps(model_accounting(config, 10).as_dict()))
        assert printed["total_params"] == model_class(config).num_parameters()
        assert printed["flops_per_token"] == config.flops_per_token(10)
        assert cli_main(["accounting", str(tmp_path / name), "--table"]) == 0
        table = capsys.readouterr().out
        assert f"total parameters           {printed['total_params']:,}" in table
        assert len(table.splitlines()) == 2 + config.num_hidden_layers + 7
    assert len(printed["layers"]) == 2 and printed["fusion_params"] == 2 * 2 * 8 * 8


@pytest.mark.parametrize(
    "command, expected",
    [
        ("accounting", "2 K l"),
        ("alpha-transform", "N' = alpha N"),
        ("propose-shape", "min(l, m)"),
        ("intrinsic-dim", "TwoNN"),
        ("allocate", "id_profile.png"),
    ],
)
def test_cli_help(command, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main([command, "--help"])
    assert exit_info.value.code == 0
    assert expected in " ".join(capsys.readouterr().out.split())


def test_cli_accounting_bad_inputs_name_the_path(tmp_path, capsys):
    """`hf-mohd accounting` on a missing path, a config of the wrong type, a `--preset` on a config that is not LLaMA
    or an unknown preset: one line `error: <path>: ...` saying what was expected, with the exit status of its kind
    (3 missing, 2 bad option, 4 wrong model type, 6 bad field; no traceback)."""
    from transformers import LlamaConfig

    from hf_mohd.models.configuration_latent_moe import LatentMoEConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4).save_pretrained(
        tmp_path / "llama"
    )
    LatentMoEConfig.from_dict(DICT_CONFIG).save_pretrained(tmp_path / "latent")
    broken = json.loads((tmp_path / "llama" / "config.json").read_text())
    broken["hidden_size"] = "64"
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps(broken))
    cases = {
        str(tmp_path / "missing" / "config.json"): ([], "expected a config.json file or a model folder", 3),
        str(tmp_path / "llama"): (["--preset", "compresion_50"], "`preset` must be one of", 2),
        str(tmp_path / "latent"): (["--preset", "compression_50"], "has model_type 'latent_moe'", 4),
        str(tmp_path / "broken"): ([], r"not a loadable config \(.*hidden_size", 6),
    }
    for path, (options, expected, status) in cases.items():
        assert cli_main(["accounting", path, *options]) == status
        captured = capsys.readouterr()
        assert captured.out == ""
        assert re.match(rf"error: {re.escape(path)}: .*{expected}", captured.err, re.S), captured.err


def test_cli_eval_and_train_bad_inputs_name_the_file_or_option(tmp_path, capsys):
    """`hf-mohd eval` on a missing folder, a file, a folder without tokenizer files or an unknown task, and `hf-mohd
    train` on a missing, unparsable or invalid config or a malformed --set: one line `error: ...` naming the file or
    option and what was expected, with the exit status of its kind, before any model is loaded (no traceback)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "bad.yaml").write_text("max_steps: [1\n")
    (tmp_path / "typo.yaml").write_text("max_stepz: 3\n")
    shipped = str(Path(__file__).resolve().parents[1] / "configs" / "train" / "mohd_wiki.yaml")
    missing = str(tmp_path / "missing")
    cases = [
        (["eval", missing, "--tasks", "arc_easy"], rf"error: model folder {re.escape(missing)} does not exist", 3),
        (["eval", str(tmp_path / "file.txt")], r"error: .*file\.txt: is a file, not a model folder", 4),
        (["eval", str(tmp_path / "empty")], rf"error: {re.escape(str(tmp_path / 'empty'))}: has no config\.json", 4),
        (
            ["eval", missing, "--tasks", "arc_easy,nope"],
            r"error: --tasks: Unknown task 'nope'; known: \['arc_challenge'",
            2,
        ),
        (["train", str(tmp_path / "none.yaml")], r"error: Training config '.*none\.yaml' does not exist", 3),
        (["train", str(tmp_path / "bad.yaml")], r"error: .*bad\.yaml: cannot parse", 5),
        (["train", str(tmp_path / "typo.yaml")], r"error: .*typo\.yaml: unknown field\(s\) \['max_stepz'\]", 6),
        (["train", shipped, "--set", "max_steps"], r"error: .*mohd_wiki\.yaml: --set expects FIELD=VALUE", 2),
    ]
    for argv, expected, status in cases:
        assert cli_main(argv) == status, argv
        captured = capsys.readouterr()
        assert captured.out == "" and re.match(expected, captured.err), (argv, captured.err)
        assert "Traceback" not in captured.err and captured.err.count("\n") <= 8


@pytest.mark.parametrize("name", ["no-such-folder", "your-name/no-such"])
def test_cli_eval_offline_name_that_is_no_folder_nor_cached_hub_model(name, tmp_path, monkeypatch, capsys):
    """Offline, a model name with at most one "/" that is no local folder and no Hub model in the cache (the typo a
    new user makes) gets the one-line error, not the Hub client's traceback; a cached Hub model would pass."""
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert cli_main(["eval", name, "--tasks", "arc_easy", "--limit", "5"]) == 3
    captured = capsys.readouterr()
    assert captured.err == (
        f"error: {name} is neither a local model folder nor a Hub model in the local cache (HF_HUB_OFFLINE is set, so "
        "nothing is downloaded); expected a folder written by save_pretrained\n"
    )
