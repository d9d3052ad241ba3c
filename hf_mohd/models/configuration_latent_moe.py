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
"""LatentMoE (arXiv 2601.18089; expert shapes and layerwise capacity of arXiv 2610.14644) model configuration."""

import math
from types import SimpleNamespace

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters
from transformers.utils import auto_docstring
from transformers.utils.type_validators import interval

from .accounting import layer_accounting
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
from .configuration_layers import MIXER_TYPES, PER_LAYER_FIELDS, check_layer_overrides


# Every parallel rule a LatentMoE can need, keyed by the kind of module it names; a config's plans hold the rules of
# the kinds it builds (`_built_module_kinds`), so that no rule names a module the model lacks.
TP_PLAN_RULES = {
    "attention": {rule: style for rule, style in LLAMA_TP_PLAN.items() if ".self_attn." in rule},
    "dense_gate": {"layers.*.mlp.gate_proj": "colwise"},
    "dense": {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"},
    "shared_gate": {"layers.*.mlp.shared_experts.gate_proj": "colwise"},
    "shared": {"layers.*.mlp.shared_experts.up_proj": "colwise", "layers.*.mlp.shared_experts.down_proj": "rowwise"},
}
EP_PLAN_RULES = {
    "experts_gated": {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm"},
    "experts_ungated": {"layers.*.mlp.experts.up_proj": "grouped_gemm"},
    "experts": {"layers.*.mlp.experts.down_proj": "grouped_gemm", "layers.*.mlp.experts": "ep_dispatch_experts"},
}
ROUTER_SCORE_FUNCS = ("softmax", "sigmoid")
ROUTER_GATES = ("weighted", "unit")
POSITION_EMBEDDING_TYPES = ("rope", "none")


@auto_docstring(
    checkpoint="hf-mohd/latent-moe-tiny",
    custom_intro="""
    Configuration of a LatentMoE decoder: LLaMA-style pre-norm layers pairing attention with an FFN mixer that is
    either a LatentMoE block or a dense MLP (arXiv 2601.18089). In a LatentMoE block the router reads the full width
    `hidden_size`, `fc1_latent_proj` maps each token to `moe_latent_size` once, the routed experts run and are combined
    at that latent width, and `fc2_latent_proj` maps back; a shared expert works at full width (as Nemotron 3 /
    transformers' `NemotronHMoE`). `moe_latent_size=None` is the standard fine-grained MoE baseline.
    Any layer may override the fields in `PER_LAYER_FIELDS` (this module; one list for the config and the
    accounting) through transformers' native `per_layer_config`
    (a sparse map {layer index: {field: value}}), e.g. `per_layer_config={0: {"mixer_type": "mlp"}}`.
    `num_parameters()`, `num_active_parameters()`, `flops_per_token(context_length)` and `accounting(context_length)`
    count the model without building it (accounting.py).
    """,
)
@strict
class LatentMoEConfig(AccountingMixin, PreTrainedConfig):
    r"""
    mlp_gated (`bool`, *optional*, defaults to `True`):
        MLP form of routed experts, shared expert and dense layers: `act(gate) * up` (3 matrices, SwiGLU with silu)
        when True, `act(up)` (2 matrices, e.g. relu2 as in Nemotron 3) when False.
    position_embedding_type (`str`, *optional*, defaults to `"rope"`):
        "rope" (rotary embedding in attention) or "none" (no positional embedding, as Nemotron-H attention).
    mixer_type (`str`, *optional*, defaults to `"moe"`):
        FFN mixer of each layer: "moe" (LatentMoE block) or "mlp" (dense MLP of width `intermediate_size`).
        Override per layer with `per_layer_config`; deliberately not `layer_types` (caches read that field).
    num_experts (`int`, *optional*, defaults to 64):
        N, routed experts per MoE layer.
    num_experts_per_tok (`int`, *optional*, defaults to 6):
        K, routed experts a token activates, 1 <= K <= N.
    moe_intermediate_size (`int`, *optional*, defaults to 1024):
        m, hidden width of one routed expert.
    moe_latent_size (`int`, *optional*):
        l, width at which routed experts read and write (`fc1_latent_proj`: hidden_size -> l, `fc2_latent_proj`:
        l -> hidden_size). None gives a standard fine-grained MoE with experts at `hidden_size`.
    moe_shared_expert_intermediate_size (`int`, *optional*, defaults to 0):
        m_s, width of the full-width shared expert added to the routed output; 0 means no shared expert.
    router_score_func (`str`, *optional*, defaults to `"softmax"`):
        "softmax": top-K of softmax scores, balanced by the Switch aux loss. "sigmoid": top-K of sigmoid scores plus
        the fp32 buffer `e_score_correction_bias` (selection only), balanced by the aux-loss-free bias update
        (DeepSeek-V3, arXiv 2412.19437 section 2.1.2; `LatentMoEForCausalLM.update_router_biases`).
    norm_topk_prob (`bool`, *optional*, defaults to `True`):
        Renormalise the K selected scores to sum to 1 before `routed_scaling_factor`.
    routed_scaling_factor (`float`, *optional*, defaults to 1.0):
        Multiplier of the routed gates (after any renormalisation).
    router_gate (`str`, *optional*, defaults to `"weighted"`):
        What multiplies each selected routed expert's output. "weighted": its router score (renormalised when
        `norm_topk_prob`, times `routed_scaling_factor`), the usual MoE gate. "unit": exactly 1 for every selected
        expert (`norm_topk_prob` and `routed_scaling_factor` do not apply), so the routed output is the plain sum of
        the K chosen experts, as in MoEfication (arXiv 2110.01786, section 3) and CMoE (arXiv 2502.04416): a dense
        FFN carved into experts (`hf_mohd.conversion.latent_moe.carve`) is then the source FFN at K = N. The gradient reaches the
        router through a straight-through estimator (gate = s - stop_gradient(s) + 1 for the selected score s).
    initializer_range (`float`, *optional*, defaults to 0.02):
        The std of every random initialisation, per projection: the token embedding, the attention projections
        (q/k/v/o), the dense MLP and shared-expert projections, the latent projections (`fc1_latent_proj`,
        `fc2_latent_proj`) and the LM head are N(0, std) with zero biases (transformers' `_init_weights` for
        `nn.Linear` / `nn.Embedding`, the embedding's padding row zero); the routers' weights and the fused 3-D
        expert weights (`gate_up_proj` / `up_proj`, `down_proj`, every expert) are N(0, std) too, and sigmoid
        routing's `e_score_correction_bias` starts at zero; RMSNorm weights start at one. This matches NemotronH's
        `_init_weights` (transformers' `modeling_nemotron_h.py`: `NemotronHTopkRouter` weight N(0, std) and zero
        correction bias, `NemotronHExperts` `up_proj` / `down_proj` N(0, std), linears and embedding N(0, std));
        its `rescale_prenorm_residual` rescales only the Mamba-2 mixers' `out_proj`, and its Mamba-2 initialisation
        has no LatentMoE counterpart. A model from `from_pretrained` or `hf-mohd convert` is not re-initialised.
    router_aux_loss_coef (`float`, *optional*, defaults to 0.01):
        Weight of the load-balance loss added to the LM loss when `output_router_logits` (softmax routing only).
    output_router_logits (`bool`, *optional*, defaults to `False`):
        Whether to output the router logits and add the aux loss to the loss.
    router_bias_update_rate (`float`, *optional*, defaults to 0.001):
        gamma of the aux-loss-free update b_i <- b_i + gamma * sign(mean load - load_i) (sigmoid routing).

    Example:

    ```python
    >>> from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM
    >>> config = LatentMoEConfig(
    ...     hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_experts=16, num_experts_per_tok=4,
    ...     moe_intermediate_size=128, moe_latent_size=64, per_layer_config={0: {"mixer_type": "mlp"}},
    ... )
    >>> model = LatentMoEForCausalLM(config)
    ```
    """

    model_type = "latent_moe"
    keys_to_ignore_at_inference = ["cache"]
    # The parallel plans are properties (`base_model_tp_plan`, `base_model_ep_plan` below): the rules of
    # `TP_PLAN_RULES` / `EP_PLAN_RULES` whose modules this config builds.
    base_model_pp_plan = dict(LLAMA_PP_PLAN)

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """Tensor-parallel rules (`DistributedConfig(tp_size=...)`) for the modules this config builds.

        Llama's plan for attention, the dense MLP layers and the shared expert (colwise in, rowwise out). The routed
        experts have no TP rule, as in Qwen3-MoE's plan from transformers 5.25 on (where the `moe_tp_experts` style
        is deprecated): under TP alone each rank holds every expert, and expert parallelism (`ep_size`, below)
        shards them whole. The router (E x D) and the latent projections stay replicated: every rank needs all E
        logits to pick the same experts.
        """
        return _rules_for_modules(TP_PLAN_RULES, _built_module_kinds(self))

    @property
    def base_model_ep_plan(self) -> dict[str, str]:
        """Expert-parallel rules (`DistributedConfig(ep_size=...)`): whole experts per rank, as Qwen3-MoE's
        `base_model_ep_plan` (`ep_dispatch_experts` on the experts module, `grouped_gemm` on its 3-D weights); they
        take precedence over the TP rules. Empty for a config without MoE layers."""
        return _rules_for_modules(EP_PLAN_RULES, _built_module_kinds(self))

    base_model_pp_plan = dict(LLAMA_PP_PLAN)

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    mlp_gated: bool = True
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    rope_parameters: RopeParameters | dict | None = None
    position_embedding_type: str = "rope"
    rms_norm_eps: float = 1e-6
    initializer_range: float = interval(min=0.0, max=1.0)(default=0.02)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    mixer_type: str = "moe"
    num_experts: int = 64
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1024
    moe_latent_size: int | None = None
    moe_shared_expert_intermediate_size: int = 0
    router_score_func: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float | int = 1.0
    router_gate: str = "weighted"
    router_aux_loss_coef: float = 0.01
    output_router_logits: bool = False
    router_bias_update_rate: float = 1e-3

    def __post_init__(self, **kwargs):
        # Before anything divides by them or `per_layer_config` is checked against the layer count.
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"))
        check_positive_ints(self, ("num_attention_heads", "max_position_embeddings"))
        defaults = SimpleNamespace(**{name: getattr(self, name) for name in PER_LAYER_FIELDS})
        if self.head_dim is None:
            self.head_dim = default_head_dim(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)
        # `@strict` wraps errors of `validate_*` in its own exception type; checking here first gives users the
        # plain `ValueError` naming the field (and the layer). The class validator runs the same checks again.
        self.validate_architecture()
        # The top-level values are the defaults of every layer: valid even where overrides (or dense layers) hide them.
        _validate_layer_fields(defaults, where="", every_field=True)

    def validate_architecture(self):
        """Cross-field rules; each `ValueError` names the field, the allowed values and, per layer, the layer index."""
        spec = self.__dict__.get("_heterogeneity_spec")
        for layer_idx, overrides in (spec.per_layer_overrides if spec is not None else {}).items():
            check_layer_overrides(layer_idx, overrides)
        # `intermediate_size` may vary per layer: checked below, per layer when the config is heterogeneous.
        check_positive_ints(self, ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"))
        check_positive_ints(self, ("num_attention_heads", "num_key_value_heads", "head_dim"))
        check_llama_fields(self)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of `num_key_value_heads` "
                f"({self.num_key_value_heads})."
            )
        for name, allowed in (
            ("router_score_func", ROUTER_SCORE_FUNCS),
            ("router_gate", ROUTER_GATES),
            ("position_embedding_type", POSITION_EMBEDDING_TYPES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {list(allowed)}, got {getattr(self, name)!r}.")
        for name in ("router_aux_loss_coef", "router_bias_update_rate"):
            check_real(self, name, low=0.0)
        if not self.is_heterogeneous:
            _validate_layer_fields(self, where="")
            return
        for layer_idx, layer_config in enumerate(self.per_layer_config):
            _validate_layer_fields(layer_config, where=f"layer {layer_idx}: ")

    # Per-layer accounting (arXiv 2610.14644 appendix B.2): accounting.py, biases included.

    def layer_num_parameters(self, layer_idx: int) -> int:
        """Parameters of decoder layer `layer_idx` (attention, mixer, both norms), as the model builds them."""
        return layer_accounting(self, layer_idx).total_params

    def layer_num_active_parameters(self, layer_idx: int) -> int:
        """Parameters of decoder layer `layer_idx` that one token reads (K of its N routed experts)."""
        return layer_accounting(self, layer_idx).activated_params


def _validate_layer_fields(config, where: str, every_field: bool = False) -> None:
    """Checks the fields that may vary per layer on one (layer) config; `where` prefixes the message.

    The MoE fields are checked on MoE layers, and on every config when `every_field` (the top-level defaults).
    """
    if config.mixer_type not in MIXER_TYPES:
        raise ValueError(f"{where}`mixer_type` must be one of {list(MIXER_TYPES)}, got {config.mixer_type!r}.")
    moe = every_field or config.mixer_type == "moe"
    positive = ["intermediate_size"]  # the width of dense layers, and the default of `per_layer_config` ones
    if moe:
        positive += ["num_experts", "num_experts_per_tok", "moe_intermediate_size"]
    for name in positive:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}`{name}` must be a positive integer, got {value!r}.")
    if not moe:
        return
    if config.num_experts_per_tok > config.num_experts:
        raise ValueError(
            f"{where}`num_experts_per_tok` must be in [1, num_experts={config.num_experts}], "
            f"got {config.num_experts_per_tok}."
        )
    latent = config.moe_latent_size
    if latent is not None and (not isinstance(latent, int) or isinstance(latent, bool) or latent < 1):
        raise ValueError(f"{where}`moe_latent_size` must be None or a positive integer, got {latent!r}.")
    shared = config.moe_shared_expert_intermediate_size
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise ValueError(f"{where}`moe_shared_expert_intermediate_size` must be an integer >= 0, got {shared!r}.")
    factor = config.routed_scaling_factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"{where}`routed_scaling_factor` must be a finite number > 0, got {factor!r}.")


raise_value_errors(LatentMoEConfig)

__all__ = ["LatentMoEConfig"]


def _built_module_kinds(config: "LatentMoEConfig") -> set[str]:
    """The kinds of module (keys of `TP_PLAN_RULES` / `EP_PLAN_RULES`) that a model of `config` builds."""
    layers = [config.per_layer_config[layer_idx] for layer_idx in range(config.num_hidden_layers)]
    kinds = {"attention"}
    for layer in layers:
        if layer.mixer_type == "mlp":
            kinds |= {"dense", "dense_gate"} if config.mlp_gated else {"dense"}
            continue
        kinds |= {"experts", "experts_gated" if config.mlp_gated else "experts_ungated"}
        if layer.moe_shared_expert_intermediate_size > 0:
            kinds |= {"shared", "shared_gate"} if config.mlp_gated else {"shared"}
    return kinds


def _rules_for_modules(rules: dict[str, dict[str, str]], kinds: set[str]) -> dict[str, str]:
    return {rule: style for kind, kind_rules in rules.items() if kind in kinds for rule, style in kind_rules.items()}
