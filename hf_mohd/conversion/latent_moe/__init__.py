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
"""Dense LLaMA -> LatentMoE: upcycling into fresh experts (`upcycle`), carving the dense FFNs into experts with the
weights unchanged (`carve`), the carved routers fitted without training (`routers`), and the calls that write
the folder (`convert`)."""

from .carve import (
    CarveOptions,
    CarveReport,
    LayerCarving,
    carve_llama,
    carve_source,
    describe_carving,
    partition_neurons,
)
from .convert import convert_carved_latent_moe, convert_latent_moe
from .routers import every_expert_active, expert_mass, fit_carved_routers, moe_blocks
from .upcycle import EXPERT_INITS, describe_latent_moe_conversion, latent_moe_config_from_llama, llama_to_latent_moe


__all__ = [
    "EXPERT_INITS",
    "CarveOptions",
    "CarveReport",
    "LayerCarving",
    "carve_llama",
    "carve_source",
    "convert_carved_latent_moe",
    "convert_latent_moe",
    "describe_carving",
    "describe_latent_moe_conversion",
    "every_expert_active",
    "expert_mass",
    "fit_carved_routers",
    "latent_moe_config_from_llama",
    "llama_to_latent_moe",
    "moe_blocks",
    "partition_neurons",
]
