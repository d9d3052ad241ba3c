"""LatentMoE model tests (fast tier, tiny configs), each against an oracle: transformers' NemotronHMoE and
MixtralSparseMoeBlock on the same weights, the eager experts path, a per-token reference MoE, the uncached forward,
hand-computed losses and bias updates, the parameters actually built, the parallel plans written out by hand, or the
saved model itself."""

import math

import pytest
import torch
from torch import nn
from transformers import MixtralConfig, NemotronHConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

from hf_mohd import LatentMoEForCausalLM, RoutingRecord
from hf_mohd.models.modeling_common import MLP
from hf_mohd.models.modeling_latent_moe import (
    LatentMoEBlock,
    LatentMoEExperts,
    LatentMoERouter,
    LatentMoEUngatedExperts,
    dense_masked_experts_forward,
)
from tests.utils import FAMILIES, gradients, input_ids


LATENT_MOE = FAMILIES["latent_moe"]
# The tiny model of this file, on the family's fields: width 32, three layers. Layer 0 dense, layer 1 uniform
# LatentMoE (the family's fields), layer 2 a standard MoE with its own N, K, m and no shared expert.
TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    per_layer_config={
        0: {"mixer_type": "mlp"},
        2: {
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 12,
            "moe_latent_size": None,
            "moe_shared_expert_intermediate_size": 0,
        },
    },
)


def latent_config(**overrides):
    return LATENT_MOE.config(**{**TINY, **overrides})


def make_model(seed: int = 0, dtype=torch.float64, **overrides) -> LatentMoEForCausalLM:
    """The tiny heterogeneous model; float64 with eager experts (no top-k ties, no grouped_mm kernel) unless
    `experts_implementation` says otherwise; routers spread, random biases."""
    return LATENT_MOE.spread_model(seed, dtype, **{**TINY, **overrides})


# --- layer oracles -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mlp_gated", [True, False])
@pytest.mark.parametrize("router_score_func", ["softmax", "sigmoid"])
def test_experts_implementations_agree_in_logits_and_gradients(mlp_gated, router_score_func):
    overrides = dict(mlp_gated=mlp_gated, router_score_func=router_score_func, mlp_bias=True)
    if not mlp_gated:
        overrides["hidden_act"] = "relu2"
    ids = input_ids()
    results = {}
    for implementation in ("eager", "batched_mm", "grouped_mm", "dense_masked"):
        model = make_model(dtype=torch.float32, experts_implementation=implementation, **overrides)
        assert model.config._experts_implementation == implementation
        logits = model(ids).logits
        logits.square().mean().backward()
        results[implementation] = (logits, {n: g for n, g in gradients(model).items() if "experts" in n})
    reference_logits, reference_grads = results["eager"]
    for implementation in ("batched_mm", "grouped_mm", "dense_masked"):
        logits, grads = results[implementation]
        torch.testing.assert_close(logits, reference_logits, atol=1e-5, rtol=1e-4)
        assert grads.keys() == reference_grads.keys()
        for name, grad in reference_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=f"{implementation} {name}")


def test_dense_masked_experts_equal_the_eager_loop_in_float64_here_and_in_mixtral():
    """`dense_masked` (every expert on every token, weighted by the routing weight or 0) is the eager loop's sum to
    float64 rounding, gradients included, on LatentMoE (latent and full width, with biases) and on transformers'
    Mixtral (its own experts layout), and drops expert-parallel off-rank ids (>= E) as the loop does."""
    from transformers import MixtralForCausalLM

    ids = input_ids()
    for overrides in ({"mlp_bias": True}, {"mlp_bias": False, "moe_latent_size": None}):
        results = []
        for implementation in ("eager", "dense_masked"):
            model = make_model(experts_implementation=implementation, **overrides)
            logits = model(ids).logits
            logits.square().mean().backward()
            results.append((logits, {n: g for n, g in gradients(model).items() if "mlp" in n}))
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-12, rtol=1e-10)
        for name, grad in results[0][1].items():
            torch.testing.assert_close(results[1][1][name], grad, atol=1e-12, rtol=1e-10, msg=name)
    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    mixtral = MixtralForCausalLM(config).double().eval()
    mixtral.set_experts_implementation("eager")  # the grouped_mm kernel takes no float64
    reference = mixtral(ids % 64).logits
    mixtral.set_experts_implementation("dense_masked")
    torch.testing.assert_close(mixtral(ids % 64).logits, reference, atol=1e-12, rtol=1e-10)
    experts = mixtral.model.layers[0].mlp.experts
    states = torch.randn(5, 32, dtype=torch.float64)
    index, weight = torch.tensor([[0, 6]] * 5), torch.rand(5, 2, dtype=torch.float64)  # 6: another rank's expert
    alone = dense_masked_experts_forward(experts, states, index[:, :1], weight[:, :1])
    torch.testing.assert_close(dense_masked_experts_forward(experts, states, index, weight), alone)


