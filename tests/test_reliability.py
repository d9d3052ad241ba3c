"""Reliability: every field of both configurations refuses bad values with a `ValueError` naming it; every file the
package reads refuses damage with an error naming the file and what was expected; interrupted writes (conversion,
Nemotron-H export, training checkpoints, publish) leave nothing a later run would trust; a full disk during a
checkpoint keeps the previous one, from which the run resumes exactly; and the remote-code files of a saved checkpoint
import nothing but torch, transformers (with huggingface_hub), the standard library and each other, and open nothing
outside the checkpoint folder, transformers, torch's site-packages and the standard library.

The table "What bad input gives" in docs/bad-input.md lists the inputs tried here and the messages they give.
"""

import errno
import json
import math
import re
from pathlib import Path

import pytest
import torch

from hf_mohd import LatentMoEConfig, MoHDConfig


NAN, INF = math.nan, math.inf

# --- invalid configurations ---------------------------------------------------------------------------------------

LLAMA_FIELDS = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
)
MOHD_BASES = {
    "mohd_gqa": dict(
        LLAMA_FIELDS, num_hidden_layers=2, num_sub_dims=8, num_shared_sub_dims=3, num_routed_sub_dims_per_tok=2
    ),
    "mohd_no_shared_tied": dict(
        LLAMA_FIELDS,
        num_hidden_layers=1,
        num_sub_dims=4,
        num_shared_sub_dims=0,
        num_routed_sub_dims_per_tok=1,
        tie_word_embeddings=True,
        sparse_modules=["ffn"],
        sparse_implementation="masked",
    ),
}
LATENT_MOE_BASES = {
    "latent_moe_per_layer": dict(
        LLAMA_FIELDS,
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_latent_size=16,
        moe_shared_expert_intermediate_size=16,
        per_layer_config={0: {"mixer_type": "mlp"}},
    ),
    "latent_moe_nemotron_like": dict(
        LLAMA_FIELDS,
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_gated=False,
        hidden_act="relu2",
        router_score_func="sigmoid",
        position_embedding_type="none",
    ),
}

# Field -> values that must be refused (out of range, wrong type), each tried alone on every valid base above.
COMMON_BAD = {
    "vocab_size": [0, -1, 2.5, "97", True],
    "hidden_size": [0, -64, 64.0, "64", True],
    "intermediate_size": [0, -1, 96.0, "96"],
    "num_hidden_layers": [0, -1, 2.0],
    "num_attention_heads": [0, -4, 3, 4.0],
    "num_key_value_heads": [0, -2, 3, 2.0],
    "head_dim": [0, -16, 16.0],
    "hidden_act": ["swish2", 3],
    "max_position_embeddings": [0, -1, 128.0],
    "initializer_range": [-0.1, 2.0, NAN, "0.02"],
    "rms_norm_eps": [0.0, -1e-6, NAN, INF, "1e-6"],
    "use_cache": ["yes", 1],
    "pad_token_id": [97, -98, 1.5, "0"],
    "bos_token_id": [1.5, "1"],
    "eos_token_id": [1.5, "2", [2, "3"]],
    "tie_word_embeddings": ["no"],
    "rope_parameters": [{"rope_type": "unknown"}, {"rope_type": "default", "rope_theta": -1.0}, "default"],
    "attention_bias": ["no"],
    "attention_dropout": [-0.1, 1.5, NAN, "0.1"],
    "mlp_bias": ["no"],
    "router_aux_loss_coef": [-0.1, NAN, INF, "0.01"],
    "output_router_logits": ["yes"],
}
MOHD_BAD = {
    **COMMON_BAD,
    "num_sub_dims": [0, 7, 8.0],
    "num_shared_sub_dims": [-1, 9, 3.0],
    "num_routed_sub_dims_per_tok": [-1, 9, 2.0],
    "attention_routed_sub_dims_per_tok": [-1, 9, 2.0, "2"],
    "ffn_routed_sub_dims_per_tok": [-1, 9, 2.0, True],
    "sparse_sides": ["neither", None],
    "sparse_modules": [["attention", "moe"], ["ffn", "ffn"], "ffn", [1]],
    "activation_scaling": ["sqrt", None],
    "routed_gate": ["sigmoid"],
    "group_fusion": ["dense"],
    "sparse_implementation": [""],  # an unknown name is refused when the model is built (test_mohd_sparse.py)
    "dropped_block_compensation": ["yes", 1],
}
LATENT_MOE_BAD = {
    **COMMON_BAD,
    "mlp_gated": ["yes"],
    "position_embedding_type": ["alibi"],
    "mixer_type": ["attention", 1],
    "num_experts": [0, 1, 4.0],
    "num_experts_per_tok": [0, 9, 2.0],
    "moe_intermediate_size": [0, 16.0],
    "moe_latent_size": [0, -1, 16.0, "16"],
    "moe_shared_expert_intermediate_size": [-1, 16.0],
    "router_score_func": ["relu"],
    "router_gate": ["ones", None],
    "norm_topk_prob": ["yes"],
    "routed_scaling_factor": [0, -1.0, NAN, INF, "1.0"],
    "router_bias_update_rate": [-1e-3, NAN, "0.001"],
}
# Per-layer overrides of LatentMoE: (per_layer_config, field the message must name).
BAD_PER_LAYER = [
    ({1: {"hidden_size": 32}}, "per_layer_config"),
    ({7: {"mixer_type": "mlp"}}, "per_layer_config"),
    ({1: {"num_experts": 0}}, "num_experts"),
    ({1: {"num_experts_per_tok": 5}}, "num_experts_per_tok"),
    ({1: {"mixer_type": "conv"}}, "mixer_type"),
    ({0: {"intermediate_size": 0}}, "intermediate_size"),
    ({1: {"moe_latent_size": -4}}, "moe_latent_size"),
    ({1: {"routed_scaling_factor": NAN}}, "routed_scaling_factor"),
]


