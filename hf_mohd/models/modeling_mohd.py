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
"""MoHD: Mixture of Hidden Dimensions (Chen et al., ICML 2025, arXiv 2412.05644) on a LLaMA decoder.

Each sparsified sublayer (attention and/or FFN) reads and writes only the token's active sub-dimensions of the
residual stream: the shared blocks plus the top-k routed blocks its router picks (docs/design.md section 3, steps 1-7).
Shapes: see the legend in `modeling_common.py`; here N = num_sub_dims, N_s shared, N_r = N - N_s routed, s = D / N.

`MoHDModel.forward` and `MoHDForCausalLM.forward` are the shared ones of `modeling_common.py` (`RoutedDecoderMixin`,
`RoutedCausalLMMixin`).
"""

import functools
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.integrations import moe as transformers_moe
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring
from transformers.utils.output_capturing import OutputRecorder

from .configuration_mohd import MoHDConfig
from .modeling_common import (
    MLP,
    Attention,
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    RoutedCausalLMMixin,
    RoutedDecoderMixin,
    TopKRouter,
    load_balancing_loss,
    replayed_routes,
)


if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
else:  # builds without torch.distributed have no sharded weights
    DTensor = None


class MoHDRouter(TopKRouter):
    """Sub-dimension router of one sublayer (docs/design.md section 3, steps 2-3), on the shared `TopKRouter`.

    logits = W_r x in fp32 (W_r: N_r x D, no bias), p = softmax(logits), S = top-k of p with ties to the lower
    index; gate of a selected block = p_j ("softmax") or k p_j / sum_S p ("normalized"), in the input dtype (the
    gates scale activations). Ids are absolute block ids (routed choice + N_s).

    Returns:
        logits (B*T, N_r) fp32 (or the input dtype when wider), also under autocast, weights (B, T, k) in the input
        dtype, indices (B, T, k) absolute block ids.
    """

    def __init__(self, config: MoHDConfig, layer_idx: int, router_name: str):
        super().__init__(
            config.num_routed_sub_dims,
            config.hidden_size,
            config.num_routed_sub_dims_per_tok,
            layer_idx,
            router_name,
            index_offset=config.num_shared_sub_dims,
        )
        self.normalize_gates = config.routed_gate == "normalized"

    def gates(self, chosen_scores: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
        # CODEPATH: routed_gate="normalized" renormalises the selected probabilities to sum to k.
        if self.normalize_gates:
            chosen_scores = self.top_k * chosen_scores / chosen_scores.sum(-1, keepdim=True)
        return chosen_scores.to(input_dtype)


def mix_blocks(fusion: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """`fusion @ blocks` for every token: fusion (N, N), blocks (M, N, s) -> (M, N, s).

    One batched matmul over the tokens with `fusion` broadcast (a stride-0 batch, no copy); `torch.matmul` on a 2-D
    and a 3-D operand would instead fold the tokens into rows, copying the blocks to (M, s, N) and the product back.
    One token (decoding) is one small GEMM.
    """
    if blocks.shape[0] == 1:
        return torch.mm(fusion, blocks[0])[None]
    return torch.bmm(fusion.expand(blocks.shape[0], *fusion.shape), blocks)


class MoHDGroupFusion(nn.Module):
    """Group fusion (docs/design.md section 3, step 5): y_i <- sum_j F_ij y_j over the N output blocks, F
    identity-initialised.

    Input and output (M, N, s); N^2 parameters, N * D multiply-adds per token.
    """

    def __init__(self, config: MoHDConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_sub_dims, config.num_sub_dims))
        self.num_routed = config.num_routed_sub_dims

    def forward(self, blocks: torch.Tensor, positions: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        """(M, N, s) -> (M, N, s): `scale * F @ blocks`, the scale (activation scaling, step 4) applied to the N x N
        matrix rather than to the M x D blocks. `positions` (k, M), given where `blocks` is zero outside the first N_s
        blocks and the routed blocks at rows `positions` of `blocks.view(-1, s)` (the grouped gather path's output),
        lets the product keep only those blocks for backward (`MoHDSparseBlockMix`)."""
        weight = self.weight.to(blocks.dtype)
        if scale != 1.0:
            weight = weight * scale
        if positions is None:
            return mix_blocks(weight, blocks)
        return MoHDSparseBlockMix.apply(weight, blocks, positions, blocks.shape[1] - self.num_routed)


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


class MoHDMaskedPlan(NamedTuple):
    """Routing of M tokens for the masked path: input `gates` and binary output `mask`, both (M, N)."""

    gates: torch.Tensor
    mask: torch.Tensor


class MoHDGatherPlan(NamedTuple):
    """Routing of M tokens for the gather path, one group of M (token, routed block) pairs per routing slot.

    For slot j of the k slots, `token_index[j]` lists the M tokens sorted by the routed block they picked in that
    slot, `block_index[j]` those blocks (routed ids 0..N_r-1), `gates[j]` their gates, and `offsets[j]` the int32
    group ends of the grouped matmul. Shapes: token_index, block_index (k, M); gates (k, M, 1); offsets (k, N_r).
    Working slot by slot keeps every intermediate at M rows, not M * k: at the bench shape an (M * k, 2816) fp32
    tensor is 46 MB, past glibc's 32 MB mmap threshold, and is page-faulted in afresh on every call.
    """

    token_index: torch.Tensor
    block_index: torch.Tensor
    gates: torch.Tensor
    offsets: torch.Tensor


class MoHDGatherFewTokensPlan(NamedTuple):
    """Routing of a few tokens (decoding) for the gather path: no sort; each token's active blocks are read directly.

    block_index (M, k) absolute block ids in the router's order; columns (M, k * s) the hidden-width positions of
    each token's routed blocks (g s + 0..s-1 for block g); gates (M, k * s) the gate of the block of each position;
    bags (M,) the start of each token's k * s positions in `columns.view(-1)` (`embedding_bag` offsets).
    The form used under `torch.compile` and on accelerators; eager CPU runs use `MoHDGatherHostPlan`.
    """

    block_index: torch.Tensor
    columns: torch.Tensor
    gates: torch.Tensor
    bags: torch.Tensor


class MoHDGatherHostPlan(NamedTuple):
    """Routing of a few tokens on an eager CPU run: the block ids are read to Python ints (no device to synchronise),
    so the blocks any of the M tokens picked are addressed as contiguous slices of the weights and read once for all
    M tokens, with no index tensors and no copies of weights.

    gates (M, N): every block's input gate per token (1 shared, g_j selected, 0 otherwise; keeps the router's
    gradient); keep (M, N) 1.0 on the shared blocks and where the token picked the routed block (None when M == 1:
    every picked block is the token's); spans: the picked blocks as maximal runs of consecutive block ids, half-open
    [start, stop), the first always starting at block 0 with the shared blocks (a routed block N_s, N_s + 1, ...
    picked next to them joins that span). One GEMM per span, not per block: fewer and wider calls, what decoding at
    small widths is bound by.

    Two forms, chosen by `MoHDGatherDispatch.small_batch_plan`: "union" (rows None) multiplies all M tokens by every
    span of the union of their picked blocks, then `keep` zeroes what a token did not pick; "per_block" (inference
    only, `block_token_spans`) multiplies each span only by the tokens that picked it, `rows[i]` (a slice, or an
    int64 index of the tokens), with keep None: the same bytes read, fewer FLOPs, more and smaller calls.
    """

    gates: torch.Tensor
    keep: torch.Tensor | None
    spans: tuple[tuple[int, int], ...]
    rows: tuple[slice | torch.Tensor, ...] | None = None


SMALL_BATCH_PLANS = ("auto", "union", "per_block")


@functools.cache
def small_gemms_compute_bound(dtype: torch.dtype, threads: int) -> bool:
    """Whether this CPU's BLAS is compute-bound on the few-row products of decoding: an (8, 64) x (64, 4096) `torch.mm`
    (8 tokens by one sub-dimension block of a projection) taking more than twice the time of a (1, 64) x (64, 4096)
    one, medians of 12 interleaved timings of 4 calls each (about 10 ms, once per process, dtype and thread count).

    A memory-bound BLAS reads the block once whatever the rows (an Intel Xeon with AVX-512: a dense batch-2 decoding
    step costs 1.1x a batch-1 step); a compute-bound one pays per row (AMD EPYC Zen 3 with MKL 2024.2: 2.2x for that
    step, 4.0x for this probe, 3.3-3.7x at out 2048 or 2816), where "per_block" plans pay (bench/README.md,
    docs/design.md section 3). Only the speed depends on the answer, never the result. Timings, not the CPU's name,
    decide: what matters is the BLAS build and the CPU together. Uses constant inputs (the global RNG is untouched).
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
        """This part's leading rows of a `slot_parts` scratch tensor (to write its product or gathered rows into), or
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


def slot_parts(
    offsets: torch.Tensor, like: torch.Tensor, width: int
) -> tuple[list[list[MoHDGroupPart]], torch.Tensor | None]:
    """The `grouped_parts` of every routing slot of the (k, G) int32 group ends `offsets`, and one (R_max, width)
    scratch tensor of `like`'s dtype and device for their per-group products (or gathered rows), R_max the most rows
    of a part (`MoHDGroupPart.scratch`); None instead of the tensor when the parts are grouped calls.

    Each per-group result is consumed at once (scattered by `index_add_` or multiplied), so one buffer serves them
    all: one allocation instead of one per group, of a different size each time. At the bench shape those are 1-4
    MB results, 20 per projection and layer, and the varying sizes keep glibc's heap growing and being trimmed
    back, which page-faults fresh memory in on every forward (measured with `ru_minflt`).
    """
    parts = [grouped_parts(slot_offsets) for slot_offsets in offsets]
    sizes = [part.rows.stop - part.rows.start for slot in parts for part in slot if part.group is not None]
    return parts, like.new_empty(max(sizes), width) if sizes else None


def grouped_parts(offsets: torch.Tensor) -> list[MoHDGroupPart]:
    """The parts of one routing slot whose (G,) int32 group ends are `offsets`: one per non-empty group on an eager
    CPU run, else one part of all rows (`MoHDGroupPart`).

    On CPU, a product per group followed at once by its scatter (`index_add_`) or its gather keeps each group's
    (rows, O) block in cache; one grouped call writes the whole (R, O) result first, and the scatter then reads it
    back from memory. Measured at the bench shape (2,048 tokens, s = 64, one thread): 50 ms instead of 72 ms per
    gate/up projection, 17 instead of 25 ms per q/k/v projection. On an accelerator, or while compiling, reading the
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
    which only needs its shape: at the bench shape that doubled the activation memory of a MoHD training step.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.mark_dirty(out)
        return out.index_add_(0, index, source)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad, None, grad.index_select(0, index)


class MoHDGatheredGroupedMatmul(torch.autograd.Function):
    """`grouped_matmul(inputs[index], weight, offsets)` that keeps `inputs` and `index`, not the gathered rows.

    The output side of the grouped path gathers, per routing slot, the M token rows (M x in) in block order; autograd
    would keep that copy for the weight gradient although `inputs` itself is kept anyway (by the shared-rows GEMM).
    The backward gathers again and recomputes the grouped product with autograd (one extra output-side routed GEMM
    per slot, a few percent of a training step) to get both gradients.
    Shapes: inputs (M, in), index (R,), weight (G, in, s), offsets (G,) int32 group ends -> (R, s).
    Used where `MoHDGatherLinearOut` does not apply (autocast, `torch.compile`), with `MoHDRowIndexAdd` on the input
    side.
    """

    @staticmethod
    def forward(ctx, inputs, index, weight, offsets):
        ctx.save_for_backward(inputs, index, weight, offsets)
        return grouped_matmul(inputs.index_select(0, index), weight, offsets)

    @staticmethod
    def backward(ctx, grad):
        inputs, index, weight, offsets = ctx.saved_tensors
        rows = inputs.detach().index_select(0, index).requires_grad_(ctx.needs_input_grad[0])
        leaf_weight = weight.detach().requires_grad_(ctx.needs_input_grad[2])
        with torch.enable_grad():
            out = grouped_matmul(rows, leaf_weight, offsets)
        wanted = [t for t in (rows, leaf_weight) if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        grad_rows = next(grads) if rows.requires_grad else None
        grad_weight = next(grads) if leaf_weight.requires_grad else None
        grad_inputs = None if grad_rows is None else torch.zeros_like(inputs).index_add_(0, index, grad_rows)
        return grad_inputs, None, grad_weight, None


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


class MoHDGatherLinearIn(torch.autograd.Function):
    """Input side of the grouped gather path for one linear: `x_shared @ W[:, :D_s].T + b` plus, per routing slot
    j, the product of each token's gated block with its block of `W_routed` added to the rows `token_index[j]`, group
    by group (`grouped_parts`: one `torch.mm` per group on CPU, one grouped kernel call elsewhere; docs/design.md
    section 3, "Execution paths").

    The backward writes both pieces of the weight gradient into one (out, in) tensor of the weight's own layout
    (so that `AccumulateGrad` takes it as `.grad` without a copy): the shared columns by one GEMM into their slice,
    the routed column blocks by one weight-gradient GEMM per group (or one grouped call per slot) into theirs.
    Autograd on the views (a column slice and a grouped routed view of `weight`) would materialise a zero-filled
    full-size gradient for each view, then sum them, and copy the sum into the block-major layout. It keeps only its
    inputs and the index (as `MoHDRowIndexAdd` does, not each slot's (M, out) output).
    Shapes: shared (M, D_s) (a view of the input), routed (k, M, s) gated routed inputs in the plan's order,
    token_index (k, M), offsets (k, N_r) int32 group ends, weight (out, D), bias (out,) or None -> (M, out).
    Same dtype for inputs, weight and bias, no autocast (`MoHDGatherDispatch` sends other cases to autograd).
    """

    @staticmethod
    def forward(ctx, shared, routed, token_index, offsets, weight, bias, num_routed: int, block: int):
        shared_width = shared.shape[1]
        ctx.save_for_backward(shared, routed, token_index, offsets, weight)
        ctx.has_bias, ctx.num_routed, ctx.block = bias is not None, num_routed, block
        out = F.linear(shared, weight[:, :shared_width], bias)
        routed_weight = weight[:, shared_width:].view(weight.shape[0], num_routed, block).permute(1, 2, 0)
        all_parts, products = slot_parts(offsets, out, weight.shape[0])
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
        all_parts, gathered = slot_parts(offsets, grad, out_features)
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


class MoHDGatherLinearOut(torch.autograd.Function):
    """Output side of the grouped gather path: (M, in) -> (M, N, s) blocks, the shared rows `x @ W[:D_s].T`
    (+ bias) and, per routing slot j, the routed block each token picked, `x[token_index[j]] @ W_routed[block].T`
    (+ its bias) group by group (`grouped_parts`), written at (token, N_s + block); the other blocks are 0
    (docs/design.md section 3).

    It keeps the input and the plan's indices only: the backward gathers each slot's token rows again for the
    routed weight gradient (no recomputation of the forward product), and writes the shared and routed row blocks of
    the weight gradient into one (out, in) tensor in the weight's own layout, instead of the two zero-filled full-size
    gradients of autograd's views and their sum.
    Shapes: hidden_states (M, in), token_index, block_index (k, M) (routed ids 0..N_r-1), offsets (k, N_r) int32,
    weight (D, in), bias (D,) or None -> (M, N, s). Same dtype for all, no autocast.
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
        all_parts, gathered = slot_parts(offsets, hidden_states, hidden_states.shape[1])
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
        all_parts, scratch = slot_parts(offsets, hidden_states, hidden_states.shape[1])
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


class MoHDMaskedDispatch:
    """Reference path (`sparse_implementation="masked"`): dense matmuls on the gated input, binary mask on the
    output."""

    def __init__(self, config: MoHDConfig):
        self.num_sub_dims = config.num_sub_dims
        self.num_shared = config.num_shared_sub_dims
        self.block = config.sub_dim_size

    def plan(self, indices: torch.Tensor, weights: torch.Tensor) -> MoHDMaskedPlan:
        """(M, k) absolute block ids and gates -> (M, N) gates and mask."""
        m = indices.shape[0]
        gates = torch.zeros(m, self.num_sub_dims, dtype=weights.dtype, device=weights.device)
        gates[:, : self.num_shared] = 1
        mask = gates.clone()
        gates = gates.scatter(1, indices, weights)
        mask = mask.scatter(1, indices, torch.ones_like(weights))
        return MoHDMaskedPlan(gates, mask)

    def project_in(self, hidden_states: torch.Tensor, plan: MoHDMaskedPlan, linears) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) tensor per linear, each reading g ⊙ x."""
        m = hidden_states.shape[0]
        gated = (hidden_states.view(m, self.num_sub_dims, self.block) * plan.gates[..., None]).view(m, -1)
        return [linear(gated) for linear in linears]

    def project_out(self, hidden_states: torch.Tensor, plan: MoHDMaskedPlan, linear: nn.Linear) -> torch.Tensor:
        """(M, in) -> (M, N, s), zero outside the active blocks."""
        out = linear(hidden_states).view(hidden_states.shape[0], self.num_sub_dims, self.block)
        return out * plan.mask[..., None]


class MoHDGatherDispatch:
    """Fast path (`sparse_implementation="gather"`): inactive blocks are never read nor computed.

    Shared blocks are one dense GEMM over the first N_s * s columns (input side) or rows (output side). Routed
    blocks of many tokens (prefill, training) are dispatched like experts, one routing slot at a time: the M tokens
    sorted by their block in that slot, products with views of the `nn.Linear` weight (no copy), then `index_add_`
    back; on an eager CPU run one product per group, scattered at once, elsewhere one grouped matmul
    (`grouped_parts`; docs/design.md section 3, "Execution paths"). For a few tokens (decoding, draft verification)
    the active blocks are read directly, with no sort and no per-group calls, the memory-bound case (Deja Vu,
    PowerInfer). On an eager CPU run (`MoHDGatherHostPlan`, up to `host_tokens` tokens) the picked block ids are read to
    the host and merged into spans of consecutive blocks, each span one GEMM on contiguous weight rows (input side:
    rows of the block-major `weight.T`; output side: rows of `weight`), read in place once for all tokens, either
    multiplied by all of them ("union") or, where the BLAS is compute-bound on few rows, each span only by the tokens
    that picked it ("per_block", `small_batch_plan`; inference only). Under `torch.compile` or on an accelerator
    (`MoHDGatherFewTokensPlan`, up to `few_tokens` tokens), where reading the ids to the host would break the graph or
    synchronise: input side `embedding_bag` over the active columns, output side one `index_select` of the k * s
    active rows and a batched matmul.

    Only plain `nn.Linear` projections come here: `MoHDSubDimensions.route` sends a sublayer with any other
    projection (a PEFT LoRA layer, a quantised linear: it computes something other than its `.weight`) to the
    masked strategy.

    Weight layout: the input side (q/k/v, gate/up) reads column blocks; in the row-major `nn.Linear` layout a block
    is s contiguous floats per row, which a CPU streams at a fraction of the contiguous bandwidth (measured here:
    64 columns at 3-5 GB/s against ~16 GB/s for whole rows). MoHD models therefore store those weights column-major
    (`MoHDPreTrainedModel.to_weight_layout("block_major")`, the default after `__init__` and `from_pretrained`:
    same values and shapes, `weight.t()` contiguous), which makes every block contiguous. The path follows the
    layout each weight actually has, so a weight replaced by another layout (FSDP2's unsharded parameters, a
    `load_state_dict(assign=True)`) stays exact, only slower: row-major input weights take the dense matmul.
    """

    input_projections = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")

    def __init__(self, config: MoHDConfig):
        self.num_sub_dims = config.num_sub_dims
        self.num_shared = config.num_shared_sub_dims
        self.num_routed = config.num_routed_sub_dims
        self.top_k = config.num_routed_sub_dims_per_tok
        self.block = config.sub_dim_size
        self.hidden_size = config.hidden_size
        self.shared_width = self.num_shared * self.block
        # Reading each token's k blocks directly beats sorting while the blocks read are fewer than the routed
        # blocks (M * k <= N_r): the grouped path would then run mostly empty groups.
        self.few_tokens = max(1, self.num_routed // max(self.top_k, 1))
        # With host ids each picked block is read once for all tokens, so the direct read stays ahead of the grouped
        # path (which reads a block once per routing slot) over the small batches of decoding and draft verification.
        self.host_tokens = max(self.few_tokens, 8)
        # "auto": "per_block" where the BLAS is compute-bound on few rows (`small_gemms_compute_bound`), else "union"
        self.small_batch_plan = "auto"

    def per_block(self, m: int, dtype: torch.dtype) -> bool:
        """Whether a host-ids plan of `m` tokens multiplies each picked block only by its tokens ("per_block"): with
        several tokens, autograd off (decoding, draft verification), by `small_batch_plan`."""
        if m == 1 or torch.is_grad_enabled() or self.small_batch_plan == "union":
            return False
        return self.small_batch_plan == "per_block" or small_gemms_compute_bound(dtype, torch.get_num_threads())

    def plan(
        self, indices: torch.Tensor, weights: torch.Tensor
    ) -> MoHDGatherPlan | MoHDGatherFewTokensPlan | MoHDGatherHostPlan:
        """(M, k) absolute block ids and gates -> per-slot pairs sorted by routed block (many tokens), or a direct
        read of each token's blocks (by host ids on an eager CPU run, at most `host_tokens` tokens, in the form
        `per_block` chooses; else by index tensors, at most `few_tokens` tokens)."""
        m = indices.shape[0]
        if m <= self.host_tokens and indices.device.type == "cpu" and not torch.compiler.is_compiling():
            ids = indices.view(-1).tolist()
            spans = contiguous_spans(self.num_shared, ids)
            if m == 1 and not torch.is_grad_enabled():  # decoding: the gates from Python floats, fewer ops
                values = [1.0] * self.num_shared + [0.0] * self.num_routed
                for block, gate in zip(ids, weights.view(-1).tolist(), strict=True):
                    values[block] = gate
                return MoHDGatherHostPlan(weights.new_tensor(values)[None], None, spans)
            shared = F.pad(weights.new_ones(m, self.num_shared), (0, self.num_routed))  # 1 on the shared blocks
            if self.per_block(m, weights.dtype):
                spans, rows = block_token_spans(self.num_shared, indices.tolist())
                return MoHDGatherHostPlan(shared.scatter(1, indices, weights), None, spans, rows)
            keep = None if m == 1 else shared.scatter(1, indices, 1.0)
            return MoHDGatherHostPlan(shared.scatter(1, indices, weights), keep, spans)
        if m <= self.few_tokens:
            width = self.top_k * self.block
            columns = (indices[..., None] * self.block + torch.arange(self.block, device=indices.device)).view(m, -1)
            gates = weights[..., None].expand(*weights.shape, self.block).reshape(m, width)
            bags = torch.arange(0, m * width, width, device=indices.device)
            return MoHDGatherFewTokensPlan(indices, columns, gates, bags)
        slots = (indices - self.num_shared).t()
        order = torch.argsort(slots, dim=1, stable=True)
        slot_offset = torch.arange(self.top_k, device=indices.device)[:, None] * self.num_routed
        counts = torch.bincount((slots + slot_offset).reshape(-1), minlength=self.top_k * self.num_routed)
        offsets = torch.cumsum(counts.view(self.top_k, self.num_routed), dim=1).to(torch.int32)
        return MoHDGatherPlan(order, slots.gather(1, order), weights.t().gather(1, order)[..., None], offsets)

    def project_in(
        self, hidden_states: torch.Tensor, plan: MoHDGatherPlan | MoHDGatherFewTokensPlan | MoHDGatherHostPlan, linears
    ) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) tensor per linear: shared columns dense, routed columns grouped or gathered."""
        if isinstance(plan, MoHDGatherHostPlan):
            return self._project_in_host(hidden_states, plan, linears)
        if isinstance(plan, MoHDGatherFewTokensPlan):
            return self._project_in_few(hidden_states, plan, linears)
        m = hidden_states.shape[0]
        shared = hidden_states[:, : self.shared_width]
        # gated routed inputs per slot, (k, M, s), in the plan's order
        rows = plan.token_index * self.num_sub_dims + self.num_shared + plan.block_index
        routed = hidden_states.reshape(m * self.num_sub_dims, self.block).index_select(0, rows.reshape(-1))
        routed = routed.view(*rows.shape, self.block) * plan.gates
        outputs = []
        for linear in linears:
            weight = linear.weight
            if self._fused(hidden_states, routed, linear):
                outputs.append(
                    MoHDGatherLinearIn.apply(
                        shared,
                        routed,
                        plan.token_index,
                        plan.offsets,
                        weight,
                        linear.bias,
                        self.num_routed,
                        self.block,
                    )
                )
                continue
            out = F.linear(shared, weight[:, : self.shared_width], linear.bias)
            # (N_r, s, out) view of the routed columns: block g is weight[:, D_s + g s : D_s + (g + 1) s].T
            routed_weight = weight[:, self.shared_width :].view(weight.shape[0], self.num_routed, self.block)
            routed_weight = routed_weight.permute(1, 2, 0)
            for slot in range(self.top_k):
                routed_out = grouped_matmul(routed[slot], routed_weight, plan.offsets[slot])
                out = MoHDRowIndexAdd.apply(out, plan.token_index[slot], routed_out.to(out.dtype))
            outputs.append(out)
        return outputs

    def project_out(
        self,
        hidden_states: torch.Tensor,
        plan: MoHDGatherPlan | MoHDGatherFewTokensPlan | MoHDGatherHostPlan,
        linear: nn.Linear,
    ) -> torch.Tensor:
        """(M, in) -> (M, N, s): shared rows dense, each token's routed rows grouped or gathered, other blocks 0."""
        if isinstance(plan, MoHDGatherHostPlan):
            return self._project_out_host(hidden_states, plan, linear)
        if isinstance(plan, MoHDGatherFewTokensPlan):
            return self._project_out_few(hidden_states, plan, linear)
        m = hidden_states.shape[0]
        weight, bias = linear.weight, linear.bias
        if self._fused(hidden_states, linear):
            return MoHDGatherLinearOut.apply(
                hidden_states,
                plan.token_index,
                plan.block_index,
                plan.offsets,
                weight,
                bias,
                self.num_shared,
                self.block,
            )
        shared = F.linear(
            hidden_states, weight[: self.shared_width], None if bias is None else bias[: self.shared_width]
        )
        # (N_r, in, s) view of the routed rows: block g is weight[D_s + g s : D_s + (g + 1) s].T
        routed_weight = weight[self.shared_width :].view(self.num_routed, self.block, weight.shape[1]).transpose(1, 2)
        routed_bias = None if bias is None else bias[self.shared_width :].view(self.num_routed, self.block)
        routed_blocks = hidden_states.new_zeros(m * self.num_routed, self.block)
        for slot in range(self.top_k):
            tokens = plan.token_index[slot]
            routed = MoHDGatheredGroupedMatmul.apply(hidden_states, tokens, routed_weight, plan.offsets[slot])
            if routed_bias is not None:
                routed = routed + routed_bias[plan.block_index[slot]]
            routed_blocks = routed_blocks.index_add_(
                0, tokens * self.num_routed + plan.block_index[slot], routed.to(hidden_states.dtype)
            )
        shared = shared.view(m, self.num_shared, self.block)
        return torch.cat([shared, routed_blocks.view(m, self.num_routed, self.block)], dim=1)

    @staticmethod
    def _fused(*tensors_and_linear) -> bool:
        """Whether the grouped path runs as one autograd Function per linear (`MoHDGatherLinearIn`,
        `MoHDGatherLinearOut`): activations, weight and bias of one dtype, eager, no autocast. Otherwise (autocast's
        casts, `torch.compile`'s tracing) autograd composes the same computation from its views of the weight."""
        *tensors, linear = tensors_and_linear
        dtype = linear.weight.dtype
        if torch.compiler.is_compiling() or torch.is_autocast_enabled(linear.weight.device.type):
            return False
        bias = getattr(linear, "bias", None)
        return all(t.dtype == dtype for t in tensors) and (bias is None or bias.dtype == dtype)

    def _project_in_few(
        self, hidden_states: torch.Tensor, plan: MoHDGatherFewTokensPlan, linears
    ) -> list[torch.Tensor]:
        """Few-tokens input side: (M, D) -> one (M, out) per linear from the shared and the k * s active columns."""
        shared = hidden_states[:, : self.shared_width]
        values = hidden_states.gather(1, plan.columns) * plan.gates  # (M, k * s) gated routed inputs
        columns, flat_values = plan.columns.view(-1), values.view(-1)
        dense = None
        outputs = []
        for linear in linears:
            weight = linear.weight
            if is_block_major(weight) and weight.dtype == values.dtype:
                # column-major ("block_major"): the shared columns are one contiguous span, and each active column
                # is a contiguous row of weight.T that embedding_bag scales by its input and sums, reading no other
                routed = F.embedding_bag(columns, weight.t(), plan.bags, mode="sum", per_sample_weights=flat_values)
                outputs.append(
                    torch.addmm(routed, shared, weight[:, : self.shared_width].t())
                    if linear.bias is None
                    else F.linear(shared, weight[:, : self.shared_width], linear.bias) + routed
                )
                continue
            # row-major: column blocks are strided (no cheaper than whole rows), so one dense matmul on the gated
            # input, zero outside the active blocks (the masked path's computation)
            if dense is None:
                dense = F.pad(shared, (0, self.hidden_size - self.shared_width)).scatter(1, plan.columns, values)
            outputs.append(linear(dense))
        return outputs

    def _project_out_few(self, hidden_states: torch.Tensor, plan: MoHDGatherFewTokensPlan, linear) -> torch.Tensor:
        """Few-tokens output side: (M, in) -> (M, N, s), the shared rows and each token's k * s active rows."""
        m = hidden_states.shape[0]
        weight, bias = linear.weight, linear.bias
        shared = F.linear(
            hidden_states, weight[: self.shared_width], None if bias is None else bias[: self.shared_width]
        )
        active = weight.view(self.num_sub_dims, self.block, weight.shape[1])
        active = active.index_select(0, plan.block_index.view(-1)).view(m, -1, weight.shape[1])  # (M, k * s, in)
        routed = torch.bmm(active, hidden_states.to(active.dtype)[..., None]).view(m, -1)
        if bias is not None:
            routed = routed + bias[plan.columns]
        out = shared.new_zeros(m, self.hidden_size)
        out[:, : self.shared_width] = shared
        out = out.scatter_(1, plan.columns, routed.to(shared.dtype))
        return out.view(m, self.num_sub_dims, self.block)

    def _project_in_host(self, hidden_states: torch.Tensor, plan: MoHDGatherHostPlan, linears) -> list[torch.Tensor]:
        """Host-ids input side: (M, D) -> one (M, out) per linear. In the block-major layout each block is s
        contiguous rows of `weight.T`: the first span (the shared blocks) is one GEMM, each further span of picked
        blocks one accumulating GEMM (`addmm`) on the gated input, whose rows are 0 for the tokens that did not pick
        a block; in place when autograd and autocast are off. Under autocast the products are its ops, as
        `nn.Linear`'s: it casts the gated input and the weight blocks read to its dtype, the outputs are in it."""
        m = hidden_states.shape[0]
        gated = (hidden_states.view(m, self.num_sub_dims, self.block) * plan.gates[..., None]).view(m, -1)
        columns = [slice(start * self.block, stop * self.block) for start, stop in plan.spans]
        # `out=` forms are not autocast ops: the functional forms where autocast would cast the operands
        in_place = not torch.is_grad_enabled() and autocast_dtype(gated) in (None, gated.dtype)
        outputs = []
        for linear in linears:
            weight = linear.weight
            if is_block_major(weight) and weight.dtype == hidden_states.dtype:
                weight_t = weight.t()  # (D, out), rows contiguous: block g is rows g s .. (g + 1) s - 1
                out = F.linear(gated[:, columns[0]], weight[:, columns[0]], linear.bias)
                if plan.rows is not None:
                    for span, rows in zip(columns[1:], plan.rows[1:], strict=True):
                        if isinstance(rows, slice) and in_place:
                            torch.addmm(out[rows], gated[rows, span], weight_t[span], out=out[rows])
                        elif isinstance(rows, slice):
                            out[rows] = torch.addmm(out[rows], gated[rows, span], weight_t[span])
                        else:
                            out.index_add_(0, rows, gated[:, span].index_select(0, rows) @ weight_t[span])
                    outputs.append(out)
                    continue
                for span in columns[1:]:
                    out = torch.addmm(out, gated[:, span], weight_t[span], out=out if in_place else None)
                outputs.append(out)
            else:  # row-major: one dense matmul on the gated input (the masked computation)
                outputs.append(linear(gated))
        return outputs

    def _project_out_host(self, hidden_states: torch.Tensor, plan: MoHDGatherHostPlan, linear) -> torch.Tensor:
        """Host-ids output side: (M, in) -> (M, N, s); each span of picked blocks is contiguous rows of the row-major
        weight, read in place once for all M tokens and kept for the tokens that picked each block; other blocks 0.
        With autograd and autocast off and no bias, each product is written straight into its span of the output.
        With several tokens, the blocks a token did not pick are zeroed by one mask over all spans at the end. Under
        autocast the products are its ops (as `nn.Linear`'s) and the output is in its dtype."""
        m = hidden_states.shape[0]
        weight, bias = linear.weight, linear.bias
        compute_dtype = autocast_dtype(hidden_states) or hidden_states.dtype
        out = hidden_states.new_zeros(m, self.hidden_size, dtype=compute_dtype)
        # `torch.mm(out=)` is not an autocast op: products written by copy where autocast would cast the operands
        direct = bias is None and not torch.is_grad_enabled() and hidden_states.dtype == weight.dtype == compute_dtype
        if plan.rows is not None:
            for (start, stop), tokens in zip(plan.spans, plan.rows, strict=True):
                rows = slice(start * self.block, stop * self.block)
                span_bias = None if bias is None else bias[rows]
                if isinstance(tokens, slice):
                    if direct:
                        torch.mm(hidden_states[tokens], weight[rows].t(), out=out[tokens, rows])
                    else:
                        out[tokens, rows] = F.linear(hidden_states[tokens], weight[rows], span_bias)
                else:
                    product = F.linear(hidden_states.index_select(0, tokens), weight[rows], span_bias)
                    out[:, rows].index_copy_(0, tokens, product)
            return out.view(m, self.num_sub_dims, self.block)
        for start, stop in plan.spans:
            rows = slice(start * self.block, stop * self.block)
            if direct:
                torch.mm(hidden_states, weight[rows].t(), out=out[:, rows])
            else:
                out[:, rows] = F.linear(hidden_states, weight[rows], None if bias is None else bias[rows])
        out = out.view(m, self.num_sub_dims, self.block)
        if plan.keep is not None:
            out.mul_(plan.keep[..., None])
        return out


MOHD_DISPATCH = {"masked": MoHDMaskedDispatch, "gather": MoHDGatherDispatch}

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
    DTensor". Here both dispatches run on the local shards instead (plain `nn.Linear` stand-ins holding
    `weight.to_local()`), with the collectives of those two styles done explicitly:

    - input side (colwise): no forward communication (the input is replicated, the output is this rank's slice of
      features, which attention reads as its local heads); backward sums the partial gradients of the input and of
      the gates (`MoHDAllReduceGradient`).
    - output side (rowwise): the dispatch's (M, N, s) partial blocks are summed over the ranks (`MoHDAllReduceSum`)
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

    def project_in(self, dispatch, hidden_states: torch.Tensor, plan, linears) -> list[torch.Tensor]:
        """(M, D) replicated -> one (M, out / P) local slice per linear."""
        if torch.is_grad_enabled():
            hidden_states = MoHDAllReduceGradient.apply(hidden_states, self.group)
            plan = plan._replace(gates=MoHDAllReduceGradient.apply(plan.gates, self.group))
        return dispatch.project_in(hidden_states, plan, [self.local_linear(linear) for linear in linears])

    def project_out(self, dispatch, hidden_states: torch.Tensor, plan, linear: nn.Linear) -> torch.Tensor:
        """(M, in / P) local slice -> (M, N, s) replicated blocks, the sum of the ranks' partial products."""
        partial = dispatch.project_out(hidden_states, plan, self.local_linear(linear, side="output"))
        return MoHDAllReduceSum.apply(partial, self.group)


