"""Compiled decoder layers, gradient checkpointing and kept matmul outputs (fgrpo.learner.compiled_layers): the same
update as the eager model."""

import copy
import logging

import pytest
import torch
from torch._dynamo.utils import compilation_time_metrics

from fgrpo.learner.segment_attention import SEGMENT_ATTENTION
from learner_cases import assert_same_update, grouped_seqs, make_seqs, update_grads


def test_compiled_layers_give_the_eager_gradients(tiny_model):
    from fgrpo.learner.compiled_layers import compile_decoder_layers

    eager = copy.deepcopy(tiny_model)
    eager.set_attn_implementation("eager")
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled) == 2
    torch._dynamo.reset()  # the layer graph traced here, not taken from an earlier test
    # two batches of different widths: the dynamic-shape graph serves both
    for seed in (8, 9):
        seqs = make_seqs(seed=seed, count=7 + seed % 2)
        assert_same_update(update_grads(compiled, seqs), update_grads(eager, seqs), loss_atol=1e-5, grad_rel=1e-4)
    # each graph traced in one attempt: no restart to specialise the layers' float attributes (RMSNorm eps, ...)
    assert compilation_time_metrics.get("compile_attempt_0") and "compile_attempt_1" not in compilation_time_metrics


def test_grad_only_compiled_layers_learn_compiled_and_generate_eager(tiny_model):
    """sampler=hf: the policy generates too, so its layers are compiled for the learner only."""
    from torch._dynamo.utils import counters

    from fgrpo.learner.compiled_layers import compile_decoder_layers

    eager = copy.deepcopy(tiny_model)
    eager.set_attn_implementation("eager")
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled, grad_only=True) == 2
    torch._dynamo.reset()  # an earlier test's compiled layer graph would otherwise be reused, uncounted
    compiled_frames = counters["frames"]["ok"]
    seqs = make_seqs(seed=8, count=7)
    assert_same_update(update_grads(compiled, seqs), update_grads(eager, seqs), loss_atol=1e-5, grad_rel=1e-4)
    assert counters["frames"]["ok"] > compiled_frames, "the learner's forward did not run compiled"

    compiled_frames = counters["frames"]["total"]
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        tokens = compiled.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        expected = eager.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert counters["frames"]["total"] == compiled_frames, "generation went through torch.compile"
    assert torch.equal(tokens, expected)


# each case compiles for 30-50 s on a 2-core CPU: both attentions in fp32, and bf16 autocast with the packed
# learner's attention (fgrpo_segments, what hardware=cpu runs); not the whole product
FP32, BF16 = (None, 1e-5, 1e-4), (torch.bfloat16, 1e-3, 0.02)


@pytest.mark.parametrize("attention, autocast_dtype, loss_atol, grad_rel", [
    ("eager", *FP32), (SEGMENT_ATTENTION, *FP32), (SEGMENT_ATTENTION, *BF16)])
def test_checkpointed_compiled_layers_give_the_eager_gradients(tiny_model, autocast_dtype, loss_atol, grad_rel,
                                                               attention):
    """The CPU default (hardware=cpu): compiled layers recomputed in the backward instead of kept."""
    from fgrpo.learner.compiled_layers import compile_decoder_layers

    eager = copy.deepcopy(tiny_model).train()
    eager.set_attn_implementation("eager")
    checkpointed = copy.deepcopy(eager)
    checkpointed.set_attn_implementation(attention)
    checkpointed.gradient_checkpointing_enable()
    # each layer runs twice per micro-batch when it is recomputed: count it on an uncompiled copy (a pre-hook:
    # the recompute stops early, before a post-hook would run)
    calls = []
    counted = copy.deepcopy(checkpointed)
    counted.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    seqs = make_seqs(seed=10, count=8)  # two micro-batches of 4
    update_grads(counted, seqs, autocast_dtype=autocast_dtype)
    assert len(calls) == 4
    assert compile_decoder_layers(checkpointed) == 2
    assert_same_update(update_grads(checkpointed, seqs, autocast_dtype=autocast_dtype),
                       update_grads(eager, seqs, autocast_dtype=autocast_dtype), loss_atol=loss_atol, grad_rel=grad_rel)
    # and packed, as hardware=cpu runs it (micro_batch_tokens): rows of several sequences through the compiled graph
    assert_same_update(update_grads(checkpointed, seqs, autocast_dtype=autocast_dtype, micro_batch_tokens=40),
                       update_grads(eager, seqs, autocast_dtype=autocast_dtype), loss_atol=loss_atol, grad_rel=grad_rel)
    # and with shared prompts (the 4D mask, or the segments' index tensors, go through the compiled graph too)
    groups = grouped_seqs(prompts=3, samples=4, seed=14)
    shared = update_grads(checkpointed, groups, autocast_dtype=autocast_dtype, micro_batch_tokens=200, share_prompts=True)
    assert shared[0]["computed_tokens"] < sum(len(s.prompt_ids) + len(s.completion_ids) for s in groups)
    assert_same_update(shared, update_grads(eager, groups, autocast_dtype=autocast_dtype),
                       loss_atol=loss_atol, grad_rel=grad_rel)


