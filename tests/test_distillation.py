"""Healing by distillation in the trainer (`distill` section, `model.trainable`), checked against hand-computed KL."""

import json
import random

import pytest
import torch
from test_conversion import VOCAB, save_tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import hf_mohd  # noqa: F401  (registers the model types)
from hf_mohd.conversion import (
    convert_carved_latent_moe,
    describe_mohd_conversion,
    llama_to_mohd,
    load_dense_llama,
    save_converted,
)
from hf_mohd.training import distillation_loss, train, train_config_from_dict
from hf_mohd.training.config import TrainConfigError
from hf_mohd.training.data import PackedBatches, load_documents, pack, split_documents
from hf_mohd.training.distill import select_trainable


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


def test_sparse_implementation_masked_trains_the_same_curve_and_saves_the_config_strategy(
    tmp_path, teacher_and_student
):
    """`model.sparse_implementation: masked` heals a MoHD student with the masked strategy: the same KL curve as the
    default gather strategy (the same function and gradients), every sublayer on the masked strategy while it
    trains, and the saved config keeps "gather"; a bad name and a non-MoHD model are refused with the field named."""
    from hf_mohd.models.mohd_strategies import MoHDMaskedStrategy

    teacher_dir, student_dir = teacher_and_student
    corpus = write_word_corpus(tmp_path / "corpus.jsonl")
    curves, models = {}, {}
    for implementation in ("", "masked"):
        config = distill_config(
            tmp_path, teacher_dir, student_dir, corpus, f"run_{implementation or 'default'}",
            **{"model.sparse_implementation": implementation, "model.trainable": "all", "save_final": True},
        )  # fmt: skip
        result = train(config)
        curves[implementation] = [r["distill_kl"] for r in result.train_log if "distill_kl" in r]
        models[implementation] = result.model
    assert len(curves[""]) == 3
    assert curves["masked"] == pytest.approx(curves[""], rel=1e-5)
    strategies = {type(m.strategy) for m in models["masked"].modules() if hasattr(m, "strategy")}
    assert strategies == {MoHDMaskedStrategy}
    assert MoHDMaskedStrategy not in {type(m.strategy) for m in models[""].modules() if hasattr(m, "strategy")}
    saved = json.loads((tmp_path / "run_masked" / "final" / "config.json").read_text(encoding="utf-8"))
    assert saved["sparse_implementation"] == "gather"
    with pytest.raises(ValueError, match="model.sparse_implementation"):
        distill_config(tmp_path, teacher_dir, student_dir, corpus, **{"model.sparse_implementation": "fast"})
    dense = distill_config(
        tmp_path, teacher_dir, teacher_dir, corpus, "dense", **{"model.sparse_implementation": "masked"}
    )
    with pytest.raises(TrainConfigError, match="model.sparse_implementation"):
        train(dense)


def test_ffn_trainable_heals_a_carved_model_moving_only_its_feed_forward_sublayers(tmp_path):
    """`model.trainable: ffn` on a carved LatentMoE (the carve route's healing, with the `dense_masked` experts
    kernel): every expert kind and the shared expert move, nothing outside the `mlp` sublayers does; everything else
    is frozen. An unknown experts kernel is refused with the field named."""
    teacher = tmp_path / "teacher"
    save_tiny_llama(teacher, tied=True, sharded=False)
    calibration = tmp_path / "calibration.txt"
    rng = random.Random(1)
    calibration.write_text(" ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(2048)), encoding="utf-8")
    convert_carved_latent_moe(
        teacher, tmp_path / "carved", num_experts=4, num_experts_per_tok=1, shared_fraction=0.5,
        calibration_text=calibration, calibration_tokens=1024, calibration_window=64,
    )  # fmt: skip
    corpus = write_word_corpus(tmp_path / "corpus.jsonl")
    config = distill_config(
        tmp_path, teacher, tmp_path / "carved", corpus,
        **{"model.trainable": "ffn", "model.experts_implementation": "dense_masked", "max_steps": 4, "optim.lr": 1e-3},
    )  # fmt: skip
    config.distill.lm_weight, config.distill.temperature = 0.0, 1.0
    result = train(config)
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "carved")
    trained = dict(result.model.named_parameters())
    moved = {
        name for name, param in initial.named_parameters() if not torch.equal(param.detach(), trained[name].detach())
    }
    assert moved and all(".mlp." in name for name in moved), sorted(moved)
    for part in ("experts.gate_up_proj", "experts.down_proj", "shared_experts.down_proj"):
        assert any(part in name for name in moved), (part, sorted(moved))
    assert not any("self_attn" in name or "norm" in name or "embed" in name for name in moved)
    frozen = {name for name, param in result.model.named_parameters() if not param.requires_grad}
    assert frozen == {name for name in trained if ".mlp." not in name}
    assert result.model.config._experts_implementation == "dense_masked"  # the kernel the run asked for
    with pytest.raises(TrainConfigError, match="model.trainable: ffn"):
        select_trainable(torch.nn.Linear(2, 2), config.model)
    with pytest.raises(ValueError, match="model.experts_implementation"):
        distill_config(tmp_path, teacher, tmp_path / "carved", corpus, **{"model.experts_implementation": "fast"})


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


