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
"""Writing a converted model folder atomically (docs/design.md section 6).

The folder holds what `push_to_hub` would publish: safetensors weights, `config.json` with `auto_map` and the
modelling code files (written by `save_pretrained` because `import hf_mohd` registers the classes for auto classes),
the source tokenizer, `generation_config.json`, and a model card (`README.md`) naming the source and what changed.
Everything is written into a temporary folder next to the destination and renamed into place, so a crash or an
interrupt never leaves a half-written model folder under the destination name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from ..atomic_folder import write_folder_atomically
from .source import ConversionError, DenseLlamaSource, load_dense_llama


logger = logging.getLogger(__name__)


def check_destination(output_dir: str | Path, overwrite: bool = False) -> Path:
    """Resolve `output_dir` and fail early when it exists (unless `overwrite`) or is a file.

    Raises:
        ConversionError: the destination exists and `overwrite` is false, or it is a file.
    """
    output = Path(output_dir).expanduser().resolve()
    if output.is_file():
        raise ConversionError(f"{output} is a file; the output must be a folder.", "exists")
    if output.exists() and not overwrite:
        raise ConversionError(f"{output} already exists; pass overwrite=True (--overwrite) to replace it.", "exists")
    return output


def _apply_umask(folder: Path) -> None:
    """mkdtemp (and some writers) create owner-only entries; give the folder the usual umask-derived modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _perplexity_table(perplexities: Mapping[str, float]) -> str:
    rows = "\n".join(f"| {name} | {value:.3f} |" for name, value in perplexities.items())
    return f"| variant | perplexity |\n|---|---|\n{rows}"


def build_model_card(
    model,
    source: DenseLlamaSource,
    changes: str,
    *,
    base_model: str | None = None,
    perplexities: Mapping[str, float] | None = None,
    perplexity_note: str | None = None,
    repo_id: str | None = None,
):
    """Model card of a converted model, rendered by `hf_mohd.model_card.render_model_card`.

    Args:
        model: the converted model.
        source: its source; `source.description` is quoted.
        changes: what the conversion changed (markdown), e.g. which weights are new and how they were initialised.
        base_model: Hub id of the source model, when known (metadata `base_model`).
        perplexities: optional {variant name: perplexity} measured on held-out text, shown as a table.
        perplexity_note: what the perplexities were measured on (text, tokens, command).
        repo_id: name or Hub id the card's title and loading example use (default: the folder's name).

    Returns:
        `huggingface_hub.ModelCard`.
    """
    from ..model_card import render_model_card

    notes = [f"**Converted with hf-mohd** from {source.description}.", "", changes]
    if perplexities:
        notes += ["", "### Perplexity without retraining", "", _perplexity_table(perplexities)]
        if perplexity_note:
            notes += ["", perplexity_note]
    card = render_model_card(
        model,
        base_model=base_model,
        datasets=["None: converted from the source model's weights, no training after conversion."],
        notes="\n".join(notes),
        repo_id=repo_id,
    )
    if perplexities:  # the template's Evaluation section knows only lm-eval results; point it at the table
        card.text = card.text.replace(
            "No evaluation results recorded.", "Perplexity without retraining: see *Notes* below."
        )
    return card


