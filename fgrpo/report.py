"""Sweep report: the paper-style table (rows algo x gamma, final pass@1 and pass@k, mean +- std over seeds).

    python -m fgrpo.report outputs/multirun/2026-11-22/10-00-00 [--out DIR]

Reads only what the runs wrote (``.hydra/config.yaml``, ``.hydra/hydra.yaml``, ``metrics.jsonl`` and
``eval_counts.jsonl`` in each run directory; the sweep's ``multirun.yaml`` and submitit's ``.submitit/`` log folders),
so a sweep copied back from a cluster reports the same. A job that failed before it wrote a run directory is still
listed as FAILED (from the job list in ``multirun.yaml``), with its Slurm log when there is one. Writes ``report.md``
and ``report.png`` (pass@k curves, one panel per algorithm, one line per gamma, drawn by :mod:`fgrpo.evaluation.plots`) next to
the sweep, or into ``--out``. ``report.md`` also lists every run (pass@1 and pass@k before -> after, held-out
problems never solved before -> after, the rare-trajectory NLL change where the run measured it, the median step
time), and ``report_success_rates.png`` shows the held-out problems' success-rate histograms before and after
training and the share of training groups all correct / all wrong per step.

Significance: where runs wrote per-problem counts (``eval_counts.jsonl``), each row with gamma != 0 also shows its
difference to the gamma = 0 row of the same algorithm at pass@1 and at a large k, with the p-value of the paired
m-out-of-n subsampling test (:mod:`fgrpo.compare`) on the average over the eval sets. The seeds of a cell are pooled
per problem: their samples are concatenated (n = sum of the seeds' n, c = sum of their c), so the test sees every
sample of the cell. m = n // 4 of the pooled n; the large k is the largest power of two <= min(the table's largest k,
m / 2) (beyond m / 2 the test is unreliable, see docs/evaluation.md); 10,000 iterations by default
(``--significance-iterations``; the paper's 50,000 take five times as long for a p-value resolution that a table of
differences rarely needs). Runs without counts (older runs) show "—" and a note; when no run has counts the columns
are left out. That test sees the sampling noise of the evaluation only; where cells have two or more seeds,
``report.md``'s "Over seeds" section lists each seed's final pass@1 and pass@k and tests the difference of the means
over seeds with a permutation test over the runs (:func:`fgrpo.compare.permutation_test`), which sees how
much training varies from seed to seed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fgrpo.compare import (AVERAGE, COUNTS_FILE, DEFAULT_ALPHA, EvalCounts, aligned_counts,
                           PERMUTATION_SPLITS, load_counts, paired_test, permutation_test, pool_counts,
                           p_value_text)
from fgrpo.infra.errors import CompareError
from fgrpo.evaluation.plots import plot_pass_at_k_panels
from fgrpo.infra.tracking import read_metrics

# keys that identify a table cell or may differ between runs of one sweep
CELL_KEYS = ("algo.name", "focal.gamma")
# what `auto` settles per job from the machine it runs on (fgrpo.infra.precision), written into its saved config
SETTLED_KEYS = {"hardware.autocast_dtype", "hardware.sampler_dtype", "hardware.keep_matmul_outputs_gib"}
# (eval.before and eval.rare_set measure more or less of a run, not how it trains: a sweep run in parts may differ)
FREE_KEYS = ("seed", "run_name", "logger.group", "logger.tags", "logger.mode", "trainer.save_final",
             "trainer.profile_step", "eval.before", "eval.rare_set")
SIGNIFICANCE_ITERATIONS = 10_000  # per compared row: about 3 s at the paper's size (6 x 500 problems, 8 x 1024 samples)
NO_VALUE = "—"


class ReportError(ValueError):
    """The sweep directory cannot be reported on; the message says why and what to pass."""


@dataclass
class Run:
    path: Path
    config: dict
    evals: list[dict] = field(default_factory=list)  # rows of metrics.jsonl with eval/pass@1
    status: str = "completed"  # completed | failed
    log_path: Path | None = None
    job_num: int | None = None  # Hydra's hydra.job.num (the #i of the sweep's job list)
    job_id: str | None = None  # Hydra's hydra.job.id (the Slurm job id, e.g. 12_3, under submitit)
    steps: list[dict] = field(default_factory=list)  # rows of metrics.jsonl with train/* (one per training step)

    @property
    def algo(self) -> str:
        return self.config["algo.name"]

    @property
    def gamma(self) -> float:
        return float(self.config["focal.gamma"])

    @property
    def final(self) -> dict:
        return self.evals[-1] if self.evals else {}

    @property
    def before(self) -> dict:
        """The evaluation before training (step 0); {} for a run with eval.before=false."""
        return self.evals[0] if self.evals and self.evals[0].get("step") == 0 else {}


def _pass_at_ks(row: dict) -> list[int]:
    """The k of each ``eval/pass@k`` in a metrics row (the average over eval sets), ascending."""
    return sorted(int(key.split("@")[1]) for key in row if key.startswith("eval/pass@") and key.split("@")[1].isdigit())


def _flatten(tree, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _slurm_log(sweep_dir: Path, job_id: str | None) -> Path | None:
    """submitit's stderr log of one Slurm task (.submitit/<job>_<task>/<job>_<task>_0_log.err), if there."""
    if not job_id:
        return None
    logs = sorted((sweep_dir / ".submitit" / job_id).glob(f"{job_id}_*_log.err"))
    return logs[0] if logs else None


