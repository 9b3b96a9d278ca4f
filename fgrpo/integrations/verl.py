"""F-GRPO inside verl: an advantage estimator registered as ``fgrpo`` (docs/integrations.md).

    pip install fgrpo       # beside verl; the package's verl.plugins entry point registers the estimator on
                            # `import verl` (verl >= 0.9), or name it: VERL_USE_EXTERNAL_MODULES=fgrpo.integrations.verl
    python -m verl.trainer.main_ppo algorithm.adv_estimator=fgrpo +algorithm.fgrpo_gamma=1.0 \\
        +algorithm.fgrpo_success_threshold=0.5 ...

The advantage is verl's own GRPO outcome advantage (``compute_grpo_outcome_advantage``: each response's score, its
token-level rewards summed, centred on its group's mean (the group: the responses sharing a ``uid``) and divided by
the group's std + epsilon unless ``algorithm.norm_adv_by_std_in_grpo`` is false) times its group's focal weight
(1 - success rate)^gamma (F-GRPO Eq. 11-13), the weight computed by fgrpo's own
:func:`fgrpo.algorithm.advantages.focal_weight` on the group's verdicts: a response succeeded when its score reaches
``algorithm.fgrpo_success_threshold``. verl hands an estimator the scores only, so the verdict is that threshold.
gamma 0 is verl's GRPO bit for bit. A group of one response keeps verl's treatment (mean 0, std 1) and its own
verdict's weight.

Versions: verl 0.9.x (:data:`SUPPORTED_VERL`); another version is refused on import, naming it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fgrpo.algorithm.advantages import focal_weight

ESTIMATOR = "fgrpo"
SUPPORTED_VERL = ("0.9",)  # the verl releases whose estimator interface this was written against and tested on
GAMMA_KEY, THRESHOLD_KEY = "fgrpo_gamma", "fgrpo_success_threshold"


def _setting(config, key: str, default=None):
    """A key of verl's ``algorithm`` node (an OmegaConf DictConfig, verl's AlgoConfig or a dict)."""
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def settings(config) -> tuple[float, float, bool]:
    """(gamma, success threshold, std normalisation) from the ``algorithm`` node; ValueError naming a bad key."""
    gamma, threshold = _setting(config, GAMMA_KEY, 1.0), _setting(config, THRESHOLD_KEY)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma >= 0:
        raise ValueError(f"algorithm.{GAMMA_KEY} must be a number >= 0 (0 is verl's GRPO), got {gamma!r}")
    if threshold is None:
        raise ValueError(f"algorithm.adv_estimator=fgrpo needs +algorithm.{THRESHOLD_KEY}=T: a response succeeded "
                         "when its score (summed token-level reward) is >= T; take a T between the wrong and the "
                         "correct score, e.g. 0.5 for 1/0 rewards or 0 for +1/-1 ones (docs/integrations.md)")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ValueError(f"algorithm.{THRESHOLD_KEY} must be a finite number, got {threshold!r}")
    return float(gamma), float(threshold), bool(_setting(config, "norm_adv_by_std_in_grpo", True))


def group_weights(scores: torch.Tensor, index: np.ndarray, gamma: float, threshold: float) -> torch.Tensor:
    """[bs] each response's group's focal weight: ``scores`` [bs], ``index`` [bs] group ids (verl's uids)."""
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} group ids for {scores.shape[0]} responses")
    succeeded = (scores >= threshold).to(torch.float64)
    weights = torch.empty_like(succeeded)
    _, group_of = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
    group_of = torch.as_tensor(group_of.reshape(-1))
    for group in range(int(group_of.max()) + 1 if len(group_of) else 0):
        members = (group_of == group).nonzero().flatten()
        verdicts = succeeded[members][None]
        if verdicts.shape[1] == 1:  # focal_weight reads [P, G >= 2]: a lone response's rate is its own verdict
            verdicts = verdicts.repeat(1, 2)
        weights[members] = focal_weight(verdicts, gamma)[0]
    return weights


def fgrpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                            index: np.ndarray | None = None, config=None, epsilon: float = 1e-6,
                            **_) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's estimator interface: ``token_level_rewards``, ``response_mask`` [bs, response_length], ``index`` [bs]
    uids, ``config`` the ``algorithm`` node. Returns (advantages, returns), both [bs, response_length], equal, as
    verl's GRPO returns them."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    if index is None:
        raise ValueError("the fgrpo estimator groups responses by their uid (data.non_tensor_batch['uid']), and this "
                         "batch has none: run it where verl's GRPO runs (rollout.n > 1)")
    gamma, threshold, std_normalize = settings(config)
    scores = token_level_rewards.sum(dim=-1)
    advantages, _ = compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=epsilon,
                                                   norm_adv_by_std_in_grpo=std_normalize)
    if gamma == 0:
        return advantages, advantages
    weighted = advantages * group_weights(scores, index, gamma, threshold).to(advantages.dtype)[:, None]
    return weighted, weighted


def _check_version() -> None:
    import verl

    version = getattr(verl, "__version__", "unknown")
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_VERL):
        raise ImportError(f"fgrpo's verl estimator supports verl {', '.join(v + '.x' for v in SUPPORTED_VERL)}; "
                          f"this is verl {version}: install verl=={SUPPORTED_VERL[-1]}.* or an fgrpo that supports it")


def register() -> None:
    """Register :func:`fgrpo_outcome_advantage` as ``fgrpo``, once: importing this module twice (the entry point and
    VERL_USE_EXTERNAL_MODULES) or reloading it keeps one registration; a *different* estimator under the name is
    refused."""
    _check_version()
    from verl.trainer.ppo import core_algos

    existing = core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR)
    if existing is not None and existing is not fgrpo_outcome_advantage:
        if getattr(existing, "__module__", None) != __name__:
            raise ValueError(f"verl already has an advantage estimator named {ESTIMATOR!r} "
                             f"({existing.__module__}.{existing.__qualname__}); fgrpo's cannot take its name")
        core_algos.ADV_ESTIMATOR_REGISTRY[ESTIMATOR] = fgrpo_outcome_advantage  # this module, reloaded
        return
    core_algos.register_adv_est(ESTIMATOR)(fgrpo_outcome_advantage)


register()
