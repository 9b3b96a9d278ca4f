"""torch.compile for the learner's decoder layers, and selective checkpointing inside them: layers that keep
their matmul outputs for the backward and recompute only the cheap rest (norms, rotary, attention scores, SiLU).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from fgrpo.infra.errors import ConfigError

log = logging.getLogger("fgrpo")

# hardware.compile_learner=auto compiles a run of at least this many learner updates (trainer.steps x mini_batches).
# The compile costs 35-55 s on a 2-core Xeon with AMX (by the hour's speed) and 140 s on a 2-core AVX2-only EPYC, once;
# it saves a learner update of the default run 0.8-1.9 s in fp32 and 2.4 s in bf16 on that Xeon, about 3 s in fp32 on
# that EPYC (projected): it pays after about 19 updates (Xeon, bf16), 29-42 (Xeon, fp32) and 46 (the EPYC; issue 64's
# section of bench/RESULTS.md). A resumed run counts all of trainer.steps, not the steps left: one rule per run.
COMPILE_AFTER_UPDATES = 40


def settle_compile(cfg, say: bool = True) -> None:
    """``hardware.compile_learner=auto`` becomes true for a run of at least :data:`COMPILE_AFTER_UPDATES` learner
    updates and false (eager) for a shorter one, such as the default run, before the config is validated and saved.
    ``say``: log an eager choice (not where nothing trains, an evaluation)."""
    hw = cfg.hardware
    if hw.compile_learner != "auto":
        return
    updates = cfg.trainer.steps * cfg.trainer.mini_batches
    hw.compile_learner = updates >= COMPILE_AFTER_UPDATES
    if say and not hw.compile_learner:
        log.info("hardware.compile_learner=auto: learner updates %d < %d, so the learner runs eager (compiling would "
                 "cost more than it saves; hardware.compile_learner=true compiles anyway)", updates, COMPILE_AFTER_UPDATES)


def require_cpp_compiler() -> None:
    """torch.compile on CPU writes C++; fail before the model loads when there is no compiler."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:
        raise ConfigError(
            f"hardware.compile_learner=true needs a C++ compiler for torch.compile on CPU ({exc}); install one "
            "(apt install g++, or xcode-select --install on macOS; CXX=... picks another) or set "
            "hardware.compile_learner=false"
        ) from None



def compile_decoder_layers(model, *, grad_only: bool = False, selective_checkpoint: bool = False) -> int:
    """``torch.compile`` each decoder layer, fusing its norms, rotary embedding, activation and casts.

    All layers run the same code, so they share one dynamic-shape graph (compiled on the first step,
    about 20 s on 2 cores). Returns how many layers were compiled (0: no ``layers`` list found).
    ``grad_only``: compiled only where autograd records (the learner's forward and its recompute);
    without gradients the layers run eager, so a policy that is also the sampler (``sampler=hf``)
    generates with its KV cache as before instead of recompiling for each cache length.
    ``selective_checkpoint`` (with the model's gradient checkpointing on): a second graph per layer
    that keeps the outputs of its matmuls and recomputes only the rest in the backward (norms, rotary,
    attention scores, SiLU, casts), used where :func:`keep_matmul_outputs` says. A checkpoint around
    a compiled layer cannot see which of its ops are matmuls, so this one sits inside the graph.
    The LM head's log-softmax passes (fgrpo.learner.logprobs.token_logprobs) are compiled too, from here on.
    """
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return 0
    # sizes that happen to be equal on the first compile (a segment bucket's count and its length, say) would
    # otherwise be guarded equal, and each new coincidence recompiles (about 20 s; after 8, torch runs eager)
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    # the layers' float attributes (RMSNorm eps, attention scaling, dropout) are the same in every layer and step;
    # traced as symbols, they fail to become tensors and dynamo traces each layer again (tiny_random's compile:
    # 43 -> 34 s cold, 7.9 -> 4.2 s warm; bench/RESULTS.md)
    dynamo_config.specialize_float = True
    if selective_checkpoint:
        logging.getLogger("torch._higher_order_ops.wrap").addFilter(_quiet_context_fn_warning)
    for layer in layers:
        eager = layer._call_impl
        if grad_only or selective_checkpoint:
            # nn.Module.__call__ runs _compiled_call_impl when it is set (what Module.compile sets)
            layer._compiled_call_impl = functools.partial(
                _compiled_call, layer, torch.compile(eager, dynamic=True),
                torch.compile(functools.partial(_checkpoint_keeping_matmuls, eager), dynamic=True)
                if selective_checkpoint else None,
                eager if grad_only else None)
            layer.can_keep_matmul_outputs = selective_checkpoint
        else:
            layer.compile(dynamic=True)
    # the LM head's log-softmax passes too (fgrpo.learner.logprobs): fused kernels instead of eager passes over fp32 copies
    model.get_output_embeddings().compiled_log_softmax = True
    return len(layers)


