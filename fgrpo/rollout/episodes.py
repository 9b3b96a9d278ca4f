"""Episodes with a user's environment (``dataset.environment``): G episodes per problem, every live episode advanced
together one turn round at a time (one sampler call per round over all of them), the environment's calls in the
workers of the user-code pool (fgrpo.environments.hosts), the result a :class:`~fgrpo.rollout.rollouts.Groups` the
loop reads as it reads single-turn samples.

Token in, token out: an episode is its first prompt's ids, then each turn's sampled ids exactly as the sampler gave
them, each followed by the ids of the suffix the chat template renders for what came back (fgrpo.environments.chat);
no sampled token is decoded and encoded again. Its :class:`~fgrpo.rollout.samplers.Completion` holds everything after
the first prompt, ``loss_mask`` 1 on sampled tokens and 0 on the suffixes'. Limits: ``max_turns`` model turns, and
``max_tokens`` after the first prompt: a turn or a suffix that would pass it is cut there and the episode ends
truncated.

The training reward: the environment's (a game's step rewards summed, a tool class's ``get_reward()``) plus the
weighted ``dataset.rewards`` on the finished episode (the assistant's text as ``completion``, the conversation as
``messages``, the environment's reward as ``env_reward``). The verdict: an entry marked ``verdict: true`` where there
is one, else the environment's (its ``correct``, or its reward >= ``threshold``), else (a tool class without
``get_reward``) the rewards' verdict entry. A call that fails (raises, runs past its time, kills its worker, returns what
its shape does not allow) ends its episode with reward 0 and verdict 0, counted by kind, its first traceback logged.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from fgrpo.environments.chat import Renderer, parse_tool_calls
from fgrpo.environments.host import Reply
from fgrpo.environments.hosts import EpisodeHosts
from fgrpo.environments.spec import EnvSpec
from fgrpo.infra.errors import RewardError
from fgrpo.infra.distributed import SINGLE, Ranks, gather_objects
from fgrpo.rewards.binding import sample_view
from fgrpo.rewards.scoring import Scorer
from fgrpo.rollout.data import Problem
from fgrpo.rollout.rollouts import Groups, sample_groups
from fgrpo.rollout.samplers import Completion

__all__ = ["Environment", "EpisodeRecord", "sample_episodes", "episode_metrics", "draw_groups", "ENV_FAILURE_KINDS"]

log = logging.getLogger("fgrpo")

ENV_FAILURE_KINDS = ("raised", "timeout", "died", "value")


@dataclass
class Environment:
    """A run's environment: its class's :class:`EnvSpec`, how its episodes are rendered, and its limits."""

    spec: EnvSpec
    renderer: Renderer
    max_turns: int
    max_tokens: int  # after the first prompt: sampled, template, observation and tool tokens together
    timeout_s: float  # each call's (reset, step, a tool, get_reward)
    threshold: float = 1.0  # the environment's verdict where it gives no `correct`: its reward >= this
    kwargs: dict = field(default_factory=dict)  # the constructor's (dataset.environment_kwargs)
    verdict_from_rewards: bool = False  # an entry of dataset.rewards is marked verdict: true
    startup_s: float = 120.0
    _reported: set = field(default_factory=set)
    _first_batch: bool = True


@dataclass
class EpisodeRecord:
    """What one episode did, beside its tokens: kept on its Completion (``episode``) for metrics and transcripts."""

    prompt_ids: list[int]
    messages: list[dict] = field(default_factory=list)  # the conversation, first prompt's messages included
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0  # malformed, unknown tool, arguments that do not fit: shown to the model as an error text
    truncated: bool = False  # cut at the token budget
    env_reward: float = 0.0
    env_correct: bool | None = None
    env_parts: dict[str, float] = field(default_factory=dict)  # the reward's other numbers by name (summed)
    failure: str | None = None  # the kind of the call that ended it (ENV_FAILURE_KINDS)
    failure_message: str = ""  # and what it said (its traceback)
    correct: bool | None = None  # the episode's verdict (the environment's or the rewards'), once scored
    reward: float | None = None  # its training reward, once scored
    done: bool = False

    @property
    def prompt_messages(self) -> list[dict]:
        """The first prompt's messages (a system message, the user's): all before the model's first turn."""
        first = next((i for i, m in enumerate(self.messages) if m["role"] == "assistant"), len(self.messages))
        return self.messages[:first]

    @property
    def assistant_text(self) -> str:
        return "\n".join(m["content"] for m in self.messages if m["role"] == "assistant")


