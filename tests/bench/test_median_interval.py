"""The confidence interval the server benchmark prints for each goal's median of per-round ratios
(bench/_timing.py's `median_interval`): the sign test's order statistics, checked against exact binomial sums and
by its coverage over draws from a distribution whose median is known."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from . import load_bench_script

timing = load_bench_script("_timing.py")


def _below(count: int, k: int) -> Fraction:
    """P(Binomial(count, 1/2) < k), exactly."""
    return Fraction(sum(math.comb(count, i) for i in range(k)), 2**count)


@pytest.mark.parametrize("count", range(1, 6))
def test_under_six_rounds_have_no_95_percent_interval(count: int) -> None:
    assert timing.median_interval([float(i) for i in range(count)]) is None


@pytest.mark.parametrize("count", range(6, 121))
def test_the_interval_is_the_widest_order_statistic_pair_the_binomial_tail_allows(count: int) -> None:
    values = [float(i) for i in range(count, 0, -1)]  # unsorted on purpose
    low, high = timing.median_interval(values)
    k = int(low)  # the values are 1..count, so x(k) == k
    assert high == count + 1 - k
    assert _below(count, k) <= Fraction(1, 40)
    assert _below(count, k + 1) > Fraction(1, 40)


def test_known_intervals() -> None:
    # Published sign-test intervals for the median at 95 %: n=6 the extremes, n=20 x(6)..x(15), n=80 x(31)..x(50).
    assert timing.median_interval([float(i) for i in range(1, 7)]) == (1.0, 6.0)
    assert timing.median_interval([float(i) for i in range(1, 21)]) == (6.0, 15.0)
    assert timing.median_interval([float(i) for i in range(1, 81)]) == (31.0, 50.0)
    assert timing.median_interval([float(i) for i in range(1, 21)], confidence=0.99) == (4.0, 17.0)


def test_coverage_over_draws_with_a_known_median() -> None:
    # Exponential draws have median ln 2; at n=20 the interval's exact coverage is 95.9 % (one order statistic
    # narrower: 88.5 %, one wider: 98.8 %), so 4000 seeded trials tell an off-by-one either way.
    draws = random.Random(17)
    trials = 4000
    covered = 0
    for _ in range(trials):
        interval = timing.median_interval([draws.expovariate(1.0) for _ in range(20)])
        assert interval is not None
        covered += interval[0] <= math.log(2) <= interval[1]
    assert 0.945 < covered / trials < 0.972
