"""The shipped experiments of docs/results.md and docs/pilot.md compose to their documented settings and run end to
end."""

import json
import re
from pathlib import Path

from fgrpo.rollout.data import arithmetic_problems
from fgrpo.infra.run_files import COUNTS_FILE, read_jsonl, read_metrics
from test_run import run_cli

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "arith_headroom"  # committed in docs/pilot.md
CONFIRM = RESULTS.parent / "arith_confirm"  # the pre-registered confirmatory run that docs/results.md leads with


def _report_of(runs: Path, tmp_path, **options) -> tuple[str, str]:
    """The report over committed runs: its printed table (the text before the first blank line) and report.md."""
    from fgrpo.report import report

    table = report(runs, tmp_path, **options).split("\n\n")[0]
    return table, (tmp_path / "report.md").read_text()


def _md_table(md: str) -> dict:
    """The first table of report.md (rows algo x advantage x gamma): {(algo, advantage, gamma): the other cells}."""
    rows = {}
    for line in md.split("## Over seeds")[0].splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ("grpo", "dapo", "cispo"):
            rows[tuple(cells[:3])] = " ".join(" ".join(cells[3:]).replace("*", "").split())
    return rows


def test_arith_headroom_composes_to_its_documented_settings(compose):
    cfg = compose("experiment=arith_headroom", "focal.gamma=1.0", "seed=2")
    assert cfg.model.name == "smollm2_135m" and cfg.algo.name == "grpo" and cfg.dataset.kind == "arithmetic"
    assert list(cfg.dataset.arithmetic.ops) == ["+", "-", "*"] and cfg.dataset.arithmetic.max_operand == 19
    assert (cfg.eval.n_samples, cfg.eval.max_problems, cfg.eval.every) == (64, 60, 0)
    assert cfg.hardware.autocast_dtype is None and cfg.hardware.sampler_dtype == "float32"  # any CPU: one precision
    assert cfg.trainer.steps == 40 and cfg.focal.gamma == 1.0 and cfg.seed == 2  # sweep keys still apply
    train, held_out = arithmetic_problems(ops=cfg.dataset.arithmetic.ops, max_operand=19, n_eval=60)
    assert (len(train), len(held_out)) == (1140, 60)  # every held-out problem is evaluated
    assert all(any(op in p.id for p in held_out) for op in "+-*")  # operands are >= 0: the op's sign is its own


def test_arith_confirm_composes_to_its_preregistered_settings(compose):
    # docs/results.md, "Pre-registration": 240 held-out problems, a superset of arith_headroom's 60, at 16 samples;
    # four updates per batch; the three arms from the command line
    arms = {"focal.gamma=0": ("focal", 0.0), "focal.gamma=1": ("focal", 1.0), "advantage=mean_focal": ("mean_focal", 1.0)}
    for arm, (method, gamma) in arms.items():
        cfg = compose("experiment=arith_confirm", arm, "seed=3")
        assert (cfg.advantage.name, cfg.focal.gamma, cfg.seed) == (method, gamma, 3)
        assert cfg.algo.name == "grpo" and cfg.trainer.mini_batches == 4 and cfg.trainer.steps == 40
        assert (cfg.eval.n_samples, cfg.eval.max_problems, cfg.eval.every, cfg.eval.before) == (16, 240, 0, False)
        assert cfg.hardware.autocast_dtype is None and cfg.hardware.sampler_dtype == "float32"
    train, held_out = arithmetic_problems(ops=cfg.dataset.arithmetic.ops, max_operand=19, n_eval=240)
    _, pilot_held_out = arithmetic_problems(ops=cfg.dataset.arithmetic.ops, max_operand=19, n_eval=60)
    assert (len(train), len(held_out)) == (960, 240) and held_out[:60] == pilot_held_out


