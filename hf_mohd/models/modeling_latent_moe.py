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
"""LatentMoE (arXiv 2601.18089, Nemotron 3) on a LLaMA-style decoder, with per-layer expert shapes (arXiv 2610.14644).

Each layer is pre-norm attention plus a pre-norm FFN mixer: a LatentMoE block or a dense MLP (arXiv 2601.18089).
The block follows transformers' `NemotronHMoE` (and Megatron-Core's latent MoE): router on the full-width input,
`fc1_latent_proj` D -> l once per token, routed experts and their weighted combine at width l, `fc2_latent_proj`
l -> D, plus a full-width shared expert on the same input. `moe_latent_size=None` makes both projections identities.
Shapes: see the legend in `modeling_common.py`; here E = num_experts, K = num_experts_per_tok, l = latent width
(D when `moe_latent_size` is None), m = moe_intermediate_size.

`LatentMoEModel.forward` and `LatentMoEForCausalLM.forward` are the shared ones of `modeling_common.py`
(`RoutedDecoderMixin`, `RoutedCausalLMMixin`).
"""

from functools import lru_cache, partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import auto_docstring, logging
from transformers.utils.output_capturing import OutputRecorder

from .configuration_latent_moe import LatentMoEConfig
from .modeling_common import (
    MLP,
    Attention,
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    RoutedCausalLMMixin,
    RoutedDecoderMixin,
    TopKRouter,
    activation,
    cast_to,
    check_weight_layout,
    load_balancing_loss,
    replayed_routes,
)
from .native_gather import DTYPES as NATIVE_DTYPES
from .native_gather import native_gather


logger = logging.get_logger(__name__)

ROUTER_NAME = "moe"
ROUTER_SCORE_FUNCTIONS = {"softmax": partial(torch.softmax, dim=-1), "sigmoid": torch.sigmoid}


