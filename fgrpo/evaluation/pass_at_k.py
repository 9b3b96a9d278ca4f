"""Unbiased pass@k (Chen et al. 2021) and pass@k curves over a set of problems.

pass@k of one problem with n samples of which c are correct is ``1 - C(n-c, k) / C(n, k)``: the
probability that k samples drawn without replacement from the n include a correct one. Never the
"any of the first k samples" estimate (high variance) nor a bootstrap with replacement (biased low).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["pass_at_k", "default_ks", "PassAtK", "pass_at_k_curve"]


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate for one problem: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``, which stays finite and accurate where the
    binomials overflow (n = 1024, k = 256). Exactly 1.0 when ``n - c < k`` (every k-subset holds a
    correct sample).

    Raises:
        ValueError: k <= 0, k > n, c < 0 or c > n.
    """
    n = _check_int("n", n, 1)
    c = _check_int("c", c, 0)
    k = _check_int("k", k, 1)
    if k > n:
        raise ValueError(f"k={k} is larger than the number of samples n={n}; pass@k needs k <= n")
    if c > n:
        raise ValueError(f"c={c} correct samples is more than the n={n} samples drawn")
    if n - c < k:
        return 1.0
    terms = 1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(terms))


def default_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n, with n itself appended when it is not a power of two."""
    n = _check_int("n", n, 1)
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    if ks[-1] != n:
        ks.append(n)
    return ks


@dataclass(frozen=True)
class PassAtK:
    """Mean pass@k over problems with a bootstrap confidence interval (over problems)."""

    k: int
    mean: float
    ci_low: float
    ci_high: float


def pass_at_k_curve(
    correct_counts: Sequence[int],
    n: int | Sequence[int],
    ks: Sequence[int] | None = None,
    *,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> list[PassAtK]:
    """Mean unbiased pass@k over problems, for each k, with a percentile bootstrap interval.

    Args:
        correct_counts: ``[M]`` correct samples per problem.
        n: samples per problem, one int for all or ``[M]``.
        ks: the k values; default :func:`default_ks` of the smallest n.
        n_bootstrap: resamples of the problem set (with replacement) for the interval; 0 gives a
            degenerate interval at the mean.
        confidence: coverage of the interval, in (0, 1).
        seed: seeds the bootstrap, so the interval is reproducible.
    """
    counts = np.asarray(correct_counts)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"correct_counts must be a non-empty 1-D sequence, got shape {counts.shape}")
    ns = np.broadcast_to(np.asarray(n), counts.shape)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_bootstrap < 0:
        raise ValueError(f"n_bootstrap must be >= 0, got {n_bootstrap}")
    if ks is None:
        ks = default_ks(int(ns.min()))
    rng = np.random.default_rng(seed)
    resamples = rng.integers(0, counts.size, size=(n_bootstrap, counts.size)) if n_bootstrap else None
    curve = []
    for k in ks:
        per_problem = np.array([pass_at_k(int(n_i), int(c_i), int(k)) for n_i, c_i in zip(ns, counts)])
        mean = float(per_problem.mean())
        if resamples is None:
            low = high = mean
        else:
            boot_means = per_problem[resamples].mean(axis=1)
            alpha = (1.0 - confidence) / 2.0
            low, high = (float(q) for q in np.quantile(boot_means, [alpha, 1.0 - alpha]))
        curve.append(PassAtK(k=int(k), mean=mean, ci_low=low, ci_high=high))
    return curve
