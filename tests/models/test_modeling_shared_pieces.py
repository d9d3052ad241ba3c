"""The pieces both families' models are built from (`hf_mohd/models/modeling_common.py`): the one router base
(`TopKRouter`) with the routing record it writes, and the activations and the gated MLP product. Oracles:
transformers' `ReLUSquaredActivation`, autograd's composition of the same product, and the router's own top-k of the
recorded logits. The families' public behaviour is checked in `test_modeling_common.py`.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from hf_mohd import RoutingCache
from hf_mohd.models.modeling_common import (
    MLP,
    ReLUSquared,
    SiLUGatedProductFunction,
    TopKRouter,
    activation,
    topk_lower_index,
)
from tests.utils import input_ids, routers, routers_by_key


# --- routers -------------------------------------------------------------------------------------------------


def test_routers_of_both_families_share_one_forward(family):
    """One router base (`TopKRouter`): a family overrides only scoring, selection scores, gates and the observe
    hook, so the fp32 logits, the replay lookup, the gathering of gates and the routing record exist once."""
    (router_class,) = {type(router) for router in routers(family.model())}
    assert issubclass(router_class, TopKRouter)
    overridden = {name for name in vars(router_class) if callable(getattr(router_class, name))}
    assert overridden - {"__init__", "_apply", "_count_load"} <= {"score", "selection_scores", "gates", "observe"}
    assert router_class.forward is TopKRouter.forward


def test_routing_record_follows_crop_reorder_and_batch_ops(family):
    """The record holds each router's top-k of every position and follows `crop`, `reorder_cache`,
    `batch_repeat_interleave` and `batch_select_indices`; decoding after a crop appends where the cache continues."""
    model = family.model()
    ids = input_ids(batch=3, length=6)
    cache = RoutingCache(config=model.config)
    out = model(ids, cache=cache, use_cache=True, output_router_logits=True)
    record = {key: value.indices.clone() for key, value in cache.routing_record.items()}
    keyed = routers_by_key(model)
    assert set(record) == set(keyed)
    for logits, (key, router) in zip(out.router_logits, sorted(keyed.items()), strict=True):
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
    for key, router in keyed.items():
        assert cache.get_routing(*key).indices.shape == (2, 5, router.top_k) and cache.get_seq_length() == 5


# --- activations and the gated MLP ---------------------------------------------------------------------------


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
    assert not MLP(LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="gelu")).fused_silu_product
    ungated = LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="relu2")
    ungated.mlp_gated = False
    assert not MLP(ungated).fused_silu_product
