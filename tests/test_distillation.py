"""Healing by distillation in the trainer (`distill` section, `model.trainable`), checked against hand-computed KL."""

import json
import random

import pytest
import torch
from test_conversion import VOCAB, save_tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import hf_mohd  # noqa: F401  (registers the model types)
from hf_mohd.conversion import describe_mohd_conversion, llama_to_mohd, load_dense_llama, save_converted
from hf_mohd.training import distillation_loss, train, train_config_from_dict
from hf_mohd.training.data import PackedBatches, load_documents, pack, split_documents


def write_word_corpus(path, num_docs=40, seed=0):
    """Documents over the tiny word-level vocabulary of `test_conversion.tiny_tokenizer` (w3 .. w95)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(num_docs):
            handle.write(json.dumps({"text": " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(60))}) + "\n")
    return str(path)


@pytest.fixture
def teacher_and_student(tmp_path):
    """(teacher folder, student folder): a tiny dense LLaMA and its MoHD compression_75 conversion."""
    teacher = tmp_path / "teacher"
    save_tiny_llama(teacher, tied=True, sharded=False)
    source = load_dense_llama(teacher)
    student = llama_to_mohd(source, "compression_75", seed=0)
    save_converted(student, tmp_path / "student", source, describe_mohd_conversion(student.config, 0))
    return teacher, tmp_path / "student"


def distill_config(tmp_path, teacher, student, corpus, output="run", **overrides):
    values = {
        "output_dir": str(tmp_path / output),
        "max_steps": 3,
        "micro_batch_size": 2,
        "log_every": 1,
        "save_every": 1,
        "keep_checkpoints": 5,
        "progress_bar": False,
        "save_final": False,
        "seed": 0,
        "optim": {"lr": 1e-2, "warmup_steps": 0, "weight_decay": 0.0},
        "model": {"init_from": str(student), "trainable": "routers_norms"},
        "data": {"path": corpus, "seq_len": 16, "eval_fraction": 0.1},
        "distill": {"teacher": str(teacher), "kl_weight": 1.0, "temperature": 2.0, "lm_weight": 0.5},
    }
    for key, value in overrides.items():
        target = values
        *parents, leaf = key.split(".")
        for part in parents:
            target = target[part]
        target[leaf] = value
    return train_config_from_dict(values)


def test_distillation_loss_is_t2_times_the_kl():
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=generator), torch.randn(2, 5, 11, generator=generator)
    t = 3.0
    p_teacher, p_student = torch.softmax(teacher / t, -1), torch.softmax(student / t, -1)
    expected = t**2 * (p_teacher * (p_teacher.log() - p_student.log())).sum(-1).mean()
    torch.testing.assert_close(distillation_loss(student, teacher, t), expected, rtol=1e-6, atol=1e-7)
    assert distillation_loss(teacher, teacher, t).abs() < 1e-6
    with pytest.raises(ValueError, match="same tokens and vocabulary"):
        distillation_loss(student, teacher[..., :10], t)


def test_distillation_run_logs_the_kl_trains_only_routers_norms_and_resumes(tmp_path, teacher_and_student):
    teacher_dir, student_dir = teacher_and_student
    corpus = write_word_corpus(tmp_path / "corpus.jsonl")
    config = distill_config(tmp_path, teacher_dir, student_dir, corpus)
    result = train(config)
    # Oracle of the first record: the KL of the untrained student to the teacher on the first micro-batch, by hand.
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir).eval()
    initial = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    train_texts, _ = split_documents(load_documents(config.data), config.data.eval_fraction, config.seed)
    batches = PackedBatches(pack(train_texts, tokenizer, config.data.seq_len), 2, config.seed, 0, 1)
    _, _, first = next(batches.iterate(0, 0))
    with torch.no_grad():
        t = 2.0
        p_teacher = torch.softmax(teacher(first).logits.double() / t, -1)
        log_student = torch.log_softmax(initial(first).logits.double() / t, -1)
        expected = t**2 * (p_teacher * (p_teacher.log() - log_student)).sum(-1).mean().item()
    records = [r for r in result.train_log if "distill_kl" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    # fp32 KL of a small divergence: about 1e-7 of cancellation error (a wrong T, T^2 or batch is far off).
    assert records[0]["distill_kl"] == pytest.approx(expected, abs=1e-6)
    # Only routers, group fusion and norms moved.
    trained = dict(result.model.named_parameters())
    moved = {
        name for name, param in initial.named_parameters() if not torch.equal(param.detach(), trained[name].detach())
    }
    assert moved and all(("router" in n or "group_fusion" in n or "norm" in n) for n in moved), sorted(moved)
    assert any("router" in n for n in moved) and any("norm" in n for n in moved)
    # Interrupted after 2 steps and resumed: the same KL curve as the uninterrupted run.
    interrupted = distill_config(tmp_path, teacher_dir, student_dir, corpus, "resumed", stop_after_steps=2)
    train(interrupted)
    resumed = train(distill_config(tmp_path, teacher_dir, student_dir, corpus, "resumed"))
    curve = [r["distill_kl"] for r in records]
    resumed_curve = [r["distill_kl"] for r in resumed.train_log if "distill_kl" in r]
    assert resumed_curve == pytest.approx(curve, rel=1e-6)


def test_lora_trainable_and_teacher_vocabulary_check(tmp_path, teacher_and_student):
    teacher_dir, student_dir = teacher_and_student
    corpus = write_word_corpus(tmp_path / "corpus.jsonl")
    config = distill_config(tmp_path, teacher_dir, student_dir, corpus, **{"model.trainable": "lora", "max_steps": 2})
    result = train(config)
    base = AutoModelForCausalLM.from_pretrained(student_dir)
    merged_names = dict(result.model.named_parameters())
    lora = [n for n in merged_names if "lora_" in n]
    assert lora and all(merged_names[n].requires_grad for n in lora)
    for name, param in base.named_parameters():  # PEFT names: base_model.model.<name> or ...<name>.base_layer...
        candidates = [
            n for n in merged_names if n.endswith(name) or n.endswith(name.replace(".weight", ".base_layer.weight"))
        ]
        assert candidates and torch.equal(merged_names[candidates[0]].detach(), param.detach()), name
    other = tmp_path / "other"
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB + 4, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    ).save_pretrained(other)
    with pytest.raises(ValueError, match="`distill.teacher`.*vocab_size 100"):
        train(distill_config(tmp_path, other, student_dir, corpus, "bad", **{"distill.teacher": str(other)}))
    with pytest.raises(ValueError, match="model.trainable"):
        distill_config(tmp_path, teacher_dir, student_dir, corpus, **{"model.trainable": "some"})
