"""`python -m fgrpo.report` on hand-made sweep directories (known final values, no training)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from fgrpo.report import main, report

REPO = Path(__file__).resolve().parents[1]
STEPS = 2

# final (pass@1, pass@4) per (algo, gamma) for seeds 0 and 1
FINALS = {
    ("grpo", 0.0): [(0.1, 0.5), (0.3, 0.7)],   # pass@1 20.0 +- 14.1, pass@4 60.0 +- 14.1
    ("grpo", 1.0): [(0.4, 0.6), (0.6, 0.6)],   # pass@1 50.0 +- 14.1 (best), pass@4 60.0 +- 0.0
    ("cispo", 0.0): [(0.2, 0.9), (0.2, 0.7)],  # pass@1 20.0 +-  0.0, pass@4 80.0 +- 14.1 (best)
    ("cispo", 1.0): [(0.3, 0.7), (0.5, 0.7)],  # pass@1 40.0 +- 14.1, pass@4 70.0 +-  0.0
}


def write_run(run_dir: Path, algo: str, gamma: float, seed: int, p1: float, p4: float, *, job_num: int = 0,
              job_id: str | None = None, lr: float = 1e-5, steps_done: int = STEPS, dtype: str = "bfloat16",
              rare_nll_delta: float | None = None, advantage: dict | None = None) -> Path:
    (run_dir / ".hydra").mkdir(parents=True)
    config = {"seed": seed, "algo": {"name": algo, "group_size": 4}, "focal": {"gamma": gamma},
              **({"advantage": advantage} if advantage else {}),
              "trainer": {"steps": STEPS, "lr": lr}, "eval": {"n_samples": 4},
              "hardware": {"autocast_dtype": dtype, "sampler_dtype": dtype},
              "logger": {"name": "wandb", "group": "sweep-x"}}
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / ".hydra" / "hydra.yaml").write_text(
        yaml.safe_dump({"hydra": {"job": {"name": "run", "num": job_num, "id": job_id or f"job_id_for_{job_num}"}}}))
    rows = [{"step": 0, "eval/pass@1": 0.05, "eval/pass@2": 0.1, "eval/pass@4": 0.2}]
    rows += [{"step": step, "train/loss": 0.1, "train/frac_all_correct": step * p1 / STEPS,
              "train/frac_all_wrong": 1 - p4, "perf/step_time_s": 2.0 + step} for step in range(1, steps_done + 1)]
    if steps_done == STEPS:
        rows.append({"step": STEPS, "eval/pass@1": p1, "eval/pass@2": (p1 + p4) / 2, "eval/pass@4": p4,
                     "eval/pass@4_ci_low": 0.0, "eval/pass@4_ci_high": 1.0,
                     **({"eval/rare_nll_delta": rare_nll_delta} if rare_nll_delta is not None else {})})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / "run.log").write_text("log\n")
    return run_dir


def write_sweep(root: Path, **kwargs) -> Path:
    num = 0
    for (algo, gamma), seeds in FINALS.items():
        for seed, (p1, p4) in enumerate(seeds):
            write_run(root / f"{num}_algo={algo},focal.gamma={gamma:g},seed={seed}", algo, gamma, seed, p1, p4,
                      job_num=num, **kwargs)
            num += 1
    return root


def table_rows(text: str) -> dict:
    """{(algo, gamma): (seeds, pass@1 cell, pass@4 cell)} from the printed table."""
    rows = {}
    for line in text.split("\n\n")[0].splitlines():  # the sweep table; the runs table follows a blank line
        parts = line.split()
        if parts and parts[0] in ("grpo", "cispo", "dapo"):
            cells = re.findall(r"\d+\.\d \+- +\d+\.\d\*?", line)
            rows[(parts[0], float(parts[1]))] = (int(parts[2]), *cells)
    return rows


def test_table_mean_std_best_mark_and_largest_k(tmp_path):
    text = report(write_sweep(tmp_path))
    header = text.splitlines()[0].split()
    assert header == ["algo", "gamma", "seeds", "pass@1", "pass@4"]  # the largest k of the runs
    rows = table_rows(text)
    assert rows == {
        ("cispo", 0.0): (2, "20.0 +-  0.0", "80.0 +- 14.1*"),
        ("cispo", 1.0): (2, "40.0 +- 14.1", "70.0 +-  0.0"),
        ("grpo", 0.0): (2, "20.0 +- 14.1", "60.0 +- 14.1"),
        ("grpo", 1.0): (2, "50.0 +- 14.1*", "60.0 +-  0.0"),
    }
    assert "8 completed runs, 0 failed" in text and "FAILED" not in text


def test_report_md_and_png(tmp_path):
    write_sweep(tmp_path)
    report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| algo | gamma | seeds | pass@1 | pass@4 |" in md
    assert "| grpo | 1 | 2 | 50.0 +- 14.1* | 60.0 +-  0.0 |" in md
    assert "| cispo | 0 | 2 | 20.0 +-  0.0 | 80.0 +- 14.1* |" in md
    assert "mean +- std over seeds" in md and "![pass@k curves](report.png)" in md
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_out_dir(tmp_path):
    write_sweep(tmp_path / "sweep")
    report(tmp_path / "sweep", tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere" / "report.md").is_file() and (tmp_path / "elsewhere" / "report.png").is_file()
    assert not (tmp_path / "sweep" / "report.md").exists()


def test_ties_are_all_marked(tmp_path):
    for num, algo in enumerate(["grpo", "cispo"]):
        write_run(tmp_path / str(num), algo, 0.0, 0, 0.0, 0.0, job_num=num)
    rows = table_rows(report(tmp_path))
    assert all(cell.endswith("*") for row in rows.values() for cell in row[1:])


def test_unfinished_run_is_listed_as_failed_with_its_log(tmp_path):
    write_sweep(tmp_path)
    broken = write_run(tmp_path / "8_algo=dapo", "dapo", 0.0, 0, 0, 0, job_num=8, steps_done=1)
    text = report(tmp_path)
    assert ("dapo", 0.0) not in table_rows(text)
    assert "8 completed runs, 1 failed" in text
    failed = [line for line in text.splitlines() if line.startswith("FAILED")]
    assert failed == [f"FAILED: {broken} (algo=dapo, gamma=0, seed=0); log: {broken / 'run.log'}"]
    assert f"- FAILED: {broken}" in (tmp_path / "report.md").read_text()


def test_job_without_run_dir_is_named_from_multirun_yaml(tmp_path):
    """A job that died before Hydra made its run directory: the job list in multirun.yaml names it, and
    submitit's folder (one task per job, in order) gives its Slurm log."""
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"params": None},
        "overrides": {"task": ["model=tiny_random", "algo=grpo,cispo", "focal.gamma=0,1"]}}}))
    jobs = [("grpo", 0.0), ("grpo", 1.0), ("cispo", 0.0), ("cispo", 1.0)]
    for num, (algo, gamma) in enumerate(jobs):
        task = tmp_path / ".submitit" / f"7_{num}"
        task.mkdir(parents=True)
        (task / f"7_{num}_0_log.err").write_text("Traceback ...\n")
        if num != 3:
            write_run(tmp_path / f"{num}_run", algo, gamma, 0, 0.5, 0.6, job_num=num, job_id=f"7_{num}")
    text = report(tmp_path)
    assert len(table_rows(text)) == 3 and "3 completed runs, 1 failed" in text
    failed = [line for line in text.splitlines() if line.startswith("FAILED")]
    assert failed == [f"FAILED: sweep job #3 [model=tiny_random algo=cispo focal.gamma=1] (Slurm job 7_3) left no run "
                      f"directory; log: {tmp_path / '.submitit' / '7_3' / '7_3_0_log.err'}"]
    # a run's log is its Slurm task's stderr when there is one
    (tmp_path / "0_run" / "metrics.jsonl").write_text('{"step": 0, "eval/pass@1": 0.1}\n')
    assert f"log: {tmp_path / '.submitit' / '7_0' / '7_0_0_log.err'}" in report(tmp_path)


