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
"""Routers of a carved LatentMoE, fitted without training (MoEfication, Zhang et al., Findings of ACL 2022, arXiv
2110.01786, section 3.2 "expert selection", in a linear, closed-form version), and the tools a carve's checks use.

Per layer, `fit_carved_routers` sets the router to the ridge least-squares fit from the FFN input x onto the centred
log activation mass of each expert, y_e = log(sum_{i in S_e} |h_i| + eps) - mean over experts (float64):
W_r^T = (X^T X + lambda I)^{-1} X^T Y, lambda = `ridge` * trace(X^T X) / D, eps = `MASS_FLOOR` * mean mass. The top-K
of W_r x then predicts the K experts of largest mass (MoEfication's "MLP selection" trains a small network to predict
each expert's activation sum). Softmax (or sigmoid) scores keep the order of the logits.

`every_expert_active` runs a carved model at K = N, where with unit gates it computes its dense source (the check of
`hf-mohd convert latent-moe --carve --verify`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ...models.modeling_latent_moe import LatentMoEBlock, LatentMoEForCausalLM, LatentMoERouter
from ..source import ConversionError


MASS_FLOOR = 1e-6  # eps of the log-mass target, relative to the mean expert mass of the layer


def expert_mass(block: LatentMoEBlock, hidden_states: torch.Tensor) -> torch.Tensor:
    """True activation mass of every routed expert: (..., D) FFN inputs -> (M, N), mass_e = sum over the expert's
    neurons of |h_i| (the expert's intermediate activation, computed in at least fp32 at the block's latent input)."""
    experts = block.experts
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    latent = block.fc1_latent_proj(flat)
    dtype = torch.promote_types(latent.dtype, torch.float32)
    latent = latent.to(dtype)
    if hasattr(experts, "gate_up_proj"):
        gate, up = torch.einsum("md,ekd->mek", latent, experts.gate_up_proj.to(dtype)).chunk(2, dim=-1)
        inner = experts.act_fn(gate.clone()) * up  # act_fn may work in place: on a copy
    else:
        inner = experts.act_fn(torch.einsum("md,ekd->mek", latent, experts.up_proj.to(dtype)).clone())
    return inner.abs().sum(-1)


def moe_blocks(model: LatentMoEForCausalLM) -> dict[int, LatentMoEBlock]:
    """The MoE blocks of a LatentMoE model by decoder layer index, in layer order (dense layers left out)."""
    return {idx: layer.mlp for idx, layer in enumerate(model.model.layers) if isinstance(layer.mlp, LatentMoEBlock)}


def _log_mass_target(mass: torch.Tensor, floor: float) -> torch.Tensor:
    logs = torch.log(mass + floor)
    return logs - logs.mean(-1, keepdim=True)


@torch.no_grad()
def fit_carved_routers(model: LatentMoEForCausalLM, inputs: list[torch.Tensor], *, ridge: float = 0.1) -> list[float]:
    """Set every router of a carved `model` to the ridge fit of the centred log expert masses onto the FFN input
    (module docstring, step 5), in place.

    Args:
        model: a carved `LatentMoEForCausalLM` (its experts define the masses).
        inputs: per MoE layer (every layer of a carved model) the (M, D) FFN inputs of the calibration tokens
            (`ffn_inputs`), M >= D.
        ridge: lambda relative to the mean eigenvalue of X^T X (> 0).

    Returns:
        The coefficient of determination R^2 of each layer's fit on the calibration tokens.

    Raises:
        ConversionError: `ridge` <= 0, or fewer calibration tokens than hidden_size.
    """
    if not ridge > 0:
        raise ConversionError(f"`ridge` must be > 0, got {ridge!r}.")
    r2 = []
    for block, x in zip(moe_blocks(model).values(), inputs, strict=True):
        width = x.shape[1]
        if x.shape[0] < width:
            raise ConversionError(
                f"Fitting the carved routers needs at least hidden_size = {width} calibration tokens, got {x.shape[0]}."
            )
        mass = expert_mass(block, x).double()
        x = x.double()
        y = _log_mass_target(mass, MASS_FLOOR * mass.mean().item() + 1e-30)
        gram = x.T @ x
        lam = ridge * torch.trace(gram) / width
        solution = torch.linalg.solve(gram + lam * torch.eye(width, dtype=gram.dtype), x.T @ y)  # (D, N)
        block.gate.weight.copy_(solution.T.to(block.gate.weight.dtype))
        residual = y - x @ solution
        r2.append((1 - residual.pow(2).sum() / (y - y.mean(0)).pow(2).sum()).item())
    return r2


@contextlib.contextmanager
def every_expert_active(model: LatentMoEForCausalLM) -> Iterator[LatentMoEForCausalLM]:
    """Within the block, every router selects all N experts (K = N): with `router_gate="unit"` a carved model then
    computes its source's function (at full width or latent width l = D; at l < D, the source with every routed
    expert's input and output projected onto the latent basis). The routers' `top_k` is restored on exit."""
    routers = [m for m in model.modules() if isinstance(m, LatentMoERouter)]
    saved = [router.top_k for router in routers]
    try:
        for router in routers:
            router.top_k = router.num_experts
        yield model
    finally:
        for router, top_k in zip(routers, saved, strict=True):
            router.top_k = top_k


__all__ = ["MASS_FLOOR", "every_expert_active", "expert_mass", "fit_carved_routers", "moe_blocks"]
