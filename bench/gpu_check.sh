#!/usr/bin/env bash
# CUDA check of hf-mohd in one short run (at most 8 minutes on one GPU), for a machine with a preinstalled CUDA build
# of torch and no network.
#
#   bash bench/gpu_check.sh --fetch   # on a networked machine, before: the pinned wheels into bench/gpu_wheels/
#   bash bench/gpu_check.sh [ARGS]    # on the CUDA machine, with bench/gpu_wheels/ carried; ARGS go to gpu_check.py
#
# It installs the pinned libraries (transformers 5.25 and the Hub client it needs, which a CUDA image may lack or
# hold at an older version) from those wheels into a private folder put first on PYTHONPATH, with hf-mohd from this
# checkout, records the versions, then runs bench/gpu_check.py (`python3 -m bench.gpu_check`): CUDA correctness
# (gather and sorted == masked, the sorted training step compiled as one graph, bf16-autocast training with fp32
# router logits, generate) and the benchmark ratios at a GPU-sized shape for every MoHD strategy, the fastest per mode
# named (what DEVICE_DEFAULT_PLANS in hf_mohd/models/mohd_strategies.py records; `--profile` adds the top kernels and
# the launches per decoded token); then, where vLLM is installed, bench/gpu_vllm_check.py (vLLM's native Nemotron-H, hf-mohd's vLLM plugin on
# CUDA), and says so where it is not. Any failure, including CUDA missing, exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=bench/gpu_wheels
PINS=(transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
    regex==2026.11.19 idna==3.20 click==8.5.1)
PYVER=${GPU_PYTHON_VERSION:-3.12}
if [ "${1:-}" = "--fetch" ]; then
    mkdir -p "$WHEELS"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "${PINS[@]}"
    ls -la "$WHEELS"
    exit 0
fi
ls "$WHEELS"/*.whl > /dev/null || { echo "gpu_check: no wheels in $WHEELS (run with --fetch first)"; exit 1; }
SITE=${TMPDIR:-/tmp}/hf_mohd_gpu_site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$PWD:$SITE" HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'CUDA not available'; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
OUTPUT=${OUT:-bench/results}/gpu_check.json
python3 -m bench.gpu_check --output "$OUTPUT" "$@"
echo "wrote $OUTPUT"
# vLLM's GPU paths (native Nemotron-H, the plugin on CUDA), where the machine's Python has vLLM: hf-mohd's metadata goes
# into the private folder too, so that vLLM finds the plugin's entry point (`vllm.general_plugins`)
if python3 -c "import vllm" 2> /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" --upgrade .
    VLLM_OUTPUT=${OUT:-bench/results}/gpu_vllm_check.json
    python3 -m bench.gpu_vllm_check --output "$VLLM_OUTPUT"
    echo "wrote $VLLM_OUTPUT"
else
    echo "gpu_check: this machine's Python has no vLLM: the vLLM checks (bench/gpu_vllm_check.py) did not run"
fi
