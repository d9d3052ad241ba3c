"""Properties over random valid configurations of both families (hypothesis).

The hand-written tests pin chosen configurations; these draw sub-dimension counts, shared/routed splits, sparse
modules, GQA ratios, tied or untied embeddings, biases, per-layer LatentMoE shapes and mixers, gated or non-gated MLPs,
softmax or sigmoid routing, and check on each draw:

- MoHD: the gather path (grouped and few-tokens plans, optionally the block-major weight layout) equals the masked
  reference path in logits, loss and every gradient: to float64 rounding (1e-10), and within 1e-5 in float32;
- both: greedy generation with the cache equals generation without it (float64, routers spread: no near-ties);
- both: the parameter accounting (`config.num_parameters()`, `hf_mohd.models.accounting.model_accounting`) equals
  the parameters the model actually builds, and `num_active_parameters()` what a token reads of them;
- both: `save_pretrained` / `from_pretrained` round trips are exact (weights and logits);
- LatentMoE of the Nemotron-H form: transformers' own `NemotronHForCausalLM` holding the exported weights gives the
  same logits.

Every property has an explicit `max_examples` and `deadline=None`; with the environment variable `CI` set the
"ci" profile derandomises the draws (the same examples on every run). A failure prints the drawn configuration.
"""

import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from hf_mohd.interop import to_nemotron_h
from tests.utils import FAMILIES, gradients, greedy, input_ids, reallocate_parameters


settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))
SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
pytestmark = pytest.mark.slow
VOCAB = 61


def _even_head_counts(hidden: int) -> list[int]:
    return [h for h in (1, 2, 4) if hidden % h == 0 and (hidden // h) % 2 == 0]


@st.composite
def mohd_configs(draw) -> dict:
    """Keyword arguments of a valid `MoHDConfig`: N in {2, 4, 8}, any N_s (all shared included), 1 <= k <= N_r."""
    num_sub_dims = draw(st.sampled_from([2, 4, 8]))
    hidden = num_sub_dims * draw(st.sampled_from([4, 8]))
    heads = draw(st.sampled_from(_even_head_counts(hidden)))
    shared = draw(st.integers(0, num_sub_dims))
    routed = num_sub_dims - shared
    return dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=draw(st.sampled_from([16, 24, 40])),
        num_hidden_layers=draw(st.integers(1, 2)),
        num_attention_heads=heads,
        num_key_value_heads=draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0])),
        max_position_embeddings=64,
        pad_token_id=0,
        hidden_act=draw(st.sampled_from(["silu", "gelu"])),
        tie_word_embeddings=draw(st.booleans()),
        attention_bias=draw(st.booleans()),
        mlp_bias=draw(st.booleans()),
        num_sub_dims=num_sub_dims,
        num_shared_sub_dims=shared,
        num_routed_sub_dims_per_tok=draw(st.integers(0 if shared else 1, routed)) if routed else 0,
        sparse_modules=draw(st.sampled_from([["attention", "ffn"], ["attention"], ["ffn"], []])),
        activation_scaling=draw(st.sampled_from(["inverse_active", "none"])),
        routed_gate=draw(st.sampled_from(["softmax", "normalized"])),
        group_fusion=draw(st.sampled_from(["mix", "none"])),
    )


