"""Checks common to both model families (MoHD and LatentMoE), each test parametrised over the family, as
transformers' `ModelTesterMixin` runs its common checks for every model. Oracles: LlamaForCausalLM (cache argument,
warnings, parallel plan), the uncached forward, each family's reference path (MoHD masked, LatentMoE eager experts),
an fp32 recomputation of the router logits, and the saved model itself.

To add a common check: take the `family` fixture and build models with `family.model(...)`; put what differs between
the families (config fields, the fast and the reference path) in `ModelFamily`.
"""

import copy
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatch

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig
from transformers.cache_utils import DynamicCache
from transformers.distributed import DistributedConfig
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

import hf_mohd  # noqa: F401  (registers the Auto classes)
from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM, MoHDConfig, MoHDForCausalLM
from hf_mohd.models.modeling_common import ReLUSquared, TopKRouter, activation
from hf_mohd.models.modeling_latent_moe import LatentMoEExpertsBase, LatentMoERouter
from hf_mohd.models.modeling_mohd import MoHDRouter
from tests.utils import reallocate_parameters


# The shared model files every family's remote code imports (the forwards of both families live in modeling_common.py)
REMOTE_CODE_SIBLINGS = {"modeling_common.py", "configuration_common.py", "routing_cache.py"}


VOCAB = 97
# The LLaMA part of every tiny config; `LlamaForCausalLM` of these fields is the oracle of the LLaMA behaviours.
LLAMA_FIELDS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass(frozen=True)
class ModelFamily:
    """How to build tiny models of one family.

    Args:
        name: test id.
        config_class, model_class: the family's config and causal LM.
        router_class: the router module (its forward returns the recorded logits first).
        fields: config fields on top of `LLAMA_FIELDS`.
        unaligned_fields: fields giving widths whose bytes in bf16/fp16 are not a multiple of 16 (36 scalars).
        fast_and_reference: (fast, reference) keyword overrides of the same model: two execution paths that must
            agree (`model(**overrides)`).
        prepare: applied to each built model (e.g. pick the experts implementation).
        assistant_fields: overrides of a smaller draft model for assisted decoding.
        code_files: the remote-code files `save_pretrained` copies next to the weights.
        saved_fields: overrides of the model of the save / reload checks (every optional module present).
        perturb: applied to that model before saving (e.g. a non-zero router bias buffer).
        bad_configs: (overrides of `config()`, regex of the `ValueError` message) of the family's own fields; the
            LLaMA fields both families share are in `LLAMA_BAD_CONFIGS`.
    """

    name: str
    config_class: type
    model_class: type
    router_class: type
    fields: dict
    unaligned_fields: dict
    fast_and_reference: tuple[dict, dict]
    prepare: Callable = field(default=lambda model, **overrides: model)
    assistant_fields: dict = field(default_factory=lambda: {"num_hidden_layers": 1})
    code_files: tuple = ()
    saved_fields: dict = field(default_factory=dict)
    perturb: Callable = field(default=lambda model: None)
    bad_configs: tuple = ()

    def config(self, **overrides):
        return self.config_class(**{**LLAMA_FIELDS, **self.fields, **overrides})

    def model(self, seed: int = 0, dtype=torch.float64, **overrides):
        """A tiny model in eval mode; float64 by default (no top-k ties between paths); routers spread (std 0.5)
        so that routing matters."""
        build = {k: v for k, v in overrides.items() if k != "experts_implementation"}
        torch.manual_seed(seed)
        model = self.model_class(self.config(**build)).to(dtype).eval()
        model = self.prepare(model, **overrides)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, self.router_class):
                    module.weight.normal_(0, 0.5)
        return model


def _perturb_correction_bias(model) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LatentMoERouter):
                module.e_score_correction_bias.normal_(0, 0.1)


def _prepare_latent_moe(model, experts_implementation="eager", **overrides):
    model.set_experts_implementation(experts_implementation)
    return model


