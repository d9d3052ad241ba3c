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
"""MoHD prefill and training step against transformers' LlamaForCausalLM (decoding: `bench_mohd_decode.py`).

Models (fp32, CPU, sdpa attention), all built in this run from the fixed bench shape:
- `llama`: transformers' `LlamaForCausalLM` of the same total width (the baseline);
- `mohd_gather` / `mohd_sorted` / `mohd_masked`: MoHD at the 50% compression preset (16 blocks, 6 shared, top-2),
  same weights, on the gather strategy (the CPU default), the sorted one (the accelerators' many-token plan: one
  sort of the pairs, no atomics) and the masked reference (as `__init__` builds them: contiguous, row-major weights);
- `llama_active`: `LlamaForCausalLM` at the activated width (hidden 512, same heads and FFN; reference only).

Ceilings come from `hf_mohd.models.accounting.model_accounting`: forward FLOPs per token (decoder at the mean causal context
(T + 1) / 2, plus the LM head). Times are medians of `--reps` repetitions run round-robin over the four models
(`common.measure_interleaved`, every repetition stored); peak memory comes from one run of each model alone.

    python -m bench.bench_mohd            # fixed shape, writes bench/results/mohd.json and mohd.png
    python -m bench.bench_mohd --quick    # 2 layers, batch 2 x seq 128 (development)
    python -m bench.bench_mohd --blocks 8 3 1   # the wider-block variant beside it: 8 blocks of 128, 3 shared, top-1
                                                # (also 50% active), writes bench/results/mohd_blocks8.json
"""

import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench import common
from hf_mohd.models.accounting import model_accounting
from hf_mohd.models.configuration_mohd import MoHDConfig
from hf_mohd.models.modeling_mohd import MoHDForCausalLM


PRESET = "compression_50"


def llama_config(shape: dict, hidden_size: int | None = None) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden_size or shape["hidden_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_attention_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["intermediate_size"],
        vocab_size=shape["vocab_size"],
        tie_word_embeddings=shape["tie_word_embeddings"],
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )


def build_models(shape: dict, blocks: dict | None = None) -> tuple[dict, dict]:
    """The models of the comparison and their configs; MoHD gather, sorted and masked share one set of weights.
    `blocks` overrides the preset's sub-dimension fields (`num_sub_dims`, `num_shared_sub_dims`,
    `num_routed_sub_dims_per_tok`)."""
    base = llama_config(shape)
    active = llama_config(shape, hidden_size=shape["hidden_size"] // 2)
    blocks = blocks or {}
    configs = {
        "llama": base,
        "mohd_gather": MoHDConfig.from_llama_config(
            base, PRESET, sparse_implementation="gather", attn_implementation="sdpa", **blocks
        ),
        "mohd_sorted": MoHDConfig.from_llama_config(
            base, PRESET, sparse_implementation="sorted", attn_implementation="sdpa", **blocks
        ),
        "mohd_masked": MoHDConfig.from_llama_config(
            base, PRESET, sparse_implementation="masked", attn_implementation="sdpa", **blocks
        ),
        "llama_active": active,
    }
    models = {
        "llama": LlamaForCausalLM(base),
        "mohd_gather": MoHDForCausalLM(configs["mohd_gather"]),
        "mohd_sorted": MoHDForCausalLM(configs["mohd_sorted"]),
        "mohd_masked": MoHDForCausalLM(configs["mohd_masked"]),
        "llama_active": LlamaForCausalLM(active),
    }
    models["mohd_sorted"].load_state_dict(models["mohd_gather"].state_dict())
    models["mohd_masked"].load_state_dict(models["mohd_gather"].state_dict())
    return {name: model.eval() for name, model in models.items()}, configs


MODELS_PER_MODE = {
    "prefill": ("llama", "mohd_gather", "mohd_sorted", "mohd_masked", "llama_active"),
    "train": ("llama", "mohd_gather", "mohd_sorted", "mohd_masked", "llama_active"),
}


def prefill_flops(config, seq: int) -> int:
    """Forward FLOPs per token of a causal prefill of `seq` tokens (mean context (seq + 1) / 2) plus the LM head."""
    return model_accounting(config, context_length=(seq + 1) // 2).flops_per_token


def prefill_fn(model, ids):
    def run():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    return run


def train_fn(model, ids):
    def run():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    return run


def check_equivalence(models, ids) -> float:
    """Max |logits| difference between the gather and masked paths on the same weights (sanity; tests are exact)."""
    with torch.inference_mode():
        a = models["mohd_gather"](input_ids=ids, use_cache=False).logits
        b = models["mohd_masked"](input_ids=ids, use_cache=False).logits
    return (a - b).abs().max().item()


def main():
    parser = common.base_arguments(__doc__.splitlines()[0])
    parser.add_argument("--skip", nargs="*", default=[], choices=["prefill", "train"])
    parser.add_argument(
        "--blocks",
        nargs=3,
        type=int,
        metavar=("N", "N_S", "K"),
        help="sub-dimensions, shared ones and routed per token instead of the preset's 16, 6, 2",
    )
    args = parser.parse_args()
    blocks = None
    if args.blocks:
        blocks = dict(
            zip(("num_sub_dims", "num_shared_sub_dims", "num_routed_sub_dims_per_tok"), args.blocks, strict=True)
        )
    shape = common.setup(args)
    clock = f"{args.clock}_s"
    machine = common.machine_description()
    print(f"machine: {machine}")
    models, configs = build_models(shape, blocks)
    batch, seq = shape["batch"], shape["seq"]
    ids = torch.randint(0, shape["vocab_size"], (batch, seq))
    bandwidth = common.copy_bandwidth()
    print(
        f"copy bandwidth: {bandwidth['cpu_best_gb_s']:.1f} GB/s (cpu clock), {bandwidth['wall_best_gb_s']:.1f} (wall)"
    )
    max_diff = check_equivalence(models, ids[:1, :64])
    print(f"gather vs masked max |logit diff| = {max_diff:.2e}")

    flops = {name: prefill_flops(cfg, seq) for name, cfg in configs.items()}
    flop_ceiling = flops["llama"] / flops["mohd_gather"]
    results = {"prefill": {}, "train": {}}
    for mode, make in (("prefill", prefill_fn), ("train", train_fn)):
        if mode in args.skip:
            continue
        names = MODELS_PER_MODE[mode]
        for name in names:
            models[name].train(mode == "train")
        results[mode] = common.measure_interleaved(
            {name: make(models[name], ids) for name in names},
            reps=args.reps,
            after=lambda name: models[name].zero_grad(set_to_none=True),
        )
        for name in names:
            models[name].eval()
            print(f"{mode:8s} {name:13s} {results[mode][name]}", flush=True)
        base_time = results[mode]["llama"][clock]
        for name, res in results[mode].items():
            res["speedup_vs_llama"] = base_time / res[clock]
            res["flop_ceiling_vs_llama"] = flops["llama"] / flops[name]
            res["tokens_per_s"] = batch * seq / res[clock]

    sweep = {} if args.no_sweep else run_sweep(models, shape, args)

    summary = summarize(results, flop_ceiling)
    print("\n" + "\n".join(summary))
    name = "mohd" if blocks is None else f"mohd_blocks{blocks['num_sub_dims']}"
    output = args.output or common.RESULTS_DIR / (f"{name}_quick.json" if args.quick else f"{name}.json")
    payload = {
        "benchmark": "mohd",
        "command": common.command_line(),
        "git_commit": common.git_commit(),
        "shape": shape,
        "quick": args.quick,
        "preset": PRESET,
        "blocks": blocks,
        "clock_for_ratios": args.clock,
        "machine": machine,
        "machine_end": {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
        "copy_bandwidth": bandwidth,
        "gather_vs_masked_max_abs_logit_diff": max_diff,
        "ceilings": {
            "prefill_flops_per_token": flops,
            "flop_ceiling_gather_vs_llama": flop_ceiling,
        },
        "results": results,
        "sweep": sweep,
        "summary": summary,
    }
    common.write_results(output, payload)
    plot(payload, output.with_suffix(".png"))
    print(f"wrote {output} and {output.with_suffix('.png')}")


def run_sweep(models, shape, args) -> dict:
    """Prefill time over sequence length (at the bench batch) and over batch (at the bench sequence length)."""
    seqs = [shape["seq"] // 4, shape["seq"] // 2, shape["seq"]]
    batches = [1, 2, shape["batch"]]
    points = sorted({(shape["batch"], s) for s in seqs} | {(b, shape["seq"]) for b in batches})
    sweep = {"points": [list(p) for p in points], "prefill": {}}
    for name in ("llama", "mohd_gather", "mohd_masked"):
        sweep["prefill"][name] = []
        for batch, seq in points:
            ids = torch.randint(0, shape["vocab_size"], (batch, seq))
            res = common.measure(prefill_fn(models[name], ids), reps=1)
            sweep["prefill"][name].append({"batch": batch, "seq": seq, **res})
            print(f"sweep    {name:13s} batch {batch} seq {seq}: {res[f'{args.clock}_s']:.3f} s", flush=True)
    return sweep


def summarize(results, flop_ceiling) -> list[str]:
    lines = []
    for mode in ("prefill", "train"):
        for name, res in results[mode].items():
            lines.append(
                f"{mode:8s} {name:13s} speedup vs llama {res['speedup_vs_llama']:.3f} "
                f"(FLOP ceiling {res['flop_ceiling_vs_llama']:.3f}, "
                f"{res['speedup_vs_llama'] / res['flop_ceiling_vs_llama']:.0%} of it), "
                f"{res['tokens_per_s']:.0f} tok/s, peak RSS +{res['peak_rss_above_start_mib']} MiB over the loaded models"
            )
    for mode in ("prefill", "train"):
        if "mohd_gather" in results[mode]:
            got = results[mode]["mohd_gather"]["speedup_vs_llama"] / flop_ceiling
            lines.append(f"target: gather {mode} >= 85% of the FLOP ceiling {flop_ceiling:.3f}: {got:.0%}")
    return lines


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, clock = payload["results"], payload["clock_for_ratios"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    names = ["llama", "mohd_gather", "mohd_sorted", "mohd_masked", "llama_active"]
    width = 0.35
    for i, mode in enumerate(("prefill", "train")):
        if not results[mode]:
            continue
        values = [results[mode][n]["speedup_vs_llama"] if n in results[mode] else 0.0 for n in names]
        ax.bar([j + (i - 0.5) * width for j in range(len(names))], values, width, label=mode)
    ceiling = payload["ceilings"]
    ax.axhline(ceiling["flop_ceiling_gather_vs_llama"], color="k", ls="--", lw=1, label="MoHD FLOP ceiling")
    ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    ax.set_ylabel(f"speedup vs LlamaForCausalLM ({clock} clock)")
    ax.legend(fontsize=8)
    ax.set_title("ratios vs same-width Llama")
    sweep = payload["sweep"]
    if sweep:
        shape = payload["shape"]
        for ax, key, fixed, label in (
            (axes[1], "seq", ("batch", shape["batch"]), "sequence length"),
            (axes[2], "batch", ("seq", shape["seq"]), "batch"),
        ):
            for name, points in sweep["prefill"].items():
                sel = [p for p in points if p[fixed[0]] == fixed[1]]
                ax.plot([p[key] for p in sel], [p[f"{clock}_s"] for p in sel], marker="o", label=name)
            ax.set_xlabel(label)
            ax.set_ylabel(f"prefill time, s ({clock} clock)")
            ax.set_title(f"prefill vs {label} ({fixed[0]} {fixed[1]})")
            ax.legend(fontsize=8)
    else:
        for ax in axes[1:]:
            ax.text(0.5, 0.5, "prefill sweep not run (--no-sweep)", ha="center", va="center", transform=ax.transAxes)
    m = payload["machine"]
    fig.suptitle(
        f"MoHD {payload['preset']} vs Llama, {'quick' if payload['quick'] else 'fixed'} shape, "
        f"{m['cpu_model']}, {m['torch_threads']} thread(s), load {m['load_average_1_5_15'][0]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
