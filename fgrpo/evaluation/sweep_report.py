"""The tables and figures of a sweep report (``python -m fgrpo.report``): the algo x gamma table with its
significance columns (the paired test of :mod:`fgrpo.evaluation.significance` against the gamma = 0 row, seeds
pooled per problem), the over-seeds table (the permutation test over runs), the table of runs, and the pass@k and
success-rate figures."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fgrpo.evaluation.eval_counts import EvalCounts, aligned_counts, load_counts, pool_counts
from fgrpo.evaluation.plots import plot_pass_at_k_panels
from fgrpo.evaluation.significance import (AVERAGE, DEFAULT_ALPHA, PERMUTATION_SPLITS, paired_test,
                                           permutation_test, p_value_text)
from fgrpo.algorithm.advantage_registry import REFERENCE
from fgrpo.evaluation.sweep_runs import (ReportError, Run, Cell, completed_cells, largest_final_k, pass_at_ks,
                                       reference_cell)
from fgrpo.infra.errors import CompareError
from fgrpo.infra.run_files import COUNTS_FILE

SIGNIFICANCE_ITERATIONS = 10_000  # per compared row: about 3 s at the paper's size (6 x 500 problems, 8 x 1024 samples)
NO_VALUE = "—"


def _describe(cell: Cell) -> str:
    """``grpo, gamma=1`` for the focal weight, ``grpo, maxrl`` for another advantage method."""
    algo, method, gamma = cell
    return f"{algo}, gamma={gamma:g}" if method == REFERENCE else f"{algo}, {method}"


def shows_method(cells) -> bool:
    """Whether the tables need an advantage column: some cell is not the focal weight."""
    return any(cell[1] != REFERENCE for cell in cells)


def _key_columns(cell: Cell, method: bool) -> list[str]:
    return [cell[0], *([cell[1]] if method else []), f"{cell[2]:g}"]


def _key_header(method: bool) -> list[str]:
    return ["algo", *(["advantage"] if method else []), "gamma"]


def _mean_std(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0



@dataclass
class Significance:
    """The significance columns of the table: their header, the cells of each row, and the notes under the table."""

    header: list[str]
    cells: dict[Cell, list[str]]
    notes: list[str]


def _pooled_cell_counts(cell_runs: list[Run]) -> EvalCounts:
    """The cell's seeds pooled per problem, each run read at the step of its final evaluation row."""
    return pool_counts([load_counts(run.path, step=run.final.get("step")) for run in cell_runs])


