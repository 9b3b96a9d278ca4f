"""F-GRPO inside TRL: :class:`FocalGRPOTrainer`, TRL's ``GRPOTrainer`` with each group's advantages multiplied by
its focal weight (1 - success rate)^gamma (F-GRPO Eq. 11-13; docs/integrations.md).

    from fgrpo.integrations.trl import FocalGRPOTrainer
    trainer = FocalGRPOTrainer(model=..., reward_funcs=[accuracy, format_reward], args=GRPOConfig(...),
                               train_dataset=..., focal_gamma=1.0, verdict="accuracy", success_threshold=1.0)

TRL has no verdict, only reward columns: a completion succeeded when the ``verdict`` reward function's value is
>= ``success_threshold`` (a None from it, NaN in TRL, counts as not succeeded). The success rate is over the whole
group, from the rewards TRL gathered from every process (a group may straddle processes), and the weight multiplies
TRL's own advantage, whatever ``scale_rewards`` ("group", "batch", "none") and ``multi_objective_aggregation`` made
it, before TRL's ``_prepare_inputs`` shuffles the batch. The weight is fgrpo's own
:func:`fgrpo.algorithm.advantages.focal_weight`; gamma 0 leaves TRL's advantages unchanged bit for bit. Logged per
step: ``fgrpo/focal_weight_mean`` and ``fgrpo/success_rate`` (the completions table keeps TRL's unweighted values).

Versions: TRL 1.16 (:data:`SUPPORTED_TRL`): the subclass reads the gathered rewards from ``_calculate_rewards`` and
weighs the sliced advantages ``_generate_and_score_completions`` returns, both TRL internals; another version is
refused at construction, naming it.
"""

from __future__ import annotations

import math

import torch
import trl
from trl import GRPOTrainer

from fgrpo.algorithm.advantages import focal_weight

SUPPORTED_TRL = ("1.16",)  # the TRL releases whose internals this subclass was written against and tested on


def check_trl_version(version: str = trl.__version__) -> None:
    """Refuse a TRL whose internals this subclass does not know (ImportError naming the versions it supports)."""
    internals = all(callable(getattr(GRPOTrainer, name, None))
                    for name in ("_calculate_rewards", "_generate_and_score_completions"))
    if not internals or not any(version == v or version.startswith(v + ".") for v in SUPPORTED_TRL):
        raise ImportError(f"FocalGRPOTrainer supports TRL {', '.join(v + '.x' for v in SUPPORTED_TRL)} (it reads "
                          f"GRPOTrainer's _calculate_rewards and _generate_and_score_completions); this is TRL "
                          f"{version}: install trl=={SUPPORTED_TRL[-1]}.*")


def _check_verdict(verdict: str | None, reward_funcs) -> None:
    """Where every reward function is a plain function (named by its ``__name__``, as TRL names it), a verdict that
    names none of them is refused before TRL loads the model; reward models are checked after, by TRL's names."""
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if verdict is None or not all(callable(f) and not isinstance(f, torch.nn.Module) for f in funcs):
        return
    names = [f.__name__ for f in funcs]
    if verdict not in names:
        raise ValueError(f"verdict={verdict!r} names no reward function of this trainer; they are {names}")


class FocalGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with F-GRPO's focal weight on each group's advantages (module docstring).

    Args (beyond GRPOTrainer's):
        focal_gamma: gamma >= 0 (0: TRL's GRPO; the paper uses 0.5 to 2).
        verdict: the name of the reward function whose value says solved (TRL's ``reward_func_names``: a function's
            ``__name__``); may be left out when there is one reward function.
        success_threshold: solved when the verdict's value is >= this.
    """

    def __init__(self, *args, focal_gamma: float = 1.0, verdict: str | None = None, success_threshold: float = 1.0,
                 **kwargs):
        check_trl_version()
        if isinstance(focal_gamma, bool) or not isinstance(focal_gamma, (int, float)) or not focal_gamma >= 0:
            raise ValueError(f"focal_gamma must be a number >= 0 (0 is TRL's GRPO), got {focal_gamma!r}")
        if isinstance(success_threshold, bool) or not isinstance(success_threshold, (int, float)) \
                or not math.isfinite(success_threshold):
            raise ValueError(f"success_threshold must be a finite number, got {success_threshold!r}")
        # before the model loads
        _check_verdict(verdict, kwargs.get("reward_funcs", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        names = list(self.reward_func_names)
        if verdict is None and len(names) != 1:
            raise ValueError(f"FocalGRPOTrainer needs verdict=NAME, the reward function that says solved, among "
                             f"{names}")
        if verdict is not None and verdict not in names:
            raise ValueError(f"verdict={verdict!r} names no reward function of this trainer; they are {names}")
        self.focal_gamma, self.success_threshold = float(focal_gamma), float(success_threshold)
        self.verdict_column = names.index(verdict) if verdict is not None else 0
        self._gathered_rewards: torch.Tensor | None = None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gathered_rewards = rewards_per_func  # [every process's completions, reward functions]
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation's advantages train nothing
            return out
        weights, success = self.group_focal_weights(self._gathered_rewards[:, self.verdict_column])
        local = out["advantages"].shape[0]
        start = self.accelerator.process_index * local  # TRL's own slice of the gathered batch
        per_completion = weights.repeat_interleave(self.num_generations)[start:start + local]
        out["advantages"] = out["advantages"] * per_completion.to(out["advantages"].device, out["advantages"].dtype)
        self._metrics["train"]["fgrpo/focal_weight_mean"].append(weights.mean().item())
        self._metrics["train"]["fgrpo/success_rate"].append(success.mean().item())
        return out

    def group_focal_weights(self, verdicts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[groups] each group's focal weight and success rate from the gathered verdict column [groups x G]."""
        solved = (verdicts >= self.success_threshold).to(torch.float64).view(-1, self.num_generations)
        return focal_weight(solved.cpu(), self.focal_gamma), solved.mean(dim=1).cpu()
