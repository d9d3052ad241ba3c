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
"""Parameter, compute and communication accounting of LatentMoE layers (pure Python, no torch).

Formulas: arXiv 2610.14644 ("Shaping Latent Mixture-of-Experts"), section 2 and appendix B.2, as pinned in docs/design.md
section 4 ("Shaping and allocation tools"). Per layer t, with D = `hidden_size`, l = `moe_latent_size`
(None = standard MoE, experts read width D), m = `moe_intermediate_size`, N = `num_experts`,
K = `num_experts_per_tok`, m_s = `moe_shared_expert_intermediate_size` and c = 3 for gated experts
(act(gate) * up, then down: `mlp_gated=True`) or c = 2 for non-gated ones (act(up), then down):

- routed expert parameters       c N l m            (standard MoE: c N D m)
- latent projections             2 D l              (fc1_latent_proj D -> l, fc2_latent_proj l -> D; 0 if l is None)
- router                         D N                (W_r is N x D, no bias)
- shared expert                  c D m_s            (0 when m_s is None or 0)
- dense MLP layer                c D I              (`mixer_type="mlp"`, I = `intermediate_size`)
- activated MACs per token       c K l m + 2 D l + D N + c D m_s   (B.2: "approximately 3 C_t + d Q_t"; FLOPs = 2 MACs;
                                 elementwise work such as activations and the routing softmax is excluded)
- all-to-all payload per token   2 K l scalars      (dispatch K l plus return K l; standard MoE 2 K D; B.2 / Fig. 6)

Attention (LLaMA form, docs/design.md section 4 "Layer"): q, k, v, o projections,
D (H + 2 H_kv) h + H h D weights (+ (H + 2 H_kv) h + D biases with `attention_bias`), where H = heads,
H_kv = key/value heads and h = `head_dim`. Each decoder layer also holds two RMSNorm weights of width D.

Everything here takes plain numbers, or a config-like object: a `PreTrainedConfig` (per-layer values read through
`config.per_layer_config[i]`), any object with the field names as attributes, or a plain `dict` such as a parsed
`config.json` (its `per_layer_config` maps layer indices, int or zero-padded str, to field overrides).

This file is copied next to the weights as remote code: it imports only the standard library.
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass


MIXER_TYPES = ("moe", "mlp")

# Fields a `per_layer_config` entry may override: the mixer of the layer and its shape. `LatentMoEConfig` imports
# this list (configuration_latent_moe.py), so that the config and the accounting accept and reject the same overrides;
# everything else (width, attention, `mlp_gated`, routing function) is one value for the whole model.
PER_LAYER_FIELDS = (
    "mixer_type",
    "intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_latent_size",
    "moe_shared_expert_intermediate_size",
    "routed_scaling_factor",
)

# Fields the accounting of a layer reads, with the value used when a config lacks them.
LAYER_FIELD_DEFAULTS = {
    "hidden_size": None,
    "moe_intermediate_size": None,
    "moe_latent_size": None,
    "num_experts": None,
    "num_experts_per_tok": None,
    "moe_shared_expert_intermediate_size": None,
    "mlp_gated": True,
    "mixer_type": "moe",
    "intermediate_size": None,
    "num_attention_heads": None,
    "num_key_value_heads": None,
    "head_dim": None,
    "attention_bias": False,
}


def check_layer_overrides(layer_idx, overrides: Mapping) -> None:
    """Rejects a `per_layer_config` entry that overrides a field outside `PER_LAYER_FIELDS`.

    Used by `LatentMoEConfig.validate_architecture` and by `layer_fields` (config dicts, other config-like objects).

    Raises:
        ValueError: naming the layer, the fields that cannot vary per layer and the allowed ones.
    """
    unknown = sorted(set(overrides) - set(PER_LAYER_FIELDS))
    if unknown:
        raise ValueError(
            f"`per_layer_config[{layer_idx}]` overrides {unknown}, which cannot vary per layer; "
            f"allowed fields: {list(PER_LAYER_FIELDS)}."
        )


def _check_positive(name: str, value, where: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}`{name}` must be a positive integer, got {value!r}.")
    return value


def _check_optional_positive(name: str, value, where: str = "") -> int | None:
    if value is None:
        return None
    return _check_positive(name, value, where)


def _matrices(mlp_gated: bool) -> int:
    """c: weight matrices of one MLP, 3 when gated (gate, up, down), 2 when not (up, down)."""
    if not isinstance(mlp_gated, bool):
        raise ValueError(f"`mlp_gated` must be a bool, got {mlp_gated!r}.")
    return 3 if mlp_gated else 2


def _shared_width(moe_shared_expert_intermediate_size, where: str = "") -> int:
    if moe_shared_expert_intermediate_size is None:
        return 0
    value = moe_shared_expert_intermediate_size
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{where}`moe_shared_expert_intermediate_size` must be None or a non-negative integer, got {value!r}."
        )
    return value


# ----------------------------------------------------------------------------------------------------------------------
# Per-component formulas (plain numbers)
# ----------------------------------------------------------------------------------------------------------------------


def routed_expert_params(
    num_experts: int,
    moe_intermediate_size: int,
    hidden_size: int,
    moe_latent_size: int | None = None,
    mlp_gated: bool = True,
) -> int:
    """Parameters of the routed experts of one layer: c N l m (standard MoE, l None: c N D m).

    Source: arXiv 2610.14644 section 2 ("routed-path parameters scale as N l m") and appendix B.2 ("each layer's
    routed experts contain 3 N_t l_t m_t parameters"); c = 3 gated, 2 non-gated (docs/design.md section 4).

    Raises:
        ValueError: a size is not a positive integer, or `mlp_gated` is not a bool.
    """
    width = hidden_size if moe_latent_size is None else moe_latent_size
    _check_positive("num_experts", num_experts)
    _check_positive("moe_intermediate_size", moe_intermediate_size)
    _check_positive("hidden_size", hidden_size)
    _check_optional_positive("moe_latent_size", moe_latent_size)
    return _matrices(mlp_gated) * num_experts * width * moe_intermediate_size


def latent_projection_params(hidden_size: int, moe_latent_size: int | None) -> int:
    """Parameters of `fc1_latent_proj` (D -> l) and `fc2_latent_proj` (l -> D): 2 D l, 0 when l is None.

    Source: arXiv 2610.14644 appendix B.2 ("2 d l_t latent-projection parameters"); no biases.
    """
    _check_positive("hidden_size", hidden_size)
    if _check_optional_positive("moe_latent_size", moe_latent_size) is None:
        return 0
    return 2 * hidden_size * moe_latent_size


def router_params(hidden_size: int, num_experts: int) -> int:
    """Router weight W_r (N x D, no bias): D N. The sigmoid router's `e_score_correction_bias` is a buffer.

    Source: arXiv 2610.14644 appendix B.2 ("d N_t router parameters"); docs/design.md section 4, Layer step 1.
    """
    return _check_positive("hidden_size", hidden_size) * _check_positive("num_experts", num_experts)


def shared_expert_params(
    hidden_size: int, moe_shared_expert_intermediate_size: int | None, mlp_gated: bool = True
) -> int:
    """Full-width shared expert: c D m_s (0 when m_s is None or 0).

    Source: arXiv 2610.14644 appendix B.2 ("3 d m_{s,t} full-width shared-expert parameters"), c = 2 non-gated.
    """
    _check_positive("hidden_size", hidden_size)
    return _matrices(mlp_gated) * hidden_size * _shared_width(moe_shared_expert_intermediate_size)


def dense_mlp_params(hidden_size: int, intermediate_size: int, mlp_gated: bool = True) -> int:
    """Dense MLP mixer (`mixer_type="mlp"`): c D I weights, no biases (docs/design.md section 4, Layer step 4)."""
    _check_positive("hidden_size", hidden_size)
    _check_positive("intermediate_size", intermediate_size)
    return _matrices(mlp_gated) * hidden_size * intermediate_size


def attention_params(
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    attention_bias: bool = False,
) -> int:
    """LLaMA attention q/k/v/o projections: D (H + 2 H_kv) h + H h D (+ (H + 2 H_kv) h + D with biases).

    `num_key_value_heads` defaults to `num_attention_heads` and `head_dim` to D / H, as in LLaMA.
    """
    d = _check_positive("hidden_size", hidden_size)
    heads = _check_positive("num_attention_heads", num_attention_heads)
    kv_heads = heads if num_key_value_heads is None else _check_positive("num_key_value_heads", num_key_value_heads)
    head_dim = d // heads if head_dim is None else _check_positive("head_dim", head_dim)
    qkv_out = (heads + 2 * kv_heads) * head_dim
    weights = d * qkv_out + heads * head_dim * d
    return weights + (qkv_out + d if attention_bias else 0)


def moe_activated_macs(
    hidden_size: int,
    moe_intermediate_size: int,
    num_experts: int,
    num_experts_per_tok: int,
    moe_latent_size: int | None = None,
    moe_shared_expert_intermediate_size: int | None = None,
    mlp_gated: bool = True,
) -> int:
    """Multiply-accumulates per token of one MoE mixer: c K l m + 2 D l + D N + c D m_s (FLOPs = 2 x MACs).

    Source: arXiv 2610.14644 appendix B.2 ("activated MACs per token are approximately 3 C_t + d Q_t", C_t = K_t l_t
    m_t, Q_t = 2 l_t + N_t + 3 m_{s,t}); standard MoE (l None) reads width D: c K D m + D N + c D m_s.
    Excludes elementwise work (activation, routing softmax/sigmoid, weighted combine).

    Raises:
        ValueError: a size is not a positive integer, or K > N.
    """
    _check_topk(num_experts, num_experts_per_tok)
    width = hidden_size if moe_latent_size is None else moe_latent_size
    c = _matrices(mlp_gated)
    routed = c * num_experts_per_tok * width * _check_positive("moe_intermediate_size", moe_intermediate_size)
    return (
        routed
        + latent_projection_params(hidden_size, moe_latent_size)
        + router_params(hidden_size, num_experts)
        + shared_expert_params(hidden_size, moe_shared_expert_intermediate_size, mlp_gated)
    )


def all_to_all_scalars(hidden_size: int, num_experts_per_tok: int, moe_latent_size: int | None = None) -> int:
    """Expert-parallel all-to-all payload per token, dispatch plus return: 2 K l scalars (standard MoE: 2 K D).

    Source: arXiv 2610.14644 appendix B.2 and Figure 6 (bytes for T tokens: 2 b T K_t l_t; routing metadata,
    O(T K_t), is not counted). Multiply by the bytes per scalar for a volume.
    """
    _check_positive("hidden_size", hidden_size)
    _check_positive("num_experts_per_tok", num_experts_per_tok)
    width = hidden_size if _check_optional_positive("moe_latent_size", moe_latent_size) is None else moe_latent_size
    return 2 * num_experts_per_tok * width


def _check_topk(num_experts, num_experts_per_tok, where: str = "") -> None:
    _check_positive("num_experts", num_experts, where)
    _check_positive("num_experts_per_tok", num_experts_per_tok, where)
    if num_experts_per_tok > num_experts:
        raise ValueError(
            f"{where}`num_experts_per_tok` must be at most `num_experts` ({num_experts}), got {num_experts_per_tok}."
        )


# ----------------------------------------------------------------------------------------------------------------------
# Config-like objects
# ----------------------------------------------------------------------------------------------------------------------


def _get(config, name: str, default=None):
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _num_layers(config) -> int:
    return _check_positive("num_hidden_layers", _get(config, "num_hidden_layers"))


def layer_fields(config, layer_idx: int) -> dict:
    """Resolved fields (`LAYER_FIELD_DEFAULTS` keys) of layer `layer_idx` of a config-like object.

    A `PreTrainedConfig` is read through `config.per_layer_config[layer_idx]` (transformers' heterogeneous view);
    a `dict` or other object with a mapping `per_layer_config` ({index (int or str): {field: value}}) gets that
    layer's overrides applied on top of the global values, each entry checked as `LatentMoEConfig` checks it
    (`check_layer_overrides`: only `PER_LAYER_FIELDS` may vary). Derived defaults follow LLaMA:
    `num_key_value_heads` = `num_attention_heads`, `head_dim` = D / H.

    Raises:
        ValueError: `layer_idx` is outside [0, num_hidden_layers), a `per_layer_config` key is not an index, or an
            entry overrides a field outside `PER_LAYER_FIELDS`.
    """
    num_layers = _num_layers(config)
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < num_layers:
        raise ValueError(f"`layer_idx` must be an integer in [0, {num_layers}), got {layer_idx!r}.")
    per_layer = _get(config, "per_layer_config")
    overrides = {}
    source = config
    if isinstance(per_layer, Mapping):
        for key, value in per_layer.items():
            if isinstance(key, bool) or not str(key).strip().isdigit() or not isinstance(value, Mapping):
                raise ValueError(
                    "`per_layer_config` must map layer indices (int or digit strings) to field overrides, "
                    f"got {key!r}: {value!r}."
                )
            check_layer_overrides(int(key), value)
            if int(key) == layer_idx:
                overrides = dict(value)
    elif per_layer is not None:
        source = per_layer[layer_idx]
    fields = {}
    for name, default in LAYER_FIELD_DEFAULTS.items():
        fields[name] = overrides[name] if name in overrides else _get(source, name, default)
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if fields["head_dim"] is None and fields["num_attention_heads"]:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return fields


@dataclass(frozen=True)
class LatentMoELayerAccounting:
    """Sizes of one decoder layer. Parameters are counts; MACs and all-to-all scalars are per token.

    `total_params` = attention + mixer + the two RMSNorm weights (2 D). `activated_params` counts what a token
    reads: attention, router, latent projections, K of the N routed experts, shared expert, norms.
    `mixer_macs` is the B.2 formula (0 attention terms); `attention_macs` counts the q/k/v/o projections plus,
    for a context of S keys, the QK^T and AV products (2 H h S).
    """

    layer_idx: int
    mixer_type: str
    attention_params: int
    routed_expert_params: int
    latent_projection_params: int
    router_params: int
    shared_expert_params: int
    dense_mlp_params: int
    norm_params: int
    total_params: int
    activated_params: int
    mixer_macs: int
    attention_macs: int
    all_to_all_scalars: int

    @property
    def mixer_params(self) -> int:
        """Parameters of the FFN mixer alone (what arXiv 2610.14644 matches across layers)."""
        return (
            self.routed_expert_params
            + self.latent_projection_params
            + self.router_params
            + self.shared_expert_params
            + self.dense_mlp_params
        )

    @property
    def activated_macs(self) -> int:
        return self.mixer_macs + self.attention_macs

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "mixer_params": self.mixer_params,
            "activated_macs": self.activated_macs,
        }


def mixer_accounting(fields: Mapping, where: str = "") -> dict:
    """Accounting of the FFN mixer alone from resolved layer fields (see `layer_fields`), for shaping tools.

    Returns a dict with `params`, `activated_params`, `macs`, `all_to_all_scalars` and the components
    `routed_expert_params`, `latent_projection_params`, `router_params`, `shared_expert_params`, `dense_mlp_params`.

    Raises:
        ValueError: a field is missing or out of range; messages start with `where` (e.g. "layer 3: ").
    """
    d = _check_positive("hidden_size", fields.get("hidden_size"), where)
    mixer_type = fields.get("mixer_type", "moe")
    if mixer_type not in MIXER_TYPES:
        raise ValueError(f"{where}`mixer_type` must be one of {MIXER_TYPES}, got {mixer_type!r}.")
    gated = fields.get("mlp_gated", True)
    if not isinstance(gated, bool):
        raise ValueError(f"{where}`mlp_gated` must be a bool, got {gated!r}.")
    c = _matrices(gated)
    out = dict.fromkeys(
        (
            "routed_expert_params",
            "latent_projection_params",
            "router_params",
            "shared_expert_params",
            "dense_mlp_params",
        ),
        0,
    )
    if mixer_type == "mlp":
        inter = _check_positive("intermediate_size", fields.get("intermediate_size"), where)
        out["dense_mlp_params"] = c * d * inter
        out.update(params=c * d * inter, activated_params=c * d * inter, macs=c * d * inter, all_to_all_scalars=0)
        return out
    m = _check_positive("moe_intermediate_size", fields.get("moe_intermediate_size"), where)
    n, k = fields.get("num_experts"), fields.get("num_experts_per_tok")
    _check_topk(n, k, where)
    latent = _check_optional_positive("moe_latent_size", fields.get("moe_latent_size"), where)
    m_s = _shared_width(fields.get("moe_shared_expert_intermediate_size"), where)
    width = d if latent is None else latent
    out["routed_expert_params"] = c * n * width * m
    out["latent_projection_params"] = 0 if latent is None else 2 * d * latent
    out["router_params"] = d * n
    out["shared_expert_params"] = c * d * m_s
    params = sum(out.values())
    activated = params - out["routed_expert_params"] + c * k * width * m
    out.update(params=params, activated_params=activated, macs=activated, all_to_all_scalars=2 * k * width)
    return out


def layer_accounting(config, layer_idx: int, context_length: int = 0) -> LatentMoELayerAccounting:
    """Accounting of decoder layer `layer_idx` of a LatentMoE config-like object (see module docstring).

    Args:
        config: `LatentMoEConfig`, any object with its field names, or a `config.json` dict.
        layer_idx: 0 <= layer_idx < num_hidden_layers.
        context_length: keys each query attends to, for the attention-score MACs (0 = projections only).

    Raises:
        ValueError: a field is missing or out of range; the message names the layer and the field.
    """
    fields = layer_fields(config, layer_idx)
    where = f"layer {layer_idx}: "
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 0:
        raise ValueError(f"`context_length` must be a non-negative integer, got {context_length!r}.")
    mixer = mixer_accounting(fields, where)
    d = fields["hidden_size"]
    try:
        attention = attention_params(
            d,
            fields["num_attention_heads"],
            fields["num_key_value_heads"],
            fields["head_dim"],
            bool(fields["attention_bias"]),
        )
    except ValueError as error:
        raise ValueError(f"{where}{error}") from None
    attention_weights = attention_params(
        d, fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_dim"], False
    )
    norms = 2 * d
    return LatentMoELayerAccounting(
        layer_idx=layer_idx,
        mixer_type=fields["mixer_type"],
        attention_params=attention,
        routed_expert_params=mixer["routed_expert_params"],
        latent_projection_params=mixer["latent_projection_params"],
        router_params=mixer["router_params"],
        shared_expert_params=mixer["shared_expert_params"],
        dense_mlp_params=mixer["dense_mlp_params"],
        norm_params=norms,
        total_params=attention + mixer["params"] + norms,
        activated_params=attention + mixer["activated_params"] + norms,
        mixer_macs=mixer["macs"],
        attention_macs=attention_weights + 2 * fields["num_attention_heads"] * fields["head_dim"] * context_length,
        all_to_all_scalars=mixer["all_to_all_scalars"],
    )


@dataclass(frozen=True)
class LatentMoEAccounting:
    """Sizes of a whole LatentMoE model: per-layer entries plus totals (counts; MACs and scalars per token).

    `total_params` counts every stored parameter once: embedding (V D), decoder layers, final norm (D) and the
    LM head (V D, 0 when tied). `activated_params` counts decoder parameters a token reads plus the LM head
    (embedding lookup excluded), the usual "activated parameters" of MoE papers.
    """

    layers: tuple
    embedding_params: int
    lm_head_params: int
    final_norm_params: int
    decoder_params: int
    activated_decoder_params: int
    total_params: int
    activated_params: int
    mixer_macs: int
    activated_macs: int
    all_to_all_scalars: int
    context_length: int

    def as_dict(self) -> dict:
        out = asdict(self)
        out["layers"] = [layer.as_dict() for layer in self.layers]
        return out


def model_accounting(config, context_length: int = 0) -> LatentMoEAccounting:
    """Accounting of a whole LatentMoE config-like object (see `layer_accounting` for the per-layer terms).

    `activated_macs` adds the LM head (V D MACs per token) to the per-layer attention and mixer MACs.

    Raises:
        ValueError: `vocab_size`/`num_hidden_layers` missing or not positive, or a layer field out of range.
    """
    layers = tuple(layer_accounting(config, i, context_length) for i in range(_num_layers(config)))
    vocab = _check_positive("vocab_size", _get(config, "vocab_size"))
    d = _check_positive("hidden_size", _get(config, "hidden_size"))
    embedding = vocab * d
    tied = bool(_get(config, "tie_word_embeddings", False))
    lm_head = vocab * d
    decoder = sum(layer.total_params for layer in layers) + d
    activated_decoder = sum(layer.activated_params for layer in layers) + d
    return LatentMoEAccounting(
        layers=layers,
        embedding_params=embedding,
        lm_head_params=lm_head,
        final_norm_params=d,
        decoder_params=decoder,
        activated_decoder_params=activated_decoder,
        total_params=embedding + decoder + (0 if tied else lm_head),
        activated_params=activated_decoder + lm_head,
        mixer_macs=sum(layer.mixer_macs for layer in layers),
        activated_macs=sum(layer.activated_macs for layer in layers) + lm_head,
        all_to_all_scalars=sum(layer.all_to_all_scalars for layer in layers),
        context_length=context_length,
    )
