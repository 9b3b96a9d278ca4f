"""A local data file read into rows, and where each row stands in it: a JSONL file line by line (a line that does not
parse is named by its number, counting from 1, and its start), a JSON file (its parser's line), CSV (each record's
line, Python's csv module), parquet (rows counting from 1). A file that cannot be read names the file and the reader's
own message. ``datasets`` reads what parses (its types, its caching), imported here only."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from fgrpo.infra.errors import DataError

__all__ = ["FILE_FORMATS", "load_file"]

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension -> the ``datasets`` builder that reads it."""

_SHOWN_CHARS = 80  # of a broken line, in its error


def load_file(path: str, limit: int | None = None):
    """Read a local jsonl / json / parquet / csv file: ``(dataset, resolved path, places)``, ``places`` naming each
    of the first ``limit`` rows' place in the file ("line 3") where the format has lines, else None.

    Raises:
        DataError: the file is missing, not a file, of another format, empty, or does not parse (naming the line).
    """
    resolved = Path(path).expanduser().resolve()
    if not resolved.exists():
        raise DataError(
            f"dataset file {resolved} does not exist (path={path!r}; relative paths start at the "
            f"working directory {os.getcwd()}); fix the path, e.g. dataset.train.path=/abs/path/train.jsonl"
        )
    if not resolved.is_file():
        raise DataError(f"dataset path {resolved} is not a file; point path= at a {'/'.join(FILE_FORMATS)} file")
    suffix = resolved.suffix.lower()
    builder = FILE_FORMATS.get(suffix)
    if builder is None:
        raise DataError(
            f"dataset file {resolved} has extension {resolved.suffix!r}, which is not supported; "
            f"use one of {list(FILE_FORMATS)}"
        )
    if resolved.stat().st_size == 0 or (suffix != ".parquet" and not resolved.read_bytes().strip()):
        raise DataError(f"dataset file {resolved} is empty: it holds no rows")
    lines = {".jsonl": _jsonl_lines, ".json": _check_json, ".csv": _csv_lines}.get(suffix, lambda _: None)(resolved)
    import datasets

    try:
        dataset = datasets.load_dataset(builder, data_files=str(resolved), split="train")
    except Exception as error:
        raise DataError(f"could not read dataset file {resolved} as {builder}: {_innermost(error)}") from error
    places = None if lines is None else [f"line {line}" for line in lines[: limit or len(lines)]]
    return dataset, resolved, places


def _jsonl_lines(path: Path) -> list[int]:
    """The line of each row (blank lines hold none); DataError naming the first line that is not a JSON object, or
    saying that none is."""
    lines, first_error = [], None
    with open(path, encoding="utf-8", errors="replace") as file:
        for number, text in enumerate(file, start=1):
            if not text.strip():
                continue
            try:
                value = json.loads(text.strip())
                problem = None if isinstance(value, dict) else f"is a JSON {type(value).__name__}, not an object"
            except json.JSONDecodeError as error:
                problem = f"is not valid JSON ({error.msg} at column {error.colno})"
            if problem is None:
                lines.append(number)
            elif first_error is None:
                first_error = f"line {number} {problem}: {text.strip()[:_SHOWN_CHARS]!r}"
    if first_error is not None and not lines:
        raise DataError(f"dataset file {path}: no line is a JSON object ({first_error}); a .jsonl file holds one "
                        '{"question": ..., "answer": ...} object per line')
    if first_error is not None:
        raise DataError(f"dataset file {path}: {first_error}; fix that line (one JSON object per line)")
    return lines


def _check_json(path: Path) -> None:
    """DataError naming the line where a .json file stops parsing; None (a JSON file's rows have no lines of their
    own)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        start = text.splitlines()[error.lineno - 1].strip()[:_SHOWN_CHARS] if text.splitlines() else ""
        raise DataError(f"dataset file {path}: not valid JSON at line {error.lineno}, column {error.colno} "
                        f"({error.msg}): {start!r}") from error
    return None


def _csv_lines(path: Path) -> list[int] | None:
    """The line on which each record (after the header) starts, as Python's csv module reads the file; None where it
    cannot (the reader's error then comes from ``datasets``)."""
    starts = []
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as file:
            reader = csv.reader(file)
            next(reader, None)
            ended = reader.line_num
            for _ in reader:
                starts.append(ended + 1)
                ended = reader.line_num
    except csv.Error:
        return None
    return starts


def _innermost(error: BaseException) -> str:
    """The reader's own message: the innermost cause of ``error`` (``datasets`` wraps pandas' and arrow's)."""
    while error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__):
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {str(error).strip()[:300]}"
