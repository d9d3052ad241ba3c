"""MoHD's execution engine (`hf_mohd/models/mohd_*.py`): every fast execution path equals the masked reference
path, in logits and in gradients, and the engine's helpers compute what they say.

The gather strategy has three regimes, chosen by the number of tokens M of a forward: per-slot grouped matmuls
(`MoHDGroupedPlan`, prefill and training) and direct reads of each token's active blocks for few tokens (decoding),
by host block ids on an eager CPU run (`MoHDSpansPlan`) or by index tensors (`MoHDIndexedPlan`, compiled);
plus both weight layouts of `MoHDPreTrainedModel.to_weight_layout`, the fallbacks for projections that are not plain
`nn.Linear`, and the switch between the strategies of `MoHDSparseInterface` on a loaded model. All run in float64 (no
top-k ties) against the masked path on the same weights (`make_model` / `pair`, built from `tests.utils.FAMILIES`).
No timing here: the benchmarks live in `bench/`.
"""

from itertools import pairwise

import pytest
import torch
from torch import nn

from hf_mohd import MoHDForCausalLM
from hf_mohd.models import modeling_mohd, mohd_layout, mohd_plans, mohd_products, mohd_strategies
from hf_mohd.models.modeling_mohd import MoHDGroupFusion
from hf_mohd.models.mohd_geometry import block_token_spans, contiguous_spans
from hf_mohd.models.mohd_layout import set_linear_layout_
from hf_mohd.models.mohd_plans import (
    MoHDGroupedPlan,
    MoHDIndexedPlan,
    MoHDMaskedPlan,
    MoHDSortedPlan,
    MoHDSpansPlan,
)
from hf_mohd.models.mohd_products import (
    MoHDGatheredGroupedMatmul,
    MoHDGroupPart,
    MoHDSparseBlockMix,
    _grouped_mm_aligned,
    grouped_matmul,
    grouped_parts,
)
from hf_mohd.models.mohd_strategies import (
    MoHDGatherStrategy,
    MoHDMaskedStrategy,
    MoHDSortedStrategy,
    MoHDSparseInterface,
)
from hf_mohd.models.native_gather import native_gather
from tests.utils import FAMILIES, gradients, input_ids


MOHD = FAMILIES["mohd"]


def make_model(seed: int = 0, dtype=torch.float64, **overrides) -> MoHDForCausalLM:
    """A tiny MoHD model in eval mode with perturbed fusion, spread routers and random biases, float64 by default."""
    return MOHD.spread_model(seed, dtype, **overrides)


def pair(seed: int = 0, implementation: str = "gather", **overrides) -> tuple[MoHDForCausalLM, MoHDForCausalLM]:
    """(fast, masked) float64 models in training mode with the weights of `make_model`, the fast one on the strategy
    `implementation`."""
    gather = make_model(seed, sparse_implementation=implementation, **overrides).train()
    masked = MoHDForCausalLM(MOHD.config(sparse_implementation="masked", **overrides)).double()
    masked.load_state_dict(gather.state_dict())
    return gather, masked


