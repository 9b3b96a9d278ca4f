"""The learner: the policy (and a frozen reference for the KL term), AdamW and its schedule, and the tricks that
make an update fast on its hardware (packed rows, compiled layers, kept matmul outputs, process memory).

The loop hands :meth:`Learner.update` a step's sequences with their advantages and :meth:`Learner.push_weights`
hands the sampler the new weights. :func:`update_policy` is one optimizer step as a function of a model, for tests
and for anyone who brings their own loop.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fgrpo.infra import distributed
from fgrpo.learner.compiled_layers import (compile_decoder_layers, compiled_without_grad, keep_matmul_outputs,
                                           matmul_output_bytes, recompute_all_layers)
from fgrpo.learner.forward import (SHARDED_PASS, PolicyPass, attention_width_cost, completion_logprobs, packs_one_row,
                                   row_multiple)
from fgrpo.algorithm.losses import LossSettings, policy_loss
from fgrpo.learner.lora import LoraSettings, adapters_disabled, apply_lora, has_adapters, sampler_weights
from fgrpo.learner.packing import MicroBatch, Sequence, micro_batches
from fgrpo.infra.process_memory import release_freed_memory
from fgrpo.learner.sharded_load import builds_on_meta, shard_from_rank0

log = logging.getLogger("fgrpo")


@dataclass(frozen=True)
class LearnerSettings:
    """How the learner computes (the ``hardware`` config group) and steps (``trainer``). No defaults here: they live
    in the config schemas (fgrpo/config.py), and ``fgrpo.prepare.learner_settings(cfg)`` builds this from a config."""

    model_name: str  # for messages
    max_new_tokens: int  # the sampler's limit: Dr. GRPO's norm constant (loss_agg=seq-mean-token-sum-norm)
    temperature: float  # the sampler's: log-probs of the distribution the samples were drawn from
    device: str  # a name in fgrpo.learner.model.DEVICES
    dtype: str  # the weights and the optimizer state
    autocast_dtype: str | None  # the matmuls' dtype; None: the weights' own
    attention: str  # a name in fgrpo.learner.forward.ATTENTIONS
    compile: bool
    gradient_checkpointing: bool
    fsdp: bool  # shard with FSDP2 in one process too (several processes always shard)
    cpu_offload: bool  # sharded on GPUs: parameters, gradients and optimizer state in CPU memory (FSDP2's offload)
    sync_grads_once: bool  # sharded: reduce-scatter the gradients after a step's last micro-batch only
    kept_matmul_gib: float  # per micro-batch, for layers that keep their matmul outputs (needs both above)
    micro_batch_size: int  # sequences per padded micro-batch, when micro_batch_tokens is None
    micro_batch_tokens: int | None  # token slots per micro-batch of packed rows
    share_prompts: bool
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup_steps: int
    grad_clip: float
    mini_batches: int  # optimizer steps per batch (PPO mini-batches); 1: on-policy
    lora: LoraSettings | None = None  # model.lora: adapters trained instead of every weight (fgrpo.learner.lora)


class Learner:
    """Owns the policy and its optimizer; ``update(seqs)`` is one step of the algorithm on a sampled batch.

    With several processes (fgrpo.infra.distributed) the policy is sharded with FSDP2 (:func:`shard_policy`): each rank
    holds a slice of the fp32 weights, gradients and AdamW moments, updates on its own share of the batch, and the
    update equals one process's on the whole batch (:func:`update_policy`).

    ``generates`` (sampler=hf): the policy also samples, so its layers are compiled only where autograd records
    (a KV cache would recompile them at each length).

    The process-wide memory settings (glibc's, the matmul kernel caches') are not made here: they must be in
    place before vLLM starts, so ``fgrpo.prepare.prepare`` sets them (fgrpo.infra.process_memory).
    """

    def __init__(self, folder: Path, settings: LearnerSettings, loss: LossSettings, *, pad_id: int,
                 generates: bool = False):
        self.settings, self.loss, self.pad_id = settings, loss, pad_id
        self.sharded = distributed.active() or settings.fsdp  # fsdp in one process: a group of one (train.py)
        # sharded over several ranks: rank 0 reads the weights, the others build on the meta device (sharded_load),
        # so a build can fail on one rank alone: agree, and every rank stops with its error instead of waiting
        self.policy = distributed.agree(lambda: self._built_policy(folder, generates))
        if settings.sync_grads_once and not self.sharded:
            log.warning("hardware.sync_grads_once=true does nothing here: the learner is not sharded (one process "
                        "without hardware.fsdp), so its gradients are never reduce-scattered")
        if self.sharded:
            self._shard(self.policy, folder)
        self.reference = None  # with LoRA the KL reference is the policy with its adapters off (no second copy)
        if loss.kl_coef > 0 and settings.lora is None:
            self.reference = distributed.agree(lambda: self._loaded(folder))
            self.reference.eval().requires_grad_(False)
            if self.sharded:
                self._shard(self.reference, folder)
        # fused: one kernel over all parameters (on CPU 9x faster than the default per-tensor loop, same math)
        trained = [p for p in self.policy.parameters() if p.requires_grad]  # all, or LoRA's adapters alone
        self.optimizer = torch.optim.AdamW(trained, lr=settings.lr, betas=tuple(settings.betas),
                                           weight_decay=settings.weight_decay, fused=True)
        # linear warm-up, then constant (the paper: constant lr after 15 warm-up steps)
        warmup = max(settings.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: min(1.0, (i + 1) / (warmup + 1)))

    def _built_policy(self, folder: Path, generates: bool):
        """The policy as this rank builds it, before sharding: loaded (or on the meta device), its LoRA adapters,
        gradient checkpointing and compiled layers."""
        s = self.settings
        policy = self._loaded(folder)
        if s.lora is not None:  # before the layers compile: the adapters are part of them
            trainable = apply_lora(policy, s.lora)
            log.info("LoRA rank %d on %s: %.2fM trained parameters of %.2fM, lr %g", s.lora.rank,
                     ", ".join(s.lora.target_modules or ["every linear layer"]), trainable / 1e6,
                     sum(p.numel() for p in policy.parameters()) / 1e6, s.lr)
        if s.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        if s.compile and not compile_decoder_layers(policy, grad_only=generates,
                                                    selective_checkpoint=s.kept_matmul_gib > 0):
            log.warning("hardware.compile_learner: %s has no decoder-layer list to compile; running eager", s.model_name)
        return policy

    def _loaded(self, folder: Path):
        """``folder``'s model as this rank loads it: whole, or on the meta device (a non-zero rank of a sharded
        learner, fgrpo.learner.sharded_load)."""
        from fgrpo.learner.model import load_policy

        s = self.settings
        return load_policy(folder, dtype=s.dtype, device=s.device, attention=s.attention,
                           empty=builds_on_meta(self.sharded))

    def _shard(self, model, folder: Path) -> None:
        """FSDP2 over the ranks, the other ranks' shards set from rank 0's weights (their models built on meta)."""
        s = self.settings
        shard_from_rank0(model, lambda: shard_policy(model, device=s.device, autocast_dtype=s.autocast_dtype,
                                                     cpu_offload=s.cpu_offload),
                         device=s.device, shard_device="cpu" if s.cpu_offload else s.device,  # offloaded: host memory
                         source=str(folder))

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def update(self, seqs: list[Sequence]) -> dict[str, float]:
        """One step on a batch: ``mini_batches`` optimizer steps (one: on-policy, no extra forward), then the
        schedule. Returns the update's metrics (loss, grad_norm, clip fractions, entropy, KL) and the learner's
        work: ``computed_tokens``, ``padding_frac``, ``matmuls_kept_frac``."""
        s = self.settings
        autocast = getattr(torch, s.autocast_dtype) if s.autocast_dtype else None
        layout = dict(pad_id=self.pad_id, temperature=s.temperature, micro_batch_size=s.micro_batch_size,
                      micro_batch_tokens=s.micro_batch_tokens, autocast_dtype=autocast, share_prompts=s.share_prompts)
        if s.mini_batches > 1:
            fill_old_logprobs(self.policy, seqs, **layout)
        chunks = mini_batch_indices(distributed.gather_objects(len(seqs)), distributed.rank(), s.mini_batches)
        results = [
            update_policy(self.policy, self.optimizer, [seqs[i] for i in chunk], loss=self.loss, grad_clip=s.grad_clip,
                          max_new_tokens=s.max_new_tokens, ref_model=self.reference,
                          kept_matmul_bytes=int(s.kept_matmul_gib * 2**30), sync_grads_once=s.sync_grads_once,
                          **layout)
            for chunk in chunks
        ]
        self.scheduler.step()
        out = {key: float(np.mean([r[key] for r in results])) for key in results[0]}
        out["computed_tokens"] = float(sum(r["computed_tokens"] for r in results))
        return out

    def push_weights(self, sampler) -> None:
        """Make the sampler draw from the current policy. The step has used the gradients: they are freed first
        (0.5 GiB for SmolLM2), and on CPU the step's freed activations and the push's copies go back to the OS."""
        self.optimizer.zero_grad(set_to_none=True)
        sampler.update_weights(self.policy)
        if self.settings.device == "cpu":
            release_freed_memory()

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue this learner: weights, optimizer moments, schedule."""
        return {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def save_pretrained(self, folder: Path, tokenizer=None) -> None:
        """The policy as an HF folder (LoRA: the merged weights, the base untouched); sharded, every rank takes part in
        gathering the weights and rank 0 writes."""
        state = None
        if has_adapters(self.policy):
            state = {name: tensor.detach().cpu() for name, tensor in sampler_weights(self.policy, distributed.whole)}
        elif self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.sharded and torch.distributed.get_rank() != 0:
            return
        if state is not None and getattr(self.policy.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # a copy of the embedding: HF would save it twice
        self.policy.save_pretrained(folder, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)


def mini_batch_indices(counts: list[int], rank: int, mini_batches: int) -> list[list[int]]:
    """Each mini-batch's indices into this rank's sequences. The split is one process's: a shuffle of the whole
    batch (``sum(counts)`` sequences, rank r holding the r-th contiguous block of ``counts[r]``) cut into
    ``mini_batches``; each rank keeps the part it holds, maybe none (its update then runs fillers). A mini-batch
    empty on every rank is left out, on every rank alike."""
    total, offset = sum(counts), sum(counts[:rank])
    order = np.random.default_rng(total).permutation(total)
    return [[int(i) - offset for i in chunk if offset <= i < offset + counts[rank]]
            for chunk in np.array_split(order, mini_batches) if len(chunk)]


def shard_policy(policy, *, device: str, autocast_dtype: str | None = None, cpu_offload: bool = False) -> None:
    """FSDP2 over the process group: each decoder layer its own unit, then the rest (embedding, final norm, LM head)
    as the root, which is a :class:`~fgrpo.learner.forward.PolicyPass` around the policy so that the learner's log-prob
    pass (base model, then the fused LM head) runs inside the root's forward. With ``autocast_dtype`` FSDP2's
    mixed-precision policy gathers the weights in that dtype over fp32 master shards and reduces gradients in fp32,
    on GPUs and on the CPU alike (tests/learner/test_sharded.py holds 2 CPU ranks under it against one process under
    autocast); ``cpu_offload`` keeps parameters, gradients and optimizer state in CPU memory between uses."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options = {}
    if autocast_dtype and autocast_dtype != "float32":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, autocast_dtype), reduce_dtype=torch.float32)
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    layers = getattr(policy.base_model, "layers", None)
    for layer in layers if isinstance(layers, torch.nn.ModuleList) else []:
        fully_shard(layer, **options)
    fully_shard(PolicyPass(policy).attach(), **options)


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

    Sharded (fgrpo.infra.distributed; ``seqs`` this rank's share, maybe none): the counts are the whole batch's, summed
    over the ranks, each rank's loss is its share of the batch's, and FSDP's gradient average over the ranks is
    undone by a factor of the world size, so the step equals one process's on the whole batch. The metrics are
    the whole batch's too.
    """
    num_tokens, num_seqs = distributed.sum_over_ranks([sum(s.loss_tokens for s in seqs), len(seqs)])
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=float(max_new_tokens))
    world = distributed.world_size()
    optimizer.zero_grad(set_to_none=True)
    totals = dict.fromkeys(TOKEN_WEIGHTED_METRICS + ("entropy",), 0.0)
    ratio_max = loss_total = 0.0
    padded_tokens = computed_tokens = kept_slots = 0
    kept_per_slot = matmul_output_bytes(model, autocast_dtype) if kept_matmul_bytes else 0
    layers = model.config.num_hidden_layers
    present: set[str] = set()  # the token-weighted metrics this loss reports
    micros, real = matched_micro_batches(model, seqs, pad_id=pad_id, micro_batch_size=micro_batch_size,
                                         micro_batch_tokens=micro_batch_tokens, share_prompts=share_prompts)
    sharded_root = vars(model).get(SHARDED_PASS)
    for index, micro in enumerate(micros):
        if sync_grads_once and sharded_root is not None:  # every rank has as many micro-batches: the same last one
            sharded_root.set_requires_gradient_sync(index == len(micros) - 1)
        if index >= real:  # a filler: the same collectives as a real micro-batch, no gradient
            micro_loss = _micro_batch_loss(model, micro, loss, counts, pad_id=pad_id, temperature=temperature,
                                           autocast_dtype=autocast_dtype, ref_model=ref_model)[0]
            (micro_loss * 0.0).backward()
            continue
        padded_tokens += micro.padded_tokens
        computed_tokens += micro.real_tokens
        if kept_matmul_bytes:
            kept_layers = kept_matmul_bytes // (micro.padded_tokens * kept_per_slot)
            keep_matmul_outputs(model, kept_layers)
            kept_slots += micro.padded_tokens * min(kept_layers, layers)
        micro_loss, metrics, tokens, entropy_sum = _micro_batch_loss(
            model, micro, loss, counts, pad_id=pad_id, temperature=temperature, autocast_dtype=autocast_dtype,
            ref_model=ref_model)
        (micro_loss * world if world > 1 else micro_loss).backward()
        loss_total += micro_loss.item()
        present.update(key for key in TOKEN_WEIGHTED_METRICS if key in metrics)
        for key in present.intersection(metrics):  # token-weighted: the step's mean over all its tokens
            totals[key] += metrics[key] * tokens
        ratio_max = max(ratio_max, metrics["ratio_max"])
        totals["entropy"] += entropy_sum
    grad_norm = float(distributed.whole(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError("the gradient norm is not finite; lower trainer.lr or check the rewards")
    optimizer.step()
    # the whole batch's sums (one process: these numbers as they are)
    loss_total, padded_tokens, computed_tokens, kept_slots, *sums = distributed.sum_over_ranks(
        [loss_total, padded_tokens, computed_tokens, kept_slots, *totals.values(),
         *(key in present for key in TOKEN_WEIGHTED_METRICS)])
    ratio_max = distributed.max_over_ranks([ratio_max])[0]
    totals, seen = dict(zip(totals, sums)), dict(zip(TOKEN_WEIGHTED_METRICS, sums[len(totals):]))
    out = {key: value / max(counts["num_tokens"], 1.0) for key, value in totals.items() if seen.get(key, True)}
    # computed_tokens: the token positions the forward and backward ran over, padding left out (a shared prompt once)
    out.update(loss=loss_total, grad_norm=grad_norm, ratio_max=ratio_max, computed_tokens=float(computed_tokens),
               padding_frac=1.0 - computed_tokens / max(padded_tokens, 1),
               # of the layers' token slots, the share whose matmul outputs were kept instead of recomputed
               matmuls_kept_frac=kept_slots / max(padded_tokens * layers, 1))
    return out


def _micro_batch_loss(model, micro: MicroBatch, loss: LossSettings, counts: dict[str, float], *, pad_id: int,
                      temperature: float, autocast_dtype, ref_model) -> tuple[torch.Tensor, dict, float, float]:
    """One micro-batch's share of the step's loss (aggregated with the whole step's ``counts``), its metrics, its
    completion tokens and the sum of their entropies."""
    rows = dict(pad_id=pad_id, temperature=temperature, autocast_dtype=autocast_dtype, rows=micro.rows,
                share_prompts=micro.share_prompts)
    logp, mask, entropy = completion_logprobs(model, micro.seqs, with_entropy=True,
                                              entropy_grad=loss.entropy_coef > 0, **rows)
    if all(s.old_logp is not None for s in micro.seqs):
        old_logp = torch.zeros_like(logp)
        for row, seq in enumerate(micro.seqs):
            old_logp[row, : len(seq.completion_ids)] = seq.old_logp
    else:
        old_logp = logp.detach()
    advantages = torch.tensor([s.advantage for s in micro.seqs], dtype=logp.dtype, device=logp.device)
    ref_logp = None
    if loss.kl_coef > 0:  # no reference model: the policy's base, its LoRA adapters off (fgrpo.learner.lora)
        with torch.no_grad(), adapters_disabled(model) if ref_model is None else contextlib.nullcontext():
            ref_logp, _, _ = completion_logprobs(ref_model if ref_model is not None else model, micro.seqs, **rows)
    micro_loss, metrics = policy_loss(
        loss.algo, logp, old_logp, advantages, mask, clip_low=loss.clip_low, clip_high=loss.clip_high, agg=loss.agg,
        ref_logp=ref_logp, kl_coef=loss.kl_coef, entropy=entropy if loss.entropy_coef > 0 else None,
        entropy_coef=loss.entropy_coef, **counts,
    )
    tokens = sum(s.loss_tokens for s in micro.seqs)  # = mask.sum(), known on the host
    return micro_loss, metrics, float(tokens), float((entropy.detach() * mask).sum())
