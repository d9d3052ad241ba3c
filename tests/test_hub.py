"""Publishing: what `prepare_files` assembles, and a round trip through a local Hub server (`tests/hub_server.py`):
publish (API, CLI and transformers' `push_to_hub`) in one fresh process, reload by repo id in another where
`hf_mohd` cannot be imported, with `trust_remote_code=True`; the logits must be those of the published model."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results

from hf_mohd import LatentMoEForCausalLM, MoHDForCausalLM
from hf_mohd.hub import prepare_files, remote_code_files
from hf_mohd.training.data import train_bpe_tokenizer
from tests.utils import BLOCK_HF_MOHD, FAMILIES


TEXT = [
    "The river rises in the hills and flows north to the sea.",
    "A mixture of hidden dimensions activates a few blocks of the residual stream for every token.",
    "Experts compute in a latent width smaller than the model width.",
] * 4
INPUT_IDS = [[3, 17, 42, 8, 91, 5, 60, 11], [2, 33, 70, 19, 44, 6, 250, 1]]
LM_EVAL_OUTPUT = {
    "results": {"tiny_task": {"alias": "tiny_task", "acc,none": 0.75, "acc_stderr,none": 0.1}},
    "configs": {"tiny_task": {"task": "tiny_task", "dataset_path": "json", "test_split": "train"}},
}


def tiny_tokenizer():
    return train_bpe_tokenizer(TEXT, vocab_size=300)


MOHD, LATENT_MOE = FAMILIES["mohd"], FAMILIES["latent_moe"]
# The LLaMA fields these models leave at the config's defaults (all key/value heads, no pad id); the vocabulary takes
# the tokenizer's 300 tokens
UNSET_LLAMA_FIELDS = ("num_key_value_heads", "max_position_embeddings", "pad_token_id")


def tiny_mohd() -> MoHDForCausalLM:
    """The config's default sub-dimensions, initial weights, float32."""
    unset = MOHD.defaults(*UNSET_LLAMA_FIELDS, "num_sub_dims", "num_shared_sub_dims", "num_routed_sub_dims_per_tok")
    return MOHD.build(dtype=torch.float32, vocab_size=320, **unset)


def tiny_latent_moe() -> LatentMoEForCausalLM:
    """One expert shape in both layers, initial weights, float32, the config's experts implementation."""
    return LATENT_MOE.build(
        dtype=torch.float32,
        experts_implementation=None,
        vocab_size=320,
        moe_intermediate_size=32,
        moe_latent_size=16,
        moe_shared_expert_intermediate_size=32,
        per_layer_config=None,
        **LATENT_MOE.defaults(*UNSET_LLAMA_FIELDS),
    )


def save_with_tokenizer(model, folder):
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    with torch.no_grad():
        return model(torch.tensor(INPUT_IDS)).logits


