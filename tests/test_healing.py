"""Healing pieces that keep the dense function: changing k of a loaded MoHD model (`set_active_sub_dims`), uneven
budgets (each layer and sublayer kind at its own k) and the dropped-block compensation.

Oracle: a model built with that k in its config, holding the same weights (the same function by construction), on
both execution strategies, for forward, the aux loss and greedy decoding.
"""

import json

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
        # labels: the aux loss is computed where a loss is asked for (labels given, or training)
        out = model(input_ids=input_ids, labels=input_ids, output_router_logits=True)
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
    with pytest.raises(
        ValueError, match=r"num_routed_sub_dims_per_tok must be None \(the config's\) or an int in \[1, 6\]"
    ):
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
    from hf_mohd.conversion.mohd.compensation import fit_dropped_block_compensation
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
            "column_major"
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


# Uneven budgets: each layer and sublayer kind with its own k (`attention_routed_sub_dims_per_tok`,
# `ffn_routed_sub_dims_per_tok`, per layer through `per_layer_config`).

BUDGETS = {  # (layer, sublayer) -> k; layer 1's attention keeps the top-level value 2, its FFN the per-kind value 5
    (0, "attention"): 1,
    (0, "ffn"): 6,
    (1, "attention"): 2,
    (1, "ffn"): 5,
}
UNEVEN = dict(
    ffn_routed_sub_dims_per_tok=5,
    per_layer_config={0: {"attention_routed_sub_dims_per_tok": 1, "ffn_routed_sub_dims_per_tok": 6}},
)


def sub_dims_of(model) -> dict:
    layers = model.model.layers
    return {
        (idx, kind): getattr(layers[idx], "self_attn" if kind == "attention" else "mlp").sub_dims
        for idx in range(len(layers))
        for kind in ("attention", "ffn")
    }


