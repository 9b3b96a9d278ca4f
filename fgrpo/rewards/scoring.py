"""The trainer's side of the rewards: :class:`Scorer` runs a run's reward functions (``dataset.rewards``) on a batch of
samples and returns, per sample, the training reward (the weighted sum), the 0/1 verdict (one entry's), whether the
sample is skipped (every function returned None), and each function's value.

A user's function always runs in a worker of the reward pool (:class:`~fgrpo.user_code.pool.WorkerPool`, even with one
worker), sent by its import path; fgrpo's ``numeric`` check runs in the trainer (microseconds), its ``math`` check in
the pool where ``dataset.reward_workers`` > 1. A call that raises, runs out of time, kills its worker or returns
something unusable gives its samples 0 (and verdict 0): counted by function and kind (:attr:`ScoredBatch.failures`),
the first of each kind logged with its traceback, and the run goes on. A function that fails its first
``stop_after`` calls in a row the same way, or every sample of the first batch it sees, stops the run with its
traceback (:class:`~fgrpo.infra.errors.RewardError`), every rank together; the first rule stops it as soon as the
last of those calls ends.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fgrpo.infra import distributed
from fgrpo.infra.errors import ConfigError, RewardError
from fgrpo.rewards.binding import FGRPO_NAMES, Binding, TrainerState, needed, unfilled, unknown_kwargs
from fgrpo.rewards.calls import Call, CallResult, Describe, Failed, Outcome, run_task, warm_up
from fgrpo.rewards.entries import RewardEntry
from fgrpo.user_code.running import run_request, warm_up_each
from fgrpo.user_code.pool import AUTO_WORKERS, STARTUP_LIMIT_S, Fault, StartupTimeout, WorkerPool, auto_workers

__all__ = ["Scorer", "ScoredBatch", "FAILURE_KINDS", "user_code_workers"]

log = logging.getLogger(__name__)

FAILURE_KINDS = ("raised", "timeout", "died", "value")  # a stuck worker killed past its limit counts as timeout
STOP_AFTER = 16
"""A function that fails its first this many calls in a row, all the same way, stops the run at once."""


def user_code_workers(cores: int | None = None) -> int:
    """``dataset.reward_workers=auto`` where a user's function runs: twice this rank's share of the cores, at least 8,
    at most 16 (a worker is about 35 MB). More than the cores, since a call waiting (on a lock, a server, its time
    limit) takes no core, and a worker on a hung call holds only its own slot: with 8 workers a function hanging on 1
    sample in 8 costs a 64-sample batch about one time limit; with one worker it cost eight (docs/tasks.md has the
    measured costs)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        cores //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(8, min(16, 2 * max(1, cores)))


@dataclass
class ScoredBatch:
    """One batch's rewards, each list in the samples' order."""

    rewards: list[float]  # the weighted sum of the entries' scores (a skipped or failed one counts 0)
    correct: list[float]  # 1.0 where the verdict entry says the sample is right
    skipped: list[bool]  # every entry returned None
    values: dict[str, list[float | None]] = field(default_factory=dict)  # name (and name/extra) -> value, None: none
    failures: dict[str, Counter] = field(default_factory=dict)  # name -> kind -> samples that failed that way
    metrics: dict[str, list[float]] = field(default_factory=dict)  # "<name>/<metric>" -> what log_metric logged

    @property
    def errors(self) -> int:
        """Samples whose call failed, over every function and kind."""
        return sum(sum(kinds.values()) for kinds in self.failures.values())


@dataclass
class _Streak:
    """A function's first calls while they all fail the same way (``signature``), and how many."""

    signature: str | None = None
    count: int = 0
    over: bool = False  # a call did not fail that way: the function works, the rule no longer applies


