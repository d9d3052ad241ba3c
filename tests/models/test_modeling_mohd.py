"""MoHD model tests (fast tier, tiny configs), each against an oracle: LlamaForCausalLM, the uncached forward, a
hand-computed loss, or the saved model itself. The execution paths against each other (gather against the masked
reference): `tests/test_mohd_sparse.py`."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_mohd import MoHDConfig, MoHDForCausalLM, RoutingCache
from hf_mohd.models.accounting import model_accounting
from hf_mohd.models.configuration_mohd import MOHD_PRESETS
from hf_mohd.models.modeling_common import load_balancing_loss
from tests.utils import FAMILIES, VOCAB, input_ids, llama_config


MOHD = FAMILIES["mohd"]


def make_model(seed: int = 0, dtype=torch.float64, **overrides) -> MoHDForCausalLM:
    """A tiny MoHD model with perturbed (non-identity) fusion, non-zero biases and spread routers, in float64 (no top-k
    ties)."""
    return MOHD.spread_model(seed, dtype, **overrides)


# --- LLaMA invariant -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_all_shared_equals_llama(tied, attn_implementation):
    config = MOHD.config(
        num_shared_sub_dims=8,
        num_routed_sub_dims_per_tok=0,
        activation_scaling="none",
        group_fusion="none",
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = MoHDForCausalLM._from_config(config, attn_implementation=attn_implementation).eval()
    llama = LlamaForCausalLM._from_config(
        llama_config(tie_word_embeddings=tied), attn_implementation=attn_implementation
    ).eval()
    missing, unexpected = llama.load_state_dict(model.state_dict(), strict=False)
    assert not missing and not unexpected
    ids = input_ids()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    torch.testing.assert_close(
        model(ids, attention_mask=mask).logits, llama(ids, attention_mask=mask).logits, atol=1e-5, rtol=0
    )


def _folded_into_llama(model: MoHDForCausalLM) -> LlamaForCausalLM:
    """The LlamaForCausalLM that computes a MoHD model whose sublayers all see one fixed set of active blocks (k = 0):
    input-side weight columns outside the N_s shared blocks zeroed, output-side rows and bias outside them zeroed,
    times alpha, then mixed by the group fusion F (y = (F kron I_s) alpha mask (W x + b))."""
    config = model.config
    llama = LlamaForCausalLM(
        llama_config(
            attention_bias=config.attention_bias,
            mlp_bias=config.mlp_bias,
            tie_word_embeddings=config.tie_word_embeddings,
        )
    ).to(torch.float64)
    state = {k: v.clone() for k, v in model.state_dict().items() if "sub_dims" not in k}
    s, n_s = config.sub_dim_size, config.num_shared_sub_dims
    keep = torch.zeros(config.hidden_size, dtype=torch.float64)
    keep[: n_s * s] = 1
    alpha = config.num_sub_dims / n_s
    for idx, layer in enumerate(model.model.layers):
        for sublayer, kind, inputs, output in (
            (layer.self_attn, "self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
            (layer.mlp, "mlp", ("gate_proj", "up_proj"), "down_proj"),
        ):
            prefix = f"model.layers.{idx}.{kind}."
            for name in inputs:
                state[prefix + name + ".weight"] = state[prefix + name + ".weight"] * keep
            fusion = torch.kron(sublayer.sub_dims.group_fusion.weight.detach(), torch.eye(s, dtype=torch.float64))
            out_map = fusion @ torch.diag(alpha * keep)
            state[prefix + output + ".weight"] = out_map @ state[prefix + output + ".weight"]
            if prefix + output + ".bias" in state:
                state[prefix + output + ".bias"] = out_map @ state[prefix + output + ".bias"]
    llama.load_state_dict(state, strict=True)
    return llama.eval()


@pytest.mark.parametrize("implementation", ["gather", "masked"])
@pytest.mark.parametrize("biases", [False, True])
def test_static_sub_dimensions_equal_the_llama_they_fold_into(implementation, biases):
    """k = 0 with routed blocks present: no router, every token reads and writes the same N_s shared blocks, the
    other blocks of the residual stream carry the embedding to the LM head; logits, loss and greedy tokens equal the
    folded LlamaForCausalLM's."""
    model = make_model(
        num_shared_sub_dims=4,
        num_routed_sub_dims_per_tok=0,
        sparse_implementation=implementation,
        attention_bias=biases,
        mlp_bias=biases,
    )
    assert not any("router" in name for name, _ in model.named_parameters())
    llama = _folded_into_llama(model)
    ids = input_ids()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    out = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    expected = llama(ids, attention_mask=mask, labels=ids)
    # LLaMA's rotary tables are computed in fp32 (differences ~1e-7); a missing alpha or fusion gives ~1e-1
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-6, rtol=0)
    assert out.aux_loss is None and out.router_logits == ()
    # without group fusion the routed blocks of the residual stream carry the embedding through every layer
    unfused = make_model(num_shared_sub_dims=4, num_routed_sub_dims_per_tok=0, group_fusion="none")
    final = []
    unfused.model.norm.register_forward_pre_hook(lambda module, args: final.append(args[0]))
    hidden = unfused.model(ids, output_hidden_states=True).hidden_states  # the last one is after the final norm
    s = model.config.sub_dim_size
    for states in (*hidden[1:-1], final[0]):
        torch.testing.assert_close(states[..., 4 * s :], hidden[0][..., 4 * s :], atol=0, rtol=0)
    assert not torch.equal(final[0][..., : 4 * s], hidden[0][..., : 4 * s])
    generated = model.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(generated, llama.generate(ids[:1], max_new_tokens=5, do_sample=False))


