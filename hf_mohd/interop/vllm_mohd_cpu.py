"""MoHD's sparse sublayers on vLLM's CPU matrix products: prepacked oneDNN weights, planned by tokens at run time.

vLLM's CPU build computes its own linears with prepacked oneDNN products (`vllm._custom_ops.create_onednn_mm`: the
weight reordered once into oneDNN's blocked layout), not with torch's `addmm`, which MoHD's strategies call on the
block-major `nn.Linear` weights; on CPUs where torch's BLAS is the slower of the two for these shapes (bench/README.md
has the measurements) that alone made a sparse sublayer slower than the dense one it replaces. Here each sparse
sublayer's weights are prepacked instead, and vLLM's one compiled graph calls two opaque operators per sublayer
(`torch.ops.hf_mohd_vllm.mohd_onednn_in`, `mohd_onednn_out`) that choose the plan from the number of tokens M of the
step when they run (a compiled graph would keep the plan of the M it was traced with):

- one token, or two on the input side (decoding one or two requests): the shared blocks and each token's k picked blocks, one product
  per block, so that only the active blocks are read (arXiv 2412.05644, section 3, steps 3-4);
- `DENSE_TOKENS` (batched decoding, where the tokens' union covers nearly every routed block and no plan reads fewer
  weight bytes than the dense one): one product of the whole weight on the gated input (input side), one masked to
  the active blocks (output side), the masked strategy's computation;
- more tokens (prefill; past 128 on the output side): the shared blocks as one product and the (token, block) pairs of the routed blocks sorted
  by block, one product per block over the tokens that picked it (FLOPs of the active blocks only).

The gates and the output mask are computed in the compiled graph, the products in the operators. Every plan computes
the masked strategy's sums, in another order. The prepacked copies replace the `nn.Linear` weights (freed after
packing, as vLLM frees its own linears' weights): per sublayer the whole weight and its shared and per-block parts,
twice the sublayer's weight bytes.
"""

import torch
from torch import nn
from vllm import _custom_ops as ops
from vllm.logger import init_logger


logger = init_logger(f"vllm.plugins.{__name__}")

# side -> (first, last) token counts M of a step that take the dense plan on the prepacked whole weight; fewer take
# the per-token plan, more the sorted one. From timings of the three forms at the bench shape (bench/README.md): the
# output side's per-block products are narrower (s columns), so its dense range is wider.
DENSE_TOKENS = {"in": (3, 32), "out": (2, 128)}
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN's primitive cache per prepacked weight (vLLM's own linears use 32): one primitive per distinct M
PRIMITIVE_CACHE = 32


def plan_of(tokens: int, side: str) -> str:
    """The plan of a step of `tokens` tokens on `side` ("in" or "out"): "per_token", "dense" or "sorted"
    (`DENSE_TOKENS`)."""
    first, last = DENSE_TOKENS[side]
    return "per_token" if tokens < first else "dense" if tokens <= last else "sorted"


def onednn_mm(out: torch.Tensor, x: torch.Tensor, handler: torch.Tensor) -> torch.Tensor:
    """out (M, n) = x (M, K) @ the prepacked (K, n) weight of `handler` (vLLM's `_C.onednn_mm`; `out` contiguous,
    `x` with unit column stride)."""
    torch.ops._C.onednn_mm(out, x, None, handler)
    return out


def sorted_pairs(ids: torch.Tensor, num_shared: int) -> tuple[list[tuple[int, int, int]], torch.Tensor, torch.Tensor]:
    """(M, k) absolute block ids -> the (token, block) pairs sorted by block (stable): the runs of each routed block
    as (routed block id, start, stop) into the pairs, the pairs' (M * k,) tokens and their absolute block ids."""
    blocks, order = ids.reshape(-1).sort(stable=True)
    runs, start = [], 0
    for block_id, count in enumerate(torch.bincount(blocks - num_shared).tolist()):
        if count:
            runs.append((block_id, start, start + count))
            start += count
    return runs, order // ids.shape[1], blocks


def project_in(
    gated: torch.Tensor, ids: torch.Tensor, handlers: torch.Tensor, num_shared: int, block: int, width: int
):
    """The input side of a sparse sublayer: gated (M, D) the gated input g ⊙ x (1 on the shared blocks, the gates
    on the picked ones, 0 elsewhere), ids (M, k) absolute block ids -> (M, width) = (g ⊙ x) W^T for the fused input
    weight W (width, D). `handlers` (2 + N_r,) int64: the prepacked whole W^T, its shared rows, each routed block's
    rows (`pack_sublayer`). Registered as `torch.ops.hf_mohd_vllm.mohd_onednn_in`."""
    m = gated.shape[0]
    out = gated.new_empty(m, width)
    plan = plan_of(m, "in")
    if plan == "dense":
        return onednn_mm(out, gated, handlers[0])
    shared = num_shared * block
    onednn_mm(out, gated[:, :shared], handlers[1])
    if plan == "per_token":  # each token's picked blocks, one product each
        part = gated.new_empty(1, width)
        for token, picked in enumerate(ids.tolist()):
            for block_id in picked:
                columns = slice(block_id * block, (block_id + 1) * block)
                out[token : token + 1] += onednn_mm(
                    part, gated[token : token + 1, columns], handlers[2 + block_id - num_shared]
                )
        return out
    runs, tokens, blocks = sorted_pairs(ids, num_shared)
    num_sub_dims = gated.shape[1] // block
    rows = gated.reshape(m * num_sub_dims, block).index_select(0, tokens * num_sub_dims + blocks)  # each pair's block
    parts = gated.new_empty(rows.shape[0], width)
    for block_id, start, stop in runs:
        onednn_mm(parts[start:stop], rows[start:stop], handlers[2 + block_id])
    return out.index_add_(0, tokens, parts)