@dataclass
class _Episode:
    problem: Problem
    seed: int
    record: EpisodeRecord | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    stopped: bool = False  # the last turn ended with its EOS token (else it was cut at its length)

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)


def sample_episodes(sampler, problems: list[Problem], env: Environment, scorer: Scorer, pool, *, group_size: int,
                    max_new_tokens: int, temperature: float, top_p: float, seed: int | list[int],
                    ranks: Ranks = SINGLE) -> Groups:
    """``group_size`` episodes per problem, scored; ``seed`` the draw's or one per problem (as
    :func:`~fgrpo.rollout.rollouts.sample_groups`). The ranks of a tensor-parallel engine play the same episodes
    (their sampler calls are one engine's, the environment's calls seeded the same) and each scores them all.
    ``verify_time_s`` of the result: the seconds in the environment's calls and the reward functions."""
    prompt_seed = seed if isinstance(seed, list) else [seed + index for index in range(len(problems))]
    episodes = [_Episode(p, prompt_seed[i] * 1_009 + g) for i, p in enumerate(problems) for g in range(group_size)]
    env_time = 0.0
    if episodes:
        with EpisodeHosts(pool, env.spec.target, len(episodes), timeout_s=env.timeout_s, kwargs=env.kwargs,
                          startup_s=env.startup_s) as hosts:
            env_time = _play(sampler, episodes, env, hosts, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_p=top_p)
    _stop_if_failing_everywhere(env, episodes)
    start = time.perf_counter()
    groups = _scored(episodes, env, scorer, group_size, (len(problems), group_size))
    groups.verify_time_s = env_time + time.perf_counter() - start
    return groups


def _play(sampler, episodes: list[_Episode], env: Environment, hosts: EpisodeHosts, *, max_new_tokens: int,
          temperature: float, top_p: float) -> float:
    """Reset every episode, then turn rounds until each is done; returns the seconds spent in the environment."""
    clock = _Clock()
    with clock:
        _reset_all(episodes, env, hosts)
    for turn in range(env.max_turns):
        live = [e for e, ep in enumerate(episodes) if not ep.record.done]
        if not live:
            break
        ops, owners = _sample_turn(sampler, episodes, live, env, turn, max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_p=top_p)
        with clock:
            replies = hosts.call([op for op in ops if op is not None])
        _take_replies(episodes, env, ops, owners, replies, last_round=turn == env.max_turns - 1)
    for ep in episodes:
        ep.record.done = True
    with clock:
        if env.spec.shape == "tools" and env.spec.has_get_reward:
            _get_rewards(episodes, env, hosts)
        hosts.call([("close", e, None) for e, ep in enumerate(episodes) if ep.record.failure is None])
    return clock.seconds


class _Clock:
    """Seconds spent inside its ``with`` blocks, added up."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        self._start = time.perf_counter()

    def __exit__(self, *exc_info):
        self.seconds += time.perf_counter() - self._start


def _reset_all(episodes: list[_Episode], env: Environment, hosts: EpisodeHosts) -> None:
    """Every episode's instance built and reset; its first prompt rendered with what reset returned."""
    replies = hosts.call([("reset", e, (_reset_row(ep.problem, env.spec), ep.seed)) for e, ep in enumerate(episodes)])
    for ep, reply in zip(episodes, replies):
        text = reply.value if reply.status == "ok" else None
        prompt = ep.problem.prompt or ep.problem.question
        ep.record = EpisodeRecord(env.renderer.prompt_ids(prompt, text), env.renderer.messages(prompt, text))
        if reply.status != "ok":
            _fail(env, ep, reply, "reset")