@pytest.mark.parametrize("implementation", ["gather", "masked"])
def test_per_layer_budgets_equal_each_sublayer_at_its_own_k(tmp_path, implementation):
    """A config with per-layer and per-kind k builds each sublayer at its k: the logits, aux loss and greedy tokens
    equal those of the uniform k = 2 model with the same weights whose sublayers are each set to the budget's k
    (`set_top_k`, checked above against models built with that k); a save and reload keeps the budgets, and
    `set_active_sub_dims(None)` restores them after a uniform k."""
    model = build(2, sparse_implementation=implementation, **UNEVEN)
    oracle = build(2, sparse_implementation=implementation)
    oracle.load_state_dict(model.state_dict())
    for key, sub_dims in sub_dims_of(oracle).items():
        sub_dims.set_top_k(BUDGETS[key])
    assert {key: sub.router.top_k for key, sub in sub_dims_of(model).items()} == BUDGETS
    assert model.active_sub_dims_per_tok is None
    input_ids = torch.randint(3, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    (logits, aux, tokens), (want_logits, want_aux, want_tokens) = outputs(model, input_ids), outputs(oracle, input_ids)
    torch.testing.assert_close(logits, want_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(aux, want_aux, rtol=1e-10, atol=1e-10)
    assert torch.equal(tokens, want_tokens)
    uniform = build(2, sparse_implementation=implementation)
    uniform.load_state_dict(model.state_dict())
    assert (outputs(uniform, input_ids)[0] - logits).abs().max() > 1e-3  # the budgets change the function

    model.save_pretrained(tmp_path)
    reloaded = MoHDForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert {key: sub.router.top_k for key, sub in sub_dims_of(reloaded).items()} == BUDGETS
    reloaded.set_active_sub_dims(6)
    assert reloaded.active_sub_dims_per_tok == 6
    reloaded.set_active_sub_dims(None)
    assert {key: sub.router.top_k for key, sub in sub_dims_of(reloaded).items()} == BUDGETS
    torch.testing.assert_close(outputs(reloaded, input_ids)[0], logits, rtol=1e-10, atol=1e-10)


def test_per_layer_budgets_aux_loss_counts_each_router_at_its_k():
    """The load-balance loss of uneven budgets is the mean over routers of each router's Switch loss at its own k,
    computed here one router at a time from the recorded logits (f_j = picks of j / (tokens k), P_j = mean p_j,
    L = N_r sum_j f_j P_j)."""
    model = build(2, **UNEVEN)
    input_ids = torch.randint(3, 61, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(input_ids=input_ids, labels=input_ids, output_router_logits=True)
    losses = []
    for logits, k in zip(out.router_logits, BUDGETS.values(), strict=True):
        probs = torch.softmax(logits, dim=-1)
        picks = torch.zeros(probs.shape[-1], dtype=probs.dtype)
        for row in probs:  # top-k by hand, ties to the lower index
            picks[sorted(range(len(row)), key=lambda j: (-row[j].item(), j))[:k]] += 1
        losses.append(probs.shape[-1] * (picks / (probs.shape[0] * k) * probs.mean(0)).sum())
    torch.testing.assert_close(out.aux_loss, torch.stack(losses).mean(), rtol=1e-12, atol=1e-12)


def test_per_layer_budgets_accounting_and_a_sublayer_without_router():
    """The accounting counts each sublayer at its k: per layer, the attention FLOPs are those of the uniform config
    with the attention's k and the FFN FLOPs those of the uniform config with the FFN's k; a sublayer at k = 0 has no
    router, and the total equals the built model's parameters; a parsed `config.json` dict counts the same."""
    from hf_mohd.models.accounting import model_accounting

    config = MoHDConfig(
        **{
            **FIELDS,
            **UNEVEN,
            "per_layer_config": {0: {"attention_routed_sub_dims_per_tok": 1, "ffn_routed_sub_dims_per_tok": 0}},
        }
    )
    budgets = {**BUDGETS, (0, "ffn"): 0}
    cost = config.accounting(16)
    for layer in cost.layers:
        for kind, field in (("attention", "attention_flops"), ("ffn", "mixer_flops")):
            uniform = MoHDConfig(**{**FIELDS, "num_routed_sub_dims_per_tok": budgets[(layer.layer_idx, kind)]})
            assert getattr(layer, field) == getattr(uniform.accounting(16).layers[layer.layer_idx], field), (
                layer,
                kind,
            )
    model = MoHDForCausalLM(config)
    assert model.model.layers[0].mlp.sub_dims.router is None
    assert cost.total_params == config.num_parameters() == sum(p.numel() for p in model.parameters())
    assert model_accounting(config.to_dict(), 16) == cost
    # additivity of what a token reads: swapping the two kinds' k between two layers keeps the sum
    swapped = MoHDConfig(**{**FIELDS, "attention_routed_sub_dims_per_tok": 4, "ffn_routed_sub_dims_per_tok": 1})
    straight = MoHDConfig(**{**FIELDS, "attention_routed_sub_dims_per_tok": 1, "ffn_routed_sub_dims_per_tok": 4})
    one = [MoHDConfig(**{**FIELDS, "num_routed_sub_dims_per_tok": k}).num_active_parameters() for k in (1, 4)]
    assert swapped.num_active_parameters() + straight.num_active_parameters() == sum(one)
    assert straight.num_active_parameters() != swapped.num_active_parameters()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"per_layer_config": {1: {"ffn_routed_sub_dims_per_tok": 7}}}, r"layer 1: `ffn_routed_sub_dims_per_tok`"),
        ({"attention_routed_sub_dims_per_tok": -1}, r"layer 0: `attention_routed_sub_dims_per_tok`"),
        ({"per_layer_config": {0: {"num_routed_sub_dims_per_tok": 3}}}, r"cannot vary per layer"),
        ({"per_layer_config": {0: {"num_sub_dims": 4}}}, r"allowed fields: \['attention_routed_sub_dims_per_tok'"),
    ],
)
def test_per_layer_budgets_refuse_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        MoHDConfig(**{**FIELDS, **overrides})


