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
"""MoHD decoding on the user's path vs LlamaForCausalLM: save, `from_pretrained`, `generate` (greedy, default cache).

Models (fixed bench shape of `common.BENCH_SHAPE`, MoHD `compression_50` preset, fp32, sdpa):
- `llama`: `LlamaForCausalLM` of the same total width, the baseline of every ratio.
- `mohd`: `MoHDForCausalLM` as a user gets it from `from_pretrained` (gather path; `generate` stores its input-side
  weights block-major before decoding).
- `mohd_row_major`: the same checkpoint after `to_weight_layout("row_major")` (the plain `nn.Linear` layout), for
  reference.
- `mohd_union`, `mohd_per_block`: the same checkpoint with `set_small_batch_plan("union")` / `("per_block")`, the
  two forms `mohd`'s "auto" chooses between for 2-8 tokens (the same as `mohd` at batch 1); the choice this machine
  made is stored as `small_batch_plan_auto`.
- `mohd_torch_path`: the same checkpoint with `set_native_token_plan(False)`: one decoded token through the torch
  form of `MoHDTokenPlan` instead of its native operators, the same everywhere else.
- `llama_active`: `LlamaForCausalLM` at the activated width (hidden 512): what a dense model reading MoHD's active
  width achieves per byte on this machine.

Each model is saved with `save_pretrained` and reloaded with `AutoModelForCausalLM.from_pretrained`; decoding is
`model.generate(prompt, max_new_tokens=N, min_new_tokens=N, do_sample=False)`. A logits processor records the clock
at every step, so the decode time excludes the prefill: (N - 1) steps between the first and the last call. Also:
- batch sweep: batch 1, 2, 4, 8 (prompts of equal length, no padding), tokens/s = batch * (N - 1) / time;
- speculative verification: one forward of 4, 6, 8 draft tokens on top of a 32-token cache (what assisted and
  prompt-lookup decoding run per step); time per verified token.
Ratios are medians over `--reps` repetitions (4 x `--reps` for verification, one forward each) after one warm-up,
on the process CPU clock by default (`--clock`); the models' repetitions run round-robin (`common.interleaved_medians`), and
every repetition is stored.
Ceiling: weight bytes read per decoded token (activated decoder weights plus the LM head, fp32) from
`model_accounting(...).decode_weight_bytes_per_token`; a model's fraction of its ceiling is its speedup over Llama
divided by its byte ratio to Llama.

    python -m bench.bench_mohd_decode --reps 5          # results/mohd_decode.json and .png
    python -m bench.bench_mohd_decode --quick           # 2 layers, development only
"""

import os
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import hf_mohd  # noqa: F401  (registers "mohd" with the Auto classes)
from bench import common
from bench.bench_mohd import PRESET, llama_config
from hf_mohd import MoHDConfig, MoHDForCausalLM
from hf_mohd.models.accounting import model_accounting
from hf_mohd.models.mohd_strategies import small_gemms_compute_bound


MODELS = ("llama", "mohd", "mohd_row_major", "mohd_union", "mohd_per_block", "mohd_torch_path", "llama_active")
BATCHES = (1, 2, 4, 8)
DRAFT_TOKENS = (4, 6, 8)
TARGETS = {"batch1_goal": 1.37, "batch1_floor": 1.15, "fraction_vs_llama_active": 0.90, "small_batch_floor": 0.97}


class StepClock(LogitsProcessor):
    """Records (wall, process CPU) time at every decoding step of `generate`; changes no score."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append((time.perf_counter(), time.process_time()))
        return scores


def build_and_reload(shape: dict, folder: str) -> tuple[dict, dict]:
    """Builds the models, saves each and reloads it with `AutoModelForCausalLM.from_pretrained` (the user's path)."""
    base = llama_config(shape)
    configs = {
        "llama": base,
        "mohd": MoHDConfig.from_llama_config(base, PRESET, attn_implementation="sdpa"),
        "llama_active": llama_config(shape, hidden_size=shape["hidden_size"] // 2),
    }
    built = {
        "llama": LlamaForCausalLM(configs["llama"]),
        "mohd": MoHDForCausalLM(configs["mohd"]),
        "llama_active": LlamaForCausalLM(configs["llama_active"]),
    }
    models = {}
    for name, model in built.items():
        path = os.path.join(folder, name)
        model.save_pretrained(path)
        models[name] = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    del built
    models["mohd_row_major"] = AutoModelForCausalLM.from_pretrained(
        os.path.join(folder, "mohd"), attn_implementation="sdpa"
    ).eval()
    models["mohd_row_major"].to_weight_layout("row_major")
    configs["mohd_row_major"] = configs["mohd"]
    for plan in ("union", "per_block"):
        name = f"mohd_{plan}"
        models[name] = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "mohd"), attn_implementation="sdpa")
        models[name].eval().set_small_batch_plan(plan)
        configs[name] = configs["mohd"]
    models["mohd_torch_path"] = AutoModelForCausalLM.from_pretrained(
        os.path.join(folder, "mohd"), attn_implementation="sdpa"
    ).eval()
    models["mohd_torch_path"].set_native_token_plan(False)
    configs["mohd_torch_path"] = configs["mohd"]
    return models, configs


