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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy import stats

from fgrpo.evaluation.seed_stats import (cell_label, check_same_eval_settings, config_cells, final_counts,
                                         paired_seed_test)
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
    return d, float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size)), d.size - 1


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


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Comparison:
    a: str  # arm names
    b: str
    metric: str  # e.g. pass@16 (the runs' final eval/<metric>, in points)
    alpha: float
    non_inferiority_margin: float | None = None  # set: a one-sided non-inferiority test instead of superiority


@dataclass(frozen=True)
class Plan:
    arms: dict[str, tuple[str, str, float]]  # name -> (algo, advantage method, gamma): the report's cell
    seeds: tuple[str, ...]
    primary: Comparison
    equivalence_margin: float
    equivalence_alpha: float
    then: tuple[Comparison, ...]
    reported: tuple[str, ...]  # metrics shown per arm, untested


def load_plan(path: Path) -> Plan:
    """Read a plan file (module docstring; the committed example: docs/results/arith_confirm/analysis_plan.yaml).
    Raises ReportError naming the first missing or wrong key."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ReportError(f"--confirm {path}: cannot read the plan ({error})") from None
    try:
        arms = {name: (str(a["algo"]), str(a["advantage"]), float(a["gamma"])) for name, a in raw["arms"].items()}
        comparisons = [raw["primary"], *raw.get("then", [])]
        parsed = [Comparison(str(c["a"]), str(c["b"]), str(c["metric"]), float(c["alpha"]),
                             None if c.get("non_inferiority_margin") is None else float(c["non_inferiority_margin"]))
                  for c in comparisons]
        plan = Plan(arms, tuple(str(s) for s in raw["seeds"]), parsed[0], float(raw["equivalence"]["margin"]),
                    float(raw["equivalence"]["alpha"]), tuple(parsed[1:]), tuple(raw.get("reported", [])))
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ReportError(f"--confirm {path}: the plan lacks or mistypes {error}; it needs arms, seeds, primary, "
                          "equivalence (margin, alpha) and may have then and reported "
                          "(see docs/results/arith_confirm/analysis_plan.yaml)") from None
    unknown = sorted({name for c in (plan.primary, *plan.then) for name in (c.a, c.b)} - set(arms))
    if unknown:
        raise ReportError(f"--confirm {path}: the comparisons name arms {', '.join(unknown)} that arms does not define")
    return plan


# ---------------------------------------------------------------- the analysis, from runs


def arm_runs(runs: list[Run], plan: Plan) -> dict[str, dict[str, Run]]:
    """{arm: {seed: run}} of the completed runs; raises ReportError naming every missing run (no interim look)."""
    check_same_eval_settings(runs)
    by_cell: dict = {}
    for (cell, extra), cell_runs in config_cells(runs).items():
        if cell in by_cell or extra:
            raise ReportError(f"the runs of {cell_label((cell, ()))} differ in {', '.join(extra) or 'other keys'}: "
                              "point --confirm at the confirmatory runs only")
        by_cell[cell] = cell_runs
    out, missing = {}, []
    for name, cell in plan.arms.items():
        have = {str(r.config.get("seed")): r for r in by_cell.get(cell, [])}
        out[name] = {seed: have[seed] for seed in plan.seeds if seed in have}
        missing += [f"{name} seed {seed}" for seed in plan.seeds if seed not in have]
    if missing:
        done = sum(len(v) for v in out.values())
        raise ReportError(f"no interim look: {done} of {len(plan.seeds) * len(plan.arms)} planned runs have finished; "
                          f"missing {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    return out


def _values(arms: dict[str, dict[str, Run]], arm: str, metric: str, seeds: Sequence[str]) -> np.ndarray:
    try:
        return np.array([100 * arms[arm][s].final[f"eval/{metric}"] for s in seeds])
    except KeyError:
        raise ReportError(f"the plan's metric {metric}: a run of {arm} logged no eval/{metric}") from None


def _superiority_line(step: str, c: Comparison, d_a: np.ndarray, d_b: np.ndarray) -> tuple[str, bool]:
    test = paired_seed_test(d_a, d_b, confidence=1 - c.alpha)
    significant = test.t_p < c.alpha
    return (f"{step}: {c.a} − {c.b}, {c.metric}: mean {test.mean:+.2f} points, {100 * (1 - c.alpha):g}% interval "
            f"[{test.ci_low:+.2f}, {test.ci_high:+.2f}], paired t p = {test.t_p:.4f} (alpha {c.alpha:g}: "
            f"{'significant' if significant else 'not significant'}); sign-flip p = {test.sign_flip_p:.4f}",
            significant)


def analysis_lines(runs: list[Run], plan: Plan) -> list[str]:
    """The pre-registered tests in their order (module docstring), then the per-arm reported metrics."""
    arms = arm_runs(runs, plan)
    seeds = list(plan.seeds)
    lines = [f"Confirmatory analysis: {len(seeds)} seeds ({', '.join(seeds)}) x {len(arms)} arms: "
             + "; ".join(f"{name} = {cell_label((cell, ()))}" for name, cell in plan.arms.items())]
    p = plan.primary
    line, significant = _superiority_line("Primary", p, _values(arms, p.a, p.metric, seeds),
                                          _values(arms, p.b, p.metric, seeds))
    lines.append(line)
    if not significant:
        d = _values(arms, p.a, p.metric, seeds) - _values(arms, p.b, p.metric, seeds)
        eq = equivalence_test(d, plan.equivalence_margin, plan.equivalence_alpha)
        verdict = ("equivalent: a null result" if eq.passed else "not equivalent either: inconclusive")
        lines.append(f"Equivalence (TOST at {plan.equivalence_alpha:g}, margin ±{plan.equivalence_margin:g}): "
                     f"{100 * (1 - 2 * plan.equivalence_alpha):g}% interval [{eq.ci_low:+.2f}, {eq.ci_high:+.2f}], "
                     f"p = {eq.p:.4f}: {verdict}")
    for i, c in enumerate(plan.then, start=1):
        if not significant:
            lines.append(f"Then {i}: {c.a} − {c.b}, {c.metric}: not tested (the test before it was not significant)")
            continue
        a, b = _values(arms, c.a, c.metric, seeds), _values(arms, c.b, c.metric, seeds)
        if c.non_inferiority_margin is None:
            line, significant = _superiority_line(f"Then {i}", c, a, b)
        else:
            ni = non_inferiority_test(a - b, c.non_inferiority_margin, c.alpha)
            significant = ni.passed
            line = (f"Then {i}: {c.a} − {c.b}, {c.metric}, non-inferiority within {c.non_inferiority_margin:g} points: "
                    f"mean {ni.mean:+.2f}, one-sided {100 * (1 - c.alpha):g}% lower bound {ni.ci_low:+.2f}, "
                    f"p = {ni.p:.4f} (alpha {c.alpha:g}: {'non-inferior' if ni.passed else 'not shown'})")
        lines.append(line)
    lines += ["", "Reported, not tested (mean over seeds [95% t interval]):", *_reported_lines(arms, plan)]
    return lines


def _interval(values: Sequence[float]) -> str:
    v = np.asarray(values, dtype=float)
    half = float(stats.t.ppf(0.975, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else float("nan")
    return f"{v.mean():.2f} [{v.mean() - half:.2f}, {v.mean() + half:.2f}]"


def _reported_lines(arms: dict[str, dict[str, Run]], plan: Plan) -> list[str]:
    lines = []
    for name, by_seed in arms.items():
        runs = [by_seed[s] for s in plan.seeds]
        parts = []
        for metric in plan.reported:
            key = f"eval/{metric}"
            if all(key in r.final for r in runs):
                scale = 100 if metric.startswith("pass@") else 1
                parts.append(f"{metric} {_interval([scale * r.final[key] for r in runs])}")
        counts = [final_counts(r) for r in runs]
        if all(c is not None for c in counts):
            parts.append(f"always solved {_interval([np.sum(c[2] == c[1]) for c in counts])}")
            parts.append(f"never solved {_interval([np.sum(c[2] == 0) for c in counts])}")
        for key in ("train/adv_norm", "train/grad_norm"):
            if all(r.steps and all(key in row for row in r.steps) for r in runs):
                parts.append(f"mean {key} {_interval([np.mean([row[key] for row in r.steps]) for r in runs])}")
        lines.append(f"- {name}: " + "; ".join(parts))
    return lines
