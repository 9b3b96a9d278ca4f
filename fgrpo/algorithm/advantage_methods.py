"""The pass@k-preserving advantage methods beside the focal weight, one pure function each (the ``advantage`` option).

Every method has one signature: ``method(rewards, correct, settings, seq_logp=None) -> advantages``, all ``[P, G]``
(P prompts, G samples each). ``rewards`` is what the verifier (and DAPO's overlong shaping) gave; ``correct`` the
0/1 verdicts, from which success rates are read; ``seq_logp`` the mean token log-prob of each sample under the policy
that sampled it (only ``unlikeliness`` reads it). The result is broadcast over each sample's tokens by the loss, so
every method composes with the GRPO, DAPO and CISPO losses (``fgrpo.algorithm.losses``). docs/algorithm.md has one
section per method: its formula, its source and how it differs from the focal weight.
"""

from __future__ import annotations

from math import comb

import torch

from fgrpo.algorithm.advantage_settings import AdvantageSettings
from fgrpo.algorithm.advantages import check_rewards, focal_group_advantages, group_advantages

__all__ = ["ADVANTAGE_METHODS", "compute_advantages", "dr_grpo", "focal", "maxrl", "mean_focal", "mean_focal_weight",
           "passk", "unlikeliness", "w_reinforce"]