def _sample_turn(sampler, episodes: list[_Episode], live: list[int], env: Environment, turn: int, *,
                 max_new_tokens: int, temperature: float, top_p: float) -> tuple[list, list]:
    """One sampler call over the live episodes, each from its own ids; the turn's tokens appended as sampled (cut at
    the budget). Returns the environment's calls to make (None: a malformed tool call, answered here) and, for each,
    ``(episode, tool call or None)``."""
    room = [env.max_tokens - len(episodes[e].ids) for e in live]
    outputs = sampler.generate([episodes[e].record.prompt_ids + episodes[e].ids for e in live], 1,
                               max_new_tokens=max(1, min(max_new_tokens, max(room))), temperature=temperature,
                               top_p=top_p, seed=[episodes[e].seed * 31 + turn for e in live])
    ops, owners = [], []
    for e, left, (completion,) in zip(live, room, outputs):
        ep = episodes[e]
        ids = completion.token_ids[:left]
        ep.add(ids, completion.logprobs[:left])
        ep.record.turns += 1
        ep.stopped = not completion.truncated
        whole = len(ids) == len(completion.token_ids)
        text = completion.text if whole else env.renderer.tokenizer.decode(ids, skip_special_tokens=True)
        ep.record.messages.append({"role": "assistant", "content": text})
        if not whole or len(ep.ids) >= env.max_tokens:
            ep.record.truncated = ep.record.done = True
        elif env.spec.shape == "game":
            ops.append(("step", e, text))
            owners.append((e, None))
        else:
            calls = parse_tool_calls(text)
            ep.record.done = not calls  # a turn without a call: the model answered
            for call in calls:
                ep.record.tool_calls += 1
                ops.append(("tool", e, (call.name, call.arguments)) if not call.error else None)
                owners.append((e, call))
    return ops, owners


def _take_replies(episodes: list[_Episode], env: Environment, ops: list, owners: list, replies: list[Reply], *,
                  last_round: bool) -> None:
    """The environment's replies into the episodes: rewards, ends, failures, and the next turn's suffix as ids."""
    answered = iter(replies)
    results: dict[int, list[dict]] = {}
    for op, (e, call) in zip(ops, owners):
        ep = episodes[e]
        reply = next(answered) if op is not None else Reply("tool_error", call.error)
        if ep.record.done:
            continue
        if reply.status == "failed":
            _fail(env, ep, reply, op[0])
        elif env.spec.shape == "game":
            observation, (reward, correct, parts), done = reply.value
            ep.record.env_reward += reward
            ep.record.env_correct = correct if correct is not None else ep.record.env_correct
            for name, value in parts.items():  # summed over the steps, as the reward is
                ep.record.env_parts[name] = ep.record.env_parts.get(name, 0.0) + value
            if done or last_round:
                ep.record.done = True
            elif observation is not None:
                results.setdefault(e, []).append({"role": "user", "content": observation})
        else:
            ep.record.tool_errors += reply.status == "tool_error"
            results.setdefault(e, []).append({"role": "tool", "name": call.name or "tool", "content": str(reply.value)})
    for e, messages in results.items():
        ep = episodes[e]
        if ep.record.done or last_round:
            ep.record.done = True
            continue
        ep.record.messages += messages
        suffix = env.renderer.suffix_ids(messages, ep.ids, stopped=ep.stopped)
        left = env.max_tokens - len(ep.ids)
        ep.add(suffix[:left], None)
        if len(suffix) >= left:  # no room left for a turn after it
            ep.record.truncated = ep.record.done = True


