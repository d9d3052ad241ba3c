"""Uneven routed budgets: each MoHD layer and sublayer kind gets its own k, allocated greedily from calibration text
without training, under the per-token parameter budget of a uniform k.

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

The errors of step 1 are local (each sublayer on the dense input), as TEAL's are; they do not see how errors compound
through later layers, which is the price of measuring 2 N_r forwards of one sublayer instead of a model forward per
step. The residual stream's norm also counts the few channels of very large magnitude that language models carry
(massive activations, Sun et al., arXiv 2402.17762) and that the next norm's weights (folded into the next linears
after a rotation) scale down, so where the stream is large the rule calls a sublayer cheap. The output error (`error="output"`, `sublayer_output_errors`) replaces step 1
with what the model predicts:

1'. e_u(k) = the mean over calibration tokens of KL(p || p_u(k)), in nats, where p is the next-token distribution of
    the model at full activation and p_u(k) that of the same model with only sublayer u at k: each sublayer's
    sensitivity as the model's output sees it, errors compounded through every later layer included (the end-to-end
    importance Minitron measures for depth pruning, the loss with one layer removed, Muralidharan et al., arXiv
    2407.14679, here per sublayer and k). It costs, per calibration batch, one full forward plus (N_r - 1) forwards
    of the layers from each sublayer's own to the last, each with the LM head. The greedy adds the units' errors as
    if they were independent, as TEAL's does.

The same greedy (`greedy_budgets`) allocates the K of each MoE layer of a carved LatentMoE in the SmolLM2 experiments
(`experiments/smollm2/expert_budgets.py`), which no conversion option reaches.
"""

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...atomic_folder import write_json_atomically
from ...models.configuration_layers import MOHD_SUBLAYERS
from ...models.modeling_common import at_least_fp32
from ...models.modeling_mohd import MoHDForCausalLM, MoHDSubDimensions
from ..source import ConversionError


# `convert_mohd(routed_budgets=...)`: every sublayer at the uniform k, or the greedy allocation of this module on the
# residual-stream error ("greedy") or on the output error ("greedy_output")
ROUTED_BUDGETS = ("uniform", "greedy", "greedy_output")
# `allocate_routed_sub_dims(error=...)`: step 1 (`sublayer_errors`) or step 1' (`sublayer_output_errors`), with the
# words a model card uses for each
BUDGET_ERRORS = {
    "residual": "each sublayer's residual-stream error",
    "output": "the KL divergence of the model's next-token distribution with only that sublayer lowered",
}


