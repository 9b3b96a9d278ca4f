"""The trainer's side of the rewards: :class:`Scorer` runs a run's reward functions (``dataset.rewards``) on a batch of
samples and returns, per sample, the training reward (the weighted sum), the 0/1 verdict (one entry's), whether the
sample is skipped (every function returned None), and each function's value.

A user's function always runs in a worker of the reward pool (:class:`~fgrpo.rewards.pool.WorkerPool`, even with one
worker), sent by its import path; fgrpo's ``numeric`` check runs in the trainer (microseconds), its ``math`` check in
the pool where ``dataset.reward_workers`` > 1. A call that raises, runs out of time, kills its worker or returns
something unusable gives its samples 0 (and verdict 0): counted (:attr:`ScoredBatch.errors`), its first traceback
logged once per function, and the run goes on; a function that fails on every sample of the first batch it sees stops
the run with its traceback (:class:`~fgrpo.infra.errors.RewardError`), every rank together.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from fgrpo.infra import distributed
from fgrpo.infra.errors import ConfigError, RewardError
from fgrpo.rewards.binding import FGRPO_NAMES, Binding, needed, unfilled
from fgrpo.rewards.calls import Call, Describe, Failed, Outcome, run_task, warm_up
from fgrpo.rewards.entries import RewardEntry
from fgrpo.rewards.pool import Fault, WorkerPool

__all__ = ["Scorer", "ScoredBatch"]

log = logging.getLogger(__name__)


@dataclass
class ScoredBatch:
    """One batch's rewards, each list in the samples' order."""

    rewards: list[float]  # the weighted sum of the entries' scores (a skipped or failed one counts 0)
    correct: list[float]  # 1.0 where the verdict entry says the sample is right
    skipped: list[bool]  # every entry returned None
    values: dict[str, list[float | None]] = field(default_factory=dict)  # name (and name/extra) -> value, None: none
    errors: int = 0  # calls' samples that failed (raised, timed out, killed, an unusable value)


class Scorer:
    """Scores samples with ``entries``. ``workers`` and ``timeout_s``: the reward pool's size and each call's time
    limit (a batch function's: ``timeout_s`` per sample). ``conversational`` and ``system_prompt``: how the prompts were
    built, for batch functions (TRL's chat form). :meth:`describe` and :meth:`check_columns` before the first batch;
    :meth:`close` at the end."""

    def __init__(self, entries: list[RewardEntry], *, workers: int | str = 1, timeout_s: float = 5.0,
                 conversational: bool = False, system_prompt: str | None = None):
        self.entries = entries
        self.timeout_s = timeout_s
        self.conversational, self.system_prompt = conversational, system_prompt
        pooled = [entry for entry in entries if not entry.in_process]
        targets = tuple((entry.target, f"{entry.key}.fn") for entry in pooled)
        # a user's code always leaves the trainer's process; the math check alone stays in it with one worker
        self.pool = WorkerPool(run_task, workers, timeout_s=timeout_s, warm_up=functools.partial(warm_up, targets),
                               in_process_alone=all(entry.builtin for entry in pooled)) if pooled else None
        self.bindings: dict[str, Binding] = {}
        self._reported: set[str] = set()  # entries whose first failure was logged
        self._first_batch = True

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
        described = self._run([Describe(entry.target, f"{entry.key}.fn") for entry in self.entries],
                              [entry.in_process for entry in self.entries], [self.timeout_s + 60] * len(self.entries))
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
        """That every function's parameters can be filled from fgrpo's names and ``columns`` (those every row has).
        Raises ConfigError naming the entry, the parameters and the fix."""
        problems = []
        for entry in self.entries:
            missing = unfilled(self.bindings.get(entry.name) or self._bind_here(entry), columns)
            if missing:
                problems.append(
                    f"{entry.key}.fn={entry.fn!r}: no value for its parameter(s) {', '.join(missing)}: a parameter "
                    f"takes fgrpo's names ({', '.join(FGRPO_NAMES)}), a column every row has "
                    f"({', '.join(sorted(columns)) or 'none'}), or keeps its default: rename it or give it a default")
        if problems:
            raise ConfigError("reward functions that cannot run on this data:\n  " + "\n  ".join(problems))

    def needs_answer(self) -> list[RewardEntry]:
        """The entries whose function takes the reference answer without a default (every row must have one)."""
        return [entry for entry in self.entries if (binding := self.bindings.get(entry.name)) is not None
                and any(name in binding.params and name not in binding.with_defaults
                        for name in ("answer", "ground_truth"))]

    def score(self, views: list[dict[str, Any]]) -> ScoredBatch:
        """Every entry on every sample (``views``: :func:`~fgrpo.rewards.binding.sample_view`), combined. Several
        ranks: each scores its own samples, then all learn whether any rank failed (a function failing its whole
        first batch, a pool that cannot run) and raise together, so that no rank waits alone in a collective."""
        first, self._first_batch = self._first_batch, False
        outcomes = distributed.agree(lambda: self._outcomes(views, check_all_failed=first))
        for entry in self.entries:
            failure = next((o for o in outcomes[entry.name] if isinstance(o, Failed)), None)
            if failure is not None:
                self._report(entry, failure)
        return self._combine(outcomes, len(views))

    def _outcomes(self, views: list[dict[str, Any]], *, check_all_failed: bool) -> dict[str, list[Outcome]]:
        """Each entry's outcome per sample: its calls (one per sample, or one per batch for a batch function) in
        this process or the pool, in one batch; each call sent only what its function reads."""
        calls, owners = [], []  # owners: (entry, the samples the call covers)
        for entry in self.entries:
            binding = self.bindings.get(entry.name) or self._bind_here(entry)
            groups = [list(range(len(views)))] if binding.batch else [[i] for i in range(len(views))]
            for samples in groups:
                if samples:
                    calls.append(Call(entry.target, f"{entry.key}.fn",
                                      tuple(needed(binding, views[i]) for i in samples), binding.batch,
                                      self.timeout_s * len(samples), bounds_itself=entry.builtin,
                                      conversational=self.conversational, system_prompt=self.system_prompt))
                    owners.append((entry, samples))
        results = self._run(calls, [entry.in_process for entry, _ in owners], [call.time_limit_s for call in calls])
        outcomes: dict[str, list[Outcome]] = {entry.name: [None] * len(views) for entry in self.entries}
        for (entry, samples), result in zip(owners, results):
            if isinstance(result, Fault):
                result = [Failed(result.kind, f"its worker {result.detail}")] * len(samples)
            for sample, outcome in zip(samples, result):
                outcomes[entry.name][sample] = outcome
        if check_all_failed:
            self._raise_if_failing_everywhere(outcomes)
        return outcomes

    # --- internals ---

    def _bind_here(self, entry: RewardEntry) -> Binding:
        """An entry :meth:`describe` did not see (a caller that skipped it): its binding, loaded where it runs."""
        result = self._run([Describe(entry.target, f"{entry.key}.fn")], [entry.in_process], [self.timeout_s + 60])[0]
        if not isinstance(result, Binding):
            raise ConfigError(str(result))
        self.bindings[entry.name] = result
        return result

    def _run(self, requests: list, in_process: list[bool], timeouts: list[float]) -> list:
        """Each request's result: in this process where ``in_process``, else in the pool (in one batch)."""
        results: list = [None] * len(requests)
        pooled = [i for i, here in enumerate(in_process) if not here]
        for i, here in enumerate(in_process):
            if here:
                results[i] = run_task(requests[i])
        if pooled:
            done = self.pool.run([(requests[i],) for i in pooled], [timeouts[i] for i in pooled])
            for i, result in zip(pooled, done):
                results[i] = result
        return results

    def _combine(self, outcomes: dict[str, list[Outcome]], count: int) -> ScoredBatch:
        verdict = self.verdict
        batch = ScoredBatch([0.0] * count, [0.0] * count, [True] * count)
        for entry in self.entries:
            scores: list[float | None] = [None] * count
            extras: dict[str, list[float | None]] = {}
            for i, outcome in enumerate(outcomes[entry.name]):
                if outcome is None:
                    continue
                batch.skipped[i] = False
                if isinstance(outcome, Failed):
                    batch.errors += 1
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
        """The first failure of each function, with its traceback; later ones are counted only (train/reward_errors)."""
        if entry.name not in self._reported:
            self._reported.add(entry.name)
            log.warning("reward function %s (%s) failed (%s); its samples score 0, the run goes on, and further "
                        "failures are counted in train/reward_errors only:\n%s", entry.name, entry.fn, failure.kind,
                        failure.message)

    def _raise_if_failing_everywhere(self, outcomes: dict[str, list[Outcome]]) -> None:
        for entry in self.entries:
            seen = [outcome for outcome in outcomes[entry.name] if outcome is not None]
            if seen and all(isinstance(outcome, Failed) for outcome in seen):
                raise RewardError(f"reward function {entry.name} ({entry.key}.fn={entry.fn!r}) failed on all "
                                  f"{len(seen)} samples of its first batch: fix it, then run again. Its first "
                                  f"failure ({seen[0].kind}):\n{seen[0].message}")

