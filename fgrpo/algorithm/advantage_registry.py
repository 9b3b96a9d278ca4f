"""Advantage methods declared once: :func:`advantage_method` decorates a method's function with its name, its
parameters (each a :class:`Param`: default, allowed range, the config key that sets it) and what it needs from the loop
(the whole step's verdicts; whether it takes shaped rewards). Everything else derives from the declarations: the config
schema's ``advantage`` keys (``fgrpo.config``), the range checks and the error that lists the choices
(``fgrpo.validation``), the labels of reports and the call (``method_label`` and ``compute_advantages`` in
:mod:`fgrpo.algorithm.advantage_methods`, beside fgrpo's own methods).

A user's method is the same: a decorated function in their own file, named by import path
(``advantage.name="my_adv.py:my_method"``; its parameters ``+advantage.<name>=value``), loaded by
:func:`fgrpo.validation.advantage_method_of`.

Torch-free: the report labels runs from their saved configs without importing torch, and the config schema is built
from these declarations when ``fgrpo.config`` is imported (run.py, whose import the reward workers repeat). The methods
(:mod:`fgrpo.algorithm.advantage_methods`) import torch inside their bodies. This module imports none of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["Param", "AdvantageMethod", "advantage_method", "declare", "declared", "configured", "REFERENCE",
           "GAMMA_KEY"]

REFERENCE = "focal"  # at gamma 0 the plain GRPO / DAPO / CISPO advantage: the reference of every comparison
GAMMA_KEY = "focal.gamma"  # the focal exponent lives in its own group (focal=baseline|fgrpo)


@dataclass(frozen=True)
class Param:
    """One parameter of a method: its default (an int default makes it an integer), its allowed range (``low`` and
    ``high``, each a number, or a config key whose value bounds it, e.g. ``"algo.group_size"``; open ends excluded),
    the config key that sets it (default ``advantage.<name>``) and what it means (shown in errors)."""

    default: float | int
    low: float | str | None = None
    high: float | str | None = None
    low_open: bool = False
    high_open: bool = False
    key: str | None = None
    doc: str = ""

    @property
    def integer(self) -> bool:
        return isinstance(self.default, int) and not isinstance(self.default, bool)

    def problem(self, value: Any, bound: Callable[[str], Any] = lambda key: None) -> str | None:
        """Why ``value`` is not allowed (``bound`` reads a config key that bounds it), or None."""
        whole = isinstance(value, int) and not isinstance(value, bool)
        if not (whole or (not self.integer and isinstance(value, float) and math.isfinite(value))):
            return f"must be {'an integer' if self.integer else 'a finite number'} ({self.doc})"
        low = bound(self.low) if isinstance(self.low, str) else self.low
        high = bound(self.high) if isinstance(self.high, str) else self.high
        too_low = low is not None and (value <= low if self.low_open else value < low)
        too_high = high is not None and (value >= high if self.high_open else value > high)
        if too_low or too_high:
            low_text = f"{self.low}={low}" if isinstance(self.low, str) else low
            high_text = f"{self.high}={high}" if isinstance(self.high, str) else high
            return f"must be {self._range(low_text, high_text)} ({self.doc})"
        return None

    def _range(self, low, high) -> str:
        if high is None:
            return f"{'>' if self.low_open else '>='} {low}"
        if low is None:
            return f"{'<' if self.high_open else '<='} {high}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


@dataclass(frozen=True)
class AdvantageMethod:
    """A method's declaration (what :func:`advantage_method` records)."""

    name: str
    fn: Callable
    params: Mapping[str, Param] = field(default_factory=dict)
    label: str | None = None  # the parameter its label shows: "passk k=4"
    needs_step: bool = False  # gets the whole step's verdicts, every rank's (step_correct): mean_focal
    shaped_rewards: bool = True  # False: it reads the verdicts (or rewards >= 0), so DAPO's overlong penalty is refused
    summary: str = ""

    def key(self, param: str) -> str:
        return self.params[param].key or f"advantage.{param}"


_DECLARED: dict[str, AdvantageMethod] = {}


def configured(node: Any, name: str, param: Param) -> Any:
    """The value of parameter ``name`` in the config's ``advantage`` node: the one set there, else (absent, or null:
    unset) the method's declared default."""
    value = node.get(name) if hasattr(node, "get") else None
    return param.default if value is None else value


def advantage_method(name: str | None = None, *, params: Mapping[str, Param] | None = None, label: str | None = None,
                     needs_step: bool = False, shaped_rewards: bool = True):
    """Declare ``fn`` an advantage method: ``fn(rewards, correct, settings, seq_logp=None)`` (plus ``step_correct=``
    where ``needs_step``) returning ``[P, G]`` advantages; ``settings.<param>`` holds each declared parameter."""

    def declare_fn(fn: Callable) -> Callable:
        method = AdvantageMethod(name or fn.__name__, fn, dict(params or {}), label, needs_step, shaped_rewards,
                                 (fn.__doc__ or "").strip().split("\n")[0])
        fn.advantage_method = method
        declare(method.name, method)
        return fn

    return declare_fn


def declare(name: str, method: AdvantageMethod) -> None:
    """Make ``method`` known under ``name`` (its own, or the import path a config names it by)."""
    known = _DECLARED.get(name)
    same = known is not None and _where(known.fn) == _where(method.fn)  # the same function (a module imported again)
    if known is not None and not same:
        raise ValueError(f"two advantage methods are named {name!r}: {_where(known.fn)} and {_where(method.fn)}; "
                         "rename one")
    _DECLARED[name] = method


def _where(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def declared() -> dict[str, AdvantageMethod]:
    """The methods declared so far, by name (fgrpo's own once :mod:`fgrpo.algorithm.advantage_methods` is imported:
    its ``methods()`` sees to that)."""
    return dict(_DECLARED)