def assert_same_training_step(gather, masked, ids, **kwargs):
    """Loss (LM + aux), logits and every parameter gradient agree between the two paths."""
    outputs = []
    for model in (gather, masked):
        model.train()
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False, **kwargs)
        # one token has no next-token label: a loss on the logits (plus the aux loss) then drives the gradients
        loss = out.loss if ids.shape[1] > 1 else out.logits.square().mean() + out.aux_loss
        loss.backward()
        outputs.append((out, loss, gradients(model)))
    (out_g, loss_g, grads_g), (out_m, loss_m, grads_m) = outputs
    torch.testing.assert_close(out_g.logits, out_m.logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(loss_g, loss_m, rtol=1e-10, atol=1e-10)
    assert grads_g.keys() == grads_m.keys()
    assert any("router" in name for name in grads_g), "router weights must receive gradients through the gates"
    for name in grads_g:
        torch.testing.assert_close(grads_g[name], grads_m[name], rtol=1e-9, atol=1e-10, msg=name)


def strategies(model):
    return [m.sub_dims.strategy for m in model.modules() if hasattr(m, "sub_dims")]


def test_plans_are_chosen_by_token_count(monkeypatch):
    strategy = MoHDGatherStrategy(MOHD.config())
    assert strategy.few_tokens == 2  # N_r = 5 routed blocks, k = 2
    indices = torch.tensor([[3, 7], [5, 4], [7, 3]])
    weights = torch.rand(3, 2)
    host = strategy.plan(indices[:2], weights[:2])
    assert isinstance(host, MoHDSpansPlan)  # eager CPU: block ids read as Python ints
    assert host.spans == ((0, 6), (7, 8))  # shared 0-2 with routed 3, 4, 5 (picked next to them), then 7
    assert host.keep.tolist() == [[1, 1, 1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 1, 1, 0, 0]]
    torch.testing.assert_close(host.gates[0], torch.tensor([1, 1, 1, weights[0, 0], 0, 0, 0, weights[0, 1]]))
    assert strategy.host_tokens == 8
    with torch.no_grad():  # one token, autograd off (decoding): the gates built from Python floats, no keep
        one = strategy.plan(indices[2:], weights[2:])
    assert one.keep is None and one.spans == ((0, 4), (7, 8))
    torch.testing.assert_close(one.gates[0], torch.tensor([1, 1, 1, weights[2, 1], 0, 0, 0, weights[2, 0]]))
    assert contiguous_spans(6, [9, 6, 7, 9]) == ((0, 8), (9, 10)) and contiguous_spans(0, [2, 1]) == ((0, 0), (1, 3))
    with monkeypatch.context() as patch:  # under torch.compile: index tensors instead
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        few = strategy.plan(indices[:2], weights[:2])
        assert isinstance(few, MoHDIndexedPlan)
        assert few.block_index.tolist() == [[3, 7], [5, 4]]  # absolute ids: rows of weight.view(N, s, in)
        assert few.columns.view(2, 2, -1)[:, :, 0].tolist() == [[3 * 8, 7 * 8], [5 * 8, 4 * 8]]  # s = 64 / 8
        plan = strategy.plan(indices, weights)  # 3 tokens > few_tokens: grouped when compiled
    assert isinstance(plan, MoHDGroupedPlan)
    assert isinstance(strategy.plan(indices.repeat(3, 1), weights.repeat(3, 1)), MoHDGroupedPlan)  # 9 > host_tokens
    # slot 0 picks routed blocks (0, 2, 4) for tokens (0, 1, 2); slot 1 picks (4, 1, 0): sorted by block per slot
    assert plan.token_index.tolist() == [[0, 1, 2], [2, 1, 0]]
    assert plan.block_index.tolist() == [[0, 2, 4], [0, 1, 4]]
    assert plan.offsets.tolist() == [[1, 1, 2, 2, 3], [1, 2, 2, 2, 3]]
    torch.testing.assert_close(plan.gates[1, :, 0], weights[[2, 1, 0], 1])


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True, "mlp_bias": True},
        {"num_routed_sub_dims_per_tok": 1},
        {"num_routed_sub_dims_per_tok": 3, "routed_gate": "normalized"},
        {"sparse_modules": ["ffn"], "group_fusion": "none"},
    ],
    ids=["default", "biases", "k1", "k3-normalized", "ffn-only"],
)
def test_prefill_and_training_step_equal_masked(overrides):
    gather, masked = pair(**overrides)
    assert_same_training_step(gather, masked, input_ids(2, 11))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"routed_gate": "normalized", "attention_bias": True, "mlp_bias": True},
        {"group_fusion": "none", "activation_scaling": "none"},
        {"num_shared_sub_dims": 0, "num_routed_sub_dims_per_tok": 3},
        {"sparse_modules": ["ffn"]},
        {"sparse_modules": ["attention"]},
    ],
)
def test_masked_and_gather_agree_in_logits_and_gradients(overrides):
    reference = make_model(sparse_implementation="masked", **overrides)
    fast = make_model(sparse_implementation="gather", **overrides)
    fast.load_state_dict(reference.state_dict())
    ids = input_ids()
    outputs = []
    for model in (reference, fast):
        model.zero_grad()
        out = model(ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        outputs.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (ref_out, ref_grads), (fast_out, fast_grads) = outputs
    torch.testing.assert_close(fast_out.logits, ref_out.logits, atol=1e-10, rtol=1e-10)
    assert ref_grads.keys() == fast_grads.keys()
    assert any("router" in name for name in ref_grads), "routers must receive gradient through the gates"
    for name in ref_grads:
        torch.testing.assert_close(fast_grads[name], ref_grads[name], atol=1e-10, rtol=1e-8, msg=name)


@pytest.mark.parametrize("length", [1, 3, 9], ids=["host-ids", "host-ids-batch", "grouped"])
def test_no_shared_sub_dimension_gather_equals_masked(length):
    """N_s = 0: the router's ids carry no offset, so they are the top-k slice of a sort; the gather plans flatten
    them, which needs them contiguous (a found-by-hypothesis regression)."""
    fields = dict(num_sub_dims=4, num_shared_sub_dims=0, num_routed_sub_dims_per_tok=2)
    gather = make_model(sparse_implementation="gather", **fields)
    masked = make_model(sparse_implementation="masked", **fields)
    ids = input_ids(batch=1, length=length)
    with torch.no_grad():
        torch.testing.assert_close(gather(ids).logits, masked(ids).logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize("tokens", [1, 2, 8], ids=["one-token", "two-tokens", "eight-tokens"])
def test_few_tokens_path_equal_masked_with_gradients(tokens):
    gather, masked = pair(attention_bias=True, mlp_bias=True)
    assert tokens <= strategies(gather)[0].host_tokens
    assert_same_training_step(gather, masked, input_ids(1, tokens))


@pytest.mark.parametrize("layout", ["row_major", "column_major"])
@pytest.mark.parametrize("small_batch_plan", ["union", "per_block"])
@pytest.mark.parametrize("batch", [1, 3, 9], ids=["batch1-few-tokens", "batch3-few-tokens", "batch9-grouped"])
def test_cached_decoding_equals_masked_step_by_step(batch, small_batch_plan, layout):
    """Prefill then single-token steps with the routing cache: logits of every step agree, as do the routes and
    their gates (at batch 1 in the block-major layout the steps run the native one-token plan)."""
    gather, masked = pair()
    gather.set_small_batch_plan(small_batch_plan)
    gather.to_weight_layout(layout)
    prompt = input_ids(batch, 7, seed=1)
    with torch.no_grad():
        out_g, out_m = gather(input_ids=prompt, use_cache=True), masked(input_ids=prompt, use_cache=True)
        torch.testing.assert_close(out_g.logits, out_m.logits, rtol=1e-10, atol=1e-10)
        for _ in range(5):
            token = out_g.logits[:, -1:].argmax(-1)
            out_g = gather(input_ids=token, cache=out_g.cache, use_cache=True)
            out_m = masked(input_ids=token, cache=out_m.cache, use_cache=True)
            torch.testing.assert_close(out_g.logits, out_m.logits, rtol=1e-10, atol=1e-10)
    for key, record in out_g.cache.routing_record.items():
        assert torch.equal(record.indices, out_m.cache.routing_record[key].indices), key
        torch.testing.assert_close(record.weights, out_m.cache.routing_record[key].weights, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("routed_gate", ["softmax", "normalized", "unit"])
def test_native_one_token_plan_runs_where_it_applies_and_yields_to_observers(monkeypatch, routed_gate):
    """One token without autograd in the block-major layout routes natively (the native form of `MoHDTokenPlan`, the
    router module not called) and equals the masked path; recorded router logits (`output_router_logits=True`),
    routing replay, the row-major layout or a hook on the router each send the token through the router module and
    the torch form instead, with the same logits, and autograd through the spans plan."""
    gather, masked = pair(routed_gate=routed_gate)
    gather.eval(), masked.eval()
    gather.to_weight_layout("column_major")
    plans, router_calls = [], []
    route = modeling_mohd.MoHDSubDimensions.route

    def spy(self, *args, **kwargs):
        plan = route(self, *args, **kwargs)
        plans.append("native" if getattr(plan, "kernels", None) is not None else type(plan).__name__)
        return plan

    monkeypatch.setattr(modeling_mohd.MoHDSubDimensions, "route", spy)
    routers = [
        sub_dims.router for layer in gather.model.layers for sub_dims in (layer.self_attn.sub_dims, layer.mlp.sub_dims)
    ]
    hooks = [router.register_forward_pre_hook(lambda module, args: router_calls.append(1)) for router in routers]
    x = input_ids(1, 1, seed=3)

    def run(expected_plan: str, **kwargs):
        plans.clear(), router_calls.clear()
        out_g, out_m = gather(input_ids=x, **kwargs), masked(input_ids=x, **kwargs)
        torch.testing.assert_close(out_g.logits, out_m.logits, rtol=1e-10, atol=1e-10)
        assert set(plans) == {expected_plan, "MoHDMaskedPlan"}, plans  # gather's plans, then masked's
        return out_g, out_m

    with torch.no_grad():
        run("MoHDTokenPlan")  # a pre-forward hook observes each router: the modules run
        assert len(router_calls) == len(routers) == 4
        for hook in hooks:
            hook.remove()
        run("native")
        gather.set_native_token_plan(False)  # switched off for comparisons: the torch form, the router module
        run("MoHDTokenPlan")
        gather.set_native_token_plan(True)
        out_g, out_m = run("MoHDTokenPlan", output_router_logits=True)
        for logits_g, logits_m in zip(out_g.router_logits, out_m.router_logits, strict=True):
            torch.testing.assert_close(logits_g, logits_m, rtol=1e-12, atol=1e-12)
        run("native")  # the capturing hooks stay installed, inactive
        replay = masked(input_ids=x, use_cache=True).cache.routing_record
        assert len(replay) == 4
        run("MoHDTokenPlan", routing_replay=replay)
        gather.to_weight_layout("row_major")
        run("MoHDTokenPlan")
        gather.to_weight_layout("column_major")
    out_g = gather(input_ids=x)  # autograd on
    assert set(plans[-4:]) == {"MoHDSpansPlan"}
    out_g.logits.sum().backward()
    assert gather.model.layers[0].mlp.sub_dims.router.weight.grad is not None


def test_one_token_path_lists_why_a_faster_form_is_refused(monkeypatch):
    """`one_token_path`, the one list of the fast path's refusals: one token without autograd in the block-major layout
    is native (the input projections' shared storage handed to the plan), and each condition named in the list
    refuses it with its reason: more tokens or autograd (the general plans), the switch, the row-major layout, a hook
    on the router, missing kernels (the torch form of `MoHDTokenPlan`)."""
    gather = make_model(sparse_implementation="gather").eval()
    gather.to_weight_layout("column_major")
    attention = gather.model.layers[0].self_attn
    sub_dims, projections = (
        attention.sub_dims,
        (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj),
    )
    one, two = torch.randn(1, 1, 64, dtype=torch.float64), torch.randn(1, 2, 64, dtype=torch.float64)

    def path(hidden=one):
        return mohd_strategies.one_token_path(sub_dims, hidden, projections)

    with torch.no_grad():
        native = path()
        assert native.form == ("native" if native_gather() is not None else "torch")
        assert path(two)[:2] == ("general", "more than one token")
        if native_gather() is not None:
            assert native.form == "native" and native.refusal == ""
            assert native.fused.data_ptr() == attention.q_proj.weight.data_ptr() and native.fused.shape == (
                64,
                64 + 64,
            )
        gather.set_native_token_plan(False)
        assert path()[:2] == ("torch", "switched off (`set_native_token_plan(False)`)")
        gather.set_native_token_plan(True)
        hook = sub_dims.router.register_forward_hook(lambda *args: None)
        assert path()[:2] == ("torch", "something observes the router (hooks, recorded router logits)")
        hook.remove()
        monkeypatch.setattr(mohd_strategies, "native_gather", lambda: None)
        assert path()[:2] == ("torch", "native kernels not built (`native_gather`)")
        gather.to_weight_layout("row_major")
        assert path()[:2] == ("torch", "input projections not in one block-major storage") and path().fused is None
    assert path()[:2] == ("general", "autograd")


def test_cached_decoding_step_gradients_equal_masked():
    """A single-token step on top of a cache (the decode path) back-propagates like the masked path."""
    gather, masked = pair(mlp_bias=True)
    prompt, token = input_ids(1, 6), input_ids(1, 1, seed=3)
    results = []
    for model in (gather, masked):
        with torch.no_grad():
            cache = model(input_ids=prompt, use_cache=True).cache
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=token, cache=cache, use_cache=True).logits
        logits.square().sum().backward()
        results.append((logits, gradients(model)))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-10, atol=1e-10)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], rtol=1e-9, atol=1e-10, msg=name)


def test_generate_equals_masked():
    gather, masked = pair()
    prompt = input_ids(1, 5, seed=2)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(gather.generate(prompt, **kwargs), masked.generate(prompt, **kwargs))


@pytest.mark.parametrize("layout", ["column_major", "row_major"])
def test_weight_layouts_keep_results(layout):
    """Both input-projection layouts give the masked path's logits and gradients; shapes and state dict stay."""
    gather, masked = pair(attention_bias=True)
    gather.to_weight_layout(layout)
    q_proj = gather.model.layers[0].self_attn.q_proj.weight
    assert q_proj.shape == (64, 64) and q_proj.stride() == ((1, 64) if layout == "column_major" else (64, 1))
    assert gather.model.layers[0].self_attn.o_proj.weight.is_contiguous()  # output side stays row-major
    assert_same_training_step(gather, masked, input_ids(2, 5))
    gather.eval()
    masked.eval()
    with torch.no_grad():
        for length in (1, 2, 9):  # few-tokens reads (1, 2) and the grouped plan (9)
            x = input_ids(1, length, seed=4)
            torch.testing.assert_close(gather(input_ids=x).logits, masked(input_ids=x).logits, rtol=1e-10, atol=1e-10)


