"""One call of a reward function as a worker of the reward pool runs it (and the trainer, for the built-in checks):
the function loaded by its import path (once per process), its arguments bound by name (:mod:`fgrpo.rewards.binding`),
the call bounded in time and seeded, and what it returned turned into an outcome per sample:

- :class:`Scored`: a number, or a dict with ``score`` (its other numbers kept as extras, its ``correct`` as the
  verdict, if given);
- ``None``: the function skipped the sample (it returned None);
- :class:`Failed`: the call raised (any exception: ``sys.exit``, ``KeyboardInterrupt`` and ``CancelledError`` too, in
  a worker), ran out of time, or returned something else (a string, NaN, a list of the wrong length); the message says
  what, with the traceback where there is one.

``async def`` functions run on one event loop per process, kept for its life (a module-level lock or client works on
every call); a per-sample one sent several samples in one call runs them concurrently, each within its own limit.

Nothing here imports torch or fgrpo's trainer: a worker that imports this module is a fresh interpreter with the
user's module and little else. Requests and outcomes are small dataclasses, pickled between the processes; the
function itself never is: each worker imports it by its path.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fgrpo.infra.errors import ConfigError
from fgrpo.user_code.loading import load_function
from fgrpo.rewards.binding import Binding, TrainerState, arguments, batch_arguments, bind
from fgrpo.user_code.running import (await_result, call_bounded, in_worker, raised_text, seed_call, user_faults,
                                     user_traceback)
from fgrpo.user_code.time_limit import TimeLimitExceeded, run_with_time_limit

__all__ = ["Scored", "Failed", "Outcome", "Call", "CallResult", "Describe", "run_task", "outcome_of", "load",
           "warm_up", "in_worker"]


@dataclass(frozen=True)
class Scored:
    score: float
    extras: dict[str, float] = field(default_factory=dict)
    correct: bool | None = None  # a dict's own verdict (its "correct"), where it gave one


@dataclass(frozen=True)
class Failed:
    kind: str  # raised | timeout | value | died
    message: str

    @property
    def signature(self) -> str:
        """What tells two failures apart: the kind and the message's last line (the exception and its text)."""
        lines = self.message.strip().splitlines()
        return f"{self.kind}: {lines[-1] if lines else ''}"


Outcome = Scored | Failed | None  # None: the function returned None (the sample is skipped)


@dataclass(frozen=True)
class Call:
    """One call: of ``target`` on one view (a per-sample function), on all ``views`` (a batch function), or on each of
    ``views`` concurrently (a per-sample ``async`` function sent several)."""

    target: str  # the import path, a file's made absolute
    key: str  # the config key that named it, for messages
    views: tuple[Mapping[str, Any], ...]
    batch: bool
    time_limit_s: float  # the whole call's (a batch's or several samples': the per-sample limit times their count)
    bounds_itself: bool = False  # a built-in check with its own time limit (the math check): no second alarm
    conversational: bool = False  # batch: completions and prompts in TRL's chat form
    system_prompt: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # the entry's own (verl's reward_kwargs)
    state: TrainerState | None = None  # TRL's trainer_state
    seed: int | None = None  # random (numpy's, torch's where imported) seeded with it before the call

    def run(self) -> CallResult:
        return run_task(self)


