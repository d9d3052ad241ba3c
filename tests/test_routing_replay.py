"""Routing records in the serving engines' layout (vLLM / SGLang [tokens, MoE layers, top_k] per request) and
routing replay from that layout, both families. Oracles: an unpadded batch-1 forward of each sequence (its own
routing), the model's own forward on the training batch (logits), and the replayed forward's own routing record."""

import numpy as np
import pytest
import torch

import hf_mohd  # noqa: F401  (registers the Auto classes)
from hf_mohd import RoutingCache, RoutingRecord
from hf_mohd.routing_replay import routed_experts_from_record, router_layout, routing_replay_from_engine
from tests.models import test_modeling_latent_moe as latent_tests
from tests.models import test_modeling_mohd as mohd_tests


NEW_TOKENS = 5
PROMPT_LENGTHS = (4, 7)


def latent_moe_model():
    # Nemotron-style: a dense first layer (no router there), sigmoid routing, one top_k for all MoE layers.
    return latent_tests.make_model(per_layer_config={0: {"mixer_type": "mlp"}}, router_score_func="sigmoid")


def mohd_model():
    return mohd_tests.make_model()


FAMILIES = {"latent_moe": (latent_moe_model, ("moe",)), "mohd": (mohd_model, ("attn", "mlp"))}


def prompts(vocab):
    """Two prompts of different lengths, left padded (as for batched generation)."""
    generator = torch.Generator().manual_seed(0)
    longest = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, length in enumerate(PROMPT_LENGTHS):
        ids[b, longest - length :] = torch.randint(3, vocab, (length,), generator=generator)
        mask[b, longest - length :] = 1
    return ids, mask


def generate_and_export(model):
    """generate -> the engines' arrays per router kind, and the unpadded full sequences."""
    ids, mask = prompts(model.config.vocab_size)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    assert isinstance(out.cache, RoutingCache)
    full_mask = torch.cat([mask, torch.ones(len(PROMPT_LENGTHS), NEW_TOKENS, dtype=mask.dtype)], dim=1)
    kinds = {kind for _, kind in out.cache.routing_record}
    exported = {kind: routed_experts_from_record(out.cache.routing_record, full_mask, router=kind) for kind in kinds}
    sequences = [row[m.bool()] for row, m in zip(out.sequences, full_mask, strict=True)]
    return exported, sequences


def right_padded(sequences):
    length = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, sequence in enumerate(sequences):
        ids[b, : len(sequence)] = sequence
        mask[b, : len(sequence)] = 1
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_export_replay_same_routes_equal_logits_router_gradient(family):
    make, kinds = FAMILIES[family]
    model = make()
    exported, sequences = generate_and_export(model)
    layout = router_layout(model)
    assert sorted(exported) == sorted(kinds) == sorted(layout)

    # The engines' layout: P + G - 1 rows per sequence (the last sampled token was never forwarded), MoE layers only.
    for kind in kinds:
        for b, array in enumerate(exported[kind]):
            assert array.dtype == np.int32
            assert array.shape == (PROMPT_LENGTHS[b] + NEW_TOKENS - 1, len(layout[kind]), layout[kind][0].top_k)
    if family == "latent_moe":
        assert [slot.layer_idx for slot in layout["moe"]] == [1, 2]  # the dense layer 0 has no row
    # Same routes as the model's own unpadded forward of each sequence alone (padding removed, rows in token order).
    for b, sequence in enumerate(sequences):
        cache = RoutingCache(config=model.config)
        with torch.no_grad():
            model(sequence[None], cache=cache, use_cache=True)
        for kind in kinds:
            np.testing.assert_array_equal(
                exported[kind][b], routed_experts_from_record(cache.routing_record, router=kind)[0][:-1]
            )

    # Training batch with the other padding side; replay from the arrays exactly as an engine returns them.
    ids, mask = right_padded(sequences)
    arrays = exported if family == "mohd" else exported["moe"]
    replay = routing_replay_from_engine(model, arrays, mask)
    with torch.no_grad():
        own_logits = model(ids, attention_mask=mask).logits
        replayed_logits = model(ids, attention_mask=mask, routing_replay=replay).logits
    for b, sequence in enumerate(sequences):
        forwarded = len(sequence) - 1  # the last position carries a dummy route
        torch.testing.assert_close(replayed_logits[b, :forwarded], own_logits[b, :forwarded], atol=1e-10, rtol=0)

    # The policy moves (router weights change): replay keeps the rollout's routes, the gates carry gradient.
    routers = [m for m in model.modules() if type(m).__name__.endswith("Router")]
    with torch.no_grad():
        for router in routers:
            router.weight.mul_(-1)
    model.train()
    cache = RoutingCache(config=model.config)
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), routing_replay=replay, cache=cache)
    out.loss.backward()
    moved = RoutingCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=moved, use_cache=True)
    for kind in kinds:
        replayed = routed_experts_from_record(cache.routing_record, mask, router=kind)
        changed = routed_experts_from_record(moved.routing_record, mask, router=kind)
        for b in range(len(sequences)):
            np.testing.assert_array_equal(replayed[b][:-1], exported[kind][b])  # last row: the dummy route
        assert any(not np.array_equal(c[:-1], e) for c, e in zip(changed, exported[kind], strict=True))
    for router in routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0, (router.layer_idx, router)