FAMILIES = {
    "mohd": ModelFamily(
        name="mohd",
        config_class=MoHDConfig,
        model_class=MoHDForCausalLM,
        router_class=MoHDRouter,
        fields=dict(num_sub_dims=8, num_shared_sub_dims=3, num_routed_sub_dims_per_tok=2),
        # hidden 144 in 4 sub-dimensions: s = 36 (SmolLM2-135M's 576 at 16 sub-dimensions)
        unaligned_fields=dict(hidden_size=144, num_sub_dims=4, num_shared_sub_dims=1, num_routed_sub_dims_per_tok=2),
        fast_and_reference=({"sparse_implementation": "gather"}, {"sparse_implementation": "masked"}),
        code_files=("modeling_mohd.py", "configuration_mohd.py", "accounting.py", "mohd_sparse.py"),
        saved_fields={"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
        bad_configs=(
            ({"num_sub_dims": 7}, "`hidden_size`"),
            ({"num_shared_sub_dims": 9}, "`num_shared_sub_dims`"),
            ({"num_shared_sub_dims": -1}, "`num_shared_sub_dims`"),
            ({"num_routed_sub_dims_per_tok": 6}, "`num_routed_sub_dims_per_tok`"),
            ({"num_shared_sub_dims": 0, "num_routed_sub_dims_per_tok": 0}, "`num_routed_sub_dims_per_tok`"),
            ({"sparse_modules": ["attention", "moe"]}, "`sparse_modules`"),
            ({"sparse_modules": ["ffn", "ffn"]}, "`sparse_modules`"),
            ({"activation_scaling": "sqrt"}, "`activation_scaling`"),
            ({"routed_gate": "sigmoid"}, "`routed_gate`"),
            ({"group_fusion": "dense"}, "`group_fusion`"),
            ({"sparse_implementation": "triton"}, "`sparse_implementation`"),
            ({"router_aux_loss_coef": -0.1}, "`router_aux_loss_coef`"),
        ),
    ),
    "latent_moe": ModelFamily(
        name="latent_moe",
        config_class=LatentMoEConfig,
        model_class=LatentMoEForCausalLM,
        router_class=LatentMoERouter,
        fields=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_latent_size=8,
            moe_shared_expert_intermediate_size=24,
            per_layer_config={1: {"num_experts": 6, "num_experts_per_tok": 3, "moe_latent_size": None}},
        ),
        # latent width and expert width 36
        unaligned_fields=dict(hidden_size=144, moe_latent_size=36, moe_intermediate_size=36, per_layer_config=None),
        fast_and_reference=({"experts_implementation": "grouped_mm"}, {"experts_implementation": "eager"}),
        prepare=_prepare_latent_moe,
        assistant_fields={"num_hidden_layers": 1, "per_layer_config": None},
        code_files=("modeling_latent_moe.py", "configuration_latent_moe.py", "accounting.py"),
        saved_fields={
            "tie_word_embeddings": True,
            "router_score_func": "sigmoid",
            "experts_implementation": "grouped_mm",
        },
        perturb=_perturb_correction_bias,
        # layer 0 takes the global fields; `fields` overrides layer 1 (replaced where a case sets per_layer_config)
        bad_configs=(
            ({"num_experts_per_tok": 9}, r"layer 0: `num_experts_per_tok`"),
            ({"per_layer_config": {1: {"num_experts_per_tok": 9}}}, r"layer 1: `num_experts_per_tok`"),
            ({"per_layer_config": {1: {"mixer_type": "mamba"}}}, r"layer 1: `mixer_type`"),
            ({"per_layer_config": {1: {"moe_latent_size": 0}}}, r"layer 1: `moe_latent_size`"),
            ({"per_layer_config": {0: {"moe_shared_expert_intermediate_size": -1}}}, r"layer 0: `moe_shared_expert"),
            ({"per_layer_config": {1: {"hidden_size": 96}}}, r"per_layer_config\[1\]`.*hidden_size"),
            ({"per_layer_config": {1: {"mlp_gated": False}}}, r"per_layer_config\[1\]`.*mlp_gated"),
            ({"per_layer_config": {1: {"skip": ["mlp"]}}}, r"per_layer_config\[1\]`.*skip"),
            ({"per_layer_config": {0: {"num_experts": 0}}}, r"layer 0: `num_experts`"),
            ({"router_score_func": "relu"}, r"`router_score_func`"),
            ({"position_embedding_type": "alibi"}, r"`position_embedding_type`"),
            ({"router_bias_update_rate": -1.0}, r"`router_bias_update_rate`"),
            ({"routed_scaling_factor": 0.0}, r"`routed_scaling_factor`"),
        ),
    ),
}
# Bad values of the LLaMA fields both configs validate with the same rules (configuration_common.check_llama_fields).
LLAMA_BAD_CONFIGS = (
    ({"num_key_value_heads": 3}, "`num_attention_heads`"),
    ({"hidden_act": "swish_cubed"}, "`hidden_act`"),
    ({"rms_norm_eps": 0.0}, "`rms_norm_eps`"),
    ({"attention_dropout": 1.5}, "`attention_dropout`"),
    ({"pad_token_id": VOCAB}, "`pad_token_id`"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "spiral", "rope_theta": 10000.0}}, "rope_type"),
    ({"num_hidden_layers": 0}, "`num_hidden_layers`"),
    ({"num_attention_heads": 128, "num_key_value_heads": 128, "head_dim": None}, "`num_attention_heads`"),
)
BAD_CONFIG_CASES = [
    pytest.param(name, overrides, message, id=f"{name}-{'-'.join(map(str, overrides))}-{index}")
    for name, family in FAMILIES.items()
    for index, (overrides, message) in enumerate(LLAMA_BAD_CONFIGS + family.bad_configs)
]


@pytest.fixture(params=list(FAMILIES))
def family(request) -> ModelFamily:
    return FAMILIES[request.param]


def input_ids(batch=2, length=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA_FIELDS, **overrides})).eval()


def caught_warnings(fn, *args, **kwargs):
    """(result, [(category, message)]) of `fn(*args, **kwargs)`, every warning recorded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return result, [(w.category, str(w.message)) for w in caught]


def as_llama_would(llama_warnings, model) -> list:
    """LLaMA's warnings with its class name replaced by `model`'s (the deprecation message names the class)."""
    return [
        (category, message.replace("LlamaForCausalLM", type(model).__name__)) for category, message in llama_warnings
    ]


# --- configuration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family_name, overrides, message", BAD_CONFIG_CASES)
def test_bad_config_raises_value_error_naming_field(family_name, overrides, message):
    """Every bad value is a `ValueError` naming the field (and, for a LatentMoE layer, the layer); the base config of
    each family is valid, so the error comes from the one field changed."""
    family = FAMILIES[family_name]
    family.config()
    with pytest.raises(ValueError, match=message):
        family.config(**overrides)


# --- cache passed as `past_key_values` ------------------------------------------------------------------------


def test_past_key_values_argument_fills_the_cache_and_warns_as_llama(family):
    """transformers 5.x renamed `past_key_values` to `cache`; LLaMA still takes the old name (with a FutureWarning)."""
    model, reference = family.model(), llama()
    ids = input_ids()
    full_logits = model(ids).logits
    _, llama_warnings = caught_warnings(
        reference, ids[:, :-1], past_key_values=DynamicCache(config=reference.config), use_cache=True
    )
    assert [category for category, _ in llama_warnings] == [FutureWarning]  # the oracle warns once
    cache = DynamicCache(config=model.config)
    prefix, model_warnings = caught_warnings(model, ids[:, :-1], past_key_values=cache, use_cache=True)
    assert model_warnings == as_llama_would(llama_warnings, model)
    assert prefix.cache is cache and cache.get_seq_length() == ids.shape[1] - 1
    with pytest.warns(FutureWarning, match="`past_key_values` is deprecated"):
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], full_logits[:, -1], atol=1e-10, rtol=1e-10)
    # the base model takes the old name too
    base_cache = DynamicCache(config=model.config)
    with pytest.warns(FutureWarning, match=f"`past_key_values` is deprecated .* for `{type(model.model).__name__}"):
        model.model(ids, past_key_values=base_cache, use_cache=True)
    assert base_cache.get_seq_length() == ids.shape[1]


def test_generate_with_past_key_values_argument_equals_generate_and_warns_as_llama(family):
    model, reference = family.model(), llama()
    prompt = input_ids(batch=1, length=5)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    _, llama_warnings = caught_warnings(
        reference.generate, prompt, past_key_values=DynamicCache(config=reference.config), **options
    )
    llama_warnings = [w for w in llama_warnings if "past_key_values" in w[1]]
    assert [category for category, _ in llama_warnings] == [FutureWarning]
    cache = DynamicCache(config=model.config)
    out, model_warnings = caught_warnings(model.generate, prompt, past_key_values=cache, **options)
    assert [w for w in model_warnings if "past_key_values" in w[1]] == as_llama_would(llama_warnings, model)
    assert torch.equal(out, model.generate(prompt, **options))
    assert cache.get_seq_length() == prompt.shape[1] + options["max_new_tokens"] - 1


# --- router precision -----------------------------------------------------------------------------------------


def test_router_logits_fp32_under_autocast(family):
    """Under bf16 autocast (the trainer's GPU setting) the routers still compute fp32 logits from their input."""
    model = family.model(dtype=torch.float32)
    inputs = []
    hooks = [
        module.register_forward_pre_hook(lambda module, args: inputs.append((module, args[0])))
        for module in model.modules()
        if isinstance(module, family.router_class)
    ]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids(), output_router_logits=True)
    for hook in hooks:
        hook.remove()
    assert out.logits.dtype == torch.bfloat16, "autocast must be active"
    assert len(out.router_logits) == len(inputs) == len(hooks)
    for logits, (router, hidden_states) in zip(out.router_logits, inputs, strict=True):
        assert logits.dtype == torch.float32
        expected = F.linear(hidden_states.float(), router.weight.float())
        torch.testing.assert_close(logits, expected.reshape(logits.shape), atol=1e-6, rtol=1e-6)