def test_contiguous_until_generate_then_block_major_and_invisible_on_disk(tmp_path):
    """Every parameter is contiguous after `__init__` and `from_pretrained` (what `fully_shard` and DeepSpeed need);
    `generate` stores the gather path's input-side weights block-major before decoding, and keeps a layout chosen with
    `to_weight_layout`; a checkpoint holds row-major tensors equal to the weights whatever the layout; a masked-path
    model (the reference) keeps the plain layout."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gather, masked = pair()
    assert all(param.is_contiguous() for param in gather.parameters())
    prompt = input_ids(1, 3, seed=4)
    gather.eval().generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    masked.eval().generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    # (out, in) = (96, 64), gate/up fused into one (64, 192) storage
    assert gather.model.layers[1].mlp.up_proj.weight.stride() == (1, 192)
    assert gather.model.layers[1].mlp.down_proj.weight.is_contiguous()  # the output side reads rows
    assert all(param.is_contiguous() for param in masked.parameters())
    gather.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    for name, param in gather.state_dict().items():
        assert saved[name].is_contiguous() and torch.equal(saved[name], param), name
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert all(param.is_contiguous() for param in reloaded.parameters())
    reloaded.eval(), masked.eval()
    reloaded.to_weight_layout("row_major")
    reloaded.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert reloaded.model.layers[0].self_attn.k_proj.weight.is_contiguous()  # the layout chosen is kept
    reloaded.to_weight_layout("column_major")
    # q (64) / k, v (2 kv heads of 16 each) fused into one (64, 128) storage
    assert reloaded.model.layers[0].self_attn.k_proj.weight.stride() == (1, 128)
    with torch.no_grad():
        x = input_ids(1, 1, seed=5)
        torch.testing.assert_close(reloaded(input_ids=x).logits, masked(input_ids=x).logits, rtol=1e-10, atol=1e-10)
    with pytest.raises(
        ValueError, match=r"`layout` must be one of \('column_major', 'row_major'\), got 'block_major'"
    ):
        gather.to_weight_layout("block_major")  # the former name: one vocabulary with LatentMoE now


def test_fused_input_projections_share_one_storage_and_equal_masked(monkeypatch, tmp_path):
    """`to_weight_layout("column_major")` stores q/k/v and gate/up of each sublayer as column ranges of one tensor
    (`fuse_block_major_`): values, shapes and the state dict unchanged; without autograd, one token on the host and
    few tokens by index tensors compute them with one product per span (counted: the fused tensor is handed out),
    several tokens per linear, all equal to the masked path; with autograd the per-linear products run and every
    weight gets its own gradient; a cast ends the fusion by itself."""
    gather, masked = pair()
    before = {name: tensor.clone() for name, tensor in gather.state_dict().items()}
    gather.to_weight_layout("column_major")
    attention, mlp = gather.model.layers[0].self_attn, gather.model.layers[0].mlp
    qkv, gate_up = [attention.q_proj, attention.k_proj, attention.v_proj], [mlp.gate_proj, mlp.up_proj]
    assert mohd_layout.shares_block_major_storage(qkv) and mohd_layout.shares_block_major_storage(gate_up)
    assert attention.v_proj.weight.data_ptr() == attention.q_proj.weight.data_ptr() + (64 + 32) * 8  # float64
    state = gather.state_dict()
    assert state.keys() == before.keys()
    for name, tensor in state.items():
        assert tensor.is_contiguous() and torch.equal(tensor, before[name]), name  # row-major copies, same values
    assert mohd_layout.shares_block_major_storage(qkv)  # the copies leave the parameters fused

    handed_out = []
    original = mohd_layout.fused_block_major_weight

    def counting(linears):
        fused = original(linears)
        handed_out.append(fused is not None)
        return fused

    monkeypatch.setattr(mohd_plans, "fused_block_major_weight", counting)
    monkeypatch.setattr(mohd_strategies, "fused_block_major_weight", counting)  # the one-token plan's
    gather.eval(), masked.eval()
    with torch.no_grad():
        # one token: `MoHDTokenPlan`, native, or in torch without the native kernels
        for plan, native in (("union", True), ("per_block", True), ("union", False), ("per_block", False)):
            gather.set_small_batch_plan(plan)
            monkeypatch.setattr(mohd_strategies, "native_gather", native_gather if native else lambda: None)
            for length in (1, 2, 3, 9):  # one-token plans, spans plans (2-3 tokens) and the grouped plan (9)
                handed_out.clear()
                x = input_ids(1, length, seed=length)
                torch.testing.assert_close(
                    gather(input_ids=x).logits, masked(input_ids=x).logits, rtol=1e-10, atol=1e-10
                )
                assert handed_out == ([True] * 4 if length == 1 else []), (plan, length)  # 2 layers x 2 sublayers
            x = input_ids(1, 6, seed=6)  # a prompt, then one token at a time from the cache
            cached = gather.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
            assert torch.equal(cached, masked.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0))
        # index-tensor plan (compiled and accelerator runs), built under the patch, computed fused on the host
        sub_dims, hidden = attention.sub_dims, torch.randn(2, 64, dtype=torch.float64)
        with monkeypatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            indexed = sub_dims.strategy.plan(torch.tensor([[3, 7], [5, 4]]), torch.rand(2, 2, dtype=torch.float64))
        assert isinstance(indexed, MoHDIndexedPlan)
        reference = sub_dims.masked.plan(indexed.block_index, indexed.gates[:, :: indexed.geometry.block])
        handed_out.clear()
        for fused_out, dense_out in zip(
            indexed.project_in(hidden, qkv), reference.project_in(hidden, qkv), strict=True
        ):
            torch.testing.assert_close(fused_out, dense_out, rtol=1e-12, atol=1e-12)
        assert handed_out == [True]
    handed_out.clear()
    for ids in (input_ids(2, 5), input_ids(1, 1)):  # per-linear products, each weight its own gradient
        assert_same_training_step(gather, masked, ids)
    assert not any(handed_out)
    assert gather.has_fused_input_projections()
    gather.save_pretrained(tmp_path)  # written row-major one sublayer at a time, then fused again
    assert mohd_layout.shares_block_major_storage(qkv) and gather.decoding_weight_layout == "column_major"
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(saved[name], before[name]) for name in before if name in saved)
    gather.to(torch.float32)
    assert not mohd_layout.shares_block_major_storage(qkv)  # a cast copies each weight: the fusion ends by itself


@pytest.mark.parametrize("layout", ["column_major", "row_major"])
@pytest.mark.parametrize("tokens", [1, 2], ids=["one-token", "two-tokens"])
def test_few_tokens_reads_by_index_tensors_equal_masked(monkeypatch, tokens, layout):
    """Under `torch.compile` (and on accelerators) the few-tokens plan reads the blocks through index tensors
    (`embedding_bag`, `index_select`) instead of host ids; that form equals the masked path too."""
    gather, masked = pair(attention_bias=True, mlp_bias=True)
    gather.to_weight_layout(layout)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert isinstance(strategies(gather)[0].plan(torch.tensor([[3, 7]]), torch.rand(1, 2)), MoHDIndexedPlan)
    assert_same_training_step(gather, masked, input_ids(1, tokens))


def test_block_token_spans_group_blocks_by_their_tokens():
    """Hand-computed: block 2 is picked by all three tokens and joins the shared span; block 4 by tokens 0 and 2 (an
    index), block 5 by token 1 (a slice); consecutive blocks with the same tokens merge, others do not."""
    spans, rows = block_token_spans(2, [[2, 4], [2, 5], [4, 2]])
    assert spans == ((0, 3), (4, 5), (5, 6))
    assert rows[0] == slice(None) and rows[2] == slice(1, 2) and rows[1].tolist() == [0, 2]
    spans, rows = block_token_spans(3, [[4, 5], [6, 4], [7, 6]])
    assert spans == ((0, 3), (4, 5), (5, 6), (6, 7), (7, 8))  # 4: tokens 0-1, 5: 0, 6: 1-2, 7: 2
    assert rows[1:] == (slice(0, 2), slice(0, 1), slice(1, 3), slice(2, 3))
    assert block_token_spans(3, [[5, 6], [6, 5]]) == (((0, 3), (5, 7)), (slice(None), slice(None)))


@pytest.mark.parametrize("layout", ["column_major", "row_major"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("tokens", [2, 3, 8])
def test_per_block_small_batch_plan_equals_masked(tokens, bias, layout):
    """Batched decoding and draft verification with each picked block multiplied only by its tokens: the masked
    path's logits, as decoding sequences (B, 1) and as verified drafts (1, T); with autograd on, the union form."""
    gather, masked = pair(attention_bias=bias, mlp_bias=bias)
    gather.to_weight_layout(layout).eval(), masked.eval()
    gather.set_small_batch_plan("per_block")
    strategy = strategies(gather)[0]
    indices, weights = torch.tensor([[3, 7], [5, 4], [7, 3]]), torch.rand(3, 2)
    with torch.no_grad():
        plan = strategy.plan(indices, weights)
        # block 3: tokens 0 and 2; blocks 4 and 5: token 1 (one span); block 7: tokens 0 and 2
        assert plan.keep is None and plan.spans == ((0, 3), (3, 4), (4, 6), (7, 8))
        assert plan.rows[2] == slice(1, 2) and plan.rows[1].tolist() == plan.rows[3].tolist() == [0, 2]
        for shape in ((tokens, 1), (1, tokens)):
            x = input_ids(*shape, seed=tokens)
            torch.testing.assert_close(gather(input_ids=x).logits, masked(input_ids=x).logits, rtol=1e-10, atol=1e-10)
    assert strategy.plan(indices, weights).rows is None  # autograd on: the union form, whose backward is tested
    gather.set_small_batch_plan("union")
    with torch.no_grad():
        assert strategy.plan(indices, weights).rows is None


