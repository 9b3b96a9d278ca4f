"""LoRA adapters on the policy (``model.lora``), through peft: the learner trains the adapters only, the base weights
stay frozen, the KL reference is the base (the adapters switched off: no second copy), and the sampler gets merged
weights computed out of place (the learner's base is never changed, so resume and the reference stay exact).

peft's adapters are injected into the model as it is (``inject_adapter_in_model``), not wrapped in a ``PeftModel``:
the learner's own access to the model (``model.base_model.layers``, the LM head, the FSDP2 units, the compiled
layers) sees the same modules, each targeted ``nn.Linear`` replaced by a LoRA layer holding it as ``base_layer``.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from fgrpo.infra.errors import ConfigError

ADAPTER = "default"  # peft's name of the one adapter


@dataclass(frozen=True)
class LoraSettings:
    """``model.lora``: rank r, scale alpha / r, dropout on the adapters' input, and the names of the linear layers
    they go on (None: every linear layer of the decoder, attention and MLP projections, not the LM head)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...] | None


def linear_layer_names(model) -> list[str]:
    """The distinct names (last part) of ``model``'s linear layers below the LM head: what ``target_modules`` may name."""
    head = model.get_output_embeddings()
    names = set()
    for name, module in model.named_modules():
        if _is_lora_layer(module):  # an adapted layer counts under its own name, not its base layer's or adapters'
            names.add(name.rsplit(".", 1)[-1])
        elif isinstance(module, torch.nn.Linear) and module is not head and not _inside_adapter(name):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def _inside_adapter(name: str) -> bool:
    return ".base_layer" in name or ".lora_" in name


def apply_lora(model, settings: LoraSettings) -> int:
    """Inject LoRA adapters into ``model`` in place, freeze every other weight, keep the adapters in fp32; returns
    the number of trainable parameters. Target modules that match nothing: a ConfigError listing the linear layers
    there are."""
    from peft import LoraConfig, inject_adapter_in_model

    names = linear_layer_names(model)
    targets = list(settings.target_modules) if settings.target_modules else names
    unknown = [t for t in targets if t not in names]
    if unknown:
        raise ConfigError(f"model.lora.target_modules={list(settings.target_modules or [])}: {unknown} match no linear "
                          f"layer of this model; its linear layers are {names} (null: all of them)")
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, bias="none")
    model.requires_grad_(False)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    trainable = 0
    for name, param in model.named_parameters():
        if is_adapter_weight(name):
            param.data = param.data.float()  # trained weights in fp32 whatever the base's dtype
            param.requires_grad_(True)
            trainable += param.numel()
    return trainable


def is_adapter_weight(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def has_adapters(model) -> bool:
    return any(_is_lora_layer(module) for module in model.modules())


def _is_lora_layer(module) -> bool:
    # peft not imported: no adapter was injected (apply_lora imports it), and a machine without peft runs as before
    lora = sys.modules.get("peft.tuners.lora")
    return lora is not None and isinstance(module, lora.LoraLayer)


@contextlib.contextmanager
def adapters_disabled(model):
    """Inside: ``model`` computes with its base weights alone (the KL term's reference model); a no-op without
    adapters."""
    layers = [module for module in model.modules() if _is_lora_layer(module)] if has_adapters(model) else []
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def sampler_weights(model, whole=lambda t: t, dtype: torch.dtype | None = None,
                    skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of ``model``'s weights under the base model's own names, each LoRA layer's weight merged out
    of place (``W + scale * B @ A`` in fp32); ``whole`` gathers a sharded tensor. Each tensor comes in ``dtype`` (None:
    its own), cast before it is gathered: a sharded learner gathers the sampler's bytes (bf16: half of fp32's), and a
    LoRA weight is merged shard by shard (its rows of B with all of A) first. Without adapters: the state dict as it
    is, cast. Names in ``skip`` (a tied LM head: the embedding's weight again) are neither gathered nor yielded."""
    modules = dict(model.named_modules())
    for name, tensor in model.state_dict().items():
        if is_adapter_weight(name) or name in skip:
            continue
        if ".base_layer." not in name:
            yield name, whole(tensor.to(dtype) if dtype is not None else tensor)
            continue
        owner, leaf = name.split(".base_layer.")
        if leaf == "weight":
            layer = modules[owner]
            tensor = _merged(tensor, layer.lora_B[ADAPTER].weight, whole(layer.lora_A[ADAPTER].weight),
                             layer.scaling[ADAPTER], dtype or tensor.dtype)
        elif dtype is not None:
            tensor = tensor.to(dtype)
        yield f"{owner}.{leaf}", whole(tensor)


def _merged(weight: torch.Tensor, lora_b: torch.Tensor, lora_a: torch.Tensor, scale: float,
            dtype: torch.dtype) -> torch.Tensor:
    """``W + scale * B @ A`` [out, in] in fp32, cast to ``dtype``. A sharded W and B (FSDP2: each rank the same rows
    of both, dim 0 split alike) merge on each rank's own rows with ``lora_a`` whole [r, in]; the result is sharded
    as W is."""
    if not hasattr(weight, "to_local"):
        return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(dtype)
    from torch.distributed.tensor import DTensor

    rows = weight.to_local().float() + scale * (lora_b.to_local().float() @ lora_a.float())
    return DTensor.from_local(rows.to(dtype), weight.device_mesh, weight.placements, shape=weight.shape,
                              stride=weight.stride())


def lora_settings_of(model_cfg) -> LoraSettings | None:
    """``model.lora`` of a config (a DictConfig or a saved run's dict) as :class:`LoraSettings`; None when off (no
    rank, or a config from before ``model.lora`` existed)."""
    lora = model_cfg.get("lora") or {}
    if lora.get("rank") is None:
        return None
    targets = lora.get("target_modules")
    return LoraSettings(rank=int(lora["rank"]), alpha=float(lora.get("alpha") or 2 * lora["rank"]),
                        dropout=float(lora.get("dropout") or 0.0), target_modules=tuple(targets) if targets else None)


def save_adapter(model, settings: LoraSettings, folder, base_folder) -> None:
    """The adapters of ``model`` in PEFT's own format (``adapter_config.json``, ``adapter_model.safetensors``), for
    ``PeftModel.from_pretrained(base, folder)`` (or vLLM's LoRA loading) over the base model in ``base_folder``."""
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules or linear_layer_names(model)), bias="none",
                        task_type="CAUSAL_LM", base_model_name_or_path=str(base_folder))
    config.save_pretrained(str(folder))
    # a PeftModel names its base "base_model.model."; the adapter's name is left out of the keys
    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    save_file({f"base_model.model.{name}": tensor.detach().contiguous() for name, tensor in state.items()},
              str(folder / "adapter_model.safetensors"))


def is_adapter_folder(folder) -> bool:
    return (Path(folder) / "adapter_config.json").is_file()


def merge_adapter_folder(adapter_folder, out) -> None:
    """An adapter folder (PEFT's format) merged into its base model, written as an HF folder at ``out``."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_folder = PeftConfig.from_pretrained(str(adapter_folder)).base_model_name_or_path
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_folder)).merge_and_unload()
    merged.save_pretrained(str(out))
    tokenizer_folder = adapter_folder if (Path(adapter_folder) / "tokenizer_config.json").is_file() else base_folder
    AutoTokenizer.from_pretrained(str(tokenizer_folder)).save_pretrained(str(out))
