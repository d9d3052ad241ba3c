#!/usr/bin/env bash
# Sets up a virtual environment (on a fresh machine) and runs the project's checks and tests.
# Usage: bash scripts/test.sh [--latest] [pytest args...]   (default: the full tier in .venv, as CI runs it)
#   --latest: the same checks in .venv-latest, built from the pyproject's ranges alone (the newest allowed releases)
#             instead of the pinned constraints.txt; run it before bumping the pins.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--latest" ]; then
    shift
    export HF_MOHD_LATEST=1
fi
export HF_MOHD_VLLM=1  # the vLLM tests (tests/test_vllm.py) run in .venv-vllm
source scripts/setup.sh
echo "== versions: $(python -c 'import json; from hf_mohd.versions import library_versions as v; print(json.dumps(v()))')"
export HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TOKENIZERS_PARALLELISM=false
echo "== ruff"
ruff check .
ruff format --check .
echo "== mlinter (model files)"
mlinter --no-progress --no-cache hf_mohd/models
echo "== pytest"
python -m pytest -q -p no:cacheprovider "$@"
