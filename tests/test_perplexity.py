"""Perplexity (`hf_mohd.evaluation.perplexity`) against hand computations: exp of the mean next-token NLL over every
predicted token, the padding of either side left out, the same value in any batching and through the trainer's
distributed form (`evaluate_perplexity`)."""

import math
from types import SimpleNamespace

import pytest
import torch

from hf_mohd.evaluation.perplexity import evaluate_perplexity, next_token_nll, perplexity


# A bigram model: the next-token distribution depends on the current token only, P(next | current) = PROBS[current].
PROBS = [[0.5, 0.25, 0.25], [0.1, 0.2, 0.7], [0.6, 0.3, 0.1]]


class Bigram(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(PROBS).log())
        self.seen = []

    def forward(self, input_ids, use_cache=None, attention_mask=None, routing_replay=None):
        assert use_cache is False
        self.seen.append(routing_replay)
        return SimpleNamespace(logits=self.table[input_ids])


# [0, 1, 2, 0] predicts 1 | 0, 2 | 1, 0 | 2; [2, 2, 1, 1] predicts 2 | 2, 1 | 2, 1 | 1
IDS = torch.tensor([[0, 1, 2, 0], [2, 2, 1, 1]])
HAND = (0.25 * 0.7 * 0.6 * 0.1 * 0.3 * 0.2) ** (-1 / 6)  # exp(-mean log p) = geometric mean of 1 / p


def test_perplexity_is_exp_of_the_mean_token_nll():
    model = Bigram()
    assert perplexity(model, IDS, batch_size=2) == pytest.approx(HAND, rel=1e-6)
    assert perplexity(model, IDS, batch_size=1) == pytest.approx(HAND, rel=1e-6)  # not a mean of per-row values
    total, count = next_token_nll(model, IDS)
    assert count == 6 and total.item() == pytest.approx(-math.log(0.25 * 0.7 * 0.6 * 0.1 * 0.3 * 0.2), rel=1e-6)


def test_padding_on_either_side_is_left_out():
    """A target counts when it and the token before it are real: left padding [pad, pad, 2, 2] predicts 2 | 2 only,
    right padding [2, 1, pad, pad] predicts 1 | 2 only; the pad id (here 1, a real id) never matters."""
    ids = torch.tensor([[0, 1, 2, 0], [1, 1, 2, 2], [2, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0]])
    expected = (0.25 * 0.7 * 0.6 * 0.1 * 0.3) ** (-1 / 5)
    for batch_size in (1, 2, 3):
        assert perplexity(Bigram(), ids, batch_size, attention_mask=mask) == pytest.approx(expected, rel=1e-6)
    assert next_token_nll(Bigram(), ids, mask)[1] == 5
    assert math.isnan(perplexity(Bigram(), ids[:1], attention_mask=torch.tensor([[1, 0, 0, 0]])))


def test_routing_records_are_replayed_one_per_batch():
    model = Bigram()
    perplexity(model, IDS, batch_size=1, routing_records=["first", "second"])
    assert model.seen == ["first", "second"]


def test_evaluate_perplexity_is_the_same_measure_and_restores_training_mode():
    """The trainer's form: (mean NLL, exp of it) over packed blocks; `max_batches` limits the blocks scored."""
    model = Bigram().train()
    mean, value = evaluate_perplexity(model, IDS, batch_size=1)
    assert value == pytest.approx(HAND, rel=1e-6) and mean == pytest.approx(math.log(HAND), rel=1e-6)
    assert model.training
    _, first = evaluate_perplexity(model, IDS, batch_size=1, max_batches=1)
    assert first == pytest.approx((0.25 * 0.7 * 0.6) ** (-1 / 3), rel=1e-6)


def test_a_real_model_matches_its_own_loss():
    """On a causal LM, the NLL equals the model's own mean cross-entropy (`labels=input_ids`) times the count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 50, (3, 9))
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert perplexity(model, ids, batch_size=2) == pytest.approx(math.exp(loss), rel=1e-5)
