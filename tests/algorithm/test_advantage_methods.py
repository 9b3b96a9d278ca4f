"""Each advantage method: closed-form values on tiny groups, its degenerate case equal to a simpler one."""

from math import comb, sqrt

import pytest
import torch

from fgrpo.algorithm.advantage_methods import AdvantageSettings, compute_advantages, method_label, methods
from fgrpo.algorithm.advantages import group_advantages
from fgrpo.algorithm.losses import policy_loss


def advantages(method, rewards, seq_logp=None, **params):
    rewards = torch.tensor(rewards, dtype=torch.float64)
    logp = None if seq_logp is None else torch.tensor(seq_logp, dtype=torch.float64)
    return compute_advantages(rewards, (rewards > 0.5).double(), AdvantageSettings(method, **params), logp)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=1e-9)


def test_focal_at_gamma_0_is_grpo_and_gamma_1_scales_by_the_failure_rate():
    rewards = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    torch.testing.assert_close(advantages("focal", rewards.tolist()), group_advantages(rewards))
    weights = torch.tensor([[0.75], [0.25]], dtype=torch.float64)
    torch.testing.assert_close(advantages("focal", rewards.tolist(), gamma=1.0), weights * group_advantages(rewards))


def test_mean_focal_is_grpo_scaled_by_the_steps_mean_focal_weight_over_mixed_groups():
    # success rates 1/4, 3/4 (mixed: weights 0.75, 0.25 at gamma 1), then all wrong and all correct (left out)
    rewards = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    scaled = advantages("mean_focal", rewards.tolist(), gamma=1.0)
    torch.testing.assert_close(scaled, 0.5 * group_advantages(rewards))
    # as far a step as F-GRPO's in total weight, but every mixed group weighted alike
    focal = advantages("focal", rewards.tolist(), gamma=1.0)
    assert scaled.abs().sum() == pytest.approx(focal.abs().sum().item()) and not torch.allclose(scaled, focal)
    torch.testing.assert_close(advantages("mean_focal", rewards.tolist(), gamma=2.0),
                               (0.75 ** 2 + 0.25 ** 2) / 2 * group_advantages(rewards))


def test_mean_focal_takes_its_mean_over_the_whole_step_when_given_every_ranks_verdicts():
    mine = torch.tensor([[1.0, 0, 0, 0]], dtype=torch.float64)  # this rank: weight 0.75
    others = torch.tensor([[1.0, 1, 1, 0]], dtype=torch.float64)  # another rank's: weight 0.25
    settings = AdvantageSettings("mean_focal", gamma=1.0)
    alone = compute_advantages(mine, mine, settings)
    whole_step = compute_advantages(mine, mine, settings, None, torch.cat([mine, others]))
    torch.testing.assert_close(alone, 0.75 * group_advantages(mine))
    torch.testing.assert_close(whole_step, 0.5 * group_advantages(mine))
    # no mixed group anywhere: nothing to scale (GRPO's zeros)
    solved = torch.ones(2, 4, dtype=torch.float64)
    assert compute_advantages(solved, solved, settings).abs().sum() == 0


def test_dr_grpo_is_the_centred_reward():
    close(advantages("dr_grpo", [[1, 0, 0, 0], [1, 1, 1, 1]]), [[0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0]])


