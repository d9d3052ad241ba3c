"""Expert shaping: the alpha-transform of a standard MoE and the near-square (l, m) proposer.

Source: arXiv 2610.14644 ("Shaping Latent Mixture-of-Experts"), section 2 (alpha-transform: l = d / alpha,
N' = alpha N, K' = alpha K at fixed m keeps the routed path's parameters N l m, compute K l m and communication K l;
alpha = 4 in Nemotron 3), section 3.1 (an expert's local Jacobian rank is bounded by q = min(l, m), largest at
l = m for fixed l m) and section 3.2 (shapes with |l/m - 1| <= 0.4 lie in or near the best plateau).
"""

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from ..models.accounting import LAYER_FIELD_DEFAULTS, layer_fields
from .config_io import config_to_dict


MOE_FIELDS = (
    "moe_latent_size",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_shared_expert_intermediate_size",
)


def _as_integer(value: float, what: str) -> int:
    rounded = round(value)
    if abs(value - rounded) > 1e-9 * max(1.0, abs(value)):
        raise ValueError(what)
    return int(rounded)


def alpha_transform_fields(fields: Mapping, alpha, where: str = "") -> dict:
    """The alpha-transform of one standard-MoE layer's fields (arXiv 2610.14644 section 2).

    Args:
        fields: mapping with `hidden_size` (D), `num_experts` (N), `num_experts_per_tok` (K) and
            `moe_latent_size` None (standard MoE); other keys are copied unchanged (m stays fixed).
        alpha: compression factor, a positive number with D / alpha, alpha N and alpha K integers.
        where: prefix of error messages (e.g. "layer 3: ").

    Returns:
        A new dict with `moe_latent_size` = D / alpha, `num_experts` = alpha N, `num_experts_per_tok` = alpha K.

    Raises:
        ValueError: `alpha` not a positive number; `moe_latent_size` already set; D / alpha, alpha N or alpha K not
            an integer; K > N.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"`alpha` must be a positive number, got {alpha!r}.")
    if fields.get("moe_latent_size") is not None:
        raise ValueError(
            f"{where}the alpha-transform starts from a standard MoE: `moe_latent_size` must be None, "
            f"got {fields['moe_latent_size']!r}."
        )
    out = dict(fields)
    for name in ("hidden_size", "num_experts", "num_experts_per_tok"):
        value = fields.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}`{name}` must be a positive integer, got {value!r}.")
    d, n, k = fields["hidden_size"], fields["num_experts"], fields["num_experts_per_tok"]
    if k > n:
        raise ValueError(f"{where}`num_experts_per_tok` must be at most `num_experts` ({n}), got {k}.")
    latent = _as_integer(
        d / alpha, f"{where}`hidden_size` ({d}) must be divisible by alpha ({alpha}) to give an integer latent size."
    )
    if latent < 1:
        raise ValueError(f"{where}alpha ({alpha}) must be at most `hidden_size` ({d}).")
    out["moe_latent_size"] = latent
    out["num_experts"] = _as_integer(
        alpha * n, f"{where}alpha ({alpha}) times `num_experts` ({n}) must be an integer, got {alpha * n}."
    )
    out["num_experts_per_tok"] = _as_integer(
        alpha * k, f"{where}alpha ({alpha}) times `num_experts_per_tok` ({k}) must be an integer, got {alpha * k}."
    )
    return out


def alpha_transform(config_or_fields, alpha):
    """Alpha-transform a standard MoE config (every MoE layer) into a LatentMoE one (arXiv 2610.14644 section 2).

    l = D / alpha, N' = alpha N, K' = alpha K, m (and the shared expert m_s) unchanged: the routed path keeps
    c N l m parameters, 2 c K l m FLOPs per token and 2 K l all-to-all scalars per token, with alpha times as many
    candidate and activated experts. Added cost outside the routed path: latent projections 2 D l and a router
    of D N' instead of D N.

    Args:
        config_or_fields: one of
            - a flat mapping of layer fields (no `num_hidden_layers`): returns the transformed dict;
            - a config dict (`config.json`, may hold `per_layer_config`): returns a new dict; each MoE layer is
              transformed, dense (`mixer_type="mlp"`) layers are kept;
            - a `PreTrainedConfig`: returns a new config of the same class built from the transformed dict.
        alpha: positive number; D / alpha, alpha N and alpha K must be integers for every MoE layer.

    Raises:
        ValueError: as `alpha_transform_fields`, with the layer index in the message.
    """
    if isinstance(config_or_fields, Mapping) and "num_hidden_layers" not in config_or_fields:
        return alpha_transform_fields(config_or_fields, alpha)
    data = config_to_dict(config_or_fields)
    overrides_in = data.pop("per_layer_config")
    new_global = dict(data)
    if data.get("num_experts") is not None:
        new_global = alpha_transform_fields(data, alpha, "global config: ")
    per_layer = {}
    for idx in range(data["num_hidden_layers"]):
        fields = layer_fields({**data, "per_layer_config": overrides_in}, idx)
        names = set(overrides_in.get(idx, {}))
        if fields["mixer_type"] == "moe":
            fields = alpha_transform_fields(fields, alpha, f"layer {idx}: ")
            names |= set(MOE_FIELDS)
        diff = {
            name: fields[name]
            for name in sorted(names)
            if name in fields and new_global.get(name, LAYER_FIELD_DEFAULTS.get(name)) != fields[name]
        }
        extra = {name: value for name, value in overrides_in.get(idx, {}).items() if name not in fields}
        if diff or extra:
            per_layer[idx] = {**extra, **diff}
    if isinstance(config_or_fields, Mapping):
        if per_layer:
            new_global["per_layer_config"] = {str(i): v for i, v in per_layer.items()}
        return new_global
    return type(config_or_fields).from_dict({**new_global, "per_layer_config": per_layer or None})


@dataclass(frozen=True)
class ExpertShape:
    """An expert shape: latent (input) width l and intermediate width m, in scalars.

    `rank_ceiling` q = min(l, m) bounds the expert's local Jacobian rank (arXiv 2610.14644 section 3.1);
    `aspect_deviation` = |l/m - 1|; `product_error` = (l m - target) / target.
    """

    latent_size: int
    intermediate_size: int
    target_product: int

    @property
    def product(self) -> int:
        return self.latent_size * self.intermediate_size

    @property
    def aspect_deviation(self) -> float:
        return abs(self.latent_size / self.intermediate_size - 1.0)

    @property
    def rank_ceiling(self) -> int:
        return min(self.latent_size, self.intermediate_size)

    @property
    def product_error(self) -> float:
        return (self.product - self.target_product) / self.target_product

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "product": self.product,
            "aspect_deviation": self.aspect_deviation,
            "rank_ceiling": self.rank_ceiling,
            "product_error": self.product_error,
        }


def propose_shapes(
    target_product: int,
    *,
    max_aspect_deviation: float = 0.4,
    multiple: int = 64,
    max_latent_size: int | None = None,
    product_tolerance: float = 0.05,
) -> list[ExpertShape]:
    """Near-square expert shapes (l, m), both multiples of `multiple`, with l m close to `target_product`.

    Keeps shapes with |l/m - 1| <= `max_aspect_deviation` (0.4: arXiv 2610.14644 section 3.2) and
    |l m / target - 1| <= `product_tolerance`, ranked by the smallest |product error| first (the per-expert
    parameter budget is the constraint), then the largest rank ceiling q = min(l, m) (section 3.1), then the
    smaller l (**choice**: less communication and smaller latent projections between transposed shapes).

    Args:
        target_product: l m to match (positive integer), e.g. the per-expert budget of an existing config.
        max_aspect_deviation: ratio bound, >= 0.
        multiple: alignment of l and m (positive integer; 64 suits GPU tiles).
        max_latent_size: upper bound on l (usually the hidden size D); None = no bound.
        product_tolerance: accepted relative deviation of l m from the target, >= 0.

    Returns:
        The ranked shapes (possibly empty when nothing fits; `propose_shape` raises instead).

    Raises:
        ValueError: a parameter is out of range.
    """
    for name, value in (("target_product", target_product), ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    if max_latent_size is not None and (
        isinstance(max_latent_size, bool) or not isinstance(max_latent_size, int) or max_latent_size < 1
    ):
        raise ValueError(f"`max_latent_size` must be None or a positive integer, got {max_latent_size!r}.")
    for name, value in (("max_aspect_deviation", max_aspect_deviation), ("product_tolerance", product_tolerance)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"`{name}` must be a non-negative number, got {value!r}.")
    upper = int(math.isqrt(target_product) * math.sqrt(1 + max_aspect_deviation) * (1 + product_tolerance)) + multiple
    if max_latent_size is not None:
        upper = min(upper, max_latent_size)
    shapes = []
    for latent in range(multiple, upper + 1, multiple):
        base = target_product / latent / multiple
        for steps in {math.floor(base), math.ceil(base)}:
            if steps < 1:
                continue
            shape = ExpertShape(latent, steps * multiple, target_product)
            if (
                shape.aspect_deviation <= max_aspect_deviation + 1e-12
                and abs(shape.product_error) <= product_tolerance + 1e-12
            ):
                shapes.append(shape)
    shapes.sort(key=lambda s: (round(abs(s.product_error), 12), -s.rank_ceiling, s.latent_size))
    return shapes


def propose_shape(target_product: int, **kwargs) -> ExpertShape:
    """The best shape of `propose_shapes` (same arguments).

    Raises:
        ValueError: no shape satisfies the bounds; the message names the bounds to relax.
    """
    shapes = propose_shapes(target_product, **kwargs)
    if not shapes:
        raise ValueError(
            f"No (l, m) with l m within {kwargs.get('product_tolerance', 0.05):.0%} of {target_product}, "
            f"|l/m - 1| <= {kwargs.get('max_aspect_deviation', 0.4)} and both multiples of {kwargs.get('multiple', 64)}"
            f"{'' if kwargs.get('max_latent_size') is None else ', l <= ' + str(kwargs['max_latent_size'])}; "
            "relax `product_tolerance`, `max_aspect_deviation` or `multiple`."
        )
    return shapes[0]
