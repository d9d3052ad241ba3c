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
"""MoHD's execution strategies and their registry: which plan computes a sublayer's tokens.

The model (`modeling_mohd.py`) routes each token to its blocks and calls one strategy, chosen by name from
`MoHDSparseInterface` (as transformers' `ExpertsInterface` holds the experts kernels):

- "masked" (`MoHDMaskedStrategy`), the reference: dense products on the gated input, a binary mask on the output.
- "gather" (`MoHDGatherStrategy`), the default: inactive blocks are never read. It plans by the number of tokens M:
  per-slot grouped products for many tokens (`MoHDGroupedPlan`: prefill, training), and a direct read of each
  token's blocks for few tokens (decoding, draft verification), by host block ids merged into spans of consecutive
  blocks on an eager CPU run (`MoHDSpansPlan`) or by index tensors under `torch.compile` and on accelerators
  (`MoHDIndexedPlan`). One token without autograd on an eager CPU run (decoding at batch 1) takes `MoHDTokenPlan`,
  routed and computed by the native kernels where nothing can tell them apart (`one_token_path`, the one list of
  the reasons a faster form is refused).
- "sorted" (`MoHDSortedStrategy`): the gather strategy's plans for few tokens, and for many tokens `MoHDSortedPlan`:
  the (token, block) pairs of all routing slots sorted by block once, one grouped product per side, no atomic
  accumulation forward or backward (the accelerators' form).

The sublayer asks its strategy once per step (`MoHDStrategy.route`); a strategy's `plan(indices, weights)` returns a
plan (`mohd_plans`), and each plan type computes its own projections: adding a strategy means registering a
`MoHDStrategy` subclass whose plans do the same.

This file is copied next to the weights by `save_pretrained` (remote code): it imports only `torch`, `transformers`
and same-folder siblings.
"""

import functools
import os
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.utils.generic import GeneralInterface

from .mohd_geometry import MoHDSubDimGeometry, block_token_spans, contiguous_spans
from .mohd_layout import BLOCK_MAJOR_PROJECTIONS, FUSED_PROJECTIONS, fused_block_major_weight
from .mohd_plans import (
    MoHDGroupedPlan,
    MoHDIndexedPlan,
    MoHDMaskedPlan,
    MoHDPlan,
    MoHDSortedPlan,
    MoHDSpansPlan,
    MoHDTokenPlan,
    autocast_dtype,
)
from .native_gather import DTYPES as NATIVE_DTYPES
from .native_gather import native_gather


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


# The plan of each mode that the gather strategy of a model built from its config takes on an accelerator: the
# strategy measured fastest there in that mode ("masked": dense products on the gated input, a few large kernels;
# "sorted": `MoHDSortedPlan`; "gather": the gather strategy's own plans). Modes: "few_tokens" (decoding, up to
# `few_tokens` tokens a step) and "many_tokens" (prefill, training). A device type not listed (the CPU) takes the
# gather strategy's own plans; `MoHDPreTrainedModel.set_sparse_implementation` overrides the table for a model.
DEVICE_DEFAULT_PLANS = {"cuda": {"few_tokens": "masked", "many_tokens": "masked"}}

# Eager CPU forwards without autograd, by tokens M (`MoHDGatherStrategy.plan`; measured by `bench.bench_mohd_tokens`):
# past the few-token plans and up to `CPU_DENSE_TOKENS` tokens (batched decoding) M tokens pick nearly every routed
# block between them, so no plan reads fewer weight bytes than the dense one and the masked plan's few large products
# are fastest; up to `CPU_SORTED_TOKENS` (short prefills) the sorted plan's one grouped product per side beats the
# per-slot grouped plan, whose k * N_r products win only on more tokens. 0 turns both regimes off.
# Measured in float32; other dtypes (bf16 sums in other places on each plan) keep the grouped plan until measured.
CPU_DENSE_TOKENS = 32
CPU_SORTED_TOKENS = 256
CPU_PLAN_DTYPES = (torch.float32, torch.float64)

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


