"""ID-guided two-regime capacity allocation across depth (arXiv 2610.14644 section 4, docs/design.md section 4).

Given a uniform LatentMoE config and the intrinsic-dimension (ID) profile of a base or short proxy model
(`intrinsic_dimension.py`), the shallow blocks before the profile's steepest rise get a narrow expert shape and
the remaining blocks a wide one. Each regime keeps, per layer and within `tolerance` (5%) of the uniform layer:

- mixer parameters     c N l m + 2 D l + D N + c D m_s
- FLOPs/token          2 (c K l m + 2 D l + D N + c D m_s)   (2 x the activated MACs of appendix B.2)
- all-to-all scalars   2 K l

following section 4.2: raising l_t is paid by lowering K_t and N_t at about fixed m_t and N_t / K_t
(so c N l m, c K l m and K l stay put), and the shared-expert width m_s absorbs the change of the latent
projections and router (appendix B.2: matching C_t = K_t l_t m_t and Q_t = 2 l_t + N_t + 3 m_{s,t} matches
parameters and activated compute). Both shapes are near-square, |l/m - 1| <= 0.3 (section 4.2), with l and m
multiples of `multiple` for hardware alignment.
"""

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..models.accounting import layer_fields, mixer_accounting
from .config_io import config_to_dict, load_config
from .shapes import MOE_FIELDS


@dataclass(frozen=True)
class RegimeShape:
    """One MoE layer shape: l, m, N, K and m_s (the `LatentMoEConfig` field values)."""

    moe_latent_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_shared_expert_intermediate_size: int

    @property
    def rank_ceiling(self) -> int:
        """q = min(l, m), the per-expert local-rank ceiling (arXiv 2610.14644 section 3.1)."""
        return min(self.moe_latent_size, self.moe_intermediate_size)

    @property
    def aspect_deviation(self) -> float:
        return abs(self.moe_latent_size / self.moe_intermediate_size - 1.0)

    def fields(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Allocation:
    """Result of `allocate_two_regime`.

    `split` is the first wide layer index of the target config: MoE layers `< split` use `narrow`, the others
    `wide`; dense layers are unchanged. `proxy_split` is the same boundary in the profile's own depth.
    `deviations[regime]` holds the relative differences (value / uniform - 1) of mixer parameters ("params"),
    forward FLOPs per token ("flops"), all-to-all scalars per token ("all_to_all") and N/K ("experts_ratio").
    """

    profile: tuple
    proxy_split: int
    split: int
    uniform: RegimeShape
    narrow: RegimeShape
    wide: RegimeShape
    layer_regimes: tuple
    deviations: dict
    tolerance: float
    config: dict

    def summary(self) -> dict:
        return {
            "profile": list(self.profile),
            "proxy_split": self.proxy_split,
            "split": self.split,
            "uniform": self.uniform.fields(),
            "narrow": self.narrow.fields(),
            "wide": self.wide.fields(),
            "layer_regimes": list(self.layer_regimes),
            "deviations": self.deviations,
            "tolerance": self.tolerance,
        }


def find_split(block_profile: Sequence[float], depth_fraction: float = 2 / 3) -> int:
    """Index of the block after the steepest rise of the ID profile within the first `depth_fraction` of depth.

    Args:
        block_profile: ID of the hidden state entering each block, length L >= 2.
        depth_fraction: window, in (0, 1]; candidate splits t satisfy 1 <= t <= max(1, round(fraction L)) and
            t <= L - 1, and the rise into block t is profile[t] - profile[t - 1] (arXiv 2610.14644 section 4.2:
            "partitions blocks at a separation in the measured ID profile").

    Returns:
        t: blocks 0 .. t-1 form the shallow (narrow) prefix. Ties go to the shallower split.

    Raises:
        ValueError: fewer than 2 blocks, non-finite values, a bad fraction, or no rise in the window (pass an
            explicit split then).
    """
    values = [float(v) for v in block_profile]
    if len(values) < 2:
        raise ValueError(f"`profile` must cover at least 2 blocks, got {len(values)}.")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"`profile` must be finite, got {values}.")
    if isinstance(depth_fraction, bool) or not 0 < depth_fraction <= 1:
        raise ValueError(f"`depth_fraction` must be in (0, 1], got {depth_fraction!r}.")
    last = min(len(values) - 1, max(1, round(depth_fraction * len(values))))
    rises = [(values[t] - values[t - 1], -t) for t in range(1, last + 1)]
    rise, neg_t = max(rises)
    if rise <= 0:
        raise ValueError(
            f"The ID profile does not rise within the first {depth_fraction:.0%} of depth ({values[: last + 1]}); "
            "pass `split` explicitly."
        )
    return -neg_t


