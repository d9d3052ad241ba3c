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
residual stream: the shared blocks plus the top-k routed blocks its router picks (paper section 3). This file holds
the router, group fusion, the sublayers and the model classes; how the active blocks are read and written (the
"masked" and "gather" strategies, the weight layout, tensor parallelism) is the execution engine in
the `mohd_*.py` siblings (strategies, plans, grouped products, weight layout, tensor parallelism).
Shapes: see the legend in `modeling_common.py`; here N = num_sub_dims, N_s shared, N_r = N - N_s routed, s = D / N.

`MoHDModel.forward` and `MoHDForCausalLM.forward` are the shared ones of `modeling_common.py` (`RoutedDecoderMixin`,
`RoutedCausalLMMixin`).
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
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
    TopKRouter,
    autocast_off,
    cast_to,
    check_weight_layout,
    eager_attention_forward,
    load_balancing_loss,
    replayed_routes,
)
from .mohd_layout import (
    fuse_block_major_,
    fused_projection_groups,
    set_linear_layout_,
    shares_block_major_storage,
    unfused_state_dict_hook,
)
from .mohd_products import MoHDSparseBlockMix, mix_blocks
from .mohd_strategies import (
    MoHDMaskedStrategy,
    resolve_small_batch_plan,
    sparse_strategy,
)
from .mohd_tensor_parallel import MoHDTensorParallelProjections


