"""Checks common to both model families (MoHD and LatentMoE), each test parametrised over the family, as
transformers' `ModelTesterMixin` runs its common checks for every model. Oracles: LlamaForCausalLM (cache argument,
warnings, parallel plan), the uncached forward, each family's reference path (MoHD masked, LatentMoE eager experts),
an fp32 recomputation of the router logits, and the saved model itself.

To add a common check: take the `family` fixture (`tests/conftest.py`) and build models with `family.model(...)`; put
what differs between the families (config fields, the fast and the reference path) in `ModelFamily` (`tests/utils.py`).
The suite uses the families through their public API only: checks of the pieces behind it are in
`test_modeling_shared_pieces.py` (modeling_common.py) and the family files.
"""

import copy
import os
import re
import warnings
from fnmatch import fnmatch

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, Qwen3MoeConfig
from transformers.cache_utils import DynamicCache
from transformers.distributed import DistributedConfig
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

from hf_mohd import RoutingCache
from tests.utils import (
    FAMILIES,
    VOCAB,
    gradients,
    greedy,
    input_ids,
    llama_config,
    reallocate_parameters,
    routers,
    routers_by_key,
    run_python_without_hf_mohd,
)


# The shared model files every family's remote code imports (the forwards of both families live in modeling_common.py)
REMOTE_CODE_SIBLINGS = {"modeling_common.py", "configuration_common.py", "routing_cache.py"}


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


def llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(**overrides)).eval()


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
        router.register_forward_pre_hook(lambda module, args: inputs.append((module, args[0])))
        for router in routers(model)
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


def test_routing_replay_reproduces_logits_and_keeps_indices(family):
    """Replaying a forward's own routing record reproduces its logits exactly; with other router weights the replay
    keeps the recorded ids, recomputes the gates from the new routers (which get a gradient), while the model's own
    routing now differs."""
    model = family.model()
    ids = input_ids()
    cache = RoutingCache(config=model.config)
    logits = model(ids, cache=cache, use_cache=True).logits
    record = cache.routing_record
    torch.testing.assert_close(model(ids, routing_replay=record).logits, logits, atol=0, rtol=0)
    model_routers = routers(model)
    with torch.no_grad():
        for router in model_routers:
            router.weight.mul_(-1)
    new_cache = RoutingCache(config=model.config)
    model(ids, routing_replay=record, cache=new_cache, use_cache=True).logits.sum().backward()
    for key, entry in record.items():
        torch.testing.assert_close(new_cache.routing_record[key].indices, entry.indices)
        assert not torch.allclose(new_cache.routing_record[key].weights, entry.weights), key
    assert all(router.weight.grad.abs().sum() > 0 for router in model_routers)
    own = RoutingCache(config=model.config)
    model(ids, cache=own, use_cache=True)
    assert any(not torch.equal(own.routing_record[key].indices, entry.indices) for key, entry in record.items())


def test_generate_under_inference_mode_leaves_a_trainable_model(family):
    """`generate` stores each family's decoding layout (MoHD's block-major input projections, LatentMoE's
    expert-input-major experts with the gather kernel) by replacing parameter data; under `torch.inference_mode()`
    those would be inference tensors, which autograd refuses to save for backward ever after. The layouts are made
    outside inference mode: no parameter is an inference tensor, and a training step then runs and gives the same
    gradients as the model that never generated."""
    model, reference = family.model(experts_implementation="gather"), family.model(experts_implementation="gather")
    prompt = input_ids(1, 4)
    with torch.inference_mode():
        model.eval().generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert not any(param.is_inference() for param in model.parameters())
    assert any(not param.is_contiguous() for param in model.parameters())  # the decoding layout is stored
    ids = input_ids(2, 6)
    for trained in (model, reference):
        trained.train()(input_ids=ids, labels=ids).loss.backward()
    expected = gradients(reference)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)


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
        grads.append(gradients(model))
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


# --- save / load ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_demo_parameter_counts_of_both_families_and_llama(family, tied):
    """`hf_mohd.models.accounting.parameter_counts`, the demo's (one accounting for every model): the decoder is what
    the model holds besides the embedding and an untied LM head, and the activated decoder is
    `num_active_parameters()` less the LM head; for Llama (dense) the two are equal."""
    from hf_mohd.models.accounting import parameter_counts

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
        assert a.stride() == b.stride() and b.is_contiguous(), name  # contiguous after the reload, as saved
    reallocate_parameters(reloaded)  # the loaded views of the file may sum in another order (see its docstring)
    if family.model_class.__name__ == "LatentMoEForCausalLM":  # the same experts kernel, whose sum order is its own
        reloaded.set_experts_implementation(model.config._experts_implementation)
    ids = input_ids()
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


