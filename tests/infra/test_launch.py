"""The launch shapes of one process: ``torchrun --nproc_per_node 1``, plain ``python run.py`` and one Slurm task (its
variables, without a Slurm), each with and without ``hardware.fsdp`` (FSDP2 over a process group of one), each a real
tiny ``run.py`` that must finish and write its metrics. Under torchrun the group of one once waited forever for a
store server that never started (fgrpo.infra.distributed.init_from_env): here such a hang fails instead."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fgrpo.infra.run_files import read_metrics
from test_sweep import LAUNCH_ENV

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # a launch that hangs fails the test (its whole process group killed) instead of hanging CI
TINY = [
    "model=tiny_random", "sampler=hf", "logger=none", "trainer.steps=1", "trainer.prompts_per_step=2",
    "algo.group_size=2", "eval.n_samples=1", "eval.max_problems=1", "eval.every=0", "sampler.max_new_tokens=4",
    "hardware.compile_learner=false",
    # set, not auto: no timing probe of bf16 against fp32
    "hardware.autocast_dtype=float32", "hardware.sampler_dtype=float32",
]
# a process group that never forms fails in about a minute, not after the 30 min default (the timeout above backs it)
QUICK = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "FGRPO_COLLECTIVE_TIMEOUT_S": "30"}
# what a single `srun -n 1` task finds in its environment (no torchrun: fgrpo reads the world size from Slurm's step)
ONE_SLURM_TASK = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
    "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "1",
    "SLURM_CPUS_PER_TASK": "1",
}
# a launcher's variables that the test's own environment may hold (pytest inside a Slurm job or under torchrun)
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_")


def launch(shape: str, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``run.py`` with ``TINY`` into ``run_dir``, launched as ``shape``: torchrun (one process), python or slurm."""
    run_py = [str(REPO / "run.py"), *TINY, f"hydra.run.dir={run_dir}", *overrides]
    if shape == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *run_py]
    else:
        command = [sys.executable, *run_py]
    env = {name: value for name, value in LAUNCH_ENV.items() if not name.startswith(LAUNCHER_PREFIXES)}
    env.update(QUICK, **(ONE_SLURM_TASK if shape == "slurm" else {}))
    # its own session: on a timeout torchrun's worker dies with it, not only the agent
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{shape} launch still running after {TIMEOUT_S} s (a hang):\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "whole"])
@pytest.mark.parametrize("shape", ["torchrun", "python", "slurm"])
def test_one_process_trains_under_every_launcher(shape, fsdp, tmp_path):
    run_dir = tmp_path / "run"
    done = launch(shape, run_dir, f"hardware.fsdp={str(fsdp).lower()}")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in steps] == [1] and steps[0]["perf/world_size"] == 1
    assert [row["step"] for row in rows if "eval/pass@1" in row] == [0, 1]  # before and after
    assert (run_dir / "summary.json").is_file()
