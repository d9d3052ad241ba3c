"""`hf-mohd nemotron-h`: export a LatentMoE model to transformers' Nemotron-H format, or import one back.

`hf-mohd nemotron-h export LATENT_MOE_FOLDER OUTPUT` writes a folder `NemotronHForCausalLM.from_pretrained` (and
vLLM / SGLang) loads; `hf-mohd nemotron-h import NEMOTRON_H_FOLDER OUTPUT` writes a LatentMoE folder (with
`auto_map` and code). Both keep the logits (docs/design.md section 4, "Interop"); the work is done by
`hf_mohd.interop.nemotron_h`. `hf-mohd nemotron-h gguf LATENT_MOE_FOLDER OUTPUT.gguf` writes a GGUF file for
llama.cpp through llama.cpp's own converter (`hf_mohd.interop.gguf_export`).
"""

from __future__ import annotations

import os

from . import CommandError, add_command, check_model_folder, check_weights


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


LATENT_MOE = dict(model_types=("latent_moe",), label="a LatentMoE folder saved by save_pretrained")
NEMOTRON_H = dict(model_types=("nemotron_h",), label="a Nemotron-H folder (NemotronHForCausalLM)")


def _write(what: str, source: str, write, *args, **kwargs) -> int:
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


def _check_config(source: str, check, config_class) -> None:
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
    _check_config(args.source, nemotron_h_config_from_latent_moe, LatentMoEConfig)
    check_weights(args.source)
    return _write(
        "Nemotron-H checkpoint", args.source, export_to_nemotron_h, args.source, args.output, overwrite=args.overwrite
    )


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
    _check_config(args.source, latent_moe_config_from_nemotron_h, NemotronHConfig)
    check_weights(args.source)
    kwargs = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}

    def write() -> str:
        import_from_nemotron_h(args.source, args.output, overwrite=args.overwrite, **kwargs)
        return args.output

    return _write("LatentMoE checkpoint", args.source, write)


def run_gguf(args) -> int:
    """LatentMoE folder (with its tokenizer) -> GGUF file for llama.cpp / llama-cpp-python, through
    llama.cpp's convert_hf_to_gguf.py (every layer MoE, relu2, and the Nemotron-H requirements of `export`).

    Bad input prints `error: <path>: <what was expected>`: no such SOURCE or converter (exit status 3), a SOURCE that
    is not a LatentMoE folder (4), truncated or garbage weights (5), a config choice llama.cpp cannot load (6), an
    existing OUTPUT without --overwrite (8); a failed converter run exits with 1.
    """
    from hf_mohd import LatentMoEConfig
    from hf_mohd.interop.gguf_export import check_llama_cpp_compatible, export_to_gguf

    check_model_folder(args.source, **LATENT_MOE, weights=False)
    _check_config(args.source, check_llama_cpp_compatible, LatentMoEConfig)
    check_weights(args.source)
    return _write(
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
