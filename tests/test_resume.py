"""Runs that stop and go on: ``python run.py`` killed with SIGKILL in the middle of a step and run again with the
same command ends with the weights of a run that never stopped, bitwise (HF sampler), on one process and on two
ranks; a 2-rank checkpoint loads in one process; the vLLM sampler resumes its step count, data cursor and
optimizer; a Slurm job sent SIGUSR2 saves, is requeued and finishes as an uninterrupted job; a resume that would
change the experiment is refused; ``python -m fgrpo.export`` writes a checkpoint as an HF folder."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fgrpo.infra import checkpoint
from fgrpo.evaluation.held_out import COUNTS_FILE
from fgrpo.infra.run_files import SUPERSEDED_FILE, read_metrics
from test_sweep import LAUNCH_ENV, SLURM, sacct_states
from wandb_files import read_wandb_run

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900
RUN = ["model=tiny_random", "sampler=hf", "logger=wandb", "trainer.steps=6", "trainer.prompts_per_step=2",
       "algo.group_size=4", "eval.n_samples=4", "eval.max_problems=4", "eval.every=3", "sampler.max_new_tokens=8",
       "trainer.checkpoint_every=2", "trainer.save_final=true",
       # a random model earns no reward: the entropy bonus gives every step a gradient
       "algo.entropy_coef=0.01", "trainer.lr=1e-3",
       # compiled, as a run of 40 updates or more is (auto would leave these 6 steps eager)
       "hardware.compile_learner=true"]
# the compiled learner costs each run about 40 s of compiling on a 2-core CPU: the uninterrupted run and its killed
# twins keep it (a resumed run compiles again, for the shapes it meets first); the others learn eager
EAGER = "hardware.compile_learner=false"
# keys that may differ between a run and its resumed twin: wall-clock times and what is measured from them
VARYING = ("time", "perf/")


def command(run_dir: Path, *overrides: str, ranks: int = 1) -> list[str]:
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [*launcher, str(REPO / "run.py"), f"hydra.run.dir={run_dir}", *RUN, *overrides]


def environment(ranks: int) -> dict:
    return {**LAUNCH_ENV, "WANDB_MODE": "offline", **({"OMP_NUM_THREADS": "1"} if ranks > 1 else {})}


def run(run_dir: Path, *overrides: str, ranks: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run(command(run_dir, *overrides, ranks=ranks), cwd=REPO, env=environment(ranks),
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def kill_during_step(run_dir: Path, step: int, *overrides: str, ranks: int = 1) -> None:
    """Start the run, and SIGKILL it (every process of it) once it has logged step ``step - 1``: inside ``step``."""
    log = open(run_dir.parent / f"{run_dir.name}.stderr", "w")  # a pipe nobody reads would fill and block the run
    process = subprocess.Popen(command(run_dir, *overrides, ranks=ranks), cwd=REPO, env=environment(ranks),
                               stdout=subprocess.DEVNULL, stderr=log)
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + TIMEOUT_S
    try:
        while process.poll() is None and time.time() < deadline:
            if metrics.exists() and any(r["step"] == step - 1 and "train/loss" in r for r in read_metrics(metrics)):
                break
            time.sleep(0.05)
        assert process.poll() is None, (run_dir.parent / f"{run_dir.name}.stderr").read_text()[-3000:]
    finally:
        for pid in process_tree(process.pid):  # torchrun starts each rank in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
        log.close()


def process_tree(root: int) -> list[int]:
    """``root`` and every process under it, from /proc (what dies when a node does)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier.extend(children.get(pid, []))
    return tree


def run_log(run_dir: Path) -> str:
    return (run_dir / "run.log").read_text()


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def assert_same_weights(mine: dict, theirs: dict) -> None:
    assert mine.keys() == theirs.keys()
    different = [name for name in mine if not torch.equal(mine[name], theirs[name])]
    assert not different, f"{len(different)} of {len(mine)} tensors differ, e.g. {different[:3]}"


