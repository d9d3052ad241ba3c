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
"""Validation helpers and the accounting methods shared by the configurations of both families (`MoHDConfig`,
`LatentMoEConfig`).

A sibling of the configuration files: `save_pretrained` copies it next to the weights with them (remote code), with
accounting.py, so it imports only `transformers`, `huggingface_hub`, the standard library and accounting.py.
"""

import math

from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .accounting import ModelAccounting, model_accounting


class AccountingMixin:
    """Parameter and FLOP accounting of the model a config describes, without building it: every method reads
    `model_accounting(self, ...)` (accounting.py), so both families answer the
    same questions with the same rules and units (FLOPs per token, 2 per multiply-add)."""

    def accounting(self, context_length: int = 0) -> ModelAccounting:
        """The whole `ModelAccounting` (per-layer entries and totals) at `context_length` keys per query.

        Raises:
            ValueError: `context_length` negative or not an integer.
        """
        return model_accounting(self, context_length)

    def num_parameters(self) -> int:
        """All parameters the model builds (a tied LM head counted once; buffers excluded)."""
        return model_accounting(self).total_params

    def num_active_parameters(self) -> int:
        """Parameters one token reads: the activated decoder parameters plus the LM head (embedding excluded)."""
        return model_accounting(self).activated_params

    def flops_per_token(self, context_length: int = 0) -> int:
        """Forward FLOPs per token (matmuls, 2 per multiply-add, plus attention scores over `context_length` keys)."""
        return model_accounting(self, context_length).flops_per_token

    def decode_weight_bytes_per_token(self, bytes_per_param: int = 4) -> int:
        """Bytes of weights a batch-1 decoding step reads (activated decoder parameters plus the LM head)."""
        return model_accounting(self).decode_weight_bytes_per_token(bytes_per_param)


class ConfigFieldError(StrictDataclassFieldValidationError, ValueError):
    """A configuration field of the wrong type (or outside an `interval`): a `ValueError` naming the field.

    `@strict` (huggingface_hub) raises `StrictDataclassFieldValidationError`, which is not a `ValueError`; this
    subclass of both keeps `except StrictDataclassFieldValidationError` working and gives users the `ValueError`
    every other bad field raises.
    """

    def __init__(self, field: str, cause: Exception):
        ValueError.__init__(self, f"`{field}` is invalid: {cause}")
        self.field = field


def raise_value_errors(cls: type) -> type:
    """Wraps the `@strict` `__setattr__` of `cls` so that its field errors are `ConfigFieldError`s."""
    strict_setattr = cls.__setattr__

    def __setattr__(self, name, value):
        try:
            strict_setattr(self, name, value)
        except StrictDataclassFieldValidationError as error:
            if isinstance(error, ValueError):
                raise
            raise ConfigFieldError(name, error.__cause__ or error) from error

    cls.__setattr__ = __setattr__
    return cls


def check_positive_ints(config, names) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")


def default_head_dim(config) -> int:
    """`head_dim` when the config leaves it unset: hidden_size // num_attention_heads, as `LlamaConfig` derives it.

    Raises:
        ValueError: naming `num_attention_heads` when it exceeds `hidden_size` (the derived width would be 0).
    """
    if config.num_attention_heads > config.hidden_size:
        raise ValueError(
            f"`num_attention_heads` ({config.num_attention_heads}) exceeds `hidden_size` ({config.hidden_size}): "
            "the derived head_dim would be 0; lower it or set `head_dim`."
        )
    return config.hidden_size // config.num_attention_heads


def check_real(config, name: str, low: float, high: float | None = None, open_low: bool = False) -> None:
    """`low <= value (<= high)` (`low < value` when `open_low`), finite; else a `ValueError` naming `name`."""
    value = getattr(config, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and (high is None or value <= high)
    if not ok:
        bounds = (
            f"{'(' if open_low else '['}{low}, {high if high is not None else 'inf'}{']' if high is not None else ')'}"
        )
        raise ValueError(f"`{name}` must be a finite number in {bounds}, got {value!r}.")


def check_llama_fields(config) -> None:
    """The LLaMA fields both families share: activation, norm epsilon, dropout, padding id, RoPE parameters."""
    if config.hidden_act not in ACT2FN:
        raise ValueError(
            f"`hidden_act` must be one of transformers' activations {sorted(ACT2FN)}, got {config.hidden_act!r}."
        )
    check_real(config, "rms_norm_eps", low=0.0, open_low=True)
    check_real(config, "attention_dropout", low=0.0, high=1.0)
    pad = config.pad_token_id
    if pad is not None and not -config.vocab_size <= pad < config.vocab_size:  # what nn.Embedding(padding_idx) takes
        raise ValueError(
            f"`pad_token_id` must be None or in [-vocab_size, vocab_size) = "
            f"[{-config.vocab_size}, {config.vocab_size}), got {pad}."
        )
    rope = config.rope_parameters or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", *ROPE_INIT_FUNCTIONS):
        raise ValueError(
            f"`rope_parameters` has rope_type {rope_type!r}; expected one of {['default', *ROPE_INIT_FUNCTIONS]}."
        )
    theta = rope.get("rope_theta", 1.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"`rope_parameters` has rope_theta {theta!r}; expected a finite number > 0.")


# The LLaMA fields (`LlamaConfig`'s names) that fix the decoder stack's tensor shapes and activation, declared with
# LLaMA's meaning by both families: the first fields a conversion copies from its source and a model card lists.
LLAMA_ARCHITECTURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
)

# Llama's tensor-parallel plan of its decoder layers (`LlamaConfig.base_model_tp_plan`): q/k/v and gate/up shard their
# output features, o_proj and down_proj their input features, so the hidden axis stays whole on every rank.
LLAMA_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
# Llama's pipeline-parallel plan (`LlamaConfig.base_model_pp_plan`): the stages' inputs and outputs by module.
LLAMA_PP_PLAN = {
    "embed_tokens": (["input_ids"], ["inputs_embeds"]),
    "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
    "norm": (["hidden_states"], ["hidden_states"]),
}
