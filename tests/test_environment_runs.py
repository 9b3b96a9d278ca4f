"""Environments through ``python run.py`` (issue 72): the two examples a user runs (a text game and TRL's
environment_factory shape) train on tiny_random with each sampler, write episode metrics and transcripts; bad input
is refused before the model loads, naming the key; a class failing every episode stops both ranks of a torchrun with
its traceback; a run killed mid-step and resumed ends bitwise as one never stopped; the bundled model (slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fgrpo.infra.run_files import read_metrics
from wandb_files import read_wandb_run
from test_run import EAGER, REPO
from test_tasks import torchrun

ENVS = REPO / "tests" / "environments" / "envs.py"
SMALL = ["model=tiny_random", "trainer.steps=2", "trainer.prompts_per_step=2", "algo.group_size=2",
         "eval.n_samples=2", "eval.max_problems=2", "eval.every=1", "sampler.max_new_tokens=8", "logger=none", EAGER]
GAME = ["--config-dir", "examples/guess", "experiment=guess"]
TOOLS = ["--config-dir", "examples/calculator", "experiment=calculator"]
ENV_KEYS = {"train/env/turns_mean", "train/env/tool_calls_mean", "train/env/tool_errors_mean",
            "train/env/truncated_frac", "train/env/sampled_tokens_mean", "train/env/reward_mean",
            "train/env/errors/raised", "train/env/errors/timeout", "train/env/errors/died", "train/env/errors/value"}


def run_example(run_dir: Path, shape: list[str], *overrides: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """``python run.py --config-dir examples/<name> experiment=<name> ...``, the README's command, from the root."""
    command = [sys.executable, str(REPO / "run.py"), *shape, f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "WANDB_MODE": "offline"})


def example(run_dir: Path, shape: list[str], *overrides: str) -> list[dict]:
    result = run_example(run_dir, shape, *SMALL, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir / "metrics.jsonl")


def run_bad(run_dir: Path, *overrides: str) -> str:
    result = run_example(run_dir, GAME, *SMALL, *overrides, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    return result.stderr


@pytest.mark.parametrize("shape", ["game", "tools"])
def test_each_example_trains_two_steps_with_episode_metrics_and_transcripts(tmp_path, shape):
    rows = example(tmp_path, GAME if shape == "game" else TOOLS, "sampler=hf", "logger=wandb")
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2 and all(ENV_KEYS <= set(r) for r in steps)
    assert all(r["train/grad_norm"] >= 0 and 1 <= r["train/env/turns_mean"] <= 3 for r in steps)
    evals = [r for r in rows if "eval/pass@1" in r]
    assert len(evals) == 3 and all(f"eval/{shape_name(shape)}/env/turns_mean" in r for r in evals)
    transcripts = [json.loads(line) for line in open(tmp_path / "transcripts.jsonl")]
    assert sorted({t["step"] for t in transcripts}) == [0, 1, 2]
    assert all(t["messages"][0]["role"] in ("system", "user") and t["turns"] >= 1 for t in transcripts)
    assert (tmp_path / "transcripts" / "step_0002.md").read_text().startswith("# Episodes at step 2")
    tables = [r for r in read_wandb_run(tmp_path).history if "eval/transcripts" in r]  # W&B's table of them
    assert [r["_step"] for r in tables] == [0, 1, 2] and tables[0]["eval/transcripts"]["_type"] == "table-file"
    if shape == "game":  # every random answer is wrong: three tries, each after the first told "higher" or "lower"
        assert all(t["turns"] == 3 and [m["role"] for m in t["messages"]].count("user") == 3 for t in transcripts)


def shape_name(shape: str) -> str:
    return "guess" if shape == "game" else "calculator"


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_and_hf_give_the_game_the_same_structure(tmp_path):
    """The same episodes' shape from both samplers: three turns each (random text never answers), a user turn between
    turns, the same per-episode metrics."""
    hf = example(tmp_path / "hf", GAME, "sampler=hf")
    vllm = example(tmp_path / "vllm", GAME, "sampler=vllm")
    for rows in (hf, vllm):
        steps = [r for r in rows if "train/loss" in r]
        assert [r["train/env/turns_mean"] for r in steps] == [3.0, 3.0]
    keys = lambda rows: {k for r in rows for k in r if "/env/" in k}  # noqa: E731
    assert keys(hf) == keys(vllm)
    for folder in ("hf", "vllm"):
        transcripts = [json.loads(line) for line in open(tmp_path / folder / "transcripts.jsonl")]
        assert all([m["role"] for m in t["messages"]] == ["user", "assistant"] * 3 for t in transcripts)


def test_bad_environments_are_refused_before_the_model_loads(tmp_path):
    cases = {
        f"dataset.environment={ENVS}:NoShape": "has reset but neither step(text)",
        f"dataset.environment={ENVS}:ToolWithoutDocstring": "cannot be described to the model",
        f"dataset.environment={ENVS}:ResetNeedsColumn": "reset takes ['missing_column'], which the rows do not have",
        f"dataset.environment={ENVS}:Missing": "has no 'Missing'",
    }
    for override, message in cases.items():
        stderr = run_bad(tmp_path / str(len(message)), override)
        assert "error: dataset.environment=" in stderr and message in stderr, stderr[-2000:]
        assert "Loading weights" not in stderr
    stderr = run_bad(tmp_path / "turns", "dataset.max_turns=0")
    assert "dataset.max_turns=0: must be >= 1" in stderr


def test_a_class_failing_every_episode_stops_both_ranks_with_its_traceback(tmp_path):
    done = torchrun(*GAME, *SMALL, "sampler=hf", f"dataset.environment={ENVS}:RaisingReset", cwd=REPO,
                    timeout=600)
    assert done.returncode != 0
    assert done.stderr.count("error: environment") == 1, done.stderr[-3000:]  # rank 0 says it, once
    assert "failed every one of the" in done.stderr and "ValueError: reset is broken" in done.stderr
    assert "exitcode  : 2" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["game", "tools"])
def test_each_example_trains_the_bundled_model(tmp_path, shape):
    rows = example(tmp_path, GAME if shape == "game" else TOOLS, "model=smollm2_135m", "trainer.prompts_per_step=4",
                   "algo.group_size=4", "eval.max_problems=2", "eval.every=2", "eval.before=false")
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2 and all(r["train/env/sampled_tokens_mean"] > 0 for r in steps)


# the text game by overrides, so that tests/test_resume.py's command (its RUN first) takes it
GAME_OVERRIDES = ["dataset.name=guess", "dataset.kind=arithmetic", "dataset.arithmetic.ops=[*]",
                  "dataset.arithmetic.max_operand=12", f"dataset.environment={REPO}/examples/guess/guess.py:GuessTheAnswer",
                  "dataset.rewards=[]", "model.instruction=''", "dataset.episode_max_tokens=64", EAGER,
                  "trainer.steps=4", "algo.group_size=2"]


def test_a_run_with_an_environment_killed_in_step_4_and_run_again_ends_bitwise_as_one_never_stopped(tmp_path):
    from test_resume import assert_same_rows, assert_same_weights, final_weights, kill_during_step, run

    whole = tmp_path / "whole"
    done = run(whole, *GAME_OVERRIDES)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = tmp_path / "resumed"
    kill_during_step(resumed, 4, *GAME_OVERRIDES)  # after the checkpoint of step 2
    done = run(resumed, *GAME_OVERRIDES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in (resumed / "run.log").read_text() and "step 2 done, 2 to go" in (resumed / "run.log").read_text()
    assert_same_weights(final_weights(resumed), final_weights(whole))
    assert_same_rows(read_metrics(resumed / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl"))
