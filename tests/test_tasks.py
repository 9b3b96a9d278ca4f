"""A user's own task through `python run.py` (docs/tasks.md): reward functions, a generator and an advantage method in
files outside the package, loaded by path; their metrics, skipped prompts, a failing function on 2 gloo ranks, and the
Countdown example (examples/countdown/)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fgrpo.infra.run_files import read_metrics
from test_run import EAGER, REPO, TINY, run_cli

HF = ["sampler=hf", "logger=none", EAGER]

TASK = '''
import random

def make(seed, count):
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"a": a, "b": b, "answer": a + b, "meta": {"level": "easy" if a + b < 10 else "hard"}})
    return rows

def exact(completion, a, b):
    return {"score": float(str(a + b) in completion), "correct": str(a + b) in completion}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.0, "source_ok": float(data_source == "sums"), "level_ok": float("meta" in extra_info)}

def length(prompts, completions, completion_ids, **kwargs):
    return [len(ids) / 100 for ids in completion_ids]

def only_additions(completion, op):
    return None if op == "*" else 0.0

def per_process(count):
    import os
    rng = random.Random(os.getpid())  # not seeded by its arguments: each rank makes other rows
    return [{"question": f"{rng.randint(1, 99)} + 1?", "answer": 0} for _ in range(count)]

def needs_target(completion, target):
    return 0.0

def always_raises(completion):
    raise RuntimeError("this reward function has a bug")

def exits_on_rank_1(count):
    import os, sys
    if os.environ.get("RANK") == "1":
        sys.exit(1)
    return [{"question": f"{i} + 1?", "answer": i + 1} for i in range(count)]
'''


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("my_task") / "my_task.py"
    path.write_text(textwrap.dedent(TASK))
    return path


def rewards(task_file: Path, *entries: str) -> str:
    return f"dataset.rewards=[{', '.join(entries).replace('FILE', str(task_file))}]"


def test_a_generated_task_with_three_reward_conventions_trains_and_logs_each(tmp_path, task_file):
    result = run_cli(tmp_path, *TINY, *HF, "dataset.kind=generator", "dataset.name=sums",
                     f"dataset.generator={task_file}:make", "dataset.generator_args={seed: 0, count: 30}",
                     "dataset.generator_n_eval=6", "dataset.prompt_template='What is {a} + {b}? {instruction}'",
                     rewards(task_file, '{fn: "FILE:exact", verdict: true}', '{fn: "FILE:compute_score"}',
                             '{fn: "FILE:length", weight: 0.5}'))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert len(steps) == 2 and len(evals) == 3
    for name in ("exact", "compute_score", "length"):
        assert all(f"train/reward/{name}" in r for r in steps) and f"eval/sums/reward/{name}" in evals[0]
    assert steps[0]["train/reward/compute_score/source_ok"] == 1.0  # data_source: the dataset's name
    assert steps[0]["train/reward/compute_score/level_ok"] == 1.0  # extra_info: the row's columns
    assert steps[0]["train/reward_errors"] == 0 and steps[0]["train/skipped_prompts"] == 0
    # the training reward is the weighted sum: exact (0 for a random model) + 0 + 0.5 * tokens / 100
    assert steps[0]["train/reward_mean"] == pytest.approx(0.5 * steps[0]["train/reward/length"], abs=1e-6)
    assert steps[0]["train/correct_mean"] == steps[0]["train/reward/exact"]
    saved = (tmp_path / ".hydra" / "config.yaml").read_text()
    assert "kind: generator" in saved and "my_task.py:exact" in saved


def test_none_from_every_reward_skips_prompts_in_training_and_problems_in_evaluation(tmp_path, task_file):
    result = run_cli(tmp_path, *TINY, *HF, "trainer.prompts_per_step=4", "eval.max_problems=8",
                     rewards(task_file, '{fn: "FILE:only_additions"}'))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "train/skipped_prompts" in r]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert sum(r["train/skipped_prompts"] for r in steps) > 0  # the a * b prompts
    skipped = evals[0]["eval/arithmetic/skipped_problems"]
    counts = [json.loads(line) for line in (tmp_path / "eval_counts.jsonl").read_text().splitlines()]
    step0 = [c for c in counts if c["step"] == 0]
    assert skipped > 0 and len(step0) == 8 - skipped and all("+" in c["problem"] for c in step0)


USER_ADVANTAGE = '''
from fgrpo.algorithm.advantage_registry import Param, advantage_method

@advantage_method("push_everything", label="alpha", params={"alpha": Param(1.0, low=0.0, low_open=True,
                                                                            doc="every sample's advantage")})
def push_everything(rewards, correct, settings, seq_logp=None):
    return rewards.new_full(rewards.shape, settings.alpha)
'''


def test_a_users_advantage_method_by_path_sets_the_update(tmp_path):
    method = tmp_path / "my_advantage.py"
    method.write_text(USER_ADVANTAGE)
    result = run_cli(tmp_path / "run", *TINY, *HF, f"advantage.name={method}:push_everything",
                     "+advantage.alpha=0.75")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    # a random model earns no reward: GRPO's advantages would be 0; this method's are alpha for every sample
    assert [r["train/adv_abs_mean"] for r in steps] == [0.75, 0.75]
    assert all(r["train/grad_norm"] > 0 for r in steps)


def torchrun(*overrides: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(REPO / "run.py"), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PWD": str(cwd)}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def test_a_reward_function_failing_its_first_batch_stops_both_ranks_with_its_traceback(tmp_path, task_file):
    done = torchrun("model=tiny_random", "trainer.steps=2", "trainer.prompts_per_step=2", "algo.group_size=2",
                    "eval.n_samples=2", "eval.max_problems=2", "sampler.max_new_tokens=4", *HF,
                    rewards(task_file, '{fn: "FILE:always_raises"}'), cwd=tmp_path)
    assert done.returncode != 0
    assert done.stderr.count("error: reward function always_raises") == 1, done.stderr[-3000:]  # rank 0, once
    assert "failed on all 2 samples of its first batch" in done.stderr
    assert 'my_task.py", line' in done.stderr and "RuntimeError: this reward function has a bug" in done.stderr
    assert "exitcode  : 2" in done.stderr  # torchrun's record: the ranks exited with the bad-input code
    assert not [r for path in tmp_path.glob("outputs/*/*/metrics.jsonl") for r in read_metrics(path)
                if "train/loss" in r]


def test_a_reward_function_the_data_cannot_feed_is_refused_on_rank_0_and_both_ranks_exit(tmp_path, task_file):
    done = torchrun("model=tiny_random", *HF, rewards(task_file, '{fn: "FILE:needs_target"}'), cwd=tmp_path)
    assert done.returncode != 0
    assert done.stderr.count("error: reward functions that cannot run on this data:") == 1, done.stderr[-3000:]
    assert "no value for its parameter(s) target" in done.stderr and "exitcode  : 2" in done.stderr
    assert not list(tmp_path.glob("outputs/*/*/metrics.jsonl"))


def test_ranks_that_generate_other_rows_stop_before_the_model_loads(tmp_path, task_file):
    done = torchrun("model=tiny_random", *HF, "dataset.kind=generator", f"dataset.generator={task_file}:per_process",
                    "dataset.generator_args={count: 20}", "dataset.generator_n_eval=4", cwd=tmp_path)
    assert done.returncode != 0
    assert done.stderr.count("error: ranks [1] loaded other problems than rank 0") == 1, done.stderr[-3000:]
    assert "exitcode  : 2" in done.stderr


def test_a_generator_exiting_on_rank_1_stops_both_ranks_with_one_error(tmp_path, task_file):
    done = torchrun("model=tiny_random", *HF, "dataset.kind=generator", f"dataset.generator={task_file}:exits_on_rank_1",
                    "dataset.generator_args={count: 20}", "dataset.generator_n_eval=4", cwd=tmp_path)
    assert done.returncode != 0
    assert done.stderr.count("error: dataset.generator=") == 1, done.stderr[-3000:]  # rank 0 says rank 1's error
    assert "SystemExit: 1" in done.stderr and "exitcode  : 2" in done.stderr
    assert not list(tmp_path.glob("outputs/*/*/metrics.jsonl"))


def test_the_countdown_example_trains(tmp_path):
    # the README's command, from the repository root, on the tiny model for one step
    command = [sys.executable, "run.py", "--config-dir", "examples/countdown", "experiment=countdown",
               f"hydra.run.dir={tmp_path}", "model=tiny_random", "trainer.steps=1", "trainer.prompts_per_step=2",
               "algo.group_size=2", "eval.n_samples=2", "eval.max_problems=4", "sampler.max_new_tokens=8", *HF]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    step = next(r for r in rows if "train/loss" in r)
    assert {"train/reward/reaches_target", "train/reward/writes_an_expression",
            "train/reward/reaches_target/found"} <= set(step)
    assert "eval/countdown/pass@1" in rows[-1]