@pytest.mark.parametrize("attention, autocast_dtype, loss_atol, grad_rel", [
    (SEGMENT_ATTENTION, *FP32), (SEGMENT_ATTENTION, *BF16)])  # the eager attention: the test above
def test_selective_checkpoint_keeps_matmul_outputs_and_gives_the_eager_gradients(
        tiny_model, autocast_dtype, loss_atol, grad_rel, attention):
    """hardware.keep_matmul_outputs_gib: layers that keep their matmul outputs recompute norms, attention and SiLU
    in the backward but not the matmuls; the others are recomputed whole; the update is the eager one."""
    import fgrpo.learner.step as learner
    from fgrpo.learner.compiled_layers import compile_decoder_layers, matmul_output_bytes

    eager = copy.deepcopy(tiny_model).train()
    eager.set_attn_implementation("eager")
    selective = copy.deepcopy(eager)
    selective.set_attn_implementation(attention)
    with pytest.raises(ValueError, match="gradient_checkpointing_enable"):
        learner.keep_matmul_outputs(selective, 1)
    selective.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="selective_checkpoint=True"):
        learner.keep_matmul_outputs(selective, 1)
    assert compile_decoder_layers(selective, selective_checkpoint=True) == 2
    # torch's four-line warning about the checkpoint's context_fn is dropped; that logger's other records are not
    wrap_log = logging.getLogger("torch._higher_order_ops.wrap")
    record = wrap_log.makeRecord(wrap_log.name, logging.WARNING, __file__, 0, "\nDetected that context_fn is passed "
                                 "to torch.utils.checkpoint under torch.compile.\n", None, None)
    assert not wrap_log.filter(record)
    assert wrap_log.filter(wrap_log.makeRecord(wrap_log.name, logging.WARNING, __file__, 0, "other", None, None))
    groups = grouped_seqs(prompts=3, samples=4, seed=15)
    per_slot = matmul_output_bytes(selective, autocast_dtype)
    assert per_slot == (2 * 32 + 2 * 16 + 2 * 64) * (2 if autocast_dtype else 4)  # q, o 32 wide; k, v 16; gate, up 64

    def update_saving(kept_bytes):
        """The update, and the last dimensions of the tensors autograd keeps for the backward."""
        widths, kept_layers = [], []
        original = learner.keep_matmul_outputs
        learner.keep_matmul_outputs = lambda model, layers: kept_layers.append(layers) or original(model, layers)
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: widths.append(t.shape[-1] if t.dim() else 0) or t,
                                                          lambda t: t):
                update = update_grads(selective, groups, autocast_dtype=autocast_dtype, micro_batch_tokens=200,
                                      share_prompts=True, kept_matmul_bytes=kept_bytes)
        finally:
            learner.keep_matmul_outputs = original
        return update, widths, kept_layers

    reference = update_grads(eager, groups, autocast_dtype=autocast_dtype, micro_batch_tokens=200, share_prompts=True)
    intermediate = eager.config.intermediate_size
    for kept_bytes, layers in ((0, None), (200 * per_slot, 1), (10**9, 2)):
        update, widths, kept_layers = update_saving(kept_bytes)
        assert_same_update(update, reference, loss_atol=loss_atol, grad_rel=grad_rel)
        if layers is None:  # every layer recomputed whole: only its input is kept
            assert not kept_layers and intermediate not in widths
            continue
        # micro-batches of at most 200 token slots: a budget of 200 slots of one layer's outputs keeps at least one
        assert kept_layers and min(kept_layers) >= layers
        # the MLP's gate and up projections (intermediate_size wide) are kept, not recomputed from the layer's input
        assert widths.count(intermediate) >= 2 * len(kept_layers)


