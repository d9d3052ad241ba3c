"""Publishing MoHD and LatentMoE checkpoints to the Hugging Face Hub (docs/design.md section 7, "Hub").

`publish` uploads, in one commit: safetensors weights, `config.json` with `auto_map`, the remote-code files
(`hf_mohd/models/*.py` siblings, so that a machine without hf-mohd loads the model with `trust_remote_code=True`),
the tokenizer, `generation_config.json` and a model card (`README.md`, from `hf_mohd.model_card`).
`prepare_files` is the same without the upload: the {path in repo: bytes or file} map `publish` commits.
The command line is `hf-mohd publish FOLDER REPO_ID` (`hf_mohd/commands/publish.py`).

The endpoint is `huggingface_hub`'s: `HF_ENDPOINT` (read when `huggingface_hub` is imported) or the `endpoint`
argument. `model.push_to_hub(repo_id)` of transformers also writes `auto_map` and the code files (the model classes
are registered with `register_for_auto_class` on `import hf_mohd`), but not this model card nor the checks below.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, ModelCard


logger = logging.getLogger(__name__)

# Files a model repository needs; everything else in a folder (optimizer states, *.bin pickles, checkpoints of a
# training run) stays local. Weights must be safetensors: pickled weights run code when loaded.
UPLOAD_SUFFIXES = (".safetensors", ".json", ".py", ".txt", ".model", ".tiktoken", ".jinja", ".md")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def _families() -> dict[str, tuple[type, ...]]:
    """model_type -> (config class, base model class, causal-LM class) of the families hf-mohd provides."""
    from . import LatentMoEConfig, LatentMoEForCausalLM, LatentMoEModel, MoHDConfig, MoHDForCausalLM, MoHDModel

    return {
        MoHDConfig.model_type: (MoHDConfig, MoHDModel, MoHDForCausalLM),
        LatentMoEConfig.model_type: (LatentMoEConfig, LatentMoEModel, LatentMoEForCausalLM),
    }


def remote_code_files(model_type: str) -> tuple[dict[str, str], dict[str, Path]]:
    """The `auto_map` and the code files a repository of `model_type` needs to load with `trust_remote_code`.

    Returns:
        (auto_map, files): auto_map {"AutoConfig": "configuration_x.XConfig", "AutoModel": ..., "AutoModelForCausalLM":
        ...}; files {file name: source path} with each class's module and its relative imports, followed the way
        transformers' `custom_object_save` does (flat, `from .x import y` only).

    Raises:
        ValueError: `model_type` is not a family of hf-mohd.
    """
    from transformers.dynamic_module_utils import get_relative_import_files

    families = _families()
    if model_type not in families:
        raise ValueError(f"`model_type` {model_type!r} is not an hf-mohd family; expected one of {list(families)}.")
    auto_map, files = {}, {}
    for auto_class, cls in zip(("AutoConfig", "AutoModel", "AutoModelForCausalLM"), families[model_type], strict=True):
        module_file = Path(sys.modules[cls.__module__].__file__)
        auto_map[auto_class] = f"{module_file.stem}.{cls.__name__}"
        for path in [module_file, *map(Path, get_relative_import_files(module_file))]:
            files[path.name] = path
    return auto_map, files


def _is_upload_file(rel: Path) -> bool:
    hidden = any(part.startswith(".") for part in rel.parts)
    run_state = any(part.startswith("checkpoint-") or part in ("runs", "__pycache__") for part in rel.parts)
    return not hidden and not run_state and rel.name.endswith(UPLOAD_SUFFIXES)


def prepare_files(
    folder: str | os.PathLike,
    repo_id: str | None = None,
    *,
    model_card: ModelCard | str | None = None,
    card_kwargs: dict[str, Any] | None = None,
) -> dict[str, bytes | Path]:
    """The files `publish` uploads from a saved model folder, completed where the folder lacks them.

    Args:
        folder: a `save_pretrained` folder of a MoHD or LatentMoE model (plus, usually, its tokenizer).
        repo_id: the target repository (used in the model card).
        model_card: a card (or README text) to upload; None keeps the folder's `README.md`, or renders one with
            `hf_mohd.model_card.render_model_card(config, repo_id=repo_id, **card_kwargs)`.
        card_kwargs: base_model, datasets, eval_results, training, notes, ... for the rendered card; when given, a
            card is rendered even if the folder has a `README.md`.

    Returns:
        {path in the repository: file path or bytes}: the folder's weights, configs, tokenizer and card files;
        `config.json` with `auto_map` set; code files from the installed hf-mohd where the folder has none;
        `generation_config.json` derived from the config where missing; `README.md`.

    Raises:
        FileNotFoundError: no `config.json`, or no `*.safetensors` weights (pickled `*.bin` weights are not uploaded).
        ValueError: `config.json` is not valid JSON, is not of an hf-mohd family, or has a bad field (the message
            names the file and the field); a safetensors file is truncated or garbage (`ConversionError`, naming it).
    """
    from transformers import GenerationConfig

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; save the model with `save_pretrained` first.")
    files: dict[str, bytes | Path] = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and _is_upload_file(rel):
            files[rel.as_posix()] = path
    if not any(name.endswith(".safetensors") for name in files):
        raise FileNotFoundError(
            f"{folder} has no *.safetensors weights; save with `save_pretrained` (safetensors is its default)."
        )

    try:
        config_dict = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"{config_path}: not valid JSON ({err}); expected the config `save_pretrained` writes."
        ) from err
    if not isinstance(config_dict, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config_dict).__name__}.")
    try:
        auto_map, code_files = remote_code_files(config_dict.get("model_type"))
    except ValueError as err:
        raise ValueError(f"{config_path}: {err}") from err
    config_dict["auto_map"] = {**auto_map, **config_dict.get("auto_map", {})}
    files["config.json"] = (json.dumps(config_dict, indent=2, sort_keys=True) + "\n").encode()
    for name, source in code_files.items():
        files.setdefault(name, source)

    try:  # a field of the wrong type or out of range (the error names it)
        config = _families()[config_dict["model_type"]][0].from_dict(config_dict)
    except ValueError as err:
        raise ValueError(f"{config_path}: not a valid {config_dict['model_type']} config ({err}).") from err
    from .conversion.source import check_safetensors

    for name, path in files.items():  # a truncated or garbage file fails here, before anything is uploaded
        if name.endswith(".safetensors"):
            check_safetensors(path)
    if "generation_config.json" not in files:
        files["generation_config.json"] = GenerationConfig.from_model_config(config).to_json_string().encode()
    if not any(name in files for name in TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files; the repository will need one to generate text.", folder)

    if model_card is None and (card_kwargs or "README.md" not in files):
        from .model_card import render_model_card

        model_card = render_model_card(config, repo_id=repo_id, **(card_kwargs or {}))
    if model_card is not None:
        files["README.md"] = str(model_card).encode()
    return files


def publish(
    folder_or_model,
    repo_id: str,
    *,
    tokenizer=None,
    model_card: ModelCard | str | None = None,
    card_kwargs: dict[str, Any] | None = None,
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str = "Upload model with hf-mohd",
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> CommitInfo:
    """Publish a MoHD or LatentMoE model to the Hub in one commit (see the module docstring for what is uploaded).

    Args:
        folder_or_model: a saved model folder, or a model object (saved with `save_pretrained` to a temporary
            folder first, safetensors, with its generation config).
        repo_id: "namespace/name"; the repository is created if missing.
        tokenizer: saved next to the model (a folder's own tokenizer files are uploaded as they are).
        model_card, card_kwargs: see `prepare_files`.
        private, revision, create_pr, commit_message, token: as in `HfApi.create_repo` / `HfApi.create_commit`.
        endpoint: Hub URL; defaults to `HF_ENDPOINT` / huggingface.co.

    Returns:
        The `CommitInfo` of the commit (`.commit_url`, `.oid`).

    Raises:
        FileNotFoundError, ValueError: from `prepare_files`; `huggingface_hub` errors from the upload.
    """
    with tempfile.TemporaryDirectory(prefix="hf-mohd-publish-") as tmp:
        if isinstance(folder_or_model, (str, os.PathLike)):
            folder = Path(folder_or_model)
        else:
            folder = Path(tmp)
            folder_or_model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer_dir = Path(tmp) / "tokenizer"
            tokenizer.save_pretrained(tokenizer_dir)
        files = prepare_files(folder, repo_id, model_card=model_card, card_kwargs=card_kwargs)
        if tokenizer is not None:
            for path in sorted(tokenizer_dir.iterdir()):
                files[path.name] = path
        api = HfApi(endpoint=endpoint, token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        operations = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=c) for p, c in sorted(files.items())]
        return api.create_commit(
            repo_id, operations, commit_message=commit_message, revision=revision, create_pr=create_pr
        )


__all__ = ["prepare_files", "publish", "remote_code_files"]
