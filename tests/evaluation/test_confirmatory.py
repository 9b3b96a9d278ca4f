"""fgrpo.evaluation.confirmatory: the equivalence and non-inferiority tests against hand computations and scipy, the
committed plan file, the refusal before every run is in (no interim look), and the fixed test order."""

from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fgrpo.evaluation.analysis_plan import load_plan
from fgrpo.evaluation.confirmatory import analysis_lines, equivalence_test, non_inferiority_test
from fgrpo.evaluation.sweep_runs import ReportError, Run
from fgrpo.report import main

PLAN = Path(__file__).resolve().parents[2] / "docs" / "results" / "arith_confirm" / "analysis_plan.yaml"
ARMS = {"grpo": ("focal", 0.0), "fgrpo": ("focal", 1.0), "control": ("mean_focal", 1.0)}


def test_equivalence_is_two_one_sided_tests_and_the_90_interval_inside_the_margin():
    d = np.array([1.0, -0.5, 2.0, 0.5, 0.0, 1.5])
    mean, se, df = d.mean(), d.std(ddof=1) / np.sqrt(6), 5
    result = equivalence_test(d, margin=3.0, alpha=0.05)
    p_lower = stats.ttest_1samp(d, -3.0, alternative="greater").pvalue
    p_upper = stats.ttest_1samp(d, 3.0, alternative="less").pvalue
    assert result.p == pytest.approx(max(p_lower, p_upper))
    half = stats.t.ppf(0.95, df) * se
    assert (result.ci_low, result.ci_high) == pytest.approx((mean - half, mean + half))
    assert result.passed
    assert not equivalence_test(d, margin=1.0).passed  # the interval reaches past +1
    rng = np.random.default_rng(0)
    for _ in range(200):  # TOST at alpha  <=>  the (1 - 2 alpha) interval inside the margin
        draw = rng.normal(rng.uniform(-3, 3), 2.0, size=8)
        r = equivalence_test(draw, 2.5, 0.05)
        assert r.passed == (-2.5 < r.ci_low and r.ci_high < 2.5)


def test_non_inferiority_is_scipys_one_sided_test_against_minus_the_margin():
    d = np.array([-1.0, -2.5, 0.5, -1.5, -0.5, 0.0, -1.0, -2.0])
    result = non_inferiority_test(d, margin=3.0, alpha=0.01)
    assert result.p == pytest.approx(stats.ttest_1samp(d, -3.0, alternative="greater").pvalue)
    assert result.ci_low == pytest.approx(d.mean() - stats.t.ppf(0.99, 7) * d.std(ddof=1) / np.sqrt(8))
    assert result.passed == (result.ci_low > -3.0)
    assert not non_inferiority_test(d - 2.0, margin=3.0, alpha=0.01).passed
    with pytest.raises(ValueError, match="two or more differences"):
        non_inferiority_test([1.0], 3.0, 0.01)
    with pytest.raises(ValueError, match="margin > 0"):
        equivalence_test([1.0, 2.0], 0.0)


def test_the_committed_plan_is_the_pre_registration():
    plan = load_plan(PLAN)
    assert plan.seeds == tuple(str(s) for s in range(3, 19))
    assert plan.arms == {"grpo": ("grpo", "focal", 0.0), "fgrpo": ("grpo", "focal", 1.0),
                         "control": ("grpo", "mean_focal", 1.0)}
    assert (plan.primary.a, plan.primary.b, plan.primary.metric, plan.primary.alpha) == ("fgrpo", "grpo", "pass@16", 0.01)
    assert (plan.equivalence_margin, plan.equivalence_alpha) == (3.0, 0.05)
    assert [(c.a, c.b, c.metric, c.alpha, c.non_inferiority_margin) for c in plan.then] == [
        ("fgrpo", "control", "pass@16", 0.01, None), ("fgrpo", "grpo", "pass@1", 0.01, 3.0)]
    assert plan.reported == ("pass@1", "pass@2", "pass@4", "pass@8", "pass@16", "rare_nll_delta")


@pytest.mark.parametrize("change, message", [
    (("then:", "than:"), "the plan has unknown key than (known: arms, collapse, equivalence, primary, reported, seeds, then)"),
    (("b: control", "b: contrl"), "then[0].b names arm 'contrl', which arms does not define (grpo, fgrpo, control)"),
    (("non_inferiority_margin: 3", "ni_margin: 3"), "then[1] has unknown key ni_margin"),
    (("pass@1, alpha: 0.01", "pass@1, alpha: 0.05"), "then[1].alpha 0.05 is above the primary's 0.01"),
    (("margin: 3, alpha: 0.05", "margin: 0, alpha: 0.05"), "equivalence.margin must be a number in (0, inf), got 0"),
    (("seeds: [3, 4,", "seeds: [3, 3,"), "seeds must be a list of two or more different seeds"),
    (("reported: [pass@1, pass@2, pass@4, pass@8, pass@16, rare_nll_delta]", "reported: pass@1"),
     "reported must be a list of metric names"),
    (("primary: {a: fgrpo, b: grpo, metric: pass@16, alpha: 0.01}", ""), "the plan lacks primary"),
])
def test_a_bad_plan_is_refused_naming_the_key(tmp_path, change, message):
    bad = tmp_path / "plan.yaml"
    bad.write_text(PLAN.read_text().replace(*change))
    with pytest.raises(ReportError) as error:
        load_plan(bad)
    assert str(error.value).startswith(f"--confirm {bad}: {message}")
    assert str(error.value).endswith("(the format: docs/results/arith_confirm/analysis_plan.yaml)")
    assert "\n" not in str(error.value)


