"""The learner: the policy (and a frozen reference for the KL term), AdamW and its schedule, and the tricks that
make an update fast on its hardware (packed rows, compiled layers, kept matmul outputs, process memory).

The loop hands :meth:`Learner.update` a step's sequences with their advantages and :meth:`Learner.push_weights`
hands the sampler the new weights. One optimizer step as a function of a model: fgrpo.learner.step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fgrpo.algorithm.losses import LossSettings
from fgrpo.infra import distributed
from fgrpo.infra.process_memory import release_freed_memory
from fgrpo.learner.compiled_layers import compile_decoder_layers
from fgrpo.learner.forward import PolicyPass
from fgrpo.learner.lora import LoraSettings, apply_lora, has_adapters, sampler_weights
from fgrpo.learner.packing import Sequence
from fgrpo.learner.sharded_load import builds_on_meta, shard_from_rank0
from fgrpo.learner.step import fill_old_logprobs, update_policy

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
        sampler_old = s.mini_batches > 1 and self.loss.old_logprobs == "sampler"
        if sampler_old:  # verl's bypass: the sampler's log-probs are the old policy, no extra forward
            for seq in seqs:
                seq.old_logp = torch.tensor(seq.sampler_logp, dtype=torch.float32)
        elif s.mini_batches > 1:
            fill_old_logprobs(self.policy, seqs, **layout)
        chunks = mini_batch_indices(distributed.gather_objects(len(seqs)), distributed.rank(), s.mini_batches)
        results = [
            update_policy(self.policy, self.optimizer, [seqs[i] for i in chunk], loss=self.loss, grad_clip=s.grad_clip,
                          max_new_tokens=s.max_new_tokens, ref_model=self.reference,
                          kept_matmul_bytes=int(s.kept_matmul_gib * 2**30), sync_grads_once=s.sync_grads_once,
                          # the learner's log-probs before the update: the old ones, or the first forward's
                          measure_mismatch=index == 0 or not sampler_old, **layout)
            for index, chunk in enumerate(chunks)
        ]
        self.scheduler.step()
        # the mismatch is measured in some mini-batches only (old_logprobs=sampler: the first); its largest is the max
        keys = dict.fromkeys(key for r in results for key in r)
        out = {key: float((max if key == "mismatch/log_ratio_abs_max" else np.mean)([r[key] for r in results
                                                                                    if key in r]))
               for key in keys}
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
