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
"""MoHD's execution engine: how a sublayer reads and writes only its tokens' active sub-dimension blocks.

The model (`modeling_mohd.py`) routes each token to its blocks and calls one strategy, chosen by name from
`MoHDSparseInterface` (as transformers' `ExpertsInterface` holds the experts kernels):

- "masked" (`MoHDMaskedStrategy`), the reference: dense products on the gated input, a binary mask on the output.
- "gather" (`MoHDGatherStrategy`), the default: inactive blocks are never read. It plans by the number of tokens M:
  per-slot grouped products for many tokens (`MoHDGroupedPlan`: prefill, training), and a direct read of each
  token's blocks for few tokens (decoding, draft verification), by host block ids merged into spans of consecutive
  blocks on an eager CPU run (`MoHDSpansPlan`) or by index tensors under `torch.compile` and on accelerators
  (`MoHDIndexedPlan`).

A strategy's `plan(indices, weights)` returns a plan, and each plan type computes its own projections
(`project_in`, `project_out`): adding a strategy means registering a class whose plans do the same. Also here: the
weight layout the gather path reads best (`set_linear_layout_`), the tensor-parallel form of the projections
(`MoHDTensorParallelProjections`), and the autograd Functions that keep a training step's memory at the dense
model's.

Shapes: B batch, T tokens, M = B * T, D hidden_size, N sub-dimensions of s = D / N scalars, N_s shared, N_r = N - N_s
routed, k routed picks per token; "in" and "out" the widths of a projection.

This file is copied next to the weights by `save_pretrained` (remote code): it imports only `torch`, `transformers`
and same-folder siblings.
"""

import dataclasses
import functools
import os
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from transformers.integrations import moe as transformers_moe
from transformers.utils.generic import GeneralInterface

from .modeling_common import autocast_off


if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
else:  # builds without torch.distributed have no sharded weights
    DTensor = None


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


# Grouped products of the grouped plan


def _grouped_mm_aligned(tensor: torch.Tensor) -> bool:
    """Whether `torch.nn.functional.grouped_mm` accepts `tensor` as an operand: a 16-byte aligned start and a leading
    stride (of the last two dims, the one that is not 1) that is a multiple of 16 bytes.

    The rule of ATen's `check_valid_strides_and_return_transposed` (`aten/src/ATen/native/GroupedMMUtils.h`), which
    raises "strides should be multiple of 16 bytes" otherwise. The start is checked as the view's offset into its
    storage (the allocator aligns storages themselves); under torch.compile, where reading the offset would break
    the graph, only the strides are: the MoHD views start at N_s * s columns or N_s * s rows of a weight, aligned
    whenever their strides are.
    """
    alignment = 16 // tensor.element_size()
    rows, columns = tensor.stride()[-2:]
    leading = columns if rows == 1 else rows
    start_aligned = torch.compiler.is_compiling() or tensor.storage_offset() % alignment == 0
    return start_aligned and leading % alignment == 0


