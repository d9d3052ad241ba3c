"""Trainer tests: exact resumption, config errors, packing, and two processes ending with identical weights."""

import dataclasses
import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_mohd.training import latest_checkpoint, load_train_config, train, train_config_from_dict
from hf_mohd.training.config import TrainConfigError
from hf_mohd.training.data import PackedBatches, load_documents, pack, split_documents, train_bpe_tokenizer


WORDS = (
    "the a river city king war music science water light stone north south old new people history language "
    "built ruled crossed wrote sang found measured named carried between under after before during with"
).split()


def write_corpus(path, num_docs=60, seed=0):
    """Deterministic pseudo-English documents, one JSON object per line."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(num_docs):
            sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) for _ in range(8)]
            handle.write(json.dumps({"text": ". ".join(sentences) + "."}) + "\n")
    return str(path)


def tiny_config(tmp_path, corpus, output="run", **overrides):
    values = {
        "output_dir": str(tmp_path / output),
        "max_steps": 6,
        "micro_batch_size": 2,
        "grad_accum_steps": 2,
        "log_every": 1,
        "save_every": 2,
        "progress_bar": False,
        "save_final": False,
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "model": {
            "tokenizer_vocab_size": 300,
            "architecture": {
                "model_type": "mohd",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_sub_dims": 8,
                "num_shared_sub_dims": 2,
                "num_routed_sub_dims_per_tok": 2,
            },
        },
        "data": {"path": corpus, "seq_len": 32, "eval_fraction": 0.1},
    }
    for key, value in overrides.items():
        target = values
        *parents, leaf = key.split(".")
        for part in parents:
            target = target[part]
        target[leaf] = value
    return train_config_from_dict(values)


def curve(result):
    return [(r["step"], r["loss"], r["aux_loss"], r["lr"], r["grad_norm"]) for r in result.train_log]


def test_resume_after_interruption_reproduces_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    config = dict(log_every=2, keep_checkpoints=5)  # a record averages 2 steps; resumption can split that window
    full = train(tiny_config(tmp_path, corpus, "full", **config))
    assert [r[0] for r in curve(full)] == [2, 4, 6]
    assert curve(full)[-1][1] < curve(full)[0][1], "the loss should fall on this repetitive corpus"

    # Attempt 1 stops after step 3 (checkpoints 2 and 3), inside the logging window of steps 3-4.
    first = train(tiny_config(tmp_path, corpus, "resumed", stop_after_steps=3, **config))
    assert first.steps == 3 and first.final_model_dir is None
    # Attempt 2 resumes at 3, stops after step 5 (checkpoints 4 and 5)...
    assert train(tiny_config(tmp_path, corpus, "resumed", stop_after_steps=2, **config)).steps == 5
    # ...and the machine "crashes" while writing step 5's checkpoint: only a partial temporary folder remains, and a
    # log record written after checkpoint 4 must not survive the resumption.
    ckpts = tmp_path / "resumed" / "checkpoints"
    shutil.rmtree(ckpts / "step_0000005")
    (ckpts / ".tmp_step_0000005").mkdir()
    with open(tmp_path / "resumed" / "log.jsonl", "a") as handle:
        handle.write(json.dumps({"step": 5, "loss": 123.0}) + "\n")
    assert latest_checkpoint(str(tmp_path / "resumed")).endswith("step_0000004")

    last = train(tiny_config(tmp_path, corpus, "resumed", **config))
    assert last.steps == 6
    # Exact in fp32 on CPU: same losses, aux losses, learning rates and gradient norms in every record, and the log
    # file reads like one run.
    assert curve(last) == curve(full)
    logged = [json.loads(line) for line in open(tmp_path / "resumed" / "log.jsonl")]
    assert [r["step"] for r in logged if "loss" in r] == [2, 4, 6]
    for (name, a), b in zip(full.model.state_dict().items(), last.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resumption"
    assert last.eval_perplexity == full.eval_perplexity

    # A rerun of the finished run trains and evaluates nothing: it says so and reads the final evaluation back.
    import hf_mohd.training.trainer as trainer_module

    def no_evaluation(*args, **kwargs):
        raise AssertionError("a finished run must not be evaluated again")

    monkeypatch.setattr(trainer_module, "evaluate_perplexity", no_evaluation)
    again = train(tiny_config(tmp_path, corpus, "resumed", **config))
    assert (again.steps, again.eval_loss, again.eval_perplexity) == (6, last.eval_loss, last.eval_perplexity)
    assert "already complete (6 of 6 steps)" in capsys.readouterr().out
    assert [json.loads(line) for line in open(tmp_path / "resumed" / "log.jsonl")] == logged


def test_checkpoint_drops_only_the_tied_weights_warning(tmp_path, caplog):
    """Accelerate warns "Removed shared tensor" for every tied LM head it leaves out of a checkpoint; the trainer
    drops that warning when the removed names are a declared tie (reloading re-ties them, and the weights round-trip
    equal) and keeps it for any other shared tensor."""
    import logging

    from accelerate import Accelerator
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_mohd.training.trainer import TiedWeightsSaveFilter, load_checkpoint, save_checkpoint

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    config.tie_word_embeddings = True
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(LlamaForCausalLM(config))
    with caplog.at_level(logging.WARNING):
        path = save_checkpoint(accelerator, str(tmp_path), step=1, keep=1)
    assert "Removed shared tensor" not in caplog.text
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
    load_checkpoint(accelerator, path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, saved["lm_head.weight"], rtol=0, atol=0)

    quiet = TiedWeightsSaveFilter({"lm_head.weight", "model.embed_tokens.weight"})

    def kept(message: str) -> bool:
        return quiet.filter(logging.LogRecord("accelerate.utils.other", logging.WARNING, "", 0, message, None, None))

    assert not kept("Removed shared tensor {'lm_head.weight'} while saving. This should be OK")
    assert kept("Removed shared tensor {'lm_head.weight', 'model.layers.0.mlp.up_proj.weight'} while saving.")
    assert kept("Some other warning")


def test_exit_process_flushes_output_and_logging_and_exits_with_the_status():
    """`exit_process` skips the interpreter's finalization (`os._exit`), which would drop buffered output: what was
    printed (to a pipe, block-buffered, no newline) and logged must still arrive, with the given exit status."""
    script = (
        "import logging, sys\n"
        "from hf_mohd.training import exit_process\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "print('printed', end='')\n"
        "logging.getLogger('hf_mohd.test').warning('logged')\n"
        "exit_process(3)\n"
        "print('not reached')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as by default
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "printed"
    assert "logged" in done.stderr


def test_config_errors_name_field_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("max_steps: 10\noptim:\n  lr: 1e-3\n  warmup: 5\ndata: {path: x.txt}\n")
    with pytest.raises(ValueError, match=r"bad.yaml.*optim.warmup"):
        load_train_config(path)
    path.write_text("max_steps: ten\ndata: {path: x.txt}\nmodel: {architecture: {model_type: llama}}\n")
    with pytest.raises(ValueError, match=r"bad.yaml.*`max_steps` must be int"):
        load_train_config(path)
    path.write_text("max_steps: 0\ndata: {path: x.txt}\nmodel: {architecture: {model_type: llama}}\n")
    with pytest.raises(ValueError, match=r"`max_steps` must be a positive integer"):
        load_train_config(path)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_train_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match=r"`data.path`.*matches no"):
        train(tiny_config(tmp_path, str(tmp_path / "nothing*.txt")))


def test_packing_keeps_every_token_and_shards_disjointly(tmp_path):
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(12)]
    tokenizer = train_bpe_tokenizer(texts, 280)
    blocks = pack(texts, tokenizer, 16)
    stream = [t for doc in tokenizer(texts)["input_ids"] for t in [*doc, tokenizer.eos_token_id]]
    assert blocks.flatten().tolist() == stream[: blocks.numel()] and len(stream) - blocks.numel() < 16
    numbered = torch.arange(27).view(27, 1)  # block i holds the number i
    ranks = [PackedBatches(numbered, 2, seed=3, process_index=r, num_processes=2) for r in range(2)]
    assert ranks[0].steps_per_epoch == 6
    seen = []
    for batches in ranks:
        iterator = batches.iterate()
        seen += [int(b) for _ in range(6) for b in next(iterator)[2]]
    assert len(set(seen)) == len(seen) == 24  # one epoch: 24 distinct blocks, none twice, none on both ranks
    # Resuming mid-epoch yields what an uninterrupted iterator yields next.
    whole = ranks[0].iterate()
    for _ in range(3):
        next(whole)
    resumed = ranks[0].iterate(epoch=0, index=3)
    assert torch.equal(next(whole)[2], next(resumed)[2])


WORKER = """
import json, sys
import torch
from accelerate import PartialState
from hf_mohd.training import train, train_config_from_dict

