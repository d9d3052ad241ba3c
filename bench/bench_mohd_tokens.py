"""MoHD's execution plans by the number of tokens of a forward: which plan is fastest from decoding (1 token) through
batched decoding (a serving engine's continuous batch: 8-64 sequences, one token each) to short prefills.

One no-grad forward of the decoder stack (`model.model`: the LM head, the same dense product for every model, left
out) over M sequences of one token each (no cache: the linear layers and the routing, which is where the plans
differ; attention over one position is the same for all), at the bench shape of `bench.bench_mohd`
(compression_50: 8 of 16 sub-dimensions active, 6 shared, 2 routed of 10), for each M and each execution:

- `llama`: the dense LLaMA of the same shape (the baseline of every ratio);
- `mohd_<strategy>`: MoHD with the strategy's own plans ("gather": spans up to 8 tokens on an eager CPU run, index
  tensors up to N_r / k, then per-slot grouped products; "sorted": the same, then one sorted grouped product per
  side; "masked": full-width products with inactive blocks zeroed);
- with `--compile`, the same models under `torch.compile` (dynamic shapes), the form a serving engine runs, where the
  host-read spans plans do not apply.

Prints milliseconds per forward and each MoHD execution's ratio to the LLaMA's (speedup > 1: MoHD faster), and the
union share of routed blocks the M tokens touch (1 - (1 - k / N_r)^M expected; measured from the routes): once the
union covers nearly every block, a sparse plan reads as many weight bytes as the dense product.

    python -m bench.bench_mohd_tokens --reps 5 --compile --output bench/results/<cpu>/mohd_tokens.json
"""

import os
import time

import torch

from bench import common
from bench.bench_mohd import build_models


TOKENS = (1, 4, 8, 16, 32, 64)
EXECUTIONS = ("llama", "mohd_gather", "mohd_sorted", "mohd_masked")


def forward_timer(model, ids: torch.Tensor):
    """A callable timing one no-grad forward of `ids`: (wall, cpu) seconds."""

    def run() -> tuple[float, float]:
        with torch.no_grad():
            wall, cpu = time.perf_counter(), time.process_time()
            model(input_ids=ids, use_cache=False)
            return time.perf_counter() - wall, time.process_time() - cpu

    return run


def union_share(model, ids: torch.Tensor) -> float:
    """Mean over routed sublayers of the share of routed blocks that at least one of the tokens picks."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_router_logits=True)
    k = model.config.num_routed_sub_dims_per_tok
    shares = []
    for logits in out.router_logits:
        picked = logits.view(-1, logits.shape[-1]).topk(k, dim=-1).indices.unique()
        shares.append(picked.numel() / logits.shape[-1])
    return sum(shares) / len(shares)


def main() -> int:
    parser = common.base_arguments(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="the M of each forward")
    parser.add_argument("--compile", action="store_true", help="also time each model under torch.compile")
    args = parser.parse_args()
    shape = common.setup(args)
    machine = common.machine_description()
    models, _ = build_models(shape)
    models = {name: models[name].eval() for name in EXECUTIONS}
    for name in EXECUTIONS[1:]:
        models[name].to_weight_layout("column_major")  # the layout `generate` and the vLLM plugin store
    runs = {name: model.model for name, model in models.items()}  # the decoder stacks
    if args.compile:
        for name in EXECUTIONS:
            runs[f"{name}_compiled"] = torch.compile(models[name].model, dynamic=True)
    clock = f"{args.clock}_s"
    results = {}
    for m in args.tokens:
        ids = torch.randint(0, shape["vocab_size"], (m, 1), generator=torch.Generator().manual_seed(m))
        timed = common.interleaved_medians(
            {name: forward_timer(model, ids) for name, model in runs.items()}, args.reps
        )
        row = {"union_share": union_share(models["mohd_masked"], ids), **timed}
        for name in runs:
            base = timed["llama_compiled" if name.endswith("_compiled") else "llama"][clock]
            row[name]["speedup_vs_llama"] = base / timed[name][clock]
        results[str(m)] = row
        shown = "  ".join(
            f"{name} {1000 * timed[name][clock]:.2f} ms ({row[name]['speedup_vs_llama']:.2f}x)" for name in runs
        )
        print(f"M = {m:3d} (union {row['union_share']:.2f}): {shown}", flush=True)
    machine["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    payload = {"command": common.command_line(), "commit": common.git_commit(), "machine": machine, "shape": shape}
    payload["clock"], payload["results"] = args.clock, results
    if args.output:
        common.write_results(args.output, payload)
    print(f"load average before {machine['load_average_1_5_15']}, after {machine['load_average_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
