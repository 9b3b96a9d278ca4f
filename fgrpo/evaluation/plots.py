"""pass@k plots: one run's curves before and after training (``pass_at_k.png``, drawn by the run) and a sweep's
final curves per algorithm, one line per gamma (``report.png``, drawn by :mod:`fgrpo.report`). Both draw with
:func:`draw_pass_at_k` on a log2 k axis; matplotlib's object API only (no pyplot), so no global backend or display
is involved."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["draw_pass_at_k", "plot_pass_at_k", "plot_pass_at_k_panels"]

Curves = Mapping[str, Sequence[Any]]
"""label -> points, each ``(k, mean, ci_low, ci_high)`` or a :class:`fgrpo.evaluation.pass_at_k.PassAtK`."""


def _log2_ticks(ks: list[int], max_powers: int = 12, min_gap_log2: float = 0.3) -> list[int]:
    """x ticks: the powers of two over the k range, plus other ks (e.g. n = 1000) that do not
    crowd a tick already there, so labels never overlap."""
    low, high = math.floor(math.log2(ks[0])), math.floor(math.log2(ks[-1]))
    exponents = list(range(low, high + 1))
    stride = math.ceil(len(exponents) / max_powers)
    ticks = [2**e for e in exponents[::stride]]
    for k in ks:
        if all(abs(math.log2(k) - math.log2(tick)) >= min_gap_log2 for tick in ticks):
            ticks.append(k)
    return sorted(ticks)


def _pass_at_k_point(label: str, point: Any) -> tuple[int, float, float, float]:
    if all(hasattr(point, name) for name in ("k", "mean", "ci_low", "ci_high")):
        point = (point.k, point.mean, point.ci_low, point.ci_high)
    try:
        k, mean, ci_low, ci_high = point
        return int(k), float(mean), float(ci_low), float(ci_high)
    except (TypeError, ValueError) as error:
        raise ValueError(f"curve {label!r}: a point must be (k, mean, ci_low, ci_high), got {point!r}") from error


def _parse(curves: Curves) -> dict[str, list[tuple[int, float, float, float]]]:
    if not curves:
        raise ValueError("a pass@k plot needs at least one curve")
    parsed = {}
    for label, points in curves.items():
        rows = sorted(_pass_at_k_point(label, point) for point in points)
        if not rows:
            raise ValueError(f"curve {label!r} has no points")
        if rows[0][0] < 1:
            raise ValueError(f"curve {label!r} has k={rows[0][0]}; k must be >= 1 for a log2 axis")
        parsed[label] = rows
    return parsed


def draw_pass_at_k(axes, curves: Curves, *, title: str, ylabel: str = "pass@k") -> None:
    """Draw pass@k against k on ``axes``: one line per label, its interval shaded (none where ci_low == ci_high)."""
    from matplotlib.ticker import FixedLocator, NullLocator

    parsed = _parse(curves)
    all_ks = sorted({k for rows in parsed.values() for k, *_ in rows})
    for label, rows in parsed.items():
        ks, means, lows, highs = (list(column) for column in zip(*rows, strict=True))
        (line,) = axes.plot(ks, means, marker="o", markersize=4, linewidth=1.8, label=label)
        if lows != highs:
            axes.fill_between(ks, lows, highs, color=line.get_color(), alpha=0.18, linewidth=0)
    ticks = _log2_ticks(all_ks)
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_locator(FixedLocator(ticks))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.set_xticklabels([str(k) for k in ticks])
    if len(all_ks) > 1:
        axes.set_xlim(all_ks[0] / 1.15, all_ks[-1] * 1.15)
    axes.set_ylim(0.0, 1.02)
    axes.set_xlabel("k (samples per problem)")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, which="major", alpha=0.35)
    axes.legend(loc="lower right", frameon=True, fontsize="small")


def plot_pass_at_k(curves: Curves, path: str | os.PathLike, *, title: str) -> None:
    """Save one run's pass@k PNG, e.g. ``{"before training": pass_at_k_curve(...), "after training": ...}``.

    Raises:
        ValueError: no curves, a curve without points, a point that is not (k, mean, ci_low, ci_high), or k < 1.
    """
    plot_pass_at_k_panels({title: curves}, path)


def plot_pass_at_k_panels(panels: Mapping[str, Curves], path: str | os.PathLike, *,
                          ylabel: str = "pass@k") -> None:
    """Save a PNG with one pass@k panel per title, side by side on a shared y axis (the sweep report: one panel
    per algorithm, one line per gamma). Its folder is created."""
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("a pass@k plot needs at least one panel")
    width = 7.0 if len(panels) == 1 else 4.5 * len(panels)
    figure = Figure(figsize=(width, 4.5), dpi=150, layout="constrained")
    all_axes = figure.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    for axes, (title, curves) in zip(all_axes, panels.items(), strict=True):
        draw_pass_at_k(axes, curves, title=title, ylabel=ylabel if axes is all_axes[0] else "")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