@dataclass
class BudgetAllocation:
    """The k of each routed sublayer, and what the allocation was made from.

    Attributes:
        budgets: {(layer_idx, sublayer): k}, sublayer "attention" or "ffn".
        errors: {(layer_idx, sublayer): [e(1), ..., e(N_r)]}: at each k the relative residual-stream error
            (`sublayer_errors`) or the output KL in nats (`sublayer_output_errors`), as `error` says; e(N_r) = 0.
        block_params: {(layer_idx, sublayer): w}, parameters one routed block adds per token.
        mean_routed_sub_dims: the requested uniform k whose parameter budget the allocation keeps.
        active_block_params: sum_u w_u k_u of the allocation; `budget_block_params`: sum_u w_u k_mean.
        tokens: calibration tokens measured.
        error: "residual" or "output" (`BUDGET_ERRORS`): which measure `errors` holds.
        steps: the units the greedy lowered, in order.
    """

    budgets: dict
    errors: dict
    block_params: dict
    mean_routed_sub_dims: float
    active_block_params: int
    budget_block_params: float
    tokens: int
    error: str = "residual"
    steps: list = field(default_factory=list)

    def per_layer_config(self, default_k: int) -> dict[int, dict[str, int]]:
        """The `MoHDConfig.per_layer_config` entries that give every sublayer its k, leaving out the sublayers at
        `default_k` (the config's `num_routed_sub_dims_per_tok`)."""
        entries: dict[int, dict[str, int]] = {}
        for (layer_idx, sublayer), k in sorted(self.budgets.items()):
            if k != default_k:
                entries.setdefault(layer_idx, {})[f"{sublayer}_routed_sub_dims_per_tok"] = k
        return entries

    @classmethod
    def from_budgets(
        cls, model: MoHDForCausalLM, budgets: dict[str, int], error: str = "residual", tokens: int = 0
    ) -> "BudgetAllocation":
        """An allocation recorded earlier (the "budgets" of `as_dict`, keyed "layer.sublayer"), for `model`, without
        measuring anything: `errors` and `steps` stay empty, the costs and the budget are `model`'s. Apply it with
        `apply_routed_budgets`; the greedy of an identical model on the same text gives the same model.

        Raises:
            ConversionError: a key that is not one of `model`'s routed sublayers, a routed sublayer left out, a k
                that is not an integer in [1, N_r], or an unknown `error`.
        """
        if error not in BUDGET_ERRORS:
            raise ConversionError(f"`error` must be one of {list(BUDGET_ERRORS)}, got {error!r}.")
        units = {f"{layer_idx}.{sublayer}": (layer_idx, sublayer) for layer_idx, sublayer in routed_sublayers(model)}
        unknown, missing = sorted(set(budgets) - set(units)), sorted(set(units) - set(budgets))
        if unknown or missing:
            raise ConversionError(
                f"recorded budgets must name each routed sublayer of the model once ('layer.sublayer'); "
                f"unknown: {unknown}, missing: {missing}."
            )
        full = model.config.num_routed_sub_dims
        bad = {
            key: k for key, k in budgets.items() if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= full
        }
        if bad:
            raise ConversionError(
                f"recorded budgets must be integers in [1, {full}] (the routed sub-dimensions), got {bad}."
            )
        per_kind = block_params(model.config)
        ks = {units[key]: k for key, k in budgets.items()}
        weights = {unit: per_kind[unit[1]] for unit in ks}
        mean = model.config.num_routed_sub_dims_per_tok
        return cls(
            budgets=ks,
            errors={},
            block_params=weights,
            mean_routed_sub_dims=float(mean),
            active_block_params=sum(weights[u] * ks[u] for u in ks),
            budget_block_params=sum(weights.values()) * float(mean),
            tokens=tokens,
            error=error,
        )

    def as_dict(self) -> dict:
        """JSON-ready: budgets and errors keyed "layer.sublayer"."""
        key = "{}.{}".format
        return {
            "error": self.error,
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
    units = _checked_units(model, calibration_ids, "sublayer_errors")
    full = model.config.num_routed_sub_dims
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
    with _measuring(model, units, handles):
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
    return {unit: (squared[unit] / max(residual[unit], 1e-30)).tolist() for unit in units}, tokens


def _checked_units(model: MoHDForCausalLM, calibration_ids: torch.Tensor, caller: str) -> dict:
    """`routed_sublayers(model)`; raises ConversionError naming `caller` when there is none or `calibration_ids` is
    not a non-empty (R, T) tensor."""
    units = routed_sublayers(model)
    if not units:
        raise ConversionError(f"{caller}: the model has no routed sublayer (no router to budget).")
    if calibration_ids.dim() != 2 or calibration_ids.numel() == 0:
        raise ConversionError(
            f"{caller}: calibration ids must be a non-empty (rows, tokens) tensor, got {tuple(calibration_ids.shape)}."
        )
    return units


@contextlib.contextmanager
def _measuring(model: MoHDForCausalLM, units: dict, handles: list):
    """The frame of both error measurements: eval mode and every routed block active inside; afterwards the hooks
    in `handles` removed, each sublayer of `units` back at the k it had and the training mode restored."""
    saved = {unit: sub.router.top_k for unit, sub in units.items()}
    was_training = model.training
    model.eval()
    try:
        model.set_active_sub_dims(model.config.num_routed_sub_dims)
        yield
    finally:
        for handle in handles:
            handle.remove()
        for unit, sub in units.items():
            sub.set_top_k(saved[unit])
        model.train(was_training)


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements as raw bytes, row-major, on the CPU."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's and buffer's name, dtype, shape and bytes (in `state_dict` order)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def _read_progress(path: Path, identity: dict) -> dict | None:
    """The saved state of an interrupted `sublayer_output_errors` at `path`, or None when there is no file; raises
    ConversionError when the file is unreadable or was written for another model, text or batch size."""
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
        mismatched = [key for key, value in identity.items() if state["identity"].get(key) != value]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConversionError(f"{path}: not a progress file of `sublayer_output_errors` ({error}).") from error
    if mismatched:
        raise ConversionError(
            f"{path}: progress of another measurement (differs in {', '.join(mismatched)}); remove the file to "
            "measure anew or pass another `progress` path."
        )
    return state


@torch.no_grad()
def sublayer_output_errors(
    model: MoHDForCausalLM,
    calibration_ids: torch.Tensor,
    batch_size: int = 4,
    progress: str | os.PathLike | None = None,
) -> tuple[dict[tuple[int, str], list[float]], int]:
    """e_u(k) for every routed sublayer u and k in [1, N_r]: the mean over tokens of KL(p || p_u(k)) in nats (module
    docstring, step 1'), p the next-token distribution at full activation, p_u(k) with only u at k.

    Each batch runs once at full activation, keeping every decoder layer's input and keyword arguments (mask,
    position embeddings); then for each u and k < N_r the layers from u's own to the last run again on the kept input
    of u's layer with u at k, followed by the final norm and the LM head. The distributions are computed in float32
    (float64 for a float64 model) and each token's KL is summed in float64.

    With `progress`, the running sums are written there (atomically, as JSON) after every sublayer of every batch,
    with the identity of the measurement (a SHA-256 of the weights and of the ids, the batch size, the sublayers);
    a later call with the same file skips what it holds and returns exactly what one uninterrupted call returns. The
    file is left in place (the caller removes it once the result is saved).

    Args:
        model: a MoHD model with routers; left at the k it had (each sublayer's).
        calibration_ids: (R, T) token ids of calibration text.
        batch_size: rows per forward.
        progress: a JSON file for the running sums, or None to keep them in memory only.

    Returns:
        ({(layer_idx, sublayer): [e(1), ..., e(N_r)]}, tokens measured), e(N_r) = 0.

    Raises:
        ConversionError: the model has no routed sublayer, `calibration_ids` is not a non-empty (R, T) tensor, or
            `progress` holds another measurement or is not a progress file.
    """
    units = _checked_units(model, calibration_ids, "sublayer_output_errors")
    full = model.config.num_routed_sub_dims
    layers = model.model.layers
    kept = {}  # per batch: layer index -> the decoder layer's (args, kwargs) in the full-activation forward
    positions = {layer: idx for idx, layer in enumerate(layers)}
    key = "{}.{}".format

    def keep(module, args, kwargs):
        if len(kept) < len(layers):  # the re-runs of later layers must not replace the full-activation inputs
            kept[positions[module]] = (args, kwargs)

    def log_probs(logits: torch.Tensor) -> torch.Tensor:  # in float32 at least (float64 stays)
        return torch.log_softmax(logits.to(at_least_fp32(logits.dtype)), dim=-1)

    kl = {unit: torch.zeros(full, dtype=torch.float64) for unit in units}
    tokens, done_batches, done_units = 0, 0, 0  # tokens of the finished batches; where the last call stopped
    path = identity = None
    if progress is not None:
        path = Path(progress)
        identity = {
            "weights_sha256": _weights_digest(model),
            "calibration_sha256": hashlib.sha256(_tensor_bytes(calibration_ids)).hexdigest(),
            "calibration_shape": list(calibration_ids.shape),
            "batch_size": batch_size,
            "units": [key(*unit) for unit in units],
        }
        state = _read_progress(path, identity)
        if state is not None:
            tokens, done_batches, done_units = state["tokens"], state["batches_done"], state["units_done"]
            for unit in units:
                kl[unit] = torch.tensor(state["kl"][key(*unit)], dtype=torch.float64)

    def save(batches_done: int, units_done: int) -> None:
        if path is not None:
            sums = {key(*unit): kl[unit].tolist() for unit in units}  # float64 round-trips through JSON exactly
            state = {"identity": identity, "batches_done": batches_done, "units_done": units_done}
            write_json_atomically(path, {**state, "tokens": tokens, "kl": sums}, indent=None)

    handles = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in layers]
    with _measuring(model, units, handles):
        for batch_idx, start in enumerate(range(0, calibration_ids.shape[0], batch_size)):
            if batch_idx < done_batches:
                continue
            batch = calibration_ids[start : start + batch_size].to(model.device)
            kept.clear()
            reference = log_probs(model(input_ids=batch, use_cache=False).logits)
            probabilities = reference.exp()
            for unit_idx, ((layer_idx, kind), sub) in enumerate(units.items()):
                if batch_idx == done_batches and unit_idx < done_units:
                    continue
                for k in range(1, full):
                    sub.set_top_k(k)
                    args, kwargs = kept[layer_idx]
                    hidden = args[0] if args else kwargs["hidden_states"]
                    for idx in range(layer_idx, len(layers)):
                        args, kwargs = kept[idx]
                        kwargs = {name: value for name, value in kwargs.items() if name != "hidden_states"}
                        hidden = layers[idx](hidden, *args[1:], **kwargs)
                    lowered = log_probs(model.lm_head(model.model.norm(hidden)))
                    divergence = (probabilities * (reference - lowered)).sum(-1)  # per token
                    kl[(layer_idx, kind)][k - 1] += divergence.double().sum().cpu()
                sub.set_top_k(full)
                save(batch_idx, unit_idx + 1)
            tokens += batch.numel()
            save(batch_idx + 1, 0)
    return {unit: (kl[unit] / tokens).tolist() for unit in units}, tokens


