"""Dropped-block compensation of a MoHD model, fitted on calibration text without training (FLAP's bias compensation,
An et al., arXiv 2312.11983, section 3.3, applied per sub-dimension block).

A sparsified sublayer reads and writes only a token's active blocks. FLAP replaces the part of a pruned layer's input
it no longer reads by its mean on calibration text, which folds into a bias; here the part depends on the token (the
router's choice), so the bias is one per block, added for the blocks a token skips:

- input side, for each projection W (out, D) of the sublayer (q/k/v, gate/up) and block j:
  `input_compensation[W][j] = W[:, js:(j+1)s] @ E[x_j | j inactive]`, x_j the sublayer's (normed) input in block j;
- output side, for the projection W_o (D, in) writing the blocks (o_proj, down_proj) and block j:
  `output_compensation[j] = W_o[js:(j+1)s] @ E[h | j inactive] (+ that block's bias)`, h its input.

The expectations are over the calibration tokens for which block j is inactive, measured in one pass of the model as
it is (routing, earlier layers and their compensation included), with the routed input gate taken as 1 (the dense
function's contribution). Blocks never inactive on the calibration text get 0.

The pass observes the model through module hooks only: a forward hook on each sublayer's router sees its input x and
the picked blocks, a forward pre-hook on the output projection sees h. The sublayers run their masked strategy during
the pass (the reference computation of the same function), which calls the output projection as a module; the
gather strategy reads its weight instead, which no hook sees.
"""

import torch
from torch.utils.hooks import RemovableHandle

from ...models.modeling_mohd import MoHDForCausalLM, MoHDSubDimensions
from ..source import ConversionError


class _BlockStatistics:
    """Per sublayer: sums of each block's input over the tokens where it is inactive (N, s), of the output side's
    input over the tokens where each block is inactive (N, in), and those token counts (N,), in float64."""

    def __init__(self):
        self.input_sums, self.input_counts, self.output_sums, self.output_counts = {}, {}, {}, {}

    def watch(self, sub_dims: MoHDSubDimensions, output_linear: torch.nn.Module) -> list[RemovableHandle]:
        """Hooks recording the statistics of `sub_dims` on every forward: a forward hook on its router (input x
        (B, T, D), picked ids (B, T, k) -> the (M, N) inactive mask: 1.0 at the blocks a token neither reads nor
        writes) and a forward pre-hook on `output_linear` (its input h, (M, in), with the mask of the same tokens).
        The output projection must run as a module (the masked strategy). Returns the handles to remove."""
        geometry = sub_dims.masked.geometry
        pending = []

        def routed(router, args, output):
            flat = args[0].reshape(-1, args[0].shape[-1])
            indices = output[2].reshape(flat.shape[0], -1)
            inactive = torch.ones(flat.shape[0], geometry.num_sub_dims, dtype=torch.float64, device=flat.device)
            inactive[:, : geometry.num_shared] = 0
            inactive.scatter_(1, indices, 0.0)
            pending.append(inactive)
            self.record_input(sub_dims, flat, inactive)

        def projected(linear, args):
            self.record_output(sub_dims, args[0].reshape(-1, args[0].shape[-1]), pending.pop())

        return [sub_dims.router.register_forward_hook(routed), output_linear.register_forward_pre_hook(projected)]

    def record_input(self, sub_dims: MoHDSubDimensions, hidden_states: torch.Tensor, inactive: torch.Tensor) -> None:
        num_sub_dims = inactive.shape[1]
        blocks = hidden_states.double().view(hidden_states.shape[0], num_sub_dims, -1)  # (M, N, s)
        mask = inactive.double()
        self._add(self.input_sums, sub_dims, torch.einsum("mn,mns->ns", mask, blocks))
        self._add(self.input_counts, sub_dims, mask.sum(0))

    def record_output(self, sub_dims: MoHDSubDimensions, hidden_states: torch.Tensor, inactive: torch.Tensor) -> None:
        mask = inactive.double()
        self._add(self.output_sums, sub_dims, mask.t() @ hidden_states.double())  # (N, in)
        self._add(self.output_counts, sub_dims, mask.sum(0))

    @staticmethod
    def _add(table: dict, key, value: torch.Tensor) -> None:
        table[key] = value if key not in table else table[key] + value