def test_routers_of_both_families_share_one_forward(family):
    """One router base (`TopKRouter`): a family overrides only scoring, selection scores, gates and the observe
    hook, so the fp32 logits, the replay lookup, the gathering of gates and the routing record exist once."""
    assert issubclass(family.router_class, TopKRouter)
    overridden = {name for name in vars(family.router_class) if callable(getattr(family.router_class, name))}
    assert overridden - {"__init__", "_apply", "_count_load"} <= {"score", "selection_scores", "gates", "observe"}
    assert family.router_class.forward is TopKRouter.forward


def test_routing_replay_reproduces_logits_and_keeps_indices(family):
    """Replaying a forward's own routing record reproduces its logits exactly; with other router weights the replay
    keeps the recorded ids, recomputes the gates from the new routers (which get a gradient), while the model's own
    routing now differs."""
    from hf_mohd.models.routing_cache import RoutingCache

    model = family.model()
    ids = input_ids()
    cache = RoutingCache(config=model.config)
    logits = model(ids, cache=cache, use_cache=True).logits
    record = cache.routing_record
    torch.testing.assert_close(model(ids, routing_replay=record).logits, logits, atol=0, rtol=0)
    routers = [module for module in model.modules() if isinstance(module, TopKRouter)]
    with torch.no_grad():
        for router in routers:
            router.weight.mul_(-1)
    new_cache = RoutingCache(config=model.config)
    model(ids, routing_replay=record, cache=new_cache, use_cache=True).logits.sum().backward()
    for key, entry in record.items():
        torch.testing.assert_close(new_cache.routing_record[key].indices, entry.indices)
        assert not torch.allclose(new_cache.routing_record[key].weights, entry.weights), key
    assert all(router.weight.grad.abs().sum() > 0 for router in routers)
    own = RoutingCache(config=model.config)
    model(ids, cache=own, use_cache=True)
    assert any(not torch.equal(own.routing_record[key].indices, entry.indices) for key, entry in record.items())


def test_sampling_beam_search_and_static_cache_equal_no_cache(family):
    """Seeded sampling, beam search (3 beams, 2 returned) and a static cache give what the uncached model gives."""
    model = family.model()
    ids = input_ids(batch=2, length=4)
    sequences = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        sequences.append(
            model.generate(ids, max_new_tokens=6, do_sample=True, top_k=10, pad_token_id=0, use_cache=use_cache)
        )
    torch.testing.assert_close(sequences[0], sequences[1])
    kwargs = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))
    torch.testing.assert_close(greedy(model, ids, cache_implementation="static"), greedy(model, ids, use_cache=False))


# --- LLaMA features -------------------------------------------------------------------------------------------


def test_outputs_hidden_states_attentions_and_logits_to_keep(family):
    model = family.model(attn_implementation="eager")
    ids = input_ids()
    out = model(ids, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert out.attentions[0].shape == (2, model.config.num_attention_heads, 9, 9)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(2, 4, 9, dtype=torch.float64))
    torch.testing.assert_close(model(ids, logits_to_keep=1).logits, out.logits[:, -1:])


def test_sdpa_equals_eager(family):
    """fp32, as LLaMA's own check: eager attention takes its softmax in fp32 whatever the model dtype."""
    from hf_mohd.models.routing_cache import RoutingCache

    eager = family.model(dtype=torch.float32, attn_implementation="eager")
    sdpa = family.model(dtype=torch.float32, attn_implementation="sdpa")
    assert sdpa.config._attn_implementation == "sdpa"
    ids = input_ids()
    cache = RoutingCache(config=eager.config)
    torch.testing.assert_close(sdpa(ids).logits, eager(ids, cache=cache, use_cache=True).logits, atol=1e-5, rtol=0)


def test_gradient_checkpointing_same_gradients(family):
    ids = input_ids()
    grads = []
    for checkpointing in (False, True):
        model = family.model()
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(ids, labels=ids, output_router_logits=True).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


# --- save / load ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_demo_parameter_counts_of_both_families_and_llama(family, tied):
    """`hf_mohd.demo.parameter_counts` (one accounting for every model): the decoder is what the model holds besides
    the embedding and an untied LM head, and the activated decoder is `num_active_parameters()` less the LM head;
    for Llama (dense) the two are equal."""
    from hf_mohd.demo import parameter_counts

    for model in (family.model(tie_word_embeddings=tied), llama(tie_word_embeddings=tied)):
        counts = parameter_counts(model)
        embedding = model.get_input_embeddings().weight.numel()
        built = sum(p.numel() for p in model.parameters())
        assert counts["total"] == built and counts["embedding"] == embedding
        assert counts["decoder"] == built - embedding * (1 if tied else 2)
    dense = counts  # the Llama model's
    assert dense["activated_decoder"] == dense["decoder"]
    sparse = parameter_counts(model := family.model(tie_word_embeddings=tied))
    embedding = model.get_input_embeddings().weight.numel()
    assert sparse["activated_decoder"] == model.config.num_active_parameters() - embedding < sparse["decoder"]