@pytest.mark.parametrize("read", ["native", "embedding_bag"])
@pytest.mark.parametrize("mlp_gated", [True, False])
def test_gather_experts_read_only_the_picked_experts_and_equal_the_eager_loop(mlp_gated, read, tmp_path, monkeypatch):
    """The gather kernel's direct read (few tokens, no autograd, column-major layout; the native kernels of
    `native_gather`, or two `embedding_bag` calls where they are not built) is the eager loop's sum to float64
    rounding at 1 to 8 tokens; with more tokens it takes the dense masked form when tokens pick at least a quarter of
    the experts on CPU (else the grouped kernel); `generate` stores the column-major layout, gives the eager model's greedy
    tokens, and the model still saves and reloads to the same logits."""
    from hf_mohd.models import modeling_latent_moe
    from hf_mohd.models.native_gather import native_gather

    native_calls = []
    if read == "native":
        kernels = native_gather()
        assert kernels is not None, "the native gather kernels did not build (see the logged reason)"

        class Spy:
            def __getattr__(self, name):
                native_calls.append(name)
                return getattr(kernels, name)

        monkeypatch.setattr(modeling_latent_moe, "native_gather", Spy)
    else:
        monkeypatch.setattr(modeling_latent_moe, "native_gather", lambda: None)
    overrides = dict(mlp_gated=mlp_gated, mlp_bias=False)
    if not mlp_gated:
        overrides["hidden_act"] = "relu2"
    reference = make_model(experts_implementation="eager", **overrides)
    model = make_model(experts_implementation="gather", **overrides)
    calls = []
    original = modeling_latent_moe.dense_masked_experts_forward

    def spy(module, *args):
        calls.append(module.num_experts)
        return original(module, *args)

    with torch.no_grad():
        for tokens in (1, 4, 8, 9):
            ids = input_ids(batch=1, length=tokens)
            model.to_weight_layout("column_major" if tokens <= 8 else "row_major")
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(modeling_latent_moe, "dense_masked_experts_forward", spy)
                logits = model(ids).logits
            torch.testing.assert_close(logits, reference(ids).logits, atol=1e-12, rtol=1e-10)
            # 9 tokens on CPU: both MoE layers (K = 2 of 8, 3 of 6: at least a quarter) take the dense masked form
            assert calls == ([] if tokens <= 8 else [8, 6]), (tokens, calls)
            calls.clear()
            # native: both layers' up and down products at 1-8 tokens, none at 9
            assert len(native_calls) == (4 if read == "native" and tokens <= 8 else 0), (tokens, native_calls)
            native_calls.clear()
    model.to_weight_layout("row_major")
    experts = model.model.layers[1].mlp.experts
    assert not modeling_latent_moe.experts_column_major(experts)
    prompt = input_ids(batch=1, length=5)
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert modeling_latent_moe.experts_column_major(experts)
    expected = reference.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, expected)
    model.save_pretrained(tmp_path / "saved")
    reloaded = LatentMoEForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float64)
    reloaded.set_experts_implementation("eager")
    torch.testing.assert_close(reloaded(prompt).logits, reference(prompt).logits, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match=r"`layout` must be one of \('column_major', 'row_major'\), got 'decoding'"):
        model.to_weight_layout("decoding")
    # an expert-parallel off-rank id (>= E, weight 0 in transformers' AllReduceEP) adds nothing; transformers marks
    # experts it has split (`MoEParamShard` sets `_is_expert_parallel`), and only those check the ids
    states = torch.randn(2, experts.hidden_dim, dtype=torch.float64)
    index, weight = torch.tensor([[0, 5], [8, 1]]), torch.rand(2, 2, dtype=torch.float64)
    model.to_weight_layout("column_major")
    experts._is_expert_parallel = True
    with torch.no_grad():
        torch.testing.assert_close(
            modeling_latent_moe.gather_experts_forward(experts, states, index, weight),
            LatentMoEExperts.forward.__wrapped__(experts, states, index, weight),
        )