def _cases(bases, table):
    return [
        pytest.param(bases[base], field, value, id=f"{base}-{field}={value!r}")
        for base in bases
        for field, values in table.items()
        for value in values
    ]


@pytest.mark.parametrize(
    "cls, bases, table",
    [(MoHDConfig, MOHD_BASES, MOHD_BAD), (LatentMoEConfig, LATENT_MOE_BASES, LATENT_MOE_BAD)],
    ids=["mohd", "latent_moe"],
)
def test_bad_value_table_covers_every_field_and_bases_are_valid(cls, bases, table):
    """A field added to a configuration class without bad values here fails this test."""
    assert set(table) == set(cls.__annotations__)
    for base in bases.values():
        cls(**base).validate_architecture()


@pytest.mark.parametrize("base, field, value", _cases(MOHD_BASES, MOHD_BAD))
def test_invalid_mohd_field_raises_value_error_naming_it(base, field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        MoHDConfig(**{**base, field: value})


@pytest.mark.parametrize("base, field, value", _cases(LATENT_MOE_BASES, LATENT_MOE_BAD))
def test_invalid_latent_moe_field_raises_value_error_naming_it(base, field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        LatentMoEConfig(**{**base, field: value})


@pytest.mark.parametrize("per_layer, field", BAD_PER_LAYER, ids=[repr(p) for p, _ in BAD_PER_LAYER])
def test_invalid_per_layer_override_raises_value_error_naming_it(per_layer, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        LatentMoEConfig(**{**LATENT_MOE_BASES["latent_moe_per_layer"], "per_layer_config": per_layer})


def test_field_type_errors_are_still_strict_errors_and_apply_on_assignment():
    """The `ValueError` of a wrongly typed field is also `@strict`'s own error type, at construction and later."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError

    config = MoHDConfig(**MOHD_BASES["mohd_gqa"])
    with pytest.raises(StrictDataclassFieldValidationError, match="`hidden_size`"):
        config.hidden_size = "64"
    with pytest.raises(ValueError, match="`use_cache`"):
        config.use_cache = "yes"
    assert config.hidden_size == 64 and config.use_cache is True


# --- a full disk during a checkpoint ------------------------------------------------------------------------------


def _folder_bytes(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_full_disk_during_checkpoint_keeps_previous_and_resumes_exactly(tmp_path, monkeypatch):
    """ENOSPC while `save_state` writes step 4's optimizer file: step 2 stays byte-identical, no partial folder is
    left, the error names both checkpoints, and the rerun resumes from step 2 to the uninterrupted run's curve."""
    import accelerate.checkpointing
    from test_training import curve, tiny_config, write_corpus

    from hf_mohd.training import latest_checkpoint, train

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    settings = dict(log_every=2, keep_checkpoints=5)
    full = train(tiny_config(tmp_path, corpus, "full", **settings))

    checkpoints = tmp_path / "run" / "checkpoints"
    real_save, seen = accelerate.checkpointing.save, {}

    def save_until_disk_full(obj, f, *args, **kwargs):
        if ".tmp_step_0000004" in str(f) and "optimizer" in str(f):
            seen["before"] = _folder_bytes(checkpoints / "step_0000002")
            real_save(obj, f, *args, **kwargs)
            with open(f, "r+b") as handle:  # the disk filled up halfway through this file
                handle.truncate(handle.seek(0, 2) // 2)
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(accelerate.checkpointing, "save", save_until_disk_full)
    with pytest.raises(OSError, match=r"step_0000004 failed.*No space left.*step_0000002 is intact") as raised:
        train(tiny_config(tmp_path, corpus, "run", **settings))
    assert raised.value.errno == errno.ENOSPC
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_0000002"]  # the partial .tmp folder is gone
    assert _folder_bytes(checkpoints / "step_0000002") == seen["before"]
    assert latest_checkpoint(str(tmp_path / "run")).endswith("step_0000002")

    monkeypatch.setattr(accelerate.checkpointing, "save", real_save)  # space freed
    resumed = train(tiny_config(tmp_path, corpus, "run", **settings))
    assert curve(resumed) == curve(full)  # the records of steps 2, 4, 6, exactly
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resuming from the checkpoint kept through ENOSPC"


# --- damaged input: every reader names the file and what it expected ----------------------------------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny dense LLaMA folder (safetensors, no tokenizer): the undamaged input each case below breaks one way."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    folder = tmp_path_factory.mktemp("llama") / "llama"
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _edit_json(path, **changes):
    values = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            values.pop(key)
        else:
            values[key] = value
    path.write_text(json.dumps(values))


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _corrupt_header(path):
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header starts at byte 8
    path.write_bytes(bytes(data))


def _wrong_shape(path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, path, metadata={"format": "pt"})


def _index_naming_missing_shard(folder):
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


# (case, damage applied to a copy of `llama_folder`, regex the `ConversionError` message must match: file + expected)
LLAMA_SOURCE_DAMAGE = [
    ("config.json not JSON", lambda d: (d / "config.json").write_text("{"), r"config\.json: not valid JSON"),
    (
        "config.json wrong type",
        lambda d: _edit_json(d / "config.json", hidden_size="32"),
        r"config\.json: not a valid LlamaConfig.*hidden_size.*expected int",
    ),
    (
        "config.json missing field",
        lambda d: _edit_json(d / "config.json", hidden_size=None),
        r"config\.json: missing field\(s\) \['hidden_size'\]",
    ),
    (
        "config.json of another model",
        lambda d: _edit_json(d / "config.json", model_type="mistral"),
        r"config\.json: model_type is 'mistral'.*only dense LLaMA",
    ),
    (
        "truncated safetensors",
        lambda d: _truncate(d / "model.safetensors"),
        r"model\.safetensors: not a complete safetensors file.*expected a JSON header and every tensor",
    ),
    (
        "corrupted safetensors header",
        lambda d: _corrupt_header(d / "model.safetensors"),
        r"model\.safetensors: not a complete safetensors file.*invalid UTF-8",
    ),
    (
        "shard index naming a missing file",
        _index_naming_missing_shard,
        r"model\.safetensors\.index\.json lists shards that are not in .*model-00001-of-00002",
    ),
    (
        "tensor of the wrong shape",
        lambda d: _wrong_shape(d / "model.safetensors"),
        r"model\.safetensors: tensor 'model\.norm\.weight' has shape \(31,\); config\.json implies \(32,\)",
    ),
    (
        "pickled weights only",
        lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
        r"holds only pickled weights \(pytorch_model\.bin\)",
    ),
]


@pytest.mark.parametrize(
    "damage, pattern", [c[1:] for c in LLAMA_SOURCE_DAMAGE], ids=[c[0] for c in LLAMA_SOURCE_DAMAGE]
)
def test_damaged_llama_source_names_file_and_expectation(llama_folder, tmp_path, damage, pattern):
    import shutil

    from hf_mohd.conversion import ConversionError, load_dense_llama

    folder = tmp_path / "damaged"
    shutil.copytree(llama_folder, folder)
    damage(folder)
    with pytest.raises(ConversionError, match=pattern):
        load_dense_llama(folder)
    load_dense_llama(llama_folder)  # the undamaged original loads


def _write_gguf(path, architecture):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_of_another_architecture_or_truncated_names_file(tmp_path):
    import gguf

    from hf_mohd.conversion import ConversionError, load_dense_llama

    _write_gguf(tmp_path / "mamba.gguf", "mamba")
    assert gguf.GGUFReader(str(tmp_path / "mamba.gguf")).fields["general.architecture"].contents() == "mamba"
    with pytest.raises(ConversionError, match=r"mamba\.gguf: general\.architecture is 'mamba'; only LLaMA GGUF"):
        load_dense_llama(tmp_path / "mamba.gguf")
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "mamba.gguf").read_bytes()[:40])
    with pytest.raises(ConversionError, match=r"cut\.gguf: not a readable GGUF file.*expected the GGUF magic"):
        load_dense_llama(tmp_path / "cut.gguf")


def _saved_mohd(folder):
    from hf_mohd import MoHDForCausalLM

    torch.manual_seed(0)
    model = MoHDForCausalLM(MoHDConfig(**MOHD_BASES["mohd_gqa"])).eval()
    model.save_pretrained(folder)
    return model


def test_damaged_config_of_a_saved_model_names_file_or_field(tmp_path):
    """`prepare_files` (publish) names config.json; transformers' own loader names the field."""
    from transformers import AutoConfig

    from hf_mohd.hub import prepare_files

    folder = tmp_path / "mohd"
    _saved_mohd(folder)
    config_path = folder / "config.json"
    good = config_path.read_text()
    config_path.write_text(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        prepare_files(folder)
    config_path.write_text(good)
    _edit_json(config_path, num_sub_dims="8")
    with pytest.raises(ValueError, match=r"config\.json: not a valid mohd config.*`num_sub_dims` is invalid.*int"):
        prepare_files(folder)
    with pytest.raises(ValueError, match=r"`num_sub_dims` is invalid: Field 'num_sub_dims' expected int"):
        AutoConfig.from_pretrained(folder)
    config_path.write_text(good)
    _edit_json(config_path, model_type=None)
    with pytest.raises(ValueError, match=r"config\.json: `model_type` None is not an hf-mohd family"):
        prepare_files(folder)


def test_missing_tokenizer_names_folder(tmp_path, llama_folder):
    from hf_mohd.evaluation import evaluate
    from hf_mohd.training import train_config_from_dict
    from hf_mohd.training.trainer import prepare_tokenizer

    folder = tmp_path / "mohd"
    _saved_mohd(folder)
    with pytest.raises(ValueError, match=rf"{folder} has no tokenizer files \(expected one of \['tokenizer\.json'"):
        evaluate(str(folder), tasks="arc_easy", limit=1)
    values = {
        "output_dir": str(tmp_path / "run"),
        "data": {"path": "x.txt"},
        "model": {"init_from": str(llama_folder)},
    }
    config = train_config_from_dict(values)
    with pytest.raises(ValueError, match=r"`model\.init_from` '.*llama' has no tokenizer files"):
        prepare_tokenizer(config, [])
    config.model.tokenizer = str(tmp_path / "no-such-tokenizer")
    with pytest.raises(ValueError, match=r"`model\.tokenizer` '.*no-such-tokenizer' does not exist"):
        prepare_tokenizer(config, [])


def test_unknown_lm_eval_task_fails_before_the_model_is_read(tmp_path):
    from hf_mohd.evaluation import evaluate

    with pytest.raises(ValueError, match=r"Unknown task 'arc_e'; known: \['arc_challenge', 'arc_easy'"):
        evaluate(str(tmp_path / "no-model-here"), tasks="arc_easy,arc_e")


# (case, YAML text, regex: the file and the field)
TRAIN_YAML_DAMAGE = [
    ("unknown key", "optim: {lr: 1.0e-3, warmup: 5}\n", r"bad\.yaml: unknown field\(s\) \['optim\.warmup'\]"),
    ("wrong type", "max_steps: ten\n", r"bad\.yaml: `max_steps` must be int, got 'ten'"),
    ("wrong section type", "optim: 3\n", r"bad\.yaml: `optim` must be a mapping, got int"),
    (
        "out of range",
        "data: {path: x.txt, eval_fraction: 1.5}\n",
        r"bad\.yaml: `data\.eval_fraction` must be in \[0, 1\)",
    ),
    ("not YAML", "max_steps: [1,\n", r"bad\.yaml: cannot parse"),
]


@pytest.mark.parametrize("text, pattern", [c[1:] for c in TRAIN_YAML_DAMAGE], ids=[c[0] for c in TRAIN_YAML_DAMAGE])
def test_damaged_training_yaml_names_file_and_field(tmp_path, text, pattern):
    from hf_mohd.training import load_train_config

    path = tmp_path / "bad.yaml"
    path.write_text(text + ("" if "data:" in text else "data: {path: x.txt}\n") + "model: {init_from: some/model}\n")
    with pytest.raises(ValueError, match=pattern):
        load_train_config(path)


def test_nemotron_h_folder_with_mamba_blocks_names_file(tmp_path):
    from transformers import NemotronHConfig

    from hf_mohd.interop import NemotronHInteropError, import_from_nemotron_h

    blocks = ["full_attention", "moe", "linear_attention", "mlp"]
    NemotronHConfig(vocab_size=97, hidden_size=32, layers_block_type=blocks).save_pretrained(tmp_path / "hybrid")
    with pytest.raises(
        NemotronHInteropError,
        match=r"hybrid/config\.json: `layers_block_type\[2\]` is 'linear_attention' \(Mamba-2 blocks have no",
    ):
        import_from_nemotron_h(tmp_path / "hybrid", out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # checked before any weight is read or anything written


def test_damaged_training_checkpoint_names_folder(tmp_path):
    from test_training import tiny_config, write_corpus

    from hf_mohd.training import train

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    assert train(tiny_config(tmp_path, corpus, "run", stop_after_steps=2)).steps == 2
    _truncate(tmp_path / "run" / "checkpoints" / "step_0000002" / "model.safetensors")
    with pytest.raises(ValueError, match=r"Checkpoint .*step_0000002 cannot be loaded \(SafetensorError.*Delete that"):
        train(tiny_config(tmp_path, corpus, "run"))


# --- interrupted writes leave nothing a later run would trust -----------------------------------------------------


def _interrupt_weight_writes(monkeypatch, error=KeyboardInterrupt):
    """`save_pretrained` writes half of its first safetensors file, then `error` is raised (a Ctrl-C, a crash)."""
    import transformers.modeling_utils

    real = transformers.modeling_utils.safe_save_file

    def write_half_then_fail(tensors, filename, *args, **kwargs):
        real(tensors, filename, *args, **kwargs)
        _truncate(Path(filename))
        raise error(f"interrupted while writing {filename}")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", write_half_then_fail)


def _tiny_mohd(seed):
    from hf_mohd import MoHDForCausalLM

    torch.manual_seed(seed)
    return MoHDForCausalLM(MoHDConfig(**MOHD_BASES["mohd_gqa"])).eval()


def test_interrupted_conversion_output_is_never_under_the_destination(tmp_path, llama_folder, monkeypatch):
    from transformers import AutoModelForCausalLM

    import hf_mohd  # noqa: F401  (registers the Auto classes)
    from hf_mohd.conversion import load_dense_llama, save_converted

    source = load_dense_llama(llama_folder)
    out = tmp_path / "out" / "converted"
    out.parent.mkdir()
    with monkeypatch.context() as patch:
        _interrupt_weight_writes(patch)
        with pytest.raises(KeyboardInterrupt):
            save_converted(_tiny_mohd(0), out, source, "first")
    assert not list(out.parent.iterdir())  # neither the destination nor a partial sibling
    save_converted(_tiny_mohd(0), out, source, "first")
    before = _folder_bytes(out)
    with monkeypatch.context() as patch:
        _interrupt_weight_writes(patch)
        with pytest.raises(KeyboardInterrupt):
            save_converted(_tiny_mohd(1), out, source, "second", overwrite=True)
    assert _folder_bytes(out) == before and [p.name for p in out.parent.iterdir()] == ["converted"]
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.lm_head.weight, _tiny_mohd(0).lm_head.weight)


def test_killed_conversion_leaves_only_a_hidden_partial_folder(tmp_path, llama_folder):
    """SIGKILL mid-write (no cleanup runs): the destination does not exist; the partial folder is a hidden sibling."""
    script = f"""
        import os, signal
        import torch
        import transformers.modeling_utils
        from test_reliability import MOHD_BASES
        from hf_mohd import MoHDConfig, MoHDForCausalLM
        from hf_mohd.conversion import load_dense_llama, save_converted

        real = transformers.modeling_utils.safe_save_file
        def write_then_die(tensors, filename, *args, **kwargs):
            real(tensors, filename, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        transformers.modeling_utils.safe_save_file = write_then_die
        model = MoHDForCausalLM(MoHDConfig(**MOHD_BASES["mohd_gqa"]))
        save_converted(model, {str(tmp_path / "converted")!r}, load_dense_llama({str(llama_folder)!r}), "killed")
    """
    import os
    import subprocess
    import sys
    import textwrap

    # the repository root and tests/ (for test_reliability's MOHD_BASES) on the child's import path
    path = os.pathsep.join([str(Path(__file__).parents[1]), str(Path(__file__).parent)])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, timeout=300)
    assert done.returncode == -9, done.stderr.decode()[-3000:]
    left = [p.name for p in tmp_path.iterdir()]
    assert not (tmp_path / "converted").exists()
    assert len(left) == 1 and left[0].startswith(".converted.") and left[0].endswith(".partial"), left


def test_interrupted_nemotron_h_export_is_never_under_the_destination(tmp_path, monkeypatch):
    from transformers import NemotronHForCausalLM

    from hf_mohd import LatentMoEForCausalLM
    from hf_mohd.interop import export_to_nemotron_h

    config = dict(LATENT_MOE_BASES["latent_moe_nemotron_like"], moe_shared_expert_intermediate_size=16)
    torch.manual_seed(0)
    first, second = LatentMoEForCausalLM(LatentMoEConfig(**config)), LatentMoEForCausalLM(LatentMoEConfig(**config))
    out = tmp_path / "out" / "nemotron"
    out.parent.mkdir()
    with monkeypatch.context() as patch:
        _interrupt_weight_writes(patch)
        with pytest.raises(KeyboardInterrupt):
            export_to_nemotron_h(first, out)
    assert not list(out.parent.iterdir())
    export_to_nemotron_h(first, out)
    before = _folder_bytes(out)
    with monkeypatch.context() as patch:
        _interrupt_weight_writes(patch)
        with pytest.raises(KeyboardInterrupt):
            export_to_nemotron_h(second, out, overwrite=True)
    assert _folder_bytes(out) == before and [p.name for p in out.parent.iterdir()] == ["nemotron"]
    reloaded = NemotronHForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.lm_head.weight, first.lm_head.weight)


def test_interrupted_final_model_write_is_never_under_final(tmp_path, monkeypatch):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from hf_mohd.training.data import train_bpe_tokenizer
    from hf_mohd.training.trainer import save_final_model

    tokenizer = train_bpe_tokenizer(["a river city", "the old king sang"] * 8, 280)
    accelerator = Accelerator(cpu=True)
    final = tmp_path / "run" / "final"
    final.parent.mkdir()
    with monkeypatch.context() as patch:
        _interrupt_weight_writes(patch)
        with pytest.raises(KeyboardInterrupt):
            save_final_model(accelerator, _tiny_mohd(0), tokenizer, str(final))
    assert not list(final.parent.iterdir())
    save_final_model(accelerator, _tiny_mohd(0), tokenizer, str(final))
    before = _folder_bytes(final)
    assert "tokenizer.json" in before and "model.safetensors" in before
    with monkeypatch.context() as patch:
        _interrupt_weight_writes(patch)
        with pytest.raises(KeyboardInterrupt):
            save_final_model(accelerator, _tiny_mohd(1), tokenizer, str(final))
    assert _folder_bytes(final) == before and [p.name for p in final.parent.iterdir()] == ["final"]
    assert torch.equal(AutoModelForCausalLM.from_pretrained(final).lm_head.weight, _tiny_mohd(0).lm_head.weight)


def test_atomic_file_write_replaces_only_when_complete(tmp_path, monkeypatch):
    """`write_text_atomically` / `write_json_atomically` (results, summaries, resume markers): an interrupted write
    leaves the previous file byte-identical and no temporary sibling; a complete one replaces it (mode from the
    umask, parent folders created)."""
    import os

    from hf_mohd import atomic_folder
    from hf_mohd.atomic_folder import write_json_atomically, write_text_atomically

    path = tmp_path / "results" / "summary.json"
    write_json_atomically(path, {"loss": 1.5})
    assert path.read_text() == '{\n  "loss": 1.5\n}\n'
    real_replace = os.replace

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(atomic_folder.os, "replace", interrupted)
        with pytest.raises(KeyboardInterrupt):
            write_text_atomically(path, "half")
    assert os.replace is real_replace
    assert path.read_text() == '{\n  "loss": 1.5\n}\n' and [p.name for p in path.parent.iterdir()] == ["summary.json"]
    write_text_atomically(path, "new")
    umask = os.umask(0)
    os.umask(umask)
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_folder_moved_into_place_replaces_the_old_one_only_when_complete(tmp_path):
    """`move_folder_into_place` (the trainer's checkpoints) and `write_folder_atomically`: the old folder stays until
    the new one is in place; an exception in the block removes the staging folder and keeps the old folder."""
    from hf_mohd.atomic_folder import move_folder_into_place, write_folder_atomically

    out = tmp_path / "step_0000002"
    with write_folder_atomically(out) as staging:
        (staging / "a.txt").write_text("first")
    staging = tmp_path / ".tmp_step_0000002"
    staging.mkdir()
    (staging / "a.txt").write_text("second")
    move_folder_into_place(staging, out)
    assert (out / "a.txt").read_text() == "second" and [p.name for p in tmp_path.iterdir()] == [out.name]
    with pytest.raises(RuntimeError), write_folder_atomically(out) as staging:
        (staging / "a.txt").write_text("third")
        raise RuntimeError("interrupted")
    assert (out / "a.txt").read_text() == "second" and [p.name for p in tmp_path.iterdir()] == [out.name]


def test_no_file_edits_sys_path():
    """Scripts of bench/ and experiments/ are modules of importable packages (`python -m bench.bench_mohd`), tests
    import them the same way; the scripts of conversion/ import the installed hf_mohd: no file puts a folder on
    `sys.path` (reading it, as the import audit does, is fine)."""
    root = Path(__file__).resolve().parents[1]
    edit = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend)\s*\(|\[[^]]*\]\s*=|\+=|=(?!=))")
    folders = ("hf_mohd", "conversion", "tests", "bench", "experiments", "scripts", "configs")
    hits = [
        f"{path.relative_to(root)}:{number}"
        for path in [p for folder in folders for p in (root / folder).rglob("*.py")]
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if edit.search(line)
    ]
    assert not hits, hits
    for folder in ("bench", "bench/replication", "experiments", "experiments/smollm2"):
        assert (root / folder / "__init__.py").is_file(), folder


