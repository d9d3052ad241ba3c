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
"""LatentMoE benchmarks: layer vs transformers' NemotronHMoE, latent vs standard MoE model.

1. Layer: our `LatentMoEBlock` against transformers' `NemotronHMoE` built from the same configuration
   (`nemotron_h_config_from_latent_moe`) and holding the same weights (outputs and gradients are checked to match),
   forward and training step (forward + backward), for the `eager` and `grouped_mm` experts implementations.
2. Model: `LatentMoEForCausalLM` with latent experts (alpha = 4 transform of the standard MoE: l = D / 4, N and K
   times 4, m lowered so that the activated FLOPs match) against the standard MoE (`moe_latent_size=None`), prefill
   and training step, with the all-to-all payload per token (2 K l scalars per MoE layer, arXiv 2610.14644 B.2).
Medians of `--reps` repetitions after one warm-up (the `eager` layer reference: one), the two contenders'
repetitions round-robin (`common.measure_interleaved`), every repetition stored.

MoE style in both: Nemotron 3 (non-gated relu2 experts, sigmoid routing with correction bias, shared expert).

    python -m bench.bench_latent_moe            # fixed shape, writes bench/results/latent_moe.json and .png
    python -m bench.bench_latent_moe --quick    # 2 layers, batch 2 x seq 128 (development)
"""

import os
from pathlib import Path

import torch
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

from bench import common
from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM
from hf_mohd.interop.nemotron_h import nemotron_h_config_from_latent_moe
from hf_mohd.models.accounting import layer_accounting, model_accounting
from hf_mohd.models.modeling_latent_moe import LatentMoEBlock


# Standard fine-grained MoE at the bench width, and its alpha = 4 latent transform (Nemotron 3 uses alpha = 4).
STANDARD_MOE = {"num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 1024, "moe_latent_size": None}
# l = 1024 / 4, N = 64, K = 8; m = 880 instead of 1024 pays for the two latent projections (2 D l per token), so that
# the activated MACs per token match the standard MoE within 1%.
LATENT_MOE = {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 880, "moe_latent_size": 256}
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm")


def latent_moe_config(shape: dict, moe: dict) -> LatentMoEConfig:
    return LatentMoEConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_attention_heads"],
        head_dim=shape["head_dim"],
        tie_word_embeddings=shape["tie_word_embeddings"],
        max_position_embeddings=4096,
        moe_shared_expert_intermediate_size=1024,
        hidden_act="relu2",
        mlp_gated=False,
        router_score_func="sigmoid",
        position_embedding_type="none",
        **moe,
    )


def spread_router(block) -> None:
    """Router weights and correction bias of a realistic spread, so that routing is balanced-ish and tie-free."""
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.05)
        block.gate.e_score_correction_bias.normal_(0, 0.01)


def layer_benchmark(shape: dict, args) -> dict:
    """LatentMoEBlock vs NemotronHMoE, same config and weights; returns timings, equivalence and accounting."""
    config = latent_moe_config(shape, LATENT_MOE)
    nemotron_config = nemotron_h_config_from_latent_moe(config)
    ours = LatentMoEBlock(config, 0)
    for param in ours.parameters():
        if param.dim() > 1:
            torch.nn.init.normal_(param, std=0.02)
    spread_router(ours)
    theirs = NemotronHMoE(nemotron_config, 0)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(shape["batch"], shape["seq"], shape["hidden_size"])
    results = {}
    blocks = {"latent_moe": ours, "nemotron_h": theirs}
    for implementation in EXPERTS_IMPLEMENTATIONS:
        config._experts_implementation = implementation
        nemotron_config._experts_implementation = implementation
        check = equivalence(ours, theirs, x[:1, :64])
        print(
            f"layer {implementation}: max |out diff| {check['max_abs_out_diff']:.2e}, grads {check['max_abs_grad_diff']:.2e}"
        )
        # the eager experts loop is the reference, not a contender: one timed repetition keeps the run short
        reps = 1 if implementation == "eager" else args.reps
        # the two blocks' repetitions round-robin (`common.measure_interleaved`)
        timings = {
            mode: common.measure_interleaved(
                {label: make(block, x) for label, block in blocks.items()},
                reps=reps,
                after=lambda label: blocks[label].zero_grad(set_to_none=True),
            )
            for mode, make in (("forward", forward_fn), ("train", train_fn))
        }
        for label in blocks:
            fwd, train = timings["forward"][label], timings["train"][label]
            results[f"{label}/{implementation}"] = {"forward": fwd, "train": train, **check}
            print(
                f"layer {label:10s} {implementation:10s} forward {fwd[args.clock + '_s']:.4f} s, train "
                f"{train[args.clock + '_s']:.4f} s",
                flush=True,
            )
        for mode in ("forward", "train"):
            ratio = (
                results[f"nemotron_h/{implementation}"][mode][args.clock + "_s"]
                / results[f"latent_moe/{implementation}"][mode][args.clock + "_s"]
            )
            results[f"latent_moe/{implementation}"][mode]["speedup_vs_nemotron_h"] = ratio
    acc = layer_accounting(config, 0)
    return {
        "config": {k: getattr(config, k) for k in ("hidden_size", *LATENT_MOE, "moe_shared_expert_intermediate_size")},
        "tokens": shape["batch"] * shape["seq"],
        "mixer_flops_per_token": acc.mixer_flops,
        "all_to_all_scalars_per_token": acc.all_to_all_scalars,
        "results": results,
    }


