"""fgrpo.evaluate (a model evaluated on its own) and the per-problem counts every evaluation writes
(eval_counts.jsonl): the counts give back the pass@k that was logged, in training runs and standalone ones."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from fgrpo.infra.errors import ConfigError
from fgrpo.learner.model_source import locate_model
from fgrpo.evaluation.held_out import COUNTS_FILE
from fgrpo.evaluation.pass_at_k import pass_at_k
from fgrpo.infra.run_files import read_metrics

REPO = Path(__file__).resolve().parents[1]
SMALL = ["trainer.prompts_per_step=2", "algo.group_size=4", "eval.n_samples=8", "eval.max_problems=8",
         "sampler.max_new_tokens=8", "logger=none", "hardware.compile_learner=false"]  # compiling: test_run.py
# fp32 matmuls in the learner and the sampler, on every CPU kind (auto: bf16 where the CPU has it)
FP32 = ["hardware.autocast_dtype=float32", "hardware.sampler_dtype=float32"]


def cli(module_or_script: str, run_dir: Path, *overrides: str, timeout: int = 900) -> subprocess.CompletedProcess:
    start = [str(REPO / "run.py")] if module_or_script == "run.py" else ["-m", module_or_script]
    return subprocess.run([sys.executable, *start, f"hydra.run.dir={run_dir}", *overrides], cwd=REPO,
                          env={**os.environ, "WANDB_MODE": "offline"}, capture_output=True, text=True, timeout=timeout)


def read_counts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / COUNTS_FILE).read_text().splitlines()]


def pass_at_k_from_counts(rows: list[dict], k: int) -> float:
    """The mean over problems of the unbiased pass@k, averaged over the sets, as fgrpo.evaluation.held_out logs it."""
    per_set = defaultdict(list)
    for row in rows:
        per_set[row["dataset"]].append(pass_at_k(row["n"], row["c"], k))
    return float(np.mean([np.mean(values) for values in per_set.values()]))


def assert_counts_give_the_logged_pass_at_k(run_dir: Path, n: int, problems: int) -> None:
    rows = read_counts(run_dir)
    logged = {row["step"]: row for row in read_metrics(run_dir / "metrics.jsonl") if "eval/pass@1" in row}
    assert {row["step"] for row in rows} == set(logged)
    for step, metrics in logged.items():
        at_step = [row for row in rows if row["step"] == step]
        assert len(at_step) == problems and {row["n"] for row in at_step} == {n}
        assert len({row["problem"] for row in at_step}) == problems
        for k in (1, 2, 4, 8):
            assert pass_at_k_from_counts(at_step, k) == pytest.approx(metrics[f"eval/pass@{k}"], abs=1e-12), (step, k)


@pytest.mark.slow
def test_the_bundled_model_run_and_its_standalone_evaluation_write_the_same_counts(tmp_path):
    """The HF sampler draws from the evaluation seed, so evaluating a run's final_model on its own redraws its last
    evaluation sample for sample: the same counts, the same pass@k. In fp32: with bf16 matmuls on the CPU the first
    generate of a process does not always compute the same (docs/evaluation.md), and that can tip a draw."""
    run_dir, eval_dir = tmp_path / "run", tmp_path / "eval"
    done = cli("run.py", run_dir, *SMALL, *FP32, "trainer.steps=1", "sampler=hf", "trainer.save_final=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_counts_give_the_logged_pass_at_k(run_dir, n=8, problems=8)
    final_counts = [row for row in read_counts(run_dir) if row["step"] == 1]
    assert 0 < sum(row["c"] for row in final_counts) < 64  # the bundled model: some right, some wrong

    done = cli("fgrpo.evaluate", eval_dir, *SMALL, *FP32, "sampler=hf", f"eval.model={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_counts(eval_dir) == final_counts  # step 1: the run's trainer.steps, its final_model
    assert_counts_give_the_logged_pass_at_k(eval_dir, n=8, problems=8)
    table = (eval_dir / "pass_at_k.md").read_text()
    metrics = read_metrics(eval_dir / "metrics.jsonl")[0]
    assert f"| arithmetic | 8 | 8 | 8 | {metrics['eval/pass@8']:.4f} |" in table and "| 1 |" in table
    assert (eval_dir / "pass_at_k.png").stat().st_size > 10_000
    summary = json.loads((eval_dir / "summary.json").read_text())
    assert summary["eval/model_step"] == 1 and summary["eval/model_kind"] == "hf folder"


@pytest.mark.slow
@pytest.mark.vllm
def test_the_vllm_sampler_evaluates_the_bundled_model_at_many_samples(tmp_path):
    eval_dir = tmp_path / "eval"
    done = cli("fgrpo.evaluate", eval_dir, "eval.n_samples=64", "eval.max_problems=6", "sampler.max_new_tokens=8",
               "logger=wandb")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_counts(eval_dir)
    assert len(rows) == 6 and {row["n"] for row in rows} == {64} and {row["step"] for row in rows} == {None}
    assert "evaluating arithmetic (6 x 64): 100%" in done.stderr  # vLLM's progress bar, under the evaluation's label
    # only the bar over the 384 completions: vLLM's bar over the 6 prompts keeps its own name
    totals = re.findall(r"evaluating arithmetic \(6 x 64\): +\d+%\|[^|]*\| *\d+/(\d+)", done.stderr)
    assert totals and set(totals) == {"384"}, set(totals)
    metrics = read_metrics(eval_dir / "metrics.jsonl")[0]
    for k in (1, 2, 4, 8, 16, 32, 64):
        assert pass_at_k_from_counts(rows, k) == pytest.approx(metrics[f"eval/pass@{k}"], abs=1e-12)
    assert metrics["eval/pass@1"] < metrics["eval/pass@64"]
    assert list((eval_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_a_tiny_run_s_checkpoint_evaluates_from_its_folder_with_its_step(tmp_path):
    run_dir, eval_dir = tmp_path / "run", tmp_path / "eval"
    tiny = ["model=tiny_random", "sampler=hf", *SMALL]
    done = cli("run.py", run_dir, *tiny, "trainer.steps=2", "trainer.checkpoint_every=1", "eval.every=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_counts_give_the_logged_pass_at_k(run_dir, n=8, problems=8)
    assert sorted({row["step"] for row in read_counts(run_dir)}) == [0, 1, 2]

    done = cli("fgrpo.evaluate", eval_dir, *tiny, f"eval.model={run_dir}/checkpoints/step_0000001")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (eval_dir / "model" / "config.json").is_file()  # the checkpoint, exported
    assert "evaluating arithmetic (8 x 8): 100%" in done.stderr  # the HF sampler's progress bar over its batches
    assert {row["step"] for row in read_counts(eval_dir)} == {1}
    assert_counts_give_the_logged_pass_at_k(eval_dir, n=8, problems=8)

    # the run's model group is part of what the run learned: another one is refused before anything loads
    done = cli("fgrpo.evaluate", tmp_path / "other", *SMALL, f"eval.model={run_dir}", timeout=120)
    assert done.returncode == 2
    assert "another prompt format" in done.stderr and "model=tiny_random" in done.stderr
    # a run directory with neither a final model nor a checkpoint
    (run_dir / "checkpoints").rename(tmp_path / "moved")
    done = cli("fgrpo.evaluate", tmp_path / "none", *tiny, f"eval.model={run_dir}", timeout=120)
    assert done.returncode == 2 and "nothing to evaluate" in done.stderr


def test_a_model_path_that_does_not_exist_is_named_before_anything_loads(tmp_path):
    done = cli("fgrpo.evaluate", tmp_path / "eval", "model=tiny_random", "logger=none",
               f"eval.model={tmp_path}/no-such-run", timeout=120)
    assert done.returncode == 2
    assert f"eval.model={tmp_path}/no-such-run: no such file or folder" in done.stderr
    assert not (tmp_path / "eval" / COUNTS_FILE).exists() and "Traceback" not in done.stderr


def test_locate_model_tells_hub_ids_from_missing_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert locate_model("Qwen/Qwen2.5-7B").kind == "hub"
    assert locate_model(None).kind == "model group"
    (tmp_path / "outputs").mkdir()
    with pytest.raises(ConfigError, match="no such file or folder"):
        locate_model("outputs/2026-11-25")  # a typo in a local path, not a hub id
    (tmp_path / "outputs" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        locate_model("outputs/notes.txt")
    with pytest.raises(ConfigError, match="neither a run directory"):
        locate_model(str(tmp_path / "outputs"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    source = locate_model(str(hf))
    assert (source.kind, source.step, source.run_model) == ("hf folder", None, None)