def assert_same_rows(mine: list[dict], theirs: list[dict]) -> None:
    """Each step once, in order, with the same values but for the wall-clock ones."""
    assert [(r["step"], "train/loss" in r) for r in mine] == [(r["step"], "train/loss" in r) for r in theirs]
    for row, twin in zip(mine, theirs):
        steady = {k: v for k, v in row.items() if not k.startswith(VARYING)}
        assert steady == {k: v for k, v in twin.items() if not k.startswith(VARYING)}, row["step"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The 6-step run that never stopped (checkpoints at 2, 4, 6), once for the tests here."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = run(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_a_run_killed_in_step_4_and_run_again_ends_bitwise_as_one_never_stopped(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    kill_during_step(run_dir, 4)
    killed_rows = read_metrics(run_dir / "metrics.jsonl")
    assert max(r["step"] for r in killed_rows) == 3 and not (run_dir / "final_model").exists()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_0000002"
    done = run(run_dir)  # the same command
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in run_log(run_dir) and "step 2 done, 4 to go" in run_log(run_dir)
    assert_same_weights(final_weights(run_dir), final_weights(uninterrupted))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert_same_rows(rows, read_metrics(uninterrupted / "metrics.jsonl"))
    # step 3 (and its evaluation, if the kill came after it), logged before the kill and redone: kept aside
    superseded = read_metrics(run_dir / SUPERSEDED_FILE)
    assert {r["step"] for r in superseded} == {3} and any("train/loss" in r for r in superseded)
    # the per-problem evaluation counts: each evaluation once, as in the run that never stopped
    assert (run_dir / COUNTS_FILE).read_text() == (uninterrupted / COUNTS_FILE).read_text()
    # one W&B run, continued: the second attempt's file has the first one's id and the steps from 3 on
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0].name == files[1].name
    resumed = read_wandb_run(files[1])
    assert min(row["_step"] for row in resumed.history) == 3 and resumed.exit_code == 0


