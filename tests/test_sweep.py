"""Sweeps end to end: `python run.py -m ...` with Hydra's basic launcher and with Slurm (a real local cluster:
scripts/local-slurm start), failed jobs, bad input, and `python -m fgrpo.report` on what the runs wrote."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fgrpo.infra.run_files import read_metrics
from fgrpo.infra.wandb_file import iter_records
from wandb_files import find_wandb_run_file, read_wandb_run

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # a hung sweep fails the test instead of hanging CI
TINY = [
    "model=tiny_random", "sampler=hf", "logger=wandb", "trainer.steps=2", "trainer.prompts_per_step=2",
    "algo.group_size=2", "eval.n_samples=2", "eval.max_problems=2", "sampler.max_new_tokens=4",
    # the compiled learner (about 40 s of compiling a run on a 2-core CPU) is the subject of
    # tests/learner/test_compiled_layers.py and of the compiled runs in test_run.py and test_resume.py
    "hardware.compile_learner=false",
]
GRID = ["algo=grpo,cispo", "focal.gamma=0,1"]
SLURM = ["hydra/launcher=slurm", "hydra.launcher.partition=debug"]


# the environment as the tests started: an in-process vLLM engine (other tests) later adds LD_PRELOAD (tcmalloc,
# libgomp) and LOCAL_WORLD_SIZE to os.environ, which the processes started here must not inherit
LAUNCH_ENV = dict(os.environ)


def sweep(sweep_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "run.py"), "-m", *TINY, f"hydra.sweep.dir={sweep_dir}", *overrides]
    full_env = {**LAUNCH_ENV, "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=TIMEOUT)


def make_report(sweep_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fgrpo.report", str(sweep_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=TIMEOUT)


def run_dirs(sweep_dir: Path) -> list[Path]:
    # rglob: an override value with a '/' (a dataset path) nests the run directory further down
    return sorted(config.parent.parent for config in sweep_dir.rglob(".hydra/config.yaml"))


def run_config(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())


def final_eval(run_dir: Path) -> dict | None:
    evals = [row for row in read_metrics(run_dir / "metrics.jsonl") if "eval/pass@1" in row]
    return evals[-1] if evals else None


def table_cells(report_stdout: str) -> set[tuple[str, float]]:
    return {(line.split()[0], float(line.split()[1])) for line in report_stdout.splitlines()
            if line.split() and line.split()[0] in ("grpo", "cispo", "dapo")}


def wandb_group_and_name(run_dir: Path) -> tuple[str, str]:
    """The W&B group and display name as stored in the offline run's .wandb file (its run record)."""
    from wandb.proto import wandb_internal_pb2

    file = find_wandb_run_file(run_dir)
    for raw in iter_records(file.read_bytes(), str(file)):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "run":
            return record.run.run_group, record.run.display_name
    raise AssertionError(f"no run record in {file}")


def check_completed_grid(sweep_dir: Path) -> None:
    dirs = run_dirs(sweep_dir)
    assert len(dirs) == 4, dirs
    cells = set()
    for run_dir in dirs:
        final = final_eval(run_dir)
        assert final is not None and final["step"] == 2 and "eval/pass@2" in final, run_dir
        config = run_config(run_dir)
        cells.add((config["algo"]["name"], float(config["focal"]["gamma"])))
    assert cells == {("grpo", 0.0), ("grpo", 1.0), ("cispo", 0.0), ("cispo", 1.0)}
    result = make_report(sweep_dir)
    assert result.returncode == 0, result.stderr
    assert table_cells(result.stdout) == cells
    assert "4 completed runs, 0 failed" in result.stdout
    assert (sweep_dir / "report.md").is_file() and (sweep_dir / "report.png").stat().st_size > 1000


def write_dataset(path: Path) -> Path:
    path.write_text("".join(json.dumps({"question": f"What is {a} + {a}?", "answer": str(2 * a)}) + "\n"
                            for a in range(8)))
    return path


