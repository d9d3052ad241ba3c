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
"""Compiled batch-1 decoding: MoHD and LlamaForCausalLM, eager vs `torch.compile(fullgraph=True)`, static cache.

The models are those of `bench_mohd_decode.py` (fixed bench shape, saved and reloaded with `from_pretrained`). Each
decodes greedily on a `StaticCache`: the prompt eagerly, then single-token steps through the eager model or through
`torch.compile(model, fullgraph=True, dynamic=False)` (compiled once, warm-up excluded), MoHD in its decoding
weight layout (block-major, as `generate` stores it; the steps call the model directly); the four variants'
repetitions run round-robin. Under compilation MoHD's few-token plan reads the blocks through index tensors
(`MoHDIndexedPlan`), not host ids. Ratios: compiled MoHD vs eager MoHD, vs compiled Llama, and eager MoHD vs
eager Llama, on the process CPU clock by default.

    python -m bench.bench_mohd_compiled --reps 3     # results/mohd_compiled.json
"""

import os
import tempfile
import time

import torch
from transformers import StaticCache

from bench import common
from bench.bench_mohd_decode import build_and_reload


NAMES = ("llama", "mohd")


def decode_steps(model, forward, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(wall, cpu) seconds of `new_tokens - 1` greedy single-token steps through `forward` on a static cache."""
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + new_tokens)
    with torch.no_grad():
        token = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        w0, c0 = time.perf_counter(), time.process_time()
        for step in range(new_tokens - 1):
            position = torch.tensor([[prompt.shape[1] + step]])
            logits = forward(input_ids=token, cache=cache, use_cache=True, position_ids=position).logits
            token = logits[:, -1:].argmax(-1)
        return time.perf_counter() - w0, time.process_time() - c0


def main():
    parser = common.base_arguments(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    shape = common.setup(args)
    machine = common.machine_description()
    print(f"machine: {machine}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        models, _ = build_and_reload(shape, folder)
    # what `generate` does before decoding (`MoHDForCausalLM.generate`): the timed steps call the model directly
    models["mohd"].to_weight_layout(models["mohd"].decoding_weight_layout)
    prompt = torch.randint(3, shape["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0))
    forwards, compile_s = {}, {}
    for name in NAMES:
        model = models[name]
        compiled = torch.compile(model, fullgraph=True, dynamic=False)
        start = time.perf_counter()
        decode_steps(model, compiled, prompt, 4)  # compiles
        compile_s[name] = time.perf_counter() - start
        forwards[f"{name}_eager"], forwards[f"{name}_compiled"] = (model, model), (model, compiled)
    # repetitions round-robin over the four variants, so that a drift of the machine's memory bandwidth falls on all
    timings = common.interleaved_medians(
        {
            key: (lambda m=model, f=forward: decode_steps(m, f, prompt, args.new_tokens))
            for key, (model, forward) in forwards.items()
        },
        args.reps,
    )
    results = {}
    for key, timing in timings.items():
        seconds = timing[f"{args.clock}_s"]
        results[key] = {
            "tok_s": (args.new_tokens - 1) / seconds,
            "seconds": seconds,
            "runs_s": timing[f"{args.clock}_runs"],
        }
    for name in NAMES:
        results[f"{name}_compiled"]["compile_wall_s"] = compile_s[name]
        print(name, {k: round(v["tok_s"], 1) for k, v in results.items() if k.startswith(name)}, flush=True)
    ratios = {
        "mohd_compiled_vs_mohd_eager": results["mohd_compiled"]["tok_s"] / results["mohd_eager"]["tok_s"],
        "mohd_compiled_vs_llama_compiled": results["mohd_compiled"]["tok_s"] / results["llama_compiled"]["tok_s"],
        "mohd_eager_vs_llama_eager": results["mohd_eager"]["tok_s"] / results["llama_eager"]["tok_s"],
        "llama_compiled_vs_llama_eager": results["llama_compiled"]["tok_s"] / results["llama_eager"]["tok_s"],
    }
    summary = [f"{key}: {value:.3f}x" for key, value in ratios.items()]
    print("\n".join(summary))
    payload = {
        "benchmark": "mohd_compiled_decode",
        "command": common.command_line(),
        "git_commit": common.git_commit(),
        "shape": shape,
        "clock_for_ratios": args.clock,
        "machine": machine,
        "machine_end": {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
        "results": results,
        "ratios": ratios,
        "summary": summary,
    }
    output = args.output or common.RESULTS_DIR / "mohd_compiled.json"
    common.write_results(output, payload)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