result = train(train_config_from_dict(json.load(open(sys.argv[1]))))
state = PartialState()
torch.save({k: v.clone() for k, v in result.model.state_dict().items()}, f"{sys.argv[2]}/rank{state.process_index}.pt")
"""


@pytest.mark.slow
def test_two_processes_end_with_identical_weights(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    config = tiny_config(tmp_path, corpus, "ddp", max_steps=2, save_every=0, save_final=False)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += [str(tmp_path / "worker.py"), str(tmp_path / "config.json"), str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # The same seed gives the same initial weights; one single-process step already moves most tensors.
    one_step = train(tiny_config(tmp_path, corpus, "one", max_steps=1, save_every=0)).model.state_dict()
    moved = 0
    for name, weight in ranks[0].items():
        assert torch.equal(weight, ranks[1][name]), f"{name} differs between ranks"
        moved += not torch.equal(weight, one_step[name])
    assert moved > len(ranks[0]) // 2, "the second step should have changed most tensors"
    logged = [json.loads(line) for line in open(tmp_path / "ddp" / "log.jsonl")]
    assert [r["tokens"] for r in logged if "loss" in r] == [2 * 2 * 2 * 32, 2 * 2 * 2 * 2 * 32]


def test_continued_training_of_a_saved_latent_moe_starts_from_its_weights(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    latent_moe = {
        "model_type": "latent_moe",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "moe_latent_size": 16,
        "router_score_func": "sigmoid",
        "router_bias_update_rate": 0.01,
    }
    first = train(
        tiny_config(tmp_path, corpus, "scratch", max_steps=3, save_final=True, **{"model.architecture": latent_moe})
    )
    biases = [b for n, b in first.model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases), "update_router_biases should have moved the biases"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = AutoModelForCausalLM.from_pretrained(first.final_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(first.final_model_dir)
    config = tiny_config(
        tmp_path, corpus, "continued", max_steps=1, grad_accum_steps=1, **{"model.init_from": first.final_model_dir}
    )
    config.model.architecture = {}
    # The first micro-batch of the continued run, recomputed here: its loss must be the saved model's loss.
    train_texts, _ = split_documents(load_documents(config.data), config.data.eval_fraction, config.seed)
    blocks = pack(train_texts, tokenizer, config.data.seq_len)
    batch = next(PackedBatches(blocks, config.micro_batch_size, config.seed, 0, 1).iterate())[2]
    with torch.no_grad():
        expected = saved(input_ids=batch, labels=batch).loss.item()
    continued = train(config)
    assert continued.train_log[0]["loss"] == pytest.approx(expected, rel=1e-6)


def test_cli_overrides_and_help():
    from hf_mohd.cli import build_parser
    from hf_mohd.commands.train import apply_overrides

    values = apply_overrides({"optim": {"lr": 1.0}}, ["optim.lr=3e-4", "max_steps=7", "data.path=a.txt"])
    assert values == {"optim": {"lr": "3e-4"}, "max_steps": 7, "data": {"path": "a.txt"}}  # YAML 1.1 reading
    values["model"] = {"architecture": {"model_type": "llama"}}
    assert train_config_from_dict(values).optim.lr == 3e-4  # numeric strings are accepted for float fields
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        apply_overrides({}, ["max_steps"])
    args = build_parser().parse_args(["train", "c.yaml", "--set", "max_steps=3"])
    assert args.config == "c.yaml" and args.set == ["max_steps=3"]
    args = build_parser().parse_args(["eval", "folder", "--tasks", "piqa", "--limit", "10"])
    assert (args.tasks, args.limit) == ("piqa", 10)
    args = build_parser().parse_args(["demo", "--quick"])
    assert args.quick and args.max_steps > 0


def test_commands_tell_deepspeed_the_cpu_without_overriding_a_choice(monkeypatch, tmp_path):
    """Without an accelerator, a command sets DS_ACCELERATOR=cpu (DeepSpeed's own pick, minus its warning); a value
    the user set is kept. In a fresh process that imports DeepSpeed the warning is then gone."""
    from hf_mohd.cli import main

    missing = str(tmp_path / "none")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert main(["accounting", missing]) == 3  # a missing folder: the error comes after the set-up
    assert os.environ.get("DS_ACCELERATOR") == ("cpu" if not torch.accelerator.is_available() else None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    assert main(["accounting", missing]) == 3
    assert os.environ["DS_ACCELERATOR"] == "xpu"
    if importlib.util.find_spec("deepspeed") is None or torch.accelerator.is_available():
        return
    code = "from hf_mohd.cli import quiet_deepspeed_on_cpu; quiet_deepspeed_on_cpu(); import deepspeed"
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    loud = subprocess.run(
        [sys.executable, "-c", "import deepspeed"], env=env, capture_output=True, text=True, check=True
    )
    assert "Setting accelerator to CPU" in loud.stdout + loud.stderr  # the warning this removes
    assert "Setting accelerator to CPU" not in quiet.stdout + quiet.stderr


def test_every_option_help_states_its_default_once():
    """Each subcommand option's help ends with its default in one form, "(default: X)" inside the closing full stop,
    whether argparse's formatter adds it or the help writes a default that depends on other options; an option whose
    default comes from elsewhere says where."""
    import argparse
    import re

    from hf_mohd.cli import build_parser

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from parsers(child)

    helps = {}
    for parser in parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.option_strings and action.help and action.help is not argparse.SUPPRESS:
                text = formatter._get_help_string(action) % {**vars(action), "prog": parser.prog}
                helps[(parser.prog, action.option_strings[-1])] = " ".join(text.split())
    assert len(helps) > 100
    for key, text in helps.items():
        mentions = re.findall(r"\bdefault\b", text, flags=re.IGNORECASE)
        assert len(mentions) <= 1, (key, text)
        if mentions and not text.endswith("(the default)."):  # one form, at the end: "... (default: X)."
            tail = text[text.index("(default: ") :] if "(default: " in text else ""
            assert tail and tail.rstrip(".").endswith(")") and ") (default:" not in text, (key, text)
            assert tail.count("(") == tail.count(")"), (key, text)
    mohd = {option: text for (prog, option), text in helps.items() if prog.endswith("convert mohd")}
    assert mohd["--preset"].endswith("(default: full).")
    assert mohd["--calibration-tokens"] == "Calibration tokens used at most (default: 16384)."
    assert "(default: none with --preset full, else inverse_active)" in mohd["--activation-scaling"]
    assert "experiments/" not in mohd["--perplexity-json"]
    assert mohd["--seed"].endswith("(default: 0).")  # a default of 0 is shown too
    for text in helps.values():  # the help of an installed package names no repository file
        assert not re.search(r"(docs/|experiments/|configs/|README\.md's|README\.md gives)", text), text


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--models", "llama-dense,gpt", "error: --models: unknown ['gpt']"),
        ("--eval-tasks", "piqa,nope", "'nope'"),
        ("--threads", "-1", "expected a whole number >= 1"),
    ],
)
def test_demo_rejects_unknown_models_and_tasks_before_training(tmp_path, capsys, option, value, message):
    """A misspelt model or lm-eval task fails at once with one line naming the option, before any data or training
    (the output folder stays empty)."""
    from hf_mohd.cli import main

    assert main(["demo", "--output-dir", str(tmp_path / "out"), option, value]) == 2  # a bad option value
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {option}: ") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_demo_threads_apply_to_the_whole_job(tmp_path, monkeypatch):
    """`--threads N` sets torch's intra-op threads before the first step of the job (the corpus), and 0 leaves
    torch's setting alone."""
    import torch

    import hf_mohd.demo.job as demo_module
    from hf_mohd.cli import main

    seen = []

    class Stop(Exception):
        pass

    def first_step(folder):
        seen.append(torch.get_num_threads())
        raise Stop

    monkeypatch.setattr(demo_module, "wikipedia_corpus", first_step)
    before = torch.get_num_threads()
    try:
        for threads in ("1", "0"):
            torch.set_num_threads(2)
            with pytest.raises(Stop):
                main(["demo", "--output-dir", str(tmp_path / "out"), "--threads", threads])
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]


