"""Model cards: rendered metadata is valid Hub metadata, eval results round-trip through the model-index format."""

import filecmp
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results

from hf_mohd import MoHDConfig
from hf_mohd.lora import lora_targets
from hf_mohd.model_card import lm_eval_to_eval_results, render_model_card
from hf_mohd.models.accounting import model_accounting


REPO_ROOT = Path(__file__).resolve().parents[1]

# The shape of `lm_eval.simple_evaluate(...)` output / the CLI's results_*.json (lm-eval 0.4.13).
LM_EVAL_OUTPUT = {
    "results": {
        "arc_easy": {
            "alias": "arc_easy",
            "acc,none": 0.625,
            "acc_stderr,none": 0.02,
            "acc_norm,none": 0.5,
            "acc_norm_stderr,none": 0.03,
            "name": "arc_easy",
            "sample_len": 2376,
        },
        "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.125, "exact_match_stderr,strict-match": "N/A"},
    },
    "configs": {
        "arc_easy": {
            "task": "arc_easy",
            "dataset_path": "allenai/ai2_arc",
            "dataset_name": "ARC-Easy",
            "test_split": "test",
        },
        "gsm8k": {"task": "gsm8k", "dataset_path": "openai/gsm8k", "dataset_name": "main", "test_split": "test"},
    },
}


def tiny_mohd_config(**kw):
    return MoHDConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, **kw
    )


def test_template_copy_for_readers_is_identical_to_package_data():
    package = REPO_ROOT / "hf_mohd" / "model_cards" / "model_card_template.md"
    readers = REPO_ROOT / "model_cards" / "model_card_template.md"
    assert filecmp.cmp(package, readers, shallow=False), f"{readers} drifted from {package}: copy it again"


def test_lm_eval_results_convert_to_model_index_entries():
    results = lm_eval_to_eval_results(LM_EVAL_OUTPUT)
    got = {(r.dataset_name, r.metric_type, r.metric_name, r.metric_value) for r in results}
    assert got == {
        ("arc_easy", "acc", "acc", 0.625),
        ("arc_easy", "acc_norm", "acc_norm", 0.5),
        ("gsm8k", "exact_match", "exact_match (strict-match)", 0.125),
    }
    arc = next(r for r in results if r.metric_type == "acc")
    assert (arc.dataset_type, arc.dataset_config, arc.dataset_split) == ("allenai/ai2_arc", "ARC-Easy", "test")
    with pytest.raises(ValueError, match="no numeric lm-eval metric"):
        lm_eval_to_eval_results({"results": {"t": {"alias": "t", "acc_stderr,none": 0.1}}})


def test_rendered_mohd_card_metadata_is_valid_and_round_trips():
    config = tiny_mohd_config()
    card = render_model_card(
        config,
        base_model="HuggingFaceTB/SmolLM2-135M",
        datasets=["wikitext", "gensim enwiki sample (CC BY-SA 3.0)"],
        eval_results=LM_EVAL_OUTPUT,
        training={"steps": 100, "learning_rate": 3e-4},
        notes="Converted for a test.",
        repo_id="someone/mohd-tiny",
    )
    # Re-parse the text as the Hub does: metadata must survive, with the model-index intact.
    reparsed = ModelCard(str(card))
    data = reparsed.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation"
    assert data["base_model"] == ["HuggingFaceTB/SmolLM2-135M"]
    assert data["datasets"] == ["wikitext"]  # free-form descriptions stay in the text only
    assert {"hf-mohd", "mohd", "custom_code"} <= set(data["tags"])
    name, eval_results = model_index_to_eval_results(data["model-index"])
    assert name == "mohd-tiny"
    assert sorted((r.metric_type, r.metric_value) for r in eval_results) == [
        ("acc", 0.625),
        ("acc_norm", 0.5),
        ("exact_match", 0.125),
    ]
    # Body: parameter accounting, sparsity settings, how to load, limits.
    acc = model_accounting(config)
    text = reparsed.text
    assert f"| total parameters | {acc.total_params:,} |" in text
    assert f"| activated parameters | {acc.activated_params:,} |" in text
    assert "| `num_routed_sub_dims_per_tok` | 2 |" in text
    assert 'from_pretrained("someone/mohd-tiny", trust_remote_code=True)' in text
    assert "gensim enwiki sample (CC BY-SA 3.0)" in text and "## Intended use and limitations" in text
    assert "| arc_easy | acc | 0.6250 |" in text


def test_card_parameter_counts_match_the_built_model():
    from hf_mohd import MoHDForCausalLM

    model = MoHDForCausalLM(tiny_mohd_config())
    card = render_model_card(model)
    assert f"| total parameters | {model.num_parameters():,} |" in card.text
    assert "model-index" not in card.data.to_dict()  # no eval results given, no empty model-index


def test_lora_targets_exclude_routers():
    modules, parameters = lora_targets(tiny_mohd_config())
    assert modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert parameters == [] and not any("router" in m or "fusion" in m for m in modules)


def test_mohd_card_lists_per_layer_budgets():
    """A MoHD model with per-layer budgets lists them, and its activated parameters are the accounting's."""
    from hf_mohd import MoHDConfig

    config = MoHDConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_sub_dims=8,
        num_shared_sub_dims=2,
        per_layer_config={1: {"ffn_routed_sub_dims_per_tok": 4}},
    )
    card = str(render_model_card(config))
    assert "| `per_layer_config` | 1: {'ffn_routed_sub_dims_per_tok': 4} |" in card
    assert f"| activated parameters | {config.num_active_parameters():,} |" in card
    uniform = MoHDConfig(**{**config.to_dict(), "per_layer_config": None})
    assert config.num_active_parameters() > uniform.num_active_parameters()


def test_latent_moe_card_reports_config_accounting_and_expert_targets():
    from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM

    config = LatentMoEConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_latent_size=16,
        per_layer_config={0: {"mixer_type": "mlp"}},
    )
    model = LatentMoEForCausalLM(config)
    card = ModelCard(str(render_model_card(model, repo_id="someone/latent-tiny", eval_results=LM_EVAL_OUTPUT)))
    data = card.data.to_dict()
    assert {"latent-moe", "moe", "custom_code"} <= set(data["tags"])
    assert model_index_to_eval_results(data["model-index"])[0] == "latent-tiny"
    assert config.num_active_parameters() < config.num_parameters() == model.num_parameters()
    assert f"| total parameters | {model.num_parameters():,} |" in card.text
    assert f"| activated parameters | {config.num_active_parameters():,} |" in card.text
    assert "| `moe_latent_size` | 16 |" in card.text
    assert "| `per_layer_config` | 0: {'mixer_type': 'mlp'} |" in card.text
    assert "target_parameters=['experts.gate_up_proj', 'experts.down_proj']" in card.text