def test_countdown_pilot_holds_out_240_of_all_483_problems_and_evaluates_the_first_120(compose):
    # conf/experiment/countdown_pilot.yaml (issue 74's pilot): the README's Countdown task with every distinct
    # problem, 30 steps at lr 1e-5, fp32, evaluated once after training at 32 samples a problem
    import importlib.util

    arms = {("focal.gamma=0",): ("focal", 0.0), ("focal.gamma=1",): ("focal", 1.0),
            ("advantage=mean_focal", "focal.gamma=1"): ("mean_focal", 1.0)}  # as scripts/countdown_pilot.sh runs them
    for arm, (method, gamma) in arms.items():
        cfg = compose("experiment=countdown_pilot", *arm, "seed=2")
        assert (cfg.advantage.name, cfg.focal.gamma, cfg.seed, cfg.algo.name) == (method, gamma, 2, "grpo")
        assert (cfg.trainer.steps, cfg.trainer.lr, cfg.trainer.mini_batches) == (30, 1e-5, 1)
        assert (cfg.eval.n_samples, cfg.eval.max_problems, cfg.eval.every, cfg.eval.before) == (32, 120, 0, False)
        assert cfg.hardware.autocast_dtype is None and cfg.hardware.sampler_dtype == "float32"
    spec = importlib.util.spec_from_file_location("countdown", Path(__file__).parents[1] / "examples/countdown/countdown.py")
    countdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(countdown)
    args = dict(cfg.dataset.generator_args)
    rows = countdown.generate(**args)
    held_out, train = rows[: cfg.dataset.generator_n_eval], rows[cfg.dataset.generator_n_eval:]
    assert (len(held_out), len(train)) == (240, 243)
    assert not {(r["numbers"], r["target"]) for r in held_out} & {(r["numbers"], r["target"]) for r in train}
    assert rows[:60] == countdown.generate(**{**args, "count": 300})[:60]  # the README's 60 held-out problems first
    try:
        countdown.generate(**{**args, "count": 484})
        raise AssertionError("483 is every distinct problem of these settings")
    except ValueError as error:
        assert "only 483 distinct problems" in str(error)


def test_the_countdown_pilot_runs_give_the_plan_docs_countdown_pilot_states():
    """docs/countdown-pilot.md's plan is the planner's output on the committed pilot runs: the variance split, the
    pairs for 5 points of pass@16 at alpha 0.01 and power 0.9 (at the sd and at its upper limit), the collapse test's."""
    from fgrpo.report import stats_report

    runs, page = RESULTS.parent / "countdown_pilot" / "runs", (RESULTS.parents[1] / "countdown-pilot.md").read_text()
    split = stats_report(runs, variance=True).splitlines()
    assert split[4].split()[:2] == ["pass@16", "6.96"] and "6%" in split[4]  # pooled seed sd; problem-level share
    plan = stats_report(runs, plan={"effect": 5.0, "alpha": 0.01, "power": 0.9, "metric": "pass@16"})
    assert "sd of a per-seed difference: 10.40 points (the pooled sd of the per-seed paired differences, 4 df" in plan
    assert "\nseed pairs needed: 68 (" in plan and "upper confidence limit (4 df): 16.19 points" in plan
    assert "at the upper limit: seed pairs needed: more than 100" in plan
    collapse = stats_report(runs, plan={"effect": 33.0, "alpha": 0.01, "power": 0.9, "metric": "collapse",
                                        "collapse_gap": 5.0, "collapse_high": "pass@16"})
    assert "collapsed 1 of 3" in collapse and "collapsed 0 of 3" in collapse and "to 0.00: 35 pairs" in collapse
    for stated in ("pooled seed-to-seed sd is 6.96 points", "10.40 points, on 4 df.", "At that sd: **68 pairs**",
                   "upper confidence limit (16.19 points): more than 100 pairs", "needs 35 pairs"):
        assert stated in " ".join(page.split()), stated