def grouped_matmul(inputs: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped matmul: rows `offsets[g-1]:offsets[g]` of `inputs` (R, K) times `weight[g]` (G, K, O) -> (R, O).

    Uses `torch.nn.functional.grouped_mm` (CPU and CUDA kernels in torch >= 2.10, float32/bf16/fp16) through
    transformers' `integrations.moe._grouped_mm`, and transformers' registered loop operator for float64
    (equivalence tests).

    The kernel needs 16-byte aligned operands (`_grouped_mm_aligned`), in the backward too, where the output's
    gradient (R, O) is one. MoHD's operands are views of an `nn.Linear` weight cut into sub-dimension blocks of s
    scalars, so a block of s * element_size bytes that is not a multiple of 16 (s = 36 in bf16 or fp16:
    SmolLM2-135M's hidden 576 at 16 sub-dimensions) breaks that rule. Such operands are padded with zeros to K', O'
    multiples of 16 bytes (the zero rows and columns add nothing to the products) and the result is cut back to O
    columns. The padding copies `inputs` and `weight`, and autograd keeps the padded weight for the backward; aligned
    operands (s a multiple of 4 in float32, of 8 in bf16/fp16) take the kernel directly, with no copy.
    """
    if inputs.dtype == torch.float64:
        return torch.ops.transformers.grouped_mm_fallback(inputs, weight, offsets)
    inputs = inputs.to(weight.dtype)  # transformers' `_grouped_mm` casts the same way (autocast leaves fp32 inputs)
    alignment = 16 // weight.element_size()
    contraction, out_features = weight.shape[-2:]
    # the output's gradient (R, O), contiguous, is an operand of the backward: O must be aligned too
    if _grouped_mm_aligned(inputs) and _grouped_mm_aligned(weight) and out_features % alignment == 0:
        return transformers_moe._grouped_mm(inputs, weight, offsets)
    pad_contraction, pad_out = -contraction % alignment, -out_features % alignment
    # F.pad returns new contiguous (hence 16-byte aligned) tensors, even when a pad is 0
    inputs = F.pad(inputs, (0, pad_contraction))
    weight = F.pad(weight, (0, pad_out, 0, pad_contraction))
    return transformers_moe._grouped_mm(inputs, weight, offsets)[:, :out_features]


class MoHDGroupPart(NamedTuple):
    """Rows of one routing slot (in the plan's block order) whose products one call computes.

    On an eager CPU run (`grouped_parts`) each non-empty group is a part: its rows times its block's (K, O) weight
    are one `torch.mm`, whose (rows, O) result is scattered at once, while it is still in cache. Elsewhere one part
    spans all the rows and its products are one grouped kernel call (`grouped_matmul`), which needs no host read.
    Fields: rows (a slice of the slot's R rows), group (the block id, or None for all groups at once), offsets
    ((G,) int32 group ends of the slot).
    """

    rows: slice
    group: int | None
    offsets: torch.Tensor

    def scratch(self, buffer: torch.Tensor | None) -> torch.Tensor | None:
        """This part's leading rows of a `routing_slot_parts` scratch tensor (to write its product or gathered rows into), or
        None for a grouped call (which allocates its own result)."""
        return None if buffer is None or self.group is None else buffer[: self.rows.stop - self.rows.start]

    def matmul(self, inputs: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """inputs (R', K), this part's rows; weight (G, K, O), one matrix per group -> (R', O), written into `out`
        (R', O) when given (`scratch`; ignored by a grouped call)."""
        if self.group is None:
            return grouped_matmul(inputs, weight, self.offsets)
        return torch.mm(inputs, weight[self.group], out=out)

    def add_weight_gradient_(self, target: torch.Tensor, inputs: torch.Tensor, grad: torch.Tensor) -> None:
        """Adds this part's weight gradient of `matmul` to `target` (G, K, O) in place: inputs (R', K), grad (R', O)."""
        if self.group is None:
            target.add_(grouped_weight_gradient(inputs, grad, self.offsets))
        else:
            target[self.group].addmm_(inputs.t(), grad)


def routing_slot_parts(
    offsets: torch.Tensor, like: torch.Tensor, width: int
) -> tuple[list[list[MoHDGroupPart]], torch.Tensor | None]:
    """The `grouped_parts` of every routing slot of the (k, G) int32 group ends `offsets`, and one (R_max, width)
    scratch tensor of `like`'s dtype and device for their per-group products (or gathered rows), R_max the most rows
    of a part (`MoHDGroupPart.scratch`); None instead of the tensor when the parts are grouped calls.

    Each per-group result is consumed at once (scattered by `index_add_` or multiplied), so one buffer serves them
    all: one allocation instead of one per group, each of a different size (allocations of varying sizes make the
    C heap grow and shrink, so fresh pages are faulted in on every forward).
    """
    parts = [grouped_parts(slot_offsets) for slot_offsets in offsets]
    sizes = [part.rows.stop - part.rows.start for slot in parts for part in slot if part.group is not None]
    return parts, like.new_empty(max(sizes), width) if sizes else None


def grouped_parts(offsets: torch.Tensor) -> list[MoHDGroupPart]:
    """The parts of one routing slot whose (G,) int32 group ends are `offsets`: one per non-empty group on an eager
    CPU run, else one part of all rows (`MoHDGroupPart`).

    On CPU, a product per group followed at once by its scatter (`index_add_`) or its gather keeps each group's
    (rows, O) block in cache; one grouped call writes the whole (R, O) result first, and the scatter then reads it
    back from memory. On an accelerator, or while compiling, reading the
    offsets to the host would synchronise or break the graph: the grouped kernel runs there.
    """
    if offsets.device.type != "cpu" or torch.compiler.is_compiling():
        return [MoHDGroupPart(slice(None), None, offsets)]
    parts, start = [], 0
    for group, end in enumerate(offsets.tolist()):
        if end > start:
            parts.append(MoHDGroupPart(slice(start, end), group, offsets))
        start = end
    return parts


class MoHDRowIndexAdd(torch.autograd.Function):
    """`out.index_add_(0, index, source)` whose backward keeps only `index`: grad_out passes through, and
    grad_source = grad_out[index].

    torch's own `index_add_` saves the whole `source` (M x out per routing slot and projection) for its backward,
    which only needs its shape: M x out per routing slot and projection, as much as the rest of the activations.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.mark_dirty(out)
        out.index_add_(0, index, source)
        return out  # the dirty input itself, which dynamo needs to see returned to trace the Function

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad, None, grad.index_select(0, index)


class MoHDGatheredGroupedMatmul(torch.autograd.Function):
    """`grouped_matmul(inputs[index], weight, offsets)` that keeps `inputs` and `index`, not the gathered rows.

    The output side of the grouped path gathers, per routing slot, the M token rows (M x in) in block order; autograd
    would keep that copy for the weight gradient although `inputs` itself is kept anyway (by the shared-rows GEMM).
    The backward gathers the rows again and computes both gradients with `grouped_matmul_backward` (no recomputation
    of the forward product), in ops that `torch.compile` traces into the step's graph.
    Shapes: inputs (M, in), index (R,), weight (G, in, s), offsets (G,) int32 group ends -> (R, s).
    Used where `MoHDGroupedLinearOut` does not apply (`torch.compile`, mixed dtypes), with `MoHDRowIndexAdd` on the input
    side.
    """

    @staticmethod
    def forward(ctx, inputs, index, weight, offsets):
        ctx.save_for_backward(inputs, index, weight, offsets)
        return grouped_matmul(inputs.index_select(0, index), weight, offsets)

    @staticmethod
    def backward(ctx, grad):
        inputs, index, weight, offsets = ctx.saved_tensors
        rows = F.embedding(index, inputs)  # = inputs[index]; not the forward's op, which a compiled step would keep
        grad_rows, grad_weight = grouped_matmul_backward(rows, weight, offsets, grad)
        grad_inputs = None
        if ctx.needs_input_grad[0]:
            grad_inputs = torch.zeros_like(inputs).index_add_(0, index, grad_rows.to(inputs.dtype))
        return grad_inputs, None, grad_weight if ctx.needs_input_grad[2] else None, None


def grouped_matmul_backward(
    inputs: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients of `grouped_matmul(inputs, weight, offsets)` for the output gradient `grad` (R, O): the input
    gradient (R, K) (group g: grad[rows g] @ weight[g].T) and the weight gradient (G, K, O) (`grouped_weight_gradient`).

    Where the forward ran transformers' grouped-matmul fallback operator (float64, and under `torch.compile` any dtype
    but bf16, for which `F.grouped_mm` has no fake-tensor kernel in torch 2.13), its backward operator
    (`transformers::grouped_mm_fallback_backward`, one `torch.mm` per group, traced as one opaque node); elsewhere
    `grouped_matmul` on the transposed weight and `grouped_weight_gradient`, the grouped kernel's own form.
    """
    if inputs.dtype == torch.float64 or (torch.compiler.is_compiling() and weight.dtype != torch.bfloat16):
        return torch.ops.transformers.grouped_mm_fallback_backward(
            inputs.to(weight.dtype), weight, offsets, grad.to(weight.dtype).contiguous()
        )
    return grouped_matmul(grad, weight.transpose(1, 2), offsets), grouped_weight_gradient(inputs, grad, offsets)


def grouped_weight_gradient(inputs: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Weight gradient of `grouped_matmul`: (G, K, O) with group g = inputs[rows g].T @ grad[rows g], rows
    `offsets[g-1]:offsets[g]` of inputs (R, K) and grad (R, O); empty groups give zeros.

    `torch.nn.functional.grouped_mm` on a 2-D (K, R) and a 2-D (R, O) operand with offsets along R (the form of
    ATen's own `_grouped_mm` backward); float64 (equivalence tests, no kernel) loops over the groups. Operands whose
    leading strides are not 16-byte multiples (`_grouped_mm_aligned`) are padded with zero columns and cut back.
    """
    if inputs.dtype == torch.float64:
        out = inputs.new_zeros(offsets.shape[0], inputs.shape[1], grad.shape[1])
        start = 0
        for group, end in enumerate(offsets.tolist()):
            if end > start:
                torch.mm(inputs[start:end].t(), grad[start:end], out=out[group])
            start = end
        return out
    alignment = 16 // inputs.element_size()
    contraction, out_features = inputs.shape[1], grad.shape[1]
    if contraction % alignment or out_features % alignment or not _grouped_mm_aligned(inputs.t()):
        inputs = F.pad(inputs, (0, -contraction % alignment))
        grad = F.pad(grad, (0, -out_features % alignment))
        return F.grouped_mm(inputs.t(), grad, offs=offsets)[:, :contraction, :out_features]
    return F.grouped_mm(inputs.t(), grad.contiguous(), offs=offsets)


class MoHDGroupedLinearIn(torch.autograd.Function):
    """Input side of the grouped gather path for one linear: `x_shared @ W[:, :D_s].T + b` plus, per routing slot
    j, the product of each token's gated block with its block of `W_routed` added to the rows `token_index[j]`, group
    by group (`grouped_parts`: one `torch.mm` per group on CPU, one grouped kernel call elsewhere).

    The backward writes both pieces of the weight gradient into one (out, in) tensor of the weight's own layout
    (so that `AccumulateGrad` takes it as `.grad` without a copy): the shared columns by one GEMM into their slice,
    the routed column blocks by one weight-gradient GEMM per group (or one grouped call per slot) into theirs.
    Autograd on the views (a column slice and a grouped routed view of `weight`) would materialise a zero-filled
    full-size gradient for each view, then sum them, and copy the sum into the block-major layout. It keeps only its
    inputs and the index (as `MoHDRowIndexAdd` does, not each slot's (M, out) output).
    Shapes: shared (M, D_s) (a view of the input), routed (k, M, s) gated routed inputs in the plan's order,
    token_index (k, M), offsets (k, N_r) int32 group ends, weight (out, D), bias (out,) or None -> (M, out).
    Same dtype for inputs, weight and bias, autocast off (the plan casts the operands to autocast's dtype).
    """

    @staticmethod
    def forward(ctx, shared, routed, token_index, offsets, weight, bias, num_routed: int, block: int):
        shared_width = shared.shape[1]
        ctx.save_for_backward(shared, routed, token_index, offsets, weight)
        ctx.has_bias, ctx.num_routed, ctx.block = bias is not None, num_routed, block
        out = F.linear(shared, weight[:, :shared_width], bias)
        routed_weight = weight[:, shared_width:].view(weight.shape[0], num_routed, block).permute(1, 2, 0)
        all_parts, products = routing_slot_parts(offsets, out, weight.shape[0])
        for slot, parts in enumerate(all_parts):
            for part in parts:
                rows = part.rows
                product = part.matmul(routed[slot, rows], routed_weight, out=part.scratch(products))
                out.index_add_(0, token_index[slot, rows], product)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        shared, routed, token_index, offsets, weight = ctx.saved_tensors
        shared_width, out_features = shared.shape[1], weight.shape[0]
        grad_shared = grad_routed = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_shared = grad.mm(weight[:, :shared_width])
        if ctx.needs_input_grad[4]:
            grad_weight = torch.empty_like(weight)  # the weight's strides: block-major stays column-major
            torch.mm(grad.t(), shared, out=grad_weight[:, :shared_width])
            routed_grad_weight = grad_weight[:, shared_width:].view(out_features, ctx.num_routed, ctx.block)
            routed_grad_weight = routed_grad_weight.permute(1, 2, 0).zero_()  # (N_r, s, out), as the forward's view
        if ctx.needs_input_grad[1]:
            grad_routed = torch.empty_like(routed)
            # (N_r, out, s): the transpose of each routed block, for the input gradient
            routed_weight_t = weight[:, shared_width:].view(out_features, ctx.num_routed, ctx.block).transpose(0, 1)
        all_parts, gathered = routing_slot_parts(offsets, grad, out_features)
        for slot, parts in enumerate(all_parts):
            for part in parts:
                rows, index = part.rows, token_index[slot, part.rows]
                # (rows, out) in the slot's block order
                grad_rows = torch.index_select(grad, 0, index, out=part.scratch(gathered))
                if grad_weight is not None:
                    part.add_weight_gradient_(routed_grad_weight, routed[slot, rows], grad_rows)
                if grad_routed is not None:
                    grad_routed[slot, rows] = part.matmul(grad_rows, routed_weight_t)
        if ctx.has_bias and ctx.needs_input_grad[5]:
            grad_bias = grad.sum(0)
        return grad_shared, grad_routed, None, None, grad_weight, grad_bias, None, None


class MoHDGroupedLinearOut(torch.autograd.Function):
    """Output side of the grouped gather path: (M, in) -> (M, N, s) blocks, the shared rows `x @ W[:D_s].T`
    (+ bias) and, per routing slot j, the routed block each token picked, `x[token_index[j]] @ W_routed[block].T`
    (+ its bias) group by group (`grouped_parts`), written at (token, N_s + block); the other blocks are 0.

    It keeps the input and the plan's indices only: the backward gathers each slot's token rows again for the
    routed weight gradient (no recomputation of the forward product), and writes the shared and routed row blocks of
    the weight gradient into one (out, in) tensor in the weight's own layout, instead of the two zero-filled full-size
    gradients of autograd's views and their sum.
    Shapes: hidden_states (M, in), token_index, block_index (k, M) (routed ids 0..N_r-1), offsets (k, N_r) int32,
    weight (D, in), bias (D,) or None -> (M, N, s). Same dtype for all, autocast off (as `MoHDGroupedLinearIn`).
    """

    @staticmethod
    def forward(ctx, hidden_states, token_index, block_index, offsets, weight, bias, num_shared: int, block: int):
        m, shared_width = hidden_states.shape[0], num_shared * block
        num_routed = weight.shape[0] // block - num_shared
        ctx.save_for_backward(hidden_states, token_index, block_index, offsets, weight)
        ctx.has_bias, ctx.num_shared, ctx.block = bias is not None, num_shared, block
        out = hidden_states.new_zeros(m, num_shared + num_routed, block)
        # the shared rows' product written in place into its columns of out (BLAS with a leading dimension), no
        # (M, D_s) temporary
        shared_out, shared_weight = out.view(m, -1)[:, :shared_width], weight[:shared_width].t()
        if bias is None:
            torch.mm(hidden_states, shared_weight, out=shared_out)
        else:
            torch.addmm(bias[:shared_width], hidden_states, shared_weight, out=shared_out)
        routed_weight = weight[shared_width:].view(num_routed, block, weight.shape[1]).transpose(1, 2)
        routed_bias = None if bias is None else bias[shared_width:].view(num_routed, block)
        flat = out.view(-1, block)
        all_parts, gathered = routing_slot_parts(offsets, hidden_states, hidden_states.shape[1])
        for slot, parts in enumerate(all_parts):
            positions = token_index[slot] * (num_shared + num_routed) + num_shared + block_index[slot]
            for part in parts:
                rows = part.rows
                inputs = torch.index_select(hidden_states, 0, token_index[slot, rows], out=part.scratch(gathered))
                routed = part.matmul(inputs, routed_weight)
                if routed_bias is not None:
                    routed = routed + routed_bias[block_index[slot, rows]]
                flat.index_add_(0, positions[rows], routed)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        hidden_states, token_index, block_index, offsets, weight = ctx.saved_tensors
        num_shared, block = ctx.num_shared, ctx.block
        m, width = grad.shape[0], grad.shape[1] * block
        num_routed, shared_width = grad.shape[1] - num_shared, num_shared * block
        grad = grad.contiguous()
        grad_shared = grad.view(m, width)[:, :shared_width]  # (M, D_s), row stride D
        routed_weight = weight[shared_width:].view(num_routed, block, weight.shape[1])  # (N_r, s, in)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_shared.mm(weight[:shared_width])
        if ctx.needs_input_grad[4]:
            grad_weight = torch.empty_like(weight)
            torch.mm(grad_shared.t(), hidden_states, out=grad_weight[:shared_width])
            routed_grad_weight = grad_weight[shared_width:].view(num_routed, block, weight.shape[1]).transpose(1, 2)
            routed_grad_weight.zero_()  # (N_r, in, s)
        wants_bias = ctx.has_bias and ctx.needs_input_grad[5]
        if wants_bias:
            grad_bias = grad.new_zeros(weight.shape[0])
            grad_bias[:shared_width] = grad_shared.sum(0)
            routed_grad_bias = grad_bias[shared_width:].view(num_routed, block)
        flat = grad.view(-1, block)
        # (rows, in) scratch: the gathered inputs for the weight gradient, then the input gradient's rows
        all_parts, scratch = routing_slot_parts(offsets, hidden_states, hidden_states.shape[1])
        for slot, parts in enumerate(all_parts):
            positions = token_index[slot] * (num_shared + num_routed) + num_shared + block_index[slot]
            for part in parts:
                rows, tokens = part.rows, token_index[slot, part.rows]
                grad_routed = flat.index_select(0, positions[rows])  # (rows, s) in the slot's block order
                if grad_weight is not None:
                    inputs = torch.index_select(hidden_states, 0, tokens, out=part.scratch(scratch))
                    part.add_weight_gradient_(routed_grad_weight, inputs, grad_routed)
                if grad_input is not None:
                    grad_input.index_add_(
                        0, tokens, part.matmul(grad_routed, routed_weight, out=part.scratch(scratch))
                    )
                if wants_bias:
                    routed_grad_bias.index_add_(0, block_index[slot, rows], grad_routed)
        return grad_input, None, None, None, grad_weight, grad_bias, None, None


def mix_blocks(fusion: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """`fusion @ blocks` for every token: fusion (N, N), blocks (M, N, s) -> (M, N, s).

    One batched matmul over the tokens with `fusion` broadcast (a stride-0 batch, no copy); `torch.matmul` on a 2-D
    and a 3-D operand would instead fold the tokens into rows, copying the blocks to (M, s, N) and the product back.
    One token (decoding) is one small GEMM.
    """
    if blocks.shape[0] == 1:
        return torch.mm(fusion, blocks[0])[None]
    return torch.bmm(fusion.expand(blocks.shape[0], *fusion.shape), blocks)


def mix_compact_blocks(
    fusion: torch.Tensor, shared: torch.Tensor, routed, token_index: torch.Tensor, block_index: torch.Tensor
) -> torch.Tensor:
    """`fusion @ blocks` for blocks that are zero outside the shared blocks `shared` (M, N_s, s) and one routed block
    per routing slot, without the zero-padded (M, N, s) blocks: the shared blocks' product with the first N_s columns
    of `fusion`, plus, per slot j, the outer product of the column of `fusion` of each row's routed block with that
    block, added at its token. routed: k tensors (M, s) in a plan's row order; token_index, block_index (k, M) the
    rows' tokens and routed block ids (0..N_r-1). -> (M, N, s).

    Plain ops, for `torch.compile`: what the compiled step keeps for backward is then the compact blocks and (M, N)
    columns of `fusion`, not the zero-padded blocks (`MoHDSparseBlockMix` keeps the same in eager autograd).
    """
    num_shared = shared.shape[1]
    mixed = mix_blocks(fusion[:, :num_shared], shared)
    routed_columns = fusion[:, num_shared:].t()  # (N_r, N): row b is the column of routed block b
    for slot, rows in enumerate(routed):
        columns = routed_columns.index_select(0, block_index[slot])  # (M, N), in the slot's row order
        mixed = mixed.index_add(0, token_index[slot], columns[:, :, None] * rows[:, None, :])
    return mixed


class MoHDSparseBlockMix(torch.autograd.Function):
    """`fusion @ blocks` (group fusion, (N, N) x (M, N, s)) for blocks that are zero outside the shared blocks
    and the routed ones at `positions`: it keeps those (N_s + k) of the N blocks per token for the gradient of
    `fusion` (autograd's matmul keeps all N), and rebuilds the zero-padded blocks in backward.
    Shapes: fusion (N, N), blocks (M, N, s), positions (k, M) rows of `blocks.view(-1, s)`, num_shared N_s.
    """

    @staticmethod
    def forward(ctx, fusion, blocks, positions, num_shared: int):
        block = blocks.shape[-1]
        shared = blocks[:, :num_shared].contiguous()
        routed = blocks.reshape(-1, block).index_select(0, positions.reshape(-1))
        ctx.save_for_backward(fusion, shared, routed, positions)
        ctx.shape = blocks.shape
        return mix_blocks(fusion, blocks)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        fusion, shared, routed, positions = ctx.saved_tensors
        grad_fusion = grad_blocks = None
        if ctx.needs_input_grad[0]:
            blocks = shared.new_zeros(ctx.shape)
            blocks[:, : shared.shape[1]] = shared
            blocks.view(-1, ctx.shape[-1]).index_copy_(0, positions.reshape(-1), routed)
            # sum over tokens of grad_m @ blocks_m.T: (M, N, N) per-token products, no copy of the (M, N, s) operands
            grad_fusion = torch.bmm(grad, blocks.transpose(1, 2)).sum(0)
            del blocks
        if ctx.needs_input_grad[1]:
            grad_blocks = mix_blocks(fusion.t(), grad)
        return grad_fusion, grad_blocks, None, None


def is_block_major(weight: torch.Tensor) -> bool:
    """Whether a (out, in) weight holds the "block_major" layout of `set_linear_layout_` (column-major, stride
    (1, out)), in which each input-side block of s columns is s contiguous rows of `weight.T`.

    The layout is a property of the tensor, read where a path chooses how to read the weight, not a flag kept beside
    it: a parameter replaced by another layout (FSDP2's unsharded parameters, `load_state_dict(assign=True)`) brings
    its own, and both readings compute the same values, so a layout can cost speed, never exactness.
    """
    return weight.stride(0) == 1


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
                # column-major ("block_major"): the shared columns are one contiguous span, and each active column
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

    def project_in(self, hidden_states: torch.Tensor, linears) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) per linear. In the block-major layout each block is s contiguous rows of
        `weight.T`: the first span (the shared blocks) is one GEMM, each further span one accumulating GEMM (`addmm`)
        on the gated input, whose rows are 0 for the tokens that did not pick a block; in place when autograd and
        autocast are off. Under autocast the products are its ops, as `nn.Linear`'s: it casts the gated input and
        the weight blocks read to its dtype, the outputs are in it. Row-major weights take one dense product. One
        token without autograd, on linears sharing one storage (`fuse_block_major_`): one product per span for all
        of them."""
        g, m = self.geometry, hidden_states.shape[0]
        gated = (hidden_states.view(m, g.num_sub_dims, g.block) * self.gates[..., None]).view(m, -1)
        columns = [slice(start * g.block, stop * g.block) for start, stop in self.spans]
        # `out=` forms are not autocast ops: the functional forms where autocast would cast the operands
        in_place = not torch.is_grad_enabled() and autocast_dtype(gated) in (None, gated.dtype)
        # one token (decoding at batch 1): one product per span for all the linears (`fuse_block_major_`), split
        # into their outputs (views); with several rows, BLAS runs one wide product slower than the narrow ones
        fused = fused_block_major_weight(linears) if m == 1 and in_place else None
        if fused is not None and fused.dtype == gated.dtype:
            out = torch.mm(gated[:, columns[0]], fused[columns[0]])
            for span in columns[1:]:
                torch.addmm(out, gated[:, span], fused[span], out=out)
            return split_outputs(out, linears)
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
class MoHDNativeTokenPlan(MoHDPlan):
    """One token on an eager CPU run without autograd (decoding at batch 1), computed by the native kernels of
    `native_gather` (`MoHDSubDimensions.route` builds it, routing natively as well): one dispatched op per side.

    gates (1, k): the routed blocks' gates, ids (1, k) their absolute block ids; the N_s shared blocks are active with
    gate 1. `project_in` takes the linears' fused block-major storage (`fuse_block_major_`): out = sum over the
    active blocks b of g_b x_b W_b, each block's s rows of `weight.T` streamed once; `project_out_mixed` computes the
    active output blocks of the row-major weight, then alpha F y over them (activation scaling and group fusion) in
    the same call. Same sums as `MoHDSpansPlan`, in another order.
    """

    ids: torch.Tensor
    fused: torch.Tensor
    kernels: object

    def project_in(self, hidden_states: torch.Tensor, linears) -> list[torch.Tensor]:
        """(1, D) -> one (1, out) view per linear of the fused product (`fused`: the linears' storage as (D, out))."""
        g = self.geometry
        out = self.kernels.mohd_gather_in(
            hidden_states.contiguous(), self.ids, self.gates, self.fused, g.num_shared, g.block
        )
        return split_outputs(out, linears)

    def project_out(self, hidden_states: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """(1, in) -> (1, N, s), zero outside the active blocks."""
        return self._gather_out(hidden_states, linear, None, 1.0)

    def project_out_mixed(
        self, hidden_states: torch.Tensor, linear: nn.Linear, fusion: nn.Module, scale: float
    ) -> torch.Tensor | None:
        """(1, in) -> (1, N, s) = alpha F y, y the active output blocks, in one call."""
        return self._gather_out(hidden_states, linear, fusion.matrix(hidden_states.dtype), scale)

    def _gather_out(self, hidden_states, linear, matrix: torch.Tensor | None, scale: float) -> torch.Tensor:
        g = self.geometry
        out = self.kernels.mohd_gather_out(
            hidden_states.contiguous(), self.ids, linear.weight, matrix, g.num_shared, g.block, scale
        )
        return out.view(1, g.num_sub_dims, g.block)


# Strategies and their registry


@functools.cache
def small_gemms_compute_bound(dtype: torch.dtype, threads: int) -> bool:
    """Whether this CPU's BLAS is compute-bound on the few-row products of decoding: an (8, 64) x (64, 4096) `torch.mm`
    (8 tokens by one sub-dimension block of a projection) taking more than twice the time of a (1, 64) x (64, 4096)
    one, medians of 12 interleaved timings of 4 calls each (about 10 ms, once per process, dtype and thread count).

    A memory-bound BLAS reads the block once whatever the rows, and "union" plans are right; a compute-bound one pays
    per row, where "per_block" plans pay. Only the speed depends on the answer, never the result. Timings, not the
    CPU's name, decide: what matters is the BLAS build and the CPU together. Uses constant inputs (the global RNG is
    untouched). Called only on request (`resolve_small_batch_plan("auto")`), never by a forward.
    """
    weight = torch.ones(64, 4096, dtype=dtype)
    rows = torch.ones(8, 64, dtype=dtype)
    times = {1: [], 8: []}
    with torch.no_grad():
        for _ in range(12):
            for m in times:
                start = time.perf_counter()
                for _ in range(4):
                    torch.mm(rows[:m], weight)
                times[m].append(time.perf_counter() - start)
    median = {m: sorted(t)[len(t) // 2] for m, t in times.items()}
    return median[8] > 2.0 * median[1]


SMALL_BATCH_PLANS = ("auto", "union", "per_block")
# An explicit choice of the small-batch plan for every MoHD model built in this process (`MoHDGatherStrategy`)
SMALL_BATCH_PLAN_ENV = "HF_MOHD_SMALL_BATCH_PLAN"


def resolve_small_batch_plan(plan: str, dtype: torch.dtype = torch.float32) -> str:
    """ "union" or "per_block" for a requested small-batch plan; "auto" runs the timing of
    `small_gemms_compute_bound` now (once per process, dtype and thread count) and takes "per_block" where few-row
    products are compute-bound, else "union".

    Raises:
        ValueError: `plan` is not one of `SMALL_BATCH_PLANS`.
    """
    if plan not in SMALL_BATCH_PLANS:
        raise ValueError(f"small_batch_plan must be one of {SMALL_BATCH_PLANS}, got {plan!r}")
    if plan != "auto":
        return plan
    return "per_block" if small_gemms_compute_bound(dtype, torch.get_num_threads()) else "union"


def default_small_batch_plan() -> str:
    """The small-batch plan a new gather strategy starts with: `HF_MOHD_SMALL_BATCH_PLAN` when set ("auto" times the
    BLAS then, at model construction), else "per_block", which needs no timing: each block read once, by the tokens
    that picked it only, as fast as "union" for one token and faster for 2-8 wherever few-row products cost more
    than one-row ones.

    Raises:
        ValueError: the environment variable holds a name other than those of `SMALL_BATCH_PLANS`.
    """
    requested = os.environ.get(SMALL_BATCH_PLAN_ENV)
    if requested is None:
        return "per_block"
    try:
        return resolve_small_batch_plan(requested)
    except ValueError:
        raise ValueError(f"{SMALL_BATCH_PLAN_ENV} must be one of {SMALL_BATCH_PLANS}, got {requested!r}") from None


class MoHDMaskedStrategy:
    """Reference strategy (`sparse_implementation="masked"`): `MoHDMaskedPlan` for every token count. Any projection
    module works with it (it calls the modules), which is why the gather strategy's sublayers fall back to it for
    projections that are not plain `nn.Linear`."""

    # the projections whose weights this strategy wants stored block-major (`set_linear_layout_`): none
    block_major_projections: tuple[str, ...] = ()
    # the groups of those that it wants in one block-major storage each (`fuse_block_major_`): none
    fused_projections: tuple[tuple[str, ...], ...] = ()

    def __init__(self, config, geometry: MoHDSubDimGeometry | None = None):
        self.geometry = geometry or MoHDSubDimGeometry.of(config)

    def with_top_k(self, top_k: int) -> "MoHDMaskedStrategy":
        """The same strategy for plans of `top_k` routed blocks per token."""
        return type(self)(None, self.geometry._replace(top_k=top_k))

    def plan(self, indices: torch.Tensor, weights: torch.Tensor) -> MoHDMaskedPlan:
        """(M, k) absolute block ids and their gates -> (M, N) gates and mask."""
        g, m = self.geometry, indices.shape[0]
        gates = torch.zeros(m, g.num_sub_dims, dtype=weights.dtype, device=weights.device)
        gates[:, : g.num_shared] = 1
        mask = gates.clone()
        gates = gates.scatter(1, indices, weights)
        mask = mask.scatter(1, indices, torch.ones_like(weights))
        return MoHDMaskedPlan(g, gates, mask)


class MoHDGatherStrategy:
    """Fast strategy (`sparse_implementation="gather"`): inactive blocks are never read nor computed.

    Plans by the number of tokens M (`plan`): up to `host_tokens` tokens on an eager CPU run, `MoHDSpansPlan` (the
    picked blocks' weight spans read once for all tokens: decoding, draft verification, the memory-bound case, as in
    Deja Vu and PowerInfer); up to `few_tokens` tokens elsewhere, `MoHDIndexedPlan`; more tokens, `MoHDGroupedPlan`.
    One token without autograd on an eager CPU run, with the native kernels built, does not reach `plan`: the
    sublayer routes it natively (`MoHDSubDimensions.native_token_plan`, `MoHDNativeTokenPlan`).

    Only plain `nn.Linear` projections come here: `MoHDSubDimensions.route` sends a sublayer with any other
    projection (a PEFT LoRA layer, a quantised linear: it computes something other than its `.weight`) to the
    masked strategy.

    Weight layout: the input side (q/k/v, gate/up) reads column blocks; in the row-major `nn.Linear` layout a block
    is s contiguous floats per row, which a CPU streams at a fraction of the contiguous bandwidth. MoHD models
    therefore decode with those weights column-major (`MoHDPreTrainedModel.to_weight_layout("block_major")`, which
    `generate` applies before decoding: same values and shapes, `weight.t()` contiguous), which makes every block
    contiguous; after `__init__` and `from_pretrained` they are plain contiguous tensors. The plans follow the layout
    each weight actually has, so any layout is exact, only slower or faster: row-major input weights take the dense
    product in the few-token plans.

    Attributes:
        few_tokens: most tokens of an index-tensor plan, N_r // k (while the blocks read are fewer than the routed
            blocks, reading each token's k blocks beats sorting: the grouped path would run mostly empty groups).
        host_tokens: most tokens of a spans plan, max(few_tokens, 8) (each picked block is read once for all tokens,
            so the direct read stays ahead of the grouped path over the small batches of decoding).
        small_batch_plan: "union" or "per_block", the form of a spans plan of several tokens without autograd
            (`MoHDSpansPlan`; `default_small_batch_plan`).
    """

    block_major_projections = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    fused_projections = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

    def __init__(self, config, geometry: MoHDSubDimGeometry | None = None):
        self.geometry = geometry or MoHDSubDimGeometry.of(config)
        self.few_tokens = max(1, self.geometry.num_routed // max(self.geometry.top_k, 1))
        self.host_tokens = max(self.few_tokens, 8)
        self.small_batch_plan = default_small_batch_plan()

    def with_top_k(self, top_k: int) -> "MoHDGatherStrategy":
        """The same strategy (and small-batch plan) for plans of `top_k` routed blocks per token."""
        strategy = type(self)(None, self.geometry._replace(top_k=top_k))
        strategy.small_batch_plan = self.small_batch_plan
        return strategy

    def plan(self, indices: torch.Tensor, weights: torch.Tensor) -> MoHDPlan:
        """(M, k) absolute block ids and their gates -> the plan for M tokens (see the class docstring)."""
        g, m = self.geometry, indices.shape[0]
        if m <= self.host_tokens and indices.device.type == "cpu" and not torch.compiler.is_compiling():
            ids = indices.view(-1).tolist()
            spans = contiguous_spans(g.num_shared, ids)
            if m == 1 and not torch.is_grad_enabled():  # decoding: the gates from Python floats, fewer ops
                values = [1.0] * g.num_shared + [0.0] * g.num_routed
                for block, gate in zip(ids, weights.view(-1).tolist(), strict=True):
                    values[block] = gate
                return MoHDSpansPlan(g, weights.new_tensor(values)[None], None, spans)
            shared = F.pad(weights.new_ones(m, g.num_shared), (0, g.num_routed))  # 1 on the shared blocks
            if self.small_batch_plan == "per_block" and not torch.is_grad_enabled():
                spans, rows = block_token_spans(g.num_shared, indices.tolist())
                return MoHDSpansPlan(g, shared.scatter(1, indices, weights), None, spans, rows)
            keep = None if m == 1 else shared.scatter(1, indices, 1.0)
            return MoHDSpansPlan(g, shared.scatter(1, indices, weights), keep, spans)
        if m <= self.few_tokens:
            width = g.top_k * g.block
            columns = (indices[..., None] * g.block + torch.arange(g.block, device=indices.device)).view(m, -1)
            gates = weights[..., None].expand(*weights.shape, g.block).reshape(m, width)
            token_starts = torch.arange(0, m * width, width, device=indices.device)
            return MoHDIndexedPlan(g, gates, indices, columns, token_starts)
        slots = (indices - g.num_shared).t()
        order = torch.argsort(slots, dim=1, stable=True)
        slot_offset = torch.arange(g.top_k, device=indices.device)[:, None] * g.num_routed
        # per (slot, block) token counts; `scatter_add_` into a fixed-length vector rather than `bincount`, whose
        # output length depends on the data and so breaks a `torch.compile` graph at every sublayer
        keys = (slots + slot_offset).reshape(-1)
        counts = keys.new_zeros(g.top_k * g.num_routed).scatter_add_(0, keys, torch.ones_like(keys))
        offsets = torch.cumsum(counts.view(g.top_k, g.num_routed), dim=1).to(torch.int32)
        return MoHDGroupedPlan(g, weights.t().gather(1, order)[..., None], order, slots.gather(1, order), offsets)


class MoHDSparseInterface(GeneralInterface):
    """The MoHD execution strategies by name, as transformers' `ExpertsInterface` holds experts kernels: a class
    built from the config (`strategy = cls(config)`) whose `plan(indices, weights)` returns a `MoHDPlan` and whose
    `with_top_k(k)` gives the strategy for another number of routed blocks per token.
    `MoHDSparseInterface.register(name, cls)` adds one for every model; `MoHDPreTrainedModel.set_sparse_implementation`
    selects one by name."""

    _global_mapping = {"masked": MoHDMaskedStrategy, "gather": MoHDGatherStrategy}


ALL_SPARSE_IMPLEMENTATIONS = MoHDSparseInterface()


# Weight layout

WEIGHT_LAYOUTS = ("block_major", "row_major")


def set_linear_layout_(linear: nn.Module, layout: str) -> None:
    """Stores a plain `nn.Linear` weight (out, in) column-major ("block_major") or row-major, in place.

    Values and shape are unchanged; only the strides change ((1, out) or (in, 1)). A weight sharded by a tensor-parallel
    plan (a `DTensor` on a 1-D mesh, in a module that `from_pretrained(tp_plan=...)` hooked) gets its local shard
    stored that way, through `torch.utils.swap_tensors` so that the parameter object stays the same. Other modules
    (PEFT, quantised linears), meta tensors and other distributed tensors (FSDP2 shards) are left as they are.
    """
    weight = getattr(linear, "weight", None)
    if type(linear) is not nn.Linear:
        return
    if DTensor is not None and isinstance(weight, DTensor):
        if getattr(linear, "_is_hooked", False) and weight.device_mesh.ndim == 1:
            _set_local_shard_layout_(weight, layout)
        return
    if type(weight.data) is not torch.Tensor or weight.is_meta:
        return
    if layout == "block_major" and not is_block_major(weight):
        weight.data = weight.data.t().contiguous().t()
    elif layout == "row_major" and not weight.is_contiguous():
        weight.data = weight.data.contiguous()


def split_outputs(out: torch.Tensor, linears) -> list[torch.Tensor]:
    """(M, sum of out) product of fused linears -> one (M, out) view per linear, in order."""
    return list(out.split([linear.weight.shape[0] for linear in linears], dim=1))


def fused_projection_groups(module: nn.Module, groups=None) -> list[list[nn.Module]]:
    """The linears of `module` (a MoHD sublayer) for each group of names in `groups` (default: the gather strategy's
    `fused_projections`) that it has entirely: [q, k, v] for attention, [gate, up] for the MLP."""
    names_groups = MoHDGatherStrategy.fused_projections if groups is None else groups
    groups = [[getattr(module, name, None) for name in names] for names in names_groups]
    return [linears for linears in groups if all(linear is not None for linear in linears)]


def _alike_linears(linears) -> bool:
    """Whether `linears` are two or more plain `nn.Linear` without bias whose weights share dtype, device and input
    width: the checks that `torch.compile` can trace, shared by `fusable_linears` and `block_major_fused_views`."""
    if len(linears) < 2 or any(type(linear) is not nn.Linear or linear.bias is not None for linear in linears):
        return False
    first = linears[0].weight
    return all(
        (linear.weight.dtype, linear.weight.device, linear.weight.shape[1])
        == (first.dtype, first.device, first.shape[1])
        for linear in linears
    )


def fusable_linears(linears) -> bool:
    """Whether `linears` (two or more) can share one block-major storage (`fuse_block_major_`): plain `nn.Linear`
    without bias whose weights are plain (not distributed, not meta) tensors of one dtype, device and input width."""
    return _alike_linears(linears) and all(
        type(linear.weight.data) is torch.Tensor and not linear.weight.is_meta for linear in linears
    )


def fused_block_major_weight(linears) -> torch.Tensor | None:
    """The (in, sum of out) row-major tensor whose consecutive column ranges are the weights of `linears` transposed,
    in order (the storage `fuse_block_major_` gives them), or None where they are not stored that way.

    Read from the tensors themselves (same storage, consecutive starts, strides (1, sum of out)), not from a flag
    kept beside them: a weight replaced or copied since (`.to()`, `load_state_dict(assign=True)`, a row-major layout)
    ends the fusion by itself. The tensor is a view (`as_strided`) that autograd would attribute to the first weight
    alone, so it is given only where no gradient is wanted (autograd off, or weights that do not require grad) and
    outside `torch.compile` (which cannot read data pointers). One block-major product with it computes all the
    linears' outputs (q/k/v, gate/up): one GEMM per span of blocks instead of one per linear, which the plans use for
    one token on the host (`MoHDSpansPlan`) and for few tokens by index tensors (`MoHDIndexedPlan`).
    Under `torch.compile`, which reads neither data pointers nor storage offsets, the strides decide
    (`block_major_fused_views`), and tracing checks the `as_strided` view against the first weight's storage size.
    """
    if torch.compiler.is_compiling():
        if not block_major_fused_views(linears):
            return None
    elif not shares_block_major_storage(linears):
        return None
    weights = [linear.weight for linear in linears]
    if torch.is_grad_enabled() and any(weight.requires_grad for weight in weights):
        return None
    first, total = weights[0], sum(weight.shape[0] for weight in weights)
    return torch.as_strided(first, (first.shape[1], total), (total, 1))


def block_major_fused_views(linears) -> bool:
    """Whether the weights of `linears` (plain `nn.Linear` without bias, one dtype, device and input width) have the
    strides (1, sum of out) of the views `fuse_block_major_` makes, the only ones with such strides: the checks of
    `shares_block_major_storage` that `torch.compile` can trace (it reads neither data pointers nor storage
    offsets)."""
    if not _alike_linears(linears):
        return False
    total = sum(linear.weight.shape[0] for linear in linears)
    return all(linear.weight.stride() == (1, total) for linear in linears)


def shares_block_major_storage(linears) -> bool:
    """Whether the weights of `linears` are the consecutive column ranges, transposed, of one row-major
    (in, sum of out) tensor (`fuse_block_major_`); host-side checks of strides and data pointers only."""
    if not (fusable_linears(linears) and block_major_fused_views(linears)):
        return False
    weights = [linear.weight for linear in linears]
    storage, expected = weights[0].untyped_storage().data_ptr(), weights[0].data_ptr()
    for weight in weights:
        if weight.data_ptr() != expected or weight.untyped_storage().data_ptr() != storage:
            return False
        expected += weight.shape[0] * weight.element_size()
    return True


def unfused_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook of a MoHD sublayer (`nn.Module.register_state_dict_post_hook`): the entries of input
    projections that share one storage (`fuse_block_major_`) become row-major copies, as a checkpoint stores them
    in any layout (safetensors and `save_pretrained` refuse tensors that share a storage). `state_dict(keep_vars=True)`
    entries (the parameters themselves) are left as they are."""
    names = {linear: name for name, linear in module.named_children()}
    for linears in fused_projection_groups(module):
        if not shares_block_major_storage(linears):
            continue
        for linear in linears:
            key = f"{prefix}{names[linear]}.weight"
            tensor = state_dict.get(key)
            if tensor is not None and not isinstance(tensor, nn.Parameter):
                state_dict[key] = tensor.contiguous()


@torch.no_grad()
def fuse_block_major_(linears) -> None:
    """Stores the weights of `linears` (a sublayer's input projections: q/k/v, gate/up) block-major in one shared
    (in, sum of out) tensor, each weight the transpose of its column range, in place: the parameters keep their
    objects, names, shapes and values; their data become views with strides (1, sum of out). Linears already stored
    so, and those that `fusable_linears` rejects, are left alone.

    `state_dict` gives the fused weights as row-major copies (`unfused_state_dict_hook`), since safetensors and
    `save_pretrained` refuse tensors that share a storage: checkpoints are the same in every layout.
    """
    if not fusable_linears(linears) or shares_block_major_storage(linears):
        return
    first = linears[0].weight
    widths = [linear.weight.shape[0] for linear in linears]
    fused = torch.empty(first.shape[1], sum(widths), dtype=first.dtype, device=first.device)
    start = 0
    for linear, width in zip(linears, widths, strict=True):
        columns = fused[:, start : start + width]
        columns.copy_(linear.weight.data.t())
        linear.weight.data = columns.t()
        start += width


@torch.no_grad()
def _set_local_shard_layout_(weight: nn.Parameter, layout: str) -> None:
    """`set_linear_layout_` for a tensor-parallel `DTensor` weight: a new local shard with the wanted strides,
    swapped into the same parameter object (`DTensor.from_local` keeps the strides it is given)."""
    local = weight.to_local()
    if local.is_meta or local.dim() != 2:
        return
    if layout == "block_major" and not is_block_major(local):
        local, stride = local.t().contiguous().t(), (1, weight.shape[0])
    elif layout == "row_major" and not local.is_contiguous():
        local, stride = local.contiguous(), (weight.shape[1], 1)
    else:
        return
    sharded = DTensor.from_local(
        local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape, stride=stride
    )
    torch.utils.swap_tensors(weight, nn.Parameter(sharded, requires_grad=weight.requires_grad))


# Tensor parallelism


class MoHDAllReduceSum(torch.autograd.Function):
    """Sum over the ranks of `group` forward, identity backward: the partial outputs of a row-sharded projection
    (each rank holds the rows of its own heads or intermediate features), whose sum is the replicated output; its
    gradient is that of the sum, already replicated (transformers' `RowwiseParallel`, `_AllReduceForward`)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        total = partial.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class MoHDAllReduceGradient(torch.autograd.Function):
    """Identity forward, sum over the ranks of `group` backward: a replicated input (hidden states, gates) read by a
    column-sharded projection gets a partial gradient on each rank (transformers' `ColwiseParallel`, which marks the
    input gradient `Partial`; `_AllReduceBackward`)."""

    @staticmethod
    def forward(ctx, replicated: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return replicated.view_as(replicated)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class MoHDTensorParallelProjections:
    """MoHD's sparse projections on tensor-parallel weights (`from_pretrained(tp_plan="auto")`).

    The plan (`MoHDConfig.base_model_tp_plan`) is Llama's: q/k/v and gate/up "colwise" (weight `Shard(0)`, output
    features: each rank holds whole heads, whole intermediate features), o_proj and down_proj "rowwise" (weight
    `Shard(1)`, input features; transformers' `integrations/tensor_parallel.py`, `ColwiseParallel` and
    `RowwiseParallel`). Neither shards the hidden axis, so every rank holds all N sub-dimension blocks of its
    slice: the input side reads the token's active column blocks of its local rows, the output side writes the active
    row blocks from its local columns.

    transformers applies those styles by replacing `forward` of the `nn.Linear` modules; the gather path never calls
    them (it reads `linear.weight`), so without this class `RowwiseParallel`'s all-reduce of the partial output never
    runs, and the `DTensor` weights mixed with plain activations raise "aten.mm.default got mixed torch.Tensor and
    DTensor". Here the plans run on the local shards instead (plain `nn.Linear` stand-ins holding
    `weight.to_local()`), with the collectives of those two styles done explicitly:

    - input side (colwise): no forward communication (the input is replicated, the output is this rank's slice of
      features, which attention reads as its local heads); backward sums the partial gradients of the input and of
      the gates (`MoHDAllReduceGradient`).
    - output side (rowwise): the plan's (M, N, s) partial blocks are summed over the ranks (`MoHDAllReduceSum`)
      before activation scaling and group fusion (both linear and replicated). The bias (replicated) enters the
      dispatch on rank 0 only (zeros elsewhere), so that the sum counts it once, on the active blocks only, as
      without TP; its gradient, computed on rank 0, is summed to every rank (`MoHDAllReduceGradient`), as a
      replicated parameter needs.

    Attributes:
        group: the process group of the tensor-parallel mesh.
        rank: this rank's index in it.
    """

    # placements of (weight, bias) that each side supports: Llama's colwise / rowwise
    INPUT_PLACEMENTS = ((Shard(0),), (Shard(0),)) if DTensor is not None else None
    OUTPUT_PLACEMENTS = ((Shard(1),), (Replicate(),)) if DTensor is not None else None

    def __init__(self, group, rank: int):
        self.group = group
        self.rank = rank

    @classmethod
    def of(cls, linears, side: str) -> "MoHDTensorParallelProjections | None":
        """The tensor-parallel state of `linears` (one side of a sublayer), or None when no weight is sharded.

        Raises:
            NotImplementedError: some but not all of the plain `nn.Linear` weights are sharded, a weight is sharded
                on a mesh of more than 1 dimension, or with placements other than the side's Llama style ("input":
                weight and bias `Shard(0)`; "output": weight `Shard(1)`, bias `Replicate()`).
        """
        if DTensor is None:
            return None
        plain = [linear for linear in linears if type(linear) is nn.Linear]
        sharded = [linear for linear in plain if isinstance(linear.weight, DTensor)]
        if not sharded:
            return None
        expected = cls.INPUT_PLACEMENTS if side == "input" else cls.OUTPUT_PLACEMENTS
        if len(sharded) != len(linears):
            raise NotImplementedError(
                f"MoHD {side} projections under tensor parallelism: either all of them are sharded plain nn.Linear "
                f"or none is; got {len(sharded)} sharded of {len(linears)}."
            )
        mesh = sharded[0].weight.device_mesh
        for linear in sharded:
            placements = [linear.weight.placements]
            if linear.bias is not None:
                placements.append(linear.bias.placements)
            if linear.weight.device_mesh.ndim != 1 or any(p != e for p, e in zip(placements, expected, strict=False)):
                raise NotImplementedError(
                    f"MoHD {side} projections support the tensor-parallel styles of Llama's plan only "
                    f"({'colwise' if side == 'input' else 'rowwise'}: placements {expected} on a 1-D mesh); "
                    f"got {placements} on a {linear.weight.device_mesh.ndim}-D mesh."
                )
        return cls(mesh.get_group(), mesh.get_local_rank())

    def local_linear(self, linear: nn.Linear, side: str = "input") -> nn.Linear:
        """A plain `nn.Linear` (no hooks, no registered parameters) computing with the local shard of `linear`:
        weight (out, in) -> its local (out / P, in) ("input" side) or (out, in / P) ("output" side) slice,
        differentiable to the `DTensor`; on the output side the bias is rank 0's alone (see the class docstring)."""
        local = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(local)
        weight = linear.weight.to_local()
        bias = None if linear.bias is None else linear.bias.to_local()
        if bias is not None and side == "output":
            if torch.is_grad_enabled():
                bias = MoHDAllReduceGradient.apply(bias, self.group)
            if self.rank != 0:
                bias = bias * 0  # zeros that keep the graph, so that every rank joins the gradient's all-reduce
        # plain attributes, not parameters: `to_local()` of a parameter is a non-leaf view (the gradient reaches the
        # DTensor through it), which `Module.__setattr__` refuses to register
        object.__setattr__(local, "weight", weight)
        object.__setattr__(local, "bias", bias)
        local.out_features, local.in_features = weight.shape
        return local

    def project_in(self, hidden_states: torch.Tensor, plan: MoHDPlan, linears) -> list[torch.Tensor]:
        """(M, D) replicated -> one (M, out / P) local slice per linear."""
        if torch.is_grad_enabled():
            hidden_states = MoHDAllReduceGradient.apply(hidden_states, self.group)
            plan = dataclasses.replace(plan, gates=MoHDAllReduceGradient.apply(plan.gates, self.group))
        return plan.project_in(hidden_states, [self.local_linear(linear) for linear in linears])

    def project_out(self, hidden_states: torch.Tensor, plan: MoHDPlan, linear: nn.Linear) -> torch.Tensor:
        """(M, in / P) local slice -> (M, N, s) replicated blocks, the sum of the ranks' partial products."""
        partial = plan.project_out(hidden_states, self.local_linear(linear, side="output"))
        return MoHDAllReduceSum.apply(partial, self.group)
