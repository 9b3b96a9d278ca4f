"""Lemma 3.1 of F-GRPO (arXiv 2602.06717, v2): the probability that a group's update is active yet misses a
rare correct subset, in closed form and by Monte Carlo.

A prompt's completions are correct with probability ``mu``; a subset E of the correct ones has mass ``tau``
(0 < tau <= mu). With N samples, the update is *active* when the group has both correct and wrong samples, and it
*misses* E when no sample lands in E. The probability of both is

    (1 - tau)^N - (mu - tau)^N - (1 - mu)^N                      (Lemma 3.1)

It rises then falls in N: small groups are mostly inactive, large ones cover E. numpy only; the figure and table
are in :mod:`fgrpo.evaluation.theory_figures`, the command line in :mod:`fgrpo.theory`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "PAPER_EXAMPLES",
    "miss_probability",
    "simulate_miss_probability",
    "miss_probability_peak",
    "LemmaPoint",
    "lemma_points",
    "log_spaced_group_sizes",
]


PAPER_EXAMPLES: tuple[tuple[float, float], ...] = ((0.5, 0.05), (0.3, 0.015), (0.2, 0.002))
"""(mu, tau) of the paper's three Lemma 3.1 examples; their peaks: N=5 (0.724), N~9 (0.83), N~21 (0.95)."""


def _check(n, mu: float, tau: float) -> np.ndarray:
    n_arr = np.asarray(n)
    if not np.issubdtype(n_arr.dtype, np.integer) or (n_arr < 1).any():
        raise ValueError(f"n must be a positive integer (or array of them), got {n!r}")
    if not 0.0 < mu <= 1.0:
        raise ValueError(f"mu must be in (0, 1], got {mu}")
    if not 0.0 < tau <= mu:
        raise ValueError(f"tau must be in (0, mu={mu}], got {tau}")
    return n_arr


def miss_probability(n, mu: float, tau: float):
    """Lemma 3.1: ``(1 - tau)^N - (mu - tau)^N - (1 - mu)^N``; ``n`` may be an int or an int array."""
    n_arr = _check(n, mu, tau).astype(np.float64)
    value = (1.0 - tau) ** n_arr - (mu - tau) ** n_arr - (1.0 - mu) ** n_arr
    value = np.maximum(value, 0.0)  # N = 1 is exactly 0; rounding can leave -1e-17
    return float(value) if np.ndim(value) == 0 else value


def simulate_miss_probability(n: int, mu: float, tau: float, trials: int, seed: int = 0) -> float:
    """Monte Carlo estimate of the Lemma 3.1 event: the group is active and E got no sample.

    Each trial draws N completions from three outcomes: in E (mass tau), correct outside E
    (mu - tau), wrong (1 - mu). Vectorised over trials. Its standard error is
    ``sqrt(p (1 - p) / trials)``.
    """
    _check(n, mu, tau)
    if int(trials) < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(int(n), [tau, mu - tau, max(0.0, 1.0 - mu)], size=int(trials))
    in_rare, correct_other, wrong = counts[:, 0], counts[:, 1], counts[:, 2]
    correct = in_rare + correct_other
    active = (correct > 0) & (wrong > 0)
    return float(np.mean(active & (in_rare == 0)))


def miss_probability_peak(mu: float, tau: float, n_max: int = 10_000) -> tuple[int, float]:
    """The integer N in ``1 .. n_max`` where Lemma 3.1's probability is largest, and that probability."""
    group_sizes = np.arange(1, int(n_max) + 1)
    curve = miss_probability(group_sizes, mu, tau)
    best = int(np.argmax(curve))
    return int(group_sizes[best]), float(curve[best])


@dataclass(frozen=True)
class LemmaPoint:
    """One Monte Carlo point of the Lemma 3.1 figure next to the closed form."""

    mu: float
    tau: float
    n: int
    exact: float
    estimate: float
    stderr: float  # of the estimate, sqrt(p (1 - p) / trials) with p the closed form


def lemma_points(
    examples: Sequence[tuple[float, float]], group_sizes: Sequence[int], trials: int, seed: int = 0
) -> list[LemmaPoint]:
    """Monte Carlo estimates of Lemma 3.1 at ``group_sizes`` for each (mu, tau), with the closed form.

    Each (example, N) gets its own seed, derived from ``seed``, so adding a point changes no other.
    """
    points = []
    for example_index, (mu, tau) in enumerate(examples):
        for n in group_sizes:
            point_seed = np.random.SeedSequence([seed, example_index, int(n)]).generate_state(1)[0]
            exact = miss_probability(int(n), mu, tau)
            estimate = simulate_miss_probability(int(n), mu, tau, trials=trials, seed=int(point_seed))
            stderr = math.sqrt(max(exact * (1.0 - exact), 0.0) / trials)
            points.append(LemmaPoint(mu, tau, int(n), exact, estimate, stderr))
    return points


def log_spaced_group_sizes(n_max: int, count: int = 16) -> list[int]:
    """About ``count`` distinct integers from 1 to ``n_max``, evenly spaced on a log axis."""
    return sorted({int(round(x)) for x in np.geomspace(1, n_max, count)})
