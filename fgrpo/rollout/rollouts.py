"""What the loop learns from: problems in epoch order, groups of G sampled completions with their rewards and
verdicts (the run's reward functions: fgrpo.rewards), prompts whose samples were skipped dropped, DAPO's dynamic
sampling and overlong shaping, and the learner's sequences with their advantages."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from fgrpo.rollout.data import Problem
from fgrpo.infra.distributed import SINGLE, Ranks, gather_objects, sum_over_ranks
from fgrpo.learner.packing import Sequence
from fgrpo.rewards.binding import sample_view
from fgrpo.rewards.scoring import FAILURE_KINDS, ScoredBatch, Scorer
from fgrpo.rollout.samplers import Completion


class ProblemStream:
    """The training problems, endlessly: a shuffled order per epoch, reshuffled with ``(seed, epoch)``.

    The first epoch's order is ``default_rng(seed).permutation`` (the benchmark feeds TRL the same order)."""

    def __init__(self, problems: list[Problem], seed: int):
        self.problems, self.seed = problems, seed
        self.epoch, self.cursor = 0, 0
        self.order = self._order(0)

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.seed if epoch == 0 else (self.seed, epoch)).permutation(len(self.problems))

    def take(self, count: int) -> list[Problem]:
        picked = []
        for _ in range(count):
            if self.cursor == len(self.order):  # a new epoch
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self._order(self.epoch)
            picked.append(self.problems[self.order[self.cursor]])
            self.cursor += 1
        return picked

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.order = self._order(self.epoch)


@dataclass
class Groups:
    """P problems with G sampled completions each, their rewards and the verdicts."""

    problems: list[Problem]
    completions: list[list[Completion]]  # [P][G]
    correct: torch.Tensor  # [P, G] float, 1.0 where the verdict entry accepted the completion
    rewards: torch.Tensor | None = None  # [P, G] the weighted sum of the reward functions (None: the verdicts)
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [P, G] each function's value, NaN: none
    skipped: torch.Tensor | None = None  # [P] bool: a sample of the prompt got None from every reward function
    reward_errors: int = 0  # samples whose reward call failed (scored 0)
    skipped_prompts: int = 0  # prompts dropped from the step for a skipped sample (drop_skipped)
    verify_time_s: float = 0.0  # inside the reward functions
    failures: dict[str, Counter] = field(default_factory=dict)  # reward function -> kind -> samples failed so
    reward_metrics: dict[str, list[float]] = field(default_factory=dict)  # "<function>/<metric>": log_metric's values

    def __post_init__(self) -> None:
        if self.rewards is None:
            self.rewards = self.correct.clone()
        if self.skipped is None:
            self.skipped = torch.zeros(len(self.problems), dtype=torch.bool)

    def __len__(self) -> int:
        return len(self.problems)

    def select(self, indices: list[int]) -> Groups:
        return Groups([self.problems[i] for i in indices], [self.completions[i] for i in indices],
                      self.correct[indices], self.rewards[indices],
                      {name: values[indices] for name, values in self.values.items()}, self.skipped[indices],
                      self.reward_errors, self.skipped_prompts, self.verify_time_s, self.failures, self.reward_metrics)

    def extend(self, other: Groups) -> Groups:
        names = set(self.values) | set(other.values)
        values = {name: torch.cat([groups.values.get(name, torch.full_like(groups.correct, math.nan))
                                   for groups in (self, other)]) for name in names}
        return Groups(self.problems + other.problems, self.completions + other.completions,
                      torch.cat([self.correct, other.correct]), torch.cat([self.rewards, other.rewards]), values,
                      torch.cat([self.skipped, other.skipped]), self.reward_errors + other.reward_errors,
                      self.skipped_prompts + other.skipped_prompts, self.verify_time_s + other.verify_time_s,
                      _added(self.failures, other.failures),
                      {name: self.reward_metrics.get(name, []) + other.reward_metrics.get(name, [])
                       for name in {**self.reward_metrics, **other.reward_metrics}})

    def drop_skipped(self) -> Groups:
        """Without the prompts that have a skipped sample (every reward function returned None): the groups stay
        whole; the count of dropped prompts is kept in ``skipped_prompts``."""
        kept = [i for i in range(len(self)) if not bool(self.skipped[i])]
        if len(kept) == len(self):
            return self
        dropped = self.select(kept)
        dropped.skipped_prompts += len(self) - len(kept)
        return dropped

    def mean_logprobs(self) -> torch.Tensor:
        """``[P, G]`` each completion's mean token log-prob under the policy that sampled it (0 for an empty one)."""
        means = [[_mean(c.sampled_logprobs()) for c in group] for group in self.completions]
        return torch.tensor(means, dtype=torch.float32).reshape(self.correct.shape)

    def mixed(self) -> list[int]:
        """Groups with both outcomes: the only ones with a non-zero group-relative advantage."""
        successes = self.correct.sum(dim=1)
        return [i for i in range(len(self)) if 0 < successes[i] < self.correct.shape[1]]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _added(one: dict[str, Counter], other: dict[str, Counter]) -> dict[str, Counter]:
    return {name: one.get(name, Counter()) + other.get(name, Counter()) for name in {**one, **other}}


