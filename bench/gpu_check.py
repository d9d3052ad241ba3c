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
"""CUDA correctness checks and GPU-sized benchmark ratios for both families, in one short run (run by gpu_check.sh).

Checks (each raises, never skips, when it fails):
1. MoHD "gather" and "sorted" (chosen by name) == masked on CUDA: logits and every gradient, float64 (no top-k
   ties), prefill and one-token decode.
2. The sorted strategy's training step compiles as one graph and equals eager (fp32).
3. LatentMoE grouped_mm, dense_masked and gather == eager experts on CUDA (fp32, tolerance 1e-4).
4. A few AdamW steps of both families under bf16 autocast: finite decreasing loss, router logits recorded in fp32.
5. `generate` on CUDA: greedy with the default cache == greedy without cache (float64), and a static cache.
Benchmarks (CUDA events, medians of `--reps`): MoHD `compression_50` vs LlamaForCausalLM of the same width at
hidden 2048 (prefill B8 x T1024 in bf16, a bf16-autocast training step, batch-1 and batch-8 greedy `generate` of 32
tokens in bf16, batch-1 with a static cache, whose decoding step `generate` compiles), each MoHD mode with every
strategy of `STRATEGIES` (the device's default plans, "gather", "sorted", "masked") and the fastest named, which is
what `DEVICE_DEFAULT_PLANS` records for the device; with `--profile` the top device operators and the kernel
launches per decoded token; and LatentMoE vs the standard MoE at equal activated MACs (prefill). Results go to
`--output` (JSON) and stdout.

    python -m bench.gpu_check --output gpu_check.json          # CUDA required
    python -m bench.gpu_check --device cpu --quick             # smoke run of the same code on a CPU
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_mohd
from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM, MoHDConfig, MoHDForCausalLM
from hf_mohd.models import mohd_strategies
from hf_mohd.versions import library_versions


def tiny_mohd(device, dtype, **overrides) -> tuple[MoHDForCausalLM, MoHDForCausalLM]:
    """(gather, masked) with the same weights: spread routers, perturbed fusion."""
    fields = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_sub_dims=8,
        num_shared_sub_dims=3,
        num_routed_sub_dims_per_tok=2,
        max_position_embeddings=128,
    )
    fields.update(overrides)
    torch.manual_seed(0)
    gather = MoHDForCausalLM(MoHDConfig(**fields, sparse_implementation="gather"))
    with torch.no_grad():
        for name, param in gather.named_parameters():
            if "router" in name:
                param.normal_(0, 0.5)
            elif "group_fusion" in name:
                param.add_(0.1 * torch.randn_like(param))
    masked = MoHDForCausalLM(MoHDConfig(**fields, sparse_implementation="masked"))
    masked.load_state_dict(gather.state_dict())
    return gather.to(device, dtype), masked.to(device, dtype)


def check_strategies_equal_masked(device) -> dict:
    """Each fast strategy chosen by name ("gather": index tensors for few tokens, per-slot grouped products for many;
    "sorted": one sort of the pairs, no atomics) against masked on `device`, float64: logits and every gradient of a
    22-token prefill and of one token; the max |logit difference| per strategy and input."""
    fast, masked = tiny_mohd(device, torch.float64)
    ids = torch.randint(3, 97, (2, 11), device=device)
    results = {}
    for strategy in ("gather", "sorted"):
        fast.set_sparse_implementation(strategy)  # by name: its own plans, not the device's defaults
        for label, inputs in (("prefill", ids), ("one_token", ids[:1, :1])):
            grads = []
            for model in (fast, masked):
                model.zero_grad(set_to_none=True)
                out = model(input_ids=inputs, use_cache=False, output_router_logits=True)
                (out.logits.square().mean() + out.aux_loss).backward()
                grads.append((out.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
            (logits_g, grads_g), (logits_m, grads_m) = grads
            torch.testing.assert_close(logits_g, logits_m, rtol=1e-10, atol=1e-10)
            assert grads_g.keys() == grads_m.keys(), f"{strategy} and masked differ in which parameters get gradients"
            for name in grads_g:
                torch.testing.assert_close(grads_g[name], grads_m[name], rtol=1e-9, atol=1e-10, msg=name)
            results[f"{strategy} {label}"] = float((logits_g - logits_m).abs().max().detach())
    return results


def check_sorted_compiles_as_one_graph(device) -> dict:
    """The sorted strategy's training step (fp32, 64 tokens: its many-token plan) traced by dynamo as one graph, and
    `torch.compile`'s loss and gradients equal eager's on `device`."""
    compiled_model, eager = (tiny_mohd(device, torch.float32)[0].train() for _ in range(2))
    for model in (compiled_model, eager):
        model.set_sparse_implementation("sorted")
    ids = torch.randint(3, 97, (4, 16), device=device)
    explained = torch._dynamo.explain(compiled_model)(input_ids=ids, labels=ids, use_cache=False)
    assert explained.graph_count == 1, [str(reason.reason) for reason in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, fullgraph=True)
    losses = []
    for run in (compiled, eager):
        loss = run(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(float(loss))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, got), want in zip(compiled_model.named_parameters(), eager.parameters(), strict=True):
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)
    return {"graphs": explained.graph_count, "loss": losses}


def tiny_latent_moe(device, **overrides) -> LatentMoEForCausalLM:
    """A seeded two-layer LatentMoE (8 experts, top-2, latent width 32) on `device`."""
    fields = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_latent_size=32,
    )
    torch.manual_seed(0)
    return LatentMoEForCausalLM(LatentMoEConfig(**{**fields, **overrides})).to(device)


def check_latent_moe_kernels(device) -> dict:
    """Every fast experts kernel against the eager loop on `device`, fp32: max |logit difference| per kernel (the
    default "gather" takes its dense masked form on an accelerator with K >= E / 2: top-4 of 8 here)."""
    differences = {}
    for top_k in (2, 4):
        model = tiny_latent_moe(device, num_experts_per_tok=top_k).eval()
        ids = torch.randint(3, 97, (2, 16), device=device)
        with torch.no_grad():
            model.set_experts_implementation("eager")
            reference = model(input_ids=ids).logits
            for kernel in ("grouped_mm", "dense_masked", "gather"):
                model.set_experts_implementation(kernel)
                fast = model(input_ids=ids).logits
                torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-4)
                differences[f"{kernel} top-{top_k}"] = float((fast - reference).abs().max())
    return differences


def check_bf16_autocast_training(device) -> dict:
    results = {}
    for family in ("mohd", "latent_moe"):
        if family == "mohd":
            model = tiny_mohd(device, torch.float32)[0]
        else:
            model = tiny_latent_moe(device, router_score_func="sigmoid")
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ids = torch.randint(3, 97, (4, 32), device=device, generator=None)
        losses = []
        for _ in range(5):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(input_ids=ids, labels=ids, output_router_logits=True)
            assert all(logits.dtype == torch.float32 for logits in out.router_logits), (
                f"{family}: router logits not fp32 under bf16 autocast: {[t.dtype for t in out.router_logits]}"
            )
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if hasattr(model, "update_router_biases"):
                model.update_router_biases()
            losses.append(float(out.loss))
        assert all(torch.isfinite(torch.tensor(losses))), f"{family}: non-finite loss {losses}"
        assert losses[-1] < losses[0], f"{family}: loss did not decrease over 5 steps: {losses}"
        results[family] = losses
    return results


def check_generate(device) -> dict:
    gather = tiny_mohd(device, torch.float64)[0].eval()
    prompt = torch.randint(3, 97, (1, 5), device=device)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    cached = gather.generate(prompt, **kwargs)
    uncached = gather.generate(prompt, use_cache=False, **kwargs)
    static = gather.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(cached, uncached), f"cached {cached.tolist()} != uncached {uncached.tolist()}"
    assert torch.equal(cached, static), f"dynamic cache {cached.tolist()} != static cache {static.tolist()}"
    return {"tokens": cached[0].tolist()}


def timed(fn, device, reps: int) -> float:
    """Median seconds of `fn` over `reps` runs after two warm-ups (CUDA events on a GPU, process clock on a CPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
    return statistics.median(times)


def kernel_profile(fn, device, top: int = 12) -> dict:
    """The `top` operators of one call of `fn` by self device time (torch profiler; CPU time on a CPU), with their
    call counts (where the time of a ratio goes), and the number of operator calls that ran on the device (kernel
    launches, on a GPU)."""
    fn()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    events = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:top]
    rows = [{"op": e.key, "calls": e.count, "self_ms": getattr(e, key) / 1e3} for e in events]
    for row in rows:
        print(f"    {row['self_ms']:9.3f} ms  {row['calls']:6d}x  {row['op'][:90]}")
    device_calls = sum(e.count for e in averages if e.self_device_time_total > 0)
    print(f"    {device_calls} operator calls on the device")
    return {"top": rows, "device_calls": device_calls}


