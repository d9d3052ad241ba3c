"""Golden values: both families' logits, one training step's gradients and greedy tokens, frozen in a fixture.

The fixture (`tests/golden/golden.pt`) was written by this file before a refactoring of the model files and the MoHD
execution engine; the refactoring must not change any of these numbers. Every MoHD strategy is covered: the masked
path, the gather path's grouped matmuls (prefill, training), its host-id plans ("union" and "per_block", batched
decoding) and its index-tensor plan (the form `torch.compile` and accelerators take, forced here by reporting a
compilation), each in both weight layouts; LatentMoE with its eager, batched and grouped experts. Models are float64
(so the values agree across CPUs to far below the tolerance), except LatentMoE's grouped experts: `grouped_mm` has no
float64 kernel, so that case is float32 with a float32 tolerance.

Regenerate only when a change of numbers is intended: `HF_MOHD_WRITE_GOLDEN=1 pytest tests/test_golden.py`.
"""

import os
from pathlib import Path

import pytest
import torch

from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM, MoHDConfig, MoHDForCausalLM


GOLDEN = Path(__file__).parent / "golden" / "golden.pt"
WRITE = os.environ.get("HF_MOHD_WRITE_GOLDEN") == "1"
VOCAB = 61
LLAMA_FIELDS = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOHD_CONFIGS = {
    "base": dict(num_sub_dims=8, num_shared_sub_dims=3, num_routed_sub_dims_per_tok=2),
    "biased": dict(
        num_sub_dims=8,
        num_shared_sub_dims=2,
        num_routed_sub_dims_per_tok=3,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        activation_scaling="none",
        routed_gate="normalized",
        group_fusion="none",
    ),
    "ffn_only_unshared": dict(
        num_sub_dims=4, num_shared_sub_dims=0, num_routed_sub_dims_per_tok=2, sparse_modules=["ffn"]
    ),
}
# (sparse_implementation, weight layout, small-batch plan, index-tensor plan forced)
MOHD_STRATEGIES = [
    ("masked", "row_major", "auto", False),
    *[("gather", layout, plan, False) for layout in ("column_major", "row_major") for plan in ("union", "per_block")],
    *[("gather", layout, "union", True) for layout in ("column_major", "row_major")],
]
LATENT_MOE_CONFIGS = {
    "latent_shared": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        moe_latent_size=16,
        moe_shared_expert_intermediate_size=20,
        per_layer_config={1: {"num_experts": 6, "num_experts_per_tok": 3, "moe_latent_size": None}},
    ),
    "sigmoid_ungated": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_gated=False,
        hidden_act="relu2",
        router_score_func="sigmoid",
        routed_scaling_factor=2.5,
        tie_word_embeddings=True,
    ),
}
LATENT_MOE_EXPERTS = ("eager", "batched_mm", "grouped_mm")
CASES = [
    pytest.param("mohd", name, strategy, id=f"mohd-{name}-{'-'.join(map(str, strategy))}")
    for name in MOHD_CONFIGS
    for strategy in MOHD_STRATEGIES
] + [
    pytest.param("latent_moe", name, (experts,), id=f"latent_moe-{name}-{experts}")
    for name in LATENT_MOE_CONFIGS
    for experts in LATENT_MOE_EXPERTS
]


def build(family: str, name: str, strategy: tuple):
    """The tiny float64 model of one case, with seeded weights: routers spread (std 0.5), biases and fusion perturbed,
    so that routing and every optional term matter."""
    torch.manual_seed(0)
    if family == "mohd":
        implementation, layout, plan, _ = strategy
        config = MoHDConfig(**LLAMA_FIELDS, **MOHD_CONFIGS[name], sparse_implementation=implementation)
        model = MoHDForCausalLM(config)
    else:
        config = LatentMoEConfig(**{**LLAMA_FIELDS, **LATENT_MOE_CONFIGS[name]})
        model = LatentMoEForCausalLM(config)
    model = model.to(dtype_of(family, strategy))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param_name, param in sorted(model.named_parameters()):
            if "router" in param_name or "gate.weight" in param_name and family == "latent_moe":
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.5)
            elif param_name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.02)
            elif "group_fusion" in param_name:
                param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype) * 0.1)
    if family == "mohd":
        model.to_weight_layout(layout)
        model.set_small_batch_plan(plan)
    else:
        model.set_experts_implementation(strategy[0])
    return model


def dtype_of(family: str, strategy: tuple) -> torch.dtype:
    return torch.float32 if family == "latent_moe" and strategy[0] == "grouped_mm" else torch.float64