def equivalence(ours, theirs, x) -> dict:
    """Max |difference| of outputs and of every parameter gradient between the two blocks (fp32)."""
    grads, outs = [], []
    for block in (ours, theirs):
        block.zero_grad(set_to_none=True)
        out = block(x)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None})
    ours.zero_grad(set_to_none=True)
    theirs.zero_grad(set_to_none=True)
    grad_diff = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])
    return {
        "max_abs_out_diff": (outs[0] - outs[1]).abs().max().item(),
        "max_abs_grad_diff": grad_diff,
        "same_grad_names": sorted(grads[0]) == sorted(grads[1]),
    }


def forward_fn(block, x):
    def run():
        with torch.inference_mode():
            block(x)

    return run


def train_fn(block, x):
    x = x.detach().requires_grad_(True)

    def run():
        block.zero_grad(set_to_none=True)
        x.grad = None
        block(x).square().mean().backward()

    return run


def model_benchmark(shape: dict, args) -> dict:
    """LatentMoE (alpha = 4) vs standard MoE causal LMs of the same shape, prefill and training step."""
    results, accounting = {}, {}
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]))
    models = {}
    for label, moe in (("standard_moe", STANDARD_MOE), ("latent_moe", LATENT_MOE)):
        config = latent_moe_config(shape, moe)
        model = LatentMoEForCausalLM(config).eval()
        model.set_experts_implementation("grouped_mm")
        for layer in model.model.layers:
            spread_router(layer.mlp)
        models[label] = model
        acc = model_accounting(config, context_length=(shape["seq"] + 1) // 2)
        per_layer = layer_accounting(config, 0, context_length=(shape["seq"] + 1) // 2)
        accounting[label] = {
            "total_params": acc.total_params,
            "mixer_flops_per_token_per_layer": per_layer.mixer_flops,
            "activated_flops_per_token_per_layer": per_layer.activated_flops,
            "all_to_all_scalars_per_token_per_layer": per_layer.all_to_all_scalars,
            "all_to_all_scalars_per_token": per_layer.all_to_all_scalars * shape["num_hidden_layers"],
            "all_to_all_bytes_per_token_bf16": 2 * per_layer.all_to_all_scalars * shape["num_hidden_layers"],
            "moe": {k: v for k, v in moe.items()},
        }
    for mode, make in (("prefill", prefill_fn), ("train", train_model_fn)):
        for model in models.values():
            model.train(mode == "train")
        # the two models' repetitions round-robin (`common.measure_interleaved`)
        results[mode] = common.measure_interleaved(
            {label: make(model, ids) for label, model in models.items()},
            reps=args.reps,
            after=lambda label: models[label].zero_grad(set_to_none=True),
        )
        for label, model in models.items():
            model.eval()
            print(f"model {mode:8s} {label:12s} {results[mode][label][args.clock + '_s']:.3f} s", flush=True)
        base = results[mode]["standard_moe"][args.clock + "_s"]
        for res in results[mode].values():
            res["speedup_vs_standard_moe"] = base / res[args.clock + "_s"]
            res["tokens_per_s"] = ids.numel() / res[args.clock + "_s"]
    sweep = {}
    if not args.no_sweep:
        for label, model in models.items():
            sweep[label] = []
            for seq in (shape["seq"] // 4, shape["seq"] // 2, shape["seq"]):
                sweep_ids = torch.randint(0, shape["vocab_size"], (shape["batch"], seq))
                res = common.measure(prefill_fn(model, sweep_ids), reps=1)
                sweep[label].append({"batch": shape["batch"], "seq": seq, **res})
                print(f"sweep {label:12s} seq {seq}: {res[args.clock + '_s']:.3f} s", flush=True)
    return {"accounting": accounting, "results": results, "sweep": sweep}


def prefill_fn(model, ids):
    def run():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    return run


def train_model_fn(model, ids):
    def run():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    return run


def summarize(layer: dict, model: dict, clock: str) -> list[str]:
    lines = []
    a2a = layer["all_to_all_scalars_per_token"]
    for implementation in EXPERTS_IMPLEMENTATIONS:
        res = layer["results"][f"latent_moe/{implementation}"]
        lines.append(
            f"layer {implementation:10s} LatentMoEBlock vs NemotronHMoE: forward {res['forward']['speedup_vs_nemotron_h']:.3f}x, "
            f"train {res['train']['speedup_vs_nemotron_h']:.3f}x (target >= 1.0), max |out diff| "
            f"{res['max_abs_out_diff']:.1e}, all-to-all {a2a} scalars/token/layer"
        )
    acc = model["accounting"]
    for mode in ("prefill", "train"):
        for label, res in model["results"][mode].items():
            lines.append(
                f"model {mode:8s} {label:12s} {res['tokens_per_s']:.0f} tok/s ({clock} clock), "
                f"{res['speedup_vs_standard_moe']:.3f}x vs standard MoE (activated FLOPs ratio "
                f"{acc['standard_moe']['activated_flops_per_token_per_layer'] / acc[label]['activated_flops_per_token_per_layer']:.3f}), "
                f"all-to-all {acc[label]['all_to_all_scalars_per_token']} scalars/token "
                f"({acc[label]['all_to_all_bytes_per_token_bf16'] / 1024:.0f} KiB in bf16), "
                f"peak RSS +{res['peak_rss_above_start_mib']} MiB"
            )
    return lines


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clock = payload["clock_for_ratios"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    layer = payload["layer"]["results"]
    labels, values = [], []
    for implementation in EXPERTS_IMPLEMENTATIONS:
        for mode in ("forward", "train"):
            for block in ("latent_moe", "nemotron_h"):
                labels.append(f"{block}\n{implementation}\n{mode}")
                values.append(layer[f"{block}/{implementation}"][mode][f"{clock}_s"] * 1e3)
    ax.bar(range(len(values)), values, color=["C0", "C1"] * (len(values) // 2))
    ax.set_xticks(range(len(values)), labels, fontsize=6)
    ax.set_ylabel(f"ms ({clock} clock)")
    ax.set_title(f"layer: LatentMoEBlock (C0) vs NemotronHMoE (C1), {payload['layer']['tokens']} tokens")
    model = payload["model"]
    ax = axes[1]
    acc = model["accounting"]
    names = list(acc)
    for i, mode in enumerate(("prefill", "train")):
        ax.bar(
            [j + 0.4 * i for j in range(len(names))],
            [model["results"][mode][n]["tokens_per_s"] for n in names],
            0.4,
            label=mode,
        )
    ax.set_xticks(
        [j + 0.2 for j in range(len(names))],
        [f"{n}\na2a {acc[n]['all_to_all_scalars_per_token']} scalars/token" for n in names],
        fontsize=8,
    )
    ax.set_ylabel(f"tokens/s ({clock} clock)")
    ax.set_title("model at matched activated FLOPs")
    ax.legend(fontsize=8)
    ax = axes[2]
    for label, points in model["sweep"].items():
        ax.plot([p["seq"] for p in points], [p[f"{clock}_s"] for p in points], marker="o", label=label)
    ax.set_xlabel("sequence length")
    ax.set_ylabel(f"prefill time, s ({clock} clock)")
    ax.set_title(f"prefill vs sequence length (batch {payload['shape']['batch']})")
    if model["sweep"]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "not run (--no-sweep)", ha="center", va="center", transform=ax.transAxes)
    m = payload["machine"]
    fig.suptitle(
        f"LatentMoE, {'quick' if payload['quick'] else 'fixed'} shape, {m['cpu_model']}, "
        f"{m['torch_threads']} thread(s), load {m['load_average_1_5_15'][0]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = common.base_arguments(__doc__.splitlines()[0])
    parser.add_argument("--skip", nargs="*", default=[], choices=["layer", "model"])
    args = parser.parse_args()
    shape = common.setup(args)
    machine = common.machine_description()
    print(f"machine: {machine}")
    layer = layer_benchmark(shape, args) if "layer" not in args.skip else {}
    model = model_benchmark(shape, args) if "model" not in args.skip else {}
    summary = summarize(layer, model, args.clock) if layer and model else []
    print("\n" + "\n".join(summary))
    output = args.output or common.RESULTS_DIR / ("latent_moe_quick.json" if args.quick else "latent_moe.json")
    payload = {
        "benchmark": "latent_moe",
        "command": common.command_line(),
        "git_commit": common.git_commit(),
        "shape": shape,
        "quick": args.quick,
        "clock_for_ratios": args.clock,
        "machine": machine,
        "machine_end": {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
        "layer": layer,
        "model": model,
        "summary": summary,
    }
    common.write_results(output, payload)
    if layer and model:
        plot(payload, output.with_suffix(".png"))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
