"""PEFT LoRA on both families: adapters change the outputs on every execution path, and save -> reload ->
merge_and_unload keep them (docs/design.md section 7b, PEFT). Float64, so top-k routing cannot flip on rounding."""

import pytest
import torch


peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from hf_mohd import LatentMoEForCausalLM, MoHDForCausalLM  # noqa: E402
from hf_mohd.lora import lora_targets  # noqa: E402
from hf_mohd.models.mohd_strategies import MoHDMaskedStrategy  # noqa: E402
from tests.utils import FAMILIES  # noqa: E402


MOHD, LATENT_MOE = FAMILIES["mohd"], FAMILIES["latent_moe"]
# The LLaMA fields these models leave at the config's defaults (all key/value heads, no pad id)
UNSET_LLAMA_FIELDS = ("num_key_value_heads", "max_position_embeddings", "pad_token_id")


def tiny_mohd(**kw) -> MoHDForCausalLM:
    """The config's default sub-dimensions (16: 6 shared, 2 routed per token), initial weights."""
    fields = MOHD.defaults(*UNSET_LLAMA_FIELDS, "num_sub_dims", "num_shared_sub_dims", "num_routed_sub_dims_per_tok")
    return MOHD.build(**{**fields, **kw})


def tiny_latent_moe(**kw) -> LatentMoEForCausalLM:
    """Layer 0 dense, layer 1 LatentMoE with a shared expert: every LoRA target kind is present. Eager experts
    (grouped_mm has no float64 kernel), initial weights."""
    fields = LATENT_MOE.defaults(*UNSET_LLAMA_FIELDS)
    fields |= dict(
        moe_intermediate_size=32,
        moe_latent_size=16,
        moe_shared_expert_intermediate_size=32,
        per_layer_config={0: {"mixer_type": "mlp"}},
    )
    return LATENT_MOE.build(**{**fields, **kw})


def lora_config(config, **kw) -> LoraConfig:
    target_modules, target_parameters = lora_targets(config)
    # init_lora_weights=False: random B as well as A, so an adapter that were bypassed would show.
    return LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=target_modules,
        target_parameters=target_parameters or None,
        init_lora_weights=False,
        **kw,
    )


INPUT_IDS = torch.tensor([[5, 17, 42, 8, 91, 3, 60], [11, 2, 33, 70, 19, 44, 6]])


@pytest.mark.parametrize("num_tokens", [7, 2], ids=["sorted-groups", "few-tokens"])
def test_lora_on_the_gather_path_equals_lora_on_the_masked_path(num_tokens):
    """The gather dispatch reads `linear.weight` views; a LoRA layer must not be bypassed there. Two tokens per
    sequence (M = 4 <= N_r / k) is the decoding-sized case the gather path may serve differently."""
    input_ids = INPUT_IDS[:, :num_tokens]
    model = tiny_mohd(sparse_implementation="gather")
    with torch.no_grad():
        base = model(input_ids).logits
    torch.manual_seed(1)
    peft_model = get_peft_model(model, lora_config(model.config))
    with torch.no_grad():
        gather = peft_model(input_ids).logits
    for module in peft_model.modules():
        if hasattr(module, "strategy"):
            module.strategy = MoHDMaskedStrategy(model.config)
    with torch.no_grad():
        masked = peft_model(input_ids).logits
    assert (gather - base).abs().max() > 1e-2, "LoRA did not change the gather path's output (bypassed)"
    torch.testing.assert_close(gather, masked, rtol=1e-10, atol=1e-10)


