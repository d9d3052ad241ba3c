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
"""Parameter, compute and communication accounting of both families, MoHD and LatentMoE, and of plain LLaMA configs,
without building the model (pure Python, no torch).

One unit for compute: forward FLOPs per token, 2 FLOPs per multiply-add, counting the matmuls (projections, router,
group fusion, LM head) plus, for a context of S keys, the attention scores QK^T and AV (4 H h S); elementwise work
(activations, norms, softmax, biases, routing combine) is left out. For LatentMoE, FLOPs = 2 x the MACs of
arXiv 2610.14644 appendix B.2.

Shared terms (MoHD arXiv 2412.05644 section 3; LatentMoE arXiv 2610.14644 appendix B.2), with
D = `hidden_size`, H = heads, H_kv = key/value heads, h = `head_dim`, V = `vocab_size`:

- attention (LLaMA q, k, v, o)   D (H + 2 H_kv) h + H h D weights (+ (H + 2 H_kv) h + D biases, `attention_bias`)
- MLP of width I                 c D I weights (+ (c - 1) I + D biases, `mlp_bias`), c = 3 gated
                                 (act(gate) * up, then down: `mlp_gated=True`), 2 non-gated (act(up), then down)
- norms                          D per RMSNorm: two per decoder layer, one final
- embedding and LM head          V D each; a tied LM head is stored once (counted once in `total_params`) but read
                                 by every token (counted in `activated_params` and in the FLOPs, 2 V D)

LatentMoE layer t (arXiv 2610.14644 section 2 and appendix B.2), with
l = `moe_latent_size` (None = standard MoE, experts read width D), m = `moe_intermediate_size`, N = `num_experts`,
K = `num_experts_per_tok`, m_s = `moe_shared_expert_intermediate_size`:

- routed expert parameters       c N l m            (standard MoE: c N D m; no biases)
- latent projections             2 D l              (fc1_latent_proj D -> l, fc2_latent_proj l -> D; 0 if l is None;
                                                    + l + D biases with `mlp_bias`)
- router                         D N                (W_r is N x D, no bias)
- shared expert                  an MLP of width m_s (0 when m_s is None or 0)
- dense MLP layer                an MLP of width I  (`mixer_type="mlp"`, I = `intermediate_size`)
- activated FLOPs per token      2 (c K l m + 2 D l + D N + c D m_s)   (B.2: "approximately 3 C_t + d Q_t" MACs)
- all-to-all payload per token   2 K l scalars      (dispatch K l plus return K l; standard MoE 2 K D; B.2 / Fig. 6)

MoHD layer (arXiv 2412.05644 section 3), N = `num_sub_dims`, N_s shared, k routed per token (each sublayer's own,
`routed_sub_dims_per_tok`), n_a = N_s + k: a sparsified sublayer reads the n_a / N fraction of the input-side
weight columns (q/k/v, gate/up) and output-side rows (o, down; with `sparse_sides` "input" or "output" the other
side is read whole) and of the output-side biases, all of the input-side biases, its
router (N_r x D, N_r = N - N_s; none when k = 0) and its group fusion (N x N; N D multiply-adds per token). With
`dropped_block_compensation` a sparsified sublayer also holds an (N, out) table per input-side projection and an
(N, D / N) output table; a token reads the N - n_a rows of its skipped blocks, and the model adds the tables with one
(N, out) product per input-side projection (2 N out FLOPs per token). A LLaMA config is a MoHD one with every block
shared.

Everything takes plain numbers, or a config-like object: a `PreTrainedConfig` (LatentMoE per-layer values read
through `config.per_layer_config[i]`), any object with the field names as attributes, or a plain `dict` such as a
parsed `config.json` (its `per_layer_config` maps layer indices, int or zero-padded str, to field overrides).

This file is copied next to the weights of both families as remote code: it imports only the standard library and the
per-layer schema (`configuration_layers.py`) at module level.
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from .configuration_layers import (
    MIXER_TYPES,
    MOHD_PER_LAYER_FIELDS,
    MOHD_SUBLAYERS,
    PER_LAYER_FIELDS,
    check_layer_overrides,
)


# LatentMoE fields the accounting of a layer reads, with the value used when a config lacks them.
LAYER_FIELD_DEFAULTS = {
    "hidden_size": None,
    "moe_intermediate_size": None,
    "moe_latent_size": None,
    "num_experts": None,
    "num_experts_per_tok": None,
    "moe_shared_expert_intermediate_size": None,
    "mlp_gated": True,
    "mlp_bias": False,
    "mixer_type": "moe",
    "intermediate_size": None,
    "num_attention_heads": None,
    "num_key_value_heads": None,
    "head_dim": None,
    "attention_bias": False,
}

# Fields that mark a config of another mixture-of-experts family, whose experts these formulas do not describe.
_FOREIGN_MOE_FIELDS = ("num_experts", "num_local_experts", "moe_intermediate_size", "n_routed_experts")


def _check_positive(name: str, value, where: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}`{name}` must be a positive integer, got {value!r}.")
    return value


def _check_optional_positive(name: str, value, where: str = "") -> int | None:
    if value is None:
        return None
    return _check_positive(name, value, where)


def _check_context(context_length) -> int:
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 0:
        raise ValueError(f"`context_length` must be a non-negative integer, got {context_length!r}.")
    return context_length


def _matrices(mlp_gated: bool, where: str = "") -> int:
    """c: weight matrices of one MLP, 3 when gated (gate, up, down), 2 when not (up, down)."""
    if not isinstance(mlp_gated, bool):
        raise ValueError(f"{where}`mlp_gated` must be a bool, got {mlp_gated!r}.")
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
# Shared primitives (plain numbers): both families' layers are built from these
# ----------------------------------------------------------------------------------------------------------------------


def attention_shapes(
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    attention_bias: bool = False,
) -> tuple[int, int, int, int]:
    """LLaMA attention as (input-side weights, output-side weights, input-side biases, output-side biases):
    q/k/v D (H + 2 H_kv) h, o H h D, and with `attention_bias` (H + 2 H_kv) h and D (else 0, 0).

    `num_key_value_heads` defaults to `num_attention_heads` and `head_dim` to D / H, as in LLaMA. The split by side
    is what a MoHD sublayer slices (it reads the active columns of the input side and rows of the output side).

    Raises:
        ValueError: a size is not a positive integer.
    """
    d = _check_positive("hidden_size", hidden_size)
    heads = _check_positive("num_attention_heads", num_attention_heads)
    kv_heads = heads if num_key_value_heads is None else _check_positive("num_key_value_heads", num_key_value_heads)
    head_dim = d // heads if head_dim is None else _check_positive("head_dim", head_dim)
    qkv_out = (heads + 2 * kv_heads) * head_dim
    bias = bool(attention_bias)
    return d * qkv_out, heads * head_dim * d, qkv_out * bias, d * bias


def attention_params(
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    attention_bias: bool = False,
) -> int:
    """LLaMA attention q/k/v/o projections: D (H + 2 H_kv) h + H h D (+ (H + 2 H_kv) h + D with biases)."""
    return sum(attention_shapes(hidden_size, num_attention_heads, num_key_value_heads, head_dim, attention_bias))


def attention_score_flops(num_attention_heads: int, head_dim: int, context_length: int) -> int:
    """FLOPs per query token of QK^T and AV over S = `context_length` keys: 2 products x 2 H h S.

    Raises:
        ValueError: `context_length` negative or not an integer.
    """
    return 4 * num_attention_heads * head_dim * _check_context(context_length)


def mlp_shapes(
    hidden_size: int, intermediate_size: int, mlp_gated: bool = True, mlp_bias: bool = False
) -> tuple[int, int, int, int]:
    """An MLP of width I as (input-side weights, output-side weights, input-side biases, output-side biases):
    gate/up (c - 1) D I, down I D, and with `mlp_bias` (c - 1) I and D (else 0, 0); c = 3 gated, 2 non-gated.

    The LLaMA MLP, the LatentMoE dense layer and shared expert (arXiv 2610.14644 section 2).

    Raises:
        ValueError: a size is not a positive integer, or `mlp_gated` is not a bool.
    """
    d = _check_positive("hidden_size", hidden_size)
    inter = _check_positive("intermediate_size", intermediate_size)
    up = _matrices(mlp_gated) - 1
    bias = bool(mlp_bias)
    return up * d * inter, inter * d, up * inter * bias, d * bias


def mlp_params(hidden_size: int, intermediate_size: int, mlp_gated: bool = True, mlp_bias: bool = False) -> int:
    """Parameters of an MLP of width I: c D I weights (+ (c - 1) I + D biases with `mlp_bias`)."""
    return sum(mlp_shapes(hidden_size, intermediate_size, mlp_gated, mlp_bias))


def norm_params(hidden_size: int) -> int:
    """One RMSNorm weight: D (two per decoder layer, one final norm)."""
    return _check_positive("hidden_size", hidden_size)


def embedding_params(vocab_size: int, hidden_size: int) -> int:
    """The word-token embedding, and equally the LM head: V D."""
    return _check_positive("vocab_size", vocab_size) * _check_positive("hidden_size", hidden_size)


# ----------------------------------------------------------------------------------------------------------------------
# LatentMoE components (plain numbers)
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
    routed experts contain 3 N_t l_t m_t parameters"); c = 3 gated, 2 non-gated.
    With N = K it is what a token reads of them.

    Raises:
        ValueError: a size is not a positive integer, or `mlp_gated` is not a bool.
    """
    width = hidden_size if moe_latent_size is None else moe_latent_size
    _check_positive("num_experts", num_experts)
    _check_positive("moe_intermediate_size", moe_intermediate_size)
    _check_positive("hidden_size", hidden_size)
    _check_optional_positive("moe_latent_size", moe_latent_size)
    return _matrices(mlp_gated) * num_experts * width * moe_intermediate_size


