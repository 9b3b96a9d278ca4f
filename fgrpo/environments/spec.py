"""What a user's environment class is, read in a worker before any model loads (:class:`DescribeEnvironment`): its
shape, what its ``reset`` takes, its tools' schemas. Two shapes run unchanged:

- ``tools``: TRL 1.16's ``environment_factory`` class. ``reset(**row) -> str | None`` (the text is appended to the
  prompt's last user message), public methods with type hints and a docstring (Google style: ``Args:``) that the model
  calls as tools, an optional ``get_reward() -> float`` called once per finished episode.
- ``game``: a text game. ``reset(**row) -> str | None`` and ``step(text) -> (observation, reward, done)`` (a tuple, or
  a dict with those keys; the reward a number, or a dict with ``score``/``correct`` as reward functions return).

Either is built with no arguments (``dataset.environment_kwargs`` are passed to the constructor by name), one instance
per episode, in a worker (fgrpo.environments.host). Nothing here imports torch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from fgrpo.infra.errors import ConfigError
from fgrpo.user_code.loading import load_function

__all__ = ["EnvSpec", "DescribeEnvironment", "describe", "load_class", "tool_methods", "SHAPES", "warm_up_environment"]

SHAPES = ("tools", "game")
_NOT_TOOLS = frozenset({"reset", "step", "get_reward", "close"})
KEY = "dataset.environment"


@dataclass(frozen=True)
class EnvSpec:
    """A class's shape and signature, small enough to send back from the worker that read it."""

    target: str
    shape: str  # one of SHAPES
    reset_params: tuple[str, ...]  # the names reset takes (bound from the row's columns)
    reset_required: tuple[str, ...]  # those without a default
    reset_any: bool  # reset takes **kwargs: every column
    tools: tuple[dict, ...] = ()  # the tools' JSON schemas ({"type": "function", "function": {...}})
    has_get_reward: bool = False

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(tool["function"]["name"] for tool in self.tools)

    def check_columns(self, columns: set[str]) -> None:
        """Every parameter ``reset`` needs is a column of every row, else ConfigError naming both."""
        missing = [name for name in self.reset_required if name not in columns]
        if missing:
            raise ConfigError(f"{KEY}={self.target!r}: reset takes {missing}, which the rows do not have (their "
                              f"columns: {sorted(columns)}); give those parameters defaults, or add the columns")


@dataclass(frozen=True)
class DescribeEnvironment:
    """Load the class at ``target`` in a worker and report its :class:`EnvSpec`, or the message saying why not."""

    target: str
    kwargs: tuple[tuple[str, object], ...] = ()

    def run(self) -> EnvSpec | str:
        try:
            return describe(self.target, dict(self.kwargs))
        except ConfigError as error:
            return str(error)


_classes: dict[str, type] = {}


def warm_up_environment(target: str) -> None:
    """A worker's start: import the class now, so that no call's time goes to the import."""
    try:
        load_class(target)
    except ConfigError:
        pass  # reported by the DescribeEnvironment request that follows


def load_class(target: str) -> type:
    """The class at ``target``, imported once per process (ConfigError if it is not a class)."""
    if target not in _classes:
        cls = load_function(target, KEY)
        if not inspect.isclass(cls):
            raise ConfigError(f"{KEY}={target!r} is a {type(cls).__name__}, not a class: name the environment's class "
                              "(TRL's environment_factory class, or a text game with reset and step)")
        _classes[target] = cls
    return _classes[target]


def tool_methods(cls: type) -> list[str]:
    """The public methods the model may call (TRL's rule): every public method but reset, step, get_reward, close."""
    return [name for name, member in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_") and name not in _NOT_TOOLS]


def describe(target: str, kwargs: dict | None = None) -> EnvSpec:
    """``target``'s :class:`EnvSpec`, or ConfigError naming ``dataset.environment`` and the fix: a class that is
    neither shape, ``step`` that does not take one text, tools without type hints or docstrings, a constructor that
    ``kwargs`` do not fit."""
    cls = load_class(target)
    if not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"{KEY}={target!r}: {cls.__name__} has no reset method; an environment is TRL's "
                          "environment_factory class (reset, tool methods, optional get_reward) or a text game "
                          "(reset and step(text) -> observation, reward, done)")
    _check_constructor(cls, target, kwargs or {})
    params, required, any_column = _reset_parameters(cls, target)
    if callable(getattr(cls, "step", None)):
        _check_step(cls, target)
        return EnvSpec(target, "game", params, required, any_column)
    names = tool_methods(cls)
    if not names:
        raise ConfigError(f"{KEY}={target!r}: {cls.__name__} has reset but neither step(text) (a text game) nor a "
                          "public tool method (TRL's environment_factory shape); add one of them")
    schemas = tuple(_schema(cls, name, target) for name in names)
    return EnvSpec(target, "tools", params, required, any_column, schemas, callable(getattr(cls, "get_reward", None)))


def _check_constructor(cls: type, target: str, kwargs: dict) -> None:
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as error:
        raise ConfigError(f"{KEY}={target!r}: {cls.__name__}({', '.join(kwargs)}) cannot be built ({error}): "
                          "an environment is built with no arguments, or with dataset.environment_kwargs by "
                          "name") from None
    except ValueError:  # no signature to read (a builtin): tried when built
        pass


def _reset_parameters(cls: type, target: str) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    signature = inspect.signature(cls.reset)
    params = [p for p in signature.parameters.values() if p.name != "self"]
    positional = [p.name for p in params if p.kind is p.VAR_POSITIONAL]
    if positional:
        raise ConfigError(f"{KEY}={target!r}: reset(*{positional[0]}) cannot be filled: the row's columns are passed "
                          "by name; take them as named parameters or **kwargs")
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return (tuple(p.name for p in named), tuple(p.name for p in named if p.default is p.empty),
            any(p.kind is p.VAR_KEYWORD for p in params))


def _check_step(cls: type, target: str) -> None:
    params = [p for p in inspect.signature(cls.step).parameters.values() if p.name != "self"]
    takes_one = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not takes_one or len(required) > 1:
        raise ConfigError(f"{KEY}={target!r}: step must take one argument, the model's text "
                          f"(step(self, text) -> observation, reward, done); it takes {[p.name for p in params]}")


def _schema(cls: type, name: str, target: str) -> dict:
    """A tool's JSON schema from its type hints and docstring (transformers' reader, as TRL uses)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(getattr(cls, name))
    except Exception as error:  # noqa: BLE001 - transformers' parsing exceptions: no hint, no docstring, bad Args
        reason = str(error).replace(" for function", " for")
        raise ConfigError(f"{KEY}={target!r}: tool method {cls.__name__}.{name} cannot be described to the model "
                          f"({reason}). A tool needs a type hint on every parameter and a docstring with an Args: "
                          "section (Google style), as TRL requires; make it private (_name) if it is not a "
                          "tool") from None
