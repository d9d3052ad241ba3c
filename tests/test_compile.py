"""torch.compile: a static-cache decode step of both families compiles with fullgraph=True (no graph break) and
decodes the same greedy tokens as eager. Under compilation MoHD's few-token plan reads blocks through index tensors
(`MoHDIndexedPlan`) instead of host ids, so this also covers that form end to end."""

import pytest
import torch
from torch import nn
from transformers import StaticCache

from hf_mohd.models import mohd_layout
from tests.utils import FAMILIES, input_ids


# Overrides of each family's tiny config: a 64-position static cache, no pad id; LatentMoE with one expert shape (latent
# and expert width 32) in both layers and no shared expert
FIELDS = {
    "mohd": dict(max_position_embeddings=64, pad_token_id=None),
    "latent_moe": dict(
        max_position_embeddings=64,
        pad_token_id=None,
        moe_intermediate_size=32,
        moe_latent_size=32,
        moe_shared_expert_intermediate_size=0,
        per_layer_config=None,
    ),
}


def build(family):
    """float32, the config's experts implementation; routers spread: distinct routes per token, no near-ties between
    eager and compiled."""
    return family.model(dtype=torch.float32, experts_implementation=None, **FIELDS[family.name])


def static_cache_greedy(model, forward, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Prefill eagerly, then `new_tokens` single-token steps through `forward` on a static cache."""
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + new_tokens)
    with torch.no_grad():
        logits = model(input_ids=prompt, cache=cache, use_cache=True).logits
        tokens = [int(logits[0, -1].argmax())]
        for step in range(new_tokens - 1):
            position = torch.tensor([prompt.shape[1] + step])
            token = torch.tensor([[tokens[-1]]])
            logits = forward(input_ids=token, cache=cache, use_cache=True, position_ids=position[None]).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


@pytest.mark.slow
def test_static_cache_decode_step_compiles_fullgraph(family):
    model = build(family)
    assert type(model)._can_compile_fullgraph
    prompt = input_ids(batch=1, length=5, seed=1)
    eager = static_cache_greedy(model, model, prompt, 8)
    torch._dynamo.reset()
    # one compilation serves every step: a recompilation (a guard on the step's position or cache length) fails
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = static_cache_greedy(model, torch.compile(model, fullgraph=True, dynamic=False), prompt, 8)
    assert compiled == eager
    assert len(set(eager)) > 2  # a real sequence, not one repeated token


@pytest.mark.slow
def test_block_major_mohd_decode_step_compiles_fullgraph_on_its_fused_weights():
    """In the layout `generate` stores (block-major, q/k/v and gate/up each one (D, sum of out) storage), the compiled
    step reads a sublayer's input projections through that one storage (`fused_block_major_weight` decides on strides
    alone while compiling, `block_major_fused_views`), with no graph break and the eager greedy tokens."""
    model = build(FAMILIES["mohd"])
    model.to_weight_layout("column_major")
    groups = [group for layer in model.model.layers for group in (
        [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
        [layer.mlp.gate_proj, layer.mlp.up_proj],
    )]  # fmt: skip
    assert all(mohd_layout.shares_block_major_storage(group) for group in groups)
    assert all(mohd_layout.block_major_fused_views(group) for group in groups)
    unfused = [nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)]
    assert not mohd_layout.block_major_fused_views(unfused)  # row-major (8, 1) strides
    prompt = input_ids(batch=1, length=5, seed=1)
    eager = static_cache_greedy(model, model, prompt, 8)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = static_cache_greedy(model, torch.compile(model, fullgraph=True, dynamic=False), prompt, 8)
    assert compiled == eager
    assert len(set(eager)) > 2


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["gather", "sorted"])
def test_mohd_prefill_without_autograd_compiles_fullgraph(implementation):
    """A many-token forward without autograd (the prefill `generate` compiles with a static cache) takes the grouped
    plan, whose input side then adds its routed products with a plain `index_add_` (dynamo traces `MoHDRowIndexAdd`'s
    `mark_dirty` only where autograd records it), or the sorted plan (its sort, group ends and row Functions): it
    compiles with fullgraph=True and gives eager's logits."""
    model = build(FAMILIES["mohd"])
    model.set_sparse_implementation(implementation)
    ids = input_ids(batch=2, length=16, seed=2)  # 32 tokens: the grouped plan
    with torch.no_grad():
        eager = model(input_ids=ids, use_cache=False).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, dynamic=False)(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_sorted_batched_decode_step_compiles_once():
    """Batched decoding on the sorted strategy: 4 sequences a step, more than the index-tensor plan's few tokens, so
    the compiled static-cache step runs the sorted plan (its sort, `searchsorted` group ends and grouped products on
    the fused block-major weights) with fullgraph=True, one compilation for every step, and decodes eager's greedy
    tokens (eager takes the host-ids plan for 4 tokens: two forms of the same function)."""
    model = build(FAMILIES["mohd"])
    model.set_sparse_implementation("sorted")
    model.to_weight_layout("column_major")
    prompt = input_ids(batch=4, length=5, seed=3)
    steps = 7

    def greedy(forward) -> torch.Tensor:
        cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + steps + 1)
        with torch.no_grad():
            logits = model(input_ids=prompt, cache=cache, use_cache=True).logits
            tokens = [logits[:, -1].argmax(-1)]
            for step in range(steps):
                position = torch.full((prompt.shape[0], 1), prompt.shape[1] + step)
                logits = forward(input_ids=tokens[-1][:, None], cache=cache, use_cache=True, position_ids=position)
                tokens.append(logits.logits[:, -1].argmax(-1))
        return torch.stack(tokens, 1)

    eager = greedy(model)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = greedy(torch.compile(model, fullgraph=True, dynamic=False))
    assert torch.equal(compiled, eager)
    assert len(set(eager.flatten().tolist())) > 4
