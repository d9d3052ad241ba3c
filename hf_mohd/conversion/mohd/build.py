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
"""Dense LLaMA -> MoHD (docs/design.md section 6; layer definition in section 3).

MoHD keeps LLaMA's parameter names and shapes at the same width D (`model.layers.i.self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj`, the norms, embedding and head), so the conversion copies every source tensor as is and
adds, per sparsified sublayer, a router `sub_dims.router.weight` (N_r x D) and a group fusion `sub_dims.group_fusion`
(N x N). Section 3's invariant makes the copy exact: with every sub-dimension shared (N_s = N, k = 0), no scaling and
no fusion, MoHD computes LlamaForCausalLM's logits. The chosen sparsity is then a config change on the same weights:
the shared blocks are the first N_s * D / N hidden channels, and the new routers start untrained.

Fresh parameters (a documented choice, reproducible with `seed`):
- routers: N(0, initializer_range^2), the same law as `MoHDPreTrainedModel._init_weights`, drawn from a generator
  seeded with `seed`, layer by layer, attention router before FFN router;
- group fusion: the identity (section 3, step 5), so fusion changes nothing until it is trained.
- which hidden channels form the blocks (`channel_order`): the source order by default, or channels sorted by a
  data-free weight-mass score so that the always-active blocks hold the heaviest channels (the model is the same
  function at full activation under any channel permutation: `permute_hidden_channels`).
- a change of basis (`rotation="pca"`, `rotation.rotate_llama`): RMSNorm weights folded, the residual stream rotated
  by one global orthogonal Q (SliceGPT, arXiv 2401.15024, section 3) into the PCA basis of calibration hidden states,
  so the shared blocks hold the leading components; exact at full activation, LM head untied;
- routers fitted on calibration text (`routers="fitted"`, `routers.fit_routers`) instead of random.
Without retraining a sparsified model loses quality (the routers are random, and the inactive channels still carry
the dense model's signal); `experiments/smollm2/evaluate_perplexity.py` measures how much.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ...models.configuration_mohd import MOHD_PRESETS, SPARSITY_FIELDS, MoHDConfig
from ...models.modeling_mohd import MoHDForCausalLM, MoHDGroupFusion, MoHDRouter, MoHDSubDimensions
from ..source import ConversionError, DenseLlamaSource, load_dense_llama
from .rotation import ROTATIONS, rotate_llama
from .routers import ROUTER_INITS, fit_routers


logger = logging.getLogger(__name__)

# "full": every sub-dimension shared, alpha = 1, no fusion: the exact LLaMA-equivalent model (section 3 invariant).
CONVERSION_PRESETS = ("full", "compression_50", "compression_75")
# Parameters the source has no tensor for: routers and group fusion (initialised here), and the dropped-block
# compensation tables (zero until `compensation.fit_dropped_block_compensation` fits them).
FRESH_PARAMETER_SUFFIXES = ("sub_dims.router.weight", "sub_dims.group_fusion.weight", "sub_dims.output_compensation")
FRESH_PARAMETER_PARTS = (".sub_dims.input_compensation.",)
CHANNEL_ORDERS = ("original", "importance")
# Per sublayer: (its norm, the projections that read the normed width-D input, the projections that write width D).
SUBLAYERS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",)),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)),
)


def _full_sub_dims(hidden_size: int) -> int:
    """Block count of the "full" preset: 16 (the rebuttal's best) or the largest power of two dividing D."""
    return next(n for n in (16, 8, 4, 2, 1) if hidden_size % n == 0)


def mohd_config_from_llama(llama_config, preset: str | None = "full", **sparsity) -> MoHDConfig:
    """The MoHD config of a converted LLaMA model: source shapes, a sparsity preset, explicit overrides.

    Args:
        llama_config: the source `LlamaConfig`.
        preset: "full" (every block shared: exact), "compression_50" or "compression_75" (docs/design.md section 3
            presets, N = 16 with N_s = 6, k = 2 or N_s = 9, k = 3), or None (then `num_sub_dims`,
            `num_shared_sub_dims` and `num_routed_sub_dims_per_tok` must be given).
        sparsity: any of `SPARSITY_FIELDS`; a value of None is ignored; given values win over the preset.

    Raises:
        ConversionError: an expansion preset (it widens D, which a weight copy cannot do), an unknown preset or
            field, or values `MoHDConfig` rejects (its message names the field).
    """
    unknown = sorted(set(sparsity) - set(SPARSITY_FIELDS))
    if unknown:
        raise ConversionError(f"Unknown MoHD conversion field(s) {unknown}; allowed: {list(SPARSITY_FIELDS)}.")
    overrides = {name: value for name, value in sparsity.items() if value is not None}
    if preset is not None and preset.startswith("expansion"):
        raise ConversionError(
            f"preset {preset!r} widens hidden_size to {MOHD_PRESETS[preset][0] if preset in MOHD_PRESETS else '?'}x "
            "the source width; a converted model keeps the source width. Use one of "
            f"{list(CONVERSION_PRESETS)} or explicit sub-dimension fields."
        )
    if preset is not None and preset not in CONVERSION_PRESETS:
        raise ConversionError(f"`preset` must be one of {list(CONVERSION_PRESETS)} or None, got {preset!r}.")
    if preset == "full":
        split = sorted({"num_shared_sub_dims", "num_routed_sub_dims_per_tok"} & set(overrides))
        if split:
            raise ConversionError(
                f"preset 'full' has every block shared (the exact source model); it takes no {split}. For another "
                "split give preset None (`--preset none`) and the three sub-dimension counts."
            )
        num_sub_dims = overrides.get("num_sub_dims", _full_sub_dims(llama_config.hidden_size))
        fields = {
            "num_sub_dims": num_sub_dims,
            "num_shared_sub_dims": num_sub_dims,
            "num_routed_sub_dims_per_tok": 0,
            "activation_scaling": "none",
            "group_fusion": "none",
        }
        fields.update(overrides)
        base_preset = None
    else:
        fields = overrides
        base_preset = preset
    if base_preset is None:
        needed = [n for n in ("num_sub_dims", "num_shared_sub_dims", "num_routed_sub_dims_per_tok") if n not in fields]
        if needed:
            raise ConversionError(f"Without a preset, give {needed} explicitly.")
    try:
        # The preset's (N, N_s, k) are overridden by `fields` when given; its width multiplier is 1 here.
        return MoHDConfig.from_llama_config(llama_config, base_preset or "compression_50", **fields)
    except ValueError as err:
        raise ConversionError(
            f"MoHD settings do not fit the source (hidden_size={llama_config.hidden_size}): {err}"
        ) from err


def channel_importance(state_dict: dict[str, torch.Tensor], num_layers: int) -> torch.Tensor:
    """Data-free importance (D,) of each hidden channel i, a heuristic for which channels to make shared.

    score_i = sum over layers and sublayers of g_i^2 * sum_r ||W_r[:, i]||^2 + sum_w ||W_w[i, :]||^2, with g the
    sublayer's RMSNorm weight, r its input projections (q, k, v or gate, up) and w its output projection (o or down):
    the squared weight mass that reads channel i (for a unit-variance normalised input) plus the mass that writes it.
    """
    score = torch.zeros(state_dict["model.embed_tokens.weight"].shape[1], dtype=torch.float64)
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        for norm, readers, writers in SUBLAYERS:
            gain = state_dict[f"{prefix}{norm}.weight"].double().pow(2)
            for name in readers:
                score += gain * state_dict[f"{prefix}{name}.weight"].double().pow(2).sum(0)
            for name in writers:
                score += state_dict[f"{prefix}{name}.weight"].double().pow(2).sum(1)
    return score


@torch.no_grad()
def calibrated_channel_importance(
    source: DenseLlamaSource, input_ids: torch.Tensor, batch_size: int = 4
) -> torch.Tensor:
    """Importance (D,) of each hidden channel measured on calibration tokens, the data-driven form of
    `channel_importance`: score_i = sum over sublayers of E[x_i^2] * sum_r ||W_r[:, i]||^2 + E[y_i^2], with x the
    sublayer's normalised input and y its output (o_proj / down_proj), expectations over the (B, T) `input_ids`.
    Give `torch.sort(score, descending=True).indices` to `llama_to_mohd(..., channel_order=...)`.
    """
    model = source.build_llama()
    state = source.state_dict
    second_moments: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args, output):
            moment = output.detach().double().pow(2).flatten(0, -2).sum(0)
            second_moments[name] = second_moments.get(name, 0) + moment

        return hook

    handles = []
    for idx, layer in enumerate(model.model.layers):
        for norm, _, writers in SUBLAYERS:
            handles.append(getattr(layer, norm).register_forward_hook(record(f"{idx}.{norm}")))
            for name in writers:
                handles.append(layer.get_submodule(name).register_forward_hook(record(f"{idx}.{name}")))
    for start in range(0, input_ids.shape[0], batch_size):
        model(input_ids=input_ids[start : start + batch_size], use_cache=False)
    for handle in handles:
        handle.remove()
    tokens = input_ids.numel()
    score = torch.zeros(source.config.hidden_size, dtype=torch.float64)
    for idx in range(source.config.num_hidden_layers):
        prefix = f"model.layers.{idx}."
        for norm, readers, writers in SUBLAYERS:
            reads = sum(state[f"{prefix}{name}.weight"].double().pow(2).sum(0) for name in readers)
            score += second_moments[f"{idx}.{norm}"] / tokens * reads
            for name in writers:
                score += second_moments[f"{idx}.{name}"] / tokens
    return score


