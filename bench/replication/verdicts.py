"""Statistics of the replication verdicts: pooled noise, intervals, equivalence tests and the Holm correction.

Every arm of the study is trained with several seeds; a seed changes the initialisation and the order of the training
blocks, never the data. The noise of one run's final held-out loss is estimated once for the whole study, pooled
across arms (each arm contributes its seed-to-seed variance with n_i - 1 degrees of freedom):

    s_p^2 = sum_i sum_j (x_ij - mean_i)^2 / sum_i (n_i - 1)

A difference of two arm means then has standard error s_p sqrt(1/n_a + 1/n_b) and a Student t distribution with
sum_i (n_i - 1) degrees of freedom (the two-sample t test with pooled variance, extended to the pooled estimate of
all arms; Welch, Student). Equivalence ("keeps quality") is Schuirmann's two one-sided tests (TOST, 1987) against a
margin stated before the runs. Holm's step-down procedure (Holm 1979, "A simple sequentially rejective multiple test
procedure") controls the family-wise error over every p-value of the study.
"""

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from scipy import stats


def pooled_sd(groups: Mapping[str, Sequence[float]]) -> tuple[float, int]:
    """Pooled standard deviation of the values of several groups, and its degrees of freedom.

    Args:
        groups: group name -> values (one per seed). Groups with a single value add nothing.

    Returns:
        (s_p, df) with df = sum_i (n_i - 1).

    Raises:
        ValueError: no group has two values (no noise estimate is possible).
    """
    squares, df = 0.0, 0
    for values in groups.values():
        if len(values) > 1:
            mean = statistics.fmean(values)
            squares += sum((value - mean) ** 2 for value in values)
            df += len(values) - 1
    if df == 0:
        raise ValueError("pooled_sd: every group has fewer than two values; no noise estimate is possible.")
    return math.sqrt(squares / df), df


@dataclass(frozen=True)
class Difference:
    """mean(a) - mean(b) with its standard error, 95% interval, t statistic and two-sided p-value (pooled noise).

    `tost_p` is the p-value of equivalence within `margin` (None when no margin was given): the larger of the two
    one-sided p-values for H0: diff <= -margin and H0: diff >= margin.
    """

    a: str
    b: str
    diff: float
    se: float
    df: int
    ci95: tuple[float, float]
    t: float
    p: float
    margin: float | None = None
    tost_p: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def difference(
    a: str, b: str, groups: Mapping[str, Sequence[float]], sd: float, df: int, margin: float | None = None
) -> Difference:
    """The difference of the means of groups `a` and `b` under the pooled noise (`pooled_sd`).

    Raises:
        ValueError: a group is missing or empty, or `sd` is not positive.
    """
    for name in (a, b):
        if not groups.get(name):
            raise ValueError(f"difference: group {name!r} has no values.")
    if not sd > 0:
        raise ValueError(f"difference: the pooled standard deviation must be > 0, got {sd}.")
    xa, xb = groups[a], groups[b]
    diff = statistics.fmean(xa) - statistics.fmean(xb)
    se = sd * math.sqrt(1 / len(xa) + 1 / len(xb))
    half = stats.t.ppf(0.975, df) * se
    t = diff / se
    p = float(2 * stats.t.sf(abs(t), df))
    tost_p = None
    if margin is not None:
        if not margin > 0:
            raise ValueError(f"difference: the equivalence margin must be > 0, got {margin}.")
        lower = stats.t.sf((diff + margin) / se, df)  # H0: diff <= -margin
        upper = stats.t.cdf((diff - margin) / se, df)  # H0: diff >= +margin
        tost_p = float(max(lower, upper))
    return Difference(a, b, diff, se, df, (diff - half, diff + half), t, p, margin, tost_p)


def holm(pvalues: Mapping[str, float]) -> dict[str, float]:
    """Holm-adjusted p-values: sort ascending, p_(i) * (m - i + 1) for rank i = 1..m, made monotone, capped at 1.

    Rejecting every hypothesis whose adjusted p-value is below alpha controls the family-wise error rate at alpha.
    """
    order = sorted(pvalues, key=pvalues.get)
    m, running, adjusted = len(order), 0.0, {}
    for rank, name in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[name]))
        adjusted[name] = running
    return adjusted


def arm_interval(values: Sequence[float], sd: float, df: int) -> tuple[float, float]:
    """95% interval of one arm's mean under the pooled noise: mean +- t_0.975(df) s_p / sqrt(n)."""
    mean = statistics.fmean(values)
    half = stats.t.ppf(0.975, df) * sd / math.sqrt(len(values))
    return mean - half, mean + half
