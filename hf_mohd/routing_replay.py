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
"""Routing records in the serving engines' layout, and routing replay from that layout ("rollout routing replay").

The engines' contract. vLLM (`enable_return_routed_experts`, docs/training/routed_experts_replay.md) and SGLang
(`return_routed_experts`, `srt/layers/moe/routed_experts_capturer.py`) return per request an integer array
[tokens, MoE layers, top_k] of expert ids, rows in token order: the prompt tokens, then the generated tokens
(vLLM splits it into `prompt_routed_experts` [prompt_len, L, k] and `routed_experts` [gen_len, L, k]; concatenate
the two). Only tokens that went through the model have a row: the last sampled token is never forwarded, so a
request of P prompt and G generated tokens has P + G - 1 rows (SGLang reads `seqlen - 1` positions; vLLM's
generated part has "`completion_tokens` or fewer" rows). `RoutingCache.routing_record` after `generate` holds the
same rows (its length is the cache length, P + G - 1), with padding; `routed_experts_from_record` converts it.

Replay (Megatron-Core `moe_enable_routing_replay`, verl `router_replay` R2/R3, slime) reuses the indices only: the
gates are recomputed from the live router's dense scores, so the router keeps its gradient (gathering the gates
from probabilities zeroed after a recorded top-k would silently cut it). `routing_replay_from_engine` builds the
`routing_replay=` mapping of a training forward from per-sequence engine arrays and the batch's attention mask
(left or right padding); padding positions, and the last token of a sequence when its row is missing, get a valid
dummy route (ids lo .. lo + k - 1), which only changes outputs at those positions (causal attention, masked keys).

Router kinds: "moe" for LatentMoE (one array per sequence over its MoE layers only); "attn" and "mlp" for MoHD (one
array per sequence and kind, over the layers that have that router). Ids are the record's: LatentMoE expert ids
0 .. E-1; MoHD absolute sub-dimension block ids N_s .. N-1 (shared blocks are never routed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .models.modeling_common import TopKRouter
from .models.routing_cache import RoutingRecord


class RouterSlot(NamedTuple):
    """One router of a model: its layer, how many ids it picks per token, and its valid id range [low, high)."""

    layer_idx: int
    top_k: int
    low: int
    high: int


def router_layout(model: nn.Module) -> dict[str, list[RouterSlot]]:
    """The routers of `model` per kind ("moe", "attn", "mlp"), in layer order: the layer axis of the engine arrays.

    Routers are the `TopKRouter` modules (MoHDRouter, LatentMoERouter): `layer_idx`, `router_name`, `top_k`, a
    `weight` of one row per routed choice, and ids offset by `index_offset` (MoHD: N_s, LatentMoE: 0).

    Raises:
        ValueError: `model` has no router.
    """
    layout: dict[str, list[RouterSlot]] = {}
    for module in model.modules():
        if not isinstance(module, TopKRouter):
            continue
        low = module.index_offset
        slot = RouterSlot(module.layer_idx, module.top_k, low, low + module.weight.shape[0])
        layout.setdefault(module.router_name, []).append(slot)
    if not layout:
        raise ValueError(f"{type(model).__name__} has no router (expected MoHD or LatentMoE routers).")
    return {kind: sorted(slots) for kind, slots in layout.items()}


def _valid_positions(attention_mask: torch.Tensor) -> list[torch.Tensor]:
    if attention_mask.ndim != 2:
        raise ValueError(
            f"`attention_mask` must be (batch, length) with 1 at real tokens; got {attention_mask.shape}."
        )
    return [torch.nonzero(row, as_tuple=True)[0] for row in attention_mask.bool().cpu()]


def _kind_of(kinds, router: str | None, what: str) -> str:
    if router is None:
        if len(kinds) != 1:
            raise ValueError(f"{what} has router kinds {sorted(kinds)}; pass `router=` (one of them).")
        return next(iter(kinds))
    if router not in kinds:
        raise ValueError(f"`router`={router!r} is not in {what} (router kinds {sorted(kinds)}).")
    return router


def routed_experts_from_record(
    routing_record: Mapping[tuple[int, str], RoutingRecord],
    attention_mask: torch.Tensor | None = None,
    router: str | None = None,
) -> list[np.ndarray]:
    """`RoutingCache.routing_record` -> one int32 array [tokens, layers, top_k] per sequence, padding removed.

    Args:
        routing_record: the record, (B, S, k) indices per (layer, router) for S cached positions.
        attention_mask: (B, L), 1 at real tokens. L == S: the mask of the cached positions, every real position has
            a row. L == S + 1: the mask of `generate`'s `sequences` (whose last token was sampled, never
            forwarded); then each sequence's last real token has no row, the engines' convention (P + G - 1 rows),
            also for a sequence that stopped early (an engine never forwards its stop token). None: all positions
            are real (L == S).
        router: the router kind ("moe" for LatentMoE, "attn" or "mlp" for MoHD); needed when the record has two.

    Returns:
        B arrays of shape (tokens_b, number of layers with that router, k), layers in increasing layer index.

    Raises:
        ValueError: an unknown router kind, or a mask whose batch size or length does not fit the record.
    """
    kinds = {kind for _, kind in routing_record}
    kind = _kind_of(kinds, router, "the routing record")
    layers = sorted(layer for layer, name in routing_record if name == kind)
    stacked = torch.stack([routing_record[(layer, kind)].indices for layer in layers], dim=2)  # (B, S, L, k)
    batch, length = stacked.shape[:2]
    if attention_mask is None:
        attention_mask = torch.ones(batch, length, dtype=torch.long)
    if attention_mask.shape[0] != batch or attention_mask.shape[1] not in (length, length + 1):
        raise ValueError(
            f"`attention_mask` {tuple(attention_mask.shape)} does not fit a record of batch {batch} and {length} "
            f"positions: expected ({batch}, {length}) (cached positions) or ({batch}, {length + 1}) (sequences)."
        )
    drop_last = attention_mask.shape[1] == length + 1
    out = []
    for b, positions in enumerate(_valid_positions(attention_mask)):
        if drop_last:
            positions = positions[:-1]
        out.append(stacked[b, positions.to(stacked.device)].cpu().numpy().astype(np.int32))
    return out


def _as_index_array(array, kind: str, sequence: int) -> torch.Tensor:
    where = f"routed experts of sequence {sequence} (router {kind!r})"
    tensor = torch.as_tensor(np.asarray(array) if not isinstance(array, torch.Tensor) else array)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"The {where} must be integers; got dtype {tensor.dtype}.")
    if tensor.ndim != 3:
        raise ValueError(f"The {where} must be [tokens, layers, top_k]; got shape {tuple(tensor.shape)}.")
    return tensor.to(torch.long)


def routing_replay_from_engine(
    model: nn.Module,
    routed_experts: Sequence | Mapping[str, Sequence],
    attention_mask: torch.Tensor,
) -> dict[tuple[int, str], RoutingRecord]:
    """The `routing_replay=` mapping of a forward on a (B, L) batch, from per-sequence engine arrays.

    Args:
        model: the model that will run the forward (its routers give the layer list, top_k and id ranges).
        routed_experts: B arrays (numpy, torch or nested lists; any integer dtype, e.g. vLLM's int16) of shape
            [rows_b, layers, top_k], rows in token order; or, for MoHD, a mapping {"attn": [...], "mlp": [...]}.
        attention_mask: (B, L), 1 at the real tokens of each row of the batch, left or right padded. A sequence
            with n real tokens takes n rows, or n - 1 (the engines' convention: its last token was never
            forwarded; that position gets a dummy route and its logits are not the model's own).

    Returns:
        {(layer_idx, kind): RoutingRecord(indices (B, L, k) int64 on the model's device, weights None)}: indices
        only; the routers recompute the gates from their live scores.

    Raises:
        ValueError: naming the mismatch: the number of sequences, the layer count, top_k, the token count of a
            sequence, an id out of the router's range (e.g. vLLM's -1 for a prefix-cached position without
            routing), or a repeated id within a token's top_k.
    """
    layout = router_layout(model)
    if not isinstance(routed_experts, Mapping):
        if len(layout) != 1:
            raise ValueError(
                f"{type(model).__name__} has router kinds {sorted(layout)}: pass routed experts as a mapping "
                "{kind: one array per sequence}."
            )
        routed_experts = {next(iter(layout)): routed_experts}
    for kind in routed_experts:
        _kind_of(layout, kind, f"{type(model).__name__}'s routers")
    missing = sorted(set(layout) - set(routed_experts))
    if missing:
        raise ValueError(
            f"No routed experts for router kind(s) {missing}; {type(model).__name__} has {sorted(layout)}."
        )
    device = next(model.parameters()).device
    positions = _valid_positions(attention_mask)
    batch, length = attention_mask.shape
    replay = {}
    for kind, arrays in routed_experts.items():
        slots = layout[kind]
        top_ks = {slot.top_k for slot in slots}
        if len(top_ks) != 1:
            raise ValueError(
                f"The {kind!r} routers pick different top_k {sorted(top_ks)}: no [tokens, layers, k] array."
            )
        top_k = top_ks.pop()
        if len(arrays) != batch:
            raise ValueError(
                f"{len(arrays)} sequences of routed experts (router {kind!r}) for a batch of {batch} rows."
            )
        low = torch.tensor([slot.low for slot in slots]).view(1, -1, 1)
        high = torch.tensor([slot.high for slot in slots]).view(1, -1, 1)
        # Dummy route: ids low .. low + k - 1 of each layer, valid and distinct.
        indices = (low + torch.arange(top_k).view(1, 1, -1)).expand(batch, length, -1, -1).clone()  # (B, L, n, k)
        for b, (array, real) in enumerate(zip(arrays, positions, strict=True)):
            tensor = _as_index_array(array, kind, b)
            rows, layers, k = tensor.shape
            where = f"sequence {b} (router {kind!r})"
            if layers != len(slots):
                raise ValueError(
                    f"Layer count mismatch for {where}: the array has {layers} layers, the model has {len(slots)} "
                    f"{kind!r} routers (layers {[slot.layer_idx for slot in slots]})."
                )
            if k != top_k:
                raise ValueError(
                    f"top_k mismatch for {where}: the array has {k} ids per token, the routers pick {top_k}."
                )
            if rows not in (len(real), len(real) - 1):
                raise ValueError(
                    f"Token count mismatch for {where}: {rows} rows for {len(real)} real tokens in the attention mask "
                    f"(expected {len(real)}, or {len(real) - 1} when the last token was never forwarded)."
                )
            bad = (tensor < low) | (tensor >= high)
            if bad.any():
                token, layer, _ = (int(i) for i in torch.nonzero(bad)[0])
                slot = slots[layer]
                raise ValueError(
                    f"Index out of range for {where}: id {int(tensor[token, layer][bad[token, layer]][0])} at row "
                    f"{token}, layer {slot.layer_idx}; valid ids are {slot.low} .. {slot.high - 1} (-1 is vLLM's mark "
                    "of a prefix-cached position without routing)."
                )
            repeated = (tensor.sort(dim=-1).values.diff(dim=-1) == 0).any(-1)  # (rows, layers)
            if repeated.any():
                token, layer = (int(i) for i in torch.nonzero(repeated)[0])
                raise ValueError(
                    f"Repeated id for {where} at row {token}, layer {slots[layer].layer_idx}: "
                    f"{tensor[token, layer].tolist()}."
                )
            indices[b, real[:rows]] = tensor
        for n, slot in enumerate(slots):
            replay[(slot.layer_idx, kind)] = RoutingRecord(indices[:, :, n].contiguous().to(device), None)
    return replay


__all__ = ["RouterSlot", "router_layout", "routed_experts_from_record", "routing_replay_from_engine"]
