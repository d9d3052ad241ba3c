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
"""Dense LLaMA checkpoint -> MoHD model folder in one call: `convert_mohd`, what `hf-mohd convert mohd` and
`conversion/convert_llama_to_mohd.py` run.

It checks its options and the destination before reading any weight (`check_mohd_options`, once), loads the source,
optionally rotates it (`rotation.rotate_llama`), builds the model (`build.build_mohd`), fits routers and routed
budgets on the calibration text, optionally checks the exact model against the source's logits (`verify_logits`),
and writes the folder atomically (`save_converted`): weights, config and code, tokenizer, generation config, model
card.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from ..calibration import calibration_ids as read_calibration
from ..output import ConversionResult, load_checked, save_converted
from ..source import ConversionError, DenseLlamaSource, load_dense_llama
from ..verify import verify_logits
from .budgets import BUDGET_ERRORS, ROUTED_BUDGETS, allocate_routed_sub_dims, apply_routed_budgets
from .build import build_mohd, check_mohd_options, describe_mohd_conversion
from .compensation import fit_dropped_block_compensation
from .rotation import rotate_llama


logger = logging.getLogger(__name__)


def allocation_progress_file(output_dir: str | Path) -> Path:
    """Where `convert_mohd(routed_budgets="greedy_output")` keeps the output measurement's running sums
    (`budgets.sublayer_output_errors`): the hidden file `.NAME.allocation_progress.json` beside `output_dir`."""
    output_dir = Path(output_dir)
    return output_dir.parent / f".{output_dir.name}.allocation_progress.json"


def convert_mohd(
    source: str | Path | DenseLlamaSource,
    output_dir: str | Path,
    preset: str | None = "full",
    *,
    seed: int = 0,
    channel_order: str = "original",
    rotation: str | None = None,
    routers: str = "random",
    calibration_text: str | Path | None = None,
    calibration_tokens: int = 16384,
    calibration_window: int = 256,
    routed_budgets: str = "uniform",
    verify: bool = False,
    atol: float = 1e-4,
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
    base_model: str | None = None,
    perplexity_json: Sequence[str | Path] | None = None,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    **sparsity,
) -> ConversionResult:
    """Convert a dense LLaMA checkpoint into a MoHD model folder (`hf-mohd convert mohd`).

    Args:
        source: a model folder, a .gguf file or a `DenseLlamaSource` (`load_dense_llama`).
        output_dir: the folder to write.
        preset: "full" (exact), "compression_50", "compression_75" or None (then give the sub-dimension counts in
            `sparsity`); see `mohd_config_from_llama` (docs/design.md section 3).
        seed: seed of the fresh router weights (and of `verify`'s random tokens).
        channel_order: "original" or "importance" (`llama_to_mohd`); must be "original" with a rotation.
        rotation: None or "pca": fold the RMSNorm weights and rotate the residual stream into the PCA basis of the
            calibration hidden states (`rotate_llama`; SliceGPT, arXiv 2401.15024, section 3; docs/design.md
            section 9). The LM head is then untied from the embedding.
        routers: "random" or "fitted" (ridge regression on the calibration tokens, `fit_routers`).
        calibration_text: UTF-8 text file, tokenized with the source tokenizer (`calibration_token_ids`); needed by
            `rotation` and `routers="fitted"`; keep it disjoint from evaluation text.
        calibration_tokens, calibration_window: at most this many calibration tokens, in rows of this many.
        routed_budgets: "uniform" (every sublayer at k), "greedy" or "greedy_output": each layer and sublayer kind
            gets its own k, allocated on the calibration text under the per-token parameter budget of the uniform k
            (`budgets.allocate_routed_sub_dims`, after the routers; saved in `per_layer_config`), from each
            sublayer's residual-stream error ("greedy") or from the model's output KL with only that sublayer
            lowered ("greedy_output": about N_r / 2 model forwards per sublayer and calibration batch; its running
            sums are kept in `allocation_progress_file(output_dir)` until the folder is written, so the same
            conversion run again after an interruption resumes the measurement).
        verify: before writing, check the exact model (every sub-dimension shared, same channel order and basis)
            against the source's logits; with a rotation the check runs in float64 (the same Q applied to a float64
            copy of the source), since fp32 rounding of the rotated weights alone moves real logits by ~1e-4.
        atol: tolerance of `verify` on the max |logit difference|.
        dtype: dtype of the converted weights; None keeps the source's (float32 for GGUF).
        gguf_file: name of a GGUF file inside the folder `source`.
        base_model: Hub id of the source, the model card's `base_model`.
        perplexity_json: JSON files of `experiments/smollm2/evaluate_perplexity.py` quoted in the model card.
        overwrite: replace an existing `output_dir`.
        max_shard_size: largest safetensors shard.
        sparsity: explicit MoHD fields (`SPARSITY_FIELDS`: num_sub_dims, num_shared_sub_dims, ...), None ignored.

    Returns:
        `ConversionResult`: the folder (safetensors weights, config.json with auto_map and the code files, the
        source tokenizer, generation_config.json, README.md model card), the model, `verify`'s number.

    Raises:
        ConversionError: options that do not go together (`check_mohd_options`: unknown rotation or routers, a
            rotation with channel_order other than "original", no calibration text where needed), a perplexity JSON
            that cannot be read, an existing destination without `overwrite`, a source that cannot be loaded, a
            calibration file that is unreadable or too short, settings that do not fit the source, a progress file
            of another conversion ("greedy_output"), or a failed `verify`. Each message names the file or field and
            what was expected.
    """
    check_mohd_options(
        rotation, routers, channel_order, calibration_text, "`calibration_text` (a UTF-8 file, --calibration-text)"
    )
    if routed_budgets not in ROUTED_BUDGETS:
        raise ConversionError(f"`routed_budgets` must be one of {list(ROUTED_BUDGETS)}, got {routed_budgets!r}.")
    if routed_budgets != "uniform" and calibration_text is None:
        raise ConversionError(
            f"routed_budgets={routed_budgets!r} allocates on calibration text: give `calibration_text` "
            "(--calibration-text)."
        )
    if sparsity.get("dropped_block_compensation") and calibration_text is None:
        raise ConversionError(
            "dropped_block_compensation=True fits the compensation tables on calibration text: give "
            "`calibration_text` (--calibration-text)."
        )
    source, save_options = load_checked(
        source, output_dir, gguf_file, dtype, perplexity_json, base_model, overwrite, max_shard_size
    )
    calibration_ids, calibration = None, None
    if calibration_text is not None:
        calibration_ids, calibration = read_calibration(
            source, calibration_text, window=calibration_window, max_tokens=calibration_tokens
        )
    converted, info = source, {"untied_parameters": 0}
    if rotation:
        converted, info = rotate_llama(source, calibration_ids)
    difference = None
    if verify and rotation:
        # In float64 with the same Q: fp32 rounding of the rotated weights alone moves SmolLM2's logits by 1e-4 to
        # 3e-4. In float64 the rotated model is the source to ~1e-12; the oracle LlamaForCausalLM still computes
        # its RMSNorm in fp32, so SmolLM2 measures 2e-5 here. (`replace`: the cast must not touch `source`.)
        source64 = load_dense_llama(dataclasses.replace(source), dtype=torch.float64)
        exact = build_mohd(
            rotate_llama(source64, rotation=info["basis"])[0], "full", seed=seed, channel_order="original",
            routers="random", calibration_ids=None,
        )  # fmt: skip
        difference = verify_logits(exact, source64, atol, seed=seed)
        del exact, source64
    elif verify:
        exact = build_mohd(
            converted, "full", seed=seed, channel_order=channel_order, routers="random", calibration_ids=None,
            num_sub_dims=sparsity.get("num_sub_dims"),
        )  # fmt: skip
        difference = verify_logits(exact, source, atol, seed=seed)
        del exact
    model = build_mohd(
        converted,
        preset,
        seed=seed,
        channel_order=channel_order,
        routers=routers,
        calibration_ids=calibration_ids,
        **sparsity,
    )
    budget_note = progress = None
    if routed_budgets != "uniform":
        if model.config.num_routed_sub_dims_per_tok == 0 or model.config.num_routed_sub_dims == 0:
            raise ConversionError(
                f"routed_budgets={routed_budgets!r} needs routed sub-dimensions (k >= 1); this preset has none."
            )
        error = "output" if routed_budgets == "greedy_output" else "residual"
        progress = allocation_progress_file(output_dir) if error == "output" else None
        allocation = allocate_routed_sub_dims(
            model, calibration_ids, model.config.num_routed_sub_dims_per_tok, error=error, progress=progress
        )
        apply_routed_budgets(model, allocation)
        shown = ", ".join(f"{layer}.{kind} {k}" for (layer, kind), k in sorted(allocation.budgets.items()))
        measure = BUDGET_ERRORS[error]
        budget_note = (
            "Each layer and sublayer kind has its own k (`per_layer_config`), allocated greedily on the calibration "
            f"text from {measure} at every k (TEAL's greedy, arXiv 2408.14690 section 4.2), under the per-token "
            f"parameter budget of k = {allocation.mean_routed_sub_dims:g} everywhere: {shown}."
        )
    compensation_note = None
    if model.config.dropped_block_compensation:  # after routers and budgets: what the model skips is final
        fit = fit_dropped_block_compensation(model, calibration_ids)
        compensation_note = (
            "Dropped-block compensation (FLAP's bias compensation, arXiv 2312.11983, per routed block): each "
            "sublayer adds the mean contribution of the blocks a token skips, measured on the calibration text "
            f"({fit['tokens']} tokens; {100 * fit['inactive_share']:.1f}% of the (token, routed block) pairs "
            "inactive), without training."
        )
    changes = describe_mohd_conversion(
        model.config,
        seed,
        channel_order,
        rotation=rotation,
        routers=routers,
        calibration=calibration,
        untied_parameters=info["untied_parameters"],
    )
    for note in (budget_note, compensation_note):
        if note:
            changes = f"{changes}\n\n{note}"
    path = save_converted(model, output_dir, converted, changes, **save_options)
    if progress is not None:
        progress.unlink(missing_ok=True)  # the allocation is in the saved config now
    tokens = None if calibration_ids is None else calibration_ids.numel()
    return ConversionResult(path, model, difference, tokens)


__all__ = ["allocation_progress_file", "convert_mohd"]
