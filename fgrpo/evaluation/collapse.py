"""A run's collapse and the exact paired test of two arms' collapse rates over seeds.

Where a pilot's runs split in two, those whose policy settled on one answer per problem (their pass@k at large k
fallen to their pass@1) and those that did not, a mean difference of pass@16 mixes how often an arm collapses with
how far, and its t-test leans on a normality the split denies. This module tests the rate itself.

Rule (:class:`CollapseRule`, fixed in the plan file before the runs): a run collapsed when its final
pass@``high`` minus its pass@``low`` is below ``gap`` points.

Test (:func:`mcnemar_exact`): seed s gives the pair (a_s, b_s) of collapsed or not. Under H0 (equal collapse rates)
a discordant seed is as likely to be "only a collapsed" as "only b collapsed", so among the m discordant seeds the
count where only a collapsed is Binomial(m, 1/2): the two-sided exact binomial test (``scipy.stats.binomtest``),
McNemar's exact test. It holds whatever the dependence between the two runs of a seed; concordant seeds carry no
information about the difference.

Power (:func:`mcnemar_power`): the exact probability of p <= alpha over the distribution of discordant counts, the
two arms' runs of a seed taken as independent given the rates (arith_confirm's same-seed runs of F-GRPO and GRPO
correlated 0.00 in pass@16: docs/results.md). Exact tests' power is not monotone in the number of pairs (a sawtooth),
so :func:`pairs_needed_mcnemar` gives the fewest pairs from which every larger count up to ``most`` reaches the power.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
from scipy import stats

MOST_COLLAPSE_PAIRS = 300  # the search range of pairs_needed_mcnemar


@dataclass(frozen=True)
class CollapseRule:
    high: str  # e.g. pass@16
    low: str  # e.g. pass@1
    gap: float  # points: collapsed when 100 * (final[high] - final[low]) < gap

    def collapsed(self, final: dict) -> bool:
        """Whether a run's final evaluation (``{"eval/pass@16": 0.52, ...}``, fractions) meets the rule."""
        return 100 * (final[f"eval/{self.high}"] - final[f"eval/{self.low}"]) < self.gap

    def text(self) -> str:
        return f"{self.high} - {self.low} below {self.gap:g} points"


@dataclass(frozen=True)
class McNemarResult:
    only_a: int  # seeds where a collapsed and b did not
    only_b: int
    both: int
    neither: int
    p: float  # two-sided exact

    @property
    def pairs(self) -> int:
        return self.only_a + self.only_b + self.both + self.neither

    @property
    def rate_difference(self) -> float:
        """a's collapse rate minus b's, in points."""
        return 100 * (self.only_a - self.only_b) / self.pairs


def mcnemar_exact(collapsed_a: Sequence[bool], collapsed_b: Sequence[bool]) -> McNemarResult:
    """The exact McNemar test over seeds (module docstring): [S] booleans each, in seed order."""
    a, b = np.asarray(collapsed_a, dtype=bool), np.asarray(collapsed_b, dtype=bool)
    if a.ndim != 1 or a.shape != b.shape or a.size < 1:
        raise ValueError(f"need two 1-d boolean arrays of one length >= 1, got shapes {a.shape} and {b.shape}")
    only_a, only_b = int(np.sum(a & ~b)), int(np.sum(~a & b))
    discordant = only_a + only_b
    p = 1.0 if discordant == 0 else float(stats.binomtest(only_a, discordant, 0.5).pvalue)
    return McNemarResult(only_a, only_b, int(np.sum(a & b)), int(np.sum(~a & ~b)), p)


@lru_cache(maxsize=4096)
def _rejecting(discordant: int, alpha: float) -> np.ndarray:
    """[discordant + 1] whether k of ``discordant`` (only a) gives the exact two-sided p <= alpha."""
    k = np.arange(discordant + 1)
    p = np.minimum(1.0, 2 * np.minimum(stats.binom.cdf(k, discordant, 0.5), stats.binom.sf(k - 1, discordant, 0.5)))
    return p <= alpha


def _rejection_probabilities(most: int, share_a: float, alpha: float) -> np.ndarray:
    """[most + 1] P(p <= alpha | m discordant seeds) for m = 0..most, a discordant seed being "only a" w.p. share_a."""
    out = np.zeros(most + 1)
    for m in range(1, most + 1):
        out[m] = stats.binom.pmf(np.arange(m + 1), m, share_a)[_rejecting(m, alpha)].sum()
    return out