def allocate_routed_sub_dims(
    model: MoHDForCausalLM,
    calibration_ids: torch.Tensor,
    mean_routed_sub_dims: float,
    batch_size: int = 4,
    error: str = "residual",
    progress: str | os.PathLike | None = None,
) -> BudgetAllocation:
    """Each routed sublayer's k for the per-token parameter budget of a uniform k = `mean_routed_sub_dims`, by the
    greedy of the module docstring (steps 1-3, or 1' and 2-3). Apply it with `apply_routed_budgets`.

    Args:
        model: a MoHD model with routers (the same geometry in every sublayer).
        calibration_ids: (R, T) calibration token ids, disjoint from evaluation text.
        mean_routed_sub_dims: k_mean in [1, N_r]; a fraction is allowed (the budget is linear in k).
        batch_size: rows per forward.
        error: "residual" (each sublayer's local residual-stream error, `sublayer_errors`) or "output" (the model's
            output KL with only that sublayer lowered, `sublayer_output_errors`).
        progress: with `error="output"`, the file that makes the measurement resumable (`sublayer_output_errors`);
            the residual-stream measure, a forward of one sublayer per k, takes no file.

    Raises:
        ConversionError: `mean_routed_sub_dims` outside [1, N_r], an unknown `error`, `progress` with the residual
            measure, or the errors cannot be measured.
    """
    full = model.config.num_routed_sub_dims
    if isinstance(mean_routed_sub_dims, bool) or not 1 <= float(mean_routed_sub_dims) <= full:
        raise ConversionError(
            f"`mean_routed_sub_dims` must be a number in [1, {full}] (the routed sub-dimensions), "
            f"got {mean_routed_sub_dims!r}."
        )
    if error not in BUDGET_ERRORS:
        raise ConversionError(f"`error` must be one of {list(BUDGET_ERRORS)}, got {error!r}.")
    if error == "output":
        errors, tokens = sublayer_output_errors(model, calibration_ids, batch_size, progress=progress)
    elif progress is not None:
        raise ConversionError('`progress` resumes the output measure only; pass it with `error="output"`.')
    else:
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
        error=error,
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