def check_failing_sweep(sweep_dir: Path, result: subprocess.CompletedProcess, missing: Path, slurm: bool) -> None:
    """2 x 2 sweep (algo x train path) where the two jobs with the missing file fail."""
    assert result.returncode != 0, result.stdout[-3000:]
    stderr = result.stderr
    assert "2 of 4 sweep jobs failed" in stderr, stderr[-5000:]
    failed_lines = [line for line in stderr.splitlines() if "failed:" in line and line.strip().startswith("sweep job #")]
    assert len(failed_lines) == 2, stderr[-5000:]
    for line in failed_lines:
        assert f"dataset.train.path={missing}" in line and "does not exist" in line
    logs = [Path(m) for m in re.findall(r"^\s+log: (.+)$", stderr, flags=re.M)]
    assert len(logs) >= 2 and all(log.is_file() for log in logs), logs
    if slurm:
        assert all(".submitit" in str(log) for log in logs)
        assert any("does not exist" in log.read_text() for log in logs)
    good = [d for d in run_dirs(sweep_dir) if run_config(d)["dataset"]["train"]["path"] != str(missing)]
    assert len(good) == 2
    for run_dir in good:
        assert final_eval(run_dir)["step"] == 2
    report = make_report(sweep_dir)
    assert report.returncode == 0, report.stderr
    assert table_cells(report.stdout) == {("grpo", 0.0), ("cispo", 0.0)}
    assert "2 completed runs, 2 failed" in report.stdout
    failed = [line for line in report.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 2
    for line in failed:
        log = Path(line.split("; log: ")[1])
        assert log.is_file(), line


# ------------------------------------------------------------------------------ local launcher


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    sweep_dir = tmp_path_factory.mktemp("local") / "2026-01-01" / "10-00-00"
    started = time.time()
    result = sweep(sweep_dir, *GRID)
    assert result.returncode == 0, result.stderr[-5000:]
    return sweep_dir, result, time.time() - started


def test_local_sweep_runs_every_job_in_its_dir_with_one_wandb_group(local_sweep):
    sweep_dir, result, _ = local_sweep
    assert "Launching 4 jobs locally" in result.stdout
    group = "sweep-2026-01-01-10-00-00"
    assert f"(W&B group {group})" in result.stdout
    dirs = run_dirs(sweep_dir)
    assert len(dirs) == 4 and all(d.parent == sweep_dir for d in dirs)
    for run_dir in dirs:
        assert "eval/pass@1" in final_eval(run_dir)
        config = run_config(run_dir)
        wandb_run = read_wandb_run(run_dir)
        assert wandb_run.config["logger"]["group"] == group
        assert wandb_run.summary["eval/pass@1"] == pytest.approx(final_eval(run_dir)["eval/pass@1"])
        stored_group, name = wandb_group_and_name(run_dir)
        assert stored_group == group
        assert f"algo={config['algo']['name']}" in name and f"focal.gamma={config['focal']['gamma']:g}" in name
    check_completed_grid(sweep_dir)


def test_saved_config_records_the_sweep_group(local_sweep):
    sweep_dir, _, _ = local_sweep
    assert {run_config(d)["logger"]["group"] for d in run_dirs(sweep_dir)} == {"sweep-2026-01-01-10-00-00"}


def test_report_on_mixed_configs_and_empty_dir(local_sweep, tmp_path):
    sweep_dir, _, _ = local_sweep
    mixed = tmp_path / "mixed"
    shutil.copytree(sweep_dir, mixed / "a")
    shutil.copytree(sweep_dir, mixed / "b")  # as if a second sweep ran with another learning rate
    for run_dir in run_dirs(mixed / "b"):
        text = (run_dir / ".hydra" / "config.yaml").read_text()
        assert "  lr: 3.0e-05" in text  # unset: the default, resolved and saved by the run
        (run_dir / ".hydra" / "config.yaml").write_text(text.replace("  lr: 3.0e-05", "  lr: 2.0e-05"))
    for target, message in [(mixed, "mix different configurations"), (tmp_path / "empty", "no runs found")]:
        target.mkdir(exist_ok=True)
        result = make_report(target)
        assert result.returncode == 2, result.stdout
        assert message in result.stderr and "Traceback" not in result.stderr
    assert "trainer.lr: 2e-05, 3e-05" in make_report(mixed).stderr  # each run saved the lr it ran


def test_local_failing_job_does_not_stop_the_others(tmp_path):
    good, missing = write_dataset(tmp_path / "train.jsonl"), tmp_path / "nonexistent.jsonl"
    sweep_dir = tmp_path / "sweep"
    result = sweep(sweep_dir, "algo=grpo,cispo", "dataset=local", f"dataset.train.path={missing},{good}",
                   f"dataset.eval.0.path={good}")
    check_failing_sweep(sweep_dir, result, missing, slurm=False)
    assert "Traceback" not in result.stderr  # a bad path is bad input: its message is enough


def test_invalid_sweep_value_rejected_before_any_job(tmp_path):
    result = sweep(tmp_path, "focal.gamma=-1,0")
    assert result.returncode == 2
    assert "1 of 2 sweep jobs have invalid configs; nothing was launched" in result.stderr
    assert "focal.gamma=-1]: focal.gamma=-1.0: must be >= 0" in result.stderr
    assert "Traceback" not in result.stderr
    assert run_dirs(tmp_path) == [] and not (tmp_path / ".submitit").exists()


def test_slurm_job_layout_checked_before_anything_is_queued(tmp_path):
    # 2 tasks per job: 3 prompts per step cannot be shared; caught by the sweeper, before sbatch is even looked for
    result = sweep(tmp_path, *SLURM, "hardware.slurm_tasks_per_node=2", "trainer.prompts_per_step=3,4")
    assert result.returncode == 2
    assert "1 of 2 sweep jobs have invalid configs; nothing was launched" in result.stderr
    assert "trainer.prompts_per_step=3 does not divide over 2 processes" in result.stderr
    assert "Traceback" not in result.stderr
    assert run_dirs(tmp_path) == [] and not (tmp_path / ".submitit").exists()


def test_slurm_launcher_without_sbatch_says_so_and_submits_nothing(tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH with this Python and nothing else
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    result = sweep(tmp_path / "sweep", *SLURM, *GRID, env={"PATH": str(bin_dir)})
    assert result.returncode == 2
    assert "hydra/launcher=slurm needs Slurm's `sbatch` on PATH" in result.stderr
    assert "Nothing was submitted" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "sweep" / ".submitit").exists() and run_dirs(tmp_path) == []


# ------------------------------------------------------------------------------ Slurm


def array_job_ids(sweep_dir: Path) -> list[str]:
    """The Slurm array job ids of a sweep, from submitit's folder names (.submitit/<job>_<task>)."""
    return sorted({p.name.split("_")[0] for p in (sweep_dir / ".submitit").glob("*_*") if p.is_dir()})


def sacct_states(job_id: str, expected: int) -> list[str]:
    """sacct's states of an array's tasks; accounting can lag a few seconds behind the job's end."""
    deadline = time.time() + 60
    while True:
        out = subprocess.run(["sacct", "-j", job_id, "-n", "-X", "-o", "State"], capture_output=True, text=True,
                             timeout=60).stdout
        states = out.split()
        if (len(states) == expected and all(s in ("COMPLETED", "FAILED") for s in states)) or time.time() > deadline:
            return states
        time.sleep(1)


@pytest.mark.slurm
def test_slurm_sweep_is_one_job_array(slurm, tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = sweep(sweep_dir, *SLURM, *GRID)
    assert result.returncode == 0, result.stderr[-5000:]
    jobs = array_job_ids(sweep_dir)
    assert len(jobs) == 1, jobs
    assert f"waiting for 4 Slurm array tasks (job {jobs[0]})" in result.stdout + result.stderr
    assert sacct_states(jobs[0], 4) == ["COMPLETED"] * 4
    script = next((sweep_dir / ".submitit").glob(".submission_file_*.sh")).read_text()
    assert "#SBATCH --array=0-3" in script and "#SBATCH --partition=debug" in script
    assert "gpu" not in script and "gres" not in script  # hardware=cpu asks for no GPUs
    group = f"sweep-{tmp_path.name}-sweep"
    for run_dir in run_dirs(sweep_dir):
        assert read_wandb_run(run_dir).config["logger"]["group"] == group
        assert wandb_group_and_name(run_dir)[0] == group
    check_completed_grid(sweep_dir)


@pytest.mark.slurm
def test_slurm_failing_job_is_reported_with_its_log(slurm, tmp_path):
    good, missing = write_dataset(tmp_path / "train.jsonl"), tmp_path / "nonexistent.jsonl"
    sweep_dir = tmp_path / "sweep"
    result = sweep(sweep_dir, *SLURM, "algo=grpo,cispo", "dataset=local", f"dataset.train.path={missing},{good}",
                   f"dataset.eval.0.path={good}")
    check_failing_sweep(sweep_dir, result, missing, slurm=True)
    jobs = array_job_ids(sweep_dir)
    assert len(jobs) == 1
    # jobs 0 and 2 have the missing file (train.path varies fastest): Slurm records them FAILED
    assert sacct_states(jobs[0], 4) == ["FAILED", "COMPLETED", "FAILED", "COMPLETED"]


@pytest.mark.parametrize("error_type", ["CheckpointError", "ConfigError", "DataError", "RuntimeError"])
def test_a_failed_job_is_described_without_a_traceback_for_bad_input_only(error_type):
    """Every error of fgrpo.infra.errors.BAD_INPUT (a sweep job's CheckpointError among them) is its message alone;
    any other error shows its traceback."""
    from hydra.core.utils import JobReturn, JobStatus

    from fgrpo.infra import errors
    from hydra_plugins.fgrpo_plugins import describe_failure

    try:
        raise getattr(errors, error_type, RuntimeError)("no checkpoint in RUN/checkpoints could be loaded")
    except Exception as raised:  # noqa: BLE001 - what the launcher keeps of a failed job
        error = raised
    result = JobReturn(overrides=["seed=1"], status=JobStatus.FAILED, _return_value=error)
    text = describe_failure(result, 3)
    assert text.startswith(f"sweep job #3 [seed=1] failed: {error_type}: no checkpoint in RUN/checkpoints")
    assert ("Traceback" in text) == (error_type == "RuntimeError")
