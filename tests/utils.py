"""Test helpers shared by several test files."""

import json
import os
import subprocess
import sys
import textwrap


# Prepended to code run in a fresh interpreter: any import of `hf_mohd` fails there, as on a machine without it.
BLOCK_HF_MOHD = textwrap.dedent(
    """
    import importlib.abc, sys

    class _BlockHfMohd(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_mohd" or name.startswith("hf_mohd."):
                raise ImportError("hf_mohd is blocked in this process")
            return None

    sys.meta_path.insert(0, _BlockHfMohd())
    try:
        import hf_mohd  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("hf_mohd is still importable")
    """
)


def run_python_without_hf_mohd(code: str, cwd: str, env: dict | None = None, timeout: int = 600) -> dict:
    """Runs `code` in a fresh interpreter where `hf_mohd` cannot be imported; returns the JSON it prints last.

    The code must print one JSON object as its last stdout line. Raises AssertionError with stderr on failure.
    """
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_HF_MOHD + textwrap.dedent(code)],
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reallocate_parameters(model) -> None:
    """Gives every parameter of a `from_pretrained` model freshly allocated memory, in place.

    Loaded tensors can be views of the safetensors file, 8-byte aligned; MKL's AVX2 kernels sum in another order on
    such memory (1 ulp apart on an AMD EPYC), so a reloaded model's logits are compared bit for bit on copies.
    """
    for parameter in model.parameters():
        parameter.data = parameter.data.clone()