def test_demo_warns_when_it_starts_on_a_busy_machine_with_one_thread_per_core(tmp_path, monkeypatch, capsys):
    """With torch's default threads (`--threads 0`) and a load average of at least half the cores, the main job prints
    one warning naming the load and `--threads 1` before it starts; with `--threads N` or a quiet machine, none."""
    import hf_mohd.demo.job as demo_module
    from hf_mohd.cli import main

    class Stop(Exception):
        pass

    def first_step(folder):
        raise Stop

    monkeypatch.setattr(demo_module, "wikipedia_corpus", first_step)
    monkeypatch.setattr(demo_module.os, "cpu_count", lambda: 2)
    before = demo_module.torch.get_num_threads()
    printed = []
    try:
        for threads, load in (("0", 1.0), ("0", 0.9), ("1", 3.0)):
            monkeypatch.setattr(demo_module.os, "getloadavg", lambda load=load: (load, load, load))
            with pytest.raises(Stop):
                main(["demo", "--output-dir", str(tmp_path / "out"), "--threads", threads])
            printed.append(capsys.readouterr().out)
    finally:
        demo_module.torch.set_num_threads(before)
    assert "load average is 1.0 on 2 cores" in printed[0] and "--threads 1" in printed[0]
    assert "warning" not in printed[1] and "warning" not in printed[2]


