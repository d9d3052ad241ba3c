"""Item 4b: expert-shape sweep of LatentMoE at a fixed latent x width product l m.

Claim (arXiv 2610.14644 section 3.2, Figure 3): at fixed l m (so fixed routed parameters 3 N l m, activated MACs
3 K l m and per-expert rank ceiling trade-off q = min(l, m)), validation loss is U-shaped in the aspect ratio l / m
with its minimum near square (|l/m - 1| <= 0.4). Sweep around item 4a's alpha = 4 LatentMoE (N = 32, K = 8,
l m = 16 x 64 = 1024): l in {8, 16, 32, 64} with m = 1024 / l, i.e. l/m = 1/16, 1/4, 1 (square), 4. As in the
paper, the shared-expert width m_s absorbs the change of the latent projections (2 D l) so that mixer parameters
and activated MACs stay within 0.3% of each other. The l = 16 point is item 4a's alpha = 4 run (reused).
Seeds 0 and 1, all seed-0 runs first.

    nice -n 19 python -m bench.replication.latentmoe_shapes
"""

from bench.replication import latentmoe_alpha, runner


COMPARISON = "latentmoe_shapes"
D = runner.BASE["hidden_size"]
PRODUCT = 1024
LATENTS = (8, 16, 32, 64)


def at_latent(reference: dict, latent: int, width: int) -> dict:
    """`reference` (a LatentMoE architecture dict) with latent width l = `latent` at the same l m, the shared expert's
    width m_s absorbing the change of the latent projections, 2 D (l - l0), at 3 D parameters per channel (the
    shape sweep of arXiv 2610.14644 section 3.2 keeps mixer parameters and activated FLOPs matched this way).

    Raises:
        ValueError: `latent` does not divide the reference's l m.
    """
    product = reference["moe_latent_size"] * reference["moe_intermediate_size"]
    if product % latent:
        raise ValueError(f"at_latent: l = {latent} does not divide l m = {product}.")
    delta = 2 * width * (latent - reference["moe_latent_size"])
    return {
        **reference,
        "moe_latent_size": latent,
        "moe_intermediate_size": product // latent,
        "moe_shared_expert_intermediate_size": reference["moe_shared_expert_intermediate_size"]
        - round(delta / (3 * width)),
    }


def shape_architecture(latent: int) -> dict:
    """Item 4a's alpha = 4 LatentMoE with (l, m) = (latent, PRODUCT / latent) and m_s absorbing 2 D delta-l."""
    reference = latentmoe_alpha.latent_architecture(4)
    assert reference["moe_latent_size"] * reference["moe_intermediate_size"] == PRODUCT
    return at_latent(reference, latent, D)


def variant(latent: int):
    if latent == latentmoe_alpha.latent_architecture(4)["moe_latent_size"]:
        return latentmoe_alpha.latent_alpha4

    def make(seed: int):
        return runner.train_config(COMPARISON, f"l{latent}_m{PRODUCT // latent}", shape_architecture(latent), seed)

    return make


VARIANTS = {f"l{latent}_m{PRODUCT // latent}": variant(latent) for latent in LATENTS}


def accounting() -> dict:
    from hf_mohd.models.accounting import mixer_accounting

    out = {}
    for latent in LATENTS:
        fields = {k: v for k, v in shape_architecture(latent).items() if k != "model_type"}
        costs = mixer_accounting(fields)
        out[f"l{latent}_m{PRODUCT // latent}"] = {
            "aspect_l_over_m": latent / (PRODUCT // latent),
            "rank_ceiling_q": min(latent, PRODUCT // latent),
            "shared_expert_width": fields["moe_shared_expert_intermediate_size"],
            **{k: costs[k] for k in ("params", "activated_params", "all_to_all_scalars")},
        }
    return out


if __name__ == "__main__":
    runner.run_comparison(
        COMPARISON,
        "Item 4b: LatentMoE expert-shape sweep at fixed l*m = 1024 (N = 32, K = 8)",
        VARIANTS,
        {name: [0, 1] for name in VARIANTS},
        baseline="l16_m64",
        meta={
            "claim": "U-shaped validation loss over l/m at fixed l*m, minimum near square (arXiv 2610.14644 3.2)",
            "command": "nice -n 19 python -m bench.replication.latentmoe_shapes",
            "shapes": accounting(),
            "reused_runs": "l16_m64 is item 4a's latent_moe_alpha4",
        },
    )
