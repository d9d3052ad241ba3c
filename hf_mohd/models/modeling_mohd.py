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
"""MoHD: Mixture of Hidden Dimensions (Chen et al., ICML 2025, arXiv 2412.05644) on a LLaMA decoder.

Each sparsified sublayer (attention and/or FFN) reads and writes only the token's active sub-dimensions of the
residual stream: the shared blocks plus the top-k routed blocks its router picks (DESIGN section 3, steps 1-7).
Shapes: see the legend in `modeling_common.py`; here N = num_sub_dims, N_s shared, N_r = N - N_s routed, s = D / N.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring
from transformers.utils.output_capturing import OutputRecorder

from .configuration_mohd import MoHDConfig
from .modeling_common import (
    MLP,
    Attention,
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    RoutedCausalLMMixin,
    RoutedDecoderMixin,
    grouped_matmul,
    load_balancing_loss,
    topk_lower_index,
)
from .routing_cache import RoutingCache


class MoHDRouter(nn.Module):
    """Sub-dimension router of one sublayer (DESIGN section 3, steps 2-3).

    logits = W_r x in fp32 (W_r: N_r x D, no bias), p = softmax(logits), S = top-k of p with ties to the lower
    index; gate of a selected block = p_j ("softmax") or k p_j / sum_S p ("normalized").
    With `routing_replay` the indices come from the record and the gates are recomputed from p (so the router
    keeps its gradient). With a `RoutingCache` the routing of these tokens is appended to the record.

    Returns:
        logits (B*T, N_r) fp32, weights (B, T, k) in the input dtype, indices (B, T, k) absolute block ids.
    """

    def __init__(self, config: MoHDConfig, layer_idx: int, router_name: str):
        super().__init__()
        self.layer_idx = layer_idx
        self.router_name = router_name
        self.num_shared = config.num_shared_sub_dims
        self.top_k = config.num_routed_sub_dims_per_tok
        self.normalize_gates = config.routed_gate == "normalized"
        self.weight = nn.Parameter(torch.empty(config.num_routed_sub_dims, config.hidden_size))

    def forward(self, hidden_states: torch.Tensor, cache=None, routing_replay=None, **kwargs):
        compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        logits = F.linear(hidden_states.to(compute_dtype), self.weight.to(compute_dtype))
        probs = torch.softmax(logits, dim=-1)
        if routing_replay is not None:
            routed = routing_replay[(self.layer_idx, self.router_name)].indices.to(probs.device) - self.num_shared
        else:
            routed = topk_lower_index(probs, self.top_k)
        weights = probs.gather(-1, routed)
        # CODEPATH: routed_gate="normalized" renormalises the selected probabilities to sum to k.
        if self.normalize_gates:
            weights = self.top_k * weights / weights.sum(-1, keepdim=True)
        weights = weights.to(hidden_states.dtype)
        indices = routed + self.num_shared
        if isinstance(cache, RoutingCache):
            cache.update_routing(self.layer_idx, self.router_name, indices, weights)
        return logits.reshape(-1, logits.shape[-1]), weights, indices


class MoHDGroupFusion(nn.Module):
    """Group fusion (DESIGN section 3, step 5): y_i <- sum_j F_ij y_j over the N output blocks, F identity-initialised.

    Input and output (M, N, s); N^2 parameters, N * D multiply-adds per token.
    """

    def __init__(self, config: MoHDConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_sub_dims, config.num_sub_dims))

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.weight.to(blocks.dtype), blocks)


class MaskedPlan(NamedTuple):
    """Routing of M tokens for the masked path: input `gates` and binary output `mask`, both (M, N)."""

    gates: torch.Tensor
    mask: torch.Tensor


class GatherPlan(NamedTuple):
    """Routing of M tokens for the gather path, R = M * k (token, routed block) pairs sorted by block.

    token_index (R,), block_index (R,) routed ids 0..N_r-1, gates (R, 1), offsets (N_r,) int32 group ends.
    """

    token_index: torch.Tensor
    block_index: torch.Tensor
    gates: torch.Tensor
    offsets: torch.Tensor


class MoHDMaskedDispatch:
    """Reference path: dense matmuls on the gated input, binary mask on the output (`sparse_implementation="masked"`)."""

    def __init__(self, config: MoHDConfig):
        self.num_sub_dims = config.num_sub_dims
        self.num_shared = config.num_shared_sub_dims
        self.block = config.sub_dim_size

    def plan(self, indices: torch.Tensor, weights: torch.Tensor) -> MaskedPlan:
        """(M, k) absolute block ids and gates -> (M, N) gates and mask."""
        m = indices.shape[0]
        gates = torch.zeros(m, self.num_sub_dims, dtype=weights.dtype, device=weights.device)
        gates[:, : self.num_shared] = 1
        mask = gates.clone()
        gates = gates.scatter(1, indices, weights)
        mask = mask.scatter(1, indices, torch.ones_like(weights))
        return MaskedPlan(gates, mask)

    def project_in(self, hidden_states: torch.Tensor, plan: MaskedPlan, linears) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) tensor per linear, each reading g ⊙ x."""
        m = hidden_states.shape[0]
        gated = (hidden_states.view(m, self.num_sub_dims, self.block) * plan.gates[..., None]).view(m, -1)
        return [linear(gated) for linear in linears]

    def project_out(self, hidden_states: torch.Tensor, plan: MaskedPlan, linear: nn.Linear) -> torch.Tensor:
        """(M, in) -> (M, N, s), zero outside the active blocks."""
        out = linear(hidden_states).view(hidden_states.shape[0], self.num_sub_dims, self.block)
        return out * plan.mask[..., None]


