"""Paired m-out-of-n subsampling test between two evaluations: the paper's significance protocol.

    python -m fgrpo.compare A B [--m M] [--iterations I] [--alpha A] [--seed S] [--step N] [--out FILE.md]

A and B are run directories, standalone evaluation directories or ``eval_counts.jsonl`` files (one row per problem
per evaluation: ``{"step", "dataset", "problem", "n", "c"}``, written by :mod:`fgrpo.evaluation.held_out`, read by
:mod:`fgrpo.evaluation.eval_counts`).

Protocol (paper, "Evaluation protocol": m = 256 of n = 1024 samples, 50,000 iterations, two-sided, alpha = 0.05):
each iteration draws, for every problem, m of its n samples without replacement for A and independently for B,
computes the unbiased pass@k of each subset, averages over the problems and takes A - B; the subsample deviations are
rescaled to the full-n spread by sqrt(m / (n - m)). The test, its calibration and its p-value are
:mod:`fgrpo.evaluation.significance`; this tool prints its table and writes it as markdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from fgrpo.evaluation.eval_counts import EvalCounts, load_counts
from fgrpo.evaluation.significance import (AVERAGE, DEFAULT_ALPHA, DEFAULT_ITERATIONS, Comparison, compare,
                                           p_value_text)

__all__ = ["TABLE_HEADER", "CLOSE_TO_M_NOTE", "table_rows", "format_markdown", "format_text", "main"]


TABLE_HEADER = ["dataset", "k", "A", "B", "A-B", "interval", "p-value", "significant"]
CLOSE_TO_M_NOTE = ("† k > m/2: pass@k of an m-sample subset is close to an 'any correct' indicator and the rescaling "
                   "does not fit it; such p-values were conservative in simulation except where nearly every problem "
                   "is solved by both (then far too small): see docs/evaluation.md.")


def table_rows(comparisons: Sequence[Comparison]) -> list[list[str]]:
    """The rows of the table: pass@k in %, differences in percentage points, † on k > m/2."""
    return [[c.dataset, str(c.k), f"{100 * c.pass_a:.2f}", f"{100 * c.pass_b:.2f}", f"{100 * c.difference:+.2f}",
             f"[{100 * c.ci_low:+.2f}, {100 * c.ci_high:+.2f}]", p_value_text(c.p_value) + ("†" if c.k_close_to_m else ""),
             "yes" if c.significant else "no"]
            for c in comparisons]


def _shown(comparisons: Sequence[Comparison]) -> list[Comparison]:
    # with one dataset the average rows repeat its rows exactly
    datasets = {c.dataset for c in comparisons} - {AVERAGE}
    return [c for c in comparisons if c.dataset != AVERAGE or len(datasets) > 1]


def _footnotes(comparisons: Sequence[Comparison]) -> list[str]:
    return [CLOSE_TO_M_NOTE] if any(c.k_close_to_m for c in comparisons) else []


def format_text(comparisons: Sequence[Comparison]) -> str:
    """The table as aligned text (with one dataset, its average rows are left out: they are the same)."""
    rows = table_rows(_shown(comparisons))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(TABLE_HEADER)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*TABLE_HEADER), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
    return "\n".join([line.rstrip() for line in lines] + _footnotes(comparisons))


def format_markdown(comparisons: Sequence[Comparison]) -> str:
    """The table in markdown, the same rows as :func:`format_text`."""
    rows = table_rows(_shown(comparisons))
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines + ["", *_footnotes(comparisons)] if _footnotes(comparisons) else lines)


def _describe(a: EvalCounts, b: EvalCounts, m: int, iterations: int, alpha: float, seed: int) -> str:
    problems = ", ".join(f"{d}: {len(p)}" for d, p in sorted(a.correct.items()))
    return (f"A: {a.source} (step {a.step})\nB: {b.source} (step {b.step})\n"
            f"Paired m-out-of-n subsampling: n = {a.n} samples per problem, m = {m}, {iterations} iterations, "
            f"seed {seed}, two-sided, alpha = {alpha:g}; problems per dataset: {problems}.\n"
            f"A, B: unbiased pass@k on all n samples (%); A-B and its {100 * (1 - alpha):g}% interval in percentage "
            f"points; deviations of the m-subsets rescaled by sqrt(m / (n - m)) (see docs/evaluation.md).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fgrpo.compare", description=__doc__.split("\n")[0])
    parser.add_argument("a", type=Path, help="model A: a run directory, an evaluation directory or eval_counts.jsonl")
    parser.add_argument("b", type=Path, help="model B, the same")
    parser.add_argument("--m", type=int, default=None, help="samples per subset (default n // 4)")
    parser.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS, help="subsampling iterations")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="significance level (two-sided)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the subsampling")
    parser.add_argument("--step", type=int, default=None, help="the evaluation step to compare (default the last)")
    parser.add_argument("--out", type=Path, default=Path("compare.md"), help="markdown table (default ./compare.md)")
    args = parser.parse_args(argv)
    try:
        a, b = load_counts(args.a, args.step), load_counts(args.b, args.step)
        comparisons = compare(a, b, m=args.m, iterations=args.iterations, alpha=args.alpha, seed=args.seed)
    except ValueError as error:  # CompareError, or a bad --m / --iterations / --alpha
        print(f"error: {error}", file=sys.stderr)
        return 2
    header = _describe(a, b, comparisons[0].m, args.iterations, args.alpha, args.seed)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"# Paired comparison\n\n{header}\n\n{format_markdown(comparisons)}\n")
    except OSError as error:
        print(f"error: cannot write {args.out}: {error} (choose another file with --out)", file=sys.stderr)
        return 2
    print("\n".join([header, "", format_text(comparisons), "", f"wrote {args.out}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
