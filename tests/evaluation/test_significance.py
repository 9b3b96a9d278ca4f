"""fgrpo.evaluation.significance: the paired m-out-of-n subsampling test, against exact enumeration and simulated
nulls, and the permutation test over seeds."""

import itertools
from math import comb

import numpy as np
import pytest

import fgrpo.evaluation.significance as significance_module
from count_files import binomial_counts
from fgrpo.evaluation.pass_at_k import pass_at_k
from fgrpo.evaluation.significance import (AVERAGE, hypergeometric_cdf, paired_test, pass_at_k_table,
                                           permutation_test, rescale_factor, subsample_pass_at_k)
from fgrpo.infra.errors import CompareError


# ---------------------------------------------------------------- helpers


def brute_force_pass_at_k(samples, k):
    """Fraction of the k-subsets of explicit 0/1 samples that hold a correct one."""
    subsets = list(itertools.combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


def subset_values(samples, m, ks):
    """``[C(n, m), K]``: brute-force pass@k of every m-subset of one problem's samples."""
    return np.array([[brute_force_pass_at_k(subset, k) for k in ks] for subset in itertools.combinations(samples, m)])


def mean_over_problems(per_problem):
    """Every combination of one subset per problem, each equally likely: ``[prod C, K]`` means over problems."""
    total = np.zeros((1, per_problem[0].shape[1]))
    for values in per_problem:
        total = (total[:, None, :] + values[None, :, :]).reshape(-1, values.shape[1])
    return total / len(per_problem)


# ---------------------------------------------------------------- building blocks


@pytest.mark.parametrize("n", [1, 2, 5, 16, 1024])
def test_pass_at_k_table_equals_metrics(n):
    ks = sorted({1, 2, max(1, n // 4), n} - {0})
    ks = [k for k in ks if k <= n]
    table = pass_at_k_table(n, ks)
    assert table.shape == (n + 1, len(ks))
    for c in sorted({0, 1, n // 3, n // 2, n - 1, n} & set(range(n + 1))):
        for j, k in enumerate(ks):
            assert table[c, j] == pytest.approx(pass_at_k(n, c, k), abs=1e-12)


def test_hypergeometric_cdf_equals_enumeration():
    n, m = 12, 5
    cdf = hypergeometric_cdf(np.arange(n + 1), n, m)
    exact = np.array([[sum(comb(c, x) * comb(n - c, m - x) for x in range(v + 1)) / comb(n, m) for v in range(m + 1)]
                      for c in range(n + 1)])
    np.testing.assert_allclose(cdf, exact, atol=1e-12)
    # exactly 1 from the largest possible count on, so inverse-CDF draws stay in the support
    assert all(cdf[c, min(c, m):].min() == 1.0 for c in range(n + 1))


def test_subsample_distribution_equals_enumeration():
    """Each iteration's mean over problems is distributed as over every m-subset of explicit 0/1 samples."""
    n, m, ks = 5, 2, [1, 2]
    problems = [(1, 1, 0, 0, 0), (1, 0, 0, 0, 0), (1, 1, 1, 1, 0)]
    exact = mean_over_problems([subset_values(s, m, ks) for s in problems])
    draws = subsample_pass_at_k(np.array([sum(s) for s in problems]), n, m, ks, 40_000, np.random.default_rng(5))
    assert draws.shape == (40_000, 2)
    for j in range(len(ks)):
        values, counts = np.unique(np.round(exact[:, j], 12), return_counts=True)
        expected = counts / counts.sum()
        seen = np.array([(np.abs(draws[:, j] - v) < 1e-9).mean() for v in values])
        assert seen.sum() == pytest.approx(1.0)  # nothing outside the exact support
        assert np.abs(seen - expected).max() < 5 * np.sqrt(expected * (1 - expected) / 40_000).max()


@pytest.mark.parametrize("m", [3, 40])  # the histogram path (m + 1 <= P K) and the direct look-up
def test_mean_over_problems_both_paths(m):
    rng = np.random.default_rng(m)
    subset_correct = rng.integers(0, m + 1, size=(6, 25))
    table = rng.random((m + 1, 2))
    expected = table[subset_correct].mean(axis=0)  # [25, 2]
    np.testing.assert_allclose(significance_module._mean_over_problems(subset_correct, table), expected, atol=1e-12)


def test_rescale_factor_matches_pass_at_1_variance():
    """E[Var(m-subset mean | data)] * factor^2 = Var(full-n mean) = p(1-p)/n, by enumerating binomial data."""
    n, m, p = 10, 3, 0.3
    expected_subset_var = 0.0
    for c in range(n + 1):
        probability = comb(n, c) * p**c * (1 - p) ** (n - c)
        x = np.arange(m + 1)
        pmf = np.diff(hypergeometric_cdf(np.array([c]), n, m)[0], prepend=0.0)
        expected_subset_var += probability * (pmf @ (x / m) ** 2 - (pmf @ (x / m)) ** 2)
    assert expected_subset_var * rescale_factor(n, m) ** 2 == pytest.approx(p * (1 - p) / n, rel=1e-12)


# ---------------------------------------------------------------- the test against exact enumeration


def test_p_value_and_interval_match_exact_enumeration():
    """Every combination of m-subsets (n=5, m=2, 3 problems per model: 10^6 equally likely pairs) gives the exact
    distribution of the rescaled difference; the Monte Carlo p-value and interval must agree within MC error."""
    n, m, ks, alpha, iterations = 5, 2, [1, 2], 0.2, 20_000
    a = [(1, 1, 1, 0, 0), (1, 0, 0, 0, 0), (1, 1, 1, 1, 0)]
    b = [(1, 0, 0, 0, 0), (1, 1, 0, 0, 0), (0, 0, 0, 0, 0)]
    full_a = np.mean([[brute_force_pass_at_k(s, k) for k in ks] for s in a], axis=0)
    full_b = np.mean([[brute_force_pass_at_k(s, k) for k in ks] for s in b], axis=0)
    sub_a = mean_over_problems([subset_values(s, m, ks) for s in a])  # [1000, K]
    sub_b = mean_over_problems([subset_values(s, m, ks) for s in b])
    scale = np.sqrt(m / (n - m))
    observed = full_a - full_b
    results = paired_test({"x": np.array([sum(s) for s in a])}, {"x": np.array([sum(s) for s in b])}, n, m=m, ks=ks,
                          iterations=iterations, alpha=alpha, seed=11)
    for j, result in enumerate(r for r in results if r.dataset == "x"):
        exact = (observed[j] + scale * ((sub_a[:, None, j] - full_a[j]) - (sub_b[None, :, j] - full_b[j]))).ravel()
        assert result.difference == pytest.approx(observed[j], abs=1e-12)
        assert (result.pass_a, result.pass_b) == (pytest.approx(full_a[j]), pytest.approx(full_b[j]))
        exact_p = min(1.0, 2 * min((exact <= 0).mean(), (exact >= 0).mean()))
        tolerance = 4 * 2 * np.sqrt(exact_p / 2 * (1 - exact_p / 2) / iterations) + 4 / (iterations + 1)
        assert 0.01 < exact_p < 0.9  # a case where the tails matter
        assert result.p_value == pytest.approx(exact_p, abs=tolerance)
        # the interval ends are the alpha/2 and 1 - alpha/2 quantiles of the exact distribution, within MC error
        band = 4 * np.sqrt(alpha / 2 * (1 - alpha / 2) / iterations)
        for end, level in ((result.ci_low, alpha / 2), (result.ci_high, 1 - alpha / 2)):
            assert (exact < end - 1e-12).mean() <= level + band
            assert (exact <= end + 1e-12).mean() >= level - band


# ---------------------------------------------------------------- calibration and power


def null_rejection_rates(repeats, *, n=16, problems=50, iterations=500, alpha=0.05):
    """Fraction of repeats where A and B, binomial from the same per-problem rates, are called different."""
    rng = np.random.default_rng(2024)
    rejections = 0
    for repeat in range(repeats):
        rates = rng.random(problems)
        results = paired_test({"x": rng.binomial(n, rates)}, {"x": rng.binomial(n, rates)}, n,
                              iterations=iterations, alpha=alpha, seed=repeat)
        rejections = rejections + np.array([r.significant for r in results if r.dataset == "x"], dtype=int)
    return rejections / repeats


def test_false_positive_rate_is_near_alpha():
    """n=16, m=4, 50 problems, 1000 null repeats. Measured: pass@1 0.059, pass@2 0.049, pass@4 0.017. With other
    factors at pass@1: none (unrescaled) 0.000; sqrt(m (n-1) / (n (n-m))) 0.062; sqrt(m / n) 0.089 (fails)."""
    rates = null_rejection_rates(1000)
    assert 0.035 <= rates[0] <= 0.075  # pass@1: binomial noise at 1000 repeats is +-0.007
    assert 0.02 <= rates[1] <= 0.075  # pass@2 = pass@(m/2): a little conservative
    assert rates[2] <= 0.075  # pass@4 = pass@m: conservative here (docs/evaluation.md)


def test_unrescaled_subsampling_would_fail_the_calibration_check(monkeypatch):
    """The band above tells a wrong calibration apart: without the rescaling the test almost never rejects."""
    monkeypatch.setattr(significance_module, "rescale_factor", lambda n, m: 1.0)
    assert null_rejection_rates(200)[0] < 0.01


def test_planted_difference_is_detected():
    a, b = binomial_counts(seed=3, shift=0.15)
    results = paired_test(a, b, 16, iterations=5000, seed=0)
    average = {r.k: r for r in results if r.dataset == AVERAGE}
    assert average[1].significant and average[1].p_value < 0.001 and average[1].ci_low > 0.05
    # power over repeats at a smaller shift (measured: 64 of these 100)
    rng = np.random.default_rng(7)
    detected = 0
    for repeat in range(100):
        rates = rng.random(50)
        result = paired_test({"x": rng.binomial(16, np.clip(rates + 0.05, 0, 1))}, {"x": rng.binomial(16, rates)},
                             16, ks=[1], iterations=500, seed=repeat)[0]
        detected += result.significant and result.difference > 0
    assert detected >= 45


# ---------------------------------------------------------------- rows, datasets, seeds


def test_rows_per_dataset_and_average():
    a, b = binomial_counts(seed=1)
    results = paired_test(a, b, 16, iterations=2000, seed=4)
    assert [(r.dataset, r.k) for r in results] == [(d, k) for d in ("arithmetic", "logic", AVERAGE) for k in (1, 2, 4)]
    assert all(r.m == 4 for r in results)
    by = {(r.dataset, r.k): r for r in results}
    for k in (1, 2, 4):
        assert by[(AVERAGE, k)].difference == pytest.approx((by[("arithmetic", k)].difference
                                                             + by[("logic", k)].difference) / 2)
        assert by[("logic", k)].pass_a == pytest.approx(np.mean([pass_at_k(16, int(c), k) for c in a["logic"]]))
        # averaging two independent datasets narrows the interval
        assert by[(AVERAGE, k)].ci_high - by[(AVERAGE, k)].ci_low < max(
            by[(d, k)].ci_high - by[(d, k)].ci_low for d in ("arithmetic", "logic"))
    assert [r.k_close_to_m for r in results[:3]] == [False, False, True]


def test_identical_counts_give_p_1_and_degenerate_counts_do_not_crash():
    a, _ = binomial_counts(seed=2)
    results = paired_test(a, a, 16, iterations=1000)
    assert all(r.difference == 0 and not r.significant for r in results)
    # all correct versus none correct: no spread at all, every draw on one side
    ones, zeros = {"x": np.full(5, 16)}, {"x": np.zeros(5, dtype=int)}
    result = paired_test(ones, zeros, 16, ks=[1], iterations=999)[0]
    assert result.difference == 1.0 and result.ci_low == result.ci_high == 1.0
    assert result.p_value == pytest.approx(2 / 1000) and result.significant  # never exactly 0: the +1 correction
    assert paired_test(zeros, zeros, 16, ks=[1], iterations=10)[0].p_value == 1.0


def test_seed_reproducibility():
    a, b = binomial_counts(seed=5)
    first = paired_test(a, b, 16, iterations=3000, seed=123)
    assert paired_test(a, b, 16, iterations=3000, seed=123) == first
    other = paired_test(a, b, 16, iterations=3000, seed=124)
    assert [r.difference for r in other] == [r.difference for r in first]  # full-n estimates: no randomness
    assert [r.ci_low for r in other] != [r.ci_low for r in first]


def test_different_n_for_a_and_b():
    """The array-level test takes n_a != n_b (pooled seeds in the report); m <= the smaller n."""
    results = paired_test({"x": np.array([8, 16, 4])}, {"x": np.array([3, 4, 2])}, 32, 8, ks=[1], iterations=500)
    assert results[0].m == 2
    assert results[0].difference == pytest.approx(np.mean([8, 16, 4]) / 32 - np.mean([3, 4, 2]) / 8)


@pytest.mark.parametrize("kwargs, message", [
    ({"m": 17}, "m=17 must be smaller than n=16"),
    ({"m": 16}, "m=16 must be smaller than n=16"),
    ({"m": 0}, "m must be >= 1"),
    ({"ks": [1, 8]}, "ks: k=8 is larger than m=4"),
    ({"ks": [0]}, "ks must be >= 1"),
    ({"iterations": 0}, "iterations must be >= 1"),
    ({"iterations": -5}, "iterations must be >= 1"),
    ({"alpha": 1.5}, "alpha must be in"),
])
def test_bad_arguments_name_the_argument(kwargs, message):
    a, b = binomial_counts(seed=0)
    with pytest.raises(ValueError, match=message):
        paired_test(a, b, 16, **kwargs)


def test_counts_outside_0_to_n():
    with pytest.raises(ValueError, match=r"correct_b\['x'\] holds counts outside 0..16"):
        paired_test({"x": np.array([1, 2])}, {"x": np.array([1, 17])}, 16)


def test_default_m_needs_n_of_at_least_4():
    with pytest.raises(ValueError, match="m: the default m = n // 4 is 0 for n=3"):
        paired_test({"x": np.array([1])}, {"x": np.array([2])}, 3)


# ---------------------------------------------------------------- the seed-level permutation test


def brute_force_permutation_p(a, b) -> float:
    """Every ordering of the pooled values (not just the splits), the first len(a) taken as group a."""
    pooled, size_a = list(a) + list(b), len(a)
    observed = abs(np.mean(a) - np.mean(b))
    hits = [abs(np.mean(order[:size_a]) - np.mean(order[size_a:])) >= observed - 1e-12
            for order in itertools.permutations(pooled)]
    return float(np.mean(hits))


def test_permutation_test_known_values_and_brute_force():
    assert permutation_test([1, 2, 3], [4, 5, 6]) == pytest.approx(2 / 20)  # only the observed split and its mirror
    assert permutation_test([0.4, 0.6], [0.1, 0.3]) == pytest.approx(2 / 6)
    assert permutation_test([0.5, 0.5], [0.5, 0.5]) == 1.0
    assert permutation_test([0.7, 0.7], [0.9, 0.7]) == 1.0  # every split differs by the same 0.1
    rng = np.random.default_rng(0)
    for size_a, size_b in [(2, 3), (3, 3), (1, 4), (3, 2)]:
        a, b = rng.random(size_a), rng.random(size_b) + 0.2
        assert permutation_test(a, b) == pytest.approx(brute_force_permutation_p(a, b))
        assert permutation_test(a, b) == pytest.approx(permutation_test(b, a))  # two-sided


def test_permutation_test_random_splits_approach_the_exact_p_and_are_seeded():
    rng = np.random.default_rng(1)
    a, b = rng.random(5), rng.random(5) + 0.3  # 252 splits
    exact = permutation_test(a, b)
    drawn = permutation_test(a, b, splits=20_000, seed=3)  # fewer splits allowed than exist: drawn at random
    assert abs(drawn - exact) < 0.01
    assert permutation_test(a, b, splits=200, seed=3) == permutation_test(a, b, splits=200, seed=3)
    assert permutation_test(a, b, splits=200, seed=3) != permutation_test(a, b, splits=200, seed=4)
    far_apart = permutation_test(np.arange(12), np.arange(12) + 100, splits=999)  # C(24, 12) splits: drawn
    assert far_apart == pytest.approx(1 / 1000)  # no drawn split as extreme; the +1 keeps it above 0


@pytest.mark.parametrize("a, b", [([], [1.0]), ([[1.0, 2.0]], [1.0])])
def test_permutation_test_bad_input(a, b):
    with pytest.raises(CompareError, match="two non-empty 1-d value lists"):
        permutation_test(a, b)