def latent_projection_params(hidden_size: int, moe_latent_size: int | None, mlp_bias: bool = False) -> int:
    """Parameters of `fc1_latent_proj` (D -> l) and `fc2_latent_proj` (l -> D): 2 D l, 0 when l is None.

    Source: arXiv 2610.14644 appendix B.2 ("2 d l_t latent-projection parameters"); with `mlp_bias` their biases add
    l + D.
    """
    _check_positive("hidden_size", hidden_size)
    if _check_optional_positive("moe_latent_size", moe_latent_size) is None:
        return 0
    return 2 * hidden_size * moe_latent_size + ((moe_latent_size + hidden_size) if mlp_bias else 0)


def router_params(hidden_size: int, num_experts: int) -> int:
    """Router weight W_r (N x D, no bias): D N. The sigmoid router's `e_score_correction_bias` is a buffer.

    Source: arXiv 2610.14644 appendix B.2 ("d N_t router parameters").
    """
    return _check_positive("hidden_size", hidden_size) * _check_positive("num_experts", num_experts)


def shared_expert_params(
    hidden_size: int, moe_shared_expert_intermediate_size: int | None, mlp_gated: bool = True, mlp_bias: bool = False
) -> int:
    """Full-width shared expert, an MLP of width m_s: c D m_s (+ biases with `mlp_bias`; 0 when m_s is None or 0).

    Source: arXiv 2610.14644 appendix B.2 ("3 d m_{s,t} full-width shared-expert parameters"), c = 2 non-gated.
    """
    _check_positive("hidden_size", hidden_size)
    width = _shared_width(moe_shared_expert_intermediate_size)
    return mlp_params(hidden_size, width, mlp_gated, mlp_bias) if width else 0