def test_the_committed_runs_compose_again_to_what_they_ran(compose):
    """A default changed later must not change a shipped experiment: each committed run's overrides compose to its
    saved config, by the comparison a resume makes (the keys that change what is learned)."""
    import yaml
    from omegaconf import OmegaConf

    from fgrpo.config import experiment_differences, to_container

    pilot = RESULTS.parent / "countdown_pilot" / "runs" / "fgrpo_seed2"  # the Countdown pilot (docs/countdown-pilot.md)
    for run in [CONFIRM / "runs" / "grpo_seed3", CONFIRM / "runs" / "control_seed10", pilot,
                *sorted((RESULTS / "runs").iterdir())[:1]]:
        # Hydra saves the config unresolved (a generator's tasks_seed: '${seed}'); the run resolved it
        saved = OmegaConf.to_container(OmegaConf.create(yaml.safe_load((run / ".hydra" / "config.yaml").read_text())),
                                       resolve=True)
        overrides = [o for o in yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
                     if not o.startswith("eval.rare_set=")]  # a path on the machine that ran it
        cfg = compose(*overrides)
        cfg.sampler.name = saved["sampler"]["name"]  # auto settles to vllm where vLLM is installed, as it was there
        assert experiment_differences(saved, to_container(cfg)) == [], run.name


def test_arith_headroom_one_step_smoke_run_on_tiny_random(tmp_path):
    """The experiment's own data and evaluation at tiny_random sizes: one step, evaluated before and after."""
    result = run_cli(tmp_path, "experiment=arith_headroom", "model=tiny_random", "sampler=hf", "logger=none",
                     "trainer.steps=1", "trainer.prompts_per_step=2", "algo.group_size=4", "eval.n_samples=4",
                     "eval.max_problems=3", "sampler.max_new_tokens=8", "focal.gamma=1.0",
                     "hardware.compile_learner=false", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 1]
    counts = [row for _, row in read_jsonl(tmp_path / COUNTS_FILE)]
    assert len(counts) == 2 * 3 and {row["n"] for row in counts} == {4}
    assert all(row["problem"].startswith("arithmetic/") for row in counts)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "eval/pass@4" in summary


def test_the_committed_arith_headroom_runs_report_the_numbers_of_docs_results(tmp_path):
    """docs/pilot.md quotes the report over the runs kept in the repository; they must still report the same."""
    _, md = _report_of(RESULTS / "runs", tmp_path)
    rows = _md_table(md)
    assert rows[("grpo", "focal", "0")] == "3 56.2 +- 5.2 77.2 +- 6.3 ref ref"
    assert rows[("grpo", "focal", "1")] == "3 57.4 +- 4.2 83.3 +- 6.0 +1.2 (p=0.0034) +3.0 (p=0.0002)"
    assert len(rows) == 7  # with the five other advantage methods, two seeds each
    assert "| grpo | focal | 1 | 0, 1, 2 | 53.7, 62.0, 56.5 | +1.2 (p=0.7000) | 81.7, 78.3, 90.0 | +6.1 (p=0.5000) |" in md
    assert "| grpo | focal | 0 | 0 | 11.9 → 55.6 | 71.7 → 81.7 | 17 → 11 | +0.533 |" in md
    assert "| grpo | focal | 1 | 0 | — → 53.7 | — → 81.7 | — → 11 | +0.362 |" in md
    assert "| grpo | focal | 0 | 2 | — → 51.3 | — → 70.0 | — → 18 | +0.455 |" in md
    assert "| grpo | focal | 1 | 2 | — → 56.5 | — → 90.0 | — → 6 | +0.372 |" in md


