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
"""LatentMoE <-> Nemotron-H (transformers' `NemotronHForCausalLM`), docs/design.md section 4 "Interop".

Nemotron-H stacks single-mixer blocks (`norm` then one of `full_attention`, `linear_attention` (Mamba-2), `moe`,
`mlp`, each with its own residual). A LatentMoE decoder layer is pre-norm attention plus a pre-norm FFN mixer, so
layer i is exactly the two blocks 2i (`full_attention`, norm = `input_layernorm`) and 2i + 1 (`moe` or `mlp`, norm =
`post_attention_layernorm`). The other Nemotron-H choices must hold on our side: no positional embedding, non-gated
MLPs (relu2 in Nemotron 3), sigmoid routing with `e_score_correction_bias`, one shared expert, bias-free attention,
and one expert shape for all MoE layers (Nemotron-H has no per-layer shapes).

Weight names (ours -> Nemotron-H, as `NemotronHForCausalLM` holds them in memory; `save_pretrained` writes its own
original checkpoint layout and `from_pretrained` reads it back):
    model.embed_tokens                      -> model.embeddings
    model.norm                              -> model.norm_f
    model.layers.i.input_layernorm          -> model.layers.{2i}.norm
    model.layers.i.self_attn.*              -> model.layers.{2i}.mixer.*
    model.layers.i.post_attention_layernorm -> model.layers.{2i+1}.norm
    model.layers.i.mlp.*                    -> model.layers.{2i+1}.mixer.*   (gate, experts, shared_experts,
                                                                              fc1/fc2_latent_proj, or up/down_proj)
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from ..atomic_folder import write_folder_atomically
from ..models.configuration_latent_moe import LatentMoEConfig
from ..models.configuration_layers import MOE_SHAPE_FIELDS
from ..models.modeling_latent_moe import LatentMoEForCausalLM


logger = logging.getLogger(__name__)

# Files of a model folder that travel with the weights (tokenizer and generation settings).
_SIDE_FILES = re.compile(r"^(tokenizer.*|special_tokens_map\.json|vocab\..*|merges\.txt|generation_config\.json)$")
_OUR_LAYER = re.compile(r"^model\.layers\.(\d+)\.(input_layernorm|self_attn|post_attention_layernorm|mlp)\.(.+)$")
_THEIR_LAYER = re.compile(r"^model\.layers\.(\d+)\.(norm|mixer)\.(.+)$")
_GLOBAL_NAMES = {"model.embed_tokens.weight": "model.embeddings.weight", "model.norm.weight": "model.norm_f.weight"}
# Fields copied unchanged between the two configs.
_SAME_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "attention_dropout",
    "intermediate_size",
    "mlp_bias",
    "moe_intermediate_size",
    "moe_latent_size",
    "moe_shared_expert_intermediate_size",
    "num_experts_per_tok",
    "norm_topk_prob",
    "routed_scaling_factor",
    "initializer_range",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)


class NemotronHInteropError(ValueError):
    """A model or checkpoint that has no exact counterpart on the other side (the message says which field)."""


# --- LatentMoE -> Nemotron-H --------------------------------------------------------------------------------------


def nemotron_h_unmet(config: LatentMoEConfig) -> list[str]:
    """Every requirement of the Nemotron-H form that `config` does not meet, one message each naming the field, the
    value expected and why (an empty list: exportable). The rules are Nemotron-H's modeling (transformers'
    `modeling_nemotron_h.py`): no positional embedding, non-gated MLPs and experts, sigmoid routing with weighted
    gates, no attention bias, one MoE shape and one dense width for all layers, a shared expert."""
    requirements = (
        ("position_embedding_type", "none", "Nemotron-H attention has no positional embedding"),
        ("mlp_gated", False, "Nemotron-H MLPs and experts are non-gated (act(up), relu2 in Nemotron 3)"),
        ("router_score_func", "sigmoid", "Nemotron-H routes with sigmoid scores plus e_score_correction_bias"),
        ("router_gate", "weighted", "Nemotron-H weights each selected expert by its router score"),
        ("attention_bias", False, "Nemotron-H attention projections have no bias"),
    )
    unmet = [
        f"`{field}` must be {value!r} ({reason}); got {getattr(config, field)!r}"
        for field, value, reason in requirements
        if getattr(config, field) != value
    ]
    layers = list(config.per_layer_config)  # layer views answer per-layer fields without ambiguity errors
    moe_layers = [i for i, layer in enumerate(layers) if layer.mixer_type == "moe"]
    mlp_layers = [i for i, layer in enumerate(layers) if layer.mixer_type == "mlp"]
    # Nemotron-H has one global MoE shape and one dense width: they must be uniform across our MoE (dense) layers.
    for field, indices in [(f, moe_layers) for f in MOE_SHAPE_FIELDS] + [("intermediate_size", mlp_layers)]:
        values = {i: getattr(layers[i], field) for i in indices}
        if len(set(values.values())) > 1:
            kind = "mlp" if field == "intermediate_size" else "moe"
            unmet.append(
                f"`{field}` differs between layers ({values}); Nemotron-H has one value for all its {kind} blocks"
            )
    if moe_layers and not layers[moe_layers[0]].moe_shared_expert_intermediate_size:
        unmet.append(
            "`moe_shared_expert_intermediate_size` must be > 0 (Nemotron-H MoE blocks always have a shared expert); got 0"
        )
    return unmet


def nemotron_h_config_from_latent_moe(config: LatentMoEConfig) -> NemotronHConfig:
    """The `NemotronHConfig` whose model computes the same function as a LatentMoE model of `config`.

    Raises:
        NemotronHInteropError: a choice Nemotron-H cannot express (RoPE, gated MLPs, softmax routing, unit gates,
            attention biases, no shared expert, or MoE shapes that differ between layers); one message listing every
            unmet requirement (`nemotron_h_unmet`), each naming its field.
    """
    unmet = nemotron_h_unmet(config)
    if unmet:
        raise NemotronHInteropError(f"Not exportable to Nemotron-H ({len(unmet)} unmet): " + "; ".join(unmet))
    layers = list(config.per_layer_config)  # layer views answer per-layer fields without ambiguity errors
    moe_layers = [i for i, layer in enumerate(layers) if layer.mixer_type == "moe"]
    mlp_layers = [i for i, layer in enumerate(layers) if layer.mixer_type == "mlp"]
    moe_reference = layers[moe_layers[0]] if moe_layers else layers[0]
    mlp_reference = layers[mlp_layers[0]] if mlp_layers else layers[0]
    fields = {}
    for name in _SAME_FIELDS:
        source = moe_reference if name in MOE_SHAPE_FIELDS else mlp_reference
        fields[name] = getattr(source, name)
    block_types = []
    for layer in layers:
        block_types += ["full_attention", layer.mixer_type]
    return NemotronHConfig(
        **fields,
        layers_block_type=block_types,
        n_routed_experts=moe_reference.num_experts,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        mlp_hidden_act=config.hidden_act,
        layer_norm_epsilon=config.rms_norm_eps,
        tie_word_embeddings=False,
        use_cache=config.use_cache,
        num_nextn_predict_layers=0,
        residual_in_fp32=False,
        hidden_dropout=0.0,
    )


def latent_moe_to_nemotron_h_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Renames a `LatentMoEForCausalLM` state dict to `NemotronHForCausalLM`'s (see the module docstring)."""
    out = {}
    for name, tensor in state_dict.items():
        match = _OUR_LAYER.match(name)
        if name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = tensor
        elif name == "lm_head.weight":
            out[name] = tensor
        elif match is None:
            raise NemotronHInteropError(f"No Nemotron-H counterpart for weight `{name}`.")
        else:
            layer, part, rest = int(match.group(1)), match.group(2), match.group(3)
            block = 2 * layer + (part in ("post_attention_layernorm", "mlp"))
            kind = "norm" if part.endswith("layernorm") else "mixer"
            out[f"model.layers.{block}.{kind}.{rest}"] = tensor
    return out


