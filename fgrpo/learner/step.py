"""One optimizer step of the learner as a function of a model: the step's micro-batches (matched over the ranks of a
sharded model), the old policy's log-probs for off-policy mini-batches, and the loss with its corrections for the
sampler/learner mismatch (fgrpo.algorithm.corrections). :class:`fgrpo.learner.learner.Learner` calls it; tests and
anyone who brings their own loop can too.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from fgrpo.algorithm.corrections import MISMATCH_SUMS, mismatch_metrics, mismatch_sums, off_policy_keep, rollout_weights
from fgrpo.algorithm.losses import LossSettings, policy_loss
from fgrpo.infra import distributed
from fgrpo.learner.compiled_layers import (compiled_without_grad, keep_matmul_outputs, matmul_output_bytes,
                                           recompute_all_layers)
from fgrpo.learner.forward import (SHARDED_PASS, attention_width_cost, completion_logprobs, packs_one_row,
                                   row_multiple)
from fgrpo.learner.lora import adapters_disabled
from fgrpo.learner.packing import MicroBatch, Sequence, micro_batches


def matched_micro_batches(model, seqs: list[Sequence], *, pad_id: int, micro_batch_size: int,
                          micro_batch_tokens: int | None, share_prompts: bool) -> tuple[list[MicroBatch], int]:
    """``seqs``' micro-batches, then, with a sharded model, fillers up to the most any rank has; and how many are
    real. Each forward and backward of a sharded model is a collective: a rank that ran one fewer would leave the
    others waiting forever. A filler is one pad-token sequence whose loss counts zero."""
    layout = dict(size=micro_batch_size, tokens=micro_batch_tokens, width_cost=attention_width_cost(model),
                  share_prompts=share_prompts, one_row=packs_one_row(model), row_multiple=row_multiple(model))
    micros = list(micro_batches(seqs, **layout))
    real = len(micros)
    most = int(distributed.max_over_ranks([real])[0])
    if most > real:
        filler = next(iter(micro_batches([Sequence([pad_id], [pad_id])], **layout)))
        micros += [filler] * (most - real)
    return micros, real


# the loss's metrics averaged over the batch's completion tokens (those of them that the algorithm reports)
TOKEN_WEIGHTED_METRICS = ("clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "kl_ref")


def fill_old_logprobs(
    model, seqs: list[Sequence], *, pad_id: int, temperature: float, micro_batch_size: int,
    micro_batch_tokens: int | None = None, autocast_dtype: torch.dtype | None = None, share_prompts: bool = False,
) -> None:
    """Record each sequence's log-probs under the current (sampling) policy, for off-policy mini-batches.

    Through the kernels of the update's own forward, so that the first mini-batch's ratio pi / pi_old is 1 up to
    the rounding of another micro-batch layout (tests/learner/test_compiled_layers.py): in one process the forward
    runs as the update's does, autograd recording (the same compiled graph; what it keeps is what one micro-batch of
    the update keeps, less with gradient checkpointing, whose layers keep no matmul outputs here) and the graph
    dropped after each micro-batch. A sharded policy (FSDP2 expects a backward after a recording forward) and a model with dropout
    (it must be off here) run without autograd, their compiled layers included (:func:`compiled_without_grad`:
    another graph of the same layers, which may round differently)."""
    recording = not (SHARDED_PASS in vars(model) or has_dropout(model))
    was_training = model.training
    if recording:
        recompute_all_layers(model)  # the update's last micro-batch set how many keep their matmul outputs: none here
    else:
        model.eval()
    micros, real = matched_micro_batches(model, seqs, pad_id=pad_id, micro_batch_size=micro_batch_size,
                                         micro_batch_tokens=micro_batch_tokens, share_prompts=share_prompts)
    with torch.set_grad_enabled(recording), compiled_without_grad(model):
        for index, micro in enumerate(micros):
            logp, _, _ = completion_logprobs(
                model, micro.seqs, pad_id=pad_id, temperature=temperature, autocast_dtype=autocast_dtype,
                rows=micro.rows, share_prompts=micro.share_prompts)
            logp = logp.detach()  # the graph goes with it
            for row, seq in enumerate(micro.seqs if index < real else []):
                seq.old_logp = logp[row, : len(seq.completion_ids)].clone()
    model.train(was_training)


def has_dropout(model) -> bool:
    """Whether ``model``'s config turns on any dropout (attention, hidden, residual ...; LLM policies have none)."""
    config = getattr(model, "config", None)
    return any(isinstance(value, float) and value > 0 for key, value in vars(config or object()).items()
               if "dropout" in key)


