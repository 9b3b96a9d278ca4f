"""Lemma 3.1 (fgrpo.algorithm.lemma): the closed form against Monte Carlo, the paper's peaks, bad input."""

import math

import numpy as np
import pytest

from fgrpo.algorithm.lemma import (
    PAPER_EXAMPLES,
    lemma_points,
    log_spaced_group_sizes,
    miss_probability,
    miss_probability_peak,
    simulate_miss_probability,
)


@pytest.mark.parametrize(
    "n, mu, tau", [(2, 0.5, 0.05), (5, 0.5, 0.05), (9, 0.3, 0.015), (21, 0.2, 0.002), (64, 0.7, 0.1), (8, 1.0, 0.3)]
)
def test_monte_carlo_agrees_with_lemma_3_1(n, mu, tau):
    trials = 200_000
    exact = miss_probability(n, mu, tau)
    estimate = simulate_miss_probability(n, mu, tau, trials=trials, seed=n)
    standard_error = math.sqrt(max(exact * (1 - exact), 1e-12) / trials)
    assert abs(estimate - exact) <= 3 * standard_error + 1e-9


def test_paper_examples_peak_positions():
    ns = np.arange(1, 200)
    curve = miss_probability(ns, 0.5, 0.05)
    assert ns[np.argmax(curve)] == 5
    assert curve.max() == pytest.approx(0.724, abs=1e-3)
    assert ns[np.argmax(miss_probability(ns, 0.3, 0.015))] in (8, 9, 10)
    assert miss_probability(ns, 0.3, 0.015).max() == pytest.approx(0.83, abs=0.01)
    assert ns[np.argmax(miss_probability(ns, 0.2, 0.002))] in (20, 21, 22)
    assert miss_probability_peak(0.5, 0.05, 1000) == (5, pytest.approx(0.724, abs=1e-3))


def test_bad_input():
    with pytest.raises(ValueError, match="tau"):
        miss_probability(4, 0.3, 0.5)
    with pytest.raises(ValueError, match="n must be"):
        miss_probability(0, 0.3, 0.1)
    with pytest.raises(ValueError, match="trials"):
        simulate_miss_probability(4, 0.3, 0.1, trials=0)


def test_lemma_figure_points_agree_with_the_closed_form():
    """The figure's Monte Carlo points (all three paper examples, N = 1 .. 1000) lie within 4 standard errors."""
    points = lemma_points(PAPER_EXAMPLES, log_spaced_group_sizes(1000), trials=20_000, seed=0)
    assert len(points) >= 3 * 12
    for p in points:
        assert abs(p.estimate - p.exact) <= 4 * p.stderr + 1e-9, p
