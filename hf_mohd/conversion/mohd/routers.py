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
quadratic, so it can only use what the rest of the token's input says about block j's energy. The SmolLM2
experiments measure how much: the routers' recall of the oracle's top-k, and the oracle itself replayed as a routing
record (`experiments/smollm2/routing_analysis.py`).
"""

from __future__ import annotations

import logging

import torch

from ...models.modeling_mohd import MoHDForCausalLM, MoHDRouter
from ..source import ConversionError, DenseLlamaSource
from .rotation import for_each_sublayer_input


logger = logging.getLogger(__name__)

ROUTER_INITS = ("random", "fitted")
ENERGY_FLOOR = 1e-8  # per channel of a block: log(e + 1e-8 s) stays finite for an all-zero block


def mohd_routers(model: MoHDForCausalLM) -> dict[tuple[int, str], MoHDRouter]:
    """{(layer_idx, "attn" / "mlp"): router} of every sparsified sublayer of a MoHD model (a dense sublayer has
    none)."""
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
    routers = mohd_routers(model)
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


__all__ = [
    "ROUTER_INITS",
    "block_energies",
    "fit_routers",
    "log_energy_targets",
    "mohd_routers",
]
