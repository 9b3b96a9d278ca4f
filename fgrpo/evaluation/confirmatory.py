"""The pre-registered analysis of a confirmatory run (``python -m fgrpo.report DIR --confirm PLAN.yaml``).

A plan file fixes, before the runs, which cells are the arms, which seeds every arm must have, the primary test, the
equivalence margin that calls a null, and the follow-up tests in the order they are run, each only if the one before
it was significant (a fixed-sequence procedure: the family-wise error stays at the primary's alpha). The analysis
refuses to run until every arm has every seed: no interim look. docs/results/arith_confirm/analysis_plan.yaml is the
plan of docs/results.md's pre-registration.

Tests on the per-seed differences d_s = a_s - b_s (points), S pairs, t with S - 1 degrees of freedom:
- superiority: two-sided paired t-test (``scipy.stats.ttest_rel``) at the step's alpha; the exact sign-flip test
  beside it (:func:`fgrpo.evaluation.seed_stats.sign_flip_p`), reported, not ruling;
- equivalence (:func:`equivalence_test`): two one-sided tests (TOST) against +-margin; equivalent when both
  p < alpha, i.e. when the (1 - 2 alpha) interval lies within (-margin, +margin);
- non-inferiority (:func:`non_inferiority_test`): one-sided test that mean(d) > -margin at alpha.
- a collapse rate (metric ``collapse``, the plan's rule): the exact McNemar test over seeds
  (:mod:`fgrpo.evaluation.collapse`) decides; d_s = 100 (a_s collapsed - b_s collapsed), so the mean of d is the
  difference of the two rates in points, and its t interval (and the TOST of a null) is an approximation beside it.

A significant two-sided result opens the next test whichever way it points (the plan's words: "if the one before it
is significant"); each line says which way (a above or below b). The plan file: :mod:`fgrpo.evaluation.analysis_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
from scipy import stats

from fgrpo.evaluation.analysis_plan import COLLAPSE, Comparison, Plan
from fgrpo.evaluation.collapse import CollapseRule, mcnemar_exact
from fgrpo.evaluation.seed_stats import (cell_label, cell_seeds, check_same_eval_settings, config_cells,
                                         final_counts, paired_seed_test, without_spread)
from fgrpo.evaluation.sweep_runs import ReportError, Run


# ---------------------------------------------------------------- the tests, on arrays


@dataclass(frozen=True)
class OneSidedResult:
    mean: float
    ci_low: float  # the (1 - 2 alpha) two-sided interval of the mean (equivalence) or its one-sided bound
    ci_high: float
    p: float  # the p that decides (the larger of the two one-sided p for equivalence)
    passed: bool


def _mean_se(differences: Sequence[float]) -> tuple[np.ndarray, float, float, int]:
    d = np.asarray(differences, dtype=float)
    if d.ndim != 1 or d.size < 2:
        raise ValueError(f"the test needs a 1-d array of two or more differences, got shape {d.shape}")
    return d, float(d.mean()), 0.0 if without_spread(d) else float(d.std(ddof=1) / np.sqrt(d.size)), d.size - 1


def _one_sided_p(mean: float, se: float, df: int, null: float, greater: bool) -> float:
    """p of H0 mean <= null (greater) or mean >= null (not greater); se 0: 0 or 1 by the side the mean is on."""
    if se == 0.0:
        return 0.0 if (mean > null if greater else mean < null) else 1.0
    t = (mean - null) / se
    return float(stats.t.sf(t, df) if greater else stats.t.cdf(t, df))


def equivalence_test(differences: Sequence[float], margin: float, alpha: float = 0.05) -> OneSidedResult:
    """TOST of |mean(d)| < margin. ``differences``: [S], S >= 2. The interval is the (1 - 2 alpha) t interval
    (90% at alpha 0.05); equivalence holds exactly when it lies inside (-margin, margin)."""
    if margin <= 0 or not 0 < alpha < 0.5:
        raise ValueError(f"equivalence needs margin > 0 and alpha in (0, 0.5), got {margin} and {alpha}")
    _, mean, se, df = _mean_se(differences)
    half = float(stats.t.ppf(1 - alpha, df)) * se
    p = max(_one_sided_p(mean, se, df, -margin, True), _one_sided_p(mean, se, df, margin, False))
    return OneSidedResult(mean, mean - half, mean + half, p, p < alpha)


def non_inferiority_test(differences: Sequence[float], margin: float, alpha: float) -> OneSidedResult:
    """One-sided t-test of H0 mean(d) <= -margin. ``differences``: [S], S >= 2. ci_low is the one-sided
    (1 - alpha) lower bound (the test passes exactly when it is above -margin); ci_high is +inf."""
    if margin <= 0 or not 0 < alpha < 0.5:
        raise ValueError(f"non-inferiority needs margin > 0 and alpha in (0, 0.5), got {margin} and {alpha}")
    _, mean, se, df = _mean_se(differences)
    low = mean - float(stats.t.ppf(1 - alpha, df)) * se
    p = _one_sided_p(mean, se, df, -margin, True)
    return OneSidedResult(mean, low, float("inf"), p, p < alpha)


# ---------------------------------------------------------------- the analysis, from runs


def arm_runs(runs: list[Run], plan: Plan) -> dict[str, list[Run]]:
    """{arm: its completed runs in the plan's seed order}. Raises ReportError (one line) when the runs differ in a
    key other than the arms' own, when an arm has a seed twice, or when any planned run is missing (no interim look).
    Runs of other cells or seeds are left out."""
    check_same_eval_settings(runs)
    cells = config_cells(runs)
    differing = sorted({entry.split("=")[0] for _, extra in cells for entry in extra})
    if differing:
        values = "; ".join(f"{key}: " + ", ".join(sorted({e.split("=", 1)[1] for _, extra in cells for e in extra
                                                          if e.split("=")[0] == key})) for key in differing)
        raise ReportError(f"the runs differ in more than their arms ({values}): the analysis compares runs that "
                          "differ only in the arms' cells and the seed; point --confirm at those runs")
    out, missing = {}, []
    for name, cell in plan.arms.items():
        cell_runs = cells.get((cell, ()), [])
        seeds = cell_seeds(cell_runs)
        twice = sorted({s for s in seeds if seeds.count(s) > 1})
        if twice:
            raise ReportError(f"arm {name} has two finished runs of seed {', '.join(twice)} "
                              f"({', '.join(str(r.path) for r in cell_runs if str(r.config.get('seed')) in twice)}): "
                              "keep one")
        by_seed = dict(zip(seeds, cell_runs))
        out[name] = [by_seed[seed] for seed in plan.seeds if seed in by_seed]
        missing += [f"{name} seed {seed}" for seed in plan.seeds if seed not in by_seed]
    if missing:
        done = sum(len(v) for v in out.values())
        raise ReportError(f"no interim look: {done} of {len(plan.seeds) * len(plan.arms)} planned runs have finished; "
                          f"missing {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    return out


def arm_values(arms: dict[str, list[Run]], arm: str, metric: str, rule: CollapseRule | None = None) -> np.ndarray:
    """[S] each run's final eval/<metric> in points, in the plan's seed order (metric collapse: 100 where the run
    collapsed by ``rule``, else 0)."""
    if metric == COLLAPSE:
        try:
            return np.array([100.0 * rule.collapsed(run.final) for run in arms[arm]])
        except KeyError:
            raise ReportError(f"the collapse rule ({rule.text()}): a run of {arm} logged no eval/{rule.high} "
                              f"or eval/{rule.low}") from None
    try:
        return np.array([100 * run.final[f"eval/{metric}"] for run in arms[arm]])
    except KeyError:
        raise ReportError(f"the plan's metric {metric}: a run of {arm} logged no eval/{metric}") from None


@dataclass(frozen=True)
class TestedStep:
    """One test the sequence ran: its line of the analysis, the per-seed differences it ran on and the intervals
    its test computed (the figure draws these, :mod:`fgrpo.evaluation.confirm_figure`)."""
    label: str  # "Primary", "Then 1", ...
    comparison: Comparison
    differences: np.ndarray  # [S] a - b per seed, points, in the plan's seed order
    line: str
    passed: bool
    confidence: float  # of the interval below: 1 - alpha (superiority), 1 - 2 alpha (non-inferiority)
    interval: tuple[float, float]  # the two-sided interval that decides (non-inferiority: its low end is the bound)
    equivalence: tuple[float, float] | None = None  # a primary that is not significant: the TOST interval


def _superiority_step(label: str, c: Comparison, values_a: np.ndarray, values_b: np.ndarray) -> TestedStep:
    test = paired_seed_test(values_a, values_b, confidence=1 - c.alpha)
    significant = test.t_p < c.alpha
    side = f"{c.a} above {c.b}" if test.mean > 0 else f"{c.a} below {c.b}"
    line = (f"{label}: {c.a} − {c.b}, {c.metric}: mean {test.mean:+.2f} points, {100 * (1 - c.alpha):g}% interval "
            f"[{test.ci_low:+.2f}, {test.ci_high:+.2f}], paired t p = {test.t_p:.4f} (alpha {c.alpha:g}: "
            + (f"significant, {side}" if significant else "not significant")
            + f"); sign-flip p = {test.sign_flip_p:.4f}")
    return TestedStep(label, c, values_a - values_b, line, significant, 1 - c.alpha, (test.ci_low, test.ci_high))


def _collapse_step(label: str, c: Comparison, values_a: np.ndarray, values_b: np.ndarray,
                   rule: CollapseRule) -> TestedStep:
    test = mcnemar_exact(values_a > 0, values_b > 0)
    significant = test.p <= c.alpha
    side = f"{c.a} collapsed more often than {c.b}" if test.rate_difference > 0 else \
        f"{c.a} collapsed less often than {c.b}"
    low, high = mean_interval(values_a - values_b, 1 - c.alpha)
    pairs = test.pairs
    line = (f"{label}: {c.a} − {c.b}, collapse rate ({rule.text()}): {c.a} {int(np.sum(values_a > 0))} of {pairs}, "
            f"{c.b} {int(np.sum(values_b > 0))} of {pairs}, difference {test.rate_difference:+.1f} points; discordant "
            f"seeds: only {c.a} collapsed {test.only_a}, only {c.b} {test.only_b}; exact McNemar p = {test.p:.4f} "
            f"(alpha {c.alpha:g}: " + (f"significant, {side}" if significant else "not significant")
            + f"); {100 * (1 - c.alpha):g}% paired t interval of the difference (approximate) "
            f"[{low:+.1f}, {high:+.1f}]")
    return TestedStep(label, c, values_a - values_b, line, significant, 1 - c.alpha, (low, high))


def _equivalence_line(plan: Plan, eq: OneSidedResult) -> str:
    return (f"Equivalence (TOST at {plan.equivalence_alpha:g}, margin ±{plan.equivalence_margin:g}): "
            f"{100 * (1 - 2 * plan.equivalence_alpha):g}% interval [{eq.ci_low:+.2f}, {eq.ci_high:+.2f}], "
            f"p = {eq.p:.4f}: " + ("equivalent: a null result" if eq.passed else "not equivalent either: inconclusive"))


def _non_inferiority_step(label: str, c: Comparison, differences: np.ndarray) -> TestedStep:
    ni = non_inferiority_test(differences, c.non_inferiority_margin, c.alpha)
    line = (f"{label}: {c.a} − {c.b}, {c.metric}, non-inferiority within {c.non_inferiority_margin:g} points: "
            f"mean {ni.mean:+.2f}, one-sided {100 * (1 - c.alpha):g}% lower bound {ni.ci_low:+.2f}, p = {ni.p:.4f} "
            f"(alpha {c.alpha:g}: {'non-inferior' if ni.passed else 'not shown'})")
    # the one-sided 1 - alpha bound is the low end of the two-sided 1 - 2 alpha interval
    return TestedStep(label, c, differences, line, ni.passed, 1 - 2 * c.alpha, (ni.ci_low, 2 * ni.mean - ni.ci_low))


def tested_steps(arms: dict[str, list[Run]], plan: Plan) -> tuple[list[TestedStep], list[str]]:
    """The plan's tests in their fixed order, each only if the one before it passed (module docstring): the steps
    that ran, and the lines of the analysis (the equivalence call and the steps not tested included)."""
    steps, lines, passed = [], [], True
    for i, c in enumerate((plan.primary, *plan.then)):
        label = "Primary" if i == 0 else f"Then {i}"
        if not passed:
            lines.append(f"{label}: {c.a} − {c.b}, {c.metric}: not tested (the test before it did not pass)")
            continue
        a, b = arm_values(arms, c.a, c.metric, plan.collapse), arm_values(arms, c.b, c.metric, plan.collapse)
        if c.metric == COLLAPSE:
            step = _collapse_step(label, c, a, b, plan.collapse)
        elif c.non_inferiority_margin is None:
            step = _superiority_step(label, c, a, b)
        else:
            step = _non_inferiority_step(label, c, a - b)
        lines.append(step.line)
        passed = step.passed
        if i == 0 and not passed and c.metric == COLLAPSE and without_spread(step.differences):
            # every seed concordant: the t interval has no width, and a null cannot be read from it
            lines.append(f"Equivalence (TOST at {plan.equivalence_alpha:g}, margin ±{plan.equivalence_margin:g}): "
                         "not assessable, every seed concordant (no spread): inconclusive")
        elif i == 0 and not passed:
            eq = equivalence_test(step.differences, plan.equivalence_margin, plan.equivalence_alpha)
            step = replace(step, equivalence=(eq.ci_low, eq.ci_high))
            lines.append(_equivalence_line(plan, eq))
        steps.append(step)
    return steps, lines


def analysis(runs: list[Run], plan: Plan) -> tuple[list[str], dict[str, list[Run]], list[TestedStep]]:
    """The pre-registered tests in their order (module docstring), then the per-arm reported values: (the lines,
    the arms' runs, the steps that ran)."""
    arms = arm_runs(runs, plan)
    steps, step_lines = tested_steps(arms, plan)
    lines = [f"Confirmatory analysis: {len(plan.seeds)} seeds ({', '.join(plan.seeds)}) x {len(arms)} arms: "
             + "; ".join(f"{name} = {cell_label((cell, ()))}" for name, cell in plan.arms.items()),
             *_cpu_lines(arms), *step_lines,
             "", "Reported, not tested (mean over seeds [95% t interval]):", *_reported_lines(arms, plan)]
    return lines, arms, steps


def analysis_lines(runs: list[Run], plan: Plan) -> list[str]:
    """The lines of :func:`analysis`."""
    return analysis(runs, plan)[0]


def _cpu_lines(arms: dict[str, list[Run]]) -> list[str]:
    """Which CPU ran which seeds, from the cpu_kind.txt that scripts/arith_confirm.sh writes beside each run."""
    kinds: dict[str, set[str]] = {}
    for run in (run for runs in arms.values() for run in runs):
        path = run.path / "cpu_kind.txt"
        kind = path.read_text().strip() if path.exists() else "not recorded"
        kinds.setdefault(kind, set()).add(str(run.config.get("seed")))
    return [f"CPU {kind}: seeds {', '.join(sorted(seeds, key=lambda s: s.zfill(12)))}" for kind, seeds in kinds.items()]


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """The t interval of the mean of ``values`` [S], S >= 2; the mean twice where they do not spread."""
    v = np.asarray(values, dtype=float)
    if np.ptp(v) == 0:
        return float(v[0]), float(v[0])
    low, high = stats.t.interval(confidence, v.size - 1, loc=v.mean(), scale=stats.sem(v))
    return float(low), float(high)


def _interval(values: Sequence[float]) -> str:
    v = np.asarray(values, dtype=float)
    low, high = mean_interval(v)
    return f"{v.mean():.2f} [{low:.2f}, {high:.2f}]"


def _reported_lines(arms: dict[str, list[Run]], plan: Plan) -> list[str]:
    lines = []
    for name, runs in arms.items():
        parts = []
        if plan.collapse is not None:
            rule = plan.collapse
            read = [r for r in runs if all(f"eval/{m}" in r.final for m in (rule.high, rule.low))]
            parts.append(f"collapsed ({rule.text()}) {sum(rule.collapsed(r.final) for r in read)} of {len(read)}"
                         + (f" ({len(runs) - len(read)} runs lack {rule.high} or {rule.low})" if len(read) < len(runs)
                            else ""))
        for metric in plan.reported:
            key = f"eval/{metric}"
            lacking = sum(key not in r.final for r in runs)
            scale = 100 if metric.startswith("pass@") else 1
            parts.append(f"{metric} {_interval([scale * r.final[key] for r in runs])}" if not lacking
                         else f"{metric}: not logged by {lacking} runs")
        counts = [final_counts(r) for r in runs]
        if all(c is not None for c in counts):
            problems = len(counts[0][0])
            parts.append(f"held-out problems always solved, % of {problems} "
                         f"{_interval([100 * np.mean(c[2] == c[1]) for c in counts])}")
            parts.append(f"never solved % {_interval([100 * np.mean(c[2] == 0) for c in counts])}")
        else:
            parts.append(f"always / never solved: no eval_counts.jsonl in {sum(c is None for c in counts)} runs")
        for key in ("train/adv_norm", "train/grad_norm"):
            if all(r.steps and all(key in row for row in r.steps) for r in runs):
                parts.append(f"{key}, each run's mean over its steps "
                             f"{_interval([np.mean([row[key] for row in r.steps]) for r in runs])}")
            else:
                parts.append(f"{key}: not logged at every step of every run")
        lines.append(f"- {name}: " + "; ".join(parts))
    return lines