def project_out(
    hidden: torch.Tensor, ids: torch.Tensor, handlers: torch.Tensor, num_sub_dims: int, num_shared: int, block: int
):
    """The output side of a sparse sublayer: hidden (M, in), ids (M, k) absolute block ids -> (M, D), the output
    weight's product W_o h on each token's active blocks (the shared ones and its k picked ones); on the other blocks
    0 or W_o h (the caller masks them). `handlers` (2 + N_r,) int64: the prepacked whole W_o^T (in, D), its shared
    columns, each routed block's columns (`pack_sublayer`). Registered as `torch.ops.hf_mohd_vllm.mohd_onednn_out`."""
    m, hidden_size, shared = hidden.shape[0], num_sub_dims * block, num_shared * block
    plan = plan_of(m, "out")
    if plan == "dense":
        return onednn_mm(hidden.new_empty(m, hidden_size), hidden, handlers[0])
    out = hidden.new_zeros(m, hidden_size)
    if plan == "per_token":  # written in place: one row of a block is contiguous
        for token, picked in enumerate(ids.tolist()):
            row = hidden[token : token + 1]
            onednn_mm(out[token : token + 1, :shared], row, handlers[1])
            for block_id in picked:
                columns = slice(block_id * block, (block_id + 1) * block)
                onednn_mm(out[token : token + 1, columns], row, handlers[2 + block_id - num_shared])
        return out
    out[:, :shared] = onednn_mm(hidden.new_empty(m, shared), hidden, handlers[1])
    runs, tokens, blocks = sorted_pairs(ids, num_shared)
    rows = hidden.index_select(0, tokens)
    parts = hidden.new_empty(rows.shape[0], block)
    for block_id, start, stop in runs:
        onednn_mm(parts[start:stop], rows[start:stop], handlers[2 + block_id])
    positions = tokens * num_sub_dims + blocks
    return out.view(m * num_sub_dims, block).index_copy_(0, positions, parts).view(m, hidden_size)


# the operators vLLM's compiled graph calls: opaque to the compiler, so that the plan is chosen at run time
LIBRARY = torch.library.Library("hf_mohd_vllm", "DEF")
LIBRARY.define(
    "mohd_onednn_in(Tensor gated, Tensor ids, Tensor handlers, int num_shared, int block, int width) -> Tensor"
)
LIBRARY.define(
    "mohd_onednn_out(Tensor hidden, Tensor ids, Tensor handlers, int num_sub_dims, int num_shared, int block) -> Tensor"
)
LIBRARY.impl("mohd_onednn_in", project_in, "CPU")
LIBRARY.impl("mohd_onednn_out", project_out, "CPU")


@torch.library.register_fake("hf_mohd_vllm::mohd_onednn_in")
def _(gated, ids, handlers, num_shared, block, width):
    return gated.new_empty(gated.shape[0], width)


@torch.library.register_fake("hf_mohd_vllm::mohd_onednn_out")
def _(hidden, ids, handlers, num_sub_dims, num_shared, block):
    return hidden.new_empty(hidden.shape[0], num_sub_dims * block)


def prepack(matrices) -> tuple[torch.Tensor, list]:
    """Prepacked oneDNN products of each (K, n) matrix of `matrices` -> their (len,) int64 handler tensor and the
    handler objects (which free the packed copies when collected: keep them alive while the tensor is used)."""
    packed = [ops.create_onednn_mm(matrix, PRIMITIVE_CACHE) for matrix in matrices]
    return torch.stack([handler.handler_tensor for handler in packed]), packed


def block_spans(geometry) -> list[tuple[int, int]]:
    """The row spans of the prepacked parts: the whole width, the shared blocks, each routed block."""
    g = geometry
    routed = [(g.shared_width + j * g.block, g.shared_width + (j + 1) * g.block) for j in range(g.num_routed)]
    return [(0, g.hidden_size), (0, g.shared_width), *routed]


