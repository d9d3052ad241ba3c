"""`hf-mohd serve` (transformers' OpenAI-compatible server with the hf-mohd classes registered) on a saved folder of
either family, with and without `--continuous-batching`: started on 127.0.0.1 at a free port, queried with the
`openai` client (chat completion, streamed chat completion, completion), and the answers equal local greedy
generation with `AutoModelForCausalLM` (the oracle). Full tier: each server start loads torch and the model in
spawned processes."""

import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM, MoHDConfig, MoHDForCausalLM
from hf_mohd.training.data import train_bpe_tokenizer
from tests.utils import CHAT_TEMPLATE, free_port


openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.slow

TEXT = [
    "The river rises in the hills and flows north to the sea.",
    "Every token activates the shared sub-dimensions and the routed ones its router picks.",
]
MAX_TOKENS = 6


def text(value: str) -> str:
    """`value` without a trailing U+FFFD: the byte-level tokenizer's last tokens can end inside a UTF-8 character,
    which the server holds back (its streaming detokenizer waits for the rest) and `decode` shows as U+FFFD."""
    return value.rstrip("\ufffd")


@pytest.fixture(scope="module", params=["mohd", "latent_moe"])
def folder(request, tmp_path_factory):
    """A saved tiny model with a tokenizer and a chat template; routers spread so that routing matters.
    LatentMoE with `output_router_logits` on in its config (as TRL used to save it): inference must not compute the
    aux loss."""
    tokenizer = train_bpe_tokenizer(TEXT * 4, vocab_size=280)
    tokenizer.chat_template = CHAT_TEMPLATE
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    if request.param == "mohd":
        model = MoHDForCausalLM(MoHDConfig(**shape, num_sub_dims=8, num_shared_sub_dims=2))
    else:
        config = LatentMoEConfig(
            **shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_latent_size=16
        )
        config.output_router_logits = True
        model = LatentMoEForCausalLM(config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "router_name"):
                module.weight.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("serve") / request.param
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def local_greedy(folder, prompt_ids: list[int]) -> list[int]:
    """The oracle: `generate`'s greedy tokens of the reloaded folder, up to EOS or MAX_TOKENS."""
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def start(folder, port: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "hf_mohd", "serve", str(folder), "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(
        [*command, "--trust-remote-code", "--device", "cpu", "--dtype", "float32", *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"hf-mohd serve exited {process.returncode}:\n{process.stdout.read()}")
        try:
            client.models.list()
            return process
        except openai.APIConnectionError:
            time.sleep(1)
    process.kill()
    raise AssertionError(f"hf-mohd serve did not answer in 150 s:\n{process.stdout.read()}")


@pytest.mark.parametrize("continuous_batching", [False, True], ids=["plain", "continuous-batching"])
def test_serve_answers_chat_and_completions_as_local_greedy_generation(folder, continuous_batching):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "The river rises"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = "Every token activates"
    want_chat = tokenizer.decode(local_greedy(folder, list(chat_ids)), skip_special_tokens=True)
    want_completion = tokenizer.decode(local_greedy(folder, tokenizer(prompt).input_ids), skip_special_tokens=True)

    port = free_port()
    process = start(folder, port, *(["--continuous-batching"] if continuous_batching else []))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        model = str(folder)
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0
        )
        assert text(chat.choices[0].message.content) == text(want_chat)
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
        )
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text(streamed) == text(want_chat)
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        assert text(completion.choices[0].text) == text(want_completion)
        assert len(text(want_chat)) > 0 and len(text(want_completion)) > 0  # not vacuous
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
