"""Will the learner fit the GPUs it was given? An estimate from the model's config, before any weight loads.

Per GPU, for a learner of P parameters sharded over N ranks (FSDP2, fgrpo.learner.learner): its 1/N of the weights,
gradients and two AdamW moments, each in ``hardware.learner_dtype`` (fp32: 16 bytes per parameter in all), and of
the frozen reference model where the KL term needs one, none of them on the GPU with ``hardware.cpu_offload``; the
root unit (embedding, final norm, LM head) and two decoder layers gathered whole in the compute dtype (the layer
computing and the one prefetched); and the activations of one micro-batch, whose residual stream (the checkpointed
layer inputs) is in the weights' dtype in one process (autocast computes the matmuls in bf16 but adds their outputs
into the fp32 stream) and in the compute dtype when FSDP2's mixed-precision policy casts the weights; plus the LM
head's logits blocks (fgrpo.learner.logprobs.CHUNK_BYTES). vLLM takes
``hardware.sampler_gpu_memory_utilization`` of each card. The activation term is a rough rule (below): the check
refuses a launch whose state and one micro-batch's activations cannot fit, and sizes micro-batches and kept matmul
outputs from the card's memory where they are ``auto`` (:func:`auto_gpu_layout`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from fgrpo.infra.errors import ConfigError

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# bytes of activations per token and hidden unit of one decoder layer in bf16 during its backward (attention and MLP
# inputs, projections, SiLU; Korthikanti et al. 2022 count 34 without the attention scores, which SDPA does not keep)
ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER = 34
# of those, the residual stream's: the two norms' inputs (2 bytes each in bf16), 2 bytes more each in an fp32 stream
NORM_INPUTS_PER_LAYER = 2
# the LM head's blocks (fgrpo.learner.logprobs): a [rows, vocab] fp32 logits block of CHUNK_BYTES["cuda"] and one
# more of its elementwise pass (eager) or gradient
LOGITS_BLOCKS = 2


def residual_dtype(*, weight_dtype: str, compute_dtype: str, sharded: bool) -> str:
    """The dtype of the hidden states between decoder layers (what gradient checkpointing keeps per layer): FSDP2's
    mixed-precision policy hands the layers weights in the compute dtype, so the stream is in it; in one process
    autocast runs the matmuls in the compute dtype and adds their outputs into the weights' dtype (fp32)."""
    return compute_dtype if sharded else weight_dtype


@dataclass(frozen=True)
class LearnerMemory:
    """Bytes per GPU, by what holds them."""

    weights: float
    gradients: float
    moments: float
    reference: float  # the frozen reference model (KL term), sharded as the policy
    gathered: float  # the root unit and two decoder layers, whole, in the compute dtype
    activations: float  # the decoder layers' and the LM head's, for one micro-batch

    @property
    def state(self) -> float:
        """What the learner holds whatever the batch: all but the activations."""
        return self.weights + self.gradients + self.moments + self.reference + self.gathered

    @property
    def total(self) -> float:
        return self.state + self.activations

    def describe(self) -> str:
        parts = ("weights", "gradients", "moments", "reference", "gathered", "activations")
        return ", ".join(f"{name} {getattr(self, name) / GIB:.1f}" for name in parts if getattr(self, name))


def learner_memory(*, params: int, layer_params: int, root_params: int, hidden: int, layers: int,
                   weight_dtype: str, compute_dtype: str, world: int, sharded: bool, cpu_offload: bool,
                   checkpointing: bool, micro_batch_tokens: int, reference: bool = False,
                   logits_block_bytes: int = 2**30, unsharded_gradients: bool = False,
                   adapter_params: int = 0) -> LearnerMemory:
    """The estimate of this module's docstring, in bytes per GPU. ``sharded``: FSDP2 (several ranks, or
    ``hardware.fsdp``); ``cpu_offload`` counts only when sharded. ``logits_block_bytes``: the LM head's block
    (fgrpo.learner.logprobs.CHUNK_BYTES for the device). ``unsharded_gradients`` (``hardware.sync_grads_once``,
    sharded): each rank accumulates whole fp32 gradients on its GPU until the step's last micro-batch reduces them.
    ``adapter_params`` (LoRA, ``model.lora``): the base (``params``) frozen in ``weight_dtype`` without gradients or
    moments, the adapters trained in fp32 (weights, gradients, two moments: 16 bytes each); the KL reference is
    the base itself (nothing more)."""
    offloaded = cpu_offload and sharded
    state = 0 if offloaded else params * BYTES[weight_dtype] / world
    if adapter_params:
        trained = 0 if offloaded else adapter_params * BYTES["float32"] / world
        return dataclasses.replace(
            learner_memory(params=params, layer_params=layer_params, root_params=root_params, hidden=hidden,
                           layers=layers, weight_dtype=weight_dtype, compute_dtype=compute_dtype, world=world,
                           sharded=sharded, cpu_offload=cpu_offload, checkpointing=checkpointing,
                           micro_batch_tokens=micro_batch_tokens, logits_block_bytes=logits_block_bytes),
            weights=state + trained, gradients=trained, moments=2 * trained, reference=0.0)
    # whole fp32 gradients until the last micro-batch, and then the shards they are reduced into beside them
    gradients = params * BYTES["float32"] + state if unsharded_gradients and sharded else state
    residual = BYTES[residual_dtype(weight_dtype=weight_dtype, compute_dtype=compute_dtype, sharded=sharded)]
    per_token_hidden = ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER + NORM_INPUTS_PER_LAYER * (residual - 2)
    per_layer = per_token_hidden * micro_batch_tokens * hidden
    # checkpointed: each layer keeps its input (the residual stream's bytes per hidden unit) and one layer at a time
    # recomputes the rest
    body = (micro_batch_tokens * hidden * residual * layers + per_layer) if checkpointing else per_layer * layers
    activations = body + LOGITS_BLOCKS * logits_block_bytes
    return LearnerMemory(weights=state, gradients=gradients, moments=2 * state, reference=state if reference else 0.0,
                         gathered=(2 * layer_params + root_params) * BYTES[compute_dtype] if sharded else 0.0,
                         activations=activations)