def test_nested_step_gradient_is_the_sum_of_the_separate_losses(tmp_path, teacher_and_student):
    """One nested-healing micro-batch at the target k and at full activation (weights 1 and 0.5) accumulates exactly
    the gradient of 1 * loss(k target) + 0.5 * loss(k = N_r), each loss computed on its own model loaded with that k."""
    from hf_mohd.training.config import DistillConfig
    from hf_mohd.training.distill import nested_backward, student_objective

    teacher_dir, student_dir = teacher_and_student
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64).eval()
    config = DistillConfig(teacher=str(teacher_dir), kl_weight=1.0, temperature=2.0, lm_weight=0.5)
    input_ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        teacher_logits = teacher(input_ids=input_ids).logits
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float64)
    target, full = student.config.num_routed_sub_dims_per_tok, student.config.num_routed_sub_dims
    assert target < full
    aux_coef = student.config.router_aux_loss_coef

    def forward(model):
        return model(input_ids=input_ids, labels=input_ids, output_router_logits=True)

    outputs, kd = nested_backward(
        student,
        [(target, 1.0), (full, 0.5)],
        lambda: forward(student),
        lambda out: student_objective(out, teacher_logits, config, aux_coef),
        lambda objective: objective.backward(),
    )
    assert student.active_sub_dims_per_tok == target  # left at the first k
    expected = {name: torch.zeros_like(param) for name, param in student.named_parameters()}
    kds = {}
    for k, weight in ((target, 1.0), (full, 0.5)):
        oracle = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float64, num_routed_sub_dims_per_tok=k)
        objective, kds[k] = student_objective(forward(oracle), teacher_logits, config, aux_coef)
        (weight * objective).backward()
        for name, param in oracle.named_parameters():
            if param.grad is not None:
                expected[name] += param.grad
    assert kds[full] > 0 and kds[target] > 0 and abs(kds[full] - kds[target]) > 1e-6  # two distinct losses
    assert kd == pytest.approx(kds[target] + 0.5 * kds[full], rel=1e-9)
    torch.testing.assert_close(outputs.logits, forward(student).logits, rtol=0, atol=0)
    for name, param in student.named_parameters():
        got = torch.zeros_like(param) if param.grad is None else param.grad
        torch.testing.assert_close(got, expected[name], rtol=1e-9, atol=1e-12, msg=name)


def test_step_activations_follow_the_schedule_and_draw_reproducibly():
    """Hand-computed schedule values (target 2, N_r 10, over half of 10 steps) and the per-step draws."""
    from hf_mohd.training.config import DistillConfig
    from hf_mohd.training.distill import step_activations

    linear = DistillConfig(active_sub_dims=[2, 10], active_weights=[1.0, 0.5], schedule_fraction=0.5)
    ks = [step_activations(linear, step, 10, 2, 10, seed=0) for step in range(7)]
    # step 0: k = 10 merges with the full-activation entry (weights 1 + 0.5); step 1: 2 + 8 * 0.8 = 8.4 -> 8;
    # step 4: 2 + 8 * 0.2 = 3.6 -> 4; from step 5 on (T = 5): the target
    assert ks[0] == [(10, 1.5)]
    assert [pairs[0][0] for pairs in ks] == [10, 8, 7, 5, 4, 2, 2]
    assert ks[1] == [(8, 1.0), (10, 0.5)]
    cubic = DistillConfig(active_sub_dims=[2], schedule_fraction=0.5, schedule_curve="cubic")
    assert [step_activations(cubic, step, 10, 2, 10, seed=0)[0][0] for step in range(6)] == [10, 6, 4, 3, 2, 2]
    drawing = DistillConfig(active_sub_dims=[2, 10], random_active_weight=0.25)
    draws = [step_activations(drawing, step, 10, 2, 10, seed=3) for step in range(40)]
    assert all(pairs[:2] == [(2, 1.0), (10, 1.0)] and 2 < pairs[2][0] < 10 for pairs in draws if len(pairs) == 3)
    assert len({pairs[-1][0] for pairs in draws}) >= 5  # spread over 3 .. 9
    assert draws == [step_activations(drawing, step, 10, 2, 10, seed=3) for step in range(40)]  # reproducible
    with pytest.raises(ValueError, match=r"`distill.active_sub_dims` \[2, 11\]"):
        step_activations(DistillConfig(active_sub_dims=[2, 11]), 0, 10, 2, 10, seed=0)
    with pytest.raises(ValueError, match="does not hold it"):
        step_activations(DistillConfig(active_sub_dims=[3, 10], schedule_fraction=0.5), 0, 10, 2, 10, seed=0)
    for distill, field in (
        ({"active_sub_dims": [2, 10], "active_weights": [1.0]}, "active_weights"),
        ({"active_sub_dims": [0]}, "active_sub_dims"),
        ({"schedule_fraction": 1.5}, "schedule_fraction"),
        ({"schedule_curve": "exp"}, "schedule_curve"),
    ):
        with pytest.raises(ValueError, match=f"`distill.{field}`"):
            train_config_from_dict({"model": {"init_from": "x"}, "data": {"path": "x"}, "distill": distill})