class MoHDRouter(TopKRouter):
    """Sub-dimension router of one sublayer (paper section 3, steps 2-3), on the shared `TopKRouter`.

    logits = W_r x in fp32 (W_r: N_r x D, no bias), p = softmax(logits), S = top-k of p with ties to the lower
    index; gate of a selected block = p_j ("softmax"), k p_j / sum_S p ("normalized") or 1 with the gradient of p_j
    ("unit", straight-through), in the input dtype (the gates scale activations). Ids are absolute block ids (routed
    choice + N_s).

    Returns:
        logits (B*T, N_r) fp32 (or the input dtype when wider), also under autocast, weights (B, T, k) in the input
        dtype, indices (B, T, k) absolute block ids.
    """

    def __init__(self, config: MoHDConfig, layer_idx: int, router_name: str, top_k: int):
        super().__init__(
            config.num_routed_sub_dims,
            config.hidden_size,
            top_k,
            layer_idx,
            router_name,
            index_offset=config.num_shared_sub_dims,
        )
        self.routed_gate = config.routed_gate

    # `routed_gate` -> the gate mode of the native router (`native_gather`'s `mohd_route`)
    NATIVE_GATE_MODES = {"softmax": 0, "normalized": 1, "unit": 2}

    def gates(self, chosen_scores: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
        # CODEPATH: routed_gate="normalized" renormalises the selected probabilities to sum to k.
        if self.routed_gate == "normalized":
            chosen_scores = self.top_k * chosen_scores / chosen_scores.sum(-1, keepdim=True)
        # CODEPATH: routed_gate="unit": the value 1 exactly (p - p = 0), the gradient of p (straight-through).
        elif self.routed_gate == "unit":  # without autograd the same ones, without the straight-through ops
            chosen_scores = (
                chosen_scores - chosen_scores.detach() + 1.0
                if torch.is_grad_enabled()
                else torch.ones_like(chosen_scores)
            )
        return cast_to(chosen_scores, input_dtype)


class MoHDGroupFusion(nn.Module):
    """Group fusion (paper section 3, step 5): y_i <- sum_j F_ij y_j over the N output blocks, F
    identity-initialised.

    Input and output (M, N, s); N^2 parameters, N * D multiply-adds per token.
    """

    def __init__(self, config: MoHDConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_sub_dims, config.num_sub_dims))
        self.num_routed = config.num_routed_sub_dims

    def matrix(self, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        """The (N, N) fusion matrix in `dtype`, times `scale` (activation scaling carried by the matrix)."""
        weight = cast_to(self.weight, dtype)
        return weight * scale if scale != 1.0 else weight

    def forward(self, blocks: torch.Tensor, positions: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        """(M, N, s) -> (M, N, s): `scale * F @ blocks`, the scale (activation scaling, step 4) applied to the N x N
        matrix rather than to the M x D blocks. `positions` (k, M), given where `blocks` is zero outside the first N_s
        blocks and the routed blocks at rows `positions` of `blocks.view(-1, s)` (the grouped gather path's output),
        lets the product keep only those blocks for backward (`MoHDSparseBlockMix`)."""
        weight = self.matrix(blocks.dtype, scale)
        if positions is None:
            return mix_blocks(weight, blocks)
        with autocast_off(blocks.device.type):  # weight and blocks share a dtype: the product autocast would run
            return MoHDSparseBlockMix.apply(weight, blocks, positions, blocks.shape[1] - self.num_routed)


class MoHDSubDimensions(nn.Module):
    """Routing, sparse projections, activation scaling and group fusion of one sparsified sublayer.

    `route` runs the router and returns the plan of the execution strategy; `project_in` applies the input gate
    (paper section 3, step 3) and `project_out` keeps the active output blocks, scales them by alpha = N / (N_s + k)
    (step 4, rebuttal Lemma 1) and fuses them (step 5). The strategy ("gather" or "masked", registered in
    `MoHDSparseInterface` of `mohd_strategies.py`) comes from `config.sparse_implementation` (switch it on a loaded model
    with `set_sparse_implementation`); `route` falls back to "masked" for a sublayer whose projections are not all
    plain `nn.Linear`, the one place that rule lives; the strategy decides how the tokens are routed and planned
    (`MoHDStrategy.route`; one decoded token: `mohd_strategies.one_token_path`).
    """

    def __init__(
        self,
        config: MoHDConfig,
        layer_idx: int,
        router_name: str,
        input_projections: dict[str, int] | None = None,
        sublayer: str = "ffn",
    ):
        super().__init__()
        # k of this sublayer: its kind's per-layer value, else the config's default
        self.sublayer = sublayer
        self.layer_idx = layer_idx
        top_k = config.routed_sub_dims_per_tok(layer_idx, sublayer)
        # CODEPATH: k = 0 (static sub-dimensions): no router, every token's N_s shared blocks.
        self.router = MoHDRouter(config, layer_idx, router_name, top_k) if top_k > 0 else None
        # CODEPATH: group_fusion="mix" (paper default) adds an N x N block mixer; "none" is the ablation.
        self.group_fusion = MoHDGroupFusion(config) if config.group_fusion == "mix" else nn.Identity()
        self.strategy = sparse_strategy(config.sparse_implementation, config).with_top_k(top_k)
        self.masked = MoHDMaskedStrategy(config).with_top_k(top_k)  # for projections that are not plain nn.Linear
        self.scale_by_active = config.activation_scaling == "inverse_active"
        # CODEPATH: sparse_sides="input" / "output" (ablations): the other side reads / writes every block.
        self.sparse_input = config.sparse_sides in ("both", "input")
        self.sparse_output = config.sparse_sides in ("both", "output")
        self.activation_scale = self.active_scale(top_k)
        self.input_compensation = self.output_compensation = None
        # CODEPATH: dropped_block_compensation=True (fitted conversions) adds the mean contribution of skipped blocks.
        if config.dropped_block_compensation and self.router is not None:
            num_sub_dims = config.num_sub_dims
            self.input_compensation = nn.ParameterDict(
                {name: nn.Parameter(torch.zeros(num_sub_dims, width)) for name, width in input_projections.items()}
            )
            # the order of the sublayer's input projections (`project_in`'s linears); ParameterDict sorts its keys
            self.input_projection_names = tuple(input_projections)
            self.output_compensation = nn.Parameter(torch.zeros(num_sub_dims, config.sub_dim_size))
        # `MoHDPreTrainedModel.set_native_token_plan`: whether one decoded token may take the native kernels
        self.native_token_plan_enabled = True

    def active_scale(self, top_k: int) -> float:
        """alpha = N / (N_s + k) with "inverse_active" activation scaling (paper section 3, step 4), else 1."""
        # CODEPATH: activation_scaling="inverse_active" (paper default) vs "none" (ablation, LLaMA equivalence).
        geometry = self.masked.geometry
        return geometry.num_sub_dims / (geometry.num_shared + top_k) if self.scale_by_active else 1.0

    def set_top_k(self, top_k: int) -> None:  # trf-ignore: TRF033 (the config keeps the saved default)
        """Makes every token activate `top_k` routed blocks from now on: the router's k, alpha and the strategies'
        plans follow (the strategy of the same name is rebuilt for the new k, keeping its small-batch plan)."""
        self.router.top_k = top_k
        self.activation_scale = self.active_scale(top_k)
        self.masked = self.masked.with_top_k(top_k)
        self.strategy = self.strategy.with_top_k(top_k)

    def route(self, hidden_states: torch.Tensor, projections, **kwargs):
        """(B, T, D) normed input -> the plan for its B * T tokens (`mohd_plans.MoHDPlan`), chosen by the configured
        strategy (`MoHDStrategy.route`, which also decides how one decoded token runs), or by the masked one when a
        projection of the sublayer (`projections`: all its linears) is not a plain `nn.Linear` (a PEFT LoRA layer, a
        quantised linear computes something other than its `.weight`, which the gather strategy reads): exact either
        way. Without a router (k = 0) every token gets the masked plan of the shared blocks alone."""
        if self.router is None:
            tokens = hidden_states.shape[:-1].numel()
            no_routes = torch.empty(tokens, 0, dtype=torch.long, device=hidden_states.device)
            return self.masked.plan(no_routes, hidden_states.new_empty(no_routes.shape))
        plain = all(type(linear) is nn.Linear for linear in projections)
        strategy = self.strategy if plain else self.masked
        return strategy.route(self, hidden_states, projections, **kwargs)

    def project_in(self, hidden_states: torch.Tensor, plan, linears) -> list[torch.Tensor]:
        """(B, T, D) -> one (B, T, out) tensor per linear W_i of `linears` (paper section 3, step 3):

            x_i = W_i (g ⊙ x) + inactive @ C_i

        g the input gates of `plan` (1 on the shared blocks, the router's gate on the picked ones, 0 elsewhere; all
        ones with `sparse_sides="output"`), computed by the plan from the active blocks alone; C_i the (N, out)
        dropped-block compensation of the linear (`input_compensation`, in the order of `input_projection_names`)
        and inactive the (M, N) blocks a token skips, where the sublayer compensates. With tensor-parallel weights
        each rank's (B, T, out / P) slice (`MoHDTensorParallelProjections`).

        Raises:
            NotImplementedError: a dense side or dropped block compensation on tensor-parallel weights.
        """
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        tensor_parallel = self.tensor_parallel(linears, "input")
        if not self.sparse_input:
            outputs = [linear(flat) for linear in linears]
        elif tensor_parallel is not None:
            outputs = tensor_parallel.project_in(flat, plan, linears)
        else:
            outputs = plan.project_in(flat, linears)
        if self.input_compensation is not None:
            tables = [self.input_compensation[name] for name in self.input_projection_names]
            inactive = plan.inactive
            outputs = [
                out + inactive.to(out.dtype) @ table.to(out.dtype) for out, table in zip(outputs, tables, strict=True)
            ]
        return [out.view(*hidden_states.shape[:-1], -1) for out in outputs]

    def project_out(self, hidden_states: torch.Tensor, plan, linear: nn.Linear) -> torch.Tensor:
        """(B, T, in) -> (B, T, D), the output of the sublayer's projection W_o written into the residual stream's
        blocks (paper section 3, steps 4-5):

            y = F (alpha (mask ⊙ W_o h + inactive ⊙ c))

        mask the token's active blocks (all with `sparse_sides="input"`, where alpha = 1), computed by the plan from
        the active blocks alone; c the (N, s) dropped-block compensation where the sublayer compensates;
        alpha = N / (N_s + k) (`activation_scale`); F group fusion (the identity with `group_fusion="none"`). A plan
        that computes the whole right-hand side at once (`project_out_mixed`) does so where y is zero outside the
        active blocks. With tensor-parallel weights h is this rank's (B, T, in / P) slice and the blocks are summed
        over the ranks before alpha and F.

        Raises:
            NotImplementedError: a dense side or dropped block compensation on tensor-parallel weights.
        """
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        tensor_parallel = self.tensor_parallel([linear], "output")
        fusion = self.group_fusion if isinstance(self.group_fusion, MoHDGroupFusion) else None
        scale = self.activation_scale if self.sparse_output else 1.0
        # the blocks are zero outside the active ones: what the plans' own forms of F alpha y rely on
        sparse = self.sparse_output and tensor_parallel is None and self.output_compensation is None
        mixed = plan.project_out_mixed(flat, linear, fusion, scale) if sparse and fusion is not None else None
        if mixed is None:
            blocks = self.output_blocks(flat, plan, linear, tensor_parallel)
            if fusion is None:
                mixed = blocks if scale == 1.0 else blocks * scale
            else:
                positions = plan.sparse_block_positions(blocks, fusion) if sparse else None
                mixed = fusion(blocks, positions, scale=scale)
        return mixed.view(*hidden_states.shape[:-1], -1)

    def output_blocks(self, flat: torch.Tensor, plan, linear: nn.Linear, tensor_parallel) -> torch.Tensor:
        """(M, in) -> (M, N, s) mask ⊙ W_o h + inactive ⊙ c, before activation scaling and group fusion (see
        `project_out`)."""
        if not self.sparse_output:
            return linear(flat).view(flat.shape[0], self.masked.geometry.num_sub_dims, -1)
        if tensor_parallel is not None:
            blocks = tensor_parallel.project_out(flat, plan, linear)
        else:
            blocks = plan.project_out(flat, linear)
        if self.output_compensation is not None:
            blocks = blocks + plan.inactive.to(blocks.dtype)[..., None] * self.output_compensation.to(blocks.dtype)
        return blocks

    def tensor_parallel(self, linears, side: str) -> MoHDTensorParallelProjections | None:
        """The tensor-parallel state of one side's `linears` ("input" or "output"; None without sharded weights).

        Raises:
            NotImplementedError: the side is dense (`sparse_sides`) or compensated on tensor-parallel weights.
        """
        tensor_parallel = MoHDTensorParallelProjections.of(linears, side)
        if tensor_parallel is None:
            return None
        if not (self.sparse_input if side == "input" else self.sparse_output):
            other = "output" if side == "input" else "input"
            raise NotImplementedError(f"MoHD sparse_sides={other!r} does not run on tensor-parallel weights.")
        if self.output_compensation is not None:
            raise NotImplementedError("MoHD dropped block compensation does not run on tensor-parallel weights.")
        return tensor_parallel


class MoHDAttention(Attention):
    """Attention whose Q/K/V read and whose o_proj writes only the token's active sub-dimensions."""

    def __init__(self, config: MoHDConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        kv_width = config.num_key_value_heads * config.head_dim
        widths = {"q_proj": config.num_attention_heads * config.head_dim, "k_proj": kv_width, "v_proj": kv_width}
        self.sub_dims = MoHDSubDimensions(config, layer_idx, "attn", widths, sublayer="attention")
        self.register_state_dict_post_hook(unfused_state_dict_hook)  # q/k/v saved row-major in every layout

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        projections = (self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        plan = self.sub_dims.route(hidden_states, projections, cache=cache, **kwargs)
        query, key, value = self.sub_dims.project_in(hidden_states, plan, (self.q_proj, self.k_proj, self.v_proj))
        query, key, value = self.prepare_attention_inputs(
            query, key, value, position_embeddings, cache=cache, **kwargs
        )
        # dispatched here, as `Attention.forward` does (engines find attention modules by this call)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        # freed before the output side, as LLaMA's temporaries are: (tokens, heads * head_dim) each
        del query, key, value
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.sub_dims.project_out(attn_output, plan, self.o_proj), attn_weights


class MoHDMLP(MLP):
    """SwiGLU feed-forward whose gate/up read and whose down_proj writes only the active sub-dimensions."""

    def __init__(self, config: MoHDConfig, layer_idx: int):
        super().__init__(config)
        widths = {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
        self.sub_dims = MoHDSubDimensions(config, layer_idx, "mlp", widths, sublayer="ffn")
        self.register_state_dict_post_hook(unfused_state_dict_hook)  # gate/up saved row-major in every layout

    def forward(self, hidden_states: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
        plan = self.sub_dims.route(
            hidden_states, (self.gate_proj, self.up_proj, self.down_proj), cache=cache, **kwargs
        )
        gate, up = self.sub_dims.project_in(hidden_states, plan, (self.gate_proj, self.up_proj))
        activated = self.activate(gate, up)
        # freed before the output side, as in LLaMA's one-expression MLP: two (tokens, intermediate) tensors that
        # would otherwise stay alive through down_proj and push the heap up, to be trimmed and faulted in again
        del gate, up
        return self.sub_dims.project_out(activated, plan, self.down_proj)


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
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(MoHDRouter, index=0),
        "hidden_states": MoHDDecoderLayer,
        "attentions": Attention,
    }

    # What the model lets a training loop do (read by `hf_mohd.training.ModelSupport`): `to_weight_layout`,
    # `set_sparse_implementation`, `set_active_sub_dims`.
    supports_weight_layout = True
    supports_sparse_implementation = True
    supports_active_sub_dims = True
    # The layout `generate` stores the input-side weights in before decoding; `to_weight_layout` sets it.
    decoding_weight_layout = "column_major"

    def to_weight_layout(self, layout: str = "column_major"):
        """Stores the input-side projections that each sublayer's strategy reads by blocks (the gather strategy: q/k/v,
        gate/up) in `layout`, in place, like `Module.to(memory_format=...)`: a storage format, not a hyperparameter
        (results do not depend on it), and the layout `generate` keeps from then on.

        "column_major": column-major, so each s-column sub-dimension block is one contiguous span and batch-1
        decoding streams only the active blocks; the input projections of a sublayer (q/k/v, gate/up) share one
        (D, sum of widths) storage (`fuse_block_major_`), so that the gather plans compute them with one product per
        span of blocks (each weight is the transpose of a column range of it, strides (1, sum of widths)). `generate`
        stores the weights this way before it decodes, unless told otherwise here. "row_major": the plain, contiguous
        `nn.Linear` layout, which a model has after `__init__` and `from_pretrained` (so that `fully_shard`, DeepSpeed
        and `Trainer` with FSDP take it as it is). Values, shapes, parameters, `state_dict` (which gives fused weights
        as row-major copies) and saved checkpoints are the same for both; results agree up to BLAS summation order.
        Masked-strategy sublayers, projections that are not plain `nn.Linear` and sharded weights other than
        tensor-parallel ones are left alone.

        Raises:
            ValueError: `layout` is not one of `WEIGHT_LAYOUTS` ("column_major", "row_major").
        """
        check_weight_layout(layout)
        self.decoding_weight_layout = layout
        # the new storages are plain tensors even when called under `torch.inference_mode()` (`generate` there):
        # inference tensors as parameter data could never be saved for a backward again
        with torch.inference_mode(False):
            for module in self.modules():
                sub_dims = getattr(module, "sub_dims", None)
                if isinstance(sub_dims, MoHDSubDimensions):
                    for name in sub_dims.strategy.block_major_projections:
                        set_linear_layout_(getattr(module, name, None), layout)
                    if layout == "column_major":
                        for linears in fused_projection_groups(module, sub_dims.strategy.fused_projections):
                            fuse_block_major_(linears)
        return self

    def has_fused_input_projections(self) -> bool:
        """Whether some sublayer's input projections share one block-major storage (`to_weight_layout`)."""
        return any(
            shares_block_major_storage(linears)
            for module in self.modules()
            if isinstance(getattr(module, "sub_dims", None), MoHDSubDimensions)
            for linears in fused_projection_groups(module)
        )

    def save_pretrained(self, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`; weights whose input projections share a block-major storage (after
        `generate`) are stored row-major while it writes and in their layout again afterwards, one sublayer at a
        time, so that saving never holds a second copy of them all (which `state_dict`'s row-major copies of shared
        storages would be)."""
        if not self.has_fused_input_projections():
            return super().save_pretrained(*args, **kwargs)
        layout = self.decoding_weight_layout
        self.to_weight_layout("row_major")
        try:
            return super().save_pretrained(*args, **kwargs)
        finally:
            self.to_weight_layout(layout)

    def set_sparse_implementation(self, implementation: str) -> None:  # trf-ignore: TRF033 (execution choice)
        """Switches every MoHD sublayer to a strategy of `MoHDSparseInterface` ("gather", "masked", or one registered
        there) on a loaded model, as `set_experts_implementation` switches experts. It is an execution choice like
        `to_weight_layout`: `config.sparse_implementation` stays the default a save records (choose another at load
        with `from_pretrained(..., sparse_implementation=...)`). The strategies compute the same function; `generate`
        stores the weights a strategy reads by blocks in its decoding layout. The small-batch plan carries over. A
        strategy chosen here runs its own plans on every device: the measured-fastest plans of an accelerator
        (`mohd_strategies.DEVICE_DEFAULT_PLANS`) are the default of a model built from its config only.

        Raises:
            ValueError: `implementation` is not registered in `MoHDSparseInterface`.
        """
        strategy = sparse_strategy(implementation, self.config)
        if hasattr(strategy, "device_defaults"):
            strategy.device_defaults = False
        for module in self.modules():
            if isinstance(module, MoHDSubDimensions):
                small_batch_plan = getattr(module.strategy, "small_batch_plan", None)
                top_k = module.masked.geometry.top_k  # the sublayer's current k
                module.strategy = strategy.with_top_k(top_k)
                if small_batch_plan is not None and hasattr(module.strategy, "small_batch_plan"):
                    module.strategy.small_batch_plan = small_batch_plan

    def set_small_batch_plan(self, plan: str = "auto") -> str:  # trf-ignore: TRF033 (execution choice)
        """How the gather strategy multiplies the picked blocks of 2 to `host_tokens` tokens on an eager CPU run
        without autograd (batched decoding, draft verification; `MoHDSpansPlan`): an execution choice like
        `to_weight_layout`, with results equal up to BLAS summation order, and not saved.

        "per_block" (the default of a new model, unless `HF_MOHD_SMALL_BATCH_PLAN` names another): each block by the
        tokens that picked it only, each block read once, fewer FLOPs in more calls (faster where few-row products
        are compute-bound). "union": all tokens by every picked block, each block read once, then a mask (faster
        only where BLAS reads a block in the same time for 1 or 8 rows). "auto": times few-row products now, once
        per process (about 10 ms, `mohd_strategies.small_gemms_compute_bound`), and takes "per_block" where they are
        compute-bound, else "union". No forward ever times anything.

        Returns:
            The plan set: "union" or "per_block".

        Raises:
            ValueError: `plan` is not one of "auto", "union", "per_block".
        """
        resolved = resolve_small_batch_plan(plan, self.dtype)
        for module in self.modules():
            if isinstance(module, MoHDSubDimensions) and hasattr(module.strategy, "small_batch_plan"):
                module.strategy.small_batch_plan = resolved
        return resolved

    def set_native_token_plan(self, enabled: bool = True) -> None:  # trf-ignore: TRF033 (execution choice)
        """Whether one decoded token may run the native form of `MoHDTokenPlan` (`mohd_strategies.one_token_path`; on by
        default where the native kernels build) or always takes its torch form: an execution choice
        like `set_small_batch_plan`, results equal up to summation order, not saved. For comparisons in one process;
        `HF_MOHD_NATIVE_GATHER=0` turns the kernels off for the whole process instead."""
        for module in self.modules():
            if isinstance(module, MoHDSubDimensions):
                module.native_token_plan_enabled = enabled

    def set_active_sub_dims(self, num_routed_sub_dims_per_tok: int | None) -> None:  # trf-ignore: TRF033
        """Changes k, the routed sub-dimensions every token activates, of a loaded model without reloading: routers,
        activation scaling, the execution plans and the load-balance loss follow. The same weights then run at
        another activation (k = N_r: every block, e.g. the dense function of an exact conversion), as nested training
        over several widths does (MatFormer, arXiv 2310.07707). An int sets k of every routed sublayer; None restores
        each sublayer's k from the config (`config.routed_sub_dims_per_tok(layer_idx, sublayer)`, per-layer budgets
        included). The config keeps what a save records; `active_sub_dims_per_tok` reads the current k.

        Raises:
            ValueError: k neither None nor in [1, N_r] (N_r = `num_routed_sub_dims`), or the model was built without
                routers (k = 0 in its config: there is nothing to route).
        """
        config = self.config
        routed = config.num_routed_sub_dims
        sub_dims = [m for m in self.modules() if isinstance(m, MoHDSubDimensions) and m.router is not None]
        if not sub_dims:
            raise ValueError(
                "set_active_sub_dims: this model has no routers (its config has num_routed_sub_dims_per_tok=0 or no "
                "sparse module), so its active sub-dimensions cannot change."
            )
        k = num_routed_sub_dims_per_tok
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= routed):
            raise ValueError(
                f"set_active_sub_dims: num_routed_sub_dims_per_tok must be None (the config's) or an int in "
                f"[1, {routed}] (the routed sub-dimensions, num_sub_dims - num_shared_sub_dims), got {k!r}."
            )
        for module in sub_dims:
            module.set_top_k(config.routed_sub_dims_per_tok(module.layer_idx, module.sublayer) if k is None else k)

    @property
    def active_sub_dims_per_tok(self) -> int | None:
        """The routed sub-dimensions every token activates now in every routed sublayer (`set_active_sub_dims`; the
        config's at load), or None when the sublayers differ (per-layer budgets)."""
        ks = {module.top_k for module in self.modules() if isinstance(module, MoHDRouter)}
        if not ks:
            return self.config.num_routed_sub_dims_per_tok
        return ks.pop() if len(ks) == 1 else None

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, MoHDRouter):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, MoHDGroupFusion):
            # `copy_` of an identity made on the weight's device: `init.eye_` writes through `torch.eye(out=...)`,
            # which refuses a meta tensor (serving engines build the model on the meta device before loading)
            weight = module.weight
            init.copy_(weight, torch.eye(*weight.shape, dtype=weight.dtype, device=weight.device))
        elif isinstance(module, MoHDSubDimensions) and module.output_compensation is not None:
            init.zeros_(module.output_compensation)
            for table in module.input_compensation.values():
                init.zeros_(table)


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
    def __init__(self, config: MoHDConfig):
        super().__init__(config)
        self.model = MoHDModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, after storing the input-side weights in the decoding layout
        (`to_weight_layout(self.decoding_weight_layout)`, block-major unless set otherwise): decoding reads each
        token's active blocks, which the block-major layout keeps contiguous. Parameters stay contiguous until then,
        so sharding and training wrappers take the model as `__init__` and `from_pretrained` give it."""
        self.to_weight_layout(self.decoding_weight_layout)
        return super().generate(*args, **kwargs)

    def load_balancing_loss(self, router_logits, attention_mask=None, routing_replay=None) -> torch.Tensor | None:
        """Sub-dimension load-balance loss (paper section 3, step 7): Switch form per router, mean over
        routers.

        Args:
            router_logits: one (B*T, N_r) tensor per router ("attn" then "mlp" of each layer), as recorded.
            attention_mask: which tokens count: (B, S) with 1 for real tokens, a 4-D mask or None (`counted_tokens`).
            routing_replay: the forward's `routing_replay`, if any: f_j then counts the replayed routes (the ones the
                forward used), not the top-k of the logits.
        """
        # the routers in call order, the order of `router_logits`: each layer's attention, then its FFN
        routers = [module for module in self.modules() if isinstance(module, MoHDRouter)]
        routes = None
        if routing_replay is not None and router_logits:
            routes = replayed_routes(routers, routing_replay, attention_mask)
        top_k = [router.top_k for router in routers]
        if router_logits and len(router_logits) != len(routers):
            top_k = self.active_sub_dims_per_tok
            if top_k is None:
                raise ValueError(
                    f"load_balancing_loss: {len(router_logits)} router logits for {len(routers)} routers whose k "
                    "differ: pass one logits tensor per router, in call order."
                )
        return load_balancing_loss(router_logits, top_k, attention_mask, routes)


__all__ = ["MoHDForCausalLM", "MoHDModel", "MoHDPreTrainedModel"]