def test_padding_positions_get_valid_dummy_routes():
    model = latent_moe_model()
    slots = router_layout(model)["moe"]
    arrays = [np.array([[[5, 1], [0, 7]]] * 2, dtype=np.int16), np.array([[[3, 2], [6, 4]]], dtype=np.int16)]
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])  # one left-padded, one right-padded row
    replay = routing_replay_from_engine(model, arrays, mask)
    first, second = replay[(slots[0].layer_idx, "moe")].indices, replay[(slots[1].layer_idx, "moe")].indices
    assert first.dtype == torch.long and first.shape == (2, 3, 2)
    assert first.tolist() == [[[0, 1], [5, 1], [5, 1]], [[3, 2], [0, 1], [0, 1]]]
    assert second.tolist() == [[[0, 1], [0, 7], [0, 7]], [[6, 4], [0, 1], [0, 1]]]
    # The mask's last real token may lack its row (never forwarded): it gets the dummy route too.
    replay = routing_replay_from_engine(model, [arrays[0][:1], arrays[1]], mask)
    assert replay[(slots[0].layer_idx, "moe")].indices[0].tolist() == [[0, 1], [5, 1], [0, 1]]
    # Forward on the padded batch runs with these routes (no index error at padding positions).
    ids = torch.tensor([[0, 5, 6], [7, 0, 0]])
    assert torch.isfinite(model(ids, attention_mask=mask, routing_replay=replay).logits).all()


def one_layer_latent_moe():
    return latent_tests.make_model(num_hidden_layers=1, per_layer_config={})


@pytest.mark.parametrize("family", ["latent_moe", "mohd"])
def test_replayed_ids_out_of_range_ignored_in_padding_rows_refused_in_real_rows(family):
    """A record in batch layout may mark padding rows with -1 (engines, RL frameworks) or any other id out of range:
    the forward ignores them (logits, loss and aux loss of the real tokens equal those of a record with a valid dummy
    route there). An out-of-range id in a real row raises a ValueError naming the record key, the row and the range."""
    model, kinds, low, high = (
        (one_layer_latent_moe(), ("moe",), 0, 8) if family == "latent_moe" else (mohd_model(), ("attn", "mlp"), 3, 8)
    )
    layers = range(model.config.num_hidden_layers)
    ids = torch.cat([torch.zeros(1, 4, dtype=torch.long), latent_tests.input_ids(batch=1, length=5)], dim=1)
    mask = (ids != 0).long()  # left padding: the first 4 positions
    real = torch.tensor([[low + 1, low + 2], [low + 3, low], [high - 1, low + 2], [low, high - 1], [low + 4, low + 1]])

    def record(padding_rows: torch.Tensor, real_rows: torch.Tensor = real) -> dict:
        indices = torch.cat([padding_rows, real_rows])[None]  # (1, 9, 2)
        return {(layer, kind): RoutingRecord(indices, None) for layer in layers for kind in kinds}

    dummy = torch.tensor([[low, low + 1]] * 4)
    marked = torch.tensor([[-1, -1], [-1, -1], [high, -1], [low, 10**6]])  # -1, past the range, partly valid
    outputs = []
    for replay in (record(dummy), record(marked)):
        cache = RoutingCache(config=model.config)
        out = model(
            ids,
            attention_mask=mask,
            labels=ids.masked_fill(mask == 0, -100),
            output_router_logits=True,
            routing_replay=replay,
            cache=cache,
            use_cache=True,
        )
        for key in replay:
            assert torch.equal(cache.routing_record[key].indices[0, 4:], real), key  # real rows use the record
        outputs.append(out)
    torch.testing.assert_close(outputs[1].logits[:, 4:], outputs[0].logits[:, 4:], atol=0, rtol=0)
    torch.testing.assert_close(outputs[1].loss, outputs[0].loss, atol=0, rtol=0)
    torch.testing.assert_close(outputs[1].aux_loss, outputs[0].aux_loss, atol=0, rtol=0)
    # By hand: every router replays `real`, so f = the share of each choice in it; P = mean softmax of real tokens.
    fraction = torch.bincount((real - low).view(-1), minlength=high - low).double() / real.numel()
    by_router = [
        (high - low) * (fraction * torch.softmax(logits[4:], -1).mean(0)).sum() for logits in outputs[1].router_logits
    ]
    torch.testing.assert_close(outputs[1].aux_loss, torch.stack(by_router).mean(), atol=1e-12, rtol=0)

    # The same ids in a real row: refused, naming the record, the row and the valid range.
    layer, kind = max(layers), kinds[-1]
    for bad in (-1, high):
        wrong = record(dummy)
        indices = wrong[(layer, kind)].indices.clone()
        indices[0, 6, 1] = bad
        wrong[(layer, kind)] = RoutingRecord(indices, None)
        message = (
            rf"Routing record \({layer}, '{kind}'\): id {bad} at row \(batch 0, position 6\) is out of range; "
            rf"valid ids are {low} \.\. {high - 1}"
        )
        with pytest.raises(ValueError, match=message):
            model(ids, attention_mask=mask, routing_replay=wrong)
    # Without an attention mask every row is real: the -1 rows are refused too.
    with pytest.raises(ValueError, match=r"id -1 at row \(batch 0, position 0\)"):
        model(ids, routing_replay=record(marked))