def test_auto_small_batch_plan_follows_the_timing(monkeypatch):
    """ "auto" takes "per_block" exactly where few-row products are compute-bound: the timing rule on a fake BLAS
    whose cost grows with the rows (per block) and one whose cost does not (union); the timing runs only when asked
    for (`set_small_batch_plan("auto")`, `HF_MOHD_SMALL_BATCH_PLAN`), never in a forward; the choice survives a
    switch of strategy, and bad names are refused."""
    rule = mohd_strategies.small_gemms_compute_bound.__wrapped__
    clock = [0.0]
    monkeypatch.setattr(mohd_strategies.time, "perf_counter", lambda: clock[0])
    for cost, expected in ((lambda rows: 1.0 * rows, True), (lambda rows: 1.0 + 0.1 * rows, False)):
        monkeypatch.setattr(torch, "mm", lambda a, b, cost=cost: clock.__setitem__(0, clock[0] + cost(a.shape[0])))
        assert rule(torch.float32, 1) is expected
    monkeypatch.undo()

    timings = []

    def fake_timing(dtype, threads, answer):
        timings.append(dtype)
        return answer

    indices, weights = torch.tensor([[3, 7], [5, 4]]), torch.rand(2, 2)
    gather, _ = pair()
    monkeypatch.delenv(mohd_strategies.SMALL_BATCH_PLAN_ENV, raising=False)
    for compute_bound, expected in ((True, "per_block"), (False, "union")):
        monkeypatch.setattr(
            mohd_strategies, "small_gemms_compute_bound", lambda d, t, v=compute_bound: fake_timing(d, t, v)
        )
        assert gather.set_small_batch_plan("auto") == expected
        strategy = strategies(gather)[0]
        with torch.no_grad():
            assert (strategy.plan(indices, weights).rows is not None) is compute_bound
            assert strategy.plan(indices[:1], weights[:1]).rows is None  # one token: a single form
        # an environment choice: timed at construction
        monkeypatch.setenv(mohd_strategies.SMALL_BATCH_PLAN_ENV, "auto")
        assert MoHDGatherStrategy(MOHD.config()).small_batch_plan == expected
        monkeypatch.delenv(mohd_strategies.SMALL_BATCH_PLAN_ENV)
    assert timings == [torch.float64, torch.float32] * 2

    # without a request nothing is timed: a new model's plan is "per_block", and forwards and generate never time
    timings.clear()
    fresh, _ = pair()
    assert {s.small_batch_plan for s in strategies(fresh)} == {"per_block"}
    with torch.no_grad():
        fresh(input_ids=input_ids(4, 1))
        fresh.generate(input_ids(3, 2), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert timings == []

    gather.set_small_batch_plan("per_block")
    gather.set_sparse_implementation("gather")
    assert {s.small_batch_plan for s in strategies(gather)} == {"per_block"}
    with pytest.raises(ValueError, match="plan must be one of"):
        gather.set_small_batch_plan("blocks")
    monkeypatch.setenv(mohd_strategies.SMALL_BATCH_PLAN_ENV, "blocks")
    with pytest.raises(ValueError, match="HF_MOHD_SMALL_BATCH_PLAN must be one of"):
        MoHDGatherStrategy(MOHD.config())


class WrappedLinear(nn.Linear):
    """Stands for a PEFT/quantised projection: not a plain `nn.Linear`, so the strategy calls it as a module."""


def test_non_plain_linear_fallback_equals_masked():
    gather, masked = pair(attention_bias=True)
    for layer in gather.model.layers:
        for parent, name in ((layer.self_attn, "q_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            old = getattr(parent, name)
            new = WrappedLinear(old.in_features, old.out_features, bias=old.bias is not None, dtype=torch.float64)
            new.load_state_dict(old.state_dict())
            setattr(parent, name, new)
    for length in (1, 7):  # few-tokens and grouped plans
        assert_same_training_step(gather, masked, input_ids(1, length))


def test_projections_that_are_not_plain_linears_take_the_masked_strategy():
    """A sublayer with a projection that is not a plain `nn.Linear` (here a subclass standing for a PEFT or a
    quantised layer, whose forward adds 1) is planned by the masked strategy in `route`, the one place of that
    rule, so the gather strategy never reads a `.weight` that is not what the module computes."""

    class Shifted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0

    model = make_model(sparse_implementation="gather")
    attention = model.model.layers[0].self_attn
    hidden = torch.randn(1, 1, model.config.hidden_size, dtype=torch.float64)
    projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
    assert isinstance(attention.sub_dims.route(hidden, projections), MoHDSpansPlan)
    reference = make_model(sparse_implementation="masked")
    shifted = Shifted(model.config.hidden_size, attention.o_proj.out_features, bias=False, dtype=torch.float64)
    for m in (model, reference):
        shifted_copy = Shifted(shifted.in_features, shifted.out_features, bias=False, dtype=torch.float64)
        shifted_copy.weight.data.copy_(m.model.layers[0].self_attn.q_proj.weight)
        m.model.layers[0].self_attn.q_proj = shifted_copy
    attention = model.model.layers[0].self_attn
    projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
    assert isinstance(attention.sub_dims.route(hidden, projections), MoHDMaskedPlan)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids()).logits, reference(input_ids()).logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize("length", [1, 3, 9], ids=["host-ids", "host-ids-batch", "grouped"])
def test_set_sparse_implementation_switches_the_strategy_of_a_loaded_model(tmp_path, length):
    """`set_sparse_implementation` switches every sublayer between the strategies of `MoHDSparseInterface` on a loaded
    model (as `set_experts_implementation` does for experts), with the same logits; a strategy registered there is
    selectable by name (here one that records its plans), and unknown names are refused."""
    make_model(sparse_implementation="masked").save_pretrained(tmp_path)
    model = MoHDForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    strategies = lambda: {type(m.sub_dims.strategy) for m in model.modules() if hasattr(m, "sub_dims")}  # noqa: E731
    assert strategies() == {MoHDMaskedStrategy}
    ids = input_ids(length=length)
    with torch.no_grad():
        masked = model(ids).logits
        model.set_sparse_implementation("gather")
        assert strategies() == {MoHDGatherStrategy}
        gather = model(ids).logits
    assert model.config.sparse_implementation == "masked"  # the saved default is unchanged
    torch.testing.assert_close(gather, masked, atol=1e-10, rtol=0)

    planned = []

    class RecordingStrategy(MoHDMaskedStrategy):
        def plan(self, indices, weights):
            planned.append(indices.shape[0])
            return super().plan(indices, weights)

    MoHDSparseInterface.register("recording", RecordingStrategy)
    try:
        model.set_sparse_implementation("recording")
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, masked, atol=1e-10, rtol=0)
        assert planned == [ids.numel()] * 2 * model.config.num_hidden_layers  # attention and FFN of every layer
    finally:
        del MoHDSparseInterface._global_mapping["recording"]
    with pytest.raises(
        ValueError, match="`sparse_implementation` must be one of .* \\['masked', 'gather', 'sorted'\\]"
    ):
        model.set_sparse_implementation("dense")


def test_a_registered_strategy_is_chosen_by_the_config_and_survives_a_reload(tmp_path):
    """`MoHDSparseInterface.register` adds a strategy that `config.sparse_implementation` selects: every sublayer
    plans with it (counted), the logits are the masked path's, and `save_pretrained` / `from_pretrained` keep the
    choice; a name registered nowhere is refused when the model is built, naming the field and the registered
    names, and a class that is not a `MoHDStrategy` is refused too."""
    calls = []

    class CountingStrategy(MoHDMaskedStrategy):
        def plan(self, indices, weights):
            calls.append(indices.shape[0])
            return super().plan(indices, weights)

    reference = make_model(sparse_implementation="masked")
    ids = input_ids(2, 5, seed=7)
    with torch.no_grad():
        expected = reference(ids).logits
    MoHDSparseInterface.register("counting", CountingStrategy)
    try:
        model = MoHDForCausalLM(MOHD.config(sparse_implementation="counting")).double().eval()
        model.load_state_dict(reference.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, atol=1e-10, rtol=0)
        layers = model.config.num_hidden_layers
        assert calls == [ids.numel()] * 2 * layers  # attention and FFN of every layer, every token at once
        model.save_pretrained(tmp_path)
        reloaded = MoHDForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
        assert reloaded.config.sparse_implementation == "counting"
        assert {type(module.strategy) for module in reloaded.modules() if hasattr(module, "masked")} == {
            CountingStrategy
        }
        calls.clear()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-10, rtol=0)
        assert calls == [ids.numel()] * 2 * layers
        MoHDSparseInterface.register("not_a_strategy", object)
        with pytest.raises(TypeError, match="must be a subclass of MoHDStrategy"):
            MoHDForCausalLM(MOHD.config(sparse_implementation="not_a_strategy"))
    finally:
        MoHDSparseInterface._global_mapping.pop("counting", None)
        MoHDSparseInterface._global_mapping.pop("not_a_strategy", None)
    with pytest.raises(ValueError, match="`sparse_implementation` must be one of .*'masked', 'gather'.*'counting'"):
        MoHDForCausalLM.from_pretrained(tmp_path)


# bf16 keeps 8 significant bits: eps = 2^-8, its relative spacing at 1 (one rounding moves a value by <= eps / 2).
BF16_EPS = 2.0**-8

# Gather plans under autocast: the strategy settings that force each one (thresholds and the small-batch form are
# execution choices, results do not depend on them) and the plan type it must then build.
AUTOCAST_PLANS = {
    "host-union": ({"small_batch_plan": "union"}, MoHDSpansPlan),
    "host-per-block": ({"small_batch_plan": "per_block"}, MoHDSpansPlan),
    "few-tokens": ({"host_tokens": 0, "few_tokens": 8, "cpu_dense_tokens": 0}, MoHDIndexedPlan),
    "grouped": ({"host_tokens": 0, "few_tokens": 0, "cpu_dense_tokens": 0}, MoHDGroupedPlan),
    "sorted": ({"host_tokens": 0, "few_tokens": 0, "cpu_dense_tokens": 0}, MoHDSortedPlan),  # the sorted strategy
}


