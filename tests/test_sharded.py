"""The sharded learner (FSDP2 over gloo, 2 real processes under torchrun) steps exactly as one process does on the
same batch: the parameters after the step and the step's metrics (tests/sharded_update.py runs both)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sharded_update import CASES

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 300  # the script's process group times out after 60 s: a hang fails, CI goes on


def torchrun(nproc: int, script: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``script`` under torchrun with ``nproc`` local processes, one thread each (2 cores)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=full_env)


def one_step(case: str, nproc: int, tmp_path: Path) -> dict:
    out = tmp_path / f"{case}-{nproc}.pt"
    if nproc == 1:
        done = subprocess.run([sys.executable, str(TESTS / "sharded_update.py"), case, str(out)], capture_output=True,
                              text=True, timeout=TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    else:
        done = torchrun(nproc, TESTS / "sharded_update.py", case, str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(out)
    assert result["world"] == nproc
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_step_as_one_process(case, tmp_path):
    one, two = one_step(case, 1, tmp_path), one_step(case, 2, tmp_path)
    exact = CASES[case]["dtype"] == torch.float64
    # fp64: the same sums in another order (7e-16 seen); fp32: a different reduction order, relative 1e-5
    rel = 1e-12 if exact else 1e-5
    for key, value in one["metrics"].items():
        if key == "padding_frac":  # each rank packs its own share: the layout differs, the tokens do not
            continue
        assert two["metrics"][key] == pytest.approx(value, rel=rel, abs=1e-12 if exact else 1e-6), key
    if CASES[case]["grad_clip"] < 1:
        assert one["metrics"]["grad_norm"] > CASES[case]["grad_clip"]  # the clip bound, in both
    assert 0 <= two["metrics"]["padding_frac"] < 1 and one["metrics"]["computed_tokens"] > 0
    assert one["params"].keys() == two["params"].keys() == two["grads"].keys()
    for name, grad in one["grads"].items():
        assert (two["grads"][name] - grad).norm() <= rel * grad.norm() + 1e-30, name
    if exact:  # AdamW's first step is about lr * sign(grad): in fp32 a tiny gradient's sign may flip, so fp64 only
        for name, param in one["params"].items():
            # lr 1e-2 moved every weight: the comparison is not of two untouched copies
            torch.testing.assert_close(two["params"][name], param, rtol=1e-12, atol=1e-12, msg=name)