def _get_rewards(episodes: list[_Episode], env: Environment, hosts: EpisodeHosts) -> None:
    """A tool class's ``get_reward()`` of each episode that did not fail."""
    alive = [e for e, ep in enumerate(episodes) if ep.record.failure is None]
    for e, reply in zip(alive, hosts.call([("reward", e, None) for e in alive])):
        if reply.status == "failed":
            _fail(env, episodes[e], reply, "get_reward")
        else:
            record = episodes[e].record
            record.env_reward, record.env_correct, record.env_parts = reply.value


def _reset_row(problem: Problem, spec: EnvSpec) -> dict:
    """``reset``'s arguments: the row's columns by parameter name (all of them where it takes ``**kwargs``)."""
    if spec.reset_any:
        return dict(problem.fields)
    return {name: problem.fields[name] for name in spec.reset_params if name in problem.fields}


def _fail(env: Environment, ep: _Episode, reply: Reply, call: str) -> None:
    ep.record.failure, ep.record.failure_message, ep.record.done = reply.kind, f"{call}: {reply.message}", True
    ep.record.env_reward, ep.record.env_correct = 0.0, False
    if reply.kind not in env._reported:
        env._reported.add(reply.kind)
        log.warning("environment %s: %s failed (%s); the episode ends with reward 0, the run goes on, and further "
                    "failures of this kind are counted in train/env/errors/%s only:\n%s", env.spec.target, call,
                    reply.kind, reply.kind, reply.message)


def _stop_if_failing_everywhere(env: Environment, episodes: list[_Episode]) -> None:
    """A class that fails every episode of the first batch stops the run (every rank: the verdict is agreed)."""
    if not env._first_batch:
        return
    env._first_batch = False
    failed = [ep.record for ep in episodes if ep.record.failure is not None]
    first = next(((r.failure, r.failure_message) for r in failed), ("", ""))
    parts = gather_objects((len(failed) == len(episodes) and bool(episodes), first, len(episodes)))
    if any(count for _, _, count in parts) and all(all_failed or not count for all_failed, _, count in parts):
        kind, message = next(first for _, first, count in parts if count)
        raise RewardError(f"environment {env.spec.target} (dataset.environment) failed every one of the "
                          f"{sum(c for _, _, c in parts)} episodes of its first batch: fix it, then run again. Its "
                          f"first failure ({kind}), in {message}")


def _scored(episodes: list[_Episode], env: Environment, scorer: Scorer, group_size: int, shape) -> Groups:
    """The episodes as Groups: their completions, the training rewards and verdicts."""
    problems = [episodes[i * group_size].problem for i in range(shape[0])]
    completions = [[_completion(ep) for ep in episodes[i * group_size:(i + 1) * group_size]] for i in range(shape[0])]
    env_reward = torch.tensor([ep.record.env_reward for ep in episodes], dtype=torch.float32)
    env_correct = torch.tensor([_env_verdict(ep.record, env) for ep in episodes], dtype=torch.float32)
    values = {"env": env_reward.reshape(shape).clone()}
    failures: dict[str, Counter] = {}  # the reward functions'; the environment's are in episode_metrics
    rewards, correct, errors, metrics = env_reward.clone(), env_correct, 0, {}
    skipped = torch.zeros(shape[0], dtype=torch.bool)
    if scorer.entries:
        views = [sample_view(completion=ep.record.assistant_text, completion_ids=[t for t, m in zip(ep.ids, ep.mask) if m],
                             prompt=ep.record.prompt_messages, answer=ep.problem.answer, source=ep.problem.source,
                             fields=ep.problem.fields, timeout_s=scorer.timeout_s, reference=ep.problem.reference,
                             episode={"messages": ep.record.messages, "env_reward": ep.record.env_reward})
                 for ep in episodes]
        scored = scorer.score(views, [ep.seed for ep in episodes])
        rewards += torch.tensor(scored.rewards, dtype=torch.float32)
        failed_env = torch.tensor([ep.record.failure is not None for ep in episodes])
        rewards[failed_env] = 0.0
        if env.verdict_from_rewards or not _env_judges(env):
            correct = torch.tensor(scored.correct, dtype=torch.float32) * ~failed_env
        values.update({name: torch.tensor([math.nan if v is None else v for v in vals],
                                          dtype=torch.float32).reshape(shape) for name, vals in scored.values.items()})
        failures.update(scored.failures)
        errors, metrics = scored.errors, scored.metrics
        skipped = torch.tensor(scored.skipped, dtype=torch.bool).reshape(shape).any(dim=1)
    for ep, right, reward in zip(episodes, correct.tolist(), rewards.tolist()):  # for the transcripts
        ep.record.correct, ep.record.reward = bool(right), reward
    return Groups(problems, completions, correct.reshape(shape), rewards.reshape(shape), values, skipped, errors,
                  failures=failures, reward_metrics=metrics)


