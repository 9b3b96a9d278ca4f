"""fgrpo.evaluation.eval_counts: reading eval_counts.jsonl, pooling seeds, and the mismatches that stop a paired
comparison."""

import numpy as np
import pytest

from count_files import count_rows, write_counts
from fgrpo.evaluation.eval_counts import EvalCounts, load_counts, pool_counts
from fgrpo.evaluation.significance import compare
from fgrpo.infra.errors import CompareError


# ---------------------------------------------------------------- loading and mismatches


def test_load_counts_last_step_chosen_step_and_sources(tmp_path):
    rows = count_rows({"arithmetic": np.array([3, 4])}, 16, step=10) + count_rows({"arithmetic": np.array([9, 5])}, 16)
    run = write_counts(tmp_path / "run", rows)
    for source in (run, run / "eval_counts.jsonl", str(run)):
        counts = load_counts(source)
        assert counts.step == 30 and counts.n == 16 and counts.correct == {"arithmetic": {"arithmetic/0": 9,
                                                                                          "arithmetic/1": 5}}
    assert load_counts(run, step=10).correct["arithmetic"]["arithmetic/0"] == 3
    with pytest.raises(CompareError, match=r"step 20 is not in .*steps present: 10, 30 \(choose one with --step\)"):
        load_counts(run, step=20)


def test_load_counts_standalone_evaluation_duplicates_and_truncated_line(tmp_path):
    rows = count_rows({"gsm": np.array([1, 2])}, 8, step=None)
    rows.append({"step": None, "dataset": "gsm", "problem": "gsm/0", "n": 8, "c": 7})  # evaluated again: last wins
    evaluation = write_counts(tmp_path / "eval", rows, run_dir=False)
    with open(evaluation / "eval_counts.jsonl", "a") as file:
        file.write('{"step": null, "dataset": "gsm", "prob')  # a crash cut the last line short
    counts = load_counts(evaluation)
    assert counts.step is None and counts.correct == {"gsm": {"gsm/0": 7, "gsm/1": 2}}


@pytest.mark.parametrize("content, message", [
    ("", "holds no rows"),
    ('{"step": 1}\n{"step": 1}\n', r"eval_counts.jsonl:1 is not an eval_counts.jsonl row"),
    ('not json\n{"step": 1, "dataset": "d", "problem": "p", "n": 4, "c": 1}\n',
     r"eval_counts.jsonl:1 is not valid JSON"),
    ('{"step": 1, "dataset": "d", "problem": "p", "n": 4, "c": 5}\n', "0 <= c <= n"),
    ('{"step": 1, "dataset": "d", "problem": "p", "n": 4, "c": 1}\n{"step": 1, "dataset": "d", "problem": "q", '
     '"n": 8, "c": 1}\n', r"n varies across problems \(\[4, 8\]\)"),
])
def test_bad_files(tmp_path, content, message):
    (tmp_path / "eval_counts.jsonl").write_text(content)
    with pytest.raises(CompareError, match=message):
        load_counts(tmp_path)


def test_missing_paths(tmp_path):
    with pytest.raises(CompareError, match="does not exist"):
        load_counts(tmp_path / "nope")
    (tmp_path / "old_run" / ".hydra").mkdir(parents=True)
    with pytest.raises(CompareError, match="holds no eval_counts.jsonl"):
        compare(tmp_path / "old_run", tmp_path / "old_run")


def evaluation(correct, n=16, source="x"):
    return EvalCounts(source, 30, n, correct)


def test_mismatches_name_the_difference_and_the_fix():
    a = evaluation({"arithmetic": {f"p{i}": 1 for i in range(10)}}, source="A")
    with pytest.raises(CompareError, match=r"datasets differ: A has \['arithmetic'\], B has \['logic'\].*same eval"):
        compare(a, evaluation({"logic": {"p0": 1}}, source="B"))
    fewer = evaluation({"arithmetic": {f"p{i}": 1 for i in range(5)}}, source="B")
    with pytest.raises(CompareError, match=r"5 only in A \('p5', 'p6', 'p7', \.\.\.\), 0 only in B \(none\).*paired"):
        compare(a, fewer)
    with pytest.raises(CompareError, match=r"n differs: A drew n=16 .* B n=32.*same eval.n_samples"):
        compare(a, evaluation(a.correct, n=32, source="B"))
    assert isinstance(CompareError("x"), ValueError)


def test_pool_counts_concatenates_samples():
    seeds = [evaluation({"d": {"p": 3, "q": 0}}), evaluation({"d": {"p": 5, "q": 16}}, source="y")]
    pooled = pool_counts(seeds)
    assert pooled.n == 32 and pooled.correct == {"d": {"p": 8, "q": 16}} and pooled.source == "x + y"
    with pytest.raises(CompareError, match="problems differ"):
        pool_counts([seeds[0], evaluation({"d": {"p": 1}})])