def test_sublayer_errors_are_each_sublayer_lowered_alone():
    """e_u(k) of `sublayer_errors` against an independent measurement: a model with only that sublayer at k (through
    `per_layer_config`, the others at N_r) run on the same ids, its sublayer output against the full model's, over
    the residual stream the sublayer adds to (the layer input for attention, plus the attention output for the
    FFN), summed over the batches."""
    from hf_mohd.conversion.mohd.budgets import sublayer_errors

    model = build(2, routed_gate="unit")
    ids = torch.randint(3, 61, (5, 6), generator=torch.Generator().manual_seed(3))
    errors, tokens = sublayer_errors(model, ids, batch_size=2)
    assert tokens == 30 and set(errors) == set(BUDGETS)
    assert {key: sub.router.top_k for key, sub in sub_dims_of(model).items()} == dict.fromkeys(BUDGETS, 2)

    def measured(per_layer):
        run = build(6, routed_gate="unit", per_layer_config=per_layer)
        run.load_state_dict(model.state_dict())
        captured = {}
        layer = run.model.layers[1]
        layer.self_attn.register_forward_hook(lambda m, a, out: captured.__setitem__("attn", out[0]))
        layer.mlp.register_forward_hook(lambda m, a, out: captured.__setitem__("mlp", out))
        rows = []
        for start in range(0, 5, 2):
            with torch.no_grad():
                hidden = run(input_ids=ids[start : start + 2], output_hidden_states=True).hidden_states[1]
            rows.append((captured["attn"], captured["mlp"], hidden))
        return rows

    full = measured({})
    for kind, k in (("attention", 1), ("ffn", 4)):
        lowered = measured({1: {f"{kind}_routed_sub_dims_per_tok": k}})
        num = den = 0.0
        for (attn, mlp, hidden), (attn_k, mlp_k, _) in zip(full, lowered, strict=True):
            num += ((attn_k - attn) if kind == "attention" else (mlp_k - mlp)).pow(2).sum().item()
            den += (hidden if kind == "attention" else hidden + attn).pow(2).sum().item()
        assert errors[(1, kind)][k - 1] == pytest.approx(num / den, rel=1e-9), kind
        assert errors[(1, kind)][k - 1] > 0 and errors[(1, kind)][-1] == 0.0


def test_sublayer_output_errors_are_the_output_kl_with_each_sublayer_lowered_alone():
    """e_u(k) of `sublayer_output_errors` against an independent measurement: a model with only that sublayer at k
    (through `per_layer_config`, the others at N_r) run whole on all the ids at once, its next-token distribution
    against the full model's, KL(full || lowered) averaged over tokens; a lowered layer-0 sublayer reaches the output
    through layer 1, so a re-run that skipped the later layers would fail it."""
    from hf_mohd.conversion.mohd.budgets import sublayer_output_errors

    model = build(2, routed_gate="unit")
    ids = torch.randint(3, 61, (5, 6), generator=torch.Generator().manual_seed(3))
    errors, tokens = sublayer_output_errors(model, ids, batch_size=2)
    assert tokens == 30 and set(errors) == set(BUDGETS)
    assert {key: sub.router.top_k for key, sub in sub_dims_of(model).items()} == dict.fromkeys(BUDGETS, 2)

    def log_probs(per_layer):
        run = build(6, routed_gate="unit", per_layer_config=per_layer)
        run.load_state_dict(model.state_dict())
        with torch.no_grad():
            return torch.log_softmax(run(input_ids=ids).logits, dim=-1)

    full = log_probs({})
    for layer, kind, k in ((0, "ffn", 4), (0, "attention", 3), (1, "attention", 1)):
        lowered = log_probs({layer: {f"{kind}_routed_sub_dims_per_tok": k}})
        want = (full.exp() * (full - lowered)).sum().item() / ids.numel()
        assert errors[(layer, kind)][k - 1] == pytest.approx(want, rel=1e-9), (layer, kind)
        assert errors[(layer, kind)][k - 1] > 0 and errors[(layer, kind)][-1] == 0.0