# --- remote-code files: what they import and open -----------------------------------------------------------------

AUDIT = r"""
import builtins, json, os, socket, sys, sysconfig

CHECKPOINTS = json.loads(sys.argv[1])
network_attempts = []


def refuse_network(*args, **kwargs):
    network_attempts.append(repr(args)[:200])
    raise OSError("network access is disabled in this test")


socket.socket.connect = socket.socket.connect_ex = refuse_network
socket.create_connection = socket.getaddrinfo = refuse_network

import importlib.util

hf_mohd_spec = None
try:
    hf_mohd_spec = importlib.util.find_spec("hf_mohd")
except ImportError:
    pass
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import HF_MODULES_CACHE

recording, opened, imports, first_imports = False, [], [], []
MODEL_ROOTS = tuple(os.path.realpath(p) + os.sep for p in (*CHECKPOINTS, HF_MODULES_CACHE))
SKIPPED_FRAMES = (sysconfig.get_paths()["stdlib"], "<frozen", __file__)


def is_model_file(filename):
    return isinstance(filename, str) and os.path.realpath(filename).startswith(MODEL_ROOTS)


def importing_file():
    frame = sys._getframe(2)
    while frame is not None and "importlib" in frame.f_code.co_filename:
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else None


def audit(event, args):
    if not recording:
        return
    if event == "open" and isinstance(args[0], (str, bytes)):
        # The code that asked for the file: the innermost frame outside the standard library and this script.
        frame, opener, by_model = sys._getframe(1), None, False
        while frame is not None:
            name = frame.f_code.co_filename
            by_model = by_model or is_model_file(name)
            if opener is None and not name.startswith(SKIPPED_FRAMES):
                opener = name
            frame = frame.f_back
        opened.append([os.path.abspath(os.fsdecode(args[0])), opener, by_model])
    elif event == "import" and is_model_file(importing_file()):
        first_imports.append(args[0])  # a module loaded for the first time by a statement in a model file


sys.addaudithook(audit)
real_import = builtins.__import__


def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    # Every import statement, also of modules already loaded (those raise no "import" audit event).
    if recording and globals and is_model_file(globals.get("__file__")):
        imports.append([os.path.basename(globals["__file__"]), name, level])
    return real_import(name, globals, locals, fromlist, level)


builtins.__import__ = recording_import
out = {"hf_mohd_spec": repr(hf_mohd_spec), "sys_path": sys.path, "models": {}}
for folder in CHECKPOINTS:
    recording = True
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[3, 17, 42, 8, 91, 5, 60, 11]])).logits
    recording = False
    out["models"][folder] = {"module": type(model).__module__, "logits": logits.tolist()}
opened = [[path, os.path.exists(path), opener, by_model] for path, opener, by_model in opened]
out.update(opened=opened, imports=imports, first_imports=first_imports, network=network_attempts)
out["roots"] = {
    "transformers": os.path.dirname(__import__("transformers").__file__),
    "torch_site_packages": os.path.dirname(os.path.dirname(torch.__file__)),
    "modules_cache": HF_MODULES_CACHE,
}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_remote_code_imports_and_opens_only_torch_transformers_stdlib_and_the_checkpoint(tmp_path):
    """Both families, saved with their code files, load with `trust_remote_code=True` in a fresh process where
    `hf_mohd` is not importable and sockets raise; an audit hook and an `__import__` wrapper record what the model
    files import and what files are opened while loading and running a forward pass."""
    import os
    import sys
    import sysconfig

    from utils import run_python_without_hf_mohd

    from hf_mohd import LatentMoEForCausalLM

    torch.manual_seed(0)
    models = {
        str(tmp_path / "mohd"): _tiny_mohd(0),
        str(tmp_path / "latent_moe"): LatentMoEForCausalLM(
            LatentMoEConfig(**LATENT_MOE_BASES["latent_moe_per_layer"])
        ),
    }
    expected = {}
    for folder, model in models.items():
        model.eval().save_pretrained(folder)
        with torch.no_grad():
            expected[folder] = model(torch.tensor([[3, 17, 42, 8, 91, 5, 60, 11]])).logits
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "audit.py").write_text(AUDIT)
    env = {"PYTHONPATH": "", "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf_home")}
    result = run_python_without_hf_mohd(
        f"import runpy, sys; sys.argv = ['audit', {json.dumps(list(models))!r}]; "
        f"runpy.run_path({str(tmp_path / 'audit.py')!r}, run_name='__main__')",
        cwd=str(tmp_path / "elsewhere"),
        env=env,
    )

    # hf_mohd is not importable there, and the model classes are transformers' dynamic modules.
    repo = str(Path(__file__).resolve().parents[1])
    in_repo = [p for p in result["sys_path"] if p and p.startswith(repo) and not p.startswith(sys.prefix)]
    assert result["hf_mohd_spec"] == "None" and not in_repo, in_repo  # (a .venv inside the clone is allowed)
    for folder, got in result["models"].items():
        assert got["module"].startswith("transformers_modules."), got["module"]
        torch.testing.assert_close(torch.tensor(got["logits"]), expected[folder], rtol=0, atol=0)
    assert result["network"] == []

    # Imports made by the model files: torch, transformers (and huggingface_hub, whose `strict` transformers'
    # configurations use), the standard library, and relative imports of files next to them in the checkpoint.
    allowed_packages = {"torch", "transformers", "huggingface_hub"}
    code_files = {name for folder in models for name in os.listdir(folder) if name.endswith(".py")}
    seen = set()
    for file, name, level in result["imports"]:
        top = name.split(".")[0]
        if level:
            assert level == 1 and f"{name}.py" in code_files, (file, name, level)
        else:
            assert top in allowed_packages or top in sys.stdlib_module_names, (file, name)
        seen.add(top if not level else ".")
    assert {"torch", "transformers", "."} <= seen, seen  # the recorder saw the real imports
    for name in result["first_imports"]:
        top = name.split(".")[0]
        assert top in allowed_packages | {"transformers_modules"} or top in sys.stdlib_module_names, name

    # Files opened while loading and running: the checkpoint, transformers' package, the standard library, the
    # site-packages of torch, and transformers' copies of the checkpoint's code files in its modules cache. Not files:
    # kernel tables under /proc (psutil, imported by transformers, and transformers' own mount check read them), and
    # paths probed without existing (importlib.metadata looking at each sys.path entry).
    roots = result["roots"]
    zipped = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info[0]}{sys.version_info[1]}.zip")
    stdlib = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"], zipped]
    allowed_roots = [*models, roots["transformers"], roots["torch_site_packages"], *stdlib, "/proc"]

    def under(path, folders):
        return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in folders)

    in_cache, elsewhere, by_model = [], [], []
    for path, exists, opener, _ in result["opened"]:
        if under(path, [roots["modules_cache"]]):
            in_cache.append(path)
        elif exists and not under(path, allowed_roots):
            elsewhere.append([path, opener])
        if opener is not None and under(opener, [*models, roots["modules_cache"]]):
            by_model.append(path)  # opened for a statement of a model file (an import, or an open of its own)
    assert elsewhere == [], elsewhere
    # What a model file's own statements opened (its imports included): nothing outside those roots, not even /proc.
    model_roots = [*models, roots["modules_cache"], roots["transformers"], roots["torch_site_packages"], *stdlib]
    assert by_model and [path for path in by_model if not under(path, model_roots)] == []
    assert any(p == os.path.join(folder, "config.json") for p, *_ in result["opened"] for folder in models)
    assert any(model_on_stack for *_, model_on_stack in result["opened"])  # the model files' own imports ran
    for path in in_cache:  # the copies transformers makes of the checkpoint's code files (plus package markers)
        name = os.path.basename(path)
        assert name == "__init__.py" or name in code_files or name.endswith(".pyc"), path


PUBLISH_INTERRUPTED = """
import json, sys
from huggingface_hub import CommitOperationAdd
from hf_mohd.hub import publish

