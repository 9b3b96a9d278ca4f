"""The theory of F-GRPO (arXiv 2602.06717, v2) as runnable simulators: Lemma 3.1 and the categorical
simulation of section 5.1.

**Lemma 3.1.** A prompt's completions are correct with probability ``mu``; a subset E of the correct ones has
mass ``tau`` (0 < tau <= mu). With N samples, the update is *active* when the group has both correct and
wrong samples, and it *misses* E when no sample lands in E. The probability of both is

    (1 - tau)^N - (mu - tau)^N - (1 - mu)^N                      (Lemma 3.1)

It rises then falls in N: small groups are mostly inactive, large ones cover E.

**Categorical simulation (section 5.1).** A softmax policy over K actions (128,000), C of them correct
(10,000; reward +1), the rest wrong (reward -1). Each step draws a group of N actions from the policy, centres
the rewards on the group mean (no std), scales them by the focal weight g = (1 - mu_hat)^gamma (Eqs. 11-12,
mu_hat = the group's share correct) and takes one optimiser step on the logits that *ascends*

    J(z) = (g / N) sum_j rtilde_j log pi_z(a_j)                  (objective "logprob", the default)

whose gradient is ``(g / N) sum_a count_a rtilde_a (e_a - pi)``: the policy gradient, what GRPO's ratio
surrogate (Eq. 14) gives at the sampling policy. The paper notes write the ascended quantity as
``(1/N) sum_j rtilde_j p_j``; reading ``p_j`` literally as the probability pi(a_j) gives the objective
"prob", ``J(z) = (g / N) sum_j rtilde_j pi_z(a_j)``, whose gradient weights each sample by its probability.
Both are here; see docs/theory.md for which one the results use and why.

Layout of the action space: actions ``0 .. C-1`` are the correct ones, action 0 the "anchor" (initial logit
5.0, the others 3.0), actions ``C .. K-1`` are wrong (logit 0.0). A grid of configurations (group size N,
gamma, seed) runs as the rows of one ``[B, K]`` logit tensor; every operation is per row (softmax, sampling,
gradient; Adam and AdamW are elementwise), so a row's trajectory does not depend on the other rows.

Command line: ``python -m fgrpo.theory lemma|categorical --help``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = [
    "miss_probability",
    "simulate_miss_probability",
    "miss_probability_peak",
    "PAPER_EXAMPLES",
    "LemmaPoint",
    "lemma_points",
    "CategoricalTask",
    "CategoricalConfig",
    "CategoricalResult",
    "OBJECTIVES",
    "OPTIMIZERS",
    "power_of_two_group_sizes",
    "focal_weight_from_counts",
    "surrogate_gradient",
    "sample_group_counts",
    "make_optimizer",
    "correct_mass_metrics",
    "run_categorical",
    "summarise_categorical",
    "main",
]


# --------------------------------------------------------------------------------------------------------------
# Lemma 3.1
# --------------------------------------------------------------------------------------------------------------

PAPER_EXAMPLES: tuple[tuple[float, float], ...] = ((0.5, 0.05), (0.3, 0.015), (0.2, 0.002))
"""(mu, tau) of the paper's three Lemma 3.1 examples; their peaks: N=5 (0.724), N~9 (0.83), N~21 (0.95)."""


def _check(n, mu: float, tau: float) -> np.ndarray:
    n_arr = np.asarray(n)
    if not np.issubdtype(n_arr.dtype, np.integer) or (n_arr < 1).any():
        raise ValueError(f"n must be a positive integer (or array of them), got {n!r}")
    if not 0.0 < mu <= 1.0:
        raise ValueError(f"mu must be in (0, 1], got {mu}")
    if not 0.0 < tau <= mu:
        raise ValueError(f"tau must be in (0, mu={mu}], got {tau}")
    return n_arr