def to_nemotron_h(model: LatentMoEForCausalLM) -> NemotronHForCausalLM:
    """A `NemotronHForCausalLM` holding `model`'s weights (copies; same dtype), equal logits on the same inputs.

    Raises:
        NemotronHInteropError: see `nemotron_h_config_from_latent_moe`.
    """
    nemotron_config = nemotron_h_config_from_latent_moe(model.config)
    state_dict = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    state_dict.setdefault("lm_head.weight", model.get_output_embeddings().weight.detach().clone())
    with torch.device("meta"):
        nemotron = NemotronHForCausalLM(nemotron_config)
    nemotron.load_state_dict(latent_moe_to_nemotron_h_state_dict(state_dict), strict=True, assign=True)
    nemotron.config.dtype = model.dtype
    return nemotron.eval()


def export_to_nemotron_h(model_or_folder, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Writes a folder that transformers' own `NemotronHForCausalLM.from_pretrained` (and vLLM / SGLang) loads.

    Args:
        model_or_folder: a `LatentMoEForCausalLM`, or a folder saved from one (its tokenizer and generation
            config files are copied along).
        out_dir: destination folder.
        overwrite: replace `out_dir` if it exists.

    Returns:
        The destination path.

    Raises:
        NemotronHInteropError (a ValueError): the model has no exact Nemotron-H counterpart (see
            `nemotron_h_config_from_latent_moe`).
        FileExistsError: `out_dir` exists and `overwrite` is false.
    """
    out = _prepare_destination(out_dir, overwrite)
    source = None
    model = model_or_folder
    if not isinstance(model_or_folder, LatentMoEForCausalLM):
        source = Path(model_or_folder)
        model = LatentMoEForCausalLM.from_pretrained(source)
    with write_folder_atomically(out) as staging:
        to_nemotron_h(model).save_pretrained(staging)
        if source is not None:
            _copy_side_files(source, staging)
    logger.info("Exported %s to Nemotron-H at %s", type(model).__name__, out)
    return out


# --- Nemotron-H -> LatentMoE --------------------------------------------------------------------------------------


def latent_moe_config_from_nemotron_h(config: NemotronHConfig) -> LatentMoEConfig:
    """The `LatentMoEConfig` of a Nemotron-H checkpoint whose blocks alternate `full_attention`, (`moe` | `mlp`).

    Raises:
        NemotronHInteropError: another block pattern (e.g. Mamba `linear_attention` blocks, or two attention blocks
            in a row), group-limited routing (n_group > 1 with topk_group < n_group), or sliding-window attention.
    """
    blocks = list(config.layers_block_type)
    if len(blocks) % 2:
        raise NemotronHInteropError(
            f"`layers_block_type` has {len(blocks)} blocks; LatentMoE needs pairs (full_attention, moe | mlp): {blocks}."
        )
    for index, block in enumerate(blocks):
        expected = ("full_attention",) if index % 2 == 0 else ("moe", "mlp")
        if block not in expected:
            hint = " (Mamba-2 blocks have no LatentMoE counterpart)" if block == "linear_attention" else ""
            raise NemotronHInteropError(
                f"`layers_block_type[{index}]` is {block!r}{hint}; LatentMoE imports only checkpoints whose blocks "
                f"alternate full_attention and moe | mlp, got {blocks}."
            )
    if config.n_group > 1 and config.topk_group < config.n_group:
        raise NemotronHInteropError(
            f"`n_group`={config.n_group} with `topk_group`={config.topk_group}: group-limited routing has no "
            "LatentMoE counterpart."
        )
    if getattr(config, "sliding_window", None) is not None:
        raise NemotronHInteropError(f"`sliding_window`={config.sliding_window}: LatentMoE attention is full.")
    if config.num_nextn_predict_layers:
        logger.warning(
            "Dropping the %d multi-token-prediction layers of the checkpoint.", config.num_nextn_predict_layers
        )
    mixers = blocks[1::2]
    default_mixer = "moe" if "moe" in mixers else "mlp"
    per_layer = {i: {"mixer_type": mixer} for i, mixer in enumerate(mixers) if mixer != default_mixer}
    return LatentMoEConfig(
        **{name: getattr(config, name) for name in _SAME_FIELDS},
        num_hidden_layers=len(mixers),
        num_experts=config.n_routed_experts,
        hidden_act=config.mlp_hidden_act,
        mlp_gated=False,
        router_score_func="sigmoid",
        position_embedding_type="none",
        rms_norm_eps=config.layer_norm_epsilon,
        attention_bias=False,
        tie_word_embeddings=False,
        mixer_type=default_mixer,
        per_layer_config=per_layer or None,
    )


def nemotron_h_to_latent_moe_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Renames a `NemotronHForCausalLM` state dict (alternating form) to `LatentMoEForCausalLM`'s."""
    reverse_globals = {theirs: ours for ours, theirs in _GLOBAL_NAMES.items()}
    out = {}
    for name, tensor in state_dict.items():
        match = _THEIR_LAYER.match(name)
        if name in reverse_globals:
            out[reverse_globals[name]] = tensor
        elif name == "lm_head.weight":
            out[name] = tensor
        elif match is None:
            raise NemotronHInteropError(f"No LatentMoE counterpart for Nemotron-H weight `{name}`.")
        else:
            block, kind, rest = int(match.group(1)), match.group(2), match.group(3)
            layer, second = divmod(block, 2)
            if kind == "norm":
                out[f"model.layers.{layer}.{'post_attention_layernorm' if second else 'input_layernorm'}.{rest}"] = (
                    tensor
                )
            else:
                out[f"model.layers.{layer}.{'mlp' if second else 'self_attn'}.{rest}"] = tensor
    return out


def from_nemotron_h(nemotron: NemotronHForCausalLM) -> LatentMoEForCausalLM:
    """A `LatentMoEForCausalLM` holding a Nemotron-H model's weights (copies; same dtype), equal logits.

    Raises:
        NemotronHInteropError: see `latent_moe_config_from_nemotron_h`.
    """
    config = latent_moe_config_from_nemotron_h(nemotron.config)
    state_dict = nemotron_h_to_latent_moe_state_dict(
        {name: tensor.detach().clone() for name, tensor in nemotron.state_dict().items()}
    )
    with torch.device("meta"):
        model = LatentMoEForCausalLM(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    # Non-persistent buffers (rotary frequencies) are not in the state dict; there are none without RoPE.
    model.config.dtype = nemotron.dtype
    return model.eval()


def import_from_nemotron_h(folder: str | Path, out_dir: str | Path | None = None, overwrite: bool = False, **kwargs):
    """Loads a Nemotron-H checkpoint folder of the alternating attention / (MoE or MLP) form as LatentMoE.

    Args:
        folder: a folder `NemotronHForCausalLM.from_pretrained` reads (no Hub download is attempted offline).
        out_dir: when given, the LatentMoE model is also saved there (with `auto_map` and code files, plus the
            source's tokenizer and generation config files).
        overwrite: replace `out_dir` if it exists.
        kwargs: passed to `NemotronHForCausalLM.from_pretrained` (e.g. `dtype`).

    Returns:
        The `LatentMoEForCausalLM` (eval mode).

    Raises:
        NemotronHInteropError (a ValueError): the checkpoint has another block pattern (e.g. Mamba blocks) or
            group-limited routing (see `latent_moe_config_from_nemotron_h`); checked on the config before any
            weight is read.
        FileExistsError: `out_dir` exists and `overwrite` is false.
    """
    folder = Path(folder)
    try:  # fail fast, before the weights
        latent_moe_config_from_nemotron_h(NemotronHConfig.from_pretrained(folder))
    except NemotronHInteropError as err:
        raise NemotronHInteropError(f"{folder / 'config.json'}: {err}") from None
    out = _prepare_destination(out_dir, overwrite) if out_dir is not None else None
    model = from_nemotron_h(NemotronHForCausalLM.from_pretrained(folder, **kwargs))
    if out is not None:
        with write_folder_atomically(out) as staging:
            model.save_pretrained(staging)
            _copy_side_files(folder, staging)
    return model


# --- files --------------------------------------------------------------------------------------------------------


def _prepare_destination(out_dir: str | Path, overwrite: bool) -> Path:
    """`out_dir`, checked before any work: an existing non-empty folder needs `overwrite` (it is replaced only once
    the new folder is complete, see `write_folder_atomically`)."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True (--overwrite) to replace it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _copy_side_files(source: Path, out: Path) -> None:
    if not source.is_dir():
        return
    for path in source.iterdir():
        if path.is_file() and _SIDE_FILES.match(path.name) and not (out / path.name).exists():
            shutil.copy2(path, out / path.name)


__all__ = [
    "NemotronHInteropError",
    "export_to_nemotron_h",
    "from_nemotron_h",
    "import_from_nemotron_h",
    "latent_moe_config_from_nemotron_h",
    "nemotron_h_config_from_latent_moe",
    "to_nemotron_h",
]
