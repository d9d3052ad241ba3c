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
"""Dense LLaMA checkpoint -> LatentMoE model folder in one call: `convert_latent_moe` (upcycling) and
`convert_carved_latent_moe` (carving), what `hf-mohd convert latent-moe` (`--carve`) and
`conversion/convert_llama_to_latent_moe.py` run.

Each checks its options and the destination before reading any weight, loads the source (`load_dense_llama`),
converts it, optionally checks the model against the source's logits (`verify_logits`), and writes the folder
atomically (`save_converted`): weights, config and code, tokenizer, generation config, model card.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..calibration import calibration_ids as read_calibration
from ..output import SAVE_OPTIONS, ConversionResult, load_checked, save_converted
from ..source import ConversionError, DenseLlamaSource
from ..verify import verify_logits
from .carve import CarveOptions, carve_source, carved_config_from_llama, describe_carving
from .routers import every_expert_active
from .upcycle import describe_latent_moe_conversion, llama_to_latent_moe


def convert_latent_moe(
    source: str | Path | DenseLlamaSource,
    output_dir: str | Path,
    *,
    expert_init: str = "slices",
    seed: int = 0,
    verify: bool = False,
    atol: float = 1e-4,
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
    **options,
) -> ConversionResult:
    """Upcycle a dense LLaMA checkpoint into a LatentMoE model folder (`hf-mohd convert latent-moe`).

    Args:
        source, output_dir: as in `convert_mohd`.
        expert_init: "slices" (slices of the dense FFN read through its top input directions) or "random"
            (`llama_to_latent_moe`).
        seed: seed of the routers, of the "random" experts and of `verify`'s tokens.
        verify: before writing, check the converted model itself against the source's logits (it is exact before
            training: `fc2_latent_proj` is zero; docs/design.md section 6).
        atol, dtype, gguf_file: as in `convert_mohd`.
        options: `base_model`, `perplexity_json`, `overwrite`, `max_shard_size` as in `convert_mohd`; every other
            keyword is a `llama_to_latent_moe` setting (num_experts, num_experts_per_tok, moe_intermediate_size,
            moe_latent_size, router_score_func, dense_layers, config overrides).

    Returns:
        `ConversionResult` (the folder's contents as in `convert_mohd`).

    Raises:
        ConversionError: a perplexity JSON that cannot be read, an existing destination without `overwrite`, a
            source that cannot be loaded, settings that do not fit it (`llama_to_latent_moe`), or a failed `verify`.
    """
    saving = {name: options.pop(name) for name in SAVE_OPTIONS if name in options}
    source, save_options = load_checked(source, output_dir, gguf_file, dtype, **saving)
    model = llama_to_latent_moe(source, expert_init=expert_init, seed=seed, **options)
    difference = verify_logits(model, source, atol, seed=seed) if verify else None
    changes = describe_latent_moe_conversion(model.config, expert_init, seed)
    path = save_converted(model, output_dir, source, changes, **save_options)
    return ConversionResult(path, model, difference)


def convert_carved_latent_moe(
    source: str | Path | DenseLlamaSource,
    output_dir: str | Path,
    *,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    shared_fraction: float = 0.25,
    latent_size: int | None = None,
    calibration_text: str | Path | None = None,
    calibration_tokens: int = 8192,
    calibration_window: int = 256,
    router_score_func: str = "softmax",
    seed: int = 0,
    verify: bool = False,
    atol: float = 1e-4,
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
    **save_options,
) -> ConversionResult:
    """Carve a dense LLaMA checkpoint into a LatentMoE model folder (`hf-mohd convert latent-moe --carve`).

    Each dense FFN is split, weights unchanged, into a shared expert and `num_experts` equal routed experts with
    routers fitted on calibration text (`carve.carve_llama`; MoEfication arXiv 2110.01786, CMoE arXiv 2502.04416).

    Args:
        source, output_dir: as in `convert_mohd`.
        num_experts, num_experts_per_tok, shared_fraction: N, K and the share of the FFN in the shared expert.
        latent_size: None: full-width routed experts; l in [1, hidden_size]: routed experts at latent width l
            (`moe_latent_size=l`), read and written in each layer's top-l PCA basis of its calibration FFN inputs
            (`carve.latent_basis`; LatentMoE arXiv 2601.18089); the shared expert and the router stay full width.
        calibration_text: UTF-8 text file; None: the first Wikipedia articles of the gensim sample
            (`calibration.calibration_ids`), disjoint from the articles evaluations hold out.
        calibration_tokens, calibration_window: at most this many calibration tokens, in rows of this many.
        router_score_func: "softmax" or "sigmoid".
        seed: seed of the balanced k-means seeding and of `verify`'s tokens.
        verify: before writing, check the carved model with every expert active (K = N, unit gates) against the
            source's logits (`verify_logits`); only an exact carve can pass, so `latent_size` must then be None or
            hidden_size.
        atol, dtype, gguf_file: as in `convert_mohd`.
        save_options: `base_model`, `perplexity_json`, `overwrite`, `max_shard_size` as in `convert_mohd`.

    Returns:
        `ConversionResult` (the folder's contents as in `convert_mohd`; `calibration_tokens` set).

    Raises:
        ConversionError: options out of range (`carve.CarveOptions`: K > N, a shared fraction outside
            [0, 1), a `latent_size` outside [1, hidden_size], ...), `verify` with a `latent_size` below
            hidden_size (that model is not the source), an unknown save option, a perplexity JSON that cannot be
            read, an existing destination without `overwrite`, a source that cannot be loaded or is not LLaMA-style,
            an intermediate_size that does not split into N equal experts, calibration text that is unreadable or
            too short, or a failed `verify`.
    """
    unknown = sorted(set(save_options) - set(SAVE_OPTIONS))
    if unknown:
        raise ConversionError(f"Unknown option(s) {unknown} of convert_carved_latent_moe; see its docstring.")
    options = CarveOptions(num_experts, num_experts_per_tok, shared_fraction, latent_size, router_score_func)
    source, save_options = load_checked(source, output_dir, gguf_file, dtype, **save_options)
    config = carved_config_from_llama(source.config, options)  # the checks against the source, before calibration
    hidden_size = source.config.hidden_size
    if verify and latent_size is not None and latent_size < hidden_size:
        raise ConversionError(
            f"`verify` (--verify) checks that the carve with every expert active computes the source, which a latent "
            f"width `latent_size` = {latent_size} < hidden_size = {hidden_size} does not (its routed experts read "
            "and write a projection of the FFN input); verify a full-width carve (no `latent_size`, or hidden_size)."
        )
    calibration_ids, calibration = read_calibration(
        source, calibration_text, window=calibration_window, max_tokens=calibration_tokens
    )
    model, report = carve_source(source, config, calibration_ids, calibration, seed=seed)
    difference = None
    if verify:
        with every_expert_active(model):
            difference = verify_logits(model, source, atol, seed=seed)
    changes = describe_carving(model.config, report, seed)
    path = save_converted(model, output_dir, source, changes, **save_options)
    return ConversionResult(path, model, difference, report.calibration_tokens)


__all__ = ["convert_carved_latent_moe", "convert_latent_moe"]