def _write_yaml(path, values) -> str:
    import yaml

    path.write_text(yaml.safe_dump(values))
    return str(path)


def _tiny_values(tmp_path, corpus) -> dict:
    values = tiny_config(tmp_path, corpus, max_steps=2, save_every=0, save_final=True).to_dict()
    values["model"] = {"tokenizer_vocab_size": 300, "architecture": dict(values["model"]["architecture"])}
    return values


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model.architecture.num_sub_dim": 8}, "`model.architecture.num_sub_dim` (did you mean 'num_sub_dims'?)"),
        ({"model.architecture.model_type": "mohdd"}, "is not a registered model type; did you mean ['mohd'"),
        ({"model.architecture.num_shared_sub_dims": 9}, "`num_shared_sub_dims` must be in [0, num_sub_dims=8]"),
        ({"data.path": "corpsu.jsonl"}, "`data.path` 'corpsu.jsonl' matches no"),
        ({"data.text_field": "content"}, "`data.text_field` 'content' is not a column"),
    ],
)
def test_train_cli_names_a_bad_architecture_or_data_field_in_one_line(tmp_path, capsys, monkeypatch, change, message):
    """Each mistake fails before the first step with one `error: <config>: ...` line naming the field; a misspelt
    architecture field is not stored as an extra attribute while the default trains."""
    from hf_mohd.cli import main

    monkeypatch.chdir(tmp_path)
    values = _tiny_values(tmp_path, write_corpus(tmp_path / "corpus.jsonl"))
    for key, value in change.items():
        *parents, leaf = key.split(".")
        target = values
        for part in parents:
            target = target[part]
        target[leaf] = value
    config = _write_yaml(tmp_path / "run.yaml", values)
    assert main(["train", config]) == (3 if "data.path" in change else 6)  # a missing path, or a bad field
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # past datasets' progress bars
    assert len(err) == 1 and err[0].startswith(f"error: {config}: ") and message in err[0], err
    assert not os.path.exists(os.path.join(values["output_dir"], "checkpoints"))