def test_sublayer_output_errors_resume_from_their_progress_file(tmp_path):
    """An output measurement stopped inside its second batch (after that batch's first two sublayers) resumes from its
    progress file to exactly the uninterrupted result, re-running only what the file does not hold (counted in calls
    of the last decoder layer: per batch one full forward plus N_r - 1 per sublayer); a file of other weights is
    refused by name, and so is `progress` with the residual measure."""
    from hf_mohd.conversion.mohd.budgets import allocate_routed_sub_dims, sublayer_output_errors
    from hf_mohd.conversion.source import ConversionError

    model = build(2, routed_gate="unit")
    ids = torch.randint(3, 61, (5, 6), generator=torch.Generator().manual_seed(3))
    want = sublayer_output_errors(model, ids, batch_size=2)
    per_batch = 1 + len(BUDGETS) * (model.config.num_routed_sub_dims - 1)
    calls, stop_at = [0], per_batch + 1 + 2 * (model.config.num_routed_sub_dims - 1) + 1

    def count(module, args):
        calls[0] += 1
        if calls[0] == stop_at:
            raise KeyboardInterrupt

    handle = model.model.layers[1].register_forward_pre_hook(count)
    progress = tmp_path / "progress.json"
    with pytest.raises(KeyboardInterrupt):
        sublayer_output_errors(model, ids, batch_size=2, progress=progress)
    state = json.loads(progress.read_text())
    assert (state["batches_done"], state["units_done"], state["tokens"]) == (1, 2, 12)
    assert {key: sub.router.top_k for key, sub in sub_dims_of(model).items()} == dict.fromkeys(BUDGETS, 2)
    calls[0] = 0
    assert sublayer_output_errors(model, ids, batch_size=2, progress=progress) == want
    assert calls[0] == (1 + 2 * (model.config.num_routed_sub_dims - 1)) + per_batch
    handle.remove()
    assert json.loads(progress.read_text())["batches_done"] == 3

    with torch.no_grad():
        model.lm_head.weight.mul_(1.01)
    with pytest.raises(ConversionError, match=r"progress\.json: progress of another measurement \(differs in weights"):
        sublayer_output_errors(model, ids, batch_size=2, progress=progress)
    with pytest.raises(ConversionError, match="`progress` resumes the output measure only"):
        allocate_routed_sub_dims(model, ids, 3, progress=progress)


def test_allocation_on_the_output_error_follows_its_table():
    """`error="output"` allocates on `sublayer_output_errors`' table: the same budgets as `greedy_budgets` on that
    table (and the recorded measure is "output"); an unknown measure is refused by name."""
    from hf_mohd.conversion.mohd.budgets import allocate_routed_sub_dims, greedy_budgets, sublayer_output_errors
    from hf_mohd.conversion.source import ConversionError

    model = build(2, routed_gate="unit")
    ids = torch.randint(3, 61, (4, 8), generator=torch.Generator().manual_seed(4))
    allocation = allocate_routed_sub_dims(model, ids, 3, batch_size=2, error="output")
    errors, _ = sublayer_output_errors(model, ids, batch_size=2)
    assert allocation.errors == errors and allocation.as_dict()["error"] == "output"
    assert allocation.budgets == greedy_budgets(errors, allocation.block_params, allocation.budget_block_params)[0]
    assert allocation.active_block_params <= allocation.budget_block_params
    with pytest.raises(ConversionError, match="`error` must be one of"):
        allocate_routed_sub_dims(model, ids, 3, error="logits")


def test_greedy_budgets_on_a_hand_table():
    """Two units, N_r = 3, w = 1 and 2, budget 2 (1 + 2) = 6: from (3, 3) = 9, lowering B 3 -> 2 costs 0.05 / 2 =
    0.025 per parameter against A's 0.1, then B 2 -> 1 costs 0.15 / 2 = 0.075 against 0.1: (3, 1) = 5 <= 6."""
    from hf_mohd.conversion.mohd.budgets import greedy_budgets

    errors = {"A": [0.5, 0.1, 0.0], "B": [0.2, 0.05, 0.0]}
    assert greedy_budgets(errors, {"A": 1, "B": 2}, 6.0) == ({"A": 3, "B": 1}, ["B", "B"])
    assert greedy_budgets(errors, {"A": 1, "B": 2}, 9.0) == ({"A": 3, "B": 3}, [])
    assert greedy_budgets(errors, {"A": 1, "B": 2}, 3.0)[0] == {"A": 1, "B": 1}