def time_generate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(wall, cpu) seconds of the `new_tokens - 1` decode steps of one greedy `generate` call."""
    clock = StepClock()
    with torch.inference_mode():
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
    (w0, c0), (w1, c1) = clock.times[0], clock.times[-1]
    return w1 - w0, c1 - c0


def time_verification(model, prompt: torch.Tensor, draft: torch.Tensor) -> tuple[float, float]:
    """(wall, cpu) seconds of one forward of `draft` (1, T) tokens on top of a fresh cache of the prompt."""
    with torch.inference_mode():
        cache = model(input_ids=prompt, use_cache=True).cache
        w0, c0 = time.perf_counter(), time.process_time()
        model(input_ids=draft, cache=cache, use_cache=True)
        return time.perf_counter() - w0, time.process_time() - c0


def main():
    parser = common.base_arguments(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per call (default 32)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    args = parser.parse_args()
    shape = common.setup(args)
    clock = f"{args.clock}_s"
    machine = common.machine_description()
    print(f"machine: {machine}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        models, configs = build_and_reload(shape, folder)
    layout = models["mohd"].model.layers[0].self_attn.q_proj.weight.stride()
    print(
        f"mohd q_proj stride after from_pretrained: {layout} (contiguous; generate makes it block-major)", flush=True
    )
    compute_bound = small_gemms_compute_bound(torch.float32, torch.get_num_threads())
    auto_plan = "per_block" if compute_bound else "union"
    print(f"small-batch plan chosen by 'auto' here: {auto_plan} (few-row products compute-bound: {compute_bound})")
    weight_bytes = {
        name: model_accounting(cfg, context_length=args.prompt).decode_weight_bytes_per_token(4)
        for name, cfg in configs.items()
    }
    generator = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    steps = args.new_tokens - 1
    results = {"generate": {}, "verify": {}}
    for batch in BATCHES:
        prompt = torch.randint(3, vocab, (batch, args.prompt), generator=generator)
        fns = {name: (lambda m=models[name], p=prompt: time_generate(m, p, args.new_tokens)) for name in MODELS}
        row = results["generate"][str(batch)] = common.interleaved_medians(fns, args.reps)
        for name in MODELS:
            row[name]["tok_s"] = batch * steps / row[name][clock]
            row[name]["speedup_vs_llama"] = row[name]["tok_s"] / row["llama"]["tok_s"]
        print(f"generate batch {batch}: " + ", ".join(f"{n} {row[n]['speedup_vs_llama']:.3f}x" for n in MODELS))
    prompt = torch.randint(3, vocab, (1, args.prompt), generator=generator)
    # one verification forward takes ~0.1 s: four times the repetitions cost little and steady its median
    verify_reps = 4 * args.reps
    for tokens in DRAFT_TOKENS:
        draft = torch.randint(3, vocab, (1, tokens), generator=generator)
        fns = {name: (lambda m=models[name], d=draft: time_verification(m, prompt, d)) for name in MODELS}
        row = results["verify"][str(tokens)] = common.interleaved_medians(fns, verify_reps)
        for name in MODELS:
            row[name]["tok_s"] = tokens / row[name][clock]
            row[name]["speedup_vs_llama"] = row[name]["tok_s"] / row["llama"]["tok_s"]
        print(f"verify {tokens} tokens: " + ", ".join(f"{n} {row[n]['speedup_vs_llama']:.3f}x" for n in MODELS))

    summary, checks = summarize(results, weight_bytes)
    print("\n" + "\n".join(summary))
    output = args.output or common.RESULTS_DIR / ("mohd_decode_quick.json" if args.quick else "mohd_decode.json")
    payload = {
        "benchmark": "mohd_decode",
        "command": common.command_line(),
        "git_commit": common.git_commit(),
        "shape": shape,
        "quick": args.quick,
        "preset": PRESET,
        "clock_for_ratios": args.clock,
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt,
        "machine": machine,
        "machine_end": {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
        "decode_weight_bytes_per_token": weight_bytes,
        "small_batch_plan_auto": auto_plan,
        "targets": TARGETS,
        "checks": checks,
        "results": results,
        "summary": summary,
    }
    common.write_results(output, payload)
    plot(payload, output.with_suffix(".png"))
    print(f"wrote {output} and {output.with_suffix('.png')}")


def summarize(results: dict, weight_bytes: dict) -> tuple[list[str], dict]:
    """Readable lines and the pass/fail of each target (batch 1 goal and floor, small batches, verification)."""
    ceiling = {name: weight_bytes["llama"] / weight_bytes[name] for name in MODELS}
    lines, checks = [], {}
    one = results["generate"]["1"]
    for name in MODELS:
        fraction = one[name]["speedup_vs_llama"] / ceiling[name]
        lines.append(
            f"batch 1 {name:15s} {one[name]['tok_s']:6.1f} tok/s, {one[name]['speedup_vs_llama']:.3f}x llama "
            f"(byte ceiling {ceiling[name]:.3f}x, {fraction:.0%} of it; {weight_bytes[name] / 1e6:.0f} MB/token)"
        )
    speedup = one["mohd"]["speedup_vs_llama"]
    fraction = speedup / ceiling["mohd"]
    fraction_active = one["llama_active"]["speedup_vs_llama"] / ceiling["llama_active"]
    checks["batch1_speedup"] = speedup
    checks["batch1_goal_met"] = speedup >= TARGETS["batch1_goal"]
    checks["batch1_floor_met"] = speedup >= TARGETS["batch1_floor"]
    checks["fraction_of_ceiling"] = fraction
    checks["llama_active_fraction_of_ceiling"] = fraction_active
    checks["fraction_vs_llama_active"] = fraction / fraction_active
    checks["fraction_floor_met"] = fraction / fraction_active >= TARGETS["fraction_vs_llama_active"]
    lines.append(
        f"target batch 1: goal {TARGETS['batch1_goal']}x, floor {TARGETS['batch1_floor']}x: {speedup:.3f}x; "
        f"fraction of ceiling {fraction:.0%} vs llama_active's {fraction_active:.0%} "
        f"= {fraction / fraction_active:.0%} (floor {TARGETS['fraction_vs_llama_active']:.0%})"
    )
    small = {f"batch {b}": results["generate"][str(b)]["mohd"]["speedup_vs_llama"] for b in BATCHES[1:]}
    small |= {f"verify {t}": results["verify"][str(t)]["mohd"]["speedup_vs_llama"] for t in DRAFT_TOKENS}
    checks["small_batches"] = small
    checks["small_batches_floor_met"] = min(small.values()) >= TARGETS["small_batch_floor"]
    lines.append(
        f"target small batches >= {TARGETS['small_batch_floor']}x llama: "
        + ", ".join(f"{k} {v:.3f}x" for k, v in small.items())
    )
    return lines, checks


def plot(payload: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = payload["results"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in ((axes[0], "generate", "batch"), (axes[1], "verify", "draft tokens verified")):
        points = sorted(results[key], key=int)
        for name in MODELS:
            ax.plot(
                [int(p) for p in points], [results[key][p][name]["speedup_vs_llama"] for p in points], "o-", label=name
            )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel(f"tokens/s vs LlamaForCausalLM ({payload['clock_for_ratios']} clock)")
        ax.legend(fontsize=8)
    axes[0].axhline(payload["targets"]["batch1_goal"], color="g", ls=":", lw=1)
    axes[0].set_title("generate (greedy, default cache)")
    axes[1].set_title("speculative verification on a 32-token cache")
    m = payload["machine"]
    fig.suptitle(
        f"MoHD {payload['preset']} decoding, {m['cpu_model']}, {m['torch_threads']} thread(s), "
        f"load {m['load_average_1_5_15'][0]}-{payload['machine_end']['load_average_1_5_15'][0]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