def moe_activated_flops(
    hidden_size: int,
    moe_intermediate_size: int,
    num_experts: int,
    num_experts_per_tok: int,
    moe_latent_size: int | None = None,
    moe_shared_expert_intermediate_size: int | None = None,
    mlp_gated: bool = True,
) -> int:
    """FLOPs per token of one MoE mixer: 2 (c K l m + 2 D l + D N + c D m_s).

    FLOPs = 2 x the MACs of arXiv 2610.14644 appendix B.2 ("activated MACs per token are approximately
    3 C_t + d Q_t", C_t = K_t l_t m_t, Q_t = 2 l_t + N_t + 3 m_{s,t}); standard MoE (l None) reads width D:
    2 (c K D m + D N + c D m_s). Excludes elementwise work (activation, routing softmax/sigmoid, weighted combine).

    Raises:
        ValueError: a size is not a positive integer, or K > N.
    """
    _check_topk(num_experts, num_experts_per_tok)
    weights = (
        routed_expert_params(num_experts_per_tok, moe_intermediate_size, hidden_size, moe_latent_size, mlp_gated)
        + latent_projection_params(hidden_size, moe_latent_size)
        + router_params(hidden_size, num_experts)
        + shared_expert_params(hidden_size, moe_shared_expert_intermediate_size, mlp_gated)
    )
    return 2 * weights


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


