"""FSDP2 and DeepSpeed ZeRO-2 through `accelerate launch` on CPU (gloo, 2 processes) against the 1-process run of the
same global batch.

Every test launches the trainer with the repository's own `configs/accelerate/fsdp2_cpu.yaml` (or
`deepspeed_zero2_cpu.yaml`) and compares the weights it ends with (`final/`, gathered from the shards by
`save_pretrained`) to a 1-process run in fp32; the oracle is the 1-process run, which the rest of the suite ties to
Llama and to transformers' own models.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from test_training import write_corpus

from hf_mohd.training import train, train_config_from_dict


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP2_CPU = os.path.join(ROOT, "configs", "accelerate", "fsdp2_cpu.yaml")
DEEPSPEED_ZERO2_CPU = os.path.join(ROOT, "configs", "accelerate", "deepspeed_zero2_cpu.yaml")
TOLERANCE = 1e-5  # max |difference| of any weight after the run, fp32

ARCHITECTURES = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "mohd": {
        "model_type": "mohd",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_sub_dims": 8,
        "num_shared_sub_dims": 2,
        "num_routed_sub_dims_per_tok": 2,
    },
    "latent_moe": {
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
    },
}
DECODER_LAYERS = {"llama": "LlamaDecoderLayer", "mohd": "MoHDDecoderLayer", "latent_moe": "LatentMoEDecoderLayer"}

# What `hf-mohd train` does, then (rank 0) which modules FSDP2 sharded and the sharded model's perplexity loss on
# 5 blocks: 3 on rank 0 (2 batches of 2), 2 on rank 1 (1 batch), so rank 1 must join rank 0's second forward.
WORKER = """
import json, sys

import torch

from accelerate import Accelerator
from torch.distributed.fsdp import FSDPModule
from transformers import AutoTokenizer

from hf_mohd.training import load_train_config, train
from hf_mohd.training.data import load_documents, pack, split_documents
from hf_mohd.training.trainer import evaluate_perplexity, exit_process

Accelerator.end_training = lambda self: None  # keeps the process group for the check below
config = load_train_config(sys.argv[1])
model = train(config).model
units = {name: [c.__name__ for c in type(m).__mro__] for name, m in model.named_modules() if isinstance(m, FSDPModule)}
texts = split_documents(load_documents(config.data), config.data.eval_fraction, config.seed)[0]
blocks = pack(texts, AutoTokenizer.from_pretrained(config.output_dir + "/tokenizer"), config.data.seq_len)[:5]
accelerator = Accelerator()  # the run's state (FSDP over gloo) is shared by every Accelerator of the process
loss = evaluate_perplexity(model, blocks, 2, accelerator)[0]
if accelerator.is_main_process:
    json.dump({"units": units, "five_block_loss": loss}, open(sys.argv[2], "w"))
