# Copyright 2026 The hf-mohd Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The per-layer schema of both families' configs: which fields a `per_layer_config` entry may override, and the one
check of an entry (`check_layer_overrides`), used by `LatentMoEConfig`, `MoHDConfig` and the accounting of
config-like objects alike, so that all give the same message.

A LatentMoE layer may change its mixer (`mixer_type`: "moe" or "mlp"), its dense width and its MoE shape
(`PER_LAYER_FIELDS`); a MoHD layer the routed sub-dimensions per token of each sublayer kind
(`MOHD_PER_LAYER_FIELDS`). Everything else is one value for the whole model. This module imports only the standard
library, so the configurations and the accounting can both import it.
"""

from collections.abc import Mapping


MIXER_TYPES = ("moe", "mlp")
# The fields that shape a LatentMoE block (experts, widths, routed scale): what may differ between two MoE layers.
MOE_SHAPE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_latent_size",
    "moe_shared_expert_intermediate_size",
    "routed_scaling_factor",
)
# Fields a `per_layer_config` entry may override: the mixer of the layer, the dense width and the MoE shape;
# everything else (width, attention, `mlp_gated`, `mlp_bias`, routing function) is one value for the whole model.
# `LatentMoEConfig` and the accounting of config dicts check overrides against this one list (`check_layer_overrides`).
PER_LAYER_FIELDS = ("mixer_type", "intermediate_size", *MOE_SHAPE_FIELDS)
# MoHD's sublayer kinds, and the fields a MoHD `per_layer_config` entry may override: the routed sub-dimensions per
# token of each kind (`routed_sub_dims_per_tok`); the block geometry and the default k are one value for the model.
MOHD_SUBLAYERS = ("attention", "ffn")
MOHD_PER_LAYER_FIELDS = tuple(f"{kind}_routed_sub_dims_per_tok" for kind in MOHD_SUBLAYERS)


def check_layer_overrides(layer_idx, overrides: Mapping, allowed: tuple[str, ...] = PER_LAYER_FIELDS) -> None:
    """Rejects a `per_layer_config` entry that overrides a field outside `allowed` (LatentMoE: `PER_LAYER_FIELDS`;
    MoHD: `MOHD_PER_LAYER_FIELDS`).

    Used by both configs' `validate_architecture` and by the accounting of config dicts and other config-like objects,
    so all give the same message.

    Raises:
        ValueError: naming the layer, the fields that cannot vary per layer and the allowed ones.
    """
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ValueError(
            f"`per_layer_config[{layer_idx}]` overrides {unknown}, which cannot vary per layer; "
            f"allowed fields: {list(allowed)}."
        )


__all__ = [
    "MIXER_TYPES",
    "MOE_SHAPE_FIELDS",
    "MOHD_PER_LAYER_FIELDS",
    "MOHD_SUBLAYERS",
    "PER_LAYER_FIELDS",
    "check_layer_overrides",
]
