"""The plan file of a pre-registered analysis (``python -m fgrpo.report DIR --confirm PLAN.yaml``), read strictly:
every key checked before any run is read, an unknown key refused (a misspelt ``then`` must not drop the follow-ups).
The committed example is docs/results/arith_confirm/analysis_plan.yaml; the analysis is
:mod:`fgrpo.evaluation.confirmatory`.

    arms:        {name: {algo: grpo, advantage: focal, gamma: 0}, ...}   # the report's cells
    seeds:       [3, 4, ...]                                             # every arm must have every one
    primary:     {a: ARM, b: ARM, metric: pass@16, alpha: 0.01}          # two-sided paired t
                 {a: ARM, b: ARM, metric: collapse, alpha: 0.01}         # or: exact McNemar on collapse rates
    collapse:    {high: pass@16, low: pass@1, gap: 5}                    # with metric collapse: the rule
    equivalence: {margin: 3, alpha: 0.05}                                # TOST: the only way to call a null
    then:        [{a, b, metric, alpha, [non_inferiority_margin]}, ...]  # in order, each if the one before passed
    reported:    [pass@1, rare_nll_delta, ...]                           # per arm, untested
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from fgrpo.evaluation.collapse import CollapseRule
from fgrpo.evaluation.sweep_runs import ReportError

EXAMPLE = "docs/results/arith_confirm/analysis_plan.yaml"
_TOP_KEYS = {"arms": True, "seeds": True, "primary": True, "equivalence": True, "then": False, "reported": False,
             "collapse": False}
COLLAPSE = "collapse"  # the metric of a comparison of collapse rates (fgrpo.evaluation.collapse)
_COMPARISON_KEYS = {"a", "b", "metric", "alpha", "non_inferiority_margin"}


@dataclass(frozen=True)
class Comparison:
    a: str  # arm names: the test is on a - b
    b: str
    metric: str  # e.g. pass@16 (the runs' final eval/<metric>, in points)
    alpha: float
    non_inferiority_margin: float | None = None  # set: one-sided non-inferiority within it, not superiority


@dataclass(frozen=True)
class Plan:
    arms: dict[str, tuple[str, str, float]]  # name -> (algo, advantage method, gamma): the report's cell
    seeds: tuple[str, ...]
    primary: Comparison
    equivalence_margin: float
    equivalence_alpha: float
    then: tuple[Comparison, ...]
    reported: tuple[str, ...]
    collapse: CollapseRule | None = None  # the rule of the comparisons whose metric is "collapse"


class _PlanError(ValueError):
    pass


def _mapping(value, where: str, keys: set[str], required: set[str]) -> dict:
    if not isinstance(value, dict):
        raise _PlanError(f"{where} must be a mapping, got {value!r}")
    unknown, missing = sorted(set(value) - keys), sorted(required - set(value))
    if unknown:
        raise _PlanError(f"{where} has unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(str, unknown))} "
                         f"(known: {', '.join(sorted(keys))})")
    if missing:
        raise _PlanError(f"{where} lacks {', '.join(missing)}")
    return value


def _number(value, where: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
        raise _PlanError(f"{where} must be a number in ({low:g}, {high:g}), got {value!r}")
    return float(value)


def _comparison(raw, where: str, arms: dict) -> Comparison:
    c = _mapping(raw, where, _COMPARISON_KEYS, {"a", "b", "metric", "alpha"})
    for side in ("a", "b"):
        if c[side] not in arms:
            raise _PlanError(f"{where}.{side} names arm {c[side]!r}, which arms does not define "
                             f"({', '.join(arms)})")
    margin = c.get("non_inferiority_margin")
    return Comparison(str(c["a"]), str(c["b"]), str(c["metric"]), _number(c["alpha"], f"{where}.alpha", 0, 0.5),
                      None if margin is None else _number(margin, f"{where}.non_inferiority_margin", 0, float("inf")))


def _collapse_rule(raw) -> CollapseRule:
    rule = _mapping(raw, "collapse", {"high", "low", "gap"}, {"high", "low", "gap"})
    ks = []
    for side in ("high", "low"):
        match = re.fullmatch(r"pass@(\d+)", str(rule[side]))
        if not match:
            raise _PlanError(f"collapse.{side} must be a pass@k metric, e.g. pass@16, got {rule[side]!r}")
        ks.append(int(match.group(1)))
    if ks[0] <= ks[1]:
        raise _PlanError(f"collapse.high ({rule['high']}) must be a larger k than collapse.low ({rule['low']})")
    return CollapseRule(str(rule["high"]), str(rule["low"]), _number(rule["gap"], "collapse.gap", 0, 100))


def _check_collapse_comparisons(comparisons: list[Comparison], rule: CollapseRule | None, names: list[str]) -> None:
    for c, where in zip(comparisons, names):
        if c.metric != COLLAPSE:
            continue
        if rule is None:
            raise _PlanError(f"{where}.metric is collapse but the plan has no collapse rule: add "
                             "collapse: {high: pass@16, low: pass@1, gap: 5}")
        if c.non_inferiority_margin is not None:
            raise _PlanError(f"{where}: a collapse rate is tested by the exact McNemar test, which has no "
                             "non-inferiority form here: leave out non_inferiority_margin")


def parse_plan(raw) -> Plan:
    """A Plan from the loaded YAML; raises _PlanError naming the first bad key."""
    top = _mapping(raw, "the plan", set(_TOP_KEYS), {k for k, required in _TOP_KEYS.items() if required})
    if not isinstance(top["arms"], dict) or len(top["arms"]) < 2:
        raise _PlanError(f"arms must map two or more names to cells, got {top['arms']!r}")
    arms = {}
    for name, cell in top["arms"].items():
        cell = _mapping(cell, f"arms.{name}", {"algo", "advantage", "gamma"}, {"algo", "advantage", "gamma"})
        arms[str(name)] = (str(cell["algo"]), str(cell["advantage"]),
                           _number(cell["gamma"], f"arms.{name}.gamma", -1e-12, float("inf")))
    seeds = top["seeds"]
    if not isinstance(seeds, list) or len(seeds) < 2 or len({str(s) for s in seeds}) != len(seeds):
        raise _PlanError(f"seeds must be a list of two or more different seeds, got {seeds!r}")
    primary = _comparison(top["primary"], "primary", arms)
    equivalence = _mapping(top["equivalence"], "equivalence", {"margin", "alpha"}, {"margin", "alpha"})
    then = top.get("then") or []
    if not isinstance(then, list):
        raise _PlanError(f"then must be a list of comparisons, got {then!r}")
    follow_ups = tuple(_comparison(c, f"then[{i}]", arms) for i, c in enumerate(then))
    for i, c in enumerate(follow_ups):  # a fixed sequence keeps the family-wise error at the primary's alpha
        if c.alpha > primary.alpha:
            raise _PlanError(f"then[{i}].alpha {c.alpha:g} is above the primary's {primary.alpha:g}: a fixed "
                             "sequence keeps the family-wise error at the primary's alpha only with follow-ups at or "
                             "below it")
    rule = _collapse_rule(top["collapse"]) if top.get("collapse") is not None else None
    _check_collapse_comparisons([primary, *follow_ups], rule,
                                ["primary", *(f"then[{i}]" for i in range(len(follow_ups)))])
    reported = top.get("reported") or []
    if not isinstance(reported, list) or not all(isinstance(m, str) for m in reported):
        raise _PlanError(f"reported must be a list of metric names, e.g. [pass@1, rare_nll_delta], got {reported!r}")
    return Plan(arms, tuple(str(s) for s in seeds), primary,
                _number(equivalence["margin"], "equivalence.margin", 0, float("inf")),
                _number(equivalence["alpha"], "equivalence.alpha", 0, 0.5), follow_ups, tuple(reported), rule)


def load_plan(path: Path) -> Plan:
    """Read and check a plan file; raises ReportError (one line) naming the file and the bad key."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ReportError(f"--confirm {path}: cannot read the plan ({' '.join(str(error).split())})") from None
    try:
        return parse_plan(raw)
    except _PlanError as error:
        raise ReportError(f"--confirm {path}: {error} (the format: {EXAMPLE})") from None
