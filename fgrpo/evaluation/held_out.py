"""Held-out evaluation: unbiased pass@k with confidence intervals (fgrpo.evaluation.pass_at_k) on each evaluation set, and the
per-problem correct counts behind it (``eval_counts.jsonl``), from which any two evaluations can be compared later
(fgrpo.compare). A problem with a sample that every reward function skipped (returned None) is left out and counted."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from fgrpo.evaluation.pass_at_k import pass_at_k_curve
from fgrpo.infra.distributed import SINGLE, Ranks, gather_objects
from fgrpo.infra.errors import RewardError
from fgrpo.infra.run_files import COUNTS_FILE
from fgrpo.rewards.scoring import Scorer
from fgrpo.rollout.data import Problem
from fgrpo.rollout.episodes import draw_groups, episode_metrics
from fgrpo.rollout.rollouts import Groups, prompt_seeds, reward_call_metrics

Curve = list[tuple[int, float, float, float]]  # (k, pass@k, ci_low, ci_high)
TRANSCRIPT_PROBLEMS = 4  # an environment's evaluation keeps one episode of each of this many problems per set
# COUNTS_FILE: one JSON row per problem per evaluation, {"step", "dataset", "problem", "n", "c"} (c of the n samples
# correct; step: the training step evaluated, null for a model evaluated on its own without one)


def evaluate(sampler, eval_sets: dict[str, list[Problem]], prompt_ids: dict[str, list[int]], scorer: Scorer, *,
             n_samples: int, max_problems: int, max_new_tokens: int, temperature: float, top_p: float,
             seed: int, ranks: Ranks = SINGLE, environment=None,
             transcripts: dict | None = None) -> tuple[dict[str, float], Curve, list[dict]]:
    """pass@k for k = 1, 2, 4, ..., ``n_samples`` on the first ``max_problems`` of each set.

    ``environment`` (fgrpo.rollout.episodes): episodes instead of single samples, their metrics (``eval/<set>/env/``)
    too, and, given ``transcripts`` (a dict), one episode of each of the first few problems per set (``set -> [(problem
    id, EpisodeRecord)]``).

    Several ranks (fgrpo.infra.distributed): each vLLM engine samples its share of the problems (the last one repeated to
    an equal count per engine: the HF sampler's sharded forwards must match), and every rank gets all the counts.

    Returns the metrics (``eval/<set>/pass@k`` with ``_ci_low`` / ``_ci_high``, ``eval/pass@k`` averaging the sets,
    each reward function's mean ``eval/<set>/reward/<name>``, ``eval/<set>/skipped_problems`` and ``reward_errors``,
    ``perf/eval_time_s``), the curve to plot (the set's own, or with several sets their average) and the per-problem
    counts (rows of :data:`COUNTS_FILE` without the step).
    """
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    curves: dict[str, Curve] = {}
    count_rows: list[dict] = []
    for name, problems in eval_sets.items():
        problems = problems[:max_problems]
        padded = problems + problems[-1:] * (-len(problems) % ranks.data_parallel_size)
        groups = draw_groups(sampler, ranks.share(padded, of_engine=True), prompt_ids, scorer, environment,
                             group_size=n_samples, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             seed=ranks.share(prompt_seeds(seed, len(padded)), of_engine=True), ranks=ranks,
                             progress=_bar_label(name, len(problems), n_samples, ranks))
        # one engine's ranks drew the same: the problems of the first rank of each engine, in order
        mine = (_per_problem(groups), groups.reward_errors) if ranks.rank % ranks.tensor_parallel == 0 else ([], 0)
        parts = gather_objects(mine)
        outcomes = sum((rows for rows, _ in parts), [])[: len(problems)]
        kept = [(problem, count) for problem, (count, _) in zip(problems, outcomes) if count is not None]
        if not kept:
            raise RewardError(f"the reward functions skipped every one of the {len(problems)} problems of eval set "
                              f"{name!r} (each had a sample for which every function returned None): nothing to "
                              "evaluate; return a value for them, or None only where a sample cannot be scored")
        counts = [count for _, count in kept]
        count_rows += [{"dataset": name, "problem": p.id, "n": n_samples, "c": c} for p, c in kept]
        curves[name] = [(pt.k, pt.mean, pt.ci_low, pt.ci_high) for pt in pass_at_k_curve(counts, n_samples, seed=seed)]
        for k, mean, low, high in curves[name]:
            metrics.update({f"eval/{name}/pass@{k}": mean, f"eval/{name}/pass@{k}_ci_low": low,
                            f"eval/{name}/pass@{k}_ci_high": high})
        metrics.update(_reward_metrics(name, outcomes))
        metrics[f"eval/{name}/reward_errors"] = float(sum(errors for _, errors in parts))
        metrics.update(reward_call_metrics(groups, f"eval/{name}", ranks))
        if environment is not None:  # turns, tool calls, truncations; a few transcripts
            metrics.update(episode_metrics(groups, f"eval/{name}"))
            if transcripts is not None:  # the first sample of the first few problems (this rank's)
                transcripts[name] = [(p.id, group[0].episode) for p, group in
                                     zip(groups.problems[:TRANSCRIPT_PROBLEMS], groups.completions)]
    ks = [k for k, *_ in next(iter(curves.values()))]
    for k in ks:
        for suffix in ("", "_ci_low", "_ci_high"):
            metrics[f"eval/pass@{k}{suffix}"] = float(np.mean([metrics[f"eval/{name}/pass@{k}{suffix}"]
                                                               for name in curves]))
    metrics["perf/eval_time_s"] = time.perf_counter() - start
    if len(curves) == 1:
        return metrics, next(iter(curves.values())), count_rows
    return metrics, [(k, metrics[f"eval/pass@{k}"], metrics[f"eval/pass@{k}_ci_low"],
                      metrics[f"eval/pass@{k}_ci_high"]) for k in ks], count_rows


def _bar_label(name: str, problems: int, n_samples: int, ranks: Ranks) -> str | None:
    """The evaluation's progress bar label, on the first rank only (one bar per run, not one per rank)."""
    return f"evaluating {name} ({problems} x {n_samples})" if ranks.rank == 0 else None


ProblemOutcome = tuple  # (correct count or None where skipped, {reward name: (sum, samples)})


def _per_problem(groups: Groups) -> list[ProblemOutcome]:
    """Each problem's correct count (None: skipped) and its reward functions' value sums over its samples."""
    counts = groups.correct.sum(dim=1).int().tolist()
    return [(None if skipped else count,
             {reward: (float(np.nansum(values[row].numpy())), int((~values[row].isnan()).sum()))
              for reward, values in groups.values.items()})
            for row, (count, skipped) in enumerate(zip(counts, groups.skipped.tolist()))]


def _reward_metrics(name: str, outcomes: list[ProblemOutcome]) -> dict[str, float]:
    """``eval/<set>/reward/<function>`` (mean over the samples of the problems kept) and ``skipped_problems``."""
    totals: dict[str, list[float]] = {}
    for count, sums in outcomes:
        if count is None:
            continue
        for reward, (total, samples) in sums.items():
            running = totals.setdefault(reward, [0.0, 0])
            running[0] += total
            running[1] += samples
    metrics = {f"eval/{name}/reward/{reward}": total / samples for reward, (total, samples) in totals.items()
               if samples}
    metrics[f"eval/{name}/skipped_problems"] = float(sum(count is None for count, _ in outcomes))
    return metrics


def append_counts(run_dir: Path, step: int | None, count_rows: list[dict]) -> None:
    """Add one evaluation's per-problem counts to ``run_dir``/eval_counts.jsonl, flushed to disk (a crash keeps
    every evaluation before it)."""
    with open(Path(run_dir) / COUNTS_FILE, "a", encoding="utf-8") as file:
        file.writelines(json.dumps({"step": step, **row}) + "\n" for row in count_rows)
        file.flush()
        os.fsync(file.fileno())
