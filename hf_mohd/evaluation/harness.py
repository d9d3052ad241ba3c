"""Run lm-evaluation-harness on a model object or folder with the offline tasks of `hf_mohd/evaluation/tasks/`.

The runner is lm-eval's own `HFLM` wrapper plus `simple_evaluate` (docs/design.md section 7), with a `TaskManager` that
includes this package's task folder, so any model `AutoModelForCausalLM` loads (MoHD, LatentMoE, Llama) is scored
exactly as `lm_eval --model hf --include_path <tasks dir>` would score it (tests/test_evaluation.py checks this).
"""

import logging
import os

import huggingface_hub

from ..log_filters import filtered_loggers


# Files from which `AutoTokenizer.from_pretrained(folder)` can build a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")

# The MoHD paper's suite (arXiv 2412.05644, Table 2): short name -> offline task name.
SUITE = {
    "arc_easy": "offline_arc_easy",
    "arc_challenge": "offline_arc_challenge",
    "boolq": "offline_boolq",
    "hellaswag": "offline_hellaswag",
    "lambada": "offline_lambada",
    "piqa": "offline_piqa",
    "sciq": "offline_sciq",
    "winogrande": "offline_winogrande",
}


def resolve_tasks(names: str | list[str]) -> list[str]:
    """Offline task names from short names ("arc_easy"), full names ("offline_arc_easy") or "all".

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if names == ["all"]:
        return list(SUITE.values())
    resolved = []
    for name in names:
        if name in SUITE:
            resolved.append(SUITE[name])
        elif name in SUITE.values():
            resolved.append(name)
        else:
            raise ValueError(f"Unknown task {name!r}; known: {sorted(SUITE)} (or 'all').")
    return resolved


def evaluate(
    model,
    tokenizer=None,
    tasks: str | list[str] = "all",
    limit: int | float | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    num_fewshot: int | None = None,
    seed: int = 1234,
    trust_remote_code: bool = False,
    log_samples: bool = False,
) -> dict:
    """lm-eval results of `model` on offline tasks.

    Args:
        model: a `PreTrainedModel` (then pass `tokenizer`) or a model folder / Hub id.
        tokenizer: tokenizer object or folder; defaults to the model folder's.
        tasks: see `resolve_tasks`.
        limit: documents per task (an int), or a fraction of each task (a float < 1); None: all.
        batch_size: lm-eval batch size (requests per forward).
        device: torch device of the model ("cpu", "cuda", ...).
        num_fewshot: few-shot examples (None: zero-shot; the task YAMLs have no few-shot split but the validation).
        seed: lm-eval's random, numpy, torch and few-shot seeds.
        log_samples: also return lm-eval's per-document records (`samples[task]`, each with `doc_id` and the
            metrics of that document), e.g. for paired standard errors between two models on the same documents.

    Returns:
        lm-eval's result dict; `results[task]` maps "acc,none", "acc_norm,none", "perplexity,none", ... to numbers.

    Raises:
        FileNotFoundError: `model` names a local path that is not an existing folder, or, with HF_HUB_OFFLINE set,
            neither a local folder nor a Hub model in the local cache (checked before loading).
        ValueError: an unknown task (checked first); a model folder (or `tokenizer` folder) without tokenizer files;
            a model object without `tokenizer`.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import hf_mohd  # noqa: F401  (registers the model types with the Auto classes)

    task_names = resolve_tasks(tasks)  # an unknown task fails before the model is loaded
    with filtered_loggers(_ExpectedLmEvalWarnings(), "lm_eval.models.huggingface", "lm_eval.api.task"):
        if isinstance(model, str):
            _check_local_model(model)
            _check_tokenizer_source(model if tokenizer is None else tokenizer)
            lm = HFLM(
                pretrained=model,
                tokenizer=tokenizer,
                device=device,
                batch_size=batch_size,
                trust_remote_code=trust_remote_code,
                backend="causal",  # every model here is a causal LM; lm-eval would guess from the model type
            )
        else:
            if tokenizer is None:
                raise ValueError("Pass `tokenizer` together with a model object.")
            lm = HFLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size, backend="causal")
        return simple_evaluate(
            model=lm,
            tasks=task_names,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=TaskManager(include_path=TASKS_DIR),
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            log_samples=log_samples,
        )


class _ExpectedLmEvalWarnings(logging.Filter):
    """Drops lm-eval warnings about what `evaluate` does by design: a model passed as an object rather than a name
    (`HFLM(pretrained=model)`, in one process), and the offline tasks' datasets built by a function
    (`custom_dataset`, "Custom kwargs can be passed to `--metadata`"). Every other lm-eval message passes."""

    MESSAGES = (
        "`pretrained` model kwarg is not of type `str`",
        "Passed an already-initialized model through",
        "Custom kwargs can be passed to `--metadata`",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(expected in message for expected in self.MESSAGES)


def _check_local_model(model: str) -> None:
    """A model string that names a local path (absolute, relative with ./ or ../, ~, or with more than one "/", which
    no Hub id has) must be an existing folder; otherwise the Hub client would reject it as a malformed repo id.

    Raises:
        FileNotFoundError: the path does not exist or is not a folder.
    """
    path = os.path.expanduser(model)
    looks_local = model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or os.path.exists(path)
    if looks_local and not os.path.isdir(path):
        what = "is a file, not a model folder" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"model folder {model} {what} (expected a folder written by save_pretrained)")
    if not looks_local and huggingface_hub.constants.HF_HUB_OFFLINE and not _in_hub_cache(model):
        raise FileNotFoundError(
            f"{model} is neither a local model folder nor a Hub model in the local cache (HF_HUB_OFFLINE is set, so "
            "nothing is downloaded); expected a folder written by save_pretrained"
        )


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds `config.json` of the Hub model `repo_id` (False for a string that
    is not a valid repo id)."""
    try:
        return isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # huggingface_hub's HFValidationError: not a repo id
        return False


def _check_tokenizer_source(source) -> None:
    """A local folder given as the tokenizer source must hold tokenizer files (Hub ids and objects pass)."""
    if isinstance(source, str) and os.path.isdir(source):
        if not any(os.path.isfile(os.path.join(source, name)) for name in TOKENIZER_FILES):
            raise ValueError(
                f"{source} has no tokenizer files (expected one of {list(TOKENIZER_FILES)}); save the tokenizer "
                "next to the model (`tokenizer.save_pretrained(folder)`) or pass `tokenizer`."
            )


def summarize(results: dict) -> dict[str, dict[str, float]]:
    """{short task name: {metric: value}} with lm-eval's ",none" filter suffix removed and stderr dropped."""
    short = {v: k for k, v in SUITE.items()}
    table = {}
    for task, metrics in results["results"].items():
        table[short.get(task, task)] = {
            key.split(",")[0]: value
            for key, value in metrics.items()
            if "," in key and "stderr" not in key and isinstance(value, (int, float))
        }
    return table