def test_nested_healing_run_logs_its_ks_resumes_and_ends_at_the_target(tmp_path, teacher_and_student):
    """A 4-step nested run with a linear schedule over half of it: the logged ks per step, the same after an
    interruption at step 2, and the saved/returned model back at its own k."""
    teacher_dir, student_dir = teacher_and_student
    corpus = write_word_corpus(tmp_path / "corpus.jsonl")
    nested = {"max_steps": 4, "distill.active_sub_dims": [3, 7], "distill.schedule_fraction": 0.5}
    student_config = json.load(open(student_dir / "config.json"))
    routed = student_config["num_sub_dims"] - student_config["num_shared_sub_dims"]
    assert (student_config["num_routed_sub_dims_per_tok"], routed) == (3, 7)
    full = train(distill_config(tmp_path, teacher_dir, student_dir, corpus, "full", **nested))
    logged = [r["active_sub_dims"] for r in full.train_log]
    # T = 2 steps: step 0 k = 7 (merged with the full entry), step 1 3 + 4 * 0.5 = 5, then the target
    assert logged == [[7], [5, 7], [3, 7], [3, 7]]
    assert full.model.active_sub_dims_per_tok == 3
    train(distill_config(tmp_path, teacher_dir, student_dir, corpus, "resumed", stop_after_steps=2, **nested))
    resumed = train(distill_config(tmp_path, teacher_dir, student_dir, corpus, "resumed", **nested))
    assert [r["active_sub_dims"] for r in resumed.train_log] == logged
    assert [r["distill_kl"] for r in resumed.train_log] == pytest.approx([r["distill_kl"] for r in full.train_log])


def test_nested_healing_of_a_student_with_per_layer_budgets(tmp_path, teacher_and_student):
    """Nested healing at [3, 7] of a student whose layer 0 FFN has k = 5: the model's own k (3, its config's) runs
    each sublayer at its configured k, and the healed model comes back with those budgets (saved and returned)."""
    teacher_dir, student_dir = teacher_and_student
    corpus = write_word_corpus(tmp_path / "corpus.jsonl")
    uneven = tmp_path / "uneven"
    model = AutoModelForCausalLM.from_pretrained(student_dir)
    config = model.config.to_dict()
    config["per_layer_config"] = {0: {"ffn_routed_sub_dims_per_tok": 5}}
    type(model)(type(model.config).from_dict(config)).save_pretrained(uneven)
    AutoTokenizer.from_pretrained(student_dir).save_pretrained(uneven)
    nested = {"max_steps": 2, "distill.active_sub_dims": [3, 7], "save_final": True}
    result = train(distill_config(tmp_path, teacher_dir, uneven, corpus, "uneven_run", **nested))
    assert [r["active_sub_dims"] for r in result.train_log] == [[3, 7], [3, 7]]
    for healed in (result.model, AutoModelForCausalLM.from_pretrained(tmp_path / "uneven_run" / "final")):
        ks = {name: module.top_k for name, module in healed.named_modules() if name.endswith("sub_dims.router")}
        assert ks["model.layers.0.mlp.sub_dims.router"] == 5
        assert {k for name, k in ks.items() if name != "model.layers.0.mlp.sub_dims.router"} == {3}


