"""The learner's log-probs and update against the straightforward computation, on a tiny model."""

import copy
import dataclasses
import logging
import os

import pytest
import torch

from fgrpo.packing import Sequence
from fgrpo.forward import completion_logprobs
from fgrpo.learner import fill_old_logprobs, update_policy
from fgrpo.losses import LossSettings
from fgrpo.segment_attention import SEGMENT_ATTENTION


def make_seqs(seed=0, count=6):
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(count):
        prompt = torch.randint(1, 97, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist()
        completion = torch.randint(1, 97, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
        seqs.append(Sequence(prompt, completion, advantage=float(torch.randn(1, generator=gen))))
    return seqs


def reference_logprobs(model, seq, temperature=1.0):
    """One unpadded sequence, full-vocabulary log-softmax at every position: the plain way."""
    ids = torch.tensor([seq.prompt_ids + seq.completion_ids])
    logits = model(ids).logits[0, len(seq.prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq.completion_ids)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fast_logprobs_equal_plain_computation(tiny_model, temperature):
    seqs = make_seqs()
    logp, mask, entropy = completion_logprobs(tiny_model, seqs, pad_id=0, temperature=temperature, with_entropy=True)
    assert logp.shape == mask.shape == (6, max(len(s.completion_ids) for s in seqs))
    for row, seq in enumerate(seqs):
        n = len(seq.completion_ids)
        torch.testing.assert_close(logp[row, :n], reference_logprobs(tiny_model, seq, temperature), atol=1e-5, rtol=1e-5)
        assert mask[row, :n].all() and not mask[row, n:].any()
        ids = torch.tensor([seq.prompt_ids + seq.completion_ids])
        probs = torch.softmax(tiny_model(ids).logits[0, len(seq.prompt_ids) - 1 : -1] / temperature, -1)
        expected_entropy = -(probs * probs.log()).sum(-1)
        torch.testing.assert_close(entropy[row, :n], expected_entropy, atol=1e-5, rtol=1e-5)


def algo(name="dapo"):
    clips = {"grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "cispo": (1.0, 5.0)}[name]
    return LossSettings(algo=name, clip_low=clips[0], clip_high=clips[1])


def grads_after_update(model, seqs, micro_batch_size, loss_settings):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: inspect the gradient only
    update_policy(model, optimizer, seqs, loss=loss_settings, pad_id=0, temperature=1.0,
                  micro_batch_size=micro_batch_size, grad_clip=1e9, max_new_tokens=8)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["grpo", "dapo", "cispo"])
def test_micro_batching_does_not_change_the_gradient(tiny_model, name):
    seqs = make_seqs(seed=1, count=7)
    full = grads_after_update(tiny_model, seqs, 7, algo(name))
    for size in (1, 3):
        split = grads_after_update(tiny_model, seqs, size, algo(name))
        for key in full:
            torch.testing.assert_close(split[key], full[key], atol=1e-6, rtol=1e-4)


def test_on_policy_update_equals_reinforce_gradient(tiny_model):
    seqs = make_seqs(seed=2)
    grads = grads_after_update(tiny_model, seqs, 4, algo("grpo"))
    model = copy.deepcopy(tiny_model)
    total_tokens = sum(len(s.completion_ids) for s in seqs)
    loss = sum(-(s.advantage * reference_logprobs(model, s)).sum() for s in seqs) / total_tokens
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-4)


def test_update_changes_every_parameter_and_reports_metrics(tiny_model):
    model = copy.deepcopy(tiny_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seqs = make_seqs(seed=3)
    metrics = update_policy(model, optimizer, seqs, loss=algo("cispo"), pad_id=0, temperature=1.0,
                            micro_batch_size=2, grad_clip=1.0, max_new_tokens=8)
    for name, param in model.named_parameters():
        assert not torch.equal(before[name], param.detach()), name
    for key in ("loss", "grad_norm", "clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "entropy"):
        assert key in metrics
    assert metrics["ratio_mean"] == pytest.approx(1.0)


def test_off_policy_old_logprobs_are_recorded(tiny_model):
    seqs = make_seqs(seed=4)
    fill_old_logprobs(tiny_model, seqs, pad_id=0, temperature=1.0, micro_batch_size=4)
    for seq in seqs:
        torch.testing.assert_close(seq.old_logp, reference_logprobs(tiny_model, seq).detach(), atol=1e-5, rtol=1e-5)


# ---- the fast path (fused LM head, eager attention, compiled layers) against the straightforward one


def update_grads(model, seqs, *, autocast_dtype=None, fused_head=True, loss_settings=None, micro_batch_tokens=None,
                 share_prompts=False, kept_matmul_bytes=0):
    """Loss and gradients of one on-policy update, with the LM-head path chosen by ``fused_head``."""
    import fgrpo.learner as learner

    original = learner.completion_logprobs
    learner.completion_logprobs = lambda *a, **k: original(*a, **{**k, "fused_head": fused_head})
    try:
        model.zero_grad(set_to_none=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        metrics = update_policy(model, optimizer, seqs, loss=loss_settings or algo("dapo"), pad_id=0, temperature=0.8,
                                micro_batch_size=4, grad_clip=1e9, max_new_tokens=8, autocast_dtype=autocast_dtype,
                                micro_batch_tokens=micro_batch_tokens, share_prompts=share_prompts,
                                kept_matmul_bytes=kept_matmul_bytes)
    finally:
        learner.completion_logprobs = original
    return metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_update(a, b, *, loss_atol, grad_rel):
    (metrics_a, grads_a), (metrics_b, grads_b) = a, b
    assert metrics_a["loss"] == pytest.approx(metrics_b["loss"], abs=loss_atol)
    assert metrics_a["entropy"] == pytest.approx(metrics_b["entropy"], rel=grad_rel)
    for name in grads_b:
        scale = grads_b[name].norm()
        assert (grads_a[name] - grads_b[name]).norm() <= grad_rel * scale + 1e-9, name


@pytest.mark.parametrize("autocast_dtype, loss_atol, grad_rel", [
    (None, 1e-6, 1e-5),  # fp32: the same numbers up to summation order
    (torch.bfloat16, 1e-3, 0.02),  # bf16 matmuls: both paths round, differently (8-bit mantissa)
])
def test_fused_head_gives_the_straightforward_loss_and_gradients(tiny_model, autocast_dtype, loss_atol, grad_rel):
    model, seqs = copy.deepcopy(tiny_model), make_seqs(seed=5, count=9)
    fused = update_grads(model, seqs, autocast_dtype=autocast_dtype, fused_head=True)
    plain = update_grads(model, seqs, autocast_dtype=autocast_dtype, fused_head=False)
    assert_same_update(fused, plain, loss_atol=loss_atol, grad_rel=grad_rel)


def test_entropy_bonus_takes_the_path_with_an_entropy_gradient(tiny_model):
    model, seqs = copy.deepcopy(tiny_model), make_seqs(seed=6)
    with_bonus = dataclasses.replace(algo("dapo"), entropy_coef=0.5)
    _, bonus = update_grads(model, seqs, loss_settings=with_bonus)
    _, no_bonus = update_grads(model, seqs)
    assert any(not torch.allclose(bonus[n], no_bonus[n]) for n in bonus)


def test_eager_attention_gives_the_sdpa_gradients(tiny_model):
    seqs = make_seqs(seed=7, count=8)
    sdpa = copy.deepcopy(tiny_model)
    sdpa.set_attn_implementation("sdpa")
    eager = copy.deepcopy(tiny_model)
    eager.set_attn_implementation("eager")
    assert_same_update(update_grads(eager, seqs), update_grads(sdpa, seqs), loss_atol=1e-6, grad_rel=1e-5)


def test_compiled_layers_give_the_eager_gradients(tiny_model):
    from fgrpo.compiled_layers import compile_decoder_layers

    eager = copy.deepcopy(tiny_model)
    eager.set_attn_implementation("eager")
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled) == 2
    # two batches of different widths: the dynamic-shape graph serves both
    for seed in (8, 9):
        seqs = make_seqs(seed=seed, count=7 + seed % 2)
        assert_same_update(update_grads(compiled, seqs), update_grads(eager, seqs), loss_atol=1e-5, grad_rel=1e-4)


def test_grad_only_compiled_layers_learn_compiled_and_generate_eager(tiny_model):
    """sampler=hf: the policy generates too, so its layers are compiled for the learner only."""
    from torch._dynamo.utils import counters

    from fgrpo.compiled_layers import compile_decoder_layers

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


@pytest.mark.parametrize("autocast_dtype, loss_atol, grad_rel", [
    (None, 1e-5, 1e-4),
    (torch.bfloat16, 1e-3, 0.02),
])
@pytest.mark.parametrize("attention", ["eager", SEGMENT_ATTENTION])
def test_checkpointed_compiled_layers_give_the_eager_gradients(tiny_model, autocast_dtype, loss_atol, grad_rel,
                                                               attention):
    """The CPU default (hardware=cpu): compiled layers recomputed in the backward instead of kept."""
    from fgrpo.compiled_layers import compile_decoder_layers

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


@pytest.mark.parametrize("autocast_dtype, loss_atol, grad_rel", [
    (None, 1e-5, 1e-4),
    (torch.bfloat16, 1e-3, 0.02),
])
@pytest.mark.parametrize("attention", ["eager", SEGMENT_ATTENTION])
def test_selective_checkpoint_keeps_matmul_outputs_and_gives_the_eager_gradients(
        tiny_model, autocast_dtype, loss_atol, grad_rel, attention):
    """hardware.keep_matmul_outputs_gib: layers that keep their matmul outputs recompute norms, attention and SiLU
    in the backward but not the matmuls; the others are recomputed whole; the update is the eager one."""
    import fgrpo.learner as learner
    from fgrpo.compiled_layers import compile_decoder_layers, matmul_output_bytes

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


# ---- packing: several sequences per row (hardware.micro_batch_tokens), against one padded sequence per row


def test_pack_rows_first_fit_decreasing():
    from fgrpo.packing import pack_rows

    lengths = [5, 9, 2, 7, 3, 3, 12, 1]
    rows = pack_rows(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert rows[0] == [6]  # longer than a row: a row of its own
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows[1:])
    assert rows == [[6], [1, 7], [3, 4], [0, 5, 2]]  # 12 | 9+1 | 7+3 | 5+3+2: first fit, longest first
    assert rows == pack_rows(lengths, 10)


def rl_like_seqs(count, seed=0):
    """A fixed-length prompt and mostly short completions with a few at the cap, as RL rollouts come."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [60 if i % 8 == 0 else int(torch.randint(2, 20, (1,), generator=gen)) for i in range(count)]
    return [Sequence(torch.randint(1, 97, (12,), generator=gen).tolist(), torch.randint(1, 97, (n,), generator=gen).tolist(),
                     advantage=float(torch.randn(1, generator=gen))) for n in lengths]


@pytest.mark.parametrize("seqs", [rl_like_seqs(40), make_seqs(seed=11, count=40)], ids=["rl-like", "even"])
def test_token_budget_micro_batches_hold_every_sequence_once_within_the_budget(seqs):
    from fgrpo.packing import micro_batches

    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    for tokens in (1, 40, 150, 10_000):
        micros = micro_batches(seqs, size=4, tokens=tokens)
        assert sorted(id(s) for m in micros for s in m.seqs) == sorted(id(s) for s in seqs)
        for m in micros:
            assert sorted(i for row in m.rows for i in row) == list(range(len(m.seqs)))
            assert m.padded_tokens <= max(tokens, max(lengths))
        if tokens == 10_000:
            assert len(micros) == 1
    # with the budget of 8 longest sequences: about as few padded slots as 8 sorted sequences per micro-batch
    # (the padded layout, best for even lengths; micro-batch boundaries differ), never fewer than the tokens
    padded = micro_batches(seqs, size=8, tokens=None)
    assert [len(m.seqs) for m in padded] == [8] * 5 and all(m.rows is None for m in padded)
    slots = sum(m.padded_tokens for m in micro_batches(seqs, size=8, tokens=8 * max(lengths)))
    assert sum(lengths) <= slots <= 1.05 * sum(m.padded_tokens for m in padded)


@pytest.mark.parametrize("share", [False, True])
def test_one_row_micro_batches_have_no_padding_and_stay_within_the_budget(share):
    """Segment attention: one row per micro-batch, every slot a token, a shared prompt once per micro-batch."""
    from fgrpo.packing import prompt_units, units_length, micro_batches

    seqs = grouped_seqs(prompts=5, samples=8, seed=21)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    groups = [[i for i in range(len(seqs)) if seqs[i].prompt_ids == seqs[k].prompt_ids] for k in range(0, 40, 8)]
    longest = max(units_length(seqs, [g]) for g in groups) if share else max(lengths)
    for tokens in (30, 100, 400, 10_000):
        micros = micro_batches(seqs, size=4, tokens=tokens, share_prompts=share, one_row=True)
        assert sorted(id(s) for m in micros for s in m.seqs) == sorted(id(s) for s in seqs)
        for m in micros:
            assert m.rows == [list(range(len(m.seqs)))]
            assert m.padded_tokens == m.real_tokens == units_length(m.seqs, prompt_units(m.seqs, m.rows[0], share))
            # over the budget only as a lone row of the layout, at most as long as the longest sequence or group
            assert m.padded_tokens <= max(tokens, longest)
        unshared = sum(lengths)
        total = sum(m.real_tokens for m in micros)
        assert total == unshared if not share else total < unshared
    # the whole step in one micro-batch: each group's prompt computed once
    (whole,) = micro_batches(seqs, size=4, tokens=10_000, share_prompts=share, one_row=True)
    prompts = {tuple(s.prompt_ids) for s in seqs}
    if share:
        assert whole.real_tokens == sum(len(p) for p in prompts) + sum(len(s.completion_ids) for s in seqs)


def test_token_budget_holds_when_the_longest_sequence_is_over_half_of_it():
    from fgrpo.packing import micro_batches

    lengths = [50, 44, 42, 41, 40, 39, 30, 24, 6]  # rows 1.5 or 2 x 50 wide would not fit 64 slots
    seqs = [Sequence([1] * 4, [2] * (n - 4)) for n in lengths]
    for cost in (0.0, 1e-3):
        micros = micro_batches(seqs, size=4, tokens=64, width_cost=cost)
        assert all(m.padded_tokens <= 64 for m in micros)
        assert sorted(id(s) for m in micros for s in m.seqs) == sorted(id(s) for s in seqs)


def test_rl_like_lengths_pack_several_to_a_row():
    from fgrpo.packing import micro_batches

    seqs = rl_like_seqs(64, seed=1)
    real = sum(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)
    padded = sum(m.padded_tokens for m in micro_batches(seqs, size=32, tokens=None))
    micros = micro_batches(seqs, size=32, tokens=32 * 72)
    packed = sum(m.padded_tokens for m in micros)
    assert max(len(row) for m in micros for row in m.rows) >= 3
    assert 1 - real / packed < 0.5 * (1 - real / padded)  # under half the padding


def test_micro_batch_layout_weighs_padding_against_row_width(tiny_model):
    from fgrpo.forward import attention_width_cost
    from fgrpo.packing import micro_batches

    # the tiny Llama: 2 * hidden / parameters of one layer
    layer_params = sum(p.numel() for p in tiny_model.model.layers[0].parameters())
    assert attention_width_cost(tiny_model) == pytest.approx(2 * 32 / layer_params)
    # lengths just over half the longest: rows as wide as the longest hold one each, twice as wide pack two
    seqs = [Sequence([1] * 6, [2] * n) for n in (14, 8, 9, 10, 8, 9, 10, 11, 12, 13)]
    longest = 20

    def widths(cost):
        return {max(sum(len(m.seqs[i].prompt_ids) + len(m.seqs[i].completion_ids) for i in row) for row in m.rows)
                for m in micro_batches(seqs, size=4, tokens=1000, width_cost=cost)}

    assert max(widths(0.0)) > longest  # attention free: the wide rows, least padding
    assert max(widths(1.0)) == longest  # attention dear: one sequence per row
    segments = copy.deepcopy(tiny_model)
    segments.set_attn_implementation(SEGMENT_ATTENTION)
    assert attention_width_cost(segments) == 0.0  # each segment gathers its own keys, whatever the row width


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(config).float()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["eager", "sdpa", SEGMENT_ATTENTION])
def test_packed_rows_give_each_sequence_its_own_logprobs(tiny_model, arch, attention):
    """Sequences sharing a row see only themselves: their log-probs are those of each one run alone."""
    from fgrpo.packing import pack_rows

    model = copy.deepcopy(tiny_model) if arch == "llama" else tiny_qwen2()
    model.set_attn_implementation(attention)
    seqs = make_seqs(seed=12, count=9)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    rows = pack_rows(lengths, 2 * max(lengths))
    assert max(len(row) for row in rows) >= 3
    assert_each_sequence_alone(model, seqs, rows=rows)


def assert_each_sequence_alone(model, seqs, **layout):
    """Log-probs laid out as ``layout`` says equal each sequence's own unpadded run; entropy the padded layout's."""
    logp, mask, entropy = completion_logprobs(model, seqs, pad_id=0, temperature=0.7, with_entropy=True, **layout)
    padded_logp, _, padded_entropy = completion_logprobs(model, seqs, pad_id=0, temperature=0.7, with_entropy=True)
    for row, seq in enumerate(seqs):
        n = len(seq.completion_ids)
        torch.testing.assert_close(logp[row, :n], reference_logprobs(model, seq, 0.7), atol=1e-5, rtol=1e-5)
        assert mask[row, :n].all() and not mask[row, n:].any()
    torch.testing.assert_close(entropy, padded_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logp, padded_logp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [12, 150, 1000])
def test_packed_micro_batches_give_the_padded_loss_and_gradients(tiny_model, tokens):
    model, seqs = copy.deepcopy(tiny_model), rl_like_seqs(count=11, seed=13)
    packed = update_grads(model, seqs, micro_batch_tokens=tokens)
    padded = update_grads(model, seqs)
    assert_same_update(packed, padded, loss_atol=1e-6, grad_rel=1e-5)
    assert packed[0]["padding_frac"] < padded[0]["padding_frac"]


# ---- shared prompts: a prompt's samples follow one copy of it in a row (hardware.share_prompts)


def grouped_seqs(prompts, samples, seed=0):
    """``prompts`` groups of ``samples`` sequences with one prompt each and RL-like completion lengths."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(prompts):
        prompt = torch.randint(1, 97, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen).tolist()
        for k in range(samples):
            n = 24 if k % 4 == 0 else int(torch.randint(1, 10, (1,), generator=gen))
            seqs.append(Sequence(prompt, torch.randint(1, 97, (n,), generator=gen).tolist(),
                                 advantage=float(torch.randn(1, generator=gen))))
    return seqs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["eager", "sdpa", SEGMENT_ATTENTION])
def test_shared_prompt_rows_give_each_sequence_its_own_logprobs(tiny_model, arch, attention):
    """A completion behind a shared prompt sees the prompt and itself only: its own sequence's log-probs."""
    from fgrpo.packing import lay_out_rows

    model = copy.deepcopy(tiny_model) if arch == "llama" else tiny_qwen2()
    model.set_attn_implementation(attention)
    seqs = grouped_seqs(prompts=3, samples=4, seed=15)
    # a whole group in a row; a group split over two rows; two groups in one row; a lone sequence with padding
    rows = [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
    layout = lay_out_rows(seqs, rows, 0, "cpu", share_prompts=True)
    prompt_lengths = [len(seqs[i].prompt_ids) for i in (0, 4, 6, 8, 10)]
    assert layout.real_tokens == sum(prompt_lengths) + sum(len(s.completion_ids) for s in seqs)
    assert_each_sequence_alone(model, seqs, rows=rows, share_prompts=True)


def test_shared_prompt_layout_masks_every_completion_off_the_others():
    from fgrpo.packing import lay_out_rows

    prompt = [5, 6, 7]
    seqs = [Sequence(prompt, [1, 2]), Sequence(prompt, [3]), Sequence([9], [4])]
    layout = lay_out_rows(seqs, [[0, 1, 2]], 0, "cpu", share_prompts=True)
    # row: 5 6 7 | 1 2 | 3 | 9 4, positions continue from the prompt for each completion
    assert layout.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 9, 4]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1]]
    assert layout.predict_at.tolist() == [2, 3, 2, 6]  # the prompt's last token predicts both first tokens
    allowed = layout.allowed[0, 0].int().tolist()
    assert allowed[5] == [1, 1, 1, 0, 0, 1, 0, 0]  # completion 2 sees the prompt and itself, not completion 1
    assert allowed[4] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert allowed[7] == [0, 0, 0, 0, 0, 0, 1, 1]  # the other prompt's sequence sees only itself
    assert lay_out_rows(seqs, [[0, 1, 2]], 0, "cpu").allowed is None  # not shared: the positions' packed mask


@pytest.mark.parametrize("tokens", [30, 200, 1000])
def test_shared_prompt_micro_batches_give_the_padded_loss_and_gradients(tiny_model, tokens):
    from fgrpo.packing import micro_batches

    model, seqs = copy.deepcopy(tiny_model), grouped_seqs(prompts=4, samples=8, seed=16)
    shared = update_grads(model, seqs, micro_batch_tokens=tokens, share_prompts=True)
    assert_same_update(shared, update_grads(model, seqs), loss_atol=1e-6, grad_rel=1e-5)
    packed = update_grads(model, seqs, micro_batch_tokens=tokens)
    assert shared[0]["computed_tokens"] < packed[0]["computed_tokens"] == sum(
        len(s.prompt_ids) + len(s.completion_ids) for s in seqs)
    micros = micro_batches(seqs, size=4, tokens=tokens, share_prompts=True)
    assert sorted(id(s) for m in micros for s in m.seqs) == sorted(id(s) for s in seqs)
    longest_group = max(sum(len(s.completion_ids) for s in seqs[k : k + 8]) + len(seqs[k].prompt_ids)
                        for k in range(0, 32, 8))
    assert all(m.share_prompts and m.padded_tokens <= max(tokens, longest_group) for m in micros)


def test_shared_prompts_need_packed_rows_and_a_mask_taking_attention(tiny_model, compose):
    from fgrpo.config import ConfigError, validate
    from fgrpo.forward import _attention_mask

    validate(compose("hardware=cpu", "hardware.share_prompts=true"))
    cfg = compose("hardware=cpu", "hardware.share_prompts=true", "hardware.micro_batch_tokens=null")
    with pytest.raises(ConfigError, match="hardware.micro_batch_tokens"):
        validate(cfg)
    model = copy.deepcopy(tiny_model)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="hardware.attention=segments"):
        _attention_mask(model, torch.ones(1, 1, 2, 2, dtype=torch.bool))


