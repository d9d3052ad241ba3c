"""Reliability: every field of both configurations refuses bad values with a `ValueError` naming it; every file the
package reads refuses damage with an error naming the file and what was expected; interrupted writes (conversion,
Nemotron-H export, training checkpoints, publish) leave nothing a later run would trust; a full disk during a
checkpoint keeps the previous one, from which the run resumes exactly; and the remote-code files of a saved checkpoint
import and open nothing outside torch, transformers, the standard library and the checkpoint folder.

The README table "What bad input gives" lists the inputs tried here and the messages they give.
"""

import errno
import math

import pytest
import torch

from hf_mohd import LatentMoEConfig, MoHDConfig


NAN, INF = math.nan, math.inf

# --- 2. invalid configurations ------------------------------------------------------------------------------------

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
    "sparse_modules": [["attention", "moe"], ["ffn", "ffn"], "ffn", [1]],
    "activation_scaling": ["sqrt", None],
    "routed_gate": ["sigmoid"],
    "group_fusion": ["dense"],
    "sparse_implementation": ["triton"],
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


# --- 4. a full disk during a checkpoint ---------------------------------------------------------------------------


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
