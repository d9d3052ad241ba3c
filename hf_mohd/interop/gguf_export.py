# Copyright 2026 The hf-mohd Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""LatentMoE -> GGUF for llama.cpp, through llama.cpp's own converter (`convert_hf_to_gguf.py`).

Path: LatentMoE -> transformers' Nemotron-H (`nemotron_h.py`, equal logits) -> a temporary Nemotron-H folder with
the tokenizer -> llama.cpp's converter (`conversion/nemotron.py`, class NemotronHModel, architecture
`nemotron_h_moe`, which writes `moe_latent_size` and the `ffn_latent_down` / `ffn_latent_up` tensors) -> one GGUF.

The converter. PyPI `llama-cpp-python==0.3.36` vendors llama.cpp; its source distribution holds
`vendor/llama.cpp/convert_hf_to_gguf.py`, the `conversion/` package and `gguf-py/` (the `gguf` writer that matches
it). `scripts/setup.sh` copies those three into `<environment>/share/hf-mohd/llama.cpp-convert`; point
`HF_MOHD_LLAMA_CPP_CONVERTER` (or `converter_dir=`) elsewhere to use another copy. The converter runs in a
subprocess of this environment's Python (transformers 5.x, numpy 2.x), not in the older transformers / numpy its
`requirements/` pin; the tests in `tests/test_engines.py` run it that way.

One workaround. llama.cpp's Nemotron-H memory is hybrid (a key/value cache plus a recurrent state) and aborts on
the first decode when no block is a Mamba block (`GGML_ASSERT(buffer)` in `llm_graph_input_mem_hybrid::set_input`).
The export therefore prepends one Mamba-2 block whose `out_proj` is zero: the block adds exactly 0 to the residual
stream (Nemotron-H blocks are `x + mixer(norm(x))`), so the logits are unchanged, bit for bit in transformers, and
llama.cpp gets a recurrent layer. With the sizes of `MAMBA_PREFIX` (d_inner = 64) it adds 232 D + about 600
parameters (in_proj 168 x D, out_proj D x 64, conv1d, A_log, the skip weights, dt_bias, norms) and a negligible amount of compute.

