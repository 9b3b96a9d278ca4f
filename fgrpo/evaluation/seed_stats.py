"""Statistics over seeds (``python -m fgrpo.report``): the paired over-seeds test of two cells run with the same
seeds and the split of a metric's run-to-run variance into training and evaluation parts (the seed planner that
builds on both is :mod:`fgrpo.evaluation.seed_planner`).

The first half holds pure functions on arrays; the second half reads their inputs from a sweep's runs.

Paired test (:func:`paired_seed_test`): the per-seed differences d_s = a_s - b_s, their mean with a t interval,
the two-sided paired t-test (``scipy.stats.ttest_rel``) and the sign-flip permutation test
(``scipy.stats.permutation_test``, ``permutation_type="samples"`` on the differences: under the null each d_s is
as likely to be -d_s; exact over all 2^S flips up to :data:`EXACT_SIGN_FLIPS` pairs).

Variance split (:func:`variance_split`): a run's final value is the mean over P problems of the unbiased pass@k of
each problem. Its variance from seed to seed within a cell is

    Var(run) = seed part + (problem x seed) / P + sampling / P

with the seed part the training seed's shift of every problem at once, problem x seed the seed's shift of single
problems (it shrinks as 1 / problems) and sampling the binomial noise of the n samples drawn per problem. Per cell
the problems x seeds table is split as a two-way layout with one value per entry: the spread of the run means gives
Var(run) (pooled over cells, weighted by seeds - 1), the residual mean square MS_res (pooled, (S - 1)(P - 1) df per
cell) estimates problem x seed + sampling per problem, and each run's own counts estimate its sampling variance
(:func:`sampling_variance`). So interaction = MS_res / P - sampling, seed = Var(run) - MS_res / P.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

from fgrpo.algorithm.advantage_registry import REFERENCE
from fgrpo.evaluation.eval_counts import load_counts
from fgrpo.evaluation.significance import pass_at_k_table
from fgrpo.evaluation.sweep_runs import FREE_KEYS, Cell, ReportError, Run, reference_cell
from fgrpo.infra.errors import CompareError

EXACT_SIGN_FLIPS = 20  # up to this many pairs every 2^S sign flip is enumerated (2^20: about a second)
SIGN_FLIP_RESAMPLES = 100_000  # random flips beyond that
VARIANCE_KS = (1, 16, 64)


# ---------------------------------------------------------------- the paired test over seeds


@dataclass(frozen=True)
class PairedSeedTest:
    """The paired test of a - b over S seeds (values in the unit of a and b)."""

    differences: np.ndarray  # [S] a_s - b_s in seed order
    mean: float
    ci_low: float
    ci_high: float
    t_p: float  # two-sided paired t-test
    sign_flip_p: float  # two-sided sign-flip permutation test
    exact: bool  # sign_flip_p enumerated all 2^S flips


def sign_flip_p(differences: Sequence[float], *, exact_up_to: int = EXACT_SIGN_FLIPS,
                resamples: int = SIGN_FLIP_RESAMPLES, seed: int = 0) -> float:
    """Two-sided p of mean(differences) under sign flips. ``differences``: [S], S >= 1. Exact over all 2^S flips
    (the observed one among them) when S <= exact_up_to, else ``resamples`` random flips seeded by ``seed``.
    S pairs all of one sign give 2 / 2^S (0.25 at S = 3)."""
    values = np.asarray(differences, dtype=float)
    if values.ndim != 1 or values.size < 1:
        raise ValueError(f"sign_flip_p needs a 1-d array of one or more differences, got shape {values.shape}")
    result = stats.permutation_test((values,), lambda x, axis: np.mean(x, axis=axis), permutation_type="samples",
                                    vectorized=True, alternative="two-sided",
                                    n_resamples=np.inf if values.size <= exact_up_to else resamples,
                                    rng=np.random.default_rng(seed))
    return float(result.pvalue)


def without_spread(differences: np.ndarray) -> bool:
    """No spread beyond float rounding (0.7 - 0.4 != 0.5 - 0.2): there a t-test is undefined (scipy would warn and
    return nan or a p near 0). ``differences``: [S]."""
    return bool(np.ptp(differences) <= 1e-9 * max(1.0, float(np.abs(differences).max())))


def paired_seed_test(values_a: Sequence[float], values_b: Sequence[float], *, confidence: float = 0.95,
                     exact_up_to: int = EXACT_SIGN_FLIPS, seed: int = 0) -> PairedSeedTest:
    """The paired test of A - B over seeds. ``values_a``, ``values_b``: [S] each, S >= 2, entry s of both from the
    same seed. The interval is mean +- t_{(1+confidence)/2, S-1} sd / sqrt(S) (scipy's ``ttest_rel`` interval).
    Where every difference is the same (to 1e-9 relative) the t-test is undefined: p is 1 for all-zero differences,
    else 0, and the interval is the mean."""
    a, b = np.asarray(values_a, dtype=float), np.asarray(values_b, dtype=float)
    if a.ndim != 1 or a.shape != b.shape or a.size < 2:
        raise ValueError(f"paired_seed_test needs two 1-d arrays of the same length >= 2, got {a.shape}, {b.shape}")
    differences = a - b
    mean = float(differences.mean())
    if without_spread(differences):
        low = high = mean
        t_p = 1.0 if abs(mean) <= 1e-9 else 0.0
    else:
        result = stats.ttest_rel(a, b)
        low, high = (float(x) for x in result.confidence_interval(confidence))
        t_p = float(result.pvalue)
    flips = sign_flip_p(differences, exact_up_to=exact_up_to, seed=seed)
    return PairedSeedTest(differences, mean, low, high, t_p, flips, differences.size <= exact_up_to)


# ---------------------------------------------------------------- the variance split


def per_problem_pass_at_k(correct: np.ndarray, n: int, k: int) -> np.ndarray:
    """The unbiased pass@k of each entry of ``correct`` (counts of n samples, any shape), same shape."""
    return pass_at_k_table(n, [k])[np.asarray(correct, dtype=np.int64), 0]


def sampling_method(n: int, k: int) -> str:
    return "unbiased" if 2 * k <= n else "bootstrap"


def sampling_variance(correct: np.ndarray, n: int, k: int) -> np.ndarray:
    """Estimated variance of each problem's unbiased pass@k from its binomial sampling, same shape as ``correct``.

    With q_j = C(n-c, j) / C(n, j), pass@k = 1 - q_k and E[q_j] = (1 - p)^j, so q_k^2 - q_2k is unbiased for
    Var(pass@k) where 2k <= n (for k = 1 it is c (n - c) / (n^2 (n - 1))). Beyond, no unbiased estimate exists: the
    binomial bootstrap, Var over c* ~ Binomial(n, c / n) computed exactly, which sees no noise in a problem with
    c = 0 or c = n and so runs low for large k."""
    correct = np.asarray(correct, dtype=np.int64)
    if sampling_method(n, k) == "unbiased":
        q_k, q_2k = (1 - pass_at_k_table(n, [j])[correct, 0] for j in (k, 2 * k))
        return q_k ** 2 - q_2k
    values = pass_at_k_table(n, [k])[:, 0]
    pmf = stats.binom.pmf(np.arange(n + 1), n, correct[..., None] / n)
    mean = pmf @ values
    return pmf @ values ** 2 - mean ** 2


@dataclass(frozen=True)
class VarianceSplit:
    """Variances of a run's final pass@k (squared proportions), pooled over the cells with two or more seeds."""

    k: int
    run: float  # seed-to-seed variance of the run value within a cell
    sampling: float  # of one run's evaluation: sum over problems of their sampling variance / P^2
    interaction: float  # problem x seed, already / P
    seed: float  # the training seed's own part: run - interaction - sampling
    run_df: int  # sum over cells of (seeds - 1)
    interaction_df: int  # sum over cells of (seeds - 1)(P - 1)
    cells: int  # cells with two or more seeds
    method: str  # how the sampling part was estimated: unbiased | bootstrap


def variance_split(cells: Sequence[np.ndarray], n: int, k: int) -> VarianceSplit:
    """Split the run-to-run variance of pass@k. ``cells``: one ``[S_c, P]`` array of correct counts (of n samples)
    per cell, row s one seed's run, column p the same problem in every cell; cells with one seed are skipped.

    Raises:
        ValueError: no cell with two seeds, P differing between cells, k > n.
    """
    tables = [np.asarray(cell, dtype=np.int64) for cell in cells]
    tables = [table for table in tables if table.ndim == 2 and table.shape[0] >= 2]
    if not tables:
        raise ValueError("variance_split needs at least one cell with two or more seeds")
    problems = {table.shape[1] for table in tables}
    if len(problems) != 1 or k > n:
        raise ValueError(f"the cells must share their problems and k <= n; got problem counts {sorted(problems)}, "
                         f"k={k}, n={n}")
    problems = problems.pop()
    run_ss = residual_ss = sampling_sum = 0.0
    run_df = residual_df = 0
    for table in tables:
        values = per_problem_pass_at_k(table, n, k)
        seeds = values.shape[0]
        run_means = values.mean(axis=1)
        run_ss += float(np.sum((run_means - run_means.mean()) ** 2))
        residual = values - run_means[:, None] - values.mean(axis=0)[None, :] + values.mean()
        residual_ss += float(np.sum(residual ** 2))
        run_df += seeds - 1
        residual_df += (seeds - 1) * (problems - 1)
        # weighted by seeds - 1 like the pooled run variance, so the parts add up
        sampling_sum += (seeds - 1) * float(np.mean(sampling_variance(table, n, k).sum(axis=1))) / problems ** 2
    run = run_ss / run_df
    sampling = sampling_sum / run_df
    residual_per_run = residual_ss / residual_df / problems if residual_df else float("nan")
    return VarianceSplit(k, run, sampling, residual_per_run - sampling, run - residual_per_run, run_df, residual_df,
                         len(tables), sampling_method(n, k))


# ---------------------------------------------------------------- from the runs of a sweep

CellKey = tuple[Cell, tuple[str, ...]]  # a table cell and the other config values that tell its runs apart
# dataset.* keys that do not change what is evaluated
# (the runs' configs are read in today's keys: an older run's dataset.verifier is dataset.rewards there)
_NOT_EVAL_KEYS = ("dataset.train", "dataset.reward_workers", "dataset.reward_timeout_s")


def check_same_eval_settings(runs: list[Run]) -> None:
    """Raise ReportError (one line) when the completed runs were evaluated differently (eval.n_samples,
    eval.max_problems, the dataset keys that set the held-out split): their values are not one measure."""
    completed = [r for r in runs if r.status == "completed"]
    keys = sorted(key for key in set().union(*(r.config for r in completed))
                  if key in ("eval.n_samples", "eval.max_problems")
                  or (key.startswith("dataset.") and not key.startswith(_NOT_EVAL_KEYS)))
    differing = []
    for key in keys:
        counts = Counter(repr(r.config.get(key)) for r in completed)
        if len(counts) > 1:
            values = ", ".join(f"{value} ({count} runs)" for value, count in sorted(counts.items()))
            differing.append(f"{key}: {values}")
    if differing:
        raise ReportError("the runs' evaluation settings differ, so their pass@k are not one measure: "
                          + "; ".join(differing) + " (point at a directory of runs evaluated alike)")


def config_cells(runs: list[Run]) -> dict[CellKey, list[Run]]:
    """The completed runs by cell: (algo, advantage method, gamma) and the values of the other config keys that
    differ between the runs (e.g. trainer.mini_batches=4 when a directory holds two sweeps), runs in seed order."""
    completed = [r for r in runs if r.status == "completed"]
    keys = set().union(*(r.config for r in completed)) if completed else set()
    extra = [key for key in sorted(keys)
             if key not in FREE_KEYS and not key.startswith(("algo.", "focal.", "advantage."))
             and len({repr(r.config.get(key)) for r in completed}) > 1]
    cells: dict[CellKey, list[Run]] = {}
    for run in sorted(completed, key=lambda r: str(r.config.get("seed")).zfill(12)):
        key = ((run.algo, run.method, run.gamma), tuple(f"{name}={run.config.get(name)}" for name in extra))
        cells.setdefault(key, []).append(run)
    return dict(sorted(cells.items(), key=lambda item: (item[0][1], item[0][0])))


def cell_label(key: CellKey) -> str:
    (algo, method, gamma), extra = key
    return ", ".join([algo, f"gamma={gamma:g}" if method == REFERENCE else method, *extra])


def compared_pairs(cells: dict[CellKey, list[Run]]) -> list[tuple[CellKey, CellKey]]:
    """Each cell that is not its algo's plain gamma=0 cell, with that cell (the same other config values); and the
    step-size control (``mean_focal``) with F-GRPO at its gamma, too: does the reweighting matter beyond the step?"""
    pairs = [(key, (reference_cell(key[0]), key[1])) for key in cells]
    pairs += [(((algo, "focal", gamma), rest), key) for key in cells for (algo, method, gamma), rest in [key]
              if method == "mean_focal"]
    return [(key, base) for key, base in pairs if key != base and key in cells and base in cells]


def cell_seeds(cell_runs: list[Run]) -> list[str]:
    return [str(r.config.get("seed")) for r in cell_runs]


def paired_values(cells: dict[CellKey, list[Run]], key: CellKey, base: CellKey,
                  metric: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(seeds, [S] values of ``key``, [S] values of ``base``): each run's final ``eval/<metric>`` in points, by seed.
    Raises ReportError (one line) when the two cells' seeds differ."""
    seeds_a, seeds_b = cell_seeds(cells[key]), cell_seeds(cells[base])
    if sorted(seeds_a) != sorted(seeds_b):
        raise ReportError(f"paired test over seeds: {cell_label(key)} has seeds {', '.join(seeds_a)} but "
                          f"{cell_label(base)} has seeds {', '.join(seeds_b)}; a paired test needs the same seeds on "
                          "both sides (--seeds picks the seeds both have)")
    by_seed_b = dict(zip(seeds_b, cells[base]))
    values_a = np.array([100 * r.final[f"eval/{metric}"] for r in cells[key]])
    values_b = np.array([100 * by_seed_b[s].final[f"eval/{metric}"] for s in seeds_a])
    return seeds_a, values_a, values_b


def paired_tables(runs: list[Run], metrics: list[str]) -> list[tuple[str, list[str], list[list[str]]]]:
    """For report.md: per compared pair a (title, header, rows) table of the per-seed differences A - B in points,
    their mean with its 95% t interval, the paired t-test p and the sign-flip p; a pair whose seeds differ or
    that has one seed gets a title line only (header and rows empty) saying so."""
    cells = config_cells(runs)
    tables = []
    for key, base in compared_pairs(cells):
        title = f"{cell_label(key)} − {cell_label(base)}"
        try:
            columns = [(metric, *paired_values(cells, key, base, metric)) for metric in metrics]
        except ReportError as error:
            tables.append((str(error), [], []))
            continue
        seeds = columns[0][1]
        if len(seeds) < 2:
            tables.append((f"{title}: one seed ({seeds[0]}), no test", [], []))
            continue
        tests = [paired_seed_test(a, b) for _, _, a, b in columns]
        rows = [[seed, *(f"{test.differences[i]:+.1f}" for test in tests)] for i, seed in enumerate(seeds)]
        rows.append(["mean [95% t interval]", *(f"{t.mean:+.1f} [{t.ci_low:+.1f}, {t.ci_high:+.1f}]" for t in tests)])
        rows.append(["paired t-test p", *(f"{t.t_p:.3f}" for t in tests)])
        flips = f"{2 ** len(seeds)} flips, exact" if tests[0].exact else f"{SIGN_FLIP_RESAMPLES} random flips"
        rows.append([f"sign-flip p ({flips})", *(f"{t.sign_flip_p:.3f}" for t in tests)])
        tables.append((f"{title} (seeds {', '.join(seeds)})", ["seed", *(f"Δ{m}" for m in metrics)], rows))
    return tables


PAIRED_NOTE = ("Paired over seeds: Δ = A − B of the runs' final values in points, seed by seed (a seed fixes the "
               "prompt order of both cells); the interval is the 95% t interval of the mean difference, p the "
               "two-sided paired t-test (scipy.stats.ttest_rel) and the sign-flip permutation test of the mean "
               "(exact over all 2^S flips up to 20 pairs). With S seeds the sign-flip p cannot go below 2 / 2^S "
               "(0.25 at 3 seeds).")


def final_counts(run: Run) -> tuple[list[tuple[str, str]], int, np.ndarray] | None:
    """(problem ids, n, [P] correct counts) of the run's final evaluation, problems sorted; None without counts."""
    try:
        counts = load_counts(run.path, step=run.final.get("step"))
    except CompareError:
        return None
    ids = sorted((dataset, problem) for dataset, problems in counts.correct.items() for problem in problems)
    return ids, counts.n, np.array([counts.correct[d][p] for d, p in ids])


def no_spread_error(cells: dict[CellKey, list[Run]], what: str) -> ReportError:
    listed = "; ".join(f"{cell_label(key)}: {len(cell_runs)} seed{'s' if len(cell_runs) != 1 else ''}"
                       for key, cell_runs in cells.items())
    return ReportError(f"{what} needs a cell with two or more seeds to estimate the spread from seed to seed; "
                       f"every cell has fewer ({listed})")


def count_tables(cells: dict[CellKey, list[Run]], what: str) -> tuple[list[np.ndarray], int, int, int]:
    """(one [S_c, P] table of final correct counts per cell with two or more runs that wrote counts, P, n, runs
    left out for want of eval_counts.jsonl). Raises ReportError (one line, naming ``what``) when no run wrote counts
    or the runs' final evaluations differ in their problems or n."""
    counts = {key: [c for r in cell_runs if (c := final_counts(r)) is not None] for key, cell_runs in cells.items()}
    left_out = sum(len(cells[key]) - len(found) for key, found in counts.items())
    found = [c for cell in counts.values() for c in cell]
    if not found:
        raise ReportError(f"{what} needs the runs' per-problem counts (eval_counts.jsonl); no run here wrote them")
    ids, n = found[0][0], found[0][1]
    if any(c[0] != ids or c[1] != n for c in found):
        raise ReportError(f"{what}: the runs' final evaluations differ in their problems or in n; evaluate every "
                          "run on the same problems with the same eval.n_samples")
    tables = [np.stack([c[2] for c in cell]) for cell in counts.values() if len(cell) >= 2]
    if not tables:
        raise ReportError(f"{what} needs a cell with two or more runs that wrote eval_counts.jsonl; none has")
    return tables, len(ids), n, left_out


def variance_table(runs: list[Run]) -> tuple[list[str], list[list[str]], list[str]]:
    """Header, rows and notes of ``--variance``: per k in VARIANCE_KS up to the runs' n, the sds (points) of the
    pooled run-to-run variance and of its parts (:func:`variance_split`), from the runs' final eval_counts.jsonl."""
    check_same_eval_settings(runs)
    cells = config_cells(runs)
    if max(len(cell_runs) for cell_runs in cells.values()) < 2:
        raise no_spread_error(cells, "--variance")
    tables, problems, n, left_out = count_tables(cells, "--variance")
    header = ["metric", "pooled seed sd", "one-run sampling sd", "problem x seed sd", "training sd",
              "problem-level share", "df (runs; problem x seed)", "sampling estimate"]
    rows = []
    for k in [k for k in VARIANCE_KS if k <= n]:
        split = variance_split(tables, n, k)
        parts = (split.run, split.sampling, split.interaction, split.seed)
        problem_level = (split.interaction + split.sampling) / split.run
        rows.append([f"pass@{k}", *(_sd_text(v) for v in parts), f"{problem_level:.0%}",
                     f"{split.run_df}; {split.interaction_df}", split.method])
    notes = [f"{sum(len(t) for t in tables)} runs in {len(tables)} cells with two or more seeds (of {len(cells)} "
             f"cells), {problems} problems, n = {n} samples each; sds in points of the run's final pass@k (the "
             "problems of every eval set as one set: the logged eval/pass@k where there is one eval set)."
             + (f" {left_out} runs without eval_counts.jsonl left out." if left_out else ""),
             "pooled seed sd: the spread of a cell's runs from seed to seed (pooled over cells; df = sum of seeds - "
             "1); it is sampling + problem x seed + training. one-run sampling sd: the binomial noise of one run's "
             "evaluation ('unbiased': q_k^2 - q_2k per problem, for 2k <= n; 'bootstrap': the exact binomial "
             "bootstrap at c / n, low for large k). problem x seed sd: the seed's effect on single problems, "
             "shrinks as 1 / problems (residual mean square of the problems x seeds table / problems - sampling). "
             "training sd: the seed's effect on every problem at once (pooled - residual / problems). "
             "problem-level share: (problem x seed + sampling) / pooled, the part that more problems would shrink. "
             "<0: an estimate below zero (that part is too small to see with these runs)."]
    return header, rows, notes


def _sd_text(variance: float) -> str:
    """A variance (squared proportion) as an sd in points; an estimate below zero as such."""
    return f"{100 * np.sqrt(variance):.2f}" if variance >= 0 else f"<0 ({1e4 * variance:+.2f} pt²)"
