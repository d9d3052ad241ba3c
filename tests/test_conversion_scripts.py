"""The transformers-style scripts of the top-level `conversion/` folder (conversion/README.md), each run on a tiny
local model and checked against its oracle: the dense LLaMA for conversions that are exact (at full activation, or
with every expert active), the LatentMoE model for the Nemotron-H export and the round trip, the model's own weights
for the GGUF read back. A script's `main` is loaded from its file (`runpy.run_path`, as `python conversion/X.py`
does) and called with its arguments; the `--push_to_hub` test runs a script in a fresh process against the local Hub
server (`tests/hub_server.py`). Nothing downloads (HF_HUB_OFFLINE=1 outside the local Hub).
"""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, NemotronHForCausalLM

from hf_mohd import LatentMoEForCausalLM, MoHDForCausalLM
from hf_mohd.conversion import every_expert_active
from hf_mohd.interop import NemotronHInteropError
from tests.test_conversion import VOCAB, save_tiny_llama, tiny_tokenizer
from tests.test_hub import hub_env
from tests.test_nemotron_h_interop import latent_moe_model


ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "conversion"
PROMPT = "w5 w9 w11 w4"  # words of `tiny_tokenizer`
NEW_TOKENS = 5
SANITY = ["--prompt", PROMPT, "--max_new_tokens", str(NEW_TOKENS)]


def script(name: str):
    """The `main(argv)` of `conversion/<name>.py`, loaded from the file."""
    return runpy.run_path(str(SCRIPTS / f"{name}.py"))["main"]


def generated_ids(out: str) -> list[int]:
    """The token ids of the sanity generation a script printed."""
    return json.loads(re.search(r"^generated token ids: (\[.*\])$", out, re.M)[1])


@torch.no_grad()
def greedy_ids(model, tokenizer=None) -> list[int]:
    """`NEW_TOKENS` greedy tokens of `model` after `PROMPT` (the oracle of the scripts' sanity generation)."""
    ids = (tokenizer or tiny_tokenizer())(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.eval()(ids, use_cache=False).logits.float()


@pytest.fixture
def llama(tmp_path):
    """(folder, oracle): a tiny random GQA LLaMA with untied embeddings and a tokenizer, read back by transformers."""
    folder = tmp_path / "llama"
    save_tiny_llama(folder, tied=False, sharded=False)
    return folder, LlamaForCausalLM.from_pretrained(folder).eval()


@pytest.fixture
def ids():
    return torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def test_llama_to_mohd_full_is_the_llama(llama, ids, tmp_path, capsys):
    folder, oracle = llama
    out = tmp_path / "mohd"
    assert script("convert_llama_to_mohd")([str(folder), str(out), "--preset", "full", "--verify", "-q", *SANITY]) == 0
    printed = capsys.readouterr().out
    assert "verify: max |logit difference| at full activation = 0\n" in printed
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, MoHDForCausalLM) and model.config.num_shared_sub_dims == model.config.num_sub_dims
    torch.testing.assert_close(logits(model, ids), logits(oracle, ids), atol=1e-5, rtol=0)
    assert generated_ids(printed) == greedy_ids(oracle)
    assert (out / "tokenizer.json").is_file() and "auto_map" in json.loads((out / "config.json").read_text())


def test_llama_to_mohd_compression_50_is_the_llama_at_full_activation_only(llama, ids, tmp_path, capsys):
    """Unit gates without scaling: with every routed sub-dimension active the sparse model is the dense one; at the
    preset's k it is not (the sparsity is real)."""
    folder, oracle = llama
    out = tmp_path / "mohd50"
    argv = [str(folder), str(out), "--preset", "compression_50", "--routed-gate", "unit", "--activation-scaling"]
    assert script("convert_llama_to_mohd")([*argv, "none", "-q", *SANITY]) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    config = model.config
    assert (config.num_sub_dims, config.num_shared_sub_dims, config.num_routed_sub_dims_per_tok) == (16, 6, 2)
    assert generated_ids(capsys.readouterr().out) == greedy_ids(model)
    assert (logits(model, ids) - logits(oracle, ids)).abs().max() > 1e-2
    model.set_active_sub_dims(config.num_routed_sub_dims)
    torch.testing.assert_close(logits(model, ids), logits(oracle, ids), atol=1e-4, rtol=0)


