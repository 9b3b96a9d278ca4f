"""How a reward function's parameters are filled: by name, so that functions written for fgrpo, verl or TRL run
unchanged (docs/tasks.md states the rule with an example of each).

One sample's *view* (:func:`sample_view`) holds every value a parameter can ask for, under each of its names:

==============================  ===========================================================================
``completion``, ``solution_str``  the completion's text (verl: ``solution_str``)
``answer``                        the row's reference answer as text (``answer_field``; None where it has none)
``ground_truth``                  the row's reference answer as it is in the row (a dict, list, number or text: verl's)
``prompt``                        the user message as sent, or the row's chat messages (``messages_field``)
``completion_ids``                the completion's token ids
``data_source``                   the row's ``data_source`` column if it has one (verl's files), else the source's name
``extra_info``                    the row's ``extra_info`` column if it has one (verl's files), else all its columns
``row``                           every column of the row as it is (a column a name above hides: ``row["answer"]``)
``timeout_s``                     the time limit of one call (``dataset.reward_timeout_s``)
*every column*                    by its own name (TRL: ``solution``); a fgrpo name above wins over a column's
==============================  ===========================================================================

Per call, not per sample (made where the call runs, :data:`CALL_NAMES`): ``trainer_state`` (TRL's: ``global_step``,
``max_steps``, ``epoch``), ``log_metric(name, value)`` and ``log_extra(column, values)`` (TRL's loggers).

A function with one of TRL's or verl's plural names (:data:`BATCH_NAMES`: ``completions``, ``prompts``,
``solution_strs``, ``ground_truths``, ``data_sources``, ``extra_infos``) is a *batch* function: it is called once per
batch with every name bound to the list of the samples' values, ``completions`` and ``prompts`` in TRL's
conversational form (a list of messages per sample) where the prompt is a chat. Any other function is called once per
sample. ``**kwargs`` receives every name no parameter took; a parameter that matches no name keeps its default, and one
without a default cannot be filled (:func:`unfilled`, checked before any model loads). An entry's own ``kwargs``
(verl's ``reward_kwargs``) are passed by name on every call.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Binding", "TrainerState", "bind", "unfilled", "sample_view", "FGRPO_NAMES", "BATCH_NAMES", "CALL_NAMES",
           "arguments", "batch_arguments", "needed", "unknown_kwargs", "EPISODE_NAMES"]

FGRPO_NAMES = ("completion", "solution_str", "answer", "ground_truth", "prompt", "completion_ids", "data_source",
               "extra_info", "row", "timeout_s")
# an episode's (fgrpo.rollout.episodes): the conversation (chat messages) and the environment's reward
EPISODE_NAMES = ("messages", "env_reward")
CALL_NAMES = ("trainer_state", "log_metric", "log_extra")  # one value per call, made in the worker
# TRL's and verl's plural names: a function taking one is called once per batch, each the list of a per-sample name
BATCH_NAMES = {"completions": "completion", "prompts": "prompt", "solution_strs": "solution_str",
               "ground_truths": "ground_truth", "data_sources": "data_source", "extra_infos": "extra_info"}
_ROW_WINS = ("data_source", "extra_info")  # verl's files carry these as columns: the row's own value is passed


@dataclass(frozen=True)
class TrainerState:
    """What TRL's ``trainer_state`` holds that a reward reads (a curriculum): the step being scored (0: the evaluation
    before training), the run's last step, and the epochs of training problems seen (fractional, as TRL's)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass(frozen=True)
class Binding:
    """What a function's signature asks for: the names its parameters take (in order), which of them have defaults,
    whether it takes ``**kwargs``, whether it is a batch function and whether it is a coroutine function."""

    params: tuple[str, ...]
    with_defaults: frozenset[str]
    takes_kwargs: bool
    batch: bool
    positional_only: tuple[str, ...] = ()  # without defaults: no name can fill them
    is_async: bool = False

    def describe(self) -> str:
        kind = ("async " if self.is_async else "") + ("batch" if self.batch else "per-sample")
        return f"{kind}({', '.join(self.params)}{', **kwargs' if self.takes_kwargs else ''})"

    def wants(self, name: str) -> bool:
        """Whether a call passes ``name`` (a parameter of that name, or ``**kwargs``)."""
        return self.takes_kwargs or name in self.params


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
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    return Binding(tuple(params), frozenset(with_defaults), takes_kwargs, batch, tuple(positional_only), is_async)


