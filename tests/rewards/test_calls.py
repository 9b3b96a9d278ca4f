"""fgrpo.rewards.calls: what a returned value means, and one call as a worker runs it (here, in this process)."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fgrpo.rewards.calls import Call, Describe, Failed, Scored, outcome_of, run_task

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value, expected", [
    (1, Scored(1.0)), (0.25, Scored(0.25)), (True, Scored(1.0)), (np.float32(0.5), Scored(0.5)),
    (torch.tensor(2.0), Scored(2.0)), (None, None),
    ({"score": 0.5, "correct": True, "length": 12, "note": "text"}, Scored(0.5, {"length": 12.0}, True)),
    ({"score": 1, "correct": 0}, Scored(1.0, {}, False)),
])
def test_values_that_count(value, expected):
    assert outcome_of(value) == expected


@pytest.mark.parametrize("value, message", [
    ("1.0", "returned str '1.0': return a number"), (math.nan, "must be finite"), ([1.0], "returned list"),
    ({"correct": True}, "without 'score'"), ({"score": math.inf}, "must be a finite number"),
    ({"score": 1.0, "correct": 0.5}, "never a fraction"), (torch.ones(2), "returned Tensor"),
    (10 ** 400, "returned inf: a reward must be finite"),
])
def test_values_that_are_faults(value, message):
    outcome = outcome_of(value)
    assert isinstance(outcome, Failed) and outcome.kind == "value" and message in outcome.message


def test_a_call_runs_the_function_by_its_path_and_catches_what_it_does(tmp_path):
    (tmp_path / "rewards_here.py").write_text(
        "import time\n"
        "def echo(completion):\n    return len(completion)\n"
        "def boom(completion):\n    raise KeyError('missing')\n"
        "def slow(completion):\n    time.sleep(5)\n    return 1.0\n"
        "def lists(completions):\n    return [1.0]\n"
        "def huge(completions):\n    return [10 ** 400, 1]\n")
    target = f"{tmp_path / 'rewards_here.py'}"

    def call(name, views=({"completion": "abc"},), batch=False, limit=1.0):
        return run_task(Call(f"{target}:{name}", "dataset.rewards[0].fn", tuple(views), batch, limit)).outcomes

    assert call("echo") == [Scored(3.0)]
    (raised,) = call("boom")
    assert raised.kind == "raised" and "KeyError: 'missing'" in raised.message
    assert "rewards_here.py" in raised.message and "fgrpo/rewards" not in raised.message  # the user's frames only
    (late,) = call("slow", limit=0.2)
    assert late.kind == "timeout" and "0.2 s time limit" in late.message
    short = call("lists", views=[{"completion": "a"}, {"completion": "b"}], batch=True)
    assert [o.kind for o in short] == ["value", "value"] and "1 values for 2 samples" in short[0].message
    assert [o.kind if isinstance(o, Failed) else o for o in call("huge", views=[{"completion": "a"}] * 2, batch=True)] \
        == ["value", Scored(1.0)]  # a value beyond float's range fails its sample, not the call
    assert run_task(Describe(f"{target}:echo", "k")).params == ("completion",)
    assert "has no 'nope'" in run_task(Describe(f"{target}:nope", "k"))


def test_what_a_worker_imports_has_no_torch():
    code = ("import sys, fgrpo.rewards.calls, fgrpo.user_code.pool, fgrpo.rewards.entries, run; "
            "print(sorted({'torch', 'transformers', 'vllm', 'datasets'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.strip() == "[]", done.stderr[-2000:]  # run.py: the main module every spawned worker re-imports
