"""The advantage methods, one pure function each (the ``advantage`` option), each declared with its parameters by
:func:`~fgrpo.algorithm.advantage_registry.advantage_method` right above it.

Every method has one signature: ``method(rewards, correct, settings, seq_logp=None) -> advantages``, all ``[P, G]``
(P prompts, G samples each). ``rewards`` is what the reward functions (and DAPO's overlong shaping) gave; ``correct``
the 0/1 verdicts, from which success rates are read; ``seq_logp`` the mean token log-prob of each sample under the
policy that sampled it (only ``unlikeliness`` reads it); ``settings.<param>`` each declared parameter. A method declared
``needs_step`` also gets ``step_correct``, the whole step's verdicts. The result is broadcast over each sample's tokens
by the loss, so every method composes with the GRPO, DAPO and CISPO losses (``fgrpo.algorithm.losses``).
docs/algorithm.md has one section per method: its formula, its source and how it differs from the focal weight.

torch is imported inside the functions (and they work through the methods of the tensors they get), so that the
declarations load without it: the config schema and the reports read them.
"""

from __future__ import annotations

from math import comb
from typing import TYPE_CHECKING, Any, Mapping

from fgrpo.algorithm.advantage_registry import GAMMA_KEY, AdvantageMethod, Param, advantage_method, declared
from fgrpo.infra.errors import AdvantageError

if TYPE_CHECKING:
    import torch

__all__ = ["dr_grpo", "focal", "maxrl", "mean_focal", "mean_focal_weight", "passk", "unlikeliness", "w_reinforce",
           "methods", "AdvantageSettings", "AdvantageError", "method_label", "compute_advantages", "advantages_problem"]


@advantage_method("focal", label="gamma",
                  params={"gamma": Param(0.0, low=0.0, key=GAMMA_KEY, doc="0 = the baseline, the paper uses 0.5-2")})