def _powers(most: int, rate_a: float, rate_b: float, alpha: float) -> np.ndarray:
    """[most] the power at 1..most pairs (:func:`mcnemar_power`)."""
    if most < 1 or not (0 <= rate_a <= 1 and 0 <= rate_b <= 1) or not 0 < alpha < 1:
        raise ValueError(f"need pairs >= 1, rates in [0, 1], 0 < alpha < 1; got {most}, {rate_a}, {rate_b}, {alpha}")
    only_a, only_b = rate_a * (1 - rate_b), rate_b * (1 - rate_a)
    discordant = only_a + only_b
    if discordant == 0:
        return np.zeros(most)
    rejecting = _rejection_probabilities(most, only_a / discordant, alpha)
    m = np.arange(most + 1)
    return np.array([stats.binom.pmf(m[: n + 1], n, discordant) @ rejecting[: n + 1] for n in range(1, most + 1)])


def mcnemar_power(pairs: int, rate_a: float, rate_b: float, alpha: float) -> float:
    """P(exact McNemar p <= alpha) over ``pairs`` seeds whose runs collapse independently with these rates."""
    return float(_powers(pairs, rate_a, rate_b, alpha)[-1])


def pairs_needed_mcnemar(rate_a: float, rate_b: float, alpha: float, power: float,
                         most: int = MOST_COLLAPSE_PAIRS) -> int | None:
    """The fewest pairs from which every count up to ``most`` reaches ``power`` (None: not within ``most``)."""
    if not 0 < power < 1:
        raise ValueError(f"need 0 < power < 1, got {power}")
    reached = _powers(most, rate_a, rate_b, alpha) >= power
    if not reached[-1]:
        return None
    short = np.flatnonzero(~reached)
    return int(short[-1]) + 2 if short.size else 1


def hardest_rates(effect: float) -> tuple[float, float]:
    """The two rates ``effect`` points apart that need the most pairs: centred on one half (the discordant seeds are
    then most often split both ways)."""
    half = effect / 200
    return 0.5 + half, 0.5 - half


# ---------------------------------------------------------------- the planner over a pilot's runs


def collapse_plan_text(runs, rule: CollapseRule, *, effect: float, alpha: float, power: float) -> str:
    """``python -m fgrpo.report DIR --plan --metric collapse --collapse-gap G --effect E``: each pilot cell's runs by
    the rule (their gaps, so that a rule can be read off them), and the seed pairs the exact McNemar test needs to
    detect ``effect`` points between two collapse rates: from each cell's pilot rate, and at the hardest rates."""
    from fgrpo.evaluation.seed_stats import cell_label, config_cells
    from fgrpo.evaluation.sweep_runs import ReportError

    if not 0 < effect < 100:
        raise ReportError(f"--effect {effect:g}: a difference of collapse rates is between 0 and 100 points")
    lines = [f"Seed planner, collapse ({rule.text()}): detect {effect:g} points between two arms' collapse rates with "
             f"the exact McNemar test at alpha {alpha:g}, power {power:g} (a seed's two runs independent)"]
    for key, cell_runs in config_cells(runs).items():
        lacking = [r for r in cell_runs if not {f"eval/{rule.high}", f"eval/{rule.low}"} <= r.final.keys()]
        if lacking:
            raise ReportError(f"{lacking[0].path} logged no eval/{rule.high} or eval/{rule.low}: the rule needs both")
        gaps = sorted(100 * (r.final[f"eval/{rule.high}"] - r.final[f"eval/{rule.low}"]) for r in cell_runs)
        collapsed = sum(rule.collapsed(r.final) for r in cell_runs)
        lines.append(f"- {cell_label(key)}: collapsed {collapsed} of {len(cell_runs)}; {rule.high} - {rule.low} per "
                     "run, points: " + ", ".join(f"{g:.1f}" for g in gaps))
        rate = collapsed / len(cell_runs)
        for other in (rate - effect / 100, rate + effect / 100):
            if 0 <= other <= 1:
                lines.append(f"  from its rate {rate:.2f} to {other:.2f}: " + _needed_text(rate, other, alpha, power))
    high, low = hardest_rates(effect)
    lines.append(f"at the hardest rates, {high:.2f} against {low:.2f}: " + _needed_text(high, low, alpha, power))
    return "\n".join(lines)


def _needed_text(rate_a: float, rate_b: float, alpha: float, power: float) -> str:
    needed = pairs_needed_mcnemar(rate_a, rate_b, alpha, power)
    if needed is None:
        return (f"more than {MOST_COLLAPSE_PAIRS} pairs (power at {MOST_COLLAPSE_PAIRS}: "
                f"{mcnemar_power(MOST_COLLAPSE_PAIRS, rate_a, rate_b, alpha):.3f})")
    return f"{needed} pairs (power {mcnemar_power(needed, rate_a, rate_b, alpha):.3f})"