def test_mixed_configs_exit_2_naming_the_key(tmp_path, capsys):
    write_sweep(tmp_path / "a")
    write_sweep(tmp_path / "b", lr=3e-5)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "mix different configurations" in err and "trainer.lr: 1e-05, 3e-05" in err
    assert not (tmp_path / "report.md").exists()
    assert "auto" not in err  # not the precision hint: the user set the lr


def test_jobs_whose_auto_precision_settled_differently_are_told_to_pin_it(tmp_path, capsys):
    write_sweep(tmp_path / "a")
    write_sweep(tmp_path / "b", dtype="float32")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "hardware.autocast_dtype: 'bfloat16', 'float32'" in err
    assert "hardware.autocast_dtype=float32 hardware.sampler_dtype=float32" in err


@pytest.mark.parametrize("what", ["empty", "missing", "only_failed"])
def test_no_runs_exit_2(tmp_path, capsys, what):
    if what == "only_failed":
        write_run(tmp_path / "0", "grpo", 0.0, 0, 0, 0, steps_done=0)
    assert main([str(tmp_path / "nope" if what == "missing" else tmp_path)]) == 2
    err = capsys.readouterr().err
    expected = {"empty": "no runs found under", "missing": "is not a directory",
                "only_failed": "every run of this sweep failed"}[what]
    assert err.startswith("error: ") and expected in err


