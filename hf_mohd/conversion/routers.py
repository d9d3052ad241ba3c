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
"""MoHD routers of a converted model fitted on calibration text, and the oracle routing they imitate.

Importance of routed block j for a token at one sublayer: the energy of the sublayer's normalised input x in that
block, e_j = sum of x_c^2 over its s channels (in a model rotated by `rotation.rotate_llama`, whose norm weights are
1, x is exactly what the sublayer reads). Keeping the highest-energy blocks keeps the most of the input, the rule of
magnitude-based activation sparsity (TEAL, Liu et al., ICLR 2025, arXiv 2408.14690; Deja Vu, Liu et al., ICML 2023).

Fitting rule (a choice, documented in the model card): per sparsified sublayer, the router W_r (N_r x D, no bias)
is the ridge regression, in float64, of the per-token centred log block energy
    y_j = log(e_j + 1e-8 s) - mean over routed blocks i of log(e_i + 1e-8 s)
onto x, over the calibration tokens of the dense (rotated) model:
    W_r^T = (X^T X + lambda I)^{-1} X^T Y,  lambda = `ridge` * trace(X^T X) / D.
Then logits W_r x predict log e_j up to a per-token constant, so softmax(W_r x) predicts each routed block's share of
the routed energy and its top-k predicts the highest-energy blocks. The regression is linear in x while e_j is
quadratic, so it can only use what the rest of the token's input says about block j's energy; the recall of the
oracle's top-k (`routing_recall`) measures how much that is (a random router gets k / N_r).

The oracle (`oracle_routing_record`) is a routing record in `RoutingCache.routing_record`'s format, built from the true
importances of the dense (rotated) model on the same tokens; passed as `routing_replay=` it makes every router use
those blocks. With zero router weights and `routed_gate="normalized"` the recomputed gates are exactly
k (1 / N_r) / (k / N_r) = 1, so the oracle applies gate 1 to the selected blocks (`zero_routers`).
"""

from __future__ import annotations

import logging

import torch

from ..models.modeling_common import topk_lower_index
from ..models.modeling_mohd import MoHDForCausalLM, MoHDRouter
from ..models.routing_cache import RoutingRecord
from .rotation import for_each_sublayer_input
from .source import ConversionError, DenseLlamaSource


logger = logging.getLogger(__name__)

ROUTER_INITS = ("random", "fitted")
ENERGY_FLOOR = 1e-8  # per channel of a block: log(e + 1e-8 s) stays finite for an all-zero block


def _routers(model: MoHDForCausalLM) -> dict[tuple[int, str], MoHDRouter]:
    return {(m.layer_idx, m.router_name): m for m in model.modules() if isinstance(m, MoHDRouter)}


def block_energies(x: torch.Tensor, num_sub_dims: int) -> torch.Tensor:
    """(M, D) -> (M, N) energies: e_j = sum of x_c^2 over block j's D / N consecutive channels."""
    return x.view(x.shape[0], num_sub_dims, -1).pow(2).sum(-1)


def log_energy_targets(x: torch.Tensor, num_sub_dims: int, num_shared: int) -> torch.Tensor:
    """(M, D) normalised inputs -> (M, N_r) centred log energies of the routed blocks (the regression target)."""
    size = x.shape[1] // num_sub_dims
    logs = torch.log(block_energies(x, num_sub_dims)[:, num_shared:] + ENERGY_FLOOR * size)
    return logs - logs.mean(-1, keepdim=True)


@torch.no_grad()
def fit_routers(
    model: MoHDForCausalLM,
    source: DenseLlamaSource,
    calibration_ids: torch.Tensor,
    *,
    ridge: float = 1e-3,
    batch_size: int = 4,
) -> dict[str, float]:
    """Set every router of `model` to the ridge fit of the centred log block energies (module docstring), in place.

    Args:
        model: a converted `MoHDForCausalLM` whose weights are `source`'s (same basis: pass the rotated source when
            the model was rotated).
        source: the dense LLaMA the model was converted from; its sublayer inputs are the regression data.
        calibration_ids: (B, T) calibration token ids (at least hidden_size tokens).
        ridge: lambda relative to the mean eigenvalue of X^T X (> 0).
        batch_size: rows per calibration forward.

    Returns:
        {"tokens": calibration tokens, "r2": mean coefficient of determination of the fit over routers (on the
        calibration tokens)}.

    Raises:
        ConversionError: the model has no routers, `ridge` <= 0, or too little calibration text.
    """
    routers = _routers(model)
    if not routers:
        raise ConversionError("The model has no routers to fit (every sub-dimension is shared).")
    if not ridge > 0:
        raise ConversionError(f"`ridge` must be > 0, got {ridge}.")
    width = model.config.hidden_size
    if calibration_ids.ndim != 2 or calibration_ids.numel() < width:
        raise ConversionError(
            f"Fitting routers needs (batch, seq) calibration ids with at least hidden_size = {width} tokens, got "
            f"shape {tuple(calibration_ids.shape)}."
        )
    n, n_s = model.config.num_sub_dims, model.config.num_shared_sub_dims
    stats = {key: [0.0, 0.0, 0.0, 0.0] for key in routers}  # X^T X, X^T Y, Y^T Y (diag), sum Y

    def accumulate(layer, router, x):
        if (layer, router) not in stats:
            return
        y = log_energy_targets(x, n, n_s)
        entry = stats[(layer, router)]
        entry[0] = entry[0] + x.T @ x
        entry[1] = entry[1] + x.T @ y
        entry[2] = entry[2] + y.pow(2).sum(0)
        entry[3] = entry[3] + y.sum(0)

    for_each_sublayer_input(source.build_llama(), calibration_ids, accumulate, batch_size)
    tokens = calibration_ids.numel()
    r2 = []
    for key, router in routers.items():
        gram, cross, yy, ysum = stats[key]
        lam = ridge * torch.trace(gram) / width
        solution = torch.linalg.solve(gram + lam * torch.eye(width, dtype=gram.dtype), cross)  # (D, N_r)
        router.weight.copy_(solution.T.to(router.weight.dtype))
        # Residual sum of squares from the sufficient statistics: Y^T Y - 2 W^T X^T Y + W^T X^T X W (diagonals).
        rss = yy - 2 * (solution * cross).sum(0) + (solution * (gram @ solution)).sum(0)
        tss = yy - ysum.pow(2) / tokens
        r2.append((1 - rss.sum() / tss.sum()).item())
    logger.info("Fitted %d routers on %d tokens: mean R^2 %.3f", len(routers), tokens, sum(r2) / len(r2))
    return {"tokens": int(tokens), "r2": sum(r2) / len(r2)}


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
        for router in _routers(model).values():
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
    routers = _routers(model)
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


__all__ = [
    "ROUTER_INITS",
    "block_energies",
    "fit_routers",
    "log_energy_targets",
    "oracle_routing_record",
    "routing_recall",
    "zero_routers",
]