def test_allocation_keeps_the_parameter_budget_and_is_saved(tmp_path):
    """The allocation reads at most the parameters per token of the uniform model at the mean k (the accounting of
    the applied config against the uniform one), is uneven on this model, and a save and reload keeps it."""
    from hf_mohd.conversion.mohd.budgets import allocate_routed_sub_dims, apply_routed_budgets

    model = build(2, routed_gate="unit")
    ids = torch.randint(3, 61, (4, 8), generator=torch.Generator().manual_seed(4))
    allocation = allocate_routed_sub_dims(model, ids, 3, batch_size=2)
    assert allocation.active_block_params <= allocation.budget_block_params
    assert len(set(allocation.budgets.values())) > 1
    apply_routed_budgets(model, allocation)
    uniform = MoHDConfig(**{**FIELDS, "num_routed_sub_dims_per_tok": 3})
    assert model.config.num_active_parameters() <= uniform.num_active_parameters()
    assert {key: sub.router.top_k for key, sub in sub_dims_of(model).items()} == allocation.budgets
    model.save_pretrained(tmp_path)
    reloaded = MoHDForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert {key: sub.router.top_k for key, sub in sub_dims_of(reloaded).items()} == allocation.budgets
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-10, atol=1e-10)


def test_recorded_allocation_rebuilds_the_same_model():
    """An allocation written with `as_dict` and read back with `BudgetAllocation.from_budgets` on a fresh copy of the
    student gives the same k in every sublayer, the same parameter count and budget, and the same logits as the
    allocation it was recorded from; a record that does not fit the model is refused by name."""
    from hf_mohd.conversion.mohd.budgets import BudgetAllocation, allocate_routed_sub_dims, apply_routed_budgets
    from hf_mohd.conversion.source import ConversionError

    ids = torch.randint(3, 61, (4, 8), generator=torch.Generator().manual_seed(4))
    allocation = allocate_routed_sub_dims(build(3, routed_gate="unit"), ids, 3, batch_size=2)
    measured = apply_routed_budgets(build(3, routed_gate="unit"), allocation)
    record = json.loads(json.dumps(allocation.as_dict()))
    fresh = build(3, routed_gate="unit")
    recorded = BudgetAllocation.from_budgets(fresh, record["budgets"], error=record["error"], tokens=record["tokens"])
    assert recorded.budgets == allocation.budgets and len(set(recorded.budgets.values())) > 1
    assert recorded.active_block_params == allocation.active_block_params
    assert recorded.budget_block_params == allocation.budget_block_params and recorded.tokens == 32
    apply_routed_budgets(fresh, recorded)
    assert fresh.config.to_dict()["per_layer_config"] == measured.config.to_dict()["per_layer_config"]
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, measured(ids).logits, rtol=0, atol=0)
    budgets = record["budgets"]
    for bad, message in (
        ({**budgets, "2.ffn": 3}, r"unknown: \['2.ffn'\]"),
        ({key: k for key, k in budgets.items() if key != "1.attention"}, r"missing: \['1.attention'\]"),
        ({**budgets, "0.ffn": 7}, r"integers in \[1, 6\].*'0.ffn': 7"),
        ({**budgets, "0.ffn": 2.0}, r"integers in \[1, 6\]"),
    ):
        with pytest.raises(ConversionError, match=message):
            BudgetAllocation.from_budgets(build(3), bad)
    with pytest.raises(ConversionError, match="`error` must be one of"):
        BudgetAllocation.from_budgets(build(3), budgets, error="logits")