def miss_probability(n, mu: float, tau: float):
    """Lemma 3.1: ``(1 - tau)^N - (mu - tau)^N - (1 - mu)^N``; ``n`` may be an int or an int array."""
    n_arr = _check(n, mu, tau).astype(np.float64)
    value = (1.0 - tau) ** n_arr - (mu - tau) ** n_arr - (1.0 - mu) ** n_arr
    value = np.maximum(value, 0.0)  # N = 1 is exactly 0; rounding can leave -1e-17
    return float(value) if np.ndim(value) == 0 else value


def simulate_miss_probability(n: int, mu: float, tau: float, trials: int, seed: int = 0) -> float:
    """Monte Carlo estimate of the Lemma 3.1 event: the group is active and E got no sample.

    Each trial draws N completions from three outcomes: in E (mass tau), correct outside E
    (mu - tau), wrong (1 - mu). Vectorised over trials. Its standard error is
    ``sqrt(p (1 - p) / trials)``.
    """
    _check(n, mu, tau)
    if int(trials) < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(int(n), [tau, mu - tau, max(0.0, 1.0 - mu)], size=int(trials))
    in_rare, correct_other, wrong = counts[:, 0], counts[:, 1], counts[:, 2]
    correct = in_rare + correct_other
    active = (correct > 0) & (wrong > 0)
    return float(np.mean(active & (in_rare == 0)))


def miss_probability_peak(mu: float, tau: float, n_max: int = 10_000) -> tuple[int, float]:
    """The integer N in ``1 .. n_max`` where Lemma 3.1's probability is largest, and that probability."""
    group_sizes = np.arange(1, int(n_max) + 1)
    curve = miss_probability(group_sizes, mu, tau)
    best = int(np.argmax(curve))
    return int(group_sizes[best]), float(curve[best])


@dataclass(frozen=True)
class LemmaPoint:
    """One Monte Carlo point of the Lemma 3.1 figure next to the closed form."""

    mu: float
    tau: float
    n: int
    exact: float
    estimate: float
    stderr: float  # of the estimate, sqrt(p (1 - p) / trials) with p the closed form


def lemma_points(
    examples: Sequence[tuple[float, float]], group_sizes: Sequence[int], trials: int, seed: int = 0
) -> list[LemmaPoint]:
    """Monte Carlo estimates of Lemma 3.1 at ``group_sizes`` for each (mu, tau), with the closed form.

    Each (example, N) gets its own seed, derived from ``seed``, so adding a point changes no other.
    """
    points = []
    for example_index, (mu, tau) in enumerate(examples):
        for n in group_sizes:
            point_seed = np.random.SeedSequence([seed, example_index, int(n)]).generate_state(1)[0]
            exact = miss_probability(int(n), mu, tau)
            estimate = simulate_miss_probability(int(n), mu, tau, trials=trials, seed=int(point_seed))
            stderr = math.sqrt(max(exact * (1.0 - exact), 0.0) / trials)
            points.append(LemmaPoint(mu, tau, int(n), exact, estimate, stderr))
    return points


def log_spaced_group_sizes(n_max: int, count: int = 16) -> list[int]:
    """About ``count`` distinct integers from 1 to ``n_max``, evenly spaced on a log axis."""
    return sorted({int(round(x)) for x in np.geomspace(1, n_max, count)})


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


# --------------------------------------------------------------------------------------------------------------
# Categorical simulation (section 5.1)
# --------------------------------------------------------------------------------------------------------------

OBJECTIVES = ("logprob", "prob")
OPTIMIZERS = ("sgd", "adam", "adamw")


