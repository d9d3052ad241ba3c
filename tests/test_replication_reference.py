"""The count-based reference lines of the replication runs (bench/replication/reference.py) against hand-computed
values and the normalisation every probability model must have."""

import math

import numpy as np
import pytest

from bench.replication import reference


TRAIN = np.array([[0, 1, 0, 1, 2]])  # pairs (0,1) (1,0) (0,1) (1,2); token 3 never seen


def test_kneser_ney_bigram_equals_the_hand_computed_probabilities():
    """V = 4, d = 0.5: N1+(. w) = 1 for w = 0, 1, 2 and 0 for w = 3 over 3 bigram types, so P_cont = 0.5 / 3 + 0.125
    (w < 3) and 0.125 (w = 3); P(1 | 0) = (2 - 0.5) / 2 + 0.5 * 1 / 2 * P_cont(1); P(2 | 1) = (1 - 0.5) / 2 +
    0.5 * 2 / 2 * P_cont(2); an unseen context backs off to P_cont."""
    log_prob, discount = reference.kneser_ney_bigram(TRAIN, 4, discount=0.5)
    p_cont = 0.5 / 3 + 0.125
    expected = {(0, 1): 0.75 + 0.25 * p_cont, (1, 2): 0.25 + 0.5 * p_cont, (3, 3): 0.125, (3, 0): p_cont}
    for (v, w), p in expected.items():
        assert math.exp(log_prob(np.array([v]), np.array([w]))[0]) == pytest.approx(p, rel=1e-12), (v, w)
    assert discount == 0.5


@pytest.mark.parametrize("discount", [None, 0.1, 0.75])
def test_kneser_ney_bigram_is_normalised_in_every_context(discount):
    rng = np.random.default_rng(0)
    vocab = 11
    train = rng.integers(0, vocab - 2, size=(6, 17))  # two ids never seen: unseen contexts and words
    log_prob, d = reference.kneser_ney_bigram(train, vocab, discount)
    assert 0 < d < 1
    words = np.arange(vocab)
    for v in range(vocab):
        total = np.exp(log_prob(np.full(vocab, v), words)).sum()
        assert total == pytest.approx(1.0, abs=1e-12), v


def test_unigram_and_bigram_held_out_losses():
    """Unigram add-one: counts 2, 2, 1, 0 of 5 tokens over V = 4, so the held-out block 0 1 2 3 (predicted: 1, 2, 3)
    costs -(ln 3/9 + ln 2/9 + ln 1/9) / 3; the bigram loss is the mean of -log P(next | previous) of its pairs."""
    held_out = np.array([[0, 1, 2, 3]])
    expected = -(math.log(3 / 9) + math.log(2 / 9) + math.log(1 / 9)) / 3
    assert reference.unigram_loss(TRAIN, held_out, 4) == pytest.approx(expected, rel=1e-12)
    log_prob, _ = reference.kneser_ney_bigram(TRAIN, 4, discount=0.5)
    pairs = -np.mean([log_prob(np.array([v]), np.array([w]))[0] for v, w in ((0, 1), (1, 2), (2, 3))])
    assert reference.bigram_loss(TRAIN, held_out, 4, discount=0.5) == pytest.approx(pairs, rel=1e-12)
    with pytest.raises(ValueError, match="token ids must be in \\[0, 3\\)"):
        reference.unigram_loss(TRAIN, held_out, 3)
