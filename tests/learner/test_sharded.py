"""The sharded learner (FSDP2 over gloo, 2 real processes under torchrun) steps exactly as one process does on the
same batch: the parameters after the step and the step's metrics (tests/children/sharded_update.py runs both)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fgrpo.infra.run_files import read_metrics
from sharded_update import CASES
from test_sweep import LAUNCH_ENV, SLURM, run_dirs, sacct_states, sweep

CHILDREN = Path(__file__).resolve().parents[1] / "children"
REPO = CHILDREN.parents[1]
TIMEOUT_S = 300  # the script's process group times out after 60 s: a hang fails, CI goes on


def torchrun(nproc: int, script: Path, *args: str, env: dict | None = None, cwd: Path | None = None
             ) -> subprocess.CompletedProcess:
    """``script`` under torchrun with ``nproc`` local processes, one thread each (2 cores)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), *args]
    full_env = {**LAUNCH_ENV, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=full_env, cwd=cwd)


def launch(layout: str, cases: list[str], out_dir: Path) -> subprocess.CompletedProcess:
    """tests/children/sharded_update.py over ``cases`` in one launch: ``one process``, ``2 ranks`` (torchrun) or
    ``fsdp alone`` (one process sharded over a group of one)."""
    args = [",".join(cases), str(out_dir)]
    if layout == "2 ranks":
        return torchrun(2, CHILDREN / "sharded_update.py", *args)
    return subprocess.run([sys.executable, str(CHILDREN / "sharded_update.py"), *args]
                          + (["fsdp"] if layout == "fsdp alone" else []), capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={**LAUNCH_ENV, "OMP_NUM_THREADS": "1"})


FSDP_ALONE = ["fp64-clip-checkpointing"]


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> dict:
    """Every case's step in each layout: three launches for the module instead of two per case (each launch costs
    about 10 s of start-up on 2 cores); a launch that fails fails the tests that read it, with its stderr."""
    done = {}
    for layout, cases in [("one process", list(CASES)), ("2 ranks", list(CASES)), ("fsdp alone", FSDP_ALONE)]:
        out_dir = tmp_path_factory.mktemp(layout.replace(" ", "_"))
        done[layout] = (launch(layout, cases, out_dir), out_dir)
    return done


def one_step(steps: dict, case: str, layout: str) -> dict:
    done, out_dir = steps[layout]
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(out_dir / f"{case}.pt")
    assert result["world"] == (2 if layout == "2 ranks" else 1)
    return result