def test_lora_targets_adapt_projections_not_routers_and_train():
    model = tiny_mohd()
    peft_model = get_peft_model(model, lora_config(model.config))
    names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert not any("router" in n or "group_fusion" in n for n in names)
    adapted = {n.split(".")[-1] for n, m in peft_model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    loss = peft_model(INPUT_IDS, labels=INPUT_IDS).loss
    loss.backward()
    grads = [p.grad for n, p in peft_model.named_parameters() if p.requires_grad]
    assert all(g is not None and g.abs().sum() > 0 for g in grads), "a LoRA matrix got no gradient"


def test_latent_moe_lora_reaches_3d_experts_not_the_router():
    model = tiny_latent_moe()
    modules, parameters = lora_targets(model.config)
    assert parameters == ["experts.gate_up_proj", "experts.down_proj"]
    assert "fc1_latent_proj" in modules and "gate" not in modules
    peft_model = get_peft_model(model, lora_config(model.config))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any(".experts." in n for n in trainable), "target_parameters did not adapt the 3-D expert weights"
    assert not any(".mlp.gate." in n for n in trainable)
    peft_model(INPUT_IDS, labels=INPUT_IDS).loss.backward()
    expert_grads = [p.grad for n, p in peft_model.named_parameters() if p.requires_grad and ".experts." in n]
    assert all(g is not None and g.abs().sum() > 0 for g in expert_grads)


BUILDERS = {
    "mohd-gather": (MoHDForCausalLM, lambda: tiny_mohd(sparse_implementation="gather")),
    "mohd-masked": (MoHDForCausalLM, lambda: tiny_mohd(sparse_implementation="masked")),
    "latent-moe": (LatentMoEForCausalLM, tiny_latent_moe),
}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_lora_save_reload_and_merge_keep_outputs(tmp_path, family):
    model_class, build = BUILDERS[family]
    model = build()
    model.save_pretrained(tmp_path / "base")
    torch.manual_seed(1)
    peft_model = get_peft_model(model, lora_config(model.config)).eval()
    with torch.no_grad():
        expected = peft_model(INPUT_IDS).logits
    peft_model.save_pretrained(tmp_path / "adapter")

    base = model_class.from_pretrained(tmp_path / "base", dtype=torch.float64).eval()
    if family == "latent-moe":
        base.set_experts_implementation("eager")
    with torch.no_grad():
        plain = base(INPUT_IDS).logits
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = reloaded(INPUT_IDS).logits
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert (got - plain).abs().max() > 1e-2, "the reloaded adapter does not change the outputs"

    merged = reloaded.merge_and_unload()
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # fast paths apply again
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        got_merged = merged(INPUT_IDS).logits
    torch.testing.assert_close(got_merged, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "overrides",
    [{"mlp_gated": False, "hidden_act": "relu2"}, {"moe_latent_size": None}],
    ids=["ungated-experts", "no-latent"],
)
def test_latent_moe_lora_targets_follow_the_config(overrides):
    """Ungated experts have `up_proj` (not `gate_up_proj`); without a latent width the latent projections are
    `nn.Identity`, which LoRA cannot wrap, so they are not targeted. Either way the merged model keeps the outputs."""
    model = tiny_latent_moe(**overrides)
    modules, parameters = lora_targets(model.config)
    peft_model = get_peft_model(model, lora_config(model.config)).eval()
    with torch.no_grad():
        expected = peft_model(INPUT_IDS).logits
    adapted = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any(".experts." in n for n in adapted)
    assert ("fc1_latent_proj" in modules) == (overrides.get("moe_latent_size", 16) is not None)
    assert parameters[0] == ("experts.up_proj" if overrides.get("mlp_gated") is False else "experts.gate_up_proj")
    merged = peft_model.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(INPUT_IDS).logits, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("parameter", ["experts.gate_up_proj", "experts.down_proj"])
def test_lora_on_3d_experts_is_expert_major_in_a_and_expert_minor_in_b(parameter):
    """PEFT's layout of a LoRA on a fused (E, out, in) expert weight, as the README documents it: lora_A is
    (E r, in) with expert e's rows at [e r:(e + 1) r], lora_B is (out, E r) with expert e's columns at [:, e::E], and
    the merged weight of expert e is W_e + (alpha / r) B[:, e::E] A[e r:(e + 1) r]. A hand merge with expert-major
    columns of B instead differs, so the layout is pinned by the value."""
    model = tiny_latent_moe()
    experts = model.model.layers[1].mlp.experts
    name = parameter.split(".")[1]
    before = getattr(experts, name).detach().clone()
    num_experts, rank, alpha = before.shape[0], 4, 8
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=[], target_parameters=[parameter], init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    lora_a = next(p for n, p in peft_model.named_parameters() if "layers.1" in n and "lora_A" in n).detach()
    lora_b = next(p for n, p in peft_model.named_parameters() if "layers.1" in n and "lora_B" in n).detach()
    assert lora_a.shape == (num_experts * rank, before.shape[2]) and lora_b.shape == (
        before.shape[1],
        num_experts * rank,
    )
    merged = getattr(peft_model.merge_and_unload().model.layers[1].mlp.experts, name).detach()
    scale = alpha / rank
    by_hand = torch.stack(
        [before[e] + scale * lora_b[:, e::num_experts] @ lora_a[e * rank : (e + 1) * rank] for e in range(num_experts)]
    )
    torch.testing.assert_close(merged, by_hand, rtol=0, atol=1e-12)
    expert_major_b = torch.stack(
        [
            before[e] + scale * lora_b[:, e * rank : (e + 1) * rank] @ lora_a[e * rank : (e + 1) * rank]
            for e in range(num_experts)
        ]
    )
    assert (merged - expert_major_b).abs().max() > 1e-3