class MoHDTokenPath(NamedTuple):
    """How the gather strategy computes one sublayer's tokens (`one_token_path`): `form` "general" (the router
    module, then `MoHDGatherStrategy.plan`), "torch" (the router module, then `MoHDTokenPlan.of_route`) or "native"
    (`route_natively`, then `MoHDTokenPlan` on the native kernels); `refusal`, why the next faster form
    does not apply ("" for "native"); `fused`, the input projections' shared block-major storage or None; `kernels`,
    the native library where the form is "native"."""

    form: str
    refusal: str
    fused: torch.Tensor | None = None
    kernels: object = None


def one_token_path(sublayer, hidden_states: torch.Tensor, projections, routing_replay=None) -> MoHDTokenPath:
    """The form of a gather-strategy sublayer's step for its (B, T, D) normed input `hidden_states`, and the one list
    of the reasons a faster form is refused, in the order they are checked.

    One token without autograd on an eager CPU run is decoding at batch 1: it takes `MoHDTokenPlan`, natively where
    nothing can tell the native kernels from the torch path (the same router choice, the same sums in another order,
    the same routing record), else in torch. `sublayer` is the `MoHDSubDimensions` (its router, sides, compensation,
    `native_token_plan_enabled`); `projections` all its plain `nn.Linear` modules, the output one last;
    `routing_replay` the forward's (routes to replay, or None).
    """
    if hidden_states.shape[:-1].numel() != 1:
        return MoHDTokenPath("general", "more than one token")
    if torch.is_grad_enabled():
        return MoHDTokenPath("general", "autograd")
    if torch.compiler.is_compiling():
        return MoHDTokenPath("general", "torch.compile (block ids are not read to the host)")
    if hidden_states.device.type != "cpu":
        return MoHDTokenPath("general", "a device other than the CPU (reading block ids would synchronise)")
    router, dtype = sublayer.router, hidden_states.dtype
    *inputs, output = projections
    fused = fused_block_major_weight(inputs)
    reasons = (
        (not sublayer.native_token_plan_enabled, "switched off (`set_native_token_plan(False)`)"),
        (dtype not in NATIVE_DTYPES, "a dtype the native kernels do not take"),
        (autocast_dtype(hidden_states) not in (None, dtype), "autocast to another dtype"),
        (routing_replay is not None, "routing replay (the router module replays the record)"),
        (not (sublayer.sparse_input and sublayer.sparse_output), "one sparse side only (`sparse_sides`)"),
        (sublayer.output_compensation is not None, "dropped-block compensation"),
        (router.weight.dtype != dtype, "a router weight in another dtype"),
        (any(linear.bias is not None for linear in projections), "projections with a bias"),
        (router.observed(), "something observes the router (hooks, recorded router logits)"),
        (fused is None or fused.dtype != dtype, "input projections not in one block-major storage"),
        (output.weight.dtype != dtype or not output.weight.is_contiguous(), "an output weight not row-major"),
    )
    for refused, reason in reasons:
        if refused:
            return MoHDTokenPath("torch", reason, fused)
    kernels = native_gather()
    if kernels is None:
        return MoHDTokenPath("torch", "native kernels not built (`native_gather`)", fused)
    return MoHDTokenPath("native", "", fused, kernels)