def test_hidden_basis_and_loss_of_an_exact_rotated_conversion(tmp_path):
    """Oracle: an exact conversion with the PCA rotation (`rotate_llama`, whose Q is returned) has the teacher's
    residual stream in basis Q after every layer. `hidden_basis` recovers that Q from the embeddings, the hidden
    loss of the exact model is 0 (float64) and that of a sparse one with the same weights is not; a student of
    another width is refused."""
    from hf_mohd.conversion import rotate_llama
    from hf_mohd.training.distill import hidden_basis, hidden_distillation_loss

    save_tiny_llama(tmp_path / "llama", tied=True, sharded=False)
    source = load_dense_llama(tmp_path / "llama", dtype=torch.float64)
    calibration = torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    rotated, info = rotate_llama(source, calibration)
    teacher = source.build_llama().eval()
    exact = llama_to_mohd(rotated, "full").eval()
    basis = hidden_basis(teacher, exact)
    torch.testing.assert_close(basis, info["basis"].double(), rtol=0, atol=1e-9)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = teacher(ids, output_hidden_states=True).hidden_states
        got = exact(ids, output_hidden_states=True).hidden_states
        assert hidden_distillation_loss(got, want, basis) < 1e-12  # relative squared error, fp32 norms inside
        sparse = llama_to_mohd(rotated, "compression_50", seed=0).eval()
        assert hidden_distillation_loss(sparse(ids, output_hidden_states=True).hidden_states, want, basis) > 1e-3
        # by hand for layer 1 alone of a two-layer model: ||h_s - h_t Q||^2 / ||h_t Q||^2
        h_s, h_t = sparse(ids, output_hidden_states=True).hidden_states, want
        by_hand = (h_s[1] - h_t[1] @ basis).pow(2).sum() / (h_t[1] @ basis).pow(2).sum()
        torch.testing.assert_close(hidden_distillation_loss(h_s, h_t, basis), by_hand)
    narrow = LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    )
    with pytest.raises(ValueError, match="`distill.hidden_weight` compares residual streams"):
        hidden_basis(teacher, narrow)


def test_hidden_weight_adds_a_trained_term(tmp_path, teacher_and_student):
    """A one-step run with `distill.hidden_weight` moves the weights differently from the same run without it (the
    term has a gradient), and the field is refused without a teacher."""
    teacher_dir, student_dir = teacher_and_student
    corpus = write_word_corpus(tmp_path / "corpus.jsonl")
    runs = {}
    for weight in (0.0, 10.0):
        overrides = {"max_steps": 1, "distill.hidden_weight": weight, "model.trainable": "all"}
        runs[weight] = train(distill_config(tmp_path, teacher_dir, student_dir, corpus, f"h{weight}", **overrides))
    plain, hidden = (dict(runs[w].model.named_parameters()) for w in (0.0, 10.0))
    assert max((plain[n] - hidden[n]).abs().max().item() for n in plain) > 1e-6
    with pytest.raises(ValueError, match="`distill.hidden_weight` must be >= 0 and needs `distill.teacher`"):
        train_config_from_dict(
            {
                "output_dir": str(tmp_path / "x"),
                "model": {"init_from": str(student_dir)},
                "data": {"path": corpus},
                "distill": {"hidden_weight": 1.0},
            }
        )


def test_hidden_distillation_resumes_with_the_basis_of_its_start(tmp_path, teacher_and_student):
    """A run with `distill.hidden_weight` that trains the embedding, interrupted at step 2 and resumed, logs the
    same KL as the uninterrupted run: the change of basis comes from the weights the run started from, not from the
    checkpoint's trained embedding (which is no longer a change of basis of the teacher's and was refused)."""
    teacher_dir, student_dir = teacher_and_student
    corpus = write_word_corpus(tmp_path / "corpus.jsonl")
    overrides = {"max_steps": 4, "distill.hidden_weight": 1.0, "model.trainable": "all"}
    full = train(distill_config(tmp_path, teacher_dir, student_dir, corpus, "full", **overrides))
    train(distill_config(tmp_path, teacher_dir, student_dir, corpus, "resumed", stop_after_steps=2, **overrides))
    start = AutoModelForCausalLM.from_pretrained(student_dir).get_input_embeddings().weight.detach()
    resumed = train(distill_config(tmp_path, teacher_dir, student_dir, corpus, "resumed", **overrides))
    trained = resumed.model.get_input_embeddings().weight.detach()
    assert (trained - start).abs().max().item() > 1e-4  # the embedding did train
    assert len(resumed.train_log) == len(full.train_log) == 4
    assert [r["distill_kl"] for r in resumed.train_log] == pytest.approx([r["distill_kl"] for r in full.train_log])
    assert [r["loss"] for r in resumed.train_log] == pytest.approx([r["loss"] for r in full.train_log])