def test_the_advantage_methods_over_seeds_0_and_1_report_the_numbers_of_docs_results(tmp_path):
    """docs/pilot.md, "Against its neighbours": the report over seeds 0 and 1 gives the quoted pooled differences."""
    _, md = _report_of(RESULTS / "runs", tmp_path, seeds=["0", "1"])
    assert "Seeds 0, 1 only (2 runs of other seeds left out). 14 completed runs, 0 failed." in md
    assert _md_table(md) == {
        ("grpo", "focal", "0"): "2 58.6 +- 4.3 80.8 +- 1.2 ref ref",
        ("grpo", "focal", "1"): "2 57.9 +- 5.8 80.0 +- 2.4 -0.8 (p=0.0796) +0.9 (p=0.3080)",
        ("grpo", "dr_grpo", "0"): "2 54.0 +- 2.9 77.5 +- 8.2 -4.7 (p=0.0002) +0.6 (p=0.5209)",
        ("grpo", "maxrl", "0"): "2 55.1 +- 2.1 80.8 +- 8.2 -3.5 (p=0.0002) +2.5 (p=0.0048)",
        ("grpo", "passk k=4", "0"): "2 50.1 +- 0.4 83.3 +- 0.0 -8.5 (p=0.0002) +1.6 (p=0.0966)",
        ("grpo", "unlikeliness beta=0.25", "0"): "2 53.7 +- 1.2 85.0 +- 4.7 -5.0 (p=0.0002) +4.0 (p=0.0008)",
        ("grpo", "w_reinforce lam=0.1", "0"): "2 39.7 +- 3.4 82.5 +- 1.2 -18.9 (p=0.0002) -0.6 (p=0.5571)",
    }
    assert "| grpo | w_reinforce lam=0.1 | 0 | 0 | — → 37.4 | — → 83.3 | — → 10 | +0.138 |" in md
    assert "| grpo | unlikeliness beta=0.25 | 0 | 0, 1 | 52.8, 54.5 | -5.0 (p=0.3333) | 88.3, 81.7 | +4.2 (p=0.6667) |" in md
    assert md.replace(str(RESULTS / "runs"), "docs/results/arith_headroom/runs") \
        == (RESULTS / "advantage_methods" / "report.md").read_text()  # the committed report is this one


def test_on_policy_dapo_is_grpo_step_for_step_as_docs_results_says():
    """docs/pilot.md: with one update per batch DAPO's gradient is GRPO's, so the committed DAPO run (gamma 1, seed 0)
    made the committed GRPO run's 40 steps: the same loss and rewards at every step, nothing clipped."""
    steps = {}
    runs = {"dapo": RESULTS / "dapo_on_policy" / "dapo_gamma1_seed0", "grpo": RESULTS / "runs" / "grpo_gamma1_seed0"}
    for name, run in runs.items():
        steps[name] = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "train/loss" in r}
    assert sorted(steps["dapo"]) == sorted(steps["grpo"]) == list(range(1, 41))
    for step, dapo in steps["dapo"].items():
        grpo = steps["grpo"][step]
        assert dapo["train/loss"] == grpo["train/loss"] and dapo["train/reward_mean"] == grpo["train/reward_mean"]
        assert abs(dapo["train/grad_norm"] - grpo["train/grad_norm"]) < 2e-4
        assert dapo["train/clip_frac_low"] == dapo["train/clip_frac_high"] == grpo["train/clip_frac_high"] == 0.0
        assert dapo["train/ratio_max"] == 1.0
    assert (runs["dapo"] / COUNTS_FILE).read_text() == (runs["grpo"] / COUNTS_FILE).read_text()


