"""The worker's side of the environments: :class:`HostEpisodes` is one long-lived task of the user-code pool that holds
its episodes' instances and serves the trainer's calls on them over a pipe, each call within its time limit.

The trainer sends a list of :data:`Op` per turn round, the host answers a list of :class:`Reply` in their order. A
call that raises (any exception, ``sys.exit`` too), runs past its limit or returns what its shape does not allow gives a
``failed`` reply and its instance is dropped: that episode ends. A tool called with arguments its signature does not
take, or an unknown tool, is no fault of the class: the reply is the error text the model is shown (TRL's rule).
Nothing here imports torch.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from fgrpo.environments.spec import load_class, tool_methods
from fgrpo.rewards.calls import Failed, outcome_of
from fgrpo.user_code.running import call_bounded, in_worker, raised_text, seed_call, user_faults
from fgrpo.user_code.time_limit import TimeLimitExceeded

__all__ = ["HostEpisodes", "Reply", "Op", "serve", "step_result", "reward_value"]

Op = tuple  # (kind, episode, payload): ("reset", e, (row, seed)), ("step", e, text), ("tool", e, (name, args)),
#             ("reward", e, None), ("close", e, None)


@dataclass(frozen=True)
class Reply:
    """One call's answer: ``ok`` with its value, ``failed`` (``kind``: raised | timeout | value, the episode ends), or
    ``tool_error`` (the text shown to the model: an unknown tool, arguments that do not fit)."""

    status: str
    value: Any = None
    kind: str = ""
    message: str = ""


@dataclass(frozen=True)
class HostEpisodes:
    """Serve the episodes of ``target`` (a class: fgrpo.environments.spec) over ``conn`` until told to stop."""

    target: str
    conn: Connection
    timeout_s: float
    kwargs: tuple[tuple[str, Any], ...] = ()

    def run(self) -> str:
        return serve(self.conn, self.target, dict(self.kwargs), self.timeout_s)


def serve(conn: Connection, target: str, kwargs: dict, timeout_s: float) -> str:
    """The host's loop: a list of ops in, a list of replies out; None or a closed pipe ends it."""
    in_worker()
    host = _Host(target, kwargs, timeout_s)
    while True:
        try:
            ops = conn.recv()
        except (EOFError, OSError):
            return "the trainer closed the pipe"
        if ops is None:
            return "done"
        conn.send([host.do(op) for op in ops])


class _Host:
    def __init__(self, target: str, kwargs: dict, timeout_s: float):
        self.target, self.kwargs, self.timeout_s = target, kwargs, timeout_s
        self.instances: dict[int, Any] = {}
        self.seeds: dict[int, tuple[int, int]] = {}  # episode -> (its seed, calls so far)

    def do(self, op: Op) -> Reply:
        kind, episode, payload = op
        if kind == "close":
            self.instances.pop(episode, None)
            return Reply("ok")
        if kind == "reset":
            row, seed = payload
            self.seeds[episode] = (seed, 0)
        elif episode not in self.instances:
            return Reply("failed", kind="raised", message="the episode's instance is gone (an earlier call failed)")
        seed, calls = self.seeds.get(episode, (0, 0))
        self.seeds[episode] = (seed, calls + 1)
        seed_call(seed * 1_000_003 + calls)  # the same draws on a rerun, whatever the other episodes did meanwhile
        try:
            reply = getattr(self, "_" + kind)(episode, payload)
        except TimeLimitExceeded:
            reply = Reply("failed", kind="timeout", message=f"{kind} still running after its {self.timeout_s:g} s time "
                                                            "limit (dataset.environment_timeout_s)")
        except user_faults():
            reply = Reply("failed", kind="raised", message=raised_text())
        if reply.status == "failed":
            self.instances.pop(episode, None)
        return reply

    def _call(self, fn, kwargs: dict) -> Any:
        return call_bounded(fn, kwargs, self.timeout_s)

    def _reset(self, episode: int, payload) -> Reply:
        row, _ = payload
        instance = self._call(load_class(self.target), self.kwargs)
        self.instances[episode] = instance
        text = self._call(instance.reset, row)
        if text is not None and not isinstance(text, str):
            return Reply("failed", kind="value", message=f"reset returned {type(text).__name__} {text!r:.60}: "
                                                         "return the text to show the model, or None")
        return Reply("ok", text)

    def _step(self, episode: int, text: str) -> Reply:
        value = self._call(functools.partial(self.instances[episode].step, text), {})  # positional: any name
        result = step_result(value)
        if isinstance(result, str):
            return Reply("failed", kind="value", message=result)
        return Reply("ok", result)

    def _tool(self, episode: int, payload) -> Reply:
        name, arguments = payload
        instance = self.instances[episode]
        if name not in tool_methods(type(instance)):
            return Reply("tool_error", f"unknown tool {name!r}; the tools are {tool_methods(type(instance))}")
        method = getattr(instance, name)
        if not isinstance(arguments, dict):
            return Reply("tool_error", f"the arguments of {name} must be a JSON object, got {arguments!r:.80}")
        try:
            inspect.signature(method).bind(**arguments)
        except TypeError as error:
            return Reply("tool_error", f"{name} cannot take these arguments: {error}")
        value = self._call(method, arguments)
        return Reply("ok", value if isinstance(value, str) else _as_text(value))

    def _reward(self, episode: int, payload) -> Reply:
        value = reward_value(self._call(self.instances[episode].get_reward, {}))
        if isinstance(value, str):
            return Reply("failed", kind="value", message=value)
        return Reply("ok", value)


def _as_text(value: Any) -> str:
    """A tool's result as the text the model reads: JSON where it serialises, else ``str``."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def reward_value(value: Any) -> tuple[float, bool | None, dict[str, float]] | str:
    """A reward as ``(score, correct or None, parts)``, read as a reward function's return is
    (:func:`fgrpo.rewards.calls.outcome_of`: a number, or a dict with ``score``, ``correct`` and other numbers, the
    reward's parts); a message (str) where it is neither."""
    outcome = outcome_of(value)
    if outcome is None:
        return "returned None as a reward: return a finite number or a dict with 'score'"
    if isinstance(outcome, Failed):
        return outcome.message
    return outcome.score, outcome.correct, dict(outcome.extras)


def step_result(value: Any) -> tuple[str | None, tuple[float, bool | None, dict], bool] | str:
    """``step``'s return as ``(observation, (reward, correct, parts), done)``, from a tuple ``(observation, reward, done)`` or
    a dict with those keys (a Gymnasium 5-tuple's ``terminated or truncated`` counts as done); a message where it is
    neither."""
    if isinstance(value, dict):
        missing = [key for key in ("observation", "reward", "done") if key not in value]
        if missing:
            return f"step returned a dict without {missing}: return observation, reward and done"
        observation, reward, done = value["observation"], value["reward"], value["done"]
    elif isinstance(value, tuple) and len(value) in (3, 5):
        observation, reward = value[0], value[1]
        done = value[2] if len(value) == 3 else bool(value[2]) or bool(value[3])
    else:
        return (f"step returned {type(value).__name__} {value!r:.60}: return (observation, reward, done) or a dict with "
                "those keys")
    if observation is not None and not isinstance(observation, str):
        return f"step's observation is {type(observation).__name__} {observation!r:.60}: return text or None"
    reward = reward_value(0.0 if reward is None else reward)
    if isinstance(reward, str):
        return "step " + reward
    return observation, reward, bool(done)