@pytest.mark.parametrize("case,layout", [(case, "2 ranks") for case in CASES] + [(case, "fsdp alone") for case in FSDP_ALONE])
def test_two_ranks_step_as_one_process(case, layout, steps):
    """``fsdp alone``: one process sharded over a group of one (hardware.fsdp=true, e.g. CPU offload on one GPU)."""
    one, two = one_step(steps, case, "one process"), one_step(steps, case, layout)
    exact = CASES[case]["dtype"] == torch.float64
    # fp64: the same sums in another order (7e-16 seen); fp32: a different reduction order, relative 1e-5; bf16: two
    # ranks under FSDP2's bf16 policy against one process under autocast (the case's own bounds)
    rel = 1e-12 if exact else 1e-5
    bounds = CASES[case].get("rel", dict(metrics=rel, grads=rel))
    for key, value in one["metrics"].items():
        if key == "padding_frac":  # each rank packs its own share: the layout differs, the tokens do not
            continue
        assert two["metrics"][key] == pytest.approx(value, rel=bounds["metrics"], abs=1e-12 if exact else 1e-6), key
    if CASES[case]["grad_clip"] < 1:
        assert one["metrics"]["grad_norm"] > CASES[case]["grad_clip"]  # the clip bound, in both
    assert 0 <= two["metrics"]["padding_frac"] < 1 and one["metrics"]["computed_tokens"] > 0
    assert one["params"].keys() == two["params"].keys() and one["grads"].keys() == two["grads"].keys()
    if CASES[case].get("lora"):  # the adapters alone train, against the base as the KL reference
        assert one["grads"] and all(".lora_" in name for name in one["grads"])
        assert one["metrics"]["kl_ref"] > 0
        # the sharded merge for the sampler (each adapter gathered whole): W + (alpha / r) B A of the ranks' weights
        # (the step's weights themselves differ where fp32 AdamW flipped a tiny gradient's sign, as above)
        params = two["params"]
        for name, tensor in two["merged"].items():
            owner = name.removesuffix(".weight")
            if f"{owner}.base_layer.weight" in params:
                merged = params[f"{owner}.base_layer.weight"] + 2.0 * (
                    params[f"{owner}.lora_B.default.weight"] @ params[f"{owner}.lora_A.default.weight"])
                torch.testing.assert_close(tensor, merged, rtol=1e-6, atol=1e-7, msg=name)
            else:  # the tied LM head is the embedding, listed once among the parameters
                assert torch.equal(tensor, params.get(name, params["model.embed_tokens.weight"])), name
    for name, grad in one["grads"].items():
        assert (two["grads"][name] - grad).norm() <= bounds["grads"] * grad.norm() + 1e-30, name
    if exact:  # AdamW's first step is about lr * sign(grad): in fp32 a tiny gradient's sign may flip, so fp64 only
        for name, param in one["params"].items():
            # lr 1e-2 moved every weight: the comparison is not of two untouched copies
            torch.testing.assert_close(two["params"][name], param, rtol=1e-12, atol=1e-12, msg=name)


def test_the_samplers_logprobs_unused_leave_the_sharded_step_bit_for_bit_and_masks_drop_on_both_ranks(steps):
    """rollout_correction=none with the sampler's log-probs read: the step without them, bit for bit, on 2 ranks (the
    mismatch is measured); the masked cases drop some tokens (and whole sequences), as one process does (above)."""
    read, plain = one_step(steps, "fp64-sampler-none", "2 ranks"), one_step(steps, "fp64-packed-offpolicy", "2 ranks")
    assert all(torch.equal(read["params"][name], param) for name, param in plain["params"].items())
    assert read["metrics"]["loss"] == plain["metrics"]["loss"] and read["metrics"]["mismatch/kl_token"] > 0
    for case in ("fp64-token-mask", "fp64-sequence-mask-seq-mean"):
        assert 0 < one_step(steps, case, "2 ranks")["metrics"]["mismatch/dropped_frac"] < 1, case


def test_gradients_reduced_once_per_step_equal_those_reduced_each_micro_batch(steps):
    """hardware.sync_grads_once: FSDP2 reduce-scatters once per parameter group and step (3 layers and the root: 4)
    instead of once per micro-batch (4 on each rank here: 16), and the step's gradients are the same."""
    once, each = one_step(steps, "fp32-sync-once", "2 ranks"), one_step(steps, "fp32-sync-each", "2 ranks")
    groups = 4
    assert once["reductions"] == groups and each["reductions"] == groups * each["micro_batches"] == 16
    for name, grad in each["grads"].items():
        assert (once["grads"][name] - grad).norm() <= 1e-6 * grad.norm() + 1e-30, name


def rank_files(prefix: Path, world: int = 2) -> list[dict]:
    return [json.loads(Path(f"{prefix}.{rank}.json").read_text()) for rank in range(world)]


