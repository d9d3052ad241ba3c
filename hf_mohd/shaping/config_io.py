"""Loading configs (objects, `config.json` dicts or paths) and presenting their accounting.

The formulas live in `hf_mohd.models.accounting` (pure Python, shipped as remote code with the models of both
families); this module only loads configs, prints the accounting as a table and summarises the alpha-transform.
Source: arXiv 2610.14644 appendix B.2, docs/design.md sections 3 and 4.
"""

import json
import os
from collections.abc import Mapping

from ..models.accounting import ModelAccounting, model_accounting


def load_config(config_or_path):
    """A config-like object from a `PreTrainedConfig`, a dict, a `config.json` path or a folder holding one.

    Paths are read as plain JSON (no `AutoConfig`, so no model code or download is needed); anything else is
    returned unchanged.

    Raises:
        ValueError: a path that does not exist or whose JSON is not an object.
    """
    if isinstance(config_or_path, (str, os.PathLike)):
        path = os.fspath(config_or_path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"config: expected a config.json file or a folder holding one, got {config_or_path!r}.")
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if not isinstance(data, Mapping):
            raise ValueError(f"config: {path} must hold a JSON object, got {type(data).__name__}.")
        return data
    return config_or_path


def config_to_dict(config) -> dict:
    """Plain dict of a config-like object, with `per_layer_config` as {int layer index: overrides} (may be empty).

    A heterogeneous `PreTrainedConfig` is read with `to_dict()` (which carries the sparse overrides); a dict is
    copied.
    """
    if isinstance(config, Mapping):
        data = dict(config)
    elif hasattr(config, "to_dict"):
        data = config.to_dict()
    else:
        data = dict(vars(config))
    per_layer = data.get("per_layer_config") or {}
    if not isinstance(per_layer, Mapping):
        raise ValueError(f"`per_layer_config` must map layer indices to field overrides, got {type(per_layer)}.")
    data["per_layer_config"] = {int(key): dict(value) for key, value in per_layer.items()}
    return data


def format_accounting(accounting: ModelAccounting) -> str:
    """A fixed-width text table of a `ModelAccounting` of either family: one row per layer (its mixer type where the
    family has one), then the totals (parameters, FLOPs per token, all-to-all scalars per token)."""
    header = f"{'layer':>5} {'mixer':>5} {'total params':>14} {'activated':>12} {'FLOPs/token':>14} {'all-to-all':>10}"
    lines = [header, "-" * len(header)]
    for layer in accounting.layers:
        lines.append(
            f"{layer.layer_idx:>5} {getattr(layer, 'mixer_type', '-'):>5} {layer.total_params:>14,} "
            f"{layer.activated_params:>12,} {layer.activated_flops:>14,} {layer.all_to_all_scalars:>10,}"
        )
    lines += [
        "-" * len(header),
        f"total parameters           {accounting.total_params:,}",
        f"activated parameters       {accounting.activated_params:,} (decoder {accounting.activated_decoder_params:,}"
        " + LM head)",
        f"embedding / LM head        {accounting.embedding_params:,} / {accounting.lm_head_params:,}",
        f"router / group fusion      {accounting.router_params:,} / {accounting.fusion_params:,}",
        f"FLOPs per token            {accounting.flops_per_token:,} (decoder {accounting.decoder_flops_per_token:,}"
        f" + LM head, {accounting.context_length} keys per query)",
        f"all-to-all per token       {accounting.all_to_all_scalars:,} scalars (dispatch + return, all layers)",
    ]
    return "\n".join(lines)


def alpha_transform_summary(before, after) -> dict[str, tuple[int, int]]:
    """What the alpha-transform kept and changed: {quantity: (before, after)} for the routed-expert parameters and the
    all-to-all scalars per token (summed over layers; kept by the transform, arXiv 2610.14644 section 2), the total
    parameters and the forward FLOPs per token. `before`, `after`: LatentMoE configs (objects, dicts or paths)."""
    old, new = model_accounting(load_config(before)), model_accounting(load_config(after))
    summary = {
        name: (sum(getattr(layer, name) for layer in old.layers), sum(getattr(layer, name) for layer in new.layers))
        for name in ("routed_expert_params", "all_to_all_scalars")
    }
    summary["total_params"] = (old.total_params, new.total_params)
    summary["flops_per_token"] = (old.flops_per_token, new.flops_per_token)
    return summary