torch.distributed.barrier()
torch.distributed.destroy_process_group()
exit_process(0)  # as `hf-mohd train` ends a multi-process run: past gloo's teardown race (see its docstring)
"""


def run_config(tmp_path, corpus, output, architecture, **overrides):
    """A 3-step fp32 run of a tiny model on 16-token sequences; `overrides` set top-level fields."""
    values = {
        "output_dir": str(tmp_path / output),
        "max_steps": 3,
        "micro_batch_size": 4,
        "grad_accum_steps": 1,
        "mixed_precision": "no",
        "router_aux_loss": False,
        "log_every": 1,
        "save_every": 0,
        "progress_bar": False,
        "save_final": True,
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "model": {"tokenizer_vocab_size": 300, "architecture": architecture},
        "data": {"path": corpus, "seq_len": 16, "eval_fraction": 0.1},
        **overrides,
    }
    return train_config_from_dict(values)


def launch(tmp_path, config, *script, config_file=FSDP2_CPU, check=True):
    """`accelerate launch --config_file CONFIG_FILE SCRIPT...` (default `fsdp2_cpu.yaml`) with 2 gloo processes;
    with `check`, it must exit 0.

    No ACCELERATE_USE_CPU: the config file alone must give FSDP2 (or DeepSpeed) on a machine without GPUs.
    """
    path = tmp_path / f"{os.path.basename(config.output_dir)}.json"
    path.write_text(json.dumps(config.to_dict()))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file]
    command += ["--main_process_port", str(port), *script]
    command = [part.replace("{config}", str(path)) for part in command]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 or not check, done.stderr[-4000:]
    return done


def final_weights(output_dir):
    return load_file(os.path.join(output_dir, "final", "model.safetensors"))


def logged(output_dir):
    with open(os.path.join(output_dir, "log.jsonl"), encoding="utf-8") as handle:
        return [record for record in map(json.loads, handle) if "loss" in record]


# What `save_state` writes for the model and AdamW, one folder each: Accelerate's FSDP path (not DDP) writes one
# torch.distributed.checkpoint shard per rank.
FSDP_CHECKPOINT = {
    part: [".metadata", "__0_0.distcp", "__1_0.distcp"] for part in ("pytorch_model_fsdp_0", "optimizer_0")
}


def assert_resumed_equals_whole(resumed_dir, whole_dir):
    """The resumed run logged exactly the uninterrupted run's 4 steps (loss, aux, lr, grad norm) and ends with its
    weights, bit for bit (fp32)."""

    def curve(output_dir):
        return [(r["step"], r["loss"], r["aux_loss"], r["lr"], r["grad_norm"]) for r in logged(output_dir)]

    assert curve(resumed_dir) == curve(whole_dir)
    assert [r[0] for r in curve(whole_dir)] == [1, 2, 3, 4]
    a, b = final_weights(resumed_dir), final_weights(whole_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_same_run(sharded_dir, single_dir, checkpoint_layout=FSDP_CHECKPOINT):
    """Same weights (<= TOLERANCE), same logged losses; the sharded run wrote a checkpoint of `checkpoint_layout`."""
    sharded, single = final_weights(sharded_dir), final_weights(single_dir)
    assert sharded.keys() == single.keys()
    worst = max((sharded[k] - single[k]).abs().max().item() for k in single)
    assert worst <= TOLERANCE, f"max |difference| of the weights {worst:.3g} > {TOLERANCE}"
    two, one = logged(sharded_dir), logged(single_dir)
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(two, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["tokens"] == b["tokens"]
    assert one[-1]["loss"] < one[0]["loss"] - 1e-3, "the three steps should have trained the model"
    checkpoint = os.path.join(sharded_dir, "checkpoints", "step_0000003")
    for part, files in checkpoint_layout.items():
        assert sorted(os.listdir(os.path.join(checkpoint, part))) == files
    return sharded


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mohd", "latent_moe", "llama"])
def test_fsdp2_on_two_cpu_processes_ends_with_the_one_process_weights(tmp_path, family):
    """`python -m hf_mohd train` under FSDP2: 2 x 2 sequences per step give the weights of 1 x 4 sequences."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=30)
    architecture = ARCHITECTURES[family]
    sharded = run_config(tmp_path, corpus, "fsdp", architecture, micro_batch_size=2)
    launch(tmp_path, sharded, "-m", "hf_mohd", "train", "{config}")
    single = train(run_config(tmp_path, corpus, "single", architecture))
    weights = assert_same_run(sharded.output_dir, single.output_dir)

    # `final/` is an ordinary save_pretrained folder of the family's own class, loadable by one process.
    from transformers import AutoModelForCausalLM

    with open(os.path.join(sharded.output_dir, "final", "config.json"), encoding="utf-8") as handle:
        saved = json.load(handle)
    assert saved["architectures"] == [type(single.model).__name__]
    assert all("fsdp" not in target.lower() for target in saved.get("auto_map", {}).values()), saved["auto_map"]
    assert not [n for n in os.listdir(os.path.join(sharded.output_dir, "final")) if n.startswith("_fsdp")]
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(sharded.output_dir, "final"))
    for name, tensor in loaded.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name]), name
    if family == "latent_moe":  # aux-loss-free balancing moved the router biases, identically in both runs
        biases = [k for k in weights if k.endswith("e_score_correction_bias")]
        assert len(biases) == 2 and all(weights[k].abs().sum() > 0 for k in biases)