def unfilled(binding: Binding, columns: set[str], kwargs: Mapping[str, Any] | None = None) -> list[str]:
    """The parameters without a default that no name fills, given the columns every row has and the entry's own
    ``kwargs`` (empty: all filled)."""
    available = set(FGRPO_NAMES) | set(CALL_NAMES) | set(columns) | set(kwargs or ())
    available |= set(BATCH_NAMES) if binding.batch else set()
    missing = [f"{name} (positional-only)" for name in binding.positional_only]
    return missing + [name for name in binding.params if name not in available and name not in binding.with_defaults]


def unknown_kwargs(binding: Binding, kwargs: Mapping[str, Any] | None) -> list[str]:
    """The entry's ``kwargs`` that the function takes under no parameter (and it has no ``**kwargs``)."""
    return [] if binding.takes_kwargs else [name for name in (kwargs or {}) if name not in binding.params]


def sample_view(*, completion: str, completion_ids: list[int], prompt: Any, answer: str | None, source: str,
                fields: Mapping[str, Any], timeout_s: float, reference: Any = None,
                episode: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every name one sample's parameters may take (the table of the module's docstring). ``reference``: the reference
    answer as it is in the row (``ground_truth``); default ``answer``. ``episode``: an episode's own names
    (:data:`EPISODE_NAMES`)."""
    view = dict(fields)
    view.update(completion=completion, solution_str=completion, answer=answer,
                ground_truth=answer if reference is None else reference, prompt=prompt,
                completion_ids=list(completion_ids), timeout_s=timeout_s, data_source=source, extra_info=dict(fields),
                row=dict(fields))
    view.update({name: fields[name] for name in _ROW_WINS if name in fields})
    view.update(episode or {})
    return view


def needed(binding: Binding, view: Mapping[str, Any]) -> dict[str, Any]:
    """The part of ``view`` a call of this function reads (all of it for ``**kwargs``): what goes to its worker."""
    if binding.takes_kwargs:
        return dict(view)
    names = {BATCH_NAMES.get(name, name) for name in binding.params}
    return {name: view[name] for name in names if name in view}


def arguments(binding: Binding, view: Mapping[str, Any], per_call: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The keyword arguments of one call: each parameter's value by name, and the rest to ``**kwargs``. ``per_call``:
    the call's own values (:data:`CALL_NAMES`, an entry's ``kwargs``), which win over the view's."""
    values = {**view, **(per_call or {})}
    chosen = {name: values[name] for name in binding.params if name in values}
    if binding.takes_kwargs:
        chosen.update({name: value for name, value in values.items() if name not in chosen})
    return chosen


def batch_arguments(binding: Binding, views: list[Mapping[str, Any]], *, conversational: bool,
                    system_prompt: str | None = None, per_call: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The keyword arguments of one batch call: each name bound to its list over the samples, under its plural name
    too; ``completions`` and ``prompts`` in TRL's conversational form where ``conversational`` (the prompt as the chat
    template saw it: the system prompt, if any, then the user message; a row's own chat messages as they are). Only
    the names the views hold are made: a function taking ``completions`` alone gets no prompts."""
    names = set().union(*(view.keys() for view in views)) if views else set()
    lists = {name: [view.get(name) for view in views] for name in names}
    lists.update({plural: lists[singular] for plural, singular in BATCH_NAMES.items() if singular in lists})
    if conversational and "completion" in names:
        lists["completions"] = [[{"role": "assistant", "content": view["completion"]}] for view in views]
    if conversational and "prompt" in names:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        lists["prompts"] = [view["prompt"] if isinstance(view["prompt"], list)
                            else system + [{"role": "user", "content": view["prompt"]}] for view in views]
    return arguments(binding, lists, per_call)
