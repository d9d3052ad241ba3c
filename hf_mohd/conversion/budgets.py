"""Uneven routed budgets for a MoHD model: each layer and sublayer kind gets its own k, allocated greedily from
calibration text without training, under the per-token parameter budget of a uniform k.

TEAL (Liu et al., arXiv 2408.14690, section 4.2) allocates activation sparsity per layer and projection with a greedy
search that, step by step, sparsifies the block whose step increases the error least, holding the average sparsity
fixed. Here the unit is a MoHD sublayer (the attention or the FFN of one layer), its step is k -> k - 1, and:

1. Errors (`sublayer_errors`): the model runs at full activation (every routed block; for an exact conversion with
   unit gates, the dense source), and each sublayer's input is kept; then each sublayer alone runs at every k in
   [1, N_r] on its kept input, and e_u(k) = sum over tokens ||y_u(k) - y_u(N_r)||^2 / sum ||r_u||^2, where r_u is
   the residual stream the sublayer adds to (the decoder layer's input for attention, the stream after attention for
   the FFN): the perturbation of the residual stream relative to its size, comparable across layers and kinds.
2. Cost: w_u, the parameters one more routed block makes a token read in that sublayer (the accounting's difference
   between k + 1 and k: its input-side columns and output-side rows).
3. Greedy (`allocate_routed_sub_dims`): from k_u = N_r everywhere, while sum_u w_u k_u exceeds the budget
   sum_u w_u k_mean (what a uniform `mean_routed_sub_dims` reads), lower by one the k of the unit with the smallest
   (e_u(k_u - 1) - e_u(k_u)) / w_u among those with k_u > 1; ties go to the earlier unit (layer order, attention
   first). The result never reads more parameters per token than the uniform model it replaces.

The errors are local (each sublayer on the dense input), as TEAL's are; they do not see how errors compound through
later layers, which is the price of measuring 2 N_r forwards of one sublayer instead of a model forward per step.
"""

from dataclasses import dataclass, field

import torch

from ..models.accounting import MOHD_SUBLAYERS
from ..models.modeling_mohd import MoHDForCausalLM, MoHDSubDimensions
from .source import ConversionError


# `convert_mohd(routed_budgets=...)`: every sublayer at the uniform k, or the greedy allocation of this module
ROUTED_BUDGETS = ("uniform", "greedy")


@dataclass
class BudgetAllocation:
    """The k of each routed sublayer, and what the allocation was made from.

    Attributes:
        budgets: {(layer_idx, sublayer): k}, sublayer "attention" or "ffn".
        errors: {(layer_idx, sublayer): [e(1), ..., e(N_r)]}, the relative residual-stream error at each k
            (`sublayer_errors`; e(N_r) = 0).
        block_params: {(layer_idx, sublayer): w}, parameters one routed block adds per token.
        mean_routed_sub_dims: the requested uniform k whose parameter budget the allocation keeps.
        active_block_params: sum_u w_u k_u of the allocation; `budget_block_params`: sum_u w_u k_mean.
        tokens: calibration tokens measured.
    """

    budgets: dict
    errors: dict
    block_params: dict
    mean_routed_sub_dims: float
    active_block_params: int
    budget_block_params: float
    tokens: int
    steps: list = field(default_factory=list)

    def per_layer_config(self, default_k: int) -> dict[int, dict[str, int]]:
        """The `MoHDConfig.per_layer_config` entries that give every sublayer its k, leaving out the sublayers at
        `default_k` (the config's `num_routed_sub_dims_per_tok`)."""
        entries: dict[int, dict[str, int]] = {}
        for (layer_idx, sublayer), k in sorted(self.budgets.items()):
            if k != default_k:
                entries.setdefault(layer_idx, {})[f"{sublayer}_routed_sub_dims_per_tok"] = k
        return entries

    def as_dict(self) -> dict:
        """JSON-ready: budgets and errors keyed "layer.sublayer"."""
        key = "{}.{}".format
        return {
            "mean_routed_sub_dims": self.mean_routed_sub_dims,
            "active_block_params": self.active_block_params,
            "budget_block_params": self.budget_block_params,
            "tokens": self.tokens,
            "budgets": {key(*unit): k for unit, k in sorted(self.budgets.items())},
            "errors": {key(*unit): [round(e, 6) for e in errors] for unit, errors in sorted(self.errors.items())},
            "block_params": {key(*unit): w for unit, w in sorted(self.block_params.items())},
        }