def test_llama_to_latent_moe_upcycled_is_the_llama(llama, ids, tmp_path, capsys):
    folder, oracle = llama
    out = tmp_path / "latent"
    argv = [str(folder), str(out), "--num-experts", "4", "--num-experts-per-tok", "2", "--verify", "-q", *SANITY]
    assert script("convert_llama_to_latent_moe")(argv) == 0
    printed = capsys.readouterr().out
    assert "LatentMoE model (upcycled) written to" in printed and "verify: max |logit difference|" in printed
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, LatentMoEForCausalLM) and model.config.num_experts == 4
    torch.testing.assert_close(logits(model, ids), logits(oracle, ids), atol=1e-5, rtol=0)
    assert generated_ids(printed) == greedy_ids(oracle)


def test_llama_to_latent_moe_carved_is_the_llama_with_every_expert_active(llama, ids, tmp_path, capsys):
    folder, oracle = llama
    out = tmp_path / "carved"
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(" ".join(f"w{3 + (7 * i) % (VOCAB - 3)}" for i in range(600)))
    argv = [str(folder), str(out), "--carve", "--num-experts", "4", "--num-experts-per-tok", "2", "--verify"]
    argv += ["--calibration-text", str(calibration), "--calibration-tokens", "512", "--calibration-window", "32"]
    assert script("convert_llama_to_latent_moe")([*argv, "-q", *SANITY]) == 0
    printed = capsys.readouterr().out
    assert "LatentMoE model (carved) written to" in printed
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.router_gate == "unit" and model.config.num_experts_per_tok == 2
    assert generated_ids(printed) == greedy_ids(model)
    assert (logits(model, ids) - logits(oracle, ids)).abs().max() > 1e-3  # K = 2 of 4: not the dense FFN
    with every_expert_active(model):
        torch.testing.assert_close(logits(model, ids), logits(oracle, ids), atol=1e-4, rtol=0)


def test_llama_options_are_checked_by_the_commands_checks(llama, tmp_path):
    """The scripts parse and check with the command's own code: an upcycling option with --carve is refused before
    anything is written."""
    from hf_mohd.conversion import ConversionError

    folder, _ = llama
    with pytest.raises(ConversionError, match=r"\['--expert-init'\] do not apply to --carve"):
        script("convert_llama_to_latent_moe")([str(folder), str(tmp_path / "x"), "--carve", "--expert-init", "random"])
    assert not (tmp_path / "x").exists()


def test_latent_moe_nemotron_h_round_trip_is_exact(tmp_path, capsys):
    model = latent_moe_model()  # the choices Nemotron-H expresses: no RoPE, relu2, sigmoid routing, a dense layer 0
    source = tmp_path / "latent"
    model.save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    expected, expected_tokens = logits(model, ids), greedy_ids(model)

    nemotron_dir = tmp_path / "nemotron"
    assert script("convert_latent_moe_to_nemotron_h")([str(source), str(nemotron_dir), *SANITY]) == 0
    assert generated_ids(capsys.readouterr().out) == expected_tokens
    nemotron = AutoModelForCausalLM.from_pretrained(nemotron_dir)
    assert isinstance(nemotron, NemotronHForCausalLM)  # transformers' own class, not remote code
    assert nemotron.config.layers_block_type == ["full_attention", "mlp"] + ["full_attention", "moe"] * 2
    torch.testing.assert_close(logits(nemotron, ids), expected, atol=1e-5, rtol=0)

    back = tmp_path / "back"
    assert script("convert_nemotron_h_to_latent_moe")([str(nemotron_dir), str(back), *SANITY]) == 0
    assert generated_ids(capsys.readouterr().out) == expected_tokens
    reloaded = AutoModelForCausalLM.from_pretrained(back)
    assert isinstance(reloaded, LatentMoEForCausalLM)
    original = model.state_dict()
    assert reloaded.state_dict().keys() == original.keys()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    torch.testing.assert_close(logits(reloaded, ids), expected, atol=0, rtol=0)
    assert (back / "tokenizer.json").is_file()


def test_nemotron_h_export_refuses_a_llama_conversion_naming_the_fields(llama, tmp_path):
    folder, _ = llama
    script("convert_llama_to_latent_moe")([str(folder), str(tmp_path / "latent"), "-q", *SANITY])
    with pytest.raises(NemotronHInteropError, match="position_embedding_type.*mlp_gated"):
        script("convert_latent_moe_to_nemotron_h")([str(tmp_path / "latent"), str(tmp_path / "nemotron")])
    assert not (tmp_path / "nemotron").exists()


def gguf_source(tmp_path: Path) -> tuple[Path, LatentMoEForCausalLM]:
    """(folder, model): an all-MoE Nemotron-style LatentMoE saved with SmolLM2's tokenizer (the full tier's engine
    and converter required, as in tests/test_engines.py)."""
    from tests.test_engines import ALL_MOE, require_engine, smollm2_tokenizer

    require_engine()
    source = smollm2_tokenizer(tmp_path / "latent")
    model = latent_moe_model(**{**ALL_MOE, "vocab_size": 49152})
    model.save_pretrained(source)
    return source, model