# --- sub-dimension blocks ------------------------------------------------------------------------------------


def test_inactive_blocks_do_not_change_outputs():
    """Perturbing a weight column of a block no token selected leaves the gather-path logits unchanged."""
    model = make_model()
    ids = input_ids(batch=1, length=3)
    cache = RoutingCache(config=model.config)
    logits = model(ids, cache=cache, use_cache=True).logits
    used = set(cache.get_routing(0, "attn").indices.flatten().tolist())
    unused = sorted(set(range(3, 8)) - used)[0]
    s = model.config.sub_dim_size
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[:, unused * s : (unused + 1) * s] += 1.0
    torch.testing.assert_close(model(ids).logits, logits, atol=0, rtol=0)


def test_activation_scaling_and_fusion_values():
    model = make_model()
    sub_dims = model.model.layers[0].mlp.sub_dims
    assert sub_dims.activation_scale == 8 / 5  # N / (N_s + k)
    assert make_model(activation_scaling="none").model.layers[0].mlp.sub_dims.activation_scale == 1.0
    torch.manual_seed(0)
    fresh = MoHDForCausalLM(MOHD.config())
    torch.testing.assert_close(fresh.model.layers[1].self_attn.sub_dims.group_fusion.weight, torch.eye(8))


# --- load-balance loss --------------------------------------------------------------------------------------


def test_load_balancing_loss_hand_computed():
    # 3 tokens, 3 routed blocks, k = 1; token 2 is padding.
    logits = torch.tensor([[0.0, math.log(3.0), 0.0], [math.log(2.0), 0.0, 0.0], [5.0, 0.0, 0.0]], dtype=torch.float64)
    # softmax rows: [0.2, 0.6, 0.2], [0.5, 0.25, 0.25]; picks: block 1, block 0.
    # f = [1/2, 1/2, 0], P = [0.35, 0.425, 0.225]; L = 3 * (0.175 + 0.2125) = 1.1625
    loss = load_balancing_loss((logits,), top_k=1, attention_mask=torch.tensor([[1, 1, 0]]))
    assert loss.item() == pytest.approx(1.1625, abs=1e-12)
    # Two routers: the mean of the per-router losses. Uniform logits with tie-break to block 0: f = [1, 0, 0].
    uniform = torch.zeros(2, 3, dtype=torch.float64)
    loss2 = load_balancing_loss((logits[:2], uniform), top_k=1)
    assert loss2.item() == pytest.approx((1.1625 + 3 * (1.0 * 1 / 3)) / 2, abs=1e-12)


