"""torch.compile: a static-cache decode step of both families compiles with fullgraph=True (no graph break) and
decodes the same greedy tokens as eager. Under compilation MoHD's few-token plan reads blocks through index tensors
(`MoHDIndexedPlan`) instead of host ids, so this also covers that form end to end."""

import pytest
import torch
from transformers import StaticCache

from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM, MoHDConfig, MoHDForCausalLM


SHAPE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def build(family: str):
    torch.manual_seed(0)
    if family == "mohd":
        config = MoHDConfig(**SHAPE, num_sub_dims=8, num_shared_sub_dims=3, num_routed_sub_dims_per_tok=2)
        model = MoHDForCausalLM(config)
    else:
        config = LatentMoEConfig(
            **SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_latent_size=32
        )
        model = LatentMoEForCausalLM(config)
    with torch.no_grad():  # spread routers: distinct routes per token, no near-ties between eager and compiled
        for name, param in model.named_parameters():
            if "router" in name or name.endswith("gate.weight"):
                param.normal_(0, 0.5)
    return model.eval()


def greedy(model, forward, prompt: torch.Tensor, new_tokens: int) -> list[int]:
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
@pytest.mark.parametrize("family", ["mohd", "latent_moe"])
def test_static_cache_decode_step_compiles_fullgraph(family):
    model = build(family)
    assert type(model)._can_compile_fullgraph
    prompt = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(1))
    eager = greedy(model, model, prompt, 8)
    torch._dynamo.reset()
    compiled = greedy(model, torch.compile(model, fullgraph=True, dynamic=False), prompt, 8)
    assert compiled == eager
    assert len(set(eager)) > 2  # a real sequence, not one repeated token
