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
"""MoHD's plans: the routing of M tokens in the form one strategy computes with, each plan type computing its own
projections.

A sparsified sublayer reads only the gated active blocks of its input (`project_in`) and writes only the active
blocks of its output (`project_out`; arXiv 2412.05644, section 3, steps 3-4). The plan types, by the number of tokens
M and where they run (`mohd_strategies` chooses):

- `MoHDMaskedPlan`: the reference, dense products on the gated input and a mask on the output;
- `MoHDGroupedPlan`: many tokens (prefill, training), the routed blocks dispatched like experts (`mohd_products`),
  one routing slot at a time, scattered back by `index_add_`;
- `MoHDSortedPlan`: many tokens, the (token, block) pairs of all slots sorted by block once, one grouped product per
  side and no atomic accumulation (the accelerators' form);
- `MoHDIndexedPlan`: few tokens through index tensors (`torch.compile`, accelerators);
- `MoHDSpansPlan`: few tokens on an eager CPU run, the picked blocks read as contiguous weight spans;
- `MoHDTokenPlan`: one token on an eager CPU run without autograd (decoding), natively (`native_gather`) or in torch.

Shapes: M tokens, D hidden_size, N sub-dimensions of s = D / N scalars, N_s shared, N_r = N - N_s routed, k routed
picks per token; "in" and "out" the widths of a projection.

This file is copied next to the weights by `save_pretrained` (remote code): it imports only `torch`, `transformers`
and same-folder siblings.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .modeling_common import autocast_off
from .mohd_geometry import MoHDSubDimGeometry, contiguous_spans
from .mohd_layout import fused_block_major_weight, is_block_major, split_outputs
from .mohd_products import (
    MoHDDistinctRows,
    MoHDGatheredGroupedMatmul,
    MoHDGroupedLinearIn,
    MoHDGroupedLinearOut,
    MoHDRepeatedRows,
    MoHDRowIndexAdd,
    grouped_matmul,
    mix_compact_blocks,
)


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes a matmul on `tensor` in (`nn.Linear`, `torch.addmm`, `torch.mm`): its lower-precision
    dtype where autocast is on for the tensor's device and the tensor is floating point other than float64 (which
    autocast leaves as it is), else None.

    The host-ids plan reads it because the `out=` forms of its products are not autocast ops (autocast neither casts
    their operands nor their result): where autocast would cast them it takes the functional forms, which it casts.
    """
    device_type = tensor.device.type
    if not torch.is_autocast_enabled(device_type) or not tensor.is_floating_point() or tensor.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(device_type)


def single_autograd_function_dtype(linear: nn.Module, *tensors: torch.Tensor) -> torch.dtype | None:
    """The dtype in which a grouped-plan product with `linear` runs as one autograd Function (`MoHDGroupedLinearIn`,
    `MoHDGroupedLinearOut`, which keep less for backward), or None where autograd composes the same computation
    from its views of the weight instead (`torch.compile`'s tracing; operands of mixed dtypes without autocast).

    Eager with autocast on for the weight's device: autocast's dtype (`autocast_dtype`), the dtype `F.linear` would
    compute in, unless an operand is float64 (which autocast does not cast); the caller casts the operands and runs
    the Function with autocast off (`autocast_off`). Eager without autocast: the weight's dtype where `tensors`, the
    weight and any bias share it.
    """
    if torch.compiler.is_compiling():
        return None
    weight, bias = linear.weight, getattr(linear, "bias", None)
    operands = [*tensors, weight, *([] if bias is None else [bias])]
    cast = autocast_dtype(weight)
    if cast is not None:
        return None if any(t.dtype == torch.float64 for t in operands) else cast
    return weight.dtype if all(t.dtype == weight.dtype for t in operands) else None


# Plans: the routing of M tokens, each type computing its own projections


