"""`hf-mohd nemotron-h`: export a LatentMoE model to transformers' Nemotron-H format, or import one back.

`hf-mohd nemotron-h export LATENT_MOE_FOLDER OUTPUT` writes a folder `NemotronHForCausalLM.from_pretrained` (and
vLLM / SGLang) loads; `hf-mohd nemotron-h import NEMOTRON_H_FOLDER OUTPUT` writes a LatentMoE folder (with
`auto_map` and code). Both keep the logits (docs/design.md section 4, "Interop"); the work is done by
`hf_mohd.interop.nemotron_h`. `hf-mohd nemotron-h gguf LATENT_MOE_FOLDER OUTPUT.gguf` writes a GGUF file for
llama.cpp through llama.cpp's own converter (`hf_mohd.interop.gguf_export`).
"""

from __future__ import annotations


DTYPES = ("float32", "bfloat16", "float16")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # hf_mohd.interop.gguf_export.OUTTYPES (kept import-free for --help)


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
    gguf = actions.add_parser(
        "gguf",
        help="LatentMoE folder (with its tokenizer) -> GGUF file for llama.cpp / llama-cpp-python, through "
        "llama.cpp's convert_hf_to_gguf.py (every layer MoE, relu2, and the Nemotron-H requirements of `export`).",
    )
    gguf.add_argument("source", help="Folder saved from a LatentMoEForCausalLM, with its tokenizer files.")
    gguf.add_argument("output", help="GGUF file to write.")
    gguf.add_argument("--outtype", choices=OUTTYPES, default="f32", help="Weight type of the GGUF (default: f32).")
    gguf.add_argument("--tokenizer", help="Folder of the tokenizer to embed (default: the one in SOURCE).")
    gguf.add_argument(
        "--converter",
        help="Folder with llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/ (default: "
        "$HF_MOHD_LLAMA_CPP_CONVERTER or <env>/share/hf-mohd/llama.cpp-convert, installed by scripts/setup.sh).",
    )
    gguf.add_argument("--overwrite", action="store_true", help="Replace OUTPUT if it exists.")
    gguf.set_defaults(func=run_gguf)


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


def run_gguf(args) -> int:
    from hf_mohd.interop.gguf_export import export_to_gguf

    try:
        out = export_to_gguf(
            args.source,
            args.output,
            outtype=args.outtype,
            tokenizer=args.tokenizer,
            converter_dir=args.converter,
            overwrite=args.overwrite,
        )
    except (ValueError, FileExistsError, FileNotFoundError) as error:
        print(f"error: {error}")
        return 1
    print(f"GGUF ({args.outtype}) written to {out}")
    return 0
