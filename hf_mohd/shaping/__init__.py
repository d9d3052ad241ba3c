"""Shaping and allocation tools of arXiv 2610.14644 for LatentMoE (docs/design.md section 4).

- config_io: configs from objects, dicts or paths, and the accounting (`hf_mohd.models.accounting`) as a table;
- shapes: the alpha-transform of a standard MoE and the near-square (l, m) proposer;
- intrinsic_dimension: TwoNN and hidden-state collection at every block boundary of any causal LM;
- allocation: ID-guided two-regime per-layer allocation, written as a per-layer config plus a PNG plot.

Only `intrinsic_dimension` needs torch at import; the plot needs matplotlib (`pip install hf-mohd[shaping]`).
"""

from .allocation import Allocation, RegimeShape, allocate_two_regime, find_split, plot_allocation, write_allocation
from .config_io import alpha_transform_summary, config_to_dict, format_accounting, load_config
from .intrinsic_dimension import (
    collect_hidden_states,
    intrinsic_dimension_profile,
    nearest_neighbour_distances,
    tokenize_texts,
    twonn,
)
from .shapes import ExpertShape, alpha_transform, alpha_transform_fields, propose_shape, propose_shapes


__all__ = [
    "Allocation",
    "ExpertShape",
    "RegimeShape",
    "allocate_two_regime",
    "alpha_transform",
    "alpha_transform_summary",
    "alpha_transform_fields",
    "collect_hidden_states",
    "config_to_dict",
    "find_split",
    "format_accounting",
    "intrinsic_dimension_profile",
    "load_config",
    "nearest_neighbour_distances",
    "plot_allocation",
    "propose_shape",
    "propose_shapes",
    "tokenize_texts",
    "twonn",
    "write_allocation",
]