def _uniform_moe_shape(data: dict) -> tuple[RegimeShape, dict, list[int]]:
    num_layers = data["num_hidden_layers"]
    moe_layers, reference, reference_idx = [], None, None
    for idx in range(num_layers):
        fields = layer_fields(data, idx)
        if fields["mixer_type"] != "moe":
            continue
        mixer_accounting(fields, f"layer {idx}: ")  # validates the fields
        moe_layers.append(idx)
        if reference is None:
            reference, reference_idx = fields, idx
            continue
        for name in (*MOE_FIELDS, "mlp_gated", "hidden_size"):
            if fields[name] != reference[name]:
                raise ValueError(
                    f"layer {idx}: allocation starts from a uniform config, but `{name}` is {fields[name]!r} "
                    f"where layer {reference_idx} has {reference[name]!r}."
                )
    if reference is None:
        raise ValueError("config: no MoE layer (`mixer_type='moe'`) to allocate.")
    if reference["moe_latent_size"] is None:
        raise ValueError(
            "config: `moe_latent_size` is None (standard MoE); allocation needs a LatentMoE base, "
            "e.g. from `alpha_transform`."
        )
    shape = RegimeShape(
        reference["moe_latent_size"],
        reference["moe_intermediate_size"],
        reference["num_experts"],
        reference["num_experts_per_tok"],
        reference["moe_shared_expert_intermediate_size"] or 0,
    )
    return shape, reference, moe_layers


def _cost(shape: RegimeShape, base_fields: dict) -> dict:
    fields = {**base_fields, **shape.fields(), "mixer_type": "moe"}
    costs = mixer_accounting(fields)
    return {
        "params": costs["params"],
        "flops": costs["flops"],
        "all_to_all": costs["all_to_all_scalars"],
        "experts_ratio": shape.num_experts / shape.num_experts_per_tok,
    }


def _deviations(shape: RegimeShape, uniform: RegimeShape, base_fields: dict) -> dict:
    cost, reference = _cost(shape, base_fields), _cost(uniform, base_fields)
    return {key: cost[key] / reference[key] - 1.0 for key in cost}


