"""Model cards for MoHD and LatentMoE checkpoints, rendered with `huggingface_hub.ModelCard` / `ModelCardData`.

`render_model_card` fills the package template `hf_mohd/model_cards/model_card_template.md` (a copy for readers lives
in the repository's top-level `model_cards/`) with: architecture and sparsity settings, total vs activated parameters,
base model, training data and settings, evaluation results in the Hub's model-index format (converted from
lm-evaluation-harness output by `lm_eval_to_eval_results`), intended use and limitations, and how to load.
Conversion and training code call it; `hf_mohd.hub.publish` writes its output as `README.md` of the Hub repository.

Sources: the model-index layout is huggingface_hub's `EvalResult` / `eval_results_to_model_index`; lm-eval's result
keys are "<metric>,<filter>" with "<metric>_stderr,<filter>" beside them (lm-evaluation-harness 0.4, `simple_evaluate`
and the `results_*.json` files the CLI writes with `--output_path`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .lora import lora_targets
from .models.configuration_common import LLAMA_ARCHITECTURE_FIELDS
from .models.configuration_mohd import SPARSITY_FIELDS as MOHD_SPARSITY_FIELDS


TEMPLATE_NAME = "model_card_template.md"
LIBRARY_NAME = "transformers"
# Per-task entries of lm-eval's "results" that are bookkeeping, not metrics (lm-eval 0.4.13 writes `sample_len`).
NON_METRIC_KEYS = {"alias", "name", "sample_len", "samples", "sample_count"}
PIPELINE_TAG = "text-generation"


# Config fields shown per family; fields a config does not have are skipped, so the card follows the config class.
ARCHITECTURE_FIELDS = [*LLAMA_ARCHITECTURE_FIELDS, "max_position_embeddings", "tie_word_embeddings"]
SPARSITY_FIELDS = {"mohd": [*MOHD_SPARSITY_FIELDS, "per_layer_config"]}  # per-layer budgets, when the model has them
# For a family without an explicit list (LatentMoE), every config field whose name contains one of these.
SPARSITY_KEYWORDS = (
    "expert",
    "moe",
    "latent",
    "router",
    "routed",
    "topk",
    "top_k",
    "score",
    "mlp_gated",
    "mixer",
    "per_layer",
)

SUMMARIES = {
    "mohd": (
        "A **MoHD** (Mixture of Hidden Dimensions, Chen et al., ICML 2025, arXiv 2412.05644) causal language model: "
        "the residual width is split into sub-dimensions; every token activates the shared sub-dimensions plus the "
        "top-k routed sub-dimensions its router picks, in attention and FFN alike, with activation scaling, group "
        "fusion and a sub-dimension load-balance loss."
    ),
    "latent_moe": (
        "A **LatentMoE** (arXiv 2601.18089, as in NVIDIA Nemotron 3; expert shapes and layerwise capacity from arXiv "
        "2610.14644) causal language model: a mixture of experts whose routed experts compute in a latent width "
        "smaller than the model width, between a down- and an up-projection of the token."
    ),
}
INTENDED_USE = {
    "mohd": (
        "Research on sparse hidden-dimension models: fine-tuning, evaluation and efficiency studies. The rules the "
        "MoHD paper's available text leaves open (routed gate form, group fusion form, where scaling applies) are "
        "configuration choices of hf-mohd, listed under *Sparsity settings*; another reading of the paper may "
        "differ. The model has not been aligned or safety-tuned; it can produce wrong, biased or offensive text and "
        "must not be used for decisions about people. Quality is only what the evaluation section shows."
    ),
    "latent_moe": (
        "Research on latent mixture-of-experts models: fine-tuning, evaluation and expert-shape studies. The model "
        "has not been aligned or safety-tuned; it can produce wrong, biased or offensive text and must not be used "
        "for decisions about people. Quality is only what the evaluation section shows."
    ),
}
CITATIONS = {
    "mohd": (
        "```bibtex\n@article{mohd2024,\n  title={Mixture of Hidden-Dimensions Transformer},\n"
        "  journal={arXiv preprint arXiv:2412.05644},\n  year={2024},\n  note={ICML 2025}\n}\n```"
    ),
    "latent_moe": "LatentMoE: arXiv 2601.18089; expert shaping and layerwise capacity: arXiv 2610.14644.",
}


def lm_eval_to_eval_results(results: Mapping[str, Any], *, task_type: str = PIPELINE_TAG) -> list[EvalResult]:
    """Convert lm-evaluation-harness output into huggingface_hub `EvalResult`s (the Hub's model-index entries).

    Args:
        results: the dict `lm_eval.simple_evaluate` returns, or a `results_*.json` the CLI wrote: a "results"
            mapping {task: {"acc,none": 0.61, "acc_stderr,none": 0.01, "alias": ...}}, optionally "configs"
            {task: {"dataset_path", "dataset_name", "test_split" / "validation_split", "task"}} naming the data.
            A bare {task: {metric: value}} mapping is accepted too.
        task_type: the Hub task type of every entry.

    Returns:
        One `EvalResult` per (task, metric) with a finite numeric value; stderr entries, bookkeeping keys
        (`NON_METRIC_KEYS`, e.g. "sample_len") and "N/A" values are dropped. The filter name is kept in `metric_name` when it is not "none" (e.g. "exact_match (strict)").

    Raises:
        ValueError: no numeric metric in `results`.
    """
    per_task = results.get("results", results)
    configs = results.get("configs", {}) if "results" in results else {}
    out = []
    for task, metrics in per_task.items():
        if not isinstance(metrics, Mapping):
            continue
        cfg = configs.get(task, {})
        split = cfg.get("test_split") or cfg.get("validation_split") or cfg.get("training_split")
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr") or metric in NON_METRIC_KEYS or isinstance(value, bool):
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            out.append(
                EvalResult(
                    task_type=task_type,
                    task_name=str(metrics.get("alias", task)).strip(" -"),
                    dataset_type=str(cfg.get("dataset_path") or task),
                    dataset_name=str(cfg.get("task") or task),
                    dataset_config=cfg.get("dataset_name") or None,
                    dataset_split=split,
                    metric_type=metric,
                    metric_name=metric if filt in ("", "none") else f"{metric} ({filt})",
                    metric_value=float(value),
                    source_name="lm-evaluation-harness",
                    source_url="https://github.com/EleutherAI/lm-evaluation-harness",
                )
            )
    if not out:
        raise ValueError("`eval_results` holds no numeric lm-eval metric (expected {'results': {task: {metric: v}}}).")
    return out


def _card_parameters(config) -> dict[str, int]:
    """The card's parameter rows, from `hf_mohd.models.accounting.parameter_counts` (counted from the config, without
    building the model): total, activated (decoder parameters a token reads plus the LM head), embedding, and the
    router and group-fusion parameters where the model has any.

    Raises:
        ValueError: a config the accounting does not cover (a mixture-of-experts of another family).
    """
    from .models.accounting import parameter_counts

    counts = parameter_counts(config)
    rows = {"total": counts["total"], "activated": counts["activated"], "embedding": counts["embedding"]}
    for name, key in (("router", "router"), ("group fusion", "fusion")):
        if counts[key]:
            rows[name] = counts[key]
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) if value else "[]"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) if value else "{}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _as_list(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _sparsity_fields(config, values: Mapping[str, Any]) -> list[str]:
    listed = SPARSITY_FIELDS.get(config.model_type)
    if listed is not None:
        return [name for name in listed if name in values]
    return sorted(name for name in values if any(word in name for word in SPARSITY_KEYWORDS))


def template_text() -> str:
    """The model-card template shipped as package data (`hf_mohd/model_cards/model_card_template.md`)."""
    return resources.files("hf_mohd").joinpath("model_cards", TEMPLATE_NAME).read_text(encoding="utf-8")


def render_model_card(
    model_or_config,
    *,
    base_model: str | Sequence[str] | None = None,
    datasets: str | Sequence[str] | None = None,
    eval_results: Mapping[str, Any] | None = None,
    training: Mapping[str, Any] | None = None,
    notes: str | None = None,
    repo_id: str | None = None,
    license: str | None = "apache-2.0",
    language: str | Sequence[str] | None = None,
) -> ModelCard:
    """Render the model card of a MoHD or LatentMoE model or config.

    Args:
        model_or_config: a model (its `.config` is used) or a config of either family.
        base_model: Hub id(s) of the model this one was converted or fine-tuned from (metadata `base_model`).
        datasets: training data: Hub dataset ids, or free-form descriptions (e.g. "gensim enwiki sample, CC BY-SA");
            every entry is listed in the text, entries without a space go to the `datasets` metadata.
        eval_results: lm-eval output (see `lm_eval_to_eval_results`); becomes the metadata `model-index`.
        training: training settings to list (steps, learning rate, tokens, hardware, ...).
        notes: free text appended as a "Notes" section.
        repo_id: the Hub repository id; the model name and the loading example use it.
        license: metadata licence id (the package's own licence, Apache-2.0, by default).
        language: metadata language(s), e.g. "en".

    Returns:
        A `huggingface_hub.ModelCard`; `card.data` is its `ModelCardData`, `str(card)` the README text.

    Raises:
        ValueError: a config the accounting does not cover (`hf_mohd.models.accounting.parameter_counts`), or
            `eval_results` without numeric metrics.
    """
    config = getattr(model_or_config, "config", model_or_config)
    family = config.model_type
    counts = _card_parameters(config)
    values = config.to_dict()  # serialisable values (e.g. `per_layer_config` as its sparse {layer: overrides} map)
    name = repo_id or getattr(config, "name_or_path", "") or f"{family}-model"
    model_name = name.rstrip("/").split("/")[-1] or f"{family}-model"
    all_datasets = _as_list(datasets)
    hub_datasets = [d for d in all_datasets if " " not in d] or None
    results = lm_eval_to_eval_results(eval_results) if eval_results else None
    tags = ["hf-mohd", family.replace("_", "-"), "custom_code", "sparse"]
    if family != "mohd":
        tags.append("moe")

    card_data = ModelCardData(
        model_name=model_name,
        library_name=LIBRARY_NAME,
        pipeline_tag=PIPELINE_TAG,
        license=license,
        language=language,
        base_model=_as_list(base_model) or None,
        datasets=hub_datasets,
        tags=tags,
        eval_results=results,
    )
    target_modules, target_parameters = lora_targets(config)
    total, active = counts["total"], counts["activated"]
    eval_rows = [(r.task_name or r.dataset_name, r.metric_name, f"{r.metric_value:.4f}") for r in results or []]
    return ModelCard.from_template(
        card_data,
        template_str=template_text(),
        model_name=model_name,
        repo_id=repo_id or "path/to/this/folder",
        summary=SUMMARIES.get(family, f"A `{family}` causal language model built with hf-mohd."),
        architecture=[(n, _fmt(values[n])) for n in ARCHITECTURE_FIELDS if n in values],
        sparsity=[(n, _fmt(values[n])) for n in _sparsity_fields(config, values)],
        parameters=[(f"{k} parameters", _fmt(v)) for k, v in counts.items()],
        parameters_note=f"A token activates {active:,} of {total:,} parameters ({100 * active / total:.1f}%), "
        "counted from the configuration (activated: what one token's forward pass reads, LM head included).",
        base_model_text=", ".join(f"[{b}](https://huggingface.co/{b})" for b in _as_list(base_model))
        or "None: trained from scratch (or not recorded).",
        datasets_text="\n".join(f"- {d}" for d in all_datasets) or "Not recorded.",
        training=[(k, _fmt(v)) for k, v in (training or {}).items()],
        eval_text="Results of lm-evaluation-harness (also in the metadata `model-index`)."
        if results
        else "No evaluation results recorded.",
        eval_rows=eval_rows,
        lora_target_modules=target_modules,
        lora_target_parameters=target_parameters,
        intended_use=INTENDED_USE.get(family, INTENDED_USE["latent_moe"]),
        notes=notes,
        citation=CITATIONS.get(family, ""),
    )


__all__ = ["lm_eval_to_eval_results", "render_model_card", "template_text"]