def prompt_seeds(seed: int, count: int) -> list[int]:
    """One sampling seed per prompt of a draw, from the draw's ``seed`` and the prompt's place in it: the same
    whichever rank draws the prompt. The first is the draw's own (a sampler that takes one seed per call, HF,
    draws as it did from one), the others a prime apart (draws' seeds are consecutive)."""
    return [seed + index * 1_000_003 for index in range(count)]


def sample_groups(sampler, problems: list[Problem], prompt_ids: dict[str, list[int]], scorer: Scorer, *,
                  group_size: int, max_new_tokens: int, temperature: float, top_p: float,
                  seed: int | list[int], ranks: Ranks = SINGLE, progress: str | None = None) -> Groups:
    """``group_size`` completions per problem, each scored by the run's reward functions. ``seed``: the draw's, or
    one per problem (:func:`prompt_seeds`); ``progress``: the sampler's progress bar label (None: no bar). All the
    draw's samples go to the scorer in one call, so its pool spreads them over its workers; the ranks of one vLLM
    engine (``ranks.tensor_parallel``) drew the same samples and score a share each (:func:`score_engine_draw`)."""
    completions = sampler.generate([prompt_ids[p.id] for p in problems], group_size, max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_p=top_p, seed=seed, progress=progress)
    start = time.perf_counter()
    views = [sample_view(completion=c.text, completion_ids=c.token_ids,
                         prompt=list(p.prompt) if isinstance(p.prompt, tuple) else p.prompt or p.question,
                         answer=p.answer, source=p.source, fields=p.fields, timeout_s=scorer.timeout_s,
                         reference=p.reference)
             for p, group in zip(problems, completions) for c in group]
    prompt_seed = seed if isinstance(seed, list) else [seed + index for index in range(len(problems))]
    # a reward's random draws follow the sample's own seed: the same on a rerun, whichever worker or rank scores it
    seeds = [prompt_seed[i] * 1_009 + g for i in range(len(problems)) for g in range(group_size)]
    scored = score_engine_draw(scorer, views, seeds, ranks)
    shape = (len(problems), group_size)

    def table(values: list) -> torch.Tensor:
        return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32).reshape(shape)

    skipped = torch.tensor(scored.skipped, dtype=torch.bool).reshape(shape).any(dim=1)
    return Groups(problems, completions, table(scored.correct), table(scored.rewards),
                  {name: table(values) for name, values in scored.values.items()}, skipped, scored.errors,
                  verify_time_s=time.perf_counter() - start, failures=scored.failures, reward_metrics=scored.metrics)