def test_layout_check_from_strides_agrees_with_torch():
    """`stored_transposed` (host-side, from the strides) says what `weight.transpose(1, 2).is_contiguous()` says, size-1
    dimensions (any stride) included, for weights stored either way and for a strided slice."""
    from hf_mohd.models.modeling_latent_moe import stored_transposed

    for shape in [(4, 6, 5), (1, 6, 5), (4, 1, 5), (4, 6, 1), (1, 1, 1)]:
        plain = torch.empty(shape)
        transposed = torch.empty(shape[0], shape[2], shape[1]).transpose(1, 2)
        sliced = torch.empty(shape[0], shape[2], 2 * shape[1]).transpose(1, 2)[:, ::2]
        for weight in (plain, transposed, sliced):
            assert stored_transposed(weight) == weight.transpose(1, 2).is_contiguous(), (shape, weight.stride())
    assert stored_transposed(torch.empty(4, 5, 6).transpose(1, 2)) and not stored_transposed(torch.empty(4, 6, 5))


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_experts_honour_a_kernel_registered_globally(implementation):
    """A kernel registered with `ExpertsInterface.register` after import (as transformers' kernels integration does)
    runs LatentMoE's experts, as it runs Mixtral's: the registered function is called with the experts module and its
    result is the layer's output; unregistering restores transformers' own kernel (same logits as before)."""
    from transformers.integrations.moe import ExpertsInterface

    model = make_model(dtype=torch.float32, experts_implementation=implementation, mlp_bias=False)
    ids = input_ids()
    before = model(ids).logits
    original = ExpertsInterface._global_mapping[implementation]
    calls = []

    def kernel(module, hidden_states, top_k_index, top_k_weights):
        calls.append(type(module).__name__)
        return 2 * original(module, hidden_states, top_k_index, top_k_weights)

    ExpertsInterface.register(implementation, kernel)
    try:
        doubled = model(ids).logits
    finally:
        ExpertsInterface.register(implementation, original)
    moe_layers = sum(layer.mixer_type == "moe" for layer in model.config.per_layer_config)
    assert calls == ["LatentMoEExperts"] * moe_layers
    assert (doubled - before).abs().max() > 1e-3  # the kernel's output reached the logits
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


def _nemotron_pair(latent_size):
    nemotron_config = NemotronHConfig(
        hidden_size=32,
        layers_block_type=["moe"],
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        moe_latent_size=latent_size,
        moe_shared_expert_intermediate_size=24,
        mlp_hidden_act="relu2",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_group=1,
        topk_group=1,
    )
    nemotron_config._experts_implementation = "eager"
    config = latent_config(
        num_hidden_layers=1,
        num_experts_per_tok=3,
        moe_latent_size=latent_size,
        per_layer_config=None,
        hidden_act="relu2",
        mlp_gated=False,
        router_score_func="sigmoid",
        routed_scaling_factor=2.5,
        position_embedding_type="none",
    )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    ours = LatentMoEBlock(config, layer_idx=0).double()
    theirs = NemotronHMoE(nemotron_config).double()
    with torch.no_grad():
        for param in ours.parameters():
            param.normal_(0, 0.3)
        ours.gate.e_score_correction_bias.normal_(0, 0.3)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and not unexpected
    return ours, theirs


