"""Under CI=true (.ci/run sets it) a test that cannot run here fails with its reason; elsewhere it skips with it."""

import os
import subprocess
import sys
from pathlib import Path

HELPERS = Path(__file__).resolve().parent / "helpers"
CASE = '''
from ci_strict import skip_unless_ci

def test_needs_a_cluster():
    skip_unless_ci("no local Slurm cluster is up")
'''


def run_case(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(CASE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(HELPERS)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_missing_cluster_skips_outside_ci_and_fails_in_ci(tmp_path):
    outside = run_case(tmp_path, None)
    assert outside.returncode == 0 and "1 skipped" in outside.stdout and "no local Slurm cluster is up" in outside.stdout
    inside = run_case(tmp_path, "true")
    assert inside.returncode == 1 and "1 failed" in inside.stdout, inside.stdout
    assert "CI=true, and this test cannot run here: no local Slurm cluster is up" in inside.stdout