class MoHDGatherDispatch:
    """Fast path (`sparse_implementation="gather"`): inactive blocks are never read nor computed.

    Shared blocks are one dense GEMM over the first N_s * s columns (input side) or rows (output side); routed
    blocks are dispatched like experts: (token, block) pairs sorted by block, one grouped matmul over views of the
    `nn.Linear` weights (no copy), scatter-add back (DESIGN section 3, "Execution paths").
    A projection that is not a plain `nn.Linear` (a PEFT LoRA layer, a quantised linear) computes something other
    than its `.weight`, so it is called as a module on the gated dense input, or its dense output is masked: exact,
    the masked path's computation for that projection only.
    """

    def __init__(self, config: MoHDConfig):
        self.num_sub_dims = config.num_sub_dims
        self.num_shared = config.num_shared_sub_dims
        self.num_routed = config.num_routed_sub_dims
        self.block = config.sub_dim_size
        self.shared_width = self.num_shared * self.block

    def plan(self, indices: torch.Tensor, weights: torch.Tensor) -> GatherPlan:
        """(M, k) absolute block ids and gates -> pairs sorted by routed block and the group offsets."""
        top_k = indices.shape[1]
        routed = indices.reshape(-1) - self.num_shared
        order = torch.argsort(routed, stable=True)
        counts = torch.bincount(routed, minlength=self.num_routed)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return GatherPlan(order // top_k, routed[order], weights.reshape(-1, 1)[order], offsets)

    def project_in(self, hidden_states: torch.Tensor, plan: GatherPlan, linears) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) tensor per linear: shared columns dense, routed columns grouped."""
        m = hidden_states.shape[0]
        shared = hidden_states[:, : self.shared_width]
        routed = hidden_states.view(m, self.num_sub_dims, self.block)[
            plan.token_index, self.num_shared + plan.block_index
        ]
        routed = routed * plan.gates
        outputs = []
        for linear in linears:
            if type(linear) is not nn.Linear:
                blocks = routed.new_zeros(m * self.num_routed, self.block)
                blocks = blocks.index_add(0, plan.token_index * self.num_routed + plan.block_index, routed)
                outputs.append(linear(torch.cat([shared, blocks.view(m, -1).to(shared.dtype)], dim=1)))
                continue
            weight = linear.weight
            out = F.linear(shared, weight[:, : self.shared_width], linear.bias)
            routed_weight = weight[:, self.shared_width :].view(weight.shape[0], self.num_routed, self.block)
            routed_out = grouped_matmul(routed, routed_weight.permute(1, 2, 0), plan.offsets)
            outputs.append(out.index_add(0, plan.token_index, routed_out.to(out.dtype)))
        return outputs

    def project_out(self, hidden_states: torch.Tensor, plan: GatherPlan, linear: nn.Linear) -> torch.Tensor:
        """(M, in) -> (M, N, s): shared rows dense, each token's routed rows grouped, other blocks zero."""
        m = hidden_states.shape[0]
        if type(linear) is not nn.Linear:
            dense = linear(hidden_states).view(m, self.num_sub_dims, self.block)
            shared, routed = (
                dense[:, : self.num_shared],
                dense[:, self.num_shared :][plan.token_index, plan.block_index],
            )
        else:
            weight, bias = linear.weight, linear.bias
            shared = F.linear(
                hidden_states, weight[: self.shared_width], None if bias is None else bias[: self.shared_width]
            )
            routed_weight = weight[self.shared_width :].view(self.num_routed, self.block, weight.shape[1])
            routed = grouped_matmul(hidden_states[plan.token_index], routed_weight.transpose(1, 2), plan.offsets)
            if bias is not None:
                routed = routed + bias[self.shared_width :].view(self.num_routed, self.block)[plan.block_index]
        routed_blocks = hidden_states.new_zeros(m * self.num_routed, self.block).index_add(
            0, plan.token_index * self.num_routed + plan.block_index, routed.to(hidden_states.dtype)
        )
        return torch.cat(
            [shared.view(m, self.num_shared, self.block), routed_blocks.view(m, self.num_routed, self.block)], dim=1
        )