def save_converted(
    model,
    output_dir: str | Path,
    source: DenseLlamaSource,
    changes: str,
    *,
    base_model: str | None = None,
    perplexities: Mapping[str, float] | None = None,
    perplexity_note: str | None = None,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write a complete model folder for `model` (converted from `source`), atomically (`write_folder_atomically`).

    Args:
        model: a MoHD or LatentMoE model (`import hf_mohd` has registered it, so `auto_map` and code are written).
        output_dir: destination folder; its parent is created if needed.
        source: the `DenseLlamaSource` it came from: tokenizer, generation config and description are saved.
        changes, base_model, perplexities, perplexity_note: model card contents (see `build_model_card`).
        overwrite: replace an existing destination (the old folder is removed only after the new one is in place).
        max_shard_size: passed to `save_pretrained`.

    Returns:
        The destination path.

    Raises:
        ConversionError: the destination exists and `overwrite` is false, or is a file.
    """
    output = check_destination(output_dir, overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    with write_folder_atomically(output) as staging:
        logger.info("Writing weights, config and code to %s", staging)
        model.generation_config = source.generation_config
        model.save_pretrained(staging, max_shard_size=max_shard_size)
        if source.tokenizer is not None:
            source.tokenizer.save_pretrained(staging)
        card = build_model_card(
            model,
            source,
            changes,
            base_model=base_model,
            perplexities=perplexities,
            perplexity_note=perplexity_note,
            repo_id=output.name,
        )
        card.save(staging / "README.md")
        _apply_umask(staging)
    logger.info("Saved %s", output)
    return output


@dataclasses.dataclass
class ConversionResult:
    """What `convert_mohd`, `convert_latent_moe` or `convert_carved_latent_moe` wrote.

    Attributes:
        path: the written model folder (resolved).
        model: the converted model (eval mode), as saved.
        max_logit_difference: with `verify=True`, max |logits(exact model) - logits(source)| on 2 x 32 random
            tokens (fp32 logits; see `verify_logits`); None without.
        calibration_tokens: calibration tokens used (rows x window), None without calibration text.
    """

    path: Path
    model: object
    max_logit_difference: float | None = None
    calibration_tokens: int | None = None


# Options of `convert_*` that concern the written folder (`save_converted`, the model card), not the conversion.
SAVE_OPTIONS = ("base_model", "perplexity_json", "overwrite", "max_shard_size")


def load_checked(
    source, output_dir, gguf_file, dtype, perplexity_json=None, base_model=None, overwrite=False, max_shard_size="5GB"
):
    """(source, `save_converted` keyword arguments): the perplexity JSON files read (`card_perplexities`) and the
    destination checked (`check_destination`) before the (possibly long) load (`load_dense_llama`) and conversion.

    Raises:
        ConversionError: as those three.
    """
    save_options = {"base_model": base_model, "overwrite": overwrite, "max_shard_size": max_shard_size}
    save_options.update(card_perplexities([str(path) for path in perplexity_json] if perplexity_json else None))
    check_destination(output_dir, overwrite)
    return load_dense_llama(source, gguf_file=gguf_file, dtype=dtype), save_options


def card_perplexities(paths: list[str] | None) -> dict:
    """`perplexities` and `perplexity_note` for `save_converted` (the model card's perplexity table and the prose
    saying what it was measured on) from JSON files of `experiments/smollm2/evaluate_perplexity.py` (or nothing).

    Tables of several files are merged in order (a variant measured twice keeps its first value); one note per file.

    Raises:
        ConversionError: a file that cannot be read or is not such a JSON (the message names the file).
    """
    if not paths:
        return {}

    perplexities, notes = {}, []
    for path in paths:
        try:
            with open(path) as handle:
                report = json.load(handle)
            for name, value in report["perplexity"].items():
                perplexities.setdefault(str(name), float(value))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            kind = "missing" if isinstance(err, FileNotFoundError) else "damaged"
            raise ConversionError(
                f"{path}: expected the JSON of experiments/smollm2/evaluate_perplexity.py ({err}).", kind
            ) from err
        text, calibration = report.get("text", {}), report.get("calibration")
        notes.append(
            f"Measured on {text.get('tokens', '?')} tokens of held-out text ({text.get('corpus', 'not recorded')}; "
            f"articles: {', '.join(text.get('articles', []))}) in windows of {text.get('window', '?')} tokens, "
            f"routers seed {report.get('router_seed', '?')}, source {report.get('source', '?')}"
            + (
                f"; channel order calibrated on {calibration['tokens']} tokens of other articles "
                f"({', '.join(calibration['articles'])})"
                if calibration
                else ""
            )
            + f". Command: `{report.get('command', '?')}`."
        )
    return {"perplexities": perplexities, "perplexity_note": "\n\n".join(notes)}


__all__ = [
    "SAVE_OPTIONS",
    "ConversionResult",
    "build_model_card",
    "card_perplexities",
    "check_destination",
    "load_checked",
    "save_converted",
]