# The MoHD strategies each mode is timed with: "default", the plans of a model built from its config on this device
# (`DEVICE_DEFAULT_PLANS`), and the registered strategies chosen by name
STRATEGIES = ("default", "gather", "sorted", "masked")


def use_strategy(model, strategy: str) -> None:
    """Sets `model`'s MoHD strategy: "default" rebuilds the config's (device defaults on), any other name is chosen
    as a user chooses it (`set_sparse_implementation`: its own plans on every device)."""
    model.set_sparse_implementation(model.config.sparse_implementation if strategy == "default" else strategy)
    if strategy == "default":
        for module in model.modules():
            if hasattr(getattr(module, "strategy", None), "device_defaults"):
                module.strategy.device_defaults = True


def benchmark(device, quick: bool, reps: int, profile: bool = False) -> dict:
    hidden = 256 if quick else 2048
    base = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=2 if quick else 8,
        num_attention_heads=hidden // 64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    batch, seq = (2, 128) if quick else (8, 1024)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    llama = LlamaForCausalLM(base).to(device, dtype)
    mohd = MoHDForCausalLM(MoHDConfig.from_llama_config(base, "compression_50", attn_implementation="sdpa"))
    mohd = mohd.to(device, dtype)
    ids = torch.randint(3, 32000, (batch, seq), device=device)
    new_tokens = 32
    out = {
        "shape": {"hidden": hidden, "layers": base.num_hidden_layers, "batch": batch, "seq": seq},
        "device_default_plans": mohd_strategies.DEVICE_DEFAULT_PLANS.get(device.type),
    }

    def prefill(model):
        def run():
            with torch.inference_mode():
                model(input_ids=ids, use_cache=False)

        return run

    def train_step(model):
        model.train()

        def run():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = model(input_ids=ids[:, : seq // 2], labels=ids[:, : seq // 2], use_cache=False).loss
            loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    def decoder(batch_size: int, static: bool = False):
        def decode(model):
            model.eval()
            prompt = ids[:batch_size, :32]
            # a static cache: `generate` compiles the decoding step (fullgraph) where the device supports it
            cache = {"cache_implementation": "static"} if static else {}

            def run():
                with torch.inference_mode():
                    model.generate(
                        prompt,
                        max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens,
                        do_sample=False,
                        pad_token_id=0,
                        **cache,
                    )

            return run

        return decode

    modes = {
        "prefill": (prefill, STRATEGIES),
        "train": (train_step, STRATEGIES),
        "decode_generate_32": (decoder(1), STRATEGIES),
        "decode_batch8_generate_32": (decoder(8), STRATEGIES),
        "decode_static_compiled_32": (decoder(1, static=True), ("default", "sorted")),
    }
    for mode, (make, strategies) in modes.items():
        llama_s = timed(make(llama), device, reps)
        times = {}
        for strategy in strategies:
            use_strategy(mohd, strategy)
            times[strategy] = timed(make(mohd), device, reps)
        use_strategy(mohd, "default")
        best = min(times, key=times.get)
        out[mode] = {
            "llama_s": llama_s,
            "mohd_s": times,
            "mohd_speedup_vs_llama": {strategy: llama_s / seconds for strategy, seconds in times.items()},
            "fastest_strategy": best,
        }
        cells = "  ".join(
            f"{strategy} {seconds * 1e3:8.2f} ms ({llama_s / seconds:.3f}x)" for strategy, seconds in times.items()
        )
        print(f"{mode:26s} llama {llama_s * 1e3:8.2f} ms  mohd: {cells}  fastest: {best}")
    if profile:
        out["profile"] = {}
        for name, model, strategy, make in (
            ("llama_prefill", llama, None, prefill),
            ("mohd_default_prefill", mohd, "default", prefill),
            ("mohd_sorted_prefill", mohd, "sorted", prefill),
            ("mohd_sorted_train", mohd, "sorted", train_step),
            ("llama_decode", llama, None, decoder(1)),
            ("mohd_default_decode", mohd, "default", decoder(1)),
        ):
            if strategy is not None:
                use_strategy(mohd, strategy)
            print(f"  profile {name}:")
            out["profile"][name] = kernel_profile(make(model), device)
            if "decode" in name:
                out["profile"][name]["device_calls_per_token"] = out["profile"][name]["device_calls"] / new_tokens
        use_strategy(mohd, "default")
    del llama, mohd
    standard = LatentMoEConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=base.num_hidden_layers,
        num_attention_heads=hidden // 64,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden,
        moe_latent_size=None,
        attn_implementation="sdpa",
    )
    latent = LatentMoEConfig(
        **{**standard.to_dict(), "num_experts": 64, "num_experts_per_tok": 8, "moe_latent_size": hidden // 4},
    )
    for name, config in (("standard_moe", standard), ("latent_moe", latent)):
        torch.manual_seed(0)
        model = LatentMoEForCausalLM(config).to(device, dtype)
        out.setdefault("latent_moe_prefill", {})[name] = timed(prefill(model), device, reps)
        del model
    times = out["latent_moe_prefill"]
    times["latent_vs_standard"] = times["standard_moe"] / times["latent_moe"]
    print(f"latent_moe prefill vs standard MoE: {times['latent_vs_standard']:.3f}x")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default; required to be available) or cpu (smoke)")
    parser.add_argument("--quick", action="store_true", help="small benchmark shape")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--output", default=None, help="JSON result path")
    parser.add_argument("--profile", action="store_true", help="also the top operators of each model's prefill")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: CUDA is not available to this torch build; nothing was checked (exit 1)")
    device = torch.device(args.device)
    versions = {
        **library_versions(),
        "cuda": torch.version.cuda,
        "hf_mohd": getattr(hf_mohd, "__version__", "source"),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
    }
    print(json.dumps(versions))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    results = {"versions": versions}
    for name, check in (
        ("strategies_equal_masked", check_strategies_equal_masked),
        ("sorted_compiles_as_one_graph", check_sorted_compiles_as_one_graph),
        ("latent_moe_kernels_equal_eager", check_latent_moe_kernels),
        ("bf16_autocast_training", check_bf16_autocast_training),
        ("generate", check_generate),
    ):
        results[name] = check(device)
        print(f"check {name}: ok {results[name]}", flush=True)
    results["benchmark"] = benchmark(device, args.quick, args.reps, args.profile)
    results["load_average_1_5_15"] = list(os.getloadavg())
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(results, handle, indent=2)
    print("gpu_check: all checks passed")


if __name__ == "__main__":
    main()