class MoHDOneDNNPlan:
    """One step's routes of a sublayer served by `MoHDOneDNNStrategy`: ids (M, k) and the masked strategy's plan of
    the same routes (`masked`: its (M, N) input gates and output mask, built once per step); computes the sublayer's
    sides through the prepacked operators (the interface `MoHDSubDimensions` calls on a plan)."""

    inactive = None  # no dropped-block compensation on this path

    def __init__(self, strategy: "MoHDOneDNNStrategy", ids: torch.Tensor, masked):
        self.strategy, self.ids, self.masked = strategy, ids, masked

    def project_in(self, hidden_states: torch.Tensor, linears) -> list[torch.Tensor]:
        """(M, D) -> one (M, out) view per input projection of the fused product of the gated input (gated in the
        compiled graph, the product in `mohd_onednn_in`)."""
        s, g = self.strategy, self.strategy.geometry
        m = hidden_states.shape[0]
        gates = self.masked.gates.to(hidden_states.dtype)
        gated = (hidden_states.view(m, g.num_sub_dims, g.block) * gates[..., None]).view(m, -1)
        out = torch.ops.hf_mohd_vllm.mohd_onednn_in(
            gated, self.ids, s.input_handlers, g.num_shared, g.block, sum(s.input_widths)
        )
        return list(out.split(s.input_widths, dim=1))

    def project_out(self, hidden_states: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """(M, in) -> (M, N, s), zero outside the active blocks (masked in the compiled graph)."""
        g = self.strategy.geometry
        out = torch.ops.hf_mohd_vllm.mohd_onednn_out(
            hidden_states, self.ids, self.strategy.output_handlers, g.num_sub_dims, g.num_shared, g.block
        )
        mask = self.masked.mask.to(out.dtype)
        return out.view(hidden_states.shape[0], g.num_sub_dims, g.block) * mask[..., None]

    def project_out_mixed(self, hidden_states, linear, fusion, scale):
        return None  # the sublayer applies activation scaling and group fusion to `project_out`'s blocks

    def sparse_block_positions(self, blocks, fusion):
        return None


class MoHDOneDNNStrategy:
    """A MoHD sublayer's strategy on vLLM's CPU build: the sublayer's router, then `MoHDOneDNNPlan` on its prepacked
    weights (built by `pack_sublayer`)."""

    def __init__(self, geometry, input_widths, input_handlers, output_handlers, keep_alive):
        self.geometry, self.input_widths = geometry, list(input_widths)
        self.input_handlers, self.output_handlers, self._packed = input_handlers, output_handlers, keep_alive

    def route(self, sublayer, hidden_states: torch.Tensor, projections, **kwargs) -> MoHDOneDNNPlan:
        """(B, T, D) normed input -> the plan of its B * T tokens (the router module's ids and gates, with the
        sublayer's masked strategy's gates and mask of them)."""
        _, gates, ids = sublayer.router(hidden_states, **kwargs)
        k = ids.shape[-1]
        ids, gates = ids.reshape(-1, k), gates.reshape(-1, k)
        return MoHDOneDNNPlan(self, ids, sublayer.masked.plan(ids, gates))


def packable(sub_dims, linears) -> str:
    """Why a sublayer (`MoHDSubDimensions`) with its projections `linears` (inputs, then output) cannot be served by
    `MoHDOneDNNStrategy`, or "" when it can."""
    weights = [linear.weight for linear in linears]
    reasons = (
        (sub_dims.router is None, "no router (k = 0)"),
        (not (sub_dims.sparse_input and sub_dims.sparse_output), "a dense side (`sparse_sides`)"),
        (sub_dims.output_compensation is not None, "dropped-block compensation"),
        (any(type(linear) is not nn.Linear for linear in linears), "projections that are not nn.Linear"),
        (any(linear.bias is not None for linear in linears), "projections with a bias"),
        (any(w.dtype not in PACKED_DTYPES or w.dtype != weights[0].dtype for w in weights), "a dtype oneDNN packs"),
    )
    return next((reason for refused, reason in reasons if refused), "")


def pack_sublayer(sub_dims, inputs, output) -> MoHDOneDNNStrategy:
    """The `MoHDOneDNNStrategy` of a sublayer whose input projections `inputs` (in the order its forward passes them)
    and output projection `output` are prepacked; their `nn.Linear` weights are freed (set to empty tensors)."""
    geometry = sub_dims.masked.geometry  # the sublayer's k (`with_top_k`)
    spans = block_spans(geometry)
    with torch.no_grad():
        weight_t = torch.cat([linear.weight.t() for linear in inputs], dim=1)  # (D, sum of out)
        input_handlers, packed_in = prepack([weight_t[start:stop] for start, stop in spans])
        # the output side's parts: W_o^T (in, D) restricted to a span of its columns, W_o's rows
        output_handlers, packed_out = prepack([output.weight[start:stop].t() for start, stop in spans])
    widths = [linear.weight.shape[0] for linear in inputs]
    for linear in (*inputs, output):
        linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
    return MoHDOneDNNStrategy(geometry, widths, input_handlers, output_handlers, (packed_in, packed_out))
