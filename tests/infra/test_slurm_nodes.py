"""A Slurm job over two nodes, on the local cluster's two slurmds (scripts/local-slurm start): the path a cluster
takes with ``hardware.slurm_nodes=2`` (node names, SLURM_* variables, one task per node meeting at the first node's
name), with the vLLM CPU sampler; then the USR2 requeue on two nodes. And a node count the cluster cannot give."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fgrpo.infra import checkpoint
from fgrpo.infra.run_files import FINAL_MODEL, read_metrics
from test_sweep import LAUNCH_ENV, SLURM, TINY, sacct_states, sweep

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
TWO_NODES = [*SLURM, "hardware.slurm_nodes=2", "hardware.slurm_cpus_per_task=1", "sampler=vllm",
             "hardware.sampler_kv_cache_gib=0.125", "algo.entropy_coef=0.01", "hydra.sweep.subdir=${hydra.job.num}"]


def sacct_field(job: str, field: str) -> list[str]:
    """One sacct field of each of the job's records (duplicates: every attempt), allocation lines only."""
    out = subprocess.run(["sacct", "-j", job, "-D", "-X", "-n", "-P", "-o", field], capture_output=True, text=True,
                         timeout=60).stdout
    return out.split()


def metric_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]


@pytest.fixture
def two_nodes(slurm):
    """The local cluster's two nodes (scripts/local-slurm start: FGRPO_SLURM_NODES=2, the default)."""
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=60).stdout.split()
    assert sorted(set(nodes)) == ["fgrpo-node1", "fgrpo-node2"], (
        f"these tests need scripts/local-slurm's two nodes, and the cluster has {nodes}: "
        "scripts/local-slurm stop, then start (FGRPO_SLURM_NODES=2)")


@pytest.mark.slurm
def test_a_job_over_two_nodes_trains_is_requeued_on_usr2_and_resumes_on_both(two_nodes, tmp_path):
    sweep_dir = tmp_path / "sweep"
    overrides = [o for o in TINY if not o.startswith(("sampler=", "trainer.steps"))]
    command = [sys.executable, str(REPO / "run.py"), "-m", *overrides, f"hydra.sweep.dir={sweep_dir}", *TWO_NODES,
               "trainer.steps=8", "trainer.checkpoint_every=0", "trainer.save_final=true"]
    process = subprocess.Popen(command, cwd=REPO, env={**LAUNCH_ENV, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = sweep_dir / "0"
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline and process.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and any(s >= 2 for s in metric_steps(run_dir)):
            break
        time.sleep(0.2)
    assert process.poll() is None, process.stderr.read()[-5000:]
    (job,) = [p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir() and p.name.isdigit()]
    # Slurm's USR2 before a time limit reaches every task of the step, one on each node
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=60)
    out, err = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 0, err[-5000:]

    assert sacct_states(job, 1) == ["COMPLETED"]
    assert sacct_field(job, "State") == ["REQUEUED", "COMPLETED"]
    assert sacct_field(job, "NodeList") == ["fgrpo-node[1-2]"] * 2  # each attempt held both nodes
    steps = subprocess.run(["sacct", "-j", f"{job}.0", "-n", "-P", "-o", "NodeList,NTasks,State"],
                           capture_output=True, text=True, timeout=60).stdout.split()
    assert steps == ["fgrpo-node[1-2]|2|COMPLETED"], steps  # the task step of the completed attempt: 2 nodes
    script = next((sweep_dir / ".submitit").glob(".submission_file_*.sh")).read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    # submitit's log of each task: task 0 on the first node, task 1 on the second
    logs = {p.name: p.read_text() for p in (sweep_dir / ".submitit" / job).glob("*_log.out")}
    assert set(logs) == {f"{job}_0_log.out", f"{job}_1_log.out"}
    assert "node=0(2), global_rank=0(2)" in logs[f"{job}_0_log.out"]
    assert "node=1(2), global_rank=1(2)" in logs[f"{job}_1_log.out"]

    run_log = (run_dir / "run.log").read_text()
    assert "stopped after step" in run_log and "resumed from" in run_log
    assert metric_steps(run_dir) == list(range(1, 9))  # once each: rank 0 writes, across both attempts
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert all(r["perf/world_size"] == 2 and r["train/groups"] == 2 for r in rows)
    assert all(r["perf/sampler_tokens_per_s"] > 0 for r in rows)  # the vLLM engines sampled
    (saved,) = checkpoint.complete_checkpoints(run_dir)  # none was due by steps: the signal's, both ranks' shards
    assert 2 <= checkpoint.read_step(saved) < 8
    assert len(list((saved / checkpoint.RNG).iterdir())) == 2
    assert (run_dir / FINAL_MODEL / "config.json").is_file()  # and the final weights, gathered from both nodes


@pytest.mark.slurm
def test_a_node_count_the_cluster_cannot_give_is_one_line_naming_the_key(two_nodes, tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = sweep(sweep_dir, *SLURM, "hardware.slurm_nodes=3", "trainer.prompts_per_step=3")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, result.stderr
    assert "Node count specification invalid" in errors[0]
    assert "hardware.slurm_nodes=3 but partition debug takes at most 2 node(s) a job" in errors[0]
    assert "set hardware.slurm_nodes to at most 2" in errors[0] and "Nothing was submitted" in errors[0]
    assert not [p for p in (sweep_dir / ".submitit").iterdir() if p.is_dir()]  # no job folder: nothing queued
    commands = subprocess.run(["squeue", "-h", "-o", "%o"], capture_output=True, text=True, timeout=60).stdout
    assert str(sweep_dir) not in commands


@pytest.mark.parametrize("stderr,expected", [
    ("sbatch: error: Batch job submission failed: More processors requested than permitted",
     "hardware.slurm_tasks_per_node=1 x slurm_cpus_per_task=64 CPUs, slurm_mem_gb=16, slurm_gpus_per_node=0"),
    # sbatch names the request that cannot be met on a line before its refusal
    ("sbatch: error: Memory specification can not be satisfied\n"
     "sbatch: error: Batch job submission failed: Requested node configuration is not available",
     "sbatch refused the job (Memory specification can not be satisfied: Requested node configuration is not "
     "available): no node in partition gpu has what one node of this job asks for"),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
     "sbatch refused the job: Invalid account or account/partition combination "
     "specified (the job's request comes from hardware.slurm_* and hydra.launcher.*)."),
])
def test_what_sbatch_refuses_is_said_in_one_line_naming_the_keys(stderr, expected):
    from hydra_plugins.fgrpo_plugins import sbatch_refusal

    said = sbatch_refusal(stderr, {"partition": "gpu", "nodes": 1, "tasks_per_node": 1, "cpus_per_task": 64,
                                   "mem_gb": 16, "gpus_per_node": None})
    assert expected in said and "\n" not in said


def test_a_failed_sbatch_that_refused_nothing_is_no_refusal():
    from hydra_plugins.fgrpo_plugins import sbatch_refusal

    assert sbatch_refusal("Job got killed for an unknown reason.", {}) is None
    assert sbatch_refusal("sbatch: error: Unable to contact slurm controller (connect failure)", {}) is None
