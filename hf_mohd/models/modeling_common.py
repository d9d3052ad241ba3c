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
"""Pieces shared by the MoHD and LatentMoE families: norm, rotary, attention, MLP, routing helpers.

Shape legend used in this package: B batch, T tokens in this forward, S cached + new tokens, D hidden_size,
M = B * T flattened tokens, N sub-dimensions (MoHD) or experts (LatentMoE), k routed picks per token.

This file is copied next to the weights by `save_pretrained` (remote code), so it imports only `torch`,
`transformers` and same-folder siblings. The forwards of the base model and of the causal LM, and the cache hook of
`generate`, which both families share, are the mixins at the end of this file (`RoutedDecoderMixin`,
`RoutedCausalLMMixin`): each family's model classes inherit them.
"""

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from transformers.activations import ACT2FN, SiLUActivation
from transformers.cache_utils import DynamicCache, StaticCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .routing_cache import RoutingCache


# How a family stores the weights its sparse kernels read (`to_weight_layout` of both families): "column_major", each
# weight (out, in) / expert weight (E, out, in) stored transposed (input-major), what decoding reads; "row_major", the
# plain contiguous layout `__init__` and `from_pretrained` give. Values, shapes and checkpoints are the same for both.
WEIGHT_LAYOUTS = ("column_major", "row_major")


def check_weight_layout(layout: str) -> None:
    """Raises ValueError naming `layout` and `WEIGHT_LAYOUTS` when it is not one of them."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"to_weight_layout: `layout` must be one of {WEIGHT_LAYOUTS}, got {layout!r}.")


try:  # the context variable transformers' output-capturing hooks read (private: absent, every such hook counts)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - other transformers versions
    _active_collector = None


logger = logging.get_logger(__name__)

# transformers 5.x renamed the forward argument `past_key_values` to `cache`; LLaMA's modules (attention, decoder
# layer, base model, causal LM) accept the old name with a `FutureWarning` and pass it on as `cache`
# (`modeling_llama.py`: `@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")`). The same decorator on the
# same modules here gives the same behaviour and message; without it the old name would fall into `**kwargs` and the
# cache would be ignored.
deprecate_past_key_values = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")


class RMSNorm(nn.Module):
    """Root-mean-square norm as in LLaMA (`LlamaRMSNorm`): x / rms(x) * weight, computed in fp32 at least."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(at_least_fp32(input_dtype))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), identical to `LlamaRotaryEmbedding` (one instance per model)."""

    def __init__(self, config):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config, **kwargs) -> tuple[torch.Tensor, float]:
        """Inverse frequencies 1 / theta^(2i / head_dim) of the original RoPE; returns (inv_freq, 1.0)."""
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @dynamic_rope_update
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Applies RoPE to q and k of shape (B, heads, T, head_dim); cos/sin are (B, T, head_dim)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, kv_heads, S, head_dim) -> (B, kv_heads * n_rep, S, head_dim), as `torch.repeat_interleave` on dim 1."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
):
    """Reference attention (softmax(QK^T * scaling + mask) V), as in `modeling_llama.eager_attention_forward`."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class Attention(nn.Module):
    """LLaMA multi-head attention with GQA and RoPE (`LlamaAttention`); the head split, RoPE and cache update
    (`prepare_attention_inputs`) are shared with the sparse variant, whose forward dispatches the same way.

    `q_proj` reads `hidden_size` columns and `o_proj` writes `hidden_size` rows; heads x head_dim is independent
    of `hidden_size` (MoHD expansion keeps the base heads while widening the residual stream).
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )

    def prepare_attention_inputs(
        self,
        query_states: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, heads * head_dim) projections -> (B, heads, T, head_dim) query and (B, kv_heads, S, head_dim) key and
        value, as the attention interface takes them.

        Splits the heads, applies RoPE when `position_embeddings` is given (None means no positional embedding, as in
        Nemotron-H) and updates the key/value cache, as `LlamaAttention.forward` does before its dispatch.
        """
        hidden_shape = (*query_states.shape[:-1], -1, self.head_dim)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        return query_states, key_states, value_states

    @deprecate_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        query_states, key_states, value_states = self.prepare_attention_inputs(
            self.q_proj(hidden_states),
            self.k_proj(hidden_states),
            self.v_proj(hidden_states),
            position_embeddings,
            cache=cache,
            **kwargs,
        )
        # the dispatch stays in `forward`, as in `LlamaAttention`: serving engines that run transformers modeling code
        # (vLLM's Transformers backend) find the attention modules by this call in their forward's source
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class ReLUSquaredFunction(torch.autograd.Function):
    """y = relu(x)^2 with dy/dx = 2 relu(x): backward is one product with the saved relu(x) (which is 0 where x <= 0),
    where autograd's composition runs pow's backward and then relu's `threshold_backward`, one more pass over a
    tensor of the experts' (tokens x K, m) size. Once differentiable."""

    @staticmethod
    def forward(ctx, hidden_states: torch.Tensor) -> torch.Tensor:
        relu = F.relu(hidden_states)
        ctx.save_for_backward(relu)
        return relu.square()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        (relu,) = ctx.saved_tensors
        return torch.mul(grad_output, relu).mul_(2.0)


