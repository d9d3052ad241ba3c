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
"""Loading a dense LLaMA checkpoint for conversion (docs/design.md section 6).

Accepted sources, all local (nothing is downloaded):
- a model folder with `config.json` (`model_type: "llama"`, architecture `LlamaForCausalLM`) and safetensors weights,
  one file (`model.safetensors`) or shards (`model.safetensors.index.json`), tied or untied embeddings, any GQA ratio;
- a GGUF file of a LLaMA model (read by transformers' GGUF loader, which dequantises it; needs `pip install gguf`).

Pickled weights (`*.bin`, `*.pt`, `*.pth`, `*.ckpt`, `*.pkl`) are never opened: unpickling runs arbitrary code.
Every tensor is checked against the shapes a `LlamaForCausalLM` of the folder's config expects, and its dtype must be
a floating type; anything else raises `ConversionError` naming the file, the tensor and what was expected.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError


logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Fields that fix the tensor shapes; a config.json without them describes no particular checkpoint.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Buffers older LLaMA checkpoints stored next to the weights; recomputed from the config, so safe to drop.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ConversionError(ValueError):
    """A source that cannot be converted, or conversion settings that do not fit it; the message says why.

    `kind` says which (a key of `hf_mohd.commands.EXIT_STATUS`, the exit status of `hf-mohd convert`): "missing"
    (no such source or file), "wrong_type" (not a LLaMA checkpoint, pickled weights only, no weights), "damaged"
    (unreadable JSON, truncated or garbage safetensors / GGUF, unreadable calibration text), "config" (a config.json
    field), "exists" (the output exists), "failed" (--verify failed), "usage" (the default: settings that do not go
    together or do not fit the source).
    """

    def __init__(self, message: str, kind: str = "usage"):
        super().__init__(message)
        self.kind = kind


@dataclass
class DenseLlamaSource:
    """A dense LLaMA checkpoint held in memory, ready for conversion.

    Attributes:
        config: the source `LlamaConfig`.
        state_dict: `LlamaForCausalLM` parameter names -> tensors, all in one floating dtype; `lm_head.weight` is
            present (it is the embedding tensor itself when `config.tie_word_embeddings`).
        tokenizer: the source tokenizer, or None when the source has none.
        generation_config: the source generation config (derived from the model config when the source has none).
        description: one line naming the source (path, GGUF metadata, dtype), quoted in model cards.
        path: the folder or GGUF file it was read from.
    """

    config: object
    state_dict: dict[str, torch.Tensor]
    tokenizer: object | None
    generation_config: object
    description: str
    path: str

    @property
    def dtype(self) -> torch.dtype:
        return self.state_dict["model.embed_tokens.weight"].dtype

    def build_llama(self):
        """The source as a `LlamaForCausalLM` in eval mode (a copy of these tensors): the oracle of a conversion."""
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(self.config).to(self.dtype)
        model.load_state_dict(self.state_dict, strict=True)
        model.generation_config = self.generation_config
        return model.eval()


def _refuse_pickles(folder: Path, found: list[Path]) -> None:
    names = ", ".join(sorted(p.name for p in found)[:5])
    raise ConversionError(
        f"{folder} holds only pickled weights ({names}). hf-mohd never loads pickled checkpoints, since unpickling "
        "can run arbitrary code. Convert them to safetensors first in an environment you trust (e.g. "
        "`LlamaForCausalLM.from_pretrained(folder).save_pretrained(new_folder)`, which writes safetensors).",
        kind="wrong_type",
    )


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of `folder`, from the shard index when there is one.

    Raises:
        ConversionError: the shard index is not JSON with a `weight_map` or names absent shards ("damaged"); the
            folder holds only pickled weights, or no weights ("wrong_type").
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ConversionError(f"{index}: expected JSON with a 'weight_map' object ({err}).", "damaged") from err
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ConversionError(f"{index} lists shards that are not in {folder}: {missing[:5]}.", "damaged")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = [p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        _refuse_pickles(folder, pickles)
    raise ConversionError(
        f"{folder}: no weights found (expected model.safetensors or model.safetensors.index.json).", "wrong_type"
    )


def _check_llama_config(config_dict: dict, where: str) -> None:
    if not isinstance(config_dict, dict):
        raise ConversionError(
            f"{where}: expected a JSON object of LlamaConfig fields, got {type(config_dict).__name__}.", "damaged"
        )
    model_type = config_dict.get("model_type")
    architectures = config_dict.get("architectures") or ["LlamaForCausalLM"]
    if model_type != "llama":
        raise ConversionError(
            f"{where}: model_type is {model_type!r}; only dense LLaMA checkpoints (model_type 'llama') can be "
            "converted to MoHD or LatentMoE.",
            "wrong_type",
        )
    if architectures != ["LlamaForCausalLM"]:
        raise ConversionError(
            f"{where}: architectures is {architectures}; expected ['LlamaForCausalLM'].", "wrong_type"
        )
    missing = [name for name in SHAPE_FIELDS if name not in config_dict]
    if missing:  # LlamaConfig would fill in its 7B defaults, and every tensor would then look misshapen
        raise ConversionError(
            f"{where}: missing field(s) {missing}; a LLaMA config.json states {list(SHAPE_FIELDS)}.", "config"
        )
    if config_dict.get("quantization_config"):
        method = config_dict["quantization_config"].get("quant_method", "unknown")
        raise ConversionError(
            f"{where}: the checkpoint is quantised (quantization_config.quant_method={method!r}); dequantise it to a "
            "floating dtype first.",
            "wrong_type",
        )


def _expected_shapes(config) -> dict[str, torch.Size]:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


def _incomplete_safetensors(path: Path, err: Exception) -> ConversionError:
    return ConversionError(
        f"{path}: not a complete safetensors file ({err}); expected a JSON header and every tensor's bytes "
        "(a truncated download or a damaged copy: fetch the file again).",
        "damaged",
    )


def check_safetensors(path: Path) -> None:
    """Checks that `path` is a complete safetensors file without reading its tensors: a JSON header whose tensors'
    byte ranges the file covers exactly (what `safe_open` validates).

    Raises:
        ConversionError ("damaged"): a truncated or garbage file; the message names it.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as err:
        raise _incomplete_safetensors(path, err) from err


