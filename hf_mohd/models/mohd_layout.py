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
"""How MoHD's projection weights are stored for the gather strategy: block-major layout and fused storages.

An input-side sub-dimension block (s columns of a (out, in) `nn.Linear` weight) is s strided floats per row in the
row-major layout; stored column-major ("column_major", `set_linear_layout_`) it is s contiguous rows of `weight.T`,
which a decoding step streams at full bandwidth. A sublayer's input projections (q/k/v, gate/up) can also share one
(in, sum of out) storage (`fuse_block_major_`), so that one product per span of blocks computes all of them. The layout
is read from each tensor's strides, never from a flag: any layout computes the same values.

This file is copied next to the weights by `save_pretrained` (remote code): it imports only `torch`, `transformers`
and same-folder siblings.
"""

import torch
from torch import nn

from .mohd_tensor_parallel import DTensor


# the input projections the gather strategy reads by column blocks (`set_linear_layout_`), and the groups of them
# that share one block-major storage (`fuse_block_major_`): q/k/v of attention, gate/up of the MLP
BLOCK_MAJOR_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def is_block_major(weight: torch.Tensor) -> bool:
    """Whether a (out, in) weight holds the "column_major" layout of `set_linear_layout_` (column-major, stride
    (1, out)), in which each input-side block of s columns is s contiguous rows of `weight.T`.

    The layout is a property of the tensor, read where a path chooses how to read the weight, not a flag kept beside
    it: a parameter replaced by another layout (FSDP2's unsharded parameters, `load_state_dict(assign=True)`) brings
    its own, and both readings compute the same values, so a layout can cost speed, never exactness.
    """
    return weight.stride(0) == 1


def set_linear_layout_(linear: nn.Module, layout: str) -> None:
    """Stores a plain `nn.Linear` weight (out, in) column-major ("column_major") or row-major, in place.

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
    if layout == "column_major" and not is_block_major(weight):
        weight.data = weight.data.t().contiguous().t()
    elif layout == "row_major" and not weight.is_contiguous():
        weight.data = weight.data.contiguous()


def split_outputs(out: torch.Tensor, linears) -> list[torch.Tensor]:
    """(M, sum of out) product of fused linears -> one (M, out) view per linear, in order."""
    return list(out.split([linear.weight.shape[0] for linear in linears], dim=1))


def fused_projection_groups(module: nn.Module, groups=None) -> list[list[nn.Module]]:
    """The linears of `module` (a MoHD sublayer) for each group of names in `groups` (default: `FUSED_PROJECTIONS`, the gather
    strategy's) that it has entirely: [q, k, v] for attention, [gate, up] for the MLP."""
    names_groups = FUSED_PROJECTIONS if groups is None else groups
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
    one token on the host (`MoHDTokenPlan`) and for few tokens by index tensors (`MoHDIndexedPlan`).
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
    if layout == "column_major" and not is_block_major(local):
        local, stride = local.t().contiguous().t(), (1, weight.shape[0])
    elif layout == "row_major" and not local.is_contiguous():
        local, stride = local.contiguous(), (weight.shape[1], 1)
    else:
        return
    sharded = DTensor.from_local(
        local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape, stride=stride
    )
    torch.utils.swap_tensors(weight, nn.Parameter(sharded, requires_grad=weight.requires_grad))
