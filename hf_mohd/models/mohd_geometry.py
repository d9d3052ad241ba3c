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
"""MoHD's block geometry and the block-span arithmetic of its few-token plans.

A MoHD model cuts the hidden width D into N sub-dimension blocks of s = D / N scalars, the first N_s shared (every
token reads and writes them), the other N_r = N - N_s routed, of which a token picks k (arXiv 2412.05644, section 3).
`MoHDSubDimGeometry` holds those numbers; the functions below turn picked block ids into runs of consecutive blocks,
which the spans plan reads as contiguous weight slices (`mohd_plans.MoHDSpansPlan`).

This file is copied next to the weights by `save_pretrained` (remote code): it imports only `torch`, `transformers`
and same-folder siblings.
"""

from typing import NamedTuple

import torch


class MoHDSubDimGeometry(NamedTuple):
    """The block geometry of a MoHD model: N `num_sub_dims` blocks of s `block` scalars, the first N_s `num_shared`
    shared, N_r `num_routed` routed of which a token picks k `top_k`."""

    num_sub_dims: int
    num_shared: int
    num_routed: int
    top_k: int
    block: int

    @classmethod
    def of(cls, config) -> "MoHDSubDimGeometry":
        """From a `MoHDConfig`."""
        return cls(
            config.num_sub_dims,
            config.num_shared_sub_dims,
            config.num_routed_sub_dims,
            config.num_routed_sub_dims_per_tok,
            config.sub_dim_size,
        )

    @property
    def hidden_size(self) -> int:
        return self.num_sub_dims * self.block

    @property
    def shared_width(self) -> int:
        """N_s * s: the leading hidden-width columns (input side) or rows (output side) every token reads."""
        return self.num_shared * self.block


# Block helpers of the spans plan


def token_rows(tokens: tuple[int, ...], m: int) -> slice | torch.Tensor:
    """Sorted distinct positions of some of a batch's `m` tokens -> a slice when they are one run (`slice(None)` for
    all m), else an int64 index tensor."""
    if tokens[-1] - tokens[0] == len(tokens) - 1:
        return slice(None) if len(tokens) == m else slice(tokens[0], tokens[-1] + 1)
    return torch.tensor(tokens)


def block_token_spans(first: int, indices: list[list[int]]) -> tuple[tuple[tuple[int, int], ...], tuple]:
    """Per-block form of `contiguous_spans`: the (M, k) picked block ids (each >= first) -> spans of consecutive blocks
    picked by the same tokens, and those tokens per span (`token_rows`). The first span [0, first) holds the shared
    blocks, used by all M tokens; a routed block picked by every token right after it joins it. Example: first 2,
    indices [[2, 4], [2, 5], [4, 2]] -> spans ((0, 3), (4, 5), (5, 6)), rows (all, tokens 0 and 2, token 1)."""
    m = len(indices)
    picked: dict[int, list[int]] = {}
    for token, blocks in enumerate(indices):
        for block in blocks:
            picked.setdefault(block, []).append(token)
    spans, tokens = [[0, first]], [tuple(range(m))]
    for block in sorted(picked):
        users = tuple(picked[block])
        if block == spans[-1][1] and users == tokens[-1]:
            spans[-1][1] += 1
        else:
            spans.append([block, block + 1])
            tokens.append(users)
    return tuple((start, stop) for start, stop in spans), tuple(token_rows(users, m) for users in tokens)


def contiguous_spans(first: int, blocks) -> tuple[tuple[int, int], ...]:
    """[0, first) followed by the sorted, distinct `blocks` (each >= first) merged into maximal half-open runs of
    consecutive ids; a run that starts at `first` extends the first span. Example: first 6, blocks {6, 7, 9} ->
    ((0, 8), (9, 10))."""
    spans = [[0, first]]
    for block in sorted(set(blocks)):
        if block == spans[-1][1]:
            spans[-1][1] += 1
        else:
            spans.append([block, block + 1])
    return tuple((start, stop) for start, stop in spans)
