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
"""MoHD (Mixture of Hidden Dimensions, arXiv 2412.05644) model configuration."""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters
from transformers.utils import auto_docstring
from transformers.utils.type_validators import interval

from .accounting import routed_sub_dims_per_tok
from .configuration_common import (
    LLAMA_PP_PLAN,
    LLAMA_TP_PLAN,
    AccountingMixin,
    check_llama_fields,
    check_positive_ints,
    check_real,
    default_head_dim,
    raise_value_errors,
)
from .configuration_layers import MOHD_PER_LAYER_FIELDS, MOHD_SUBLAYERS, check_layer_overrides


SPARSE_MODULES = ("attention", "ffn")
ACTIVATION_SCALINGS = ("inverse_active", "none")
ROUTED_GATES = ("softmax", "normalized", "unit")
GROUP_FUSIONS = ("mix", "none")
SPARSE_SIDES = ("both", "input", "output")
# The fields MoHD adds to LLaMA's that set its sparsity (in declaration order; `output_router_logits` is a forward
# option, not a setting): what a conversion from LLaMA may set and what a model card lists.
SPARSITY_FIELDS = (
    "num_sub_dims",
    "num_shared_sub_dims",
    "num_routed_sub_dims_per_tok",
    "attention_routed_sub_dims_per_tok",
    "ffn_routed_sub_dims_per_tok",
    "sparse_modules",
    "activation_scaling",
    "routed_gate",
    "group_fusion",
    "router_aux_loss_coef",
    "sparse_implementation",
    "sparse_sides",
    "dropped_block_compensation",
)

# The paper's settings (arXiv 2412.05644 section 4) from a base LLaMA shape: (width multiplier, N, N_s, k).
MOHD_PRESETS = {
    "compression_50": (1, 16, 6, 2),
    "compression_75": (1, 16, 9, 3),
    "expansion_x2": (2, 16, 6, 2),
    "expansion_x3": (3, 24, 6, 2),
    "expansion_x4": (4, 32, 6, 2),
}


