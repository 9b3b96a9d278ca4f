"""Tables and figures of the theory simulators (fgrpo.algorithm.lemma, fgrpo.algorithm.categorical): the Lemma 3.1
figure and its table, the categorical simulation's four-panel figure, table and raw arrays. matplotlib is imported
inside the plotting functions."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from fgrpo.algorithm.categorical import CategoricalResult, summarise_categorical
from fgrpo.algorithm.lemma import LemmaPoint, miss_probability, miss_probability_peak

__all__ = ["lemma_table", "plot_lemma", "describe_run", "categorical_table", "plot_categorical", "save_arrays"]


def lemma_table(points: Sequence[LemmaPoint], examples: Sequence[tuple[float, float]], n_max: int) -> str:
    """Markdown: each example's peak, then every Monte Carlo point against the closed form."""
    lines = ["| mu | tau | peak N | peak probability |", "|---|---|---|---|"]
    for mu, tau in examples:
        n_star, p_star = miss_probability_peak(mu, tau, n_max)
        lines.append(f"| {mu:g} | {tau:g} | {n_star} | {p_star:.4f} |")
    lines += ["", "| mu | tau | N | closed form | Monte Carlo | standard error | z |", "|---|---|---|---|---|---|---|"]
    for p in points:
        z = (p.estimate - p.exact) / p.stderr if p.stderr > 0 else 0.0
        lines.append(f"| {p.mu:g} | {p.tau:g} | {p.n} | {p.exact:.4f} | {p.estimate:.4f} | {p.stderr:.4f} | {z:+.2f} |")
    return "\n".join(lines) + "\n"