def test_the_committed_four_updates_runs_report_the_numbers_of_docs_results(tmp_path):
    """docs/pilot.md, "Four updates per batch": the report over the committed runs gives the quoted numbers."""
    table, md = _report_of(RESULTS / "mini_batches4" / "runs", tmp_path)
    rows = {tuple(line.split()[:2]): " ".join(line.split()[2:]) for line in table.replace("*", " ").splitlines()[2:]}
    assert rows[("cispo", "0")] == "3 53.9 +- 3.6 73.9 +- 5.9 ref ref"
    assert rows[("cispo", "1")] == "3 48.0 +- 3.4 77.8 +- 5.4 -5.9 (p=0.0002) -2.2 (p=0.0086)"
    assert rows[("dapo", "0")] == "3 51.0 +- 2.9 81.1 +- 3.8 ref ref"
    assert rows[("dapo", "1")] == "3 55.3 +- 8.4 75.6 +- 1.9 +4.3 (p=0.0002) -1.7 (p=0.0362)"
    assert rows[("grpo", "0")] == "3 55.6 +- 2.5 74.4 +- 3.5 ref ref"
    assert rows[("grpo", "1")] == "3 53.1 +- 5.7 82.8 +- 6.9 -2.5 (p=0.0002) +8.3 (p=0.0002)"
    run_rows = [  # the report's table of runs, as docs/pilot.md quotes it
        "| cispo | 0 | 0 | — → 52.9 | — → 68.3 | — → 19 | +0.746 |",
        "| cispo | 1 | 0 | — → 45.2 | — → 71.7 | — → 17 | +0.535 |",
        "| cispo | 0 | 1 | — → 50.9 | — → 80.0 | — → 12 | +0.653 |",
        "| cispo | 1 | 1 | — → 47.0 | — → 80.0 | — → 12 | +0.595 |",
        "| cispo | 0 | 2 | — → 57.9 | — → 73.3 | — → 16 | +0.840 |",
        "| cispo | 1 | 2 | — → 51.8 | — → 81.7 | — → 11 | +0.765 |",
        "| dapo | 0 | 0 | — → 54.3 | — → 83.3 | — → 10 | +0.583 |",
        "| dapo | 1 | 0 | — → 59.9 | — → 76.7 | — → 14 | +0.646 |",
        "| dapo | 0 | 1 | — → 49.3 | — → 83.3 | — → 10 | +0.643 |",
        "| dapo | 1 | 1 | — → 45.7 | — → 73.3 | — → 16 | +0.616 |",
        "| dapo | 0 | 2 | — → 49.4 | — → 76.7 | — → 14 | +0.675 |",
        "| dapo | 1 | 2 | — → 60.3 | — → 76.7 | — → 14 | +0.687 |",
        "| grpo | 0 | 0 | — → 55.6 | — → 71.7 | — → 17 | +0.706 |",
        "| grpo | 1 | 0 | — → 57.4 | — → 88.3 | — → 7 | +0.556 |",
        "| grpo | 0 | 1 | — → 53.2 | — → 73.3 | — → 16 | +0.932 |",
        "| grpo | 1 | 1 | — → 46.6 | — → 75.0 | — → 15 | +0.661 |",
        "| grpo | 0 | 2 | — → 58.1 | — → 78.3 | — → 13 | +0.826 |",
        "| grpo | 1 | 2 | — → 55.3 | — → 85.0 | — → 9 | +0.508 |",
    ]
    for row in run_rows:
        assert row in md
    assert "| grpo | 1 | 0, 1, 2 | 57.4, 46.6, 55.3 | -2.5 (p=0.6000) | 88.3, 75.0, 85.0 | +8.3 (p=0.2000) |" in md
    assert "| cispo | 1 | 0, 1, 2 | 45.2, 47.0, 51.8 | -5.9 (p=0.2000) | 71.7, 80.0, 81.7 | +3.9 (p=0.6000) |" in md
    assert "| dapo | 1 | 0, 1, 2 | 59.9, 45.7, 60.3 | +4.3 (p=0.4000) | 76.7, 73.3, 76.7 | -5.6 (p=0.3000) |" in md


def test_the_confirmatory_runs_give_the_analysis_docs_results_leads_with(tmp_path, capsys):
    """docs/results.md leads with the pre-registered analysis of the 48 committed runs (analysis.txt beside them): the
    runs must still give it line for line, and the page must quote the primary test's mean, interval and p."""
    from fgrpo.report import main

    plan = CONFIRM / "analysis_plan.yaml"
    assert main([str(CONFIRM / "runs"), "--confirm", str(plan), "--out", str(tmp_path)]) == 0
    committed = (CONFIRM / "analysis.txt").read_text()
    assert capsys.readouterr().out == committed and (tmp_path / "analysis.txt").read_text() == committed
    assert (tmp_path / "analysis.png").stat().st_size > 10_000
    primary = next(line for line in committed.splitlines() if line.startswith("Primary: fgrpo − grpo, pass@16"))
    quoted = re.search(r"mean (\S+) points, 99% interval \[(\S+), (\S+)\], paired t p = (\S+) ", primary).groups()
    page = (RESULTS.parents[1] / "results.md").read_text()
    assert all(value in page for value in quoted), (quoted, "docs/results.md must quote these")