def routed_sublayers(model: MoHDForCausalLM) -> dict[tuple[int, str], MoHDSubDimensions]:
    """{(layer_idx, sublayer): its `MoHDSubDimensions`} for every sublayer of `model` with a router, in layer order,
    attention first."""
    units = {}
    for module in model.modules():
        if isinstance(module, MoHDSubDimensions) and module.router is not None:
            units[(module.layer_idx, module.sublayer)] = module
    return dict(sorted(units.items(), key=lambda item: (item[0][0], MOHD_SUBLAYERS.index(item[0][1]))))


def block_params(config) -> dict[str, int]:
    """{sublayer: parameters one more routed block makes a token read}, from the accounting: the per-token FLOPs of
    a uniform config at k = 2 minus k = 1, halved (both have a router, so only the block's weights differ)."""
    fields = config.to_dict()
    fields.pop("per_layer_config", None)
    for kind in MOHD_SUBLAYERS:
        fields.pop(f"{kind}_routed_sub_dims_per_tok", None)
    cost = {}
    for k in (1, 2):
        layer = type(config).from_dict({**fields, "num_routed_sub_dims_per_tok": k}).accounting(0).layers[0]
        cost[k] = {"attention": layer.attention_flops, "ffn": layer.mixer_flops}
    return {kind: (cost[2][kind] - cost[1][kind]) // 2 for kind in MOHD_SUBLAYERS}


@torch.no_grad()
def sublayer_errors(
    model: MoHDForCausalLM, calibration_ids: torch.Tensor, batch_size: int = 4
) -> tuple[dict[tuple[int, str], list[float]], int]:
    """e_u(k) for every routed sublayer u and k in [1, N_r] (module docstring, step 1).

    Args:
        model: a MoHD model with routers; left at the k it had (each sublayer's).
        calibration_ids: (R, T) token ids of calibration text.
        batch_size: rows per forward.

    Returns:
        ({(layer_idx, sublayer): [e(1), ..., e(N_r)]}, tokens measured).

    Raises:
        ConversionError: the model has no routed sublayer, or `calibration_ids` is not a non-empty (R, T) tensor.
    """
    units = routed_sublayers(model)
    if not units:
        raise ConversionError("sublayer_errors: the model has no routed sublayer (no router to budget).")
    if calibration_ids.dim() != 2 or calibration_ids.numel() == 0:
        raise ConversionError(
            f"sublayer_errors: calibration ids must be a non-empty (rows, tokens) tensor, got {tuple(calibration_ids.shape)}."
        )
    full = model.config.num_routed_sub_dims
    saved = {unit: sub.router.top_k for unit, sub in units.items()}
    layers = model.model.layers
    # sublayer module (attention / MLP) -> unit
    owners = {getattr(layers[idx], "self_attn" if kind == "attention" else "mlp"): (idx, kind) for idx, kind in units}
    squared = {unit: torch.zeros(full, dtype=torch.float64) for unit in units}
    residual = dict.fromkeys(units, 0.0)
    kept, streams = {}, {}  # per batch: each sublayer's (args, kwargs); the residual stream's squared norm

    def keep(module, args, kwargs):
        kept[owners[module]] = (args, kwargs)

    def keep_stream(unit):
        def hook(module, args, kwargs):
            streams[unit] = (args[0] if args else kwargs["hidden_states"]).double().pow(2).sum().item()

        return hook

    handles = [module.register_forward_pre_hook(keep, with_kwargs=True) for module in owners]
    for layer_idx, layer in enumerate(model.model.layers):  # the residual stream each sublayer adds to
        for kind, norm in (("attention", layer.input_layernorm), ("ffn", layer.post_attention_layernorm)):
            if (layer_idx, kind) in units:
                handles.append(norm.register_forward_pre_hook(keep_stream((layer_idx, kind)), with_kwargs=True))
    tokens = 0
    was_training = model.training
    model.eval()
    try:
        model.set_active_sub_dims(full)
        for start in range(0, calibration_ids.shape[0], batch_size):
            batch = calibration_ids[start : start + batch_size].to(model.device)
            kept.clear()
            streams.clear()
            model(input_ids=batch, use_cache=False)
            tokens += batch.numel()
            for module, unit in owners.items():
                args, kwargs = kept[unit]
                sub = units[unit]
                reference = _first(module(*args, **kwargs)).double()
                for k in range(1, full):
                    sub.set_top_k(k)
                    squared[unit][k - 1] += (_first(module(*args, **kwargs)).double() - reference).pow(2).sum()
                sub.set_top_k(full)
                residual[unit] += streams[unit]
    finally:
        for handle in handles:
            handle.remove()
        for unit, sub in units.items():
            sub.set_top_k(saved[unit])
        model.train(was_training)
    return {unit: (squared[unit] / max(residual[unit], 1e-30)).tolist() for unit in units}, tokens


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def allocate_routed_sub_dims(
    model: MoHDForCausalLM, calibration_ids: torch.Tensor, mean_routed_sub_dims: float, batch_size: int = 4
) -> BudgetAllocation:
    """Each routed sublayer's k for the per-token parameter budget of a uniform k = `mean_routed_sub_dims`, by the
    greedy of the module docstring (steps 1-3). Apply it with `apply_routed_budgets`.

    Args:
        model: a MoHD model with routers (the same geometry in every sublayer).
        calibration_ids: (R, T) calibration token ids, disjoint from evaluation text.
        mean_routed_sub_dims: k_mean in [1, N_r]; a fraction is allowed (the budget is linear in k).
        batch_size: rows per forward.

    Raises:
        ConversionError: `mean_routed_sub_dims` outside [1, N_r], or the errors cannot be measured
            (`sublayer_errors`).
    """
    full = model.config.num_routed_sub_dims
    if isinstance(mean_routed_sub_dims, bool) or not 1 <= float(mean_routed_sub_dims) <= full:
        raise ConversionError(
            f"`mean_routed_sub_dims` must be a number in [1, {full}] (the routed sub-dimensions), "
            f"got {mean_routed_sub_dims!r}."
        )
    errors, tokens = sublayer_errors(model, calibration_ids, batch_size)
    per_kind = block_params(model.config)
    weights = {unit: per_kind[unit[1]] for unit in errors}
    budget = sum(weights.values()) * float(mean_routed_sub_dims)
    ks, steps = greedy_budgets(errors, weights, budget)
    return BudgetAllocation(
        budgets=ks,
        errors=errors,
        block_params=weights,
        mean_routed_sub_dims=float(mean_routed_sub_dims),
        active_block_params=sum(weights[u] * ks[u] for u in ks),
        budget_block_params=budget,
        tokens=tokens,
        steps=steps,
    )


def greedy_budgets(errors: dict, weights: dict, budget: float) -> tuple[dict, list]:
    """The greedy of the module docstring (step 3) on given tables.

    Args:
        errors: {unit: [e(1), ..., e(N_r)]}, every unit with the same N_r; weights: {unit: w > 0}; budget: the most
            sum_u w_u k_u may be, at least sum_u w_u (every k >= 1).

    Returns:
        ({unit: k}, the units lowered, in order).
    """
    full = len(next(iter(errors.values())))
    ks = dict.fromkeys(errors, full)
    steps = []
    while sum(weights[u] * ks[u] for u in ks) > budget + 1e-9:
        candidates = [u for u in ks if ks[u] > 1]
        unit = min(candidates, key=lambda u: (errors[u][ks[u] - 2] - errors[u][ks[u] - 1]) / weights[u])
        ks[unit] -= 1
        steps.append(unit)
    return ks, steps


def apply_routed_budgets(model: MoHDForCausalLM, allocation: BudgetAllocation) -> MoHDForCausalLM:
    """Writes the allocation into `model.config.per_layer_config` (so `save_pretrained` records it) and sets every
    sublayer to its k (`set_active_sub_dims(None)`); returns the model.

    Raises:
        ValueError: a k the config refuses (`MoHDConfig.validate_architecture`).
    """
    config = model.config
    config.per_layer_config = allocation.per_layer_config(config.num_routed_sub_dims_per_tok)
    config.validate_architecture()
    model.set_active_sub_dims(None)
    return model
