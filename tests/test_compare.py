"""`python -m fgrpo.compare`: the paired test between two evaluations from the command line."""

import subprocess
import sys

import numpy as np
import pytest

from count_files import binomial_counts, count_rows, write_counts
from fgrpo.compare import main
from fgrpo.evaluation.significance import AVERAGE, compare


# ---------------------------------------------------------------- the CLI


def test_cli_two_run_dirs(tmp_path, capsys):
    a, b = binomial_counts(seed=8, shift=0.2)
    run_a = write_counts(tmp_path / "a", count_rows(a, 16))
    run_b = write_counts(tmp_path / "b", count_rows(b, 16))
    out = tmp_path / "out" / "cmp.md"
    assert main([str(run_a), str(run_b), "--iterations", "2000", "--seed", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "n = 16 samples per problem, m = 4, 2000 iterations, seed 3" in text
    header = next(line for line in text.splitlines() if line.startswith("dataset"))
    assert header.split() == ["dataset", "k", "A", "B", "A-B", "interval", "p-value", "significant"]
    average = [line.split() for line in text.splitlines() if line.startswith(AVERAGE)]
    assert [row[1] for row in average] == ["1", "2", "4"] and average[0][-1] == "yes"
    assert average[2][-2].endswith("†") and "† k > m/2" in text
    md = out.read_text()
    assert "| dataset | k | A | B | A-B | interval | p-value | significant |" in md
    assert md.count("| arithmetic |") == 3 and md.count(f"| {AVERAGE} |") == 3
    results = compare(run_a, run_b, iterations=2000, seed=3)
    assert f"| {AVERAGE} | 1 | {100 * results[-3].pass_a:.2f} |" in md


@pytest.mark.parametrize("extra, message", [
    (["--m", "16"], "m=16 must be smaller than n=16"),
    (["--iterations", "0"], "iterations must be >= 1"),
    (["--step", "3"], "step 3 is not in"),
])
def test_cli_bad_input_exit_2(tmp_path, capsys, extra, message):
    run = write_counts(tmp_path / "a", count_rows({"d": np.array([1, 2, 3])}, 16))
    assert main([str(run), str(run), "--out", str(tmp_path / "c.md"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert not (tmp_path / "c.md").exists()


def test_cli_subprocess_no_traceback(tmp_path):
    run = write_counts(tmp_path / "a", count_rows({"d": np.array([1, 2, 3])}, 16))
    result = subprocess.run([sys.executable, "-m", "fgrpo.compare", str(run), str(tmp_path / "missing")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr
    result = subprocess.run([sys.executable, "-m", "fgrpo.compare", str(run), str(run), "--iterations", "100"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "compare.md").is_file() and "wrote compare.md" in result.stdout