def focal(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
          seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """F-GRPO, Eq. 13 of arXiv 2602.06717: ``(1 - mu_hat) ** gamma * (R - mean R) / (std R + eps)``; gamma 0 is
    GRPO's group-normalised advantage (Eq. 3)."""
    from fgrpo.algorithm.advantages import focal_group_advantages

    return focal_group_advantages(rewards, settings.gamma, correct=correct)


def mean_focal_weight(correct: torch.Tensor, gamma: float) -> torch.Tensor:
    """The mean focal weight ``(1 - mu_hat) ** gamma`` over the groups of ``correct`` ``[P, G]`` whose samples are
    neither all correct nor all wrong (the only groups with a nonzero advantage, so the only ones that move the
    policy); 1 when there is none. A 0-d float64 tensor."""
    rates = correct.double().mean(dim=1)
    mixed = (rates > 0) & (rates < 1)
    if not bool(mixed.any()):
        return rates.new_ones(())
    return ((1.0 - rates[mixed]) ** gamma).mean()


@advantage_method("mean_focal", label="gamma", needs_step=True, params={
    "gamma": Param(1.0, low=0.0, low_open=True, key=GAMMA_KEY,
                   doc="with advantage=mean_focal: the focal weight whose step mean scales GRPO; at 0 it is GRPO, "
                       "advantage=focal")})
def mean_focal(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
               seq_logp: torch.Tensor | None = None, step_correct: torch.Tensor | None = None) -> torch.Tensor:
    """The step-size control for F-GRPO (ours, issue 48): GRPO's advantage (Eq. 3) times one number per step, the
    step's mean focal weight (Eq. 12 at ``focal.gamma``, over the groups that move the policy). It moves as far as
    F-GRPO on average but weights every group alike, so a difference between F-GRPO and this arm is the
    reweighting's, not the smaller steps'. ``step_correct``: the whole step's verdicts (every rank's), for the mean;
    default ``correct``."""
    from fgrpo.algorithm.advantages import group_advantages

    scale = mean_focal_weight(correct if step_correct is None else step_correct, settings.gamma)
    return group_advantages(rewards) * scale.to(rewards.dtype)


@advantage_method("dr_grpo")
def dr_grpo(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
            seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """Dr. GRPO (arXiv 2503.20783, Fig. 1): ``R - mean R``, the std division removed (it up-weights groups whose
    rewards barely vary, i.e. the nearly solved and the nearly unsolved prompts). The paper also sums each
    sample's tokens over a constant: ``algo.loss_agg=seq-mean-token-sum-norm``, a separate key."""
    from fgrpo.algorithm.advantages import group_advantages

    return group_advantages(rewards, std_normalize=False)


@advantage_method("maxrl", shaped_rewards=False)
def maxrl(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
          seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """MaxRL (arXiv 2602.02710, Algorithm 1): ``(R - mean R) / mean R`` on the 0/1 verdicts (the paper's binary
    reward; a weighted sum of reward functions or a -1/+1 score would make the mean <= 0 and the method undefined),
    0 for a group whose mean is 0. A correct sample gets G/K - 1 and a wrong one -1 (K correct of G): the gradient
    weights a prompt by about 1/p instead of GRPO's 1/sqrt(p(1-p)), so hard prompts (small p) count for more and easy
    ones for less, an estimate of the gradient of log pass-rate (maximum likelihood) truncated at order G - 1. The
    paper's code adds 1e-6 to the mean; we return 0 where the mean is 0 instead, as its Algorithm 1 writes."""
    from fgrpo.algorithm.advantages import check_rewards

    rewards = check_rewards(rewards)
    verdicts = correct.to(rewards.dtype)
    mean = verdicts.mean(dim=1, keepdim=True)
    safe = mean.where(mean > 0, mean.new_ones(()))
    return ((verdicts - mean) / safe).where(mean > 0, rewards.new_zeros(()))


@advantage_method("unlikeliness", label="beta", params={
    "beta": Param(0.25, low=0.0, high=1.0, doc="the unlikeliness penalty; the paper: 0.25")})
def unlikeliness(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
                 seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """The unlikeliness reward (arXiv 2506.02355): before GRPO's normalisation, a correct sample's reward is
    multiplied by ``1 - beta * rank / G``, rank 0 for the least likely of the group's G samples under the policy
    that sampled them and G - 1 for the most likely, so the rare correct answers gain the most. As the authors' code:
    the likelihood is the mean token log-prob, the rank runs over all G samples, and all-correct and all-wrong groups
    get 0 (their recipe drops those groups; without that an all-correct group would push its likely answers down)."""
    from fgrpo.algorithm.advantages import check_rewards, group_advantages

    rewards = check_rewards(rewards)
    if seq_logp is None or seq_logp.shape != rewards.shape:
        raise ValueError("unlikeliness needs seq_logp, the [P, G] mean token log-prob of each sample, "
                         f"got {None if seq_logp is None else tuple(seq_logp.shape)} for rewards {tuple(rewards.shape)}")
    group = rewards.shape[1]
    ranks = seq_logp.argsort(dim=1, stable=True).argsort(dim=1).to(rewards.dtype)  # 0 = least likely
    shaped = rewards * (1.0 - settings.beta * ranks / group) * correct + rewards * (1 - correct)
    mixed = (correct.amax(dim=1) != correct.amin(dim=1))[:, None]
    return group_advantages(shaped).where(mixed, rewards.new_zeros(()))


@advantage_method("w_reinforce", label="lam", shaped_rewards=False, params={
    "lam": Param(0.1, low=0.0, low_open=True, doc="W-REINFORCE's weight of a correct sample; the paper: 0.1")})
def w_reinforce(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
                seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """W-REINFORCE (arXiv 2506.01347): ``+lam`` for a correct sample, ``-1`` for a wrong one, no baseline and no
    group statistics, so all-correct and all-wrong groups still move the policy. lam = 0.1 (the paper's choice)
    mostly pushes wrong answers down (negative-sample reinforcement) and leaves the mass on the correct ones free
    to spread; lam = 1 is REINFORCE with +-1 rewards."""
    from fgrpo.algorithm.advantages import check_rewards

    rewards = check_rewards(rewards)
    return rewards.new_full(rewards.shape, settings.lam).where(correct > 0, rewards.new_full(rewards.shape, -1.0))


@advantage_method("passk", label="k", shaped_rewards=False, params={
    "k": Param(4, low=1, high="algo.group_size", doc="the k of the pass@k trained: a k-subset of the group")})
def passk(rewards: torch.Tensor, correct: torch.Tensor, settings: AdvantageSettings,
          seq_logp: torch.Tensor | None = None) -> torch.Tensor:
    """Pass@k training, analytic form (arXiv 2508.10751): the GRPO advantage of the reward max over a
    k-subset, averaged over every k-subset of the group that holds the sample. With N = G, N_neg wrong samples,
    ``R = 1 - C(N_neg, k) / C(N, k)`` and ``s = sqrt(R (1 - R))``: a correct sample gets ``(1 - R) / s``, a wrong
    one ``(1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / s``. k = 1 is GRPO with the population std. A group with
    fewer than k wrong samples (every k-subset solved) gets 0."""
    from fgrpo.algorithm.advantages import check_rewards

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
    values = rewards.new_tensor(rows).reshape(-1, 2)
    return values[:, :1].where(correct > 0, values[:, 1:]).expand_as(rewards).clone()


# --- the declarations in uses: the choices, a method's settings, its label, the call ---------------------------


def methods() -> dict[str, AdvantageMethod]:
    """Every declared method by name: fgrpo's own (this module's, declared above) and any a user's file declared."""
    return declared()


class AdvantageSettings:
    """One method and its parameters' values (the declared defaults where not given):
    ``AdvantageSettings("passk", k=2).k == 2``. What the config's ``advantage`` group and ``focal.gamma`` set."""

    def __init__(self, method: str, **params: Any):
        known = methods().get(method)
        defaults = {name: param.default for name, param in known.params.items()} if known else {}
        self.method = method
        self.params = {**defaults, **params}

    def __getattr__(self, name: str) -> Any:
        params = self.__dict__.get("params", {})
        if name in params:
            return params[name]
        raise AttributeError(f"advantage method {self.__dict__.get('method')!r} has no parameter {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AdvantageSettings) and (self.method, self.params) == (other.method, other.params)

    def __repr__(self) -> str:
        return f"AdvantageSettings({self.method!r}, {', '.join(f'{k}={v!r}' for k, v in self.params.items())})"


def method_label(method: str, params: Mapping[str, Any], *, with_gamma: bool = True) -> str:
    """The method with the parameter that sets it apart: ``focal gamma=1`` (``focal`` without gamma), ``passk k=4``,
    ``maxrl``; a method not declared here (a user's, named by import path) with every parameter it was given."""
    known = methods().get(method)
    if known is None:
        extra = " ".join(f"{key}={value:g}" if isinstance(value, (int, float)) else f"{key}={value}"
                         for key, value in sorted(params.items()))
        return f"{method} {extra}".strip()
    shown = known.label
    if shown is not None and known.key(shown) == GAMMA_KEY and not with_gamma:
        shown = None
    if shown is None or shown not in params:
        return method
    return f"{method} {shown}={params[shown]:g}"


def compute_advantages(rewards, correct, settings: AdvantageSettings, seq_logp=None, step_correct=None):
    """``[P, G]`` advantages of ``settings.method``: the one place the training loop calls. ``step_correct``: the
    verdicts of the whole step, every rank's (``[P_all, G]``), passed to a method declared ``needs_step``; default
    ``correct``."""
    from fgrpo.algorithm.advantages import check_rewards

    known = methods().get(settings.method)
    if known is None:
        raise ValueError(f"advantage method must be one of {tuple(methods())}, got {settings.method!r}")
    rewards = check_rewards(rewards)
    if correct.shape != rewards.shape:
        raise ValueError(f"correct has shape {tuple(correct.shape)} but rewards {tuple(rewards.shape)}; "
                         "pass one verdict per sample")
    correct = correct.to(rewards.dtype)
    if known.needs_step:
        advantages = known.fn(rewards, correct, settings, seq_logp, step_correct=step_correct)
    else:
        advantages = known.fn(rewards, correct, settings, seq_logp)
    problem = advantages_problem(advantages, rewards)
    if problem:
        raise AdvantageError(f"advantage method {settings.method!r} {problem}: every method returns a finite [P, G] "
                             f"tensor of the rewards' dtype (here [{', '.join(map(str, rewards.shape))}], "
                             f"{str(rewards.dtype).replace('torch.', '')})")
    return advantages


def advantages_problem(advantages: Any, rewards: torch.Tensor) -> str | None:
    """What is wrong with ``advantages`` for ``rewards`` ``[P, G]``, or None."""
    import torch

    if not isinstance(advantages, torch.Tensor):
        return f"returned a {type(advantages).__name__}, not a tensor"
    if advantages.shape != rewards.shape:
        return f"returned shape [{', '.join(map(str, advantages.shape))}]"
    if advantages.dtype != rewards.dtype:
        return f"returned dtype {str(advantages.dtype).replace('torch.', '')}"
    if not bool(torch.isfinite(advantages).all()):
        return f"returned {int((~torch.isfinite(advantages)).sum())} non-finite values (NaN or infinity)"
    return None
