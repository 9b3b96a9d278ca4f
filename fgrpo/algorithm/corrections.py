"""The sampler is not the learner: what their log-probs of the same tokens say, and how the loss corrects for it.

The sampler (vLLM, bf16 kernels) draws the tokens; the learner (its own weights, dtype and kernels) recomputes their
log-probs and uses those as the old policy. Where the two differ the update is off-policy without knowing it
("Your efficient RL framework secretly brings you off-policy RL training", Yao et al., 2025). This module measures the
difference and builds the peers' corrections, each a pure function on ``[B, T]`` tensors:

- ``logp``: the learner's log-probs (current, with grad); ``old_logp``: the learner's before the update (detached);
  ``sampler_logp``: the sampler's of the same tokens; ``mask``: 1 on the tokens the loss counts.
- the mismatch ratio per token ``rho_t = pi_old(y_t) / pi_sampler(y_t)``; per sequence ``rho = prod_t rho_t``.

docs/algorithm.md writes each as an equation beside its config key.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ROLLOUT_CORRECTIONS", "RATIO_LEVELS", "SEQUENCE_FORMS", "rollout_weights", "mismatch_sums", "MISMATCH_SUMS",
           "mismatch_metrics", "sequence_ratio", "off_policy_keep"]

# algo.rollout_correction: the weight's level (token or sequence) and what happens beyond the bounds
ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
RATIO_LEVELS = ("token", "sequence")  # algo.ratio_level: the policy ratio per token (PPO) or per sequence (GSPO)
# the losses whose ratio has a sequence form (fgrpo.algorithm.losses): PPO's clip on it is GSPO; CISPO's clamped,
# detached weight on it is well defined too (the sequence's weight on each of its tokens' log-prob)
SEQUENCE_FORMS = ("grpo", "dapo", "gspo", "cispo")


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(dim=-1)


def _log_bounds(low: float, high: float) -> tuple[float, float]:
    """The bounds in log space, as numbers (a CPU tensor as clamp's bound would not reach a CUDA tensor)."""
    return math.log(low), math.log(high)


def rollout_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str, *,
                    low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weight on each token's loss and which tokens stay in it, both ``[B, T]``, no grad.

    - ``token_truncate`` (TIS): ``w_t = min(rho_t, high)``; every token stays.
    - ``token_mask`` (MIS): ``w_t = rho_t`` where ``low <= rho_t <= high``; the other tokens leave the loss.
    - ``sequence_truncate``: every token of a sequence ``w = min(rho, high)``, ``rho = exp(sum_t log rho_t)``.
    - ``sequence_mask``: ``w = rho`` where ``low <= rho <= high``; the other sequences leave the loss whole.
    The ratio is computed in log space and clamped there, so a product over a long sequence does not overflow.
    """
    if mode not in ROLLOUT_CORRECTIONS or mode == "none":
        raise ValueError(f"mode must be one of {ROLLOUT_CORRECTIONS[1:]}, got {mode!r}")
    if not 0 < low <= 1 <= high:
        raise ValueError(f"the bounds must satisfy 0 < low <= 1 <= high, got low={low}, high={high}")
    mask = mask.bool()
    with torch.no_grad():
        log_rho = (old_logp - sampler_logp).masked_fill(~mask, 0.0)
        if mode.startswith("sequence"):
            log_rho = log_rho.sum(dim=-1, keepdim=True).expand_as(log_rho)
        # in log space: exp of a sequence's summed log ratio can overflow; the bounds are what matters
        log_low, log_high = _log_bounds(low, high)
        if mode.endswith("truncate"):
            return torch.exp(torch.clamp(log_rho, max=log_high)), mask
        inside = (log_rho >= log_low) & (log_rho <= log_high)
        return torch.where(inside, torch.exp(log_rho), torch.zeros_like(log_rho)), mask & inside


# what mismatch_sums returns, in order: sums over tokens or sequences, added over micro-batches and ranks
MISMATCH_SUMS = ("tokens", "seqs", "k3", "abs_log_ratio", "tokens_out", "seqs_out")


def mismatch_sums(learner_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, *, low: float,
                  high: float) -> tuple[list[float], float]:
    """How far the learner's log-probs are from the sampler's, as sums to add over micro-batches and ranks
    (:data:`MISMATCH_SUMS`), and the largest ``|log rho_t|``. The KL is the k3 estimator of KL(sampler || learner)
    from the sampler's own draws, ``k3 = rho - 1 - log rho`` per token (>= 0); a sequence's is the sum over its
    tokens. A token (a sequence) is out where its ``rho_t`` (``rho``) lies outside ``[low, high]``."""
    mask = mask.bool()
    with torch.no_grad():
        log_rho = (learner_logp.double() - sampler_logp.double()).masked_fill(~mask, 0.0)
        k3 = torch.expm1(log_rho) - log_rho
        seq_log_rho = log_rho.sum(dim=-1)
        has_tokens = mask.any(dim=-1)
        log_low, log_high = _log_bounds(low, high)
        token_out = ((log_rho < log_low) | (log_rho > log_high)) & mask
        seq_out = ((seq_log_rho < log_low) | (seq_log_rho > log_high)) & has_tokens
        # one transfer to the host (a GPU would wait once, not once per number); the largest is 0 without tokens
        *sums, largest = torch.stack([mask.sum(), has_tokens.sum(), k3.sum(), log_rho.abs().sum(), token_out.sum(),
                                      seq_out.sum(), log_rho.abs().amax()]).tolist()
    return sums, largest


def mismatch_metrics(sums: list[float], largest: float) -> dict[str, float]:
    """``train/mismatch/...`` from the added :func:`mismatch_sums`: per token and per sequence."""
    total = dict(zip(MISMATCH_SUMS, sums))
    tokens, seqs = max(total["tokens"], 1.0), max(total["seqs"], 1.0)
    return {"mismatch/kl_token": total["k3"] / tokens, "mismatch/kl_seq": total["k3"] / seqs,
            "mismatch/log_ratio_abs_mean": total["abs_log_ratio"] / tokens, "mismatch/log_ratio_abs_max": largest,
            "mismatch/tokens_out_frac": total["tokens_out"] / tokens,
            "mismatch/seqs_out_frac": total["seqs_out"] / seqs}


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's ratio (Zheng et al., 2025, Eq. 7) on every token of a sequence, ``[B, T]``: its value is the geometric
    mean of the sequence's token ratios, ``s = exp(mean_t (logp_t - old_logp_t))``; its gradient through token t is
    ``s * grad logp_t`` (GSPO-token's ``sg[s] * pi_t / sg[pi_t]``), so that with ``loss_agg=seq-mean-token-mean`` the
    loss's gradient is GSPO's ``s * A * mean_t grad logp_t``."""
    mask = mask.to(logp.dtype)
    mean_log = _masked_sum(logp.detach() - old_logp.detach(), mask) / mask.sum(dim=-1).clamp(min=1.0)
    return torch.exp(mean_log[:, None] + logp - logp.detach())


def off_policy_keep(logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (its Eq. 9), ``[B]`` bool: a sequence leaves the loss when its
    advantage is negative and the mean over its tokens of ``log pi_sampler - log pi_learner`` exceeds ``threshold``:
    a wrong answer the learner has already moved away from teaches little and destabilises."""
    mask = mask.to(logp.dtype)
    with torch.no_grad():
        drift = _masked_sum(sampler_logp - logp.detach(), mask) / mask.sum(dim=-1).clamp(min=1.0)
    return ~((advantages < 0) & (drift > threshold))