def plot_lemma(path, examples: Sequence[tuple[float, float]], points: Sequence[LemmaPoint], n_max: int) -> None:
    """Lemma 3.1 figure: closed-form curves over N = 1 .. n_max (log axis), Monte Carlo points with 95% error
    bars (1.96 standard errors), each curve's peak marked and labelled."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5, 4.8), dpi=150, layout="constrained")
    axes = figure.subplots()
    group_sizes = np.arange(1, int(n_max) + 1)
    for mu, tau in examples:
        n_star, p_star = miss_probability_peak(mu, tau, n_max)
        (line,) = axes.plot(group_sizes, miss_probability(group_sizes, mu, tau), linewidth=1.8,
                            label=f"mu={mu:g}, tau={tau:g}: peak N={n_star}, {p_star:.3f}")
        mine = [p for p in points if p.mu == mu and p.tau == tau]
        axes.errorbar([p.n for p in mine], [p.estimate for p in mine], yerr=[1.96 * p.stderr for p in mine],
                      fmt="o", markersize=3.5, capsize=2.5, color=line.get_color(), linewidth=1)
        axes.plot([n_star], [p_star], marker="*", markersize=13, color=line.get_color(), markeredgecolor="black")
        axes.annotate(f"N={n_star}", (n_star, p_star), textcoords="offset points", xytext=(6, 6), fontsize="small")
    axes.set_xscale("log")
    axes.set_ylim(0.0, 1.05)
    axes.set_xlabel("group size N")
    axes.set_ylabel("P(active update and E unsampled)")
    axes.set_title("Lemma 3.1: lines closed form, points Monte Carlo (95% bars), stars peaks")
    axes.grid(True, which="major", alpha=0.35)
    axes.legend(loc="upper left", fontsize="small")
    _save(figure, path)


def _save(figure, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")


def describe_run(result: CategoricalResult) -> str:
    c = result.config
    return (f"optimizer {c.optimizer}, lr {c.lr:g}, weight decay {c.effective_weight_decay:g}, objective "
            f"{c.objective}, {c.steps} steps, {c.seeds} seeds, K={result.task.num_actions}, "
            f"C={result.task.num_correct}, {len(result.group_size)} rows")


def categorical_table(result: CategoricalResult) -> str:
    """Markdown: per N and gamma, the final Q_pos, retained mass and anchor mass (mean +- std over seeds)."""
    initial_q = float(result.q_pos[0, 0])
    lines = [
        f"{describe_run(result)}; Q_pos(0) = {initial_q:.4f}, anchor pi_0 = {result.anchor_mass[0, 0]:.2e}; "
        f"{result.seconds:.0f} s on {result.threads} thread(s).",
        "",
        "| N | gamma | Q_pos final | retained final | anchor mass final | active groups |",
        "|---:|---:|---|---|---|---:|",
    ]
    for r in summarise_categorical(result):
        lines.append(f"| {r.group_size} | {r.gamma:g} | {r.q_pos[0]:.4f} +- {r.q_pos[1]:.4f} | "
                     f"{r.retained[0]:.4f} +- {r.retained[1]:.4f} | {r.anchor_mass[0]:.4f} +- "
                     f"{r.anchor_mass[1]:.4f} | {100 * r.active_fraction:.1f}% |")
    return "\n".join(lines) + "\n"


def plot_categorical(result: CategoricalResult, path) -> None:
    """Four panels: final retained mass, final Q_pos and final anchor mass against N (mean +- std over
    seeds, one line per gamma), and the retained mass over the steps for a few N."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 8), dpi=130, layout="constrained")
    (ax_retained, ax_q), (ax_anchor, ax_time) = figure.subplots(2, 2)
    summary = summarise_categorical(result)
    for g in result.config.gammas:
        mine = [r for r in summary if r.gamma == g]
        ns = [r.group_size for r in mine]
        for axes, attribute in ((ax_retained, "retained"), (ax_q, "q_pos"), (ax_anchor, "anchor_mass")):
            means, stds = zip(*(getattr(r, attribute) for r in mine))
            axes.errorbar(ns, means, yerr=stds, marker="o", markersize=3.5, capsize=2.5, label=f"gamma={g:g}")
    titles = (("retained positive mass (final)", ax_retained), ("correct mass Q_pos (final)", ax_q),
              ("anchor probability (final)", ax_anchor))
    for title, axes in titles:
        axes.set_xscale("log", base=2)
        axes.set_xlabel("group size N")
        axes.set_title(title)
        axes.grid(True, alpha=0.35)
        axes.legend(fontsize="small")
    ax_q.axhline(result.q_pos[0, 0], color="grey", linestyle=":", linewidth=1)
    ax_retained.set_ylim(-0.02, 1.02)
    ax_q.set_ylim(-0.02, 1.02)

    sizes = list(result.config.group_sizes)
    shown = sorted({sizes[0], sizes[len(sizes) // 3], sizes[(2 * len(sizes)) // 3], sizes[-1]})
    colours = [f"C{i}" for i in range(len(shown))]
    for colour, n in zip(colours, shown):
        for g, style in zip(result.config.gammas, ("-", "--", ":", "-.")):
            mine = (result.group_size == n) & (result.gamma == g)
            ax_time.plot(result.record_steps, result.retained[mine].mean(axis=0), style, color=colour,
                         label=f"N={n}, gamma={g:g}")
    ax_time.set_xlabel("step")
    ax_time.set_title("retained positive mass over steps (mean over seeds)")
    ax_time.set_ylim(-0.02, 1.02)
    ax_time.grid(True, alpha=0.35)
    ax_time.legend(fontsize="x-small", ncol=2)
    figure.suptitle(f"Categorical simulation (section 5.1): {describe_run(result)}", fontsize="medium")
    _save(figure, path)


def save_arrays(result: CategoricalResult, path) -> None:
    """The raw curves as .npz (rows, record steps, q_pos, retained, anchor mass, active fraction)."""
    np.savez_compressed(path, group_size=result.group_size, gamma=result.gamma, seed_index=result.seed_index,
                        record_steps=result.record_steps, q_pos=result.q_pos, retained=result.retained,
                        anchor_mass=result.anchor_mass, active_fraction=result.active_fraction,
                        seconds=result.seconds)