def _layer_source(config, layer_idx: int, allowed: tuple[str, ...]) -> tuple[object, dict]:
    """(object to read layer `layer_idx`'s fields from, overrides to apply on top): a `PreTrainedConfig`'s
    `per_layer_config[layer_idx]` view and no overrides, or a config-like object and its mapping `per_layer_config`
    entry for the layer, every entry checked against `allowed` (`check_layer_overrides`).

    Raises:
        ValueError: `layer_idx` outside [0, num_hidden_layers), a key that is not a layer index, or an entry that
            overrides a field outside `allowed`.
    """
    num_layers = _num_layers(config)
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < num_layers:
        raise ValueError(f"`layer_idx` must be an integer in [0, {num_layers}), got {layer_idx!r}.")
    per_layer = _get(config, "per_layer_config")
    if isinstance(per_layer, Mapping):
        overrides = {}
        for key, value in per_layer.items():
            if isinstance(key, bool) or not str(key).strip().isdigit() or not isinstance(value, Mapping):
                raise ValueError(
                    "`per_layer_config` must map layer indices (int or digit strings) to field overrides, "
                    f"got {key!r}: {value!r}."
                )
            check_layer_overrides(int(key), value, allowed)
            if int(key) == layer_idx:
                overrides = dict(value)
        return config, overrides
    if per_layer is not None:
        return per_layer[layer_idx], {}
    return config, {}


def layer_fields(config, layer_idx: int) -> dict:
    """Resolved LatentMoE fields (`LAYER_FIELD_DEFAULTS` keys) of layer `layer_idx` of a config-like object.

    A `PreTrainedConfig` is read through `config.per_layer_config[layer_idx]` (transformers' heterogeneous view);
    a `dict` or other object with a mapping `per_layer_config` ({index (int or str): {field: value}}) gets that
    layer's overrides applied on top of the global values, each entry checked as `LatentMoEConfig` checks it
    (`check_layer_overrides`: only the config's `PER_LAYER_FIELDS` may vary). Derived defaults follow LLaMA:
    `num_key_value_heads` = `num_attention_heads`, `head_dim` = D / H.

    Raises:
        ValueError: `layer_idx` is outside [0, num_hidden_layers), a `per_layer_config` key is not an index, or an
            entry overrides a field outside `PER_LAYER_FIELDS`.
    """
    source, overrides = _layer_source(config, layer_idx, PER_LAYER_FIELDS)
    fields = {}
    for name, default in LAYER_FIELD_DEFAULTS.items():
        fields[name] = overrides[name] if name in overrides else _get(source, name, default)
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if fields["head_dim"] is None and fields["num_attention_heads"]:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return fields


# ----------------------------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerAccounting:
    """Sizes of one decoder layer, the terms both families share. Parameters are counts; FLOPs (2 per multiply-add)
    and all-to-all scalars are per token of one forward pass.

    `attention_params`: q/k/v/o with their biases; `norm_params`: the two RMSNorm weights (2 D); `router_params` and
    `fusion_params`: every router and group-fusion matrix of the layer (MoHD: one of each per sparsified sublayer;
    LatentMoE: the MoE router, no fusion). `activated_params` counts what a token reads. `attention_flops`: the
    attention sublayer (projections, and a MoHD sublayer's router and fusion) plus the QK^T and AV scores at the
    accounting's context length; `mixer_flops`: the FFN sublayer (MLP or MoE mixer, with its router and fusion).
    `all_to_all_scalars`: expert-parallel payload (0 without routed experts).
    """

    layer_idx: int
    attention_params: int
    norm_params: int
    router_params: int
    fusion_params: int
    total_params: int
    activated_params: int
    attention_flops: int
    mixer_flops: int
    all_to_all_scalars: int

    @property
    def activated_flops(self) -> int:
        """FLOPs per token of the whole layer: `attention_flops + mixer_flops`."""
        return self.attention_flops + self.mixer_flops

    def as_dict(self) -> dict:
        return {**asdict(self), "activated_flops": self.activated_flops}


@dataclass(frozen=True)
class MoHDLayerAccounting(LayerAccounting):
    """A MoHD (or LLaMA) decoder layer: `LayerAccounting` plus `mlp_params`, the gate/up/down projections with their
    biases."""

    mlp_params: int