def test_seeds_flag_reports_only_those_seeds_and_names_the_seeds_there_are(tmp_path, capsys):
    write_sweep(tmp_path)
    assert main([str(tmp_path), "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    rows = {key: tuple(str(cell).rstrip("*") for cell in row) for key, row in table_rows(out).items()}
    assert rows[("grpo", 0.0)] == ("1", "30.0 +-  0.0", "70.0 +-  0.0")  # seed 1's values alone
    assert rows[("cispo", 1.0)] == ("1", "50.0 +-  0.0", "70.0 +-  0.0")
    assert "Seeds 1 only (4 runs of other seeds left out). 4 completed runs, 0 failed" in out
    assert main([str(tmp_path), "--seeds", "0, 1"]) == 0 and "8 completed runs" in capsys.readouterr().out
    assert main([str(tmp_path), "--seeds", "5"]) == 2
    assert "no run has seed 5; the runs' seeds are 0, 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's usage error, exit 2
        main([str(tmp_path), "--seeds", ","])
    assert "--seeds needs seeds" in capsys.readouterr().err


def test_cli_exit_code_and_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fgrpo.report", str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "no runs found" in result.stderr and "Traceback" not in result.stderr
    write_sweep(tmp_path)
    result = subprocess.run([sys.executable, "-m", "fgrpo.report", str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pass@4" in result.stdout and f"wrote {tmp_path / 'report.md'}" in result.stdout


# ---------------------------------------------------------------- significance columns (eval_counts.jsonl)

COUNTS_N = 16
PROBLEMS = 20


def sweep_counts(seed: int = 0) -> dict:
    """{(algo, gamma, run seed): {dataset: [PROBLEMS] correct of COUNTS_N}}: grpo gamma=1 solves far more than
    grpo gamma=0; cispo gamma=1 has exactly cispo gamma=0's counts."""
    rng = np.random.default_rng(seed)
    rates = {dataset: rng.random(PROBLEMS) for dataset in ("arithmetic", "logic")}
    counts = {}
    for run_seed in (0, 1):
        for algo, gamma, lift in (("grpo", 0.0, 0.0), ("grpo", 1.0, 0.3), ("cispo", 0.0, 0.0)):
            counts[(algo, gamma, run_seed)] = {d: rng.binomial(COUNTS_N, np.clip(r + lift, 0, 1))
                                               for d, r in rates.items()}
        counts[("cispo", 1.0, run_seed)] = counts[("cispo", 0.0, run_seed)]
    return counts


def write_counts(run_dir: Path, counts: dict) -> None:
    rows = [{"step": 0, "dataset": d, "problem": f"{d}/{i}", "n": COUNTS_N, "c": 0}  # an earlier evaluation
            for d, cs in counts.items() for i in range(len(cs))]
    rows += [{"step": STEPS, "dataset": d, "problem": f"{d}/{i}", "n": COUNTS_N, "c": int(c)}
             for d, cs in counts.items() for i, c in enumerate(cs)]
    (run_dir / "eval_counts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_sweep_with_counts(root: Path) -> dict:
    write_sweep(root)
    counts = sweep_counts()
    for run_dir in root.iterdir():
        config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
        write_counts(run_dir, counts[(config["algo"]["name"], config["focal"]["gamma"], config["seed"])])
    return counts


def significance_cells(text: str) -> dict:
    """{(algo, gamma): [cells after the pass@k columns]} from the printed table."""
    cells = {}
    for line in text.split("\n\n")[0].splitlines():
        parts = line.split()
        if parts and parts[0] in ("grpo", "cispo", "dapo"):
            tail = re.split(r"\d+\.\d \+- +\d+\.\d\*?", line)[-1]
            cells[(parts[0], float(parts[1]))] = re.findall(r"[+-]\d+\.\d \(p=[^)]+\)|ref|—", tail)
    return cells


def expected_pass_at_1_delta(counts: dict, algo: str) -> float:
    """Pooled over seeds per problem: (sum of c) / (sum of n), averaged over problems, then over the datasets."""
    def pooled(gamma):
        return np.mean([np.mean((counts[(algo, gamma, 0)][d] + counts[(algo, gamma, 1)][d]) / (2 * COUNTS_N))
                        for d in ("arithmetic", "logic")])
    return pooled(1.0) - pooled(0.0)


def test_significance_columns_against_gamma_0(tmp_path):
    counts = write_sweep_with_counts(tmp_path)
    text = report(tmp_path)
    header = text.splitlines()[0]
    assert header.split()[:5] == ["algo", "gamma", "seeds", "pass@1", "pass@4"]
    assert "Δpass@1 vs γ=0" in header and "Δpass@4 vs γ=0" in header  # pooled n=32, m=8: k <= m/2 = 4
    cells = significance_cells(text)
    assert cells[("grpo", 0.0)] == cells[("cispo", 0.0)] == ["ref", "ref"]
    grpo = cells[("grpo", 1.0)]
    assert grpo[0].startswith(f"{100 * expected_pass_at_1_delta(counts, 'grpo'):+.1f} (p=")
    assert float(re.search(r"p=([^)]+)", grpo[0]).group(1)) < 0.001
    assert cells[("cispo", 1.0)] == ["+0.0 (p=1.0000)", "+0.0 (p=1.0000)"]
    assert table_rows(text)[("grpo", 1.0)] == (2, "50.0 +- 14.1*", "60.0 +-  0.0")  # the old columns unchanged
    md = (tmp_path / "report.md").read_text()
    assert "| algo | gamma | seeds | pass@1 | pass@4 | Δpass@1 vs γ=0 | Δpass@4 vs γ=0 |" in md
    assert "| cispo | 1 | 2 | 40.0 +- 14.1 | 70.0 +-  0.0 | +0.0 (p=1.0000) | +0.0 (p=1.0000) |" in md
    assert "seeds pooled per problem" in md and "n = sum of n, c = sum of c" in md and "10000 iterations" in md
    assert report(tmp_path) == text  # the test is seeded: the same p-values each time


def test_significance_with_runs_without_counts(tmp_path):
    write_sweep_with_counts(tmp_path)
    old_run = next(p for p in tmp_path.iterdir() if p.name.startswith("6_"))  # cispo gamma=1, seed 0
    (old_run / "eval_counts.jsonl").unlink()
    text = report(tmp_path)
    cells = significance_cells(text)
    assert cells[("cispo", 1.0)] == ["—", "—"] and cells[("grpo", 1.0)][0].startswith("+")
    assert "cispo, gamma=1: 1 of its runs wrote no eval_counts.jsonl" in text
    assert "cispo, gamma=1: 1 of its runs wrote no eval_counts.jsonl" in (tmp_path / "report.md").read_text()


def test_no_counts_at_all_leaves_the_columns_out(tmp_path):
    write_sweep(tmp_path)
    text = report(tmp_path)
    assert text.splitlines()[0].split() == ["algo", "gamma", "seeds", "pass@1", "pass@4"]
    assert "No significance columns: no run of this sweep wrote eval_counts.jsonl" in text
    assert "No significance columns" in (tmp_path / "report.md").read_text()


def test_one_seed_per_cell_tests_a_smaller_k_and_says_so(tmp_path):
    counts = sweep_counts()
    for num, (algo, gamma) in enumerate([("grpo", 0.0), ("grpo", 1.0)]):
        run_dir = write_run(tmp_path / str(num), algo, gamma, 0, 0.2, 0.5, job_num=num)
        write_counts(run_dir, counts[(algo, gamma, 0)])
    text = report(tmp_path)
    assert "Δpass@2 vs γ=0" in text.splitlines()[0]  # n=16, m=4: k <= 2
    assert "pass@4 is not tested" in text and "pass@2 is the largest k tested" in text


def test_significance_mismatched_problems_and_missing_baseline(tmp_path):
    counts = sweep_counts()
    run_dirs = {}
    for num, (algo, gamma) in enumerate([("grpo", 0.0), ("grpo", 1.0), ("dapo", 1.0)]):
        run_dirs[(algo, gamma)] = write_run(tmp_path / str(num), algo, gamma, 0, 0.2, 0.5, job_num=num)
        write_counts(run_dirs[(algo, gamma)], counts[("grpo", gamma, 0)])
    fewer = {d: cs[:-2] for d, cs in counts[("grpo", 1.0, 0)].items()}
    write_counts(run_dirs[("grpo", 1.0)], fewer)
    text = report(tmp_path)
    cells = significance_cells(text)
    assert cells[("grpo", 1.0)] == cells[("dapo", 1.0)] == ["—", "—"]
    assert "grpo, gamma=1 versus gamma=0: dataset 'arithmetic': the problems differ" in text
    assert "dapo, gamma=1: no gamma=0 run of dapo to compare with" in text


def test_significance_iterations_flag(tmp_path, capsys):
    write_sweep_with_counts(tmp_path)
    assert main([str(tmp_path), "--significance-iterations", "200"]) == 0
    assert "200 iterations" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--significance-iterations", "0"])
    assert exit_info.value.code == 2 and "--significance-iterations must be >= 1" in capsys.readouterr().err


def test_over_seeds_section_per_seed_values_and_permutation_p(tmp_path):
    text = report(write_sweep(tmp_path))
    md = (tmp_path / "report.md").read_text()
    assert "| algo | gamma | seeds | pass@1 % per seed | Δ mean vs γ=0 | pass@4 % per seed | Δ mean vs γ=0 |" in md
    # grpo gamma=1 pass@1 (40, 60) against (10, 30): +30 points; of the 6 splits of 4 runs, 2 are that far apart
    assert "| grpo | 1 | 0, 1 | 40.0, 60.0 | +30.0 (p=0.3333) | 60.0, 60.0 | +0.0 (p=1.0000) |" in md
    assert "| cispo | 0 | 0, 1 | 20.0, 20.0 | ref | 90.0, 70.0 | ref |" in md
    assert "| cispo | 1 | 0, 1 | 30.0, 50.0 | +20.0 (p=0.3333) | 70.0, 70.0 | -10.0 (p=1.0000) |" in md
    assert "cannot go below 2 / C(2s, s)" in md and "Over seeds: each run's final pass@k is one value" in text
    assert md.index("## Over seeds") < md.index("## Runs")


def test_over_seeds_section_left_out_with_one_seed_per_cell_and_dashes_for_a_lone_seed(tmp_path):
    for num, (algo, gamma) in enumerate([("grpo", 0.0), ("grpo", 1.0)]):
        write_run(tmp_path / "one" / str(num), algo, gamma, 0, 0.2, 0.5, job_num=num)
    report(tmp_path / "one")
    assert "Over seeds" not in (tmp_path / "one" / "report.md").read_text()
    for num, (gamma, seed) in enumerate([(0.0, 0), (0.0, 1), (1.0, 0)]):
        write_run(tmp_path / "uneven" / str(num), "grpo", gamma, seed, 0.2, 0.5, job_num=num)
    report(tmp_path / "uneven")
    assert "| grpo | 1 | 0 | 20.0 | — | 50.0 | — |" in (tmp_path / "uneven" / "report.md").read_text()


# ---------------------------------------------------------------- the runs table and the success-rate figure


def runs_section(md: str) -> dict:
    """{(algo, gamma, seed): cells} of report.md's runs table."""
    section = md.split("## Runs")[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("grpo", "cispo"):
            rows[(cells[0], float(cells[1]), int(cells[2]))] = cells[3:]
    return rows


def test_runs_table_before_after_never_solved_rare_nll_and_step_time(tmp_path):
    counts = write_sweep_with_counts(tmp_path)
    metrics = tmp_path / "0_algo=grpo,focal.gamma=0,seed=0" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows[-1]["eval/rare_nll_delta"] = 0.125  # as a run with eval.rare_set logs it
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = report(tmp_path)
    table = runs_section((tmp_path / "report.md").read_text())
    assert len(table) == 8
    never_after = sum(int(np.sum(c == 0)) for c in counts[("grpo", 0.0, 0)].values())
    assert table[("grpo", 0.0, 0)] == ["5.0 → 10.0", "20.0 → 50.0", f"40 → {never_after}", "+0.125", "3.5"]
    assert table[("grpo", 1.0, 1)][3] == "—"  # no rare-trajectory set measured
    score = {"rare_nll": 2.5, "rare_nll_delta": -0.25, "base_nll": 2.75, "trajectories": 10}
    (tmp_path / "3_algo=grpo,focal.gamma=1,seed=1" / "rare_nll.json").write_text(json.dumps(score))  # rare_nll score --out
    report(tmp_path)
    assert runs_section((tmp_path / "report.md").read_text())[("grpo", 1.0, 1)][3] == "-0.250"
    assert (tmp_path / "report_success_rates.png").stat().st_size > 20_000
    assert "report_success_rates.png" in text.splitlines()[-1]


def test_runs_table_without_counts_and_no_success_rate_figure(tmp_path):
    write_sweep(tmp_path)
    report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert runs_section(md)[("cispo", 1.0, 0)][2] == "— → —"  # no eval_counts.jsonl: no problem counts
    assert not (tmp_path / "report_success_rates.png").exists() and "report_success_rates.png" not in md


def test_runs_without_an_evaluation_before_training_pool_with_those_with_one(tmp_path):
    counts = write_sweep_with_counts(tmp_path)
    for run_dir in [p for p in tmp_path.iterdir() if "seed=1" in p.name]:  # eval.before=false eval.rare_set=rare/
        config_file = run_dir / ".hydra" / "config.yaml"
        config = yaml.safe_load(config_file.read_text())
        config_file.write_text(yaml.safe_dump({**config, "eval": {**config["eval"], "before": False,
                                                                  "rare_set": "rare/"}}))
        for name in ("metrics.jsonl", "eval_counts.jsonl"):
            rows = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
            (run_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] != 0))
    text = report(tmp_path)  # eval.before and eval.rare_set differ between the runs: still one table
    assert table_rows(text)[("grpo", 1.0)] == (2, "50.0 +- 14.1*", "60.0 +-  0.0")
    table = runs_section((tmp_path / "report.md").read_text())
    never_after = sum(int(np.sum(c == 0)) for c in counts[("grpo", 0.0, 1)].values())
    assert table[("grpo", 0.0, 1)][:3] == ["— → 30.0", "— → 70.0", f"— → {never_after}"]
    assert table[("grpo", 0.0, 0)][0] == "5.0 → 10.0"
    assert (tmp_path / "report_success_rates.png").exists()  # its "before" bars from the runs that evaluated then


def test_advantage_methods_are_cells_compared_with_the_plain_algorithm(tmp_path):
    """A sweep over advantage=focal,maxrl,passk: one row per method, each tested against focal at gamma 0."""
    counts = sweep_counts()
    methods = [({"name": "focal"}, 0.0, ("grpo", 0.0)), ({"name": "focal"}, 1.0, ("grpo", 1.0)),
               ({"name": "maxrl", "k": 4}, 0.0, ("grpo", 1.0)), ({"name": "passk", "k": 2}, 0.0, ("cispo", 1.0))]
    for num, (advantage, gamma, finals) in enumerate(methods):
        for seed in (0, 1):
            run_dir = write_run(tmp_path / f"{num}_{advantage['name']}_{seed}", "grpo", gamma, seed,
                                *FINALS[finals][seed], job_num=2 * num + seed, advantage=advantage)
            write_counts(run_dir, counts[(*finals, seed)])
    text = report(tmp_path)
    assert text.splitlines()[0].split()[:6] == ["algo", "advantage", "gamma", "seeds", "pass@1", "pass@4"]
    rows = {tuple(line.split()[:3]): line for line in text.split("\n\n")[0].splitlines()[2:]}
    assert set(rows) == {("grpo", "focal", "0"), ("grpo", "focal", "1"), ("grpo", "maxrl", "0"), ("grpo", "passk", "k=2")}
    assert rows[("grpo", "focal", "0")].split()[-2:] == ["ref", "ref"]
    # maxrl's counts are focal gamma 1's: the same difference to the reference, the same p
    assert re.findall(r"[+-]\d+\.\d \(p=[^)]+\)", rows[("grpo", "maxrl", "0")]) == \
        re.findall(r"[+-]\d+\.\d \(p=[^)]+\)", rows[("grpo", "focal", "1")])
    assert "compared with the gamma=0 row of its algo's focal advantage" in text
    md = (tmp_path / "report.md").read_text()
    assert "| algo | advantage | gamma | seed | pass@1 % |" in md and "| grpo | passk k=2 | 0 | 1 |" in md
    assert "| algo | advantage | gamma | seeds | pass@1 % per seed |" in md  # the over-seeds table
    assert (tmp_path / "report.png").stat().st_size > 0


# ---------------------------------------------------------------- paired over seeds, --variance, --plan


def test_paired_over_seeds_section_and_cells_whose_seeds_differ(tmp_path):
    write_sweep(tmp_path)
    report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert md.index("## Over seeds") < md.index("## Paired over seeds") < md.index("## Runs")
    grpo = md.split("grpo, gamma=1 − grpo, gamma=0 (seeds 0, 1)")[1].split("## Runs")[0]
    # pass@1: +30 on both seeds (no spread: t-test p 0); pass@4: +10 and -10, mean 0, t interval +-12.706 * 10
    assert "| seed | Δpass@1 | Δpass@4 |\n|---|---|---|\n| 0 | +30.0 | +10.0 |\n| 1 | +30.0 | -10.0 |" in grpo
    assert "| mean [95% t interval] | +30.0 [+30.0, +30.0] | +0.0 [-127.1, +127.1] |" in grpo
    assert "| paired t-test p | 0.000 | 1.000 |\n| sign-flip p (4 flips, exact) | 0.500 | 1.000 |" in grpo
    write_run(tmp_path / "8_extra", "grpo", 1.0, 2, 0.5, 0.5, job_num=8)
    report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert ("\npaired test over seeds: grpo, gamma=1 has seeds 0, 1, 2 but grpo, gamma=0 has seeds 0, 1; a paired "
            "test needs the same seeds on both sides") in md
    assert "cispo, gamma=1 − cispo, gamma=0 (seeds 0, 1)" in md  # the other pair is still tested


def test_variance_flag_prints_the_split_and_plan_projects_it(tmp_path, capsys):
    counts = write_sweep_with_counts(tmp_path)
    assert main([str(tmp_path), "--variance"]) == 0 and not (tmp_path / "report.md").exists()  # prints only
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("pass@")}
    assert set(rows) == {"pass@1", "pass@16"}  # n = 16: no pass@64
    # the pooled seed sd of pass@1 by hand: each run's mean over the 40 problems of c / n, pooled over the 4 cells
    cells = [[np.concatenate([counts[(algo, gamma, seed)][d] for d in ("arithmetic", "logic")]) / COUNTS_N
              for seed in (0, 1)] for algo, gamma in FINALS]
    pooled = np.sqrt(np.mean([np.var([run.mean() for run in cell], ddof=1) for cell in cells]))
    assert rows["pass@1"][1] == f"{100 * pooled:.2f}" and rows["pass@1"][-3:] == ["4;", "156", "unbiased"]
    assert main([str(tmp_path), *"--plan --effect 4 --metric pass@4 --problems 240 --samples 32".split()]) == 0
    out = capsys.readouterr().out  # projected from 40 problems x 16 samples; the pass@4 differences give V = 200
    for line in ("\nProjected to 240 problems x 32 samples (the pilot: 40 x 16), pass@4: V' = V - 2 (I + S(16)) / 40",
                 "\n  components (points²): seed part ", "\n  V' = 200.00 - 2 x (", "\n  projected sd of a per-seed ",
                 "\n  projected seed pairs needed: ", "\n  cross-check: ", "\n  16 "):  # n' = 16 only: 32 > the pilot's n
        assert line in out


def test_plan_flag_and_its_bad_input(tmp_path, capsys):
    write_sweep(tmp_path / "sweep")
    assert main([str(tmp_path / "sweep"), "--plan", "--effect", "20", "--metric", "pass@4"]) == 0
    out = capsys.readouterr().out
    # pass@4 differences: grpo +10, -10; cispo -20, 0: pooled variance (200 + 200) / 2, sd 14.14; d = 1.41
    assert "sd of a per-seed difference: 14.14 points (the pooled sd of the per-seed paired differences, 2 df" in out
    assert "seed pairs needed: 7 (power 0.874; 6 give 0.789)" in out  # scipy.stats.nct
    for num, gamma in enumerate([0.0, 1.0]):
        write_run(tmp_path / "one" / str(num), "grpo", gamma, 0, 0.2, 0.5, job_num=num)
    assert main([str(tmp_path / "one"), "--plan", "--effect", "4", "--metric", "pass@4"]) == 2
    assert (err := capsys.readouterr().err).count("\n") == 1 and "every cell has fewer (grpo, gamma=0: 1 seed; grpo, gamma=1: 1 seed)" in err
    for run_dir in (tmp_path / "sweep").iterdir():
        if "cispo" in run_dir.name:  # evaluated with 8 samples instead of 4
            config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
            (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump({**config, "eval": {"n_samples": 8}}))
    for flag in (["--variance"], ["--plan", "--effect", "4", "--metric", "pass@4"]):
        assert main([str(tmp_path / "sweep"), *flag]) == 2
        assert (err := capsys.readouterr().err).count("\n") == 1 and "eval.n_samples: 4 (4 runs), 8 (4 runs)" in err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "sweep"), "--plan"])
    assert "--plan needs --effect > 0" in capsys.readouterr().err