ACCUMULATION_CASES = {
    # family, architecture changes, what the case adds to plain accumulation
    "llama": ("llama", {}),
    "mohd_aux": ("mohd", {}),  # sub-dimension load-balance loss (output_router_logits)
    "latent_moe_aux": ("latent_moe", {"router_score_func": "softmax", "tie_word_embeddings": True}),  # Switch aux
    "latent_moe_bias": ("latent_moe", {}),  # sigmoid routing: update_router_biases() on all-reduced loads
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ACCUMULATION_CASES))
def test_fsdp2_gradient_accumulation_router_aux_loss_and_bias_updates_match_one_process(tmp_path, case):
    """2 processes x 2 accumulated micro-batches of 1 sequence = 1 process x 4 accumulated micro-batches.

    The router aux loss is a product of per-micro-batch means (Switch Transformer eq. 4-6), so it is the same only
    for the same micro-batches: here both runs see the same single-sequence micro-batches (`PackedBatches` gives
    micro-step i's sequences 2i, 2i + 1 to ranks 0, 1), and AdamW sees the mean of their gradients either way.
    """
    family, changes = ACCUMULATION_CASES[case]
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=30)
    architecture = {**ARCHITECTURES[family], **changes}
    common = {"micro_batch_size": 1, "router_aux_loss": True}
    sharded = run_config(tmp_path, corpus, "fsdp", architecture, grad_accum_steps=2, **common)
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    launch(tmp_path, sharded, str(tmp_path / "worker.py"), "{config}", str(tmp_path / "units.json"))
    single_config = run_config(tmp_path, corpus, "single", architecture, grad_accum_steps=4, **common)
    single = train(single_config)
    weights = assert_same_run(sharded.output_dir, single.output_dir)

    # The wrapping policy of fsdp2_cpu.yaml: each decoder layer (`_no_split_modules`) is one FSDP2 unit, nothing
    # inside it is sharded apart; Accelerate adds the embeddings and [final norm, LM head] (one group) and the root.
    report = json.loads((tmp_path / "units.json").read_text())
    units = report["units"]
    assert sorted(units) == ["", "lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    assert all(DECODER_LAYERS[family] in units[f"model.layers.{i}"] for i in range(2))
    # Held-out scoring of the sharded model with uneven shards of blocks = the 1-process model's.
    from transformers import AutoTokenizer

    from hf_mohd.training.data import load_documents, pack, split_documents
    from hf_mohd.training.trainer import evaluate_perplexity

    texts = split_documents(load_documents(single_config.data), single_config.data.eval_fraction, 0)[0]
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(sharded.output_dir, "tokenizer"))
    blocks = pack(texts, tokenizer, single_config.data.seq_len)[:5]
    assert report["five_block_loss"] == pytest.approx(evaluate_perplexity(single.model, blocks, 2)[0], abs=1e-5)
    aux = [r["aux_loss"] for r in logged(single.output_dir)]
    if case.endswith("_aux"):
        assert all(a > 0.5 for a in aux), "the aux loss should be on (about 1 for balanced routing)"
    if case == "latent_moe_bias":
        biases = [k for k in weights if k.endswith("e_score_correction_bias")]
        assert len(biases) == 2 and all(weights[k].abs().sum() > 0 for k in biases)