@dataclass(frozen=True)
class CallResult:
    """A :class:`Call`'s outcomes (one per view) and what it logged with ``log_metric`` (name -> values)."""

    outcomes: list[Outcome]
    metrics: dict[str, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Describe:
    """Load ``target`` and report its :class:`~fgrpo.rewards.binding.Binding` (or why it cannot be loaded)."""

    target: str
    key: str

    def run(self) -> Binding | str:
        return run_task(self)


_loaded: dict[str, tuple[Callable, Binding]] = {}


def load(target: str, key: str) -> tuple[Callable, Binding]:
    """The function at ``target`` and its binding, imported once per process.

    Raises:
        ConfigError: it cannot be imported, found or bound.
    """
    if target not in _loaded:
        fn = load_function(target, key)
        try:
            binding = bind(fn)
        except ValueError as error:
            raise ConfigError(f"{key}={target!r}: {error}") from error
        _loaded[target] = fn, binding
    return _loaded[target]


def warm_up(targets: tuple[tuple[str, str], ...]) -> None:
    """Import every ``(target, key)`` now (a worker's start), so that no call's time goes to an import; marks this
    process a worker (:func:`in_worker`)."""
    in_worker()
    for target, key in targets:
        try:
            load(target, key)
        except ConfigError:
            pass  # reported by the Describe request that follows, with the message


def run_task(request: Call | Describe) -> CallResult | Binding | str:
    """What a worker of the reward pool runs: a :class:`Call`'s :class:`CallResult`, or a :class:`Describe`'s binding
    (or the message saying why the function cannot be loaded). Never raises for the function's faults: a raise here
    would fail the whole batch in the pool."""
    if isinstance(request, Describe):
        try:
            return load(request.target, request.key)[1]
        except ConfigError as error:
            return str(error)
    log = _CallLog(len(request.views), request.batch or len(request.views) > 1)
    try:
        fn, binding = load(request.target, request.key)
        seed_call(request.seed)
        per_call = {**request.kwargs, **log.names(binding, request.state)}
        if request.batch:
            outcomes = _batch_call(fn, binding, request, per_call)
        elif len(request.views) > 1:
            outcomes = _concurrent_calls(fn, binding, request, per_call)
        else:
            outcomes = [_one_call(fn, arguments(binding, request.views[0], per_call), request)]
    except ConfigError as error:
        outcomes = [Failed("raised", str(error))] * len(request.views)
    except Exception:  # noqa: BLE001 - reading what the function returned failed (a value beyond float's range)
        outcomes = [Failed("value", user_traceback())] * len(request.views)
    return CallResult(log.with_extras(outcomes), log.metrics)


class _CallLog:
    """TRL's ``log_metric(name, value)`` and ``log_extra(column, values)`` for one call: the metrics kept by name, a
    number per sample of ``log_extra`` added to the sample's extras (``train/reward/<name>/<column>``, as a dict's)."""

    def __init__(self, samples: int, many: bool):
        self.samples, self.many = samples, many
        self.metrics: dict[str, list[float]] = {}
        self.extras: dict[str, list] = {}

    def names(self, binding: Binding, state: TrainerState | None) -> dict[str, Any]:
        made = {"trainer_state": state or TrainerState(), "log_metric": self.log_metric, "log_extra": self.log_extra}
        return {name: value for name, value in made.items() if binding.wants(name)}

    def log_metric(self, name: str, value: float) -> None:
        number = _number(value)
        if number is not None and math.isfinite(number):
            self.metrics.setdefault(str(name), []).append(number)

    def log_extra(self, column: str, values: Any) -> None:
        items = list(values) if isinstance(values, (list, tuple)) else [values]
        if len(items) == self.samples:
            self.extras[str(column)] = items

    def with_extras(self, outcomes: list[Outcome]) -> list[Outcome]:
        if not self.extras:
            return outcomes
        kept = []
        for index, outcome in enumerate(outcomes):
            if isinstance(outcome, Scored):
                numbers_here = {column: _number(items[index]) for column, items in self.extras.items()}
                extras = {c: n for c, n in numbers_here.items() if n is not None and math.isfinite(n)}
                outcome = Scored(outcome.score, {**outcome.extras, **extras}, outcome.correct)
            kept.append(outcome)
        return kept


def _invoke(fn: Callable, kwargs: dict, request: Call) -> Any:
    """``fn(**kwargs)``, awaited when it is a coroutine, bounded by the call's time limit."""
    return call_bounded(fn, kwargs, None if request.bounds_itself else request.time_limit_s)


def _timeout(request: Call, samples: int = 1) -> Failed:
    each = f" ({samples} samples at dataset.reward_timeout_s each)" if samples > 1 else " (dataset.reward_timeout_s)"
    return Failed("timeout", f"still running after its {request.time_limit_s:g} s time limit{each}")


def _one_call(fn: Callable, kwargs: dict, request: Call) -> Outcome:
    try:
        return outcome_of(_invoke(fn, kwargs, request))
    except TimeLimitExceeded:
        return _timeout(request)
    except user_faults():  # the user's function raised: the sample scores 0, counted
        return _raised()


def _concurrent_calls(fn: Callable, binding: Binding, request: Call, per_call: dict) -> list[Outcome]:
    """A per-sample ``async`` function on each of several samples, concurrently on this process's loop: each within
    the per-sample limit (``asyncio.wait_for``), all within their sum (an alarm, for a coroutine that blocks)."""
    each_s = request.time_limit_s / len(request.views)

    async def one(view):
        try:
            return outcome_of(await asyncio.wait_for(fn(**arguments(binding, view, per_call)), each_s))
        except TimeLimitExceeded:
            return Failed("timeout", f"blocked past the {request.time_limit_s:g} s limit of its {len(request.views)} "
                                     "samples (an async function that blocks the event loop)")
        except asyncio.TimeoutError:
            return Failed("timeout", f"still running after its {each_s:g} s time limit (dataset.reward_timeout_s)")
        except BaseException:  # noqa: BLE001 - in a worker: every exception is the function's
            return _raised()

    async def every():
        return await asyncio.gather(*(one(view) for view in request.views))

    try:
        return run_with_time_limit(lambda: await_result(every()), request.time_limit_s + 1.0)
    except TimeLimitExceeded:
        return [_timeout(request, len(request.views))] * len(request.views)


def _raised() -> Failed:
    """The exception being handled as the call's failure (a capped worker past its memory ends here instead)."""
    return Failed("raised", raised_text())


def _batch_call(fn: Callable, binding: Binding, request: Call, per_call: dict) -> list[Outcome]:
    count = len(request.views)
    kwargs = batch_arguments(binding, list(request.views), conversational=request.conversational,
                             system_prompt=request.system_prompt, per_call=per_call)
    try:
        values = _invoke(fn, kwargs, request)
    except TimeLimitExceeded:
        return [_timeout(request, count)] * count
    except user_faults():
        return [_raised()] * count
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        return [Failed("value", f"a batch function (it takes completions or prompts) must return a list of "
                                f"{count} values, got {_shown(values)}")] * count
    if len(values) != count:
        return [Failed("value", f"returned a list of {len(values)} values for {count} samples")] * count
    return [outcome_of(value) for value in values]


def outcome_of(value: Any) -> Outcome:
    """What a returned value means: a number (bool and numpy/torch scalars too), a dict with ``score`` (finite) and any
    other numbers, ``correct`` a bool or 0/1; None skips; anything else, NaN or infinity is a :class:`Failed`."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return _dict_outcome(value)
    number = _number(value)
    if number is None:
        return Failed("value", f"returned {_shown(value)}: return a number, a dict with 'score', or None")
    if not math.isfinite(number):
        return Failed("value", f"returned {number}: a reward must be finite")
    return Scored(number)


def _dict_outcome(value: Mapping) -> Outcome:
    if "score" not in value:
        return Failed("value", f"returned a dict without 'score' (keys {sorted(map(str, value))[:10]}): a dict must "
                               "hold the reward under 'score'")
    score = _number(value["score"])
    if score is None or not math.isfinite(score):
        return Failed("value", f"returned score {_shown(value['score'])}: it must be a finite number")
    correct = value.get("correct")
    if correct is not None:
        verdict = _number(correct)
        if verdict not in (0.0, 1.0):
            return Failed("value", f"returned correct={_shown(correct)}: a verdict is True/False or 1/0, never a "
                                   "fraction")
        correct = verdict == 1.0
    extras = {}
    for name, item in value.items():
        number = None if name in ("score", "correct") else _number(item)
        if number is not None and math.isfinite(number):
            extras[str(name)] = number
    return Scored(score, extras, correct)


def _number(value: Any) -> float | None:
    """``value`` as a float if it is a real number (bool, int, float, numpy or torch scalars), else None."""
    if isinstance(value, (str, bytes)):
        return None
    if not isinstance(value, numbers.Real) and not (hasattr(value, "__float__") and getattr(value, "ndim", 0) == 0):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
    except OverflowError:  # an int beyond float's range: not a usable reward
        return math.inf


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"
