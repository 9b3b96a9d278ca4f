"""The seed planner (``python -m fgrpo.report DIR --plan``): how many seed pairs a paired over-seeds test needs, from
the spread of pilot runs, and that spread projected to another evaluation design (more problems, other samples).

Pairs (:func:`pairs_needed`): the smallest number of seed pairs whose two-sided paired t-test at alpha detects a
given mean difference with the given power, from the exact noncentral-t power (``scipy.stats.nct``).

Projection (:func:`projected_variance`, ``--problems P' --samples n'``): a run's final pass@k is the mean over P
problems of each problem's unbiased pass@k of n samples, so its problem x seed and sampling parts (the variance
split of :mod:`fgrpo.evaluation.seed_stats`, per problem) shrink as 1 / P, and each of the two runs of a per-seed
difference carries its own. With V the pilot's variance of a per-seed difference, I the problem x seed variance
per problem and S(n) the sampling variance per problem at n samples,

    V' = V - 2 (I + S(n)) / P + 2 (I + S(n')) / P'

(I, S pooled over the cells as in the split), assuming the P' problems are like the pilot's P and the seed part
unchanged. V' below VARIANCE_FLOOR is clamped there, and said so. S(n') is the exact variance of the unbiased
pass@k of n' samples drawn Bernoulli(p) (:func:`binomial_sampling_variance`). It is a polynomial in p of degree at
most 2k, so where 2k <= n it is estimated without bias from each pilot problem's c of n
(:func:`projected_sampling_variance`) rather than at a plug-in p = c / n (which sees no noise in a problem with
c = 0 or c = n: 18% low at n' = 32 on the arith_headroom pilot's pass@16) or a shrunk (c + 0.5) / (n + 1) (60% high
there, from the many problems with c = 0). At n' = n it is the split's own estimate q_k^2 - q_2k, so projecting to
the pilot's P and n changes nothing. Where 2k > n no unbiased estimate exists and p = c / n is plugged in (the
split's bootstrap, low for large k).

The 2 in V' takes the problem x seed parts of the two runs of a difference as independent. Two runs of one seed
can share part of them; the cross-check (:func:`paired_interaction`) estimates the part a difference carries,
I_d, from the seeds x problems tables of the per-seed differences themselves and projects with I_d in place of I.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import special, stats

from fgrpo.evaluation.seed_stats import (cell_label, cell_seeds, check_same_eval_settings, compared_pairs,
                                         config_cells, count_tables, final_counts, no_spread_error,
                                         per_problem_pass_at_k, sampling_method, sampling_variance, variance_split)
from fgrpo.evaluation.significance import pass_at_k_table
from fgrpo.evaluation.sweep_report import format_text
from fgrpo.evaluation.sweep_runs import ReportError, Run, pass_at_ks

MOST_PAIRS = 100  # the planner's search range is 2..MOST_PAIRS
PLAN_SAMPLES = (16, 32, 64)  # the samples per problem the projection tabulates (those k <= n' <= the pilot's n)
VARIANCE_FLOOR = 0.01  # points², sd 0.1 point: a projected variance below it is clamped (the t-test needs sd > 0)
SD_UPPER_CONFIDENCE = 0.8  # the one-sided confidence of the pilot sd's upper limit that the planner also sizes for


# ---------------------------------------------------------------- pairs needed


def paired_t_power(pairs: int, effect: float, sd: float, alpha: float) -> float:
    """Power of the two-sided paired t-test at ``alpha`` over ``pairs`` differences of mean ``effect`` and standard
    deviation ``sd``: P(|T| > t_{1-alpha/2, pairs-1}) with T noncentral t, noncentrality effect / sd * sqrt(pairs)."""
    df = pairs - 1
    critical = stats.t.ppf(1 - alpha / 2, df)
    noncentrality = effect / sd * np.sqrt(pairs)
    # the lower tail as the upper tail of -T: scipy's nct.cdf far below the mean can return nan (df 3, nc 7.33)
    return float(stats.nct.sf(critical, df, noncentrality) + stats.nct.sf(critical, df, -noncentrality))


def pairs_needed(effect: float, sd: float, alpha: float, power: float, most: int = MOST_PAIRS) -> int | None:
    """The fewest seed pairs (2..most) whose paired t-test reaches ``power``; None when even ``most`` do not.
    For sd 1, effect 1, alpha 0.05, power 0.8: 10."""
    if effect <= 0 or sd <= 0 or not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"need effect > 0, sd > 0, 0 < alpha < 1, 0 < power < 1; got {effect}, {sd}, {alpha}, {power}")
    return next((n for n in range(2, most + 1) if paired_t_power(n, effect, sd, alpha) >= power), None)


def sd_upper_limit(sd: float, df: int, confidence: float = SD_UPPER_CONFIDENCE) -> float:
    """The one-sided ``confidence`` upper limit of a normal sd estimated as ``sd`` on ``df`` degrees of freedom:
    sd sqrt(df / chi2_{1-confidence, df}). A pilot's sd runs low more often than high (its median is below the true
    sd), and a run sized on a low one is underpowered; sized on this limit (Browne 1995, at 80%), a run reaches the
    power with that probability at least. The factor: 2.12 at df 2, 1.56 at df 4, 1.27 at df 10."""
    if df < 1:
        raise ValueError(f"need df >= 1 for an upper limit, got {df}")
    return float(sd * np.sqrt(df / stats.chi2.ppf(1 - confidence, df)))


def expected_half_width(pairs: int, sd: float, confidence: float = 0.90) -> float:
    """E[half-width] of the t interval of the mean of ``pairs`` differences with standard deviation ``sd``:
    t_{(1+confidence)/2, pairs-1} c4 sd / sqrt(pairs), c4 = E[s] / sd (the sample sd is biased low)."""
    c4 = np.sqrt(2 / (pairs - 1)) * np.exp(special.gammaln(pairs / 2) - special.gammaln((pairs - 1) / 2))
    return float(stats.t.ppf((1 + confidence) / 2, pairs - 1) * c4 * sd / np.sqrt(pairs))


# ---------------------------------------------------------------- sampling variance at another n


def _overlap_pmf(n: int, k: int) -> np.ndarray:
    """[k + 1]: P(two independent uniform k-subsets of n samples share i samples), i = 0..k (hypergeometric)."""
    return stats.hypergeom.pmf(np.arange(k + 1), n, k, k)


def _check_k(n: int, k: int) -> None:
    if not 1 <= k <= n:
        raise ValueError(f"the unbiased pass@k needs 1 <= k <= n samples; got k={k}, n={n}")


def binomial_sampling_variance(p: np.ndarray | float, n: int, k: int) -> np.ndarray:
    """Exact variance of the unbiased pass@k of n samples, each correct with probability p (any shape, same shape
    back). pass@k = 1 - q with q the chance that k of the n samples drawn without replacement are all wrong; q^2 is
    the chance that two independent such draws are, and they cover 2k - i samples when they share i, so
    Var = sum_i P(share i) (1 - p)^(2k - i) - (1 - p)^(2k)."""
    _check_k(n, k)
    miss = 1 - np.asarray(p, dtype=float)
    powers = miss[..., None] ** (2 * k - np.arange(k + 1))
    return powers @ _overlap_pmf(n, k) - miss ** (2 * k)


def projected_sampling_variance(correct: np.ndarray, n: int, new_n: int, k: int) -> np.ndarray:
    """Estimate, for each count of ``correct`` (c of n samples, any shape), the problem's sampling variance of the
    unbiased pass@k at ``new_n`` samples (:func:`binomial_sampling_variance` at its unknown p).

    Where 2k <= n each (1 - p)^j (j <= 2k) is replaced by its unbiased estimate q_j = C(n - c, j) / C(n, j), so the
    estimate is unbiased at any new_n >= k; at new_n = n it equals :func:`seed_stats.sampling_variance`. Where
    2k > n: the exact variance at p = c / n, low for problems with c = 0 or c = n (no noise seen there)."""
    _check_k(new_n, k)
    correct = np.asarray(correct, dtype=np.int64)
    if sampling_method(n, k) != "unbiased":
        return binomial_sampling_variance(correct / n, new_n, k)
    q = 1 - pass_at_k_table(n, np.arange(k, 2 * k + 1))[correct]  # [..., k + 1]: q_k .. q_2k
    return q[..., ::-1] @ _overlap_pmf(new_n, k) - q[..., k]  # reversed: entry i is q_{2k-i}


def pooled_per_problem(tables: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> float:
    """The mean over problems and runs of ``values`` (one [S_c, P] array per table), cells weighted by S_c - 1 as
    in :func:`seed_stats.variance_split`, so that it is that split's per-problem sampling part at the pilot's n."""
    weights = [table.shape[0] - 1 for table in tables]
    return sum(w * float(np.mean(v)) for w, v in zip(weights, values)) / sum(weights)


def projected_variance(pilot: float, interaction: float, sampling: float, new_sampling: float, problems: int,
                       new_problems: int) -> float:
    """The variance of a per-seed difference at new_problems problems and the sampling variance ``new_sampling``
    per problem: pilot - 2 (interaction + sampling) / problems + 2 (interaction + new_sampling) / new_problems
    (interaction, sampling: per problem; all in one unit). Not clamped."""
    return pilot - 2 * (interaction + sampling) / problems + 2 * (interaction + new_sampling) / new_problems


def paired_interaction(pairs: Sequence[tuple[np.ndarray, np.ndarray]], n: int, k: int) -> tuple[float, int]:
    """(I_d, df): the problem x seed variance per problem and run that a per-seed difference carries, from the
    difference tables themselves. ``pairs``: per pair of cells ([S, P] counts of a, [S, P] of b), row s of both
    from seed s. I_d = (R_d - S_d) / 2 with R_d the residual mean square of the seeds x problems table of the
    per-problem differences (pooled, (S - 1)(P - 1) df per pair) and S_d the two runs' sampling variance per
    problem (pooled with weights S - 1). I_d = I (:func:`seed_stats.variance_split`) where the two runs' problem x
    seed parts are independent, less where a shared seed makes them alike (squared proportions)."""
    residual_ss, df = 0.0, 0
    for a, b in pairs:
        d = per_problem_pass_at_k(a, n, k) - per_problem_pass_at_k(b, n, k)
        residual = d - d.mean(axis=1, keepdims=True) - d.mean(axis=0, keepdims=True) + d.mean()
        residual_ss += float(np.sum(residual ** 2))
        df += (d.shape[0] - 1) * (d.shape[1] - 1)
    both = pooled_per_problem([a for a, _ in pairs], [sampling_variance(a, n, k) + sampling_variance(b, n, k)
                                                      for a, b in pairs])
    return (residual_ss / df - both) / 2, df


def clamped(variance: float) -> tuple[float, bool]:
    """(max(variance, VARIANCE_FLOOR), whether it was clamped)."""
    return max(variance, VARIANCE_FLOOR), variance < VARIANCE_FLOOR


# ---------------------------------------------------------------- from the runs of a sweep


def _pooled_sd(groups: list[np.ndarray]) -> tuple[float, int]:
    """(pooled sd, df) of several groups of values, each with its own mean; groups of one value add nothing."""
    groups = [g for g in groups if len(g) >= 2]
    df = sum(len(g) - 1 for g in groups)
    return float(np.sqrt(sum(np.sum((g - g.mean()) ** 2) for g in groups) / df)), df


def pilot_difference_sd(cells: dict, metric: str) -> tuple[float, int, str]:
    """(sd in points, its df, where it came from): the pooled sd of the per-seed paired differences over the
    compared pairs (on the seeds both cells have), else sqrt(2) x the pooled seed sd."""
    differences, used = [], []
    for key, base in compared_pairs(cells):
        common = [s for s in cell_seeds(cells[key]) if s in cell_seeds(cells[base])]
        if len(common) >= 2:
            value = {label: {str(r.config.get("seed")): 100 * r.final[f"eval/{metric}"] for r in cells[label]}
                     for label in (key, base)}
            differences.append(np.array([value[key][s] - value[base][s] for s in common]))
            used.append(f"{cell_label(key)} vs {cell_label(base)} ({len(common)} seeds)")
    if differences:
        sd, df = _pooled_sd(differences)
        return sd, df, (f"the pooled sd of the per-seed paired differences, {df} df, over {len(used)} pairs: "
                    + "; ".join(used))
    seed_sd, df = _pooled_sd([np.array([100 * r.final[f"eval/{metric}"] for r in c]) for c in cells.values()])
    return np.sqrt(2) * seed_sd, df, (f"no pair of cells shares two seeds: sqrt(2) x the pooled seed sd ({seed_sd:.2f} "
                                      f"points, {df} df, pooled over the cells), i.e. pairing assumed to gain nothing")


def _pairs_lines(effect: float, sd: float, alpha: float, power: float, prefix: str = "") -> list[str]:
    needed = pairs_needed(effect, sd, alpha, power)
    at = needed or MOST_PAIRS
    return [(f"{prefix}seed pairs needed: {needed} (power {paired_t_power(needed, effect, sd, alpha):.3f}"
             + (f"; {needed - 1} give {paired_t_power(needed - 1, effect, sd, alpha):.3f})" if needed > 2 else ")"))
            if needed else f"{prefix}seed pairs needed: more than {MOST_PAIRS} (power at {MOST_PAIRS}: "
                           f"{paired_t_power(MOST_PAIRS, effect, sd, alpha):.3f})",
            f"{prefix}90% interval half-width expected under no effect at {at} pairs: "
            f"+-{expected_half_width(at, sd):.2f} points (an equivalence margin must be wider than this to be "
            "reachable)"]


def plan_text(runs: list[Run], *, effect: float, alpha: float, power: float, metric: str,
              problems: int | None = None, samples: int | None = None) -> str:
    """``--plan``: the seed pairs a two-sided paired t-test needs to detect ``effect`` points of ``metric`` at
    ``alpha`` with ``power``, from the sd of the pilot runs' per-seed differences (:func:`pilot_difference_sd`),
    and the 90% interval half-width expected under no effect at that many pairs; the same at that sd's upper
    confidence limit (:func:`sd_upper_limit`). With ``problems`` or ``samples`` (default the pilot's own): the same
    projected to that evaluation design (:func:`projection_lines`)."""
    check_same_eval_settings(runs)
    cells = config_cells(runs)
    missing = [r for cell_runs in cells.values() for r in cell_runs if f"eval/{metric}" not in r.final]
    if missing:
        have = ", ".join(f"pass@{k}" for k in pass_at_ks(missing[0].final))
        raise ReportError(f"--metric {metric}: {missing[0].path} logged no eval/{metric} (it has {have}); "
                          "pass one of those")
    if max(len(cell_runs) for cell_runs in cells.values()) < 2:
        raise no_spread_error(cells, "--plan")
    sd, df, source = pilot_difference_sd(cells, metric)
    upper = sd_upper_limit(sd, df)
    lines = [f"Seed planner, {metric}: detect {effect:g} points with a two-sided paired t-test at alpha {alpha:g}, "
             f"power {power:g}",
             f"sd of a per-seed difference: {sd:.2f} points ({source})",
             *_pairs_lines(effect, sd, alpha, power),
             f"its {SD_UPPER_CONFIDENCE:.0%} upper confidence limit ({df} df): {upper:.2f} points (a pilot's sd runs "
             f"low more often than high; sized on this limit, a run reaches the power with probability "
             f"{SD_UPPER_CONFIDENCE:g})",
             *_pairs_lines(effect, upper, alpha, power, prefix="at the upper limit: ")]
    if problems is not None or samples is not None:
        lines += projection_lines(cells, metric, sd ** 2, effect=effect, alpha=alpha, power=power,
                                  problems=problems, samples=samples)
    return "\n".join(lines)


def _metric_k(metric: str) -> int:
    match = re.fullmatch(r"pass@(\d+)", metric)
    if not match:
        raise ReportError(f"--problems and --samples project a pass@k metric; --metric {metric} is not one")
    return int(match.group(1))


def _paired_count_tables(cells: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per compared pair with two or more shared seeds that wrote counts: ([S, P] counts of the cell, of its
    gamma=0 cell), rows in the same seed order."""
    tables = []
    for key, base in compared_pairs(cells):
        counts = {label: {str(r.config.get("seed")): c[2] for r in cells[label] if (c := final_counts(r)) is not None}
                  for label in (key, base)}
        common = [s for s in cell_seeds(cells[key]) if s in counts[key] and s in counts[base]]
        if len(common) >= 2:
            tables.append(tuple(np.stack([counts[label][s] for s in common]) for label in (key, base)))
    return tables


@dataclass(frozen=True)
class _Design:
    """The projection of ``pilot`` (points²) with ``interaction`` (points² per problem and run) and the sampling
    part pooled over ``tables`` (counts of n samples), from ``problems`` to ``new_problems`` problems."""

    pilot: float
    interaction: float
    tables: list[np.ndarray]
    n: int
    k: int
    problems: int
    new_problems: int

    def sampling(self, new_n: int) -> float:
        """S(new_n) per problem, points²."""
        return 1e4 * pooled_per_problem(self.tables, [projected_sampling_variance(t, self.n, new_n, self.k)
                                                      for t in self.tables])

    def variance(self, new_n: int) -> tuple[float, bool]:
        """(V' clamped, whether it was) at new_n samples."""
        return clamped(projected_variance(self.pilot, self.interaction, self.sampling(self.n), self.sampling(new_n),
                                          self.problems, self.new_problems))


def projection_lines(cells: dict, metric: str, pilot: float, *, effect: float, alpha: float, power: float,
                     problems: int | None, samples: int | None) -> list[str]:
    """The projection of ``pilot`` (the variance of a per-seed difference, points²) to ``problems`` problems of
    ``samples`` samples each (None: the pilot's), from the variance split of the runs' final counts: its components,
    the projected sd, pairs and half-width, the cross-check with the paired differences' own problem x seed part
    (:func:`paired_interaction`), and a table of both by samples per problem (PLAN_SAMPLES)."""
    k = _metric_k(metric)
    if problems is not None and problems < 1:
        raise ReportError(f"--problems must be >= 1, got {problems}")
    if samples is not None and k > samples:
        raise ReportError(f"--samples {samples} is below k = {k} of --metric {metric}: the unbiased pass@k needs at "
                          "least k samples per problem")
    tables, pilot_problems, n, left_out = count_tables(cells, "--problems/--samples")
    if k > n:
        raise ReportError(f"--metric {metric} needs k <= the pilot's {n} samples per problem to split its variance")
    problems, samples = problems or pilot_problems, samples or n
    split = variance_split(tables, n, k)
    design = _Design(pilot, 1e4 * split.interaction * pilot_problems, tables, n, k, pilot_problems, problems)
    interaction, sampling, new_sampling = design.interaction, design.sampling(n), design.sampling(samples)
    variance, was_clamped = design.variance(samples)
    kept, added = pilot - 2 * (interaction + sampling) / pilot_problems, 2 * (interaction + new_sampling) / problems
    how = ("unbiased estimate of the exact binomial variance" if sampling_method(n, k) == "unbiased"
           else "exact binomial variance at p = c / n, low for problems with c = 0 or n")
    lines = [f"Projected to {problems} problems x {samples} samples (the pilot: {pilot_problems} x {n}), {metric}: "
             f"V' = V - 2 (I + S({n})) / {pilot_problems} + 2 (I + S({samples})) / {problems}, from the variance "
             f"split of the final counts of {sum(len(t) for t in tables)} runs in {len(tables)} cells with two or "
             "more seeds" + (f" ({left_out} runs without eval_counts.jsonl left out)" if left_out else ""),
             f"  components (points²): seed part {split.seed * 1e4:.2f} per run; problem x seed I = {interaction:.1f} "
             f"per problem; sampling S per problem {sampling:.1f} at n = {n}, {new_sampling:.1f} at n = {samples} "
             f"({how})",
             f"  V' = {pilot:.2f} - 2 x ({interaction:.1f} + {sampling:.1f}) / {pilot_problems} + 2 x "
             f"({interaction:.1f} + {new_sampling:.1f}) / {problems} = {kept:.2f} + {added:.2f} = {kept + added:.2f} "
             "points²" + (f", clamped to {VARIANCE_FLOOR:g}: the problem-level parts of the split exceed the pilot's "
                          "variance, too noisy to project from" if was_clamped else "")
             + (" (the part that does not shrink with problems is below 0: the pilot's V is smaller than the "
                "problem-level parts it should hold, so V' runs low)" if kept < 0 and not was_clamped else ""),
             f"  projected sd of a per-seed difference: {np.sqrt(variance):.2f} points",
             *_pairs_lines(effect, np.sqrt(variance), alpha, power, prefix="  projected ")]
    paired_design, cross_check = _paired_cross_check(cells, design, samples, effect=effect, alpha=alpha,
                                                     power=power)
    lines += [cross_check] if cross_check else []
    rows = []
    for new_n in (m for m in PLAN_SAMPLES if k <= m <= n):
        var, low = design.variance(new_n)
        needed = pairs_needed(effect, np.sqrt(var), alpha, power)
        rows.append([str(new_n), f"{design.sampling(new_n):.1f}", f"{np.sqrt(var):.2f}" + (" (clamped)" if low else ""),
                     str(needed) if needed else f">{MOST_PAIRS}",
                     f"+-{expected_half_width(needed or MOST_PAIRS, np.sqrt(var)):.2f}"])
        if paired_design:
            var, low = paired_design.variance(new_n)
            rows[-1] += [f"{np.sqrt(var):.2f}" + (" (clamped)" if low else ""),
                         _needed_text(effect, np.sqrt(var), alpha, power)]
    if rows:
        header = ["samples n'", "S(n') per problem", "sd of a difference", "pairs needed", "90% half-width"]
        table = format_text(header + (["sd with I_d", "pairs with I_d"] if paired_design else []), rows)
        lines += [f"  at {problems} problems, by samples per problem:", *("  " + line for line in table.split("\n"))]
    return lines


def _paired_cross_check(cells: dict, design: _Design, samples: int, *, effect: float, alpha: float,
                        power: float) -> tuple[_Design | None, str | None]:
    """``design`` with the per-seed differences' own problem x seed part I_d (:func:`paired_interaction`) in place
    of the split's I, and the line that reports it; (None, None) where no pair of cells shares two seeds."""
    paired = _paired_count_tables(cells)
    if not paired:
        return None, None
    paired_i, df = paired_interaction(paired, design.n, design.k)
    paired_design = _Design(design.pilot, 1e4 * paired_i, [t for pair in paired for t in pair], design.n, design.k,
                            design.problems, design.new_problems)
    variance, was_clamped = paired_design.variance(samples)
    lower = paired_design.interaction < design.interaction
    return paired_design, (
        f"  cross-check: the per-seed differences' own problem x seed part is I_d = {paired_design.interaction:.1f} "
        f"per problem and run ({len(paired)} pairs, {df} df) against the split's I = {design.interaction:.1f} "
        + ("(lower: a shared seed makes the two runs' problem x seed parts alike, which V' above takes as "
           "independent, so V' runs low)" if lower else
           "(not lower: no sign that a shared seed makes the two runs' problem x seed parts alike)")
        + f". With I_d: V' = {variance:.2f} points²" + (" (clamped)" if was_clamped else "")
        + f", sd {np.sqrt(variance):.2f} points, pairs needed {_needed_text(effect, np.sqrt(variance), alpha, power)}")


def _needed_text(effect: float, sd: float, alpha: float, power: float) -> str:
    needed = pairs_needed(effect, sd, alpha, power)
    return str(needed) if needed else f">{MOST_PAIRS}"