def test_save_and_reload_exact(family, tmp_path):
    """`save_pretrained` writes `auto_map` and the remote-code files; `AutoModelForCausalLM` reloads the same class,
    config, weights and logits (fp32, bit for bit)."""
    from transformers import AutoModelForCausalLM

    model = family.model(dtype=torch.float32, **family.saved_fields)
    family.perturb(model)
    model.save_pretrained(tmp_path)
    config_json = (tmp_path / "config.json").read_text()
    assert '"auto_map"' in config_json and f"{family.code_files[0][:-3]}.{family.model_class.__name__}" in config_json
    for name in (*family.code_files, *REMOTE_CODE_SIBLINGS):
        assert (tmp_path / name).exists(), name
    # only the model's own files travel with the weights: its modeling and configuration files and what they import
    assert {path.name for path in tmp_path.glob("*.py")} == set(family.code_files) | REMOTE_CODE_SIBLINGS
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is family.model_class
    saved, loaded = model.config.to_dict(), reloaded.config.to_dict()
    assert {k: v for k, v in loaded.items() if k != "_name_or_path"} == {
        k: v for k, v in saved.items() if k != "_name_or_path"
    }
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
        assert a.stride() == b.stride(), name  # the same weight layout (block-major input side) after the reload
    reallocate_parameters(reloaded)  # the loaded views of the file may sum in another order (see its docstring)
    ids = input_ids()
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


