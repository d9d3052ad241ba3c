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
"""MoHD's prepacked oneDNN plans in vLLM's CPU build, by tokens per step, against the dense product Llama runs there.

Runs with the Python of `.venv-vllm` (vLLM's CPU operators exist only there):

    .venv-vllm/bin/python -m bench.bench_vllm_mohd_plans --output bench/results/<cpu>/vllm_mohd_plans.json

For the bench shape's two input sides (q/k/v: 1024 -> 3072; gate/up: 1024 -> 5632) and output sides (o_proj:
1024 -> 1024; down_proj: 2816 -> 1024) at `compression_50` (16 blocks of 64, 6 shared, 2 routed picked of 10), and M
tokens with random routes, times `hf_mohd_vllm::mohd_onednn_in` / `_out` with each plan forced (per token, dense,
sorted by block; `vllm_mohd_cpu.DENSE_TOKENS` set for the call) and the prepacked dense product of the same weight
(`_C::onednn_mm`, what vLLM's Llama runs): wall-clock medians over `--reps` rounds, each round cycling over
`--weights` distinct weight sets (8 x 23 MiB for gate/up: more than the L3 cache, as in a served model whose layers
follow each other), with vLLM's thread count (both cores). Prints the ratio dense / plan per side, M and plan (above
1: the plan is faster than Llama's product) and the plan `DENSE_TOKENS` picks.
"""

import argparse
import json
import os
import statistics
import time

import torch
from vllm import _custom_ops as ops

from bench import common
from hf_mohd.interop import vllm_mohd_cpu
from hf_mohd.models.mohd_geometry import MoHDSubDimGeometry


GEOMETRY = MoHDSubDimGeometry(num_sub_dims=16, num_shared=6, num_routed=10, top_k=2, block=64)
# side -> (input width, output width) of the fused weight: input sides D -> sum of out, output sides in -> D
SIDES = {"qkv_in": (1024, 3072), "gate_up_in": (1024, 5632), "o_out": (1024, 1024), "down_out": (2816, 1024)}
# plan -> the `DENSE_TOKENS` range (either side) that forces it for every M >= 1
FORCED = {"per_token": (10**9, 10**9), "dense": (1, 10**9), "sorted": (0, 0)}


def packed_side(side: str, generator: torch.Generator):
    """One weight set of `side`: the operator's handlers (and their owners) and the dense product's handler."""
    width_in, width_out = SIDES[side]
    spans = vllm_mohd_cpu.block_spans(GEOMETRY)
    if side.endswith("_in"):  # weight^T (D, out): row spans
        weight_t = torch.randn(width_in, width_out, generator=generator)
        handlers = vllm_mohd_cpu.prepack([weight_t[a:b] for a, b in spans])
    else:  # W_o (D, in): row spans of W_o, columns of W_o^T
        weight = torch.randn(width_out, width_in, generator=generator)
        weight_t = weight.t()
        handlers = vllm_mohd_cpu.prepack([weight[a:b].t() for a, b in spans])
    return handlers, ops.create_onednn_mm(weight_t, vllm_mohd_cpu.PRIMITIVE_CACHE)


def time_rounds(call, count: int, reps: int) -> float:
    """Median seconds per call of `call(i)` over `reps` rounds of i = 0..count-1, after one untimed round."""
    for i in range(count):
        call(i)
    rounds = []
    for _ in range(reps):
        start = time.perf_counter()
        for i in range(count):
            call(i)
        rounds.append((time.perf_counter() - start) / count)
    return statistics.median(rounds)


def time_side(side: str, weights: list, m: int, generator: torch.Generator, reps: int) -> dict:
    """The dense product's and each forced plan's milliseconds on `side` for `m` tokens with random routes, the
    speed-up of each plan over the dense product and the plan `DENSE_TOKENS` chooses."""
    g, (width_in, width_out) = GEOMETRY, SIDES[side]
    x = torch.randn(m, width_in, generator=generator)
    ids = torch.rand(m, g.num_routed, generator=generator).argsort(dim=1)[:, : g.top_k] + g.num_shared
    out = torch.empty(m, width_out)

    def dense(i):
        torch.ops._C.onednn_mm(out, x, None, weights[i][1].handler_tensor)

    def operator(i):
        handlers = weights[i][0][0]
        if side.endswith("_in"):
            return torch.ops.hf_mohd_vllm.mohd_onednn_in(x, ids, handlers, g.num_shared, g.block, width_out)
        return torch.ops.hf_mohd_vllm.mohd_onednn_out(x, ids, handlers, g.num_sub_dims, g.num_shared, g.block)

    dense_seconds = time_rounds(dense, len(weights), reps)
    row = {"dense_ms": dense_seconds * 1e3}
    chosen = vllm_mohd_cpu.DENSE_TOKENS
    try:
        for plan, forced in FORCED.items():
            vllm_mohd_cpu.DENSE_TOKENS = {"in": forced, "out": forced}
            seconds = time_rounds(operator, len(weights), reps)
            row[f"{plan}_ms"], row[f"{plan}_speedup"] = seconds * 1e3, dense_seconds / seconds
    finally:
        vllm_mohd_cpu.DENSE_TOKENS = chosen
    row["chosen"] = vllm_mohd_cpu.plan_of(m, "in" if side.endswith("_in") else "out")
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 1024])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--weights", type=int, default=8)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    machine = common.machine_description()
    print(f"machine: {machine}", flush=True)
    generator = torch.Generator().manual_seed(0)
    g = GEOMETRY
    results = {}
    with torch.no_grad():
        for side in SIDES:
            weights = [packed_side(side, generator) for _ in range(args.weights)]
            results[side] = {}
            for m in args.tokens:
                row = time_side(side, weights, m, generator, args.reps)
                results[side][m] = row
                speedups = ", ".join(f"{plan} {row[f'{plan}_speedup']:.2f}x" for plan in FORCED)
                print(f"{side:11s} M={m:5d}: dense {row['dense_ms']:.3f} ms; {speedups}; chosen {row['chosen']}")
    payload = {
        "benchmark": "vllm_mohd_plans",
        "command": common.command_line(),
        "git_commit": common.git_commit(),
        "machine": machine,
        "machine_end": {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
        "settings": {"geometry": g._asdict(), "sides": SIDES, "reps": args.reps, "weights": args.weights},
        "dense_tokens": vllm_mohd_cpu.DENSE_TOKENS,
        "results": results,
    }
    if args.output:
        common.write_results(args.output, payload)
        print(f"wrote {args.output}")
    else:
        print(json.dumps(payload, indent=1)[:2000])


if __name__ == "__main__":
    main()