def test_replayed_record_of_another_shape_is_refused():
    model = one_layer_latent_moe()
    indices = torch.tensor([[[1, 2]] * 5])
    with pytest.raises(ValueError, match=r"Routing record \(0, 'moe'\): indices of shape \(1, 5, 2\), expected "):
        model(latent_tests.input_ids(batch=1, length=6), routing_replay={(0, "moe"): RoutingRecord(indices, None)})


def test_mohd_dummy_routes_are_routed_block_ids():
    model = mohd_model()
    num_shared, top_k = model.config.num_shared_sub_dims, model.config.num_routed_sub_dims_per_tok
    layers = len(router_layout(model)["mlp"])
    row = np.full((1, layers, top_k), num_shared) + np.arange(top_k)[::-1]
    replay = routing_replay_from_engine(model, {"attn": [row], "mlp": [row]}, torch.tensor([[0, 1]]))
    assert replay[(0, "attn")].indices.tolist() == [[list(range(num_shared, num_shared + top_k)), row[0, 0].tolist()]]


def aligned_latent_moe_input():
    model = latent_moe_model()
    array = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 0], [3, 2]]], dtype=np.int64)  # 3 tokens, 2 layers
    return model, array, torch.ones(1, 3, dtype=torch.long)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a[:, :1], r"Layer count mismatch .* 1 layers, the model has 2 'moe' routers \(layers \[1, 2\]\)"),
        (lambda a: a[:, :, :1], r"top_k mismatch .* 1 ids per token, the routers pick 2"),
        (lambda a: a[:1], r"Token count mismatch .* 1 rows for 3 real tokens"),
        (lambda a: np.concatenate([a, a]), r"Token count mismatch .* 6 rows for 3 real tokens"),
        (
            lambda a: np.where(np.arange(2) == 1, 8, a),
            r"Index out of range .* id 8 at row 0, layer 1; valid ids are 0 \.\. 7",
        ),
        (lambda a: np.where(a == 6, -1, a), r"Index out of range .* id -1 at row 1, layer 2; .*vLLM"),
        (lambda a: np.where(a == 5, 4, a), r"Repeated id .* row 1, layer 1: \[4, 4\]"),
        (lambda a: a.astype(np.float32), r"must be integers"),
        (lambda a: a[0], r"must be \[tokens, layers, top_k\]"),
    ],
)
def test_misaligned_engine_arrays_raise_naming_the_mismatch(change, message):
    model, array, mask = aligned_latent_moe_input()
    routing_replay_from_engine(model, [array], mask)  # aligned input is accepted
    with pytest.raises(ValueError, match=message):
        routing_replay_from_engine(model, [change(array)], mask)


def test_wrong_batch_and_router_kinds_raise():
    model, array, mask = aligned_latent_moe_input()
    with pytest.raises(ValueError, match=r"2 sequences of routed experts \(router 'moe'\) for a batch of 1 rows"):
        routing_replay_from_engine(model, [array, array], mask)
    with pytest.raises(ValueError, match=r"`router`='mlp' is not in"):
        routing_replay_from_engine(model, {"mlp": [array]}, mask)
    mohd = mohd_model()
    with pytest.raises(ValueError, match=r"router kinds \['attn', 'mlp'\]: pass routed experts as a mapping"):
        routing_replay_from_engine(mohd, [array], mask)
    with pytest.raises(ValueError, match=r"No routed experts for router kind\(s\) \['mlp'\]"):
        routing_replay_from_engine(mohd, {"attn": [array]}, mask)
    heterogeneous = latent_tests.make_model(router_score_func="sigmoid")  # layer 2 picks 3 experts, layer 1 two
    with pytest.raises(ValueError, match=r"different top_k \[2, 3\]"):
        routing_replay_from_engine(heterogeneous, [array], mask)


def test_export_checks_the_mask_and_the_router_kind():
    model = mohd_model()
    cache = RoutingCache(config=model.config)
    model(torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"pass `router=`"):
        routed_experts_from_record(cache.routing_record)
    with pytest.raises(ValueError, match=r"expected \(1, 3\) \(cached positions\) or \(1, 4\) \(sequences\)"):
        routed_experts_from_record(cache.routing_record, torch.ones(1, 5), router="mlp")
    # Mask of the cached positions: every real position has a row; of the sequences: the last real one has none.
    assert routed_experts_from_record(cache.routing_record, torch.tensor([[0, 1, 1]]), router="mlp")[0].shape[0] == 2
    assert (
        routed_experts_from_record(cache.routing_record, torch.tensor([[0, 1, 1, 1]]), router="mlp")[0].shape[0] == 2
    )