def test_model_aux_loss_enters_loss():
    model = make_model(router_aux_loss_coef=0.5)
    ids = input_ids()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    out = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    assert len(out.router_logits) == 2 * model.config.num_hidden_layers
    expected_aux = load_balancing_loss(out.router_logits, 2, mask)
    torch.testing.assert_close(out.aux_loss, expected_aux)
    plain = model(ids, attention_mask=mask, labels=ids)
    assert plain.aux_loss is None
    torch.testing.assert_close(out.loss, plain.loss + 0.5 * expected_aux.to(plain.loss.dtype))


# --- configuration, presets, accounting ---------------------------------------------------------------------


def test_presets_match_design_table():
    base = LlamaConfig(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=2, num_attention_heads=8, vocab_size=1000
    )
    expected = {
        "compression_50": (512, 16, 6, 2),
        "compression_75": (512, 16, 9, 3),
        "expansion_x2": (1024, 16, 6, 2),
        "expansion_x3": (1536, 24, 6, 2),
        "expansion_x4": (2048, 32, 6, 2),
    }
    assert set(MOHD_PRESETS) == set(expected)
    dense = model_accounting(base)
    for preset, (width, n, n_shared, k) in expected.items():
        config = MoHDConfig.from_llama_config(base, preset)
        assert (
            config.hidden_size,
            config.num_sub_dims,
            config.num_shared_sub_dims,
            config.num_routed_sub_dims_per_tok,
        ) == (width, n, n_shared, k)
        assert (config.head_dim, config.num_attention_heads, config.intermediate_size) == (64, 8, 1376)
        active_width = config.num_active_sub_dims * config.sub_dim_size
        assert active_width == (512 if preset.startswith("expansion") else 512 * (n_shared + k) // n)
        if preset.startswith("expansion"):
            # constant activated attention + FFN parameters; only routers, fusion and the wider norms add
            cost = model_accounting(config)
            routers, fusion, norms = 2 * (n - n_shared) * width, 2 * n * n, 2 * (width - 512)
            extra = 2 * (routers + fusion + norms) + (width - 512)
            assert cost.activated_decoder_params - dense.activated_decoder_params == extra
            assert cost.embedding_params == width * 1000
    with pytest.raises(ValueError, match="`preset`"):
        MoHDConfig.from_llama_config(base, "compression_10")


def _activated_from_modules(model) -> int:
    """Parameters one token reads, counted on the built modules: in a sparsified sublayer n_a / N of the columns of
    q/k/v and gate/up (their biases whole) and of the rows of o_proj and down_proj (and of their biases), all of the
    router and fusion; everything else whole; the LM head (tied or not), not the embedding lookup."""
    config = model.config
    n, n_active = config.num_sub_dims, config.num_active_sub_dims
    sparse = set(config.sparse_modules) if config.num_routed_sub_dims else set()
    total = sum(p.numel() for p in model.model.norm.parameters()) + model.lm_head.weight.numel()
    for layer in model.model.layers:
        total += sum(
            p.numel() for p in (*layer.input_layernorm.parameters(), *layer.post_attention_layernorm.parameters())
        )
        for name, sublayer, inputs, outputs in (
            ("attention", layer.self_attn, ("q_proj", "k_proj", "v_proj"), ("o_proj",)),
            ("ffn", layer.mlp, ("gate_proj", "up_proj"), ("down_proj",)),
        ):
            frac = (n_active, n) if name in sparse else (1, 1)
            for proj in inputs:
                linear = getattr(sublayer, proj)
                total += linear.weight.numel() * frac[0] // frac[1] + (
                    0 if linear.bias is None else linear.bias.numel()
                )
            for proj in outputs:
                linear = getattr(sublayer, proj)
                total += sum(p.numel() * frac[0] // frac[1] for p in linear.parameters())
            if hasattr(sublayer, "sub_dims"):
                total += sum(p.numel() for p in sublayer.sub_dims.parameters())
    return total


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
        {"sparse_modules": ["ffn"], "group_fusion": "none"},
        {"num_shared_sub_dims": 8, "num_routed_sub_dims_per_tok": 0, "mlp_bias": True},
        {"num_shared_sub_dims": 4, "num_routed_sub_dims_per_tok": 0, "attention_bias": True},
    ],
)
def test_accounting_matches_built_model(overrides):
    config = MOHD.config(**overrides)
    model = MoHDForCausalLM(config)
    cost = config.accounting(context_length=16)
    assert cost == model_accounting(config, 16) and cost.total_params == config.num_parameters()
    assert config.num_parameters() == model.num_parameters() == sum(p.numel() for p in model.parameters())
    assert config.num_active_parameters() == _activated_from_modules(model) == cost.activated_params
    assert config.decode_weight_bytes_per_token(2) == 2 * cost.activated_params
    d, n_active, n = 64, 5, 8
    # hand count, no biases case: q 64x64, k/v 64x32 each, o 64x64; mlp 3 x 64x96
    if not overrides:
        attn_in, attn_out, mlp = 64 * (64 + 32 + 32), 64 * 64, 3 * 64 * 96
        routers, fusion, norms = 2 * 5 * 64, 2 * 64, 2 * d
        per_layer = (attn_in + attn_out + mlp) * n_active // n + routers + fusion + norms
        assert cost.activated_decoder_params == 2 * per_layer + d
        flops = 2 * ((attn_in + attn_out + mlp) * n_active // n + routers + 2 * n * d) + 4 * 64 * 16
        assert cost.decoder_flops_per_token == 2 * flops
        assert cost.flops_per_token == 2 * flops + 2 * VOCAB * d == config.flops_per_token(16)
        assert (cost.router_params, cost.fusion_params) == (2 * routers, 2 * fusion)


@pytest.mark.parametrize("overrides", [{}, {"sparse_modules": ["attention"], "attention_bias": True}])
def test_flops_per_token_equal_counted_matmuls_of_each_decoding_step(overrides):
    """FLOPs of each cached decoding step of the gather path (one token, which reads only its active blocks), as
    torch's FlopCounterMode counts its matmuls, are the accounting's FLOPs per token at a context of the t keys
    cached so far plus its own (eager attention). A decoding loop of forward calls stores the weights block-major
    first, as `generate` does."""
    from torch.utils.flop_counter import FlopCounterMode

    model = make_model(sparse_implementation="gather", **overrides).to_weight_layout("column_major")
    model.set_attn_implementation("eager")
    ids = input_ids(batch=1, length=4)
    cache = RoutingCache(config=model.config)
    with torch.no_grad():
        for step in range(ids.shape[1]):
            with FlopCounterMode(display=False) as counter:
                model(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True)
            assert counter.get_total_flops() == model.config.flops_per_token(context_length=step + 1), step


def test_llama_config_accounting_equals_llama_model():
    """A `LlamaConfig` goes through the same accounting (every block shared): LlamaForCausalLM's parameters, and
    the FLOPs FlopCounterMode counts in a forward of T tokens with eager attention, per token."""
    from torch.utils.flop_counter import FlopCounterMode

    for overrides in ({}, {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}):
        config = llama_config(**overrides)
        config._attn_implementation = "eager"
        model = LlamaForCausalLM(config).eval()
        cost = model_accounting(config, context_length=5)
        assert cost.total_params == model.num_parameters() == sum(p.numel() for p in model.parameters())
        assert cost.activated_decoder_params == cost.decoder_params  # dense: a token reads the whole decoder
        assert (cost.router_params, cost.fusion_params, cost.all_to_all_scalars) == (0, 0, 0)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(input_ids=input_ids(batch=1, length=5), use_cache=False)
        assert counter.get_total_flops() == 5 * cost.flops_per_token
