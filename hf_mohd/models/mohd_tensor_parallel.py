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
"""MoHD's sparse projections on tensor-parallel weights (`from_pretrained(tp_plan="auto")`).

transformers shards Llama's projections column-wise (q/k/v, gate/up) and row-wise (o_proj, down_proj) and applies
those styles by replacing the `nn.Linear` forwards; MoHD's plans read `linear.weight` instead, so this file runs the
plans on each rank's local shard and does the two styles' collectives itself (`MoHDTensorParallelProjections`).

This file is copied next to the weights by `save_pretrained` (remote code): it imports only `torch`, `transformers`
and same-folder siblings.
"""

import dataclasses

import torch
from torch import nn


if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
else:  # builds without torch.distributed have no sharded weights
    DTensor = None


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

    def project_in(self, hidden_states: torch.Tensor, plan, linears) -> list[torch.Tensor]:
        """(M, D) replicated -> one (M, out / P) local slice per linear."""
        if torch.is_grad_enabled():
            hidden_states = MoHDAllReduceGradient.apply(hidden_states, self.group)
            plan = dataclasses.replace(plan, gates=MoHDAllReduceGradient.apply(plan.gates, self.group))
        return plan.project_in(hidden_states, [self.local_linear(linear) for linear in linears])

    def project_out(self, hidden_states: torch.Tensor, plan, linear: nn.Linear) -> torch.Tensor:
        """(M, in / P) local slice -> (M, N, s) replicated blocks, the sum of the ranks' partial products."""
        partial = plan.project_out(hidden_states, self.local_linear(linear, side="output"))
        return MoHDAllReduceSum.apply(partial, self.group)
