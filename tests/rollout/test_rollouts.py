"""The loop's data side: problems in epoch order, DAPO's dynamic sampling, the sequences the learner gets."""

import numpy as np
import pytest
import torch

from fgrpo.rollout.data import Problem
from fgrpo.infra.distributed import Ranks
from fgrpo.rollout.rollouts import Groups, ProblemStream, collect_groups, learner_sequences, overlong_penalty, prompt_seeds
from fgrpo.rollout.samplers import Completion


def problems(count):
    return [Problem(id=f"p{i}", question=f"{i}+0?", answer=str(i), source="t") for i in range(count)]


def test_each_epoch_is_a_new_permutation_and_the_first_is_the_benchmarks():
    data = problems(10)
    stream = ProblemStream(data, seed=3)
    epochs = [[p.id for p in stream.take(10)] for _ in range(4)]
    for order in epochs:
        assert sorted(order) == sorted(p.id for p in data)  # every problem once per epoch
    assert len({tuple(order) for order in epochs}) == 4  # no epoch repeats another (the old bug: all after the first)
    assert epochs[0] == [data[i].id for i in np.random.default_rng(3).permutation(10)]
    # takes across an epoch's end continue in the next epoch's order, the same as taking one at a time
    one_by_one = ProblemStream(data, seed=3)
    assert [p.id for _ in range(13) for p in one_by_one.take(1)] == epochs[0] + epochs[1][:3]
    across = ProblemStream(data, seed=3)
    across.take(7)
    assert [p.id for p in across.take(6)] == epochs[0][7:] + epochs[1][:3]


def test_stream_state_round_trips():
    stream = ProblemStream(problems(6), seed=1)
    stream.take(8)
    resumed = ProblemStream(problems(6), seed=1)
    resumed.load_state_dict(stream.state_dict())
    assert [p.id for p in resumed.take(9)] == [p.id for p in stream.take(9)]


def draw_from(verdicts):
    """A draw whose n-th call returns groups with the n-th list of per-problem correct counts (of 4 samples)."""
    calls = []

    def draw(batch, seed):
        counts = verdicts[len(calls)]
        calls.append(seed)
        correct = torch.tensor([[1.0] * c + [0.0] * (4 - c) for c in counts])
        completions = [[Completion([1, 2], [-0.1, -0.1], False, "x")] * 4 for _ in batch]
        return Groups(batch, completions, correct, verify_time_s=0.5)

    return draw, calls


def test_dynamic_sampling_keeps_mixed_groups_and_draws_again():
    draw, seeds = draw_from([[4, 2, 0], [1, 4, 3], [2, 2, 2]])
    groups = collect_groups(draw, ProblemStream(problems(9), seed=0), 3, seed=100, dynamic_sampling=True, max_rounds=3)
    # two mixed after the second draw: 1 + 2 >= 3, no third; one seed per prompt, from the draw's and its place
    assert seeds == [prompt_seeds(100, 3), prompt_seeds(100 + 7919, 3)]
    assert len(set(seeds[0] + seeds[1])) == 6
    assert groups.correct.sum(dim=1).tolist() == [2, 1, 3] and len(groups.problems) == 3
    assert groups.verify_time_s == 1.0
    draw, seeds = draw_from([[4, 0, 0], [0, 4, 4]])
    assert len(collect_groups(draw, ProblemStream(problems(9), seed=0), 3, seed=0, dynamic_sampling=True,
                              max_rounds=2)) == 0  # rounds spent, none mixed: the loop skips the update
    draw, seeds = draw_from([[4, 0, 2]])
    assert len(collect_groups(draw, ProblemStream(problems(9), seed=0), 3, seed=0)) == 3  # off: all kept


def test_learner_sequences_carry_their_advantage_and_skip_empty_completions():
    batch = problems(2)
    completions = [[Completion([5], [-1.0], False, "5"), Completion([], [], False, "")],
                   [Completion([6, 7], [-1.0, -1.0], True, "67"), Completion([8], [-1.0], False, "8")]]
    groups = Groups(batch, completions, torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    advantages = torch.tensor([[0.5, -0.5], [-0.25, 0.25]])
    seqs = learner_sequences(groups, advantages, {"p0": [1, 2], "p1": [3]})
    assert [(s.prompt_ids, s.completion_ids, s.advantage) for s in seqs] == [
        ([1, 2], [5], 0.5), ([3], [6, 7], -0.25), ([3], [8], 0.25)]


def test_mean_logprobs_are_each_completions_mean_token_log_prob():
    completions = [[Completion([5, 6], [-1.0, -3.0], False, "56"), Completion([], [], False, "")],
                   [Completion([7], [-0.5], False, "7"), Completion([8, 9, 1], [-1.0, -2.0, -6.0], True, "891")]]
    groups = Groups(problems(2), completions, torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert groups.mean_logprobs().tolist() == [[-2.0, 0.0], [-0.5, -3.0]]


def test_overlong_penalty_follows_dapo():
    # max 32 tokens, buffer 16: no penalty up to 16, then linear down to -1 at 32
    assert overlong_penalty(10, 32, 16, 1.0) == 0.0
    assert overlong_penalty(16, 32, 16, 1.0) == 0.0
    assert overlong_penalty(24, 32, 16, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(32, 32, 16, 0.5) == pytest.approx(-0.5)


@pytest.mark.parametrize("world,tensor_parallel", [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4)])
def test_each_rank_learns_on_its_own_share_whatever_engine_drew_it(world, tensor_parallel):
    items = list(range(8))
    shares = []
    for rank in range(world):
        ranks = Ranks(rank=rank, world=world, tensor_parallel=tensor_parallel)
        engine_share = ranks.share(items, of_engine=True)
        assert len(engine_share) == 8 // (world // tensor_parallel)
        assert ranks.own_part(engine_share) == ranks.share(items)  # sampled together, learned apart
        shares.append(ranks.share(items))
    assert sum(shares, []) == items  # each item on exactly one rank, in rank order