@pytest.mark.parametrize("latent_size", [8, None])
def test_block_equals_nemotron_h_moe(latent_size):
    ours, theirs = _nemotron_pair(latent_size)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    # Same experts picked; NemotronHTopkRouter always computes its logits in fp32, hence fp32-level gate agreement.
    _, our_weights, our_indices = ours.gate(x)
    _, their_weights, their_indices = theirs.gate(x)
    their_order = their_indices.sort(-1)
    assert torch.equal(our_indices.reshape(14, 3).sort(-1).values, their_order.values)
    our_gates = our_weights.reshape(14, 3).gather(-1, our_indices.reshape(14, 3).sort(-1).indices)
    torch.testing.assert_close(our_gates, their_weights.gather(-1, their_order.indices).double(), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
    # The correction bias changes which experts are picked (and nothing else): without it the output differs.
    unbiased = theirs.gate.e_score_correction_bias.clone()
    with torch.no_grad():
        ours.gate.e_score_correction_bias.zero_()
    assert not torch.allclose(ours(x), theirs(x))
    _, weights, indices = theirs.gate(x)
    assert unbiased.abs().sum() > 0 and weights.shape == indices.shape == (14, 3)


def test_block_without_latent_equals_mixtral_and_reference_moe():
    config = latent_config(num_hidden_layers=1, moe_latent_size=None, per_layer_config=None)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = LatentMoEBlock(config, layer_idx=0).double()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.3)
    assert isinstance(block.fc1_latent_proj, nn.Identity) and isinstance(block.fc2_latent_proj, nn.Identity)
    assert block.experts.gate_up_proj.shape == (8, 32, 32)  # (E, 2m, D): experts at full width
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    # Oracle 1: transformers' Mixtral block (softmax top-K, renormalised) plus the shared expert; Mixtral takes its
    # softmax in fp32 whatever the input dtype, hence the fp32-level tolerance (oracle 2 below is exact).
    mixtral_config = MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
    mixtral_config._experts_implementation = "eager"
    mixtral = MixtralSparseMoeBlock(mixtral_config).double()
    mixtral.load_state_dict({k: v for k, v in block.state_dict().items() if not k.startswith("shared")})
    torch.testing.assert_close(block(x), mixtral(x) + block.shared_experts(x), atol=1e-6, rtol=0)
    # Oracle 2: token by token, expert by expert, straight from the definition.
    expected = torch.zeros_like(x)
    for b in range(2):
        for t in range(5):
            token = x[b, t]
            probs = torch.softmax(block.gate.weight @ token, dim=-1)
            top = torch.argsort(probs, descending=True)[:2]
            gates = probs[top] / probs[top].sum()
            for gate, e in zip(gates, top, strict=True):
                gate_h, up_h = (block.experts.gate_up_proj[e] @ token).chunk(2)
                expected[b, t] += gate * (block.experts.down_proj[e] @ (nn.functional.silu(gate_h) * up_h))
            expected[b, t] += block.shared_experts(token)
    torch.testing.assert_close(block(x), expected, atol=1e-12, rtol=0)


def test_per_layer_config_builds_layer_shapes():
    model = make_model()
    dense, uniform, standard = (layer.mlp for layer in model.model.layers)
    assert type(dense) is MLP and dense.up_proj.weight.shape == (48, 32) and dense.gate_proj is not None
    assert isinstance(uniform, LatentMoEBlock) and isinstance(uniform.experts, LatentMoEExperts)
    assert uniform.fc1_latent_proj.weight.shape == (8, 32) and uniform.fc2_latent_proj.weight.shape == (32, 8)
    assert uniform.experts.gate_up_proj.shape == (8, 32, 8) and uniform.experts.down_proj.shape == (8, 8, 16)
    assert uniform.gate.weight.shape == (8, 32) and uniform.shared_experts.up_proj.weight.shape == (24, 32)
    assert isinstance(standard.fc1_latent_proj, nn.Identity) and standard.shared_experts is None
    assert standard.experts.gate_up_proj.shape == (6, 24, 32) and standard.gate.top_k == 3
    ungated = make_model(mlp_gated=False, hidden_act="relu2", router_score_func="sigmoid")
    experts = ungated.model.layers[1].mlp.experts
    assert isinstance(experts, LatentMoEUngatedExperts) and experts.up_proj.shape == (8, 16, 8)
    assert ungated.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    # The global config refuses to answer for a field that varies per layer; each layer config answers.
    assert [c.num_experts for c in model.config.per_layer_config] == [8, 8, 6]


