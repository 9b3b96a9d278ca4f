"""Problems to train and evaluate on: generated arithmetic, a user's generator (by import path), local files, or
Hugging Face hub datasets.

The runner calls :func:`load_problems` before any model loads, so a wrong path, a missing field or
an unreachable hub fails in seconds with a message that says what to change. ``datasets`` is
imported inside the loaders only, so ``import fgrpo.rollout.data`` stays cheap. How a row becomes a problem (fields,
dotted paths, prompt templates, chat messages): :mod:`fgrpo.rollout.rows`.
"""

from __future__ import annotations

import contextlib
import numbers
import operator
import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from fgrpo.infra.errors import ConfigError, DataError
from fgrpo.infra.hub import HUB_PROBE_TIMEOUT_S, datasets_offline, hub_reachable, offline_env_var
from fgrpo.rollout.files import FILE_FORMATS, load_file
from fgrpo.rollout.rows import (MISSING, answer_text, chat_messages, field_value, question_text, render_template,
                                template_fields)

__all__ = [
    "DataError",
    "Problem",
    "ARITHMETIC_OPS",
    "LOADER_KINDS",
    "FILE_FORMATS",
    "arithmetic_problems",
    "load_problems",
    "rows_to_problems",
    "generated_problems",
    "RowFormat",
    "build_prompt",
    "templated",
    "with_prompts",
]


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer (if any) and its row's columns."""

    id: str  # stable across runs: "arithmetic/3+4" or "<source name>/<row index from 0>"
    question: str  # the question (or the rendered prompt template; a chat's last user message)
    answer: str | None  # reference answer as text, as the reward functions read it; None where the row has none
    source: str  # dataset name, to group eval metrics
    # the user message as sent (the question and model.instruction, the rendered template) or the row's chat
    # messages; None: not yet settled (with_prompts adds model.instruction to the question)
    prompt: str | tuple[dict[str, str], ...] | None = None
    fields: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)  # every column of the row
    reference: Any = field(default=None, compare=False, repr=False)  # the answer as the row holds it (ground_truth)


@dataclass(frozen=True)
class RowFormat:
    """How a source's rows become problems: the question's and the answer's fields (names or dotted paths), a column
    of chat messages or a prompt template (then the question is not needed), and whether every row needs an
    answer (the reward functions take one)."""

    question_field: str = "question"
    answer_field: str = "answer"
    messages_field: str | None = None
    prompt_template: str | None = None
    instruction: str = ""  # model.instruction: after the question; in a template where it says {instruction}
    require_answer: bool | str = True  # True (or "text"): usable as text; "value": any value (verl's ground_truth)
    generated: bool = False  # rows of a user's generator (errors say what its rows must hold)


ARITHMETIC_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
LOADER_KINDS = ("file", "hub")
# dataset.kind: arithmetic, a generator or reasoning-gym's tasks (fgrpo.tasks.reasoning_gym) in-process; files / hub
DATASET_KINDS = ("arithmetic", "sources", "generator", "reasoning_gym")

_LOCAL_FILE_HINT = "dataset=local dataset.train.path=/path/to/train.jsonl"


