"""LatentMoE part of the replication study past the n-gram regime: alpha-transform, expert shapes, ID-guided allocation.

The claims (arXiv 2601.18089; arXiv 2610.14644 "Shaping Latent Mixture-of-Experts"):

1. Alpha-transform (2601.18089; 2610.14644 section 2): l = D / alpha, N' = alpha N, K' = alpha K at fixed expert
   width m keeps routed parameters, activated compute and all-to-all volume and improves quality (alpha = 4).
2. Expert shape (2610.14644 section 3.2): at fixed l m the loss is U-shaped in the aspect ratio l / m, lowest near
   square (|l/m - 1| <= 0.4).
3. ID-guided allocation (2610.14644 sections 4.2 and 5.3, Table 3): narrow near-square experts in the shallow blocks
   before the steepest rise of the intrinsic-dimension profile and wide ones in the rest, at matched per-layer cost,
   beat both uniform endpoints; the reversed allocations (wide-then-narrow at the same split, and the split mirrored
   in depth) are the controls.

Everything else is `study.py`'s (imported, one runner): the data and its validation / verdict halves, the budget
(1,000 steps x 16 x 128 tokens), the seeds, the learning-rate rule, the lock-file queue (`--workers`), `--scale`, the
pooled noise, TOST and Holm (over this file's p-values). Runs go to `runs/replication_v2/lmoe_*`, results to
`bench/results/replication/study_v2_latentmoe.{json,png,md}`.

Width. Measured cost (`--measure-cost`: CPU seconds of 20 training steps at the real shape, `time.process_time`,
one torch thread, after 2 warm-up steps, extrapolated to 1,000 steps; 2-core machine shared with two other training
runs), CPU seconds per run at width 128 / 256: standard MoE 259 / 671, alpha = 4 LatentMoE 347 / 862, shapes
l = D/8 471 / 1,195, l = D/2 312 / 768, l = D 356 / 817, the 8-layer square proxy 607 / 1,557 (every 8-layer
allocation arm counted at the proxy's cost). The suite is 35 runs: 16,159 CPU seconds (4.5 CPU-hours) at width 128,
40,917 (11.4 CPU-hours) at width 256, against a budget of about 4 CPU-hours, so width 256 does not fit and the base
is the study's width 128 (4 layers, 8 heads of 16, tied embeddings, vocabulary 2,048). `WIDTH` switches it (arm
names then start with `lmoe<WIDTH>_`). The 8-layer allocation arms are 60% of the cost.

Arms (every FFN a MoE layer whose activated width matches the dense FFN of 3 D; sigmoid routing with the
aux-loss-free bias update at rate 0.01, as round 1):
- `lmoe_standard`: standard fine-grained MoE, N = 8 experts of m = D, K = 2, shared expert m_s = D. Own sweep.
- `lmoe_alpha4`: `alpha_transform_fields(standard, 4)`: l = D/4, N = 32, K = 8, m = D; the shared expert narrowed
  to absorb the latent projections 2 D l and the 4x router (appendix B.2). The LatentMoE family's sweep.
- `lmoe_l{l}_m{m}`: the shape sweep at l m = D^2 / 4 (N = 32, K = 8) with l in D/8, D/4 (= `lmoe_alpha4`), D/2
  (square), D: aspect 1/16, 1/4, 1, 4; m_s absorbs 2 D delta-l (params and FLOPs matched; all-to-all 2 K l grows with
  l, as it must at fixed K).
- `lmoe_proxy`: the uniform square LatentMoE (l = m = D/2, N = 32, K = 8) at 8 layers, seed 0: after training, its
  TwoNN profile is measured on the validation set (`hf_mohd.shaping.collect_hidden_states`, 20,000 pooled tokens,
  5,000 kept, 10% of the ratios discarded, as `id_profile.py`) and `allocate_two_regime` (multiple 4, tolerance 5%)
  turns it into the allocation of the 8-layer arms:
- `lmoe_alloc_uniform_narrow`, `lmoe_alloc_uniform_wide`: the two regime shapes in every layer;
  `lmoe_alloc_id_guided`: narrow before the split, wide after; `lmoe_alloc_reversed`: wide before the split, narrow
  after; `lmoe_alloc_mirrored`: the ID-guided layers in reverse depth order (the narrow block at the output end).
  At width 128 the library picks narrow = l 44 x m 60 (N 48, K 12, m_s 96; q 44) and wide = l 84 x m 68 (N 24, K 6,
  m_s 52; q 68) around the uniform 64 x 64 (N 32, K 8, m_s 78). Until the proxy has finished, the three
  split-dependent arms are pending. The split is the library's `find_split` over the boundaries entering blocks
  0..7, the embedding boundary 0 included (whose TwoNN value is that of the distinct token vectors, see
  `id_profile.py`); the profile, its duplicate counts and the split are written into the results.

Every LatentMoE arm uses the `lmoe_alpha4` family's rate (chosen on the validation set of the 4-layer sweep, also for
the 8-layer arms); the standard MoE has its own sweep, so the alpha comparison does not favour either model's rate.

    nice -n 10 python -m bench.replication.study_latentmoe --workers 2     # train what is missing, then report
    python -m bench.replication.study_latentmoe --report                   # results from what exists
    nice -n 10 python -m bench.replication.study_latentmoe --measure-cost  # CPU seconds per run, both widths
"""

