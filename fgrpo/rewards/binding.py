"""How a reward function's parameters are filled: by name, so that functions written for fgrpo, verl or TRL run
unchanged (docs/tasks.md states the rule with an example of each).

One sample's *view* (:func:`sample_view`) holds every value a parameter can ask for, under each of its names:

==============================  ===========================================================================
``completion``, ``solution_str``  the completion's text (verl: ``solution_str``)
``answer``, ``ground_truth``      the row's reference answer as text (``answer_field``; None where it has none)
``prompt``                        the user message as sent, or the row's chat messages (``messages_field``)
``completion_ids``                the completion's token ids
``data_source``                   the row's ``data_source`` column if it has one (verl's files), else the source's name
``extra_info``                    the row's ``extra_info`` column if it has one (verl's files), else all its columns
``timeout_s``                     the time limit of one call (``dataset.reward_timeout_s``)
*every column*                    by its own name (TRL: ``solution``); a fgrpo name above wins over a column's
==============================  ===========================================================================

A function with a parameter ``completions`` or ``prompts`` (TRL's plural names) is a *batch* function: it is called
once per batch with every name bound to the list of the samples' values, ``completions`` and ``prompts`` in TRL's
conversational form (a list of messages per sample) where the prompt was built with a chat template. Any other
function is called once per sample. ``**kwargs`` receives every name no parameter took; a parameter that matches
no name keeps its default, and one without a default cannot be filled (:func:`unfilled`, checked before any model
loads).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Binding", "bind", "unfilled", "sample_view", "FGRPO_NAMES", "BATCH_NAMES", "arguments",
           "batch_arguments", "needed"]

FGRPO_NAMES = ("completion", "solution_str", "answer", "ground_truth", "prompt", "completion_ids", "data_source",
               "extra_info", "timeout_s")
BATCH_NAMES = ("completions", "prompts")  # TRL's: a function that takes one of these is called once per batch
_ROW_WINS = ("data_source", "extra_info")  # verl's files carry these as columns: the row's own value is passed


@dataclass(frozen=True)
class Binding:
    """What a function's signature asks for: the names its parameters take (in order), which of them have defaults,
    whether it takes ``**kwargs``, and whether it is a batch function."""

    params: tuple[str, ...]
    with_defaults: frozenset[str]
    takes_kwargs: bool
    batch: bool
    positional_only: tuple[str, ...] = ()  # without defaults: no name can fill them

    def describe(self) -> str:
        kind = "batch" if self.batch else "per-sample"
        return f"{kind}({', '.join(self.params)}{', **kwargs' if self.takes_kwargs else ''})"


def bind(fn: Callable) -> Binding:
    """The :class:`Binding` of ``fn``'s signature (``inspect.signature``: functions, partials, callable objects).

    Raises:
        ValueError: the signature cannot be read (some C functions).
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as error:
        raise ValueError(f"its signature cannot be read ({error}); wrap it in a Python function") from error
    params, with_defaults, positional_only, takes_kwargs = [], set(), [], False
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            takes_kwargs = True
        elif parameter.kind is parameter.VAR_POSITIONAL:
            continue
        elif parameter.kind is parameter.POSITIONAL_ONLY:
            if parameter.default is parameter.empty:
                positional_only.append(parameter.name)
        else:
            params.append(parameter.name)
            if parameter.default is not parameter.empty:
                with_defaults.add(parameter.name)
    batch = any(name in BATCH_NAMES for name in params)
    return Binding(tuple(params), frozenset(with_defaults), takes_kwargs, batch, tuple(positional_only))


def unfilled(binding: Binding, columns: set[str]) -> list[str]:
    """The parameters without a default that no name fills, given the columns every row has (empty: all filled)."""
    available = set(FGRPO_NAMES) | set(columns) | (set(BATCH_NAMES) if binding.batch else set())
    missing = [f"{name} (positional-only)" for name in binding.positional_only]
    return missing + [name for name in binding.params if name not in available and name not in binding.with_defaults]


def sample_view(*, completion: str, completion_ids: list[int], prompt: Any, answer: str | None, source: str,
                fields: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """Every name one sample's parameters may take (the table of the module's docstring)."""
    view = dict(fields)
    view.update(completion=completion, solution_str=completion, answer=answer, ground_truth=answer, prompt=prompt,
                completion_ids=list(completion_ids), timeout_s=timeout_s, data_source=source, extra_info=dict(fields))
    view.update({name: fields[name] for name in _ROW_WINS if name in fields})
    return view


def needed(binding: Binding, view: Mapping[str, Any]) -> dict[str, Any]:
    """The part of ``view`` a call of this function reads (all of it for ``**kwargs``): what goes to its worker."""
    if binding.takes_kwargs:
        return dict(view)
    names = set(binding.params)
    names |= {"completion"} if "completions" in names else set()
    names |= {"prompt"} if "prompts" in names else set()
    return {name: view[name] for name in names if name in view}


def arguments(binding: Binding, view: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of one per-sample call: each parameter's value by name, and the rest to ``**kwargs``."""
    chosen = {name: view[name] for name in binding.params if name in view}
    if binding.takes_kwargs:
        chosen.update({name: value for name, value in view.items() if name not in chosen})
    return chosen


def batch_arguments(binding: Binding, views: list[Mapping[str, Any]], *, conversational: bool,
                    system_prompt: str | None = None) -> dict[str, Any]:
    """The keyword arguments of one batch call: each name bound to its list over the samples; ``completions`` and
    ``prompts`` in TRL's conversational form where ``conversational`` (the prompt as the chat template saw it: the
    system prompt, if any, then the user message; a row's own chat messages as they are)."""
    names = set().union(*(view.keys() for view in views)) if views else set(FGRPO_NAMES)
    lists = {name: [view.get(name) for view in views] for name in names}
    lists["completions"], lists["prompts"] = lists.get("completion", []), lists.get("prompt", [])
    if conversational:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        lists["completions"] = [[{"role": "assistant", "content": view["completion"]}] for view in views]
        lists["prompts"] = [view["prompt"] if isinstance(view["prompt"], list)
                            else system + [{"role": "user", "content": view["prompt"]}] for view in views]
    return arguments(binding, lists)
