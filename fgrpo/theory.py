"""Lemma 3.1 of F-GRPO: how likely an active group update misses a rare correct region.

A prompt's completions are correct with probability ``mu``; a subset E of the correct ones has mass
``tau`` (0 < tau <= mu). With N samples, the update is *active* when the group has both correct and
wrong samples, and it *misses* E when no sample lands in E. The probability of both is

    (1 - tau)^N - (mu - tau)^N - (1 - mu)^N                      (Lemma 3.1)

It rises then falls in N: small groups are mostly inactive, large ones cover E.
"""

from __future__ import annotations

import numpy as np

__all__ = ["miss_probability", "simulate_miss_probability"]


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