class LatentMoERouter(TopKRouter):
    """Top-K expert router of one LatentMoE layer (arXiv 2601.18089), on the shared `TopKRouter`.

    logits = W_r x in fp32 on the full-width input (W_r: E x D, no bias); scores = softmax(logits) or
    sigmoid(logits); the K experts are the top-K of the scores (sigmoid: of scores + `e_score_correction_bias`, an
    fp32 buffer used only for selection, DeepSeek-V3 arXiv 2412.19437 section 2.1.2, as `NemotronHTopkRouter`),
    ties to the lower index. Gates = the unbiased scores of the selected experts, renormalised to sum to 1 when
    `norm_topk_prob`, times `routed_scaling_factor`, in fp32; with `router_gate="unit"` exactly 1 instead. In
    training, sigmoid routers add the number of real tokens (`token_mask`; padding is not counted) each expert received
    to `expert_load` for `LatentMoEForCausalLM.update_router_biases`.

    Returns:
        logits (B*T, E) fp32, weights (B, T, K) fp32, indices (B, T, K) int64 expert ids.
    """

    def __init__(self, config: LatentMoEConfig, layer_config: LatentMoEConfig, layer_idx: int):
        super().__init__(
            layer_config.num_experts, config.hidden_size, layer_config.num_experts_per_tok, layer_idx, ROUTER_NAME
        )
        self.num_experts = layer_config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = layer_config.routed_scaling_factor
        self.unit_gates = config.router_gate == "unit"
        self.uses_bias_correction = config.router_score_func == "sigmoid"
        self.score_fn = ROUTER_SCORE_FUNCTIONS[config.router_score_func]
        # CODEPATH: sigmoid routing (DeepSeek-V3 / Nemotron-H) keeps a selection bias; softmax routing has none.
        if self.uses_bias_correction:
            self.e_score_correction_bias = nn.Buffer(torch.zeros(self.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        # Tokens per expert since the last bias update: a plain attribute, not a buffer, so that DDP's buffer
        # broadcast does not replace each rank's counts by rank 0's before `update_router_biases` all-reduces them.
        self.expert_load: torch.Tensor | None = None

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        return self.score_fn(logits)

    def selection_scores(self, scores: torch.Tensor) -> torch.Tensor:
        if self.e_score_correction_bias is None:
            return scores
        return scores + self.e_score_correction_bias.to(scores.dtype)

    def gates(self, chosen_scores: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
        # CODEPATH: router_gate="unit" (a carved dense FFN): gate exactly 1, gradient straight through to the scores.
        if self.unit_gates:  # without autograd the same ones, without the straight-through ops
            return (
                chosen_scores - chosen_scores.detach() + 1.0
                if torch.is_grad_enabled()
                else torch.ones_like(chosen_scores)
            )
        # CODEPATH: norm_topk_prob=True (Mixtral, DeepSeek-V3, Nemotron-H) renormalises the K selected scores.
        if self.norm_topk_prob:
            chosen_scores = chosen_scores / (chosen_scores.sum(-1, keepdim=True) + 1e-20)
        return chosen_scores * self.routed_scaling_factor

    def observe(self, indices: torch.Tensor, token_mask: torch.Tensor | None = None) -> None:
        if self.training and self.uses_bias_correction:
            self._count_load(indices, token_mask)

    def _apply(self, fn, recurse=True):
        """Keeps `e_score_correction_bias` in fp32 through dtype casts (`.to(torch.bfloat16)`, `.double()`): steps
        of gamma = 1e-3 on a bias of order 1 vanish in bf16. Device moves apply as usual."""
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        # CODEPATH: only sigmoid routers (DeepSeek-V3 / Nemotron-H style) hold a correction bias.
        if bias is not None and self.e_score_correction_bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.to(device=self.e_score_correction_bias.device, dtype=torch.float32)
        return self

    @torch.no_grad()
    def _count_load(self, indices: torch.Tensor, token_mask: torch.Tensor | None = None) -> None:
        """Adds the (B, T, K) routed picks of the real tokens (`token_mask` (B, T) nonzero; None: all) to
        `expert_load` (E,), fp32 token counts per expert."""
        if token_mask is None:
            counts = torch.bincount(indices.reshape(-1), minlength=self.num_experts).to(torch.float32)
        else:
            real = token_mask.to(device=indices.device, dtype=torch.bool)[..., None].expand(indices.shape)
            counts = torch.bincount(
                indices.reshape(-1), weights=real.reshape(-1).to(torch.float32), minlength=self.num_experts
            )
        self.expert_load = counts if self.expert_load is None else self.expert_load + counts.to(self.expert_load)


class LatentMoEExpertsBase(nn.Module):
    """Reference (eager) forward shared by both expert forms: a loop over the experts that received tokens.

    `hidden_states` (M, l) at the latent width, `top_k_index` and `top_k_weights` (M, K) -> (M, l), the weighted sum
    of each token's K expert outputs (the Mixtral / NemotronH eager loop; `integrations/moe.py` swaps in batched and
    grouped kernels through `@use_experts_implementation`). Under expert parallelism (`base_model_ep_plan`) each rank
    holds `num_experts` of the experts and the routes to other ranks' experts come as id `num_experts` (weight 0,
    transformers' `AllReduceEP`): those are skipped, as in the example experts class of `integrations/moe.py`.
    """

    @staticmethod
    def shape(config: LatentMoEConfig, layer_idx: int) -> tuple[int, int, int]:
        """(E, l, m) of layer `layer_idx`: experts, width they read and write (D without latent), hidden width."""
        layer_config = config.per_layer_config[layer_idx]
        latent_size = layer_config.moe_latent_size
        width = config.hidden_size if latent_size is None else latent_size
        return layer_config.num_experts, width, layer_config.moe_intermediate_size

    def expert_forward(self, hidden_states: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states, dtype=top_k_weights.dtype)
        with torch.no_grad():
            # one more class for the off-rank id of expert parallelism, never computed
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)  # (E + 1, K, M)
            expert_hit = torch.greater(expert_mask[: self.num_experts].sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            out = self.expert_forward(hidden_states[token_idx], expert_idx)
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, out.to(final_hidden_states.dtype))
        return final_hidden_states.to(hidden_states.dtype)


def aligned_grouped_mm_experts_forward(
    self: LatentMoEExpertsBase, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """`experts_implementation="grouped_mm"`: transformers' `grouped_mm_experts_forward` when the expert widths suit
    the kernel, the eager loop (`LatentMoEExpertsBase.forward`, same result) otherwise.

    `torch.nn.functional.grouped_mm` needs every operand's leading stride to be a multiple of 16 bytes (ATen's
    `check_valid_strides_and_return_transposed`, "strides should be multiple of 16 bytes"); its operands here are
    (tokens, l) and (tokens, m) activations and (E, ., l) / (E, ., m) weights, so l and m must be multiples of
    16 / element_size scalars: of 8 in bf16 and fp16 (l = 36 is not), of 4 in float32.
    """
    alignment = 16 // self.down_proj.element_size()
    if self.hidden_dim % alignment or self.intermediate_dim % alignment:
        logger.warning_once(
            f"LatentMoE experts of width l={self.hidden_dim}, m={self.intermediate_dim} in {self.down_proj.dtype} do "
            f"not suit the grouped_mm kernel (l and m must be multiples of {alignment}); using the eager experts loop."
        )
        return LatentMoEExpertsBase.forward(self, hidden_states, top_k_index, top_k_weights)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def dense_masked_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """`experts_implementation="dense_masked"`: every expert on every token as two dense products, each expert's
    output weighted by its routing weight, 0 where the token did not pick it. The same function as the other kernels
    (the sum over the picked experts), computed like a dense FFN of width E m.

    For many tokens with many experts per token it is the fast form: the grouped and batched kernels copy each token
    K times at the expert input width (an (M K, l) gather, and an (M K, l) output summed back), which with fine
    experts (a carved model: K = 80 of 128 experts of 8 neurons) outweighs the experts' own products and, in
    training, holds K copies of every token per layer for backward. Here the products cost E / K times the picked
    experts' and nothing is copied per expert. For decoding (few tokens) the grouped kernel reads less.
    Shapes: hidden_states (M, l), top_k_index and top_k_weights (M, K) -> (M, l). Any transformers experts layout:
    `gate_up_proj` (E, 2m, l) or `up_proj` (E, m, l) and `down_proj` (E, l, m), transposed ((E, l, 2m), (E, m, l))
    with `is_transposed`, with or without biases. Expert-parallel off-rank ids (>= E) are dropped.

    Raises:
        NotImplementedError: experts with a post-expert norm (it does not commute with the weighting).
    """
    if self.has_post_expert_norm:
        raise NotImplementedError("experts_implementation='dense_masked' does not support a post-expert norm.")
    num_tokens, num_experts = hidden_states.shape[0], self.num_experts
    # (M, E): the routing weight of each picked expert, 0 elsewhere; one more column takes off-rank ids
    gates = top_k_weights.new_zeros(num_tokens, num_experts + 1).scatter_add_(1, top_k_index, top_k_weights)
    gates = gates[:, :num_experts, None].to(hidden_states.dtype)
    weight = self.gate_up_proj if self.has_gate else self.up_proj
    weight = weight.transpose(1, 2) if self.is_transposed else weight  # (E, 2m or m, l)
    hidden = F.linear(hidden_states, weight.reshape(-1, weight.shape[-1]))
    bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    hidden = hidden.view(num_tokens, num_experts, -1) + (0 if bias is None else bias)
    hidden = (self._apply_gate(hidden) if self.has_gate else self.act_fn(hidden)) * gates  # (M, E, m)
    down = self.down_proj if self.is_transposed else self.down_proj.transpose(1, 2)  # (E, m, l)
    out = hidden.reshape(num_tokens, -1) @ down.reshape(-1, down.shape[-1])
    if self.has_bias:
        out = out + gates[..., 0] @ self.down_proj_bias
    return out.to(hidden_states.dtype)


ExpertsInterface.register("dense_masked", dense_masked_experts_forward)

GATHER_FEW_TOKENS = 8  # most tokens of the gather kernel's direct read (decoding, draft verification)


def stored_transposed(weight: torch.Tensor) -> bool:
    """Whether the 3-D `weight` (E, a, b) is stored as a contiguous (E, b, a) tensor (`weight.transpose(1, 2)`
    contiguous), read from its strides on the host (no tensor op: the check runs per layer and decoded token)."""
    _, rows, cols = weight.shape
    expected = (rows * cols, 1, rows)  # strides of a contiguous (E, b, a) read as (E, a, b)
    return all(
        size == 1 or stride == want for size, stride, want in zip(weight.shape, weight.stride(), expected, strict=True)
    )


def experts_column_major(experts: nn.Module) -> bool:
    """Whether the experts' fused weights are stored column-major, expert-input-major (`LatentMoEPreTrainedModel.
    to_weight_layout("column_major")`): `gate_up_proj` / `up_proj` (E, o, l) with `transpose(1, 2)` contiguous, and
    `down_proj` (E, l, m) likewise, so that one expert's weights for one input scalar (a row of o) and for one hidden
    unit (a row of l) are contiguous rows of an embedding table."""
    first = experts.gate_up_proj if experts.has_gate else experts.up_proj
    return stored_transposed(first) and stored_transposed(experts.down_proj)


@lru_cache(maxsize=64)
def bag_starts(count: int, step: int) -> torch.Tensor:
    """(count,) int64 CPU tensor 0, step, 2 step, ...: the gather kernel's bag offsets (and with step 1 the row
    numbers inside one expert), made once per shape rather than per layer and decoded token. Read-only: callers
    must not modify it."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.arange(0, count * step, step)


def gather_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """`experts_implementation="gather"`: only the picked experts' weights are read, planned by the number of tokens M
    (as MoHD's gather strategy plans its blocks).

    - Few tokens on a CPU (M <= `GATHER_FEW_TOKENS`, eager, no autograd, weights in the column-major layout that
      `generate` sets; the decoding case, memory-bound): both products read exactly the K picked experts' weights
      once and copy none, by the native loops of `native_gather` (each picked expert's block streamed), or, where
      those are not built or the dtypes differ, as `embedding_bag` over the weights' rows. Up side: row (e l + i)
      of `gate_up_proj.transpose(1, 2)` is expert e's weights for input scalar i, so bag (token, e) =
      sum_i x_i row(e l + i) = W_e x (a (M K, o) result); down side: row (e m + j) of `down_proj.transpose(1, 2)` is
      expert e's output for hidden unit j, so one bag per token of its K m rows weighted by the gated hidden units is
      the weighted sum of its experts' outputs (the native loops compute the same sums, block by block).
    - Many tokens: `dense_masked_experts_forward` when a token picks at least a quarter of the experts on CPU (half
      elsewhere): then the grouped kernel's K copies of every token, and on CPU its loop over all E experts, cost
      more than computing every expert; else transformers' grouped kernel
      (`aligned_grouped_mm_experts_forward`; the eager loop in float64, which that kernel does not take).
    Shapes: hidden_states (M, l), top_k_index and top_k_weights (M, K) -> (M, l). Expert-parallel off-rank ids (>= E)
    are dropped; the direct read looks for them only on experts that transformers has split
    (`_is_expert_parallel`, set by its expert-parallel sharding), where alone they occur. Layouts, biases and
    post-expert norms the direct read does not cover take the many-token forms.
    """
    num_tokens, num_top_k = top_k_index.shape
    direct = (
        num_tokens <= GATHER_FEW_TOKENS
        and hidden_states.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not (self.has_bias or self.is_transposed or self.has_post_expert_norm)
        and experts_column_major(self)
    )
    if not direct:
        # torch's grouped kernel on CPU is a loop over every expert, so there the dense form wins from K = E / 4
        share = 4 if hidden_states.device.type == "cpu" else 2
        if share * num_top_k >= self.num_experts and not self.has_post_expert_norm:
            return dense_masked_experts_forward(self, hidden_states, top_k_index, top_k_weights)
        if hidden_states.dtype == torch.float64:  # torch's grouped kernel takes no float64
            return LatentMoEExpertsBase.forward(self, hidden_states, top_k_index, top_k_weights)
        return aligned_grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    # Every step below is one dispatched op per layer and decoded token, so constants come from `bag_starts` and
    # no-op casts are skipped.
    num_experts, width = self.num_experts, hidden_states.shape[1]
    experts, gates = top_k_index, top_k_weights
    if self._is_expert_parallel:  # off-rank ids (>= E, weight 0) read expert 0's rows with gate 0
        valid = top_k_index < num_experts
        experts, gates = torch.where(valid, top_k_index, 0), torch.where(valid, top_k_weights, 0)
    gates = cast_to(gates, hidden_states.dtype)
    weight = self.gate_up_proj if self.has_gate else self.up_proj  # (E, o, l)
    same_dtype = weight.dtype == self.down_proj.dtype == hidden_states.dtype
    kernels = native_gather() if same_dtype and hidden_states.dtype in NATIVE_DTYPES else None
    if kernels is not None:  # each picked expert's contiguous block streamed (native_gather.py)
        hidden = kernels.gathered_up(hidden_states.contiguous(), experts.contiguous(), weight.transpose(1, 2))
    else:
        up_rows = torch.add(bag_starts(width, 1), experts.unsqueeze(-1), alpha=width).view(-1)  # (M K l): e l + i
        hidden = F.embedding_bag(
            up_rows,
            weight.transpose(1, 2).reshape(num_experts * width, weight.shape[1]),
            bag_starts(num_tokens * num_top_k, width),
            mode="sum",
            per_sample_weights=hidden_states.repeat(1, num_top_k).view(-1),  # x_i for row (token, k, i)
        )  # (M K, o)
    hidden = (self._apply_gate(hidden) if self.has_gate else self.act_fn(hidden)) * gates.view(-1, 1)  # (M K, m)
    inner = hidden.shape[1]
    if kernels is not None:
        out = kernels.gathered_down(hidden.contiguous(), experts.contiguous(), self.down_proj.transpose(1, 2))
    else:
        down_rows = torch.add(bag_starts(inner, 1), experts.unsqueeze(-1), alpha=inner).view(-1)  # (M K m): e m + j
        out = F.embedding_bag(
            down_rows,
            self.down_proj.transpose(1, 2).reshape(num_experts * inner, width),
            bag_starts(num_tokens, num_top_k * inner),
            mode="sum",
            per_sample_weights=hidden.view(-1),
        )  # (M, l)
    return cast_to(out, hidden_states.dtype)


ExpertsInterface.register("gather", gather_experts_forward)


class LatentMoEExpertsInterface(ExpertsInterface):
    """transformers' experts registry (`ExpertsInterface`'s global mapping, read at every call, so that a kernel
    registered with `ExpertsInterface.register(name, fn)` after import is used as by Mixtral), except that
    transformers' own `grouped_mm_experts_forward` runs as `aligned_grouped_mm_experts_forward`, which falls back to
    the eager loop where the expert widths do not suit the kernel. A kernel registered under "grouped_mm" replaces
    both."""

    def get_interface(self, experts_implementation: str, default):
        forward = super().get_interface(experts_implementation, default)
        return aligned_grouped_mm_experts_forward if forward is grouped_mm_experts_forward else forward


LATENT_MOE_EXPERTS_FUNCTIONS = LatentMoEExpertsInterface()


@use_experts_implementation(experts_interface=LATENT_MOE_EXPERTS_FUNCTIONS)
class LatentMoEExperts(LatentMoEExpertsBase):
    """Gated routed experts as fused 3-D weights: `gate_up_proj` (E, 2m, l) = [gate; up], `down_proj` (E, l, m).

    Expert e maps x (l) to down_e(act(gate_e x) * up_e x) (arXiv 2610.14644: 3 N l m parameters).
    """

    def __init__(self, config: LatentMoEConfig, layer_idx: int):
        super().__init__()
        num_experts, input_size, intermediate_size = self.shape(config, layer_idx)
        self.num_experts = num_experts
        self.hidden_dim = input_size
        self.intermediate_dim = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, input_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, input_size, intermediate_size))
        self.act_fn = activation(config.hidden_act, inplace=True)  # on the kernels' own intermediates

    def expert_forward(self, hidden_states: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(hidden_states, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])


@use_experts_implementation(experts_interface=LATENT_MOE_EXPERTS_FUNCTIONS, has_gate=False)
class LatentMoEUngatedExperts(LatentMoEExpertsBase):
    """Non-gated routed experts (`mlp_gated=False`, e.g. relu2 as Nemotron 3, same layout as `NemotronHExperts`):
    `up_proj` (E, m, l), `down_proj` (E, l, m); expert e maps x to down_e(act(up_e x)) (2 N l m parameters).
    """

    def __init__(self, config: LatentMoEConfig, layer_idx: int):
        super().__init__()
        num_experts, input_size, intermediate_size = self.shape(config, layer_idx)
        self.num_experts = num_experts
        self.hidden_dim = input_size
        self.intermediate_dim = intermediate_size
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, input_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, input_size, intermediate_size))
        self.act_fn = activation(config.hidden_act, inplace=True)  # on the kernels' own intermediates

    def expert_forward(self, hidden_states: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act_fn(F.linear(hidden_states, self.up_proj[expert_idx])), self.down_proj[expert_idx])


class LatentMoEBlock(nn.Module):
    """LatentMoE FFN mixer of one layer (arXiv 2601.18089; transformers' `NemotronHMoE`).

    Stages, for x (B, T, D) (the normed layer input):
    1. `gate`: logits on x at full width D -> weights, indices (B, T, K);
    2. `fc1_latent_proj`: (M, D) -> (M, l), once per token (identity when `moe_latent_size` is None);
    3. `experts`: dispatch, K experts per token and weighted combine at width l -> (M, l);
    4. `fc2_latent_proj`: (M, l) -> (M, D);
    5. `shared_experts` (when m_s > 0): full-width MLP of width m_s on x, added -> (B, T, D).
    No norm inside the latent path (as Nemotron 3). Layer shapes come from `config.per_layer_config[layer_idx]`.
    """

    def __init__(self, config: LatentMoEConfig, layer_idx: int):
        super().__init__()
        layer_config = config.per_layer_config[layer_idx]
        hidden_size, latent_size = config.hidden_size, layer_config.moe_latent_size
        self.gate = LatentMoERouter(config, layer_config, layer_idx)
        # CODEPATH: moe_latent_size=None is the standard fine-grained MoE baseline (experts at full width).
        if latent_size is None:
            self.fc1_latent_proj, self.fc2_latent_proj = nn.Identity(), nn.Identity()
        else:
            self.fc1_latent_proj = nn.Linear(hidden_size, latent_size, bias=config.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent_size, hidden_size, bias=config.mlp_bias)
        # CODEPATH: mlp_gated=True (SwiGLU, arXiv 2610.14644) vs False (relu2, Nemotron 3 / Nemotron-H checkpoints).
        experts_class = LatentMoEExperts if config.mlp_gated else LatentMoEUngatedExperts
        self.experts = experts_class(config, layer_idx)
        shared_size = layer_config.moe_shared_expert_intermediate_size
        # CODEPATH: moe_shared_expert_intermediate_size=0 builds no shared expert.
        self.shared_experts = MLP(layer_config, intermediate_size=shared_size) if shared_size > 0 else None

    def forward(self, hidden_states: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
        _, weights, indices = self.gate(hidden_states, cache=cache, **kwargs)
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])  # (M, D)
        latent = self.fc1_latent_proj(flat)  # (M, l)
        routed = self.experts(latent, indices.reshape(-1, indices.shape[-1]), weights.reshape(-1, weights.shape[-1]))
        output = self.fc2_latent_proj(routed).view(hidden_states.shape)  # (B, T, D)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return output


class LatentMoEDecoderLayer(DecoderLayer):
    """Pre-norm attention then a pre-norm FFN mixer: `LatentMoEBlock` (mixer_type "moe") or the dense `MLP` ("mlp")."""

    def __init__(self, config: LatentMoEConfig, layer_idx: int):
        super().__init__()
        layer_config = config.per_layer_config[layer_idx]
        self.self_attn = Attention(config, layer_idx)
        # CODEPATH: per-layer `mixer_type` ("mlp" layers are dense, e.g. the first layers of Nemotron-style stacks).
        self.mlp = LatentMoEBlock(config, layer_idx) if layer_config.mixer_type == "moe" else MLP(layer_config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LatentMoENoPositionEmbedding(nn.Module):
    """`position_embedding_type="none"`: attention gets no rotary embedding (as Nemotron-H); returns None."""

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> None:
        return None


@auto_docstring
class LatentMoEPreTrainedModel(PreTrainedModel):
    config: LatentMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LatentMoEDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(LatentMoERouter, index=0),
        "hidden_states": LatentMoEDecoderLayer,
        "attentions": Attention,
    }

    # What the model lets a training loop do (read by `hf_mohd.training.ModelSupport`): `to_weight_layout`.
    supports_weight_layout = True

    def post_init(self):
        """Lists `e_score_correction_bias` in `_keep_in_fp32_modules_strict` only for sigmoid routing, the only routing
        that builds the buffer: `from_pretrained(dtype=torch.bfloat16)` then loads it in fp32 (steps of gamma = 1e-3 on
        a bias of order 1 vanish in bf16), and the list names no module that the model lacks (transformers' model
        checks require every listed module to exist)."""
        # CODEPATH: sigmoid routers (DeepSeek-V3 / Nemotron-H style) hold the fp32 selection bias; softmax ones do not.
        if self.config.router_score_func == "sigmoid":
            self._keep_in_fp32_modules_strict = ["e_score_correction_bias"]
        super().post_init()

    def to_weight_layout(self, layout: str = "column_major"):
        """Stores every routed experts module's fused weights in `layout` (same values, shapes and names; only the
        strides change) and returns the model, like MoHD's `to_weight_layout`. "column_major": each expert's
        (out, in) weight stored transposed, expert-input-major (`experts_column_major`), which the gather kernel's
        direct read of few tokens needs; "row_major": contiguous, as `__init__` and `from_pretrained` give them (what
        sharding, training wrappers and the other kernels expect). `generate` with the gather kernel stores the
        column-major layout first.

        Raises:
            ValueError: `layout` is not one of `WEIGHT_LAYOUTS` ("column_major", "row_major").
        """
        check_weight_layout(layout)
        # the new storages are plain tensors even when called under `torch.inference_mode()` (`generate` there):
        # inference tensors as parameter data could never be saved for a backward again
        with torch.inference_mode(False):
            for module in self.modules():
                if isinstance(module, LatentMoEExpertsBase):
                    for param in module.parameters(recurse=False):
                        if param.dim() == 3:
                            stored = param.data.transpose(1, 2).contiguous().transpose(1, 2)
                            param.data = stored if layout == "column_major" else param.data.contiguous()
        return self

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """The experts kernel when none is requested: "gather" (`gather_experts_forward`: transformers' grouped kernel
        or the dense masked form for many tokens, a direct read of the picked experts while decoding on CPU), instead
        of transformers' default "grouped_mm"; a requested kernel is checked by transformers as usual."""
        return super().get_correct_experts_implementation("gather" if requested_experts is None else requested_experts)

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, LatentMoERouter):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.e_score_correction_bias is not None:
                init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, LatentMoEExpertsBase):
            for param in module.parameters(recurse=False):
                init.normal_(param, mean=0.0, std=std)


@auto_docstring
class LatentMoEModel(RoutedDecoderMixin, LatentMoEPreTrainedModel):
    def __init__(self, config: LatentMoEConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [LatentMoEDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # CODEPATH: position_embedding_type="none" (Nemotron-H attention has no positional embedding).
        if config.position_embedding_type == "rope":
            self.rotary_emb = RotaryEmbedding(config=config)
        else:
            self.rotary_emb = LatentMoENoPositionEmbedding()
        self.gradient_checkpointing = False
        self.post_init()


@auto_docstring
class LatentMoEForCausalLM(RoutedCausalLMMixin, LatentMoEPreTrainedModel, GenerationMixin):
    # `update_router_biases` after every optimizer step (aux-loss-free balancing; `hf_mohd.training.ModelSupport`)
    supports_router_bias_update = True

    def __init__(self, config: LatentMoEConfig):
        super().__init__(config)
        self.model = LatentMoEModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, after storing the experts' weights column-major when the experts kernel is
        "gather" (`to_weight_layout`), whose direct read of each decoded token's experts needs it."""
        # CODEPATH: the "gather" experts kernel (a carved checkpoint's, or chosen at load) reads the column-major layout.
        if self.config._experts_implementation == "gather":
            self.to_weight_layout("column_major")
        return super().generate(*args, **kwargs)

    def routers(self) -> list[LatentMoERouter]:
        """The routers of the MoE layers, in layer order (the order of `router_logits`)."""
        return [module for module in self.modules() if isinstance(module, LatentMoERouter)]

    def load_balancing_loss(
        self,
        router_logits: tuple[torch.Tensor, ...] | None,
        attention_mask: torch.Tensor | None = None,
        routing_replay: dict | None = None,
    ) -> torch.Tensor | None:
        """Switch load-balance loss of each router (E_t * sum_j f_j P_j with that layer's K_t), averaged over routers.

        Args:
            router_logits: one (B*T, E_t) tensor per MoE layer, in layer order (as recorded).
            attention_mask: which tokens count: (B, S) with 1 for real tokens, a 4-D mask or None (`counted_tokens`).
            routing_replay: the forward's `routing_replay`, if any: f_j then counts the replayed routes (the ones the
                forward used), not the top-k of the logits.

        Returns:
            A scalar (1.0 under perfect balance), or None when no router was recorded or routing is sigmoid.
        """
        # CODEPATH: the Switch aux loss balances softmax routers; sigmoid routers use `update_router_biases` instead.
        if not router_logits or self.config.router_score_func != "softmax":
            return None
        routers = self.routers()
        routes = replayed_routes(routers, routing_replay, attention_mask) or [None] * len(routers)
        losses = [
            load_balancing_loss((logits,), router.top_k, attention_mask, None if chosen is None else [chosen])
            for logits, router, chosen in zip(router_logits, routers, routes, strict=True)
        ]
        return torch.stack(losses).mean()

    @torch.no_grad()
    def update_router_biases(self) -> dict[int, torch.Tensor]:
        """Aux-loss-free balancing step for sigmoid routers; the trainer calls it after each optimizer step.

        For every sigmoid router, with load_i the tokens routed to expert i since the last call (summed over the
        gradient-accumulation window by the training forwards and all-reduced over ranks when `torch.distributed`
        is initialised): b_i <- b_i + gamma * sign(mean_i load_i - load_i), gamma = `router_bias_update_rate`
        (DeepSeek-V3, arXiv 2412.19437 section 2.1.2). Counters are then reset. The
        sign makes the step independent of the load's scale (e.g. forwards recomputed by gradient checkpointing).

        Returns:
            {layer index: (E,) fp32 loads used for the update}; empty for softmax routing or before any training
            forward.
        """
        routers = [router for router in self.routers() if router.uses_bias_correction]
        if not routers:
            return {}
        loads = [
            router.expert_load
            if router.expert_load is not None
            else torch.zeros(router.num_experts, device=router.e_score_correction_bias.device)
            for router in routers
        ]
        flat = torch.cat([load.to(routers[0].e_score_correction_bias.device) for load in loads])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flat)
        gamma = self.config.router_bias_update_rate
        used = {}
        for router, load in zip(routers, flat.split([router.num_experts for router in routers]), strict=True):
            bias = router.e_score_correction_bias
            bias += gamma * torch.sign(load.mean() - load).to(device=bias.device, dtype=bias.dtype)
            router.expert_load = None
            used[router.layer_idx] = load
        return used


__all__ = ["LatentMoEForCausalLM", "LatentMoEModel", "LatentMoEPreTrainedModel"]