@pytest.mark.parametrize("layout", ["column_major", "row_major"])
@pytest.mark.parametrize("plan", list(AUTOCAST_PLANS))
def test_gather_plans_under_bf16_autocast_follow_masked(monkeypatch, plan, layout):
    """On a float32 model under CPU bf16 autocast, every gather plan runs a forward (8 tokens, 1 token), `generate`
    and a training step, in bf16 as autocast runs `nn.Linear`, and agrees with the masked path under the same
    autocast: the same greedy tokens, logits, loss and gradients equal up to bf16 rounding.

    Tolerance: 4 bf16 eps of the reference's scale (max |logit|, the loss, the gradients' norm). Both paths round the
    products' operands and results to bf16 (eps = 2^-8), at different places (the gather path per span or group of
    blocks, the masked path once per dense GEMM), so they differ by a few roundings: measured up to 2 eps of max
    |logit| (the masked path itself is 1.4 eps from a float64 run) and 1.6 eps of the gradients' norm; 4 eps leaves
    room for BLAS kernels that round otherwise, while a wrong block, gate or scale moves them by a sizeable fraction
    of their scale. The greedy tokens are compared where the masked path's top-2 logit margin exceeds twice the
    tolerance at every step (checked: 0.06 of max |logit| for this seed), so equal tokens are not luck.
    """
    settings, plan_type = AUTOCAST_PLANS[plan]
    # the FFN with biases, attention without: both forms of each side (o_proj's products written in place)
    gather, masked = pair(seed=9, mlp_bias=True)
    gather, masked = gather.float().eval(), masked.float().eval()
    gather.to_weight_layout(layout)
    if plan_type is MoHDSortedPlan:
        gather.set_sparse_implementation("sorted")
    for strategy in strategies(gather):
        for name, value in settings.items():
            setattr(strategy, name, value)
    plans = []
    build = MoHDGatherStrategy.plan
    monkeypatch.setattr(MoHDGatherStrategy, "plan", lambda self, *args: plans.append(build(self, *args)) or plans[-1])
    prompt = input_ids(2, 4, seed=9)  # 8 tokens, then 2 per decoding step
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    with torch.no_grad(), autocast:
        for x in (prompt, prompt[:1, :1]):
            logits_g, logits_m = gather(input_ids=x).logits, masked(input_ids=x).logits
            assert logits_g.dtype == logits_m.dtype == torch.bfloat16
            atol = 4 * BF16_EPS * logits_m.abs().max().item()
            torch.testing.assert_close(logits_g.float(), logits_m.float(), rtol=0, atol=atol)
        options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True)
        out_g = gather.generate(prompt, return_dict_in_generate=True, **options)
        out_m = masked.generate(prompt, return_dict_in_generate=True, **options)
    steps_g, steps_m = torch.stack(out_g.logits, 1).float(), torch.stack(out_m.logits, 1).float()  # (B, 6, vocab)
    atol = 4 * BF16_EPS * steps_m.abs().max().item()
    top = steps_m.topk(2, dim=-1).values
    assert (top[..., 0] - top[..., 1]).min() > 2 * atol, "the masked path's greedy tokens must be well separated"
    assert torch.equal(out_g.sequences, out_m.sequences)
    torch.testing.assert_close(steps_g, steps_m, rtol=0, atol=atol)

    results = []
    for model in (gather, masked):
        model.train()
        with autocast:
            out = model(input_ids=prompt, labels=prompt, output_router_logits=True, use_cache=False)
        out.loss.backward()
        results.append((out.loss, gradients(model)))
    (loss_g, grads_g), (loss_m, grads_m) = results
    torch.testing.assert_close(loss_g, loss_m, rtol=4 * BF16_EPS, atol=0)
    assert grads_g.keys() == grads_m.keys()
    flat_g, flat_m = (torch.cat([g[name].flatten() for name in sorted(g)]) for g in (grads_g, grads_m))
    assert torch.isfinite(flat_g).all()
    assert (flat_g - flat_m).norm() <= 4 * BF16_EPS * flat_m.norm()

    assert {type(built) for built in plans} == {plan_type}
    if plan_type is MoHDSpansPlan:  # the per-block form where autograd is off, the union form otherwise
        assert any(built.rows is not None for built in plans) == (plan == "host-per-block")


def linear_pair(out_features: int, in_features: int, bias: bool, layout: str, dtype) -> tuple[nn.Linear, nn.Linear]:
    """(linear in `dtype` and `layout`, its float64 row-major copy): random weights and bias."""
    reference = nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        reference.weight.normal_()
        if bias:
            reference.bias.normal_()
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    linear.load_state_dict(reference.state_dict())
    set_linear_layout_(linear, layout)
    return linear, reference


def block_gates(strategy, indices, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, N) input gates (1 shared, the gate on chosen blocks, 0 elsewhere) and 0/1 output mask, by hand."""
    gates = torch.zeros(indices.shape[0], strategy.geometry.num_sub_dims, dtype=weights.dtype)
    gates[:, : strategy.geometry.num_shared] = 1
    mask = gates.clone()
    for token in range(indices.shape[0]):
        for slot in range(indices.shape[1]):
            gates[token, indices[token, slot]] = weights[token, slot]
            mask[token, indices[token, slot]] = 1
    return gates, mask


# (hidden, N, N_s, k, intermediate, dtype): float64 (group loop in the weight gradient), float32 with aligned blocks
# (grouped_mm kernel) and float32 with s = 6 and 30 features (padded operands)
GROUPED_CASES = [(64, 8, 3, 2, 96, torch.float64), (64, 8, 3, 2, 96, torch.float32), (48, 8, 2, 3, 30, torch.float32)]


def test_grouped_parts_are_the_non_empty_groups_on_cpu(monkeypatch):
    """Eager CPU: one part per non-empty group, its rows the group's slice; while compiling: one part of all rows."""
    offsets = torch.tensor([1, 1, 2, 2, 3], dtype=torch.int32)  # groups 1 and 3 are empty
    parts = grouped_parts(offsets)
    assert [(part.rows.start, part.rows.stop, part.group) for part in parts] == [(0, 1, 0), (1, 2, 2), (2, 3, 4)]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    (part,) = grouped_parts(offsets)
    assert part.rows == slice(None) and part.group is None and part.offsets is offsets


def grouped_kernel_parts(offsets: torch.Tensor) -> list[MoHDGroupPart]:
    """`grouped_parts` as on an accelerator: one part of all rows, the grouped kernel."""
    return [MoHDGroupPart(slice(None), None, offsets)]