@pytest.mark.slow
def test_fsdp2_sharded_checkpoint_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Stopped after 2 of 4 steps (sharded checkpoint), then relaunched: the same losses as one uninterrupted
    FSDP2 run, exactly (fp32), and the same final weights. A sharded save killed half-way (a `.tmp_step_*` folder
    with a truncated shard) is ignored: the resume starts from the previous complete checkpoint."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=30)
    architecture = ARCHITECTURES["mohd"]
    common = {"micro_batch_size": 2, "max_steps": 4, "save_every": 2, "router_aux_loss": True}
    whole = run_config(tmp_path, corpus, "whole", architecture, **common)
    launch(tmp_path, whole, "-m", "hf_mohd", "train", "{config}")
    interrupted = run_config(tmp_path, corpus, "resumed", architecture, stop_after_steps=2, **common)
    launch(tmp_path, interrupted, "-m", "hf_mohd", "train", "{config}")
    checkpoints = os.path.join(interrupted.output_dir, "checkpoints")
    assert sorted(os.listdir(checkpoints)) == ["step_0000002"]
    assert not os.path.exists(os.path.join(interrupted.output_dir, "final"))
    partial = os.path.join(checkpoints, ".tmp_step_0000003", "pytorch_model_fsdp_0")
    os.makedirs(partial)
    with open(os.path.join(checkpoints, "step_0000002", "pytorch_model_fsdp_0", "__0_0.distcp"), "rb") as handle:
        head = handle.read(100)
    with open(os.path.join(partial, "__0_0.distcp"), "wb") as handle:
        handle.write(head)
    resumed = run_config(tmp_path, corpus, "resumed", architecture, **common)
    launch(tmp_path, resumed, "-m", "hf_mohd", "train", "{config}")

    assert_resumed_equals_whole(resumed.output_dir, whole.output_dir)
    assert sorted(n for n in os.listdir(checkpoints) if n.startswith("step_")) == ["step_0000002", "step_0000004"]


needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (scripts/setup.sh installs it: pip install --no-build-isolation deepspeed)",
)


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_zero2_on_two_cpu_processes_ends_with_the_one_process_weights(tmp_path):
    """`python -m hf_mohd train` under DeepSpeed ZeRO-2 (`deepspeed_zero2_cpu.yaml`, gloo): 2 x 2 sequences per
    step give the weights of 1 x 4 sequences (DeepSpeed clips at 1.0, as the 1-process run does)."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=30)
    architecture = ARCHITECTURES["mohd"]
    sharded = run_config(tmp_path, corpus, "zero2", architecture, micro_batch_size=2)
    launch(tmp_path, sharded, "-m", "hf_mohd", "train", "{config}", config_file=DEEPSPEED_ZERO2_CPU)
    single = train(run_config(tmp_path, corpus, "single", architecture))
    # DeepSpeed's own checkpoint (not DDP's model.safetensors + optimizer.bin): ZeRO-2 partitioned the AdamW states,
    # one file per rank, next to the one copy of the model.
    zero2 = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    zero2.append("zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert_same_run(sharded.output_dir, single.output_dir, {"pytorch_model": zero2})


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_refuses_the_trainers_gradient_accumulation(tmp_path):
    """DeepSpeed owns accumulation (it steps inside `backward`): `grad_accum_steps: 2` under ZeRO-2 fails at once
    with an error naming the field, instead of training with other steps than the trainer counts."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=30)
    config = run_config(tmp_path, corpus, "accum", ARCHITECTURES["mohd"], micro_batch_size=2, grad_accum_steps=2)
    done = launch(tmp_path, config, "-m", "hf_mohd", "train", "{config}", config_file=DEEPSPEED_ZERO2_CPU, check=False)
    assert done.returncode != 0
    assert "`grad_accum_steps` is 2" in done.stderr and "both must be 1" in done.stderr


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_zero2_checkpoint_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Stopped after 2 of 4 steps (DeepSpeed checkpoint: partitioned AdamW states), then relaunched: the same losses
    as one uninterrupted ZeRO-2 run, exactly (fp32), and the same final weights."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=30)
    architecture = ARCHITECTURES["mohd"]
    common = {"micro_batch_size": 2, "max_steps": 4, "save_every": 2, "router_aux_loss": True}
    script = ("-m", "hf_mohd", "train", "{config}")
    whole = run_config(tmp_path, corpus, "whole", architecture, **common)
    launch(tmp_path, whole, *script, config_file=DEEPSPEED_ZERO2_CPU)
    interrupted = run_config(tmp_path, corpus, "resumed", architecture, stop_after_steps=2, **common)
    launch(tmp_path, interrupted, *script, config_file=DEEPSPEED_ZERO2_CPU)
    checkpoints = os.path.join(interrupted.output_dir, "checkpoints")
    assert sorted(os.listdir(checkpoints)) == ["step_0000002"]
    resumed = run_config(tmp_path, corpus, "resumed", architecture, **common)
    launch(tmp_path, resumed, *script, config_file=DEEPSPEED_ZERO2_CPU)

    assert_resumed_equals_whole(resumed.output_dir, whole.output_dir)