@pytest.mark.slow
def test_trust_remote_code_reload_in_fresh_process(family, tmp_path):
    """A process without hf_mohd installed loads the saved folder with `trust_remote_code=True`: the classes come
    from the copied files, generate records every router, the logits equal the saving process's, and the config's
    accounting (the copied accounting.py) counts the parameters the model holds."""
    from tests.utils import run_python_without_hf_mohd

    model = family.model(dtype=torch.float32, **family.saved_fields)
    family.perturb(model)
    model.save_pretrained(tmp_path)
    ids = input_ids()
    torch.save(ids, tmp_path / "ids.pt")
    expected = model(ids).logits
    result = run_python_without_hf_mohd(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval()
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        torch.save(model(ids).logits, {str(tmp_path / "logits.pt")!r})
        print(json.dumps({{"module": type(model).__module__, "record": sorted(map(list, out.cache.routing_record)),
                          "experts": getattr(model.config, "_experts_implementation", None),
                          "params": [model.config.num_parameters(), model.num_parameters()],
                          "accounting": type(model.config.accounting()).__module__}}))
        """,
        cwd=str(tmp_path),
    )
    assert not result["module"].startswith("hf_mohd")
    assert result["record"] == sorted(map(list, routers_by_key(model)))
    assert result["experts"] == getattr(model.config, "_experts_implementation", None)
    # the copied accounting.py answers for the config, as the model counts its parameters
    assert result["params"] == [model.num_parameters()] * 2 and not result["accounting"].startswith("hf_mohd")
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-6, rtol=0)


# --- generation -----------------------------------------------------------------------------------------------


def greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **kwargs)


def test_generate_uses_plain_dynamic_cache_only_when_asked(family):
    """`generate` records the routing (a `RoutingCache`) by default and keeps a cache the caller passes as it is."""
    from hf_mohd.models.routing_cache import RoutingCache

    model = family.model()
    ids = input_ids(batch=1, length=4)
    user_cache = DynamicCache(config=model.config)
    out = model.generate(
        ids, max_new_tokens=2, do_sample=False, pad_token_id=0, cache=user_cache, return_dict_in_generate=True
    )
    assert type(out.cache) is DynamicCache
    assert type(greedy(model, ids, return_dict_in_generate=True).cache) is RoutingCache


def routers_by_key(model) -> dict:
    """(layer index, router name) -> the `TopKRouter` of that key."""
    return {(m.layer_idx, m.router_name): m for m in model.modules() if isinstance(m, TopKRouter)}


def test_cached_generation_equals_uncached_and_record_matches_full_forward(family):
    """Cached greedy generation gives the uncached tokens and logits, and its routing record (B, S - 1, k) per router
    equals the routing of one forward over the same tokens."""
    from hf_mohd.models.routing_cache import RoutingCache

    model = family.model()
    ids = input_ids(batch=2, length=5)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    out = model.generate(ids, **options)
    assert isinstance(out.cache, RoutingCache)
    uncached = model.generate(ids, use_cache=False, **options)
    assert uncached.cache is None
    torch.testing.assert_close(out.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(uncached.logits), atol=1e-10, rtol=0)
    full_cache = RoutingCache(config=model.config)
    model(out.sequences[:, :-1], cache=full_cache, use_cache=True)
    routers = routers_by_key(model)
    assert set(full_cache.routing_record) == set(routers)
    for key, record in full_cache.routing_record.items():
        generated = out.cache.routing_record[key]
        assert generated.indices.shape == (2, out.sequences.shape[1] - 1, routers[key].top_k)
        torch.testing.assert_close(generated.indices, record.indices)
        torch.testing.assert_close(generated.weights, record.weights)


def test_assisted_and_prompt_lookup_decoding_equal_greedy(family):
    model = family.model(seed=0)
    assistant = family.model(seed=1, **family.assistant_fields)
    ids = input_ids(batch=1, length=8)
    ids[0, 4:] = ids[0, :4]  # repeated n-grams give prompt lookup candidates
    reference = greedy(model, ids, use_cache=False)
    torch.testing.assert_close(greedy(model, ids, assistant_model=assistant), reference)
    torch.testing.assert_close(greedy(model, ids, prompt_lookup_num_tokens=3), reference)


def test_routing_record_follows_crop_reorder_and_batch_ops(family):
    """The record holds each router's top-k of every position and follows `crop`, `reorder_cache`,
    `batch_repeat_interleave` and `batch_select_indices`; decoding after a crop appends where the cache continues."""
    from hf_mohd.models.modeling_common import topk_lower_index
    from hf_mohd.models.routing_cache import RoutingCache

    model = family.model()
    ids = input_ids(batch=3, length=6)
    cache = RoutingCache(config=model.config)
    out = model(ids, cache=cache, use_cache=True, output_router_logits=True)
    record = {key: value.indices.clone() for key, value in cache.routing_record.items()}
    routers = routers_by_key(model)
    assert set(record) == set(routers)
    for logits, (key, router) in zip(out.router_logits, sorted(routers.items()), strict=True):
        scores = router.selection_scores(router.score(logits.view(3, 6, -1)))
        torch.testing.assert_close(record[key], topk_lower_index(scores, router.top_k) + router.index_offset)
    cache.crop(-2)
    assert cache.get_seq_length() == 4
    for key, value in cache.routing_record.items():
        torch.testing.assert_close(value.indices, record[key][:, :4])
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    for key, value in cache.routing_record.items():
        torch.testing.assert_close(value.indices, record[key][beam_idx, :4])
    cache.batch_repeat_interleave(2)
    cache.batch_select_indices(torch.tensor([0, 5]))
    for key, value in cache.routing_record.items():
        torch.testing.assert_close(value.indices, record[key][beam_idx][[0, 2], :4])
    assert cache.layers[0].keys.shape[0] == 2
    model(ids[[0, 1], 4:5], cache=cache, use_cache=True)
    for key, router in routers.items():
        assert cache.get_routing(*key).indices.shape == (2, 5, router.top_k) and cache.get_seq_length() == 5


def test_left_padded_batch_equals_each_sequence_alone(family):
    """A left-padded batch generates, and scores, each sequence as it would alone."""
    model = family.model()
    long, short = input_ids(batch=1, length=7, seed=1), input_ids(batch=1, length=4, seed=2)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    out = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(out[0, 7:], greedy(model, long)[0, 7:12])
    torch.testing.assert_close(out[1, 7:], greedy(model, short)[0, 4:9])
    logits = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(logits[1, 3:], model(short).logits[0], atol=1e-8, rtol=0)  # float64 rounding


# --- fast path at widths the grouped_mm kernel does not take --------------------------------------------------


DTYPE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def logits_and_gradients(model, ids, decode: bool):
    """Logits and parameter gradients (float64) of a training step: the LM loss over `ids` (prefill), or, for
    decode, the mean squared logits of the last token computed with the cache of the others (no gradient into
    that prefill)."""
    model.train()  # gradients; no dropout in these configs
    model.zero_grad()
    if decode:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :-1], cache=cache, use_cache=True)
        out = model(ids[:, -1:], cache=cache, use_cache=True)
        loss = out.logits.float().square().mean()
    else:
        out = model(ids, labels=ids)
        loss = out.loss
    loss.backward()
    return out.logits.double(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", list(DTYPE_TOLERANCE), ids=str)
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_fast_path_equals_reference_at_unaligned_widths(family, dtype, decode):
    """Widths of 36 scalars (72 bytes in bf16/fp16, not a multiple of 16, which torch's grouped_mm rejects): the fast
    path runs in every dtype and is as accurate as the reference path, in logits and in every gradient.

    Truth: the reference model's (rounded) weights in float64. Errors are in units of eps * max|truth| of each
    tensor. The fast path's error may exceed the reference path's by a small factor (different summation order), not
    by the size of the values as a wrong computation would (about 1 / eps units). The reference's error on a tensor
    is taken as the largest over the tensors of the same role in every layer (`role`): how much rounding a tensor
    gathers is a property of its role (a router's weight gradient passes the softmax Jacobian's cancellation: a
    decoding step's router gradients carry 3 to 2,600 units on either path), and one layer's reference can be lucky
    where the fast path is not (seen on an AMD EPYC Zen 5: 3.0 against 30 units, beside 2,632 for the other layer).
    Decode is batch 1 (MoHD: the few-tokens path), prefill batch 2 (the grouped path).
    """
    fast_overrides, reference_overrides = family.fast_and_reference
    ids = input_ids(batch=1 if decode else 2, length=9)
    fast = family.model(dtype=dtype, **family.unaligned_fields, **fast_overrides)
    reference = family.model(dtype=dtype, **family.unaligned_fields, **reference_overrides)
    truth = family.prepare(copy.deepcopy(reference).double(), **reference_overrides)
    (fast_logits, fast_grads), (reference_logits, reference_grads), (true_logits, true_grads) = (
        logits_and_gradients(model, ids, decode) for model in (fast, reference, truth)
    )
    assert fast_grads.keys() == reference_grads.keys() == true_grads.keys()
    eps = torch.finfo(dtype).eps
    fast_units, reference_units = {}, {}
    for name, got, want, true in [
        ("logits", fast_logits, reference_logits, true_logits),
        *((name, fast_grads[name], reference_grads[name], true_grads[name]) for name in true_grads),
    ]:
        unit = eps * true.abs().max().item()
        fast_units[name] = (got - true).abs().max().item() / unit
        reference_units[name] = (want - true).abs().max().item() / unit
    worst_reference = {}  # role -> the reference's largest error over that role's tensors
    for name, units in reference_units.items():
        worst_reference[role(name)] = max(worst_reference.get(role(name), 0.0), units)
    for name, units in fast_units.items():
        reference = worst_reference[role(name)]
        assert units <= 8 * reference + 4, (name, units, reference_units[name], reference)


def role(name: str) -> str:
    """A parameter's name without its layer index ('model.layers.1.mlp.up_proj.weight' -> 'model.layers.*.mlp...')."""
    return re.sub(r"\.\d+\.", ".*.", name)


# --- modules kept in fp32 -------------------------------------------------------------------------------------


# Config variants that build different module sets: (family, variant id, overrides).
MODULE_VARIANTS = [
    ("mohd", "default", {}),
    ("mohd", "attention_only", {"sparse_modules": ["attention"]}),
    ("latent_moe", "softmax", {"router_score_func": "softmax"}),
    ("latent_moe", "sigmoid", {"router_score_func": "sigmoid"}),
]


@pytest.mark.parametrize(
    ("family_name", "overrides"),
    [(name, overrides) for name, _, overrides in MODULE_VARIANTS],
    ids=[f"{name}-{variant}" for name, variant, _ in MODULE_VARIANTS],
)
def test_keep_in_fp32_modules_are_all_in_the_model(family_name, overrides):
    """transformers' rule: every name in `_keep_in_fp32_modules_strict` is a module (or parameter/buffer) name of the
    model built from the config; LatentMoE's correction bias is listed exactly where it is built (sigmoid routing)."""
    model = FAMILIES[family_name].model(dtype=torch.float32, **overrides)
    names = {
        part
        for name, _ in [*model.named_modules(), *model.named_parameters(), *model.named_buffers()]
        for part in name.split(".")
    }
    listed = set(model._keep_in_fp32_modules_strict)
    assert listed <= names, listed - names
    has_bias = any(getattr(m, "e_score_correction_bias", None) is not None for m in model.modules())
    assert ("e_score_correction_bias" in listed) == has_bias
    assert has_bias == (overrides.get("router_score_func") == "sigmoid")


def test_sigmoid_correction_bias_loads_in_fp32_with_bf16_weights(tmp_path):
    """LatentMoE only (MoHD has no fp32 buffer): the bias survives `from_pretrained(dtype=torch.bfloat16)` exactly."""
    model = FAMILIES["latent_moe"].model(dtype=torch.float32, router_score_func="sigmoid")
    bias = 1.0 + 1e-3 * torch.arange(8, dtype=torch.float32)  # 1.001 .. 1.007 round to 1.0 or 1.0078 in bf16
    with torch.no_grad():
        model.model.layers[0].mlp.gate.e_score_correction_bias.copy_(bias)
    model.save_pretrained(tmp_path)
    loaded = LatentMoEForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    router = loaded.model.layers[0].mlp.gate
    assert router.weight.dtype == torch.bfloat16 and loaded.lm_head.weight.dtype == torch.bfloat16
    assert router.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(router.e_score_correction_bias, bias)
    assert loaded._get_dtype_plan(torch.bfloat16) == {"e_score_correction_bias": torch.float32}


# --- tensor-parallel plan -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_tied_weights_are_sharded_together_as_in_llama(family, tied):
    """A plan shards both tied weights (embedding and LM head, same (V, D) tensor) or neither; here both on the
    vocabulary, with the styles `LlamaForCausalLM.tp_plan` gives them."""
    model = family.model(dtype=torch.float32, tie_word_embeddings=tied)
    tied_model = model if tied else family.model(dtype=torch.float32, tie_word_embeddings=True)
    plan = model.tp_plan

    def style(parameter: str):
        module = parameter.rsplit(".", 1)[0]
        matches = [value for pattern, value in plan.items() if fnmatch(module, pattern)]
        return matches[0] if matches else None

    assert tied_model.all_tied_weights_keys, "the tied config must tie the LM head to the embedding"
    for target, source in tied_model.all_tied_weights_keys.items():
        assert (style(target) is None) == (style(source) is None), (target, source, plan)
    reference = llama(tie_word_embeddings=tied).tp_plan
    for module in ("model.embed_tokens", "lm_head"):
        assert plan.get(module) == reference.get(module), module


# Tiny configs whose heads (4, 2 key/value), widths (64, 96, 24, m = 16) and experts (8, 6) divide by 2 ranks:
# MoHD sparse in both sublayers with 4 sub-dimensions (1 shared, 2 routed) on the gather path; LatentMoE with a latent
# MoE layer, a full-width MoE layer and a dense layer, so that every rule of the plans shards something.
TENSOR_PARALLEL_FIELDS = {
    "mohd": dict(
        num_sub_dims=4,
        num_shared_sub_dims=1,
        num_routed_sub_dims_per_tok=2,
        sparse_implementation="gather",
        attention_bias=True,  # biases: sharded with the input side's weights, replicated on the output side's
        mlp_bias=True,
    ),
    "latent_moe": dict(
        num_hidden_layers=3,
        per_layer_config={
            1: {"num_experts": 6, "num_experts_per_tok": 3, "moe_latent_size": None},
            2: {"mixer_type": "mlp"},
        },
    ),
}


def _full_gradients(model) -> dict[str, torch.Tensor]:
    """{parameter name: its whole gradient}, sharded gradients gathered (a collective: every rank calls it)."""
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return grads


def _greedy(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """4 greedy tokens (B, T + 4) and the logits of each decoding step (4, B, V): steps of 2 tokens run MoHD's
    host-ids gather path against the key/value cache, the prompt its grouped path."""
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.logits)


def _tensor_parallel_outputs(model, ids) -> dict:
    """Logits, 4 greedy tokens, the gradients of the LM loss and each parameter's (placements, local stride)."""
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits
    generated = _greedy(model, ids)
    model.train()
    model(ids, labels=ids).loss.backward()
    layouts = {
        name: (
            tuple((type(p).__name__, getattr(p, "dim", None)) for p in getattr(param, "placements", ())),
            param.to_local().stride() if hasattr(param, "to_local") else param.stride(),
        )
        for name, param in model.named_parameters()
    }
    return {"logits": logits, "generated": generated, "grads": _full_gradients(model), "layouts": layouts}


def _tensor_parallel_rank(rank: int, family_name: str, folder: str, init_file: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")  # as torchrun sets them
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    family = FAMILIES[family_name]
    ids = torch.load(f"{folder}/ids.pt")
    configs = {"tp": DistributedConfig(tp_plan="auto")}
    if family_name == "latent_moe":  # the experts by expert (base_model_ep_plan), the rest by the TP plan
        configs["tp_ep"] = DistributedConfig(tp_plan="auto", ep_size=2)
    results = {}
    for name, distributed_config in configs.items():
        model = family.model_class.from_pretrained(folder, distributed_config=distributed_config, dtype=torch.float32)
        results[name] = _tensor_parallel_outputs(family.prepare(model), ids)
    torch.save(results, f"{folder}/rank{rank}.pt")
    torch.distributed.destroy_process_group()
    # the TP models still hold their gloo groups (7-10 per process, their worker threads alive after the destroy):
    # ended as a multi-process training run is, past gloo's teardown race (`exit_process`)
    from hf_mohd.training import exit_process

    exit_process(0)


def _expected_placements(family_name: str, run: str, parameter: str):
    """The placements the plans give `parameter` (a name of the TP test's tiny models), () for replicated."""
    module, _, _ = parameter.rpartition(".")
    leaf = module.rsplit(".", 1)[-1]
    if parameter in ("model.embed_tokens.weight", "lm_head.weight"):
        return (("Shard", 0),)
    if ".experts." in parameter:  # fused 3-D (E, out, in): whole experts per rank under EP, replicated under TP alone
        return (("Shard", 0),) if run == "tp_ep" else ()
    if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return (("Shard", 0),)
    if leaf in ("o_proj", "down_proj"):  # the bias is added once, after the sum of the ranks' partial products
        return (("Replicate", None),) if parameter.endswith(".bias") else (("Shard", 1),)
    return ()  # norms, routers, group fusion, latent projections


# Variants whose modules together hold every rule of the family's plans (dense and sparse FFNs; gated, ungated experts)
PLAN_VARIANTS = {
    "mohd": [TENSOR_PARALLEL_FIELDS["mohd"], {"sparse_modules": ["attention"]}],
    "latent_moe": [TENSOR_PARALLEL_FIELDS["latent_moe"], {"mlp_gated": False, "hidden_act": "relu2"}],
}


@pytest.mark.parametrize("family_name", list(FAMILIES))
def test_parallel_plans_cover_every_expert_and_match_modules(family_name):
    """The plans as transformers resolves them (`_resolve_parallel_plans`, the concrete names `from_pretrained`
    shards): every parameter gets the placement `_expected_placements` says (Llama's plan for attention and MLPs,
    routers and latent projections replicated), the routed experts have no TP rule (as Qwen3-MoE's plan from
    transformers 5.25 on) and every parameter of every experts module is sharded whole by the EP plan, tied weights
    are sharded together, every rule of each variant's plans matches one of its modules (the plans follow the config:
    no rule for a dense MLP, shared expert or gated experts the config does not build), and the rules equal Llama's /
    Qwen3-MoE's where the modules are the same."""
    family = FAMILIES[family_name]
    for overrides in PLAN_VARIANTS[family_name]:
        model = family.model(dtype=torch.float32, tie_word_embeddings=True, **overrides)
        names = {replace_layer_number_by_wildcard(n) for n, _ in [*model.named_modules(), *model.named_parameters()]}
        assert set(model.tp_plan) <= names and set(model.ep_plan) <= names, overrides
        tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2))
        if model.ep_plan:  # LatentMoE (MoHD's sub-dimension blocks are slices of shared weights, not experts)
            tp_with_ep, ep_plan, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2, ep_size=2))
        for name, _ in model.named_parameters():
            placements = _expected_placements(family_name, "tp", name)
            assert (name in tp_plan) == bool(placements), name
            if placements and "embed_tokens" not in name:
                style = {("Shard", 0): "colwise", ("Shard", 1): "rowwise", ("Replicate", None): "rowwise"}
                assert tp_plan[name] == style[placements[0]], name
        for target, source in model.all_tied_weights_keys.items():
            assert (target in tp_plan) == (source in tp_plan), (target, source)
        experts = [(n, m) for n, m in model.named_modules() if isinstance(m, LatentMoEExpertsBase)]
        assert bool(experts) == (family_name == "latent_moe")
        for module_name, module in experts:
            assert module_name not in tp_plan and ep_plan[module_name] == "ep_dispatch_experts"
            assert module_name not in tp_with_ep
            for param_name, _ in module.named_parameters():
                full_name = f"{module_name}.{param_name}"
                assert full_name not in tp_plan and full_name not in tp_with_ep, full_name
                assert ep_plan[full_name] == "grouped_gemm", full_name
        reference = llama(tie_word_embeddings=True).tp_plan
        if family_name == "mohd":
            assert model.tp_plan == reference and not model.ep_plan
        else:
            assert {rule: model.tp_plan[rule] for rule in reference if rule in names} == {
                rule: style for rule, style in reference.items() if rule in names
            }
            assert not any(".mlp.experts" in rule for rule in model.tp_plan)
            qwen3_moe_ep = {f"model.{rule}": style for rule, style in Qwen3MoeConfig.base_model_ep_plan.items()}
            assert {
                rule: style for rule, style in qwen3_moe_ep.items() if rule in names
            }.items() <= model.ep_plan.items()