# --- accounting ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"mlp_gated": False, "hidden_act": "relu2", "router_score_func": "sigmoid"},
        {"mlp_bias": True, "attention_bias": True, "tie_word_embeddings": True},
        {"per_layer_config": None, "moe_shared_expert_intermediate_size": 0},
        {"mlp_bias": True, "mlp_gated": False, "hidden_act": "relu2"},
    ],
)
def test_num_parameters_equal_built_model(overrides):
    model = make_model(**overrides)
    config = model.config
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    for i, layer in enumerate(model.model.layers):
        assert config.layer_num_parameters(i) == sum(p.numel() for p in layer.parameters()), i
    # Active: everything but the (E - K) experts a token skips in each MoE layer, and the embedding lookup.
    skipped_per_layer = []
    for layer in model.model.layers:
        layer_skipped = 0
        if isinstance(layer.mlp, LatentMoEBlock):
            per_expert = sum(p[0].numel() for p in layer.mlp.experts.parameters())
            layer_skipped = (layer.mlp.gate.num_experts - layer.mlp.gate.top_k) * per_expert
        skipped_per_layer.append(layer_skipped)
    skipped = sum(skipped_per_layer)
    embedding = 0 if config.tie_word_embeddings else model.model.embed_tokens.weight.numel()
    assert config.num_active_parameters() == sum(p.numel() for p in model.parameters()) - skipped - embedding
    for i in range(config.num_hidden_layers):
        layer_skipped = skipped_per_layer[i]
        built = sum(p.numel() for p in model.model.layers[i].parameters())
        assert config.layer_num_active_parameters(i) == built - layer_skipped, i


