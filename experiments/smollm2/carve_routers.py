#!/usr/bin/env python
"""How well can a cheap router pick a carving's experts? Oracle recall of router variants on held-out tokens.

The carving is `experiments.smollm2.heal_carved`'s `carved75` (SmolLM2-135M, N = 128 routed experts of 8 neurons,
the shared third, K = 80). The model runs with every expert active (the dense function), and at sampled layers each
variant's top-K is compared with the oracle's (the top-K experts by true activation mass, `expert_mass`) on 2,048
held-out Wikipedia tokens: |variant ∩ oracle| / K, chance K / N = 0.625. Fitting text: the first `--tokens` tokens
of the multi-source healing text (`experiments.smollm2.healing_corpus`), disjoint from the held-out text.

Variants (every one but the last two is a linear router, the form the model has, W_r of 128 x 576):
- `fitted`: the carving's router, the ridge fit of centred log masses on 4,096 Wikipedia calibration tokens;
- `ridge_T`: the same fit on the first T fitting tokens (more and more varied data);
- `listwise`: the ridge fit refined by Adam on the cross-entropy of the router's softmax to the oracle's K experts
  (a classification objective instead of a regression);
- `mlp256`: a two-layer router, W_2 silu(W_1 x) with a 256-wide hidden layer (2.3x the linear router's
  multiply-adds), trained on the centred log masses;
- `two_neurons`: per expert the true |h| of its two neurons of highest mean |h| (a quarter of the expert's gate and
  up rows for every expert: 2 x 256 x 576 multiply-adds per token).

Groupings: the same layers carved again from the dense FFN (`--teacher`) with the shared neurons kept and the
routed ones grouped by balanced spherical k-means of other features than the carving's co-activation |h|: the gate
rows, the gate and up rows side by side, and the signed gate activations silu(g_i x) on 4,096 fitting tokens; each
with its ridge router fitted on 8,192 fitting tokens. Per grouping: recall, and the relative error of the FFN output
||y_K - y|| / ||y|| on the held-out tokens with the router's K and with the oracle's K (y: the dense FFN's output).

    python -m experiments.smollm2.carve_routers      # writes results/smollm2_carve_routers.json
"""

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from experiments.smollm2 import RESULTS_DIR
from experiments.smollm2 import evaluate_perplexity as ep
from hf_mohd.atomic_folder import write_json_atomically


logger = logging.getLogger("experiments.smollm2.carve_routers")
LAYERS = (3, 15, 27)
HELD_OUT_TOKENS = 2048
WINDOW = 256


def fitting_ids(tokenizer, corpus: Path, tokens: int) -> torch.Tensor:
    """(tokens / 256, 256) ids of the first `tokens` tokens of `corpus`/healing.jsonl (documents joined)."""
    ids: list[int] = []
    with open(corpus / "healing.jsonl", encoding="utf-8") as lines:
        for line in lines:
            ids += tokenizer(json.loads(line)["text"])["input_ids"]
            if len(ids) >= tokens:
                break
    if len(ids) < tokens:
        sys.exit(f"{corpus / 'healing.jsonl'}: {len(ids)} tokens, fewer than --tokens {tokens}.")
    return torch.tensor(ids[:tokens]).view(-1, WINDOW)


