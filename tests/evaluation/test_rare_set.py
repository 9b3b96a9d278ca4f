"""fgrpo.evaluation.rare_set: the rare-trajectory NLL against a direct log-prob computation, the set's selection,
batches and file format. The commands that build and score sets, and the score at each training evaluation, are in
tests/test_rare_nll.py."""

from __future__ import annotations

import numpy as np
import pytest

from fgrpo.evaluation.rare_set import (RareSet, check_vocabulary, length_normalised_nll, load_rare_set, save_rare_set, score,
                                       select_rarest, token_budget_batches)
from fgrpo.learner.packing import Sequence
from rare_cases import direct_nll, some_sequences, tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


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
