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
"""Carving: a dense LLaMA-style checkpoint turned into a sparse LatentMoE by splitting each dense FFN into experts.

The rule is MoEfication's (Zhang et al., Findings of ACL 2022, arXiv 2110.01786, section 3: "expert construction"
by co-activation clustering, then "expert selection" by a router fitted without training the model), with CMoE's
split into always-active shared neurons and routed experts (Pei et al., arXiv 2502.04416, section 3: shared experts
= the most active neurons, routed experts by balanced clustering of the rest). Notation per layer: D = hidden_size,
I = intermediate_size of the dense FFN, x (D,) the FFN input (the output of `post_attention_layernorm`, weight
included), h = act(W_gate x) * (W_up x) (I,) the FFN's intermediate activation, FFN(x) = W_down h.

1. Calibration (`ffn_inputs`): the dense source runs on calibration tokens; every layer's x is kept (M tokens).
2. Shared expert: the m_s = round(`shared_fraction` * I) neurons of highest mean |h_i| over the calibration tokens
   (CMoE's shared experts are its most often activated neurons), ties to the lower index; m_s = 0 builds none.
3. Routed experts (`balanced_spherical_kmeans`): the other I - m_s neurons, each described by its pattern
   a_i = (|h_i(x_1)|, ..., |h_i(x_M)|) / norm, are split into N = `num_experts` clusters of equal size
   m = (I - m_s) / N by balanced spherical k-means: cosine similarity to unit centroids (k-means++ seeding with
   `seed`), each step a **greedy balanced assignment** (all neuron-cluster pairs in decreasing similarity, a pair
   taken while its neuron is free and its cluster holds fewer than m: a dependency-free approximation of the
   equal-size partition that MoEfication obtains by balanced partitioning and CMoE by solving a linear assignment
   problem exactly), then centroids = normalised member means, until the assignment repeats or
   `iterations` steps. Experts are numbered by decreasing calibration mass (expert 0 the most active), neurons in
   source order inside each.
4. Weights, taken as they are: expert e = rows S_e of W_gate and W_up and columns S_e of W_down, at full width
   (`moe_latent_size=None`, so `fc1_latent_proj` / `fc2_latent_proj` are identities), the shared expert likewise.
   `router_gate="unit"` multiplies every selected expert by exactly 1, so the carved model at K = N is the dense
   model (the FFN sum over neurons, regrouped) and at K < N drops the unselected experts' terms.
4b. Latent width (optional, `latent_size` = l, 1 <= l <= D; `moe_latent_size=l`), LatentMoE's latent projection
   (arXiv 2601.18089: `fc1_latent_proj` D -> l before the routed experts, `fc2_latent_proj` l -> D after their
   combine; the router and the shared expert keep reading the full-width x). Per layer, two orthonormal bases from
   the calibration text (`latent_basis`: the top-l eigenvectors of an **uncentred** second moment, float64, signs
   fixed as in `pca.pca_rotation`): the input basis V (D, l) of the FFN inputs x, C = (1/M) sum_t x_t x_t^T,
   and the output basis U (D, l) of the routed experts' summed output y_t = W_{down,R} h_R(x_t) (R: every routed
   neuron, all experts active). Then `fc1_latent_proj.weight` = V^T (l, D), `fc2_latent_proj.weight` = U (D, l),
   and expert e reads in V and writes in U: gate / up rows W_{gate,S_e} V, W_{up,S_e} V (m, l), down
   W'_{down,S_e} = U^T W_{down,S_e} (l, m). Routed expert e so computes U U^T W_{down,S_e} h_{S_e}(V V^T x): the
   carved expert with its input projected onto span(V) and its output onto span(U) (routed experts 3 N m l + 2 D l
   parameters instead of 3 N m D). The output side gets its own basis because the directions an FFN writes are not
   those it reads (on SmolLM2-135M at l = D / 2, N = 64, 75% active, fitted routers: held-out perplexity 162 with U
   against 303 with fc2 = V). The partition (steps 2, 3) is the full-width one, the same for every l; the routers
   (step 5) are fitted to the latent experts' masses. At l = D, V and U are orthogonal and the model is the
   full-width carve up to float rounding.
   Why uncentred: fc1 / fc2 have no bias (a carved source has mlp_bias=False), so the routed path sees
   x^ = V V^T x. For orthonormal V, E||x - V V^T x||^2 = tr(C) - tr(V^T C V), minimised by the top-l eigenvectors
   of C (Ky Fan; Eckart-Young), with error the sum of the D - l smallest eigenvalues (likewise for y and U).
   Centred PCA (eigenvectors of C - mu mu^T, mu = E x) minimises the error of mu + V V^T (x - mu), which needs the
   bias (I - V V^T) mu that the bias-free projections do not have: it chooses V without regard to mu, which in
   pretrained LLaMAs' FFN inputs can carry a large part of E||x||^2 = ||mu||^2 + tr(C - mu mu^T). The reported
   shares `latent_explained` (V, inputs) and `latent_output_explained` (U, routed outputs) = (sum of the top-l
   eigenvalues) / trace = 1 - E||x - V V^T x||^2 / E||x||^2 (the uncentred analogue of explained variance; 1 at
   l = D). MoHD's rotation (`mohd/rotation.py`, SliceGPT, arXiv 2401.15024 section 3.3) uses the same uncentred second moment.
5. Router (`routers.fit_carved_routers`), fitted without training: per layer, ridge least squares from x onto the centred
   log activation mass of each expert, y_e = log(sum_{i in S_e} |h_i| + eps) - mean over experts (float64):
   W_r^T = (X^T X + lambda I)^{-1} X^T Y, lambda = `ridge` * trace(X^T X) / D, eps = 1e-6 * mean mass. The top-K
   of W_r x then predicts the K experts of largest mass (MoEfication's "MLP selection" trains a small network to
   predict each expert's activation sum; this is a linear, closed-form version). Softmax (or sigmoid) scores keep the order of the logits.
6. `routers.every_expert_active` runs a carved model at K = N (the dense source's function, `hf-mohd convert --carve`'s
   check). The oracle arm (the top-K experts by true mass `expert_mass`, the upper bound of any router over this
   partition) and the routers' recall of it are analyses of the SmolLM2 experiments
   (`experiments/smollm2/routing_analysis.py`).

Default calibration text (`calibration.calibration_ids`): the first `CALIBRATION_ARTICLES` articles of the English
Wikipedia sample of the PyPI `gensim` wheel (CC BY-SA), in memory; evaluations hold out the *last*
`HELD_OUT_ARTICLES` articles.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from transformers.activations import ACT2FN
from transformers.initialization import no_init_weights

from ...models.configuration_latent_moe import LatentMoEConfig
from ...models.modeling_latent_moe import LatentMoEBlock, LatentMoEForCausalLM
from ..calibration import calibration_ids as read_calibration
from ..pca import principal_basis
from ..source import ConversionError, DenseLlamaSource, load_dense_llama
from .routers import fit_carved_routers, moe_blocks
from .upcycle import COPIED_FIELDS


logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LayerCarving:
    """The partition of one dense FFN.

    Attributes:
        shared: (m_s,) int64 source neuron indices of the shared expert, ascending.
        experts: (N, m) int64 source neuron indices of each routed expert, ascending within a row.
        mean_abs_activation: (I,) mean |h_i| over the calibration tokens (the FFN's own units).
        cohesion: mean cosine similarity of the routed neurons' activation patterns to their expert's centroid.
        router_r2: coefficient of determination of the router fit on the calibration tokens (None before the fit).
        latent_explained: with a latent width l (module docstring, step 4b), the share of the calibration inputs'
            second moment E||x||^2 that the input basis V keeps, (sum of the top-l eigenvalues of C) / tr(C) in
            [0, 1]; None at full width.
        latent_output_explained: likewise for the output basis U and the routed experts' summed output y.
    """

    shared: torch.Tensor
    experts: torch.Tensor
    mean_abs_activation: torch.Tensor
    cohesion: float
    router_r2: float | None = None
    latent_explained: float | None = None
    latent_output_explained: float | None = None


@dataclasses.dataclass
class CarveReport:
    """What `carve_llama` did.

    Attributes:
        layers: one `LayerCarving` per decoder layer.
        calibration_tokens: tokens the partition and the routers were fitted on.
        calibration: a line saying what the calibration text was.
        shared_mass: share of the calibration activation mass sum_i mean|h_i| held by the shared experts (0..1).
        latent_size: l, the routed experts' latent width (step 4b); None at full width.
    """

    layers: list[LayerCarving]
    calibration_tokens: int
    calibration: str
    shared_mass: float
    latent_size: int | None = None

    def as_dict(self) -> dict:
        """JSON-ready summary (no tensors): calibration, shared mass, cohesion and router R^2 per layer, and the
        latent width with the second-moment share of each layer's input and output bases (`latent_explained`,
        `latent_output_explained`; None at full width)."""
        return {
            "calibration_tokens": self.calibration_tokens,
            "calibration": self.calibration,
            "shared_mass": self.shared_mass,
            "cohesion": [layer.cohesion for layer in self.layers],
            "router_r2": [layer.router_r2 for layer in self.layers],
            "latent_size": self.latent_size,
            "latent_explained": None
            if self.latent_size is None
            else [layer.latent_explained for layer in self.layers],
            "latent_output_explained": None
            if self.latent_size is None
            else [layer.latent_output_explained for layer in self.layers],
        }


# ---------------------------------------------------------------------------------------------- options and sizes


@dataclasses.dataclass(frozen=True)
class CarveOptions:
    """The carving settings that do not depend on the source, checked once, when built (before any weight is read).

    Attributes:
        num_experts: N routed experts per layer, a positive integer.
        num_experts_per_tok: K experts per token, 1 <= K <= N (K = N computes the source exactly).
        shared_fraction: share of the I neurons in the shared expert, in [0, 1).
        latent_size: None (full-width routed experts) or a positive integer l (checked against the source's
            hidden_size by `carved_config_from_llama`).
        router_score_func: "softmax" or "sigmoid" (checked by `LatentMoEConfig`).

    Raises:
        ConversionError (a ValueError): `num_experts` not a positive integer, `num_experts_per_tok` outside
            [1, num_experts], `shared_fraction` outside [0, 1), `latent_size` neither None nor a positive integer;
            the message names the field.
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    shared_fraction: float = 0.25
    latent_size: int | None = None
    router_score_func: str = "softmax"

    def __post_init__(self):
        for name in ("num_experts", "num_experts_per_tok"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConversionError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.num_experts_per_tok > self.num_experts:
            raise ConversionError(
                f"`num_experts_per_tok` (K = {self.num_experts_per_tok}) must be <= `num_experts` "
                f"(N = {self.num_experts})."
            )
        fraction = self.shared_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ConversionError(f"`shared_fraction` must be a number in [0, 1), got {fraction!r}.")
        if not 0 <= fraction < 1:
            raise ConversionError(f"`shared_fraction` must be in [0, 1), got {fraction!r}.")
        _check_positive_latent_size(self.latent_size)


def _check_positive_latent_size(latent_size) -> None:
    if latent_size is not None and (
        isinstance(latent_size, bool) or not isinstance(latent_size, int) or latent_size < 1
    ):
        raise ConversionError(
            f"`latent_size` (--latent-size) must be a positive integer <= hidden_size (or None: full width), "
            f"got {latent_size!r}."
        )


def check_latent_size(latent_size: int | None, hidden_size: int) -> None:
    """Checks a carve's latent width l against the source: None (full width) or 1 <= l <= hidden_size.

    Raises:
        ConversionError: l not a positive integer (`CarveOptions`) or l > hidden_size (a latent space wider
            than x has no orthonormal basis in it); the message names `latent_size` and the source's hidden_size.
    """
    _check_positive_latent_size(latent_size)
    if latent_size is not None and latent_size > hidden_size:
        raise ConversionError(
            f"`latent_size` (--latent-size) must be <= hidden_size = {hidden_size} of the source (the top-l PCA "
            f"directions of the FFN input), got {latent_size}."
        )


def carve_sizes(intermediate_size: int, num_experts: int, shared_fraction: float) -> tuple[int, int]:
    """(m_s, m): shared expert width round(shared_fraction * I) and routed expert width (I - m_s) / N.

    Raises:
        ConversionError: I - m_s is not a positive multiple of N (the message names `intermediate_size` and gives
            shared fractions that fit).
    """
    shared = round(shared_fraction * intermediate_size)
    rest = intermediate_size - shared
    if rest < num_experts or rest % num_experts:
        fits = [s for s in range(intermediate_size - num_experts, -1, -num_experts) if s < intermediate_size]
        near = sorted(fits, key=lambda s: abs(s - shared))[:3]
        raise ConversionError(
            f"`intermediate_size` {intermediate_size} minus the shared part round({shared_fraction} * "
            f"{intermediate_size}) = {shared} leaves {rest} neurons, not divisible into num_experts = {num_experts} "
            f"equal experts; shared fractions that fit: {[round(s / intermediate_size, 6) for s in sorted(near)]}."
        )
    return shared, rest // num_experts


def carved_config_from_llama(llama_config, options: CarveOptions) -> LatentMoEConfig:
    """LatentMoE config of a carved LLaMA: the source's shapes, routed experts of width m at full width
    (`moe_latent_size=None`) or at latent width `options.latent_size` (module docstring step 4b), a shared expert of
    width m_s (`carve_sizes`), `router_gate="unit"`, every layer MoE. The checks against the source, once per carve.

    Raises:
        ConversionError: a source that is not a gated (SwiGLU-style) LLaMA without MLP biases, or sizes that do not
            fit it (`carve_sizes`, `check_latent_size`).
    """
    if getattr(llama_config, "model_type", None) != "llama":
        raise ConversionError(
            f"`source` must be a LLaMA-style checkpoint (model_type 'llama'), got {llama_config.model_type!r}.",
            kind="wrong_type",
        )
    if getattr(llama_config, "mlp_bias", False):
        raise ConversionError(
            "`mlp_bias` is true in the source: carved experts have no biases (a bias of W_gate / W_up belongs to "
            "one neuron and LatentMoE experts hold none), so only sources with mlp_bias=False can be carved.",
            kind="wrong_type",
        )
    shared, width = carve_sizes(llama_config.intermediate_size, options.num_experts, options.shared_fraction)
    check_latent_size(options.latent_size, llama_config.hidden_size)
    fields = {name: getattr(llama_config, name) for name in COPIED_FIELDS if hasattr(llama_config, name)}
    fields["head_dim"] = getattr(llama_config, "head_dim", None) or (
        llama_config.hidden_size // llama_config.num_attention_heads
    )
    fields.update(
        mlp_gated=True,
        mixer_type="moe",
        num_experts=options.num_experts,
        num_experts_per_tok=options.num_experts_per_tok,
        moe_intermediate_size=width,
        moe_latent_size=options.latent_size,
        moe_shared_expert_intermediate_size=shared,
        router_score_func=options.router_score_func,
        router_gate="unit",
    )
    try:
        return LatentMoEConfig(**fields)
    except ValueError as err:
        raise ConversionError(f"Carving settings do not fit the source: {err}") from err


# ------------------------------------------------------------------------------------------------- calibration


@torch.no_grad()
def ffn_inputs(source: DenseLlamaSource, input_ids: torch.Tensor, batch_size: int = 4) -> list[torch.Tensor]:
    """Every layer's FFN input x of the dense source on (B, T) `input_ids`: a list of (B * T, D) tensors in the
    source dtype (the output of `post_attention_layernorm`, norm weight included, what the carved router reads)."""
    model = source.build_llama()
    inputs: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    handles = [
        layer.mlp.register_forward_pre_hook(lambda module, args, idx=idx: inputs[idx].append(args[0].flatten(0, -2)))
        for idx, layer in enumerate(model.model.layers)
    ]
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            model.model(input_ids=input_ids[start : start + batch_size], use_cache=False)  # no LM head needed
    finally:
        for handle in handles:
            handle.remove()
    return [torch.cat(chunks) for chunks in inputs]


def intermediate_activation(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act_fn) -> torch.Tensor:
    """h = act(x W_gate^T) * (x W_up^T): (M, D) inputs, (I, D) weights -> (M, I), in the inputs' dtype."""
    return act_fn(x @ gate.T) * (x @ up.T)


# ------------------------------------------------------------------------------------------------- partition


def balanced_assignment(similarity: torch.Tensor, capacity: int) -> torch.Tensor:
    """Greedy equal-size assignment: (n, N) similarities -> (n,) cluster ids, each cluster exactly `capacity` items.

    Pairs are taken in decreasing similarity (ties: lower item, then lower cluster) while the item is unassigned and
    the cluster holds fewer than `capacity`. Needs n = N * capacity.
    """
    n, clusters = similarity.shape
    if n != clusters * capacity:
        raise ConversionError(f"balanced assignment needs n = N * capacity, got n={n}, N={clusters}, {capacity=}.")
    order = torch.sort(similarity.flatten(), descending=True, stable=True).indices.tolist()
    labels, counts, left = [-1] * n, [0] * clusters, n
    for pair in order:
        item, cluster = divmod(pair, clusters)
        if labels[item] < 0 and counts[cluster] < capacity:
            labels[item], counts[cluster], left = cluster, counts[cluster] + 1, left - 1
            if not left:
                break
    return torch.tensor(labels)


def balanced_spherical_kmeans(
    features: torch.Tensor, num_clusters: int, *, seed: int = 0, iterations: int = 30
) -> tuple[torch.Tensor, float]:
    """Balanced spherical k-means of (n, M) feature rows into `num_clusters` clusters of n / num_clusters each.

    Rows are normalised to unit length in fp32 (all-zero rows stay zero); similarity is the cosine to unit centroids;
    seeding is k-means++ on 1 - cosine with a generator seeded with `seed`; each step assigns with
    `balanced_assignment` and recomputes centroids as normalised member means, until the labels repeat or after
    `iterations` steps (module docstring, step 3).

    Returns:
        (labels (n,) int64, mean cosine similarity of the rows to their centroid).
    """
    n = features.shape[0]
    capacity = n // num_clusters
    unit = torch.nn.functional.normalize(features.float(), dim=1).contiguous()
    generator = torch.Generator().manual_seed(seed)
    first = int(torch.randint(n, (1,), generator=generator))
    centroids = [unit[first]]
    for _ in range(1, num_clusters):
        distance = (1 - (unit @ torch.stack(centroids).T).amax(1)).clamp_min(0)
        weights = distance.double() if distance.sum() > 0 else torch.ones(n, dtype=torch.float64)
        centroids.append(unit[int(torch.multinomial(weights, 1, generator=generator))])
    centroids = torch.stack(centroids)
    labels = None
    for _ in range(max(1, iterations)):
        new = balanced_assignment(unit @ centroids.T, capacity)
        members = torch.sort(new, stable=True).indices.view(num_clusters, capacity)  # equal sizes: one reshape
        centroids = torch.nn.functional.normalize(unit[members].sum(1), dim=1)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
    cohesion = (unit * centroids[labels]).sum(1).mean().item()
    return labels, cohesion


def partition_neurons(
    abs_activation: torch.Tensor, shared_size: int, num_experts: int, *, seed: int = 0, iterations: int = 30
) -> LayerCarving:
    """Split one FFN's I neurons into a shared expert and `num_experts` equal routed experts (module docstring,
    steps 2 and 3).

    Args:
        abs_activation: (M, I) |h| of the layer on M calibration tokens.
        shared_size: m_s, neurons of the shared expert (the highest mean |h|).
        num_experts: N; (I - m_s) must be a multiple of N.
        seed, iterations: of `balanced_spherical_kmeans`.
    """
    importance = abs_activation.double().mean(0)  # (I,)
    order = torch.sort(importance, descending=True, stable=True).indices
    shared = torch.sort(order[:shared_size]).values
    rest = torch.sort(order[shared_size:]).values
    labels, cohesion = balanced_spherical_kmeans(
        abs_activation[:, rest].T, num_experts, seed=seed, iterations=iterations
    )
    experts = torch.stack([rest[labels == e] for e in range(num_experts)])  # ascending within each expert
    mass = importance[experts].sum(1)
    experts = experts[torch.sort(mass, descending=True, stable=True).indices]
    return LayerCarving(shared, experts, importance, cohesion)


# ------------------------------------------------------------------------------------------------- latent basis


def latent_basis(inputs: torch.Tensor, latent_size: int) -> tuple[torch.Tensor, float]:
    """The latent basis of one layer (module docstring, step 4b): the top-l PCA directions of the FFN inputs, on
    the uncentred second moment (no bias in `fc1_latent_proj` / `fc2_latent_proj`).

    Args:
        inputs: (M, D) calibration FFN inputs x (`ffn_inputs`), any float dtype; M >= D keeps every direction
            determined (with M < D the trailing eigenvectors span the null space arbitrarily).
        latent_size: l, 1 <= l <= D.

    Returns:
        (V, explained): V (D, l) float64 with orthonormal columns, the eigenvectors of C = (1/M) X^T X (in float64)
        of the l largest eigenvalues in decreasing order, each column's largest-magnitude entry positive
        (`pca.principal_basis`); explained = (sum of the top-l eigenvalues) / tr(C) = 1 - ||X - X V V^T||_F^2 /
        ||X||_F^2, in [0, 1] (0 for all-zero inputs).

    Raises:
        ConversionError: `inputs` not 2-D, or `latent_size` not in [1, D] (`check_latent_size`).
    """
    if inputs.ndim != 2:
        raise ConversionError(f"`inputs` must be (tokens, hidden_size), got shape {tuple(inputs.shape)}.")
    check_latent_size(latent_size, inputs.shape[1])
    return principal_basis(inputs, latent_size)


def _fill_block(
    block: LatentMoEBlock,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    carving: LayerCarving,
    bases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Copy the dense FFN's rows / columns into the shared expert and the fused routed expert weights; with latent
    `bases` (V, U), each (D, l) (step 4b), the routed rows are W_{gate,S_e} V, W_{up,S_e} V, the down columns
    U^T W_{down,S_e}, `fc1_latent_proj` = V^T and `fc2_latent_proj` = U (products in float64, then cast)."""
    experts = carving.experts
    gate_up = torch.cat([gate[experts], up[experts]], dim=1)  # (N, 2m, D)
    down_rows = down[:, experts].permute(1, 0, 2)  # (N, D, m)
    if bases is not None:
        basis, output = bases
        gate_up = gate_up.double() @ basis  # (N, 2m, l)
        down_rows = output.T @ down_rows.double()  # (N, l, m)
        block.fc1_latent_proj.weight.copy_(basis.T)  # (l, D)
        block.fc2_latent_proj.weight.copy_(output)  # (D, l)
    block.experts.gate_up_proj.copy_(gate_up)
    block.experts.down_proj.copy_(down_rows)
    if block.shared_experts is not None:
        block.shared_experts.gate_proj.weight.copy_(gate[carving.shared])
        block.shared_experts.up_proj.weight.copy_(up[carving.shared])
        block.shared_experts.down_proj.weight.copy_(down[:, carving.shared])


# ------------------------------------------------------------------------------------------------- carving


@torch.no_grad()
def carve_llama(
    source: str | Path | DenseLlamaSource,
    calibration_ids: torch.Tensor | None = None,
    *,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    shared_fraction: float = 0.25,
    latent_size: int | None = None,
    router_score_func: str = "softmax",
    ridge: float = 0.1,
    iterations: int = 30,
    seed: int = 0,
    batch_size: int = 4,
    calibration_text: str | Path | None = None,
    calibration_tokens: int = 8192,
    calibration_window: int = 256,
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
) -> tuple[LatentMoEForCausalLM, CarveReport]:
    """Carve a dense LLaMA-style checkpoint into a LatentMoE model (module docstring), eval mode.

    Args:
        source: a `DenseLlamaSource` or anything `load_dense_llama` accepts (folder, .gguf file).
        calibration_ids: (B, T) calibration token ids; None: tokenize `calibration_text` (default the first
            Wikipedia articles, `calibration.default_calibration_text`).
        num_experts: N routed experts per layer.
        num_experts_per_tok: K experts per token, 1 <= K <= N (K = N computes the source exactly).
        shared_fraction: share of the I neurons in the shared expert, in [0, 1); (I - m_s) must divide into N.
        latent_size: None: full-width routed experts; l in [1, D]: routed experts at latent width l in each layer's
            top-l PCA basis of its calibration FFN inputs (module docstring, step 4b; exact only at l = D).
        router_score_func: "softmax" or "sigmoid" (either keeps the order of the fitted logits).
        ridge: regularisation of the router fit (`fit_carved_routers`).
        iterations: most balanced k-means steps per layer.
        seed: seed of the k-means++ seeding.
        batch_size: rows per calibration forward.
        calibration_text: a UTF-8 text file; None: the default calibration text (`calibration.calibration_ids`).
        calibration_tokens, calibration_window: at most this many calibration tokens, in rows of this many.
        dtype: dtype of the carved model; None keeps the source's.
        gguf_file: GGUF file name inside the folder `source`.

    Returns:
        (model, report): `LatentMoEForCausalLM` with `router_gate="unit"`, `moe_latent_size=latent_size`, the
        source's generation config (float64 models use the "eager" experts implementation); `CarveReport` with the
        partition of every layer (and, with a latent width, the second-moment share its basis keeps).

    Raises:
        ConversionError (a ValueError; the message names the input): bad options (`CarveOptions`), a source
            that is not a LLaMA-style checkpoint (`load_dense_llama`) or has MLP biases, an intermediate_size that
            does not split into N equal experts after the shared part (`carve_sizes`), a `latent_size` that is not
            None or in [1, hidden_size] (`check_latent_size`), calibration text or ids with fewer than
            max(hidden_size, window) tokens.
    """
    options = CarveOptions(num_experts, num_experts_per_tok, shared_fraction, latent_size, router_score_func)
    if not isinstance(source, (str, Path, DenseLlamaSource)):
        raise ConversionError(
            f"`source` must be a LLaMA folder, a .gguf file or a DenseLlamaSource, got {type(source).__name__}.",
            kind="wrong_type",
        )
    source = load_dense_llama(source, gguf_file=gguf_file, dtype=dtype)
    config = carved_config_from_llama(source.config, options)
    if calibration_ids is None:
        calibration_ids, calibration = read_calibration(
            source, calibration_text, window=calibration_window, max_tokens=calibration_tokens
        )
    else:
        calibration = f"{calibration_ids.numel()} given token ids"
    return carve_source(
        source, config, calibration_ids, calibration, ridge=ridge, iterations=iterations, seed=seed,
        batch_size=batch_size,
    )  # fmt: skip


@torch.no_grad()
def carve_source(
    source: DenseLlamaSource,
    config: LatentMoEConfig,
    calibration_ids: torch.Tensor,
    calibration: str,
    *,
    ridge: float = 0.1,
    iterations: int = 30,
    seed: int = 0,
    batch_size: int = 4,
) -> tuple[LatentMoEForCausalLM, CarveReport]:
    """Carve a loaded source into the LatentMoE `config` of `carved_config_from_llama` (module docstring): what
    `carve_llama` runs after its checks, and `convert_carved_latent_moe` after its own.

    Args:
        source: the dense LLaMA.
        config: its carved config (N, K, widths, latent width).
        calibration_ids: (B, T) calibration token ids, at least hidden_size of them.
        calibration: a line saying what the calibration text is (for the report and the model card).
        ridge, iterations, seed, batch_size: as in `carve_llama`.

    Returns:
        (model, report) as `carve_llama`.

    Raises:
        ConversionError: `calibration_ids` not (B, T) or fewer than hidden_size tokens, or source tensors that do
            not fit the config.
    """
    num_experts, latent_size = config.num_experts, config.moe_latent_size
    if calibration_ids.ndim != 2 or calibration_ids.numel() < config.hidden_size:
        raise ConversionError(
            f"`calibration_ids` must be (batch, seq) with at least hidden_size = {config.hidden_size} tokens, got "
            f"shape {tuple(calibration_ids.shape)}."
        )
    logger.info(
        "Carving: %d routed experts of width %d (top-%d), shared expert of width %d, on %d calibration tokens",
        config.num_experts,
        config.moe_intermediate_size,
        config.num_experts_per_tok,
        config.moe_shared_expert_intermediate_size,
        calibration_ids.numel(),
    )
    inputs = ffn_inputs(source, calibration_ids, batch_size)
    with no_init_weights():  # every parameter is set below: from the source, carved from its FFNs, or fitted
        model = LatentMoEForCausalLM(config)
    model.tie_weights()  # skipped under `no_init_weights`
    model.to(source.dtype)
    if source.dtype == torch.float64:  # the grouped_mm kernel takes fp32 / bf16 / fp16 only
        model.set_experts_implementation("eager")
    state = source.state_dict
    missing, unexpected = model.load_state_dict(
        {name: tensor for name, tensor in state.items() if ".mlp." not in name}, strict=False
    )
    if unexpected or any(".mlp." not in name for name in missing):
        raise ConversionError(f"Source tensors that do not fit the carved model: {(unexpected or missing)[:5]}.")
    act_fn = ACT2FN[source.config.hidden_act]
    layers, total_mass, shared_mass = [], 0.0, 0.0
    for (idx, block), x in zip(moe_blocks(model).items(), inputs, strict=True):
        prefix = f"model.layers.{idx}.mlp."
        gate, up, down = (state[f"{prefix}{name}_proj.weight"] for name in ("gate", "up", "down"))
        compute = torch.promote_types(source.dtype, torch.float32)
        activation = intermediate_activation(x.to(compute), gate.to(compute), up.to(compute), act_fn).abs()
        carving = partition_neurons(
            activation, config.moe_shared_expert_intermediate_size, num_experts, seed=seed, iterations=iterations
        )
        bases = None
        if latent_size is not None:
            basis, carving.latent_explained = latent_basis(x, latent_size)
            routed = carving.experts.reshape(-1)
            signed = intermediate_activation(x.to(compute), gate[routed].to(compute), up[routed].to(compute), act_fn)
            output, carving.latent_output_explained = latent_basis(signed @ down[:, routed].to(compute).T, latent_size)
            bases = (basis, output)
        _fill_block(block, gate, up, down, carving, bases)
        total_mass += carving.mean_abs_activation.sum().item()
        shared_mass += carving.mean_abs_activation[carving.shared].sum().item()
        layers.append(carving)
        logger.debug("carved layer %d: cohesion %.3f", idx, carving.cohesion)
    for carving, r2 in zip(layers, fit_carved_routers(model, inputs, ridge=ridge), strict=True):
        carving.router_r2 = r2
    model.generation_config = source.generation_config
    report = CarveReport(
        layers, int(calibration_ids.numel()), calibration, shared_mass / max(total_mass, 1e-30), latent_size
    )
    logger.info(
        "Carved %d layers: shared experts hold %.1f%% of the calibration activation mass, mean cohesion %.3f, "
        "mean router R^2 %.3f",
        len(layers),
        100 * report.shared_mass,
        sum(c.cohesion for c in layers) / len(layers),
        sum(c.router_r2 for c in layers) / len(layers),
    )
    if latent_size is not None:
        explained = [c.latent_explained for c in layers]
        logger.info(
            "Latent width %d of %d: the bases keep %.1f%% (min %.1f%%) of the FFN inputs' second moment",
            latent_size,
            config.hidden_size,
            100 * sum(explained) / len(explained),
            100 * min(explained),
        )
    return model.eval(), report


def describe_carving(config: LatentMoEConfig, report: CarveReport, seed: int = 0) -> str:
    """Markdown for the model card: how the dense FFNs were carved and what the routers are (and, with a latent
    width, the latent bases and the shares of the FFN inputs' and routed outputs' second moments they keep)."""
    exact = report.latent_size is None or report.latent_size == config.hidden_size
    unchanged = ", without changing any weight," if report.latent_size is None else ""
    source_exactly = ", so with all experts active the model computes the source exactly" if exact else ""
    text = (
        "Carved (MoEfication, arXiv 2110.01786; CMoE, arXiv 2502.04416): attention, norms, embedding and LM head "
        f"copied unchanged; each layer's dense SwiGLU FFN split{unchanged} into a shared expert "
        f"(width {config.moe_shared_expert_intermediate_size}: the neurons of highest mean |act(gate x) * up x| on "
        f"calibration text, {100 * report.shared_mass:.1f}% of the activation mass) and {config.num_experts} routed "
        f"experts of width {config.moe_intermediate_size} (balanced spherical k-means of the other neurons' "
        f"activation patterns, seed {seed}); top-{config.num_experts_per_tok} routing with unit gates "
        f'(`router_gate="unit"`){source_exactly}. '
        "Routers fitted without training: ridge least squares from the FFN input onto each expert's centred log "
        f"activation mass. Calibration: {report.calibration}."
    )
    if report.latent_size is None:
        return text
    explained = [layer.latent_explained for layer in report.layers]
    outputs = [layer.latent_output_explained for layer in report.layers]
    return text + (
        f" Routed experts at latent width {report.latent_size} of {config.hidden_size} (LatentMoE, arXiv "
        "2601.18089): per layer, fc1_latent_proj = V^T and fc2_latent_proj = U, V the top "
        f"{report.latent_size} PCA directions of the FFN input and U those of the routed experts' summed output "
        "(eigenvectors of their uncentred second moments on the calibration text); the routed experts' gate / up "
        "rows are the carved rows times V, their down columns U^T times the carved columns; router and shared "
        "expert read the full-width input. The input bases keep "
        f"{100 * sum(explained) / len(explained):.1f}% of the inputs' second moment on average "
        f"({100 * min(explained):.1f}% to {100 * max(explained):.1f}% over layers), the output bases "
        f"{100 * sum(outputs) / len(outputs):.1f}% of the routed outputs'"
        + (
            "; at full latent width the model is the full-width carve."
            if exact
            else ": with all experts active the model is the source with each routed expert's input and output "
            "projected onto those bases."
        )
    )


__all__ = [
    "CarveReport",
    "LayerCarving",
    "balanced_assignment",
    "balanced_spherical_kmeans",
    "carve_llama",
    "carve_source",
    "carve_sizes",
    "carved_config_from_llama",
    "CarveOptions",
    "check_latent_size",
    "describe_carving",
    "ffn_inputs",
    "intermediate_activation",
    "latent_basis",
    "partition_neurons",
]
