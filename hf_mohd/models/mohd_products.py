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
"""The grouped products and autograd Functions of MoHD's many-token plan, and group fusion's block products.

The grouped plan (`mohd_plans.MoHDGroupedPlan`: prefill, training) dispatches each routing slot's tokens to their
routed blocks as a mixture-of-experts layer dispatches tokens to experts: one product per block (group) on an eager
CPU run, one grouped kernel call (`torch.nn.functional.grouped_mm`) elsewhere. The autograd Functions here keep a
training step's saved activations at the dense model's: they save inputs and indices, not gathered copies.
`mix_blocks` and `MoHDSparseBlockMix` compute group fusion, F @ blocks (arXiv 2412.05644, section 3, step 5).

Shapes: M tokens, N blocks of s scalars, N_s shared, N_r routed, k routing slots, G groups (blocks), R rows of a
slot, K the contraction width, O the output width.

This file is copied next to the weights by `save_pretrained` (remote code): it imports only `torch`, `transformers`
and same-folder siblings.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from transformers.integrations import moe as transformers_moe


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


class MoHDDistinctRows(torch.autograd.Function):
    """`source.index_select(0, index)` for an `index` of distinct rows, whose backward writes each row's gradient to
    its own row (`index_copy_` into zeros) instead of accumulating (`index_select`'s own backward is `index_add_`,
    an atomic kernel on accelerators). Shapes: source (R, C), index (P,) distinct -> (P, C).

    The sorted plan (`mohd_plans.MoHDSortedPlan`) reads the (token, routed block) pairs' input blocks this way: a
    token picks distinct blocks, so no two pairs share a row of the (M * N, s) blocks.
    """

    @staticmethod
    def forward(ctx, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = source.shape[0]
        return source.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, grad.shape[1]).index_copy_(0, index, grad), None


class MoHDRepeatedRows(torch.autograd.Function):
    """`source.index_select(0, index)` where every row of `source` is read exactly `repeats` times, the reads of row r
    at the positions `inverse[r * repeats : (r + 1) * repeats]` (so `index[inverse[p]] == p // repeats`); backward
    gathers each row's `repeats` gradients by `inverse` and sums them by a reshape: no atomic accumulation, the same
    order on every run. Shapes: source (R, C), index and inverse (R * repeats,) -> (R * repeats, C).

    With `repeats` 1 it is a permutation, whose backward is the inverse permutation: the sorted plan reorders the
    gates and the products between the router's (token, slot) order and its sorted order this way; with `repeats` k
    it reads each token's row once per routing slot, in sorted order (the output side's inputs).
    """

    @staticmethod
    def forward(ctx, source: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, repeats: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.repeats = repeats
        return source.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        if ctx.repeats > 1:
            grad = grad.view(-1, ctx.repeats, grad.shape[1]).sum(1)
        return grad, None, None, None


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