MOHD_DISPATCH = {"masked": MoHDMaskedDispatch, "gather": MoHDGatherDispatch}


class MoHDSubDimensions(nn.Module):
    """Routing, sparse projections, activation scaling and group fusion of one sparsified sublayer.

    `route` runs the router and prepares the dispatch; `project_in` applies the input gate (step 3) and
    `project_out` keeps the active output blocks, scales them by alpha = N / (N_s + k) (step 4, rebuttal Lemma 1)
    and fuses them (step 5). The execution path is chosen once from `config.sparse_implementation`.
    """

    def __init__(self, config: MoHDConfig, layer_idx: int, router_name: str):
        super().__init__()
        self.router = MoHDRouter(config, layer_idx, router_name)
        # CODEPATH: group_fusion="mix" (paper default) adds an N x N block mixer; "none" is the ablation.
        self.group_fusion = MoHDGroupFusion(config) if config.group_fusion == "mix" else nn.Identity()
        self.dispatch = MOHD_DISPATCH[config.sparse_implementation](config)
        self.activation_scale = (
            # CODEPATH: activation_scaling="inverse_active" (paper default) vs "none" (ablation, LLaMA equivalence).
            config.num_sub_dims / config.num_active_sub_dims if config.activation_scaling == "inverse_active" else 1.0
        )

    def route(self, hidden_states: torch.Tensor, **kwargs):
        """(B, T, D) normed input -> dispatch plan for its B * T tokens."""
        _, weights, indices = self.router(hidden_states, **kwargs)
        return self.dispatch.plan(indices.reshape(-1, indices.shape[-1]), weights.reshape(-1, weights.shape[-1]))

    def project_in(self, hidden_states: torch.Tensor, plan, linears) -> list[torch.Tensor]:
        """(B, T, D) -> one (B, T, out) tensor per linear, reading only the active (gated) blocks."""
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        return [out.view(*hidden_states.shape[:-1], -1) for out in self.dispatch.project_in(flat, plan, linears)]

    def project_out(self, hidden_states: torch.Tensor, plan, linear: nn.Linear) -> torch.Tensor:
        """(B, T, in) -> (B, T, D): active output blocks, scaled by alpha, then group-fused."""
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        blocks = self.dispatch.project_out(flat, plan, linear) * self.activation_scale
        return self.group_fusion(blocks).view(*hidden_states.shape[:-1], -1)


