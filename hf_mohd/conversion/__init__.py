"""Conversion of dense LLaMA checkpoints into MoHD and LatentMoE models (docs/design.md section 6), organised by the
model produced:

- shared by both targets: `source` (loading a dense LLaMA folder or GGUF file), `calibration` (calibration text and
  its token ids), `pca` (principal directions of calibration activations), `verify` (logits against the source),
  `output` (the converted folder, written atomically, and its model card);
- `mohd`: build, rotation, fitted routers, routed budgets, compensation, `convert_mohd`;
- `latent_moe`: upcycling, carving, carved routers, `convert_latent_moe`, `convert_carved_latent_moe`.

Format conversions of finished models (the Nemotron-H checkpoint, GGUF for llama.cpp, vLLM) are in `hf_mohd.interop`.
The functions live in the package, so an installed `hf-mohd` converts without the repository; `hf-mohd convert` is a
thin command-line wrapper around the `convert_*` calls, and so are the repository's transformers-style scripts in
`conversion/`, which share their closing steps (sanity generation, `--push_to_hub`) through
`hf_mohd.conversion.scripts`.
"""

from .calibration import (
    CALIBRATION_ARTICLES,
    HELD_OUT_ARTICLES,
    calibration_ids,
    calibration_token_ids,
    default_calibration_text,
)
from .latent_moe import (
    EXPERT_INITS,
    CarveOptions,
    CarveReport,
    carve_llama,
    convert_carved_latent_moe,
    convert_latent_moe,
    describe_carving,
    describe_latent_moe_conversion,
    every_expert_active,
    fit_carved_routers,
    latent_moe_config_from_llama,
    llama_to_latent_moe,
    partition_neurons,
)
from .mohd import (
    CHANNEL_ORDERS,
    CONVERSION_PRESETS,
    ROTATIONS,
    ROUTED_BUDGETS,
    ROUTER_INITS,
    BudgetAllocation,
    allocate_routed_sub_dims,
    apply_routed_budgets,
    calibrated_channel_importance,
    channel_importance,
    check_mohd_options,
    convert_mohd,
    describe_mohd_conversion,
    fit_routers,
    fold_rmsnorm_weights,
    greedy_budgets,
    hidden_state_second_moment,
    llama_to_mohd,
    mohd_config_from_llama,
    permute_hidden_channels,
    rotate_hidden_basis,
    rotate_llama,
)
from .mohd.budgets import sublayer_errors
from .output import ConversionResult, build_model_card, card_perplexities, check_destination, save_converted
from .pca import pca_rotation, principal_basis
from .source import ConversionError, DenseLlamaSource, load_dense_llama
from .verify import max_logit_difference, verify_logits


__all__ = [
    "CALIBRATION_ARTICLES",
    "CHANNEL_ORDERS",
    "CONVERSION_PRESETS",
    "EXPERT_INITS",
    "HELD_OUT_ARTICLES",
    "ROTATIONS",
    "ROUTED_BUDGETS",
    "ROUTER_INITS",
    "BudgetAllocation",
    "CarveOptions",
    "CarveReport",
    "ConversionError",
    "ConversionResult",
    "DenseLlamaSource",
    "allocate_routed_sub_dims",
    "apply_routed_budgets",
    "build_model_card",
    "calibrated_channel_importance",
    "calibration_ids",
    "calibration_token_ids",
    "card_perplexities",
    "carve_llama",
    "channel_importance",
    "check_destination",
    "check_mohd_options",
    "convert_carved_latent_moe",
    "convert_latent_moe",
    "convert_mohd",
    "default_calibration_text",
    "describe_carving",
    "describe_latent_moe_conversion",
    "describe_mohd_conversion",
    "every_expert_active",
    "fit_carved_routers",
    "fit_routers",
    "fold_rmsnorm_weights",
    "greedy_budgets",
    "hidden_state_second_moment",
    "latent_moe_config_from_llama",
    "llama_to_latent_moe",
    "llama_to_mohd",
    "load_dense_llama",
    "max_logit_difference",
    "mohd_config_from_llama",
    "partition_neurons",
    "pca_rotation",
    "permute_hidden_channels",
    "principal_basis",
    "rotate_hidden_basis",
    "rotate_llama",
    "save_converted",
    "sublayer_errors",
    "verify_logits",
]