def _job_log(run_dir: Path, sweep_dir: Path, job_id: str | None = None) -> Path | None:
    """The most useful log of a run: submitit's stderr of its Slurm task (it holds the traceback), else
    Hydra's job log in the run directory."""
    slurm = _slurm_log(sweep_dir, job_id)
    if slurm is not None:
        return slurm
    logs = sorted(run_dir.glob("*.log"))
    return logs[0] if logs else None


def _load_yaml(path: Path):
    import yaml

    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def sweep_jobs(sweep_dir: Path) -> dict[int, list[str]] | None:
    """The sweep's job list {job number: overrides}, expanded from its multirun.yaml as Hydra's basic
    sweeper does; None when there is no multirun.yaml or it cannot be expanded."""
    multirun = _load_yaml(Path(sweep_dir) / "multirun.yaml")
    hydra = multirun.get("hydra") if isinstance(multirun, dict) else None
    if not isinstance(hydra, dict):
        return None
    arguments = [f"{key}={value}" for key, value in ((hydra.get("sweeper") or {}).get("params") or {}).items()]
    arguments += list((hydra.get("overrides") or {}).get("task") or [])
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(arguments), None)
    except Exception:  # e.g. a glob over config groups, which needs the config tree: skip this check
        return None
    return {num: list(overrides) for num, overrides in enumerate(job for batch in batches for job in batch)}


def _slurm_tasks(sweep_dir: Path) -> list[str]:
    """submitit's Slurm task folders (<job>_<task>) in submission order."""
    names = [p.name for p in (Path(sweep_dir) / ".submitit").glob("*_*") if p.is_dir()]
    tasks = [n for n in names if all(part.isdigit() for part in n.split("_"))]
    return sorted(tasks, key=lambda n: tuple(int(part) for part in n.split("_")))


@dataclass
class MissingJob:
    """A job of the sweep's list that left no run directory (it failed before Hydra made one, or never ran)."""

    job_num: int
    overrides: list[str]
    job_id: str | None = None
    log_path: Path | None = None


def find_missing_jobs(sweep_dir: Path, runs: list[Run]) -> list[MissingJob]:
    jobs = sweep_jobs(sweep_dir)
    if not jobs:
        return []
    seen = {run.job_num for run in runs}
    missing = [MissingJob(num, overrides) for num, overrides in jobs.items() if num not in seen]
    tasks = _slurm_tasks(sweep_dir)
    # a sweep submitted once has one task per job, in job order; use that only if the runs agree with it
    if len(tasks) == len(jobs) and all(run.job_id is None or tasks[run.job_num] == run.job_id
                                       for run in runs if run.job_num is not None and run.job_num < len(tasks)):
        for job in missing:
            job.job_id = tasks[job.job_num]
            job.log_path = _slurm_log(sweep_dir, job.job_id)
    return missing


