"""What one training step logs: the batch's outcomes and F-GRPO weights (``train/``) and where the time went
(``perf/``). :class:`StepOutcomes` is what each rank contributes, gathered to rank 0 every step."""

from __future__ import annotations

import resource
from dataclasses import dataclass

import numpy as np
import torch

from fgrpo.algorithm.advantages import focal_weight, success_rate
from fgrpo.infra import distributed
from fgrpo.rollout.rollouts import Groups


@dataclass
class StepOutcomes:
    """What a step's metrics are computed from, small enough to gather from every rank each step."""

    correct: torch.Tensor  # [P, G] the verdicts
    rewards: torch.Tensor  # [P, G] after shaping
    advantages: torch.Tensor  # [P, G] focal-weighted
    lengths: list[int]  # each completion's tokens
    truncated: list[bool]  # each completion stopped by max_new_tokens
    learner_tokens: int  # prompt and completion tokens of the learner's sequences
    reward_values: dict[str, torch.Tensor]  # name -> [P, G] each reward function's value (NaN: none)

    @classmethod
    def of(cls, groups: Groups, rewards: torch.Tensor, advantages: torch.Tensor, seqs) -> StepOutcomes:
        completions = [c for group in groups.completions for c in group]
        return cls(groups.correct, rewards, advantages, [len(c.token_ids) for c in completions],
                   [c.truncated for c in completions], sum(len(s.prompt_ids) + len(s.completion_ids) for s in seqs),
                   groups.values)

    def gathered(self) -> StepOutcomes:
        """The whole run's outcomes: every rank's, in rank order (this rank's own with one process)."""
        parts = distributed.gather_objects(self)
        if len(parts) == 1:
            return self
        names = sorted(set().union(*(p.reward_values for p in parts)))
        values = {name: torch.cat([p.reward_values[name] for p in parts if name in p.reward_values]) for name in names}
        return StepOutcomes(*(torch.cat([getattr(p, key) for p in parts]) for key in ("correct", "rewards", "advantages")),
                            sum((p.lengths for p in parts), []), sum((p.truncated for p in parts), []),
                            sum(p.learner_tokens for p in parts), values)


def step_metrics(outcomes: StepOutcomes, learned: dict[str, float], timings: dict[str, float], gamma: float, lr: float,
                 world_size: int = 1) -> dict:
    """What one step logs: the batch's outcomes and F-GRPO weights (``train/``) and where the time went (``perf/``:
    rank 0's times; token rates of the whole run)."""
    correct, rewards, advantages, lengths = outcomes.correct, outcomes.rewards, outcomes.advantages, outcomes.lengths
    rates, weights = success_rate(correct), focal_weight(correct, gamma)
    learner_tokens = outcomes.learner_tokens
    work = {key: learned.pop(key) for key in ("padding_frac", "computed_tokens", "matmuls_kept_frac")}
    return {
        **{f"train/{key}": value for key, value in learned.items()},
        **reward_means(outcomes.reward_values, "train/reward"),
        "train/reward_mean": float(rewards.mean()),
        "train/correct_mean": float(correct.mean()),
        "train/frac_all_correct": float((rates == 1).float().mean()),
        "train/frac_all_wrong": float((rates == 0).float().mean()),
        "train/frac_mixed": float(((rates > 0) & (rates < 1)).float().mean()),
        "train/success_rate_hist": rates.tolist(),
        "train/focal_weight_mean": float(weights.mean()),
        "train/focal_weight_min": float(weights.min()),
        "train/adv_abs_mean": float(advantages.abs().mean()),
        # how far the step pushes, to compare arms on it (with train/grad_norm): the batch's advantages' L2 norm
        "train/adv_norm": float(advantages.norm()),
        "train/adv_abs_mean_per_group": advantages.abs().mean(dim=1).tolist(),  # in the order of success_rate_hist
        "train/completion_len_mean": float(np.mean(lengths)),
        "train/completion_len_max": float(np.max(lengths)),
        "train/truncated_frac": float(np.mean(outcomes.truncated)),
        "train/lr": lr,
        "train/groups": float(len(correct)),
        "perf/world_size": world_size,
        "perf/sample_time_s": timings["sample"],
        "perf/verify_time_s": timings["verify"],
        "perf/learn_time_s": timings["learn"],
        "perf/sync_time_s": timings["sync"],
        "perf/sampler_tokens_per_s": sum(lengths) / max(timings["sample"], 1e-9),
        "perf/learner_tokens_per_s": learner_tokens / max(timings["learn"], 1e-9),
        "perf/learner_padding_frac": work["padding_frac"],
        # positions the learner ran over (padding out, a shared prompt once): its FLOPs are ~6 x params x this
        "perf/learner_computed_tokens": work["computed_tokens"],
        # share of the layers' token slots whose backward reused kept matmul outputs (no recompute)
        "perf/learner_matmuls_kept_frac": work["matmuls_kept_frac"],
        "perf/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def reward_means(values: dict[str, torch.Tensor], prefix: str) -> dict[str, float]:
    """``<prefix>/<name>``: each reward function's mean over the samples it scored (its extras' too: ``name/key``)."""
    means = {}
    for name, table in values.items():
        scored = table[~torch.isnan(table)]
        if scored.numel():
            means[f"{prefix}/{name}"] = float(scored.mean())
    return means
