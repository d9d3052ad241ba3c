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
"""What the transformers-style scripts of the repository's top-level `conversion/` folder share once their
conversion has written its output: a greedy sanity generation by the written model, loaded the way a user loads it,
and the upload (`--push_to_hub REPO_ID`).

`script_parser(__doc__)` is a script's parser (its docstring as the description, kept as written, and each option's
default in its help); `add_script_arguments(parser)` adds `--push_to_hub`, `--prompt` and `--max_new_tokens`;
`finish(path, args)` prints
the greedy continuation and uploads. The upload of a MoHD or LatentMoE folder is `hf_mohd.hub.publish` (code files,
`auto_map`, model card); a folder of another family (a Nemotron-H export) or a single file (a GGUF) is uploaded as it
is, with `huggingface_hub.HfApi`.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch


logger = logging.getLogger(__name__)

DEFAULT_PROMPT = "The capital of France is"


def script_parser(description: str) -> argparse.ArgumentParser:
    """An `ArgumentParser` whose help prints `description` (a script's docstring) as written, example commands
    included, and each option's default (`hf_mohd.commands.DefaultsHelpFormatter`, as `hf-mohd --help` does)."""
    from ..commands import DefaultsHelpFormatter

    class Formatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
        pass

    return argparse.ArgumentParser(description=description, formatter_class=Formatter)


def add_script_arguments(parser):
    """Adds `--push_to_hub REPO_ID`, `--prompt TEXT` and `--max_new_tokens N` (transformers' spelling) to `parser`."""
    parser.add_argument(
        "--push_to_hub",
        metavar="REPO_ID",
        help="After the sanity generation, upload the output to this Hub repository (namespace/name, created if "
        "missing; HF_TOKEN / HF_ENDPOINT as for huggingface_hub).",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="Prompt of the final greedy sanity generation.")
    parser.add_argument("--max_new_tokens", type=int, default=8, help="Tokens the sanity generation decodes.")
    return parser


@torch.no_grad()
def greedy_generation(folder: str | Path, prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 8) -> tuple[list, str]:
    """Loads the model folder as a user does (`AutoModelForCausalLM`, `AutoTokenizer`; a MoHD or LatentMoE folder
    through its registered classes, a Nemotron-H folder through transformers' own) and decodes `max_new_tokens`
    greedily after `prompt` (exactly that many: end-of-sequence does not stop it).

    Returns:
        (new token ids, their text). A folder without a tokenizer starts from its `bos_token_id` (else 0), and the
        text is then the ids themselves.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mohd  # noqa: F401  (registers MoHD and LatentMoE with the Auto classes)

    folder = Path(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = None
    if any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    else:
        input_ids = torch.tensor([[model.config.bos_token_id or 0]])
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=model.config.pad_token_id or 0,
    )
    new = output[0, input_ids.shape[1] :].tolist()
    return new, tokenizer.decode(new) if tokenizer is not None else str(new)


def gguf_greedy_generation(path: str | Path, prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 8):
    """The greedy continuation of `prompt` by llama.cpp (`llama_cpp.Llama`, one thread, argmax of its own logits) from
    the GGUF file `path`: (new token ids, their text), or None where llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    import numpy as np

    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=1, n_threads_batch=1, logits_all=True, verbose=False)
    llm.eval(llm.tokenize(prompt.encode("utf-8")))
    new = []
    for _ in range(max_new_tokens):
        new.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([new[-1]])
    return new, llm.detokenize(new).decode("utf-8", errors="replace")


def push_to_hub(path: str | Path, repo_id: str) -> str:
    """Uploads a written conversion to the Hub repository `repo_id` (created if missing) and returns the commit URL.

    A MoHD or LatentMoE folder goes through `hf_mohd.hub.publish` (safetensors, `auto_map` and code files, tokenizer,
    model card); another model folder (a Nemotron-H export) is uploaded as it is (`HfApi.upload_folder`), a file (a
    GGUF) under its own name (`HfApi.upload_file`).
    """
    from huggingface_hub import HfApi

    path = Path(path)
    config = path / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type in ("mohd", "latent_moe"):
        from ..hub import publish

        return publish(path, repo_id).commit_url
    api = HfApi()
    api.create_repo(repo_id, exist_ok=True)
    message = f"Upload {path.name} with hf-mohd"
    if path.is_dir():
        return api.upload_folder(repo_id=repo_id, folder_path=path, commit_message=message).commit_url
    return api.upload_file(
        repo_id=repo_id, path_or_fileobj=path, path_in_repo=path.name, commit_message=message
    ).commit_url


def finish(path: str | Path, args) -> None:
    """The end of every conversion script: prints the greedy sanity generation of the written `path` (a model folder,
    or a GGUF file run by llama.cpp when llama-cpp-python is installed), then uploads it with `--push_to_hub`."""
    path = Path(path)
    if path.suffix == ".gguf":
        generated = gguf_greedy_generation(path, args.prompt, args.max_new_tokens)
        if generated is None:
            print("sanity generation skipped: llama-cpp-python is not installed (pip install llama-cpp-python)")
    else:
        generated = greedy_generation(path, args.prompt, args.max_new_tokens)
    if generated is not None:
        ids, text = generated
        print(f"sanity generation (greedy, {len(ids)} tokens): {args.prompt!r} -> {text!r}")
        print(f"generated token ids: {json.dumps(ids)}")
    if args.push_to_hub:
        print(f"pushed to {push_to_hub(path, args.push_to_hub)}")


__all__ = [
    "add_script_arguments",
    "finish",
    "greedy_generation",
    "gguf_greedy_generation",
    "push_to_hub",
    "script_parser",
]
