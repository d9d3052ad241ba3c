"""`hf-mohd export`: write a LatentMoE model in another format, for the engines that serve it.

`hf-mohd export nemotron-h LATENT_MOE_FOLDER OUTPUT` writes a folder `NemotronHForCausalLM.from_pretrained` (and
vLLM / SGLang) loads, with the same logits (docs/design.md section 4, "Interop"; `hf_mohd.interop.nemotron_h`).
`hf-mohd export gguf LATENT_MOE_FOLDER OUTPUT.gguf` writes a GGUF file for llama.cpp through llama.cpp's own
converter (`hf_mohd.interop.gguf_export`). The way back from Nemotron-H is `hf-mohd nemotron-h import`.
`hf-mohd nemotron-h export` and `hf-mohd nemotron-h gguf` are deprecated aliases of these (kept for one release).
"""

from __future__ import annotations

import os

from . import CommandError, add_command, check_model_folder, check_weights


OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # hf_mohd.interop.gguf_export.OUTTYPES (kept import-free for --help)
LATENT_MOE = dict(model_types=("latent_moe",), label="a LatentMoE folder saved by save_pretrained")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="Export a LatentMoE model: a Nemotron-H folder (vLLM, SGLang) or a GGUF file (llama.cpp)."
    )
    formats = parser.add_subparsers(dest="format", metavar="FORMAT", required=True)
    add_nemotron_h_arguments(add_command(formats, "nemotron-h", run_export))
    add_gguf_arguments(add_command(formats, "gguf", run_gguf))


def add_nemotron_h_arguments(parser):
    """The arguments of `hf-mohd export nemotron-h` (and of its deprecated alias)."""
    parser.add_argument("source", help="Folder saved from a LatentMoEForCausalLM.")
    parser.add_argument("output", help="Folder to write.")
    parser.add_argument("--overwrite", action="store_true", help="Replace OUTPUT if it exists.")
    return parser


def add_gguf_arguments(parser):
    """The arguments of `hf-mohd export gguf` (and of its deprecated alias)."""
    parser.add_argument("source", help="Folder saved from a LatentMoEForCausalLM, with its tokenizer files.")
    parser.add_argument("output", help="GGUF file to write.")
    parser.add_argument("--outtype", choices=OUTTYPES, default="f32", help="Weight type of the GGUF.")
    parser.add_argument("--tokenizer", help="Folder of the tokenizer to embed (default: the one in SOURCE).")
    parser.add_argument(
        "--converter",
        help="Folder with llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/ (default: "
        "$HF_MOHD_LLAMA_CPP_CONVERTER or <env>/share/hf-mohd/llama.cpp-convert, installed by scripts/setup.sh).",
    )
    parser.add_argument("--overwrite", action="store_true", help="Replace OUTPUT if it exists.")
    return parser


def write_output(what: str, source: str, write, *args, **kwargs) -> int:
    """Calls `write(*args, **kwargs)` and prints `<what> written to <its result>` (exit status 0).

    Raises:
        CommandError: exists (the output exists without --overwrite); config (a `NemotronHInteropError` or
            `LlamaCppExportError`: a choice of `source`'s config.json the target format cannot express), failed
            (llama.cpp's converter failed); missing (no llama.cpp converter).
    """
    from hf_mohd.interop.gguf_export import LlamaCppExportError
    from hf_mohd.interop.nemotron_h import NemotronHInteropError

    config_file = os.path.join(source, "config.json")
    try:
        out = write(*args, **kwargs)
    except FileExistsError as error:
        raise CommandError("exists", None, str(error)) from error
    except FileNotFoundError as error:  # the llama.cpp converter
        raise CommandError("missing", "--converter", str(error)) from error
    except (NemotronHInteropError, LlamaCppExportError) as error:
        failed = str(error).startswith("llama.cpp's converter failed")
        raise CommandError("failed" if failed else "config", config_file, str(error)) from error
    print(f"{what} written to {out}")
    return 0


def check_config(source: str, check, config_class) -> None:
    """`check(config_class.from_pretrained(source))`, before any weight is read.

    Raises:
        CommandError: config (`check` refuses a field: a `NemotronHInteropError` or `LlamaCppExportError`), naming
            the config.json.
    """
    from hf_mohd.interop.gguf_export import LlamaCppExportError
    from hf_mohd.interop.nemotron_h import NemotronHInteropError

    try:
        check(config_class.from_pretrained(source))
    except (NemotronHInteropError, LlamaCppExportError) as error:
        raise CommandError("config", os.path.join(source, "config.json"), str(error)) from error


def run_export(args) -> int:
    """LatentMoE folder -> Nemotron-H folder (needs position_embedding_type='none', mlp_gated=False,
    sigmoid routing, a shared expert and one expert shape for all MoE layers).

    Bad input prints `error: <path>: <what was expected>`: no such SOURCE (exit status 3), a SOURCE that is not a
    LatentMoE folder (4), truncated or garbage weights (5), a config field out of range or a choice Nemotron-H
    cannot express (6), an existing OUTPUT without --overwrite (8).
    """
    from hf_mohd import LatentMoEConfig
    from hf_mohd.interop.nemotron_h import export_to_nemotron_h, nemotron_h_config_from_latent_moe

    check_model_folder(args.source, **LATENT_MOE, weights=False)
    check_config(args.source, nemotron_h_config_from_latent_moe, LatentMoEConfig)
    check_weights(args.source)
    return write_output(
        "Nemotron-H checkpoint", args.source, export_to_nemotron_h, args.source, args.output, overwrite=args.overwrite
    )


def run_gguf(args) -> int:
    """LatentMoE folder (with its tokenizer) -> GGUF file for llama.cpp / llama-cpp-python, through
    llama.cpp's convert_hf_to_gguf.py (every layer MoE, relu2, and the requirements of `export nemotron-h`).

    Bad input prints `error: <path>: <what was expected>`: no such SOURCE or converter (exit status 3), a SOURCE that
    is not a LatentMoE folder (4), truncated or garbage weights (5), a config choice llama.cpp cannot load (6), an
    existing OUTPUT without --overwrite (8); a failed converter run exits with 1.
    """
    from hf_mohd import LatentMoEConfig
    from hf_mohd.interop.gguf_export import check_llama_cpp_compatible, export_to_gguf

    check_model_folder(args.source, **LATENT_MOE, weights=False)
    check_config(args.source, check_llama_cpp_compatible, LatentMoEConfig)
    check_weights(args.source)
    return write_output(
        f"GGUF ({args.outtype})",
        args.source,
        export_to_gguf,
        args.source,
        args.output,
        outtype=args.outtype,
        tokenizer=args.tokenizer,
        converter_dir=args.converter,
        overwrite=args.overwrite,
    )
