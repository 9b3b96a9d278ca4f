"""fgrpo.evaluation.collapse: the exact McNemar test against a hand count and scipy, its power against simulation and
at the null, the pairs it needs, the plan file's collapse rule and a collapse primary through the analysis, and the
planner's text from a pilot's runs."""

import re

import numpy as np
import pytest
from scipy import stats

from fgrpo.evaluation.analysis_plan import load_plan
from fgrpo.evaluation.collapse import (CollapseRule, collapse_plan_text, hardest_rates, mcnemar_exact, mcnemar_power,
                                       pairs_needed_mcnemar)
from fgrpo.evaluation.confirmatory import analysis_lines
from fgrpo.evaluation.sweep_runs import ReportError
from fgrpo.report import main
from test_confirmatory import PLAN, make_runs

COLLAPSE_PLAN = PLAN.read_text().replace(
    "primary: {a: fgrpo, b: grpo, metric: pass@16, alpha: 0.01}",
    "primary: {a: fgrpo, b: grpo, metric: collapse, alpha: 0.01}\ncollapse: {high: pass@16, low: pass@1, gap: 5}")


def test_mcnemar_counts_the_discordant_seeds_and_is_scipys_binomial_test_on_them():
    a = [True, False, False, False, True, False, False]
    b = [True, True, True, True, True, False, True]
    result = mcnemar_exact(a, b)
    assert (result.only_a, result.only_b, result.both, result.neither) == (0, 4, 2, 1)
    assert result.p == pytest.approx(2 * 0.5 ** 4)  # none of 4 discordant seeds one way, two-sided
    assert result.rate_difference == pytest.approx(100 * (2 / 7 - 6 / 7))
    rng = np.random.default_rng(0)
    for _ in range(50):
        x, y = rng.random(30) < 0.6, rng.random(30) < 0.3
        r = mcnemar_exact(x, y)
        assert r.p == pytest.approx(stats.binomtest(int(np.sum(x & ~y)), int(np.sum(x != y)), 0.5).pvalue)
        assert mcnemar_exact(y, x).p == pytest.approx(r.p)  # two-sided: symmetric
    assert mcnemar_exact([True, False], [True, False]).p == 1.0  # no discordant seed
    with pytest.raises(ValueError, match="one length"):
        mcnemar_exact([True], [True, False])


def test_the_rejection_regions_are_scipys_exact_p_at_or_below_alpha():
    from fgrpo.evaluation.collapse import _rejecting

    for m in range(1, 41):
        for alpha in (0.01, 0.05, 1 / 16):
            expected = [stats.binomtest(k, m, 0.5).pvalue <= alpha for k in range(m + 1)]
            assert _rejecting(m, alpha).tolist() == expected, (m, alpha)


def test_the_power_is_the_rejection_rate_of_simulated_seeds_and_at_most_alpha_under_the_null():
    rng = np.random.default_rng(1)
    for pairs, rate_a, rate_b in [(30, 0.4, 0.8), (20, 0.3, 0.6)]:
        trials = 4000
        rejected = sum(mcnemar_exact(rng.random(pairs) < rate_a, rng.random(pairs) < rate_b).p <= 0.05
                       for _ in range(trials))
        assert mcnemar_power(pairs, rate_a, rate_b, 0.05) == pytest.approx(rejected / trials, abs=0.025)
    for rate in (0.1, 0.5, 0.8):  # exact: the size never exceeds alpha
        assert all(mcnemar_power(n, rate, rate, 0.01) <= 0.01 for n in (5, 20, 60))


def test_the_pairs_needed_reach_the_power_from_there_on_and_the_centre_is_hardest():
    needed = pairs_needed_mcnemar(0.4, 0.8, 0.01, 0.9)
    powers = [mcnemar_power(n, 0.4, 0.8, 0.01) for n in range(needed - 3, needed + 15)]
    assert powers[3] >= 0.9 and min(powers[3:]) >= 0.9 and powers[2] < 0.9
    assert hardest_rates(30) == pytest.approx((0.65, 0.35))
    assert pairs_needed_mcnemar(*hardest_rates(40), 0.01, 0.9) >= pairs_needed_mcnemar(0.9, 0.5, 0.01, 0.9)
    assert pairs_needed_mcnemar(0.5, 0.52, 0.01, 0.9) is None  # not within the search range


def test_the_rule_reads_a_runs_final_pass_at_k():
    rule = CollapseRule("pass@16", "pass@1", 5.0)
    assert rule.collapsed({"eval/pass@16": 0.54, "eval/pass@1": 0.50})
    assert not rule.collapsed({"eval/pass@16": 0.56, "eval/pass@1": 0.50})
    assert rule.text() == "pass@16 - pass@1 below 5 points"