import json
import sys
import time
from functools import cache

from bench.replication import latentmoe_shapes, study


WIDTH = 128
PROXY_LAYERS = 8
ALPHA = 4
SHAPE_DIVISORS = (8, 4, 2, 1)  # l = D / divisor at l m = D^2 / 4: aspect 1/16, 1/4, 1, 4
ALLOCATION_MULTIPLE = 4  # l and m multiples of 4 (the library's default 64 leaves no near-square shape at D = 128)
MATCH_TOLERANCE = 0.05  # relative, per layer: the tolerance of `allocate_two_regime` (arXiv 2610.14644 section 4.2)
SPLIT_OVERRIDE = None  # first wide layer, only if the proxy's profile has no rise in its first 2/3 (`find_split`)
ID_POOL, ID_SAMPLES, ID_DISCARD = 20000, 5000, 0.1  # arXiv 2610.14644 appendix E.2
# Arm names carry the width when it is not the study's 128, so that runs of another width never share a folder.
PREFIX = "lmoe_" if WIDTH == 128 else f"lmoe{WIDTH}_"
FAMILY, STANDARD, PROXY = f"{PREFIX}alpha4", f"{PREFIX}standard", f"{PREFIX}proxy"
ALLOCATION_ARMS = ("uniform_narrow", "uniform_wide", "id_guided", "reversed", "mirrored")


def base(width: int = WIDTH, layers: int = 4) -> dict:
    """The study's dense shape at `width` (heads of 16, FFN 3 D) and depth `layers`."""
    return {
        **study.BASE,
        "hidden_size": width,
        "intermediate_size": 3 * width,
        "num_attention_heads": width // 16,
        "num_hidden_layers": layers,
    }


def standard_moe(width: int = WIDTH, layers: int = 4) -> dict:
    """Standard fine-grained MoE: N = 8 experts of m = D, K = 2 active, a shared expert m_s = D (K m + m_s = 3 D)."""
    return {
        "model_type": "latent_moe",
        **base(width, layers),
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": width,
        "moe_latent_size": None,
        "moe_shared_expert_intermediate_size": width,
        "router_score_func": "sigmoid",
        "router_bias_update_rate": 0.01,
    }


def alpha_transformed(width: int = WIDTH, layers: int = 4, alpha: int = ALPHA) -> dict:
    """`alpha_transform_fields` of the standard MoE, the shared expert narrowed by the added 2 D l + D (N' - N)."""
    from hf_mohd.shaping import alpha_transform_fields

    standard = standard_moe(width, layers)
    fields = alpha_transform_fields(standard, alpha)
    added = 2 * width * fields["moe_latent_size"] + width * (fields["num_experts"] - standard["num_experts"])
    fields["moe_shared_expert_intermediate_size"] = standard["moe_shared_expert_intermediate_size"] - round(
        added / (3 * width)
    )
    return fields


def shape(latent: int, width: int = WIDTH, layers: int = 4) -> dict:
    """The alpha-transformed LatentMoE with (l, m) = (latent, l0 m0 / latent), m_s absorbing 2 D (latent - l0)."""
    return latentmoe_shapes.at_latent(alpha_transformed(width, layers), latent, width)


def shape_name(latent: int, width: int = WIDTH) -> str:
    fields = shape(latent, width)
    return f"{PREFIX}l{latent}_m{fields['moe_intermediate_size']}"


