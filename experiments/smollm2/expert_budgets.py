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
"""Uneven expert budgets of a carved LatentMoE: each MoE layer gets its own K, allocated greedily from calibration
text without training, under the per-token parameter budget of a uniform K. An analysis of the SmolLM2 carving
experiments (`experiments.smollm2.carve --expert-budgets`); no conversion option reaches it.

The rule is the MoHD budgets' (`hf_mohd.conversion.mohd.budgets`, after TEAL, Liu et al., arXiv 2408.14690, section 4.2)
with a MoE layer as the unit: its step K -> K - 1 drops the router's lowest-ranked picked expert, its cost w is a
routed expert's parameters, and its error is measured after the norm that reads the layer's output
(`carved_layer_errors`); the same greedy (`budgets.greedy_budgets`) allocates (`allocate_experts_per_tok`), and the
result is saved as `per_layer_config` {layer: {"num_experts_per_tok": K}} (`apply_expert_budgets`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_mohd.conversion.latent_moe.routers import every_expert_active, moe_blocks
from hf_mohd.conversion.mohd.budgets import greedy_budgets
from hf_mohd.conversion.source import ConversionError
from hf_mohd.models.modeling_common import topk_lower_index
from hf_mohd.models.modeling_latent_moe import LatentMoEBlock, LatentMoEForCausalLM


@dataclass
class ExpertBudgets:
    """The K of each MoE layer of a carved LatentMoE model, and what the allocation was made from.

    Attributes:
        budgets: {layer_idx: K}.
        errors: {layer_idx: [e(1), ..., e(N)]}, the relative residual-stream error with the router's top K
            (`carved_layer_errors`; e(N) = 0).
        expert_params: {layer_idx: w}, parameters one more routed expert makes a token read.
        mean_experts_per_tok: the requested uniform K whose parameter budget the allocation keeps.
        active_expert_params: sum_l w_l K_l of the allocation; `budget_expert_params`: sum_l w_l K_mean.
        tokens: calibration tokens measured.
    """

    budgets: dict
    errors: dict
    expert_params: dict
    mean_experts_per_tok: float
    active_expert_params: int
    budget_expert_params: float
    tokens: int

    def per_layer_config(self) -> dict[int, dict[str, int]]:
        """The `LatentMoEConfig.per_layer_config` entries {layer_idx: {"num_experts_per_tok": K}} of every layer."""
        return {layer_idx: {"num_experts_per_tok": k} for layer_idx, k in sorted(self.budgets.items())}

    def as_dict(self) -> dict:
        """JSON-ready: budgets, errors and expert parameters keyed by layer index."""
        return {
            "mean_experts_per_tok": self.mean_experts_per_tok,
            "active_expert_params": self.active_expert_params,
            "budget_expert_params": self.budget_expert_params,
            "tokens": self.tokens,
            "budgets": {str(idx): k for idx, k in sorted(self.budgets.items())},
            "errors": {str(idx): [round(e, 6) for e in errors] for idx, errors in sorted(self.errors.items())},
            "expert_params": {str(idx): w for idx, w in sorted(self.expert_params.items())},
        }


@torch.no_grad()
def carved_layer_errors(
    model: LatentMoEForCausalLM, calibration_ids: torch.Tensor, batch_size: int = 4
) -> tuple[dict[int, list[float]], int]:
    """e_l(K) for every MoE layer l of a carved model and K in [1, N]: the local error of keeping the router's top K
    experts, as the next layer sees it.

    The model runs with every expert active (`routers.every_expert_active`: for an exact carving, the dense source);
    each MoE block's input x (M, D) is kept with the residual stream r it adds to (the input of
    `post_attention_layernorm`). Each token's N experts are ranked by the router's selection scores (ties to the
    lower index, as routing does), every expert's output is computed alone at gate 1, and with y(K) the routed output
    of the first K of that ranking (after `fc2_latent_proj`), s(K) = r + shared(x) + y(K) is the stream the layer
    writes and n the norm that reads it next (the next layer's `input_layernorm`, or the final norm):
    e_l(K) = sum over tokens ||n(s(K)) - n(s(N))||^2 / sum ||n(s(N))||^2.

    Measured after that norm rather than relative to ||r|| (as `sublayer_errors` does for MoHD): SmolLM2's residual
    stream carries a few channels of large magnitude that its norms' weights scale down, so the error relative to
    ||r|| called the middle layers' experts nearly free, and an allocation from it (K = 3-5 of 128 there) gave a
    worse model than the uniform K.

    Args:
        model: a `LatentMoEForCausalLM` with `router_gate="unit"` (a carving: a selected expert adds its output
            exactly) and the same N in every MoE layer; left at the K it had.
        calibration_ids: (R, T) token ids of calibration text.
        batch_size: rows per forward.

    Returns:
        ({layer_idx: [e(1), ..., e(N)]}, tokens measured).

    Raises:
        ConversionError: not a unit-gate LatentMoE with MoE layers of one N, or `calibration_ids` is not a
            non-empty (R, T) tensor.
    """
    blocks = moe_blocks(model)
    if not blocks or getattr(model.config, "router_gate", None) != "unit":
        raise ConversionError(
            "carved_layer_errors: needs a LatentMoE model with MoE layers and `router_gate='unit'` (a carving), "
            f"got {type(model).__name__} with router_gate={getattr(model.config, 'router_gate', None)!r}."
        )
    counts = {block.gate.num_experts for block in blocks.values()}
    if len(counts) != 1:
        raise ConversionError(
            f"carved_layer_errors: every MoE layer needs the same num_experts, got {sorted(counts)}."
        )
    if calibration_ids.dim() != 2 or calibration_ids.numel() == 0:
        raise ConversionError(
            "carved_layer_errors: calibration ids must be a non-empty (rows, tokens) tensor, "
            f"got {tuple(calibration_ids.shape)}."
        )
    (full,) = counts
    squared = {idx: torch.zeros(full, dtype=torch.float64) for idx in blocks}
    reference = dict.fromkeys(blocks, 0.0)
    kept, streams = {}, {}
    layers = model.model.layers
    # the norm that reads the stream each MoE layer writes: the next layer's input norm, or the final norm
    next_norms = {
        idx: layers[idx + 1].input_layernorm if idx + 1 < len(layers) else model.model.norm for idx in blocks
    }

    def keep(idx):
        def hook(module, args):
            kept[idx] = args[0]

        return hook

    def keep_stream(idx):
        def hook(module, args):
            streams[idx] = args[0]

        return hook

    handles = []
    for idx, block in blocks.items():
        handles.append(block.register_forward_pre_hook(keep(idx)))
        handles.append(layers[idx].post_attention_layernorm.register_forward_pre_hook(keep_stream(idx)))
    tokens = 0
    was_training = model.training
    model.eval()
    try:
        with every_expert_active(model):
            for start in range(0, calibration_ids.shape[0], batch_size):
                batch = calibration_ids[start : start + batch_size].to(model.device)
                kept.clear()
                streams.clear()
                model(input_ids=batch, use_cache=False)
                tokens += batch.numel()
                for idx, block in blocks.items():
                    errors, norm = _ranked_expert_errors(block, kept[idx], streams[idx], next_norms[idx])
                    squared[idx] += errors
                    reference[idx] += norm
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return {idx: (squared[idx] / max(reference[idx], 1e-30)).tolist() for idx in blocks}, tokens


def _ranked_expert_errors(
    block: LatentMoEBlock, hidden_states: torch.Tensor, stream: torch.Tensor, next_norm: torch.nn.Module
) -> tuple[torch.Tensor, float]:
    """(N,) float64 sum over tokens of ||n(s(K)) - n(s(N))||^2 for K = 1..N, and sum ||n(s(N))||^2
    (`carved_layer_errors`)."""
    router = block.gate
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits = router(flat)[0].reshape(flat.shape[0], -1)
    ranking = topk_lower_index(router.selection_scores(router.score(logits)), router.num_experts)  # (M, N)
    latent = block.fc1_latent_proj(flat)
    ones = torch.ones(flat.shape[0], 1, dtype=latent.dtype, device=latent.device)
    outputs = [block.experts(latent, ranking[:, j : j + 1], ones) for j in range(ranking.shape[1])]  # N x (M, l)
    routed = block.fc2_latent_proj(torch.stack(outputs).sum(0))
    full = stream.reshape(flat.shape) + routed
    if block.shared_experts is not None:
        full = full + block.shared_experts(flat)
    target = next_norm(full).double()
    errors = torch.zeros(len(outputs), dtype=torch.float64)
    running = torch.zeros_like(outputs[0])
    for j, output in enumerate(outputs[:-1]):
        running = running + output
        partial = full - routed + block.fc2_latent_proj(running)
        errors[j] = (next_norm(partial).double() - target).pow(2).sum()
    return errors, target.pow(2).sum().item()


def allocate_experts_per_tok(
    model: LatentMoEForCausalLM,
    calibration_ids: torch.Tensor,
    mean_experts_per_tok: float,
    batch_size: int = 4,
    errors: tuple[dict[int, list[float]], int] | None = None,
) -> ExpertBudgets:
    """Each MoE layer's K for the per-token parameter budget of a uniform K = `mean_experts_per_tok`: the errors of
    `carved_layer_errors`, a routed expert's parameters as the cost, and `greedy_budgets` (module docstring, step 3:
    from K = N everywhere, lower the K whose step costs the least error per parameter saved). Apply it with
    `apply_expert_budgets`.

    Args:
        model: a carved `LatentMoEForCausalLM` (`carved_layer_errors`).
        calibration_ids: (R, T) calibration token ids, disjoint from evaluation text.
        mean_experts_per_tok: K_mean in [1, N]; a fraction is allowed (the budget is linear in K).
        batch_size: rows per forward.
        errors: what `carved_layer_errors(model, calibration_ids)` returned, to reuse for another K (the errors do
            not depend on K); None measures them.

    Raises:
        ConversionError: `mean_experts_per_tok` outside [1, N], or the errors cannot be measured.
    """
    errors, tokens = errors if errors is not None else carved_layer_errors(model, calibration_ids, batch_size)
    full = len(next(iter(errors.values())))
    if isinstance(mean_experts_per_tok, bool) or not 1 <= float(mean_experts_per_tok) <= full:
        raise ConversionError(
            f"`mean_experts_per_tok` must be a number in [1, {full}] (the routed experts), got {mean_experts_per_tok!r}."
        )
    blocks = moe_blocks(model)
    weights = {idx: sum(p.numel() for p in blocks[idx].experts.parameters()) // full for idx in errors}
    budget = sum(weights.values()) * float(mean_experts_per_tok)
    ks, _ = greedy_budgets(errors, weights, budget)
    return ExpertBudgets(
        budgets=ks,
        errors=errors,
        expert_params=weights,
        mean_experts_per_tok=float(mean_experts_per_tok),
        active_expert_params=sum(weights[idx] * ks[idx] for idx in ks),
        budget_expert_params=budget,
        tokens=tokens,
    )


def apply_expert_budgets(model: LatentMoEForCausalLM, allocation: ExpertBudgets) -> LatentMoEForCausalLM:
    """Writes the allocation into `model.config.per_layer_config` (so `save_pretrained` records it, merged with the
    entries already there) and sets every router's `top_k` to its layer's K; returns the model.

    Raises:
        ValueError: a K the config refuses (`LatentMoEConfig.validate_architecture`).
    """
    config = model.config
    entries = {int(idx): dict(fields) for idx, fields in (config.to_dict().get("per_layer_config") or {}).items()}
    for idx, fields in allocation.per_layer_config().items():
        entries.setdefault(idx, {}).update(fields)
    config.per_layer_config = entries
    config.validate_architecture()
    for idx, block in moe_blocks(model).items():
        block.gate.top_k = config.per_layer_config[idx].num_experts_per_tok
    return model