class MoHDSubDimensions(nn.Module):
    """Routing, sparse projections, activation scaling and group fusion of one sparsified sublayer.

    `route` runs the router and prepares the dispatch; `project_in` applies the input gate (step 3) and
    `project_out` keeps the active output blocks, scales them by alpha = N / (N_s + k) (step 4, rebuttal Lemma 1)
    and fuses them (step 5). The execution strategy ("gather" or "masked", `MOHD_DISPATCH`) comes from
    `config.sparse_implementation` (switch it on a loaded model with `set_sparse_implementation`); `route` falls
    back to "masked" for a sublayer whose projections are not all plain `nn.Linear`, the one place that rule lives.
    """

    def __init__(self, config: MoHDConfig, layer_idx: int, router_name: str):
        super().__init__()
        # CODEPATH: num_routed_sub_dims_per_tok=0 (static sub-dimensions): no router, every token's N_s shared blocks.
        self.router = MoHDRouter(config, layer_idx, router_name) if config.num_routed_sub_dims_per_tok > 0 else None
        # CODEPATH: group_fusion="mix" (paper default) adds an N x N block mixer; "none" is the ablation.
        self.group_fusion = MoHDGroupFusion(config) if config.group_fusion == "mix" else nn.Identity()
        self.dispatch = MOHD_DISPATCH[config.sparse_implementation](config)
        self.masked = MoHDMaskedDispatch(config)  # for projections that are not plain nn.Linear
        self.activation_scale = (
            # CODEPATH: activation_scaling="inverse_active" (paper default) vs "none" (ablation, LLaMA equivalence).
            config.num_sub_dims / config.num_active_sub_dims if config.activation_scaling == "inverse_active" else 1.0
        )

    def route(self, hidden_states: torch.Tensor, projections, **kwargs):
        """(B, T, D) normed input -> dispatch plan for its B * T tokens, of the configured strategy, or of the
        masked one when a projection of the sublayer (`projections`: all its linears) is not a plain `nn.Linear`
        (a PEFT LoRA layer, a quantised linear computes something other than its `.weight`, which the gather
        strategy reads): exact either way. Without a router (k = 0) every token gets the masked plan of the shared
        blocks alone."""
        if self.router is None:
            tokens = hidden_states.shape[:-1].numel()
            no_routes = torch.empty(tokens, 0, dtype=torch.long, device=hidden_states.device)
            return self.masked.plan(no_routes, hidden_states.new_empty(no_routes.shape))
        _, weights, indices = self.router(hidden_states, **kwargs)
        dispatch = self.dispatch
        if any(type(linear) is not nn.Linear for linear in projections):
            dispatch = self.masked
        return dispatch.plan(indices.reshape(-1, indices.shape[-1]), weights.reshape(-1, weights.shape[-1]))

    def _dispatch(self, plan):
        return self.masked if isinstance(plan, MoHDMaskedPlan) else self.dispatch

    def project_in(self, hidden_states: torch.Tensor, plan, linears) -> list[torch.Tensor]:
        """(B, T, D) -> one (B, T, out) tensor per linear, reading only the active (gated) blocks; with
        tensor-parallel weights each rank's (B, T, out / P) slice (`MoHDTensorParallelProjections`)."""
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        tensor_parallel = MoHDTensorParallelProjections.of(linears, "input")
        if tensor_parallel is None:
            outputs = self._dispatch(plan).project_in(flat, plan, linears)
        else:
            outputs = tensor_parallel.project_in(self._dispatch(plan), flat, plan, linears)
        return [out.view(*hidden_states.shape[:-1], -1) for out in outputs]

    def project_out(self, hidden_states: torch.Tensor, plan, linear: nn.Linear) -> torch.Tensor:
        """(B, T, in) -> (B, T, D): active output blocks, scaled by alpha, then group-fused; with tensor-parallel
        weights the input is this rank's (B, T, in / P) slice and the blocks are summed over the ranks first."""
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        tensor_parallel = MoHDTensorParallelProjections.of([linear], "output")
        if tensor_parallel is None:
            blocks = self._dispatch(plan).project_out(flat, plan, linear)
        else:
            blocks = tensor_parallel.project_out(self._dispatch(plan), flat, plan, linear)
        if not isinstance(self.group_fusion, MoHDGroupFusion):
            return (blocks * self.activation_scale).view(*hidden_states.shape[:-1], -1)
        positions = None
        if (
            isinstance(plan, MoHDGatherPlan)
            and tensor_parallel is None
            and torch.is_grad_enabled()
            and MoHDGatherDispatch._fused(blocks, self.group_fusion)
        ):
            # the grouped path's blocks are zero outside the shared and the routed (token, block) pairs
            positions = plan.token_index * self.dispatch.num_sub_dims + self.dispatch.num_shared + plan.block_index
        mixed = self.group_fusion(blocks, positions, scale=self.activation_scale)
        return mixed.view(*hidden_states.shape[:-1], -1)