@auto_docstring(
    checkpoint="hf-mohd/mohd-tiny",
    custom_intro="""
    Configuration of a MoHD decoder: a LLaMA model whose residual width `hidden_size` is split into `num_sub_dims`
    equal sub-dimensions (blocks). Blocks `0 .. num_shared_sub_dims - 1` are shared (always active); a router per
    sparsified sublayer activates `num_routed_sub_dims_per_tok` of the others per token (arXiv 2412.05644
    section 3), or its own k per layer and sublayer kind (`attention_routed_sub_dims_per_tok`,
    `ffn_routed_sub_dims_per_tok`, per layer through `per_layer_config`). With every block shared the model is LLaMA. `num_parameters()`,
    `num_active_parameters()`, `flops_per_token(context_length)` and `accounting(context_length)` count the model
    without building it (accounting.py).
    """,
)
@strict
class MoHDConfig(AccountingMixin, PreTrainedConfig):
    r"""
    num_sub_dims (`int`, *optional*, defaults to 16):
        N, number of sub-dimensions; must divide `hidden_size` (the rebuttal's best: 16 blocks).
    num_shared_sub_dims (`int`, *optional*, defaults to 6):
        N_s, always-active blocks (the first N_s), 0 <= N_s <= N.
    num_routed_sub_dims_per_tok (`int`, *optional*, defaults to 2):
        k, routed blocks a token activates, 0 <= k <= N - N_s, with N_s + k >= 1. k = 0 with N_s < N builds no
        router: every token activates the same N_s blocks (a dense decoder of width N_s s inside a residual stream of
        width D, whose other blocks carry the embedding to the LM head). The default k of every sublayer.
    attention_routed_sub_dims_per_tok (`int`, *optional*):
        k of the attention sublayers, in the same range (None: `num_routed_sub_dims_per_tok`); 0 builds no router
        there. Set per layer with `per_layer_config`, e.g. `per_layer_config={0: {"attention_routed_sub_dims_per_tok":
        5}}` (only the two per-kind k fields may vary per layer), for uneven budgets (TEAL, arXiv 2408.14690).
    ffn_routed_sub_dims_per_tok (`int`, *optional*):
        k of the feed-forward sublayers, likewise.
    sparse_modules (`list[str]`, *optional*, defaults to `["attention", "ffn"]`):
        Sublayers whose projections read/write only active blocks; others stay dense and have no router.
    activation_scaling (`str`, *optional*, defaults to `"inverse_active"`):
        "inverse_active" scales the active outputs by alpha = N / (N_s + k) (rebuttal Lemma 1), "none" by 1.
    routed_gate (`str`, *optional*, defaults to `"softmax"`):
        Input gate of a selected routed block: "softmax" = p_j, "normalized" = k p_j / sum of selected p, "unit" = 1
        with the gradient of p_j (straight-through, Bengio et al. arXiv 1308.3432): the router only selects, so with
        every routed block active (`set_active_sub_dims(N_r)`) an exact conversion is its dense source.
    group_fusion (`str`, *optional*, defaults to `"mix"`):
        "mix": an N x N identity-initialised matrix mixes the output blocks; "none": no fusion.
    router_aux_loss_coef (`float`, *optional*, defaults to 0.01):
        Weight of the sub-dimension load-balance loss added to the LM loss when `output_router_logits`.
    output_router_logits (`bool`, *optional*, defaults to `False`):
        Whether to output the router logits and add the aux loss to the loss.
    sparse_implementation (`str`, *optional*, defaults to `"gather"`):
        The execution strategy, by its name in `MoHDSparseInterface` (`mohd_strategies.py`): "masked", dense
        matmuls with the mask (reference); "gather", only active blocks are computed; "sorted", the gather strategy
        with the (token, block) pairs of many tokens sorted once and no atomic accumulation; or a strategy
        registered with `MoHDSparseInterface.register(name, cls)` before the model is built (checked then: the
        config does not know the registry).
    sparse_sides (`str`, *optional*, defaults to `"both"`):
        Which side of a sparsified sublayer is sparse: "both" (the paper's MoHD: it reads and writes only the
        active blocks), "input" (it reads only the active blocks, with their gates, and writes every block, unscaled)
        or "output" (it reads every block, ungated, and writes only the active ones, scaled and fused as usual; the
        router then only selects and gets no gradient).
    dropped_block_compensation (`bool`, *optional*, defaults to `False`):
        Each sparsified sublayer adds, for every block a token does not read, that block's mean contribution to each
        input projection, and writes, for every block it does not write, that block's mean output (FLAP's bias
        compensation, arXiv 2312.11983, per block): parameters `input_compensation.<projection>` (N, out) and
        `output_compensation` (N, s), zero (no change) until fitted on calibration text, trainable like any other.

    Example:

    ```python
    >>> from hf_mohd import MoHDConfig, MoHDForCausalLM
    >>> config = MoHDConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
    >>> model = MoHDForCausalLM(config)
    ```
    """

    model_type = "mohd"
    keys_to_ignore_at_inference = ["cache"]
    # Llama's plan: q/k/v, gate/up shard their output features and o_proj, down_proj their input features, so the
    # hidden axis (the sub-dimension blocks) stays whole on every rank. The sparse sublayers do not call these
    # modules (the gather path reads their weights); `MoHDTensorParallelProjections` in modeling_mohd.py runs them on the
    # local shards with the two styles' collectives. Routers and group fusion are replicated.
    base_model_tp_plan = dict(LLAMA_TP_PLAN)
    base_model_pp_plan = dict(LLAMA_PP_PLAN)

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = interval(min=0.0, max=1.0)(default=0.02)
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    num_sub_dims: int = 16
    num_shared_sub_dims: int = 6
    num_routed_sub_dims_per_tok: int = 2
    attention_routed_sub_dims_per_tok: int | None = None
    ffn_routed_sub_dims_per_tok: int | None = None
    sparse_modules: list[str] | tuple[str, ...] | None = None
    activation_scaling: str = "inverse_active"
    routed_gate: str = "softmax"
    group_fusion: str = "mix"
    router_aux_loss_coef: float = 0.01
    output_router_logits: bool = False
    sparse_implementation: str = "gather"
    sparse_sides: str = "both"
    dropped_block_compensation: bool = False

    def __post_init__(self, **kwargs):
        # Before anything divides by them.
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"))
        check_positive_ints(self, ("num_attention_heads", "max_position_embeddings", "num_sub_dims"))
        if self.head_dim is None:
            self.head_dim = default_head_dim(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.sparse_modules = list(SPARSE_MODULES if self.sparse_modules is None else self.sparse_modules)
        super().__post_init__(**kwargs)
        # `@strict` wraps errors of `validate_*` in its own exception type; checking here first gives users the
        # plain `ValueError` naming the field. The class validator below runs the same (cheap) checks again.
        self.validate_architecture()

    @property
    def sub_dim_size(self) -> int:
        """s = hidden_size / num_sub_dims, the width of one sub-dimension block."""
        return self.hidden_size // self.num_sub_dims

    @property
    def num_routed_sub_dims(self) -> int:
        """N_r = num_sub_dims - num_shared_sub_dims, blocks the router chooses from."""
        return self.num_sub_dims - self.num_shared_sub_dims

    @property
    def num_active_sub_dims(self) -> int:
        """n_a = N_s + k, blocks active per token at the default k (`num_routed_sub_dims_per_tok`)."""
        return self.num_shared_sub_dims + self.num_routed_sub_dims_per_tok

    def routed_sub_dims_per_tok(self, layer_idx: int, sublayer: str) -> int:
        """k of the `sublayer` ("attention" or "ffn") of layer `layer_idx`: its kind's field for that layer when set,
        else `num_routed_sub_dims_per_tok` (`accounting.routed_sub_dims_per_tok`)."""
        return routed_sub_dims_per_tok(self, layer_idx, sublayer)

    def validate_architecture(self):
        """Cross-field rules; each `ValueError` names the field and the allowed values (and the layer)."""
        # first: reading a field that a layer overrides from the top level raises transformers' ambiguity error
        spec = self.__dict__.get("_heterogeneity_spec")
        for layer_idx, overrides in (spec.per_layer_overrides if spec is not None else {}).items():
            check_layer_overrides(layer_idx, overrides, MOHD_PER_LAYER_FIELDS)
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"))
        check_positive_ints(self, ("num_attention_heads", "num_key_value_heads", "head_dim", "num_sub_dims"))
        check_positive_ints(self, ("max_position_embeddings",))
        check_llama_fields(self)
        if self.hidden_size % self.num_sub_dims != 0:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_sub_dims` ({self.num_sub_dims})."
            )
        if not 0 <= self.num_shared_sub_dims <= self.num_sub_dims:
            raise ValueError(
                f"`num_shared_sub_dims` must be in [0, num_sub_dims={self.num_sub_dims}], "
                f"got {self.num_shared_sub_dims}."
            )
        routed = self.num_sub_dims - self.num_shared_sub_dims
        low = 0 if self.num_shared_sub_dims > 0 else 1
        if not low <= self.num_routed_sub_dims_per_tok <= routed:
            raise ValueError(
                f"`num_routed_sub_dims_per_tok` must be in [{low}, {routed}] (the routed count num_sub_dims - "
                f"num_shared_sub_dims; at least 1 without shared blocks), got {self.num_routed_sub_dims_per_tok}."
            )
        for layer_idx in range(self.num_hidden_layers):
            for kind in MOHD_SUBLAYERS:
                k = routed_sub_dims_per_tok(self, layer_idx, kind)
                if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= routed:
                    raise ValueError(
                        f"layer {layer_idx}: `{kind}_routed_sub_dims_per_tok` must be None or an integer in [{low}, "
                        f"{routed}] (the routed count num_sub_dims - num_shared_sub_dims), got {k!r}."
                    )
        unknown = [m for m in self.sparse_modules if m not in SPARSE_MODULES]
        if unknown or len(set(self.sparse_modules)) != len(self.sparse_modules):
            raise ValueError(
                f"`sparse_modules` must be distinct names from {list(SPARSE_MODULES)}, got {self.sparse_modules}."
            )
        for name, allowed in (
            ("activation_scaling", ACTIVATION_SCALINGS),
            ("routed_gate", ROUTED_GATES),
            ("group_fusion", GROUP_FUSIONS),
            ("sparse_sides", SPARSE_SIDES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {list(allowed)}, got {getattr(self, name)!r}.")
        if not isinstance(self.sparse_implementation, str) or not self.sparse_implementation:
            raise ValueError(
                f"`sparse_implementation` must be the name of a strategy registered in MoHDSparseInterface, got "
                f"{self.sparse_implementation!r}."
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of `num_key_value_heads` "
                f"({self.num_key_value_heads})."
            )
        check_real(self, "router_aux_loss_coef", low=0.0)
        if self.dropped_block_compensation and self.sparse_sides != "both":
            raise ValueError(
                f"`dropped_block_compensation` compensates both sides of a sublayer; it needs `sparse_sides` 'both', "
                f"got {self.sparse_sides!r}."
            )

    @classmethod
    def from_llama_config(cls, base_config, preset: str, **overrides) -> "MoHDConfig":
        """MoHD config of one of the paper's settings built from a base LLaMA shape (`MOHD_PRESETS`).

        Args:
            base_config: a `LlamaConfig` (or any config with LLaMA fields) giving d, heads, head_dim, intermediate.
            preset: one of "compression_50", "compression_75", "expansion_x2", "expansion_x3", "expansion_x4".
            overrides: any other `MoHDConfig` field (they win over the preset).

        Raises:
            ValueError: unknown preset, or a base width the preset's `num_sub_dims` does not divide.
        """
        base = base_config.to_dict()
        fields = {name: base[name] for name in cls.__dataclass_fields__ if name in base and name != "model_type"}
        for name in ("transformers_version", "architectures", "dtype"):
            fields.pop(name, None)
        head_dim = getattr(base_config, "head_dim", None)
        fields.update(cls.preset_fields(preset, base_config.hidden_size, base_config.num_attention_heads, head_dim))
        fields.update(overrides)
        return cls(**fields)

    @staticmethod
    def preset_fields(preset: str, hidden_size: int, num_attention_heads: int, head_dim: int | None = None) -> dict:
        """The fields one of the paper's settings sets on a base LLaMA shape of width `hidden_size`
        (`MOHD_PRESETS`): the widened `hidden_size`, the base's `head_dim` (so attention keeps its size), and the
        three sub-dimension counts. The one place the preset table is expanded (`from_llama_config` uses it).

        Raises:
            ValueError: unknown preset.
        """
        if preset not in MOHD_PRESETS:
            raise ValueError(f"`preset` must be one of {list(MOHD_PRESETS)}, got {preset!r}.")
        multiplier, num_sub_dims, num_shared, top_k = MOHD_PRESETS[preset]
        return {
            "hidden_size": multiplier * hidden_size,
            "head_dim": head_dim or hidden_size // num_attention_heads,
            "num_sub_dims": num_sub_dims,
            "num_shared_sub_dims": num_shared,
            "num_routed_sub_dims_per_tok": top_k,
        }


raise_value_errors(MoHDConfig)

__all__ = ["MoHDConfig"]