@torch.no_grad()
def fit_dropped_block_compensation(
    model: MoHDForCausalLM, calibration_ids: torch.Tensor, batch_size: int = 4
) -> dict[str, float]:
    """Fits every `input_compensation` and `output_compensation` of `model` in place (module docstring).

    Args:
        model: a MoHD model built with `dropped_block_compensation=True` (e.g. `from_pretrained(...,
            dropped_block_compensation=True)`); its compensation is reset to 0 before measuring.
        calibration_ids: (R, T) token ids of calibration text (disjoint from evaluation text).
        batch_size: rows per forward.

    Returns:
        {"tokens": calibration tokens, "inactive_share": mean share of (token, routed block) pairs inactive,
        "input_norm" / "output_norm": root mean square of the fitted tables' entries}.

    Raises:
        ConversionError: the model has no compensation parameters, or `calibration_ids` is not a non-empty 2-D tensor.
    """
    sublayers = [m for m in model.modules() if isinstance(m, MoHDSubDimensions) and m.output_compensation is not None]
    if not sublayers:
        raise ConversionError(
            "fit_dropped_block_compensation: the model has no compensation parameters; load or build it with "
            "dropped_block_compensation=True (and at least one routed sub-dimension)."
        )
    if calibration_ids.dim() != 2 or calibration_ids.numel() == 0:
        raise ConversionError(
            f"fit_dropped_block_compensation: calibration_ids must be a non-empty (rows, tokens) tensor, got shape "
            f"{tuple(calibration_ids.shape)}."
        )
    statistics = _BlockStatistics()
    was_training = model.training
    model.eval()
    hooks, strategies = [], {}
    for sub_dims in sublayers:
        sub_dims.output_compensation.zero_()
        for table in sub_dims.input_compensation.values():
            table.zero_()
        hooks += statistics.watch(sub_dims, _output_linear(_parent_of(model, sub_dims)))
        # the masked strategy calls the output projection as a module (its pre-hook sees h); restored below
        strategies[sub_dims], sub_dims.strategy = sub_dims.strategy, sub_dims.masked
    try:
        device = next(model.parameters()).device
        for start in range(0, calibration_ids.shape[0], batch_size):
            model(input_ids=calibration_ids[start : start + batch_size].to(device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
        for sub_dims, strategy in strategies.items():
            sub_dims.strategy = strategy
        model.train(was_training)

    input_squares = output_squares = input_entries = output_entries = 0.0
    inactive_pairs = routed_pairs = 0.0
    for sub_dims in sublayers:
        parent = _parent_of(model, sub_dims)
        counts = statistics.input_counts[sub_dims].clamp(min=1)[:, None]
        means = statistics.input_sums[sub_dims] / counts  # (N, s): E[x_j | j inactive]
        num_sub_dims, block = means.shape
        for name, table in sub_dims.input_compensation.items():
            weight = getattr(parent, name).weight.double()  # (out, D)
            blocks = weight.view(weight.shape[0], num_sub_dims, block)  # (out, N, s)
            fitted = torch.einsum("ons,ns->no", blocks, means)
            table.copy_(fitted.to(table.dtype))
            input_squares += fitted.square().sum().item()
            input_entries += fitted.numel()
        output_linear = _output_linear(parent)
        weight = output_linear.weight.double()  # (D, in)
        output_means = statistics.output_sums[sub_dims] / statistics.output_counts[sub_dims].clamp(min=1)[:, None]
        per_block = torch.einsum("nsi,ni->ns", weight.view(num_sub_dims, block, -1), output_means)
        if output_linear.bias is not None:
            per_block = per_block + output_linear.bias.double().view(num_sub_dims, block)
        per_block = per_block * (statistics.output_counts[sub_dims] > 0)[:, None]  # never inactive: 0
        sub_dims.output_compensation.copy_(per_block.to(sub_dims.output_compensation.dtype))
        output_squares += per_block.square().sum().item()
        output_entries += per_block.numel()
        geometry = sub_dims.masked.geometry
        inactive_pairs += statistics.input_counts[sub_dims][geometry.num_shared :].sum().item()
        tokens = calibration_ids.numel()
        routed_pairs += tokens * geometry.num_routed
    return {
        "tokens": int(calibration_ids.numel()),
        "inactive_share": inactive_pairs / max(routed_pairs, 1),
        "input_norm": (input_squares / max(input_entries, 1)) ** 0.5,
        "output_norm": (output_squares / max(output_entries, 1)) ** 0.5,
    }


def _output_linear(parent) -> torch.nn.Module:
    """The projection writing the blocks of a MoHD attention (`o_proj`) or MLP (`down_proj`) module."""
    return parent.o_proj if hasattr(parent, "o_proj") else parent.down_proj


def _parent_of(model, sub_dims: MoHDSubDimensions):
    """The attention or MLP module holding `sub_dims` (its projections are attributes of that module)."""
    for module in model.modules():
        if getattr(module, "sub_dims", None) is sub_dims:
            return module
    raise ConversionError("fit_dropped_block_compensation: a sub-dimension module has no parent sublayer.")


__all__ = ["fit_dropped_block_compensation"]