@dataclass(frozen=True)
class LatentMoELayerAccounting(LayerAccounting):
    """A LatentMoE decoder layer: `LayerAccounting` plus the mixer's components (arXiv 2610.14644 appendix B.2), each
    with the biases `mlp_bias` adds to it. `mixer_flops` is the B.2 formula in FLOPs (2 x its MACs)."""

    mixer_type: str
    routed_expert_params: int
    latent_projection_params: int
    shared_expert_params: int
    dense_mlp_params: int

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

    def as_dict(self) -> dict:
        return {**super().as_dict(), "mixer_params": self.mixer_params}


@dataclass(frozen=True)
class ModelAccounting:
    """Sizes of a whole model of either family (or LLaMA). Parameters are counts; FLOPs (2 per multiply-add) and
    all-to-all scalars are per token of one forward pass at `context_length` keys per query.

    `total_params` counts every stored parameter once: embedding (V D), decoder (layers and final norm) and the LM
    head (V D, 0 when tied). `activated_decoder_params` counts the decoder parameters a token reads; the embedding
    lookup and the LM head are given separately. `layers` holds the per-layer entries (`MoHDLayerAccounting` or
    `LatentMoELayerAccounting`); `router_params`, `fusion_params` and `all_to_all_scalars` are their sums.
    """

    layers: tuple
    total_params: int
    decoder_params: int
    activated_decoder_params: int
    embedding_params: int
    lm_head_params: int
    final_norm_params: int
    router_params: int
    fusion_params: int
    decoder_flops_per_token: int
    lm_head_flops_per_token: int
    all_to_all_scalars: int
    context_length: int

    @property
    def activated_params(self) -> int:
        """Activated decoder parameters plus the LM head (the usual "activated parameters" of MoE papers)."""
        return self.activated_decoder_params + self.lm_head_params

    @property
    def flops_per_token(self) -> int:
        """Forward FLOPs per token: decoder plus LM head."""
        return self.decoder_flops_per_token + self.lm_head_flops_per_token

    def decode_weight_bytes_per_token(self, bytes_per_param: int = 4) -> int:
        """Bytes of weights one batch-1 decoding step reads: the activated decoder parameters plus the LM head.

        This is the memory-bound cost of decoding; the embedding row and the key/value cache are left out
        (one row, and a few MB at short contexts). 4 bytes per parameter is fp32.
        """
        return self.activated_params * bytes_per_param

    def as_dict(self) -> dict:
        out = asdict(self)
        out["layers"] = [layer.as_dict() for layer in self.layers]
        out.update(activated_params=self.activated_params, flops_per_token=self.flops_per_token)
        return out


# ----------------------------------------------------------------------------------------------------------------------
# LatentMoE layers
# ----------------------------------------------------------------------------------------------------------------------

_MIXER_COMPONENTS = (
    "routed_expert_params",
    "latent_projection_params",
    "router_params",
    "shared_expert_params",
    "dense_mlp_params",
)


def mixer_accounting(fields: Mapping, where: str = "") -> dict:
    """Accounting of a LatentMoE FFN mixer alone from resolved layer fields (see `layer_fields`), for shaping tools.

    Returns a dict with `params`, `activated_params`, `flops` (per token), `all_to_all_scalars` and the components
    `routed_expert_params`, `latent_projection_params`, `router_params`, `shared_expert_params`, `dense_mlp_params`
    (each with its `mlp_bias` biases), from the component functions of this module.

    Raises:
        ValueError: a field is missing or out of range; messages start with `where` (e.g. "layer 3: ").
    """
    d = _check_positive("hidden_size", fields.get("hidden_size"), where)
    mixer_type = fields.get("mixer_type", "moe")
    if mixer_type not in MIXER_TYPES:
        raise ValueError(f"{where}`mixer_type` must be one of {MIXER_TYPES}, got {mixer_type!r}.")
    gated = fields.get("mlp_gated", True)
    _matrices(gated, where)
    bias = bool(fields.get("mlp_bias", False))
    out = dict.fromkeys(_MIXER_COMPONENTS, 0)
    if mixer_type == "mlp":
        inter = _check_positive("intermediate_size", fields.get("intermediate_size"), where)
        out["dense_mlp_params"] = mlp_params(d, inter, gated, bias)
        flops = 2 * mlp_params(d, inter, gated)
        out.update(params=out["dense_mlp_params"], activated_params=out["dense_mlp_params"], flops=flops)
        out["all_to_all_scalars"] = 0
        return out
    m = _check_positive("moe_intermediate_size", fields.get("moe_intermediate_size"), where)
    n, k = fields.get("num_experts"), fields.get("num_experts_per_tok")
    _check_topk(n, k, where)
    latent = _check_optional_positive("moe_latent_size", fields.get("moe_latent_size"), where)
    m_s = _shared_width(fields.get("moe_shared_expert_intermediate_size"), where)
    out["routed_expert_params"] = routed_expert_params(n, m, d, latent, gated)
    out["latent_projection_params"] = latent_projection_params(d, latent, bias)
    out["router_params"] = router_params(d, n)
    out["shared_expert_params"] = shared_expert_params(d, m_s, gated, bias)
    params = sum(out.values())
    # a token reads K of the N experts
    activated = params - out["routed_expert_params"] + routed_expert_params(k, m, d, latent, gated)
    out.update(
        params=params,
        activated_params=activated,
        flops=moe_activated_flops(d, m, n, k, latent, m_s, gated),
        all_to_all_scalars=all_to_all_scalars(d, k, latent),
    )
    return out