def permute_hidden_channels(state_dict: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same LLaMA with its hidden channels reordered: new channel j is old channel `order[j]`.

    Exact up to float summation order: RMSNorm's mean of squares does not depend on the channel order, and every
    matrix that reads (embedding / LM head columns, q, k, v, gate, up columns) or writes (o, down rows and biases) the
    hidden width, and every norm weight, is permuted alike. A tied LM head stays the embedding tensor.
    """
    permuted = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and tensor is state_dict.get("model.embed_tokens.weight"):
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight") or any(
            name.endswith(f"{r}.weight") for _, readers, _ in SUBLAYERS for r in readers
        ):
            permuted[name] = tensor[:, order].contiguous()
        elif name.endswith("norm.weight") or any(
            name.endswith(f"{w}.bias") for _, _, writers in SUBLAYERS for w in writers
        ):
            permuted[name] = tensor[order].contiguous()
        elif any(name.endswith(f"{w}.weight") for _, _, writers in SUBLAYERS for w in writers):
            permuted[name] = tensor[order, :].contiguous()
        else:
            permuted[name] = tensor
    if "lm_head.weight" not in permuted:
        permuted["lm_head.weight"] = permuted["model.embed_tokens.weight"]
    return permuted


def _channel_order(source: DenseLlamaSource, channel_order) -> torch.Tensor | None:
    if isinstance(channel_order, str):
        if channel_order not in CHANNEL_ORDERS:
            raise ConversionError(f"`channel_order` must be one of {list(CHANNEL_ORDERS)} or a permutation.")
        if channel_order == "original":
            return None
        score = channel_importance(source.state_dict, source.config.num_hidden_layers)
        return torch.sort(score, descending=True, stable=True).indices
    order = torch.as_tensor(channel_order, dtype=torch.long)
    if not torch.equal(torch.sort(order).values, torch.arange(source.config.hidden_size)):
        raise ConversionError(f"`channel_order` must be a permutation of range({source.config.hidden_size}).")
    return order


def _init_fresh_parameters(model: MoHDForCausalLM, seed: int) -> None:
    """Routers ~ N(0, initializer_range^2) from a generator seeded with `seed`; group fusion = identity; dropped-block
    compensation tables 0 (the function without compensation until they are fitted)."""
    generator = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MoHDRouter):
                fresh = torch.randn(module.weight.shape, generator=generator, dtype=torch.float32) * std
                module.weight.copy_(fresh.to(module.weight.dtype))
            elif isinstance(module, MoHDGroupFusion):
                module.weight.copy_(torch.eye(module.weight.shape[0], dtype=module.weight.dtype))
            elif isinstance(module, MoHDSubDimensions) and module.output_compensation is not None:
                module.output_compensation.zero_()
                for table in module.input_compensation.values():
                    table.zero_()


def check_mohd_options(rotation, routers, channel_order, calibration, calibration_field: str) -> None:
    """Refuse conversion options that do not go together, before any weight is read (one check per rule, shared by
    `llama_to_mohd` and `convert_mohd`; docs/design.md sections 6 and 9).

    Args:
        rotation: None or one of `ROTATIONS`.
        routers: one of `ROUTER_INITS`.
        channel_order: "original" (the only order a rotation allows: the PCA basis orders the blocks), another of
            `CHANNEL_ORDERS`, or a permutation.
        calibration: the calibration input (token ids or a text file), or None.
        calibration_field: how the message names that input, e.g. "`calibration_ids` ((B, T) token ids)".

    Raises:
        ConversionError: an unknown `rotation` or `routers`; a rotation with a `channel_order` other than
            "original"; a rotation or fitted routers without calibration.
    """
    if rotation is not None and rotation not in ROTATIONS:
        raise ConversionError(f"`rotation` must be one of {list(ROTATIONS)} or None, got {rotation!r}.")
    if routers not in ROUTER_INITS:
        raise ConversionError(f"`routers` must be one of {list(ROUTER_INITS)}, got {routers!r}.")
    if rotation is not None and not (isinstance(channel_order, str) and channel_order == "original"):
        shown = channel_order if isinstance(channel_order, str) else "a permutation"
        raise ConversionError(
            f"`channel_order` must be 'original' with rotation={rotation!r} (the PCA basis orders the blocks), "
            f"got {shown!r}."
        )
    if (rotation is not None or routers == "fitted") and calibration is None:
        raise ConversionError(
            f"rotation={rotation!r} / routers={routers!r} need calibration text: give {calibration_field}."
        )


def llama_to_mohd(
    source: str | DenseLlamaSource,
    preset: str | None = "full",
    *,
    seed: int = 0,
    channel_order: str | Sequence[int] = "original",
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
    rotation: str | None = None,
    routers: str = "random",
    calibration_ids: torch.Tensor | None = None,
    ridge: float = 1e-3,
    **sparsity,
) -> MoHDForCausalLM:
    """Convert a dense LLaMA checkpoint into a MoHD model (eval mode) of the same width.

    Every source tensor is copied under its own name; routers and group fusion are fresh (module docstring).
    With `preset="full"` the result reproduces the source logits (section 3 invariant; tested on SmolLM2-135M).

    Args:
        source: a `DenseLlamaSource` or anything `load_dense_llama` accepts (folder, .gguf file).
        preset: see `mohd_config_from_llama`.
        seed: seed of the fresh router weights.
        channel_order: which hidden channels form the sub-dimension blocks (blocks are consecutive channels, the
            first N_s blocks shared). "original" keeps the source order (bitwise the same function at full
            activation); "importance" sorts channels by `channel_importance`, descending, so that the shared blocks
            hold the channels with the most weight mass; or an explicit permutation of range(D) (e.g. from
            calibration data). Any order computes the same function at full activation (`permute_hidden_channels`).
        dtype: dtype of the converted model; None keeps the source's.
        gguf_file: GGUF file name inside the folder `source`.
        rotation: None (the source basis) or "pca": fold the RMSNorm weights and rotate the residual stream into the
            PCA basis of `calibration_ids`' hidden states with one global orthogonal Q (`rotation.rotate_llama`;
            SliceGPT, arXiv 2401.15024, section 3), leading components in the shared blocks. Exact at full
            activation; the LM head is then untied from the embedding (it carries the final norm's weight).
        routers: "random" (N(0, initializer_range^2), seeded) or "fitted": ridge regression of the routed blocks'
            centred log energies on `calibration_ids` (`routers.fit_routers`).
        calibration_ids: (B, T) calibration token ids, needed by `rotation` and `routers="fitted"`; keep them
            disjoint from evaluation text.
        ridge: relative ridge strength of the router fit.
        sparsity: explicit MoHD fields (`SPARSITY_FIELDS`), winning over the preset.

    Returns:
        `MoHDForCausalLM` whose `generation_config` is the source's.

    Raises:
        ConversionError: the source cannot be loaded (see `load_dense_llama`), the settings do not fit it, an
            unknown `rotation` / `routers`, a rotation with a `channel_order` other than "original", or missing or
            too short calibration text.
    """
    check_mohd_options(rotation, routers, channel_order, calibration_ids, "`calibration_ids` ((B, T) token ids)")
    source = load_dense_llama(source, gguf_file=gguf_file, dtype=dtype)
    if rotation == "pca":
        source, _ = rotate_llama(source, calibration_ids)
    return build_mohd(
        source, preset, seed=seed, channel_order=channel_order, routers=routers, calibration_ids=calibration_ids,
        ridge=ridge, **sparsity,
    )  # fmt: skip


def build_mohd(
    source: DenseLlamaSource,
    preset: str | None,
    *,
    seed: int,
    channel_order: str | Sequence[int],
    routers: str,
    calibration_ids: torch.Tensor | None,
    ridge: float = 1e-3,
    **sparsity,
) -> MoHDForCausalLM:
    """The MoHD model of a loaded (and, for a rotation, already rotated) source: `llama_to_mohd` after its option
    check (`check_mohd_options`), which `convert_mohd` runs once per conversion before reading any weight.

    Args:
        source, preset, seed, channel_order, routers, calibration_ids, ridge, sparsity: as in `llama_to_mohd`.

    Returns:
        `MoHDForCausalLM` (eval mode) whose `generation_config` is the source's.

    Raises:
        ConversionError: the settings do not fit the source, a bad `channel_order` permutation, or too short
            calibration text for fitted routers.
    """
    config = mohd_config_from_llama(source.config, preset, **sparsity)
    logger.info(
        "MoHD: %d of %d sub-dimensions of width %d active per token (%d shared, %d routed of %d), sparse modules %s",
        config.num_active_sub_dims,
        config.num_sub_dims,
        config.sub_dim_size,
        config.num_shared_sub_dims,
        config.num_routed_sub_dims_per_tok,
        config.num_routed_sub_dims,
        config.sparse_modules,
    )
    order = _channel_order(source, channel_order)
    state_dict = source.state_dict if order is None else permute_hidden_channels(source.state_dict, order)
    model = MoHDForCausalLM(config).to(source.dtype)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    not_fresh = [
        name
        for name in missing
        if not name.endswith(FRESH_PARAMETER_SUFFIXES) and not any(part in name for part in FRESH_PARAMETER_PARTS)
    ]
    if unexpected or not_fresh:
        raise ConversionError(
            f"Source tensors do not match MoHD's LLaMA names: unexpected {unexpected[:5]}, missing {not_fresh[:5]}."
        )
    _init_fresh_parameters(model, seed)
    if routers == "fitted":
        fit_routers(model, source, calibration_ids, ridge=ridge)
    model.generation_config = source.generation_config
    logger.info("Copied %d tensors, initialised %d router/fusion tensors", len(source.state_dict), len(missing))
    return model.eval()


def describe_mohd_conversion(
    config: MoHDConfig,
    seed: int,
    channel_order: str = "original",
    *,
    rotation: str | None = None,
    routers: str = "random",
    calibration: str | None = None,
    untied_parameters: int = 0,
) -> str:
    """Markdown for the model card: what the conversion kept, what it added, and the sparsity it set.

    Args:
        config, seed, channel_order: as given to `llama_to_mohd`.
        rotation, routers: as given to `llama_to_mohd` ("pca" / None; "random" / "fitted").
        calibration: what the calibration text was (file, tokens), quoted when `rotation` or fitted routers used it.
        untied_parameters: LM-head elements added by untying it from the embedding (`rotate_llama`'s info).
    """
    if rotation == "pca":
        kept = (
            "Every RMSNorm weight was folded into the linears that read it (the norm weights are 1) and the residual "
            "stream was rotated by one global orthogonal matrix Q, the PCA basis of the calibration hidden states "
            "sorted by decreasing variance (SliceGPT, arXiv 2401.15024, section 3; the single-Q variant, exact, no "
            "extra matrices): embedding E Q, readers W Q, writers Q^T W. The first (shared) blocks hold the leading "
            "principal components. At full activation this is the source model up to float rounding."
        )
        if untied_parameters:
            kept += (
                f" The LM head carries the final norm's weight, so it is untied from the embedding: "
                f"{untied_parameters:,} more parameters ({config.vocab_size} x {config.hidden_size})."
            )
    elif channel_order == "original":
        kept = "All source tensors were copied unchanged under their own names (embedding, attention, FFN, norms, LM head)."
    else:
        kept = (
            "All source tensors were copied under their own names, with the hidden channels reordered "
            f"(channel_order '{channel_order}': the same function at full activation; the first blocks, which are "
            "shared, hold the channels ranked first)."
        )
    if calibration and (rotation or routers == "fitted"):
        kept += f" Calibration text: {calibration}."
    if config.num_routed_sub_dims == 0:
        return (
            f"{kept} Every one of the {config.num_sub_dims} sub-dimensions is shared (no routers, activation scaling "
            "'none', no group fusion): this model computes the source model's logits (MoHD with every block shared "
            "is a LLaMA model)."
        )
    active = config.num_active_sub_dims
    if routers == "fitted":
        router_text = (
            "weights fitted on the calibration text (ridge regression, in float64, of each routed block's centred log "
            "energy of the normed input onto that input, per sublayer: softmax(W_r x) predicts the blocks' energy "
            "shares)"
        )
        advice = "The routers are fitted but the model was not retrained: heal it (distillation) before use."
    else:
        router_text = f"weights drawn from N(0, {config.initializer_range}^2) with seed {seed}"
        advice = "The routers are untrained: fine-tune before use."
    return (
        f"{kept} New: one router per sparsified sublayer ({', '.join(config.sparse_modules)}), {router_text}, and "
        f"group fusion '{config.group_fusion}' (identity-initialised). Each token now activates "
        f"{active} of {config.num_sub_dims} sub-dimensions of width {config.sub_dim_size} "
        f"({100 * active / config.num_sub_dims:.1f}% of the hidden width): the first {config.num_shared_sub_dims} "
        f"blocks always, plus its top-{config.num_routed_sub_dims_per_tok} of the other "
        f"{config.num_routed_sub_dims}; activation scaling '{config.activation_scaling}', routed gate "
        f"'{config.routed_gate}'. {advice} (The perplexity below, when given, was measured without retraining.)"
    )


__all__ = [
    "CHANNEL_ORDERS",
    "CONVERSION_PRESETS",
    "calibrated_channel_importance",
    "channel_importance",
    "build_mohd",
    "check_mohd_options",
    "describe_mohd_conversion",
    "llama_to_mohd",
    "mohd_config_from_llama",
    "permute_hidden_channels",
]
