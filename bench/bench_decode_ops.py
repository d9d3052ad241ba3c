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
"""Operator count of one decoding step: the ops MoHD dispatches per generated token against Llama's.

On the user's path of `bench_mohd_decode` (the models saved and reloaded with `from_pretrained`, greedy `generate`
at batch 1, the fixed bench shape), `torch.profiler` records two `generate` calls of 4 and 12 new tokens after the
same 64-token prompt; the difference of their top-level op counts (aten's and this package's native `native_gather` ops,
not called from inside another such op)
over the 8 extra steps is the count per decoding step, everything in it: the decoder layers, the LM head and
`generate`'s own work, which is the same for both models. Per layer = per step / num_hidden_layers. The most
frequent ops are listed. A count, not a timing: the machine's load does not change it, but each op costs dispatch
time (one to a few microseconds on CPU) whatever it computes.

    python -m bench.bench_decode_ops            # fixed shape, writes bench/results/decode_ops.json
"""

import argparse
import collections
import os
import tempfile
from pathlib import Path

import torch

from bench import common
from bench.bench_mohd_decode import build_and_reload


PROMPT_TOKENS = 64
SHORT, LONG = 4, 12


def top_level_ops(model, prompt: torch.Tensor, new_tokens: int) -> collections.Counter:
    """Counter of the top-level dispatched ops of one greedy `generate` of `new_tokens` tokens after `prompt`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return collections.Counter(event.name for event in common.top_level_op_events(profile))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shape (2 layers)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--output", type=Path, default=None, help="result JSON path")
    args = parser.parse_args()
    shape = common.setup(args)
    prompt = torch.randint(3, shape["vocab_size"], (1, PROMPT_TOKENS))
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        models, _ = build_and_reload(shape, folder)
        for name in ("llama", "mohd"):
            model = models[name]
            with torch.inference_mode():
                model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
                short, long = (top_level_ops(model, prompt, n) for n in (SHORT, LONG))
            per_step = {op: (long[op] - short.get(op, 0)) / (LONG - SHORT) for op in long}
            total = sum(per_step.values())
            rows[name] = {
                "ops_per_step": total,
                "ops_per_layer": total / shape["num_hidden_layers"],
                "most_frequent_per_step": dict(sorted(per_step.items(), key=lambda item: -item[1])[:25]),
            }
            print(f"{name:6s} {total:7.1f} ops per step, {rows[name]['ops_per_layer']:6.1f} per layer", flush=True)
    ratio = rows["mohd"]["ops_per_step"] / rows["llama"]["ops_per_step"]
    print(f"mohd / llama: {ratio:.2f}x")
    payload = {
        "command": common.command_line(),
        "commit": common.git_commit(),
        "shape": shape,
        "what": f"top-level dispatched ops (aten and native_gather) per greedy decoding step (generate of {LONG} minus {SHORT} new tokens)",
        "models": rows,
        "mohd_over_llama": ratio,
        "machine": common.machine_description(),
        "machine_end": {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
    }
    output = args.output or common.RESULTS_DIR / ("decode_ops_quick.json" if args.quick else "decode_ops.json")
    common.write_results(output, payload)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