@pytest.mark.parametrize("path", ["fused-per-group", "fused-grouped-kernel", "autograd-views"])
@pytest.mark.parametrize("layout", ["column_major", "row_major"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("case", GROUPED_CASES, ids=["f64", "f32", "f32-unaligned"])
def test_grouped_projection_gradients_equal_dense(monkeypatch, case, bias, layout, path):
    """The grouped path's projections (`MoHDGroupedLinearIn`, `MoHDGroupedLinearOut`, or autograd on the weight views when
    they do not apply) against the dense float64 formula on the gated input / masked output: outputs and the
    gradients of input, gates, weight (shared and routed blocks) and bias, and `.grad` kept in the weight's layout.
    Both ways of running a slot's groups (`grouped_parts`: a product per group on CPU, one grouped kernel call on an
    accelerator), with the last routed block picked by no token (an empty group, whose weight gradient is 0)."""
    hidden, num_sub_dims, num_shared, top_k, features, dtype = case
    strategy = MoHDGatherStrategy(
        MOHD.config(
            hidden_size=hidden,
            num_sub_dims=num_sub_dims,
            num_shared_sub_dims=num_shared,
            num_routed_sub_dims_per_tok=top_k,
            intermediate_size=features,
        )
    )
    fused = path != "autograd-views"
    if not fused:
        monkeypatch.setattr(mohd_plans, "single_autograd_function_dtype", lambda *args: None)
    if path == "fused-grouped-kernel":
        monkeypatch.setattr(mohd_products, "grouped_parts", grouped_kernel_parts)
    tokens = 3 * strategy.host_tokens  # grouped plan
    generator = torch.Generator().manual_seed(1)
    scores = torch.rand(tokens, strategy.geometry.num_routed, generator=generator)
    scores[:, -1] = -1.0  # never picked
    indices = scores.topk(top_k, dim=1).indices + num_shared
    weights = torch.rand(tokens, top_k, generator=generator, dtype=torch.float64)
    gates, mask = block_gates(strategy, indices, weights)
    tolerance = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    for side, (out_features, in_features) in (("in", (features, hidden)), ("out", (hidden, features))):
        linear, reference = linear_pair(out_features, in_features, bias, layout, dtype)
        x = torch.randn(tokens, in_features, dtype=torch.float64, generator=generator)
        upstream = torch.randn(tokens, out_features, dtype=torch.float64, generator=generator)
        x_ref, gates_ref, x_run = x.clone().requires_grad_(), gates.clone().requires_grad_(), x.to(dtype)
        weights_run = weights.to(dtype).requires_grad_()
        x_run.requires_grad_()
        plan = strategy.plan(indices, weights_run)
        assert isinstance(plan, MoHDGroupedPlan)
        if side == "in":
            out = plan.project_in(x_run, [linear])[0]
            blocks = x_ref.view(tokens, num_sub_dims, -1) * gates_ref[..., None]
            expected = reference(blocks.view(tokens, -1))
        else:
            out = plan.project_out(x_run, linear)
            expected = (reference(x_ref).view(tokens, num_sub_dims, -1) * mask[..., None]).view(tokens, -1)
        assert (type(out.grad_fn).__name__ == f"MoHDGroupedLinear{side.capitalize()}Backward") == fused
        out = out.reshape(tokens, -1)
        torch.testing.assert_close(out.double(), expected, **tolerance)
        (out.double() * upstream).sum().backward()
        (expected * upstream).sum().backward()
        torch.testing.assert_close(x_run.grad.double(), x_ref.grad, **tolerance, msg=f"{side} input")
        torch.testing.assert_close(linear.weight.grad.double(), reference.weight.grad, **tolerance, msg=f"{side} W")
        assert linear.weight.grad.stride() == linear.weight.stride()
        if bias:
            torch.testing.assert_close(linear.bias.grad.double(), reference.bias.grad, **tolerance, msg=f"{side} b")
        if side == "in":  # the gates reach the router through the input side only
            expected_gates = gates_ref.grad.gather(1, indices)
            # each gate's gradient sums s * out products of an order-1 input and upstream gradient (up to about 80
            # here): its rounding error scales with the largest, not with its own value, which can be near 0
            scale = max(1.0, expected_gates.abs().max().item())
            gate_tolerance = dict(rtol=tolerance["rtol"], atol=tolerance["atol"] * scale)
            torch.testing.assert_close(weights_run.grad.double(), expected_gates, **gate_tolerance, msg="gates")


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_compiled_grouped_output_side_mixes_its_compact_blocks(monkeypatch, bias):
    """While compiling, the grouped plan's output side fuses its blocks from the compact ones
    (`project_out_mixed`, `mix_compact_blocks`: the shared blocks plus one outer product per routing slot), equal in
    value and in the gradients of input, fusion matrix, weight and bias to `scale * F @ project_out(...)`; eager it
    leaves the product to the caller (None)."""
    hidden, num_sub_dims, num_shared, top_k, features, _ = GROUPED_CASES[0]
    config = MOHD.config(
        hidden_size=hidden,
        num_sub_dims=num_sub_dims,
        num_shared_sub_dims=num_shared,
        num_routed_sub_dims_per_tok=top_k,
        intermediate_size=features,
    )
    strategy = MoHDGatherStrategy(config)
    tokens = 3 * strategy.host_tokens  # grouped plan
    generator = torch.Generator().manual_seed(2)
    indices = torch.rand(tokens, num_sub_dims - num_shared, generator=generator).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=generator, dtype=torch.float64)
    plan = strategy.plan(indices + num_shared, weights)
    assert isinstance(plan, MoHDGroupedPlan)
    linear, _ = linear_pair(hidden, features, bias, "row_major", torch.float64)
    x = torch.randn(tokens, features, dtype=torch.float64, generator=generator, requires_grad=True)
    fusion = MoHDGroupFusion(config).double()
    with torch.no_grad():
        fusion.weight.copy_(torch.randn(num_sub_dims, num_sub_dims, dtype=torch.float64, generator=generator))
    scale = 1.6  # activation scaling, carried by the matrix
    upstream = torch.randn(tokens, num_sub_dims, hidden // num_sub_dims, dtype=torch.float64, generator=generator)
    assert plan.project_out_mixed(x, linear, fusion, scale) is None  # eager: the caller's MoHDSparseBlockMix
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    parameters = [x, fusion.weight, *linear.parameters()]
    mixed = plan.project_out_mixed(x, linear, fusion, scale)
    got = torch.autograd.grad((mixed * upstream).sum(), parameters)
    expected = torch.matmul(scale * fusion.weight, plan.project_out(x, linear))
    want = torch.autograd.grad((expected * upstream).sum(), parameters)
    torch.testing.assert_close(mixed, expected, rtol=1e-12, atol=1e-12)
    for name, g, w in zip(("input", "fusion", "weight", "bias"), got, want, strict=False):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)


def saved_bytes(run) -> tuple[object, int]:
    """(run(), bytes of the tensors autograd saved for backward while it ran)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return result, total


@pytest.mark.parametrize("layout", ["column_major", "row_major"])
def test_grouped_projections_under_autocast_keep_less_and_match_autocast_linear(monkeypatch, layout):
    """Under CPU bf16 autocast (a bf16 Trainer run) the grouped path's projections still run as one autograd Function
    each, on operands cast as `F.linear` under autocast would cast them: the same bf16 output and gradients as the
    composed form under autocast (within bf16 rounding of a sum; both near the float64 dense formula), while autograd
    keeps fewer bytes for backward."""
    hidden, num_sub_dims, num_shared, top_k, features = 64, 8, 3, 2, 96
    strategy = MoHDGatherStrategy(
        MOHD.config(
            hidden_size=hidden,
            num_sub_dims=num_sub_dims,
            num_shared_sub_dims=num_shared,
            num_routed_sub_dims_per_tok=top_k,
            intermediate_size=features,
        )
    )
    tokens = 6 * strategy.host_tokens
    generator = torch.Generator().manual_seed(3)
    indices = torch.rand(tokens, strategy.geometry.num_routed, generator=generator).topk(top_k, dim=1).indices
    indices = indices + num_shared
    weights = torch.rand(tokens, top_k, generator=generator)
    gates, mask = block_gates(strategy, indices, weights.double())
    for side, (out_features, in_features) in (("in", (features, hidden)), ("out", (hidden, features))):
        linear, reference = linear_pair(out_features, in_features, True, layout, torch.float32)
        x = torch.randn(tokens, in_features, generator=generator)
        upstream = torch.randn(tokens, out_features, generator=generator)
        runs = {}
        for path in ("fused", "composed"):
            if path == "composed":
                monkeypatch.setattr(mohd_plans, "single_autograd_function_dtype", lambda *args: None)
            linear.zero_grad()
            x_run, weights_run = x.clone().requires_grad_(), weights.clone().requires_grad_()
            plan = strategy.plan(indices, weights_run)

            def project(plan=plan, x_run=x_run, side=side, linear=linear):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    if side == "in":
                        return plan.project_in(x_run, [linear])[0]
                    return plan.project_out(x_run, linear)

            out, kept = saved_bytes(project)
            fused = type(out.grad_fn).__name__ == f"MoHDGroupedLinear{side.capitalize()}Backward"
            assert fused == (path == "fused"), (path, type(out.grad_fn).__name__)
            if fused:  # autocast's dtype, as `F.linear` under autocast
                assert out.dtype == torch.bfloat16
            (out.reshape(tokens, -1).float() * upstream).sum().backward()
            grads = [x_run.grad, linear.weight.grad, linear.bias.grad] + ([weights_run.grad] if side == "in" else [])
            runs[path] = (out.reshape(tokens, -1).float(), [g.clone() for g in grads], kept)
        monkeypatch.undo()
        (fused_out, fused_grads, fused_kept), (composed_out, composed_grads, composed_kept) = runs.values()
        assert fused_kept < composed_kept, (side, fused_kept, composed_kept)
        x_ref, gates_ref = x.double().requires_grad_(), gates.clone().requires_grad_()
        if side == "in":
            expected = reference((x_ref.view(tokens, num_sub_dims, -1) * gates_ref[..., None]).view(tokens, -1))
        else:
            expected = (reference(x_ref).view(tokens, num_sub_dims, -1) * mask[..., None]).view(tokens, -1)
        (expected * upstream.double()).sum().backward()
        expected_grads = [x_ref.grad, reference.weight.grad, reference.bias.grad]
        if side == "in":
            expected_grads.append(gates_ref.grad.gather(1, indices))
        for got, other, want in zip(
            [fused_out, *fused_grads], [composed_out, *composed_grads], [expected, *expected_grads], strict=True
        ):
            scale = want.abs().max().item()
            torch.testing.assert_close(got.double(), other.double(), rtol=0, atol=2e-2 * scale)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2 * scale)


def backward_node_names(tensor: torch.Tensor) -> set[str]:
    """The class names of every node of `tensor`'s autograd graph."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_training_step_under_autocast_runs_the_single_function_products(monkeypatch):
    """A bf16-autocast training step of a gather model records `MoHDGroupedLinearIn`/`Out` and `MoHDSparseBlockMix`
    (the products that keep less for backward), and keeps fewer bytes than the same step composed by autograd."""
    model = MoHDForCausalLM(MOHD.config(sparse_implementation="gather")).train()
    ids = input_ids(batch=2, length=24)
    kept = {}
    for path in ("fused", "composed"):
        if path == "composed":
            monkeypatch.setattr(mohd_plans, "single_autograd_function_dtype", lambda *args: None)
            monkeypatch.setattr(MoHDGroupedPlan, "sparse_block_positions", lambda *args: None)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(input_ids=ids, labels=ids, use_cache=False).loss

        loss, kept[path] = saved_bytes(step)
        names = backward_node_names(loss)
        fused_nodes = {"MoHDGroupedLinearInBackward", "MoHDGroupedLinearOutBackward", "MoHDSparseBlockMixBackward"}
        assert (fused_nodes <= names) == (path == "fused"), (path, sorted(names))
        assert torch.isfinite(loss)
    assert kept["fused"] < kept["composed"], kept


def test_sparse_block_mix_equals_matmul():
    """Group fusion on the grouped path's blocks (zero outside the shared and the routed (token, block) pairs) keeps
    only the nonzero blocks for backward; output and gradients equal autograd's `fusion @ blocks` in float64."""
    strategy = MoHDGatherStrategy(MOHD.config())
    tokens, generator = 3 * strategy.host_tokens, torch.Generator().manual_seed(2)
    indices = (
        torch.rand(tokens, strategy.geometry.num_routed, generator=generator).topk(2, dim=1).indices
        + strategy.geometry.num_shared
    )
    plan = strategy.plan(indices, torch.rand(tokens, 2, dtype=torch.float64, generator=generator))
    _, mask = block_gates(strategy, indices, torch.ones(tokens, 2, dtype=torch.float64))
    blocks = torch.randn(
        tokens, strategy.geometry.num_sub_dims, strategy.geometry.block, dtype=torch.float64, generator=generator
    )
    blocks = (blocks * mask[..., None]).requires_grad_()
    fusion = torch.randn(
        strategy.geometry.num_sub_dims, strategy.geometry.num_sub_dims, dtype=torch.float64
    ).requires_grad_()
    positions = plan.token_index * strategy.geometry.num_sub_dims + strategy.geometry.num_shared + plan.block_index
    upstream = torch.randn_like(blocks)
    out = MoHDSparseBlockMix.apply(fusion, blocks, positions, strategy.geometry.num_shared)
    grad_fusion, grad_blocks = torch.autograd.grad((out * upstream).sum(), (fusion, blocks))
    expected = torch.matmul(fusion, blocks)
    expected_fusion, expected_blocks = torch.autograd.grad((expected * upstream).sum(), (fusion, blocks))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_fusion, expected_fusion, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_blocks, expected_blocks, rtol=1e-12, atol=1e-12)