class MoHDAttention(Attention):
    """Attention whose Q/K/V read and whose o_proj writes only the token's active sub-dimensions."""

    def __init__(self, config: MoHDConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.sub_dims = MoHDSubDimensions(config, layer_idx, "attn")

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        projections = (self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        plan = self.sub_dims.route(hidden_states, projections, cache=cache, **kwargs)
        query, key, value = self.sub_dims.project_in(hidden_states, plan, (self.q_proj, self.k_proj, self.v_proj))
        attn_output, attn_weights = self.attend(
            query, key, value, position_embeddings, attention_mask, cache=cache, **kwargs
        )
        # freed before the output side, as LLaMA's temporaries are: (tokens, heads * head_dim) each
        del query, key, value
        return self.sub_dims.project_out(attn_output, plan, self.o_proj), attn_weights


class MoHDMLP(MLP):
    """SwiGLU feed-forward whose gate/up read and whose down_proj writes only the active sub-dimensions."""

    def __init__(self, config: MoHDConfig, layer_idx: int):
        super().__init__(config)
        self.sub_dims = MoHDSubDimensions(config, layer_idx, "mlp")

    def forward(self, hidden_states: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
        plan = self.sub_dims.route(
            hidden_states, (self.gate_proj, self.up_proj, self.down_proj), cache=cache, **kwargs
        )
        gate, up = self.sub_dims.project_in(hidden_states, plan, (self.gate_proj, self.up_proj))
        activated = self.activate(gate, up)
        # freed before the output side, as in LLaMA's one-expression MLP: two (tokens, intermediate) tensors that
        # would otherwise stay alive through down_proj and push the heap up, to be trimmed and faulted in again
        del gate, up
        return self.sub_dims.project_out(activated, plan, self.down_proj)


class MoHDDecoderLayer(DecoderLayer):
    """Pre-norm LLaMA block; each sublayer named in `config.sparse_modules` is a MoHD sublayer (with a router)."""

    def __init__(self, config: MoHDConfig, layer_idx: int):
        super().__init__()
        # CODEPATH: sublayers outside `sparse_modules` (or with every block shared) are plain LLaMA sublayers.
        routed = config.num_routed_sub_dims > 0
        sparse_attention = routed and "attention" in config.sparse_modules
        sparse_ffn = routed and "ffn" in config.sparse_modules
        self.self_attn = MoHDAttention(config, layer_idx) if sparse_attention else Attention(config, layer_idx)
        self.mlp = MoHDMLP(config, layer_idx) if sparse_ffn else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


@auto_docstring
class MoHDPreTrainedModel(PreTrainedModel):
    config: MoHDConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MoHDDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(MoHDRouter, index=0),
        "hidden_states": MoHDDecoderLayer,
        "attentions": Attention,
    }

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, then the decoding layout `to_weight_layout("block_major")`.

        Checkpoints on disk keep the standard row-major `nn.Linear` layout (`save_pretrained` writes contiguous
        copies); the layout is chosen here, at load, as a BLAS library prepacks weights.
        """
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading_info) with output_loading_info
        model.to_weight_layout("block_major")
        return loaded

    def post_init(self):
        super().post_init()
        self.to_weight_layout("block_major")

    def to_weight_layout(self, layout: str = "block_major"):
        """Stores the input-side projections (q/k/v, gate/up) of the gather-path sublayers in `layout`, in place,
        like `Module.to(memory_format=...)`: a storage format, not a hyperparameter (results do not depend on it).

        "block_major" (default): column-major, `weight.t()` contiguous, so each s-column sub-dimension block is one
        contiguous span and batch-1 decoding streams only the active blocks. "row_major": the plain `nn.Linear`
        layout. Values, shapes, parameters, `state_dict` and saved checkpoints are the same for both; results agree up
        to BLAS summation order. Masked-path sublayers and projections that are not plain `nn.Linear` are left alone.

        Raises:
            ValueError: `layout` is not one of "block_major", "row_major".
        """
        if layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"to_weight_layout: layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
        for module in self.modules():
            sub_dims = getattr(module, "sub_dims", None)
            if isinstance(sub_dims, MoHDSubDimensions) and isinstance(sub_dims.dispatch, MoHDGatherDispatch):
                for name in MoHDGatherDispatch.input_projections:
                    set_linear_layout_(getattr(module, name, None), layout)
        return self

    def set_sparse_implementation(self, implementation: str) -> None:  # trf-ignore: TRF033 (execution choice)
        """Switches every MoHD sublayer to the "gather" or "masked" strategy (`MOHD_DISPATCH`, docs/design.md
        section 3, "Execution paths") on a loaded model, as `set_experts_implementation` switches experts. It is an
        execution choice like `to_weight_layout`: `config.sparse_implementation` stays the default a save records
        (choose another at load with `from_pretrained(..., sparse_implementation=...)`). Both strategies compute the
        same function; "gather" also stores the input-side weights block-major.

        Raises:
            ValueError: `implementation` is not one of `MOHD_DISPATCH`.
        """
        if implementation not in MOHD_DISPATCH:
            raise ValueError(f"`implementation` must be one of {list(MOHD_DISPATCH)}, got {implementation!r}.")
        for module in self.modules():
            if isinstance(module, MoHDSubDimensions):
                small_batch_plan = getattr(module.dispatch, "small_batch_plan", None)
                module.dispatch = MOHD_DISPATCH[implementation](self.config)
                if small_batch_plan is not None and isinstance(module.dispatch, MoHDGatherDispatch):
                    module.dispatch.small_batch_plan = small_batch_plan
        if implementation == "gather":
            self.to_weight_layout("block_major")

    def set_small_batch_plan(self, plan: str = "auto") -> None:  # trf-ignore: TRF033 (execution choice)
        """How the gather path multiplies the picked blocks of 2 to `host_tokens` tokens on an eager CPU run without
        autograd (batched decoding, draft verification; `MoHDGatherHostPlan`): an execution choice like
        `to_weight_layout`, with results equal up to BLAS summation order, and not saved.

        "union": all tokens by every picked block, each block read once (the fastest where BLAS reads a block in
        the same time for 1 or 8 rows). "per_block": each block by the tokens that picked it only, the same bytes and
        fewer FLOPs in more calls (faster where few-row products are compute-bound). "auto" (default): "per_block"
        where a one-time timing finds them compute-bound (`small_gemms_compute_bound`), else "union".

        Raises:
            ValueError: `plan` is not one of `SMALL_BATCH_PLANS`.
        """
        if plan not in SMALL_BATCH_PLANS:
            raise ValueError(f"set_small_batch_plan: plan must be one of {SMALL_BATCH_PLANS}, got {plan!r}")
        for module in self.modules():
            if isinstance(module, MoHDSubDimensions) and isinstance(module.dispatch, MoHDGatherDispatch):
                module.dispatch.small_batch_plan = plan

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, MoHDRouter):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, MoHDGroupFusion):
            init.eye_(module.weight)


@auto_docstring
class MoHDModel(RoutedDecoderMixin, MoHDPreTrainedModel):
    def __init__(self, config: MoHDConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [MoHDDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


@auto_docstring
class MoHDForCausalLM(RoutedCausalLMMixin, MoHDPreTrainedModel, GenerationMixin):
    def __init__(self, config: MoHDConfig):
        super().__init__(config)
        self.model = MoHDModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def load_balancing_loss(self, router_logits, attention_mask=None, routing_replay=None) -> torch.Tensor | None:
        """Sub-dimension load-balance loss (docs/design.md section 3, step 7): Switch form per router, mean over
        routers.

        Args:
            router_logits: one (B*T, N_r) tensor per router ("attn" then "mlp" of each layer), as recorded.
            attention_mask: (B, S), 1 for the tokens that count.
            routing_replay: the forward's `routing_replay`, if any: f_j then counts the replayed routes (the ones the
                forward used), not the top-k of the logits.
        """
        routes = None
        if routing_replay is not None and router_logits:
            # the routers in call order, the order of `router_logits`: each layer's attention, then its FFN
            routers = [module for module in self.modules() if isinstance(module, MoHDRouter)]
            routes = replayed_routes(routers, routing_replay, attention_mask)
        return load_balancing_loss(router_logits, self.config.num_routed_sub_dims_per_tok, attention_mask, routes)


__all__ = ["MoHDForCausalLM", "MoHDModel", "MoHDPreTrainedModel"]