@torch.no_grad()
def ffn_inputs(model, blocks: list, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """layer -> (M, D) inputs of its MoE block at LAYERS, with every expert active (the dense function)."""
    from hf_mohd.conversion.latent_moe.routers import every_expert_active

    store: dict[int, list[torch.Tensor]] = {layer: [] for layer in LAYERS}
    handles = [
        blocks[layer].register_forward_pre_hook(
            lambda module, args, layer=layer: store[layer].append(args[0].reshape(-1, args[0].shape[-1]))
        )
        for layer in LAYERS
    ]
    try:
        with every_expert_active(model):
            for start in range(0, input_ids.shape[0], 4):
                model(input_ids=input_ids[start : start + 4], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {layer: torch.cat(rows) for layer, rows in store.items()}


def recall(scores: torch.Tensor, oracle: torch.Tensor, k: int) -> float:
    """Mean over tokens of |top-K of `scores` ∩ `oracle`| / K; scores (M, N), oracle (M, K) expert ids."""
    from hf_mohd.models.modeling_common import topk_lower_index

    chosen = topk_lower_index(scores, k)
    return (oracle[:, :, None] == chosen[:, None, :]).any(-1).sum(-1).double().div(k).mean().item()


def ridge(x: torch.Tensor, target: torch.Tensor, strength: float = 0.1) -> torch.Tensor:
    """(N, D) ridge solution of x W^T ≈ target in float64, lambda = `strength` x mean eigenvalue of x^T x (as
    `fit_carved_routers`)."""
    x, target = x.double(), target.double()
    gram = x.T @ x
    lam = strength * torch.trace(gram) / x.shape[1]
    return torch.linalg.solve(gram + lam * torch.eye(x.shape[1], dtype=gram.dtype), x.T @ target).T.float()


def train(parameters, loss_fn, steps: int, lr: float, rows: int, generator: torch.Generator) -> None:
    """Adam for `steps` steps on random batches of 2,048 of `rows` rows (`loss_fn(index)`)."""
    optimizer = torch.optim.Adam(parameters, lr=lr)
    for _ in range(steps):
        loss = loss_fn(torch.randint(0, rows, (2048,), generator=generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def layer_variants(block, x: torch.Tensor, x_held: torch.Tensor, sizes: list[int]) -> dict[str, float]:
    """Oracle recall of every variant at one layer (module docstring)."""
    from hf_mohd.conversion.latent_moe.routers import MASS_FLOOR, _log_mass_target, expert_mass
    from hf_mohd.models.modeling_common import topk_lower_index

    k = block.gate.top_k
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        mass, mass_held = expert_mass(block, x), expert_mass(block, x_held)
    oracle = topk_lower_index(mass_held, k)
    target = _log_mass_target(mass.double(), MASS_FLOOR * mass.mean().item() + 1e-30).float()
    row = {"fitted": recall(x_held @ block.gate.weight.T, oracle, k)}
    for size in sizes:
        row[f"ridge_{size}"] = recall(x_held @ ridge(x[:size], target[:size]).T, oracle, k)
    weight = ridge(x, target).requires_grad_()
    members = torch.zeros_like(mass).scatter_(1, topk_lower_index(mass, k), 1.0)
    train(
        [weight],
        lambda i: -(torch.log_softmax(x[i] @ weight.T, -1) * members[i]).sum(-1).mean() / k,
        300, 1e-3, x.shape[0], generator,
    )  # fmt: skip
    row["listwise"] = recall(x_held @ weight.detach().T, oracle, k)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], 256, bias=False), torch.nn.SiLU(), torch.nn.Linear(256, mass.shape[1], bias=False)
    )

    def mlp_loss(i):
        out = mlp(x[i])
        return (out - out.mean(-1, keepdim=True) - target[i]).pow(2).mean()

    train(mlp.parameters(), mlp_loss, 1500, 2e-3, x.shape[0], generator)
    with torch.no_grad():
        row["mlp256"] = recall(mlp(x_held), oracle, k)
        experts = block.experts
        gate, up = torch.einsum("md,ekd->mek", x, experts.gate_up_proj).chunk(2, -1)
        chosen = (experts.act_fn(gate.clone()) * up).abs().mean(0).topk(2, -1).indices  # (N, 2)
        gate, up = torch.einsum("md,ekd->mek", x_held, experts.gate_up_proj).chunk(2, -1)
        inner = (experts.act_fn(gate.clone()) * up).abs()
        row["two_neurons"] = recall(inner.gather(2, chosen[None].expand(inner.shape[0], -1, -1)).sum(-1), oracle, k)
    return row


def grouping_variants(weights: dict, layer: int, x: torch.Tensor, x_held: torch.Tensor, k: int, n: int) -> dict:
    """Recall and relative FFN output error of the groupings of the module docstring at one layer, from the dense
    FFN's `weights` (safetensors names); the shared neurons are the carving's rule (highest mean |h|, a third)."""
    from hf_mohd.conversion.latent_moe.carve import balanced_spherical_kmeans
    from hf_mohd.conversion.latent_moe.routers import MASS_FLOOR, _log_mass_target
    from hf_mohd.models.modeling_common import topk_lower_index

    prefix = f"model.layers.{layer}.mlp."
    gate, up, down = (weights[prefix + name + ".weight"].float() for name in ("gate_proj", "up_proj", "down_proj"))
    silu = torch.nn.functional.silu
    x = x[:8192]
    inner, inner_held = silu(x @ gate.T) * (x @ up.T), silu(x_held @ gate.T) * (x_held @ up.T)
    order = inner.abs().mean(0).argsort(descending=True, stable=True)
    shared_size = gate.shape[0] // 3
    shared, rest = order[:shared_size].sort().values, order[shared_size:].sort().values
    dense_out = inner_held @ down.T
    features = {
        "co-activation |h| (the carving's)": inner[:4096, rest].abs().T,
        "gate rows": gate[rest],
        "gate and up rows": torch.cat([gate[rest], up[rest]], 1),
        "signed gate activations": silu(x[:4096] @ gate[rest].T).T,
    }
    rows = {}
    for name, feature in features.items():
        labels, _ = balanced_spherical_kmeans(feature, n, seed=0)
        experts = torch.stack([rest[labels == e] for e in range(n)])  # (N, width)
        mass, mass_held = inner[:, experts].abs().sum(-1), inner_held[:, experts].abs().sum(-1)
        router = ridge(x, _log_mass_target(mass.double(), MASS_FLOOR * mass.mean().item() + 1e-30))
        oracle = topk_lower_index(mass_held, k)
        row = {"recall": recall(x_held @ router.T, oracle, k)}
        for route, chosen in (("router", topk_lower_index(x_held @ router.T, k)), ("oracle", oracle)):
            active = torch.zeros(x_held.shape[0], gate.shape[0])
            active[:, shared] = 1.0
            picked = torch.zeros(x_held.shape[0], n).scatter_(1, chosen, 1.0)
            active[:, experts.reshape(-1)] = picked.repeat_interleave(experts.shape[1], 1)
            error = ((inner_held * active) @ down.T - dense_out).norm() / dense_out.norm()
            row[f"output_error_{route}"] = error.item()
        rows[name] = row
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--carving", type=Path, default=Path("runs/heal_carved/carved75"))
    parser.add_argument("--corpus-dir", type=Path, default=Path("runs/healing_corpus"))
    parser.add_argument("--teacher", type=Path, default=Path("runs/heal_smollm2/teacher"), help="the dense model.")
    parser.add_argument("--tokens", type=int, default=32768, help="fitting tokens (default 32,768).")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1).")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "smollm2_carve_routers.json")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from experiments.smollm2.heal_carved import load
    from hf_mohd.conversion.latent_moe.routers import moe_blocks

    if not (args.teacher / "model.safetensors").exists():
        sys.exit(f"{args.teacher}: no dense model; run python -m experiments.smollm2.heal prepare first.")
    if not (args.carving / "config.json").exists():
        sys.exit(f"{args.carving}: missing; run python -m experiments.smollm2.heal_carved prepare first.")
    started = time.process_time()
    model = load(args.carving)
    tokenizer = AutoTokenizer.from_pretrained(args.carving)
    held = (args.corpus_dir / "held_out" / "wikipedia.txt").read_text(encoding="utf-8")
    held_ids = torch.tensor(tokenizer(held)["input_ids"][:HELD_OUT_TOKENS]).view(-1, WINDOW)
    blocks = moe_blocks(model)
    x = ffn_inputs(model, blocks, fitting_ids(tokenizer, args.corpus_dir, args.tokens))
    x_held = ffn_inputs(model, blocks, held_ids)
    sizes = [size for size in (4096, 16384, 32768, 65536) if size <= args.tokens]
    layers = {}
    for layer in LAYERS:
        layers[layer] = layer_variants(blocks[layer], x[layer], x_held[layer], sizes)
        logger.info("layer %d: %s", layer, {name: round(value, 4) for name, value in layers[layer].items()})
    names = list(layers[LAYERS[0]])
    gate = blocks[0].gate
    from safetensors.torch import load_file

    weights = load_file(args.teacher / "model.safetensors")
    groupings = {}
    for layer in LAYERS:
        groupings[layer] = grouping_variants(weights, layer, x[layer], x_held[layer], gate.top_k, gate.num_experts)
        logger.info("groupings, layer %d: %s", layer, groupings[layer])
    grouping_names = list(groupings[LAYERS[0]])
    grouping_mean = {
        name: {
            field: sum(groupings[layer][name][field] for layer in LAYERS) / len(LAYERS)
            for field in groupings[LAYERS[0]][name]
        }
        for name in grouping_names
    }
    result = {
        "command": "python -m experiments.smollm2.carve_routers " + " ".join(argv or sys.argv[1:]),
        "carving": str(args.carving),
        "num_experts": gate.num_experts,
        "num_experts_per_tok": gate.top_k,
        "chance": gate.top_k / gate.num_experts,
        "fitting_tokens": args.tokens,
        "held_out_tokens": HELD_OUT_TOKENS,
        "recall_of_oracle_top_k": {
            "mean_over_layers": {n: sum(r[n] for r in layers.values()) / len(layers) for n in names},
            "layers": layers,
        },
        "groupings": {"mean_over_layers": grouping_mean, "layers": groupings},
        "cpu_seconds": round(time.process_time() - started, 1),
        "machine": ep.machine(),
        "torch_threads": args.threads,
    }
    write_json_atomically(args.output, result)
    print(
        json.dumps(
            {"routers": result["recall_of_oracle_top_k"]["mean_over_layers"], "groupings": grouping_mean}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