# fp32 / bf16 / fp16 relative tolerance of one product against its float64 value
DTYPE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", list(DTYPE_TOLERANCE), ids=str)
@pytest.mark.parametrize(("contraction", "out_features"), [(36, 64), (64, 36), (9, 64), (64, 64)])
def test_grouped_matmul_equals_per_group_matmul(dtype, contraction, out_features):
    """`grouped_matmul` on views of a wider weight, as the MoHD gather path passes them, equals one matmul per group,
    in value and gradients; aligned operands take the kernel with no padding copy."""
    groups, rows = 3, 10
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(rows, contraction, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(out_features, 8 + groups * contraction, generator=generator).to(dtype).requires_grad_()
    grouped = weight[:, 8:].view(out_features, groups, contraction).permute(1, 2, 0)  # (G, K, O), strided
    offsets = torch.tensor([3, 3, rows], dtype=torch.int32)  # one empty group
    grad_output = torch.randn(rows, out_features, generator=generator).to(dtype)
    result = grouped_matmul(inputs, grouped, offsets)
    (grad_inputs, grad_weight) = torch.autograd.grad(result, (inputs, weight), grad_output)
    bounds = [0, *offsets.tolist()]
    expected = torch.cat(
        [inputs[start:end].double() @ grouped[g].double() for g, (start, end) in enumerate(pairwise(bounds))]
    )
    expected_grads = torch.autograd.grad(expected, (inputs, weight), grad_output.double())
    tolerance = DTYPE_TOLERANCE[dtype]
    torch.testing.assert_close(result.double(), expected, atol=tolerance * 10, rtol=tolerance)
    for got, want in zip((grad_inputs, grad_weight), expected_grads, strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=tolerance * 10, rtol=tolerance)
    alignment = 16 // torch.tensor([], dtype=dtype).element_size()
    if contraction % alignment == 0 and out_features % alignment == 0:
        assert _grouped_mm_aligned(inputs) and _grouped_mm_aligned(grouped)  # the kernel directly, no copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "compiling"])
def test_gathered_grouped_matmul_gradients(monkeypatch, dtype, compiling):
    """`MoHDGatheredGroupedMatmul` equals gathering the rows and one matmul per group, in value and in both gradients
    (the rows gathered twice or never: a token's gradient sums over its repeats), on the eager kernels and on the
    operators a compiled step traces (`grouped_matmul_backward` as while compiling: transformers' fallback backward
    for fp32, the grouped kernel for bf16)."""
    if compiling:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    groups, block, width = 3, 8, 16
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(5, width, generator=generator).to(dtype).requires_grad_()
    linear_weight = torch.randn(groups * block, width, generator=generator).to(dtype).requires_grad_()
    weight = linear_weight.view(groups, block, width).transpose(1, 2)  # (G, in, s), the output side's view
    index = torch.tensor([4, 0, 0, 2, 1, 4, 3])  # token 0 twice, every token at least once
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)  # group 1 empty
    grad = torch.randn(7, block, generator=generator).to(dtype)
    out = MoHDGatheredGroupedMatmul.apply(inputs, index, weight, offsets)
    grad_inputs, grad_weight = torch.autograd.grad(out, (inputs, linear_weight), grad)
    rows, weight64 = inputs.double()[index], linear_weight.double().view(groups, block, width).transpose(1, 2)
    expected = torch.cat([rows[0:2] @ weight64[0], rows[2:7] @ weight64[2]])
    expected_grads = torch.autograd.grad(expected, (inputs, linear_weight), grad.double())
    tolerance = DTYPE_TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance * 10, rtol=tolerance)
    for got, want in zip((grad_inputs, grad_weight), expected_grads, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want.to(torch.float64), atol=tolerance * 10, rtol=tolerance)
    assert grad_weight.view(groups, block, width)[1].abs().sum() == 0  # the empty group's block


@pytest.mark.parametrize("implementation", ["gather", "sorted"])
def test_compiled_training_step_is_one_graph(implementation):
    """dynamo traces a whole MoHD training forward of the grouped plan, its backward included, as one graph: the
    routing counts are a fixed-length `scatter_add_` (not `bincount`, whose output length depends on the data),
    `MoHDRowIndexAdd` returns its dirty input, and `MoHDGatheredGroupedMatmul`'s backward is written out
    (`grouped_matmul_backward`), with no `torch.autograd.grad` inside it."""
    model = make_model(0, torch.float32, sparse_implementation="gather").train()
    ids = input_ids(4, 16)  # 64 tokens: the grouped plan
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids, use_cache=False)
    assert [str(item.reason) for item in explained.break_reasons] == []
    assert explained.graph_count == 1


@pytest.mark.parametrize("implementation", ["gather", "sorted"])
def test_compiled_training_step_matches_eager(implementation):
    """Under `torch.compile` the grouped plan composes its products (the single autograd Functions are eager's) and
    AOTAutograd's partitioner chooses what backward keeps: the compiled training step's loss and gradients equal the
    eager step's on the same strategy. (What it keeps is measured by `bench/bench_saved_memory.py --compile`, not asserted here.)"""
    compiled_model = make_model(0, torch.float32, sparse_implementation=implementation).train()
    eager = make_model(0, torch.float32, sparse_implementation=implementation).train()
    ids = input_ids(4, 16)  # 64 tokens: the grouped plan

    def step(model):
        return model(input_ids=ids, labels=ids, use_cache=False)

    compiled = torch.compile(compiled_model)
    step(compiled).loss.backward()  # compiles the forward and the backward
    compiled_model.zero_grad(set_to_none=True)
    out_compiled = step(compiled)
    out_compiled.loss.backward()
    out_eager = step(eager)
    out_eager.loss.backward()
    torch.testing.assert_close(out_compiled.loss, out_eager.loss, rtol=1e-5, atol=1e-6)
    grads_compiled, grads_eager = gradients(compiled_model), gradients(eager)
    assert grads_compiled.keys() == grads_eager.keys()
    for name in grads_eager:
        torch.testing.assert_close(grads_compiled[name], grads_eager[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any("router" in name for name in grads_eager)  # the routers' gradient flows through the gates compiled too


# The sorted strategy (`MoHDSortedStrategy`): the gather strategy's few-token plans, and for many tokens one sort of
# all (token, block) pairs, one grouped product per side and no atomic accumulation (`MoHDSortedPlan`).


def test_sorted_plan_sorts_the_pairs_once():
    """The pairs of the router's order (p = token * k + slot) sorted by routed block, stably; the inverse permutation,
    the tokens and blocks of the sorted pairs, the group ends and the gates in sorted order, by hand."""
    strategy = MoHDSortedStrategy(MOHD.config())  # N = 8, N_s = 3: routed blocks 0..4, k = 2
    indices = torch.tensor([[3, 7], [5, 4], [7, 3], [4, 6]])
    weights = torch.rand(4, 2)
    with torch.no_grad():
        plan = strategy.many_token_plan(indices, weights)
    # routed ids per pair: [0, 4, 2, 1, 4, 0, 1, 3]
    assert plan.order.tolist() == [0, 5, 3, 6, 2, 7, 1, 4]
    assert plan.inverse.tolist() == [0, 6, 4, 2, 7, 1, 3, 5]
    assert plan.tokens.tolist() == [0, 2, 1, 3, 1, 3, 0, 2]
    assert plan.blocks.tolist() == [0, 0, 1, 1, 2, 3, 4, 4]
    assert plan.offsets.dtype == torch.int32 and plan.offsets.tolist() == [2, 4, 5, 6, 8]
    torch.testing.assert_close(plan.gates[:, 0], weights.flatten()[plan.order])
    # 9 tokens, more than the few-token plans take on an eager CPU run: the sorted plan
    assert isinstance(strategy.plan(indices.repeat(3, 1)[:9], weights.repeat(3, 1)[:9]), MoHDSortedPlan)
    assert isinstance(strategy.plan(indices[:1], weights[:1]), MoHDSpansPlan)  # few tokens: the gather plans


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True, "mlp_bias": True},
        {"num_routed_sub_dims_per_tok": 1},
        {"num_routed_sub_dims_per_tok": 3, "routed_gate": "normalized"},
        {"num_shared_sub_dims": 0, "num_routed_sub_dims_per_tok": 3, "routed_gate": "unit"},
        {"per_layer_config": {0: {"attention_routed_sub_dims_per_tok": 1}, 1: {"ffn_routed_sub_dims_per_tok": 4}}},
        {"sparse_modules": ["ffn"], "group_fusion": "none"},
        {"sparse_sides": "input"},
        {"sparse_sides": "output"},
        {"dropped_block_compensation": True},
    ],
    ids=["default", "biases", "k1", "k3-normalized", "no-shared-unit", "per-layer", "ffn-only", "input-side",
         "output-side", "compensation"],
)  # fmt: skip
def test_sorted_training_step_equals_masked(monkeypatch, overrides):
    """Loss (LM + aux), logits and the gradient of every parameter of a float64 training step on the sorted plan
    equal the masked path's, for uniform and per-layer budgets, one-sided sparsity and compensated blocks; every
    sparse sublayer planned its 22 tokens with the sorted plan."""
    planned = []
    build = MoHDSortedPlan.of_routes
    monkeypatch.setattr(MoHDSortedPlan, "of_routes", lambda *args: planned.append(args[2].shape) or build(*args))
    sorted_model, masked = pair(implementation="sorted", **overrides)
    if overrides.get("dropped_block_compensation"):  # nonzero compensation, so that its terms count
        with torch.no_grad():
            for name, param in sorted_model.named_parameters():
                if "compensation" in name:
                    param.normal_(std=0.1)
        masked.load_state_dict(sorted_model.state_dict())
    assert_same_training_step(sorted_model, masked, input_ids(2, 11))
    routed_sublayers = sum(m.sub_dims.router is not None for m in sorted_model.modules() if hasattr(m, "sub_dims"))
    assert len(planned) == routed_sublayers > 0 and all(shape[0] == 22 for shape in planned)


