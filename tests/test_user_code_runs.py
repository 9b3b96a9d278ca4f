"""Issue 71 through `python run.py` on the tiny model: verl's ground truths of every type reach the reward as the
row holds them, TRL's ``trainer_state`` advances with the step and ``log_metric`` reaches metrics.jsonl, TRL batch
functions taking only ``completions`` or only ``prompts`` run on a chat model, and a reward that hangs on every sample
stops the real vLLM run early with one error and nothing after it."""

import json
import textwrap
from pathlib import Path

import pytest

from fgrpo.infra.run_files import read_metrics
from test_run import EAGER, TINY, run_cli

REWARDS = '''
import time

def typed(ground_truth, kind, trainer_state, log_metric):
    expected = {"dict": dict, "list": list, "int": int}[kind]
    log_metric("step", trainer_state.global_step)
    log_metric("max_steps", trainer_state.max_steps)
    return {"score": 0.0, "type_ok": float(type(ground_truth) is expected)}

def only_completions(completions):
    return [float(isinstance(c, list) and c[0]["role"] == "assistant") for c in completions]

def only_prompts(prompts):
    return [float(isinstance(p, list) and p[-1]["role"] == "user") for p in prompts]

def always_hangs(completion):
    time.sleep(3600)
'''

GROUND_TRUTHS = {"dict": {"target": [3, "three"]}, "list": [1, 2], "int": 7}


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("verl_task")
    (folder / "rewards.py").write_text(textwrap.dedent(REWARDS))
    for split, count in (("train", 12), ("test", 6)):
        with open(folder / f"{split}.jsonl", "w") as file:
            for index in range(count):
                kind = list(GROUND_TRUTHS)[index % 3]
                row = {"question": f"Question {index}?", "kind": kind,
                       "reward_model": {"ground_truth": GROUND_TRUTHS[kind], "style": "rule"}}
                file.write(json.dumps(row) + "\n")
    return folder


def test_ground_truths_trainer_state_log_metric_and_trls_single_names(tmp_path, task):
    entries = (f'{{fn: "{task}/rewards.py:typed", verdict: true}}, {{fn: "{task}/rewards.py:only_completions", '
               f'weight: 0}}, {{fn: "{task}/rewards.py:only_prompts", weight: 0}}')
    result = run_cli(tmp_path, *TINY, "sampler=hf", "logger=none", EAGER, "dataset=local",
                     f"dataset.train.path={task}/train.jsonl", f"dataset.eval.0.path={task}/test.jsonl",
                     "dataset.train.answer_field=reward_model.ground_truth",
                     "dataset.eval.0.answer_field=reward_model.ground_truth", f"dataset.rewards=[{entries}]")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [r["train/reward/typed/type_ok"] for r in steps] == [1.0, 1.0]  # a dict, a list and an int, unchanged
    assert [r["train/reward/typed/step"] for r in steps] == [1.0, 2.0]  # trainer_state.global_step, by log_metric
    assert all(r["train/reward/typed/max_steps"] == 2.0 for r in steps)
    assert [r["eval/eval/reward/typed/step"] for r in evals] == [0.0, 1.0, 2.0]  # eval.every=1: before, 1, 2
    assert all(r["train/reward/only_completions"] == 1.0 and r["train/reward/only_prompts"] == 1.0 for r in steps)
    assert all(r["train/reward_errors"] == 0 for r in steps)
    assert all(r["train/reward/typed/errors/raised"] == 0 for r in steps)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_reward_hanging_on_every_sample_stops_the_vllm_run_early_with_one_error(tmp_path, task):
    result = run_cli(tmp_path, "model=tiny_random", "logger=none", "sampler=vllm", EAGER,
                     f'dataset.rewards=[{{fn: "{task}/rewards.py:always_hangs"}}]', "dataset.reward_timeout_s=1")
    assert result.returncode == 2
    error = result.stderr[result.stderr.index("error: reward function always_hangs"):]
    assert "failed its first 16 calls, all the same way (timeout)" in error
    assert "Traceback" not in error and "ValueError" not in error, error  # nothing after the one error
