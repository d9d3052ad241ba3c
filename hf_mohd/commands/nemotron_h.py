"""`hf-mohd nemotron-h`: export a LatentMoE model to transformers' Nemotron-H format, or import one back.

`hf-mohd nemotron-h export LATENT_MOE_FOLDER OUTPUT` writes a folder `NemotronHForCausalLM.from_pretrained` (and
vLLM / SGLang) loads; `hf-mohd nemotron-h import NEMOTRON_H_FOLDER OUTPUT` writes a LatentMoE folder (with
`auto_map` and code). Both keep the logits (DESIGN section 4, "Interop"); the work is done by
`hf_mohd.interop.nemotron_h`.
"""

from __future__ import annotations


DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "nemotron-h", help="Export LatentMoE to Nemotron-H (NemotronHForCausalLM) or import Nemotron-H as LatentMoE."
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    export = actions.add_parser(
        "export",
        help="LatentMoE folder -> Nemotron-H folder (needs position_embedding_type='none', mlp_gated=False, "
        "sigmoid routing, a shared expert and one expert shape for all MoE layers).",
    )
    export.add_argument("source", help="Folder saved from a LatentMoEForCausalLM.")
    export.add_argument("output", help="Folder to write.")
    export.add_argument("--overwrite", action="store_true", help="Replace OUTPUT if it exists.")
    export.set_defaults(func=run_export)
    imp = actions.add_parser(
        "import", help="Nemotron-H folder whose blocks alternate full_attention and moe | mlp -> LatentMoE folder."
    )
    imp.add_argument("source", help="Folder that NemotronHForCausalLM.from_pretrained reads.")
    imp.add_argument("output", help="Folder to write.")
    imp.add_argument("--dtype", choices=DTYPES, help="dtype to load the weights in (default: the checkpoint's).")
    imp.add_argument("--overwrite", action="store_true", help="Replace OUTPUT if it exists.")
    imp.set_defaults(func=run_import)


def run_export(args) -> int:
    from hf_mohd.interop.nemotron_h import NemotronHInteropError, export_to_nemotron_h

    try:
        out = export_to_nemotron_h(args.source, args.output, overwrite=args.overwrite)
    except (NemotronHInteropError, FileExistsError) as error:
        print(f"error: {error}")
        return 1
    print(f"Nemotron-H checkpoint written to {out}")
    return 0


def run_import(args) -> int:
    import torch

    from hf_mohd.interop.nemotron_h import NemotronHInteropError, import_from_nemotron_h

    kwargs = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}
    try:
        import_from_nemotron_h(args.source, args.output, overwrite=args.overwrite, **kwargs)
    except (NemotronHInteropError, FileExistsError) as error:
        print(f"error: {error}")
        return 1
    print(f"LatentMoE checkpoint written to {args.output}")
    return 0