def test_the_loops_collectives_on_two_ranks(tmp_path):
    done = torchrun(2, CHILDREN / "sharded_collectives.py", str(tmp_path / "seen"))
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = rank_files(tmp_path / "seen")
    # a check that failed on rank 1 alone stops rank 0 too, with rank 1's message
    assert rank0["agree"] == rank1["agree"] == "rank 1's data file is missing"
    # dynamic sampling: rank 0 drew 2 mixed groups a round, rank 1 none; the run's 4 are all rank 0's
    assert (rank0["dynamic_kept"], rank1["dynamic_kept"]) == (4, 0)
    # 5 problems with 0..4 of 4 samples correct, split 3 + 2 (the last repeated on rank 1 and dropped)
    assert rank0["pass@1"] == rank1["pass@1"] == pytest.approx(0.5)
    # one engine over both ranks: rank 0 scored samples 0-2, rank 1 samples 3-5, each rank holds all six
    assert rank0["tensor_parallel_scores"] == rank1["tensor_parallel_scores"] == [0.0] * 3 + [1.0] * 3


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_each_ranks_vllm_scores_as_the_sharded_learner_after_a_push(tmp_path, tensor_parallel):
    done = torchrun(2, CHILDREN / "sharded_push.py", str(tmp_path / "gap"), str(tensor_parallel))
    assert done.returncode == 0, done.stderr[-3000:]
    for seen in rank_files(tmp_path / "gap"):
        assert seen["world"] == 2
        assert seen["before"] > 0.05  # the learner's weights changed: vLLM's old ones score its samples differently
        assert seen["after"] < 1e-4  # fp32 both sides: 2e-6 seen


def test_a_sharded_push_gathers_the_samplers_dtype_and_sends_the_same_weights(tmp_path):
    """Cast on each rank's shard, then gathered (LoRA merged on each rank's rows first), against gathered whole in fp32
    and then cast, the push before: the same bf16 weights, bit for bit, for less than half the bytes (the tied LM
    head, the embedding's weight, is not gathered a second time)."""
    done = torchrun(2, CHILDREN / "sharded_push_dtype.py", str(tmp_path / "push"), "tiny")
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads((tmp_path / "push.json").read_text())
    assert seen["world"] == 2 and seen["cases"].keys() == {"every weight", "lora"}
    for case in seen["cases"].values():
        assert case["differing"] == [] and case["largest_difference"] == 0.0
        assert 2 * case["bytes_after"] < case["bytes_before"]


TINY_RUN = ["model=tiny_random", "logger=wandb", "trainer.steps=2", "trainer.prompts_per_step=4", "algo.group_size=2",
            "eval.n_samples=2", "eval.max_problems=3", "sampler.max_new_tokens=4", "eval.every=0",
            # compiling the layers under FSDP took 290 s on 2 busy cores
            "hardware.compile_learner=false", "hardware.sampler_kv_cache_gib=0.125",
            "algo.entropy_coef=0.01"]  # a random model earns no reward: the entropy bonus gives a gradient