@pytest.mark.parametrize("override, fix", [
    ("hardware.gradient_checkpointing=false", "hardware.gradient_checkpointing=true"),
    ("hardware.compile_learner=false", "hardware.compile_learner=true"),
])
def test_kept_matmul_outputs_need_checkpointed_compiled_layers(compose, override, fix):
    from fgrpo.config import ConfigError, validate

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

    from fgrpo.config import ConfigError
    from fgrpo.compiled_layers import require_cpp_compiler

    require_cpp_compiler()  # this machine has one
    with inductor_config.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        with pytest.raises(ConfigError, match="hardware.compile_learner=false"):
            require_cpp_compiler()


GLIBC_MEMORY_PROBE = """
import torch
from fgrpo.process_memory import keep_freed_memory, release_freed_memory

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

assert keep_freed_memory()
block = torch.ones(256 << 20, dtype=torch.uint8)  # under the 1 GiB mmap threshold: a heap block
before = rss()
del block
kept = rss()
assert release_freed_memory()
print(before - kept, kept - rss())
"""


def test_freed_memory_is_kept_within_a_step_and_released_after_it():
    """keep_freed_memory holds freed blocks (no page faults next time); release_freed_memory hands them back.

    In a child process: both change process-wide malloc settings."""
    import platform
    import subprocess
    import sys

    from fgrpo.process_memory import keep_freed_memory, release_freed_memory

    if not (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"):
        assert keep_freed_memory() is False and release_freed_memory() is False
        return
    out = subprocess.run([sys.executable, "-c", GLIBC_MEMORY_PROBE], capture_output=True, text=True, check=True)
    dropped_on_free, dropped_on_release = (int(x) for x in out.stdout.split())
    assert dropped_on_free < 16 << 20  # freeing alone keeps the block's pages
    assert dropped_on_release > 200 << 20  # the trim returns them


KERNEL_CACHE_PROBE = """
import os, sys, torch
from fgrpo.process_memory import bound_kernel_caches, release_freed_memory

print(bound_kernel_caches(), file=sys.stderr)
torch.set_num_threads(2)
# the learner's matmul dtype here: bf16 (oneDNN's kernels) where it is native; where it is emulated, fp32 (1.4 TFLOP
# of emulated bf16 would take hours)
from fgrpo.precision import bf16_is_fast, probe_matmul_rates
dtype = torch.bfloat16 if bf16_is_fast(probe_matmul_rates()) else torch.float32
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
weight = torch.randn(576, 1536, dtype=dtype)
def matmul_with_grad(rows):
    x = torch.randn(rows, 576, dtype=dtype, requires_grad=True)
    (x @ weight).sum().backward()
for rows in range(1000, 1064):  # the caches full
    matmul_with_grad(rows)
release_freed_memory()
start = rss()
for rows in range(1064, 1364):  # 300 new shapes, as 300 learner steps' row widths would bring
    matmul_with_grad(rows)
release_freed_memory()
print(rss() - start)
"""


def test_matmul_kernel_caches_stay_bounded_as_shapes_change(monkeypatch):
    """Each new matmul shape adds a kernel to oneDNN's and ideep's caches; capped at 64 the memory stays flat.

    In a child process (the caches read the cap once). Without the cap, on the 2-core Xeon here, the
    same probe grew by 558 MiB."""
    import platform
    import subprocess
    import sys

    from fgrpo.process_memory import KERNEL_CACHE_CAPACITY, bound_kernel_caches

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")  # a user's own setting wins
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")  # so that the test's own setting is undone after it
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert bound_kernel_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(KERNEL_CACHE_CAPACITY),
                                     "LRU_CACHE_CAPACITY": "7"}
    if platform.system() != "Linux":
        return
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", KERNEL_CACHE_PROBE], capture_output=True, text=True, check=True, env=env)
    assert "'LRU_CACHE_CAPACITY': '64'" in out.stderr
    assert int(out.stdout) < 64 << 20