def test_latent_moe_plans_follow_the_config():
    """A config without dense layers, shared expert or gated experts gets no rule for them, and a config with all of
    them gets each rule (the rule lists as written out by hand; transformers warns on a rule that matches nothing)."""
    fields = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts=4, num_experts_per_tok=2)
    fields |= dict(moe_intermediate_size=32, intermediate_size=64, vocab_size=100)
    attention = ["layers.*.self_attn.q_proj", "layers.*.self_attn.k_proj", "layers.*.self_attn.v_proj"]
    attention += ["layers.*.self_attn.o_proj"]
    bare = LatentMoEConfig(**fields)
    assert sorted(bare.base_model_tp_plan) == sorted(attention)
    assert sorted(bare.base_model_ep_plan) == sorted(
        ["layers.*.mlp.experts", "layers.*.mlp.experts.gate_up_proj", "layers.*.mlp.experts.down_proj"]
    )
    mixed = LatentMoEConfig(
        **fields, per_layer_config={0: {"mixer_type": "mlp"}}, moe_shared_expert_intermediate_size=16
    )
    mlp = ["layers.*.mlp.gate_proj", "layers.*.mlp.up_proj", "layers.*.mlp.down_proj"]
    shared = [f"layers.*.mlp.shared_experts.{name}" for name in ("gate_proj", "up_proj", "down_proj")]
    assert sorted(mixed.base_model_tp_plan) == sorted(attention + mlp + shared)
    ungated = LatentMoEConfig(**fields, mlp_gated=False, hidden_act="relu2")
    assert sorted(ungated.base_model_ep_plan) == sorted(
        ["layers.*.mlp.experts", "layers.*.mlp.experts.up_proj", "layers.*.mlp.experts.down_proj"]
    )
    assert "base_model_ep_plan" not in ungated.to_dict() and "base_model_tp_plan" not in ungated.to_dict()