def _read_safetensors(files: list[Path], expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Read and check every tensor (the files passed `check_safetensors`): name known, shape as expected, floating
    dtype, no name twice."""
    from safetensors import SafetensorError

    state_dict, origin = {}, {}
    for path in files:
        try:
            _read_one_safetensors(path, expected, state_dict, origin)
        except SafetensorError as err:
            raise _incomplete_safetensors(path, err) from err
    return state_dict


def _read_one_safetensors(path: Path, expected: dict, state_dict: dict, origin: dict) -> None:
    """Adds the checked tensors of `path` to `state_dict` (`origin`: tensor name -> file it came from)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name not in expected:
                raise ConversionError(
                    f"{path.name}: tensor {name!r} is not a parameter of LlamaForCausalLM for this config.json "
                    "(wrong architecture, or a checkpoint of a different model class).",
                    "wrong_type",
                )
            if name in state_dict:
                raise ConversionError(f"{path.name}: tensor {name!r} is also in {origin[name]}.", "damaged")
            tensor = handle.get_tensor(name)
            if tensor.dtype not in FLOAT_DTYPES:
                raise ConversionError(
                    f"{path.name}: tensor {name!r} has dtype {tensor.dtype}; expected one of "
                    f"{[str(d) for d in FLOAT_DTYPES]} (quantised weights must be dequantised first).",
                    "wrong_type",
                )
            if tensor.shape != expected[name]:
                raise ConversionError(
                    f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}; config.json implies "
                    f"{tuple(expected[name])}.",
                    "damaged",
                )
            state_dict[name], origin[name] = tensor, path.name