def update_policy(
    model,
    optimizer: torch.optim.Optimizer,
    seqs: list[Sequence],
    *,
    loss: LossSettings,
    pad_id: int,
    temperature: float,
    micro_batch_size: int,
    grad_clip: float,
    max_new_tokens: int,
    micro_batch_tokens: int | None = None,
    ref_model=None,
    autocast_dtype: torch.dtype | None = None,
    share_prompts: bool = False,
    kept_matmul_bytes: int = 0,
    sync_grads_once: bool = False,
    measure_mismatch: bool = True,
) -> dict[str, float]:
    """One optimizer step on ``seqs`` with gradient accumulation over micro-batches (fgrpo.learner.packing).

    The loss is aggregated with the whole step's token / sequence counts, so the accumulated gradient
    equals the full-batch gradient. ``old_logp`` comes from each sequence when set (mini_batches > 1);
    otherwise the batch is on-policy and old = current log-probs, detached (ratio exactly 1).
    ``ref_model`` (frozen) is needed only for the optional KL penalty, ``loss.kl_coef > 0``.
    ``kept_matmul_bytes``: per micro-batch, as many layers as fit in it keep their matmul outputs for
    the backward instead of recomputing them (fgrpo.learner.compiled_layers.keep_matmul_outputs); 0 for none.
    ``sync_grads_once`` (sharded): FSDP2 reduce-scatters the gradients after the last micro-batch only, each rank
    accumulating unsharded gradients until then (fgrpo.learner.gpu_memory counts them), instead of after each.

    The sampler's log-probs (``Sequence.sampler_logp``), where every sequence has them: with ``measure_mismatch``
    the step logs ``mismatch/...`` (fgrpo.algorithm.corrections), and ``loss.rollout_correction`` and
    ``loss.off_policy_mask`` weight or drop tokens. A dropped token leaves the loss and its count: the gradient is
    scaled from the full count to the kept tokens' (token-mean) or sequences' (seq-* modes) once every micro-batch
    is in.

    Sharded (fgrpo.infra.distributed; ``seqs`` this rank's share, maybe none): the counts are the whole batch's, summed
    over the ranks, each rank's loss is its share of the batch's, and FSDP's gradient average over the ranks is
    undone by a factor of the world size, so the step equals one process's on the whole batch. The metrics are
    the whole batch's too.
    """
    num_tokens, num_seqs = distributed.sum_over_ranks([sum(s.loss_tokens for s in seqs), len(seqs)])
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=float(max_new_tokens))
    world = distributed.world_size()
    optimizer.zero_grad(set_to_none=True)
    tally = _StepTally()
    kept_per_slot = matmul_output_bytes(model, autocast_dtype) if kept_matmul_bytes else 0
    layers = model.config.num_hidden_layers
    micros, real = matched_micro_batches(model, seqs, pad_id=pad_id, micro_batch_size=micro_batch_size,
                                         micro_batch_tokens=micro_batch_tokens, share_prompts=share_prompts)
    sharded_root = vars(model).get(SHARDED_PASS)
    for index, micro in enumerate(micros):
        if sync_grads_once and sharded_root is not None:  # every rank has as many micro-batches: the same last one
            sharded_root.set_requires_gradient_sync(index == len(micros) - 1)
        if index >= real:  # a filler: the same collectives as a real micro-batch, no gradient
            micro_loss = _micro_batch_loss(model, micro, loss, counts, pad_id=pad_id, temperature=temperature,
                                           autocast_dtype=autocast_dtype, ref_model=ref_model, filler=True).loss
            (micro_loss * 0.0).backward()
            continue
        kept_layers = 0
        if kept_matmul_bytes:
            kept_layers = kept_matmul_bytes // (micro.padded_tokens * kept_per_slot)
            keep_matmul_outputs(model, kept_layers)
        part = _micro_batch_loss(model, micro, loss, counts, pad_id=pad_id, temperature=temperature,
                                 autocast_dtype=autocast_dtype, ref_model=ref_model, measure_mismatch=measure_mismatch)
        (part.loss * world if world > 1 else part.loss).backward()
        tally.add(part, micro, min(kept_layers, layers))
    if loss.drops_tokens:  # the loss was divided by every token's (sequence's) count: by the kept ones' instead
        tally.loss_total *= _rescale_to_kept(model, counts, loss.agg, tally.dropped_tokens, tally.dropped_seqs)
    grad_norm = float(distributed.whole(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError("the gradient norm is not finite; lower trainer.lr or check the rewards")
    optimizer.step()
    corrected = loss.rollout_correction != "none" or loss.off_policy_mask is not None
    return {**tally.whole_batch(counts, layers, dropped_frac=corrected), "grad_norm": grad_norm}


@dataclass
class _StepTally:
    """What a step adds up over its micro-batches, and the whole batch's metrics from it (summed over the ranks)."""

    loss_total: float = 0.0
    ratio_max: float = 0.0
    largest_log_ratio: float = 0.0
    padded_tokens: int = 0
    computed_tokens: int = 0
    kept_slots: int = 0  # the layers' token slots whose matmul outputs were kept
    dropped_tokens: int = 0
    dropped_seqs: int = 0
    totals: dict = field(default_factory=lambda: dict.fromkeys(TOKEN_WEIGHTED_METRICS + ("entropy",), 0.0))
    present: set = field(default_factory=set)  # the token-weighted metrics this loss reports
    mismatch: list = field(default_factory=lambda: [0.0] * len(MISMATCH_SUMS))

    def add(self, part: MicroBatchLoss, micro: MicroBatch, kept_layers: int) -> None:
        self.padded_tokens += micro.padded_tokens
        self.computed_tokens += micro.real_tokens
        self.kept_slots += micro.padded_tokens * kept_layers
        self.loss_total += part.loss.item()
        self.present.update(key for key in TOKEN_WEIGHTED_METRICS if key in part.metrics)
        for key in self.present.intersection(part.metrics):  # token-weighted: the step's mean over its kept tokens
            self.totals[key] += part.metrics[key] * part.kept_tokens
        self.ratio_max = max(self.ratio_max, part.metrics["ratio_max"])
        self.totals["entropy"] += part.entropy_sum
        self.dropped_tokens += part.dropped_tokens
        self.dropped_seqs += part.dropped_seqs
        if part.mismatch is not None:
            self.mismatch = [a + b for a, b in zip(self.mismatch, part.mismatch[0])]
            self.largest_log_ratio = max(self.largest_log_ratio, part.mismatch[1])

    def whole_batch(self, counts: dict[str, float], layers: int, *, dropped_frac: bool) -> dict[str, float]:
        """The step's metrics over the whole batch (one process: these numbers as they are); ``mismatch/...`` where
        the mismatch was measured, and with ``dropped_frac`` the share of tokens a correction dropped."""
        totals = self.totals
        loss_total, padded, computed, kept_slots, dropped, *sums = distributed.sum_over_ranks(
            [self.loss_total, self.padded_tokens, self.computed_tokens, self.kept_slots, self.dropped_tokens,
             *totals.values(), *(key in self.present for key in TOKEN_WEIGHTED_METRICS), *self.mismatch])
        ratio_max, largest_log_ratio = distributed.max_over_ranks([self.ratio_max, self.largest_log_ratio])
        mismatch = sums[len(totals) + len(TOKEN_WEIGHTED_METRICS):]
        totals, seen = dict(zip(totals, sums)), dict(zip(TOKEN_WEIGHTED_METRICS, sums[len(totals):]))
        kept_tokens = counts["num_tokens"] - dropped
        out = {key: value / max(kept_tokens if key != "entropy" else counts["num_tokens"], 1.0)
               for key, value in totals.items() if seen.get(key, True)}
        # computed_tokens: the token positions the forward and backward ran over, padding out (a shared prompt once)
        out.update(loss=loss_total, ratio_max=ratio_max, computed_tokens=float(computed),
                   padding_frac=1.0 - computed / max(padded, 1),
                   # of the layers' token slots, the share whose matmul outputs were kept instead of recomputed
                   matmuls_kept_frac=kept_slots / max(padded * layers, 1))
        if mismatch[0] > 0:  # measured: the sampler's log-probs were there
            out.update(mismatch_metrics(mismatch, largest_log_ratio))
        if dropped_frac:
            out["mismatch/dropped_frac"] = dropped / max(counts["num_tokens"], 1.0)
        return out


def _rescale_to_kept(model, counts: dict[str, float], agg: str, dropped_tokens: int, dropped_seqs: int) -> float:
    """Scale the accumulated gradient from the step's full counts to its kept ones (summed over the ranks) and return
    the factor. Every aggregation divides by one step-wide count (tokens for token-mean, sequences otherwise; a
    sequence's own token count is its micro-batch's business), so one factor makes the loss the kept tokens' mean."""
    dropped_tokens, dropped_seqs = distributed.sum_over_ranks([dropped_tokens, dropped_seqs])
    full, dropped = ((counts["num_tokens"], dropped_tokens) if agg == "token-mean"
                     else (counts["num_seqs"], dropped_seqs))
    if dropped == 0 or dropped >= full:  # none dropped, or all: the gradient is already right (all: zero)
        return 1.0
    factor = full / (full - dropped)
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad.mul_(factor)
    return factor


@dataclass
class MicroBatchLoss:
    """One micro-batch's share of the step's loss and what the step adds up from it."""

    loss: torch.Tensor
    metrics: dict[str, float]
    kept_tokens: float  # the completion tokens the loss counts, less the dropped ones
    entropy_sum: float  # over every completion token the loss would count
    dropped_tokens: int = 0  # by the rollout correction or the off-policy mask
    dropped_seqs: int = 0  # sequences with every token dropped
    mismatch: tuple[list[float], float] | None = None  # fgrpo.algorithm.corrections.mismatch_sums


def _per_token(seqs: list[Sequence], name: str, like: torch.Tensor) -> torch.Tensor | None:
    """``[B, T]`` of each sequence's ``name`` (a per-completion-token list or tensor), 0 beyond its length; None if a
    sequence has none."""
    values = [getattr(seq, name) for seq in seqs]
    if any(value is None for value in values):
        return None
    # lists (the sampler's) are laid out on the host and moved once; tensors (old log-probs) are on the device
    on_host = all(isinstance(value, list) for value in values)
    out = torch.zeros(like.shape, dtype=like.dtype) if on_host else torch.zeros_like(like)
    for row, value in enumerate(values):
        out[row, : len(value)] = torch.as_tensor(value, dtype=like.dtype)
    return out.to(like.device) if on_host else out


def _micro_batch_loss(model, micro: MicroBatch, loss: LossSettings, counts: dict[str, float], *, pad_id: int,
                      temperature: float, autocast_dtype, ref_model, measure_mismatch: bool = False,
                      filler: bool = False) -> MicroBatchLoss:
    """One micro-batch's share of the step's loss (aggregated with the whole step's ``counts``) and its numbers."""
    rows = dict(pad_id=pad_id, temperature=temperature, autocast_dtype=autocast_dtype, rows=micro.rows,
                share_prompts=micro.share_prompts)
    logp, mask, entropy = completion_logprobs(model, micro.seqs, with_entropy=True,
                                              entropy_grad=loss.entropy_coef > 0, **rows)
    old_logp = _per_token(micro.seqs, "old_logp", logp)
    old_logp = logp.detach() if old_logp is None else old_logp
    advantages = torch.tensor([s.advantage for s in micro.seqs], dtype=logp.dtype, device=logp.device)
    sampler_logp = _per_token(micro.seqs, "sampler_logp", logp)
    kept, weights = (mask, None) if filler else _corrections(loss, logp, old_logp, sampler_logp, advantages, mask)
    found = None
    if measure_mismatch and sampler_logp is not None:  # the learner's log-probs before the update against the sampler's
        before = logp.detach() if loss.old_logprobs == "sampler" else old_logp
        found = mismatch_sums(before, sampler_logp, mask, low=loss.correction_low, high=loss.correction_high)
    ref_logp = None
    if loss.kl_coef > 0:  # no reference model: the policy's base, its LoRA adapters off (fgrpo.learner.lora)
        with torch.no_grad(), adapters_disabled(model) if ref_model is None else contextlib.nullcontext():
            ref_logp, _, _ = completion_logprobs(ref_model if ref_model is not None else model, micro.seqs, **rows)
    micro_loss, metrics = policy_loss(
        loss.algo, logp, old_logp, advantages, kept, clip_low=loss.clip_low, clip_high=loss.clip_high, agg=loss.agg,
        ref_logp=ref_logp, kl_coef=loss.kl_coef, entropy=entropy if loss.entropy_coef > 0 else None,
        entropy_coef=loss.entropy_coef, ratio_level=loss.ratio_level, weights=weights,
        kl_bias_correction=loss.kl_bias_correction, **counts,
    )
    tokens = sum(s.loss_tokens for s in micro.seqs)  # = mask.sum(), known on the host
    dropped = int(mask.sum() - kept.sum()) if kept is not mask else 0
    dropped_seqs = int((mask.bool().any(dim=1) & ~kept.bool().any(dim=1)).sum()) if dropped else 0
    return MicroBatchLoss(micro_loss, metrics, float(tokens - dropped), float((entropy.detach() * mask).sum()),
                          dropped, dropped_seqs, found)


def _corrections(loss: LossSettings, logp, old_logp, sampler_logp, advantages, mask):
    """The tokens the loss keeps (``mask`` itself when no correction drops any) and the rollout correction's weights
    (None: off), from the sampler's log-probs (fgrpo.algorithm.corrections)."""
    if loss.rollout_correction == "none" and loss.off_policy_mask is None:
        return mask, None
    if sampler_logp is None:
        raise ValueError("algo.rollout_correction and algo.off_policy_mask need the sampler's log-probs of every "
                         "sequence (Sequence.sampler_logp); a sequence here has none")
    kept, weights = mask.bool(), None
    if loss.rollout_correction != "none":
        weights, kept = rollout_weights(old_logp, sampler_logp, mask, loss.rollout_correction,
                                        low=loss.correction_low, high=loss.correction_high)
    if loss.off_policy_mask is not None:
        kept = kept & off_policy_keep(logp, sampler_logp, advantages, mask, loss.off_policy_mask)[:, None]
    return kept.to(mask.dtype), weights
