"""Per-token policy losses (GRPO, DAPO, CISPO) and loss aggregation.

Shapes: ``logp``, ``old_logp``, ``mask`` are ``[B, T]`` (B sequences, T response tokens, mask 1 on
real tokens); ``advantages`` is ``[B]`` (one per sequence, broadcast over its tokens) or ``[B, T]``.
The ratio is ``r = exp(logp - old_logp)`` per token.

Equation numbers refer to F-GRPO (arXiv 2602.06717, v2). The focal weight lives in the advantages
(``fgrpo.algorithm.advantages``), so these losses are the same for the F- and the plain variants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fgrpo.algorithm.corrections import RATIO_LEVELS, sequence_ratio

__all__ = ["ALGOS", "AGG_MODES", "LossSettings", "aggregate", "policy_loss", "per_token_policy_loss"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossSettings:
    """One algorithm's policy loss (the ``algo`` config group): what :func:`policy_loss` takes besides tensors. No
    defaults: they live in the config schema (``AlgoConfig``); ``fgrpo.prepare.loss_settings(cfg.algo)`` builds it."""

    algo: str  # a name in ALGOS
    clip_low: float
    clip_high: float
    agg: str  # a name in AGG_MODES
    kl_coef: float  # 0: no KL term (the paper's setting)
    entropy_coef: float  # 0: no entropy bonus
    # the sampler/learner mismatch and the ratio's level (fgrpo.algorithm.corrections); the defaults: today's loss
    ratio_level: str = "token"  # token | sequence (GSPO)
    rollout_correction: str = "none"  # a name in corrections.ROLLOUT_CORRECTIONS
    correction_low: float = 0.5
    correction_high: float = 2.0
    off_policy_mask: float | None = None  # DeepSeek-V3.2's threshold on the sequence's mean log drift; None: off
    kl_bias_correction: bool = False  # the KL term times the ratio pi / pi_old: the unbiased reverse-KL gradient
    old_logprobs: str = "learner"  # learner | sampler: whose log-probs are the old policy of mini-batches > 1

    @property
    def drops_tokens(self) -> bool:
        """Whether a correction may drop tokens from the loss (and so from its counts)."""
        return self.rollout_correction.endswith("_mask") or self.off_policy_mask is not None


def _check_token_tensors(**tensors: torch.Tensor) -> torch.Size:
    shape = None
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape [B, T], got {type(value).__name__}")
        if value.dim() != 2:
            raise ValueError(f"{name} must have shape [B, T], got shape {tuple(value.shape)}")
        if shape is None:
            shape = value.shape
        elif value.shape != shape:
            names = list(tensors)
            raise ValueError(
                f"{name} has shape {tuple(value.shape)} but {names[0]} has shape {tuple(shape)}; "
                "all token tensors must share one [B, T] shape"
            )
    return shape


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    Modes:
        - ``token-mean``: sum over all real tokens / number of real tokens (the paper's setting; DAPO).
        - ``seq-mean-token-mean``: mean over each sequence's tokens, then mean over sequences (GRPO paper).
        - ``seq-mean-token-sum``: sum over each sequence's tokens, then mean over sequences.
        - ``seq-mean-token-sum-norm``: sum over each sequence's tokens / ``norm_constant`` (e.g. the
          max response length, Dr. GRPO), then mean over sequences.

    Global counts: when the batch is split into micro-batches, pass the whole batch's
    ``num_tokens`` (token-mean) or ``num_seqs`` (seq-* modes). Then the micro-batch losses sum to the
    full-batch loss, so gradient accumulation does not change the gradient. Without them the local
    counts are used.
    """
    _check_token_tensors(loss_mat=loss_mat, mask=mask)
    if mode not in AGG_MODES:
        raise ValueError(f"agg mode must be one of {AGG_MODES}, got {mode!r}")
    mask = mask.to(loss_mat.dtype)
    masked = loss_mat * mask
    if mode == "token-mean":
        denominator = mask.sum() if num_tokens is None else num_tokens
        if num_tokens is not None and num_tokens <= 0:
            raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
        # clamp: a micro-batch of only padding contributes 0 instead of 0/0
        return masked.sum() / torch.clamp(torch.as_tensor(denominator, dtype=loss_mat.dtype), min=1.0)

    if num_seqs is not None and num_seqs <= 0:
        raise ValueError(f"num_seqs must be > 0, got {num_seqs}")
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    elif mode == "seq-mean-token-sum":
        per_seq = masked.sum(dim=1)
    else:
        if norm_constant is None or not norm_constant > 0:
            raise ValueError(
                f"agg mode 'seq-mean-token-sum-norm' needs norm_constant > 0 (e.g. the max response length), "
                f"got {norm_constant}"
            )
        per_seq = masked.sum(dim=1) / norm_constant
    return per_seq.sum() / (loss_mat.shape[0] if num_seqs is None else num_seqs)


