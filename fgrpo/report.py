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
m-out-of-n subsampling test (:mod:`fgrpo.evaluation.significance`) on the average over the eval sets. The seeds of a
cell are pooled per problem: their samples are concatenated (n = sum of the seeds' n, c = sum of their c), so the
test sees every sample of the cell. m = n // 4 of the pooled n; the large k is the largest power of two <= min(the
table's largest k, m / 2) (beyond m / 2 the test is unreliable, see docs/evaluation.md); 10,000 iterations by default
(``--significance-iterations``; the paper's 50,000 take five times as long for a p-value resolution that a table of
differences rarely needs). Runs without counts (older runs) show "—" and a note; when no run has counts the columns
are left out. That test sees the sampling noise of the evaluation only; where cells have two or more seeds,
``report.md``'s "Over seeds" section lists each seed's final pass@1 and pass@k and tests the difference of the means
over seeds with a permutation test over the runs (:func:`fgrpo.evaluation.significance.permutation_test`), which sees
how much training varies from seed to seed.

``--seeds 0,1`` reports only the runs of those seeds (the others are left out, not counted as failed): the pooled
test then compares cells over the same seeds, when some cells have run more seeds than others.

``report.md``'s "Paired over seeds" section pairs each gamma != 0 row with gamma = 0 of its algo seed by seed: the
per-seed differences of pass@1, pass@16 and pass@k, their mean with a 95% t interval, the paired t-test and the exact
sign-flip test (:mod:`fgrpo.evaluation.seed_stats`); a pair whose cells ran different seeds is named instead.

    python -m fgrpo.report DIR --variance     # run-to-run variance split: training / problem x seed / sampling
    python -m fgrpo.report DIR --plan --effect 4 --alpha 0.01 [--power 0.8] [--metric pass@16]  # pairs needed
    python -m fgrpo.report DIR --plan --effect 4 --problems 240 --samples 32  # projected to another evaluation
    python -m fgrpo.report DIR --plan --metric collapse --collapse-gap 5 --effect 30  # collapse rates (exact test)
    python -m fgrpo.report DIR --confirm PLAN.yaml  # a pre-registered analysis (fgrpo.evaluation.confirmatory)
    python -m fgrpo.report DIR --confirm PLAN.yaml --out OUT  # also OUT/analysis.txt and OUT/analysis.png

``--problems``/``--samples`` project the pilot's spread to that many held-out problems and samples per problem
(default the pilot's own) from its variance split (:mod:`fgrpo.evaluation.seed_planner`). These print only. They
read every run under DIR (several sweeps at once: cells are also told apart by any other config key that differs,
e.g. trainer.mini_batches), but refuse runs evaluated differently.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from fgrpo.evaluation.sweep_report import (SIGNIFICANCE_ITERATIONS, build_table, format_markdown, format_text,
                                           plot_curves, plot_success_rates, runs_table, seeds_table,
                                           significance_columns, significance_note)
from fgrpo.evaluation.sweep_runs import (ReportError, check_same_config, find_missing_jobs, find_runs, largest_final_k,
                                       pass_at_ks)
from fgrpo.evaluation.analysis_plan import COLLAPSE, Plan, load_plan
from fgrpo.evaluation.collapse import CollapseRule, collapse_plan_text
from fgrpo.evaluation.confirm_figure import plot_confirmatory
from fgrpo.evaluation.confirmatory import analysis
from fgrpo.evaluation.seed_planner import plan_text
from fgrpo.evaluation.seed_stats import PAIRED_NOTE, paired_tables, variance_table


def report(sweep_dir: Path, out_dir: Path | None = None, *,
           significance_iterations: int = SIGNIFICANCE_ITERATIONS, seeds: list[str] | None = None) -> str:
    """Build the table, write report.md and report.png; return the text that is printed. ``seeds``: report only the
    runs of these seeds (as strings, as the configs hold them)."""
    all_runs = find_runs(Path(sweep_dir))
    missing = find_missing_jobs(Path(sweep_dir), all_runs) if seeds is None else []
    runs = all_runs if seeds is None else _of_seeds(all_runs, seeds)
    failed = [r for r in runs if r.status == "failed"]
    check_same_config(runs)
    completed = [r for r in runs if r.status == "completed"]
    significance = (significance_columns(runs, largest_final_k(completed), iterations=significance_iterations)
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
    note = ("" if seeds is None
            else f"Seeds {', '.join(seeds)} only ({len(all_runs) - len(runs)} runs of other seeds left out). ")
    note += f"{len(runs) - len(failed)} completed runs, {len(failed) + len(missing)} failed. Final pass@1 and pass@{k} in %, mean +- std over seeds; * = best in column."
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
        paired_md, paired_text = _paired_section(runs, k)
        seed_md, seed_text = seed_md + paired_md, seed_text + paired_text
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


def _paired_section(runs: list, k: int) -> tuple[str, str]:
    """report.md's "Paired over seeds" section and its printed text: pass@1, pass@16 (when logged) and pass@k."""
    logged = {f"pass@{logged_k}" for r in runs if r.status == "completed"
              for logged_k in pass_at_ks(r.final)}
    metrics = [m for m in dict.fromkeys(["pass@1", "pass@16", f"pass@{k}"]) if m in logged]
    tables = paired_tables(runs, metrics)
    if not tables:
        return "", ""
    md = "\n## Paired over seeds\n\n" + PAIRED_NOTE + "\n"
    text = [PAIRED_NOTE]
    for title, header, rows in tables:
        md += f"\n{title}\n" + (f"\n{format_markdown(header, rows)}\n" if rows else "")
        text += [title, *([format_text(header, rows)] if rows else [])]
    return md, "\n".join([*text, ""])


def stats_report(sweep_dir: Path, *, variance: bool = False, plan: dict | None = None,
                 seeds: list[str] | None = None) -> str:
    """``--variance`` and ``--plan``: the text they print (nothing is written). ``plan``: plan_text's keywords."""
    runs = find_runs(Path(sweep_dir))
    runs = [r for r in (runs if seeds is None else _of_seeds(runs, seeds)) if r.status == "completed"]
    if not runs:
        raise ReportError("every run of this sweep failed; see the log paths in the report")
    parts = []
    if variance:
        header, rows, notes = variance_table(runs)
        parts.append("\n".join([f"Variance split over seeds: {sweep_dir}", format_text(header, rows), *notes]))
    if plan is not None and plan["metric"] == COLLAPSE:
        rule = CollapseRule(plan["collapse_high"], "pass@1", plan["collapse_gap"])
        parts.append(collapse_plan_text(runs, rule, effect=plan["effect"], alpha=plan["alpha"], power=plan["power"]))
    elif plan is not None:
        parts.append(plan_text(runs, **{k: v for k, v in plan.items() if not k.startswith("collapse_")}))
    return "\n\n".join(parts)


def confirm(sweep_dir: Path, plan: Plan, out_dir: Path | None = None) -> list[str]:
    """Print the pre-registered analysis of the completed runs under sweep_dir; with out_dir, also write it to
    out_dir/analysis.txt and its figure to out_dir/analysis.png (:mod:`fgrpo.evaluation.confirm_figure`)."""
    lines, arms, steps = analysis([r for r in find_runs(sweep_dir) if r.status == "completed"], plan)
    print("\n".join(lines))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "analysis.txt").write_text("\n".join(lines) + "\n")
        plot_confirmatory(steps, arms, plan, out_dir / "analysis.png")
        print(f"wrote {out_dir / 'analysis.txt'} and {out_dir / 'analysis.png'}", file=sys.stderr)
    return lines


def _of_seeds(runs: list, seeds: list[str]) -> list:
    kept = [r for r in runs if str(r.config.get("seed")) in seeds]
    if not kept:
        found = sorted({str(r.config.get("seed")) for r in runs})
        raise ReportError(f"no run has seed {', '.join(seeds)}; the runs' seeds are {', '.join(found) or 'none'}: "
                          "pass some of those to --seeds, or leave --seeds out")
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fgrpo.report", description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a sweep directory, e.g. outputs/multirun/<date>/<time>")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write report.md and report.png (with --confirm: analysis.txt and analysis.png)")
    parser.add_argument("--significance-iterations", type=int, default=SIGNIFICANCE_ITERATIONS,
                        help="iterations of the paired subsampling test per compared row (the paper: 50000)")
    parser.add_argument("--seeds", type=lambda text: [s.strip() for s in text.split(",") if s.strip()], default=None,
                        help="report only the runs of these seeds, e.g. 0,1 (cells compared over the same seeds)")
    parser.add_argument("--variance", action="store_true",
                        help="print the split of each pass@k's run-to-run variance (training, problems, sampling)")
    parser.add_argument("--plan", action="store_true", help="print the seed pairs needed to detect --effect")
    parser.add_argument("--effect", type=float, default=None, help="with --plan: the effect to detect, in points")
    parser.add_argument("--alpha", type=float, default=0.05, help="with --plan: two-sided level (default 0.05)")
    parser.add_argument("--power", type=float, default=0.8, help="with --plan: power (default 0.8)")
    parser.add_argument("--metric", default="pass@16",
                        help="with --plan: the metric (default pass@16), or collapse (with --collapse-gap)")
    parser.add_argument("--collapse-gap", type=float, default=None,
                        help="with --metric collapse: a run collapsed when its --collapse-high - pass@1 is below this "
                             "many points")
    parser.add_argument("--collapse-high", default="pass@16", help="with --metric collapse (default pass@16)")
    parser.add_argument("--confirm", type=Path, default=None, metavar="PLAN.yaml",
                        help="print the pre-registered tests of this plan file (refused until every run is done)")
    parser.add_argument("--problems", type=int, default=None,
                        help="with --plan: project to this many held-out problems (default the pilot's)")
    parser.add_argument("--samples", type=int, default=None,
                        help="with --plan: project to this many samples per problem (default the pilot's)")
    args = parser.parse_args(argv)
    if args.plan and (args.effect is None or args.effect <= 0):
        parser.error("--plan needs --effect > 0, the difference to detect in points, e.g. --effect 4")
    if args.plan and not (0 < args.alpha < 1 and 0 < args.power < 1):
        parser.error(f"--alpha and --power must be in (0, 1), got {args.alpha} and {args.power}")
    if args.metric != COLLAPSE and args.collapse_gap is not None:
        parser.error("--collapse-gap goes with --metric collapse")
    if args.metric == COLLAPSE and not re.fullmatch(r"pass@([2-9]|[1-9]\d+)", args.collapse_high):
        parser.error(f"--collapse-high must be pass@k with k > 1, got {args.collapse_high}")
    if args.metric == COLLAPSE and not (args.collapse_gap is not None and 0 < args.collapse_gap < 100):
        parser.error("--metric collapse needs --collapse-gap G (0 < G < 100 points): a run collapsed when its "
                     f"{args.collapse_high} - pass@1 is below G")
    if args.metric == COLLAPSE and (args.problems is not None or args.samples is not None):
        parser.error("--problems and --samples project a pass@k metric, not collapse")
    if (args.problems is not None or args.samples is not None) and not args.plan:
        parser.error("--problems and --samples go with --plan")
    if any(value is not None and value < 1 for value in (args.problems, args.samples)):
        parser.error(f"--problems and --samples must be >= 1, got {args.problems} and {args.samples}")
    if args.significance_iterations < 1:
        parser.error(f"--significance-iterations must be >= 1, got {args.significance_iterations}")
    if args.confirm is not None and (args.variance or args.plan or args.seeds is not None):
        parser.error("--confirm runs the plan file's analysis alone: leave out --variance, --plan and --seeds")
    if args.seeds == []:
        parser.error("--seeds needs seeds, e.g. --seeds 0,1 (or leave it out for every seed)")
    try:
        if args.confirm is not None:
            confirm(args.sweep_dir, load_plan(args.confirm), args.out)
            return 0
        if args.variance or args.plan:
            plan = (dict(effect=args.effect, alpha=args.alpha, power=args.power, metric=args.metric,
                         problems=args.problems, samples=args.samples, collapse_gap=args.collapse_gap,
                         collapse_high=args.collapse_high) if args.plan else None)
            print(stats_report(args.sweep_dir, variance=args.variance, plan=plan, seeds=args.seeds))
            return 0
        print(report(args.sweep_dir, args.out, significance_iterations=args.significance_iterations, seeds=args.seeds))
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