@st.composite
def latent_moe_configs(draw, nemotron_h: bool = False) -> dict:
    """Keyword arguments of a valid `LatentMoEConfig`; `nemotron_h`: only the form Nemotron-H can express
    (no RoPE, non-gated MLPs, sigmoid routing, a shared expert, one MoE shape for all layers)."""
    hidden = draw(st.sampled_from([16, 32]))
    heads = draw(st.sampled_from([2, 4]))
    layers = draw(st.integers(1, 3))
    experts = draw(st.integers(2, 6))
    gated = False if nemotron_h else draw(st.booleans())
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=draw(st.sampled_from([16, 24])),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0])),
        max_position_embeddings=64,
        pad_token_id=0,
        mlp_gated=gated,
        hidden_act=draw(st.sampled_from(["silu", "gelu"] if gated else ["relu2", "silu"])),
        position_embedding_type="none" if nemotron_h else draw(st.sampled_from(["rope", "none"])),
        router_score_func="sigmoid" if nemotron_h else draw(st.sampled_from(["softmax", "sigmoid"])),
        attention_bias=False if nemotron_h else draw(st.booleans()),
        mlp_bias=False if nemotron_h else draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
        norm_topk_prob=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.0])),
        num_experts=experts,
        num_experts_per_tok=draw(st.integers(1, experts)),
        moe_intermediate_size=draw(st.sampled_from([8, 16])),
        moe_latent_size=draw(st.sampled_from([None, 8, hidden // 2])),
        moe_shared_expert_intermediate_size=draw(st.sampled_from([8, 16] if nemotron_h else [0, 8, 16])),
    )
    per_layer = {}
    for layer in range(layers):
        choice = draw(st.sampled_from(["same", "mlp", "shape"] if not nemotron_h else ["same", "mlp"]))
        if choice == "mlp":
            per_layer[layer] = {"mixer_type": "mlp", "intermediate_size": draw(st.sampled_from([16, 32]))}
            if nemotron_h:  # Nemotron-H has one MLP width
                per_layer[layer] = {"mixer_type": "mlp"}
        elif choice == "shape":
            layer_experts = draw(st.integers(1, 5))
            per_layer[layer] = {
                "num_experts": layer_experts,
                "num_experts_per_tok": draw(st.integers(1, layer_experts)),
                "moe_latent_size": draw(st.sampled_from([None, 8])),
                "moe_shared_expert_intermediate_size": draw(st.sampled_from([0, 8])),
            }
    fields["per_layer_config"] = per_layer or None
    return fields


def _build(family: str, fields: dict, dtype=torch.float64, seed: int = 0, **overrides):
    """The family's model of the drawn `fields` (they set every field of the tiny config), every kind of weight away
    from its initialisation (router correction biases included); eager experts in float64 (torch's grouped_mm kernel
    takes float32 / bfloat16 only), the config's choice otherwise."""
    experts = "eager" if dtype == torch.float64 else None
    return FAMILIES[family].spread_model(
        seed, dtype, correction_bias=True, experts_implementation=experts, **{**fields, **overrides}
    )


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return input_ids(batch, length, seed, vocab_size=VOCAB)


def _step(model, input_ids):
    """Logits, loss and gradients of one training step (LM loss, or a logits loss for single tokens, plus aux)."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids, output_router_logits=True, use_cache=False)
    loss = out.loss if input_ids.shape[1] > 1 else out.logits.square().mean()
    if input_ids.shape[1] == 1 and out.aux_loss is not None:
        loss = loss + out.aux_loss
    loss.backward()
    grads = gradients(model)
    model.eval()
    return out.logits.detach(), loss.detach(), grads


@settings(max_examples=40, deadline=None, suppress_health_check=SLOW_OK)
@given(
    fields=mohd_configs(),
    batch=st.integers(1, 2),
    length=st.integers(1, 9),
    layout=st.sampled_from(["column_major", "row_major"]),
)
def test_mohd_gather_paths_equal_masked_in_float64_and_float32(fields, batch, length, layout):
    note(f"MoHDConfig(**{fields}); batch={batch}, length={length}, layout={layout}")
    input_ids = _ids(batch, length)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        masked = _build("mohd", fields, dtype, sparse_implementation="masked")
        gather = _build("mohd", fields, dtype, sparse_implementation="gather")
        gather.load_state_dict(masked.state_dict())
        gather.to_weight_layout(layout)
        logits_g, loss_g, grads_g = _step(gather, input_ids)
        logits_m, loss_m, grads_m = _step(masked, input_ids)
        torch.testing.assert_close(logits_g, logits_m, rtol=tol, atol=tol, msg=f"{dtype} logits")
        torch.testing.assert_close(loss_g, loss_m, rtol=tol, atol=tol, msg=f"{dtype} loss")
        assert grads_g.keys() == grads_m.keys()
        for name, grad in grads_g.items():
            torch.testing.assert_close(grad, grads_m[name], rtol=tol, atol=tol, msg=f"{dtype} grad {name}")


@settings(max_examples=20, deadline=None, suppress_health_check=SLOW_OK)
@given(fields=mohd_configs(), implementation=st.sampled_from(["gather", "masked"]), batch=st.integers(1, 2))
def test_mohd_cached_greedy_equals_uncached(fields, implementation, batch):
    note(f"MoHDConfig(**{fields}, sparse_implementation={implementation!r}); batch={batch}")
    model = _build("mohd", fields, sparse_implementation=implementation)
    prompt = _ids(batch, 5, seed=1)
    assert torch.equal(greedy(model, prompt, 4, use_cache=True), greedy(model, prompt, 4, use_cache=False))


@settings(max_examples=20, deadline=None, suppress_health_check=SLOW_OK)
@given(fields=latent_moe_configs(), batch=st.integers(1, 2))
def test_latent_moe_cached_greedy_equals_uncached(fields, batch):
    note(f"LatentMoEConfig(**{fields}); batch={batch}")
    model = _build("latent_moe", fields)
    prompt = _ids(batch, 5, seed=1)
    assert torch.equal(greedy(model, prompt, 4, use_cache=True), greedy(model, prompt, 4, use_cache=False))


def _built_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors once


@settings(max_examples=60, deadline=None, suppress_health_check=SLOW_OK)
@given(fields=mohd_configs())
def test_mohd_accounting_equals_built_parameters(fields):
    note(f"MoHDConfig(**{fields})")
    config = FAMILIES["mohd"].config(**fields)
    with torch.device("meta"):
        model = FAMILIES["mohd"].model_class(config)
    assert config.num_parameters() == _built_parameters(model)
    # a token reads n_a / N of the sparsified projections (whole biases on the input side), the rest whole, the LM
    # head, and not the embedding lookup
    n, n_active = config.num_sub_dims, config.num_active_sub_dims
    sparse = set(config.sparse_modules) if config.num_routed_sub_dims else set()
    skipped = 0 if config.tie_word_embeddings else model.model.embed_tokens.weight.numel()
    for layer in model.model.layers:
        for name, projections in (
            (
                "attention",
                [layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight],
            ),
            ("ffn", [layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
        ):
            output = layer.self_attn.o_proj if name == "attention" else layer.mlp.down_proj
            if name in sparse:
                sliced = sum(w.numel() for w in projections) + sum(p.numel() for p in output.parameters())
                skipped += sliced - sliced * n_active // n
    assert config.num_active_parameters() == _built_parameters(model) - skipped


@settings(max_examples=60, deadline=None, suppress_health_check=SLOW_OK)
@given(fields=latent_moe_configs())
def test_latent_moe_accounting_equals_built_parameters(fields):
    note(f"LatentMoEConfig(**{fields})")
    config = FAMILIES["latent_moe"].config(**fields)
    with torch.device("meta"):
        model = FAMILIES["latent_moe"].model_class(config)
    assert config.num_parameters() == _built_parameters(model)
    layers = model.model.layers
    skipped = 0 if config.tie_word_embeddings else model.model.embed_tokens.weight.numel()
    for index, layer in enumerate(layers):
        assert config.layer_num_parameters(index) == _built_parameters(layer), index
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:  # a token reads K of the N experts
            per_expert = sum(p[0].numel() for p in experts.parameters())
            skipped += (layer.mlp.gate.num_experts - layer.mlp.gate.top_k) * per_expert
    assert config.num_active_parameters() == _built_parameters(model) - skipped


def _assert_round_trip_exact(model) -> None:
    prompt = _ids(2, 6, seed=2)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(reloaded) is type(model)
    state, reloaded_state = model.state_dict(), reloaded.state_dict()
    assert state.keys() == reloaded_state.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, reloaded_state[name]), name
    reallocate_parameters(reloaded)  # the loaded views of the file may sum in another order (see its docstring)
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, reloaded(prompt).logits)


@settings(max_examples=8, deadline=None, suppress_health_check=SLOW_OK)
@given(mohd=mohd_configs(), latent_moe=latent_moe_configs())
def test_save_load_round_trip_is_exact(mohd, latent_moe):
    note(f"MoHDConfig(**{mohd}); LatentMoEConfig(**{latent_moe})")
    _assert_round_trip_exact(_build("mohd", mohd, torch.float32))
    _assert_round_trip_exact(_build("latent_moe", latent_moe, torch.float32))


@settings(max_examples=15, deadline=None, suppress_health_check=SLOW_OK)
@given(fields=latent_moe_configs(nemotron_h=True))
def test_nemotron_h_export_equals_transformers_model(fields):
    note(f"LatentMoEConfig(**{fields})")
    model = _build("latent_moe", fields, torch.float32)
    nemotron = to_nemotron_h(model)
    assert type(nemotron).__module__.startswith("transformers.models.nemotron_h")
    prompt = _ids(2, 7, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(nemotron(prompt).logits, model(prompt).logits, rtol=0, atol=1e-5)


def _relative_bad_values(field: str, base: dict) -> list:
    """Values invalid for this drawn `base` in particular (the fixed tables hold the ones invalid for any base)."""
    n, heads = base.get("num_sub_dims"), base["num_attention_heads"]
    relative = {
        "pad_token_id": [base["vocab_size"], -base["vocab_size"] - 1],
        "num_key_value_heads": [heads + 1],
        "num_attention_heads": [base["num_key_value_heads"] * heads + 1] if base["num_key_value_heads"] > 1 else [],
    }
    if n is not None:  # MoHD
        shared = base["num_shared_sub_dims"]
        relative.update(
            num_sub_dims=[base["hidden_size"] + 1],
            num_shared_sub_dims=[n + 1],
            num_routed_sub_dims_per_tok=[n - shared + 1],
        )
    else:
        relative.update(num_experts_per_tok=[base["num_experts"] + 1])
        if base["num_experts_per_tok"] > 1:
            relative["num_experts"] = [base["num_experts_per_tok"] - 1]
    return relative.get(field, [])


# Entries of the fixed tables that are invalid only for their fixed base configurations.
_BASE_SPECIFIC = {
    ("num_attention_heads", 3),
    ("num_key_value_heads", 3),
    ("num_sub_dims", 7),
    ("num_shared_sub_dims", 9),
    ("num_routed_sub_dims_per_tok", 9),
    ("pad_token_id", 97),
    ("pad_token_id", -98),
    ("num_experts", 1),
    ("num_experts_per_tok", 9),
}


@st.composite
def invalid_configurations(draw):
    """(family name, drawn valid kwargs, field, a value invalid for it there) for either family."""
    from test_reliability import LATENT_MOE_BAD, MOHD_BAD

    name, base, table = draw(
        st.sampled_from([("mohd", mohd_configs(), MOHD_BAD), ("latent_moe", latent_moe_configs(), LATENT_MOE_BAD)])
    )
    base = draw(base)
    field = draw(st.sampled_from(sorted(table)))
    fixed = [v for v in table[field] if isinstance(v, (list, dict)) or (field, v) not in _BASE_SPECIFIC]
    values = fixed + _relative_bad_values(field, base)
    return name, base, field, draw(st.sampled_from(values))


@settings(max_examples=200, deadline=None, suppress_health_check=SLOW_OK)
@given(case=invalid_configurations())
def test_one_invalid_field_on_a_random_valid_configuration_raises_value_error_naming_it(case):
    name, base, field, value = case
    family = FAMILIES[name]
    note(f"{family.config_class.__name__}(**{base}) with {field}={value!r}")
    family.config(**base)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        family.config(**{**base, field: value})
