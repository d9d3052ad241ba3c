"""`hf-mohd nemotron-h import NEMOTRON_H_FOLDER OUTPUT`: a transformers Nemotron-H folder as a LatentMoE folder
(with `auto_map` and code), with the same logits (docs/design.md section 4, "Interop"; `hf_mohd.interop.nemotron_h`).

The exports live under `hf-mohd export` (`export nemotron-h`, `export gguf`); `hf-mohd nemotron-h export` and
`hf-mohd nemotron-h gguf` are their deprecated aliases, kept for one release.
"""

from __future__ import annotations

from . import add_command, add_deprecated_alias, check_model_folder, check_weights
from .export import add_gguf_arguments, add_nemotron_h_arguments, check_config, run_export, run_gguf, write_output


DTYPES = ("float32", "bfloat16", "float16")
NEMOTRON_H = dict(model_types=("nemotron_h",), label="a Nemotron-H folder (NemotronHForCausalLM)")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "nemotron-h", help="Import Nemotron-H as LatentMoE (the exports are `hf-mohd export nemotron-h | gguf`)."
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    add_import_arguments(add_command(actions, "import", run_import))
    export = add_deprecated_alias(
        actions, "export", run_export, "hf-mohd export nemotron-h", old="hf-mohd nemotron-h export"
    )
    add_nemotron_h_arguments(export)
    add_gguf_arguments(
        add_deprecated_alias(actions, "gguf", run_gguf, "hf-mohd export gguf", old="hf-mohd nemotron-h gguf")
    )


def add_import_arguments(parser):
    """The arguments of `hf-mohd nemotron-h import` (and of `conversion/convert_nemotron_h_to_latent_moe.py`)."""
    parser.add_argument("source", help="Folder that NemotronHForCausalLM.from_pretrained reads.")
    parser.add_argument("output", help="Folder to write.")
    parser.add_argument("--dtype", choices=DTYPES, help="dtype to load the weights in (default: the checkpoint's).")
    parser.add_argument("--overwrite", action="store_true", help="Replace OUTPUT if it exists.")
    return parser


def run_import(args) -> int:
    """Nemotron-H folder whose blocks alternate full_attention and moe | mlp -> LatentMoE folder.

    Bad input prints `error: <path>: <what was expected>`: no such SOURCE (exit status 3), a SOURCE that is not a
    Nemotron-H folder (4), truncated or garbage weights (5), a config field out of range or a block pattern LatentMoE
    cannot express, e.g. Mamba blocks (6), an existing OUTPUT without --overwrite (8).
    """
    import torch
    from transformers import NemotronHConfig

    from hf_mohd.interop.nemotron_h import import_from_nemotron_h, latent_moe_config_from_nemotron_h

    check_model_folder(args.source, **NEMOTRON_H, weights=False)
    check_config(args.source, latent_moe_config_from_nemotron_h, NemotronHConfig)
    check_weights(args.source)
    kwargs = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}

    def write() -> str:
        import_from_nemotron_h(args.source, args.output, overwrite=args.overwrite, **kwargs)
        return args.output

    return write_output("LatentMoE checkpoint", args.source, write)