class MoHDAttention(Attention):
    """Attention whose Q/K/V read and whose o_proj writes only the token's active sub-dimensions."""

    def __init__(self, config: MoHDConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.sub_dims = MoHDSubDimensions(config, layer_idx, "attn")

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        plan = self.sub_dims.route(hidden_states, cache=cache, **kwargs)
        query, key, value = self.sub_dims.project_in(hidden_states, plan, (self.q_proj, self.k_proj, self.v_proj))
        attn_output, attn_weights = self.attend(
            query, key, value, position_embeddings, attention_mask, cache=cache, **kwargs
        )
        return self.sub_dims.project_out(attn_output, plan, self.o_proj), attn_weights


class MoHDMLP(MLP):
    """SwiGLU feed-forward whose gate/up read and whose down_proj writes only the active sub-dimensions."""

    def __init__(self, config: MoHDConfig, layer_idx: int):
        super().__init__(config)
        self.sub_dims = MoHDSubDimensions(config, layer_idx, "mlp")

    def forward(self, hidden_states: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
        plan = self.sub_dims.route(hidden_states, cache=cache, **kwargs)
        gate, up = self.sub_dims.project_in(hidden_states, plan, (self.gate_proj, self.up_proj))
        return self.sub_dims.project_out(self.activate(gate, up), plan, self.down_proj)


class MoHDDecoderLayer(DecoderLayer):
    """Pre-norm LLaMA block; each sublayer named in `config.sparse_modules` is a MoHD sublayer (with a router)."""

    def __init__(self, config: MoHDConfig, layer_idx: int):
        super().__init__()
        # CODEPATH: sublayers outside `sparse_modules` (or with every block shared) are plain LLaMA sublayers.
        routed = config.num_routed_sub_dims > 0
        sparse_attention = routed and "attention" in config.sparse_modules
        sparse_ffn = routed and "ffn" in config.sparse_modules
        self.self_attn = MoHDAttention(config, layer_idx) if sparse_attention else Attention(config, layer_idx)
        self.mlp = MoHDMLP(config, layer_idx) if sparse_ffn else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


@auto_docstring
class MoHDPreTrainedModel(PreTrainedModel):
    config: MoHDConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MoHDDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(MoHDRouter, index=0),
        "hidden_states": MoHDDecoderLayer,
        "attentions": Attention,
    }

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, MoHDRouter):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, MoHDGroupFusion):
            init.eye_(module.weight)


@auto_docstring
class MoHDModel(RoutedDecoderMixin, MoHDPreTrainedModel):
    def __init__(self, config: MoHDConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [MoHDDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


@auto_docstring
class MoHDForCausalLM(RoutedCausalLMMixin, MoHDPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: MoHDConfig):
        super().__init__(config)
        self.model = MoHDModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def load_balancing_loss(self, router_logits, attention_mask=None) -> torch.Tensor | None:
        """Sub-dimension load-balance loss (DESIGN section 3, step 7): Switch form per router, mean over routers.

        Args:
            router_logits: one (B*T, N_r) tensor per router ("attn" then "mlp" of each layer), as recorded.
            attention_mask: (B, S), 1 for the tokens that count.
        """
        return load_balancing_loss(router_logits, self.config.num_routed_sub_dims_per_tok, attention_mask)


__all__ = ["MoHDForCausalLM", "MoHDModel", "MoHDPreTrainedModel"]
