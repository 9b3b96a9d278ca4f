"""Will the learner fit the GPUs it was given? An estimate from the model's config, before any weight loads.

Per GPU, for a learner of P parameters sharded over N ranks (FSDP2, fgrpo.learner): its 1/N of the weights,
gradients and two AdamW moments, each in ``hardware.learner_dtype`` (fp32: 16 bytes per parameter in all), none of
them on the GPU with ``hardware.cpu_offload``; two decoder layers gathered whole in the compute dtype (the one
computing and the one prefetched); and the activations of one micro-batch. vLLM takes
``hardware.sampler_gpu_memory_utilization`` of each card. The activation term is a rough rule (below), so the check
refuses only what clearly cannot fit and leaves a margin to the user's judgement.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# bytes of activations per token and hidden unit of one decoder layer in bf16 during its backward (attention and MLP
# inputs, projections, SiLU; Korthikanti et al. 2022 count 34 without the attention scores, which SDPA does not keep)
ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER = 34


@dataclass(frozen=True)
class LearnerMemory:
    """Bytes per GPU, by what holds them."""

    weights: float
    gradients: float
    moments: float
    gathered_layers: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.moments + self.gathered_layers + self.activations

    def describe(self) -> str:
        parts = ("weights", "gradients", "moments", "gathered_layers", "activations")
        return ", ".join(f"{name.replace('_', ' ')} {getattr(self, name) / GIB:.1f}" for name in parts)


def learner_memory(*, params: int, layer_params: int, hidden: int, layers: int, weight_dtype: str,
                   compute_dtype: str, world: int, cpu_offload: bool, checkpointing: bool,
                   micro_batch_tokens: int) -> LearnerMemory:
    """The estimate of this module's docstring, in bytes per GPU."""
    state = 0 if cpu_offload else params * BYTES[weight_dtype] / world
    per_layer = ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER * micro_batch_tokens * hidden
    # checkpointed: each layer keeps its input (2 bytes per hidden unit) and one layer at a time recomputes the rest
    activations = (micro_batch_tokens * hidden * 2 * layers + per_layer) if checkpointing else per_layer * layers
    return LearnerMemory(weights=state, gradients=state, moments=2 * state,
                         gathered_layers=2 * layer_params * BYTES[compute_dtype] if world > 1 or cpu_offload else 0.0,
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
    return dict(params=sum(p.numel() for p in model.parameters()),
                layer_params=sum(p.numel() for p in layers[0].parameters()) if layers is not None else 0,
                hidden=config.hidden_size, layers=config.num_hidden_layers)


def check_learner_fits_gpus(folder: Path, cfg, world: int) -> None:
    """Raise ConfigError when the learner clearly cannot fit this machine's GPU beside vLLM's share."""
    import torch

    from fgrpo.config import ConfigError

    hw, sampler = cfg.hardware, cfg.sampler
    shape = model_shape(folder)
    tokens = hw.micro_batch_tokens or hw.micro_batch_size * sampler.max_model_len
    compute = hw.autocast_dtype if hw.autocast_dtype in BYTES else hw.learner_dtype  # "auto" is settled later
    sharded = world > 1 or hw.fsdp

    def need(ranks: int) -> LearnerMemory:
        return learner_memory(**shape, weight_dtype=hw.learner_dtype, compute_dtype=compute, world=ranks,
                              cpu_offload=hw.cpu_offload and sharded, checkpointing=hw.gradient_checkpointing,
                              micro_batch_tokens=tokens)

    card = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    vllm_share = hw.sampler_gpu_memory_utilization if sampler.name == "vllm" else 0.0
    available = card * (1 - vllm_share)
    estimate = need(world)
    if estimate.total <= available:
        return
    enough = next((n for n in (2, 4, 8, 16, 32, 64, 128) if n > world and need(n).total <= available), None)
    more = f"launch {enough} or more GPUs (about {need(enough).total / GIB:.0f} GiB each then)" if enough else \
        "more GPUs will not do it alone"
    raise ConfigError(
        f"the learner of {cfg.model.name} ({shape['params'] / 1e9:.2f}B parameters, {hw.learner_dtype} weights with "
        f"AdamW) needs about {estimate.total / GIB:.0f} GiB per GPU with {world} process{'es' if world > 1 else ''} ({estimate.describe()} "
        f"GiB) but each GPU has {available / GIB:.0f} GiB for it ({card / GIB:.0f} GiB, less vLLM's "
        f"hardware.sampler_gpu_memory_utilization={vllm_share:g}). Options: {more}; hardware.cpu_offload=true "
        f"{'' if sharded else 'with hardware.fsdp=true '}(weights, gradients and moments in CPU memory); smaller "
        "micro-batches (hardware.micro_batch_tokens or micro_batch_size)"
        + ("" if hw.gradient_checkpointing else "; hardware.gradient_checkpointing=true"))