def test_resume_check_reads_fields_a_run_predates_as_their_defaults_and_ignores_execution_choices(tmp_path):
    """A run folder whose `train_config.json` was written before a field existed resumes when that field is at its
    default (what the run used) and is refused when it is not; the experts kernel and the MoHD strategy may change
    between calls (the same function), the model may not."""
    from hf_mohd.training.trainer import check_same_run, field_default

    assert field_default("model.trainable") == "all" and field_default("model.sparse_implementation") == ""
    assert field_default("seed") == 0 and field_default("model.no_such_field") is None
    values = _tiny_values(tmp_path, write_corpus(tmp_path / "corpus.jsonl"))
    saved = json.loads(json.dumps(values))
    assert "sparse_implementation" not in saved["model"] and "trainable" not in saved["model"]  # older than both
    os.makedirs(os.path.join(values["output_dir"], "checkpoints", "step_0000002"))
    with open(os.path.join(values["output_dir"], "train_config.json"), "w", encoding="utf-8") as handle:
        json.dump(saved, handle)

    check_same_run(train_config_from_dict(values))  # both at their defaults: resumes
    check_same_run(train_config_from_dict({**values, "model": {**values["model"], "sparse_implementation": "masked"}}))
    check_same_run(train_config_from_dict({**values, "model": {**values["model"], "experts_implementation": "eager"}}))
    with pytest.raises(TrainConfigError, match="`model.trainable` is 'routers_norms'.* were trained with 'all'"):
        check_same_run(train_config_from_dict({**values, "model": {**values["model"], "trainable": "routers_norms"}}))