@pytest.mark.slow
def test_latent_moe_to_gguf_reads_back_with_the_models_weights(tmp_path, capsys):
    """The GGUF of an all-MoE Nemotron-style LatentMoE with SmolLM2's tokenizer (llama.cpp knows its pre-tokenizer):
    read back with the `gguf` package, its architecture is nemotron_h_moe, its f32 embedding, attention and output
    weights are the model's, and llama.cpp (`llama_cpp.Llama`) decodes the sanity tokens."""
    gguf = pytest.importorskip("gguf")
    source, model = gguf_source(tmp_path)
    out = tmp_path / "model.gguf"
    argv = [str(source), str(out), "--prompt", "The river", "--max_new_tokens", "3"]
    assert script("convert_to_gguf")(argv) == 0
    assert len(generated_ids(capsys.readouterr().out)) == 3

    reader = gguf.GGUFReader(out)
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == "nemotron_h_moe"
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    embedding = torch.from_numpy(tensors["token_embd.weight"].data.copy()).reshape(49152, -1)
    assert torch.equal(embedding, model.model.embed_tokens.weight.detach())
    # block 0 is the zero-output Mamba block; LatentMoE layer 0 is blocks 1 (attention) and 2 (MoE). (The converter
    # permutes the query and key rows as it does for RoPE models, which leaves their dot products unchanged.)
    for gguf_name, weight in [
        ("blk.1.attn_v.weight", model.model.layers[0].self_attn.v_proj.weight),
        ("blk.1.attn_output.weight", model.model.layers[0].self_attn.o_proj.weight),
        ("output.weight", model.lm_head.weight),
    ]:
        tensor = torch.from_numpy(tensors[gguf_name].data.copy()).reshape(weight.shape)
        assert torch.equal(tensor, weight.detach()), gguf_name


@pytest.mark.slow
def test_push_to_hub_uploads_what_the_script_wrote(llama, tmp_path, local_hub):
    """`python conversion/convert_llama_to_mohd.py ... --push_to_hub` in a fresh process (the repository on
    PYTHONPATH, as an installed hf-mohd would be): the Hub holds the folder's weights byte for byte, config.json with
    auto_map, the code files and a model card; a Nemotron-H export is uploaded as it is."""
    folder, _ = llama
    env = {**os.environ, **hub_env(local_hub, tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    out = tmp_path / "mohd"
    command = [sys.executable, str(SCRIPTS / "convert_llama_to_mohd.py"), str(folder), str(out), "-q", *SANITY]
    done = subprocess.run(
        [*command, "--push_to_hub", "tester/script-mohd"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"^pushed to .*tester/script-mohd", done.stdout, re.M), done.stdout
    assert local_hub.file("tester/script-mohd", "model.safetensors") == (out / "model.safetensors").read_bytes()
    config = json.loads(local_hub.file("tester/script-mohd", "config.json"))
    assert config["model_type"] == "mohd" and config["auto_map"]["AutoModelForCausalLM"].endswith("MoHDForCausalLM")
    assert local_hub.file("tester/script-mohd", "modeling_mohd.py") and local_hub.file(
        "tester/script-mohd", "README.md"
    )

    source = tmp_path / "latent"
    latent_moe_model().save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    command = [sys.executable, str(SCRIPTS / "convert_latent_moe_to_nemotron_h.py"), str(source), str(tmp_path / "nh")]
    done = subprocess.run(
        [*command, *SANITY, "--push_to_hub", "tester/script-nemotron"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(local_hub.file("tester/script-nemotron", "config.json"))["model_type"] == "nemotron_h"
    assert (
        local_hub.file("tester/script-nemotron", "tokenizer.json") == (tmp_path / "nh" / "tokenizer.json").read_bytes()
    )
    assert not local_hub.unhandled, local_hub.unhandled


@pytest.mark.slow
def test_gguf_push_to_hub_uploads_the_file(tmp_path, local_hub):
    """`python conversion/convert_to_gguf.py ... --push_to_hub` in a fresh process: the Hub holds the GGUF byte for
    byte under its own name."""
    source, _ = gguf_source(tmp_path)
    out = tmp_path / "model-f16.gguf"
    command = [sys.executable, str(SCRIPTS / "convert_to_gguf.py"), str(source), str(out), "--outtype", "f16"]
    env = {**os.environ, **hub_env(local_hub, tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*command, "--max_new_tokens", "2", "--push_to_hub", "tester/script-gguf"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert local_hub.file("tester/script-gguf", "model-f16.gguf") == out.read_bytes()
    assert not local_hub.unhandled, local_hub.unhandled