@dataclasses.dataclass(slots=True)
class MoHDPlan:
    """The routing of M tokens in the form one strategy computes with; each plan type computes its own projections.

    Fields common to every plan: `geometry` (the model's blocks) and `gates`, the input gates the router's gradient
    flows through (their shape is the plan type's); `inactive`, set by the sublayer only where it compensates
    dropped blocks: (M, N) 1.0 at the blocks a token neither reads nor writes, else 0. `dataclasses.replace` makes a
    copy with other fields (the tensor-parallel path replaces `gates`).
    """

    geometry: MoHDSubDimGeometry
    gates: torch.Tensor
    inactive: torch.Tensor | None = dataclasses.field(default=None, kw_only=True)

    def project_in(self, hidden_states: torch.Tensor, linears) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) tensor per linear of `linears`, reading only the gated active blocks."""
        raise NotImplementedError

    def project_out(self, hidden_states: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """(M, in) -> (M, N, s) blocks, zero outside each token's active blocks."""
        raise NotImplementedError

    def sparse_block_positions(self, blocks: torch.Tensor, fusion: nn.Module) -> torch.Tensor | None:
        """For group fusion of the `project_out` result `blocks` (M, N, s) by `fusion`: the (k, M) rows of
        `blocks.view(-1, s)` holding the routed blocks, where the rest outside the shared blocks is zero and
        `MoHDSparseBlockMix` may keep only those for backward; None where the plain product applies."""
        return None

    def project_out_mixed(
        self, hidden_states: torch.Tensor, linear: nn.Linear, fusion: nn.Module, scale: float
    ) -> torch.Tensor | None:
        """(M, in) -> the group-fused (M, N, s) `F @ project_out(hidden_states, linear)` for the (N, N) matrix
        F = `fusion.matrix(dtype, scale)` (`MoHDGroupFusion`), computed from the active blocks alone, or None where
        the caller composes the two (this plan has no such form, or it does not apply here)."""
        return None