def test_train_cli_refuses_other_model_in_a_run_folder_and_leaves_a_finished_run_alone(tmp_path, capsys):
    """A second run in the same folder with another width names the field and both values and touches no
    checkpoint; rerunning the finished run keeps what the user added to `final/`."""
    from hf_mohd.cli import main

    values = _tiny_values(tmp_path, write_corpus(tmp_path / "corpus.jsonl"))
    config = _write_yaml(tmp_path / "run.yaml", values)
    assert main(["train", config, "--set", "optim.lrr=1"]) == 6
    assert f"error: {config} with --set: unknown field(s) ['optim.lrr']" in capsys.readouterr().err
    assert main(["train", config]) == 0
    final = os.path.join(values["output_dir"], "final")
    with open(os.path.join(final, "README.md"), "w") as handle:
        handle.write("my model card\n")
    checkpoints = sorted(os.listdir(os.path.join(values["output_dir"], "checkpoints")))
    capsys.readouterr()

    assert main(["train", config, "--set", "model.architecture.hidden_size=64"]) == 6
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "`model.architecture.hidden_size` is 64, but the checkpoints in" in err[0], err
    assert "trained with 32" in err[0]
    assert sorted(os.listdir(os.path.join(values["output_dir"], "checkpoints"))) == checkpoints

    assert main(["train", config]) == 0
    assert "already complete (2 of 2 steps)" in capsys.readouterr().out
    with open(os.path.join(final, "README.md")) as handle:
        assert handle.read() == "my model card\n"


def test_model_support_reads_each_familys_declared_flags_and_nothing_of_llama():
    """The trainer asks a model what it supports through its class flags (`ModelSupport.of`), not by probing for
    methods: MoHD has layouts, strategies and several activations; LatentMoE layouts and router-bias updates; a
    LLaMA none. Each flag names a method the family really has."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_mohd.training import ModelSupport
    from tests.utils import FAMILIES

    mohd, latent = FAMILIES["mohd"].build(0, torch.float32), FAMILIES["latent_moe"].build(0, torch.float32)
    assert ModelSupport.of(mohd) == ModelSupport(
        weight_layout=True, sparse_implementation=True, active_sub_dims=True, router_bias_update=False
    )
    assert ModelSupport.of(latent) == ModelSupport(weight_layout=True, router_bias_update=True)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))  # fmt: skip
    assert ModelSupport.of(llama) == ModelSupport()
    methods = {
        "weight_layout": "to_weight_layout",
        "sparse_implementation": "set_sparse_implementation",
        "active_sub_dims": "set_active_sub_dims",
        "router_bias_update": "update_router_biases",
    }
    for model in (mohd, latent):
        support = dataclasses.asdict(ModelSupport.of(model))
        assert all(callable(getattr(model, methods[name], None)) == flag for name, flag in support.items()), support