def make_runs(values: dict[str, list[tuple[float, float]]], seeds=range(3, 19), **extra) -> list[Run]:
    """Runs of the plan's arms: values[arm][i] = (pass@1, pass@16) of seed seeds[i], as fractions."""
    runs = []
    for arm, rows in values.items():
        method, gamma = ARMS[arm]
        for seed, (p1, p16) in zip(seeds, rows):
            config = {"algo.name": "grpo", "focal.gamma": gamma, "advantage.name": method, "seed": seed,
                      "eval.n_samples": 16, "eval.max_problems": 240, "trainer.steps": 40,
                      "eval.rare_set": "/abs/rare_set", **extra}
            final = {"step": 40, "eval/pass@1": p1, "eval/pass@16": p16, "eval/rare_nll_delta": 0.1}
            steps = [{"step": 1, "train/adv_norm": 2.0 * (method == "focal" and gamma == 0) + 1.0}]
            runs.append(Run(Path(f"/runs/{arm}_seed{seed}"), config, [final], steps=steps))
    return runs


def arm_values(rng, shift16: float, shift1: float = 0.0, seeds: int = 16) -> list[tuple[float, float]]:
    return [(0.5 + shift1 + rng.normal(0, 0.01), 0.75 + shift16 + rng.normal(0, 0.01)) for _ in range(seeds)]


def test_no_interim_look_names_the_missing_runs():
    rng = np.random.default_rng(0)
    runs = make_runs({"grpo": arm_values(rng, 0), "fgrpo": arm_values(rng, 0), "control": arm_values(rng, 0)})
    with pytest.raises(ReportError) as error:
        analysis_lines(runs[:-1], load_plan(PLAN))
    assert str(error.value) == "no interim look: 47 of 48 planned runs have finished; missing control seed 18"


def test_a_significant_primary_opens_the_follow_ups_in_order():
    rng = np.random.default_rng(1)
    values = {"grpo": arm_values(rng, 0.0), "fgrpo": arm_values(rng, 0.05, shift1=-0.01),
              "control": arm_values(rng, 0.0)}
    lines = analysis_lines(make_runs(values), load_plan(PLAN))
    mean = 100 * np.mean([f[1] - g[1] for f, g in zip(values["fgrpo"], values["grpo"])])
    assert lines[1] == "CPU not recorded: seeds " + ", ".join(str(s) for s in range(3, 19))
    assert lines[2].startswith(f"Primary: fgrpo − grpo, pass@16: mean {mean:+.2f} points, 99% interval [")
    assert "(alpha 0.01: significant, fgrpo above grpo); sign-flip p = 0.0000" in lines[2]
    assert not any(line.startswith("Equivalence") for line in lines)
    assert lines[3].startswith("Then 1: fgrpo − control, pass@16") and "significant, fgrpo above control)" in lines[3]
    assert lines[4].startswith("Then 2: fgrpo − grpo, pass@1, non-inferiority within 3 points: mean -1.")
    assert lines[4].endswith("(alpha 0.01: non-inferior)")
    grpo_line = next(line for line in lines if line.startswith("- grpo: "))
    assert f"pass@16 {100 * np.mean([v[1] for v in values['grpo']]):.2f} [" in grpo_line
    assert "rare_nll_delta 0.10 [0.10, 0.10]" in grpo_line
    assert "train/adv_norm, each run's mean over its steps 3.00 [3.00, 3.00]" in grpo_line
    assert "train/grad_norm: not logged at every step of every run" in grpo_line
    assert "pass@2: not logged by 16 runs" in grpo_line
    assert "always / never solved: no eval_counts.jsonl in 16 runs" in grpo_line


def test_a_significant_harm_says_so_and_a_failed_follow_up_stops_the_next():
    rng = np.random.default_rng(3)
    runs = make_runs({"grpo": arm_values(rng, 0.05), "fgrpo": arm_values(rng, 0.0), "control": arm_values(rng, 0.0)})
    lines = analysis_lines(runs, load_plan(PLAN))
    assert "(alpha 0.01: significant, fgrpo below grpo)" in lines[2]
    assert "(alpha 0.01: not significant)" in lines[3]  # fgrpo and the control alike
    assert lines[4] == "Then 2: fgrpo − grpo, pass@1: not tested (the test before it did not pass)"


