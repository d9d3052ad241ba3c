"""The router load-balance loss under every attention-mask form a client passes, and inference that never computes
it: a 2-D padding mask, the equivalent 4-D mask (boolean and additive), packed sequences marked by position ids, no
mask; `generate_batch` (transformers' continuous batching, a 4-D mask over a packed batch) equals `generate` with
`output_router_logits` on and off. Oracles: the loss by hand from the recorded logits, the loss of the same tokens
under another mask form, and `generate`'s greedy tokens."""

import pytest
import torch
from transformers import GenerationConfig

from hf_mohd.models.modeling_common import counted_tokens, load_balancing_loss
from tests.utils import input_ids


def switch_loss_by_hand(logits: torch.Tensor, top_k: int, real: torch.Tensor) -> torch.Tensor:
    """E * sum_j f_j P_j over the rows where `real` (Fedus et al. 2021, eqs. 4-6), top-k by hand (ties to the lower
    index)."""
    probs = torch.softmax(logits.double(), dim=-1)[real]
    picks = torch.zeros(probs.shape[-1], dtype=torch.float64)
    for row in probs:
        for j in sorted(range(len(row)), key=lambda j: (-row[j].item(), j))[:top_k]:
            picks[j] += 1
    return probs.shape[-1] * (picks / (probs.shape[0] * top_k) * probs.mean(0)).sum()


def routed_model(family, **overrides):
    """The family's tiny model with an aux loss: `output_router_logits` on, LatentMoE with softmax routing (sigmoid
    routing balances by its bias, without a loss)."""
    if family.name == "latent_moe":
        overrides.setdefault("router_score_func", "softmax")
    return family.model(output_router_logits=True, **overrides)


def four_d(mask: torch.Tensor, additive: bool) -> torch.Tensor:
    """The (B, 1, T, T) causal mask of a (B, T) padding mask: boolean (True: attend) or additive (0 / dtype min)."""
    length = mask.shape[1]
    allowed = torch.tril(torch.ones(length, length, dtype=torch.bool))[None, None] & mask.bool()[:, None, None, :]
    if not additive:
        return allowed
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def test_counted_tokens_reads_every_mask_form():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = mask.float()
    torch.testing.assert_close(counted_tokens(mask, 2, 5), expected)
    torch.testing.assert_close(counted_tokens(torch.cat([torch.ones(2, 3), mask], 1), 2, 5), expected)  # past
    torch.testing.assert_close(counted_tokens(four_d(mask, additive=False), 2, 5), expected)
    torch.testing.assert_close(counted_tokens(four_d(mask, additive=True), 2, 5), expected)
    assert counted_tokens(None, 2, 5) is None
    with pytest.raises(ValueError, match="expected a 2-D .* or 4-D"):
        counted_tokens(torch.ones(2, 1, 5), 2, 5)
    with pytest.raises(ValueError, match="does not match the forward's 2 x 5 tokens"):
        counted_tokens(torch.ones(2, 1, 4, 4, dtype=torch.bool), 2, 5)


def test_load_balancing_loss_by_hand_under_each_mask_form():
    """The shared Switch loss of one router counts the same tokens whichever form says which are real."""
    logits = torch.randn(10, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    want = switch_loss_by_hand(logits, 2, mask.reshape(-1).bool())
    for form in (mask, four_d(mask, additive=False), four_d(mask, additive=True)):
        torch.testing.assert_close(load_balancing_loss((logits,), 2, form), want, rtol=1e-12, atol=1e-12)
    everything = switch_loss_by_hand(logits, 2, torch.ones(10, dtype=torch.bool))
    torch.testing.assert_close(load_balancing_loss((logits,), 2, None), everything, rtol=1e-12, atol=1e-12)
    assert (everything - want).abs() > 1e-3  # the masks are not vacuous


def test_model_aux_loss_is_the_same_under_2d_4d_and_no_mask(family):
    """The model's aux loss (with labels) under a 4-D mask equals the one under the equivalent 2-D mask; with every
    token real, it equals the one without a mask; and the 2-D value is the family's loss of the recorded logits
    counted on the real tokens only."""
    model = routed_model(family)
    model.eval()
    ids = input_ids(batch=2, length=6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 2] = -100  # its prediction comes from a padding position, whose logits the two masks leave unspecified
    with torch.no_grad():
        two = model(ids, attention_mask=mask, labels=labels)
        bool_four = model(ids, attention_mask=four_d(mask, additive=False), labels=labels)
        add_four = model(ids, attention_mask=four_d(mask, additive=True), labels=labels)
    assert two.aux_loss is not None and two.aux_loss > 0
    torch.testing.assert_close(two.aux_loss, model.load_balancing_loss(two.router_logits, mask))
    for four in (bool_four, add_four):
        torch.testing.assert_close(four.logits[mask.bool()], two.logits[mask.bool()], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(four.aux_loss, two.aux_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(four.loss, two.loss, rtol=1e-5, atol=1e-6)
    full = torch.ones_like(mask)
    with torch.no_grad():
        with_mask = model(ids, attention_mask=four_d(full, additive=True), labels=ids)
        without = model(ids, labels=ids)
    torch.testing.assert_close(with_mask.aux_loss, without.aux_loss, rtol=1e-5, atol=1e-6)
    assert (without.aux_loss - two.aux_loss).abs() > 1e-4  # padding changes which tokens count


def test_aux_loss_only_where_a_loss_is_asked_for(family):
    """Inference (eval, no labels) returns the router logits but no aux loss; training mode or labels compute it."""
    model = routed_model(family)
    ids = input_ids(batch=1, length=5)
    model.eval()
    with torch.no_grad():
        inference = model(ids)
        with_labels = model(ids, labels=ids)
    assert inference.aux_loss is None and len(inference.router_logits) > 0
    torch.testing.assert_close(with_labels.aux_loss, model.load_balancing_loss(inference.router_logits))
    model.train()
    with torch.no_grad():
        training = model(ids)
    torch.testing.assert_close(training.aux_loss, with_labels.aux_loss)


@pytest.mark.parametrize("output_router_logits", [False, True])
def test_generate_batch_equals_generate(family, output_router_logits):
    """Continuous batching (`generate_batch`: prompts packed into one row under a 4-D mask, paged cache) gives the
    greedy tokens of `generate`, request by request, with the config's `output_router_logits` on or off (on, it used
    to fail in the load-balance loss on the 4-D mask)."""
    model = family.model(output_router_logits=output_router_logits).eval()
    prompts = [input_ids(1, length, seed=seed)[0].tolist() for seed, length in ((1, 5), (2, 7), (3, 3))]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = [
        model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
        for prompt in prompts
    ]
    with torch.no_grad():
        results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    by_prompt = {tuple(result.prompt_ids): result.generated_tokens for result in results.values()}
    assert [by_prompt[tuple(prompt)] for prompt in prompts] == want
