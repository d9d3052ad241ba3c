"""LatentMoE <-> Nemotron-H interop, against transformers' own `NemotronHForCausalLM` as the oracle (docs/design.md
section 4, "Interop"): exported folders load there with equal logits and generations, Nemotron-H checkpoints of the
alternating form import with equal logits, and other patterns fail with a clear error."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, NemotronHConfig, NemotronHForCausalLM

from hf_mohd import LatentMoEForCausalLM
from hf_mohd.cli import main as cli_main
from hf_mohd.interop import NemotronHInteropError, export_to_nemotron_h, import_from_nemotron_h
from tests.utils import FAMILIES, VOCAB, input_ids


LATENT_MOE = FAMILIES["latent_moe"]
# Overrides of the family's tiny config: the choices Nemotron-H can express (no RoPE, a non-gated relu2 MLP, sigmoid
# routing), width 32 in heads of 8, three layers of which layer 0 is dense
NEMOTRON_STYLE = dict(
    LATENT_MOE.defaults("max_position_embeddings"),
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    head_dim=8,
    hidden_act="relu2",
    mlp_gated=False,
    router_score_func="sigmoid",
    position_embedding_type="none",
    routed_scaling_factor=2.0,
    per_layer_config={0: {"mixer_type": "mlp"}},
)


def latent_moe_model(seed=0, **overrides) -> LatentMoEForCausalLM:
    """float32, transformers' grouped experts kernel (Nemotron-H's default, so that logits compare bit for bit);
    routers and their correction biases spread."""
    model = LATENT_MOE.build(
        seed, torch.float32, experts_implementation="grouped_mm", **{**NEMOTRON_STYLE, **overrides}
    )
    with torch.no_grad():
        for router in model.routers():
            router.weight.normal_(0, 0.5)  # spread scores: no near-ties between the two routers' top-K
            if router.e_score_correction_bias is not None:
                router.e_score_correction_bias.normal_(0, 0.2)
    return model


def nemotron_h_model(blocks, latent_size=8, seed=0) -> NemotronHForCausalLM:
    config = NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        layers_block_type=blocks,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=40,
        n_routed_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=12,
        moe_latent_size=latent_size,
        moe_shared_expert_intermediate_size=20,
        routed_scaling_factor=1.5,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("from_folder", [False, True])
def test_export_loads_in_transformers_nemotron_h_with_equal_logits(tmp_path, from_folder):
    model = latent_moe_model()
    source = tmp_path / "latent"
    model.save_pretrained(source)
    (source / "tokenizer_config.json").write_text("{}")
    export_to_nemotron_h(source if from_folder else model, tmp_path / "nemotron")
    config = json.loads((tmp_path / "nemotron" / "config.json").read_text())
    assert config["model_type"] == "nemotron_h" and "auto_map" not in config
    assert config["layers_block_type"] == ["full_attention", "mlp", "full_attention", "moe", "full_attention", "moe"]
    assert (tmp_path / "nemotron" / "tokenizer_config.json").exists() == from_folder
    nemotron = NemotronHForCausalLM.from_pretrained(tmp_path / "nemotron").eval()
    ids = input_ids()
    torch.testing.assert_close(nemotron(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(nemotron.generate(ids, **kwargs), model.generate(ids, **kwargs))


@pytest.mark.parametrize("latent_size", [8, None])
def test_import_nemotron_h_checkpoint_with_equal_logits(tmp_path, latent_size):
    blocks = ["full_attention", "moe", "full_attention", "mlp", "full_attention", "moe"]
    nemotron = nemotron_h_model(blocks, latent_size)
    nemotron.save_pretrained(tmp_path / "nemotron")
    model = import_from_nemotron_h(tmp_path / "nemotron", tmp_path / "latent")
    assert [c.mixer_type for c in model.config.per_layer_config] == ["moe", "mlp", "moe"]
    assert model.model.layers[0].mlp.experts.up_proj.shape == (6, 12, latent_size or 32)
    ids = input_ids()
    expected = nemotron(ids).logits
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=0)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "latent").eval()
    assert type(reloaded) is LatentMoEForCausalLM
    torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=0)
    # And back: exporting the imported model gives Nemotron-H's weights, bit for bit.
    export_to_nemotron_h(reloaded, tmp_path / "again")
    again = NemotronHForCausalLM.from_pretrained(tmp_path / "again")
    for (name, a), (_, b) in zip(nemotron.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "blocks, message",
    [
        (["linear_attention", "moe", "full_attention", "moe"], r"layers_block_type\[0\].*Mamba"),
        (["full_attention", "full_attention", "moe", "mlp"], r"layers_block_type\[1\]"),
        (["moe", "full_attention"], r"layers_block_type\[0\]"),
        (["full_attention", "moe", "full_attention"], r"pairs"),
    ],
)
def test_import_other_patterns_raise(tmp_path, blocks, message):
    NemotronHConfig(layers_block_type=blocks, hidden_size=32, vocab_size=VOCAB).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        import_from_nemotron_h(tmp_path)
    assert cli_main(["nemotron-h", "import", str(tmp_path), str(tmp_path / "out")]) == 6  # a config field


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"position_embedding_type": "rope"}, "position_embedding_type"),
        ({"mlp_gated": True, "hidden_act": "silu"}, "mlp_gated"),
        ({"router_score_func": "softmax"}, "router_score_func"),
        ({"attention_bias": True}, "attention_bias"),
        ({"moe_shared_expert_intermediate_size": 0}, "moe_shared_expert_intermediate_size"),
        ({"per_layer_config": {1: {"moe_latent_size": 16}}}, "moe_latent_size"),
        ({"per_layer_config": {0: {"mixer_type": "mlp"}, 2: {"num_experts": 4}}}, "num_experts"),
    ],
)
def test_export_of_non_nemotron_choices_raises(tmp_path, overrides, field):
    model = latent_moe_model(**overrides)
    with pytest.raises(NemotronHInteropError, match=f"`{field}`"):
        export_to_nemotron_h(model, tmp_path / "out")


def test_cli_export_and_import(tmp_path):
    model = latent_moe_model(per_layer_config=None)
    model.save_pretrained(tmp_path / "latent")
    assert cli_main(["export", "nemotron-h", str(tmp_path / "latent"), str(tmp_path / "nemotron")]) == 0
    assert cli_main(["export", "nemotron-h", str(tmp_path / "latent"), str(tmp_path / "nemotron")]) == 8  # exists
    assert cli_main(["nemotron-h", "import", str(tmp_path / "nemotron"), str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = input_ids()
    torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