def model_shape(folder: Path) -> dict[str, int]:
    """Parameter counts (all, and one decoder layer's), hidden size and layer count of the model in ``folder``,
    from its config alone (a model on the meta device: no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = getattr(model.base_model, "layers", None)
    params = sum(p.numel() for p in model.parameters())
    layer_params = sum(p.numel() for p in layers[0].parameters()) if layers is not None else 0
    return dict(params=params, layer_params=layer_params, root_params=params - layer_params * config.num_hidden_layers,
                hidden=config.hidden_size, layers=config.num_hidden_layers)


def adapter_params(folder: Path, lora) -> int:
    """How many parameters LoRA's adapters (``lora``: fgrpo.learner.lora.LoraSettings) add to the model in
    ``folder``, from its config alone (injected into a model on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fgrpo.learner.lora import apply_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return apply_lora(model, lora)


# hardware.micro_batch_tokens=auto on a GPU: a multiple of this many token slots, at most the maximum
AUTO_TOKENS_STEP, AUTO_TOKENS_MAX = 2048, 65536
# of the memory the learner's state leaves on the card, the share one micro-batch's activations may take; of what
# they leave, the share that keeps matmul outputs (hardware.keep_matmul_outputs_gib=auto). The rest: the allocator's
# fragmentation, the compiler's workspaces, HF generate's KV cache with sampler=hf
ACTIVATIONS_SHARE, KEPT_SHARE = 0.5, 0.5


def auto_gpu_layout(estimate, available: float, min_tokens: int, tokens: int | None = None) -> tuple[int, float]:
    """``(micro_batch_tokens, kept matmul GiB per micro-batch)`` from the free memory and the model:
    ``estimate(tokens) -> LearnerMemory`` (one GPU's, the model's shape bound), ``available`` the bytes the learner
    may use, ``min_tokens`` the longest sequence (a micro-batch holds at least one). Activations grow linearly with the
    tokens: the most tokens whose activations take :data:`ACTIVATIONS_SHARE` of what the state leaves, then
    :data:`KEPT_SHARE` of what is still left keeps matmul outputs (fgrpo.learner.compiled_layers) instead of
    recomputing them. ``tokens`` given (a micro-batch size set by hand): only the kept outputs are sized, for it."""
    empty = estimate(0)
    headroom = available - empty.state
    if tokens is None:
        per_token = (estimate(AUTO_TOKENS_STEP).activations - empty.activations) / AUTO_TOKENS_STEP
        tokens = int((headroom * ACTIVATIONS_SHARE - empty.activations) / per_token) // AUTO_TOKENS_STEP * AUTO_TOKENS_STEP
        tokens = max(min(tokens, AUTO_TOKENS_MAX), -(-min_tokens // 128) * 128)
    kept = max(0.0, headroom - estimate(tokens).activations) * KEPT_SHARE
    return tokens, kept / GIB


def fit_learner_to_gpus(folder: Path, cfg, world: int) -> None:
    """Settle ``auto`` in ``hardware.micro_batch_tokens`` and ``keep_matmul_outputs_gib`` from this GPU's memory
    (:func:`auto_gpu_layout`), then raise ConfigError when the learner's state, or its state and one micro-batch's
    activations, cannot fit beside vLLM's share, naming the options."""
    import torch

    from fgrpo.learner.lora import lora_settings_of

    hw = cfg.hardware
    shape = model_shape(folder)
    lora = lora_settings_of(cfg.model)
    if lora is not None:
        shape["adapter_params"] = adapter_params(folder, lora)
    card = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    vllm_share = hw.sampler_gpu_memory_utilization if cfg.sampler.name != "hf" else 0.0
    available = card * (1 - vllm_share)
    if "auto" in (hw.micro_batch_tokens, hw.keep_matmul_outputs_gib):
        fixed = None if hw.micro_batch_tokens == "auto" else _tokens(cfg)  # kept outputs sized for the real micro-batch
        tokens, kept = auto_gpu_layout(lambda n: _estimate(cfg, shape, world, world, n), available,
                                       cfg.sampler.max_model_len, tokens=fixed)
        if hw.micro_batch_tokens == "auto":
            hw.micro_batch_tokens = tokens
        if hw.keep_matmul_outputs_gib == "auto":
            selective = hw.gradient_checkpointing and hw.compile_learner
            hw.keep_matmul_outputs_gib = round(kept, 2) if selective else 0.0
        logging.getLogger("fgrpo").info(
            "GPU layout from %.0f GiB for the learner: micro-batches of %s token slots, %g GiB of matmul outputs kept",
            available / GIB, hw.micro_batch_tokens, hw.keep_matmul_outputs_gib)
    check_learner_fits_gpus(shape, cfg, world, card=card, available=available, vllm_share=vllm_share)


def _tokens(cfg) -> int:
    """Token slots per micro-batch: ``hardware.micro_batch_tokens``, or a padded micro-batch's at the longest."""
    hw = cfg.hardware
    return hw.micro_batch_tokens or hw.micro_batch_size * cfg.sampler.max_model_len


def _estimate(cfg, shape: dict, world: int, ranks: int, tokens: int) -> LearnerMemory:
    """The learner's memory per GPU for ``cfg`` on ``ranks`` processes, ``tokens`` slots per micro-batch."""
    hw = cfg.hardware
    compute = hw.autocast_dtype if hw.autocast_dtype in BYTES else hw.learner_dtype
    if hw.autocast_dtype == "auto":  # settled after this check (fgrpo.infra.precision): bf16 on a card that has it
        import torch

        compute = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else hw.learner_dtype
    return learner_memory(**shape, weight_dtype=hw.learner_dtype, compute_dtype=compute, world=ranks,
                          sharded=world > 1 or hw.fsdp or ranks > 1, cpu_offload=hw.cpu_offload,
                          checkpointing=hw.gradient_checkpointing, micro_batch_tokens=tokens,
                          reference=cfg.algo.kl_coef > 0, unsharded_gradients=hw.sync_grads_once)


def check_learner_fits_gpus(shape: dict, cfg, world: int, *, card: float, available: float, vllm_share: float) -> None:
    """Raise ConfigError when the learner cannot fit this machine's GPU beside vLLM's share (its state, or its state
    and one micro-batch's activations, a rougher estimate), naming the options."""
    hw = cfg.hardware
    tokens, kept = _tokens(cfg), float(hw.keep_matmul_outputs_gib) * GIB if hw.keep_matmul_outputs_gib != "auto" else 0
    sharded = world > 1 or hw.fsdp
    estimate = _estimate(cfg, shape, world, world, tokens)
    total = estimate.total + kept
    trains = (f"LoRA adapters of {shape['adapter_params'] / 1e6:.1f}M parameters" if shape.get("adapter_params")
              else "AdamW")
    what = (f"the learner of {cfg.model.name} ({shape['params'] / 1e9:.2f}B parameters, {hw.learner_dtype} weights "
            f"with {trains}) needs about {total / GIB:.0f} GiB per GPU with {world} "
            f"process{'es' if world > 1 else ''} ({estimate.describe()}"
            + (f", kept matmul outputs {kept / GIB:.1f}" if kept else "") + f" GiB) but each GPU has {available / GIB:.0f} "
            f"GiB for it ({card / GIB:.0f} GiB, less vLLM's hardware.sampler_gpu_memory_utilization={vllm_share:g})")
    options = []
    if hw.sync_grads_once and sharded:
        options.append(f"hardware.sync_grads_once=false (it holds the whole fp32 gradients on each GPU, "
                       f"{shape['params'] * BYTES['float32'] / GIB:.1f} GiB, until a step's last micro-batch)")
    if not (hw.cpu_offload and sharded):
        enough = next((n for n in (2, 4, 8, 16, 32, 64, 128)
                       if n > world and _estimate(cfg, shape, world, n, tokens).total + kept <= available), None)
        if enough:
            options.append(f"launch {enough} or more GPUs (about "
                           f"{_estimate(cfg, shape, world, enough, tokens).total / GIB:.0f} GiB each then)")
        options.append("hardware.cpu_offload=true" + ("" if sharded else " with hardware.fsdp=true")
                       + " (weights, gradients and moments in CPU memory)")
    options.append(f"smaller micro-batches: hardware.micro_batch_tokens={tokens // 2} (now {tokens} token slots), "
                   "or auto (sized from the card's memory)")
    if not hw.gradient_checkpointing:
        options.append("hardware.gradient_checkpointing=true")
    if kept:
        options.append(f"less kept matmul outputs (hardware.keep_matmul_outputs_gib={hw.keep_matmul_outputs_gib}; "
                       "auto sizes them from the card)")
    if total > available:
        raise ConfigError(f"{what}. Options: {'; '.join(options)}")