def test_nested_backward_runs_the_own_k_at_the_per_layer_budgets():
    """In nested healing the model's own k (its config's default, 2) stands for its per-layer budgets: the forward at
    k = 2 sees every sublayer at its budget, the forward at k = 6 every sublayer at 6, and the model is left at
    its budgets."""
    from hf_mohd.training.distill import nested_backward

    model = build(2, **UNEVEN)
    seen = []

    def forward():
        seen.append({key: sub.router.top_k for key, sub in sub_dims_of(model).items()})
        return None

    nested_backward(model, [(2, 1.0), (6, 0.5)], forward, lambda out: (torch.zeros(()), 0.0), lambda x: None, own_k=2)
    assert seen == [dict.fromkeys(BUDGETS, 6), BUDGETS]
    assert {key: sub.router.top_k for key, sub in sub_dims_of(model).items()} == BUDGETS


# One sparse side: `sparse_sides="input"` reads only the active blocks and writes all, "output" the reverse.


@pytest.mark.parametrize("sides", ["input", "output"])
@pytest.mark.parametrize("implementation", ["gather", "masked"])
def test_one_sparse_side_is_the_hand_computed_sublayer(sides, implementation):
    """Oracle by hand for the FFN of layer 0 (unit gates, no scaling, no fusion, so the gates and alpha are 1):
    input side sparse, down(silu(gate(x m)) * up(x m)); output side sparse, down(silu(gate x) * up x) m, with m the
    0/1 mask of the token's shared and routed blocks from the router. The attention sublayer, the whole model on
    both strategies and greedy decoding agree likewise (strategy against strategy)."""
    fields = dict(routed_gate="unit", activation_scaling="none", group_fusion="none", sparse_sides=sides)
    model = build(2, sparse_implementation=implementation, **fields)
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    _, _, indices = mlp.sub_dims.router(x)
    mask = torch.zeros(3, 5, 8, dtype=torch.float64)
    mask[..., :2] = 1
    mask.scatter_(-1, indices, 1.0)
    mask = mask.repeat_interleave(4, dim=-1)  # (B, T, D): blocks of s = 4
    silu = torch.nn.functional.silu
    with torch.no_grad():
        if sides == "input":
            want = mlp.down_proj(silu(mlp.gate_proj(x * mask)) * mlp.up_proj(x * mask))
        else:
            want = mlp.down_proj(silu(mlp.gate_proj(x)) * mlp.up_proj(x)) * mask
        torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)
    other = build(2, sparse_implementation="masked" if implementation == "gather" else "gather", **fields)
    input_ids = torch.randint(3, 61, (2, 7), generator=torch.Generator().manual_seed(6))
    (logits, aux, tokens), (want_logits, want_aux, want_tokens) = outputs(model, input_ids), outputs(other, input_ids)
    torch.testing.assert_close(logits, want_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(aux, want_aux, rtol=1e-10, atol=1e-10)
    assert torch.equal(tokens, want_tokens)
    both = build(2, sparse_implementation=implementation, **{**fields, "sparse_sides": "both"})
    assert (outputs(both, input_ids)[0] - logits).abs().max() > 1e-3


def test_one_sparse_side_accounting():
    """Per token, a one-sided sublayer reads the sparse side's active share and the other side whole: the parameters
    of input-only plus output-only equal those of both sides sparse plus every block active (k = N_r), for the
    parameters a token reads and the FLOPs; the total is the built model's; compensation needs both sides."""

    def cost(sides, k=2):
        config = MoHDConfig(**{**FIELDS, "num_routed_sub_dims_per_tok": k, "sparse_sides": sides})
        return config.num_active_parameters(), config.flops_per_token(16), config.num_parameters()

    (ai, fi, ti), (ao, fo, _), (ab, fb, tb), (af, ff, _) = cost("input"), cost("output"), cost("both"), cost("both", 6)
    assert ai + ao == ab + af and fi + fo == fb + ff and ai != ao
    assert ti == tb == sum(p.numel() for p in build(2, sparse_sides="input").parameters())
    with pytest.raises(ValueError, match="`dropped_block_compensation` .* needs `sparse_sides` 'both'"):
        MoHDConfig(**FIELDS, sparse_sides="input", dropped_block_compensation=True)
    with pytest.raises(ValueError, match="`sparse_sides` must be one of"):
        MoHDConfig(**FIELDS, sparse_sides="neither")