@pytest.mark.slow
def test_parameters_are_contiguous_and_fully_shard_takes_the_model(family, tmp_path):
    """As transformers' `test_load_contiguous_weights`: every parameter of a new and of a reloaded model is contiguous,
    so FSDP2's `fully_shard`, which refuses non-contiguous parameters, wraps the model as `from_pretrained` gives it
    (here on a one-process gloo group) and a training step runs, with the loss of the unsharded model."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = family.model(dtype=torch.float32)
    assert [name for name, param in model.named_parameters() if not param.is_contiguous()] == []
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert [name for name, param in reloaded.named_parameters() if not param.is_contiguous()] == []
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ids = input_ids()
        with torch.no_grad():
            expected = model.train()(input_ids=ids, labels=ids).loss
        mesh = init_device_mesh("cpu", (1,))
        for layer in reloaded.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(reloaded, mesh=mesh)
        loss = reloaded.train()(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
        assert all(param.grad is not None for param in reloaded.parameters() if param.requires_grad)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padding_matches_padding_free_with_position_ids(family, attention):
    """As transformers' `test_eager_padding_matches_padding_free_with_position_ids`: two sequences (5 and 3 tokens)
    right-padded with an attention mask, and packed into one row with position ids restarting at 0 (no mask, no
    cache: transformers' masks then keep the sequences apart), give the same logits at every real token and the same
    router aux loss (the padded batch's loss counts only the real tokens); `LlamaForCausalLM` does the same. Eager
    attention takes its softmax in float32, as Llama's does, and the padded row (masked columns) and the packed one
    round differently by the CPU's vector width (AVX2 against AVX-512): its logits and aux loss (the routers read the
    attention's output) agree to float32's tolerance."""
    model = family.model()
    model.set_attn_implementation(attention)
    tolerance = {"rtol": 1e-10, "atol": 1e-10} if attention == "sdpa" else {"rtol": 1e-5, "atol": 1e-7}
    first, second = input_ids(1, 5, seed=1)[0], input_ids(1, 3, seed=2)[0]
    padded = torch.zeros(2, 5, dtype=torch.long)
    padded[0], padded[1, :3] = first, second
    mask = (torch.arange(5) < torch.tensor([[5], [3]])).long()
    packed, positions = torch.cat([first, second])[None], torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    with torch.no_grad():
        # labels: the aux loss is computed where a loss is asked for
        padded_out = model(
            input_ids=padded,
            attention_mask=mask,
            labels=padded.masked_fill(mask == 0, -100),
            use_cache=False,
            output_router_logits=True,
        )
        packed_out = model(
            input_ids=packed, position_ids=positions, labels=packed, use_cache=False, output_router_logits=True
        )
    torch.testing.assert_close(padded_out.logits[0], packed_out.logits[0, :5], **tolerance)
    torch.testing.assert_close(padded_out.logits[1, :3], packed_out.logits[0, 5:], **tolerance)
    aux_tolerance = {"rtol": 1e-10, "atol": 1e-12} if attention == "sdpa" else tolerance
    assert padded_out.aux_loss is not None
    torch.testing.assert_close(padded_out.aux_loss, packed_out.aux_loss, **aux_tolerance)
    with torch.no_grad():  # the check is not vacuous: without the restart the second sequence sees the first
        unpacked = model(input_ids=packed, use_cache=False).logits
    assert (unpacked[0, 5:] - padded_out.logits[1, :3]).abs().max() > 1e-3


def test_trust_remote_code_reload_in_fresh_process(family, tmp_path):
    """A process without hf_mohd installed loads the saved folder with `trust_remote_code=True`: the classes come
    from the copied files, generate records every router, the logits equal the saving process's, and the config's
    accounting (the copied accounting.py) counts the parameters the model holds."""
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


def test_generate_uses_plain_dynamic_cache_only_when_asked(family):
    """`generate` records the routing (a `RoutingCache`) by default and keeps a cache the caller passes as it is."""
    model = family.model()
    ids = input_ids(batch=1, length=4)
    user_cache = DynamicCache(config=model.config)
    out = model.generate(
        ids, max_new_tokens=2, do_sample=False, pad_token_id=0, cache=user_cache, return_dict_in_generate=True
    )
    assert type(out.cache) is DynamicCache
    assert type(greedy(model, ids, return_dict_in_generate=True).cache) is RoutingCache


def test_cached_generation_equals_uncached_and_record_matches_full_forward(family):
    """Cached greedy generation gives the uncached tokens and logits, and its routing record (B, S - 1, k) per router
    equals the routing of one forward over the same tokens."""
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
    return out.logits.double(), {name: grad.double() for name, grad in gradients(model).items()}


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


def _greedy_steps(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
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
    generated = _greedy_steps(model, ids)
    model.train()
    model(ids, labels=ids).loss.backward()
    layouts = {
        name: (
            tuple((type(p).__name__, getattr(p, "dim", None)) for p in getattr(param, "placements", ())),
            param.to_local().stride() if hasattr(param, "to_local") else param.stride(),
        )
        for name, param in model.named_parameters()
    }
    return {"logits": logits, "generated": generated, "grads": gradients(model), "layouts": layouts}


def _tensor_parallel_rank(rank: int, family_name: str, folder: str, init_file: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")  # as torchrun sets them
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    family = FAMILIES[family_name]
    ids = torch.load(f"{folder}/ids.pt")
    configs = {"tp": DistributedConfig(tp_plan="auto")}
    if family_name == "latent_moe":  # the experts by expert (base_model_ep_plan), the rest by the TP plan
        configs["tp_ep"] = DistributedConfig(tp_plan="auto", ep_size=2)
    else:  # the sorted strategy's many-token plan on the local shards
        configs["tp_sorted"] = DistributedConfig(tp_plan="auto")
    results = {}
    for name, distributed_config in configs.items():
        model = family.model_class.from_pretrained(folder, distributed_config=distributed_config, dtype=torch.float32)
        if name == "tp_sorted":
            model.set_sparse_implementation("sorted")
        results[name] = _tensor_parallel_outputs(family.prepare(model), ids)
    torch.save(results, f"{folder}/rank{rank}.pt")
    torch.distributed.destroy_process_group()
    # the TP models still hold their gloo groups (7-10 per process, their worker threads alive after the destroy):
    # ended as a multi-process training run is, past gloo's teardown race (`exit_process`)
    from hf_mohd.training import exit_process

    exit_process(0)


def is_experts_module(module) -> bool:
    """A routed-experts module: it holds fused (E, out, in) expert weights, 3-D parameters of its own."""
    return any(param.ndim == 3 for param in module.parameters(recurse=False))


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
        experts = [(n, m) for n, m in model.named_modules() if is_experts_module(m)]
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


@pytest.mark.slow
def test_tensor_parallel_on_two_processes_equals_one(family, tmp_path):
    """`from_pretrained(distributed_config=DistributedConfig(tp_plan="auto"))` on 2 gloo processes shards attention
    and MLPs as Llama, the tied embedding / LM head on the vocabulary, the routed experts as Qwen3-MoE, and leaves
    routers and latent projections replicated; every rank's logits, greedy tokens and (gathered) gradients equal
    the single-process ones. MoHD runs its gather path on block-major local shards (`MoHDTensorParallelProjections`),
    then the sorted strategy's (its many-token plan: the 14-token prompt and the training step); LatentMoE runs a second time with `ep_size=2` (whole experts per rank, `base_model_ep_plan`)."""
    fields = TENSOR_PARALLEL_FIELDS[family.name]
    model = family.model(dtype=torch.float32, tie_word_embeddings=True, vocab_size=96, **fields)  # 96: 2 shards
    ids = input_ids(batch=2, length=7, vocab_size=96)
    model.save_pretrained(tmp_path)
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected_logits = model(ids).logits
    expected_tokens, expected_step_logits = _greedy_steps(model, ids)
    model.train()
    model(ids, labels=ids).loss.backward()
    expected_grads = gradients(model)
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


def test_model_builds_on_the_meta_device_and_initialises_there(family):
    """Serving engines (vLLM's Transformers backend) build the model with its parameters on the meta device and load
    the weights afterwards, under the target device as torch's default device; every `_init_weights` rule must run
    there (MoHD's identity fusion once wrote through `torch.eye(out=...)`, which then refuses a meta tensor). Oracle: the same initialisation on the CPU, where the group
    fusion weight is the identity."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = family.config(**family.saved_fields)
    # parameters on meta, buffers and new tensors on the target device, as vLLM's model loader builds it
    with torch.device("cpu"), init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    parameters = dict(model.named_parameters())
    assert parameters and all(p.device.type == "meta" for p in parameters.values())
    torch.manual_seed(0)
    reference = family.model_class(config)
    assert {name: p.shape for name, p in model.state_dict().items()} == {
        name: p.shape for name, p in reference.state_dict().items()
    }
    for name, weight in reference.named_parameters():
        if name.endswith("group_fusion.weight"):
            torch.testing.assert_close(weight, torch.eye(*weight.shape), rtol=0, atol=0)


def test_every_attention_dispatches_through_the_attention_interface(family):
    """The attention of every layer, sparse or dense, calls the function registered in `ALL_ATTENTION_FUNCTIONS` under
    the config's `_attn_implementation` from its own `forward`, as `LlamaAttention` does: that is how serving engines
    (vLLM's Transformers backend, which reads the call from the forward's source) and user kernels take over attention.
    Oracle: a registered function that records its callers and returns SDPA's result (a registered function gets
    SDPA's mask) gives the SDPA logits, and is called once per layer from a module whose `forward` source holds the
    dispatch."""
    import inspect

    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    callers = []

    def recording_attention(module, *args, **kwargs):
        callers.append(module)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, *args, **kwargs)

    AttentionInterface.register("hf_mohd_recording", recording_attention)
    sdpa = family.model(attn_implementation="sdpa")
    recording = family.model(attn_implementation="hf_mohd_recording")
    ids = input_ids()
    torch.testing.assert_close(recording(ids).logits, sdpa(ids).logits, rtol=0, atol=0)
    assert [module.layer_idx for module in callers] == list(range(recording.config.num_hidden_layers))
    for module in callers:
        source = inspect.getsource(type(module).forward)
        assert "ALL_ATTENTION_FUNCTIONS.get_interface(" in source and "attention_interface(" in source
