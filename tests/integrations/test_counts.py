"""fgrpo.integrations.counts: another trainer's per-sample results as eval_counts.jsonl and a run directory that
fgrpo.report and fgrpo.compare read (the counts by hand; the report's paired table and planner over converted runs;
the errors, each naming the record or problem and the fix)."""

import csv
import json

import numpy as np
import pytest

from fgrpo.evaluation.pass_at_k import pass_at_k
from fgrpo.evaluation.sweep_runs import find_runs
from fgrpo.integrations.counts import CountsError, count_rows, main


def samples(rng, problems=12, n=16, skill=0.5) -> list[dict]:
    rates = rng.uniform(0, 1, problems) * skill * 2
    return [{"problem": f"p{p}", "correct": bool(rng.random() < min(rates[p], 1))}
            for p in range(problems) for _ in range(n)]


def test_counts_are_the_correct_samples_of_each_problem_in_first_seen_order(tmp_path):
    rng = np.random.default_rng(0)
    records = samples(rng)
    rng.shuffle(records)
    rows = count_rows(records, step=30)
    assert [r["problem"] for r in rows] == list(dict.fromkeys(r["problem"] for r in records))
    for row in rows:
        assert row == {"step": 30, "dataset": "eval", "problem": row["problem"], "n": 16,
                       "c": sum(r["correct"] for r in records if r["problem"] == row["problem"])}
    path = tmp_path / "scores.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["prompt_id", "reward"])
        writer.writeheader()
        writer.writerows({"prompt_id": r["problem"], "reward": 1.0 if r["correct"] else -0.2} for r in records)
    assert main([str(path), "--out", str(tmp_path / "run"), "--problem-key", "prompt_id", "--score-key", "reward",
                 "--threshold", "1.0", "--step", "30"]) == 0
    written = [json.loads(line) for line in (tmp_path / "run" / "eval_counts.jsonl").read_text().splitlines()]
    assert written == rows


def test_converted_runs_are_what_the_report_and_its_planner_read(tmp_path, capsys):
    from fgrpo.report import main as report

    rng = np.random.default_rng(1)
    for gamma, skill in ((0.0, 0.4), (1.0, 0.5)):
        for seed in (0, 1, 2):
            path = tmp_path / "in.jsonl"
            records = samples(rng, skill=skill)
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
            out = tmp_path / "runs" / f"g{gamma}_s{seed}"
            assert main([str(path), "--out", str(out), "--gamma", str(gamma), "--seed", str(seed), "--step", "30"]) == 0
            rows = [json.loads(line) for line in (out / "eval_counts.jsonl").read_text().splitlines()]
            expected16 = np.mean([pass_at_k(16, r["c"], 16) for r in rows])
            run = next(r for r in find_runs(tmp_path / "runs") if r.path == out)
            assert run.status == "completed" and run.final["eval/pass@16"] == pytest.approx(expected16)
    assert report([str(tmp_path / "runs"), "--plan", "--effect", "5", "--alpha", "0.05"]) == 0
    assert "seed pairs needed" in capsys.readouterr().out
    assert report([str(tmp_path / "runs"), "--out", str(tmp_path / "report")]) == 0
    assert "Paired over seeds" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.parametrize("records, options, message", [
    ([{"id": "a", "correct": 1}], {},
     "record 1 has no 'problem' (its keys: id, correct); name the problem id's column"),
    ([{"problem": "a", "ok": 1}], {}, "record 1 has no 'correct'"),
    ([{"problem": "a", "correct": "maybe"}], {}, "record 1: correct='maybe' is not a verdict"),
    ([{"problem": "a", "correct": 1}] * 2 + [{"problem": "b", "correct": 0}], {},
     "problems have different numbers of samples (2 for most; b (1))"),
    ([{"problem": "a", "score": 1.0}], {"score_key": "score"}, "--score-key and --threshold go together"),
    ([], {}, "the samples file holds no records"),
])
def test_samples_that_make_no_counts_are_refused_naming_the_fix(records, options, message):
    with pytest.raises(CountsError, match="^" + __import__("re").escape(message)):
        count_rows(records, **options)


def test_the_command_writes_nothing_over_an_earlier_run_and_says_why_in_one_line(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text('{"problem": "a", "correct": true}\n{"problem": "a", "correct": false}\n')
    assert main([str(path), "--out", str(tmp_path / "run")]) == 0
    assert main([str(path), "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "exists: pass another --out" in error and error.count("\n") == 1
    with pytest.raises(SystemExit):
        main([str(path), "--out", str(tmp_path / "other"), "--seed", "1"])  # --gamma missing
