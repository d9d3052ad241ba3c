"""Healing pieces that keep the dense function: changing k of a loaded MoHD model (`set_active_sub_dims`).

Oracle: a model built with that k in its config, holding the same weights (the same function by construction), on
both execution strategies, for forward, the aux loss and greedy decoding.
"""

import pytest
import torch

from hf_mohd import MoHDConfig, MoHDForCausalLM


FIELDS = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    num_sub_dims=8,
    num_shared_sub_dims=2,
    num_routed_sub_dims_per_tok=2,
)


def build(k: int, **overrides) -> MoHDForCausalLM:
    torch.manual_seed(0)
    model = MoHDForCausalLM(MoHDConfig(**{**FIELDS, "num_routed_sub_dims_per_tok": k, **overrides})).double().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "router" in name:
                param.normal_(0, 0.5)
            elif "group_fusion" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def outputs(model, input_ids):
    with torch.no_grad():
        out = model(input_ids=input_ids, output_router_logits=True)
        tokens = model.generate(input_ids[:1, :3], max_new_tokens=4, do_sample=False, pad_token_id=0)
    return out.logits, out.aux_loss, tokens


@pytest.mark.parametrize("implementation", ["gather", "masked"])
@pytest.mark.parametrize("scaling", ["inverse_active", "none"])
def test_set_active_sub_dims_equals_a_model_built_with_that_k(tmp_path, implementation, scaling):
    """k = 2 -> 6 (every routed block) -> 4 -> back to 2 on one loaded model: each time the logits, aux loss and
    greedy tokens of a model whose config has that k, with the same weights; the saved config keeps its k."""
    overrides = dict(sparse_implementation=implementation, activation_scaling=scaling)
    model = build(2, **overrides)
    input_ids = torch.randint(3, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    for k in (6, 4, 2):
        model.set_active_sub_dims(k)
        assert model.active_sub_dims_per_tok == k
        oracle = build(k, **overrides)
        oracle.load_state_dict(model.state_dict())
        (logits, aux, tokens), (want_logits, want_aux, want_tokens) = (
            outputs(model, input_ids),
            outputs(oracle, input_ids),
        )
        torch.testing.assert_close(logits, want_logits, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(aux, want_aux, rtol=1e-10, atol=1e-10)
        assert torch.equal(tokens, want_tokens)
    model.set_active_sub_dims(6)
    model.save_pretrained(tmp_path)
    assert MoHDConfig.from_pretrained(tmp_path).num_routed_sub_dims_per_tok == 2


def test_set_active_sub_dims_full_activation_differs_from_the_target():
    """The test above is not vacuous: at k = N_r the function differs from k = 2 (every block now contributes)."""
    model = build(2)
    input_ids = torch.randint(3, 61, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sparse = model(input_ids=input_ids).logits
        model.set_active_sub_dims(6)
        full = model(input_ids=input_ids).logits
    assert (sparse - full).abs().max() > 1e-3


@pytest.mark.parametrize("bad", [0, 7, -1, 2.0, True, "2"])
def test_set_active_sub_dims_refuses_bad_k(bad):
    model = build(2)
    with pytest.raises(ValueError, match=r"num_routed_sub_dims_per_tok must be an int in \[1, 6\]"):
        model.set_active_sub_dims(bad)
    assert model.active_sub_dims_per_tok == 2


def test_set_active_sub_dims_needs_routers():
    model = build(0)
    with pytest.raises(ValueError, match="has no routers"):
        model.set_active_sub_dims(1)