@pytest.mark.parametrize("override, fix", [
    ("hardware.gradient_checkpointing=false", "hardware.gradient_checkpointing=true"),
    ("hardware.compile_learner=false", "hardware.compile_learner=true"),
])
def test_kept_matmul_outputs_need_checkpointed_compiled_layers(compose, override, fix):
    from fgrpo.validation import validate
    from fgrpo.infra.errors import ConfigError

    validate(compose("hardware=cpu", "hardware.keep_matmul_outputs_gib=0.5"))
    with pytest.raises(ConfigError, match=fix):
        validate(compose("hardware=cpu", "hardware.keep_matmul_outputs_gib=0.5", override))
    with pytest.raises(ConfigError, match="must be auto or >= 0"):
        validate(compose("hardware=cpu", "hardware.keep_matmul_outputs_gib=-1"))
    with pytest.raises(ConfigError, match="must be auto or >= 0"):
        validate(compose("hardware=cpu", "hardware.keep_matmul_outputs_gib=lots"))
    validate(compose("hardware=cpu", "hardware.keep_matmul_outputs_gib=0", override))  # 0: nothing kept, no need
    validate(compose("hardware=cpu", override))  # auto: nothing kept without checkpointed compiled layers


def test_missing_cpp_compiler_is_a_config_error_naming_the_fix():
    from torch._inductor import config as inductor_config

    from fgrpo.infra.errors import ConfigError
    from fgrpo.learner.compiled_layers import require_cpp_compiler

    require_cpp_compiler()  # this machine has one
    with inductor_config.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        with pytest.raises(ConfigError, match="hardware.compile_learner=false"):
            require_cpp_compiler()


def test_old_logprobs_come_from_the_updates_own_kernels_so_the_first_ratio_is_one(tiny_model, monkeypatch):
    """sampler=hf compiles the layers for the learner only. The old log-probs of mini_batches > 1 came from eager
    layers (no autograd: eager), which round bf16 otherwise than the update's compiled forward: 5.0e-4 off here.
    Now they run the update's forward (autograd recording, the graph dropped): equal to 1e-5 (measured: 0.0); the
    no-autograd path of sharded models and models with dropout, through compiled layers, within 1e-3."""
    import contextlib

    import fgrpo.learner.step as learner
    from fgrpo.learner.learner import mini_batch_indices
    from fgrpo.learner.compiled_layers import compile_decoder_layers
    from fgrpo.learner.forward import completion_logprobs

    def first_mini_batch_difference(recording: bool, compiled_old: bool) -> float:
        model = copy.deepcopy(tiny_model)
        model.set_attn_implementation(SEGMENT_ATTENTION)
        model.gradient_checkpointing_enable()
        torch._dynamo.reset()  # the earlier tests' graphs of these layers' code count towards its recompile limit
        compile_decoder_layers(model, grad_only=True)
        seqs = make_seqs(seed=3, count=16)
        layout = dict(pad_id=0, temperature=1.0, autocast_dtype=torch.bfloat16)
        with monkeypatch.context() as patch:
            patch.setattr(learner, "has_dropout", lambda m: not recording)
            if not compiled_old:  # as before: no autograd, eager layers
                patch.setattr(learner, "compiled_without_grad", lambda m: contextlib.nullcontext())
            learner.fill_old_logprobs(model, seqs, micro_batch_size=4, micro_batch_tokens=256, share_prompts=False,
                                      **layout)
        assert model.training
        first = [seqs[i] for i in mini_batch_indices([len(seqs)], 0, 2)[0]]
        logp, mask, _ = completion_logprobs(model, first, **layout)  # another layout: padded rows of the half
        assert logp.requires_grad  # the update's own forward
        old = torch.zeros_like(logp)
        for row, seq in enumerate(first):
            old[row, : len(seq.completion_ids)] = seq.old_logp
        return float((logp.detach() - old)[mask].abs().max())

    before = first_mini_batch_difference(recording=False, compiled_old=False)
    assert first_mini_batch_difference(recording=True, compiled_old=True) <= 1e-5 < before
    assert first_mini_batch_difference(recording=False, compiled_old=True) <= 1e-3


def test_old_logprobs_keep_no_matmul_outputs_whatever_the_last_update_kept(tiny_model):
    """The update sets per micro-batch how many layers keep their matmul outputs and leaves its last micro-batch's
    count; the old log-probs' recording forward (next step, a micro-batch of another width) must keep none, or it
    would hold outputs its budget was not sized for."""
    from fgrpo.learner.compiled_layers import compile_decoder_layers, keep_matmul_outputs
    from fgrpo.learner.step import fill_old_logprobs

    model = copy.deepcopy(tiny_model)
    model.gradient_checkpointing_enable()
    compile_decoder_layers(model, selective_checkpoint=True)
    keep_matmul_outputs(model, 2)  # as an update's last micro-batch may leave them
    with torch.compiler.set_stance("force_eager"):  # the flags are the point here, not the kernels
        fill_old_logprobs(model, make_seqs(seed=4, count=6), pad_id=0, temperature=1.0, micro_batch_size=3)
    layers = model.model.layers
    assert not any(layer.keeps_matmul_outputs for layer in layers)
    assert all(layer.gradient_checkpointing for layer in layers)
