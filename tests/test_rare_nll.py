"""The rare-trajectory NLL's commands (python -m fgrpo.rare_nll build / score) and its logging at each training
evaluation. The set's own functions: tests/evaluation/test_rare_set.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fgrpo.evaluation.rare_set import RareSet, length_normalised_nll, load_rare_set, save_rare_set
from fgrpo.infra.run_files import read_metrics
from rare_cases import some_sequences, tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def test_a_training_run_logs_the_rare_nll_at_each_evaluation(tiny, tmp_path):
    folder, model, tokenizer = tiny
    seqs = some_sequences(12, seed=1)
    base = length_normalised_nll(model, seqs, pad_id=tokenizer.pad_token_id)
    save_rare_set(tmp_path / "rare", RareSet(["p"] * 12, seqs, base, {"model": "tiny_random"}), [""] * 12)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(REPO / "run.py"), f"hydra.run.dir={run_dir}", "model=tiny_random", "sampler=hf",
         "logger=none", "trainer.steps=2", "trainer.prompts_per_step=2", "algo.group_size=4", "eval.n_samples=2",
         "eval.max_problems=2", "eval.every=1", "sampler.max_new_tokens=8", "trainer.lr=1e-3",
         "hardware.compile_learner=false", f"eval.rare_set={tmp_path / 'rare'}"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert done.returncode == 0, done.stderr[-3000:]
    evals = [row for row in read_metrics(run_dir / "metrics.jsonl") if "eval/rare_nll" in row]
    assert [row["step"] for row in evals] == [0, 1, 2]
    # before training the policy is the base model: no change (the learner's kernels against the plain forward)
    assert evals[0]["eval/rare_nll"] == pytest.approx(base.mean(), abs=1e-4)
    assert abs(evals[0]["eval/rare_nll_delta"]) < 1e-4
    assert evals[2]["eval/rare_nll_delta"] != evals[0]["eval/rare_nll_delta"]  # the updates moved it


def test_a_missing_rare_set_stops_a_run_before_the_model_loads(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "run.py"), f"hydra.run.dir={tmp_path / 'run'}", "model=tiny_random", "logger=none",
         f"eval.rare_set={tmp_path}/none"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and f"eval.rare_set={tmp_path}/none" in done.stderr and "build one with" in done.stderr


@pytest.mark.slow
def test_build_keeps_the_rarest_correct_base_samples_and_score_gives_the_base_no_change(tmp_path):
    out = tmp_path / "rare"
    command = [sys.executable, "-m", "fgrpo.rare_nll"]
    done = subprocess.run([*command, "build", "--prompts", "6", "--samples", "8", "--fraction", "0.25", "--out",
                           str(out), "sampler=hf", "sampler.max_new_tokens=16"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((out / "rare_set.json").read_text())
    rare = load_rare_set(out)
    assert 0 < meta["correct"] <= 48 and meta["kept"] == len(rare.seqs) == max(1, round(0.25 * meta["correct"]))
    assert rare.base_nll.min() == pytest.approx(meta["nll_threshold"])
    assert rare.base_mean >= meta["base_nll_mean_all_correct"]  # the rarest: above the average correct one
    done = subprocess.run([*command, "score", str(out), meta["model_folder"], "--out", str(tmp_path / "s.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "s.json").read_text())
    assert abs(result["rare_nll_delta"]) < 1e-4 and result["trajectories"] == len(rare.seqs)
    done = subprocess.run([*command, "score", str(tmp_path / "none"), meta["model_folder"]],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "build one with" in done.stderr