def _latent_moe_layer(config, layer_idx: int, context_length: int) -> LatentMoELayerAccounting:
    fields = layer_fields(config, layer_idx)
    where = f"layer {layer_idx}: "
    mixer = mixer_accounting(fields, where)
    d = fields["hidden_size"]
    heads, head_dim = fields["num_attention_heads"], fields["head_dim"]
    try:
        attention = attention_shapes(d, heads, fields["num_key_value_heads"], head_dim, fields["attention_bias"])
    except ValueError as error:
        raise ValueError(f"{where}{error}") from None
    norms = 2 * norm_params(d)
    return LatentMoELayerAccounting(
        layer_idx=layer_idx,
        attention_params=sum(attention),
        norm_params=norms,
        router_params=mixer["router_params"],
        fusion_params=0,
        total_params=sum(attention) + mixer["params"] + norms,
        activated_params=sum(attention) + mixer["activated_params"] + norms,
        attention_flops=2 * (attention[0] + attention[1]) + attention_score_flops(heads, head_dim, context_length),
        mixer_flops=mixer["flops"],
        all_to_all_scalars=mixer["all_to_all_scalars"],
        mixer_type=fields["mixer_type"],
        routed_expert_params=mixer["routed_expert_params"],
        latent_projection_params=mixer["latent_projection_params"],
        shared_expert_params=mixer["shared_expert_params"],
        dense_mlp_params=mixer["dense_mlp_params"],
    )


# ----------------------------------------------------------------------------------------------------------------------
# MoHD (and LLaMA) layers
# ----------------------------------------------------------------------------------------------------------------------


def routed_sub_dims_per_tok(config, layer_idx: int, sublayer: str) -> int:
    """k of one MoHD sublayer: the routed sub-dimensions each token activates in the `sublayer` kind ("attention" or
    "ffn") of layer `layer_idx`. The layer's `{sublayer}_routed_sub_dims_per_tok` when set (for one layer through
    `per_layer_config`, or for every layer at the top level), else `num_routed_sub_dims_per_tok`; 0 (no router,
    the shared blocks alone) for a config without the MoHD fields (LLaMA). Per-sublayer budgets follow TEAL (arXiv
    2408.14690 section 4.2), which gives each layer and projection kind its own sparsity.

    Raises:
        ValueError: `sublayer` not in `MOHD_SUBLAYERS`, `layer_idx` outside [0, num_hidden_layers), or a
            `per_layer_config` entry of a config dict that overrides a field outside `MOHD_PER_LAYER_FIELDS`.
    """
    if sublayer not in MOHD_SUBLAYERS:
        raise ValueError(f"`sublayer` must be one of {list(MOHD_SUBLAYERS)}, got {sublayer!r}.")
    name = f"{sublayer}_routed_sub_dims_per_tok"
    source, overrides = _layer_source(config, layer_idx, MOHD_PER_LAYER_FIELDS)
    value = overrides[name] if name in overrides else _get(source, name)
    return _get(config, "num_routed_sub_dims_per_tok", 0) if value is None else value