def test_prepare_files_completes_a_bare_folder(tmp_path):
    """A folder without auto_map, code files, generation config or card gets them; pickles stay local."""
    folder = tmp_path / "model"
    save_with_tokenizer(tiny_mohd(), folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("auto_map")
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("modeling_mohd.py", "configuration_mohd.py", "modeling_common.py", "generation_config.json"):
        (folder / name).unlink()
    (folder / "optimizer.bin").write_bytes(b"pickle")
    (folder / "checkpoint-10").mkdir()
    (folder / "checkpoint-10" / "config.json").write_text("{}")

    files = prepare_files(folder, "tester/mohd-tiny", card_kwargs={"eval_results": LM_EVAL_OUTPUT})
    auto_map, code = remote_code_files("mohd")
    # accounting.py through the configs' accounting methods; no LatentMoE file (the per-layer schema of both families
    # lives in configuration_layers.py); the native decoding kernels both families share
    assert set(code) == {
        "accounting.py",
        "configuration_common.py",
        "configuration_layers.py",
        "configuration_mohd.py",
        "modeling_mohd.py",
        "modeling_common.py",
        "mohd_geometry.py",
        "mohd_layout.py",
        "mohd_plans.py",
        "mohd_products.py",
        "mohd_strategies.py",
        "mohd_tensor_parallel.py",
        "native_gather.py",
        "routing_cache.py",
    }
    assert set(code) | {"model.safetensors", "config.json", "generation_config.json", "README.md"} <= set(files)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert "optimizer.bin" not in files and not any(p.startswith("checkpoint-") for p in files)
    assert json.loads(files["config.json"])["auto_map"] == {
        "AutoConfig": "configuration_mohd.MoHDConfig",
        "AutoModel": "modeling_mohd.MoHDModel",
        "AutoModelForCausalLM": "modeling_mohd.MoHDForCausalLM",
    }
    assert json.loads(files["generation_config.json"])["eos_token_id"] == config["eos_token_id"]
    card = ModelCard(files["README.md"].decode())
    assert model_index_to_eval_results(card.data.to_dict()["model-index"])[1][0].metric_value == 0.75

    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        prepare_files(folder)
    shutil.rmtree(folder)
    (folder).mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not an hf-mohd family"):
        prepare_files(folder)


def test_publish_command_line_parses():
    from hf_mohd.cli import build_parser
    from hf_mohd.commands.publish import run

    args = build_parser().parse_args(
        ["publish", "folder", "me/model", "--dataset", "a", "--dataset", "b", "--base-model", "org/base", "--private"]
    )
    assert (args.func, args.folder, args.repo_id, args.dataset, args.base_model, args.private) == (
        run,
        "folder",
        "me/model",
        ["a", "b"],
        ["org/base"],
        True,
    )


def hub_env(local_hub, home) -> dict:
    """Environment of a fresh process that talks to the local Hub (read when huggingface_hub is imported)."""
    return {
        "HF_ENDPOINT": local_hub.endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_TOKEN": "hf_local_test_token",
        "HF_HOME": str(home),
        "TRANSFORMERS_VERBOSITY": "error",
    }


PUBLISH = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from hf_mohd.cli import main as cli
from hf_mohd.hub import publish

mohd, latent, results = sys.argv[1:4]
info = publish(mohd, "tester/mohd-tiny", card_kwargs={"eval_results": json.load(open(results)),
                                                      "datasets": ["tiny inline text"]})
assert cli(["publish", latent, "tester/latent-moe-tiny", "--dataset", "tiny inline text"]) == 0
# transformers' own push_to_hub (registered classes write auto_map and the code files)
model = AutoModelForCausalLM.from_pretrained(mohd)
model.push_to_hub("tester/mohd-pushed")
AutoTokenizer.from_pretrained(mohd).push_to_hub("tester/mohd-pushed")
# publish() from a model object and a tokenizer object
publish(AutoModelForCausalLM.from_pretrained(latent), "tester/latent-moe-object",
        tokenizer=AutoTokenizer.from_pretrained(latent))
print(json.dumps({"commit": info.oid}))
"""

RELOAD = """
import json
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

out = {}
args = json.loads(__ARGS__)
input_ids = torch.tensor(args["input_ids"])
for repo in args["repos"]:
    try:
        AutoModelForCausalLM.from_pretrained(repo)
        refused = None
    except Exception as err:
        refused = [type(err).__name__, str(err)]
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(repo)
    with torch.no_grad():
        logits = model(input_ids).logits
    generated = model.generate(input_ids[:1, :4], max_new_tokens=3, do_sample=False)
    out[repo] = {
        "refused": refused,
        "class": type(model).__name__,
        "module": type(model).__module__,
        "logits": logits.tolist(),
        "tokens": tokenizer("The river rises")["input_ids"],
        "generated": generated.shape[1],
        "eos": GenerationConfig.from_pretrained(repo).eos_token_id,
    }
print()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_publish_then_reload_by_repo_id_without_hf_mohd(tmp_path, local_hub):
    expected = {
        "tester/mohd-tiny": save_with_tokenizer(tiny_mohd(), tmp_path / "mohd"),
        "tester/latent-moe-tiny": save_with_tokenizer(tiny_latent_moe(), tmp_path / "latent"),
    }
    expected["tester/mohd-pushed"] = expected["tester/mohd-tiny"]
    expected["tester/latent-moe-object"] = expected["tester/latent-moe-tiny"]
    (tmp_path / "results.json").write_text(json.dumps(LM_EVAL_OUTPUT))

    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PUBLISH), str(tmp_path / "mohd"), str(tmp_path / "latent")]
        + [str(tmp_path / "results.json")],
        env={**os.environ, **hub_env(local_hub, tmp_path / "publisher-home")},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]

    # What the server holds: weights, config with auto_map, code, tokenizer, generation config, validated card.
    published = [("tester/mohd-tiny", "mohd"), ("tester/latent-moe-tiny", "latent_moe")]
    for repo_id, code in published + [("tester/latent-moe-object", "latent_moe")]:
        files = set(local_hub.repos[repo_id].commits[local_hub.repos[repo_id].branches["main"]])
        needed = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"}
        assert needed | set(remote_code_files(code)[1]) <= files, sorted(files)
        assert not any(f.endswith(".bin") for f in files)
        card = ModelCard(local_hub.file(repo_id, "README.md").decode())
        assert card.data.library_name == "transformers" and "hf-mohd" in card.data.tags
    card = ModelCard(local_hub.file("tester/mohd-tiny", "README.md").decode())
    assert model_index_to_eval_results(card.data.to_dict()["model-index"])[0] == "mohd-tiny"
    assert ("POST", "/api/validate-yaml") in local_hub.requests  # the card's metadata passed the server's check
    assert "auto_map" in json.loads(local_hub.file("tester/mohd-pushed", "config.json"))

    # A fresh process where `import hf_mohd` fails; stdin closed, so transformers' "run custom code? [y/N]" prompt
    # answers at once (EOF) instead of waiting for its 15 s timeout.
    code = RELOAD.replace("__ARGS__", repr(json.dumps({"input_ids": INPUT_IDS, "repos": list(expected)})))
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_HF_MOHD + textwrap.dedent(code)],
        cwd=tmp_path,
        env={**os.environ, **hub_env(local_hub, tmp_path / "reader-home")},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    for repo_id, logits in expected.items():
        got = result[repo_id]
        assert got["module"].startswith("transformers_modules."), got["module"]  # remote code, not hf_mohd
        torch.testing.assert_close(torch.tensor(got["logits"]), logits, rtol=0, atol=1e-5)
        assert got["tokens"] == tiny_tokenizer()("The river rises")["input_ids"]
        assert got["generated"] == 4 + 3 and got["eos"] == 2
        error_type, message = got["refused"]
        assert error_type == "ValueError" and "trust_remote_code=True" in message, got["refused"]
    assert not local_hub.unhandled, local_hub.unhandled