def test_maxrl_divides_by_the_mean_and_gives_0_to_unsolved_groups():
    # K correct of G: a correct sample gets G/K - 1, a wrong one -1 (the paper's Algorithm 1)
    close(advantages("maxrl", [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
          [[3, -1, -1, -1], [1, 1, -1, -1], [0, 0, 0, 0], [0, 0, 0, 0]])
    eight = advantages("maxrl", [[1, 1, 0, 0, 0, 0, 0, 0]])
    close(eight, [[3, 3, -1, -1, -1, -1, -1, -1]])
    # the degenerate relation: MaxRL is Dr. GRPO over the group mean
    rewards = [[1, 0, 1, 0, 0], [0, 1, 0, 0, 0]]
    means = torch.tensor([[0.4], [0.2]], dtype=torch.float64)
    torch.testing.assert_close(advantages("maxrl", rewards), advantages("dr_grpo", rewards) / means)
    # it reads the verdicts: a weighted sum of reward functions (here a -1/+2 score) gives the same advantages
    scored = torch.tensor([[2.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    verdicts = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    close(compute_advantages(scored, verdicts, AdvantageSettings("maxrl")), [[3, -1, -1, -1]])


def test_unlikeliness_penalises_the_likely_correct_samples_before_normalising():
    # ranks by log-prob, 0 = least likely: -3 -> 0, -2 -> 1, -1 -> 2, -0.5 -> 3
    got = advantages("unlikeliness", [[1, 1, 0, 0]], seq_logp=[[-1.0, -3.0, -2.0, -0.5]], beta=0.25)
    shaped = [1 - 0.25 * 2 / 4, 1.0, 0.0, 0.0]  # the likely correct sample loses 1/8 of its reward
    mean = sum(shaped) / 4
    std = sqrt(sum((x - mean) ** 2 for x in shaped) / 3)
    close(got, [[(x - mean) / (std + 1e-6) for x in shaped]])
    assert got[0, 1] > got[0, 0] > 0 > got[0, 2] == got[0, 3]


def test_unlikeliness_at_beta_0_is_grpo_and_one_sided_groups_get_0():
    rewards, logp = [[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], [[-1.0, -2, -3, -4]] * 3
    got = advantages("unlikeliness", rewards, seq_logp=logp, beta=0.0)
    close(got[0:1], group_advantages(torch.tensor(rewards[:1], dtype=torch.float64)).tolist())
    assert torch.count_nonzero(advantages("unlikeliness", rewards, seq_logp=logp, beta=0.5)[1:]) == 0
    with pytest.raises(ValueError, match="unlikeliness needs seq_logp"):
        advantages("unlikeliness", rewards)


def test_w_reinforce_has_no_baseline():
    close(advantages("w_reinforce", [[1, 0, 1], [1, 1, 1], [0, 0, 0]], lam=0.1),
          [[0.1, -1, 0.1], [0.1, 0.1, 0.1], [-1, -1, -1]])
    close(advantages("w_reinforce", [[1, 0, 1]], lam=1.0), [[1, -1, 1]])  # lam 1: REINFORCE with +-1 rewards


def test_w_reinforce_gradient_is_lam_times_positive_plus_negative_reinforcement():
    """On-policy, the loss's gradient is lam * grad(-sum of correct log-probs) + grad(sum of wrong ones), over T."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5], [-2.5, -0.1]], requires_grad=True)
    mask = torch.ones_like(logp)
    adv = advantages("w_reinforce", [[1, 0, 1]], lam=0.1).float().reshape(3)
    loss, _ = policy_loss("grpo", logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    hand = torch.tensor([[-0.1, -0.1], [1.0, 1.0], [-0.1, -0.1]]) / 6
    torch.testing.assert_close(grad, hand)


def test_passk_closed_form_and_its_k_1_case():
    # G 8, 2 correct, k 4: R = 1 - C(6,4)/C(8,4) = 55/70; a wrong sample's subsets fail with C(5,3)/C(7,3) = 20/70
    solved = 55 / 70
    spread = sqrt(solved * (1 - solved))
    close(advantages("passk", [[1, 1, 0, 0, 0, 0, 0, 0]], k=4),
          [[(15 / 70) / spread] * 2 + [(15 / 70 - comb(5, 3) / comb(7, 3)) / spread] * 6])
    # k = 1: GRPO with the population std
    rewards = torch.tensor([[1.0, 0, 0, 1, 0], [0, 1, 0, 0, 0]], dtype=torch.float64)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    torch.testing.assert_close(advantages("passk", rewards.tolist(), k=1), centred / rewards.std(dim=1, correction=0,
                                                                                                keepdim=True))


def test_passk_groups_every_k_subset_of_which_is_solved_get_0():
    close(advantages("passk", [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], k=2), [[0] * 4] * 3)
    with pytest.raises(ValueError, match="1 <= advantage.k <= the group size 4"):
        advantages("passk", [[1, 0, 0, 0]], k=5)


@pytest.mark.parametrize("method", sorted(methods()))
def test_every_method_keeps_the_shape_and_dtype(method):
    rewards = torch.tensor([[1.0, 0, 0, 1], [0, 0, 0, 1], [1, 1, 1, 1]])
    logp = torch.randn(3, 4)
    out = compute_advantages(rewards, rewards.clone(), AdvantageSettings(method, k=2), logp)
    assert out.shape == rewards.shape and out.dtype == rewards.dtype and torch.isfinite(out).all()


def test_unknown_method_lists_the_choices():
    with pytest.raises(ValueError, match="one of .*'focal'.*'maxrl'.*got 'grpo_passk'"):
        compute_advantages(torch.ones(1, 2), torch.ones(1, 2), AdvantageSettings("grpo_passk"))


def test_method_labels_name_the_parameter_that_sets_a_method_apart():
    names = ["dr_grpo", "focal", "maxrl", "mean_focal", "passk", "unlikeliness", "w_reinforce"]
    assert sorted(methods()) == names
    labels = [method_label(m, AdvantageSettings(m, gamma=1.0, lam=0.2, beta=0.5, k=2).params) for m in names]
    assert labels == ["dr_grpo", "focal gamma=1", "maxrl", "mean_focal gamma=1", "passk k=2", "unlikeliness beta=0.5",
                      "w_reinforce lam=0.2"]
    assert method_label("focal", {"gamma": 1.0}, with_gamma=False) == "focal"