def test_runs_that_differ_beyond_their_arms_or_repeat_a_seed_are_named():
    rng = np.random.default_rng(4)
    values = {"grpo": arm_values(rng, 0), "fgrpo": arm_values(rng, 0), "control": arm_values(rng, 0)}
    runs = make_runs(values) + make_runs({"grpo": values["grpo"][:1]}, **{"trainer.lr": 2e-5})
    with pytest.raises(ReportError, match=r"^the runs differ in more than their arms \(trainer.lr: 2e-05, None\)"):
        analysis_lines(runs, load_plan(PLAN))
    runs = make_runs(values) + make_runs({"grpo": values["grpo"][:1]})
    with pytest.raises(ReportError, match=r"^arm grpo has two finished runs of seed 3 \(/runs/grpo_seed3, "):
        analysis_lines(runs, load_plan(PLAN))


def test_a_null_primary_is_called_by_equivalence_and_stops_the_sequence():
    rng = np.random.default_rng(2)
    runs = make_runs({"grpo": arm_values(rng, 0.0), "fgrpo": arm_values(rng, 0.0), "control": arm_values(rng, 0.1)})
    lines = analysis_lines(runs, load_plan(PLAN))
    assert "(alpha 0.01: not significant)" in lines[2]
    assert lines[3].startswith("Equivalence (TOST at 0.05, margin ±3): 90% interval [")
    assert lines[3].endswith("equivalent: a null result")
    assert lines[4] == "Then 1: fgrpo − control, pass@16: not tested (the test before it did not pass)"
    assert lines[5] == "Then 2: fgrpo − grpo, pass@1: not tested (the test before it did not pass)"


def test_the_command_refuses_before_the_runs_in_one_line(tmp_path, capsys):
    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text(
        "algo: {name: grpo}\nfocal: {gamma: 0}\nseed: 3\ntrainer: {steps: 40}\n")
    assert main([str(tmp_path), "--confirm", str(PLAN)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: no interim look: 0 of 48 planned runs have finished; missing grpo seed 3, ")
    assert error.count("\n") == 1
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--confirm", str(PLAN), "--seeds", "3,4"])
    assert "--confirm runs the plan file's analysis alone" in capsys.readouterr().err


def test_the_cpu_that_ran_each_seed_is_named(tmp_path):
    from fgrpo.evaluation.confirmatory import _cpu_lines

    runs = make_runs({"grpo": arm_values(np.random.default_rng(5), 0, seeds=3)}, seeds=(3, 4, 10))
    for run in runs:
        run.path = tmp_path / run.path.name
        run.path.mkdir()
        kind = "AMD EPYC: AVX2 only" if run.config["seed"] == 4 else "AMD EPYC: avx512_bf16"
        (run.path / "cpu_kind.txt").write_text(kind + "\n")
    assert _cpu_lines({"grpo": runs}) == ["CPU AMD EPYC: avx512_bf16: seeds 3, 10", "CPU AMD EPYC: AVX2 only: seeds 4"]


def test_the_figure_draws_the_tests_the_sequence_ran_and_each_arms_pass_at_k(tmp_path):
    from fgrpo.evaluation.confirm_figure import pass_at_k_by_arm, plot_confirmatory
    from fgrpo.evaluation.confirmatory import arm_runs, tested_steps

    rng, plan = np.random.default_rng(1), load_plan(PLAN)
    values = {"grpo": arm_values(rng, 0.0), "fgrpo": arm_values(rng, 0.05, shift1=-0.01),
              "control": arm_values(rng, 0.0)}
    arms = arm_runs(make_runs(values), plan)
    steps, lines = tested_steps(arms, plan)
    assert [s.label for s in steps] == ["Primary", "Then 1", "Then 2"] and [s.line for s in steps] == lines
    assert np.allclose(steps[0].differences, [100 * (f[1] - g[1]) for f, g in zip(values["fgrpo"], values["grpo"])])
    figure = plot_confirmatory(steps, arms, plan, tmp_path / "out" / "analysis.png")
    assert (tmp_path / "out" / "analysis.png").read_bytes()[:4] == b"\x89PNG"
    left, right = figure.axes
    assert [t.get_text().split(":")[0] for t in left.get_yticklabels()] == ["Then 2", "Then 1", "Primary"]
    assert [t.get_text() for t in right.get_legend().get_texts()] == ["grpo", "fgrpo", "control"]
    curves = pass_at_k_by_arm(arms, plan)  # the plan reports pass@1..16; these runs logged 1 and 16
    assert [k for k, *_ in curves["fgrpo"]] == [1, 16]
    assert curves["fgrpo"][1][1] == pytest.approx(np.mean([v[1] for v in values["fgrpo"]]))

    rng = np.random.default_rng(2)  # a null primary: one test ran, one row drawn
    arms = arm_runs(make_runs({"grpo": arm_values(rng, 0.0), "fgrpo": arm_values(rng, 0.0),
                               "control": arm_values(rng, 0.1)}), plan)
    steps, lines = tested_steps(arms, plan)
    assert len(steps) == 1 and lines[1].startswith("Equivalence") and lines[-1].endswith("did not pass)")
    left = plot_confirmatory(steps, arms, plan, tmp_path / "null.png").axes[0]
    assert len(left.get_yticklabels()) == 1
    legend = [t.get_text() for t in left.get_legend().get_texts()]
    assert "90% t interval (equivalence)" in legend and "equivalence margin ±3" in legend
