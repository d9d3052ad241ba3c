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
"""vLLM on a GPU: the paths the CPU build cannot run (run by gpu_check.sh where the machine's Python has vLLM).

Checks (each raises when it fails):
1. Native Nemotron-H: a LatentMoE model in the Nemotron-H form (non-gated relu2 experts, sigmoid routing, no
   positional embedding, a shared expert, latent width) exported with `export_to_nemotron_h` and served by vLLM's
   own `NemotronHForCausalLM` (vLLM's CPU build refuses its non-gated fused MoE); greedy tokens equal transformers'.
2. The hf-mohd plugin on CUDA: MoHD (uniform budgets) and LatentMoE (latent width, per-layer expert shapes) from
   their folders; greedy tokens equal transformers'; LatentMoE's routed experts run in vLLM's fused MoE.
Models are tiny (hidden 256, 4 heads of 64, 2 layers, vocab 256) with spread weights, so that greedy choices are
clear; 8 prompts of different lengths go to the engine together; float32, eager and with vLLM's default compile.

    python3 -m bench.gpu_vllm_check --output gpu_vllm_check.json
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.vllm_runner import run_vllm
from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM, MoHDConfig, MoHDForCausalLM
from hf_mohd.interop import export_to_nemotron_h


SHAPE = dict(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
NEW_TOKENS = 8
ENGINE = dict(dtype="float32", max_model_len=128, gpu_memory_utilization=0.3, max_num_seqs=8)


def models() -> dict:
    """{name: model} of the checks, weights drawn with std 0.15 so that greedy choices are clear."""
    latent = dict(SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, moe_latent_size=64)
    built = {
        "nemotron_form": LatentMoEForCausalLM(
            LatentMoEConfig(
                **latent,
                moe_shared_expert_intermediate_size=128,
                mlp_gated=False,
                hidden_act="relu2",
                router_score_func="sigmoid",
                position_embedding_type="none",
            )
        ),
        "latent": LatentMoEForCausalLM(
            LatentMoEConfig(**latent, per_layer_config={1: {"num_experts": 6, "moe_intermediate_size": 48}})
        ),
        "mohd": MoHDForCausalLM(
            MoHDConfig(
                **SHAPE, intermediate_size=512, num_sub_dims=16, num_shared_sub_dims=6, num_routed_sub_dims_per_tok=2
            )
        ),
    }
    torch.manual_seed(0)
    with torch.no_grad():
        for model in built.values():
            for parameter in model.parameters():
                if parameter.dim() >= 2:
                    parameter.normal_(0.0, 0.15)
    return {name: model.eval() for name, model in built.items()}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (1, 3, 6, 10, 17, 25, 38, 50)]


def greedy(model) -> list[list[int]]:
    """transformers' greedy tokens of each prompt alone (float32, CPU)."""
    out = []
    for ids in prompts():
        sequence = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        out.append(sequence[0, len(ids) :].tolist())
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None, help="JSON result path")
    args = parser.parse_args()
    built = models()
    with tempfile.TemporaryDirectory() as workdir:
        folders = {name: Path(workdir) / name for name in built}
        for name, model in built.items():
            model.save_pretrained(folders[name])
        export_to_nemotron_h(built["nemotron_form"], Path(workdir) / "nemotron_h")
        served = {"nemotron_h": "nemotron_form", "latent": "latent", "mohd": "mohd"}
        runs = [
            {
                "name": f"{name}_{mode}",
                "model": str(Path(workdir) / name),
                "engine": {**ENGINE, "enforce_eager": mode == "eager"},
                "prompts": prompts(),
                "sampling": {"max_tokens": NEW_TOKENS, "ignore_eos": True},
                "modules": ".layers.",
            }
            for name in served
            for mode in ("eager", "compiled")
        ]
        results = run_vllm(runs, Path(workdir), timeout=1200, python="python3")
    report, failures = {}, []
    for name, source in served.items():
        want = greedy(built[source])
        for mode in ("eager", "compiled"):
            result = results[f"{name}_{mode}"]
            if "error" in result:
                failures.append(f"{name} ({mode}): {result['error']}")
                continue
            got = [out["token_ids"] for out in result["outputs"]]
            modules = result["modules"]
            report[f"{name}_{mode}"] = {"tokens_equal": got == want, "modules": modules}
            if got != want:
                failures.append(f"{name} ({mode}): vLLM {got} != transformers {want}")
    # the path each model ran: vLLM's fused MoE (natively, or fed the model's routes by the plugin), MoHD's linears
    expected_types = {"nemotron_h": "FusedMoE", "latent": "TransformersMoERunner", "mohd": "Linear"}
    for name, entry in report.items():
        wanted = expected_types[name.rsplit("_", 1)[0]]
        if not any(wanted in kind for kind in entry["modules"].values()):
            failures.append(f"{name}: no {wanted} module in its layers: {sorted(set(entry['modules'].values()))}")
    if args.output:
        Path(args.output).write_text(json.dumps({"report": report, "failures": failures}, indent=2))
    if failures:
        raise SystemExit("gpu_vllm_check failed:\n" + "\n".join(failures))
    print("gpu_vllm_check: all checks passed")


if __name__ == "__main__":
    main()
