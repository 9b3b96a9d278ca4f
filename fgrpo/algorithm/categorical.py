"""The categorical simulation of F-GRPO's section 5.1 (arXiv 2602.06717, v2): a softmax bandit trained on
focal-weighted group rewards, many configurations at once.

A softmax policy over K actions (128,000), C of them correct (10,000; reward +1), the rest wrong (reward -1). Each
step draws a group of N actions from the policy, centres the rewards on the group mean (no std), scales them by
the focal weight g = (1 - mu_hat)^gamma (Eqs. 11-12, mu_hat = the group's share correct) and takes one optimiser
step on the logits that *ascends*

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

numpy and torch only; the figures and tables are in :mod:`fgrpo.evaluation.theory_figures`, the command line in
:mod:`fgrpo.theory`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = [
    "OBJECTIVES",
    "OPTIMIZERS",
    "CategoricalTask",
    "CategoricalConfig",
    "CategoricalResult",
    "SummaryRow",
    "power_of_two_group_sizes",
    "focal_weight_from_counts",
    "surrogate_gradient",
    "row_generators",
    "sample_group_counts",
    "make_optimizer",
    "correct_mass_metrics",
    "run_categorical",
    "summarise_categorical",
]


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