@dataclasses.dataclass(slots=True)
class MoHDMaskedPlan(MoHDPlan):
    """Masked (reference) form: dense products on the gated input, a binary mask on the output.

    gates (M, N): 1 on the shared blocks, the router's gate on the picked ones, 0 elsewhere; mask (M, N) binary.
    """

    mask: torch.Tensor

    def project_in(self, hidden_states: torch.Tensor, linears) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) tensor per linear, each reading g ⊙ x (any module: PEFT, quantised linears)."""
        g, m = self.geometry, hidden_states.shape[0]
        gated = (hidden_states.view(m, g.num_sub_dims, g.block) * self.gates[..., None]).view(m, -1)
        return [linear(gated) for linear in linears]

    def project_out(self, hidden_states: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """(M, in) -> (M, N, s), zero outside the active blocks."""
        g = self.geometry
        out = linear(hidden_states).view(hidden_states.shape[0], g.num_sub_dims, g.block)
        return out * self.mask[..., None]


@dataclasses.dataclass(slots=True)
class MoHDGroupedPlan(MoHDPlan):
    """Many tokens (prefill, training): the routed blocks dispatched like experts, one routing slot at a time.

    For slot j of the k slots, `token_index[j]` lists the M tokens sorted by the routed block they picked in that
    slot, `block_index[j]` those blocks (routed ids 0..N_r-1), `gates[j]` their gates, and `offsets[j]` the int32
    group ends of the grouped product. Shapes: token_index, block_index (k, M); gates (k, M, 1); offsets (k, N_r).
    Working slot by slot keeps every intermediate at M rows, not M * k. The shared blocks are one dense product over
    the first N_s * s columns (input side) or rows (output side); the routed ones are products with views of the
    `nn.Linear` weight (no copy), scattered back with `index_add_`: on an eager CPU run one product per group, else
    one grouped matmul (`grouped_parts`).
    """

    token_index: torch.Tensor
    block_index: torch.Tensor
    offsets: torch.Tensor

    def project_in(self, hidden_states: torch.Tensor, linears) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) tensor per linear: shared columns dense, routed columns grouped."""
        g, m = self.geometry, hidden_states.shape[0]
        shared = hidden_states[:, : g.shared_width]
        # gated routed inputs per slot, (k, M, s), in the plan's order
        rows = self.token_index * g.num_sub_dims + g.num_shared + self.block_index
        routed = hidden_states.reshape(m * g.num_sub_dims, g.block).index_select(0, rows.reshape(-1))
        routed = routed.view(*rows.shape, g.block) * self.gates
        outputs = []
        cast = {}  # the operands cast once per dtype, not once per linear
        for linear in linears:
            weight = linear.weight
            dtype = single_autograd_function_dtype(linear, hidden_states, routed)
            if dtype is not None:
                if dtype not in cast:
                    cast[dtype] = shared.to(dtype), routed.to(dtype)
                bias = None if linear.bias is None else linear.bias.to(dtype)
                with autocast_off(weight.device.type):
                    outputs.append(
                        MoHDGroupedLinearIn.apply(
                            *cast[dtype], self.token_index, self.offsets, weight.to(dtype), bias, g.num_routed, g.block
                        )
                    )
                continue
            out = F.linear(shared, weight[:, : g.shared_width], linear.bias)
            # (N_r, s, out) view of the routed columns: block j is weight[:, D_s + j s : D_s + (j + 1) s].T
            routed_weight = weight[:, g.shared_width :].view(weight.shape[0], g.num_routed, g.block).permute(1, 2, 0)
            for slot in range(g.top_k):
                routed_out = grouped_matmul(routed[slot], routed_weight, self.offsets[slot]).to(out.dtype)
                if torch.is_grad_enabled():
                    out = MoHDRowIndexAdd.apply(out, self.token_index[slot], routed_out)
                else:  # no backward to save for; dynamo traces `mark_dirty` only where autograd records the Function
                    out = out.index_add_(0, self.token_index[slot], routed_out)
            outputs.append(out)
        return outputs

    def project_out(self, hidden_states: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """(M, in) -> (M, N, s): shared rows dense, each token's routed rows grouped, other blocks 0."""
        g, m = self.geometry, hidden_states.shape[0]
        weight, bias = linear.weight, linear.bias
        dtype = single_autograd_function_dtype(linear, hidden_states)
        if dtype is not None:
            with autocast_off(weight.device.type):
                return MoHDGroupedLinearOut.apply(
                    hidden_states.to(dtype), self.token_index, self.block_index, self.offsets, weight.to(dtype),
                    None if bias is None else bias.to(dtype), g.num_shared, g.block,
                )  # fmt: skip
        shared, routed = self.compact_out(hidden_states, linear)
        routed_blocks = hidden_states.new_zeros(m * g.num_routed, g.block)
        for slot, rows in enumerate(routed):
            positions = self.token_index[slot] * g.num_routed + self.block_index[slot]
            routed_blocks = routed_blocks.index_add_(0, positions, rows)
        return torch.cat([shared, routed_blocks.view(m, g.num_routed, g.block)], dim=1)

    def compact_out(self, hidden_states: torch.Tensor, linear: nn.Linear) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The active output blocks by autograd's composition: the shared blocks (M, N_s, s) and, per routing slot,
        the (M, s) routed blocks in the slot's row order (`token_index`, `block_index`)."""
        g, m = self.geometry, hidden_states.shape[0]
        weight, bias = linear.weight, linear.bias
        shared = F.linear(hidden_states, weight[: g.shared_width], None if bias is None else bias[: g.shared_width])
        # (N_r, in, s) view of the routed rows: block j is weight[D_s + j s : D_s + (j + 1) s].T
        routed_weight = weight[g.shared_width :].view(g.num_routed, g.block, weight.shape[1]).transpose(1, 2)
        routed_bias = None if bias is None else bias[g.shared_width :].view(g.num_routed, g.block)
        routed = []
        for slot in range(g.top_k):
            rows = MoHDGatheredGroupedMatmul.apply(
                hidden_states, self.token_index[slot], routed_weight, self.offsets[slot]
            )
            if routed_bias is not None:
                rows = rows + routed_bias[self.block_index[slot]]
            routed.append(rows.to(hidden_states.dtype))
        return shared.view(m, g.num_shared, g.block), routed

    def project_out_mixed(
        self, hidden_states: torch.Tensor, linear: nn.Linear, fusion: nn.Module, scale: float
    ) -> torch.Tensor | None:
        """While compiling, `mix_compact_blocks` on `compact_out`'s blocks (eager autograd keeps the compact blocks
        through `MoHDSparseBlockMix` instead, on the single-Function product)."""
        if not torch.compiler.is_compiling():
            return None
        shared, routed = self.compact_out(hidden_states, linear)
        dtype = torch.promote_types(shared.dtype, routed[0].dtype)  # the dtype `project_out`'s concatenation has
        routed = [rows.to(dtype) for rows in routed]
        matrix = fusion.matrix(dtype, scale)
        return mix_compact_blocks(matrix, shared.to(dtype), routed, self.token_index, self.block_index)

    def sparse_block_positions(self, blocks: torch.Tensor, fusion: nn.Module) -> torch.Tensor | None:
        """The routed blocks' rows while autograd records an eager step (`project_out`'s blocks are zero outside the
        shared and the routed (token, block) pairs on both of its paths; `MoHDGroupFusion` casts its weight to the
        blocks' dtype, and `MoHDSparseBlockMix` runs with autocast off, so autocast does not change the product)."""
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        g = self.geometry
        return self.token_index * g.num_sub_dims + g.num_shared + self.block_index


def product_dtype(weight: torch.Tensor, hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype of a grouped product of `hidden_states` rows with blocks of `weight`, as `F.linear` would compute it:
    autocast's (`autocast_dtype`) where autocast casts the weight and neither operand is float64, else the weight's
    (`torch.nn.functional.grouped_mm` is not an autocast op, so the plan casts its operands itself)."""
    cast = autocast_dtype(weight)
    if cast is None or torch.float64 in (weight.dtype, hidden_states.dtype):
        return weight.dtype
    return cast


@dataclasses.dataclass(slots=True)
class MoHDSortedPlan(MoHDPlan):
    """Many tokens on accelerators (prefill, training, batched decoding): the P = M * k (token, routed block) pairs
    of every routing slot sorted by block once, one grouped product per side and projection (one for all the input
    projections where they share a block-major storage), and no atomic accumulation, forward or backward.

    Pair p = token * k + slot is the router's order. `order` (P,) lists the pairs sorted by routed block (stable),
    `inverse` (P,) the sorted position of each pair (`order[inverse[p]] == p`), `tokens` and `blocks` (P,) the token
    and routed block id (0..N_r-1) of each sorted pair, `offsets` (N_r,) int32 the group ends of the grouped product
    (`torch.searchsorted` on the sorted blocks: fixed length, no host read), `gates` (P, 1) the pairs' gates in sorted
    order (`MoHDRepeatedRows`: the router's gradient comes back by the inverse permutation).

    - `project_in`: each pair's gated input block (`MoHDDistinctRows`: distinct rows, written back to their own rows in
      backward) times its block of the weight, one row per pair; the k rows of a token are brought back to the
      router's order (a permutation) and summed by a reshape; the shared columns are one dense product.
    - `project_out`: each pair's token row (`MoHDRepeatedRows`, k reads per token, summed by a reshape in backward)
      times its block of the weight, written to the disjoint (token, block) slices of the output (`index_copy`,
      whose backward is a gather); the shared rows are one dense product.

    The grouped products are `grouped_matmul` (`torch.nn.functional.grouped_mm` where the device and dtype have it,
    whose backward is grouped products again); the same sort serves the forward and the backward of both sides.
    """

    order: torch.Tensor
    inverse: torch.Tensor
    tokens: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def of_routes(cls, geometry: MoHDSubDimGeometry, indices: torch.Tensor, weights: torch.Tensor) -> "MoHDSortedPlan":
        """The plan of the router's (M, k) absolute block ids `indices` and their gates `weights`: one stable sort of
        the M * k pairs by block, its inverse by a scatter of distinct positions, the group ends by `searchsorted`."""
        g, top_k = geometry, indices.shape[1]
        blocks = (indices - g.num_shared).reshape(-1)
        order = torch.argsort(blocks, stable=True)
        pairs = torch.arange(order.shape[0], device=order.device)
        inverse = torch.empty_like(order).scatter_(0, order, pairs)
        sorted_blocks = blocks.index_select(0, order)
        groups = torch.arange(g.num_routed, device=order.device, dtype=sorted_blocks.dtype)
        offsets = torch.searchsorted(sorted_blocks, groups, right=True).to(torch.int32)
        gates = MoHDRepeatedRows.apply(weights.reshape(-1, 1), order, inverse, 1)
        tokens = torch.div(order, top_k, rounding_mode="floor")
        return cls(g, gates, order=order, inverse=inverse, tokens=tokens, blocks=sorted_blocks, offsets=offsets)

    def input_block_rows(self) -> torch.Tensor:
        """(P,) the rows of the (M * N, s) blocks of a (M, D) input (or of `project_out`'s (M, N, s) output) that
        hold each sorted pair's routed block: token * N + N_s + block."""
        g = self.geometry
        return self.tokens * g.num_sub_dims + g.num_shared + self.blocks

    def pair_sums(self, products: torch.Tensor) -> torch.Tensor:
        """(P, C) products in sorted order -> (M, C), the sum of each token's k rows (a permutation back to the
        router's order, then a reshape: no scatter)."""
        pairs = MoHDRepeatedRows.apply(products, self.inverse, self.order, 1)
        return pairs.view(-1, self.geometry.top_k, products.shape[1]).sum(1)

    def project_in(self, hidden_states: torch.Tensor, linears) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) tensor per linear: shared columns dense, routed columns one grouped product."""
        g, m = self.geometry, hidden_states.shape[0]
        shared = hidden_states[:, : g.shared_width]
        blocks = hidden_states.reshape(m * g.num_sub_dims, g.block)
        routed = MoHDDistinctRows.apply(blocks, self.input_block_rows()) * self.gates  # (P, s) gated blocks, sorted
        fused = fused_block_major_weight(linears)
        if fused is not None and fused.dtype == routed.dtype and autocast_dtype(routed) in (None, routed.dtype):
            # all the linears at once: block j of the routed columns is rows D_s + j s .. of the (D, sum out) storage
            routed_weight = fused[g.shared_width :].view(g.num_routed, g.block, fused.shape[1])
            out = self.pair_sums(grouped_matmul(routed, routed_weight, self.offsets))
            return split_outputs(torch.addmm(out, shared, fused[: g.shared_width]), linears)
        outputs = []
        for linear in linears:
            weight = linear.weight
            dtype = product_dtype(weight, hidden_states)
            # (N_r, s, out) view of the routed columns: block j is weight[:, D_s + j s : D_s + (j + 1) s].T
            routed_weight = weight[:, g.shared_width :].view(weight.shape[0], g.num_routed, g.block).permute(1, 2, 0)
            products = grouped_matmul(routed.to(dtype), routed_weight.to(dtype), self.offsets)
            out = F.linear(shared, weight[:, : g.shared_width], linear.bias)
            outputs.append(out + self.pair_sums(products).to(out.dtype))
        return outputs

    def project_out(self, hidden_states: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """(M, in) -> (M, N, s): shared rows dense, each pair's routed block one row of a grouped product written to
        its own (token, block) slice; other blocks 0."""
        g, m = self.geometry, hidden_states.shape[0]
        weight, bias = linear.weight, linear.bias
        shared = F.linear(hidden_states, weight[: g.shared_width], None if bias is None else bias[: g.shared_width])
        dtype = product_dtype(weight, hidden_states)
        rows = MoHDRepeatedRows.apply(hidden_states, self.tokens, self.inverse, g.top_k)  # (P, in), sorted
        # (N_r, in, s) view of the routed rows: block j is weight[D_s + j s : D_s + (j + 1) s].T
        routed_weight = weight[g.shared_width :].view(g.num_routed, g.block, weight.shape[1]).transpose(1, 2)
        products = grouped_matmul(rows.to(dtype), routed_weight.to(dtype), self.offsets)  # (P, s)
        positions = self.tokens * g.num_routed + self.blocks  # distinct: a token picks distinct blocks
        routed = products.new_zeros(m * g.num_routed, g.block).index_copy(0, positions, products)
        routed = routed.view(m, g.num_routed, g.block)
        if bias is not None:  # on the picked blocks only: a mask, so that the bias gradient is a plain sum
            picked = products.new_zeros(m * g.num_routed).index_fill_(0, positions, 1.0)
            routed = routed + picked.view(m, g.num_routed, 1) * bias[g.shared_width :].view(g.num_routed, g.block)
        return torch.cat([shared.view(m, g.num_shared, g.block), routed.to(shared.dtype)], dim=1)

    def sparse_block_positions(self, blocks: torch.Tensor, fusion: nn.Module) -> torch.Tensor | None:
        """The routed blocks' rows of `blocks.view(-1, s)` while autograd records an eager step (`project_out`'s
        blocks are zero outside the shared blocks and the pairs)."""
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        return self.input_block_rows()


@dataclasses.dataclass(slots=True)
class MoHDIndexedPlan(MoHDPlan):
    """Few tokens, read through index tensors (the form under `torch.compile` and on accelerators, where reading the
    block ids to the host would break the graph or synchronise): no sort, each token's active blocks read directly.

    block_index (M, k) absolute block ids in the router's order; columns (M, k * s) the hidden-width positions of
    each token's routed blocks (j s + 0..s-1 for block j); gates (M, k * s) the gate of the block of each position;
    token_starts (M,) the start of each token's k * s positions in `columns.view(-1)` (`embedding_bag` offsets).
    """

    block_index: torch.Tensor
    columns: torch.Tensor
    token_starts: torch.Tensor

    def project_in(self, hidden_states: torch.Tensor, linears) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) per linear from the shared and the k * s active columns."""
        g = self.geometry
        shared = hidden_states[:, : g.shared_width]
        values = hidden_states.gather(1, self.columns) * self.gates  # (M, k * s) gated routed inputs
        columns, flat_values = self.columns.view(-1), values.view(-1)
        fused = fused_block_major_weight(linears)
        if fused is not None and fused.dtype == values.dtype:
            # all the linears at once (`fuse_block_major_`): one bag over the rows of the fused (D, sum out) weight
            routed = F.embedding_bag(columns, fused, self.token_starts, mode="sum", per_sample_weights=flat_values)
            out = torch.addmm(routed, shared, fused[: g.shared_width])
            return split_outputs(out, linears)
        dense = None
        outputs = []
        for linear in linears:
            weight = linear.weight
            if is_block_major(weight) and weight.dtype == values.dtype:
                # column-major ("column_major"): the shared columns are one contiguous span, and each active column
                # is a contiguous row of weight.T that embedding_bag scales by its input and sums, reading no other
                routed = F.embedding_bag(
                    columns, weight.t(), self.token_starts, mode="sum", per_sample_weights=flat_values
                )
                outputs.append(
                    torch.addmm(routed, shared, weight[:, : g.shared_width].t())
                    if linear.bias is None
                    else F.linear(shared, weight[:, : g.shared_width], linear.bias) + routed
                )
                continue
            # row-major: column blocks are strided (no cheaper than whole rows), so one dense matmul on the gated
            # input, zero outside the active blocks (the masked path's computation)
            if dense is None:
                dense = F.pad(shared, (0, g.hidden_size - g.shared_width)).scatter(1, self.columns, values)
            outputs.append(linear(dense))
        return outputs

    def project_out(self, hidden_states: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """(M, in) -> (M, N, s), the shared rows and each token's k * s active rows."""
        g, m = self.geometry, hidden_states.shape[0]
        weight, bias = linear.weight, linear.bias
        shared = F.linear(hidden_states, weight[: g.shared_width], None if bias is None else bias[: g.shared_width])
        active = weight.view(g.num_sub_dims, g.block, weight.shape[1])
        active = active.index_select(0, self.block_index.view(-1)).view(m, -1, weight.shape[1])  # (M, k * s, in)
        routed = torch.bmm(active, hidden_states.to(active.dtype)[..., None]).view(m, -1)
        if bias is not None:
            routed = routed + bias[self.columns]
        out = shared.new_zeros(m, g.hidden_size)
        out[:, : g.shared_width] = shared
        out = out.scatter_(1, self.columns, routed.to(shared.dtype))
        return out.view(m, g.num_sub_dims, g.block)


@dataclasses.dataclass(slots=True)
class MoHDSpansPlan(MoHDPlan):
    """Few tokens on an eager CPU run: the block ids are read to Python ints (no device to synchronise), so the
    blocks any of the M tokens picked are addressed as contiguous slices of the weights and read once for all M
    tokens, with no index tensors and no copies of weights.

    gates (M, N): every block's input gate per token (1 shared, g_j picked, 0 otherwise; keeps the router's
    gradient); keep (M, N) 1.0 on the shared blocks and where the token picked the routed block (None when M == 1,
    every picked block being the token's, or in the per-block form); spans: the picked blocks as maximal runs of
    consecutive block ids, half-open [start, stop), the first always starting at block 0 with the shared blocks (a
    routed block N_s, N_s + 1, ... picked next to them joins that span). One product per span, not per block.

    Two forms (`MoHDGatherStrategy.small_batch_plan`): "union" (`rows` None) multiplies all M tokens by every span of
    the union of their picked blocks, then `keep` zeroes what a token did not pick; "per_block" (inference only,
    `block_token_spans`) multiplies each span only by the tokens that picked it, `rows[i]` (a slice, or an int64
    index of the tokens): the same bytes read, fewer FLOPs, more and smaller calls.
    """

    keep: torch.Tensor | None
    spans: tuple[tuple[int, int], ...]
    rows: tuple[slice | torch.Tensor, ...] | None = None

    def gated_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(M, D) -> (M, D) g ⊙ x, each block times its gate (0 outside the token's active blocks)."""
        g, m = self.geometry, hidden_states.shape[0]
        return (hidden_states.view(m, g.num_sub_dims, g.block) * self.gates[..., None]).view(m, -1)

    def column_spans(self) -> list[slice]:
        """The spans of blocks as slices of the hidden width (block j: j s .. (j + 1) s - 1)."""
        return [slice(start * self.geometry.block, stop * self.geometry.block) for start, stop in self.spans]

    def project_in(self, hidden_states: torch.Tensor, linears) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) per linear. In the block-major layout each block is s contiguous rows of
        `weight.T`: the first span (the shared blocks) is one GEMM, each further span one accumulating GEMM (`addmm`)
        on the gated input, whose rows are 0 for the tokens that did not pick a block; in place when autograd and
        autocast are off. Under autocast the products are its ops, as `nn.Linear`'s: it casts the gated input and
        the weight blocks read to its dtype, the outputs are in it. Row-major weights take one dense product. One
        token without autograd is `MoHDTokenPlan`'s."""
        gated, columns = self.gated_input(hidden_states), self.column_spans()
        # `out=` forms are not autocast ops: the functional forms where autocast would cast the operands
        in_place = not torch.is_grad_enabled() and autocast_dtype(gated) in (None, gated.dtype)
        outputs = []
        for linear in linears:
            weight = linear.weight
            if not (is_block_major(weight) and weight.dtype == hidden_states.dtype):
                outputs.append(linear(gated))  # row-major: one dense matmul on the gated input (the masked form)
                continue
            weight_t = weight.t()  # (D, out), rows contiguous: block j is rows j s .. (j + 1) s - 1
            out = F.linear(gated[:, columns[0]], weight[:, columns[0]], linear.bias)
            if self.rows is None:
                for span in columns[1:]:
                    out = torch.addmm(out, gated[:, span], weight_t[span], out=out if in_place else None)
            else:
                for span, rows in zip(columns[1:], self.rows[1:], strict=True):
                    if isinstance(rows, slice) and in_place:
                        torch.addmm(out[rows], gated[rows, span], weight_t[span], out=out[rows])
                    elif isinstance(rows, slice):
                        out[rows] = torch.addmm(out[rows], gated[rows, span], weight_t[span])
                    else:
                        out.index_add_(0, rows, gated[:, span].index_select(0, rows) @ weight_t[span])
            outputs.append(out)
        return outputs

    def project_out(self, hidden_states: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """(M, in) -> (M, N, s); each span of picked blocks is contiguous rows of the row-major weight, read in place
        once for all M tokens (or, per block, for the tokens that picked it); other blocks 0. With autograd and
        autocast off and no bias, each product is written straight into its span of the output. With several tokens
        in the union form, the blocks a token did not pick are zeroed by one mask over all spans at the end. Under
        autocast the products are its ops (as `nn.Linear`'s) and the output is in its dtype."""
        g, m = self.geometry, hidden_states.shape[0]
        weight, bias = linear.weight, linear.bias
        compute_dtype = autocast_dtype(hidden_states) or hidden_states.dtype
        out = hidden_states.new_zeros(m, g.hidden_size, dtype=compute_dtype)
        # `torch.mm(out=)` is not an autocast op: products written by copy where autocast would cast the operands
        direct = bias is None and not torch.is_grad_enabled() and hidden_states.dtype == weight.dtype == compute_dtype
        if self.rows is not None:
            for (start, stop), tokens in zip(self.spans, self.rows, strict=True):
                rows = slice(start * g.block, stop * g.block)
                span_bias = None if bias is None else bias[rows]
                if isinstance(tokens, slice):
                    if direct:
                        torch.mm(hidden_states[tokens], weight[rows].t(), out=out[tokens, rows])
                    else:
                        out[tokens, rows] = F.linear(hidden_states[tokens], weight[rows], span_bias)
                else:
                    product = F.linear(hidden_states.index_select(0, tokens), weight[rows], span_bias)
                    out[:, rows].index_copy_(0, tokens, product)
            return out.view(m, g.num_sub_dims, g.block)
        weight_t = weight.t()  # (in, D): each span of blocks is a column range of it
        for start, stop in self.spans:
            rows = slice(start * g.block, stop * g.block)
            if direct:
                torch.mm(hidden_states, weight_t[:, rows], out=out[:, rows])
            else:
                out[:, rows] = F.linear(hidden_states, weight[rows], None if bias is None else bias[rows])
        out = out.view(m, g.num_sub_dims, g.block)
        if self.keep is not None:
            out.mul_(self.keep[..., None])
        return out


@dataclasses.dataclass(slots=True)
class MoHDTokenPlan(MoHDPlan):
    """One token on an eager CPU run without autograd (decoding at batch 1): the one home of the one-token fast path.
    `MoHDGatherStrategy.route` builds it in the form that `one_token_path` (`mohd_strategies`) allows.

    gates (1, k) the routed blocks' gates and ids (1, k) their absolute block ids; the N_s shared blocks are active
    with gate 1. fused: the (D, sum of out) block-major storage the sublayer's input projections share
    (`fuse_block_major_`), or None. Two forms compute the same sums in different orders:

    - native (`kernels`, the library of `native_gather`; the router ran natively too): one dispatched op per side.
      `project_in`: out = sum over the active blocks b of g_b x_b W_b, each block's s rows of `fused` streamed once;
      `project_out_mixed`: the active output blocks of the row-major weight, then alpha F y over them (activation
      scaling and group fusion) in the same call.
    - torch (`kernels` None, `spans` the token's `MoHDSpansPlan`, its gates spread over the N blocks from Python
      floats, `of_route`): `project_in` computes all the input projections with one product per span of `fused`
      where autocast leaves the dtype alone (split into their outputs; with several rows, BLAS runs one wide product
      slower than the narrow ones, hence one token only), else the spans plan's products; `project_out` is the spans
      plan's.
    """

    ids: torch.Tensor
    fused: torch.Tensor | None = None
    kernels: object = None
    spans: MoHDSpansPlan | None = None

    @classmethod
    def of_route(
        cls, geometry: MoHDSubDimGeometry, ids: torch.Tensor, gates: torch.Tensor, fused: torch.Tensor | None
    ) -> "MoHDTokenPlan":
        """The torch form for the router's (1, k) ids and gates: the gates of all N blocks built from Python floats
        (fewer dispatched ops than a scatter) and the picked blocks merged into spans (`contiguous_spans`)."""
        g = geometry
        picked = ids.view(-1).tolist()
        values = [1.0] * g.num_shared + [0.0] * g.num_routed
        for block, gate in zip(picked, gates.view(-1).tolist(), strict=True):
            values[block] = gate
        spans = MoHDSpansPlan(g, gates.new_tensor(values)[None], None, contiguous_spans(g.num_shared, picked))
        return cls(g, gates, ids=ids, fused=fused, spans=spans)

    def project_in(self, hidden_states: torch.Tensor, linears) -> list[torch.Tensor]:
        """(1, D) -> one (1, out) tensor per linear (views of one product where `fused` serves)."""
        g, fused = self.geometry, self.fused
        if self.kernels is not None:
            out = self.kernels.mohd_gather_in(
                hidden_states.contiguous(), self.ids, self.gates, fused, g.num_shared, g.block
            )
            return split_outputs(out, linears)
        gated = self.spans.gated_input(hidden_states)
        if fused is None or fused.dtype != gated.dtype or autocast_dtype(gated) not in (None, gated.dtype):
            return self.spans.project_in(hidden_states, linears)
        columns = self.spans.column_spans()
        out = torch.mm(gated[:, columns[0]], fused[columns[0]])
        for span in columns[1:]:
            torch.addmm(out, gated[:, span], fused[span], out=out)
        return split_outputs(out, linears)

    def project_out(self, hidden_states: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """(1, in) -> (1, N, s), zero outside the active blocks."""
        if self.kernels is None:
            return self.spans.project_out(hidden_states, linear)
        return self._gather_out(hidden_states, linear, None, 1.0)

    def project_out_mixed(
        self, hidden_states: torch.Tensor, linear: nn.Linear, fusion: nn.Module, scale: float
    ) -> torch.Tensor | None:
        """(1, in) -> (1, N, s) = alpha F y, y the active output blocks, in one native call; None in the torch form."""
        if self.kernels is None:
            return None
        return self._gather_out(hidden_states, linear, fusion.matrix(hidden_states.dtype), scale)

    def _gather_out(self, hidden_states, linear, matrix: torch.Tensor | None, scale: float) -> torch.Tensor:
        g = self.geometry
        out = self.kernels.mohd_gather_out(
            hidden_states.contiguous(), self.ids, linear.weight, matrix, g.num_shared, g.block, scale
        )
        return out.view(1, g.num_sub_dims, g.block)
