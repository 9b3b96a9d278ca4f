"""``dataset.rewards``: the reward functions of a run, each an entry ``{fn, name, weight, verdict, threshold,
kwargs}``, and the checks that need no import (names, weights, the one verdict, the form of ``fn``), run before anything loads.

``fn`` is a built-in check by name (:data:`BUILTINS`: ``numeric``, ``math``) or a user's function by import path
(``"package.module:function"``, ``"path/to/file.py:function"``). The training reward of a sample is the weighted sum of
its entries' scores; its 0/1 verdict (what the focal weight's success rate, pass@k, DAPO's dynamic sampling and the
``passk`` and ``w_reinforce`` advantages read) comes from exactly one entry: the one marked ``verdict: true``, else the
only one. An entry's verdict is its dict's ``correct`` where it returned one, else ``score >= threshold``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from fgrpo.infra.errors import ConfigError
from fgrpo.user_code.loading import function_name, is_import_path, resolve_target

__all__ = ["BUILTINS", "RewardEntry", "reward_entries", "verdict_entry"]

BUILTINS = {
    "numeric": "fgrpo.rewards.answers:verify_numeric",  # the last number (or \boxed{}) equals the answer: microseconds
    "math": "fgrpo.rewards.answers:verify_math",  # math-verify's equivalence, bounded in time: milliseconds
}
IN_PROCESS_BUILTINS = ("numeric",)  # cheaper than sending a sample to another process: always in the trainer
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class RewardEntry:
    """One checked entry of ``dataset.rewards``."""

    fn: str  # as configured: a built-in's name or an import path
    target: str  # the import path (a file's absolute)
    name: str  # unique: the metrics' train/reward/<name>
    weight: float
    verdict: bool  # this entry gives the sample's 0/1 verdict
    threshold: float  # verdict: score >= threshold, where the function returned no "correct"
    key: str  # dataset.rewards[i], for messages
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # passed by name on every call (verl's reward_kwargs)

    @property
    def builtin(self) -> bool:
        return self.fn in BUILTINS

    @property
    def in_process(self) -> bool:
        """Runs in the trainer's process: only fgrpo's own cheap check. A user's function always runs in a worker."""
        return self.fn in IN_PROCESS_BUILTINS


def reward_entries(configured: Iterable[Mapping[str, Any]], key: str = "dataset.rewards", *,
                   resolve_files: bool = True, allow_empty: bool = False) -> list[RewardEntry]:
    """The entries of ``configured`` (the config's list), checked: every ``fn`` of a known form (and, with
    ``resolve_files``, every file there), unique names, finite weights, one verdict. ``allow_empty``: none is
    allowed (a run with an environment, which rewards and judges its episodes itself).

    Raises:
        ConfigError: listing every problem, each naming its key and the fix.
    """
    configured = list(configured or [])
    problems: list[str] = []
    if not configured and allow_empty:  # an environment's episodes: its own reward and verdict
        return []
    if not configured:
        raise ConfigError(f"{key} is empty: list at least one reward function, e.g. "
                          f"'{key}=[{{fn: numeric}}]' or '{key}=[{{fn: \"my_task.py:score\"}}]'")
    entries = [entry for index, item in enumerate(configured)
               if (entry := _entry(item, f"{key}[{index}]", problems, resolve_files)) is not None]
    names = [entry.name for entry in entries]
    for name in sorted({name for name in names if names.count(name) > 1}):
        keys = [entry.key for entry in entries if entry.name == name]
        problems.append(f"{', '.join(keys)} are all named {name!r}: give each a unique name (name: ...), which its "
                        "metrics train/reward/<name> carry")
    marked = [entry for entry in entries if entry.verdict]
    if len(marked) > 1:
        problems.append(f"{', '.join(e.key for e in marked)} are all marked verdict: true: exactly one entry gives the "
                        "0/1 verdict (success rate, pass@k); mark one")
    elif not marked and len(configured) > 1:
        problems.append(f"{key} has {len(configured)} entries and none is marked verdict: true: mark the one whose "
                        "score (or 'correct') says whether a sample is right, e.g. {fn: ..., verdict: true}")
    if problems:
        raise ConfigError("invalid reward functions:\n  " + "\n  ".join(problems))
    if not marked:
        entries[0] = RewardEntry(**{**entries[0].__dict__, "verdict": True})
    return entries


def verdict_entry(entries: list[RewardEntry]) -> RewardEntry:
    return next(entry for entry in entries if entry.verdict)


def _entry(item: Mapping[str, Any], key: str, problems: list[str], resolve_files: bool) -> RewardEntry | None:
    fn = item.get("fn")
    if not isinstance(fn, str) or not fn.strip():
        problems.append(f"{key}.fn={fn!r}: name a built-in check ({', '.join(BUILTINS)}) or a function, "
                        "'package.module:function' or 'path/to/file.py:function'")
        return None
    if fn in BUILTINS:
        target = BUILTINS[fn]
    elif not is_import_path(fn):
        problems.append(f"{key}.fn={fn!r}: not a built-in check ({', '.join(BUILTINS)}); a function by import path "
                        "has a ':' ('my_task.py:score', 'my_package.rewards:score')")
        return None
    else:
        try:
            target = resolve_target(fn, f"{key}.fn") if resolve_files else fn
        except ConfigError as error:
            problems.append(str(error))
            return None
    name = item.get("name") or (fn if fn in BUILTINS else function_name(fn))
    if not _NAME.fullmatch(str(name)):
        problems.append(f"{key}.name={name!r}: use letters, digits, '_', '-' or '.' (it names metrics)")
    weight, threshold = item.get("weight", 1.0), item.get("threshold", 1.0)
    for field_name, value in (("weight", weight), ("threshold", threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{key}.{field_name}={value!r}: must be a finite number (e.g. {field_name}: 1.0)")
            return None
    kwargs = item.get("kwargs") or {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        problems.append(f"{key}.kwargs={kwargs!r}: a mapping of parameter names to values, e.g. kwargs: {{scale: 2}}")
        return None
    return RewardEntry(fn, target, str(name), float(weight), bool(item.get("verdict", False)), float(threshold), key,
                       _plain(kwargs))


def _plain(value: Any) -> Any:
    """A config's mappings and lists as plain dicts and lists (they are pickled to the workers)."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and type(value).__name__ == "ListConfig"):
        return [_plain(item) for item in value]
    return value
