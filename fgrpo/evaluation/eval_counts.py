"""Per-problem correct counts of an evaluation (``eval_counts.jsonl``, one row per problem per evaluation:
``{"step", "dataset", "problem", "n", "c"}``, written by :mod:`fgrpo.evaluation.held_out`): read one evaluation,
pool several (seeds of one configuration), and align two by problem for the paired test of
:mod:`fgrpo.evaluation.significance`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from fgrpo.infra.errors import CompareError
from fgrpo.infra.run_files import COUNTS_FILE, read_jsonl

__all__ = ["COUNTS_FILE", "EvalCounts", "load_counts", "pool_counts", "aligned_counts"]


@dataclass(frozen=True)
class EvalCounts:
    """One evaluation of one model: ``correct[dataset][problem]`` of ``n`` samples were correct."""

    source: str
    step: int | None
    n: int
    correct: dict[str, dict[str, int]]


def _counts_file(path: Path) -> Path:
    if path.is_dir():
        file = path / COUNTS_FILE
        if not file.is_file():
            raise CompareError(f"{path} holds no {COUNTS_FILE}: pass a run directory or evaluation directory whose "
                               f"evaluations wrote per-problem counts (runs from before they existed have none; "
                               f"evaluate their final model again), or the {COUNTS_FILE} file itself")
        return file
    if not path.is_file():
        raise CompareError(f"{path} does not exist: pass a run directory, an evaluation directory or an "
                           f"{COUNTS_FILE} file")
    return path


def _read_rows(file: Path) -> list[dict]:
    try:
        numbered = read_jsonl(file)
    except (OSError, ValueError) as error:
        raise CompareError(f"cannot read {file}: {error}") from error
    rows = []
    for number, row in numbered:
        line = json.dumps(row)
        if not isinstance(row, dict) or not {"step", "dataset", "problem", "n", "c"} <= row.keys():
            raise CompareError(f"{file}:{number} is not an {COUNTS_FILE} row "
                               f"({{\"step\", \"dataset\", \"problem\", \"n\", \"c\"}}): {line[:200]}")
        n, c, step = row["n"], row["c"], row["step"]
        if not (isinstance(n, int) and isinstance(c, int) and 0 <= c <= n and n >= 1
                and (step is None or isinstance(step, int))):
            raise CompareError(f"{file}:{number}: needs an integer n >= 1, 0 <= c <= n and an integer or null "
                               f"step, got {line[:200]}")
        rows.append(row)
    if not rows:
        raise CompareError(f"{file} holds no rows: no evaluation finished writing its counts")
    return rows


def _latest_step(steps: set) -> int | None:
    numbered = [s for s in steps if s is not None]
    return max(numbered) if numbered else None


def load_counts(path: str | Path, step: int | None = None) -> EvalCounts:
    """The per-problem counts of one evaluation in a run directory, an evaluation directory or an
    ``eval_counts.jsonl`` file.

    ``step``: the training step whose evaluation to read; default the latest one present (the file's only
    evaluation when its step is null). A problem listed twice at one step (a resumed run that evaluated that
    step again) counts as its last row.

    Raises:
        CompareError: no such file or directory, no counts file, a corrupt file, the step absent, n varying
            across the problems of that step.
    """
    file = _counts_file(Path(path))
    rows = _read_rows(file)
    steps = {row["step"] for row in rows}
    chosen = _latest_step(steps) if step is None else step
    if chosen not in steps:
        present = ", ".join("null" if s is None else str(s) for s in sorted(steps, key=lambda s: (s is None, s or 0)))
        raise CompareError(f"step {step} is not in {file}; steps present: {present} (choose one with --step)")
    kept = {(str(row["dataset"]), str(row["problem"])): row for row in rows if row["step"] == chosen}  # last row wins
    correct: dict[str, dict[str, int]] = {}
    for (dataset, problem), row in kept.items():
        correct.setdefault(dataset, {})[problem] = row["c"]
    ns = {row["n"] for row in kept.values()}
    if len(ns) > 1:
        raise CompareError(f"{file}, step {chosen}: n varies across problems ({sorted(ns)}); the paired test needs "
                           "one number of samples per problem (evaluate again with one eval.n_samples)")
    return EvalCounts(str(file), chosen, ns.pop(), correct)


def pool_counts(evaluations: Sequence[EvalCounts]) -> EvalCounts:
    """Several evaluations of the same problems (e.g. seeds of one configuration) as one: per problem the
    samples are concatenated, so n = sum of n and c = sum of c.

    Raises:
        CompareError: no evaluations, or their problem sets differ.
    """
    if not evaluations:
        raise CompareError("pool_counts needs at least one evaluation")
    first = evaluations[0]
    for other in evaluations[1:]:
        _check_same_problems(first, other)
    correct = {dataset: {problem: sum(e.correct[dataset][problem] for e in evaluations) for problem in problems}
               for dataset, problems in first.correct.items()}
    return EvalCounts(" + ".join(e.source for e in evaluations), first.step, sum(e.n for e in evaluations), correct)


def _sample(ids, limit: int = 3) -> str:
    ids = sorted(ids)
    return ", ".join(repr(i) for i in ids[:limit]) + (", ..." if len(ids) > limit else "")


def _check_same_problems(a: EvalCounts, b: EvalCounts) -> None:
    if set(a.correct) != set(b.correct):
        only_a, only_b = set(a.correct) - set(b.correct), set(b.correct) - set(a.correct)
        raise CompareError(f"the datasets differ: {a.source} has {sorted(a.correct)}, {b.source} has "
                           f"{sorted(b.correct)} (only in the first: {_sample(only_a) or 'none'}; only in the "
                           f"second: {_sample(only_b) or 'none'}); evaluate both on the same eval sets")
    for dataset in sorted(a.correct):
        only_a = a.correct[dataset].keys() - b.correct[dataset].keys()
        only_b = b.correct[dataset].keys() - a.correct[dataset].keys()
        if only_a or only_b:
            raise CompareError(
                f"dataset {dataset!r}: the problems differ: {len(only_a)} only in {a.source} "
                f"({_sample(only_a) or 'none'}), {len(only_b)} only in {b.source} ({_sample(only_b) or 'none'}); "
                "the test is paired by problem: evaluate both on the same problems (same eval.max_problems)")


def aligned_counts(a: EvalCounts, b: EvalCounts) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``({dataset: [P_d]}, {dataset: [P_d]})``: the correct counts of A and of B, problems in the same (sorted)
    order, as :func:`fgrpo.evaluation.significance.paired_test` takes them.

    Raises:
        CompareError: the datasets or the problems of a dataset differ.
    """
    _check_same_problems(a, b)
    order = {dataset: sorted(problems) for dataset, problems in a.correct.items()}
    return ({d: np.array([a.correct[d][p] for p in problems], dtype=np.int64) for d, problems in order.items()},
            {d: np.array([b.correct[d][p] for p in problems], dtype=np.int64) for d, problems in order.items()})
