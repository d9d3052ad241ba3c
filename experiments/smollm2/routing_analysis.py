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
"""Oracle routing and the routers' recall of it: analyses of the SmolLM2 experiments, on both converted families.

The oracle of a sparse layer picks, per token, the routed units that matter most by a measure the router cannot see
at inference, and so bounds what any router over the same units can do:

- Carved LatentMoE (`hf_mohd.conversion.latent_moe.carve`): the top-K experts by true activation mass
  sum_{i in S_e} |h_i(x)| at the block's own input (`hf_mohd.conversion.latent_moe.routers.expert_mass`), gate 1 (`oracle_routing`);
  `carved_routing_recall` measures |router top-K ∩ oracle top-K| / K on held-out tokens (a random router: K / N).
- MoHD (`hf_mohd.conversion.mohd.routers`): the top-k routed blocks by the energy of the dense (rotated) model's
  normalised input (`routers.block_energies`), as a routing record in `RoutingCache.routing_record`'s format
  (`oracle_routing_record`); passed as `routing_replay=` it makes every router use those blocks. With zero router
  weights and `routed_gate="normalized"` the recomputed gates are exactly k (1 / N_r) / (k / N_r) = 1, so the oracle
  applies gate 1 to the selected blocks (`zero_routers`). `routing_recall` measures the fitted routers' recall of
  its top-k (a random router: k / N_r).

Users: `experiments.smollm2.carve`, `evaluate_perplexity` and `ladder`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hf_mohd.conversion.latent_moe.routers import every_expert_active, expert_mass, moe_blocks
from hf_mohd.conversion.mohd.rotation import for_each_sublayer_input
from hf_mohd.conversion.mohd.routers import block_energies, mohd_routers
from hf_mohd.conversion.source import ConversionError, DenseLlamaSource
from hf_mohd.models.modeling_common import topk_lower_index
from hf_mohd.models.modeling_latent_moe import LatentMoEForCausalLM
from hf_mohd.models.modeling_mohd import MoHDForCausalLM
from hf_mohd.models.routing_cache import RoutingRecord


# ------------------------------------------------------------------------------------------- carved LatentMoE


@contextlib.contextmanager
def oracle_routing(model: LatentMoEForCausalLM) -> Iterator[LatentMoEForCausalLM]:
    """Within the block, the oracle arm: every MoE layer routes each token to the top-K experts by their true mass
    (`expert_mass` at the block's input; ties to the lower index) with gate exactly 1, whatever the routers say.

    The routers still run (their logits are returned unchanged), and a `RoutingCache` records *their* choice, not
    the oracle's: call the model with `use_cache=False`. The hooks are removed on exit.
    """
    handles = []
    for block in moe_blocks(model).values():

        def hook(router, args, output, block=block):
            logits, weights, _ = output
            hidden_states = args[0]
            chosen = topk_lower_index(expert_mass(block, hidden_states), router.top_k)
            chosen = chosen.view(*hidden_states.shape[:-1], router.top_k)
            return logits, torch.ones(chosen.shape, dtype=weights.dtype, device=weights.device), chosen

        handles.append(block.gate.register_forward_hook(hook))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def carved_routing_recall(model: LatentMoEForCausalLM, input_ids: torch.Tensor, *, batch_size: int = 4) -> dict:
    """Recall of the oracle's top-K by the routers, on (B, T) held-out `input_ids`.

    The model runs with every expert active (`every_expert_active`: the dense source's function, so each layer sees
    the dense model's FFN input; with a latent width l < D, the source with projected routed experts); at each MoE
    layer and token the routers' own top-K (of their selection scores) is compared with the top-K by true expert
    mass (of the latent experts, `expert_mass`): |router ∩ oracle| / K.

    Returns:
        {"mean": over layers and tokens, "layers": [per layer], "chance": K / N, "tokens": B * T}.
    """
    hits: dict[int, list[torch.Tensor]] = {}
    handles = []
    blocks = moe_blocks(model)
    for idx, block in blocks.items():
        top_k = block.gate.top_k

        def hook(router, args, output, block=block, idx=idx, top_k=top_k):
            logits = output[0]
            chosen = topk_lower_index(router.selection_scores(router.score(logits)), top_k)
            oracle = topk_lower_index(expert_mass(block, args[0]), top_k)
            overlap = (oracle[:, :, None] == chosen[:, None, :]).any(-1).sum(-1).double() / top_k
            hits.setdefault(idx, []).append(overlap)

        handles.append(block.gate.register_forward_hook(hook))
    try:
        with every_expert_active(model):
            for start in range(0, input_ids.shape[0], batch_size):
                model(input_ids=input_ids[start : start + batch_size], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    layers = [torch.cat(hits[idx]).mean().item() for idx in sorted(hits)]
    router = next(iter(blocks.values())).gate
    return {
        "mean": sum(layers) / len(layers),
        "layers": layers,
        "chance": router.top_k / router.num_experts,
        "tokens": int(input_ids.numel()),
    }


# ------------------------------------------------------------------------------------------------------ MoHD


@torch.no_grad()
def oracle_routing_record(
    source: DenseLlamaSource, input_ids: torch.Tensor, config, *, batch_size: int | None = None
) -> dict[tuple[int, str], RoutingRecord]:
    """Routing record of the oracle: per token and sparsified sublayer, the top-k routed blocks by the energy of the
    dense (rotated) `source`'s normalised input (ties to the lower index).

    Args:
        source: the dense LLaMA in the basis of the MoHD model that will replay the record.
        input_ids: (B, T) the tokens the record is for (the same batch is then given to the MoHD model).
        config: the MoHD model's `MoHDConfig` (N, N_s, k, sparse_modules).
        batch_size: rows per forward (default: all B at once).

    Returns:
        {(layer, "attn" / "mlp"): RoutingRecord(indices (B, T, k) int64 absolute block ids, weights (B, T, k) ones)}
        for the sublayers in `config.sparse_modules`; pass it as `routing_replay=` with the same `input_ids`.
    """
    n, n_s, k = config.num_sub_dims, config.num_shared_sub_dims, config.num_routed_sub_dims_per_tok
    wanted = {"attn"} if "attention" in config.sparse_modules else set()
    wanted |= {"mlp"} if "ffn" in config.sparse_modules else set()
    picks: dict[tuple[int, str], list[torch.Tensor]] = {}

    def pick(layer, router, x):
        if router in wanted:
            top = topk_lower_index(block_energies(x, n)[:, n_s:], k) + n_s
            picks.setdefault((layer, router), []).append(top)

    for_each_sublayer_input(source.build_llama(), input_ids, pick, batch_size or input_ids.shape[0])
    shape = (*input_ids.shape, k)
    record = {}
    for key, tops in picks.items():
        indices = torch.cat(tops).view(shape)
        record[key] = RoutingRecord(indices, torch.ones(shape, dtype=source.dtype))
    return record


def zero_routers(model: MoHDForCausalLM) -> MoHDForCausalLM:
    """Set every router weight to 0 (uniform p = 1 / N_r), in place; with `routed_gate="normalized"` (or "unit", whose
    gates are 1 anyway) a replayed record then gets gate exactly 1 on each selected block. Raises ConversionError for
    another `routed_gate`."""
    if model.config.routed_gate not in ("normalized", "unit"):
        raise ConversionError(
            "Oracle replay needs routed_gate='normalized' or 'unit' (gate 1 with zero routers), got "
            f"{model.config.routed_gate!r}."
        )
    with torch.no_grad():
        for router in mohd_routers(model).values():
            router.weight.zero_()
    return model


@torch.no_grad()
def routing_recall(
    model: MoHDForCausalLM, source: DenseLlamaSource, input_ids: torch.Tensor, *, batch_size: int = 4
) -> dict[str, float]:
    """Recall of the oracle's top-k by the model's routers, on the dense (rotated) `source`'s sublayer inputs.

    For every token and router: |router top-k ∩ oracle top-k| / k, averaged over tokens; a router that ignores its
    input scores k / N_r in expectation.

    Returns:
        {"mean": over all routers, "attn": over attention routers, "mlp": over FFN routers} (absent kinds omitted),
        plus "chance": k / N_r.
    """
    routers = mohd_routers(model)
    n, n_s, k = model.config.num_sub_dims, model.config.num_shared_sub_dims, model.config.num_routed_sub_dims_per_tok
    hits: dict[str, list[float]] = {}

    def score(layer, name, x):
        router = routers.get((layer, name))
        if router is None:
            return
        oracle = topk_lower_index(block_energies(x, n)[:, n_s:], k)
        chosen = topk_lower_index(torch.softmax(x @ router.weight.double().T, -1), k)
        overlap = (oracle[:, :, None] == chosen[:, None, :]).any(-1).sum(-1).double() / k
        hits.setdefault(name, []).append(overlap)

    for_each_sublayer_input(source.build_llama(), input_ids, score, batch_size)
    result = {name: torch.cat(values).mean().item() for name, values in hits.items()}
    result["mean"] = torch.cat([torch.cat(v) for v in hits.values()]).mean().item()
    result["chance"] = k / (n - n_s)
    return result
