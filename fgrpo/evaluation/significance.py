"""Significance tests between evaluations: the paper's paired m-out-of-n subsampling test of pass@k(A) - pass@k(B)
on the same problems (:func:`paired_test`, on counts; :func:`compare`, on two evaluations' ``eval_counts.jsonl``), and
the permutation test over runs (:func:`permutation_test`, each seed's final value one observation). The command
line tool ``python -m fgrpo.compare`` runs the paired test between two evaluations; ``python -m fgrpo.report`` runs
both between the cells of a sweep.

Protocol (paper, "Evaluation protocol": m = 256 of n = 1024 samples, 50,000 iterations, two-sided, alpha = 0.05):
each iteration draws, for every problem, m of its n samples without replacement for A and independently for B,
computes the unbiased pass@k (:mod:`fgrpo.evaluation.pass_at_k`) of each subset, averages over the problems and takes A - B.
Only how many of the m are correct matters, which is hypergeometric(c, n - c, m), so no per-sample arrays are needed.

Calibration. A size-m subsample estimate spreads around the full-n estimate more than the full-n estimate spreads
around the truth, so counting how often the raw subsampled difference crosses 0 is far too conservative. As in
m-out-of-n subsampling (Politis & Romano 1994; Bickel, Goetze & van Zwet 1997), the deviations
``theta*_m - theta_hat_n`` are rescaled to the full-n spread before they are used. For pass@1 the conditional
variance of an m-subset mean (without replacement) is ``S^2 (1/m - 1/n)`` with S^2 the sample variance, whose
expectation over the data is ``p(1-p) (1/m - 1/n)``, while the full-n estimate's variance is ``p(1-p) / n``;
the ratio gives the factor :func:`rescale_factor` = ``sqrt(m / (n - m))``. (The plug-in variant
``sqrt(m (n-1) / (n (n-m)))`` matches ``S^2 (n-1)/n / n`` instead, biased low by (n-1)/n, which makes the test
slightly liberal at small n; the two agree to 0.05 % at n = 1024.) For k > 1 the same factor holds to first order
(pass@k is a U-statistic of order k). For k > m / 2 it does not: pass@k of an m-subset is then close to an
"any correct" indicator; in simulation the test was conservative there, except where nearly every problem is
solved by both models, where tiny differences came out significant. Tables mark those rows with † (measured
rejection rates: docs/evaluation.md).

The interval is the observed difference plus the alpha/2 and 1 - alpha/2 quantiles of the rescaled deviations;
the p-value is two-sided, ``2 min(P(d* <= 0), P(d* >= 0))`` over the rescaled draws d* centred at the observed
difference, each tail counted with a +1 (``(count + 1) / (iterations + 1)``) so that a finite number of iterations
never reports p = 0; clipped to 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from scipy import stats

from fgrpo.evaluation.eval_counts import EvalCounts, aligned_counts, load_counts
from fgrpo.evaluation.pass_at_k import default_ks
from fgrpo.infra.errors import CompareError

__all__ = [
    "AVERAGE", "DEFAULT_ALPHA", "DEFAULT_ITERATIONS", "PERMUTATION_SPLITS", "Comparison", "pass_at_k_table",
    "hypergeometric_cdf", "subsample_pass_at_k", "rescale_factor", "summarize_draws", "paired_test", "compare",
    "permutation_test", "p_value_text",
]

AVERAGE = "(average)"  # the dataset name of the rows averaged over datasets
DEFAULT_ITERATIONS = 50_000
DEFAULT_ALPHA = 0.05
_CHUNK_DRAWS = 1 << 21  # draws held at once (iterations x problems): bounds memory for large evaluations
PERMUTATION_SPLITS = 100_000  # splits the seed-level test enumerates at most (else draws this many at random)


@dataclass(frozen=True)
class Comparison:
    """One row of the comparison: pass@k of A and B (full-n unbiased estimates) and the test of A - B."""

    dataset: str  # an evaluation set, or AVERAGE
    k: int
    m: int  # samples per subset
    pass_a: float
    pass_b: float
    difference: float  # pass_a - pass_b
    ci_low: float
    ci_high: float
    p_value: float
    significant: bool  # p_value < alpha

    @property
    def k_close_to_m(self) -> bool:
        """k > m / 2, where the rescaling is unreliable: pass@k of an m-subset is nearly an "any correct"
        indicator, not a rescaled copy of the full-n estimate (docs/evaluation.md has the measured error rates)."""
        return 2 * self.k > self.m


# ---------------------------------------------------------------- argument checks


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _check_m(m, n: int) -> int:
    m = _positive_int("m", m)
    if m >= n:
        raise ValueError(f"m={m} must be smaller than n={n} (the samples per problem): subsets of all n samples "
                         f"have no spread to measure; the protocol uses m = n // 4")
    return m


def _check_ks(ks: Sequence[int], m: int) -> list[int]:
    ks = [_positive_int("ks", k) for k in ks]
    if not ks:
        raise ValueError("ks must hold at least one k")
    too_large = [k for k in ks if k > m]
    if too_large:
        raise ValueError(f"ks: k={too_large[0]} is larger than m={m}: pass@k of an m-sample subset needs k <= m")
    return ks


def _check_alpha(alpha: float) -> float:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    return float(alpha)


# ---------------------------------------------------------------- the test, on arrays


def pass_at_k_table(n: int, ks: Sequence[int]) -> np.ndarray:
    """``[n + 1, K]``: unbiased pass@k (Chen et al. 2021) of n samples with c = 0..n correct, for each k.

    Row c is ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` as in :func:`fgrpo.evaluation.pass_at_k.pass_at_k`, built for every c at
    once with a cumulative product; exactly 1 where ``n - c < k``.
    """
    n = _positive_int("n", n)
    ks = np.asarray(ks, dtype=np.float64)
    divisors = np.arange(n, 0, -1, dtype=np.float64)  # i = n, n-1, ..., 1: row c multiplies the first c
    products = np.cumprod(1.0 - ks[None, :] / divisors[:, None], axis=0)
    table = 1.0 - np.vstack([np.ones((1, ks.size)), products])
    fewer_wrong_than_k = (n - np.arange(n + 1))[:, None] < ks[None, :]
    return np.where(fewer_wrong_than_k, 1.0, table)


def _log_factorials(n: int) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1, dtype=np.float64)))])


def hypergeometric_cdf(correct: np.ndarray, n: int, m: int) -> np.ndarray:
    """``[C, m + 1]``: P(X <= x) for X ~ hypergeometric(c, n - c, m), the correct samples among m drawn without
    replacement from n of which c (one per row of ``correct`` ``[C]``) are correct.

    Exactly 1 from the largest possible x on and exactly 0 below the smallest, so inverse-CDF draws never leave
    the support. (``scipy.stats.hypergeom(n, c, m).cdf`` gives the same values to 2e-12, but element by element:
    0.8 s instead of 0.03 s for every c at n = 1024, m = 256, and 19 s instead of 0.25 s at n = 3072, m = 768, the
    pooled seeds of a sweep report; so the pmf is built here from one table of log factorials.)
    """
    correct = np.asarray(correct, dtype=np.int64)[:, None]
    x = np.arange(m + 1)[None, :]
    possible = (x <= correct) & (m - x <= n - correct)
    log_fact = _log_factorials(n)

    def log_comb(top, bottom):
        bottom = np.clip(bottom, 0, top)  # impossible entries are masked below; keep their indices valid
        return log_fact[top] - log_fact[bottom] - log_fact[top - bottom]

    log_pmf = log_comb(correct, x) + log_comb(n - correct, m - x) - log_comb(np.int64(n), np.int64(m))
    cdf = np.cumsum(np.where(possible, np.exp(log_pmf), 0.0), axis=1)
    cdf /= cdf[:, -1:]
    cdf[x >= np.minimum(correct, m)] = 1.0
    return cdf


def subsample_pass_at_k(correct: np.ndarray, n: int, m: int, ks: Sequence[int], iterations: int,
                        rng: np.random.Generator) -> np.ndarray:
    """``[iterations, K]``: mean over problems of pass@k on a random m-of-n subset of each problem's samples.

    Args:
        correct: ``[P]`` correct samples of each problem, of ``n`` drawn.
        m: subset size, ``1 <= m < n``; ks: each in ``1..m``.
        rng: consumed in a fixed order, so one seed gives the same draws.

    The correct count of a subset is drawn by inverting :func:`hypergeometric_cdf` with uniforms (about 5x faster
    than ``Generator.hypergeometric`` at n = 1024, m = 256). Only the mean over problems is returned, so the
    problems are taken in order of c, and those sharing a c share a CDF and a contiguous block of draws.
    """
    values, group_sizes = np.unique(np.asarray(correct, dtype=np.int64), return_counts=True)
    problems = int(group_sizes.sum())
    cdfs = hypergeometric_cdf(values, n, m)
    bounds = np.concatenate([[0], np.cumsum(group_sizes)])
    table = pass_at_k_table(m, ks)
    means = np.empty((iterations, len(ks)))
    chunk = max(1, _CHUNK_DRAWS // problems)
    for start in range(0, iterations, chunk):
        rows = min(chunk, iterations - start)
        uniforms = rng.random((problems, rows))  # problem-major: each group's draws are one contiguous block
        subset_correct = np.empty((problems, rows), dtype=np.intp)
        for cdf, low, high in zip(cdfs, bounds[:-1], bounds[1:]):
            subset_correct[low:high] = np.searchsorted(cdf, uniforms[low:high], side="right")
        means[start:start + rows] = _mean_over_problems(subset_correct, table)
    return means


def _mean_over_problems(subset_correct: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``[rows, K]`` mean over problems of ``table[subset_correct]`` (``[P, rows]`` counts, ``[m + 1, K]`` table)."""
    problems, rows = subset_correct.shape
    width = table.shape[0]
    if width > problems * table.shape[1]:  # large m, few k: look the values up directly
        return np.stack([column[subset_correct].mean(axis=0) for column in table.T], axis=1)
    # per iteration, how many problems had 0, 1, ..., m correct in their subset, times the table
    flat = (subset_correct + width * np.arange(rows)[None, :]).ravel()
    histogram = np.bincount(flat, minlength=rows * width).reshape(rows, width)
    return histogram @ table / problems


def rescale_factor(n: int, m: int) -> float:
    """``sqrt(m / (n - m))``: scales m-of-n subsample deviations from the full-n estimate to the full-n estimate's
    sampling spread (for pass@1 exactly in expectation: ``E[S^2] (1/m - 1/n)`` versus ``p(1-p) / n``)."""
    return float(np.sqrt(m / (n - m)))


def summarize_draws(draws: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Interval and two-sided p-value, per column, from rescaled draws centred at the observed difference.

    Args:
        draws: ``[I, K]`` d* = observed difference + rescaled deviation of one iteration.

    Returns ``(ci_low [K], ci_high [K], p_value [K])``: the alpha/2 and 1 - alpha/2 quantiles of d*, and
    ``min(1, 2 (min(#{d* <= 0}, #{d* >= 0}) + 1) / (I + 1))``.
    """
    ci_low, ci_high = np.quantile(draws, [alpha / 2, 1 - alpha / 2], axis=0)
    tail = np.minimum((draws <= 0).sum(axis=0), (draws >= 0).sum(axis=0))
    p_value = np.minimum(1.0, 2.0 * (tail + 1) / (draws.shape[0] + 1))
    return ci_low, ci_high, p_value


def paired_test(correct_a: Mapping[str, np.ndarray], correct_b: Mapping[str, np.ndarray], n_a: int,
                n_b: int | None = None, *, m: int | None = None, ks: Sequence[int] | None = None,
                iterations: int = DEFAULT_ITERATIONS, alpha: float = DEFAULT_ALPHA, seed: int = 0
                ) -> list[Comparison]:
    """The paired m-out-of-n subsampling test of pass@k(A) - pass@k(B), per dataset and averaged over datasets.

    Args:
        correct_a, correct_b: ``{dataset: [P_d]}`` correct counts, the same problems in the same order in A and B.
        n_a, n_b: samples per problem of A and of B (n_b defaults to n_a).
        m: subset size, default ``min(n_a, n_b) // 4`` (the paper: 256 of 1024); ``1 <= m < min(n_a, n_b)``.
        ks: default 1, 2, 4, ..., m; each k in ``1..m``.
        iterations: subsampling iterations (the paper: 50,000); alpha: level of the interval and of
            ``significant``; seed: seeds ``numpy.random.default_rng``, so the result is reproducible.

    Returns one :class:`Comparison` per (dataset, k), datasets sorted, then the :data:`AVERAGE` rows: the per-dataset
    differences averaged per iteration, so the average has its own interval and p-value. pass_a / pass_b are the
    full-n estimates. See the module docstring for the rescaling and the p-value.

    Raises:
        ValueError: bad m, ks, iterations, alpha; datasets or problem counts that differ between A and B; a count
            outside 0..n.
    """
    n_b = n_a if n_b is None else n_b
    n_a, n_b = _positive_int("n_a", n_a), _positive_int("n_b", n_b)
    n_small = min(n_a, n_b)
    if m is None:
        if n_small // 4 < 1:
            raise ValueError(f"m: the default m = n // 4 is 0 for n={n_small}; pass m (1 <= m < n)")
        m = n_small // 4
    m = _check_m(m, n_small)
    ks = _check_ks(default_ks(m) if ks is None else ks, m)
    iterations = _positive_int("iterations", iterations)
    alpha = _check_alpha(alpha)
    if set(correct_a) != set(correct_b) or not correct_a:
        raise ValueError(f"correct_a and correct_b must hold the same non-empty datasets, got "
                         f"{sorted(correct_a)} and {sorted(correct_b)}")
    rng = np.random.default_rng(seed)
    scale_a, scale_b = rescale_factor(n_a, m), rescale_factor(n_b, m)
    table_a, table_b = pass_at_k_table(n_a, ks), pass_at_k_table(n_b, ks)
    rows, observed_all, draws_all, full_a_all, full_b_all = [], [], [], [], []
    for dataset in sorted(correct_a):
        a, b = np.asarray(correct_a[dataset], dtype=np.int64), np.asarray(correct_b[dataset], dtype=np.int64)
        if a.ndim != 1 or a.shape != b.shape or a.size == 0:
            raise ValueError(f"dataset {dataset!r}: correct_a and correct_b must be 1-D, equal-length and non-empty, "
                             f"got shapes {a.shape} and {b.shape}")
        for name, counts, n in (("correct_a", a, n_a), ("correct_b", b, n_b)):
            if counts.min() < 0 or counts.max() > n:
                raise ValueError(f"{name}[{dataset!r}] holds counts outside 0..{n} (its n)")
        full_a, full_b = table_a[a].mean(axis=0), table_b[b].mean(axis=0)
        sub_a = subsample_pass_at_k(a, n_a, m, ks, iterations, rng)
        sub_b = subsample_pass_at_k(b, n_b, m, ks, iterations, rng)
        observed = full_a - full_b
        draws = observed + scale_a * (sub_a - full_a) - scale_b * (sub_b - full_b)
        rows += _rows(dataset, ks, m, full_a, full_b, observed, draws, alpha)
        observed_all.append(observed)
        draws_all.append(draws)
        full_a_all.append(full_a)
        full_b_all.append(full_b)
    rows += _rows(AVERAGE, ks, m, np.mean(full_a_all, axis=0), np.mean(full_b_all, axis=0),
                  np.mean(observed_all, axis=0), np.mean(draws_all, axis=0), alpha)
    return rows


def _rows(dataset: str, ks: list[int], m: int, full_a: np.ndarray, full_b: np.ndarray, observed: np.ndarray,
          draws: np.ndarray, alpha: float) -> list[Comparison]:
    ci_low, ci_high, p_value = summarize_draws(draws, alpha)
    return [Comparison(dataset, k, m, float(full_a[i]), float(full_b[i]), float(observed[i]), float(ci_low[i]),
                       float(ci_high[i]), float(p_value[i]), bool(p_value[i] < alpha)) for i, k in enumerate(ks)]


def compare(a: EvalCounts | str | Path, b: EvalCounts | str | Path, *, step: int | None = None,
            m: int | None = None, ks: Sequence[int] | None = None, iterations: int = DEFAULT_ITERATIONS,
            alpha: float = DEFAULT_ALPHA, seed: int = 0) -> list[Comparison]:
    """:func:`paired_test` of two evaluations of the same problems with the same n (paths are read with
    :func:`load_counts` at ``step``).

    Raises:
        CompareError: a file missing or unreadable, the step absent, different datasets, problems or n.
        ValueError: bad m, ks, iterations or alpha (the message names the argument).
    """
    a = a if isinstance(a, EvalCounts) else load_counts(a, step)
    b = b if isinstance(b, EvalCounts) else load_counts(b, step)
    correct_a, correct_b = aligned_counts(a, b)
    if a.n != b.n:
        raise CompareError(f"n differs: {a.source} drew n={a.n} samples per problem, {b.source} n={b.n}; the "
                           "protocol subsamples m of the same n from both: evaluate both with the same eval.n_samples")
    return paired_test(correct_a, correct_b, a.n, b.n, m=m, ks=ks, iterations=iterations, alpha=alpha, seed=seed)


# ---------------------------------------------------------------- over seeds


def permutation_test(values_a: Sequence[float], values_b: Sequence[float], *, splits: int = PERMUTATION_SPLITS,
                     seed: int = 0) -> float:
    """Two-sided p-value of mean(a) - mean(b) when each value is one run (one seed), under the null that the runs'
    labels are exchangeable: the share of the splits of the pooled values into groups of len(a) and len(b) whose
    |difference of means| is at least the observed one (``scipy.stats.permutation_test`` of that statistic,
    alternative "greater").

    Exact (every split, the observed one among them) when there are at most ``splits`` splits (always when a side
    has one value); otherwise ``splits`` random splits drawn with ``numpy.random.default_rng(seed)``, with
    ``(count + 1) / (splits + 1)`` so that it never reports 0. Unlike :func:`paired_test`, this sees how much training
    varies from seed to seed, but it has only the runs to go on: with s runs a side its smallest possible p is
    2 / C(2s, s) (0.1 at s = 3, 0.0079 at s = 5).
    Shapes: values_a (s_a,), values_b (s_b,), s_a, s_b >= 1.
    """
    a, b = np.asarray(values_a, dtype=float), np.asarray(values_b, dtype=float)
    if a.ndim != 1 or b.ndim != 1 or not len(a) or not len(b):
        raise CompareError(f"permutation_test needs two non-empty 1-d value lists, got shapes {a.shape} and {b.shape}")
    scale = max(1.0, float(np.abs(np.concatenate([a, b])).max()))

    def spread(group_a: np.ndarray, group_b: np.ndarray, axis: int) -> np.ndarray:
        # |difference of means| to 12 digits of the values' scale: splits whose float sums differ only by rounding
        # count as ties (scipy's own tie tolerance, 100 eps relative to the observed value, misses some where the
        # difference is small next to the values, e.g. pass rates k / 60 a few points apart)
        return np.round(np.abs(group_a.mean(axis=axis) - group_b.mean(axis=axis)) / scale, 12)

    if min(len(a), len(b)) == 1:
        # scipy.stats.permutation_test takes only groups of two or more values; with one value alone, a split is
        # which of the pooled values stands alone: all len(a) + len(b) of them, enumerated here
        pooled = np.concatenate([a, b])
        rest = np.stack([np.delete(pooled, i) for i in range(len(pooled))])
        null = spread(pooled[:, None], rest, axis=1)
        return float(np.mean(null >= spread(a, b, axis=0)))
    result = stats.permutation_test((a, b), spread, permutation_type="independent", vectorized=True,
                                    n_resamples=splits, alternative="greater", rng=np.random.default_rng(seed))
    return float(result.pvalue)


def p_value_text(p: float) -> str:
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"