def _complete(state_dict: dict, expected: dict, config, where: str) -> dict[str, torch.Tensor]:
    """Check that every parameter is present; tie `lm_head.weight` to the embedding when the config says so."""
    if config.tie_word_embeddings:
        if "lm_head.weight" in state_dict and "model.embed_tokens.weight" in state_dict:
            if not torch.equal(state_dict["lm_head.weight"], state_dict["model.embed_tokens.weight"]):
                logger.warning("%s: tie_word_embeddings is true; the stored lm_head.weight is ignored.", where)
        if "model.embed_tokens.weight" in state_dict:
            state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    missing = [name for name in expected if name not in state_dict]
    if missing:
        hint = " (tie_word_embeddings is false, so lm_head.weight is needed)" if "lm_head.weight" in missing else ""
        raise ConversionError(f"{where}: missing tensors {missing[:5]}{hint}.", "damaged")
    return state_dict


def _to_dtype(state_dict: dict, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        dtypes = {t.dtype for t in state_dict.values()}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    if dtype not in FLOAT_DTYPES:
        raise ConversionError(f"`dtype` must be one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype}.")
    converted = {}
    for name, tensor in state_dict.items():
        converted[name] = tensor.to(dtype)
    if "lm_head.weight" in state_dict and state_dict["lm_head.weight"] is state_dict["model.embed_tokens.weight"]:
        converted["lm_head.weight"] = converted["model.embed_tokens.weight"]
    return converted


def _load_folder(folder: Path, dtype: torch.dtype | None) -> DenseLlamaSource:
    from transformers import GenerationConfig, LlamaConfig

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConversionError(
            f"{folder}: no config.json; expected a Hugging Face model folder or a .gguf file.", "wrong_type"
        )
    try:
        config_dict = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{config_path}: not valid JSON ({err}).", "damaged") from err
    _check_llama_config(config_dict, str(config_path))
    files = safetensors_files(folder)
    for path in files:  # complete headers, before any tensor is read
        check_safetensors(path)
    try:
        config = LlamaConfig.from_pretrained(folder)
    except (ValueError, TypeError, StrictDataclassError) as err:  # a field of the wrong type or out of range
        message = " ".join(str(err).split())
        raise ConversionError(f"{config_path}: not a valid LlamaConfig ({message}).", "config") from err
    expected = _expected_shapes(config)
    logger.info("Reading %d safetensors file(s) from %s", len(files), folder)
    state_dict = _complete(_read_safetensors(files, expected), expected, config, str(folder))
    state_dict = _to_dtype(state_dict, dtype)
    if (folder / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(folder)
    else:
        generation_config = GenerationConfig.from_model_config(config)
    tokenizer = None
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        logger.warning("%s has no tokenizer files; the converted folder will have none either.", folder)
    dtype_name = str(next(iter(state_dict.values())).dtype).removeprefix("torch.")
    description = f"local LLaMA folder `{folder}` ({len(files)} safetensors file(s), {dtype_name})"
    return DenseLlamaSource(config, state_dict, tokenizer, generation_config, description, str(folder))


def _gguf_metadata(path: Path) -> dict[str, object]:
    try:
        import gguf
    except ImportError as err:
        raise ConversionError(
            f"Reading {path.name} needs the `gguf` package: pip install gguf (or hf-mohd[convert])."
        ) from err
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # the reader raises ValueError, IndexError, struct errors, ... on damaged files
        raise ConversionError(
            f"{path}: not a readable GGUF file ({type(err).__name__}: {err}); expected the GGUF magic, version, "
            "metadata and tensor data (a truncated or damaged file?).",
            "damaged",
        ) from err
    meta = {}
    for key in ("general.architecture", "general.name", "general.organization", "general.license"):
        if key in reader.fields:
            meta[key] = reader.fields[key].contents()
    meta["tensor_types"] = sorted({t.tensor_type.name for t in reader.tensors})
    return meta


@contextlib.contextmanager
def gguf_progress_bar_follows_transformers():
    """Within the block, transformers' GGUF dequantisation bar ("Converting and de-quantizing GGUF tensors...") obeys
    transformers' progress-bar switch (`transformers.utils.logging.disable_progress_bar`), as its weight-loading bars
    do: the GGUF loader calls `tqdm` directly, so while the switch is off its module's `tqdm` is a disabled one."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as transformers_logging

    original = getattr(gguf_utils, "tqdm", None)
    if original is None or transformers_logging.is_progress_bar_enabled():
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _load_gguf(path: Path, dtype: torch.dtype | None) -> DenseLlamaSource:
    from transformers import AutoTokenizer, LlamaForCausalLM

    meta = _gguf_metadata(path)
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        raise ConversionError(
            f"{path.name}: general.architecture is {architecture!r}; only LLaMA GGUF files ('llama') can be converted.",
            "wrong_type",
        )
    logger.info("Reading and dequantising %s (tensor types %s)", path.name, ", ".join(meta["tensor_types"]))
    with gguf_progress_bar_follows_transformers():
        model = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype or torch.float32)
    config = model.config
    # the tensors are dequantised: the GGUF loader's `quantization_config` (quant_method "gguf") would make a folder
    # saved from this config claim a GGUF quantisation it does not hold, which engines then refuse to load
    config.__dict__.pop("quantization_config", None)
    expected = _expected_shapes(config)
    state_dict = _complete(dict(model.state_dict()), expected, config, path.name)
    state_dict = _to_dtype(state_dict, dtype or torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    generation_config = model.generation_config
    names = ", ".join(f"{k.split('.')[-1]}={meta[k]}" for k in ("general.name", "general.organization") if k in meta)
    description = (
        f"GGUF file `{path.name}` ({names}; tensor types {', '.join(meta['tensor_types'])}, dequantised to "
        f"{str(next(iter(state_dict.values())).dtype).removeprefix('torch.')} by transformers' GGUF loader)"
    )
    return DenseLlamaSource(config, state_dict, tokenizer, generation_config, description, str(path))


def load_dense_llama(
    source: str | Path | DenseLlamaSource, *, gguf_file: str | None = None, dtype: torch.dtype | None = None
) -> DenseLlamaSource:
    """Load a local dense LLaMA checkpoint for conversion.

    Args:
        source: a model folder (config.json + safetensors), a `.gguf` file, or a folder holding `gguf_file`.
            An already loaded `DenseLlamaSource` is returned as is (cast to `dtype` when given).
        gguf_file: name of a GGUF file inside the folder `source` (as in `from_pretrained(folder, gguf_file=...)`).
        dtype: dtype of the returned tensors; None keeps the source's dtype (float32 for GGUF, which is dequantised).

    Returns:
        A `DenseLlamaSource` (config, complete state dict, tokenizer, generation config, description).

    Raises:
        ConversionError: no such path; pickled weights only (never loaded); a model type or architecture other than
            LLaMA / `LlamaForCausalLM`; a quantised checkpoint; a truncated or garbage safetensors or GGUF file; a
            tensor with an unknown name, a wrong shape or a non-floating dtype; a missing tensor. The message names
            the file and tensor; `kind` says which kind of error it is (see `ConversionError`).
    """
    if isinstance(source, DenseLlamaSource):
        if dtype is not None and dtype != source.dtype:
            source.state_dict = _to_dtype(source.state_dict, dtype)
        return source
    path = Path(source).expanduser()
    if gguf_file is not None:
        path = path / gguf_file
    if not path.exists():
        raise ConversionError(
            f"{path} does not exist (sources are local folders or .gguf files; nothing is downloaded).", "missing"
        )
    if path.is_file():
        if path.suffix == ".gguf":
            return _load_gguf(path, dtype)
        if path.suffix in PICKLE_SUFFIXES:
            _refuse_pickles(path.parent, [path])
        if path.suffix == ".safetensors":
            return _load_folder(path.parent, dtype)
        raise ConversionError(f"{path}: expected a model folder, a .gguf file or a .safetensors file.", "wrong_type")
    return _load_folder(path, dtype)


__all__ = ["ConversionError", "DenseLlamaSource", "check_safetensors", "load_dense_llama", "safetensors_files"]
