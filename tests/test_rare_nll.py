"""The rare-trajectory NLL (fgrpo.rare_nll): its score against a direct log-prob computation, the set's selection,
file format and commands, and its logging at each training evaluation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fgrpo.learner.model import load_policy, load_tokenizer, random_folder
from fgrpo.learner.packing import Sequence
from fgrpo.rare_nll import (RareSet, check_vocabulary, length_normalised_nll, load_rare_set, save_rare_set, score,
                             select_rarest, token_budget_batches)
from fgrpo.infra.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]
TINY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=1024)  # conf/model/tiny_random.yaml


@pytest.fixture(scope="module")
def tiny():
    folder = random_folder(TINY_SHAPE, seed=0)
    return folder, load_policy(folder, dtype="float32", device="cpu"), load_tokenizer(folder)


def some_sequences(count: int, seed: int = 0) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    return [Sequence(rng.integers(5, 1000, size=rng.integers(3, 12)).tolist(),
                     rng.integers(5, 1000, size=rng.integers(1, 9)).tolist()) for _ in range(count)]


def direct_nll(model, seq: Sequence) -> float:
    """One sequence alone through the model's plain forward: -mean log p of its completion tokens."""
    ids = torch.tensor([seq.prompt_ids + seq.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    start = len(seq.prompt_ids)
    targets = torch.tensor(seq.completion_ids)
    return float(-logp[start - 1:-1].gather(-1, targets[:, None]).mean())


def test_the_score_equals_a_direct_log_prob_computation(tiny):
    _, model, tokenizer = tiny
    seqs = some_sequences(37)  # more than one batch, with lengths that need padding
    got = length_normalised_nll(model, seqs, pad_id=tokenizer.pad_token_id, budget=200)
    want = np.array([direct_nll(model, s) for s in seqs])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    rare = RareSet(["p"] * len(seqs), seqs, want + 0.25, {})
    result = score(model, rare, pad_id=tokenizer.pad_token_id)
    assert result["rare_nll"] == pytest.approx(want.mean(), abs=1e-5)
    assert result["rare_nll_delta"] == pytest.approx(-0.25, abs=1e-5)
    assert model.training  # put back as it was


def test_the_rarest_are_the_highest_nll_and_the_fraction_is_checked():
    nll = np.array([0.1, 3.0, 0.5, 2.0, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8])
    assert select_rarest(nll, 0.2).tolist() == [1, 3]
    assert select_rarest(nll, 0.01).tolist() == [1]  # at least one
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            select_rarest(nll, bad)
    with pytest.raises(ValueError, match="non-empty"):
        select_rarest(np.array([]), 0.5)
    with pytest.raises(ValueError, match="completion token"):
        length_normalised_nll(None, [Sequence([1, 2], [])], pad_id=0)


def test_batches_keep_their_padded_size_within_the_budget_and_the_order():
    seqs = some_sequences(40, seed=3)
    batches = token_budget_batches(seqs, 60)
    assert [s for batch in batches for s in batch] == seqs and len(batches) > 1
    for batch in batches:
        longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in batch)
        assert len(batch) == 1 or len(batch) * longest <= 60
    assert [len(b) for b in token_budget_batches(seqs[:2], 1)] == [1, 1]  # longer than the budget: alone


def test_a_set_of_another_tokenizer_is_refused():
    rare = RareSet(["p"], [Sequence([1, 2], [70_000])], np.array([1.0]), {"model": "qwen"})
    with pytest.raises(ValueError, match="token id 70000, past this model's vocabulary of 49152.*qwen"):
        check_vocabulary(rare, 49152)
    check_vocabulary(rare, 151_000)


def test_a_set_reads_back_as_written_and_a_missing_one_is_named(tmp_path):
    seqs = some_sequences(3)
    save_rare_set(tmp_path / "rare", RareSet(["a", "b", "c"], seqs, np.array([1.0, 2.0, 3.5]), {"kept": 3}),
                  ["x", "y", "z"])
    back = load_rare_set(tmp_path / "rare" / "rare_set.jsonl")
    assert back.problems == ["a", "b", "c"] and back.meta == {"kept": 3} and back.base_mean == pytest.approx(6.5 / 3)
    assert [(s.prompt_ids, s.completion_ids) for s in back.seqs] == [(s.prompt_ids, s.completion_ids) for s in seqs]
    with pytest.raises(ValueError, match="build one with"):
        load_rare_set(tmp_path / "nowhere")


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
         f"eval.rare_set={tmp_path / 'rare'}"],
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