class ReLUSquared(nn.Module):
    """relu(x)^2, transformers' `ReLUSquaredActivation` (the "relu2" of Nemotron-H, arXiv 2109.08668).

    Under autograd `ReLUSquaredFunction` computes it, with a one-pass backward. With `inplace=True`, an input outside
    autograd (inference, `torch.no_grad`) is overwritten: `relu_` then `square_`, the same values without the two
    input-sized temporaries. That is for intermediates no one else can see, as `nn.ReLU(inplace=True)`: the experts'
    (tokens x K, m) hidden activations inside the experts kernels (large temporaries are fresh memory, faulted in on
    every call). A module's output, which a forward hook may have kept (the MLP's `up_proj`), takes `inplace=False`.

    Shapes: (..., m) -> (..., m).
    """

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = inplace

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.requires_grad:
            return ReLUSquaredFunction.apply(hidden_states)
        if self.inplace:
            return torch.relu_(hidden_states).square_()
        return torch.square(F.relu(hidden_states))


class SiLUGatedProductFunction(torch.autograd.Function):
    """y = silu(gate) * up (SwiGLU's product, Shazeer 2020, arXiv 2002.05202) as one autograd node that keeps only
    `gate` and `up` for backward, where autograd's composition (silu, then mul) also keeps silu(gate).

    Forward: silu(gate) written once and multiplied in place by `up` (one (tokens, intermediate) tensor instead of
    two). Backward, with g the incoming gradient: grad_up = silu(gate) * g, recomputed, and grad_gate =
    `silu_backward(g * up, gate)` written over g * up, two tensors instead of the composition's three. The values are
    the composition's to the bit: the same elementwise operations on the same operands. Each (tokens, intermediate)
    tensor not allocated is memory not faulted in, which on CPU costs more than these products' arithmetic. Once
    differentiable, as `ReLUSquaredFunction`.
    Shapes: gate, up (..., intermediate), one dtype and shape -> (..., intermediate).
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            grad_gate = torch.mul(grad_output, up)
            torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        if ctx.needs_input_grad[1]:
            grad_up = F.silu(gate).mul_(grad_output)
        return grad_gate, grad_up


def activation(name: str, inplace: bool = False) -> nn.Module:
    """The activation module of `config.hidden_act`: transformers' `ACT2FN[name]`, with "relu2" as
    `ReLUSquared(inplace)` (see there for when `inplace` is safe)."""
    return ReLUSquared(inplace) if name == "relu2" else ACT2FN[name]


class MLP(nn.Module):
    """Feed-forward block: `down(act(gate(x)) * up(x))` when `mlp_gated` (SwiGLU with silu, as LLaMA), else
    `down(act(up(x)))` (e.g. relu2, as Nemotron-H). The form is fixed once in `__init__`.

    Args:
        config: a config with `hidden_size`, `intermediate_size`, `hidden_act`, optionally `mlp_gated`
            (default True) and `mlp_bias` (default False).
        intermediate_size: overrides `config.intermediate_size` (shared experts, per-layer widths).
    """

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size or config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        # CODEPATH: Nemotron-H style checkpoints use a non-gated MLP (relu2); LLaMA style uses SwiGLU.
        self.gate_proj = (
            nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
            if getattr(config, "mlp_gated", True)
            else None
        )
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)
        self.act_fn = activation(config.hidden_act)
        # silu gates (LLaMA's SwiGLU) run as one autograd node under autograd (`SiLUGatedProductFunction`)
        self.fused_silu_product = self.gate_proj is not None and type(self.act_fn) in (SiLUActivation, nn.SiLU)

    def _act_fn_hooked(self, pre: bool = False) -> bool:
        """Whether a forward hook of `act_fn` (its own or a global one; with `pre`, a pre-forward hook too) could see
        it run."""
        act_fn = self.act_fn
        if act_fn._forward_hooks or _global_forward_hooks:
            return True
        return pre and bool(act_fn._forward_pre_hooks or _global_forward_pre_hooks)

    def _fusable(self, gate: torch.Tensor, up: torch.Tensor) -> bool:
        """Whether `SiLUGatedProductFunction` may stand in for `act_fn(gate) * up`: no hook of any kind can expect to
        see `act_fn` run (its module hooks, the global ones, a forward set on the instance), not while compiling (the
        compiler fuses the composition itself), and operands of one dtype and shape (the composition would promote
        or broadcast)."""
        return not (
            self._act_fn_hooked(pre=True)
            or "forward" in vars(self.act_fn)
            or torch.compiler.is_compiling()
            or gate.dtype != up.dtype
            or gate.shape != up.shape
        )

    def activate(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up for the gated form, act(up) otherwise; shapes (..., intermediate_size)."""
        if gate is None:
            return self.act_fn(up)
        if self.fused_silu_product and torch.is_grad_enabled() and self._fusable(gate, up):
            return SiLUGatedProductFunction.apply(gate, up)
        activated = self.act_fn(gate)
        if not torch.is_grad_enabled() and not self._act_fn_hooked() and activated is not gate:
            # outside autograd, and no forward hook can hold act(gate) (a fresh tensor, not gate itself): the product
            # overwrites it, one (tokens, intermediate) temporary fewer
            return activated.mul_(up)
        return activated * up

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        gate = self.gate_proj(hidden_states) if self.gate_proj is not None else None
        return self.down_proj(self.activate(gate, self.up_proj(hidden_states)))