@pytest.mark.slow
def test_tensor_parallel_on_two_processes_equals_one(family, tmp_path):
    """`from_pretrained(distributed_config=DistributedConfig(tp_plan="auto"))` on 2 gloo processes shards attention
    and MLPs as Llama, the tied embedding / LM head on the vocabulary, the routed experts as Qwen3-MoE, and leaves
    routers and latent projections replicated; every rank's logits, greedy tokens and (gathered) gradients equal
    the single-process ones. MoHD runs its gather path on block-major local shards (`MoHDTensorParallelProjections`);
    LatentMoE runs a second time with `ep_size=2` (whole experts per rank, `base_model_ep_plan`)."""
    fields = TENSOR_PARALLEL_FIELDS[family.name]
    model = family.model(dtype=torch.float32, tie_word_embeddings=True, vocab_size=96, **fields)  # 96: 2 shards
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path)
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected_logits = model(ids).logits
    expected_tokens, expected_step_logits = _greedy(model, ids)
    model.train()
    model(ids, labels=ids).loss.backward()
    expected_grads = _full_gradients(model)
    torch.multiprocessing.spawn(
        _tensor_parallel_rank, args=(family.name, str(tmp_path), str(tmp_path / "init")), nprocs=2
    )
    block_major = tuple(f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    for rank in range(2):
        for run, result in torch.load(tmp_path / f"rank{rank}.pt").items():
            for parameter, (placements, stride) in result["layouts"].items():
                assert placements == _expected_placements(family.name, run, parameter), (run, parameter)
                if family.name == "mohd" and parameter.endswith(block_major):
                    assert stride[0] == 1, parameter  # the local shard is block-major: the gather fast paths
            torch.testing.assert_close(result["logits"], expected_logits, atol=1e-5, rtol=1e-5)
            tokens, step_logits = result["generated"]
            assert torch.equal(tokens, expected_tokens), run
            torch.testing.assert_close(step_logits, expected_step_logits, atol=1e-5, rtol=1e-5)
            assert result["grads"].keys() == expected_grads.keys()
            for name, grad in result["grads"].items():
                torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-5, msg=f"{run} {name}")


