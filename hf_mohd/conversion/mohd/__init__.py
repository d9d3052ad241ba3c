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
"""Dense LLaMA -> MoHD: the model of the same width with sub-dimension blocks (`build`), the optional change of
basis (`rotation`), fitted routers (`routers`), per-layer routed budgets (`budgets`), the dropped-block
compensation (`compensation`), and the one call that writes the folder (`convert`)."""

from .budgets import ROUTED_BUDGETS, BudgetAllocation, allocate_routed_sub_dims, apply_routed_budgets, greedy_budgets
from .build import (
    CHANNEL_ORDERS,
    CONVERSION_PRESETS,
    build_mohd,
    calibrated_channel_importance,
    channel_importance,
    check_mohd_options,
    describe_mohd_conversion,
    llama_to_mohd,
    mohd_config_from_llama,
    permute_hidden_channels,
)
from .convert import allocation_progress_file, convert_mohd
from .rotation import ROTATIONS, fold_rmsnorm_weights, hidden_state_second_moment, rotate_hidden_basis, rotate_llama
from .routers import ROUTER_INITS, fit_routers


__all__ = [
    "CHANNEL_ORDERS",
    "CONVERSION_PRESETS",
    "ROTATIONS",
    "ROUTED_BUDGETS",
    "ROUTER_INITS",
    "BudgetAllocation",
    "allocate_routed_sub_dims",
    "allocation_progress_file",
    "apply_routed_budgets",
    "build_mohd",
    "calibrated_channel_importance",
    "channel_importance",
    "check_mohd_options",
    "convert_mohd",
    "describe_mohd_conversion",
    "fit_routers",
    "fold_rmsnorm_weights",
    "greedy_budgets",
    "hidden_state_second_moment",
    "llama_to_mohd",
    "mohd_config_from_llama",
    "permute_hidden_channels",
    "rotate_hidden_basis",
    "rotate_llama",
]
