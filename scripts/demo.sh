#!/usr/bin/env bash
# The main job on a fresh machine: sets up .venv (scripts/setup.sh), then trains, evaluates and compares a dense
# Llama, a MoHD and a LatentMoE model on real Wikipedia text, then SmolLM2-135M against its sparse versions (12-16
# minutes on 2 idle CPU cores, set-up not counted; README.md gives the time per CPU).
# Usage: bash scripts/demo.sh [hf-mohd demo options, e.g. --output-dir runs/demo --max-steps 150 --quick]
# On a machine other jobs share: bash scripts/demo.sh --threads 1 (torch's one thread per core stalls on busy cores).
set -euo pipefail
cd "$(dirname "$0")/.."
# --help alone needs no set-up when .venv is already there
wants_help=false
for argument in "$@"; do
  if [[ "$argument" == "-h" || "$argument" == "--help" ]]; then wants_help=true; fi
done
if [[ "$wants_help" == true && -x .venv/bin/hf-mohd ]]; then
  source .venv/bin/activate
else
  source scripts/setup.sh
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TOKENIZERS_PARALLELISM=false
hf-mohd demo "$@"
