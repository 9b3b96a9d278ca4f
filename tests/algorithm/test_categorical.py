"""The categorical simulation of section 5.1 (fgrpo.algorithm.categorical): the gradient against autograd, the
sampler, the optimisers, the simulation loop, bad configurations."""

import numpy as np
import pytest
import torch

from fgrpo.algorithm.advantages import focal_group_advantages, focal_weight
from fgrpo.algorithm.categorical import (
    CategoricalConfig,
    CategoricalTask,
    correct_mass_metrics,
    focal_weight_from_counts,
    make_optimizer,
    power_of_two_group_sizes,
    row_generators,
    run_categorical,
    sample_group_counts,
    surrogate_gradient,
)


def _autograd_gradient(logits, sampled_actions, rewards, gamma, objective):
    """J = (1/N) sum_j A^F_j f(pi(a_j)) from per-sample arrays, A^F from fgrpo.algorithm.advantages (Eq. 13 without std)."""
    logits = logits.clone().requires_grad_(True)
    probs = torch.softmax(logits, dim=-1)
    sample_rewards = rewards[sampled_actions].unsqueeze(0)  # [1, N]
    advantages = focal_group_advantages(sample_rewards, gamma, std_normalize=False, r_correct=1.0, r_wrong=-1.0)[0]
    chosen = probs[sampled_actions]
    values = torch.log(chosen) if objective == "logprob" else chosen
    (advantages * values).mean().backward()
    return logits.grad


@pytest.mark.parametrize("objective", ["logprob", "prob"])
def test_surrogate_gradient_equals_autograd(objective):
    task = CategoricalTask(num_actions=10, num_correct=3)
    rewards = task.rewards()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(10, dtype=torch.float64, generator=generator)
    groups = [torch.tensor([0, 0, 4, 7, 1, 9]), torch.tensor([2, 5, 5, 5]), torch.tensor([0, 1, 2]),
              torch.tensor([3, 8])]  # mixed, mixed, all correct, all wrong
    for gamma in (0.0, 1.0):
        counts = torch.stack([torch.bincount(g, minlength=10).to(torch.float64) for g in groups])
        probs = torch.softmax(logits, dim=-1).expand(len(groups), -1).contiguous()
        ours = surrogate_gradient(probs, counts, rewards, torch.full((len(groups),), gamma), objective=objective)
        for row, sampled in enumerate(groups):
            expected = _autograd_gradient(logits, sampled, rewards, gamma, objective)
            torch.testing.assert_close(ours[row], expected, rtol=1e-12, atol=1e-15)
    assert (ours[2:] == 0).all()  # constant groups carry no signal


def test_focal_weight_from_counts_is_eq_12():
    rewards = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    for gamma in (0.0, 0.5, 1.0, 2.0):
        ours = focal_weight_from_counts(rewards.sum(1), torch.full((4,), 4), torch.full((4,), gamma))
        torch.testing.assert_close(ours, focal_weight(rewards, gamma).to(torch.float64))


def test_sampled_counts_are_multinomial():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.1, 0.1, 0.1, 0.7]], dtype=torch.float64)
    group_size = np.array([40_000, 7])
    generators = row_generators(3, np.array([0, 0]), group_size)
    totals = torch.zeros_like(probs)
    draws = 200
    for _ in range(draws):
        counts = sample_group_counts(torch.cumsum(probs, -1), group_size, generators)
        assert counts.sum(1).tolist() == group_size.tolist()
        assert counts[0, 1] == 0  # a zero-probability action is never drawn
        totals += counts
    mean = totals / draws
    expected = probs * torch.from_numpy(group_size).unsqueeze(1)
    stderr = (expected * (1 - probs) / draws).sqrt().clamp(min=1e-9)
    assert ((mean - expected).abs() <= 5 * stderr).all()