def _mohd_layers(config, context_length: int) -> tuple:
    """The `MoHDLayerAccounting` of every decoder layer of a MoHD config, each sublayer at its own k
    (`routed_sub_dims_per_tok`); a config without the MoHD fields (LLaMA) has one block, all shared: every sublayer
    dense, no router and no fusion (MoHD arXiv 2412.05644 section 3)."""
    d = _check_positive("hidden_size", _get(config, "hidden_size"))
    heads = _check_positive("num_attention_heads", _get(config, "num_attention_heads"))
    kv_heads = _get(config, "num_key_value_heads") or heads
    head_dim = _get(config, "head_dim") or d // heads
    n = _check_positive("num_sub_dims", _get(config, "num_sub_dims", 1))
    n_shared = _get(config, "num_shared_sub_dims", n)
    n_routed = n - n_shared
    sparse = set(_get(config, "sparse_modules", ()) or ()) if n_routed > 0 else set()
    fusion = _get(config, "group_fusion", "none") == "mix"
    compensation = bool(_get(config, "dropped_block_compensation", False))
    sides = _get(config, "sparse_sides", "both")
    sparse_in, sparse_out = sides in ("both", "input"), sides in ("both", "output")
    # the widths of each sublayer's input-side projections (q, k, v; gate, up): the compensation tables' columns
    input_widths = {"attention": (heads + 2 * kv_heads) * head_dim, "ffn": 2 * _get(config, "intermediate_size")}
    shapes = {
        "attention": attention_shapes(d, heads, kv_heads, head_dim, bool(_get(config, "attention_bias", False))),
        "ffn": mlp_shapes(d, _get(config, "intermediate_size"), True, bool(_get(config, "mlp_bias", False))),
    }

    def sizes(name: str, top_k: int) -> dict:
        w_in, w_out, b_in, b_out = shapes[name]
        if name not in sparse:
            params = w_in + w_out + b_in + b_out
            return dict(params=params, activated=params, routers=0, fusions=0, flops=2 * (w_in + w_out))
        n_active = n_shared + top_k
        compensated = compensation and top_k > 0
        active_in = w_in * n_active // n if sparse_in else w_in
        active_weights = active_in + (w_out * n_active // n if sparse_out else w_out)
        routers, fusions = n_routed * d * (top_k > 0), n * n * fusion  # k = 0 builds no router
        tables = (input_widths[name] + d // n) * compensated  # per block: the input tables' row, the output's
        return dict(
            params=w_in + w_out + b_in + b_out + n * tables,
            activated=active_weights
            + b_in
            + (b_out * n_active // n if sparse_out else b_out)
            + (n - n_active) * tables,
            routers=routers,
            fusions=fusions,
            # the router reads the full width (N_r x D); the fusion mixes N blocks of width D / N (N D)
            flops=2 * (active_weights + routers + n * d * fusion + n * input_widths[name] * compensated),
        )

    norms = 2 * norm_params(d)
    layers = []
    for idx in range(_num_layers(config)):
        attention, ffn = (sizes(kind, routed_sub_dims_per_tok(config, idx, kind)) for kind in MOHD_SUBLAYERS)
        routers, fusions = attention["routers"] + ffn["routers"], attention["fusions"] + ffn["fusions"]
        layers.append(
            MoHDLayerAccounting(
                layer_idx=idx,
                attention_params=attention["params"],
                norm_params=norms,
                router_params=routers,
                fusion_params=fusions,
                total_params=attention["params"] + ffn["params"] + routers + fusions + norms,
                activated_params=attention["activated"] + ffn["activated"] + routers + fusions + norms,
                attention_flops=attention["flops"] + attention_score_flops(heads, head_dim, context_length),
                mixer_flops=ffn["flops"],
                all_to_all_scalars=0,
                mlp_params=ffn["params"],
            )
        )
    return tuple(layers)


# ----------------------------------------------------------------------------------------------------------------------
# The entry point
# ----------------------------------------------------------------------------------------------------------------------


def _is_latent_moe(config) -> bool:
    """The one dispatch between the families: `model_type` "latent_moe", or (no `model_type`: a dict or plain object)
    LatentMoE fields. "mohd", LLaMA-like and absent types without those fields take the MoHD (LLaMA) formulas.

    Raises:
        ValueError: another model type with mixture-of-experts fields (its experts are not LatentMoE's).
    """
    model_type = _get(config, "model_type")
    if model_type == "latent_moe":
        return True
    if model_type == "mohd":
        return False
    has_moe_fields = any(_get(config, name) is not None for name in _FOREIGN_MOE_FIELDS)
    if model_type is None:
        return has_moe_fields
    if has_moe_fields:
        raise ValueError(
            f"No accounting for model_type {model_type!r}: its mixture-of-experts fields are not LatentMoE's; "
            "accounted families: 'mohd', 'latent_moe' and dense LLaMA-like configs."
        )
    return False


def model_accounting(config, context_length: int = 0) -> ModelAccounting:
    """Accounting of a whole model of either family, or of a dense LLaMA-style config, without building it.

    Args:
        config: a `MoHDConfig`, a `LatentMoEConfig`, a `LlamaConfig` (or any LLaMA-like config: every block counts
            as shared), a `config.json` dict, or any object with those field names. Dispatch: `model_type`
            ("latent_moe", "mohd"), else the presence of LatentMoE fields (`num_experts`, `moe_intermediate_size`).
        context_length: keys each query attends to, for the attention-score FLOPs (0 = projections only).

    Returns:
        A `ModelAccounting`; see the module docstring for the terms (FLOPs per token, 2 per multiply-add).

    Raises:
        ValueError: a field is missing or out of range (per layer, the message names the layer), a LatentMoE
            `per_layer_config` entry overrides a field the config does not let vary, `context_length` is negative,
            or the config is a mixture-of-experts of another family.
    """
    _check_context(context_length)
    if _is_latent_moe(config):
        layers = tuple(_latent_moe_layer(config, idx, context_length) for idx in range(_num_layers(config)))
    else:
        layers = _mohd_layers(config, context_length)
    d = _check_positive("hidden_size", _get(config, "hidden_size"))
    embedding = embedding_params(_get(config, "vocab_size"), d)
    final_norm = norm_params(d)
    decoder = sum(layer.total_params for layer in layers) + final_norm
    tied = bool(_get(config, "tie_word_embeddings", False))
    return ModelAccounting(
        layers=layers,
        total_params=embedding + decoder + (0 if tied else embedding),
        decoder_params=decoder,
        activated_decoder_params=sum(layer.activated_params for layer in layers) + final_norm,
        embedding_params=embedding,
        lm_head_params=embedding,
        final_norm_params=final_norm,
        router_params=sum(layer.router_params for layer in layers),
        fusion_params=sum(layer.fusion_params for layer in layers),
        decoder_flops_per_token=sum(layer.activated_flops for layer in layers),
        lm_head_flops_per_token=2 * embedding,
        all_to_all_scalars=sum(layer.all_to_all_scalars for layer in layers),
        context_length=context_length,
    )


def layer_accounting(config, layer_idx: int, context_length: int = 0) -> LayerAccounting:
    """Entry `layer_idx` of `model_accounting(config, context_length).layers` (every layer's fields are checked).

    Raises:
        ValueError: `layer_idx` is outside [0, num_hidden_layers), or as `model_accounting`.
    """
    num_layers = _num_layers(config)
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < num_layers:
        raise ValueError(f"`layer_idx` must be an integer in [0, {num_layers}), got {layer_idx!r}.")
    return model_accounting(config, context_length).layers[layer_idx]


def parameter_counts(model_or_config) -> dict[str, int]:
    """The parameter counts reports print, all from `model_accounting` (no second count):

    - total: parameters the model holds (a tied LM head once), `ModelAccounting.total_params`;
    - embedding: the input embedding (V D);
    - decoder: everything but the embedding and an untied LM head (layers and final norm);
    - activated_decoder: the decoder parameters one token reads;
    - activated: activated_decoder plus the LM head (what one token's forward pass reads);
    - router, fusion: router and group-fusion parameters (0 where the model has none).

    Args:
        model_or_config: a model (its `.config` is read) or anything `model_accounting` takes.

    Raises:
        ValueError: as `model_accounting`.
    """
    accounting = model_accounting(getattr(model_or_config, "config", model_or_config))
    return {
        "total": accounting.total_params,
        "embedding": accounting.embedding_params,
        "decoder": accounting.decoder_params,
        "activated_decoder": accounting.activated_decoder_params,
        "activated": accounting.activated_params,
        "router": accounting.router_params,
        "fusion": accounting.fusion_params,
    }