def focal(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
          seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """F-GRPO, Eq. 13 of arXiv 2602.06717: ``(1 - mu_hat) ** gamma * (R - mean R) / (std R + eps)``; gamma 0 is
    GRPO's group-normalised advantage (Eq. 3)."""
    return focal_group_advantages(rewards, settings.gamma, correct=correct)


def mean_focal_weight(correct: torch.Tensor, gamma: float) -> torch.Tensor:
    """The mean focal weight ``(1 - mu_hat) ** gamma`` over the groups of ``correct`` ``[P, G]`` whose samples are
    neither all correct nor all wrong (the only groups with a nonzero advantage, so the only ones that move the
    policy); 1 when there is none. A 0-d tensor."""
    rates = correct.to(torch.float64).mean(dim=1)
    mixed = (rates > 0) & (rates < 1)
    if not bool(mixed.any()):
        return torch.ones((), dtype=torch.float64)
    return ((1.0 - rates[mixed]) ** gamma).mean()


def mean_focal(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
               seq_logp: torch.Tensor | None = None, step_correct: torch.Tensor | None = None) -> torch.Tensor:
    """The step-size control for F-GRPO (ours, issue 48): GRPO's advantage (Eq. 3) times one number per step, the
    step's mean focal weight (Eq. 12 at ``focal.gamma``, over the groups that move the policy). It moves as far as
    F-GRPO on average but weights every group alike, so a difference between F-GRPO and this arm is the
    reweighting's, not the smaller steps'. ``step_correct``: the whole step's verdicts (every rank's), for the mean;
    default ``correct``."""
    scale = mean_focal_weight(correct if step_correct is None else step_correct, settings.gamma)
    return group_advantages(rewards) * scale.to(rewards.dtype)


def dr_grpo(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
            seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """Dr. GRPO (arXiv 2503.20783, Fig. 1): ``R - mean R``, the std division removed (it up-weights groups whose
    rewards barely vary, i.e. the nearly solved and the nearly unsolved prompts). The paper also sums each
    sample's tokens over a constant: ``algo.loss_agg=seq-mean-token-sum-norm``, a separate key."""
    return group_advantages(rewards, std_normalize=False)


def maxrl(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
          seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """MaxRL (arXiv 2602.02710, Algorithm 1): ``(R - mean R) / mean R``, 0 for a group whose mean is 0. With 0/1
    rewards a correct sample gets G/K - 1 and a wrong one -1 (K correct of G): the gradient weights a prompt by
    about 1/p instead of GRPO's 1/sqrt(p(1-p)), so hard prompts (small p) count for more and easy ones for less,
    an estimate of the gradient of log pass-rate (maximum likelihood) truncated at order G - 1. The paper's
    code adds 1e-6 to the mean; we return 0 where the mean is <= 0 instead, as its Algorithm 1 writes."""
    rewards = check_rewards(rewards)
    mean = rewards.mean(dim=1, keepdim=True)
    safe = torch.where(mean > 0, mean, torch.ones_like(mean))
    return torch.where(mean > 0, (rewards - mean) / safe, torch.zeros_like(rewards))


def unlikeliness(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
                 seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """The unlikeliness reward (arXiv 2506.02355): before GRPO's normalisation, a correct sample's reward is
    multiplied by ``1 - beta * rank / G``, rank 0 for the least likely of the group's G samples under the policy
    that sampled them and G - 1 for the most likely, so the rare correct answers gain the most. As the authors' code:
    the likelihood is the mean token log-prob, the rank runs over all G samples, and all-correct and all-wrong groups
    get 0 (their recipe drops those groups; without that an all-correct group would push its likely answers down)."""
    rewards = check_rewards(rewards)
    if seq_logp is None or seq_logp.shape != rewards.shape:
        raise ValueError("unlikeliness needs seq_logp, the [P, G] mean token log-prob of each sample, "
                         f"got {None if seq_logp is None else tuple(seq_logp.shape)} for rewards {tuple(rewards.shape)}")
    group = rewards.shape[1]
    ranks = seq_logp.argsort(dim=1, stable=True).argsort(dim=1).to(rewards.dtype)  # 0 = least likely
    shaped = rewards * (1.0 - settings.beta * ranks / group) * correct + rewards * (1 - correct)
    mixed = (correct.amax(dim=1) != correct.amin(dim=1))[:, None]
    return torch.where(mixed, group_advantages(shaped), torch.zeros_like(rewards))


def w_reinforce(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
                seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """W-REINFORCE (arXiv 2506.01347): ``+lam`` for a correct sample, ``-1`` for a wrong one, no baseline and no
    group statistics, so all-correct and all-wrong groups still move the policy. lam = 0.1 (the paper's choice)
    mostly pushes wrong answers down (negative-sample reinforcement) and leaves the mass on the correct ones free
    to spread; lam = 1 is REINFORCE with +-1 rewards."""
    check_rewards(rewards)
    return torch.where(correct > 0, torch.full_like(rewards, settings.lam), torch.full_like(rewards, -1.0))


def passk(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
          seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """Pass@k training, analytic form (arXiv 2508.10751): the GRPO advantage of the reward max over a
    k-subset, averaged over every k-subset of the group that holds the sample. With N = G, N_neg wrong samples,
    ``R = 1 - C(N_neg, k) / C(N, k)`` and ``s = sqrt(R (1 - R))``: a correct sample gets ``(1 - R) / s``, a wrong
    one ``(1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / s``. k = 1 is GRPO with the population std. A group with
    fewer than k wrong samples (every k-subset solved) gets 0."""
    rewards = check_rewards(rewards)
    group, k = rewards.shape[1], settings.k
    if not 1 <= k <= group:
        raise ValueError(f"passk needs 1 <= advantage.k <= the group size {group}, got k={k}")
    rows = []
    for n_wrong in (group - correct.sum(dim=1)).round().long().tolist():
        solved = 1.0 - comb(n_wrong, k) / comb(group, k)
        spread = (solved * (1.0 - solved)) ** 0.5
        if spread == 0.0:
            rows.append((0.0, 0.0))
            continue
        fail_with_me = comb(n_wrong - 1, k - 1) / comb(group - 1, k - 1) if n_wrong >= 1 else 0.0
        rows.append(((1.0 - solved) / spread, (1.0 - solved - fail_with_me) / spread))
    values = torch.tensor(rows, dtype=rewards.dtype).reshape(-1, 2)
    return torch.where(correct > 0, values[:, :1], values[:, 1:]).expand_as(rewards).clone()


# every method by name (the names, torch-free, in advantage_settings.METHODS: config.validate and the report read them)
ADVANTAGE_METHODS = {"focal": focal, "mean_focal": mean_focal, "dr_grpo": dr_grpo, "maxrl": maxrl, "unlikeliness": unlikeliness,
                     "w_reinforce": w_reinforce, "passk": passk}


def compute_advantages(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
                       seq_logp: torch.Tensor | None = None, step_correct: torch.Tensor | None = None) -> torch.Tensor:
    """``[P, G]`` advantages of ``settings.method``: the one place the training loop calls. ``step_correct``: the
    verdicts of the whole step, every rank's (``[P_all, G]``), for a method that reads a step-wide statistic
    (``mean_focal``); default ``correct``."""
    if settings.method not in ADVANTAGE_METHODS:
        raise ValueError(f"advantage method must be one of {tuple(ADVANTAGE_METHODS)}, got {settings.method!r}")
    rewards = check_rewards(rewards)
    if correct.shape != rewards.shape:
        raise ValueError(f"correct has shape {tuple(correct.shape)} but rewards {tuple(rewards.shape)}; "
                         "pass one verdict per sample")
    if settings.method == "mean_focal":
        return mean_focal(rewards, correct, settings, seq_logp, step_correct)
    return ADVANTAGE_METHODS[settings.method](rewards, correct.to(rewards.dtype), settings, seq_logp)