def route_natively(router, kernels, hidden_states: torch.Tensor, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routes of one token by the native kernels (`native_gather`'s `mohd_route`), without calling the router
    module `router` (a `MoHDRouter`): (1, 1, D) normed input -> (1, k) absolute ids and (1, k) gates, the choice of its
    forward (the k largest softmax probabilities in fp32, or float64, ties to the lower index; gates by
    `routed_gate`), recorded as its forward records them (`TopKRouter.record`). Only where nothing observes the
    module (`one_token_path`)."""
    ids, gates = kernels.mohd_route(
        hidden_states.reshape(1, -1).contiguous(),  # a no-op on the normed input, which is contiguous
        router.weight.contiguous(),
        router.top_k,
        router.index_offset,
        router.NATIVE_GATE_MODES[router.routed_gate],
    )
    router.record(ids.view(1, 1, -1), gates.view(1, 1, -1), cache)
    return ids, gates


class MoHDStrategy:
    """Base of the MoHD execution strategies (`MoHDSparseInterface`): built from the config (`cls(config)`), it turns
    a sublayer's routes into a plan (`plan`, which a strategy defines) and gives itself for another k (`with_top_k`).
    `route` runs the sublayer's router module and plans its routes; a strategy with a faster way to route some steps
    (the gather strategy's one-token path) overrides it. Only plain `nn.Linear` projections reach a strategy other
    than the masked one (`MoHDSubDimensions.route`)."""

    # the projections whose weights this strategy wants stored block-major (`set_linear_layout_`): none
    block_major_projections: tuple[str, ...] = ()
    # the groups of those that it wants in one block-major storage each (`fuse_block_major_`): none
    fused_projections: tuple[tuple[str, ...], ...] = ()

    def __init__(self, config, geometry: MoHDSubDimGeometry | None = None):
        self.geometry = geometry or MoHDSubDimGeometry.of(config)

    def with_top_k(self, top_k: int) -> "MoHDStrategy":
        """The same strategy for plans of `top_k` routed blocks per token."""
        return type(self)(None, self.geometry._replace(top_k=top_k))

    def plan(self, indices: torch.Tensor, weights: torch.Tensor) -> MoHDPlan:
        """(M, k) absolute block ids and their gates -> the plan of M tokens."""
        raise NotImplementedError(f"{type(self).__name__} must define `plan(indices, weights)`.")

    def route(self, sublayer, hidden_states: torch.Tensor, projections, **kwargs) -> MoHDPlan:
        """(B, T, D) normed input of `sublayer` (a `MoHDSubDimensions`) -> the plan of its B * T tokens: the router
        module's routes (`kwargs`: the forward's, for the router), planned by `plan`."""
        indices, weights = self.routes(sublayer, hidden_states, **kwargs)
        return self.compensated(sublayer, self.plan(indices, weights), indices)

    @staticmethod
    def routes(sublayer, hidden_states: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """The router module's (M, k) absolute block ids and gates for the (B, T, D) input."""
        _, weights, indices = sublayer.router(hidden_states, **kwargs)
        return indices.reshape(-1, indices.shape[-1]), weights.reshape(-1, weights.shape[-1])

    @staticmethod
    def compensated(sublayer, plan: MoHDPlan, indices: torch.Tensor) -> MoHDPlan:
        """`plan` with its (M, N) `inactive` blocks set (1.0 where a token neither reads nor writes a block) where
        `sublayer` compensates dropped blocks, which reads them."""
        if sublayer.output_compensation is not None:
            g = plan.geometry
            inactive = torch.ones(indices.shape[0], g.num_sub_dims, dtype=plan.gates.dtype, device=indices.device)
            inactive[:, : g.num_shared] = 0
            plan.inactive = inactive.scatter_(1, indices, 0.0)
        return plan


class MoHDMaskedStrategy(MoHDStrategy):
    """Reference strategy (`sparse_implementation="masked"`): `MoHDMaskedPlan` for every token count. Any projection
    module works with it (it calls the modules), which is why the gather strategy's sublayers fall back to it for
    projections that are not plain `nn.Linear`."""

    def plan(self, indices: torch.Tensor, weights: torch.Tensor) -> MoHDMaskedPlan:
        """(M, k) absolute block ids and their gates -> (M, N) gates and mask."""
        return masked_plan(self.geometry, indices, weights)


def masked_plan(geometry: MoHDSubDimGeometry, indices: torch.Tensor, weights: torch.Tensor) -> MoHDMaskedPlan:
    """The masked plan of the router's (M, k) absolute block ids and their gates: (M, N) input gates (1 on the shared
    blocks, the gate on the picked ones, 0 elsewhere) and the (M, N) binary mask of the active blocks."""
    g, m = geometry, indices.shape[0]
    gates = torch.zeros(m, g.num_sub_dims, dtype=weights.dtype, device=weights.device)
    gates[:, : g.num_shared] = 1
    mask = gates.clone()
    gates = gates.scatter(1, indices, weights)
    mask = mask.scatter(1, indices, torch.ones_like(weights))
    return MoHDMaskedPlan(g, gates, mask)


class MoHDGatherStrategy(MoHDStrategy):
    """Fast strategy (`sparse_implementation="gather"`): inactive blocks are never read nor computed.

    Plans by the number of tokens M (`plan`): up to `host_tokens` tokens on an eager CPU run, `MoHDSpansPlan` (the
    picked blocks' weight spans read once for all tokens: decoding, draft verification, the memory-bound case, as in
    Deja Vu and PowerInfer); up to `few_tokens` tokens elsewhere, `MoHDIndexedPlan`; more tokens, `MoHDGroupedPlan`,
    except on an eager float32 (or float64) CPU forward without autograd: up to `cpu_dense_tokens` tokens the masked
    plan (batched decoding, where the tokens' union is every block), up to `cpu_sorted_tokens` `MoHDSortedPlan` (short
    prefills).
    One token without autograd on an eager CPU run (decoding at batch 1) takes `MoHDTokenPlan` instead, natively
    where the native kernels apply (`route`, `one_token_path`).

    Only plain `nn.Linear` projections come here: `MoHDSubDimensions.route` sends a sublayer with any other
    projection (a PEFT LoRA layer, a quantised linear: it computes something other than its `.weight`) to the
    masked strategy.

    Weight layout: the input side (q/k/v, gate/up) reads column blocks; in the row-major `nn.Linear` layout a block
    is s contiguous floats per row, which a CPU streams at a fraction of the contiguous bandwidth. MoHD models
    therefore decode with those weights column-major (`MoHDPreTrainedModel.to_weight_layout("column_major")`, which
    `generate` applies before decoding: same values and shapes, `weight.t()` contiguous), which makes every block
    contiguous; after `__init__` and `from_pretrained` they are plain contiguous tensors. The plans follow the layout
    each weight actually has, so any layout is exact, only slower or faster: row-major input weights take the dense
    product in the few-token plans.

    On an accelerator listed in `DEVICE_DEFAULT_PLANS`, a strategy built from the config (`device_defaults`) takes
    that table's plan of the mode instead: the device's measured-fastest strategy becomes its default without being
    saved in the config, as this strategy is the CPU's.

    Attributes:
        device_defaults: whether `DEVICE_DEFAULT_PLANS` applies (True when built from the config; False once a user
            chose a strategy by name, `set_sparse_implementation`).
        few_tokens: most tokens of an index-tensor plan, N_r // k (while the blocks read are fewer than the routed
            blocks, reading each token's k blocks beats sorting: the grouped path would run mostly empty groups).
        host_tokens: most tokens of a spans plan, max(few_tokens, 8) (each picked block is read once for all tokens,
            so the direct read stays ahead of the grouped path over the small batches of decoding).
        small_batch_plan: "union" or "per_block", the form of a spans plan of several tokens without autograd
            (`MoHDSpansPlan`; `default_small_batch_plan`).
        cpu_dense_tokens, cpu_sorted_tokens: on an eager CPU forward without autograd, the most tokens of the masked
            plan (past the few-token plans) and of the sorted plan (`CPU_DENSE_TOKENS`, `CPU_SORTED_TOKENS`; 0: the
            grouped plan for every M past the few-token plans).
    """

    block_major_projections = BLOCK_MAJOR_PROJECTIONS
    fused_projections = FUSED_PROJECTIONS

    def __init__(self, config, geometry: MoHDSubDimGeometry | None = None):
        self.geometry = geometry or MoHDSubDimGeometry.of(config)
        self.few_tokens = max(1, self.geometry.num_routed // max(self.geometry.top_k, 1))
        self.host_tokens = max(self.few_tokens, 8)
        self.small_batch_plan = default_small_batch_plan()
        self.device_defaults = True
        self.cpu_dense_tokens, self.cpu_sorted_tokens = CPU_DENSE_TOKENS, CPU_SORTED_TOKENS

    def with_top_k(self, top_k: int) -> "MoHDGatherStrategy":
        """The same strategy (small-batch plan, device defaults) for plans of `top_k` routed blocks per token."""
        strategy = type(self)(None, self.geometry._replace(top_k=top_k))
        strategy.small_batch_plan, strategy.device_defaults = self.small_batch_plan, self.device_defaults
        strategy.cpu_dense_tokens, strategy.cpu_sorted_tokens = self.cpu_dense_tokens, self.cpu_sorted_tokens
        return strategy

    def route(self, sublayer, hidden_states: torch.Tensor, projections, **kwargs) -> MoHDPlan:
        """(B, T, D) normed input of `sublayer` -> the plan of its tokens, in the form `one_token_path` gives: one
        decoded token routed natively, or the router module's routes as `MoHDTokenPlan` (one token) or `plan`."""
        path = one_token_path(sublayer, hidden_states, projections, kwargs.get("routing_replay"))
        if path.form == "native":
            ids, gates = route_natively(sublayer.router, path.kernels, hidden_states, kwargs.get("cache"))
            return MoHDTokenPlan(self.geometry, gates, ids=ids, fused=path.fused, kernels=path.kernels)
        indices, weights = self.routes(sublayer, hidden_states, **kwargs)
        if path.form == "torch":
            plan = MoHDTokenPlan.of_route(self.geometry, indices, weights, path.fused)
        else:
            plan = self.plan(indices, weights)
        return self.compensated(sublayer, plan, indices)

    def plan(self, indices: torch.Tensor, weights: torch.Tensor) -> MoHDPlan:
        """(M, k) absolute block ids and their gates -> the plan for M tokens (see the class docstring)."""
        g, m = self.geometry, indices.shape[0]
        device_plans = DEVICE_DEFAULT_PLANS.get(indices.device.type) if self.device_defaults else None
        if device_plans is not None:
            form = device_plans["few_tokens" if m <= self.few_tokens else "many_tokens"]
            if form == "masked":
                return masked_plan(g, indices, weights)
            if form == "sorted":
                return MoHDSortedPlan.of_routes(g, indices, weights)
        if m <= self.host_tokens and indices.device.type == "cpu" and not torch.compiler.is_compiling():
            spans = contiguous_spans(g.num_shared, indices.view(-1).tolist())
            shared = F.pad(weights.new_ones(m, g.num_shared), (0, g.num_routed))  # 1 on the shared blocks
            if self.small_batch_plan == "per_block" and m > 1 and not torch.is_grad_enabled():
                spans, rows = block_token_spans(g.num_shared, indices.tolist())
                return MoHDSpansPlan(g, shared.scatter(1, indices, weights), None, spans, rows)
            keep = None if m == 1 else shared.scatter(1, indices, 1.0)
            return MoHDSpansPlan(g, shared.scatter(1, indices, weights), keep, spans)
        cpu_inference = (  # the CPU plans by tokens (0 `cpu_dense_tokens`: off)
            self.cpu_dense_tokens > 0
            and indices.device.type == "cpu"
            and weights.dtype in CPU_PLAN_DTYPES
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        )
        if cpu_inference and max(self.host_tokens, self.few_tokens) < m <= self.cpu_dense_tokens:
            return masked_plan(g, indices, weights)  # batched decoding: the union is every block
        if cpu_inference and self.cpu_dense_tokens < m <= self.cpu_sorted_tokens:
            return MoHDSortedPlan.of_routes(g, indices, weights)  # short prefills
        if m <= self.few_tokens:
            width = g.top_k * g.block
            columns = (indices[..., None] * g.block + torch.arange(g.block, device=indices.device)).view(m, -1)
            gates = weights[..., None].expand(*weights.shape, g.block).reshape(m, width)
            token_starts = torch.arange(0, m * width, width, device=indices.device)
            return MoHDIndexedPlan(g, gates, indices, columns, token_starts)
        return self.many_token_plan(indices, weights)

    def many_token_plan(self, indices: torch.Tensor, weights: torch.Tensor) -> MoHDPlan:
        """(M, k) absolute block ids and their gates of more tokens than the few-token plans take -> the per-slot
        grouped plan (`MoHDGroupedPlan`)."""
        g = self.geometry
        slots = (indices - g.num_shared).t()
        order = torch.argsort(slots, dim=1, stable=True)
        slot_offset = torch.arange(g.top_k, device=indices.device)[:, None] * g.num_routed
        # per (slot, block) token counts; `scatter_add_` into a fixed-length vector rather than `bincount`, whose
        # output length depends on the data and so breaks a `torch.compile` graph at every sublayer
        keys = (slots + slot_offset).reshape(-1)
        counts = keys.new_zeros(g.top_k * g.num_routed).scatter_add_(0, keys, torch.ones_like(keys))
        offsets = torch.cumsum(counts.view(g.top_k, g.num_routed), dim=1).to(torch.int32)
        return MoHDGroupedPlan(g, weights.t().gather(1, order)[..., None], order, slots.gather(1, order), offsets)


class MoHDSortedStrategy(MoHDGatherStrategy):
    """Accelerator strategy (`sparse_implementation="sorted"`): the gather strategy's plans for few tokens, and for
    many tokens (prefill, training, batched decoding) `MoHDSortedPlan`: the (token, block) pairs of all routing slots
    sorted by block once, one grouped product per side and projection (one for all the input projections where
    they share a block-major storage), and no atomic accumulation forward or backward. The gather strategy's
    grouped plan instead loops over the k routing slots and scatters each slot's products back with `index_add_`,
    an atomic kernel on accelerators. Chosen by name, it runs its own plans on every device (`DEVICE_DEFAULT_PLANS`
    is the gather strategy's)."""

    def __init__(self, config, geometry: MoHDSubDimGeometry | None = None):
        super().__init__(config, geometry)
        self.device_defaults = False

    def many_token_plan(self, indices: torch.Tensor, weights: torch.Tensor) -> MoHDSortedPlan:
        """(M, k) absolute block ids and their gates -> the sorted plan of the M * k pairs."""
        return MoHDSortedPlan.of_routes(self.geometry, indices, weights)


class MoHDSparseInterface(GeneralInterface):
    """The MoHD execution strategies by name, as transformers' `ExpertsInterface` holds experts kernels: a subclass
    of `MoHDStrategy` built from the config (`strategy = cls(config)`) whose `plan(indices, weights)` returns a
    `MoHDPlan` and whose `with_top_k(k)` gives the strategy for another number of routed blocks per token.
    `MoHDSparseInterface.register(name, cls)` adds one for every model built afterwards; `config.sparse_implementation`
    (saved with the model) or `MoHDPreTrainedModel.set_sparse_implementation` selects one by name."""

    _global_mapping = {"masked": MoHDMaskedStrategy, "gather": MoHDGatherStrategy, "sorted": MoHDSortedStrategy}


ALL_SPARSE_IMPLEMENTATIONS = MoHDSparseInterface()


def sparse_strategy(name: str, config) -> MoHDStrategy:
    """The strategy registered as `name` in `MoHDSparseInterface`, built from `config` (a `MoHDConfig`).

    Raises:
        ValueError: no strategy is registered as `name` (the message names `sparse_implementation` and the registered
            names).
        TypeError: the registered class is not a subclass of `MoHDStrategy`.
    """
    if name not in ALL_SPARSE_IMPLEMENTATIONS:
        raise ValueError(
            f"`sparse_implementation` must be one of the strategies registered in MoHDSparseInterface "
            f"{list(ALL_SPARSE_IMPLEMENTATIONS)}, got {name!r}; register another with "
            f"`MoHDSparseInterface.register(name, cls)` before building the model."
        )
    cls = ALL_SPARSE_IMPLEMENTATIONS[name]
    if not (isinstance(cls, type) and issubclass(cls, MoHDStrategy)):
        raise TypeError(f"MoHDSparseInterface[{name!r}] must be a subclass of MoHDStrategy, got {cls!r}.")
    return cls(config)