def find_runs(sweep_dir: Path) -> list[Run]:
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ReportError(f"{sweep_dir} is not a directory: pass a sweep directory such as outputs/multirun/<date>/<time>")
    runs = []
    for config_file in sorted(sweep_dir.rglob(".hydra/config.yaml")):
        run_dir = config_file.parent.parent
        config = _flatten(_load_yaml(config_file))
        if "algo.name" not in config or "focal.gamma" not in config:
            continue
        job = (_load_yaml(config_file.parent / "hydra.yaml").get("hydra") or {}).get("job") or {}
        job_num = job.get("num") if isinstance(job.get("num"), int) else None
        job_id = str(job["id"]) if job.get("id") not in (None, "???") else None
        metrics_file = run_dir / "metrics.jsonl"
        try:
            rows = read_metrics(metrics_file) if metrics_file.exists() else []
        except ValueError:  # a corrupt metrics.jsonl: count the run as failed
            rows = []
        evals = [row for row in rows if "eval/pass@1" in row]
        steps = [row for row in rows if "train/frac_all_correct" in row]
        finished = bool(evals) and evals[-1].get("step") == config.get("trainer.steps")
        runs.append(Run(run_dir, config, evals, "completed" if finished else "failed",
                        _job_log(run_dir, sweep_dir, job_id), job_num, job_id, steps))
    if not runs:
        raise ReportError(
            f"no runs found under {sweep_dir}: a run directory holds .hydra/config.yaml and metrics.jsonl "
            "(pass the sweep directory that `python run.py -m ...` printed)"
        )
    return runs


def check_same_config(runs: list[Run]) -> None:
    """Runs of one table must differ only in algo, gamma and seed (and what the algo option sets)."""
    completed = [r for r in runs if r.status == "completed"]
    differing = {}
    keys = set().union(*(r.config for r in completed)) if completed else set()
    for key in sorted(keys):
        if key in FREE_KEYS or key.startswith(("algo.", "focal.")):
            continue
        values = {repr(r.config.get(key)) for r in completed}
        if len(values) > 1:
            differing[key] = sorted(values)
    if differing:
        lines = [f"  {key}: {', '.join(values)}" for key, values in differing.items()]
        fix = "report on each configuration's sweep directory separately"
        if differing.keys() & SETTLED_KEYS:
            fix = ("`auto` precision settled differently from job to job (jobs on different kinds of CPU: a bf16 "
                   "matmul is native on some and emulated on others); run the sweep again with the dtypes pinned, "
                   "e.g. hardware.autocast_dtype=float32 hardware.sampler_dtype=float32, or " + fix)
        raise ReportError(
            "the runs under this directory mix different configurations, so one algo x gamma table would "
            "compare unlike things:\n" + "\n".join(lines) + "\n" + fix
        )


def _largest_k(runs: list[Run]) -> int:
    ks = [k for r in runs for k in _pass_at_ks(r.final)]
    return max(ks)


