"""LoRA defaults for hf-mohd models: which modules and 3-D parameters PEFT should adapt.

Custom model types need explicit `target_modules` in PEFT (docs/design.md section 7b); routers (`*.sub_dims.router`,
`*.gate`) and MoHD group fusion stay frozen by default: adapting them changes which sub-dimensions or experts a
token uses, which the adapter's low rank cannot represent well and which breaks routing replay. LatentMoE's fused
3-D expert weights are `nn.Parameter`s, reached with PEFT's `target_parameters`.

Layout of a LoRA on a fused expert weight W of shape (E, out, in) with rank r (PEFT 0.21's `ParamWrapper`):
`lora_A` is (E r, in), expert-major: expert e's rows are `lora_A[e*r:(e+1)*r]`; `lora_B` is (out, E r),
expert-minor: expert e's columns are `lora_B[:, e::E]`. Expert e's merged weight is
`W[e] + (lora_alpha / r) * lora_B[:, e::E] @ lora_A[e*r:(e+1)*r]`; a per-expert merge, export or surgery by hand equals
PEFT's `merge_and_unload` only with this layout (`tests/test_peft.py` pins it).
"""

ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]
LATENT_PROJECTIONS = ["fc1_latent_proj", "fc2_latent_proj"]


def lora_targets(config) -> tuple[list[str], list[str]]:
    """Default LoRA `target_modules` and `target_parameters` of a MoHD or LatentMoE config.

    Returns:
        (target_modules, target_parameters): module-name suffixes of the attention and dense MLP projections (for
        LatentMoE also the shared expert's, and the latent projections when every MoE layer has a latent width;
        with `moe_latent_size=None` they are `nn.Identity`, which LoRA cannot wrap), and the parameter names of the
        fused 3-D expert weights (`experts.gate_up_proj` or `experts.up_proj`, and `experts.down_proj`; none for
        MoHD). Routers and group fusion are excluded (see `ATTENTION_PROJECTIONS` above).
    """
    if getattr(config, "model_type", None) == "mohd":
        return ATTENTION_PROJECTIONS + MLP_PROJECTIONS, []
    gated = getattr(config, "mlp_gated", True)
    modules = ATTENTION_PROJECTIONS + (MLP_PROJECTIONS if gated else ["up_proj", "down_proj"])
    layers = getattr(config, "per_layer_config", None) or [config]
    moe_layers = [layer for layer in layers if getattr(layer, "mixer_type", "moe") == "moe"]
    if moe_layers and all(getattr(layer, "moe_latent_size", None) is not None for layer in moe_layers):
        modules = modules + LATENT_PROJECTIONS
    parameters = ["experts.gate_up_proj" if gated else "experts.up_proj", "experts.down_proj"] if moe_layers else []
    return modules, parameters


__all__ = ["lora_targets"]