def fingerprint(gradient: torch.Tensor, seed: int) -> torch.Tensor:
    """(sum, sum of squares, dot with a seeded Gaussian vector) of a gradient: any change of one entry shows."""
    flat = gradient.detach().reshape(-1).double()
    probe = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.stack([flat.sum(), flat.square().sum(), flat @ probe])


def measure(model) -> dict:
    """Logits of a padded batch, the training step's loss and gradient fingerprints, and greedy tokens."""
    input_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    result = {}
    model.eval()
    with torch.no_grad():
        result["logits"] = model(input_ids=input_ids, attention_mask=attention_mask).logits
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids, output_router_logits=True, use_cache=False)
    out.loss.backward()
    result["loss"] = out.loss.detach()
    if out.aux_loss is not None:  # None where the config has no aux loss (sigmoid routing balances by its bias)
        result["aux_loss"] = out.aux_loss.detach()
    named = [(name, param.grad) for name, param in sorted(model.named_parameters()) if param.grad is not None]
    result["gradient_names"] = [name for name, _ in named]
    result["gradients"] = torch.stack([fingerprint(grad, index) for index, (_, grad) in enumerate(named)])
    model.eval()
    for batch in (1, 2, 3):
        prompt = torch.randint(3, VOCAB, (batch, 4), generator=torch.Generator().manual_seed(10 + batch))
        result[f"greedy_batch_{batch}"] = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    return result


def all_cases() -> dict:
    values = {}
    for case in CASES:
        family, name, strategy = case.values
        values[case.id] = run_case(family, name, strategy)
    return values


def run_case(family: str, name: str, strategy: tuple) -> dict:
    compiled_form = family == "mohd" and strategy[3]
    original = torch.compiler.is_compiling
    if compiled_form:
        torch.compiler.is_compiling = lambda: True
    try:
        return measure(build(family, name, strategy))
    finally:
        torch.compiler.is_compiling = original


@pytest.fixture(scope="module")
def golden() -> dict:
    if WRITE:
        GOLDEN.parent.mkdir(exist_ok=True)
        torch.save(all_cases(), GOLDEN)
    return torch.load(GOLDEN, weights_only=True)


@pytest.mark.parametrize("family, name, strategy", CASES)
def test_matches_golden(golden, request, family, name, strategy):
    """Every recorded value of the case is reproduced: float64 values to 1e-9 relative (float32 ones to 1e-4), tokens
    exactly. The loss and the gradients are float32-exact only: transformers' `ForCausalLMLoss` casts the logits to
    float32, and how a float32 reduction rounds depends on the CPU's vector width (AVX2 against AVX-512), so they are
    compared at float32's tolerance whatever the model's dtype."""
    case_id = request.node.callspec.id
    rtol, atol = (1e-9, 1e-12) if dtype_of(family, strategy) == torch.float64 else (1e-4, 1e-5)
    loss_rtol, loss_atol = max(rtol, 1e-4), max(atol, 1e-6)
    assert case_id in golden, f"{case_id} has no golden values; regenerate with HF_MOHD_WRITE_GOLDEN=1"
    expected, actual = golden[case_id], run_case(family, name, strategy)
    assert expected.keys() == actual.keys()
    for key in expected:
        if key == "gradient_names":
            assert actual[key] == expected[key], "the set of parameters with gradients changed"
        elif key == "gradients":
            for name, got, want in zip(expected["gradient_names"], actual[key], expected[key], strict=True):
                torch.testing.assert_close(got, want, rtol=loss_rtol, atol=loss_atol, msg=name)
        elif key.startswith("greedy"):
            assert torch.equal(actual[key], expected[key]), key
        elif key == "loss":
            torch.testing.assert_close(actual[key], expected[key], rtol=loss_rtol, atol=loss_atol, msg=key)
        else:
            torch.testing.assert_close(actual[key], expected[key], rtol=rtol, atol=atol, msg=key)


def test_golden_cases_differ_between_configs(golden):
    """The fixture is not degenerate: different configs give different logits, and the strategies of one config
    agree with each other (so a strategy that silently fell back to another could not hide a changed number)."""
    base = [key for key in golden if key.startswith("mohd-base-")]
    biased = [key for key in golden if key.startswith("mohd-biased-")]
    assert len(base) == len(MOHD_STRATEGIES) and len(biased) == len(MOHD_STRATEGIES)
    assert not torch.allclose(golden[base[0]]["logits"], golden[biased[0]]["logits"])
    for key in base[1:]:
        torch.testing.assert_close(golden[key]["logits"], golden[base[0]]["logits"], rtol=1e-9, atol=1e-10)
    assert golden[base[0]]["aux_loss"] > 0