def _check_int(name: str, value, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DataError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise DataError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


# --- generated arithmetic --------------------------------------------------------------------


def arithmetic_problems(
    *, ops=("+", "*"), max_operand: int = 9, seed: int = 0, n_eval: int = 40
) -> tuple[list[Problem], list[Problem]]:
    """Every ``a op b`` for ``a, b`` in ``0..max_operand``, shuffled with ``seed``, split (train, eval).

    A small, fully known task for smoke runs: 200 problems for the defaults, ``n_eval`` held out.
    Questions read ``"What is 3 * 4?"`` (ASCII operators as given); answers are exact integers
    as text (``"-1"`` for ``"0 - 1"``). Ids are ``"arithmetic/3*4"``. The same arguments always
    give the same split.
    """
    ops = tuple(ops)
    if not ops:
        raise DataError(f"ops is empty; pass some of {list(ARITHMETIC_OPS)}, e.g. ops=('+', '*')")
    unknown = [op for op in ops if op not in ARITHMETIC_OPS]
    if unknown:
        raise DataError(f"unknown arithmetic ops {unknown} in ops={list(ops)}; choose from {list(ARITHMETIC_OPS)}")
    if len(set(ops)) != len(ops):
        raise DataError(f"ops={list(ops)} repeats an op, which would repeat problems; list each op once")
    max_operand = _check_int("max_operand", max_operand, minimum=0)
    seed = _check_int("seed", seed)
    n_eval = _check_int("n_eval", n_eval, minimum=1)

    operands = range(max_operand + 1)
    problems = [
        Problem(
            id=f"arithmetic/{a}{op}{b}",
            question=f"What is {a} {op} {b}?",
            answer=str(ARITHMETIC_OPS[op](a, b)),
            source="arithmetic",
            fields={"question": f"What is {a} {op} {b}?", "answer": str(ARITHMETIC_OPS[op](a, b)), "a": a, "op": op,
                    "b": b},
        )
        for op in ops
        for a in operands
        for b in operands
    ]
    if n_eval >= len(problems):
        raise DataError(
            f"n_eval={n_eval} leaves no training problems: ops {list(ops)} with operands 0..{max_operand} "
            f"give {len(problems)} problems; use n_eval < {len(problems)} or a larger max_operand"
        )
    random.Random(seed).shuffle(problems)
    return problems[n_eval:], problems[:n_eval]


# --- a user's generator ----------------------------------------------------------------------


def generated_problems(spec: str, args: Mapping[str, Any], *, name: str, n_eval: int, fmt: RowFormat,
                       timeout_s: float = 300.0, import_timeout_s: float = 120.0) -> tuple[list[Problem], list[Problem]]:
    """The rows of a user's generator (``dataset.generator``: ``"file.py:function"``, called in a worker process with
    ``dataset.generator_args`` bound by parameter name, within ``timeout_s``: :mod:`fgrpo.rollout.generate`), split
    (train, eval): the first ``n_eval`` rows (``dataset.generator_n_eval``) are held out.
    Ids are ``<name>/train/<i>`` and ``<name>/<i>``; both splits have source ``name``.

    Raises:
        ConfigError: the function cannot be loaded, or its parameters and ``args`` do not match.
        DataError: it raised, exited, hung, returned no list of dicts, or too few rows for ``n_eval``.
    """
    from fgrpo.rollout.generate import generate_rows

    rows = generate_rows(spec, args or {}, timeout_s=timeout_s, import_timeout_s=import_timeout_s)
    n_eval = _check_int("dataset.generator_n_eval", n_eval, minimum=1)
    if len(rows) <= n_eval:
        raise DataError(f"dataset.generator={spec!r} made {len(rows)} rows, which leaves none for training after "
                        f"dataset.generator_n_eval={n_eval} held out: make more rows or lower dataset.generator_n_eval")
    where, fmt = f"generator {spec}", replace(fmt, generated=True)
    held_out = rows_to_problems(rows[:n_eval], where=where, name=name, fmt=fmt)
    train = rows_to_problems(rows[n_eval:], where=where, name=name, fmt=fmt, id_prefix=f"{name}/train",
                             rows_before=n_eval)
    return train, held_out


# --- files and hub datasets ------------------------------------------------------------------


def _row_error(row: Mapping[str, Any], where: str, place: str, field_name: str, value, role: str,
               generated: bool = False) -> DataError:
    """The error for a row whose question or answer cannot be used, listing what the row has."""
    present = [key for key, item in row.items() if item is not None and item != ""]
    got = "missing or null" if value is MISSING or value is None else f"got {value!r:.80}"
    if generated:
        fix = (f"a generator's row holds the {role} under '{field_name}'" + (
            " (or set dataset.prompt_template or dataset.messages_field)" if role == "question" else
            " where a reward function takes answer or ground_truth"))
    else:
        fix = (f"if the {role} is under another name or nested, pass {role}_field=<name or dotted.path> (in a config: "
               f"dataset.train.{role}_field=<name> or dataset.eval.<i>.{role}_field=<name>)")
    return DataError(f"{where}: {place} has no usable {role} field '{field_name}' ({got}); "
                     f"the row has fields {present}. {fix[0].upper()}{fix[1:]}")


def rows_to_problems(rows: list[Mapping[str, Any]], *, where: str, name: str, fmt: RowFormat,
                     id_prefix: str | None = None, rows_before: int = 0,
                     places: list[str] | None = None) -> list[Problem]:
    """One :class:`Problem` per row (id ``<id_prefix or name>/<row index from 0>``), every row checked; its prompt
    the row's chat messages or the rendered template where ``fmt`` names them (else None: :func:`with_prompts` asks the
    question with ``model.instruction``). ``places``: each row's place in its file for messages ("line 3"); default
    "row N (counting from 1)", ``rows_before`` rows of the same source before these."""
    if not rows:
        raise DataError(f"{where} has no rows")
    if fmt.prompt_template is not None:
        template_fields(fmt.prompt_template)
    problems = []
    for index, row in enumerate(rows):
        place = places[index] if places else f"row {rows_before + index + 1} (counting from 1)"
        if not isinstance(row, Mapping):
            raise DataError(f"{where}: {place} is a {type(row).__name__}, not a dict of columns")
        if fmt.messages_field is not None:
            prompt = chat_messages(field_value(row, fmt.messages_field), field=fmt.messages_field, where=where,
                                   place=place)
            question = next((m["content"] for m in reversed(prompt) if m["role"] == "user"), prompt[-1]["content"])
        elif fmt.prompt_template is not None:
            question = prompt = render_template(fmt.prompt_template, row, instruction=fmt.instruction, where=where,
                                                place=place)
        else:
            raw_question = field_value(row, fmt.question_field)
            question = question_text(raw_question)
            if question is None:
                raise _row_error(row, where, place, fmt.question_field, raw_question, "question", fmt.generated)
            prompt = None  # the question with model.instruction: with_prompts
        raw_answer = field_value(row, fmt.answer_field)
        answer = answer_text(raw_answer)
        unusable = raw_answer is MISSING or raw_answer is None if fmt.require_answer == "value" else answer is None
        if fmt.require_answer and unusable:
            raise _row_error(row, where, place, fmt.answer_field, raw_answer, "answer", fmt.generated)
        problems.append(Problem(id=f"{id_prefix or name}/{index}", question=question, answer=answer, source=name,
                                prompt=prompt, fields=dict(row), reference=None if raw_answer is MISSING else raw_answer))
    return problems


def _load_hub(dataset_id: str, subset: str | None, split: str):
    """Load a hub dataset; without a network, only from the local cache, failing fast otherwise."""
    import datasets

    offline_var = offline_env_var()
    if offline_var:
        reason = f"{offline_var}={os.environ[offline_var]} asks for offline mode"
    elif hub_reachable():
        reason = None
    else:
        endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        reason = f"no network: a {HUB_PROBE_TIMEOUT_S:g} s TCP connect to {endpoint} failed"
    offline = contextlib.nullcontext() if reason is None else datasets_offline(datasets)
    try:
        with offline:
            return datasets.load_dataset(dataset_id, subset, split=split)
    except (ConnectionError, FileNotFoundError) as error:
        if reason is None:
            raise DataError(
                f"could not load hub dataset '{dataset_id}' (subset={subset!r}, split={split!r}): "
                f"{type(error).__name__}: {error}. Check the id on https://huggingface.co/datasets "
                f"or pass a local file: {_LOCAL_FILE_HINT}"
            ) from error
        raise DataError(
            f"dataset '{dataset_id}' is not in the local Hugging Face cache "
            f"({datasets.config.HF_DATASETS_CACHE}) and the hub cannot be reached ({reason}). "
            f"Load it once on a machine with a network (same cache), or pass a local file: "
            f"{_LOCAL_FILE_HINT}"
        ) from error
    except Exception as error:  # an unknown split or subset, unreadable data: say which dataset
        raise DataError(
            f"could not load hub dataset '{dataset_id}' (subset={subset!r}, split={split!r}): "
            f"{type(error).__name__}: {error}"
        ) from error


def load_problems(
    *,
    name: str,
    kind: str,
    path: str | None = None,
    split: str = "train",
    question_field: str = "question",
    answer_field: str = "answer",
    subset: str | None = None,
    limit: int | None = None,
    messages_field: str | None = None,
    prompt_template: str | None = None,
    instruction: str = "",
    require_answer: bool | str = True,
) -> list[Problem]:
    """Load one source of problems and check every kept row, before any model loads.

    Args:
        name: the source's name: ``Problem.source`` and the prefix of ``Problem.id`` ("name/row").
        kind: ``"file"`` (a local .jsonl/.json/.parquet/.csv, one split per file) or ``"hub"``
            (a Hugging Face dataset id).
        path: the file path or the hub id.
        split: the hub split; a file is a single split, so ignored for files.
        question_field, answer_field: the columns (or dotted paths into nested ones) holding the question and the
            reference answer.
        messages_field, prompt_template, instruction, require_answer: how each row's prompt is made and whether it
            needs an answer (:class:`RowFormat`).
        subset: the hub dataset's configuration name, if it has several; ignored for files.
        limit: keep only the first ``limit`` rows (only those are checked).

    Raises:
        DataError (a ValueError): an unknown kind, a missing file, a row without a usable
            question or answer (naming the row and its fields), or a hub dataset that cannot be
            loaded (neither cached nor reachable, unknown split or subset).
    """
    if not isinstance(name, str) or not name.strip():
        raise DataError(f"name must be a non-empty string naming the dataset, got {name!r}")
    if kind not in LOADER_KINDS:
        raise DataError(f"unknown dataset kind {kind!r} for dataset '{name}'; choose one of {list(LOADER_KINDS)}")
    if limit is not None:
        limit = _check_int("limit", limit, minimum=1)
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        example = "/path/to/train.jsonl" if kind == "file" else "HuggingFaceH4/MATH-500"
        raise DataError(f"dataset '{name}' (kind={kind!r}) needs path=, got {path!r}; e.g. path={example}")
    for field_name, value in (("question_field", question_field), ("answer_field", answer_field)):
        if not isinstance(value, str) or not value:
            raise DataError(f"{field_name} must be a column name, got {value!r}")
    fmt = RowFormat(question_field, answer_field, messages_field, prompt_template, instruction, require_answer)

    places = None
    if kind == "file":
        dataset, resolved, places = load_file(str(path), limit)
        where = f"dataset file {resolved}"
    else:
        dataset = _load_hub(str(path), subset, split)
        where = f"hub dataset '{path}'" + (f" subset '{subset}'" if subset else "") + f" split '{split}'"
    if limit is not None and limit < len(dataset):
        dataset = dataset.select(range(limit))
    return rows_to_problems(dataset.to_list(), where=where, name=name, fmt=fmt, places=places)


def build_prompt(question: str, *, instruction: str) -> str:
    """The user message: the question, then the answer-format instruction (the chat template comes later)."""
    return f"{question} {instruction}".strip()


def templated(problems: list[Problem], template: str, *, instruction: str, where: str) -> list[Problem]:
    """The problems with prompts rendered from ``template`` over their fields (arithmetic's: question, answer, a, op,
    b)."""
    return [replace(p, prompt=render_template(template, p.fields, instruction=instruction, where=where,
                                              place=f"problem {p.id}")) for p in problems]


def with_prompts(problems: list[Problem], instruction: str) -> list[Problem]:
    """The problems with their prompts settled: a problem without one asks its question with ``instruction``."""
    return [p if p.prompt is not None else replace(p, prompt=build_prompt(p.question, instruction=instruction))
            for p in problems]