class DecoderLayer(GradientCheckpointingLayer):
    """Pre-norm decoder block of both families: h + attn(norm(h)), then h + mixer(norm(h)).

    Subclasses build `self_attn`, `mlp` (the FFN mixer: dense, MoHD or LatentMoE), `input_layernorm` and
    `post_attention_layernorm`; the cache reaches the mixer too, so that routers can record into it.
    """

    @deprecate_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states), cache=cache, **kwargs)
        return residual + hidden_states


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """`torch.autocast(device_type, enabled=False)` where autocast is on for `device_type`, else a null context:
    entering autocast costs more than a small product (a decoding step's router GEMV)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """`torch.promote_types(dtype, torch.float32)` for a floating dtype, decided on the host (no dispatched op):
    float64 stays (equivalence tests), every narrower float becomes float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cast_to(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)`, without dispatching an op when it already has that dtype (the same tensor either way)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def topk_lower_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (..., k) of the k largest `scores` along the last dim; ties go to the lower index.

    `torch.topk` does not promise an order among equal values; a stable descending sort does, which makes
    routing deterministic across execution paths and devices.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


class TopKRouter(nn.Module):
    """The router both families share: fp32 logits, top-k selection (or a replayed one), gates, routing record.

    logits = W_r x (W_r: C x D, no bias) in fp32 with autocast off, also under bf16 autocast: top-k selection is
    sensitive to rounding. scores = `score(logits)`; the chosen
    ids are `topk_lower_index(selection_scores(scores), top_k)` (ties to the lower index), or, with
    `routing_replay`, the record of (`layer_idx`, `router_name`) minus `index_offset` (`replayed_choices`; the gates
    are then still recomputed from the current scores, so the router keeps its gradient). gates = `gates(scores of
    the chosen ids, input dtype)`; ids returned are the chosen ones plus `index_offset`. With a `RoutingCache` the ids
    and gates of these tokens are appended to its record.

    `token_mask` (B, T), 1 at the real tokens of this forward (the base model passes the last T columns of its 2-D
    `attention_mask`; None: all real), tells padding apart: a replayed record may mark padding rows with any id (the
    engines' -1), and `observe` sees it to count real tokens only.

    A family overrides `score` (default softmax), `selection_scores` (default the scores), `gates` (default the
    scores as they are) and `observe` (a hook seeing the returned ids and `token_mask`; default nothing).

    Args:
        num_choices: C, the routed choices (MoHD: routed sub-dimensions N_r; LatentMoE: experts E).
        hidden_size: D.
        top_k: k choices per token.
        layer_idx, router_name: the key of this router in routing records.
        index_offset: added to the chosen ids (MoHD: N_s, so ids are absolute block ids).

    Returns (forward):
        logits (B*T, C) in fp32 (or the input dtype when wider), weights (B, T, k), indices (B, T, k) int64.
    """

    def __init__(
        self, num_choices: int, hidden_size: int, top_k: int, layer_idx: int, router_name: str, index_offset: int = 0
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.router_name = router_name
        self.top_k = top_k
        self.index_offset = index_offset
        self.weight = nn.Parameter(torch.empty(num_choices, hidden_size))

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1)

    def selection_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores

    def gates(self, chosen_scores: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
        return chosen_scores

    def observe(self, indices: torch.Tensor, token_mask: torch.Tensor | None = None) -> None:
        pass

    def replayed_choices(
        self,
        routing_replay,
        token_mask: torch.Tensor | None = None,
        tokens_shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """The choices this router replays: the ids of `routing_replay[(layer_idx, router_name)]` minus `index_offset`.

        Engines and RL frameworks mark padding rows with -1: an id outside the record's range [index_offset,
        index_offset + C) in a row that `token_mask` marks as padding is ignored, and that row gets the valid dummy
        route 0 .. k-1 (as `routing_replay_from_engine` gives padding; the outputs of padding rows do not matter).

        Args:
            routing_replay: {(layer_idx, router name): `RoutingRecord`} with indices (B, T, k) of any integer dtype.
            token_mask: (B, T), nonzero at real tokens; None: every row is a real token.
            tokens_shape: (B, T) of the forward, checked against the record when given.

        Returns:
            (B, T, k) int64 choice ids 0 .. C-1 on the router's device.

        Raises:
            ValueError: the record's shape is not (B, T, k), or an id is out of range in a real-token row (the message
                names the record key (layer, kind), the row (batch, position) and the allowed range).
        """
        key = (self.layer_idx, self.router_name)
        record = routing_replay[key].indices
        num_choices, low = self.weight.shape[0], self.index_offset
        if tokens_shape is not None and tuple(record.shape) != (*tokens_shape, self.top_k):
            raise ValueError(
                f"Routing record {key}: indices of shape {tuple(record.shape)}, expected (batch, tokens, top_k) = "
                f"{(*tokens_shape, self.top_k)} for this forward."
            )
        chosen = record.to(device=self.weight.device, dtype=torch.long) - low
        invalid = (chosen < 0) | (chosen >= num_choices)  # (B, T, k)
        real = invalid if token_mask is None else invalid & token_mask.to(chosen.device).bool()[..., None]
        if real.any():
            batch, position, slot = torch.nonzero(real)[0].tolist()
            raise ValueError(
                f"Routing record {key}: id {int(chosen[batch, position, slot]) + low} at row (batch {batch}, "
                f"position {position}) is out of range; valid ids are {low} .. {low + num_choices - 1}. Ids outside "
                "that range (such as the engines' -1) are allowed only in padding rows (attention_mask 0)."
            )
        padding = invalid.any(-1, keepdim=True)
        return torch.where(padding, torch.arange(self.top_k, device=chosen.device), chosen)

    def observed(self) -> bool:
        """Whether anything besides the forward's return value could see this router run: a global module hook, a
        pre-forward hook, a forward set on the instance, a forward hook other than transformers' output-capturing
        one, or that hook while the current forward records "router_logits" (`output_router_logits=True`). A caller
        that could route without calling the module (MoHD's native decoding step) calls it when this is True."""
        if _global_forward_hooks or _global_forward_pre_hooks or self._forward_pre_hooks or "forward" in vars(self):
            return True
        if not self._forward_hooks:
            return False
        if any(getattr(hook, "__name__", "") != "output_capturing_hook" for hook in self._forward_hooks.values()):
            return True
        if _active_collector is None:
            return True
        collected = _active_collector.get()
        return collected is not None and "router_logits" in collected

    def forward(self, hidden_states: torch.Tensor, cache=None, routing_replay=None, token_mask=None, **kwargs):
        # host-side dtype rule and no no-op casts: the router runs once per sublayer and token in decoding, where
        # each dispatched op costs time
        compute_dtype = at_least_fp32(hidden_states.dtype)
        with autocast_off(hidden_states.device.type):
            logits = F.linear(cast_to(hidden_states, compute_dtype), cast_to(self.weight, compute_dtype))
        scores = self.score(logits)
        if routing_replay is not None:
            chosen = self.replayed_choices(routing_replay, token_mask, hidden_states.shape[:-1])
        else:
            chosen = topk_lower_index(self.selection_scores(scores), self.top_k)
        weights = self.gates(scores.gather(-1, chosen), hidden_states.dtype)
        # contiguous either way: the plans flatten the ids with `view`
        indices = chosen + self.index_offset if self.index_offset else chosen.contiguous()
        self.record(indices, weights, cache, token_mask)
        return logits.reshape(-1, logits.shape[-1]), weights, indices

    def record(self, indices: torch.Tensor, weights: torch.Tensor, cache=None, token_mask=None) -> None:
        """Where a forward's routes go once chosen, the one place for every way of routing (this forward, MoHD's
        native one-token routing): `observe` sees the ids, and a `RoutingCache` appends ids and gates, (B, T, k)
        each, to its routing record under (`layer_idx`, `router_name`); other caches keep no record."""
        self.observe(indices, token_mask)
        if isinstance(cache, RoutingCache):
            cache.update_routing(self.layer_idx, self.router_name, indices, weights)


def replayed_routes(routers, routing_replay, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor] | None:
    """The choices each of `routers` (in their order) replays from `routing_replay`, as `TopKRouter.replayed_choices`
    gives them to the forward: (B, T, k) ids 0 .. C-1, padding rows (0 in the last T columns of the (B, S)
    `attention_mask`) with a dummy route. None when `routing_replay` is None (the routers chose their own top-k)."""
    if routing_replay is None:
        return None
    routes = []
    for router in routers:
        tokens = routing_replay[(router.layer_idx, router.router_name)].indices.shape[1]
        token_mask = None if attention_mask is None else attention_mask[:, -tokens:]
        routes.append(router.replayed_choices(routing_replay, token_mask))
    return routes


def counted_tokens(attention_mask: torch.Tensor | None, batch: int, tokens: int) -> torch.Tensor | None:
    """Which tokens of a forward's (B, T) inputs are real, from the forward's `attention_mask` in any of the forms
    transformers passes: (B, S) with 1 for real tokens (its last T columns); a 4-D (B, 1 or H, T, S) mask, boolean
    (True: attend) or additive float (0: attend, the dtype's minimum: masked) as `generate_batch` (continuous batching)
    and packed training pass it, where a token is real when it attends to itself (the diagonal of the last T key
    columns: a padding row of a 4-D mask attends to nothing); None (no mask) for all tokens.

    Packed sequences marked by `position_ids` only (no mask, or a 2-D mask of ones) count every token: packing changes
    which tokens attend to which, not which tokens are real.

    Returns:
        (B, T) tensor of 1.0 / 0.0 (the mask's device), or None when every token counts.

    Raises:
        ValueError: when `attention_mask` is neither 2-D nor 4-D, or its batch or length does not cover (B, T).
    """
    if attention_mask is None:
        return None
    if attention_mask.ndim == 2:
        if attention_mask.shape[0] != batch or attention_mask.shape[1] < tokens:
            raise ValueError(
                f"attention_mask: a 2-D mask of shape {tuple(attention_mask.shape)} does not cover the forward's "
                f"{batch} x {tokens} tokens; expected (batch, past + current length) = ({batch}, >= {tokens})."
            )
        return attention_mask[:, -tokens:].float()
    if attention_mask.ndim == 4:
        if attention_mask.shape[0] != batch or attention_mask.shape[2] != tokens or attention_mask.shape[3] < tokens:
            raise ValueError(
                f"attention_mask: a 4-D mask of shape {tuple(attention_mask.shape)} does not match the forward's "
                f"{batch} x {tokens} tokens; expected (batch, heads, queries, keys) = ({batch}, *, {tokens}, >= "
                f"{tokens})."
            )
        own = torch.diagonal(attention_mask[:, 0, :, -tokens:], dim1=-2, dim2=-1)  # (B, T): each query's own key
        if own.dtype == torch.bool:
            return own.float()
        if own.is_floating_point():
            return (own == 0).float()  # additive: 0 where attended
        return (own != 0).float()
    raise ValueError(
        f"attention_mask: expected a 2-D (batch, length) or 4-D (batch, heads, queries, keys) mask, got "
        f"{attention_mask.ndim} dimensions (shape {tuple(attention_mask.shape)})."
    )


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...] | None,
    top_k: int | Sequence[int],
    attention_mask: torch.Tensor | None = None,
    routes: list[torch.Tensor] | None = None,
) -> torch.Tensor | None:
    r"""Switch-Transformer load-balance loss, computed per router and averaged over routers.

    For one router with E choices and top-k selection over the counted (non-padding) tokens:
    f_j = (tokens selecting j) / (tokens * k), P_j = mean_t softmax(logits_t)_j, L = E * sum_j f_j P_j,
    which is 1.0 under perfect balance (Fedus et al. 2021, eqs. 4-6; MoHD arXiv 2412.05644 section 3). Selection uses
    `topk_lower_index`, the routers' own tie rule, or, under routing replay, the replayed `routes`: f counts the
    routes the forward actually used.

    Args:
        router_logits: one (B*T, E) tensor per router, as recorded by `OutputRecorder`.
        top_k: routed picks per token (k), one for every router or one per router (sublayers with their own k).
        attention_mask: which tokens count, in any form `counted_tokens` reads: (B, S) with 1 for real tokens (its
            last T columns), a 4-D (B, H, T, S) mask (a token counts when it attends to itself), or None (all count).
            B is the mask's batch; T = rows / B.
        routes: one (B, T, k) tensor of choice ids 0 .. E-1 per router (`replayed_routes`), or None for the top-k of
            the logits.

    Returns:
        A scalar tensor (fp32 or wider), or None when no router was recorded.

    Raises:
        ValueError: when `top_k` gives a different number of values than routers, or the mask does not cover the
            rows (see `counted_tokens`).
    """
    if not router_logits:
        return None
    losses = []
    ks = [top_k] * len(router_logits) if isinstance(top_k, int) else list(top_k)
    if len(ks) != len(router_logits):
        raise ValueError(f"load_balancing_loss: {len(ks)} values of top_k for {len(router_logits)} routers.")
    for number, (logits, top_k) in enumerate(zip(router_logits, ks, strict=True)):
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        num_choices = probs.shape[-1]
        batch = 1 if attention_mask is None else attention_mask.shape[0]
        counted = counted_tokens(attention_mask, batch, probs.shape[0] // batch)
        if counted is None:
            token_weight = torch.ones(probs.shape[0], dtype=probs.dtype, device=probs.device)
        else:
            token_weight = counted.reshape(-1).to(device=probs.device, dtype=probs.dtype)
        if routes is None:
            selected = topk_lower_index(probs, top_k)
        else:
            selected = routes[number].to(probs.device)
        counts = torch.zeros(num_choices, dtype=probs.dtype, device=probs.device).scatter_add_(
            0, selected.reshape(-1), token_weight.repeat_interleave(top_k)
        )
        num_tokens = token_weight.sum()
        fraction_routed = counts / (num_tokens * top_k)
        mean_prob = (probs * token_weight[:, None]).sum(0) / num_tokens
        losses.append(num_choices * torch.sum(fraction_routed * mean_prob))
    return torch.stack(losses).mean()


# --- the forwards both families share: base model, causal LM, the cache hook of `generate` ---


class RoutingGenerationMixin:
    """Makes `generate` use a `RoutingCache` (key/value cache plus routing record) by default.

    `GenerationMixin._prepare_cache_for_generation` builds a plain `DynamicCache`; this swaps it for a
    `RoutingCache` with the same layer structure. A static cache keeps working, without a
    record.
    """

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        user_cache = model_kwargs.get("cache")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("cache")
        if user_cache is None and type(cache) is DynamicCache and not cache.offloading:
            model_kwargs["cache"] = RoutingCache(config=self.config.get_text_config(decoder=True))
            if generation_config.is_assistant:
                model_kwargs["cache"].activate_past_recording()
        elif isinstance(cache, StaticCache):
            logger.warning_once(
                "A static cache keeps keys and values only: the routing record (indices and weights per token) is "
                "not available with cache_implementation='static'. Use the default cache to read it."
            )


class RoutedDecoderMixin:
    """`forward` of both families' base models (the `LlamaModel` flow): embed, create the `RoutingCache`, positions
    and causal mask once, run the decoder layers, final norm. The model defines `embed_tokens`, `layers`, `norm` and
    `rotary_emb` (a module returning None when the family has no positional embedding).
    """

    @deprecate_past_key_values
    @merge_with_config_defaults
    @capture_outputs
    @auto_docstring(
        custom_intro="""
        The decoder stack. Besides the arguments below, takes `routing_replay`
        (`dict[tuple[int, str], RoutingRecord]`, *optional*): a routing record (e.g. `RoutingCache.routing_record` of a
        generation) whose indices, (B, T, k) per (layer, router), replace the routers' own top-k; the gates are
        recomputed by the current routers, so the routers keep their gradient. Ids out of
        a router's range (the engines' -1) are allowed in padding rows (`attention_mask` 0) only, and ignored there.
        """
    )
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: RoutingCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        r"""
        cache (`RoutingCache`, *optional*):
            Keys, values and the routing record (indices and gates per token and router);
            created when `use_cache` and none is given.

        Returns:
            `MoeModelOutputWithPast` with `last_hidden_state` (B, T, D) and the cache; hidden states, attentions and
            router logits when requested.
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = RoutingCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        # (B, T): 1 at the real tokens of this forward, for the routers (replayed padding rows, expert loads)
        token_mask = None
        if attention_mask is not None and attention_mask.ndim == 2:
            token_mask = attention_mask[:, -inputs_embeds.shape[1] :]
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                token_mask=token_mask,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class RoutedCausalLMMixin(RoutingGenerationMixin):
    """`forward` of both families' causal LMs (the `MixtralForCausalLM` flow): LM head on the kept positions, LM
    loss, and `router_aux_loss_coef` times the family's `load_balancing_loss(router_logits, token mask,
    routing_replay)` when `output_router_logits` and a loss is asked for (labels given, or the model is training; the
    family returns None where routing is balanced otherwise). Inference never computes it, so no attention-mask form
    of a serving path (a 4-D mask of continuous batching) reaches it.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # both tied weights sharded on the vocabulary, as in `LlamaForCausalLM.tp_plan`
    _tp_plan = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def post_init(self):
        """`PreTrainedModel.post_init`, then a note of the config's `output_router_logits` and `router_aux_loss_coef`
        as the model was built (loaded config plus the caller's keyword arguments): clients that rewrite them on the
        shared config for their own bookkeeping (TRL's `SFTTrainer`) can be undone from it
        (`hf_mohd.training.trl.prepare_trl_trainer`), so a saved fine-tune keeps the settings its user chose."""
        super().post_init()
        self.built_router_settings = {
            name: getattr(self.config, name, None) for name in ("output_router_logits", "router_aux_loss_coef")
        }

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, with `auto_map.AutoModel` naming the base model class too.

        transformers writes `auto_map` entries for the saved class only (`AutoModelForCausalLM`); serving engines that
        load remote code through `AutoModel` (vLLM's Transformers modeling backend) need the base class as well, which
        sits in the same copied code file.
        """
        base = type(self.model)
        if getattr(base, "_auto_class", None) == "AutoModel":
            auto_map = dict(getattr(self.config, "auto_map", None) or {})
            auto_map.setdefault("AutoModel", f"{base.__module__.rsplit('.', 1)[-1]}.{base.__name__}")
            self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)

    @deprecate_past_key_values
    @can_return_tuple
    @auto_docstring(
        custom_intro="""
        The causal LM: LM head on the kept positions, LM loss, and the load-balance loss when `output_router_logits`.
        Besides the arguments below, takes `routing_replay` (a routing record whose indices replace the routers' own
        top-k, as in the base model's forward; the load-balance loss then counts the replayed routes).
        """
    )
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: RoutingCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        r"""
        cache (`RoutingCache`, *optional*):
            Keys, values and the routing record (indices and gates per token and router).
        output_router_logits (`bool`, *optional*):
            Whether to return the router logits, one (B*T, choices) fp32 tensor per router, and, when a loss is
            asked for (`labels` given or the model in training mode), the family's load-balance loss (`aux_loss`),
            added to the loss times `router_aux_loss_coef` when `labels` are given. The tokens it counts follow
            `attention_mask` (2-D padding mask, 4-D mask or none; `counted_tokens`).

        Returns:
            `MoeCausalLMOutputWithPast`: logits (B, T', vocab), loss = LM loss + coef * aux loss, aux_loss (None in
            inference), cache.

        Example:

        ```python
        >>> out = model.generate(input_ids, max_new_tokens=8, return_dict_in_generate=True)
        >>> out.cache.routing_record[(0, "mlp")].indices.shape  # (batch, seq, k); "moe" for LatentMoE
        ```"""
        output_router_logits = (
            output_router_logits if output_router_logits is not None else self.config.output_router_logits
        )
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        aux_loss = None
        # CODEPATH: the aux loss only where a loss is asked for; inference (generate, serving) returns the logits only
        if output_router_logits and (labels is not None or self.training):
            batch, tokens = outputs.last_hidden_state.shape[:2]
            token_mask = counted_tokens(attention_mask, batch, tokens)
            aux_loss = self.load_balancing_loss(outputs.router_logits, token_mask, kwargs.get("routing_replay"))
            if labels is not None and aux_loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device, loss.dtype)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )
