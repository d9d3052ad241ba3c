#!/usr/bin/env bash
# Sets up a virtual environment (on a fresh machine) and runs the project's checks and tests.
# Usage: bash scripts/test.sh [pytest args...]   (default: the full tier, as CI runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TOKENIZERS_PARALLELISM=false
echo "== ruff"
ruff check .
ruff format --check .
echo "== mlinter (model files)"
mlinter --no-progress --no-cache hf_mohd/models
echo "== pytest"
python -m pytest -q -p no:cacheprovider "$@"
