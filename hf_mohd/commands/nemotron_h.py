"""`hf-mohd nemotron-h`: export a LatentMoE model to transformers' Nemotron-H format, or import one back.

`hf-mohd nemotron-h export LATENT_MOE_FOLDER OUTPUT` writes a folder `NemotronHForCausalLM.from_pretrained` (and
vLLM / SGLang) loads; `hf-mohd nemotron-h import NEMOTRON_H_FOLDER OUTPUT` writes a LatentMoE folder (with
`auto_map` and code). Both keep the logits (docs/design.md section 4, "Interop"); the work is done by
`hf_mohd.interop.nemotron_h`. `hf-mohd nemotron-h gguf LATENT_MOE_FOLDER OUTPUT.gguf` writes a GGUF file for
llama.cpp through llama.cpp's own converter (`hf_mohd.interop.gguf_export`).
"""

from __future__ import annotations

from . import add_command


DTYPES = ("float32", "bfloat16", "float16")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # hf_mohd.interop.gguf_export.OUTTYPES (kept import-free for --help)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "nemotron-h", help="Export LatentMoE to Nemotron-H (NemotronHForCausalLM) or import Nemotron-H as LatentMoE."
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    export = add_command(actions, "export", run_export)
    export.add_argument("source", help="Folder saved from a LatentMoEForCausalLM.")
    export.add_argument("output", help="Folder to write.")
    export.add_argument("--overwrite", action="store_true", help="Replace OUTPUT if it exists.")
    imp = add_command(actions, "import", run_import)
    imp.add_argument("source", help="Folder that NemotronHForCausalLM.from_pretrained reads.")
    imp.add_argument("output", help="Folder to write.")
    imp.add_argument("--dtype", choices=DTYPES, help="dtype to load the weights in (default: the checkpoint's).")
    imp.add_argument("--overwrite", action="store_true", help="Replace OUTPUT if it exists.")
    gguf = add_command(actions, "gguf", run_gguf)
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


def _write(what: str, errors: tuple[type[Exception], ...], write, *args, **kwargs) -> int:
    """Calls `write(*args, **kwargs)` and prints `<what> written to <its result>` (exit status 0); one of `errors`
    (the writer's errors of the input) prints `error: <message>` instead (exit status 1)."""
    try:
        out = write(*args, **kwargs)
    except errors as error:
        print(f"error: {error}")
        return 1
    print(f"{what} written to {out}")
    return 0


def run_export(args) -> int:
    """LatentMoE folder -> Nemotron-H folder (needs position_embedding_type='none', mlp_gated=False,
    sigmoid routing, a shared expert and one expert shape for all MoE layers)."""
    from hf_mohd.interop.nemotron_h import NemotronHInteropError, export_to_nemotron_h

    errors = (NemotronHInteropError, FileExistsError)
    return _write(
        "Nemotron-H checkpoint", errors, export_to_nemotron_h, args.source, args.output, overwrite=args.overwrite
    )


def run_import(args) -> int:
    """Nemotron-H folder whose blocks alternate full_attention and moe | mlp -> LatentMoE folder."""
    import torch

    from hf_mohd.interop.nemotron_h import NemotronHInteropError, import_from_nemotron_h

    kwargs = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}

    def write() -> str:
        import_from_nemotron_h(args.source, args.output, overwrite=args.overwrite, **kwargs)
        return args.output

    return _write("LatentMoE checkpoint", (NemotronHInteropError, FileExistsError), write)


def run_gguf(args) -> int:
    """LatentMoE folder (with its tokenizer) -> GGUF file for llama.cpp / llama-cpp-python, through
    llama.cpp's convert_hf_to_gguf.py (every layer MoE, relu2, and the Nemotron-H requirements of `export`)."""
    from hf_mohd.interop.gguf_export import export_to_gguf

    return _write(
        f"GGUF ({args.outtype})",
        (ValueError, FileExistsError, FileNotFoundError),
        export_to_gguf,
        args.source,
        args.output,
        outtype=args.outtype,
        tokenizer=args.tokenizer,
        converter_dir=args.converter,
        overwrite=args.overwrite,
    )
