import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fgrpo.algorithm.advantages import focal_group_advantages, focal_weight, group_advantages, success_rate


def test_hand_computed_single_correct_of_four():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    # mean 0.25; Bessel std = sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    expected = torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / (0.5 + 1e-6)
    torch.testing.assert_close(group_advantages(rewards), expected)
    torch.testing.assert_close(group_advantages(rewards, std_normalize=False), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))
    assert success_rate(rewards).item() == pytest.approx(0.25)
    for gamma in (0.5, 1.0, 2.0):
        assert focal_weight(rewards, gamma).item() == pytest.approx(0.75**gamma)
        torch.testing.assert_close(focal_group_advantages(rewards, gamma), 0.75**gamma * expected)


def test_paper_worked_example_group_of_eight():
    # paper-notes: N = 8, mu_hat = 7/8, 4/8, 1/8 and gamma 0.5, 1, 2
    rewards = torch.tensor([[1.0] * 7 + [0.0], [1.0] * 4 + [0.0] * 4, [1.0] + [0.0] * 7])
    expected = {0.5: [0.354, 0.707, 0.935], 1.0: [0.125, 0.5, 0.875], 2.0: [0.016, 0.25, 0.766]}
    for gamma, values in expected.items():
        assert focal_weight(rewards, gamma).tolist() == pytest.approx(values, abs=1e-3)


def test_gamma_zero_is_plain_grpo_bit_for_bit():
    torch.manual_seed(0)
    rewards = (torch.rand(64, 8) < 0.4).float()
    rewards[0] = 1.0  # an all-correct group: 0 ** 0 must still be weight 1
    assert torch.equal(focal_weight(rewards, 0.0), torch.ones(64))
    assert torch.equal(focal_group_advantages(rewards, 0.0), group_advantages(rewards))
    assert torch.equal(focal_group_advantages(rewards, 0), group_advantages(rewards))


def test_constant_groups_give_zero_and_no_nan():
    rewards = torch.tensor([[1.0] * 8, [0.0] * 8, [0.1] * 8, [0.7] * 8])
    for gamma in (0.0, 1.0):
        adv = focal_group_advantages(rewards, gamma)
        assert torch.equal(adv, torch.zeros(4, 8))
    assert focal_weight(rewards[:1], 1.0).item() == 0.0  # all-correct: g = 0 with gamma > 0


def test_integer_rewards_are_accepted():
    adv = group_advantages(torch.tensor([[1, 0], [0, 0]]))
    assert adv.dtype == torch.get_default_dtype()
    assert adv[1].abs().sum() == 0


def test_custom_reward_levels():
    rewards = torch.tensor([[1.0, -1.0, -1.0, -1.0]])  # R_c = 1, R_w = -1
    assert success_rate(rewards, r_correct=1.0, r_wrong=-1.0).item() == pytest.approx(0.25)
    assert focal_weight(rewards, 1.0, r_correct=1.0, r_wrong=-1.0).item() == pytest.approx(0.75)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: group_advantages(torch.tensor([[1.0], [0.0]])), "G >= 2"),
        (lambda: group_advantages(torch.tensor([1.0, 0.0])), r"shape \[P, G\]"),
        (lambda: group_advantages(torch.tensor([[1.0, float("nan")]])), "NaN"),
        (lambda: group_advantages([[1.0, 0.0]]), "torch.Tensor"),
        (lambda: focal_weight(torch.tensor([[1.0, 0.0]]), -0.5), "gamma must be >= 0"),
        (lambda: focal_weight(torch.tensor([[1.0, 0.0]]), float("nan")), "gamma must be >= 0"),
        (lambda: success_rate(torch.tensor([[1.0, 0.0]]), r_correct=1.0, r_wrong=1.0), "must differ"),
    ],
)
def test_bad_input_raises_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


reward_groups = st.integers(1, 6).flatmap(
    lambda p: st.integers(2, 12).flatmap(
        lambda g: st.lists(
            st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=g, max_size=g), min_size=p, max_size=p
        )
    )
)


@settings(max_examples=200, deadline=None)
@given(reward_groups, st.floats(-50, 50, allow_nan=False))
def test_property_shift_invariance_and_shapes(rows, shift):
    rewards = torch.tensor(rows, dtype=torch.float64)
    adv = group_advantages(rewards)
    assert adv.shape == rewards.shape
    assert torch.isfinite(adv).all()
    shifted = group_advantages(rewards + shift)
    # std + eps makes tiny spreads ill-conditioned; compare where the spread is meaningful
    spread = (rewards.amax(1) - rewards.amin(1))[:, None].expand_as(adv)
    keep = spread > 1e-3
    torch.testing.assert_close(shifted[keep], adv[keep], rtol=1e-6, atol=1e-6)
    assert success_rate(rewards).shape == (rewards.shape[0],)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 64), st.floats(0.0, 4.0, allow_nan=False))
def test_property_focal_weight_non_increasing_in_success_rate(group_size, gamma):
    # row i has i correct samples out of G
    rewards = torch.zeros(group_size + 1, group_size)
    for correct in range(group_size + 1):
        rewards[correct, :correct] = 1.0
    weights = focal_weight(rewards, gamma)
    assert (weights[1:] <= weights[:-1] + 1e-7).all()
    assert weights.min() >= 0 and weights.max() <= 1
    assert math.isclose(weights[0].item(), 1.0)


def test_shaped_rewards_take_the_success_rate_from_correct():
    # DAPO's overlong penalty shifts rewards: the focal weight still counts correct samples (Eq. 11)
    correct = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    shaped = correct + torch.tensor([[0.0, -0.5, 0.0, -0.25], [0.0, 0.0, -0.1, 0.0]])
    advantages = focal_group_advantages(shaped, 2.0, correct=correct)
    expected_weights = torch.tensor([0.75**2, 0.25**2])
    torch.testing.assert_close(advantages, expected_weights[:, None] * group_advantages(shaped))
    # read from the shaped rewards instead, the first group's rate would be (1 - 0.75) / 4, not 1 / 4
    assert not torch.allclose(focal_group_advantages(shaped, 2.0), advantages)
    with pytest.raises(ValueError, match="one verdict per sample"):
        focal_group_advantages(shaped, 2.0, correct=correct[:, :2])
