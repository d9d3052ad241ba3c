"""The statistics of the replication verdicts (bench/replication/verdicts.py) against scipy's tests and hand-computed
values."""

import math
import statistics

import pytest
from scipy import stats

from bench.replication import verdicts


A = [4.31, 4.35, 4.29]
B = [4.40, 4.38, 4.45]


def test_two_groups_reproduce_scipys_pooled_t_test():
    """With only the two compared groups, the pooled noise is the classic two-sample t test with equal variances."""
    sd, df = verdicts.pooled_sd({"a": A, "b": B})
    result = verdicts.difference("a", "b", {"a": A, "b": B}, sd, df)
    expected = stats.ttest_ind(A, B, equal_var=True)
    assert df == 4
    assert result.t == pytest.approx(expected.statistic, rel=1e-12)
    assert result.p == pytest.approx(expected.pvalue, rel=1e-10)
    low, high = expected.confidence_interval(0.95)
    assert result.ci95 == pytest.approx((low, high), rel=1e-10)


def test_pooled_sd_over_arms_is_the_hand_computed_value():
    """Squares about each mean: A 0.0008+..., B ...; a one-value group adds no degrees of freedom."""
    groups = {"a": A, "b": B, "single": [9.0]}
    squares = sum((x - statistics.fmean(g)) ** 2 for g in (A, B) for x in g)
    sd, df = verdicts.pooled_sd(groups)
    assert df == 4
    assert sd == pytest.approx(math.sqrt(squares / 4), rel=1e-12)
    with pytest.raises(ValueError, match="fewer than two values"):
        verdicts.pooled_sd({"single": [1.0]})


def test_tost_is_the_larger_one_sided_p_value():
    """Equivalence within 0.2: both one-sided tests of the shifted difference, as scipy's one-sided t tests give them."""
    sd, df = verdicts.pooled_sd({"a": A, "b": B})
    result = verdicts.difference("a", "b", {"a": A, "b": B}, sd, df, margin=0.2)
    shifted_up = stats.ttest_ind([x + 0.2 for x in A], B, equal_var=True, alternative="greater").pvalue
    shifted_down = stats.ttest_ind([x - 0.2 for x in A], B, equal_var=True, alternative="less").pvalue
    assert result.tost_p == pytest.approx(max(shifted_up, shifted_down), rel=1e-10)
    # A margin smaller than the observed difference (-0.093) cannot be shown: p above 0.5.
    assert verdicts.difference("a", "b", {"a": A, "b": B}, sd, df, margin=0.05).tost_p > 0.5


def test_holm_matches_the_hand_computed_step_down():
    """p = (0.01, 0.04, 0.03, 0.5), m = 4: sorted 0.01*4 = 0.04, 0.03*3 = 0.09, 0.04*2 = 0.08 -> 0.09 (monotone),
    0.5*1 = 0.5."""
    adjusted = verdicts.holm({"w": 0.01, "x": 0.04, "y": 0.03, "z": 0.5})
    assert adjusted == pytest.approx({"w": 0.04, "y": 0.09, "x": 0.09, "z": 0.5})
    assert verdicts.holm({"only": 0.7, "cap": 0.6}) == pytest.approx({"cap": 1.0, "only": 1.0})