first, second = sys.argv[1:3]
publish(first, "tester/atomic")
real_content = CommitOperationAdd.b64content


def connection_lost_at_the_weights(self):
    if self.path_in_repo == "model.safetensors":
        raise OSError("connection lost while sending model.safetensors")
    return real_content(self)


CommitOperationAdd.b64content = connection_lost_at_the_weights
try:
    publish(second, "tester/atomic")
    outcome = "published"
except OSError as error:
    outcome = str(error)
print(json.dumps({"outcome": outcome}))
"""


@pytest.mark.slow
def test_interrupted_publish_leaves_the_published_revision(tmp_path, local_hub):
    """`publish` sends everything in one commit: losing the connection while sending the new weights (after the
    config and code were sent) leaves the repository at the previous revision, file for file."""
    import os
    import subprocess
    import sys
    import textwrap

    from test_hub import hub_env, save_with_tokenizer, tiny_mohd

    first, second = tmp_path / "first", tmp_path / "second"
    save_with_tokenizer(tiny_mohd(), first)
    model = tiny_mohd()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_with_tokenizer(model, second)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PUBLISH_INTERRUPTED), str(first), str(second)],
        env={**os.environ, **hub_env(local_hub, tmp_path / "home")},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1])["outcome"] == "connection lost while sending model.safetensors"
    repo = local_hub.repos["tester/atomic"]
    assert len(repo.commits) == 2  # the repository's initial commit and the first publish, nothing after
    files = repo.commits[repo.branches["main"]]
    assert files["model.safetensors"] == (first / "model.safetensors").read_bytes()
    assert files["model.safetensors"] != (second / "model.safetensors").read_bytes()
    assert files["config.json"] and "modeling_mohd.py" in files


def test_readme_table_shows_the_messages_of_these_cases():
    """The "What bad input gives" rows of docs/bad-input.md are these cases, and each shown message matches the test's
    pattern."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "bad-input.md").read_text()
    section = text[text.index("## What bad input gives") :]
    lines = section.splitlines()
    for prefix, cases in (("LLaMA source: ", LLAMA_SOURCE_DAMAGE), ("training YAML: ", TRAIN_YAML_DAMAGE)):
        for label, _, pattern in cases:
            rows = [line for line in lines if line.startswith(f"| {prefix}{label} ")]
            assert len(rows) == 1, (prefix, label)
            assert re.search(pattern, rows[0].replace("\\|", "|")), (rows[0], pattern)