def proxy_architecture(width: int = WIDTH) -> dict:
    """The uniform square LatentMoE (the shape sweep's l = m point) at `PROXY_LAYERS` layers: the allocation base."""
    return shape(width // 2, width, PROXY_LAYERS)


@cache
def regime_shapes(width: int = WIDTH):
    """The narrow and wide regime shapes of `allocate_two_regime` on the proxy architecture.

    They do not depend on the ID profile (only the split does), so the split is given explicitly here and the
    profile is a placeholder of the right length that the library does not read.
    """
    from hf_mohd.shaping import allocate_two_regime

    allocation = allocate_two_regime(
        proxy_architecture(width), [0.0] * (PROXY_LAYERS + 1), split=1, multiple=ALLOCATION_MULTIPLE
    )
    return allocation.narrow, allocation.wide


def layered(regimes: list[str], width: int = WIDTH) -> dict:
    """An 8-layer architecture with the wide shape as the global fields and `per_layer_config` for narrow layers."""
    narrow, wide = regime_shapes(width)
    if len(regimes) != PROXY_LAYERS or set(regimes) - {"narrow", "wide"}:
        raise ValueError(f"layered: {PROXY_LAYERS} regimes 'narrow'/'wide' expected, got {regimes}.")
    fields = {**proxy_architecture(width), **(narrow if all(r == "narrow" for r in regimes) else wide).fields()}
    overrides = {str(i): narrow.fields() for i, r in enumerate(regimes) if r == "narrow" and "wide" in regimes}
    return {**fields, "per_layer_config": overrides} if overrides else fields


def allocation_regimes(split: int) -> dict[str, list[str]]:
    """Per-layer regimes of the five allocation arms for a split (first wide layer of the ID-guided model).

    ID-guided: narrow for layers < split (arXiv 2610.14644 section 4.2). Reversed: the same split with the regimes
    swapped (wide first). Mirrored: the ID-guided sequence in reverse depth order, so that it has as many narrow layers
    as the ID-guided one, at the output end (Table 3's controls).
    """
    guided = ["narrow" if i < split else "wide" for i in range(PROXY_LAYERS)]
    return {
        "uniform_narrow": ["narrow"] * PROXY_LAYERS,
        "uniform_wide": ["wide"] * PROXY_LAYERS,
        "id_guided": guided,
        "reversed": ["wide" if r == "narrow" else "narrow" for r in guided],
        "mirrored": guided[::-1],
    }


def allocation_of(scale: int):
    """`allocate_two_regime` of the proxy architecture with the proxy run's measured profile (None before it ends)."""
    from hf_mohd.shaping import allocate_two_regime

    rate = study.chosen_lr(scale, FAMILY)
    proxy = study.summary_of(scale, PROXY, rate, 0) if rate is not None else None
    if proxy is None:
        return None
    try:
        return allocate_two_regime(
            proxy_architecture(), proxy["id_profile"], split=SPLIT_OVERRIDE, multiple=ALLOCATION_MULTIPLE
        )
    except ValueError as error:
        raise SystemExit(
            f"allocate_two_regime on the proxy's profile {proxy['id_profile']} failed: {error} "
            "Set SPLIT_OVERRIDE in bench/replication/study_latentmoe.py (and say so in the results) to go on."
        ) from error


def static_arms(width: int = WIDTH) -> dict:
    """Every arm that does not wait for the proxy (and the proxy itself)."""
    arms = {
        STANDARD: study.Arm(STANDARD, standard_moe(width), "standard MoE: 8 experts of m = D, K 2, shared m_s = D"),
        FAMILY: study.Arm(FAMILY, alpha_transformed(width), "alpha = 4 LatentMoE: l = D/4, 32 experts, K 8, m = D"),
    }
    for divisor in SHAPE_DIVISORS:
        latent = width // divisor
        fields = shape(latent, width)
        name = shape_name(latent, width)
        if fields["moe_latent_size"] == arms[FAMILY].architecture["moe_latent_size"]:
            continue  # the alpha = 4 arm is this point of the sweep
        aspect = latent / fields["moe_intermediate_size"]
        arms[name] = study.Arm(
            FAMILY, fields, f"shape sweep: l {latent} x m {fields['moe_intermediate_size']} (l/m {aspect:g})"
        )
    arms[PROXY] = study.Arm(
        FAMILY,
        proxy_architecture(width),
        f"ID proxy: uniform square l = m = {width // 2}, {PROXY_LAYERS} layers (seed 0; its TwoNN profile sets the split)",
        seeds=(0,),
    )
    return arms


def arms(scale: int) -> dict:
    """`static_arms` plus the five 8-layer allocation arms (the split-dependent ones pending until the proxy ends)."""
    out = static_arms()
    allocation = allocation_of(scale)
    regimes = allocation_regimes(allocation.split) if allocation is not None else None
    for name in ALLOCATION_ARMS:
        known = regimes is not None or name.startswith("uniform")
        sequence = (regimes or allocation_regimes(1))[name]
        text = " ".join("n" if r == "narrow" else "W" for r in sequence) if known else "pending the proxy's profile"
        out[f"{PREFIX}alloc_{name}"] = study.Arm(
            FAMILY, layered(sequence) if known else None, f"allocation {name}: layers {text}"
        )
    return out


def jobs(scale: int) -> list[tuple[str, float | None, int]]:
    """Sweeps first, then the proxy, then each claim's arms seed-major."""
    order = [(family, lr, 0) for family in (FAMILY, STANDARD) for lr in study.sweep_grid(scale, family)]
    order.append((PROXY, None, 0))
    order += [(arm, None, seed) for arm in (FAMILY, STANDARD) for seed in study.SEEDS]
    shapes = [name for name in static_arms() if name.startswith(f"{PREFIX}l")]
    for seed in study.SEEDS:
        order += [(arm, None, seed) for arm in shapes]
    for seed in study.SEEDS:
        order += [(f"{PREFIX}alloc_{name}", None, seed) for name in ALLOCATION_ARMS]
    return order


def measure_id_profile(model, loaded: dict) -> dict:
    """TwoNN profile of a trained model on the validation blocks (the verdict set is never read), as `id_profile.py`."""
    from hf_mohd.shaping import collect_hidden_states, intrinsic_dimension_profile

    model.eval()
    hidden = collect_hidden_states(
        model, loaded["blocks"]["validation"], max_tokens=ID_POOL, num_samples=ID_SAMPLES, batch_size=16, seed=0
    )
    profile, duplicates = intrinsic_dimension_profile(hidden, ID_DISCARD, return_duplicates=True)
    return {
        "id_profile": profile,
        "id_profile_duplicates": duplicates,
        "id_profile_points": int(hidden.shape[1]),
        "id_profile_protocol": f"validation blocks, {ID_POOL} pooled tokens, {ID_SAMPLES} kept (seed 0), "
        f"TwoNN discarding {ID_DISCARD:.0%} of the ratios; boundary i < L enters block i, boundary L is the last "
        "block's output before the final norm",
    }


COMPARISONS = (
    (
        "alpha4_vs_standard",
        FAMILY,
        STANDARD,
        "the alpha = 4 LatentMoE improves on the standard MoE at matched cost (arXiv 2601.18089; 2610.14644 s. 2)",
        None,
    ),
)


def _comparisons() -> tuple:
    square = shape_name(WIDTH // 2)
    others = [shape_name(WIDTH // d) for d in SHAPE_DIVISORS if d != 2]
    out = list(COMPARISONS)
    for other in others:
        arm = FAMILY if other == shape_name(WIDTH // ALPHA) else other
        out.append(
            (
                f"square_vs_{arm.removeprefix(PREFIX)}",
                square,
                arm,
                "the square expert beats this aspect at fixed l m (U-shape, minimum near square; 2610.14644 s. 3.2)",
                None,
            )
        )
    out.append(
        (
            f"{FAMILY.removeprefix(PREFIX)}_vs_{others[0].removeprefix(PREFIX)}",
            FAMILY,
            others[0],
            "aspect 1/4 beats 1/16 (the U's falling branch left of square; 2610.14644 s. 3.2)",
            None,
        )
    )
    for control in ("uniform_narrow", "uniform_wide", "reversed", "mirrored"):
        claim = (
            "ID-guided allocation beats the uniform endpoint (2610.14644 s. 4.2, 5.3)"
            if control.startswith("uniform")
            else "ID-guided allocation beats its reversed control (2610.14644 Table 3)"
        )
        out.append((f"id_guided_vs_{control}", f"{PREFIX}alloc_id_guided", f"{PREFIX}alloc_{control}", claim, None))
    return tuple(out)


def _relative(value: int, reference: int) -> float:
    return value / reference - 1.0


def accounting_match(scale: int) -> dict:
    """Relative deviations of the compared arms' costs (library accounting), and whether they are within tolerance.

    alpha: routed-expert parameters, mixer parameters, activated FLOPs per token and all-to-all scalars of the alpha
    arm vs the standard MoE (all matched). shapes: routed params, mixer params and FLOPs vs the alpha arm (all-to-all
    varies as 2 K l, reported). allocation: per layer, mixer params, mixer FLOPs and all-to-all of every layer of
    every allocation arm vs the uniform square layer of the proxy architecture (the library's 5% rule).
    """
    from hf_mohd.models.accounting import mixer_accounting, model_accounting

    arm_set = arms(scale)

    def totals(name):
        return study.accounting_of(name, arm_set)

    out = {"tolerance": MATCH_TOLERANCE, "alpha": {}, "shapes": {}, "allocation": {}}
    reference = totals(STANDARD)
    alpha = totals(FAMILY)
    out["alpha"] = {
        key: _relative(alpha[key], reference[key])
        for key in ("routed_expert_params", "mixer_params", "flops_per_token", "all_to_all_scalars", "total_params")
    }
    for name in arm_set:
        if name.startswith(f"{PREFIX}l"):
            costs = totals(name)
            out["shapes"][name] = {
                **{
                    key: _relative(costs[key], alpha[key])
                    for key in ("routed_expert_params", "mixer_params", "flops_per_token", "total_params")
                },
                "all_to_all_scalars_ratio": costs["all_to_all_scalars"] / alpha["all_to_all_scalars"],
            }
    fields = {k: v for k, v in proxy_architecture().items() if k != "model_type"}
    uniform = mixer_accounting(fields)
    for name, arm in arm_set.items():
        if not name.startswith(f"{PREFIX}alloc_") or arm.architecture is None:
            continue
        config = {**arm.architecture, "vocab_size": study.runner.BUDGET["vocab_size"]}
        layers = model_accounting(config).layers
        worst = {
            "params": max(abs(_relative(layer.mixer_params, uniform["params"])) for layer in layers),
            "flops": max(abs(_relative(layer.mixer_flops, uniform["flops"])) for layer in layers),
            "all_to_all": max(
                abs(_relative(layer.all_to_all_scalars, uniform["all_to_all_scalars"])) for layer in layers
            ),
        }
        out["allocation"][name] = {"worst_layer_deviation": worst, **totals(name)}
    checked = [abs(v) for k, v in out["alpha"].items()]
    checked += [abs(v) for row in out["shapes"].values() for k, v in row.items() if k != "all_to_all_scalars_ratio"]
    checked += [v for row in out["allocation"].values() for v in row["worst_layer_deviation"].values()]
    out["within_tolerance"] = max(checked) <= MATCH_TOLERANCE + 1e-12
    return out


def extend(scale: int, results: dict) -> str:
    """Adds the accounting match, the proxy's ID profile and the allocation to the results; returns their tables."""
    match = accounting_match(scale)
    results["accounting_match"] = match
    allocation = allocation_of(scale)
    narrow, wide = regime_shapes()
    results["allocation"] = (
        {**allocation.summary(), "split_override": SPLIT_OVERRIDE}
        if allocation is not None
        else {
            "split": None,
            "narrow": narrow.fields(),
            "wide": wide.fields(),
            "note": "pending the proxy run's ID profile",
        }
    )
    lines = [
        f"Accounting (library `model_accounting`; tolerance {MATCH_TOLERANCE:.0%}, "
        f"{'all within' if match['within_tolerance'] else 'NOT all within'}):",
        "",
        "| arm | total params | routed-expert params | mixer params | FLOPs/token | all-to-all scalars/token |",
        "|---|---|---|---|---|---|",
    ]
    for name, arm in results["arms"].items():
        acc = arm["accounting"]
        lines.append(
            f"| {name} | {study._count(acc['total_params'])} | {study._count(acc.get('routed_expert_params'))} | "
            f"{study._count(acc.get('mixer_params'))} | {study._count(acc['flops_per_token'])} | "
            f"{study._count(acc.get('all_to_all_scalars'))} |"
        )
    lines += [
        "",
        "Relative deviations: alpha vs standard " + json.dumps({k: round(v, 4) for k, v in match["alpha"].items()}),
    ]
    for name, row in match["shapes"].items():
        lines.append(f"- {name} vs {FAMILY}: " + json.dumps({k: round(v, 4) for k, v in row.items()}))
    for name, row in match["allocation"].items():
        worst = {k: round(v, 4) for k, v in row["worst_layer_deviation"].items()}
        lines.append(f"- {name}: worst layer vs the uniform square layer {json.dumps(worst)}")
    summary = results["allocation"]
    lines += [
        "",
        f"Allocation: narrow {json.dumps(summary['narrow'])}, wide {json.dumps(summary['wide'])}, "
        f"split {summary['split']}"
        + (f", proxy profile {[round(v, 2) for v in summary['profile']]}" if summary.get("profile") else ""),
    ]
    return "\n".join(lines)


SUITE = study.Suite(
    name="study_v2_latentmoe",
    title=f"LatentMoE claims past the n-gram regime (width-{WIDTH} base, 2.05M tokens, 3 seeds)",
    script="bench.replication.study_latentmoe",
    arms=arms,
    jobs=jobs,
    swept=(FAMILY, STANDARD),
    comparisons=_comparisons(),
    post_train={PROXY: measure_id_profile},
    extend=extend,
)


def _cpu_seconds(architecture: dict, blocks, steps: int) -> float:
    """CPU seconds (`time.process_time`) of `steps` AdamW training steps of a fresh model, after 2 warm-up steps."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_mohd  # noqa: F401  (registers the model types)

    fields = {k: v for k, v in architecture.items() if k != "model_type"}
    config = AutoConfig.for_model("latent_moe", **fields, vocab_size=study.runner.BUDGET["vocab_size"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = study.BUDGET["micro_batch_size"]
    start = 0.0
    for index in range(steps + 2):
        if index == 2:
            start = time.process_time()
        ids = blocks[(index * batch) % (len(blocks) - batch) :][:batch]
        model(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.update_router_biases()
    return time.process_time() - start


def measure_cost(steps: int = 20, widths: tuple = (128, 256)) -> dict:
    """CPU seconds (one torch thread) of `steps` training steps of each distinct shape of this file at each width,
    extrapolated to the study's steps, and the suite's total: each arm's runs (a swept arm: one per rate plus its
    other seeds; the proxy once; every allocation arm at the proxy's 8-layer cost) times its cost per run."""
    import torch

    torch.set_num_threads(1)
    blocks = study.data(1)["blocks"]["train"]
    out = {"steps_timed": steps, "full_steps": study.BUDGET["max_steps"], "torch_threads": 1, "widths": {}}
    seeds, rates = len(study.SEEDS), len(study.LR_GRID)
    for width in widths:
        shapes = {STANDARD: standard_moe(width), FAMILY: alpha_transformed(width)}
        shapes.update({shape_name(width // d, width): shape(width // d, width) for d in SHAPE_DIVISORS if d != ALPHA})
        shapes[PROXY] = proxy_architecture(width)
        per_run, runs = {}, {}
        for name, architecture in shapes.items():
            seconds = _cpu_seconds(architecture, blocks, steps)
            per_run[name] = seconds * study.BUDGET["max_steps"] / steps
            runs[name] = rates + seeds - 1 if name in (STANDARD, FAMILY) else 1 if name == PROXY else seeds
            print(f"width {width} {name}: {seconds:.2f} CPU s / {steps} steps -> {per_run[name]:.0f} s per run")
        runs["allocation arms (at the proxy's cost)"] = len(ALLOCATION_ARMS) * seeds
        per_run["allocation arms (at the proxy's cost)"] = per_run[PROXY]
        total = sum(runs[name] * per_run[name] for name in runs)
        out["widths"][str(width)] = {"cpu_seconds_per_run": per_run, "runs": runs, "total_cpu_hours": total / 3600}
        print(f"width {width}: {sum(runs.values())} runs, about {total / 3600:.1f} CPU-hours", flush=True)
    return out


def main() -> None:
    if "--measure-cost" in sys.argv:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        result = measure_cost()
        path = study.RESULTS / "study_v2_latentmoe_cost.json"
        study.RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")
        return
    study.main(SUITE, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    main()