def regime_candidates(
    uniform: RegimeShape,
    base_fields: dict,
    *,
    tolerance: float = 0.05,
    max_aspect_deviation: float = 0.3,
    multiple: int = 64,
    shared_multiple: int | None = None,
) -> list[tuple[RegimeShape, dict]]:
    """Every shape (l, m, N, K, m_s) whose per-layer cost stays within `tolerance` of `uniform`.

    l and m are multiples of `multiple`, l <= D, |l/m - 1| <= `max_aspect_deviation`; K is near 2 K0 l0 / (2 l)
    (communication), m near K0 l0 m0 / (K l) (routed compute), N near K N0 / K0 (ratio), and m_s, a multiple of
    `shared_multiple` (default `multiple`; 0 allowed), absorbs the latent-projection and router change.
    All four deviations (params, FLOPs, all-to-all, N/K) must be within `tolerance`.

    Returns:
        (shape, deviations) pairs; the uniform shape itself is among them when it is aligned.
    """
    d = base_fields["hidden_size"]
    c = 3 if base_fields.get("mlp_gated", True) else 2
    shared_multiple = multiple if shared_multiple is None else shared_multiple
    l0, m0, k0, n0 = (
        uniform.moe_latent_size,
        uniform.moe_intermediate_size,
        uniform.num_experts_per_tok,
        uniform.num_experts,
    )
    reference = _cost(uniform, base_fields)
    out, seen = [], set()
    for latent in range(multiple, d + 1, multiple):
        k_center = k0 * l0 / latent
        for k in range(max(1, math.floor(k_center * (1 - tolerance))), math.ceil(k_center * (1 + tolerance)) + 1):
            m_center = k0 * l0 * m0 / (k * latent) / multiple
            for m_steps in {math.floor(m_center), math.ceil(m_center)}:
                if m_steps < 1:
                    continue
                m = m_steps * multiple
                if abs(latent / m - 1) > max_aspect_deviation + 1e-12:
                    continue
                for n in {math.floor(k * n0 / k0), math.ceil(k * n0 / k0)}:
                    if n < k:
                        continue
                    # multiply-adds (FLOPs / 2) left for the shared expert's c D m_s
                    rest = reference["flops"] // 2 - c * k * latent * m - 2 * d * latent - d * n
                    shared_center = rest / (c * d) / shared_multiple
                    for shared_steps in {math.floor(shared_center), math.ceil(shared_center)}:
                        shape = RegimeShape(latent, m, n, k, max(0, shared_steps) * shared_multiple)
                        if shape in seen:
                            continue
                        seen.add(shape)
                        deviations = _deviations(shape, uniform, base_fields)
                        if all(abs(value) <= tolerance + 1e-12 for value in deviations.values()):
                            out.append((shape, deviations))
    return out


def _pick(candidates, uniform: RegimeShape, wide: bool, target_latent: int | None):
    """The regime's shape: wide raises l (q not below uniform), narrow lowers it (q not above uniform).

    Among those, the largest capacity contrast wins (wide: largest q = min(l, m), then largest l; narrow: smallest
    q, then smallest l), then the smallest worst-case deviation, then the most square shape (**choice**: the paper
    fixes the regimes by hand, section 4.2 and Table 1).
    """
    l0, q0 = uniform.moe_latent_size, uniform.rank_ceiling
    if wide:
        pool = [(s, dev) for s, dev in candidates if s.moe_latent_size > l0 and s.rank_ceiling >= q0]
    else:
        pool = [(s, dev) for s, dev in candidates if s.moe_latent_size < l0 and s.rank_ceiling <= q0]
    if target_latent is not None:
        pool = [(s, dev) for s, dev in pool if s.moe_latent_size == target_latent]
    if not pool:
        return None
    sign = -1 if wide else 1

    def key(item):
        shape, deviations = item
        worst = max(abs(v) for v in deviations.values())
        return (sign * shape.rank_ceiling, sign * shape.moe_latent_size, worst, shape.aspect_deviation)

    return min(pool, key=key)


