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
"""Dense LLaMA -> LatentMoE upcycling (docs/design.md section 6; layer definition in section 4).

Per layer, with D = hidden_size, I = the dense FFN width, E experts of width m, latent width l:
- attention, norms, embedding and LM head are copied unchanged;
- the dense FFN becomes the shared expert (`mlp.shared_experts.{gate,up,down}_proj`, m_s = I), unchanged;
- `mlp.fc2_latent_proj` (D x l, and its bias) is **zero**, so the routed path adds exactly 0 and the converted model
  computes the source logits at step 0 (the zero-init of the up-projection is the same device as LoRA's B = 0:
  fc2 receives gradient first, the rest once fc2 is non-zero);
- the router `mlp.gate.weight` (E x D) is N(0, initializer_range^2), the law of `LatentMoEPreTrainedModel._init_weights`;
- routed experts and `fc1_latent_proj` (l x D), `expert_init`:
  - "slices" (default; "sparse upcycling", Komatsuzaki et al. 2022, arXiv 2212.05055, with the fine-grained split
    of DeepSeekMoE, arXiv 2401.06066): P (l x D) = the top-l right singular vectors of the layer's stacked dense
    input map [W_gate; W_up] (the input directions the FFN reads most; data-free), `fc1_latent_proj = P`; expert e
    takes rows e*m .. (e+1)*m of the dense FFN, read through the latent space: gate_e = W_gate[rows] P^T,
    up_e = W_up[rows] P^T (m x l), down_e = P W_down[:, rows] (l x m). With fc2 = P^T (instead of 0) each expert
    would be its slice of the FFN restricted to the top-l input subspace; dense biases are not carried into experts;
  - "random": experts and `fc1_latent_proj` ~ N(0, initializer_range^2).
All random draws come from a generator seeded with `seed`, layer by layer (router, then fc1 and experts).
`dense_layers` keeps chosen layers dense (`mixer_type="mlp"` in `per_layer_config`), their FFN copied as is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ...models.configuration_common import LLAMA_ARCHITECTURE_FIELDS
from ...models.configuration_latent_moe import LatentMoEConfig
from ...models.modeling_latent_moe import LatentMoEForCausalLM
from ..source import ConversionError, DenseLlamaSource, load_dense_llama


logger = logging.getLogger(__name__)

EXPERT_INITS = ("slices", "random")
# LLaMA fields that LatentMoEConfig takes as they are.
COPIED_FIELDS = (
    *LLAMA_ARCHITECTURE_FIELDS,
    "mlp_bias",
    "max_position_embeddings",
    "rope_parameters",
    "rms_norm_eps",
    "initializer_range",
    "tie_word_embeddings",
    "attention_bias",
    "attention_dropout",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)


def latent_moe_config_from_llama(
    llama_config,
    *,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    moe_latent_size: int | None = None,
    router_score_func: str = "softmax",
    dense_layers: Sequence[int] = (),
    **overrides,
) -> LatentMoEConfig:
    """LatentMoE config of an upcycled LLaMA: source shapes, shared expert = the dense FFN (m_s = I).

    Args:
        llama_config: the source `LlamaConfig`.
        num_experts, num_experts_per_tok: E and K of every MoE layer.
        moe_intermediate_size: m; default I / E (the dense FFN cut into E slices).
        moe_latent_size: l; default D / 4 (the alpha = 4 of Nemotron 3, docs/design.md section 4).
        router_score_func: "softmax" or "sigmoid".
        dense_layers: layer indices kept dense (`mixer_type="mlp"`).
        overrides: other `LatentMoEConfig` fields.

    Raises:
        ConversionError: a layer index out of range, or values `LatentMoEConfig` rejects (its message names the field).
    """
    hidden, intermediate = llama_config.hidden_size, llama_config.intermediate_size
    bad = [i for i in dense_layers if not 0 <= i < llama_config.num_hidden_layers]
    if bad:
        raise ConversionError(f"`dense_layers` {bad} out of range [0, {llama_config.num_hidden_layers}).")
    fields = {name: getattr(llama_config, name) for name in COPIED_FIELDS if hasattr(llama_config, name)}
    fields["head_dim"] = getattr(llama_config, "head_dim", None) or hidden // llama_config.num_attention_heads
    fields.update(
        mlp_gated=True,
        mixer_type="moe",
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size or max(1, intermediate // num_experts),
        moe_latent_size=moe_latent_size or max(1, hidden // 4),
        moe_shared_expert_intermediate_size=intermediate,
        router_score_func=router_score_func,
        per_layer_config={i: {"mixer_type": "mlp"} for i in sorted(set(dense_layers))} or None,
    )
    fields.update(overrides)
    if fields["hidden_act"] != llama_config.hidden_act or not fields["mlp_gated"]:
        raise ConversionError("The shared expert reuses the dense SwiGLU FFN: keep `mlp_gated=True` and `hidden_act`.")
    try:
        return LatentMoEConfig(**fields)
    except ValueError as err:
        raise ConversionError(f"LatentMoE settings do not fit the source (hidden_size={hidden}): {err}") from err


def _latent_basis(gate: torch.Tensor, up: torch.Tensor, latent_size: int) -> torch.Tensor:
    """(l, D) orthonormal rows: the top-l right singular vectors of [W_gate; W_up] (2I x D), computed in fp32."""
    stacked = torch.cat([gate, up], dim=0).float()
    _, _, vh = torch.linalg.svd(stacked, full_matrices=False)
    if latent_size > vh.shape[0]:
        raise ConversionError(
            f"`moe_latent_size` {latent_size} exceeds the rank bound {vh.shape[0]} of the dense FFN input map."
        )
    return vh[:latent_size]


def _upcycle_layer(block, dense: dict[str, torch.Tensor], expert_init: str, generator, std: float) -> None:
    """Fill one `LatentMoEBlock` from the dense FFN tensors {gate, up, down} (module docstring)."""
    dtype = block.shared_experts.up_proj.weight.dtype
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(block.shared_experts, name).load_state_dict(
            {k.removeprefix(f"{name}."): v for k, v in dense.items() if k.startswith(f"{name}.")}
        )
    block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=generator) * std)
    fc1, fc2, experts = block.fc1_latent_proj, block.fc2_latent_proj, block.experts
    fc2.weight.zero_()
    if fc2.bias is not None:
        fc2.bias.zero_()
    if fc1.bias is not None:
        fc1.bias.zero_()
    num_experts, width = experts.num_experts, experts.intermediate_dim
    if expert_init == "random":
        fc1.weight.copy_(torch.randn(fc1.weight.shape, generator=generator) * std)
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=generator) * std)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=generator) * std)
        return
    gate, up, down = (dense[f"{n}_proj.weight"].float() for n in ("gate", "up", "down"))
    basis = _latent_basis(gate, up, fc1.weight.shape[0])  # (l, D)
    fc1.weight.copy_(basis)
    rows = torch.arange(num_experts * width).view(num_experts, width)  # (E, m) dense FFN rows per expert
    gate_up = torch.cat([gate[rows] @ basis.T, up[rows] @ basis.T], dim=1)  # (E, 2m, l)
    experts.gate_up_proj.copy_(gate_up.to(dtype))
    down_latent = (basis @ down[:, rows.reshape(-1)]).view(-1, num_experts, width)  # (l, E, m)
    experts.down_proj.copy_(down_latent.transpose(0, 1).to(dtype))  # (E, l, m)


def llama_to_latent_moe(
    source: str | DenseLlamaSource,
    *,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    moe_latent_size: int | None = None,
    expert_init: str = "slices",
    router_score_func: str = "softmax",
    dense_layers: Sequence[int] = (),
    seed: int = 0,
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
    **overrides,
) -> LatentMoEForCausalLM:
    """Upcycle a dense LLaMA checkpoint into a LatentMoE model (eval mode) with the same logits at step 0.

    Args:
        source: a `DenseLlamaSource` or anything `load_dense_llama` accepts (folder, .gguf file).
        num_experts, num_experts_per_tok, moe_intermediate_size, moe_latent_size, router_score_func, dense_layers,
            overrides: see `latent_moe_config_from_llama`.
        expert_init: "slices" or "random" (module docstring).
        seed: seed of every random draw.
        dtype: dtype of the converted model; None keeps the source's.
        gguf_file: GGUF file name inside the folder `source`.

    Returns:
        `LatentMoEForCausalLM` whose `generation_config` is the source's.

    Raises:
        ConversionError: the source cannot be loaded, the settings do not fit it, or "slices" asks for more FFN rows
            (num_experts * moe_intermediate_size) than the dense FFN has.
    """
    if expert_init not in EXPERT_INITS:
        raise ConversionError(f"`expert_init` must be one of {list(EXPERT_INITS)}, got {expert_init!r}.")
    source = load_dense_llama(source, gguf_file=gguf_file, dtype=dtype)
    config = latent_moe_config_from_llama(
        source.config,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        moe_latent_size=moe_latent_size,
        router_score_func=router_score_func,
        dense_layers=dense_layers,
        **overrides,
    )
    if expert_init == "slices":
        for idx in range(config.num_hidden_layers):
            layer = config.per_layer_config[idx]
            if (
                layer.mixer_type == "moe"
                and layer.num_experts * layer.moe_intermediate_size > config.intermediate_size
            ):
                raise ConversionError(
                    f"layer {idx}: expert_init='slices' needs num_experts * moe_intermediate_size "
                    f"({layer.num_experts} * {layer.moe_intermediate_size}) <= intermediate_size "
                    f"({config.intermediate_size}); lower them or use expert_init='random'."
                )
            if layer.mixer_type == "moe" and layer.moe_latent_size is None:
                raise ConversionError(f"layer {idx}: expert_init='slices' needs a `moe_latent_size`.")
    logger.info(
        "LatentMoE: %d experts (top-%d) of width %d at latent width %d, shared expert = dense FFN (%d), "
        "expert init %r, dense layers %s",
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        config.moe_latent_size,
        config.intermediate_size,
        expert_init,
        sorted(dense_layers),
    )
    model = LatentMoEForCausalLM(config).to(source.dtype)
    state = source.state_dict
    keep = {name: t for name, t in state.items() if ".mlp." not in name or int(name.split(".")[2]) in dense_layers}
    missing, unexpected = model.load_state_dict(keep, strict=False)
    if unexpected:
        raise ConversionError(f"Source tensors unknown to LatentMoE: {unexpected[:5]}.")
    generator = torch.Generator().manual_seed(seed)
    std = config.initializer_range
    with torch.no_grad():
        for idx, layer in enumerate(model.model.layers):
            if idx in dense_layers:
                continue
            prefix = f"model.layers.{idx}.mlp."
            dense = {name.removeprefix(prefix): t for name, t in state.items() if name.startswith(prefix)}
            _upcycle_layer(layer.mlp, dense, expert_init, generator, std)
            logger.debug("upcycled layer %d", idx)
    unfilled = [name for name in missing if ".mlp." not in name]
    if unfilled:
        raise ConversionError(f"LatentMoE parameters with no source tensor: {unfilled[:5]}.")
    model.generation_config = source.generation_config
    return model.eval()


def describe_latent_moe_conversion(config: LatentMoEConfig, expert_init: str, seed: int) -> str:
    """Markdown for the model card: what the upcycling kept, added and zeroed."""
    init = (
        "slices of the dense FFN read through the top-`moe_latent_size` right singular vectors of [W_gate; W_up] "
        "(also `fc1_latent_proj`)"
        if expert_init == "slices"
        else f"N(0, {config.initializer_range}^2) (also `fc1_latent_proj`)"
    )
    dense = [i for i in range(config.num_hidden_layers) if config.per_layer_config[i].mixer_type == "mlp"]
    return (
        "Upcycled: attention, norms, embedding and LM head copied unchanged; each layer's dense SwiGLU FFN became the "
        f"shared expert (width {config.intermediate_size}) unchanged. New: {config.num_experts} routed experts "
        f"(top-{config.num_experts_per_tok}) of width {config.moe_intermediate_size} at latent width "
        f"{config.moe_latent_size}, initialised from {init}; routers N(0, {config.initializer_range}^2) "
        f"({config.router_score_func} scores); all draws with seed {seed}. `fc2_latent_proj` is zero, so before "
        "any training this model computes the source model's logits exactly; train it to use the experts."
        + (f" Layers kept dense: {dense}." if dense else "")
    )


__all__ = ["EXPERT_INITS", "describe_latent_moe_conversion", "latent_moe_config_from_llama", "llama_to_latent_moe"]