def _mean_std(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


Cell = tuple[str, float]  # (algo, gamma)


def _seed_key(run: Run) -> tuple:
    seed = run.config.get("seed")
    return (0, seed, "") if isinstance(seed, int) else (1, 0, str(seed))


def completed_cells(runs: list[Run]) -> dict[Cell, list[Run]]:
    """The completed runs by table cell (algo, gamma), each cell's runs in seed order."""
    cells: dict[Cell, list[Run]] = defaultdict(list)
    for run in sorted((r for r in runs if r.status == "completed"), key=_seed_key):
        cells[(run.algo, run.gamma)].append(run)
    return cells


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
    power of two <= min(largest_k, m / 2), in percentage points, with the paired test's p-value (fgrpo.compare,
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
            notes.append(f"{cell[0]}, gamma={cell[1]:g}: {len(without)} of its runs wrote no {COUNTS_FILE} "
                         f"(e.g. {without[0].path}; runs from before per-problem counts), so no test ({NO_VALUE})")
            continue
        try:
            pooled[cell] = _pooled_cell_counts(cell_runs)
        except CompareError as error:
            notes.append(f"{cell[0]}, gamma={cell[1]:g}: {error} ({NO_VALUE})")
    pairs = {cell: (cell[0], 0.0) for cell in cells if cell[1] != 0}
    testable = {cell: base for cell, base in pairs.items() if cell in pooled and base in pooled}
    for cell, base in sorted(pairs.items()):
        if base not in cells:
            notes.append(f"{cell[0]}, gamma={cell[1]:g}: no gamma=0 run of {cell[0]} to compare with ({NO_VALUE})")
    half_m = {cell: min(pooled[cell].n, pooled[base].n) // 4 // 2 for cell, base in testable.items()}
    for cell in [c for c, h in half_m.items() if h < 1]:
        notes.append(f"{cell[0]}, gamma={cell[1]:g}: too few pooled samples per problem for the test "
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
            notes.append(f"{cell[0]}, gamma={cell[1]:g} versus gamma=0: {error} ({NO_VALUE})")
            continue
        comparisons = paired_test(correct_a, correct_b, pooled[cell].n, pooled[base].n, ks=ks,
                                  iterations=iterations, alpha=alpha, seed=seed)
        results[cell] = [f"{100 * c.difference:+.1f} (p={p_value_text(c.p_value)})"
                         for c in comparisons if c.dataset == AVERAGE]
    row_cells = {}
    for cell in cells:
        if cell[1] == 0:
            row_cells[cell] = ["ref"] * len(ks)
        else:
            row_cells[cell] = results.get(cell, [NO_VALUE] * len(ks))
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
    permutation test's p (fgrpo.compare.permutation_test, each run one value). None when no cell has two seeds."""
    cells = completed_cells(runs)
    if max((len(cell_runs) for cell_runs in cells.values()), default=0) < 2:
        return None
    keys = ["eval/pass@1", f"eval/pass@{k}"]
    header = ["algo", "gamma", "seeds"]
    for key in keys:
        header += [f"{key.removeprefix('eval/')} % per seed", "Δ mean vs γ=0"]
    rows = []
    for algo, gamma in sorted(cells):
        cell_runs, base_runs = cells[(algo, gamma)], cells.get((algo, 0.0), [])
        row = [algo, f"{gamma:g}", ", ".join(str(r.config.get("seed")) for r in cell_runs)]
        for key in keys:
            values = [r.final[key] for r in cell_runs if key in r.final]
            base = [r.final[key] for r in base_runs if key in r.final]
            row.append(", ".join(f"{100 * v:.1f}" for v in values) or NO_VALUE)
            if gamma == 0:
                row.append("ref")
            elif min(len(values), len(base)) >= 2:
                difference = 100 * (np.mean(values) - np.mean(base))
                row.append(f"{difference:+.1f} (p={p_value_text(permutation_test(values, base))})")
            else:
                row.append(NO_VALUE)
        rows.append(row)
    notes = ["Over seeds: each run's final pass@k is one value; Δ mean is the difference of the means over seeds to "
             "the gamma=0 row of the same algo, p the two-sided permutation test over the runs' labels "
             f"(fgrpo.compare.permutation_test: exact up to {PERMUTATION_SPLITS:,} splits, random splits beyond). "
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
    k = _largest_k(completed)
    cells = completed_cells(runs)
    columns = ["eval/pass@1", f"eval/pass@{k}"]
    stats = {
        cell: [_mean_std([r.final[c] for r in cell_runs if c in r.final]) for c in columns]
        for cell, cell_runs in cells.items()
    }
    best = [max(stats[cell][i][0] for cell in stats) for i in range(len(columns))]
    header = ["algo", "gamma", "seeds", "pass@1", f"pass@{k}"]
    rows = []
    for algo, gamma in sorted(cells, key=lambda c: (c[0], c[1])):
        row = [algo, f"{gamma:g}", str(len(cells[(algo, gamma)]))]
        for i, (mean, std) in enumerate(stats[(algo, gamma)]):
            mark = "*" if math.isclose(mean, best[i]) else " "
            row.append(f"{100 * mean:5.1f} +- {100 * std:4.1f}{mark}")
        if significance is not None:
            row += significance.cells[(algo, gamma)]
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
    """report.png: one panel per algorithm, one line per gamma (final pass@k, mean over seeds, +-1 std shaded), and
    a line for the evaluation before training (the algorithm's runs at step 0) where they made one."""
    completed = [r for r in runs if r.status == "completed"]

    def mean_curve(rows: list[dict]) -> list[tuple[int, float, float, float]]:
        points = []
        for k in _pass_at_ks(rows[0]):
            mean, std = _mean_std([row[f"eval/pass@{k}"] for row in rows if f"eval/pass@{k}" in row])
            points.append((k, mean, mean - std, mean + std))
        return points

    panels = {}
    for algo in sorted({r.algo for r in completed}):
        curves = {}
        befores = [r.before for r in completed if r.algo == algo and r.before]
        if befores:
            curves[f"before training ({_counted(len(befores), 'run')})"] = mean_curve(befores)
        for gamma in sorted({r.gamma for r in completed if r.algo == algo}):
            group = [r.final for r in completed if r.algo == algo and r.gamma == gamma]
            curves[f"gamma={gamma:g} ({_counted(len(group), 'seed')})"] = mean_curve(group)
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


def _cell_label(algo: str, gamma: float) -> str:
    return f"{algo} γ={gamma:g}"


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
    bars += [(f"{_cell_label(*cell)} after ({_counted(len(rates), 'seed')})", colors[cell], np.concatenate(rates))
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
            training.plot(steps, smooth, style, color=color, label=f"{_cell_label(*cell)}: {what}",
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
    header = ["algo", "gamma", "seed", "pass@1 %", f"pass@{k} %", "c=0 problems", "ΔNLL_rare", "median step s"]
    rows = []
    completed = sorted((r for r in runs if r.status == "completed"),
                       key=lambda r: (r.algo, r.gamma, str(r.config.get("seed"))))
    for run in completed:
        first, last = run.before, run.final
        cells = [run.algo, f"{run.gamma:g}", str(run.config.get("seed"))]
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


def report(sweep_dir: Path, out_dir: Path | None = None, *,
           significance_iterations: int = SIGNIFICANCE_ITERATIONS) -> str:
    """Build the table, write report.md and report.png; return the text that is printed."""
    runs = find_runs(Path(sweep_dir))
    failed = [r for r in runs if r.status == "failed"]
    missing = find_missing_jobs(Path(sweep_dir), runs)
    check_same_config(runs)
    completed = [r for r in runs if r.status == "completed"]
    significance = (significance_columns(runs, _largest_k(completed), iterations=significance_iterations)
                    if completed else None)
    header, rows, k = build_table(runs, significance)
    sig_notes = significance_note(significance, significance_iterations)
    out_dir = Path(out_dir or sweep_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    failed_lines = [f"FAILED: {r.path} (algo={r.algo}, gamma={r.gamma:g}, seed={r.config.get('seed')}); log: {r.log_path}"
                    for r in failed]
    failed_lines += [f"FAILED: sweep job #{job.job_num} [{' '.join(job.overrides)}]"
                     + (f" (Slurm job {job.job_id})" if job.job_id else "")
                     + f" left no run directory; log: {job.log_path or 'none (it failed before writing one, or never ran)'}"
                     for job in missing]
    note = f"{len(runs) - len(failed)} completed runs, {len(failed) + len(missing)} failed. Final pass@1 and pass@{k} in %, mean +- std over seeds; * = best in column."
    plot_curves(runs, out_dir / "report.png")
    drew_rates = plot_success_rates(runs, out_dir / "report_success_rates.png")
    run_header, run_rows = runs_table(runs, k)
    over_seeds = seeds_table(runs, k)
    seed_md = seed_text = ""
    if over_seeds is not None:
        seed_header, seed_rows, seed_notes = over_seeds
        seed_md = ("\n## Over seeds\n\n" + format_markdown(seed_header, seed_rows) + "\n\n"
                   + "\n".join(f"{line}\n" for line in seed_notes))
        seed_text = "\n".join([format_text(seed_header, seed_rows), *seed_notes, ""])
    (out_dir / "report.md").write_text(
        f"# Sweep report: {sweep_dir}\n\n{note}\n\n{format_markdown(header, rows)}\n"
        + "\n" + "\n".join(f"{line}\n" for line in sig_notes)
        + ("\n" + "\n".join(f"- {line}" for line in failed_lines) + "\n" if failed_lines else "")
        + "\n![pass@k curves](report.png)\n"
        + seed_md
        + "\n## Runs\n\nBefore → after training; c=0 problems: held-out problems with no correct sample.\n\n"
        + format_markdown(run_header, run_rows) + "\n"
        + ("\n![success rates](report_success_rates.png)\n" if drew_rates else "")
    )
    written = ["report.md", "report.png"] + (["report_success_rates.png"] if drew_rates else [])
    text = "\n".join([format_text(header, rows), "", note, *sig_notes, *failed_lines, "",
                      *([seed_text] if seed_text else []), format_text(run_header, run_rows), "",
                      f"wrote {', '.join(str(out_dir / name) for name in written)}"])
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fgrpo.report", description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a sweep directory, e.g. outputs/multirun/<date>/<time>")
    parser.add_argument("--out", type=Path, default=None, help="where to write report.md and report.png")
    parser.add_argument("--significance-iterations", type=int, default=SIGNIFICANCE_ITERATIONS,
                        help="iterations of the paired subsampling test per compared row (the paper: 50000)")
    args = parser.parse_args(argv)
    if args.significance_iterations < 1:
        parser.error(f"--significance-iterations must be >= 1, got {args.significance_iterations}")
    try:
        print(report(args.sweep_dir, args.out, significance_iterations=args.significance_iterations))
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
