"""Shared pytest setup: offline Hugging Face, deterministic seeds, the `family` fixture and helpers for fresh-process
checks. The tiny configs and helpers themselves live in `tests/utils.py` (`from tests.utils import ...`)."""

import os

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the repository root is on the path (pyproject's pytest `pythonpath`), under `pytest` as under `python -m pytest`
from tests.utils import FAMILIES, ModelFamily  # noqa: E402


@pytest.fixture(params=list(FAMILIES))
def family(request) -> ModelFamily:
    """Each model family of `tests.utils.FAMILIES` in turn (test id: its name): a common check runs once per family."""
    return FAMILIES[request.param]


@pytest.fixture(scope="session")
def local_hub():
    """A server on 127.0.0.1 speaking the Hub HTTP API (`tests/hub_server.py`); `.endpoint` is its base URL.

    Point `HF_ENDPOINT` of a fresh process at it (set before `huggingface_hub` is imported, with
    `HF_HUB_OFFLINE=0` and `HF_HUB_DISABLE_XET=1`); the server is stopped when the session ends.
    """
    from hub_server import LocalHub

    hub = LocalHub().start()
    yield hub
    hub.stop()