def test_optimisers_ascend_one_step():
    lr, weight_decay = 0.1, 0.5
    start = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    ascent = torch.tensor([[0.3, -0.02, 0.0]], dtype=torch.float64)
    expected = {
        "sgd": start + lr * ascent,
        "adam": start + lr * torch.sign(ascent),  # Adam's first step is lr * sign(gradient), up to eps
        "adamw": start * (1 - lr * weight_decay) + lr * torch.sign(ascent),
    }
    for name, after in expected.items():
        logits = start.clone()
        optimizer = make_optimizer(name, logits, lr, weight_decay if name == "adamw" else 0.0)
        logits.grad = -ascent  # the simulator minimises -J
        optimizer.step()
        torch.testing.assert_close(logits, after, rtol=0, atol=1e-6)


TINY = CategoricalTask(num_actions=64, num_correct=8)


def _tiny_config(**overrides):
    settings = dict(optimizer="adamw", lr=0.05, steps=30, seeds=2, group_sizes=(2, 4, 8), record_every=10)
    settings.update(overrides)
    return CategoricalConfig(**settings)


def test_tiny_grid_is_reproducible_and_rows_are_independent():
    first = run_categorical(TINY, _tiny_config(), threads=1)
    again = run_categorical(TINY, _tiny_config(), threads=1)
    other_seed = run_categorical(TINY, _tiny_config(seed=1), threads=1)
    np.testing.assert_array_equal(first.retained, again.retained)
    np.testing.assert_array_equal(first.q_pos, again.q_pos)
    assert not np.array_equal(first.retained, other_seed.retained)
    assert first.retained.shape == (3 * 2 * 2, 4)
    np.testing.assert_allclose(first.retained[:, 0], 1.0)
    # one row run alone is the same row of the grid: nothing is shared across rows
    alone = run_categorical(TINY, _tiny_config(group_sizes=(4,), gammas=(1.0,), seeds=1), threads=1)
    row = np.flatnonzero((first.group_size == 4) & (first.gamma == 1.0) & (first.seed_index == 0))[0]
    np.testing.assert_allclose(alone.retained[0], first.retained[row], rtol=0, atol=1e-12)


def test_one_sgd_step_of_the_loop_is_lr_times_the_gradient():
    config = _tiny_config(optimizer="sgd", lr=3.0, steps=1, record_every=1)
    result = run_categorical(TINY, config, threads=1)
    group_size, gamma, seed_index = config.rows()
    logits = TINY.initial_logits().expand(len(group_size), -1).contiguous()
    probs = torch.softmax(logits, -1)
    counts = sample_group_counts(torch.cumsum(probs, -1), group_size, row_generators(0, seed_index, group_size))
    gradient = surrogate_gradient(probs, counts, TINY.rewards(), torch.from_numpy(gamma))
    after = torch.softmax(logits + config.lr * gradient, -1)
    q_pos, retained, anchor = correct_mass_metrics(after, probs[0, : TINY.num_correct], TINY.num_correct)
    np.testing.assert_allclose(result.q_pos[:, -1], q_pos.numpy(), rtol=1e-12)
    np.testing.assert_allclose(result.retained[:, -1], retained.numpy(), rtol=1e-12)
    np.testing.assert_allclose(result.anchor_mass[:, -1], anchor.numpy(), rtol=1e-12)


def test_paper_task_starts_as_described():
    task = CategoricalTask()
    probs = torch.softmax(task.initial_logits(), -1)
    q_pos, retained, anchor = correct_mass_metrics(probs.unsqueeze(0), probs[: task.num_correct], task.num_correct)
    assert q_pos.item() == pytest.approx(0.63, abs=0.005)  # "total correct mass about 0.63"
    assert retained.item() == 1.0
    assert power_of_two_group_sizes(2, 131_072) == tuple(2**e for e in range(1, 18))


@pytest.mark.parametrize("bad", [dict(lr=0.0), dict(lr=-1e-3), dict(lr=float("nan")), dict(steps=0),
                                 dict(seeds=0), dict(optimizer="rmsprop"), dict(objective="logit"),
                                 dict(gammas=(-1.0,)), dict(weight_decay=-0.1)])
def test_bad_config_is_a_value_error(bad):
    with pytest.raises(ValueError):
        _tiny_config(**bad)


def test_bad_task_and_group_sizes():
    with pytest.raises(ValueError, match="correct"):
        CategoricalTask(num_actions=10, num_correct=10)
    with pytest.raises(ValueError, match="power of two"):
        power_of_two_group_sizes(2, 12)
