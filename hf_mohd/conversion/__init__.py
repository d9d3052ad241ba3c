"""Conversion of dense LLaMA checkpoints into MoHD and LatentMoE models (docs/design.md section 6), including the
carving of dense FFNs into experts (`carve`).

The functions live in the package, so an installed `hf-mohd` converts without the repository; `hf-mohd convert` is
a thin command-line wrapper around `convert_mohd`, `convert_latent_moe` and `convert_carved_latent_moe`, and so are the
repository's transformers-style scripts in `conversion/`, which share their closing steps (sanity generation,
`--push_to_hub`) through `hf_mohd.conversion.scripts`.
"""

from .budgets import (
    ROUTED_BUDGETS,
    BudgetAllocation,
    allocate_routed_sub_dims,
    apply_routed_budgets,
    greedy_budgets,
    sublayer_errors,
)
from .carve import (
    CarveReport,
    carve_llama,
    describe_carving,
    every_expert_active,
    fit_carved_routers,
    partition_neurons,
)
from .convert import ConversionResult, convert_carved_latent_moe, convert_latent_moe, convert_mohd
from .latent_moe import (
    EXPERT_INITS,
    describe_latent_moe_conversion,
    latent_moe_config_from_llama,
    llama_to_latent_moe,
)
from .mohd import (
    CHANNEL_ORDERS,
    CONVERSION_PRESETS,
    calibrated_channel_importance,
    channel_importance,
    check_mohd_options,
    describe_mohd_conversion,
    llama_to_mohd,
    mohd_config_from_llama,
    permute_hidden_channels,
)
from .output import build_model_card, card_perplexities, check_destination, save_converted
from .rotation import (
    ROTATIONS,
    calibration_token_ids,
    fold_rmsnorm_weights,
    hidden_state_second_moment,
    pca_rotation,
    rotate_hidden_basis,
    rotate_llama,
)
from .routers import ROUTER_INITS, fit_routers
from .source import ConversionError, DenseLlamaSource, load_dense_llama
from .verify import max_logit_difference, verify_logits


__all__ = [
    "ROUTED_BUDGETS",
    "BudgetAllocation",
    "allocate_routed_sub_dims",
    "apply_routed_budgets",
    "greedy_budgets",
    "sublayer_errors",
    "CarveReport",
    "carve_llama",
    "convert_carved_latent_moe",
    "describe_carving",
    "every_expert_active",
    "fit_carved_routers",
    "partition_neurons",
    "ROTATIONS",
    "ROUTER_INITS",
    "calibration_token_ids",
    "fit_routers",
    "fold_rmsnorm_weights",
    "hidden_state_second_moment",
    "pca_rotation",
    "rotate_hidden_basis",
    "rotate_llama",
    "CHANNEL_ORDERS",
    "CONVERSION_PRESETS",
    "ConversionError",
    "ConversionResult",
    "convert_latent_moe",
    "convert_mohd",
    "check_mohd_options",
    "EXPERT_INITS",
    "describe_latent_moe_conversion",
    "latent_moe_config_from_llama",
    "llama_to_latent_moe",
    "DenseLlamaSource",
    "build_model_card",
    "card_perplexities",
    "calibrated_channel_importance",
    "channel_importance",
    "check_destination",
    "describe_mohd_conversion",
    "llama_to_mohd",
    "load_dense_llama",
    "max_logit_difference",
    "mohd_config_from_llama",
    "permute_hidden_channels",
    "save_converted",
    "verify_logits",
]