@dataclass(frozen=True)
class CategoricalTask:
    """The bandit of section 5.1: K actions, the first C correct (action 0 the anchor), the rest wrong."""

    num_actions: int = 128_000
    num_correct: int = 10_000
    anchor_logit: float = 5.0
    correct_logit: float = 3.0
    incorrect_logit: float = 0.0
    r_correct: float = 1.0
    r_wrong: float = -1.0

    def __post_init__(self):
        if not 1 <= self.num_correct < self.num_actions:
            raise ValueError(f"need 1 <= correct < actions (at least one wrong action), got correct="
                             f"{self.num_correct}, actions={self.num_actions}")
        if self.r_correct <= self.r_wrong:
            raise ValueError(f"r_correct must exceed r_wrong, got {self.r_correct} <= {self.r_wrong}")

    def initial_logits(self) -> torch.Tensor:
        """``[K]`` float64: anchor, other correct, wrong."""
        logits = torch.full((self.num_actions,), self.incorrect_logit, dtype=torch.float64)
        logits[: self.num_correct] = self.correct_logit
        logits[0] = self.anchor_logit
        return logits

    def rewards(self) -> torch.Tensor:
        """``[K]`` float64 reward of each action."""
        rewards = torch.full((self.num_actions,), self.r_wrong, dtype=torch.float64)
        rewards[: self.num_correct] = self.r_correct
        return rewards


def power_of_two_group_sizes(n_min: int, n_max: int) -> tuple[int, ...]:
    """``n_min, 2 n_min, ..., n_max``; both must be powers of two, 2 <= n_min <= n_max."""
    for name, value in (("n_min", n_min), ("n_max", n_max)):
        if not isinstance(value, int) or value < 2 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 2, got {value!r}")
    if n_min > n_max:
        raise ValueError(f"n_min={n_min} exceeds n_max={n_max}")
    return tuple(2**e for e in range(n_min.bit_length() - 1, n_max.bit_length()))


