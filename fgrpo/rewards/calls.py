"""One call of a reward function as a worker of the reward pool runs it (and the trainer, for the built-in checks):
the function loaded by its import path (once per process), its arguments bound by name (:mod:`fgrpo.rewards.binding`),
the call bounded in time, and what it returned turned into an outcome per sample:

- :class:`Scored`: a number, or a dict with ``score`` (its other numbers kept as extras, its ``correct`` as the
  verdict, if given);
- ``None``: the function skipped the sample (it returned None);
- :class:`Failed`: the call raised, ran out of time, or returned something else (a string, NaN, a list of the wrong
  length); the message says what, with the traceback where there is one.

Nothing here imports torch or fgrpo's trainer: a worker that imports this module is a fresh interpreter with the
user's module and little else. Requests and outcomes are small dataclasses, pickled between the processes; the
function itself never is: each worker imports it by its path.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fgrpo.infra.errors import ConfigError
from fgrpo.infra.user_code import load_function
from fgrpo.rewards.binding import Binding, arguments, batch_arguments, bind
from fgrpo.rewards.time_limit import TimeLimitExceeded, run_with_time_limit

__all__ = ["Scored", "Failed", "Outcome", "Call", "Describe", "run_task", "outcome_of", "load", "warm_up"]


@dataclass(frozen=True)
class Scored:
    score: float
    extras: dict[str, float] = field(default_factory=dict)
    correct: bool | None = None  # a dict's own verdict (its "correct"), where it gave one


@dataclass(frozen=True)
class Failed:
    kind: str  # raised | timeout | value | died | stuck
    message: str


Outcome = Scored | Failed | None  # None: the function returned None (the sample is skipped)


@dataclass(frozen=True)
class Call:
    """One call: of ``target`` on one view (a per-sample function) or on all ``views`` (a batch function)."""

    target: str  # the import path, a file's made absolute
    key: str  # the config key that named it, for messages
    views: tuple[Mapping[str, Any], ...]
    batch: bool
    time_limit_s: float
    bounds_itself: bool = False  # a built-in check with its own time limit (the math check): no second alarm
    conversational: bool = False  # batch: completions and prompts in TRL's chat form
    system_prompt: str | None = None


@dataclass(frozen=True)
class Describe:
    """Load ``target`` and report its :class:`~fgrpo.rewards.binding.Binding` (or why it cannot be loaded)."""

    target: str
    key: str


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
    """Import every ``(target, key)`` now (a worker's start), so that no call's time goes to an import."""
    for target, key in targets:
        try:
            load(target, key)
        except ConfigError:
            pass  # reported by the Describe request that follows, with the message


def run_task(request: Call | Describe) -> list[Outcome] | Binding | str:
    """What a worker of the reward pool runs: a :class:`Call`'s outcomes (one per view), or a :class:`Describe`'s
    binding (or the message saying why the function cannot be loaded). Never raises for the function's faults: a
    raise here would fail the whole batch in the pool."""
    if isinstance(request, Describe):
        try:
            return load(request.target, request.key)[1]
        except ConfigError as error:
            return str(error)
    try:
        fn, binding = load(request.target, request.key)
        if request.batch:
            return _batch_call(fn, binding, request)
        return [_one_call(fn, arguments(binding, request.views[0]), request)]
    except ConfigError as error:
        return [Failed("raised", str(error))] * len(request.views)
    except Exception:  # noqa: BLE001 - reading what the function returned failed (a value beyond float's range)
        return [Failed("value", user_traceback())] * len(request.views)


def _invoke(fn: Callable, kwargs: dict, request: Call) -> Any:
    """``fn(**kwargs)``, awaited when it is a coroutine, bounded by the call's time limit."""

    def call():
        result = fn(**kwargs)
        return asyncio.run(result) if inspect.isawaitable(result) else result

    return call() if request.bounds_itself else run_with_time_limit(call, request.time_limit_s)


def _one_call(fn: Callable, kwargs: dict, request: Call) -> Outcome:
    try:
        return outcome_of(_invoke(fn, kwargs, request))
    except TimeLimitExceeded:
        return Failed("timeout", f"still running after its {request.time_limit_s:g} s time limit "
                                 "(dataset.reward_timeout_s)")
    except Exception:  # noqa: BLE001 - the user's function raised: the sample scores 0, counted
        return Failed("raised", user_traceback())


def user_traceback() -> str:
    """The exception being handled, its traceback without fgrpo's own frames (the call's wrapping): the user's code."""
    error = traceback.TracebackException(*sys.exc_info())
    error.stack = traceback.StackSummary.from_list(
        [frame for frame in error.stack if not frame.filename.startswith(_FGRPO_REWARDS)])
    return "".join(error.format())


_FGRPO_REWARDS = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _batch_call(fn: Callable, binding: Binding, request: Call) -> list[Outcome]:
    count = len(request.views)
    kwargs = batch_arguments(binding, list(request.views), conversational=request.conversational,
                             system_prompt=request.system_prompt)
    try:
        values = _invoke(fn, kwargs, request)
    except TimeLimitExceeded:
        return [Failed("timeout", f"still running after its {request.time_limit_s:g} s time limit "
                                  f"({count} samples at dataset.reward_timeout_s each)")] * count
    except Exception:  # noqa: BLE001
        return [Failed("raised", user_traceback())] * count
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
