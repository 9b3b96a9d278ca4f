"""Group-relative advantages and the F-GRPO focal weight.

Equation numbers refer to F-GRPO (arXiv 2602.06717, v2). Every function takes the rewards of one
batch as a ``[P, G]`` tensor: P prompts, G sampled completions for each.

The whole F-GRPO change is :func:`focal_weight` multiplied into :func:`group_advantages`, see
:func:`focal_group_advantages` (Eq. 13).
"""

from __future__ import annotations

import torch

__all__ = [
    "group_advantages",
    "success_rate",
    "focal_weight",
    "focal_group_advantages",
    "check_rewards",
]


def check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """Validate a ``[P, G]`` reward tensor and return it as floating point."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor of shape [P, G], got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must have shape [P, G] (prompts x samples per prompt), got shape {tuple(rewards.shape)}"
        )
    if rewards.shape[1] < 2:
        raise ValueError(
            f"rewards has group size G={rewards.shape[1]}; group-relative advantages need G >= 2 samples per prompt"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if torch.isnan(rewards).any():
        rows = torch.isnan(rewards).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"rewards contain NaN (prompt rows {rows[:10]}); the reward functions must return finite rewards")
    if torch.isinf(rewards).any():
        raise ValueError("rewards contain +-inf; the reward functions must return finite rewards")
    return rewards


def _check_reward_levels(r_correct: float, r_wrong: float) -> None:
    if r_correct == r_wrong:
        raise ValueError(f"r_correct and r_wrong must differ, got both = {r_correct}")


def group_advantages(rewards: torch.Tensor, *, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage, Eq. 3: ``A_i = (R_i - mean(R)) / (std(R) + eps)`` within each group.

    Args:
        rewards: ``[P, G]`` rewards, G >= 2.
        std_normalize: divide by the group's std (GRPO). False gives ``R_i - mean(R)`` (Dr. GRPO).
        eps: added to the std. The paper does not state it; 1e-6 as in verl.

    Returns:
        ``[P, G]`` advantages, same dtype as ``rewards`` (float for integer input).

    The std is Bessel-corrected (N - 1), torch's default, as in verl and TRL. Groups whose rewards are
    all equal (all correct, all wrong) carry no signal and get exactly 0, even where float rounding
    of the mean would leave a tiny residue.
    """
    rewards = check_rewards(rewards)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if std_normalize:
        advantages = centred / (rewards.std(dim=1, keepdim=True) + eps)
    else:
        advantages = centred
    constant_group = rewards.amax(dim=1) == rewards.amin(dim=1)
    return advantages.masked_fill(constant_group[:, None], 0.0)


def success_rate(rewards: torch.Tensor, *, r_correct: float = 1.0, r_wrong: float = 0.0) -> torch.Tensor:
    """Empirical success rate of each group, Eq. 11: ``mu_hat = (mean(R) - R_w) / (R_c - R_w)``.

    Args:
        rewards: ``[P, G]``.
        r_correct, r_wrong: the reward levels of a correct and a wrong completion.

    Returns:
        ``[P]`` in [0, 1] (clamped, for rewards outside the two levels, e.g. shaped ones).
    """
    rewards = check_rewards(rewards)
    _check_reward_levels(r_correct, r_wrong)
    return ((rewards.mean(dim=1) - r_wrong) / (r_correct - r_wrong)).clamp(0.0, 1.0)


def focal_weight(
    rewards: torch.Tensor, gamma: float, *, r_correct: float = 1.0, r_wrong: float = 0.0
) -> torch.Tensor:
    """F-GRPO focal weight, Eq. 12: ``g = (1 - mu_hat) ** gamma``.

    Args:
        rewards: ``[P, G]``.
        gamma: focusing strength, >= 0. gamma = 0 gives exactly 1 for every group (plain GRPO),
            all-correct groups included (0 ** 0 = 1).

    Returns:
        ``[P]`` weights in [0, 1]; non-increasing in the success rate. Depends on rewards only, so no
        gradient flows through it.
    """
    if not isinstance(gamma, (int, float)) or isinstance(gamma, bool):
        raise ValueError(f"gamma must be a number >= 0, got {gamma!r}")
    if not gamma >= 0:  # also catches NaN
        raise ValueError(f"gamma must be >= 0 (0 = plain GRPO; the paper uses 0.5-2), got {gamma}")
    mu_hat = success_rate(rewards, r_correct=r_correct, r_wrong=r_wrong)
    if gamma == 0:
        return torch.ones_like(mu_hat)
    return (1.0 - mu_hat).pow(float(gamma))


def focal_group_advantages(
    rewards: torch.Tensor,
    gamma: float,
    *,
    correct: torch.Tensor | None = None,
    std_normalize: bool = True,
    eps: float = 1e-6,
    r_correct: float = 1.0,
    r_wrong: float = 0.0,
) -> torch.Tensor:
    """F-GRPO advantage, Eq. 13: ``A^F_i = g * A_i``, the focal weight applied after std normalisation.

    Args:
        rewards: ``[P, G]``, what the advantage of Eq. 3 normalises.
        gamma: focal strength (Eq. 12); 0 reproduces :func:`group_advantages` bit for bit.
        correct: ``[P, G]`` 1 / 0 correctness, where the rewards are shaped (e.g. DAPO's overlong penalty): the
            success rate of Eq. 11 is then the share correct, not read from the rewards. None: from ``rewards``
            with the levels ``r_correct`` / ``r_wrong``.

    Returns:
        ``[P, G]``: one weight per prompt, shared by all its samples (and, in the loss, all tokens).
    """
    if correct is None:
        weight = focal_weight(rewards, gamma, r_correct=r_correct, r_wrong=r_wrong)
    else:
        if correct.shape != rewards.shape:
            raise ValueError(f"correct has shape {tuple(correct.shape)} but rewards {tuple(rewards.shape)}; "
                             "pass one verdict per sample")
        weight = focal_weight(correct, gamma)
    return weight[:, None] * group_advantages(rewards, std_normalize=std_normalize, eps=eps)