@dataclass(frozen=True)
class CategoricalConfig:
    """One grid: every (group size, gamma, seed) runs ``steps`` optimiser steps with one optimiser and lr."""

    optimizer: str = "adamw"
    lr: float = 1e-2
    weight_decay: float | None = None  # None: 0.01 for adamw (the paper's LLM runs), 0 for sgd and adam
    steps: int = 1000
    seeds: int = 4
    seed: int = 0
    group_sizes: tuple[int, ...] = power_of_two_group_sizes(2, 131_072)
    gammas: tuple[float, ...] = (0.0, 1.0)
    objective: str = "logprob"
    record_every: int = 10

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if isinstance(self.lr, bool) or not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr)
                                             and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if self.weight_decay is not None and not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        for name in ("steps", "seeds", "record_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.group_sizes or any(not isinstance(n, int) or n < 1 for n in self.group_sizes):
            raise ValueError(f"group_sizes must be integers >= 1, got {self.group_sizes!r}")
        if not self.gammas or any(not (math.isfinite(g) and g >= 0) for g in self.gammas):
            raise ValueError(f"gammas must be numbers >= 0, got {self.gammas!r}")

    @property
    def effective_weight_decay(self) -> float:
        if self.weight_decay is not None:
            return float(self.weight_decay)
        return 0.01 if self.optimizer == "adamw" else 0.0

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The grid as rows, ordered by (N, gamma, seed): ``[B]`` group sizes, gammas, seed indices."""
        grid = [(n, g, s) for n in self.group_sizes for g in self.gammas for s in range(self.seeds)]
        group_size, gamma, seed_index = zip(*grid)
        return np.array(group_size, np.int64), np.array(gamma, np.float64), np.array(seed_index, np.int64)


def focal_weight_from_counts(num_correct: torch.Tensor, group_size: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """F-GRPO's focal weight of each group, Eqs. 11-12: ``g = (1 - mu_hat)^gamma``, ``mu_hat = #correct / N``.

    All arguments ``[B]``; returns ``[B]`` float64. gamma = 0 gives 1 for every group, all-correct ones
    included (0^0 = 1), as in :func:`fgrpo.algorithm.advantages.focal_weight`.
    """
    success_rate = num_correct.to(torch.float64) / group_size.to(torch.float64)
    return torch.pow(1.0 - success_rate, gamma.to(torch.float64))


def surrogate_gradient(
    probs: torch.Tensor,
    counts: torch.Tensor,
    rewards: torch.Tensor,
    gamma: torch.Tensor,
    *,
    objective: str = "logprob",
    r_correct: float = 1.0,
    r_wrong: float = -1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient wrt the logits of the focal-weighted group surrogate, per row (section 5.1, Eqs. 11-13).

    Args:
        probs: ``[B, K]`` the policy pi = softmax(logits) the group was drawn from.
        counts: ``[B, K]`` float, how often each action was drawn; row sums are the group sizes N (>= 1).
        rewards: ``[K]`` reward of each action, ``r_correct`` or ``r_wrong``.
        gamma: ``[B]`` focal exponent of each row.
        objective: "logprob": J = (g/N) sum_j rtilde_j log pi(a_j), gradient
            ``(g/N) sum_a count_a rtilde_a (e_a - pi)``; "prob": J = (g/N) sum_j rtilde_j pi(a_j), gradient
            ``(g/N) sum_a count_a rtilde_a pi_a (e_a - pi)``.
        out: ``[B, K]`` float64 buffer to write into (the simulator reuses one: fresh 100 MB tensors cost more
            than the arithmetic).

    Returns:
        ``[B, K]`` float64 gradient of J (ascend it). rtilde = R - mean(R) over the group, no std division;
        g = (1 - mu_hat)^gamma depends on the rewards only (no gradient through it). For "logprob" the
        ``- pi sum(...)`` term is zero (the centred rewards of a group sum to zero), so it is left out.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    group_size = counts.sum(dim=-1)
    if (group_size < 1).any():
        raise ValueError("every row of counts must hold at least one sample")
    mean_reward = (counts @ rewards) / group_size  # exact: integer counts times +-1 rewards
    num_correct = torch.round(group_size * (mean_reward - r_wrong) / (r_correct - r_wrong))
    scale = focal_weight_from_counts(num_correct, group_size, gamma) / group_size  # g / N, [B]
    # count_a (R_a - mean R) g / N: the coefficient of e_a. One fused pass builds (R_a - mean R) g / N.
    out = torch.addcmul((-mean_reward * scale).unsqueeze(1), rewards.unsqueeze(0), scale.unsqueeze(1), out=out)
    out.mul_(counts)
    if objective == "logprob":
        # the -pi sum_a(...) term vanishes: a group's centred rewards sum to zero (up to rounding, ~1e-16)
        return out
    out.mul_(probs)
    return out.addcmul_(probs, out.sum(dim=-1, keepdim=True), value=-1.0)


def row_generators(seed: int, seed_index: np.ndarray, group_size: np.ndarray) -> list[np.random.Generator]:
    """One numpy generator per row, keyed by (seed, seed index, N): the gamma = 0 and gamma = 1 rows of a
    configuration share their random stream (a paired comparison), and no row's stream depends on the grid."""
    return [np.random.default_rng(np.random.SeedSequence([seed, int(s), int(n)]))
            for s, n in zip(seed_index, group_size, strict=True)]


def sample_group_counts(
    cdf: torch.Tensor,
    group_size: np.ndarray,
    generators: Sequence[np.random.Generator],
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw each row's group and count it: ``counts[b, a]`` = how many of row b's N_b samples are action a.

    Args:
        cdf: ``[B, K]`` float64 cumulative sums of each row's probabilities (last column ~1).
        group_size: ``[B]`` N of each row.
        generators: one per row.
        out: ``[B, K]`` float64 buffer.

    Exact multinomial sampling by inversion: each row's N uniforms come already sorted (normalised partial
    sums of N + 1 exponentials are distributed as uniform order statistics); numpy's searchsorted narrows
    each search with the previous result when the keys are sorted, 3-4x faster here than unsorted keys.
    The counts depend only on the multiset of draws, so sorting changes nothing in distribution.
    """
    batch, num_actions = cdf.shape
    cdf_rows = cdf.numpy()
    flat_indices = []
    for row in range(batch):
        partial_sums = np.cumsum(generators[row].standard_exponential(int(group_size[row]) + 1))
        sorted_uniforms = partial_sums[:-1] * (cdf_rows[row, -1] / partial_sums[-1])
        actions = np.searchsorted(cdf_rows[row], sorted_uniforms, side="right")
        np.minimum(actions, num_actions - 1, out=actions)  # a uniform rounded onto the last edge
        flat_indices.append(actions + row * num_actions)
    flat = torch.from_numpy(np.concatenate(flat_indices))
    if out is None:
        out = torch.empty(batch, num_actions, dtype=torch.float64)
    out.zero_()
    out.view(-1).index_put_((flat,), torch.ones((), dtype=torch.float64).expand(flat.numel()), accumulate=True)
    return out


def make_optimizer(name: str, parameter: torch.Tensor, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """torch's SGD, Adam (L2 ``weight_decay``) or AdamW (decoupled) on the batched ``[B, K]`` logits.

    All three are elementwise, so rows stay independent; no gradient-norm clipping (a global norm would mix
    the rows). Adam and AdamW use betas (0.9, 0.999) and eps 1e-8, the fused CPU kernel where available.
    """
    if name == "sgd":
        return torch.optim.SGD([parameter], lr=lr, weight_decay=weight_decay)
    if name not in ("adam", "adamw"):
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    optimizer_class = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    try:
        return optimizer_class([parameter], lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, TypeError):  # no fused kernel for this device or dtype
        return optimizer_class([parameter], lr=lr, weight_decay=weight_decay)


def correct_mass_metrics(
    probs: torch.Tensor, initial_correct_probs: torch.Tensor, num_correct: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The section 5.1 metrics of each row.

    Args:
        probs: ``[B, K]`` current policy; correct actions first.
        initial_correct_probs: ``[C]`` pi_0 of the correct actions.

    Returns:
        ``[B]`` each: correct mass Q_pos = sum_{a correct} pi(a); retained positive mass
        ``1 - sum_{a correct} max(0, pi_0(a) - pi(a)) / Q_pos(0)``; the anchor's probability pi(0).
    """
    correct_probs = probs[:, :num_correct]
    lost = (initial_correct_probs.unsqueeze(0) - correct_probs).clamp_(min=0.0).sum(dim=-1)
    return correct_probs.sum(dim=-1), 1.0 - lost / initial_correct_probs.sum(), probs[:, 0].clone()


def _softmax_into(logits: torch.Tensor, probs: torch.Tensor, cdf: torch.Tensor) -> None:
    """probs = softmax(logits) row by row and cdf = its cumulative sums, in place (no fresh [B, K] tensors)."""
    torch.ops.aten._softmax.out(logits, -1, False, out=probs)  # torch.softmax has no out=
    torch.cumsum(probs, dim=-1, out=cdf)


@dataclass
class CategoricalResult:
    """What :func:`run_categorical` measured. Row b is (group_size[b], gamma[b], seed_index[b])."""

    task: CategoricalTask
    config: CategoricalConfig
    group_size: np.ndarray  # [B]
    gamma: np.ndarray  # [B]
    seed_index: np.ndarray  # [B]
    record_steps: np.ndarray  # [T] steps at which the metrics were taken (0 = before training)
    q_pos: np.ndarray  # [B, T] correct mass
    retained: np.ndarray  # [B, T] retained positive mass
    anchor_mass: np.ndarray  # [B, T] probability of the anchor action
    active_fraction: np.ndarray  # [B] share of steps whose group had both correct and wrong samples
    seconds: float
    threads: int
    meta: dict = field(default_factory=dict)


def run_categorical(
    task: CategoricalTask,
    config: CategoricalConfig,
    *,
    threads: int | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> CategoricalResult:
    """Run the section 5.1 simulation for every (N, gamma, seed) of ``config`` at once, as rows of ``[B, K]``.

    ``threads`` sets torch's intra-op threads for the call (restored after). ``progress(step, seconds)`` is
    called every ``config.record_every`` steps.
    """
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        return _run_categorical(task, config, progress)
    finally:
        torch.set_num_threads(previous_threads)


def _run_categorical(task, config, progress) -> CategoricalResult:
    started = time.perf_counter()
    group_size, gamma, seed_index = config.rows()
    batch, num_actions = len(group_size), task.num_actions
    logits = task.initial_logits().unsqueeze(0).repeat(batch, 1)  # [B, K], the optimised parameter
    rewards = task.rewards()
    gamma_t = torch.from_numpy(gamma)
    probs, cdf, counts, gradient = (torch.empty(batch, num_actions, dtype=torch.float64) for _ in range(4))
    initial_correct_probs = torch.softmax(task.initial_logits(), dim=-1)[: task.num_correct]
    optimizer = make_optimizer(config.optimizer, logits, config.lr, config.effective_weight_decay)
    generators = row_generators(config.seed, seed_index, group_size)

    record_steps = sorted(set(range(0, config.steps + 1, config.record_every)) | {config.steps})
    q_pos, retained, anchor = (np.empty((batch, len(record_steps))) for _ in range(3))
    active_steps = torch.zeros(batch, dtype=torch.float64)

    def record(column: int) -> None:
        metrics = correct_mass_metrics(probs, initial_correct_probs, task.num_correct)
        for table, values in zip((q_pos, retained, anchor), metrics, strict=True):
            table[:, column] = values.numpy()

    _softmax_into(logits, probs, cdf)
    record(0)
    column = 1
    group_size_t = torch.from_numpy(group_size).to(torch.float64)
    for step in range(1, config.steps + 1):
        sample_group_counts(cdf, group_size, generators, out=counts)
        surrogate_gradient(probs, counts, rewards, gamma_t, objective=config.objective,
                           r_correct=task.r_correct, r_wrong=task.r_wrong, out=gradient)
        num_correct = counts[:, : task.num_correct].sum(dim=-1)
        active_steps += ((num_correct > 0) & (num_correct < group_size_t)).to(torch.float64)
        logits.grad = gradient.neg_()  # torch's optimisers minimise -J
        optimizer.step()
        _softmax_into(logits, probs, cdf)
        if column < len(record_steps) and step == record_steps[column]:
            record(column)
            column += 1
            if progress is not None:
                progress(step, time.perf_counter() - started)
    return CategoricalResult(
        task=task, config=config, group_size=group_size, gamma=gamma, seed_index=seed_index,
        record_steps=np.array(record_steps), q_pos=q_pos, retained=retained, anchor_mass=anchor,
        active_fraction=(active_steps / config.steps).numpy(), seconds=time.perf_counter() - started,
        threads=torch.get_num_threads(),
    )


@dataclass(frozen=True)
class SummaryRow:
    """Final metrics of one (N, gamma), mean and std (ddof 0) over seeds."""

    group_size: int
    gamma: float
    q_pos: tuple[float, float]
    retained: tuple[float, float]
    anchor_mass: tuple[float, float]
    active_fraction: float


def summarise_categorical(result: CategoricalResult, column: int = -1) -> list[SummaryRow]:
    """One row per (N, gamma) at record column ``column`` (default: the end), over seeds."""
    rows = []
    for n in result.config.group_sizes:
        for g in result.config.gammas:
            mine = (result.group_size == n) & (result.gamma == g)

            def stat(table):
                values = table[mine, column]
                return float(values.mean()), float(values.std())

            rows.append(SummaryRow(int(n), float(g), stat(result.q_pos), stat(result.retained),
                                   stat(result.anchor_mass), float(result.active_fraction[mine].mean())))
    return rows


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


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------

def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fgrpo.theory", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    lemma = commands.add_parser("lemma", help="Lemma 3.1 figure: closed form, Monte Carlo points, peaks")
    lemma.add_argument("--n-max", type=_positive(int), default=1000, help="largest N on the curve (default 1000)")
    lemma.add_argument("--trials", type=_positive(int), default=20_000, help="Monte Carlo groups per point")
    lemma.add_argument("--seed", type=int, default=0)
    lemma.add_argument("--out", type=Path, default=Path("outputs/theory"), help="folder for the PNG and table")

    cat = commands.add_parser("categorical", help="section 5.1 simulation over the (N, gamma, seed) grid")
    cat.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    cat.add_argument("--lr", type=_positive(float), nargs="+", default=[1e-2],
                     help="learning rate; several run one after another (default 1e-2)")
    cat.add_argument("--weight-decay", type=_non_negative_float, default=None,
                     help="default: 0.01 for adamw, 0 for sgd and adam")
    cat.add_argument("--objective", choices=OBJECTIVES, default="logprob",
                     help="ascend sum rtilde log pi (logprob, default) or sum rtilde pi (prob)")
    cat.add_argument("--steps", type=_positive(int), default=1000)
    cat.add_argument("--seeds", type=_positive(int), default=4, help="seeds per (N, gamma)")
    cat.add_argument("--seed", type=int, default=0, help="base seed")
    cat.add_argument("--n-min", type=_positive(int), default=2, help="smallest group size, a power of two")
    cat.add_argument("--n-max", type=_positive(int), default=131_072, help="largest group size, a power of two")
    cat.add_argument("--gammas", type=_non_negative_float, nargs="+", default=[0.0, 1.0])
    cat.add_argument("--actions", type=_positive(int), default=128_000, help="number of actions K")
    cat.add_argument("--correct", type=_positive(int), default=10_000, help="number of correct actions C")
    cat.add_argument("--record-every", type=_positive(int), default=10, help="steps between metric records")
    cat.add_argument("--threads", type=_positive(int), default=1,
                     help="torch threads (default 1: as fast as 2 on the 2-core test machine, see docs/theory.md)")
    cat.add_argument("--out", type=Path, default=Path("outputs/theory"), help="folder for PNG, table, npz")
    return parser


def _run_lemma_command(args) -> list[Path]:
    group_sizes = log_spaced_group_sizes(args.n_max)
    points = lemma_points(PAPER_EXAMPLES, group_sizes, trials=args.trials, seed=args.seed)
    png, table = args.out / "theory-lemma.png", args.out / "theory-lemma.md"
    plot_lemma(png, PAPER_EXAMPLES, points, args.n_max)
    table.write_text(lemma_table(points, PAPER_EXAMPLES, args.n_max))
    return [png, table]


def _run_categorical_command(args) -> list[Path]:
    task = CategoricalTask(num_actions=args.actions, num_correct=args.correct)
    written = []
    for lr in args.lr:
        config = CategoricalConfig(
            optimizer=args.optimizer, lr=lr, weight_decay=args.weight_decay, steps=args.steps, seeds=args.seeds,
            seed=args.seed, group_sizes=power_of_two_group_sizes(args.n_min, args.n_max),
            gammas=tuple(args.gammas), objective=args.objective, record_every=args.record_every,
        )

        def progress(step, seconds, total=config.steps):
            if step % max(1, total // 10) < config.record_every:
                print(f"  step {step}/{total}  {seconds:.0f} s", file=sys.stderr, flush=True)

        print(f"categorical: {config.optimizer} lr {lr:g} ...", file=sys.stderr, flush=True)
        result = run_categorical(task, config, threads=args.threads, progress=progress)
        stem = f"theory-categorical-{config.optimizer}-lr{lr:g}-{config.objective}"
        args.out.mkdir(parents=True, exist_ok=True)
        png, table, arrays = (args.out / f"{stem}{suffix}" for suffix in (".png", ".md", ".npz"))
        plot_categorical(result, png)
        table.write_text(categorical_table(result))
        save_arrays(result, arrays)
        print(f"  {result.seconds:.1f} s ({result.seconds / config.steps:.3f} s per step, {result.threads} "
              f"thread(s))", file=sys.stderr)
        written += [png, table, arrays]
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        written = _run_lemma_command(args) if args.command == "lemma" else _run_categorical_command(args)
    except ValueError as error:
        parser.error(str(error))  # exits with status 2 and the usage line
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
