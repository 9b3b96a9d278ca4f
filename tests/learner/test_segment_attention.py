"""Segment attention (hardware.attention=segments) against the dense masked eager attention it replaces."""

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from fgrpo.learner.packing import Sequence, lay_out_rows
from fgrpo.learner.segment_attention import SEGMENT_ATTENTION, segment_attention, segment_buckets


def groups_of(prompts, samples, seed, prompt_len=(2, 9), completion_len=(1, 14)):
    """``prompts`` random prompts with ``samples`` completions each; lengths drawn from the half-open ranges."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(prompts):
        prompt = torch.randint(1, 97, (int(torch.randint(*prompt_len, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(samples):
            n = int(torch.randint(*completion_len, (1,), generator=gen))
            seqs.append(Sequence(prompt, torch.randint(1, 97, (n,), generator=gen).tolist()))
    return seqs


# shared prompts: whole groups, a group split over rows, two groups in a row; then the same rows unshared
LAYOUTS = [([[0, 1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]], True), ([[0, 1, 2], [3, 4, 5, 6], [7], [8, 9, 10, 11]], False)]


def real_slots(layout):
    """Flat slots that hold a token (the rest is row padding)."""
    return sorted(slot for start, length, _, _ in layout.segments for slot in range(start, start + length))


def dense_allowed(layout, share):
    """The (query, key) pairs a dense masked attention allows, over real slots."""
    if share:
        allowed = layout.allowed[:, 0]
    else:  # packed without sharing: transformers' packed mask, each sequence (positions from 0) causal on itself
        sequence = (layout.position_ids == 0).cumsum(1)
        allowed = (sequence[:, :, None] == sequence[:, None, :]) & torch.ones(allowed_width(layout), allowed_width(layout),
                                                                             dtype=torch.bool).tril()
    width = allowed_width(layout)
    real = set(real_slots(layout))
    return {(r * width + q, r * width + k) for r, q, k in allowed.nonzero().tolist()
            if r * width + q in real and r * width + k in real}


def allowed_width(layout):
    return layout.input_ids.shape[1]


@pytest.mark.parametrize("rows, share", LAYOUTS)
@pytest.mark.parametrize("buckets", [1, 2])
def test_segment_buckets_allow_exactly_the_dense_masks_pairs(rows, share, buckets):
    seqs = groups_of(prompts=3, samples=4, seed=1)
    layout = lay_out_rows(seqs, rows, 0, "cpu", share_prompts=share)
    pad = layout.input_ids.numel()
    queries, keys, allowed = segment_buckets(layout.segments, pad, "cpu", buckets=buckets)
    assert len(queries) == buckets
    pairs = set()
    for q, k, a in zip(queries, keys, allowed):
        assert q.shape[0] >= 2 or buckets == 1  # torch.compile would specialise a bucket of one
        for s, i, j in a.nonzero().tolist():
            assert q[s, i] != pad and k[s, j] != pad, "an allowed pair reads padding"
            pairs.add((int(q[s, i]), int(k[s, j])))
        written = q[q != pad].tolist()
        assert len(written) == len(set(written)), "a slot is written by two segments"
    assert pairs == dense_allowed(layout, share)
    assert sorted(int(x) for q in queries for x in q[q != pad]) == real_slots(layout)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none here)")])])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_segment_attention_gives_the_dense_masked_outputs_and_gradients(dtype, atol, device):
    seqs = groups_of(prompts=3, samples=4, seed=2)
    rows = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    layout = lay_out_rows(seqs, rows, 0, device, share_prompts=True)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, True
    gen = torch.Generator().manual_seed(3)
    r, w = layout.input_ids.shape
    q, k, v = (torch.randn(r, h, w, 8, generator=gen).to(device, dtype).requires_grad_() for h in (4, 2, 2))
    additive = torch.zeros(layout.allowed.shape, dtype=dtype, device=device).masked_fill(
        ~layout.allowed, torch.finfo(dtype).min)
    dense, _ = eager_attention_forward(module, q, k, v, additive, scaling=8**-0.5)
    queries, keys, allowed = segment_buckets(layout.segments, r * w, device)
    ours, weights = segment_attention(module, q, k, v, None, scaling=8**-0.5, segment_queries=queries,
                                      segment_keys=keys, segment_allowed=allowed)
    assert weights is None and ours.shape == dense.shape == (r, w, 4, 8)
    real = torch.zeros(r * w, dtype=torch.bool, device=device)
    real[real_slots(layout)] = True
    real = real.view(r, w)
    torch.testing.assert_close(ours[real].float(), dense[real].float(), atol=atol, rtol=atol)
    assert not ours[~real].any()  # row padding: zeros, and no gradient flows from it
    upstream = torch.randn(dense.shape, generator=gen).to(device, dtype) * real[:, :, None, None]
    grads_dense = torch.autograd.grad(dense, (q, k, v), upstream)
    grads_ours = torch.autograd.grad(ours, (q, k, v), upstream)
    for ours_grad, dense_grad in zip(grads_ours, grads_dense):
        torch.testing.assert_close(ours_grad.float(), dense_grad.float(), atol=atol * 10, rtol=atol * 10)


def assert_without_inputs_it_is(model, implementation: str, fallback: str) -> None:
    """``implementation`` called without its packed-row inputs (generation, a plain forward) gives ``fallback``'s
    logits and greedy tokens."""
    reference = copy.deepcopy(model).eval()
    reference.set_attn_implementation(fallback)
    ours = copy.deepcopy(reference)
    ours.set_attn_implementation(implementation)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits)
        tokens = ours.generate(ids[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
        expected = reference.generate(ids[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, expected)


def test_without_segments_it_is_eager_attention(tiny_model):
    """Generation (sampler=hf) and plain forwards pass no segments: eager attention with its causal mask."""
    assert_without_inputs_it_is(tiny_model, SEGMENT_ATTENTION, "eager")


def test_what_segment_attention_does_not_do_is_refused(tmp_path, compose):
    from transformers import MistralConfig

    from fgrpo.validation import validate

    from fgrpo.infra.errors import ConfigError
    from fgrpo.learner.model import load_policy

    q = k = v = torch.zeros(1, 2, 3, 4)
    buckets = segment_buckets([(0, 3, 0, 0)], 3, "cpu")
    module = torch.nn.Module()
    module.num_key_value_groups = 1
    kwargs = dict(segment_queries=buckets[0], segment_keys=buckets[1], segment_allowed=buckets[2])
    with pytest.raises(ValueError, match="dropout"):
        segment_attention(module, q, k, v, None, 1.0, dropout=0.1, **kwargs)
    with pytest.raises(ValueError, match="hardware.attention=eager"):
        segment_attention(module, q, k, v, None, 1.0, sliding_window=2, **kwargs)
    with pytest.raises(ValueError, match="at least one segment"):
        segment_buckets([(0, 0, 0, 0)], 3, "cpu")
    MistralConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=16).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="hardware.attention=eager"):
        load_policy(tmp_path, dtype="float32", device="cpu", attention="segments")
    validate(compose("hardware=cpu", "hardware.attention=segments"))
    with pytest.raises(ConfigError, match="segments"):
        validate(compose("hardware=cpu", "hardware.attention=flash"))


def test_compiled_gradients_of_shared_prompt_keys_are_the_same_bits_every_time():
    """A prompt's keys and values are read by each of its completions; compiled, their gradient is a sum that must not
    depend on which thread adds first (inductor's atomic adds did: the default run's step 1 varied run to run)."""
    seqs = groups_of(prompts=4, samples=8, seed=0, prompt_len=(40, 41), completion_len=(10, 80))
    gen = torch.Generator().manual_seed(1)
    layout = lay_out_rows(seqs, [list(range(i, i + 8)) for i in range(0, 32, 8)], 0, "cpu", share_prompts=True)
    rows, width = layout.input_ids.shape
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 3, True
    q, k, v = (torch.randn(rows, heads, width, 64, generator=gen).bfloat16().requires_grad_() for heads in (9, 3, 3))
    upstream = torch.randn(rows, width, 9, 64, generator=gen).bfloat16()
    queries, keys, allowed = segment_buckets(layout.segments, rows * width, "cpu")

    def attend(q, k, v):
        return segment_attention(module, q, k, v, None, scaling=0.125, segment_queries=queries, segment_keys=keys,
                                 segment_allowed=allowed)[0]

    compiled = torch.compile(attend, dynamic=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # one thread would add in order whatever the kernel
    try:
        first, *again = [torch.autograd.grad(compiled(q, k, v), (k, v), upstream) for _ in range(5)]
    finally:
        torch.set_num_threads(threads)
    for grads in again:
        assert all(torch.equal(a, b) for a, b in zip(grads, first))
    eager = torch.autograd.grad(attend(q, k, v), (k, v), upstream)
    for ours, reference in zip(first, eager):
        torch.testing.assert_close(ours.float(), reference.float(), atol=1e-2, rtol=1e-2)