def score_engine_draw(scorer: Scorer, views: list[dict], seeds: list[int], ranks: Ranks = SINGLE) -> ScoredBatch:
    """The scores of an engine's draw. With one rank per engine, this rank's; with ``ranks.tensor_parallel`` ranks per
    engine (all holding the same draw), each scores a contiguous share and every rank gathers its engine's shares, so
    that each sample is scored once."""
    tp = ranks.tensor_parallel
    if tp == 1:
        return scorer.score(views, seeds)
    size = -(-len(views) // tp)
    index = ranks.rank % tp
    mine = scorer.score(views[index * size:(index + 1) * size], seeds[index * size:(index + 1) * size])
    first = ranks.rank - index
    return join_scored(gather_objects(mine)[first:first + tp])


def join_scored(parts: list[ScoredBatch]) -> ScoredBatch:
    """Scored batches of consecutive samples as one (a function's values None where a part lacks it)."""
    joined = ScoredBatch([], [], [])
    names = [name for part in parts for name in part.values]
    for part in parts:
        count = len(part.rewards)
        joined.rewards += part.rewards
        joined.correct += part.correct
        joined.skipped += part.skipped
        for name in dict.fromkeys(names):
            joined.values.setdefault(name, []).extend(part.values.get(name, [None] * count))
        for name, kinds in part.failures.items():
            joined.failures.setdefault(name, Counter()).update(kinds)
        for name, values in part.metrics.items():
            joined.metrics.setdefault(name, []).extend(values)
    return joined


def collect_groups(draw: Callable[[list[Problem], list[int]], Groups], stream: ProblemStream, count: int, *, seed: int,
                   dynamic_sampling: bool = False, max_rounds: int = 3, ranks: Ranks = SINGLE) -> Groups:
    """``count`` groups from ``draw(problems, seeds)`` (one seed per problem). DAPO's dynamic sampling keeps only
    mixed groups and draws ``count`` more problems until ``count`` are kept or ``max_rounds`` draws are spent (then
    fewer, maybe none).

    Several ranks (fgrpo.infra.distributed): every rank takes the same problems from its copy of the stream and draws its
    share (its engine's, then keeps its own part); the count kept is the whole run's, and the first ``count`` in rank
    order are kept, so ranks may end with unequal shares (the learner pads its micro-batches to match). A prompt with a
    sample that every reward function skipped is dropped (counted in ``Groups.skipped_prompts``)."""
    def draw_round(round_seed: int) -> Groups:
        problems = stream.take(count)
        drawn = draw(ranks.share(problems, of_engine=True), ranks.share(prompt_seeds(round_seed, count), of_engine=True))
        return drawn.select(ranks.own_part(list(range(len(drawn))))).drop_skipped()

    groups = draw_round(seed)
    if not dynamic_sampling:
        return groups
    groups, rounds = groups.select(groups.mixed()), 1
    while sum_over_ranks([len(groups)])[0] < count and rounds < max_rounds:
        extra = draw_round(seed + 7919 * rounds)
        groups, rounds = groups.extend(extra.select(extra.mixed())), rounds + 1
    kept_before = sum(gather_objects(len(groups))[: ranks.rank])
    return groups.select(list(range(max(0, min(len(groups), count - kept_before)))))


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer, then falling linearly to -penalty."""
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / max(buffer, 1))


def overlong_penalties(groups: Groups, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """``[P, G]``: :func:`overlong_penalty` of each completion's length."""
    penalties = torch.zeros_like(groups.rewards)  # [P, G] also when this rank kept no group (P = 0)
    for row, group in enumerate(groups.completions):
        for column, completion in enumerate(group):
            penalties[row, column] = overlong_penalty(len(completion.token_ids), max_new_tokens, buffer, penalty)
    return penalties


def learner_sequences(groups: Groups, advantages: torch.Tensor, prompt_ids: dict[str, list[int]]) -> list[Sequence]:
    """One sequence per non-empty completion, carrying its advantage ``advantages[p, g]``."""
    return [Sequence(completion.episode.prompt_ids if completion.episode is not None else prompt_ids[problem.id],
                     completion.token_ids, float(advantages[i, j]), loss_mask=completion.loss_mask,
                     sampler_logp=completion.logprobs)
            for i, (problem, group) in enumerate(zip(groups.problems, groups.completions))
            for j, completion in enumerate(group) if completion.token_ids]


def reward_call_metrics(groups: Groups, prefix: str, ranks: Ranks = SINGLE,
                        pool_counters: dict[str, int] | None = None) -> dict[str, float]:
    """What the reward calls of a draw say beyond the scores, over every rank (one per engine: its ranks scored one
    draw): ``<prefix>/reward/<function>/errors/<kind>`` (samples failed so, :data:`FAILURE_KINDS`), the means of what
    the functions logged with ``log_metric`` (``<prefix>/reward/<function>/<metric>``), and, given ``pool_counters``,
    the worker pools' own counts summed (``<prefix>/reward_pool/<count>``)."""
    first_of_engine = ranks.rank % ranks.tensor_parallel == 0
    mine = (groups.failures, groups.reward_metrics) if first_of_engine else ({}, {})
    parts = gather_objects((mine, pool_counters or {}))
    metrics: dict[str, float] = {}
    values: dict[str, list[float]] = {}
    for (failures, logged), _ in parts:
        for name, kinds in failures.items():
            for kind in FAILURE_KINDS:
                key = f"{prefix}/reward/{name}/errors/{kind}"
                metrics[key] = metrics.get(key, 0.0) + float(kinds.get(kind, 0))
        for name, logged_values in logged.items():
            values.setdefault(name, []).extend(logged_values)
    metrics.update({f"{prefix}/reward/{name}": float(np.mean(items)) for name, items in values.items() if items})
    if pool_counters is not None:
        for _, counters in parts:
            for name, count in counters.items():
                key = f"{prefix}/reward_pool/{name}"
                metrics[key] = metrics.get(key, 0.0) + float(count)
    return metrics
