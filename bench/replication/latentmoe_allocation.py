"""Item 4c: ID-guided two-regime allocation vs both uniform endpoints.

Claim (arXiv 2610.14644 sections 4.2 and 5.3, Table 3): giving the shallow blocks (before the ID profile's steepest
rise) a narrow near-square expert shape and the remaining blocks a wide one, at matched per-layer parameters,
activated MACs and all-to-all volume, beats both uniform models (all narrow, all wide).

The allocation is the library's `allocate_two_regime` applied to the square LatentMoE of item 4b (l = m = 32,
N = 32, K = 8), with the intrinsic-dimension profile of item 1 (SmolLM2-135M, the "base model" proxy; its split is
mapped to the 4-layer target by relative depth), l and m multiples of 4 (the default 64 does not fit a 64-wide
model) and the default 5% tolerance. The two uniform endpoints use the narrow and the wide shape in every layer.
Seeds 0 and 1, all seed-0 runs first.

    nice -n 19 python -m bench.replication.latentmoe_allocation

(needs bench/results/replication/id_profile.json from `python -m bench.replication.id_profile`).
"""

import json

from bench.replication import latentmoe_shapes, runner


COMPARISON = "latentmoe_allocation"
MULTIPLE = 4


def allocation():
    from hf_mohd.shaping import allocate_two_regime

    profile = json.loads((runner.RESULTS / "id_profile.json").read_text(encoding="utf-8"))["intrinsic_dimension"]
    base = latentmoe_shapes.shape_architecture(32)
    return allocate_two_regime(base, profile, multiple=MULTIPLE)


def uniform(regime: str):
    def make(seed: int):
        shape = getattr(allocation(), regime)
        architecture = {**latentmoe_shapes.shape_architecture(32), **shape.fields()}
        return runner.train_config(COMPARISON, f"uniform_{regime}", architecture, seed)

    return make


def id_guided(seed: int):
    config = allocation().config
    architecture = {**latentmoe_shapes.shape_architecture(32), **config}
    architecture = {k: v for k, v in architecture.items() if k in set(config) | {"model_type"}}
    return runner.train_config(COMPARISON, "id_guided", architecture, seed)


VARIANTS = {"uniform_narrow": uniform("narrow"), "uniform_wide": uniform("wide"), "id_guided": id_guided}


if __name__ == "__main__":
    chosen = allocation()
    runner.run_comparison(
        COMPARISON,
        "Item 4c: ID-guided two-regime LatentMoE vs uniform narrow / uniform wide (matched per-layer cost)",
        VARIANTS,
        {name: [0, 1] for name in VARIANTS},
        baseline="uniform_wide",
        meta={
            "claim": "ID-guided narrow-prefix / wide-rest allocation beats both uniform endpoints (arXiv 2610.14644)",
            "command": "nice -n 19 python -m bench.replication.latentmoe_allocation",
            "allocation": chosen.summary(),
        },
    )