def test_relu_squared_equals_transformers_and_works_in_place_only_where_asked_outside_autograd():
    """relu2 equals transformers' `ReLUSquaredActivation` bit for bit, with the same gradient; outside autograd
    `inplace=True` overwrites its input (no temporaries) and the default leaves it; inside autograd neither does."""
    from transformers.activations import ReLUSquaredActivation

    assert isinstance(activation("relu2"), ReLUSquared) and type(activation("silu")).__name__ == "SiLUActivation"
    x = torch.randn(64, 96, dtype=torch.float64)
    reference = ReLUSquaredActivation()(x)
    with torch.no_grad():
        scratch = x.clone()
        out = ReLUSquared(inplace=True)(scratch)
        assert torch.equal(out, reference) and out.data_ptr() == scratch.data_ptr()
        scratch = x.clone()
        out = ReLUSquared()(scratch)  # not in place: the input (a module output a hook may hold) stays
        assert torch.equal(out, reference) and torch.equal(scratch, x)
    leaf = x.clone().requires_grad_(True)
    out = ReLUSquared(inplace=True)(leaf)
    assert torch.equal(out, reference) and torch.equal(leaf.detach(), x)
    grad = torch.randn_like(x)
    out.backward(grad)
    expected = x.clone().requires_grad_(True)
    ReLUSquaredActivation()(expected).backward(grad)
    torch.testing.assert_close(leaf.grad, expected.grad, rtol=1e-15, atol=0)
    torch.testing.assert_close(leaf.grad, 2 * grad * x.clamp_min(0), rtol=1e-15, atol=0)
    assert torch.autograd.gradcheck(ReLUSquared(), (torch.randn(5, 7, dtype=torch.float64, requires_grad=True),))


def test_gated_mlp_product_in_place_only_where_no_hook_can_hold_the_activation():
    """The SwiGLU product `act(gate) * up` overwrites act(gate) outside autograd (one temporary fewer) and equals
    the out-of-place product bit for bit; a forward hook on `act_fn` (a module or a global hook) keeps seeing
    silu(gate), not the product; under autograd act(gate) is never overwritten."""
    from hf_mohd.models.modeling_common import MLP

    mlp = MLP(LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu"))
    gate, up = torch.randn(5, 48, dtype=torch.float64), torch.randn(5, 48, dtype=torch.float64)
    expected = F.silu(gate) * up
    with torch.no_grad():
        out = mlp.activate(gate, up)
        assert torch.equal(out, expected)
        kept = []
        for register in (mlp.act_fn.register_forward_hook, torch.nn.modules.module.register_module_forward_hook):
            handle = register(lambda module, args, output: kept.append(output))
            out = mlp.activate(gate, up)
            handle.remove()
            assert torch.equal(out, expected) and torch.equal(kept.pop(), F.silu(gate))
        hidden = torch.randn(5, 32, dtype=torch.float64)
        mlp = mlp.double()
        dense = mlp.down_proj(F.silu(mlp.gate_proj(hidden)) * mlp.up_proj(hidden))
        assert torch.equal(mlp(hidden), dense)
    leaf = gate.clone().requires_grad_(True)
    kept = []
    handle = mlp.act_fn.register_forward_hook(lambda module, args, output: kept.append(output))
    out = mlp.activate(leaf, up)
    handle.remove()
    out.sum().backward()
    assert torch.equal(out.detach(), expected) and torch.equal(kept[0].detach(), F.silu(gate))
    torch.testing.assert_close(leaf.grad, up * torch.sigmoid(gate) * (1 + gate * (1 - torch.sigmoid(gate))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wanted", ["both", "gate", "up"])
def test_fused_silu_gated_product_equals_the_composition_bit_for_bit(dtype, wanted):
    """Under autograd the SwiGLU product is one node (`SiLUGatedProductFunction`, which keeps gate and up only): its
    output and both input gradients equal autograd's `silu(gate) * up` to the bit, also when only one input needs a
    gradient, in fp32 and bf16; a hook on `act_fn` (module or global, forward or pre-forward) brings the composition
    back, and the hook sees silu(gate)."""
    from hf_mohd.models.modeling_common import MLP, SiLUGatedProductFunction

    mlp = MLP(LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu"))
    assert mlp.fused_silu_product
    generator = torch.Generator().manual_seed(0)
    gate0, up0 = (torch.randn(3, 7, 48, generator=generator).to(dtype) for _ in range(2))
    grad = torch.randn(3, 7, 48, generator=generator).to(dtype)

    def run(function):
        gate = gate0.clone().requires_grad_(wanted in ("both", "gate"))
        up = up0.clone().requires_grad_(wanted in ("both", "up"))
        out = function(gate, up)
        out.backward(grad)
        return out.detach(), gate.grad, up.grad, out.grad_fn

    expected = run(lambda gate, up: F.silu(gate) * up)
    fused = run(mlp.activate)
    assert type(fused[3]).__name__ == "SiLUGatedProductFunctionBackward"
    for got, want in zip(fused[:3], expected[:3], strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
    kept = []
    for register in (
        mlp.act_fn.register_forward_hook,
        torch.nn.modules.module.register_module_forward_hook,
    ):
        handle = register(lambda module, args, output: kept.append(output.detach()))
        hooked = run(mlp.activate)
        handle.remove()
        assert type(hooked[3]).__name__ == "MulBackward0" and torch.equal(kept.pop(), F.silu(gate0))
        assert all(
            (g is None and w is None) or torch.equal(g, w) for g, w in zip(hooked[:3], expected[:3], strict=True)
        )
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    assert type(run(mlp.activate)[3]).__name__ == "MulBackward0"
    handle.remove()
    # the rule itself, away from the module: float64 gradcheck of both inputs
    gate64, up64 = (torch.randn(4, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(SiLUGatedProductFunction.apply, (gate64, up64))


def test_non_silu_or_ungated_mlp_keeps_the_composition():
    """Only a gated MLP with a silu activation takes the fused node: gelu and relu2 MLPs keep their own composition."""
    from hf_mohd.models.modeling_common import MLP

    assert not MLP(LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="gelu")).fused_silu_product
    ungated = LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="relu2")
    ungated.mlp_gated = False
    assert not MLP(ungated).fused_silu_product
