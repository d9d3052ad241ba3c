"""Shared pytest setup: offline Hugging Face, deterministic seeds, and helpers for fresh-process checks."""

import os

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