def test_sorted_plan_reads_fused_input_projections_with_one_product():
    """With the input projections in one block-major storage (`to_weight_layout("column_major")`) and autograd off,
    each sublayer's input side is one grouped product for q/k/v (gate/up) together and its output side one: 4
    grouped products per layer, and logits equal the masked path's in float64 (batched decoding steps too)."""
    with pytest.MonkeyPatch.context() as patch:  # 18 tokens: the sorted plan, not the CPU's batched-decoding one
        patch.setattr(mohd_strategies, "CPU_DENSE_TOKENS", 0)
        sorted_model, masked = pair(implementation="sorted")
    sorted_model.eval().to_weight_layout("column_major"), masked.eval()
    assert sorted_model.has_fused_input_projections()
    calls = []
    original = mohd_plans.grouped_matmul
    ids = input_ids(3, 6)
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(mohd_plans, "grouped_matmul", lambda *args: calls.append(args[1].shape) or original(*args))
        torch.testing.assert_close(sorted_model(ids).logits, masked(ids).logits, rtol=1e-10, atol=1e-10)
        layers = sorted_model.config.num_hidden_layers
        assert len(calls) == 4 * layers
        config = sorted_model.config
        qkv = config.num_attention_heads * config.head_dim + 2 * config.num_key_value_heads * config.head_dim
        assert calls[0] == (5, 8, qkv)  # (N_r, s, q + k + v): the fused storage's routed rows
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        for module in sorted_model.modules():
            if hasattr(module, "sub_dims"):
                module.sub_dims.strategy.host_tokens = module.sub_dims.strategy.few_tokens = 0
        assert torch.equal(sorted_model.generate(ids, **kwargs), masked.generate(ids, **kwargs))


def aten_ops(function) -> list[str]:
    """The ATen overloads `function()` dispatches (forward and any backward it runs), with `accumulate=True` marked
    on the index_put forms."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(func.overloadpacket.__name__)
            if name.startswith(("index_put", "_index_put_impl")) and (
                kwargs.get("accumulate") or args[3:4] == (True,)
            ):
                name += "(accumulate)"
            ops.append(name)
            return func(*args, **kwargs)

    with Recorder():
        function()
    return ops


ATOMIC_OPS = ("index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "embedding_dense_backward")


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_sorted_plan_accumulates_nothing_atomically(bias):
    """Forward and backward of both sides of the sorted plan (inputs, gates, weights and biases requiring gradients)
    dispatch no accumulating scatter (`index_add`, `scatter_add`, `index_put` with accumulate, embedding backward),
    the kernels that are atomic on accelerators; the per-slot grouped plan does (the check can fail), and both give
    the same gradients (the grouped plan's equal the masked path's, above)."""
    torch.manual_seed(0)
    config = MOHD.config()
    g = MoHDSortedStrategy(config).geometry
    indices = torch.stack([torch.randperm(g.num_routed)[: g.top_k] + g.num_shared for _ in range(12)])
    inputs = {"ops": {}, "grads": {}}
    for name, strategy in (("sorted", MoHDSortedStrategy(config)), ("grouped", MoHDGatherStrategy(config))):
        torch.manual_seed(1)
        weights = torch.rand(12, g.top_k, dtype=torch.float64, requires_grad=True)
        hidden = torch.randn(12, g.hidden_size, dtype=torch.float64, requires_grad=True)
        up = nn.Linear(g.hidden_size, 24, bias=bias, dtype=torch.float64)
        down = nn.Linear(24, g.hidden_size, bias=bias, dtype=torch.float64)

        def step(strategy=strategy, weights=weights, hidden=hidden, up=up, down=down):
            plan = strategy.many_token_plan(indices, weights)
            (middle,) = plan.project_in(hidden, [up])
            out = plan.project_out(torch.tanh(middle), down)
            (out.square().sum()).backward()
            return out

        inputs["ops"][name] = aten_ops(step)
        inputs["grads"][name] = [t.grad for t in (hidden, weights, up.weight, down.weight)]
    assert not [op for op in inputs["ops"]["sorted"] if op.startswith(ATOMIC_OPS) or "(accumulate)" in op]
    assert "_grouped_mm" in inputs["ops"]["sorted"] or "grouped_mm_fallback" in " ".join(inputs["ops"]["sorted"])
    assert any(op.startswith("index_add") for op in inputs["ops"]["grouped"])
    for got, want in zip(inputs["grads"]["sorted"], inputs["grads"]["grouped"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_cpu_plans_by_tokens_without_autograd(monkeypatch):
    """An eager CPU forward without autograd takes, past the few-token plans, the masked plan up to
    `cpu_dense_tokens` tokens (batched decoding), the sorted plan up to `cpu_sorted_tokens` (short prefills) and the
    grouped plan beyond; with autograd the grouped plan at every such M. Logits equal the masked strategy's in
    float64 in every regime. Thresholds shrunk to 16 / 40 tokens here to keep the model small."""
    fast, masked = pair()
    fast.eval(), masked.eval()
    for strategy in strategies(fast):
        strategy.cpu_dense_tokens, strategy.cpu_sorted_tokens = 16, 40
    plans = []
    build = MoHDGatherStrategy.plan
    monkeypatch.setattr(MoHDGatherStrategy, "plan", lambda self, *args: plans.append(build(self, *args)) or plans[-1])

    def plan_type(ids, grad=False):
        plans.clear()
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(fast(ids).logits, masked(ids).logits, rtol=1e-10, atol=1e-10)
        assert len({type(plan) for plan in plans}) == 1, plans
        return type(plans[0])

    assert strategies(fast)[0].host_tokens == 8
    assert plan_type(input_ids(2, 4)) is MoHDSpansPlan  # 8 tokens: decoding's spans plan
    assert plan_type(input_ids(2, 8)) is MoHDMaskedPlan  # 16
    assert plan_type(input_ids(2, 9)) is MoHDSortedPlan  # 18
    assert plan_type(input_ids(4, 10)) is MoHDSortedPlan  # 40
    assert plan_type(input_ids(3, 14)) is MoHDGroupedPlan  # 42
    assert plan_type(input_ids(2, 8), grad=True) is MoHDGroupedPlan  # training: the same plans as before
    fast.to(torch.bfloat16), masked.to(torch.bfloat16)  # measured in float32: bf16 keeps the grouped plan
    plans.clear()
    with torch.no_grad():
        fast(input_ids(2, 8))
    assert {type(plan) for plan in plans} == {MoHDGroupedPlan}
    assert mohd_strategies.CPU_DENSE_TOKENS == 32 and mohd_strategies.CPU_SORTED_TOKENS == 256  # the defaults


def test_device_default_plans_apply_to_a_model_built_from_its_config(monkeypatch):
    """A device type listed in `DEVICE_DEFAULT_PLANS` (the CPU, patched in for this test; CUDA in the library) makes
    the gather strategy of a model built from its config take the table's plan of each mode there, with the masked
    path's logits; a strategy chosen by name (`set_sparse_implementation("gather")`) runs its own plans again, and
    the sorted strategy ignores the table."""
    monkeypatch.setitem(mohd_strategies.DEVICE_DEFAULT_PLANS, "cpu", {"few_tokens": "masked", "many_tokens": "sorted"})
    monkeypatch.setattr(mohd_strategies, "CPU_DENSE_TOKENS", 0)  # 22 tokens: the grouped plan when chosen by name
    fast, masked = pair()
    fast.eval(), masked.eval()
    plans = []
    build = MoHDGatherStrategy.plan
    monkeypatch.setattr(MoHDGatherStrategy, "plan", lambda self, *args: plans.append(build(self, *args)) or plans[-1])
    sublayers = 2 * fast.config.num_hidden_layers

    def plan_types(model):
        plans.clear()
        with torch.no_grad():
            for ids in (input_ids(1, 2), input_ids(2, 11)):  # 2 tokens: the few-token mode; 22: many tokens
                torch.testing.assert_close(model(ids).logits, masked(ids).logits, rtol=1e-10, atol=1e-10)
        return [type(plan) for plan in plans]

    assert plan_types(fast) == [MoHDMaskedPlan] * sublayers + [MoHDSortedPlan] * sublayers
    fast.set_sparse_implementation("gather")  # chosen by name: the gather strategy's own plans
    assert plan_types(fast) == [MoHDSpansPlan] * sublayers + [MoHDGroupedPlan] * sublayers
    by_config = make_model(sparse_implementation="sorted").eval()
    by_config.load_state_dict(masked.state_dict())
    assert plan_types(by_config) == [MoHDSpansPlan] * sublayers + [MoHDSortedPlan] * sublayers