def _quiet_context_fn_warning(record: logging.LogRecord) -> bool:
    """Drops torch's warning that a checkpoint under torch.compile got a ``context_fn`` (ours keeps the
    matmul outputs): it printed four lines on every run's first step, and what it warns of, in-place ops
    in the checkpointed region, would show as gradients unlike the eager model's, which tests/learner/test_learner.py checks."""
    return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


def _compiled_call(layer, compiled, compiled_keeping_matmuls, eager, *args, **kwargs):
    if eager is not None and not torch.is_grad_enabled() and not getattr(layer, "compiled_without_grad", False):
        return eager(*args, **kwargs)
    if compiled_keeping_matmuls is not None and getattr(layer, "keeps_matmul_outputs", False):
        return compiled_keeping_matmuls(*args, **kwargs)
    return compiled(*args, **kwargs)


@contextlib.contextmanager
def compiled_without_grad(model):
    """Inside: layers compiled for the learner only (``grad_only``, sampler=hf) run compiled where autograd does not
    record too. The old log-probs of off-policy mini-batches (fgrpo.learner.step.fill_old_logprobs) then come from
    the kernels the update's forward runs, not eager ones: eager and compiled bf16 layers round differently, and the
    first mini-batch's ratio pi / pi_old would start off 1 (tests/learner/test_compiled_layers.py measures both). Its
    first use compiles the layers' no-grad graph (one more compile)."""
    layers = getattr(model.base_model, "layers", None)
    layers = list(layers) if isinstance(layers, torch.nn.ModuleList) else []
    for layer in layers:
        layer.compiled_without_grad = True
    try:
        yield
    finally:
        for layer in layers:
            layer.compiled_without_grad = False


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _keep_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _keeping_matmuls_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_matmuls)


def _checkpoint_keeping_matmuls(call, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(call, *args, use_reentrant=False, context_fn=_keeping_matmuls_context, **kwargs)


# hardware.keep_matmul_outputs_gib=auto: 0.3 GiB of bf16 outputs, or what keeps the same layers in another dtype.
# bench, AVX512-BF16, bf16: 0 -> 0.3 GiB: 4x8x64 45.9 -> 52.9% of the bf16 rate (peak RSS 3.28 -> 3.48 GiB).
# fp32 (AVX2 kernels): 0.3 -> 0.6 GiB: learner 7.81 -> 7.04 s (4x8x64), 24.5 -> 22.0 s (8x8x128), peak +0.14-0.21 GiB
KEPT_MATMUL_GIB_IN_BF16 = 0.3


def auto_kept_matmul_gib(matmul_dtype: torch.dtype) -> float:
    """The ``auto`` budget of :func:`keep_matmul_outputs` for matmul outputs in ``matmul_dtype``."""
    return KEPT_MATMUL_GIB_IN_BF16 * matmul_dtype.itemsize / torch.bfloat16.itemsize


def matmul_output_bytes(model, dtype: torch.dtype | None) -> int:
    """Bytes per token slot that one decoder layer's kept matmul outputs take (q, k, v, attention output,
    gate and up; the MLP's down projection is not needed by the backward)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    widths = (2 * config.num_attention_heads * head_dim + 2 * config.num_key_value_heads * head_dim
              + 2 * config.intermediate_size)
    return widths * (dtype or next(model.parameters()).dtype).itemsize


def recompute_all_layers(model) -> None:
    """Undo :func:`keep_matmul_outputs` (which the update sets per micro-batch and leaves as its last micro-batch
    had it): every layer recomputed whole in the backward again. A no-op where layers cannot keep matmul outputs."""
    layers = getattr(model.base_model, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and all(getattr(layer, "can_keep_matmul_outputs", False)
                                                       for layer in layers) and model.is_gradient_checkpointing:
        keep_matmul_outputs(model, 0)


def keep_matmul_outputs(model, count: int) -> None:
    """The first ``count`` decoder layers keep their matmul outputs (selective checkpoint); the others
    are recomputed whole in the backward. Needs :func:`compile_decoder_layers` with ``selective_checkpoint``."""
    if not model.is_gradient_checkpointing:
        raise ValueError("keeping matmul outputs chooses what gradient checkpointing keeps: call "
                         "model.gradient_checkpointing_enable() first (hardware.gradient_checkpointing=true)")
    decoder_layers = getattr(model.base_model, "layers", [])
    if not all(getattr(layer, "can_keep_matmul_outputs", False) for layer in decoder_layers):
        # else a layer taken out of transformers' checkpoint would keep all its activations, silently
        raise ValueError("keeping matmul outputs needs compile_decoder_layers(model, selective_checkpoint=True) "
                         "first (hardware.compile_learner=true)")
    for index, layer in enumerate(decoder_layers):
        layer.keeps_matmul_outputs = index < count
        layer.gradient_checkpointing = index >= count  # transformers' whole-layer checkpoint, around the graph