@pytest.mark.parametrize(
    "overrides",
    [{}, {"mlp_gated": False, "hidden_act": "relu2", "mlp_bias": True, "attention_bias": True}],
)
def test_flops_per_token_equal_counted_matmuls_of_a_forward(overrides):
    """FLOPs of one forward of T tokens (torch's FlopCounterMode: every matmul, eager attention scoring all T keys),
    divided by T, are the accounting's FLOPs per token at a context of T keys (2 per multiply-add, biases left out)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = make_model(**overrides)
    model.set_attn_implementation("eager")
    length = 7
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=input_ids(batch=1, length=length), use_cache=False)
    assert counter.get_total_flops() == length * model.config.flops_per_token(context_length=length)
    # the dense layer 0 alone: q 32x32, k/v 32x16, o 32x32 and a c x 32x48 MLP, scores 4 x 4 heads x 8 x T
    c = 3 if model.config.mlp_gated else 2
    layer = model.config.accounting(length).layers[0]
    assert layer.activated_flops == 2 * (32 * 64 + 32 * 32 + c * 32 * 48) + 4 * 4 * 8 * length


# --- losses and the aux-loss-free update ---------------------------------------------------------------------


def test_load_balancing_loss_hand_computed_with_per_layer_top_k():
    # 4 experts; layer 0 picks K=2, layer 1 K=1 (per_layer_config); token 2 is padding.
    model = make_model(
        num_hidden_layers=2, num_experts=4, per_layer_config={1: {"num_experts_per_tok": 1}}, router_aux_loss_coef=0.5
    )
    ln = math.log
    logits = torch.tensor(
        [[ln(4.0), ln(2.0), 0.0, 0.0], [ln(3.0), 0.0, 0.0, ln(5.0)], [9.0, 0.0, 0.0, 0.0]], dtype=torch.float64
    )
    # softmax rows: [.5, .25, .125, .125], [.3, .1, .1, .5]; P = [.4, .175, .1125, .3125].
    # K=2: picks {0, 1}, {3, 0}: f = [.5, .25, 0, .25], L = 4 (.2 + .04375 + .078125) = 1.2875.
    # K=1: picks 0, 3: f = [.5, 0, 0, .5], L = 4 (.2 + .15625) = 1.425. Mean: 1.35625.
    loss = model.load_balancing_loss((logits, logits), attention_mask=torch.tensor([[1, 1, 0]]))
    assert loss.item() == pytest.approx(1.35625, abs=1e-12)
    # In the model: aux loss of the recorded router logits, added to the LM loss with its coefficient.
    ids = input_ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[1].shape == (18, 4)
    torch.testing.assert_close(out.aux_loss, model.load_balancing_loss(out.router_logits, mask))
    plain = model(ids, attention_mask=mask, labels=ids)
    assert plain.aux_loss is None
    torch.testing.assert_close(out.loss, plain.loss + 0.5 * out.aux_loss.to(plain.loss.dtype))


def test_sigmoid_bias_update_moves_bias_against_load():
    model = make_model(router_score_func="sigmoid", router_bias_update_rate=0.01, num_experts=4)
    router = model.model.layers[1].mlp.gate
    router.expert_load = torch.tensor([5.0, 1.0, 3.0, 3.0])  # mean 3: expert 0 overloaded, expert 1 underloaded
    used = model.update_router_biases()
    torch.testing.assert_close(router.e_score_correction_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    torch.testing.assert_close(used[1], torch.tensor([5.0, 1.0, 3.0, 3.0]))
    assert router.expert_load is None and model.update_router_biases()[1].abs().sum() == 0
    # Training forwards count the routed picks (B * T * K per router); eval forwards do not.
    ids = input_ids()
    model(ids)
    assert router.expert_load is None
    model.train()
    model(ids)
    model(ids)
    assert router.expert_load.sum() == 2 * 18 * 2
    assert model.model.layers[2].mlp.gate.expert_load.sum() == 2 * 18 * 3
    before = router.e_score_correction_bias.clone()
    load = router.expert_load.clone()
    model.update_router_biases()
    torch.testing.assert_close(router.e_score_correction_bias - before, 0.01 * torch.sign(load.mean() - load))
    # The bias only selects: gates are the unbiased sigmoid scores of the picked experts, renormalised.
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 10.0]))
    x = torch.randn(1, 4, 32, dtype=torch.float64)
    _, weights, indices = router(x)
    assert torch.equal(indices.sort(-1).values, torch.tensor([2, 3]).expand(1, 4, 2))
    scores = torch.sigmoid(x @ router.weight.T).gather(-1, indices)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True))


def padded(ids: torch.Tensor, pad: int, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """(1, T) ids -> (1, T + pad) ids padded with 0 on `side`, and their attention mask (0 on the padding)."""
    zeros = torch.zeros(1, pad, dtype=ids.dtype)
    padded_ids = torch.cat([zeros, ids] if side == "left" else [ids, zeros], dim=1)
    mask = torch.cat([zeros, torch.ones_like(ids)] if side == "left" else [torch.ones_like(ids), zeros], dim=1)
    return padded_ids, mask


def test_sigmoid_expert_loads_count_real_tokens_only():
    """Aux-loss-free balancing sees the same loads for the same tokens, padded or not: 5 real tokens count 5 (times
    K) also when left- or right-padded to 9, in `expert_load` and in the loads `update_router_biases` uses."""
    model = make_model(router_score_func="sigmoid", num_hidden_layers=1, per_layer_config={}).train()
    router = model.model.layers[0].mlp.gate
    ids = input_ids(batch=1, length=5)
    model(ids)
    alone = router.expert_load.clone()
    assert alone.sum() == 5 * 2
    for side in ("left", "right"):
        router.expert_load = None
        model(*padded(ids, 4, side))
        torch.testing.assert_close(router.expert_load, alone, atol=0, rtol=0, msg=side)
    torch.testing.assert_close(model.update_router_biases()[0], alone, atol=0, rtol=0)


def test_replay_loss_and_loads_count_the_replayed_routes():
    """Under routing replay the forward uses the record's routes: the Switch aux loss (softmax routing) and the
    sigmoid expert loads count those, not the live top-k, and only on real tokens (padding rows hold -1)."""
    ids, mask = padded(input_ids(batch=1, length=5), 4)
    routes = torch.tensor([[[0, 1], [0, 1], [2, 3], [0, 3], [6, 7]]])  # (1, 5, 2): far from the live top-k
    record = torch.cat([torch.full((1, 4, 2), -1), routes], dim=1)
    replay = {(0, "moe"): RoutingRecord(record, None)}

    softmax = make_model(num_hidden_layers=1, per_layer_config={})
    out = softmax(ids, attention_mask=mask, labels=ids, output_router_logits=True, routing_replay=replay)
    probs = torch.softmax(out.router_logits[0][4:], dim=-1)  # (5, 8) of the real tokens
    fraction = torch.bincount(routes.view(-1), minlength=8).double() / (5 * 2)
    torch.testing.assert_close(out.aux_loss, 8 * (fraction * probs.mean(0)).sum(), atol=1e-12, rtol=0)
    live = softmax(ids, attention_mask=mask, labels=ids, output_router_logits=True).aux_loss
    assert (live - out.aux_loss).abs() > 1e-3, "the replayed routes must give another loss than the live top-k"

    sigmoid = make_model(router_score_func="sigmoid", num_hidden_layers=1, per_layer_config={}).train()
    sigmoid(ids, attention_mask=mask, routing_replay=replay)
    expected = torch.bincount(routes.view(-1), minlength=8).float()
    torch.testing.assert_close(sigmoid.model.layers[0].mlp.gate.expert_load, expected, atol=0, rtol=0)


def _bias_update_rank(rank: int, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = make_model(router_score_func="sigmoid", router_bias_update_rate=0.01, num_experts=4)
    router = model.model.layers[1].mlp.gate
    router.expert_load = torch.tensor([[4.0, 0.0, 1.0, 3.0], [0.0, 4.0, 1.0, 3.0]][rank])
    model.update_router_biases()
    torch.save(router.e_score_correction_bias, f"{out_dir}/bias{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_bias_update_all_reduces_loads_across_ranks(tmp_path):
    # Summed load [4, 4, 2, 6], mean 4: both ranks move the bias by 0.01 * [0, 0, 1, -1]. Rank 0 alone would have
    # applied 0.01 * sign(2 - [4, 0, 1, 3]) = [-1, 1, 1, -1] * 0.01.
    torch.multiprocessing.spawn(_bias_update_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        bias = torch.load(tmp_path / f"bias{rank}.pt")
        torch.testing.assert_close(bias, torch.tensor([0.0, 0.0, 0.01, -0.01]))


def test_softmax_routing_has_no_bias_and_no_update():
    model = make_model()
    model.train()
    model(input_ids())
    assert model.model.layers[1].mlp.gate.e_score_correction_bias is None
    assert model.update_router_biases() == {}
    assert "e_score_correction_bias" not in str(list(model.state_dict()))


# --- generation and the routing cache ------------------------------------------------------------------------


# --- save / load ---------------------------------------------------------------------------------------------


# --- configuration -------------------------------------------------------------------------------------------


def test_correction_bias_stays_fp32_through_dtype_casts():
    model = make_model(dtype=torch.float32, router_score_func="sigmoid")
    router = model.model.layers[1].mlp.gate
    with torch.no_grad():
        router.e_score_correction_bias.fill_(0.123456789)  # not representable in bf16 (0.12353515625)
    model.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.e_score_correction_bias.dtype == torch.float32
    assert router.e_score_correction_bias[0].item() == torch.tensor(0.123456789).item()


def test_sigmoid_correction_bias_loads_in_fp32_with_bf16_weights(tmp_path):
    """The correction bias (MoHD has no fp32 buffer) survives `from_pretrained(dtype=torch.bfloat16)` exactly."""
    model = LATENT_MOE.model(dtype=torch.float32, router_score_func="sigmoid")
    bias = 1.0 + 1e-3 * torch.arange(8, dtype=torch.float32)  # 1.001 .. 1.007 round to 1.0 or 1.0078 in bf16
    with torch.no_grad():
        model.model.layers[0].mlp.gate.e_score_correction_bias.copy_(bias)
    model.save_pretrained(tmp_path)
    loaded = LatentMoEForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    router = loaded.model.layers[0].mlp.gate
    assert router.weight.dtype == torch.bfloat16 and loaded.lm_head.weight.dtype == torch.bfloat16
    assert router.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(router.e_score_correction_bias, bias)
    assert loaded._get_dtype_plan(torch.bfloat16) == {"e_score_correction_bias": torch.float32}


def test_gradient_checkpointing_same_gradients_and_load_signs():
    ids = input_ids()
    grads, loads = [], []
    for checkpointing in (False, True):
        model = make_model(router_score_func="sigmoid")
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append(gradients(model))
        loads.append(model.update_router_biases())
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)
    # Recomputed forwards count again, every token once more: loads double, the sign (all the update uses) holds.
    for layer, load in loads[0].items():
        assert torch.equal(loads[1][layer], 2 * load)
        assert torch.equal(torch.sign(loads[1][layer].mean() - loads[1][layer]), torch.sign(load.mean() - load))


def test_router_is_recorded_and_exposed():
    model = make_model()
    out = model(input_ids(), output_router_logits=True, output_hidden_states=True)
    assert [tuple(t.shape) for t in out.router_logits] == [(18, 8), (18, 6)]
    assert len(out.hidden_states) == 4
    assert sum(isinstance(m, LatentMoERouter) for m in model.modules()) == 2


# --- parallel plans -------------------------------------------------------------------------------------------


def test_latent_moe_plans_follow_the_config():
    """A config without dense layers, shared expert or gated experts gets no rule for them, and a config with all of
    them gets each rule (the rule lists as written out by hand; transformers warns on a rule that matches nothing)."""
    # the family's fields without shared expert, latent width or per-layer shapes (the config's defaults)
    fields = LATENT_MOE.defaults(
        "num_key_value_heads",
        "max_position_embeddings",
        "pad_token_id",
        "moe_latent_size",
        "moe_shared_expert_intermediate_size",
    )
    fields |= dict(
        num_experts=4, moe_intermediate_size=32, intermediate_size=64, vocab_size=100, per_layer_config=None
    )
    attention = ["layers.*.self_attn.q_proj", "layers.*.self_attn.k_proj", "layers.*.self_attn.v_proj"]
    attention += ["layers.*.self_attn.o_proj"]
    bare = LATENT_MOE.config(**fields)
    assert sorted(bare.base_model_tp_plan) == sorted(attention)
    assert sorted(bare.base_model_ep_plan) == sorted(
        ["layers.*.mlp.experts", "layers.*.mlp.experts.gate_up_proj", "layers.*.mlp.experts.down_proj"]
    )
    mixed = LATENT_MOE.config(
        **fields | {"per_layer_config": {0: {"mixer_type": "mlp"}}, "moe_shared_expert_intermediate_size": 16}
    )
    mlp = ["layers.*.mlp.gate_proj", "layers.*.mlp.up_proj", "layers.*.mlp.down_proj"]
    shared = [f"layers.*.mlp.shared_experts.{name}" for name in ("gate_proj", "up_proj", "down_proj")]
    assert sorted(mixed.base_model_tp_plan) == sorted(attention + mlp + shared)
    ungated = LATENT_MOE.config(**fields, mlp_gated=False, hidden_act="relu2")
    assert sorted(ungated.base_model_ep_plan) == sorted(
        ["layers.*.mlp.experts", "layers.*.mlp.experts.up_proj", "layers.*.mlp.experts.down_proj"]
    )
    assert "base_model_ep_plan" not in ungated.to_dict() and "base_model_tp_plan" not in ungated.to_dict()