def test_a_deterministic_run_killed_and_resumed_ends_bitwise_as_the_default_one_never_stopped(uninterrupted, tmp_path):
    """hardware.deterministic=true (torch's deterministic algorithms, inductor without timing) on the CPU: the flags
    change no kernel here, so the killed and resumed run ends with the default uninterrupted run's bits."""
    run_dir = tmp_path / "run"
    kill_during_step(run_dir, 4, "hardware.deterministic=true")
    done = run(run_dir, "hardware.deterministic=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in run_log(run_dir)
    assert_same_weights(final_weights(run_dir), final_weights(uninterrupted))


LORA = ("model.lora.rank=4", "trainer.lr=1e-2", EAGER)


@pytest.fixture(scope="module")
def lora_uninterrupted(tmp_path_factory) -> Path:
    """The 6-step LoRA run that never stopped (checkpoints at 2, 4, 6)."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    done = run(run_dir, *LORA)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_a_lora_run_killed_and_resumed_ends_bitwise_as_one_never_stopped(lora_uninterrupted, tmp_path):
    """model.lora: the checkpoint holds the adapters and their AdamW moments; resumed, the run ends with the
    uninterrupted one's merged weights, bitwise."""
    lora, whole = LORA, lora_uninterrupted
    run_dir = tmp_path / "run"
    kill_during_step(run_dir, 4, *lora)
    done = run(run_dir, *lora)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in run_log(run_dir)
    assert_same_weights(final_weights(run_dir), final_weights(whole))
    # and a full-weight config cannot go on from a LoRA checkpoint
    refused = run(run_dir, "trainer.steps=8")
    assert refused.returncode == 2 and "model.lora.rank: 4 -> None" in refused.stderr


def test_a_lora_run_on_two_ranks_ends_as_one_process_does(lora_uninterrupted, tmp_path):
    """model.lora with the learner sharded over 2 ranks (FSDP2 on gloo, the adapters sharded with their layers): the
    run ends with one process's merged weights, up to fp32 AdamW's sign flips of tiny gradients (a weight moves by
    at most about 2 lr times the adapters' scale where one flips)."""
    run_dir = tmp_path / "run"
    done = run(run_dir, *LORA, ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    mine, theirs = final_weights(run_dir), final_weights(lora_uninterrupted)
    assert mine.keys() == theirs.keys()
    moved = [name for name in theirs if not torch.equal(theirs[name], initial_weights()[name])]
    assert moved and all(name.endswith("_proj.weight") for name in moved)
    for name in theirs:
        assert (mine[name] - theirs[name]).abs().max() < 0.1, name


def initial_weights() -> dict:
    from safetensors.torch import load_file

    from fgrpo.learner.model import random_folder

    return load_file(str(random_folder(dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1,
                                            max_position_embeddings=1024), seed=0) / "model.safetensors"))


def test_a_lora_checkpoint_exports_as_an_adapter_or_merged_and_evaluate_takes_either(lora_uninterrupted, tmp_path):
    """fgrpo.export of a LoRA run: the adapter in PEFT's format (PeftModel loads it over the base) or, --merged, the
    merged model (the run's final weights, bitwise); both give the same log-probs, and fgrpo.evaluate takes the
    adapter folder."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    def export(*extra):
        done = subprocess.run([sys.executable, "-m", "fgrpo.export", str(lora_uninterrupted), *extra], cwd=REPO,
                              env=LAUNCH_ENV, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]

    export("--out", str(tmp_path / "adapter"))
    export("--merged", "--out", str(tmp_path / "merged"))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file() and not (tmp_path / "adapter" / "config.json").exists()
    assert_same_weights(load_file(str(tmp_path / "merged" / "model.safetensors")), final_weights(lora_uninterrupted))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base_folder = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32),
                                        str(tmp_path / "adapter"))
    ids = torch.tensor([[5, 17, 99, 260, 31, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits.log_softmax(-1), merged(ids).logits.log_softmax(-1),
                                   atol=1e-5, rtol=1e-5)
    out = tmp_path / "eval"
    done = subprocess.run([sys.executable, "-m", "fgrpo.evaluate", f"hydra.run.dir={out}", "model=tiny_random",
                           "sampler=hf", "logger=none", "eval.n_samples=2", "eval.max_problems=2",
                           f"eval.model={tmp_path / 'adapter'}"], cwd=REPO, env=LAUNCH_ENV, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["eval/model_kind"] == "adapter"


def test_two_ranks_resume_bitwise_and_their_checkpoint_loads_in_one_process(tmp_path):
    two = [EAGER, "hardware.sampler_kv_cache_gib=0.125"]  # compiling under FSDP: minutes
    reference = tmp_path / "uninterrupted"
    done = run(reference, *two, ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    kill_during_step(run_dir, 4, *two, ranks=2)
    done = run(run_dir, *two, ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2 done, 4 to go" in run_log(run_dir)
    assert_same_weights(final_weights(run_dir), final_weights(reference))
    assert_same_rows(read_metrics(run_dir / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl"))
    # the sharded checkpoint of step 6, whole in one process: the weights the two ranks saved at the end
    exported = subprocess.run([sys.executable, "-m", "fgrpo.export", str(run_dir), "--out", str(tmp_path / "hf")],
                              cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert exported.returncode == 0, exported.stderr[-3000:]
    from safetensors.torch import load_file

    assert_same_weights(load_file(str(tmp_path / "hf" / "model.safetensors")), final_weights(reference))
    # and the run goes on in one process from the 2-rank checkpoint
    done = run(run_dir, *two, "trainer.steps=8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 6 done, 2 to go" in run_log(run_dir)
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r["perf/world_size"] for r in steps] == [2] * 6 + [1] * 2


def test_export_writes_any_checkpoint_and_names_the_steps_there_are(uninterrupted, tmp_path):
    from safetensors.torch import load_file

    exported = subprocess.run([sys.executable, "-m", "fgrpo.export", str(uninterrupted), "--out", str(tmp_path / "6")],
                              cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert_same_weights(load_file(str(tmp_path / "6" / "model.safetensors")), final_weights(uninterrupted))
    assert (tmp_path / "6" / "config.json").is_file() and (tmp_path / "6" / "tokenizer_config.json").is_file()
    wrong = subprocess.run([sys.executable, "-m", "fgrpo.export", str(uninterrupted), "--step", "5"], cwd=REPO,
                           env=LAUNCH_ENV, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert wrong.returncode == 2 and "no complete checkpoint of step 5; it has steps: 4, 6" in wrong.stderr


def test_a_resume_that_would_change_the_experiment_is_refused_before_the_model_loads(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    done = run(run_dir, "focal.gamma=1.0", "trainer.lr=1e-4", "trainer.steps=8")
    assert done.returncode == 2
    assert "holds a checkpoint (step 6) of another experiment" in done.stderr
    assert "focal.gamma: 0.0 -> 1.0" in done.stderr and "trainer.lr: 0.001 -> 0.0001" in done.stderr
    assert "trainer.steps" not in done.stderr  # going on longer is the same experiment
    assert "trainer.resume=false" in done.stderr and "Traceback" not in done.stderr
    assert "Loading weights" not in done.stderr
    fewer = run(run_dir, "trainer.steps=4")  # fewer steps than the checkpoint has done
    assert fewer.returncode == 2 and "trainer.steps=4 is below the step of" in fewer.stderr
    assert "set trainer.steps to 6 or more" in fewer.stderr


def test_resume_false_starts_over_keeps_the_previous_runs_files_aside_and_time_makes_checkpoints(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    # and checkpoints by time: every 6 ms, so after each step
    done = run(run_dir, "trainer.resume=false", "trainer.steps=2", "trainer.checkpoint_every=0",
               "trainer.checkpoint_every_min=0.0001", EAGER)
    assert done.returncode == 0, done.stderr[-3000:]
    (aside,) = run_dir.glob("replaced-*")
    assert read_metrics(aside / "metrics.jsonl") == read_metrics(uninterrupted / "metrics.jsonl")
    assert (aside / "checkpoints" / "step_0000006").is_dir()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r] == [1, 2]
    assert [p.name for p in checkpoint.complete_checkpoints(run_dir)] == ["step_0000001", "step_0000002"]


def test_sigusr2_outside_slurm_saves_at_the_end_of_the_step_and_exits_75(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    log = open(tmp_path / "stderr.txt", "w")
    process = subprocess.Popen(command(run_dir, "trainer.checkpoint_every=0"), cwd=REPO, env=environment(1),
                               stdout=subprocess.DEVNULL, stderr=log)
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + TIMEOUT_S
    while process.poll() is None and time.time() < deadline:
        if metrics.exists() and any(r["step"] == 1 and "train/loss" in r for r in read_metrics(metrics)):
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR2)
    process.wait(timeout=TIMEOUT_S)
    log.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 75, stderr[-3000:]
    (saved,) = checkpoint.complete_checkpoints(run_dir)  # no step was due: the signal's
    stopped = checkpoint.read_step(saved)
    assert f"stopped after step {stopped} on SIGUSR2" in run_log(run_dir)
    assert max(r["step"] for r in read_metrics(metrics)) == stopped  # it finished the step it was in, no more
    done = run(run_dir, "trainer.checkpoint_every=0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_weights(final_weights(run_dir), final_weights(uninterrupted))


def test_sigusr2_to_one_rank_stops_both_at_the_same_step(tmp_path):
    """A signal may reach one task only: the ranks agree at the end of the step, save together and exit 75."""
    run_dir = tmp_path / "run"
    log = open(tmp_path / "stderr.txt", "w")
    process = subprocess.Popen(command(run_dir, "trainer.checkpoint_every=0", "trainer.steps=40",
                                       EAGER, "hardware.sampler_kv_cache_gib=0.125",
                                       ranks=2), cwd=REPO, env=environment(2), stdout=subprocess.DEVNULL, stderr=log)
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + TIMEOUT_S
    while process.poll() is None and time.time() < deadline:
        if metrics.exists() and any(r["step"] == 1 and "train/loss" in r for r in read_metrics(metrics)):
            break
        time.sleep(0.05)
    rank_1 = [pid for pid in process_tree(process.pid) if b"LOCAL_RANK=1\0" in _environ(pid)]
    assert len(rank_1) == 1, rank_1
    os.kill(rank_1[0], signal.SIGUSR2)
    process.wait(timeout=TIMEOUT_S)
    log.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    # torchrun's record: the first rank out exited 75 (torchrun then ends the other, past its last collective)
    assert "exitcode  : 75" in stderr.split("Root Cause")[-1], stderr[-3000:]
    (saved,) = checkpoint.complete_checkpoints(run_dir)
    stopped = checkpoint.read_step(saved)
    assert stopped < 40 and f"stopped after step {stopped} on SIGUSR2" in run_log(run_dir)
    assert max(r["step"] for r in read_metrics(metrics)) == stopped
    assert len(list((saved / checkpoint.RNG).iterdir())) == 2  # both ranks wrote theirs


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
@pytest.mark.vllm
def test_the_vllm_sampler_resumes_its_step_data_cursor_and_optimizer(tmp_path):
    vllm = ["sampler=vllm", "trainer.steps=4", "hardware.sampler_kv_cache_gib=0.125", EAGER]
    run_dir = tmp_path / "run"
    kill_during_step(run_dir, 4, *vllm)
    done = run(run_dir, *vllm)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2 done, 2 to go" in run_log(run_dir)
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2, 3, 4]
    state = checkpoint.read_trainer_state(run_dir / "checkpoints" / "step_0000004")
    assert state.stream == {"epoch": 0, "cursor": 4 * 2}  # 2 prompts a step, none drawn twice or skipped
    assert state.scheduler["last_epoch"] == 4
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(run_dir / "checkpoints" / "step_0000004" / "weights")).read_metadata()
    step_keys = [key for key in metadata.state_dict_metadata if key.startswith("optimizer.state.") and key.endswith(".step")]
    assert step_keys  # AdamW's step counts, read back below: 4 updates, not 2 (a restart) or 6 (a repeat)
    counts = {key: torch.zeros(()) for key in step_keys}
    from torch.distributed.checkpoint import load

    load(counts, checkpoint_id=str(run_dir / "checkpoints" / "step_0000004" / "weights"), no_dist=True)
    assert {float(v) for v in counts.values()} == {4.0}


@pytest.mark.slurm
def test_a_slurm_job_sent_usr2_saves_is_requeued_and_ends_as_an_uninterrupted_one(slurm, tmp_path):
    """Two identical jobs in one array; the first gets ``scancel --signal=USR2`` mid-run (what Slurm sends before a
    time limit, and on preemption): it saves at the end of its step, submitit requeues it, and the requeued job
    resumes in the same directory and ends with the weights of the job that ran through."""
    sweep_dir = tmp_path / "sweep"
    overrides = [*SLURM, *[o for o in RUN if not o.startswith(("trainer.checkpoint_every", "trainer.steps"))],
                 "trainer.steps=8", "trainer.checkpoint_every=0", "seed=0,0", "hydra.sweep.subdir=${hydra.job.num}",
                 EAGER]
    process = subprocess.Popen([sys.executable, str(REPO / "run.py"), "-m", f"hydra.sweep.dir={sweep_dir}", *overrides],
                               cwd=REPO, env={**LAUNCH_ENV, "WANDB_MODE": "offline"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    signalled = sweep_dir / "0"
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline and process.poll() is None:
        metrics = signalled / "metrics.jsonl"
        if metrics.exists() and any(r["step"] >= 2 and "train/loss" in r for r in read_metrics(metrics)):
            break
        time.sleep(0.2)
    assert process.poll() is None, process.stderr.read()[-5000:]
    # submitit's folders are named <array>_<task>
    array = next(p.name for p in (sweep_dir / ".submitit").iterdir() if p.name.endswith("_0")).split("_")[0]
    subprocess.run(["scancel", "--signal=USR2", f"{array}_0"], check=True, timeout=60)
    out, err = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 0, err[-5000:]
    assert sacct_states(array, 2) == ["COMPLETED", "COMPLETED"]
    # with duplicates: the first attempt's record (requeued) before the one that completed
    attempts = subprocess.run(["sacct", "-j", f"{array}_0", "-D", "-X", "-n", "-o", "State"], capture_output=True,
                              text=True, timeout=60).stdout.split()
    assert attempts == ["REQUEUED", "COMPLETED"], attempts
    assert "stopped after step" in run_log(signalled) and "resumed from" in run_log(signalled)
    (saved,) = checkpoint.complete_checkpoints(signalled)  # none was due by steps or time: the signal's
    assert 2 <= checkpoint.read_step(saved) < 8
    rows = read_metrics(signalled / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 9))
    assert_same_weights(final_weights(signalled), final_weights(sweep_dir / "1"))
    assert_same_rows(rows, read_metrics(sweep_dir / "1" / "metrics.jsonl"))