What llama.cpp cannot load, beyond what Nemotron-H already rejects (`nemotron_h_config_from_latent_moe`): dense
`mlp` layers (the converter's MoE variant counts only `moe` blocks as feed-forward blocks, `_MLP_LAYER_TYPES`), an
activation other than relu2 (llama.cpp's `nemotron_h_moe` computes relu^2, `LLM_FFN_RELU_SQR`, in every expert and
in the shared expert), and a vocabulary size that is not a multiple of 8 (see `check_llama_cpp_compatible`).

Tokenizer. GGUF embeds the vocabulary, so a tokenizer is required. For BPE tokenizers the converter identifies
the pre-tokenizer by the hash of the ids of a fixed text (`get_vocab_base_pre` in `conversion/base.py`) and refuses
unknown ones; SmolLM2's tokenizer is known (`smollm`). A user's own BPE tokenizer whose pre-tokenizer is not in that
list fails with `LlamaCppExportError`; llama.cpp's `convert_hf_to_gguf_update.py` is the documented way to add it.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

from ..models.configuration_latent_moe import LatentMoEConfig
from ..models.modeling_latent_moe import LatentMoEForCausalLM
from .nemotron_h import (
    _copy_side_files,
    latent_moe_to_nemotron_h_state_dict,
    nemotron_h_config_from_latent_moe,
    nemotron_h_unmet,
)


logger = logging.getLogger(__name__)

CONVERTER_ENV = "HF_MOHD_LLAMA_CPP_CONVERTER"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# The prepended Mamba-2 block: the smallest shape the converter accepts (d_inner = heads * head_dim must be a multiple
# of 64, GraniteHybridModel.set_gguf_parameters); its output is zero whatever these values are.
MAMBA_PREFIX = dict(mamba_num_heads=8, mamba_head_dim=8, n_groups=1, ssm_state_size=16, conv_kernel=4)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class LlamaCppExportError(ValueError):
    """A model, tokenizer or converter llama.cpp's GGUF export cannot use (the message says which and why)."""


def default_converter_dir() -> Path:
    """`$HF_MOHD_LLAMA_CPP_CONVERTER`, else `<sys.prefix>/share/hf-mohd/llama.cpp-convert` (where setup.sh puts it)."""
    return Path(os.environ.get(CONVERTER_ENV) or Path(sys.prefix) / "share" / "hf-mohd" / "llama.cpp-convert")


def check_llama_cpp_compatible(config: LatentMoEConfig) -> NemotronHConfig:
    """The Nemotron-H config of a LatentMoE config that llama.cpp's `nemotron_h_moe` loads and computes exactly.

    Raises:
        LlamaCppExportError: one message listing every unmet requirement, each naming its field: those of the
            Nemotron-H form (`nemotron_h_unmet`), dense `mlp` layers, an activation other than relu2, a `vocab_size`
            that is not a multiple of 8; for a carved model (unit gates over gated experts) it says so first and why
            no GGUF form exists.
    """
    unmet = nemotron_h_unmet(config)
    dense = [i for i, layer in enumerate(config.per_layer_config) if layer.mixer_type != "moe"]
    if dense:
        unmet.append(
            f"`mixer_type` is 'mlp' at layers {dense}: llama.cpp's nemotron_h_moe counts only 'moe' blocks as "
            "feed-forward blocks (conversion/nemotron.py `_MLP_LAYER_TYPES`); use mixer_type='moe' in every layer"
        )
    if config.hidden_act != "relu2":
        unmet.append(
            f"`hidden_act` must be 'relu2' (nemotron_h_moe computes relu^2, LLM_FFN_RELU_SQR, in every expert and the "
            f"shared expert); got {config.hidden_act!r}"
        )
    if config.vocab_size % 8:
        unmet.append(
            f"`vocab_size` must be a multiple of 8; got {config.vocab_size} (the converter pads the vocabulary of "
            "hybrid Nemotron-H models to a multiple of 8 but not the embedding and output matrices, so llama.cpp "
            "refuses the file; resize the embeddings with model.resize_token_embeddings(n, pad_to_multiple_of=8) and "
            "fine-tune briefly)"
        )
    if unmet and config.router_gate == "unit" and config.mlp_gated:
        raise LlamaCppExportError(
            "This is a carved model (`router_gate` 'unit' over gated experts, as `hf-mohd convert latent-moe --carve` "
            "writes): it has no GGUF form, since llama.cpp weighs every routed expert by a function of its router "
            "logit (build_moe_ffn) and has no selection-only gate of weight 1 over SwiGLU experts (docs/serving.md, "
            f"'Carved models and llama.cpp'). Unmet ({len(unmet)}): " + "; ".join(unmet) + "."
        )
    if unmet:
        raise LlamaCppExportError(
            f"Not exportable to GGUF for llama.cpp ({len(unmet)} unmet): " + "; ".join(unmet) + "."
        )
    nemotron = nemotron_h_config_from_latent_moe(config)
    return nemotron


def to_nemotron_h_with_mamba_prefix(model: LatentMoEForCausalLM) -> NemotronHForCausalLM:
    """`to_nemotron_h(model)` with one Mamba-2 block in front whose `out_proj` is zero (same logits, see module doc).

    Block 0 is the Mamba block (initialised as `NemotronHPreTrainedModel._init_weights` does, `out_proj` zeroed);
    blocks 1 .. 2L are the attention and MoE blocks of the L LatentMoE layers.

    Raises:
        NemotronHInteropError, LlamaCppExportError: see `check_llama_cpp_compatible`.
    """
    config = check_llama_cpp_compatible(model.config)
    config = NemotronHConfig(
        **{
            **config.to_dict(),
            "layers_block_type": ["linear_attention", *config.layers_block_type],
            **MAMBA_PREFIX,
            "expand": MAMBA_PREFIX["mamba_num_heads"],
        }
    )
    state_dict = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    state_dict.setdefault("lm_head.weight", model.get_output_embeddings().weight.detach().clone())
    renamed = {}
    for name, tensor in latent_moe_to_nemotron_h_state_dict(state_dict).items():
        match = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
        renamed[f"model.layers.{int(match.group(1)) + 1}.{match.group(2)}" if match else name] = tensor
    with torch.device("meta"):
        nemotron = NemotronHForCausalLM(config)
    mamba = NemotronHBlock(config, layer_idx=0).to(model.dtype)
    for module in mamba.modules():
        nemotron._init_weights(module)
    with torch.no_grad():
        mamba.mixer.out_proj.weight.zero_()
    nemotron.model.layers[0] = mamba
    missing, unexpected = nemotron.load_state_dict(renamed, strict=False, assign=True)
    if unexpected or any(not name.startswith("model.layers.0.") for name in missing):
        raise RuntimeError(f"Nemotron-H weight names do not match: missing {missing}, unexpected {unexpected}.")
    nemotron.config.dtype = model.dtype
    return nemotron.eval()


def export_to_gguf(
    model_or_folder,
    out_file: str | Path,
    outtype: str = "f32",
    tokenizer=None,
    converter_dir: str | Path | None = None,
    overwrite: bool = False,
    timeout: float | None = None,
) -> Path:
    """Writes a GGUF file that llama.cpp (and `llama_cpp.Llama`) loads, with the tokenizer embedded.

    Args:
        model_or_folder: a `LatentMoEForCausalLM`, or a folder saved from one (its tokenizer files are used).
        out_file: the `.gguf` file to write.
        outtype: the converter's `--outtype`: "f32", "f16", "bf16" or "q8_0" (weights; norms and router stay f32).
        tokenizer: a folder with tokenizer files or a tokenizer object; required when `model_or_folder` is a model,
            and overrides the folder's own tokenizer otherwise.
        converter_dir: the folder holding `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/` (default:
            `default_converter_dir()`).
        overwrite: replace `out_file` if it exists.
        timeout: seconds allowed to the converter (None: no limit).

    Returns:
        The path of the GGUF file.

    Raises:
        NemotronHInteropError, LlamaCppExportError (ValueErrors): the model cannot be exported (see
            `check_llama_cpp_compatible`), no tokenizer, an unknown BPE pre-tokenizer, an unknown `outtype`, or
            the converter failed (its last output lines are in the message).
        FileNotFoundError: no converter in `converter_dir`.
        FileExistsError: `out_file` exists and `overwrite` is false.
    """
    if outtype not in OUTTYPES:
        raise LlamaCppExportError(f"`outtype` must be one of {OUTTYPES}; got {outtype!r}.")
    out_file = Path(out_file)
    if out_file.exists() and not overwrite:
        raise FileExistsError(f"{out_file} exists; pass overwrite=True (--overwrite) to replace it.")
    source = None
    if not isinstance(model_or_folder, LatentMoEForCausalLM):
        source = Path(model_or_folder)
        check_llama_cpp_compatible(LatentMoEConfig.from_pretrained(source))  # fail fast, before the weights
    else:
        check_llama_cpp_compatible(model_or_folder.config)
    converter = Path(converter_dir) if converter_dir is not None else default_converter_dir()
    script = converter / "convert_hf_to_gguf.py"
    if not script.is_file() or not (converter / "conversion").is_dir():
        raise FileNotFoundError(
            f"llama.cpp's converter is not in {converter} (expected convert_hf_to_gguf.py, conversion/ and gguf-py/ "
            f"from the llama-cpp-python 0.3.36 source distribution; scripts/setup.sh installs them, or set "
            f"{CONVERTER_ENV})."
        )
    model = model_or_folder if source is None else LatentMoEForCausalLM.from_pretrained(source)
    nemotron = to_nemotron_h_with_mamba_prefix(model)
    with tempfile.TemporaryDirectory(prefix="hf-mohd-gguf-") as staging:
        staging = Path(staging)
        nemotron.save_pretrained(staging)
        if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
            tokenizer.save_pretrained(staging)
        elif tokenizer is not None:
            _copy_side_files(Path(tokenizer), staging)
        if source is not None:
            _copy_side_files(source, staging)
        if not any((staging / name).is_file() for name in _TOKENIZER_FILES):
            raise LlamaCppExportError(
                "No tokenizer: GGUF embeds the vocabulary. Save the tokenizer with the model folder or pass "
                f"tokenizer= (a folder with one of {_TOKENIZER_FILES}, or a tokenizer object)."
            )
        out_file.parent.mkdir(parents=True, exist_ok=True)
        name = source.resolve().name if source is not None else Path(model.name_or_path or "latent-moe").name
        command = [sys.executable, str(script), str(staging), "--outfile", str(out_file), "--outtype", outtype]
        command += ["--model-name", name or "latent-moe"]
        logger.info("Running %s", " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=converter)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-12:])
        if "pre-tokenizer was not recognized" in tail:
            raise LlamaCppExportError(
                "llama.cpp's converter does not know this tokenizer's BPE pre-tokenizer (it identifies it by a hash, "
                "get_vocab_base_pre in conversion/base.py). Use a tokenizer llama.cpp knows (e.g. SmolLM2's, "
                "GPT-2's, Llama 3's) or add yours with llama.cpp's convert_hf_to_gguf_update.py.\n" + tail
            )
        raise LlamaCppExportError(f"llama.cpp's converter failed (exit code {result.returncode}):\n{tail}")
    logger.info("Wrote %s (%.1f MB)", out_file, out_file.stat().st_size / 1e6)
    return out_file


__all__ = [
    "CONVERTER_ENV",
    "LlamaCppExportError",
    "check_llama_cpp_compatible",
    "default_converter_dir",
    "export_to_gguf",
    "to_nemotron_h_with_mamba_prefix",
]