def per_token_policy_loss(
    algo: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    ratio_level: str = "token",
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``[B, T]`` surrogate loss of one algorithm, before masking and aggregation.

    - ``grpo`` / ``dapo`` (PPO clip, Eq. 14 per token): ``-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)``.
      The two differ only in their clip values (0.2/0.2 and 0.2/0.28), which live in the config.
    - ``cispo`` (Eqs. 15-16): ``-sg(clip(r, 1-clip_low, 1+clip_high)) * A * logp``. The importance weight
      is clamped on BOTH sides and detached, as the paper writes it (with clip_low=1.0, clip_high=5.0 it
      lies in [0, 6]). TRL and open-instruct clip only from above; verl clips both sides like us.

    ``ratio_level="sequence"`` (GSPO; ``mask`` needed) puts the sequence's ratio, the geometric mean of its token
    ratios (:func:`fgrpo.algorithm.corrections.sequence_ratio`), in place of each token's: GRPO's clip on it is GSPO,
    CISPO's weight on it is CISPO's sequence form, ``-sg(clip(s)) * A * logp_t``.

    Returns ``(loss, ratio, clipped_low, clipped_high)``: the ``[B, T]`` loss, the ratio, and boolean
    ``[B, T]`` maps of tokens where the low / high clip changed the loss. For PPO that is where the
    clipped term won the min (ratio out of range on the side that matters for the advantage's
    sign); for CISPO, where the weight was clamped.
    """
    if algo not in SURROGATES:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high)):
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    shape = _check_token_tensors(logp=logp, old_logp=old_logp)
    if advantages.dim() == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(
                f"advantages has shape {tuple(advantages.shape)} but logp has {shape[0]} sequences; "
                "pass one advantage per sequence [B] or one per token [B, T]"
            )
        advantages = advantages[:, None]
    elif advantages.shape != shape:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; expected [B]=({shape[0]},) or [B, T]={tuple(shape)}"
        )
    advantages = advantages.detach().to(logp.dtype)
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if ratio_level == "token":
        ratio = torch.exp(logp - old_logp.detach())
    elif mask is None:
        raise ValueError("ratio_level='sequence' needs mask, the [B, T] tokens each sequence's mean runs over")
    else:
        ratio = sequence_ratio(logp, old_logp, mask)
    loss, clipped_low, clipped_high = SURROGATES[algo](logp, ratio, advantages, 1.0 - clip_low, 1.0 + clip_high)
    return loss, ratio, clipped_low, clipped_high


def _ppo_clip(logp, ratio, advantages, low, high):
    """Eq. 14 per token: ``-min(r*A, clip(r, low, high)*A)``; clipped where the clipped term wins the min."""
    loss = torch.maximum(-ratio * advantages, -ratio.clamp(low, high) * advantages)
    return loss, (ratio < low) & (advantages < 0), (ratio > high) & (advantages > 0)


def _cispo(logp, ratio, advantages, low, high):
    """Eqs. 15-16: ``-sg(clip(r, low, high)) * A * logp``; clipped where the weight was clamped."""
    return -ratio.clamp(low, high).detach() * advantages * logp, ratio < low, ratio > high


# the policy loss of each algorithm by name (config.validate reads the names): GRPO, DAPO and GSPO differ only in
# their clip values and GSPO in its ratio's level (algo.ratio_level=sequence), which live in conf/algo
SURROGATES = {"grpo": _ppo_clip, "dapo": _ppo_clip, "cispo": _cispo, "gspo": _ppo_clip}
ALGOS = tuple(SURROGATES)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(
    algo: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_constant: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ratio_level: str = "token",
    weights: torch.Tensor | None = None,
    kl_bias_correction: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss for one (micro-)batch, aggregated to a scalar.

    Args:
        algo: ``"grpo"``, ``"dapo"`` or ``"cispo"``; see :func:`per_token_policy_loss`.
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy (with grad).
        old_logp: ``[B, T]`` the same under the policy that sampled them (no grad).
        advantages: ``[B]`` or ``[B, T]``, e.g. from ``focal_group_advantages`` flattened.
        mask: ``[B, T]``, 1 for response tokens, 0 for padding.
        agg, num_tokens, num_seqs, norm_constant: see :func:`aggregate`.
        ref_logp, kl_coef: optional k3 KL penalty ``exp(ref - logp) - (ref - logp) - 1`` to a reference
            policy, added per token. Off by default (the paper uses no KL).
        entropy, entropy_coef: optional ``[B, T]`` token entropies; ``-entropy_coef * entropy`` is added
            per token. Off by default.
        ratio_level: ``token`` or ``sequence`` (GSPO); see :func:`per_token_policy_loss`.
        weights: optional ``[B, T]`` rollout-correction weights (no grad) on each token's policy term
            (fgrpo.algorithm.corrections.rollout_weights); the tokens a correction masks are 0 in ``mask``.
        kl_bias_correction: the KL term times the ratio ``pi / pi_old`` (with its gradient), DeepSeek-V3.2's
            unbiased estimator of the reverse KL's gradient from samples of pi_old.

    Returns:
        ``(loss, metrics)``: the scalar loss and floats ``clip_frac_low``, ``clip_frac_high``,
        ``ratio_mean``, ``ratio_max``, ``approx_kl`` (k3 estimate of KL(old || new) on these tokens),
        plus ``kl_ref`` / ``entropy`` when those terms are on.
    """
    _check_token_tensors(logp=logp, old_logp=old_logp, mask=mask)
    loss_mat, ratio, clipped_low, clipped_high = per_token_policy_loss(
        algo, logp, old_logp, advantages, clip_low=clip_low, clip_high=clip_high, ratio_level=ratio_level, mask=mask
    )
    if weights is not None:
        _check_token_tensors(logp=logp, weights=weights)
        loss_mat = loss_mat * weights.detach()
    float_mask = mask.to(logp.dtype)
    metrics: dict[str, float] = {}

    if kl_coef < 0 or entropy_coef < 0:
        raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {kl_coef} and {entropy_coef}")
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp, the [B, T] log-probs under the reference policy")
        _check_token_tensors(logp=logp, ref_logp=ref_logp)
        log_ratio_ref = ref_logp.detach() - logp
        kl_ref = torch.exp(log_ratio_ref) - log_ratio_ref - 1.0
        kl_term = kl_ref * torch.exp(logp - old_logp.detach()) if kl_bias_correction else kl_ref
        loss_mat = loss_mat + kl_coef * kl_term
        metrics["kl_ref"] = _masked_mean(kl_ref.detach(), float_mask).item()
    if entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs entropy, the [B, T] per-token entropies")
        _check_token_tensors(logp=logp, entropy=entropy)
        loss_mat = loss_mat - entropy_coef * entropy
        metrics["entropy"] = _masked_mean(entropy.detach(), float_mask).item()

    loss = aggregate(
        loss_mat, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=norm_constant
    )

    with torch.no_grad():
        bool_mask = mask.bool()
        log_ratio = (logp - old_logp).detach()
        # k3 estimator of KL(old || new) from samples of old: (r - 1) - log r, r = new / old
        approx_kl = torch.expm1(log_ratio) - log_ratio
        any_token = bool(bool_mask.any())
        metrics.update(
            clip_frac_low=_masked_mean(clipped_low.to(logp.dtype), float_mask).item(),
            clip_frac_high=_masked_mean(clipped_high.to(logp.dtype), float_mask).item(),
            ratio_mean=_masked_mean(ratio.detach(), float_mask).item(),
            ratio_max=ratio.detach()[bool_mask].max().item() if any_token else 1.0,
            approx_kl=_masked_mean(approx_kl, float_mask).item(),
        )
    return loss, metrics
