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
"""Key/value cache that also keeps the routing record of every cached position."""

from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicCache


class RoutingRecord(NamedTuple):
    """Routing of one router for a span of tokens.

    Attributes:
        indices: (B, S, k) int64, absolute ids (MoHD: sub-dimension block 0..N-1; LatentMoE: expert 0..E-1).
        weights: (B, S, k), the gates actually applied to those picks.
    """

    indices: torch.Tensor
    weights: torch.Tensor


class RoutingCache(DynamicCache):
    """A `DynamicCache` that records, per (layer index, router name), the routing of every cached token.

    Router names: "attn" and "mlp" for MoHD, "moe" for LatentMoE. The record follows the keys and values through
    beam-search `reorder_cache`, `batch_repeat_interleave`, `batch_select_indices` and `crop` (assisted and
    prompt-lookup decoding), so that `record[key].indices.shape[1] == get_seq_length()` at all times.

    Read it with `cache.routing_record` (a dict) or `cache.get_routing(layer_idx, router)`. Pass the dict back as
    `routing_replay=` to a forward to reuse the indices (routing replay).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._record: dict[tuple[int, str], RoutingRecord] = {}
        # routing of the forwards since the record was last read, concatenated when it is read: a decoding step
        # appends to a list instead of copying the whole record (two concatenations per router and step)
        self._pending: dict[tuple[int, str], list[RoutingRecord]] = {}

    @property
    def routing_record(self) -> dict[tuple[int, str], RoutingRecord]:
        """The record, (layer index, router name) -> `RoutingRecord` of every cached token, (B, S, k) each."""
        for key, chunks in self._pending.items():
            previous = self._record.get(key)
            if previous is not None:
                chunks = [previous, *chunks]
            dtype = chunks[0].weights.dtype
            self._record[key] = RoutingRecord(
                torch.cat([chunk.indices for chunk in chunks], dim=1) if len(chunks) > 1 else chunks[0].indices,
                torch.cat([chunk.weights.to(dtype) for chunk in chunks], dim=1)
                if len(chunks) > 1
                else chunks[0].weights,
            )
        self._pending = {}
        return self._record

    @routing_record.setter
    def routing_record(self, record: dict[tuple[int, str], RoutingRecord]) -> None:
        self._record, self._pending = record, {}

    def update_routing(self, layer_idx: int, router: str, indices: torch.Tensor, weights: torch.Tensor) -> None:
        """Appends (B, T, k) `indices` and `weights` of the tokens of this forward to the record."""
        self._pending.setdefault((layer_idx, router), []).append(RoutingRecord(indices, weights.detach()))

    def get_routing(self, layer_idx: int, router: str) -> RoutingRecord | None:
        """The record of one router, or None if nothing was routed there yet."""
        return self.routing_record.get((layer_idx, router))

    def _map_record(self, fn) -> None:
        self.routing_record = {
            key: RoutingRecord(fn(rec.indices), fn(rec.weights)) for key, rec in self.routing_record.items()
        }

    def reset(self):
        super().reset()
        self.routing_record = {}

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self._map_record(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0:
            self._map_record(lambda t: t[:, :tokens_to_remove])

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._map_record(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self._map_record(lambda t: t[indices, ...])
