"""Problems to train and evaluate on: generated arithmetic, local files, or Hugging Face hub datasets.

The runner calls :func:`load_problems` before any model loads, so a wrong path, a missing field or
an unreachable hub fails in seconds with a message that says what to change. ``datasets`` is
imported inside the loaders only, so ``import fgrpo.rollout.data`` stays cheap.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
import random
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from fgrpo.infra.errors import DataError
from fgrpo.infra.hub import HUB_PROBE_TIMEOUT_S, datasets_offline, hub_reachable, offline_env_var

__all__ = [
    "DataError",
    "Problem",
    "ARITHMETIC_OPS",
    "LOADER_KINDS",
    "FILE_FORMATS",
    "arithmetic_problems",
    "load_problems",
    "build_prompt",
]



@dataclass(frozen=True)
class Problem:
    """One question with its reference answer."""

    id: str  # stable across runs: "arithmetic/3+4" or "<source name>/<row index>"
    question: str
    answer: str  # reference answer as text, as the verifier reads it
    source: str  # dataset name, to group eval metrics


ARITHMETIC_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
LOADER_KINDS = ("file", "hub")
DATASET_KINDS = ("arithmetic", "sources")  # dataset.kind: generated in-process, or loaded from files / the hub
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension -> the ``datasets`` builder that reads it."""

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


# --- files and hub datasets ------------------------------------------------------------------


def _answer_text(value) -> str | None:
    """A reference answer as text, or None when unusable (missing, empty, NaN, a mapping).

    Whole floats lose their ".0" (JSON columns mixing 3 and 2.5 load 3 as 3.0), other floats are
    written without exponent. A list of answers (OlympiadBench's ``final_answer``) becomes its
    one item, or its items joined with ", ".
    """
    if value is None:
        return None
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        return value.strip() or None
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        if not math.isfinite(value):
            return None
        if value.is_integer():
            return str(int(value))
        return format(Decimal(repr(value)), "f")
    if isinstance(value, (list, tuple)):
        items = [_answer_text(item) for item in value]
        if not items or any(item is None for item in items):
            return None
        return ", ".join(items)
    return None


def _question_text(value) -> str | None:
    if not isinstance(value, str):
        return None
    return value.strip() or None


def _row_error(dataset, where: str, row_index: int, field: str, value, role: str) -> DataError:
    """The error for a row whose question or answer cannot be used, listing what the row has."""
    row = dataset[row_index]
    present = [key for key, item in row.items() if item is not None and item != ""]
    got = "missing or null" if field not in row or row[field] is None else f"got {value!r:.80}"
    return DataError(
        f"{where}: row {row_index} (0-based) has no usable {role} field '{field}' ({got}); "
        f"the row has fields {present}. If the {role} is under another name, pass "
        f"{role}_field=<name> (in a config: dataset.train.{role}_field=<name> or dataset.eval.<i>.{role}_field=<name>)"
    )


def _rows_to_problems(
    dataset, *, where: str, name: str, question_field: str, answer_field: str, limit: int | None
) -> list[Problem]:
    """Turn the first ``limit`` rows into Problems, checking every kept row's question and answer."""
    n_rows = len(dataset) if limit is None else min(limit, len(dataset))
    if n_rows == 0:
        raise DataError(f"{where} has no rows")
    kept = dataset.select(range(n_rows)) if n_rows < len(dataset) else dataset
    columns = set(kept.column_names)
    questions = kept[question_field] if question_field in columns else [None] * n_rows
    answers = kept[answer_field] if answer_field in columns else [None] * n_rows
    problems = []
    for row_index, (raw_question, raw_answer) in enumerate(zip(questions, answers)):
        question = _question_text(raw_question)
        if question is None:
            raise _row_error(kept, where, row_index, question_field, raw_question, "question")
        answer = _answer_text(raw_answer)
        if answer is None:
            raise _row_error(kept, where, row_index, answer_field, raw_answer, "answer")
        problems.append(Problem(id=f"{name}/{row_index}", question=question, answer=answer, source=name))
    return problems


def _load_file(path: str):
    """Read a local jsonl / json / parquet / csv file with ``datasets``; returns (dataset, resolved path)."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.exists():
        raise DataError(
            f"dataset file {resolved} does not exist (path={path!r}; relative paths start at the "
            f"working directory {os.getcwd()}); fix the path, e.g. dataset.train.path=/abs/path/train.jsonl"
        )
    if not resolved.is_file():
        raise DataError(f"dataset path {resolved} is not a file; point path= at a {'/'.join(FILE_FORMATS)} file")
    builder = FILE_FORMATS.get(resolved.suffix.lower())
    if builder is None:
        raise DataError(
            f"dataset file {resolved} has extension {resolved.suffix!r}, which is not supported; "
            f"use one of {list(FILE_FORMATS)}"
        )
    import datasets

    try:
        return datasets.load_dataset(builder, data_files=str(resolved), split="train"), resolved
    except Exception as error:
        raise DataError(
            f"could not read dataset file {resolved} as {builder}: {type(error).__name__}: {error}"
        ) from error










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
) -> list[Problem]:
    """Load one source of problems and check every kept row, before any model loads.

    Args:
        name: the source's name: ``Problem.source`` and the prefix of ``Problem.id`` ("name/row").
        kind: ``"file"`` (a local .jsonl/.json/.parquet/.csv, one split per file) or ``"hub"``
            (a Hugging Face dataset id).
        path: the file path or the hub id.
        split: the hub split; a file is a single split, so ignored for files.
        question_field, answer_field: the columns holding the question and the reference answer.
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
    for field_name, field in (("question_field", question_field), ("answer_field", answer_field)):
        if not isinstance(field, str) or not field:
            raise DataError(f"{field_name} must be a column name, got {field!r}")

    if kind == "file":
        dataset, resolved = _load_file(str(path))
        where = f"dataset file {resolved}"
    else:
        dataset = _load_hub(str(path), subset, split)
        where = f"hub dataset '{path}'" + (f" subset '{subset}'" if subset else "") + f" split '{split}'"
    return _rows_to_problems(
        dataset, where=where, name=name, question_field=question_field, answer_field=answer_field, limit=limit
    )


def build_prompt(question: str, *, instruction: str) -> str:
    """The user message: the question, then the answer-format instruction (the chat template comes later)."""
    return f"{question} {instruction}".strip()