def allocate_two_regime(
    config,
    profile: Sequence[float],
    *,
    split: int | None = None,
    tolerance: float = 0.05,
    max_aspect_deviation: float = 0.3,
    multiple: int = 64,
    shared_multiple: int | None = None,
    narrow_latent_size: int | None = None,
    wide_latent_size: int | None = None,
    depth_fraction: float = 2 / 3,
) -> Allocation:
    """Two-regime per-layer allocation of a uniform LatentMoE config from an ID profile.

    Args:
        config: uniform LatentMoE config (object, dict or path); every MoE layer must share l, m, N, K, m_s.
        profile: ID at each block boundary of the measured (base or proxy) model, as returned by
            `intrinsic_dimension_profile`: L_p + 1 values (entering blocks 0 .. L_p - 1, then the last block's
            output before the final norm). The split is found on the first L_p values and mapped to the target
            depth L by relative depth, round(t L / L_p), kept within [1, L - 1].
        split: first wide layer of the target config, overriding the profile's split (arXiv 2610.14644 reports the
            exact boundary matters little, section 5.3).
        tolerance: relative budget per layer for params, FLOPs per token, all-to-all volume and N/K (0.05).
        max_aspect_deviation: near-square bound |l/m - 1| of both regimes (0.3, section 4.2).
        multiple: alignment of l and m; `shared_multiple` that of m_s (defaults to `multiple`).
        narrow_latent_size, wide_latent_size: force the regimes' l (else: the most contrasting rank ceilings,
            smallest q for the prefix and largest for the rest, that meet every bound).
        depth_fraction: window of `find_split`.

    Returns:
        An `Allocation`; `allocation.config` is the new config dict: global MoE fields = wide regime,
        `per_layer_config` overrides for the narrow layers (and any pre-existing non-MoE overrides).

    Raises:
        ValueError: non-uniform or standard-MoE base, bad profile/split, or no shape meets the bounds (the message
            says which regime and what to relax).
    """
    data = config_to_dict(load_config(config))
    num_layers = data.get("num_hidden_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 2:
        raise ValueError(f"`num_hidden_layers` must be an integer >= 2, got {num_layers!r}.")
    if isinstance(tolerance, bool) or not 0 <= tolerance < 1:
        raise ValueError(f"`tolerance` must be in [0, 1), got {tolerance!r}.")
    uniform, base_fields, moe_layers = _uniform_moe_shape(data)
    values = tuple(float(v) for v in profile)
    if len(values) < 3:
        raise ValueError(f"`profile` must hold L_p + 1 >= 3 boundary values, got {len(values)}.")
    proxy_blocks = len(values) - 1
    if split is None:
        proxy_split = find_split(values[:proxy_blocks], depth_fraction)
        split = min(num_layers - 1, max(1, round(proxy_split * num_layers / proxy_blocks)))
    else:
        if isinstance(split, bool) or not isinstance(split, int) or not 1 <= split <= num_layers - 1:
            raise ValueError(f"`split` must be an integer in [1, {num_layers - 1}], got {split!r}.")
        proxy_split = min(proxy_blocks - 1, max(1, round(split * proxy_blocks / num_layers)))
    candidates = regime_candidates(
        uniform,
        base_fields,
        tolerance=tolerance,
        max_aspect_deviation=max_aspect_deviation,
        multiple=multiple,
        shared_multiple=shared_multiple,
    )
    picks = {}
    for regime, wide, target in (("narrow", False, narrow_latent_size), ("wide", True, wide_latent_size)):
        pick = _pick(candidates, uniform, wide, target)
        if pick is None:
            raise ValueError(
                f"No {regime} shape (l {'above' if wide else 'below'} the uniform l = {uniform.moe_latent_size}"
                f"{'' if target is None else f', l = {target}'}) keeps params, FLOPs, "
                f"all-to-all and N/K within {tolerance:.0%} of uniform with |l/m - 1| <= {max_aspect_deviation} "
                f"and l, m multiples of {multiple}; try a smaller `multiple`, a larger `tolerance`, or a base with "
                "more activated experts (K)."
            )
        picks[regime] = pick
    narrow, wide = picks["narrow"][0], picks["wide"][0]
    regimes = tuple(
        ("narrow" if idx < split else "wide") if idx in moe_layers else "dense" for idx in range(num_layers)
    )
    new = dict(data)
    new.update(wide.fields())
    per_layer = {}
    for idx, overrides in data["per_layer_config"].items():
        kept = {name: value for name, value in overrides.items() if name not in MOE_FIELDS}
        if kept:
            per_layer[idx] = kept
    for idx, regime in enumerate(regimes):
        if regime == "narrow":
            per_layer[idx] = {**per_layer.get(idx, {}), **narrow.fields()}
    new["per_layer_config"] = {str(idx).zfill(len(str(num_layers - 1))): per_layer[idx] for idx in sorted(per_layer)}
    if not per_layer:
        new.pop("per_layer_config")
    # Self-check on the written config: every MoE layer within the tolerance of the uniform layer.
    reference = _cost(uniform, base_fields)
    for idx in moe_layers:
        costs = mixer_accounting(layer_fields(new, idx), f"layer {idx}: ")
        for key, value in (
            ("params", costs["params"]),
            ("flops", costs["flops"]),
            ("all_to_all", costs["all_to_all_scalars"]),
        ):
            if abs(value / reference[key] - 1) > tolerance + 1e-12:
                raise AssertionError(f"layer {idx}: {key} {value} is outside {tolerance:.0%} of {reference[key]}")
    return Allocation(
        profile=values,
        proxy_split=proxy_split,
        split=split,
        uniform=uniform,
        narrow=narrow,
        wide=wide,
        layer_regimes=regimes,
        deviations={"narrow": picks["narrow"][1], "wide": picks["wide"][1]},
        tolerance=tolerance,
        config=new,
    )


def plot_allocation(allocation: Allocation, path: str) -> str:
    """Write a PNG of the ID profile (x: block boundary of the measured model) with the chosen split.

    Uses matplotlib's Agg backend (no display). Returns `path`.

    Raises:
        ImportError: matplotlib is missing (`pip install hf-mohd[shaping]`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = allocation.profile
    proxy_blocks = len(values) - 1
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(range(len(values)), values, marker="o", color="tab:blue", label="TwoNN ID")
    ax.axvspan(-0.5, allocation.proxy_split - 0.5, color="tab:orange", alpha=0.15, label="narrow prefix")
    ax.axvspan(allocation.proxy_split - 0.5, proxy_blocks - 0.5, color="tab:green", alpha=0.12, label="wide blocks")
    ax.axvline(allocation.proxy_split - 0.5, color="black", linestyle="--", linewidth=1)
    n, w = allocation.narrow, allocation.wide
    ax.set_title(
        f"split at block {allocation.proxy_split} of {proxy_blocks} (target layer {allocation.split}); "
        f"narrow l={n.moe_latent_size} m={n.moe_intermediate_size} K/N={n.num_experts_per_tok}/{n.num_experts}, "
        f"wide l={w.moe_latent_size} m={w.moe_intermediate_size} K/N={w.num_experts_per_tok}/{w.num_experts}",
        fontsize=7,
    )
    ax.set_xlabel("block boundary (hidden state entering block; last = before final norm)")
    ax.set_ylabel("intrinsic dimension (TwoNN)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_allocation(allocation: Allocation, output_dir: str) -> dict:
    """Write `config.json` (per-layer LatentMoE config), `allocation.json` (summary) and `id_profile.png`.

    The config is built and saved as a `LatentMoEConfig` when `hf_mohd.models.configuration_latent_moe` is
    importable (so the model's own validation runs); otherwise the dict is written as JSON.

    Returns:
        {"config": path, "allocation": path, "plot": path, "config_class": name or None}.
    """
    os.makedirs(output_dir, exist_ok=True)
    config_path = os.path.join(output_dir, "config.json")
    config_class = None
    try:
        from ..models.configuration_latent_moe import LatentMoEConfig
    except ImportError:
        LatentMoEConfig = None
    if LatentMoEConfig is not None:
        fields = {k: v for k, v in allocation.config.items() if k not in ("model_type", "transformers_version")}
        LatentMoEConfig(**fields).save_pretrained(output_dir)
        config_class = "LatentMoEConfig"
    else:
        with open(config_path, "w", encoding="utf-8") as handle:
            json.dump(allocation.config, handle, indent=2, sort_keys=True)
    summary_path = os.path.join(output_dir, "allocation.json")
    with open(summary_path, "w", encoding="utf-8") as handle:
        json.dump(allocation.summary(), handle, indent=2)
    plot_path = plot_allocation(allocation, os.path.join(output_dir, "id_profile.png"))
    return {"config": config_path, "allocation": summary_path, "plot": plot_path, "config_class": config_class}