class Scorer:
    """Scores samples with ``entries``. ``workers`` and ``timeout_s``: the reward pool's size and each call's time
    limit (a batch function's: ``timeout_s`` per sample). ``conversational`` and ``system_prompt``: how the prompts were
    built, for batch functions (TRL's chat form). ``seed`` and ``rank`` seed the workers; ``memory_gib``, ``max_calls``
    and ``import_timeout_s``: each worker's memory cap, the calls after which it is replaced (0: never), the time its
    imports may take. :meth:`describe` and :meth:`check_columns` before the first batch; :meth:`close` at the end."""

    def __init__(self, entries: list[RewardEntry], *, workers: int | str = 1, timeout_s: float = 5.0,
                 conversational: bool = False, system_prompt: str | None = None, seed: int = 0, rank: int = 0,
                 memory_gib: float | None = None, max_calls: int = 0, import_timeout_s: float = STARTUP_LIMIT_S,
                 stop_after: int = STOP_AFTER, warm_up_also: Callable[[], Any] | None = None):
        self.entries = entries
        self.timeout_s = timeout_s
        self.conversational, self.system_prompt = conversational, system_prompt
        self.import_timeout_s, self.stop_after = import_timeout_s, stop_after
        self.state = TrainerState()  # TRL's trainer_state: the loop moves it (:meth:`at_step`)
        pooled = [entry for entry in entries if not entry.in_process]
        users = [entry for entry in pooled if not entry.builtin]
        targets = tuple((entry.target, f"{entry.key}.fn") for entry in pooled)
        # warm_up_also: other user code the workers serve (an environment's class: fgrpo.environments), imported too
        users_here = bool(users) or warm_up_also is not None
        if workers == AUTO_WORKERS:
            workers = user_code_workers() if users_here else auto_workers()
        warm = functools.partial(warm_up, targets)
        if warm_up_also is not None:
            warm = functools.partial(warm_up_each, (warm, warm_up_also))
        # a user's code always leaves the trainer's process; the math check alone stays in it with one worker
        self.pool = WorkerPool(run_request, workers, timeout_s=timeout_s, warm_up=warm, in_process_alone=not users_here,
                               seed=hash((seed, rank)) % 2 ** 32, memory_gib=memory_gib, max_calls=max_calls,
                               startup_limit_s=import_timeout_s) if pooled or users_here else None
        self.bindings: dict[str, Binding] = {}
        self.environment = None  # the run's environment's EnvSpec (fgrpo.environments.spec), set by fgrpo.prepare
        self._reported: set[tuple[str, str]] = set()  # (entry, kind) whose first failure was logged
        self._streaks = {entry.name: _Streak() for entry in entries}
        self._first_batch = True

    def at_step(self, step: int, max_steps: int, epoch: float) -> None:
        """What ``trainer_state`` says from now on: the step scored (0: the evaluation before training)."""
        self.state = TrainerState(int(step), int(max_steps), float(epoch))

    @property
    def pool_counters(self) -> dict[str, int]:
        """The worker pool's own counts so far (deaths, stuck workers killed) and its workers now."""
        if self.pool is None or self.pool.in_process:
            return {}
        return {**self.pool.counters, "workers": self.pool.workers}

    @property
    def verdict(self) -> RewardEntry:
        return next(entry for entry in self.entries if entry.verdict)

    def start(self) -> None:
        """Start the pool's workers now (they import the functions meanwhile)."""
        if self.pool is not None:
            self.pool.start()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def describe(self) -> None:
        """Load every function where it will run (a user's in a worker: the pool starts here) and read its signature.
        Raises ConfigError naming each entry that cannot be loaded and why."""
        try:
            described = self._run([Describe(entry.target, f"{entry.key}.fn") for entry in self.entries],
                                  [entry.in_process for entry in self.entries],
                                  [self.timeout_s + 60] * len(self.entries))
        except StartupTimeout as error:
            pooled = ", ".join(f"{e.key}.fn={e.fn!r}" for e in self.entries if not e.in_process)
            raise ConfigError(f"the reward workers did not finish importing {pooled} within "
                              f"dataset.reward_import_timeout_s={self.import_timeout_s:g} s: raise it if the imports "
                              f"are slow, or find what hangs at import ({error})") from error
        problems = []
        for entry, result in zip(self.entries, described):
            if isinstance(result, Fault):
                problems.append(f"{entry.key}.fn={entry.fn!r}: the worker loading it {result.kind} ({result.detail})")
            elif isinstance(result, str):
                problems.append(result)
            else:
                self.bindings[entry.name] = result
        if problems:
            raise ConfigError("reward functions that cannot be loaded:\n  " + "\n  ".join(problems))

    def check_columns(self, columns: set[str]) -> None:
        """That every function's parameters can be filled from fgrpo's names, ``columns`` (those every row has) and its
        entry's ``kwargs``, and takes those kwargs. Raises ConfigError naming the entry, the parameters and the fix."""
        problems = []
        for entry in self.entries:
            binding = self.bindings.get(entry.name) or self._bind_here(entry)
            missing = unfilled(binding, columns, entry.kwargs)
            if missing:
                problems.append(
                    f"{entry.key}.fn={entry.fn!r}: no value for its parameter(s) {', '.join(missing)}: a parameter "
                    f"takes fgrpo's names ({', '.join(FGRPO_NAMES)}), a column every row has "
                    f"({', '.join(sorted(columns)) or 'none'}), or keeps its default: rename it or give it a default")
            extra = unknown_kwargs(binding, entry.kwargs)
            if extra:
                problems.append(f"{entry.key}.kwargs has {', '.join(extra)}, which {entry.fn!r} does not take (its "
                                f"parameters: {', '.join(binding.params) or 'none'}, no **kwargs): drop them or add the "
                                "parameters")
        if problems:
            raise ConfigError("reward functions that cannot run on this data:\n  " + "\n  ".join(problems))

    def needs_answer(self) -> list[RewardEntry]:
        """The entries whose function takes the reference answer without a default (every row must have one)."""
        return [entry for entry in self.entries if (binding := self.bindings.get(entry.name)) is not None
                and any(name in binding.params and name not in binding.with_defaults
                        for name in ("answer", "ground_truth", "ground_truths"))]

    def needs_answer_text(self) -> bool:
        """Whether a function takes the answer as text (``answer``) without a default: then it must be text."""
        return any("answer" in b.params and "answer" not in b.with_defaults for b in self.bindings.values())

    def score(self, views: list[dict[str, Any]], seeds: list[int] | None = None) -> ScoredBatch:
        """Every entry on every sample (``views``: :func:`~fgrpo.rewards.binding.sample_view`), combined. ``seeds``:
        one per sample (each call seeded from its first sample's). Several ranks: each scores its own samples, then
        all learn whether any rank failed (a function failing as :meth:`_stop_rule` says, a pool that cannot run) and
        raise together, so that no rank waits alone in a collective."""
        first, self._first_batch = self._first_batch, False
        outcomes, metrics = distributed.agree(lambda: self._outcomes(views, seeds, check_all_failed=first))
        for entry in self.entries:
            for failure in {o.kind: o for o in outcomes[entry.name] if isinstance(o, Failed)}.values():
                self._report(entry, failure)
        return self._combine(outcomes, metrics, len(views))

    def _calls(self, views: list[dict[str, Any]], seeds: list[int] | None) -> tuple[list[Call], list]:
        """The batch's calls and, for each, its entry and the samples it covers: one call per sample, one per batch for
        a batch function, one per worker's share for a per-sample ``async`` function (its samples run concurrently)."""
        calls, owners = [], []
        chunks = self.pool.workers if self.pool is not None else 1
        for number, entry in enumerate(self.entries):
            binding = self.bindings.get(entry.name) or self._bind_here(entry)
            every = list(range(len(views)))
            if binding.batch:
                groups = [every]
            elif binding.is_async and not entry.in_process:
                size = -(-len(views) // max(1, min(chunks, len(views))))
                groups = [every[start:start + size] for start in range(0, len(views), size)]
            else:
                groups = [[i] for i in every]
            for samples in groups:
                if not samples:
                    continue
                chat = self.conversational or any(isinstance(views[i].get("prompt"), list) for i in samples)
                seed = None if seeds is None else (seeds[samples[0]] * 1_000_003 + number) % 2 ** 63
                calls.append(Call(entry.target, f"{entry.key}.fn", tuple(needed(binding, views[i]) for i in samples),
                                  binding.batch, self.timeout_s * len(samples), bounds_itself=entry.builtin,
                                  conversational=chat, system_prompt=self.system_prompt, kwargs=dict(entry.kwargs),
                                  state=self.state, seed=seed))
                owners.append((entry, samples))
        return calls, owners

    def _outcomes(self, views: list[dict[str, Any]], seeds: list[int] | None, *,
                  check_all_failed: bool) -> tuple[dict[str, list[Outcome]], dict[str, list[float]]]:
        """Each entry's outcome per sample (its calls in this process or the pool, in one batch; each call sent only
        what its function reads), and what the calls logged (``"<name>/<metric>"`` -> values)."""
        calls, owners = self._calls(views, seeds)
        stop: list[str] = []

        def on_result(index: int, result: Any) -> bool:
            message = self._stop_rule(owners[index][0], self._as_outcomes(result, len(owners[index][1])))
            if message:
                stop.append(message)
            return bool(message)

        results = self._run(calls, [entry.in_process for entry, _ in owners], [call.time_limit_s for call in calls],
                            on_result)
        if stop:
            raise RewardError(stop[0])
        outcomes: dict[str, list[Outcome]] = {entry.name: [None] * len(views) for entry in self.entries}
        metrics: dict[str, list[float]] = {}
        for (entry, samples), result in zip(owners, results):
            for sample, outcome in zip(samples, self._as_outcomes(result, len(samples))):
                outcomes[entry.name][sample] = outcome
            for name, values in (result.metrics.items() if isinstance(result, CallResult) else ()):
                metrics.setdefault(f"{entry.name}/{name}", []).extend(values)
        if check_all_failed:
            self._raise_if_failing_everywhere(outcomes)
        return outcomes, metrics

    @staticmethod
    def _as_outcomes(result: Any, count: int) -> list[Outcome]:
        if isinstance(result, Fault):
            return [Failed("timeout" if result.kind == "stuck" else "died", f"its worker {result.detail}")] * count
        return result.outcomes

    def _stop_rule(self, entry: RewardEntry, outcomes: list[Outcome]) -> str | None:
        """The error that stops the run where ``entry``'s first ``stop_after`` calls (this one the last) all failed the
        same way; None otherwise (and for good once one did not)."""
        streak = self._streaks[entry.name]
        if streak.over or not self.stop_after:
            return None
        failed = [o for o in outcomes if o is not None]
        signatures = {o.signature if isinstance(o, Failed) else None for o in failed}
        if not failed or len(signatures) != 1 or None in signatures or streak.signature not in (None, *signatures):
            streak.over = True
            return None
        streak.signature, streak.count = signatures.pop(), streak.count + 1
        if streak.count < self.stop_after:
            return None
        first = failed[0]
        return (f"reward function {entry.name} ({entry.key}.fn={entry.fn!r}) failed its first {streak.count} calls, all "
                f"the same way ({first.kind}): fix it, then run again (dataset.reward_stop_after=0 turns this stop "
                f"off). Its failure:\n{first.message}")

    # --- internals ---

    def _bind_here(self, entry: RewardEntry) -> Binding:
        """An entry :meth:`describe` did not see (a caller that skipped it): its binding, loaded where it runs."""
        result = self._run([Describe(entry.target, f"{entry.key}.fn")], [entry.in_process], [self.timeout_s + 60])[0]
        if not isinstance(result, Binding):
            raise ConfigError(str(result))
        self.bindings[entry.name] = result
        return result

    def _run(self, requests: list, in_process: list[bool], timeouts: list[float], on_result=None) -> list:
        """Each request's result: in this process where ``in_process``, else in the pool (in one batch);
        ``on_result(index, result)`` as each ends (True: stop)."""
        results: list = [None] * len(requests)
        pooled = [i for i, here in enumerate(in_process) if not here]
        for i, here in enumerate(in_process):
            if here:
                results[i] = run_task(requests[i])
                if on_result is not None and on_result(i, results[i]):
                    return results
        if pooled:
            relay = None if on_result is None else (lambda j, result: on_result(pooled[j], result))
            done = self.pool.run([(requests[i],) for i in pooled], [timeouts[i] for i in pooled], relay)
            for i, result in zip(pooled, done):
                results[i] = result
        return results

    def _combine(self, outcomes: dict[str, list[Outcome]], metrics: dict[str, list[float]], count: int) -> ScoredBatch:
        verdict = self.verdict
        batch = ScoredBatch([0.0] * count, [0.0] * count, [True] * count, metrics=metrics)
        for entry in self.entries:
            scores: list[float | None] = [None] * count
            extras: dict[str, list[float | None]] = {}
            failures = batch.failures.setdefault(entry.name, Counter())
            for i, outcome in enumerate(outcomes[entry.name]):
                if outcome is None:
                    continue
                batch.skipped[i] = False
                if isinstance(outcome, Failed):
                    failures[outcome.kind] += 1
                    scores[i] = 0.0
                    continue
                scores[i] = outcome.score
                batch.rewards[i] += entry.weight * outcome.score
                for name, value in outcome.extras.items():
                    extras.setdefault(name, [None] * count)[i] = value
                if entry is verdict:
                    right = outcome.correct if outcome.correct is not None else outcome.score >= entry.threshold
                    batch.correct[i] = 1.0 if right else 0.0
            batch.values[entry.name] = scores
            batch.values.update({f"{entry.name}/{name}": values for name, values in extras.items()})
        return batch

    def _report(self, entry: RewardEntry, failure: Failed) -> None:
        """The first failure of each function and kind, with its traceback; later ones are counted only."""
        if (entry.name, failure.kind) not in self._reported:
            self._reported.add((entry.name, failure.kind))
            log.warning("reward function %s (%s) failed (%s); its samples score 0, the run goes on, and further "
                        "failures of this kind are counted in train/reward/%s/errors/%s only:\n%s", entry.name,
                        entry.fn, failure.kind, entry.name, failure.kind, failure.message)

    def _raise_if_failing_everywhere(self, outcomes: dict[str, list[Outcome]]) -> None:
        for entry in self.entries:
            seen = [outcome for outcome in outcomes[entry.name] if outcome is not None]
            if seen and all(isinstance(outcome, Failed) for outcome in seen):
                raise RewardError(f"reward function {entry.name} ({entry.key}.fn={entry.fn!r}) failed on all "
                                  f"{len(seen)} samples of its first batch: fix it, then run again. Its first "
                                  f"failure ({seen[0].kind}):\n{seen[0].message}")
