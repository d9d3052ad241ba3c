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


def test_unit_gates_make_full_activation_the_dense_source(tmp_path):
    """routed_gate="unit": a converted model at k = N_r (`set_active_sub_dims`) is its dense LLaMA source (the oracle),
    whatever its routers; at the target k the routers still get gradients (straight-through); softmax gates at
    full activation are not the source (the reason for the option)."""
    from test_conversion import VOCAB, save_tiny_llama
    from transformers import LlamaForCausalLM

    from hf_mohd.conversion import llama_to_mohd, load_dense_llama

    save_tiny_llama(tmp_path / "dense", tied=False, sharded=False)
    dense = LlamaForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float64).eval()
    source = load_dense_llama(tmp_path / "dense", dtype=torch.float64)
    input_ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = dense(input_ids=input_ids).logits
    errors = {}
    for gate in ("unit", "softmax"):
        model = llama_to_mohd(source, "compression_75", routed_gate=gate, dtype=torch.float64).eval()
        with torch.no_grad():
            for module in model.modules():
                if type(module).__name__ == "MoHDRouter":
                    module.weight.normal_(0, 0.5)  # routers that pick and weigh unevenly
            sparse = model(input_ids=input_ids).logits
            model.set_active_sub_dims(model.config.num_routed_sub_dims)
            errors[gate] = (model(input_ids=input_ids).logits - expected).abs().max().item()
        assert (sparse - expected).abs().max() > 1e-3  # the target k is a different function
        if gate == "unit":
            model.set_active_sub_dims(model.config.num_routed_sub_dims_per_tok)
            model.train()
            model(input_ids=input_ids, labels=input_ids).loss.backward()
            routers = [m.weight.grad for m in model.modules() if type(m).__name__ == "MoHDRouter"]
            assert routers and all(grad is not None and grad.abs().max() > 0 for grad in routers)
    # float64: the unit-gate error is rounding (the rotary tables are float32 in both models, as in LLaMA)
    assert errors["unit"] < 1e-6 < 1e-3 < errors["softmax"]


def test_fitted_compensation_is_the_mean_contribution_of_skipped_blocks(tmp_path):
    """`fit_dropped_block_compensation` on a 1-layer model whose FFN alone is sparse: the tables equal the
    hand-computed W[:, block j] @ mean(x_j over tokens skipping j) (input side) and W_o[block j] @ mean(h over those
    tokens) + bias (output side); zero-initialised tables change nothing; the fitted model saves and reloads."""
    from hf_mohd.conversion.compensation import fit_dropped_block_compensation
    from hf_mohd.conversion.source import ConversionError

    # attention sparse too (q and k/v of different widths), its compensation checked through the gather/masked match
    fields = dict(num_hidden_layers=1, sparse_implementation="masked", mlp_bias=True)
    plain = build(2, **fields)
    model = build(2, dropped_block_compensation=True, **fields)
    model.load_state_dict(plain.state_dict(), strict=False)
    calibration = torch.randint(3, 61, (3, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=calibration).logits, plain(input_ids=calibration).logits)

    mlp = model.model.layers[0].mlp
    captured = {}

    def keep(name, tensor):  # a hook returning None leaves the module's input and output as they are
        captured[name] = tensor.reshape(-1, tensor.shape[-1])

    hooks = [
        model.model.layers[0].post_attention_layernorm.register_forward_hook(lambda m, i, o: keep("x", o)),
        mlp.down_proj.register_forward_pre_hook(lambda m, i: keep("h", i[0])),
    ]
    with torch.no_grad():
        model(input_ids=calibration)
    for hook in hooks:
        hook.remove()
    x, h = captured["x"], captured["h"]
    with torch.no_grad():
        _, _, indices = mlp.sub_dims.router(x)
    active = torch.zeros(x.shape[0], 8, dtype=torch.bool)
    active[:, :2] = True
    active.scatter_(1, indices.reshape(x.shape[0], -1), True)
    report = fit_dropped_block_compensation(model, calibration, batch_size=2)
    assert report["tokens"] == 30 and report["inactive_share"] == pytest.approx(
        (~active[:, 2:]).double().mean().item()
    )
    s = 4
    for j in range(8):
        skipped = ~active[:, j]
        if j < 2:
            assert not skipped.any()
        mean_x = x[skipped, j * s : (j + 1) * s].mean(0) if skipped.any() else torch.zeros(s, dtype=x.dtype)
        mean_h = h[skipped].mean(0) if skipped.any() else None
        for name in ("gate_proj", "up_proj"):
            expected = getattr(mlp, name).weight[:, j * s : (j + 1) * s] @ mean_x
            torch.testing.assert_close(mlp.sub_dims.input_compensation[name][j], expected, rtol=1e-10, atol=1e-12)
        expected_out = (
            torch.zeros(s, dtype=x.dtype)
            if mean_h is None
            else mlp.down_proj.weight[j * s : (j + 1) * s] @ mean_h + mlp.down_proj.bias[j * s : (j + 1) * s]
        )
        torch.testing.assert_close(mlp.sub_dims.output_compensation[j], expected_out, rtol=1e-10, atol=1e-12)
    assert mlp.sub_dims.output_compensation[2:].abs().max() > 0
    with torch.no_grad():
        fitted = model(input_ids=calibration).logits
        assert (fitted - plain(input_ids=calibration).logits).abs().max() > 1e-4
        model.set_sparse_implementation("gather")  # the gather strategy adds the same compensation
        torch.testing.assert_close(model(input_ids=calibration).logits, fitted, rtol=1e-10, atol=1e-10)
    model.save_pretrained(tmp_path)
    reloaded = MoHDForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=calibration).logits, fitted, rtol=1e-10, atol=1e-10)
    with pytest.raises(ConversionError, match="dropped_block_compensation=True"):
        fit_dropped_block_compensation(plain, calibration)


def test_accounting_counts_the_compensation_tables():
    """With dropped-block compensation the accounting's parameter count is the built model's, and its FLOPs per
    token are what FlopCounterMode counts in a decoding step (block-major, eager attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_mohd.models.routing_cache import RoutingCache

    for sparse_modules in (["attention", "ffn"], ["ffn"]):
        model = build(2, dropped_block_compensation=True, sparse_modules=sparse_modules).to_weight_layout(
            "block_major"
        )
        assert model.config.num_parameters() == sum(p.numel() for p in model.parameters())
        plain = build(2, sparse_modules=sparse_modules)
        assert model.config.num_parameters() > plain.config.num_parameters()
        model.set_attn_implementation("eager")
        ids = torch.randint(3, 61, (1, 3), generator=torch.Generator().manual_seed(0))
        cache = RoutingCache(config=model.config)
        with torch.no_grad():
            for step in range(3):
                with FlopCounterMode(display=False) as counter:
                    model(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True)
                assert counter.get_total_flops() == model.config.flops_per_token(context_length=step + 1), step
