"""The figure of a pre-registered analysis (``python -m fgrpo.report DIR --confirm PLAN.yaml --out OUT`` writes
``OUT/analysis.png`` beside ``OUT/analysis.txt``): on the left, each test the sequence ran, its per-seed differences
as dots and its mean with the step's interval (the equivalence margin shaded on the primary, with the interval that
calls a null where the primary is not significant; the non-inferiority margin drawn as a line); on the right, the
reported pass@k per arm, mean over seeds with its 95% t interval. Steps the sequence did not reach are left out: the
figure shows what the analysis tested, nothing more."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fgrpo.evaluation.analysis_plan import Plan
from fgrpo.evaluation.confirmatory import TestedStep, mean_interval
from fgrpo.evaluation.plots import draw_pass_at_k
from fgrpo.evaluation.sweep_runs import Run


def pass_at_k_by_arm(arms: dict[str, list[Run]], plan: Plan) -> dict[str, list[tuple[int, float, float, float]]]:
    """{arm: [(k, mean, ci_low, ci_high)]} over the plan's reported pass@k, as fractions, 95% t over seeds."""
    ks = sorted(int(m.split("@")[1]) for m in plan.reported if m.startswith("pass@"))
    curves = {}
    for name, runs in arms.items():
        points = []
        for k in ks:
            values = np.array([run.final[f"eval/pass@{k}"] for run in runs if f"eval/pass@{k}" in run.final])
            if values.size == len(runs) and values.size >= 2:
                points.append((k, float(values.mean()), *mean_interval(values)))
        if points:
            curves[name] = points
    return curves


def _draw_differences(axes, steps: list[TestedStep], plan: Plan) -> None:
    margin = plan.equivalence_margin
    rng = np.random.default_rng(0)  # vertical jitter of the dots only
    for row, step in enumerate(steps):
        c, d = step.comparison, step.differences
        y = len(steps) - 1 - row
        axes.scatter(d, y + rng.uniform(-0.12, 0.12, d.size), s=14, color="0.45", zorder=3)
        low, high = step.interval
        axes.errorbar(d.mean(), y + 0.3, xerr=[[d.mean() - low], [high - d.mean()]], fmt="o", color="C3",
                      capsize=4, zorder=4, label="mean, the step's t interval" if row == 0 else None)
        if step.equivalence is not None:  # a primary that is not significant: the interval that calls a null
            low, high = step.equivalence
            axes.errorbar(d.mean(), y + 0.18, xerr=[[d.mean() - low], [high - d.mean()]], fmt="s", color="C2",
                          capsize=4, zorder=4, label=f"{100 * (1 - 2 * plan.equivalence_alpha):g}% t interval "
                                                     "(equivalence)")
        if row == 0 and margin:
            axes.fill_betweenx([y - 0.4, y + 0.45], -margin, margin, color="C2", alpha=0.12,
                               label=f"equivalence margin ±{margin:g}")
        if c.non_inferiority_margin is not None:
            axes.plot([-c.non_inferiority_margin] * 2, [y - 0.4, y + 0.45], color="C1", linestyle="--",
                      label=f"non-inferiority margin -{c.non_inferiority_margin:g}")
    axes.axvline(0.0, color="0.2", linewidth=0.8)
    axes.set_yticks(range(len(steps)))
    axes.set_yticklabels([f"{s.label}: {s.comparison.a} − {s.comparison.b}\n{s.comparison.metric}, "
                          f"{100 * s.confidence:g}% interval" for s in reversed(steps)], fontsize="small")
    axes.set_ylim(-0.6, len(steps) - 0.4)
    axes.set_xlabel("per-seed difference (points)")
    axes.set_title("the tests the sequence ran (a dot per seed)")
    axes.grid(True, axis="x", alpha=0.35)
    axes.legend(loc="lower right", fontsize="x-small")


def plot_confirmatory(steps: list[TestedStep], arms: dict[str, list[Run]], plan: Plan, path: str | os.PathLike):
    """Save the analysis figure (module docstring) as a PNG at ``path`` (its folder is created); returns the
    matplotlib Figure."""
    from matplotlib.figure import Figure

    if not steps:
        raise ValueError("the analysis ran no test: nothing to draw")
    figure = Figure(figsize=(11.0, 1.6 + 1.3 * len(steps)), dpi=150, layout="constrained")
    left, right = figure.subplots(1, 2, width_ratios=[1.25, 1.0])
    _draw_differences(left, steps, plan)
    curves = pass_at_k_by_arm(arms, plan)
    if curves:
        draw_pass_at_k(right, curves, title=f"pass@k after training, {len(plan.seeds)} seeds per arm")
    else:
        right.set_axis_off()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return figure