@pytest.mark.parametrize("change, message", [
    (("collapse: {high: pass@16, low: pass@1, gap: 5}", ""), "primary.metric is collapse but the plan has no collapse"),
    (("gap: 5}", "gap: 0}"), "collapse.gap must be a number in (0, 100), got 0"),
    (("low: pass@1,", "low: pass@32,"), "collapse.high (pass@16) must be a larger k than collapse.low (pass@32)"),
    (("high: pass@16,", "high: top16,"), "collapse.high must be a pass@k metric"),
    (("{a: fgrpo, b: grpo, metric: pass@1, alpha: 0.01, non_inferiority_margin: 3}",
      "{a: fgrpo, b: grpo, metric: collapse, alpha: 0.01, non_inferiority_margin: 3}"),
     "then[1]: a collapse rate is tested by the exact McNemar test"),
])
def test_a_bad_collapse_plan_is_refused_naming_the_key(tmp_path, change, message):
    bad = tmp_path / "plan.yaml"
    bad.write_text(COLLAPSE_PLAN.replace(*change))
    with pytest.raises(ReportError, match="^--confirm .*: " + re.escape(message)):
        load_plan(bad)


def split_runs(collapsed: int, seeds: int = 16) -> list[tuple[float, float]]:
    """(pass@1, pass@16) per seed: the first ``collapsed`` runs collapsed (gap 1 point), the rest not (gap 30)."""
    return [(0.55, 0.56) if i < collapsed else (0.58, 0.88) for i in range(seeds)]


def test_a_collapse_primary_runs_the_exact_test_and_reports_each_arms_rate(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(COLLAPSE_PLAN)
    plan = load_plan(path)
    assert plan.collapse == CollapseRule("pass@16", "pass@1", 5.0)
    grpo, fgrpo = split_runs(14), split_runs(2)  # F-GRPO collapsed on the first two seeds only
    lines = analysis_lines(make_runs({"grpo": grpo, "fgrpo": fgrpo, "control": split_runs(8)}), plan)
    p = stats.binomtest(0, 12, 0.5).pvalue
    assert lines[2].startswith("Primary: fgrpo − grpo, collapse rate (pass@16 - pass@1 below 5 points): fgrpo 2 of 16, "
                               "grpo 14 of 16, difference -75.0 points; discordant seeds: only fgrpo collapsed 0, only "
                               f"grpo 12; exact McNemar p = {p:.4f} (alpha 0.01: significant, fgrpo collapsed less "
                               "often than grpo); 99% paired t interval of the difference (approximate) [")
    assert lines[3].startswith("Then 1: fgrpo − control, pass@16")  # the follow-ups as planned
    assert "- grpo: collapsed (pass@16 - pass@1 below 5 points) 14 of 16; pass@1 " in lines[lines.index("") + 2]
    even = analysis_lines(make_runs({"grpo": split_runs(8), "fgrpo": split_runs(8)[::-1], "control": split_runs(8)}),
                          plan)
    assert "exact McNemar p = 1.0000 (alpha 0.01: not significant)" in even[2]
    assert even[3].startswith("Equivalence (TOST at 0.05, margin ±3): 90% interval [")  # in points of the rate
    alike = analysis_lines(make_runs({"grpo": split_runs(0), "fgrpo": split_runs(0), "control": split_runs(0)}), plan)
    assert alike[3] == ("Equivalence (TOST at 0.05, margin ±3): not assessable, every seed concordant (no spread): "
                        "inconclusive")  # 0 of 16 each: the rates may still differ


def test_the_planner_reads_the_pilots_gaps_and_sizes_the_exact_test(tmp_path, capsys):
    runs = make_runs({"grpo": split_runs(3, seeds=4), "fgrpo": split_runs(1, seeds=4)}, seeds=range(4))
    text = collapse_plan_text(runs, CollapseRule("pass@16", "pass@1", 5.0), effect=40, alpha=0.01, power=0.9)
    lines = text.splitlines()
    assert lines[0].startswith("Seed planner, collapse (pass@16 - pass@1 below 5 points): detect 40 points")
    grpo = lines.index(next(line for line in lines if line.startswith("- grpo, gamma=0: ")))
    assert "collapsed 3 of 4; pass@16 - pass@1 per run, points: 1.0, 1.0, 1.0, 30.0" in lines[grpo]
    assert lines[grpo + 1].startswith(f"  from its rate 0.75 to 0.35: {pairs_needed_mcnemar(0.75, 0.35, 0.01, 0.9)} ")
    assert lines[-1].startswith(f"at the hardest rates, 0.70 against 0.30: "
                                f"{pairs_needed_mcnemar(0.7, 0.3, 0.01, 0.9)} pairs (power 0.9")
    for argv, message in [(["--metric", "collapse"], "--metric collapse needs --collapse-gap G"),
                          (["--metric", "collapse", "--collapse-gap", "5", "--collapse-high", "pass@1"],
                           "--collapse-high must be pass@k with k > 1"),
                          (["--collapse-gap", "5"], "--collapse-gap goes with --metric collapse")]:
        with pytest.raises(SystemExit):
            main([str(tmp_path), "--plan", "--effect", "40", *argv])
        assert message in capsys.readouterr().err