def _env_judges(env: Environment) -> bool:
    """Whether the environment gives the verdict: a game always; a tool class where it has get_reward."""
    return env.spec.shape == "game" or env.spec.has_get_reward


def _env_verdict(record: EpisodeRecord, env: Environment) -> float:
    if record.failure is not None:
        return 0.0
    if record.env_correct is not None:
        return float(record.env_correct)
    return float(record.env_reward >= env.threshold)


def _completion(ep: _Episode) -> Completion:
    return Completion(list(ep.ids), list(ep.logprobs), ep.record.truncated, ep.record.assistant_text,
                      loss_mask=list(ep.mask), episode=ep.record)


def episode_metrics(groups: Groups, prefix: str) -> dict[str, float]:
    """Per episode, over every rank: turns, tool calls and failed calls, truncated share, the tokens the loss counts,
    the environment's reward, failures by kind (``<prefix>/env/...``)."""
    mine = [c.episode for group in groups.completions for c in group if c.episode is not None]
    mine_masked = [sum(c.loss_mask) for group in groups.completions for c in group if c.loss_mask is not None]
    parts = gather_objects((mine, mine_masked))
    records = [r for part, _ in parts for r in part]
    masked = [m for _, part in parts for m in part]
    if not records:
        return {}
    count = len(records)
    metrics = {
        f"{prefix}/env/turns_mean": sum(r.turns for r in records) / count,
        f"{prefix}/env/tool_calls_mean": sum(r.tool_calls for r in records) / count,
        f"{prefix}/env/tool_errors_mean": sum(r.tool_errors for r in records) / count,
        f"{prefix}/env/truncated_frac": sum(r.truncated for r in records) / count,
        f"{prefix}/env/sampled_tokens_mean": sum(masked) / max(len(masked), 1),
        f"{prefix}/env/reward_mean": sum(r.env_reward for r in records) / count,
    }
    for name in sorted({name for r in records for name in r.env_parts}):  # a part missing from an episode counts 0
        metrics[f"{prefix}/env/reward/{name}"] = sum(r.env_parts.get(name, 0.0) for r in records) / count
    kinds = Counter(r.failure for r in records if r.failure)
    metrics.update({f"{prefix}/env/errors/{kind}": float(kinds.get(kind, 0)) for kind in ENV_FAILURE_KINDS})
    return metrics


def draw_groups(sampler, problems: list[Problem], prompt_ids: dict[str, list[int]], scorer: Scorer,
                environment: Environment | None, *, group_size: int, max_new_tokens: int, temperature: float,
                top_p: float, seed: int | list[int], ranks: Ranks = SINGLE, progress: str | None = None) -> Groups:
    """A draw's groups: single samples (:func:`~fgrpo.rollout.rollouts.sample_groups`; ``progress``: their progress
    bar's label), or episodes where the run has an environment (turn by turn: no bar)."""
    if environment is None:
        return sample_groups(sampler, problems, prompt_ids, scorer, group_size=group_size,
                             max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                             ranks=ranks, progress=progress)
    return sample_episodes(sampler, problems, environment, scorer, scorer.pool, group_size=group_size,
                           max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, ranks=ranks)