def torchrun_run_py(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 run.py ...`` in ``tmp_path`` (its outputs/ there), W&B offline."""
    return torchrun(2, REPO / "run.py", *TINY_RUN, *overrides, env={"WANDB_MODE": "offline", "PWD": str(tmp_path)},
                    cwd=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_torchrun_trains_on_two_ranks_and_rank_0_writes_once(tmp_path, sampler):
    done = torchrun_run_py(tmp_path, f"sampler={sampler}", "trainer.save_final=true")
    assert done.returncode == 0, done.stderr[-3000:]
    # one run directory for both ranks (rank 0's clock), though each resolved ${now:...} itself
    run_dirs = [config.parent.parent for config in tmp_path.glob("outputs/*/*/.hydra/config.yaml")]
    assert len(run_dirs) == 1, run_dirs
    rows = read_metrics(run_dirs[0] / "metrics.jsonl")
    steps = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in steps] == [1, 2]  # each step once: rank 0 alone writes
    assert all(row["perf/world_size"] == 2 for row in steps)
    # the whole batch's outcomes: 4 prompts x 2 samples, gathered from both ranks
    assert all(row["train/groups"] == 4 and len(row["train/success_rate_hist"]) == 4 for row in steps)
    assert all(math.isfinite(row["train/grad_norm"]) and row["train/grad_norm"] > 0 for row in steps)
    assert len([row for row in rows if "eval/pass@1" in row]) == 2  # before and after
    # the per-problem counts of both evaluations, every problem once per evaluation (rank 0 writes the gathered counts)
    counts = [json.loads(line) for line in (run_dirs[0] / "eval_counts.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in counts}) == [0, 2]
    assert all(len([row for row in counts if row["step"] == step]) == len({row["problem"] for row in counts})
               for step in (0, 2))
    assert len(list(run_dirs[0].glob("wandb/offline-run-*/run-*.wandb"))) == 1
    assert (run_dirs[0] / "pass_at_k.png").is_file()
    log_lines = (run_dirs[0] / "run.log").read_text().splitlines()
    assert sum("precision:" in line for line in log_lines) == 1  # rank 0's log only
    # the final model gathered whole from the shards: every tensor at its full shape, and changed by training
    from safetensors.torch import load_file

    from fgrpo.learner.model import random_folder
    from sharded_push import TINY

    before = load_file(str(random_folder(TINY, seed=0) / "model.safetensors"))
    after = load_file(str(run_dirs[0] / "final_model" / "model.safetensors"))
    assert after.keys() == before.keys()
    assert all(after[name].shape == before[name].shape and after[name].dtype == torch.float32 for name in before)
    assert any(not torch.equal(after[name], before[name]) for name in before)


@pytest.mark.parametrize("overrides,message", [
    (["trainer.prompts_per_step=3"], "trainer.prompts_per_step=3 does not divide over 2 processes"),
    (["sampler=vllm", "sampler.tensor_parallel_size=4"], "sampler.tensor_parallel_size=4 does not divide the 2"),
])
def test_bad_layout_stops_every_rank_before_the_model_loads(tmp_path, overrides, message):
    done = torchrun_run_py(tmp_path, "sampler=hf", *overrides)
    assert done.returncode != 0
    assert done.stderr.count("error: invalid config for this launch:") == 1  # rank 0 says it, once
    assert message in done.stderr
    assert "Traceback" not in done.stderr.split("error: invalid config")[0]
    assert "exitcode  : 2" in done.stderr  # torchrun's record of the ranks' exits: non-zero, the bad-input code
    assert not list(tmp_path.glob("outputs/*/*/metrics.jsonl"))


@pytest.mark.slurm
def test_slurm_job_of_two_tasks_trains_as_torchrun_does(slurm, tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = sweep(sweep_dir, *SLURM, "hardware.slurm_tasks_per_node=2", "hardware.slurm_cpus_per_task=1",
                   "hardware.compile_learner=false", "algo.entropy_coef=0.01",
                   "hydra.sweep.subdir=${hydra.job.num}",  # the overrides would name a directory over 255 bytes
                   # a stale LOCAL_WORLD_SIZE (an in-process vLLM sets one) must not stop a task taking Slurm's
                   env={"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"})
    assert result.returncode == 0, result.stderr[-5000:]
    (job,) = [p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir() and p.name.isdigit()]
    assert sacct_states(job, 1) == ["COMPLETED"]
    # submitit's logs of task 0 and task 1: both ran the job
    assert {p.name for p in (sweep_dir / ".submitit" / job).glob("*_log.out")} == {f"{job}_0_log.out", f"{job}_1_log.out"}
    script = next((sweep_dir / ".submitit").glob(".submission_file_*.sh")).read_text()
    assert "#SBATCH --ntasks-per-node=2" in script
    assert "--kill-on-bad-exit=1" in script  # a task that fails ends its peers, none waits for a timeout
    (run_dir,) = run_dirs(sweep_dir)
    steps = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in steps] == [1, 2]  # once each: rank 0 writes, rank 1 does not
    assert all(row["perf/world_size"] == 2 and row["train/groups"] == 2 for row in steps)
