"""From a data row (a dict of a file's, the hub's or a generator's columns) to a :class:`~fgrpo.rollout.data.Problem`:
its fields by name or dotted path (``reward_model.ground_truth``, verl's layout), its prompt (the question plus
``model.instruction``, ``dataset.prompt_template`` with ``{column}`` placeholders, or a column of chat messages), its
reference answer as text, and every column kept for the reward functions. A message names a row by its place: its
line in a JSONL or CSV file, else "row N (counting from 1)"."""

from __future__ import annotations

import math
import numbers
import string
from decimal import Decimal
from typing import Any, Mapping

from fgrpo.infra.errors import ConfigError, DataError

__all__ = ["MISSING", "field_value", "template_fields", "render_template", "answer_text", "question_text",
           "chat_messages"]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()  # a field the row does not have (None is a value: a null cell)


def field_value(row: Mapping[str, Any], path: str) -> Any:
    """The row's field ``path``: a column's name, or a dotted path into nested columns (``reward_model.ground_truth``);
    a column whose own name holds the dots wins. :data:`MISSING` where there is none."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return MISSING
        value = value[part]
    return value


def template_fields(template: str, key: str = "dataset.prompt_template") -> list[str]:
    """The fields a prompt template names (``{column}``, ``{nested.path}``; ``{instruction}`` is
    ``model.instruction``). ConfigError for a template Python's ``str.format`` cannot read, or a positional ``{}``."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise ConfigError(f"{key}={template!r}: {error}; write placeholders as {{column}} and a literal brace as "
                          "{{ or }}") from error
    names = [name for _, name, _, _ in parsed if name is not None]
    if any(name == "" or name.isdigit() for name in names):
        raise ConfigError(f"{key}={template!r}: a placeholder must name a column, e.g. {{question}}; a literal brace "
                          "is written {{ or }}")
    return names


def render_template(template: str, row: Mapping[str, Any], *, instruction: str, where: str, place: str) -> str:
    """``template`` with each ``{field}`` replaced by the row's value (``{instruction}``: ``model.instruction``).

    Raises:
        DataError: a placeholder names a field the row does not have, naming it and the row's ``place`` ("line 3",
            "row 3 (counting from 1)").
    """
    parts = []
    for literal, name, spec, conversion in string.Formatter().parse(template):
        parts.append(literal)
        if name is None:
            continue
        value = instruction if name == "instruction" and "instruction" not in row else field_value(row, name)
        if value is MISSING:
            raise DataError(f"{where}: dataset.prompt_template names {{{name}}}, which {place} does not have; its "
                            f"fields are {sorted(row)}. Fix the placeholder or the data")
        value = {"r": repr, "s": str, "a": ascii}[conversion](value) if conversion else value
        parts.append(format(value, spec or ""))
    return "".join(parts)


def answer_text(value) -> str | None:
    """A reference answer as text, or None when unusable (missing, empty, NaN, a mapping).

    Whole floats lose their ".0" (JSON columns mixing 3 and 2.5 load 3 as 3.0), other floats are
    written without exponent. A list of answers (OlympiadBench's ``final_answer``) becomes its
    one item, or its items joined with ", ".
    """
    if value is None or value is MISSING:
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
        items = [answer_text(item) for item in value]
        if not items or any(item is None for item in items):
            return None
        return ", ".join(items)
    return None


def question_text(value) -> str | None:
    if not isinstance(value, str):
        return None
    return value.strip() or None


def chat_messages(value, *, field: str, where: str, place: str) -> tuple[dict[str, str], ...]:
    """A column of chat messages (``[{"role": ..., "content": ...}, ...]``, verl's ``prompt``) as the prompt.

    Raises:
        DataError: the value is not a non-empty list of messages with string roles and contents.
    """
    ok = isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise DataError(f"{where}: {place} has no chat messages in '{field}' (got "
                        f"{value!r:.100}); dataset.messages_field names a column of [{{role: ..., content: ...}}, ...] "
                        "lists, or set it to null to build the prompt from the question")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)
