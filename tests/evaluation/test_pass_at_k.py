import itertools
from fractions import Fraction
from math import comb

import numpy as np
import pytest

from fgrpo.evaluation.pass_at_k import default_ks, pass_at_k, pass_at_k_curve


def brute_force_pass_at_k(n, c, k):
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_equals_enumeration_over_all_k_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_large_n_is_finite_and_exact():
    n, k = 1024, 256
    for c in (0, 1, 3, 10, 100, 500, 768, 769, 1024):
        exact = 1 - Fraction(comb(n - c, k), comb(n, k))
        value = pass_at_k(n, c, k)
        assert np.isfinite(value)
        assert abs(value - float(exact)) < 1e-12


def test_exactly_one_when_fewer_wrong_than_k():
    assert pass_at_k(10, 8, 3) == 1.0
    assert pass_at_k(4, 4, 1) == 1.0


@pytest.mark.parametrize(
    "args, message",
    [((4, 1, 5), "k=5 is larger"), ((4, 5, 1), "c=5"), ((4, 1, 0), "k must be >= 1"), ((4, -1, 1), "c must be >= 0"),
     ((4.0, 1, 1), "n must be an integer")],
)
def test_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(*args)


def test_default_ks():
    assert default_ks(8) == [1, 2, 4, 8]
    assert default_ks(6) == [1, 2, 4, 6]
    assert default_ks(1) == [1]


def test_curve_mean_and_bootstrap_interval():
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 17, size=50)
    curve = pass_at_k_curve(counts, 16, n_bootstrap=2000, seed=3)
    assert [p.k for p in curve] == [1, 2, 4, 8, 16]
    for point in curve:
        expected = np.mean([pass_at_k(16, int(c), point.k) for c in counts])
        assert point.mean == pytest.approx(expected)
        assert point.ci_low <= point.mean <= point.ci_high
        assert point.ci_high - point.ci_low > 0
    assert curve[0].mean == pytest.approx(counts.mean() / 16)
    means = [p.mean for p in curve]
    assert means == sorted(means)  # pass@k grows with k
    # seeded: the same interval twice, another seed a different one
    assert pass_at_k_curve(counts, 16, seed=3, n_bootstrap=2000) == curve
    assert pass_at_k_curve(counts, 16, seed=4, n_bootstrap=2000)[0].ci_low != curve[0].ci_low


def test_bootstrap_interval_covers_true_mean_most_of_the_time():
    # problems with true success rates p; the CI of pass@1 should cover mean(p) ~95% of the time
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, size=40)
    covered = 0
    for trial in range(100):
        counts = rng.binomial(8, p)
        point = pass_at_k_curve(counts, 8, ks=[1], n_bootstrap=500, seed=trial)[0]
        covered += point.ci_low <= p.mean() <= point.ci_high
    assert covered >= 85