def significance_columns(runs: list[Run], largest_k: int, *, iterations: int = SIGNIFICANCE_ITERATIONS,
                         alpha: float = DEFAULT_ALPHA, seed: int = 0) -> Significance | None:
    """Per row with gamma != 0: pass@k(row) - pass@k(gamma = 0 row of the same algo) at k = 1 and at the largest
    power of two <= min(largest_k, m / 2), in percentage points, with the paired test's p-value (:func:`paired_test`,
    average over the eval sets, seeds pooled per problem, m = n // 4 of the smaller pooled n).

    None when no completed run wrote eval_counts.jsonl (the table then has no such columns). Rows whose counts are
    missing or do not match show NO_VALUE, with a note saying why; nothing here raises.
    """
    completed = [r for r in runs if r.status == "completed"]
    if not any((r.path / COUNTS_FILE).is_file() for r in completed):
        return None
    cells = completed_cells(runs)
    pooled: dict[Cell, EvalCounts] = {}
    notes = []
    for cell, cell_runs in sorted(cells.items()):
        without = [r for r in cell_runs if not (r.path / COUNTS_FILE).is_file()]
        if without:
            notes.append(f"{_describe(cell)}: {len(without)} of its runs wrote no {COUNTS_FILE} "
                         f"(e.g. {without[0].path}; runs from before per-problem counts), so no test ({NO_VALUE})")
            continue
        try:
            pooled[cell] = _pooled_cell_counts(cell_runs)
        except CompareError as error:
            notes.append(f"{_describe(cell)}: {error} ({NO_VALUE})")
    pairs = {cell: reference_cell(cell) for cell in cells if cell != reference_cell(cell)}
    testable = {cell: base for cell, base in pairs.items() if cell in pooled and base in pooled}
    for cell, base in sorted(pairs.items()):
        if base not in cells:
            notes.append(f"{_describe(cell)}: no gamma=0 run of {cell[0]} to compare with ({NO_VALUE})")
    half_m = {cell: min(pooled[cell].n, pooled[base].n) // 4 // 2 for cell, base in testable.items()}
    for cell in [c for c, h in half_m.items() if h < 1]:
        notes.append(f"{_describe(cell)}: too few pooled samples per problem for the test "
                     f"(n={min(pooled[cell].n, pooled[pairs[cell]].n)}; m = n // 4 must be >= 2) ({NO_VALUE})")
        del testable[cell]
    limit = min([largest_k, *(half_m[cell] for cell in testable)])
    big_k = 1 << (limit.bit_length() - 1)  # the largest power of two <= limit
    ks = sorted({1, big_k})
    header = [f"Δpass@{k} vs γ=0" for k in ks]
    results = {}
    for cell, base in testable.items():
        try:
            correct_a, correct_b = aligned_counts(pooled[cell], pooled[base])
        except CompareError as error:
            notes.append(f"{_describe(cell)} versus gamma=0: {error} ({NO_VALUE})")
            continue
        comparisons = paired_test(correct_a, correct_b, pooled[cell].n, pooled[base].n, ks=ks,
                                  iterations=iterations, alpha=alpha, seed=seed)
        results[cell] = [f"{100 * c.difference:+.1f} (p={p_value_text(c.p_value)})"
                         for c in comparisons if c.dataset == AVERAGE]
    row_cells = {}
    for cell in cells:
        if cell == reference_cell(cell):
            row_cells[cell] = ["ref"] * len(ks)
        else:
            row_cells[cell] = results.get(cell, [NO_VALUE] * len(ks))
    if shows_method(cells):
        notes.append("A row of another advantage method is compared with the gamma=0 row of its algo's focal "
                     "advantage (the plain algorithm); its gamma is 0.")
    if big_k < largest_k and testable:
        notes.append(f"pass@{largest_k} is not tested: the test needs k <= m/2 = n/8 of the pooled samples "
                     f"(pass@{largest_k} needs {8 * largest_k} samples per problem per cell, i.e. more seeds); "
                     f"pass@{big_k} is the largest k tested")
    return Significance(header, row_cells, notes)


def significance_note(significance: Significance | None, iterations: int) -> list[str]:
    """The lines under the table that say how the significance columns were made (or why they are absent)."""
    if significance is None:
        return [f"No significance columns: no run of this sweep wrote {COUNTS_FILE} (per-problem counts; runs "
                "from before they were written have none)."]
    return [f"Δ: difference to the gamma=0 row of the same algo in percentage points, on the mean over the eval sets, "
            f"from the per-problem counts ({COUNTS_FILE}) of each run's final evaluation; seeds pooled per problem "
            "(their samples concatenated: n = sum of n, c = sum of c, so Δ at k > 1 can differ slightly from the "
            f"difference of the mean-over-seeds columns). p: two-sided paired m-out-of-n subsampling test "
            f"(fgrpo.compare; m = n // 4 of the pooled n, {iterations} iterations, seed 0), significant at "
            f"p < {DEFAULT_ALPHA:g}. The test sees the sampling noise of the pooled samples only, not how much "
            "training itself varies from seed to seed: read it together with the +- std over seeds.",
            *significance.notes]


def seeds_table(runs: list[Run], k: int) -> tuple[list[str], list[list[str]], list[str]] | None:
    """Header, rows and notes of the seed-level comparison: per cell, each seed's final pass@1 and pass@k (%, in
    seed order) and, for gamma != 0, the difference of the means over seeds to gamma = 0 of the same algo with the
    permutation test's p (:func:`permutation_test`, each run one value). None when no cell has two seeds."""
    cells = completed_cells(runs)
    if max((len(cell_runs) for cell_runs in cells.values()), default=0) < 2:
        return None
    keys = ["eval/pass@1", f"eval/pass@{k}"]
    method = shows_method(cells)
    header = [*_key_header(method), "seeds"]
    for key in keys:
        header += [f"{key.removeprefix('eval/')} % per seed", "Δ mean vs γ=0"]
    rows = []
    for cell in sorted(cells):
        cell_runs, base_runs = cells[cell], cells.get(reference_cell(cell), [])
        row = [*_key_columns(cell, method), ", ".join(str(r.config.get("seed")) for r in cell_runs)]
        for key in keys:
            values = [r.final[key] for r in cell_runs if key in r.final]
            base = [r.final[key] for r in base_runs if key in r.final]
            row.append(", ".join(f"{100 * v:.1f}" for v in values) or NO_VALUE)
            if cell == reference_cell(cell):
                row.append("ref")
            elif min(len(values), len(base)) >= 2:
                difference = 100 * (np.mean(values) - np.mean(base))
                row.append(f"{difference:+.1f} (p={p_value_text(permutation_test(values, base))})")
            else:
                row.append(NO_VALUE)
        rows.append(row)
    notes = ["Over seeds: each run's final pass@k is one value; Δ mean is the difference of the means over seeds to "
             "the gamma=0 row of the same algo, p the two-sided permutation test over the runs' labels "
             f"(fgrpo.evaluation.significance.permutation_test: exact up to {PERMUTATION_SPLITS:,} splits, random splits beyond). "
             "It sees how much training varies from seed to seed, which the pooled test above does not, but with s "
             "seeds a side it cannot go below 2 / C(2s, s) (0.1 at 3 seeds, 0.0079 at 5). Rows with fewer than 2 "
             f"seeds on either side show {NO_VALUE}."]
    return header, rows, notes


def build_table(runs: list[Run], significance: Significance | None = None) -> tuple[list[str], list[list[str]], int]:
    """Header, rows (strings) and the largest k. The best mean per column is marked with '*'. With ``significance``,
    its columns follow the pass@k columns."""
    completed = [r for r in runs if r.status == "completed"]
    if not completed:
        raise ReportError("every run of this sweep failed; see the log paths above")
    k = largest_final_k(completed)
    cells = completed_cells(runs)
    columns = ["eval/pass@1", f"eval/pass@{k}"]
    stats = {
        cell: [_mean_std([r.final[c] for r in cell_runs if c in r.final]) for c in columns]
        for cell, cell_runs in cells.items()
    }
    best = [max(stats[cell][i][0] for cell in stats) for i in range(len(columns))]
    method = shows_method(cells)
    header = [*_key_header(method), "seeds", "pass@1", f"pass@{k}"]
    rows = []
    for cell in sorted(cells):
        row = [*_key_columns(cell, method), str(len(cells[cell]))]
        for i, (mean, std) in enumerate(stats[cell]):
            mark = "*" if math.isclose(mean, best[i]) else " "
            row.append(f"{100 * mean:5.1f} +- {100 * std:4.1f}{mark}")
        if significance is not None:
            row += significance.cells[cell]
        rows.append(row)
    if significance is not None:
        header += significance.header
    return header, rows, k


def format_markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.strip() for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def format_text(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def plot_curves(runs: list[Run], path: Path) -> None:
    """report.png: one panel per algorithm, one line per gamma or advantage method (final pass@k, mean over seeds,
    +-1 std shaded), and a line for the evaluation before training (the algorithm's runs at step 0) where they made
    one."""
    completed = [r for r in runs if r.status == "completed"]

    def mean_curve(rows: list[dict]) -> list[tuple[int, float, float, float]]:
        points = []
        for k in pass_at_ks(rows[0]):
            mean, std = _mean_std([row[f"eval/pass@{k}"] for row in rows if f"eval/pass@{k}" in row])
            points.append((k, mean, mean - std, mean + std))
        return points

    panels = {}
    for algo in sorted({r.algo for r in completed}):
        curves = {}
        befores = [r.before for r in completed if r.algo == algo and r.before]
        if befores:
            curves[f"before training ({_counted(len(befores), 'run')})"] = mean_curve(befores)
        for _, method, gamma in sorted(cell for cell in completed_cells(runs) if cell[0] == algo):
            group = [r.final for r in completed if (r.algo, r.method, r.gamma) == (algo, method, gamma)]
            name = f"gamma={gamma:g}" if method == REFERENCE else method
            curves[f"{name} ({_counted(len(group), 'seed')})"] = mean_curve(group)
        panels[algo] = curves
    plot_pass_at_k_panels(panels, path, ylabel="pass@k")


# held-out problems by their success rate c / n in one evaluation: never solved, rare, ..., always solved
SUCCESS_BINS = ("0", "(0, 1/8)", "[1/8, 1/4)", "[1/4, 1/2)", "[1/2, 3/4)", "[3/4, 1)", "1")
_INNER_EDGES = (1 / 8, 1 / 4, 1 / 2, 3 / 4)


def success_rate_shares(rates: np.ndarray) -> np.ndarray:
    """``[len(SUCCESS_BINS)]``: the share of ``rates`` (each c / n in [0, 1]) in each of SUCCESS_BINS."""
    rates = np.asarray(rates, dtype=float)
    if rates.size == 0:
        raise ValueError("no success rates to bin")
    inner = (rates > 0) & (rates < 1)
    bins = np.concatenate([[np.sum(rates == 0)],
                           np.histogram(rates[inner], bins=(0.0, *_INNER_EDGES, 1.0))[0],
                           [np.sum(rates == 1)]])
    return bins / rates.size


def _rates(run: Run, step: int | None) -> np.ndarray | None:
    """Every held-out problem's c / n in ``run``'s evaluation at ``step`` (all eval sets), or None without counts."""
    try:
        counts = load_counts(run.path, step=step)
    except CompareError:
        return None
    return np.array([c for problems in counts.correct.values() for c in problems.values()]) / counts.n


def _cell_label(cell: Cell) -> str:
    algo, method, gamma = cell
    return f"{algo} γ={gamma:g}" if method == REFERENCE else f"{algo} {method}"


def plot_success_rates(runs: list[Run], path: Path) -> bool:
    """report_success_rates.png: left, the held-out problems' success rates before training (every run's step 0
    pooled) and after (each algo x gamma, its seeds pooled); right, the share of training groups all correct and
    all wrong per step (mean over seeds, 5-step moving average). False (nothing drawn) when no run wrote counts."""
    from matplotlib.figure import Figure

    completed = [r for r in runs if r.status == "completed"]
    cells = completed_cells(runs)
    befores = [rates for r in completed if r.before and (rates := _rates(r, 0)) is not None]
    afters = {cell: [rates for r in cell_runs if (rates := _rates(r, r.final.get("step"))) is not None]
              for cell, cell_runs in sorted(cells.items())}
    colors = {cell: f"C{index}" for index, cell in enumerate(sorted(cells))}  # one color per cell, both panels
    bars = ([(f"before training ({_counted(len(befores), 'run')})", "0.6", np.concatenate(befores))] if befores else [])
    bars += [(f"{_cell_label(cell)} after ({_counted(len(rates), 'seed')})", colors[cell], np.concatenate(rates))
             for cell, rates in afters.items() if rates]
    if not bars:
        return False
    figure = Figure(figsize=(12, 4.5), dpi=150, layout="constrained")
    held_out, training = figure.subplots(1, 2)
    width = 0.8 / len(bars)
    positions = np.arange(len(SUCCESS_BINS))
    for i, (label, color, rates) in enumerate(bars):
        held_out.bar(positions + (i - (len(bars) - 1) / 2) * width, success_rate_shares(rates), width, label=label,
                     color=color)
    held_out.set_xticks(positions, SUCCESS_BINS)
    held_out.set_xlabel("success rate c / n of a held-out problem")
    held_out.set_ylabel("share of held-out problems")
    held_out.set_title("held-out problems by success rate")
    held_out.legend(fontsize=8)
    for cell, cell_runs in sorted(cells.items()):
        color = colors[cell]
        for key, style, what in (("train/frac_all_correct", "-", "all correct"), ("train/frac_all_wrong", "--", "all wrong")):
            series = [np.array([row[key] for row in r.steps]) for r in cell_runs if r.steps]
            if not series:
                continue
            length = min(len(x) for x in series)
            mean = np.mean([x[:length] for x in series], axis=0)
            window = min(5, length)
            smooth = np.convolve(mean, np.ones(window) / window, mode="valid")
            steps = [row["step"] for row in cell_runs[0].steps][window - 1:length]
            training.plot(steps, smooth, style, color=color, label=f"{_cell_label(cell)}: {what}",
                          marker="." if len(steps) < 10 else None)
    training.set_xlabel("training step")
    training.set_ylabel(f"share of the step's groups ({min(5, max(len(r.steps) for r in completed) or 1)}-step mean)")
    training.set_ylim(-0.02, 1.02)
    training.set_title("training groups all correct (-) and all wrong (--)")
    if training.lines:
        training.legend(fontsize=7)
    figure.savefig(path, format="png")
    return True


RARE_SCORE_FILE = "rare_nll.json"  # `python -m fgrpo.rare_nll score SET RUN --out RUN/rare_nll.json` after training


def _scored_rare_nll_delta(run_dir: Path) -> float | None:
    """The rare-trajectory NLL change that ``fgrpo.rare_nll score`` wrote into the run directory, if it did."""
    try:
        return float(json.loads((run_dir / RARE_SCORE_FILE).read_text())["rare_nll_delta"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def runs_table(runs: list[Run], k: int) -> tuple[list[str], list[list[str]]]:
    """One row per completed run: pass@1 and pass@k before -> after training (%), the held-out problems never
    solved (c = 0) before -> after, the rare-trajectory NLL change at the last evaluation (when the run measured
    it, eval.rare_set, else from RARE_SCORE_FILE in the run directory) and the median step time."""
    completed = sorted((r for r in runs if r.status == "completed"),
                       key=lambda r: (r.algo, r.method, r.gamma, str(r.config.get("seed"))))
    method = shows_method((r.algo, r.method, r.gamma) for r in completed)
    header = [*_key_header(method), "seed", "pass@1 %", f"pass@{k} %", "c=0 problems", "ΔNLL_rare", "median step s"]
    rows = []
    for run in completed:
        first, last = run.before, run.final
        cells = [*_key_columns((run.algo, run.method, run.gamma), method), str(run.config.get("seed"))]
        for key in ("eval/pass@1", f"eval/pass@{k}"):
            cells.append(" → ".join(f"{100 * row[key]:.1f}" if key in row else NO_VALUE for row in (first, last)))
        never = [None if not row or (rates := _rates(run, row.get("step"))) is None else int(np.sum(rates == 0))
                 for row in (first, last)]
        cells.append(" → ".join(NO_VALUE if count is None else str(count) for count in never))
        delta = last.get("eval/rare_nll_delta", _scored_rare_nll_delta(run.path))
        cells.append(f"{delta:+.3f}" if delta is not None else NO_VALUE)
        step_times = [row["perf/step_time_s"] for row in run.steps if "perf/step_time_s" in row]
        cells.append(f"{np.median(step_times):.1f}" if step_times else NO_VALUE)
        rows.append(cells)
    return header, rows
