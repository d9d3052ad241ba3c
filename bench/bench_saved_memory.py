# Copyright 2026 The hf-mohd Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Activation memory of one training step: the bytes autograd keeps for backward, MoHD against Llama.

The models of `bench_mohd` (the fixed bench shape; MoHD at the 50% compression preset, gather and masked) run one
forward with labels in training mode, in fp32 eager and under CPU bf16 autocast (as a bf16 `Trainer` run computes),
and `torch.autograd.graph.saved_tensors_hooks` adds up the distinct storages autograd keeps for backward (a tensor
saved by two ops counts once). `mohd_gather_composed` is the gather model with its single-Function products
(`MoHDGroupedLinearIn`, `MoHDGroupedLinearOut`) switched off, the composition autograd records otherwise: the
saving those Functions make. With `--compile`, `llama_compiled` and `mohd_gather_compiled` are the same models under
`torch.compile` (fp32; counted after one compiling step): there the Functions are not used, and the graph that
AOTAutograd's partitioner saves for backward is counted (the hooks see what its compiled autograd Function keeps).
Memory is counted, not timed, so the numbers do not depend on the machine's load.

    python -m bench.bench_saved_memory            # fixed shape, writes bench/results/saved_memory.json
    python -m bench.bench_saved_memory --quick    # 2 layers, batch 2 x seq 128
    python -m bench.bench_saved_memory --compile  # also the compiled models (a few minutes of compiling)
    python -m bench.bench_saved_memory --compile --breakdown  # and each fp32 count's activations by shape
"""

import argparse
import contextlib
import os
from pathlib import Path

import torch

from bench import common
from bench.bench_mohd import build_models
from hf_mohd.models import mohd_plans


def saved_storage_bytes(model, ids: torch.Tensor, autocast: bool, breakdown: dict | None = None) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward with labels of `model` on `ids`.

    `breakdown`, when given, receives the activations among them (storages that are not the model's parameters), as
    {"(shape) dtype": [storages, MiB]}: what the count is made of beyond the weights backward reads."""
    storages, activations = {}, {}
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    @torch.compiler.disable  # a hook, not model code: dynamo would otherwise compile it once per dtype
    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        if storage.data_ptr() not in parameters:
            activations[storage.data_ptr()] = (
                f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}",
                storage.nbytes(),
            )
        return tensor

    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), context:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    del loss
    if breakdown is not None:
        for key, nbytes in activations.values():
            entry = breakdown.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] = round(entry[1] + nbytes / 2**20, 2)
    return sum(storages.values())


@contextlib.contextmanager
def composed_products():
    """Within the block, the gather path's products run as autograd's composition, not as single Functions."""
    saved = mohd_plans.single_autograd_function_dtype
    mohd_plans.single_autograd_function_dtype = lambda *args: None
    try:
        yield
    finally:
        mohd_plans.single_autograd_function_dtype = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shape (2 layers, batch 2 x seq 128)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--output", type=Path, default=None, help="result JSON path")
    parser.add_argument("--compile", action="store_true", help="also count the fp32 models under torch.compile")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also list each fp32 count's activations (storages other than parameters) by shape",
    )
    args = parser.parse_args()
    shape = common.setup(args)
    models, _ = build_models(shape)
    models.pop("llama_active")
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]))
    rows, breakdowns = {}, {}
    for precision, autocast in (("fp32", False), ("bf16_autocast", True)):
        measured = {}
        for name, model in models.items():
            breakdown = breakdowns.setdefault(name, {}) if args.breakdown and not autocast else None
            measured[name] = saved_storage_bytes(model, ids, autocast, breakdown)
        with composed_products():
            measured["mohd_gather_composed"] = saved_storage_bytes(models["mohd_gather"], ids, autocast)
        rows[precision] = measured
    if args.compile:  # last: the compiled models' caches stay in memory
        for name in ("llama", "mohd_gather"):
            compiled = torch.compile(models[name])
            compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # compiles forward and backward
            models[name].zero_grad(set_to_none=True)
            breakdown = breakdowns.setdefault(f"{name}_compiled", {}) if args.breakdown else None
            rows["fp32"][f"{name}_compiled"] = saved_storage_bytes(compiled, ids, False, breakdown)
    for precision, measured in rows.items():
        rows[precision] = {
            name: {"saved_mib": round(value / 2**20, 1), "x_llama": round(value / measured["llama"], 3)}
            for name, value in measured.items()
        }
        for name, row in rows[precision].items():
            print(f"{precision:14s} {name:22s} {row['saved_mib']:9.1f} MiB  {row['x_llama']:.3f}x llama", flush=True)
    payload = {
        "command": common.command_line(),
        "commit": common.git_commit(),
        "shape": shape,
        "what": "bytes of the distinct storages autograd keeps for backward in one training forward (with labels)",
        "saved": rows,
        "fp32_activations_by_shape": {
            name: {
                "total_mib": round(sum(mib for _, mib in parts.values()), 1),
                "parts": dict(sorted(parts.items(), key=lambda item: -item[1][1])),
            }
            for name, parts in breakdowns.items()
        },
        "machine": common.machine_description(),
        "machine_end": {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
    }
    output = args.output or common.RESULTS_DIR / ("saved_memory_quick.json" if args.quick else "saved_memory.json")
    common.write_results(output, payload)
    for name, entry in payload["fp32_activations_by_shape"].items():
        largest = ", ".join(f"{key} x{count} {mib} MiB" for key, (count, mib) in list(entry["parts"].items())[:6])
        print(f"fp32 activations {name:22s} {entry['total_mib']:9.1f} MiB: {largest}")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
