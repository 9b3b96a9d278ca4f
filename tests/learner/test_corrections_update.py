"""The sampler/learner corrections inside the update (fgrpo.learner.step): ``none`` is the update without them bit for
bit; a correction's weights multiply each token's gradient and the tokens it drops leave the loss and its count, over
micro-batches and layouts, on LoRA's adapters and compiled layers, against the loss computed sequence by sequence. The 2-rank sharded learner with a mask:
tests/learner/test_sharded.py's fp64-token-mask case."""

import copy
import dataclasses

import pytest
import torch

from fgrpo.algorithm.corrections import rollout_weights
from fgrpo.learner.packing import Sequence
from fgrpo.learner.step import update_policy
from learner_cases import algo, grouped_seqs, reference_logprobs

LAYOUTS = {"padded": {}, "packed": dict(micro_batch_tokens=64)}


def with_sampler_logprobs(model, seqs: list[Sequence], noise: float, seed: int = 0) -> list[Sequence]:
    """Each sequence with a sampler's log-probs: the model's own, moved by Gaussian noise of scale ``noise`` (a
    sampler with other kernels; the real one: tests/test_mismatch_runs.py)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for seq in seqs:
        with torch.no_grad():
            logp = reference_logprobs(model, seq)
        moved = logp + noise * torch.randn(logp.shape, generator=gen)
        out.append(dataclasses.replace(seq, sampler_logp=moved.tolist()))
    return out


def update(model, seqs, loss, **layout):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = update_policy(model, optimizer, seqs, loss=loss, pad_id=0, temperature=1.0, grad_clip=1e9,
                            max_new_tokens=24, **{"micro_batch_size": 4, **layout})
    return metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_none_is_the_update_without_the_samplers_logprobs_bit_for_bit(tiny_model, layout):
    seqs = grouped_seqs(3, 4, seed=1)
    measured = with_sampler_logprobs(tiny_model, seqs, noise=0.3)
    for name in ("grpo", "cispo"):
        plain, grads = update(tiny_model, seqs, algo(name), **LAYOUTS[layout])
        read, read_grads = update(tiny_model, measured, algo(name), **LAYOUTS[layout])
        assert all(torch.equal(grads[key], read_grads[key]) for key in grads)
        assert read["loss"] == plain["loss"]
        assert "mismatch/kl_token" not in plain and read["mismatch/kl_token"] > 0  # measured, not used
        assert "mismatch/dropped_frac" not in read


def hand_gradients(model, seqs, mode, agg, *, low=0.5, high=2.0, off_policy=None):
    """The on-policy corrected loss sequence by sequence, unpadded: -sum kept * w * A * logp over the kept tokens
    (token-mean) or each sequence's kept tokens (then over the kept sequences)."""
    model = copy.deepcopy(model)
    terms, kept_tokens, kept_seqs = [], 0, 0
    for seq in seqs:
        logp = reference_logprobs(model, seq)[None]
        sampler, mask = torch.tensor([seq.sampler_logp]), torch.ones_like(logp)
        weights, kept = (torch.ones_like(logp), mask.bool()) if mode == "none" else rollout_weights(
            logp.detach(), sampler, mask, mode, low=low, high=high)
        if off_policy is not None and seq.advantage < 0 and (sampler - logp.detach()).mean() > off_policy:
            kept = torch.zeros_like(kept)
        term = -(kept * weights * seq.advantage * logp).sum()
        count = int(kept.sum())
        terms.append(term if agg == "token-mean" else term / max(count, 1))
        kept_tokens, kept_seqs = kept_tokens + count, kept_seqs + (count > 0)
    (sum(terms) / (kept_tokens if agg == "token-mean" else kept_seqs)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, kept_tokens


CASES = [("token_mask", None), ("sequence_mask", None), ("token_truncate", None), ("sequence_truncate", None),
         ("none", 0.1)]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode, off_policy", CASES)
def test_the_corrected_update_is_the_loss_over_the_kept_tokens_with_their_weights(tiny_model, mode, off_policy, agg):
    seqs = with_sampler_logprobs(tiny_model, grouped_seqs(3, 4, seed=1), noise=0.4, seed=2)
    loss = dataclasses.replace(algo("grpo"), agg=agg, rollout_correction=mode, off_policy_mask=off_policy,
                               correction_high=1.6 if mode.startswith("sequence") else 2.0)
    expected, kept = hand_gradients(tiny_model, seqs, mode, agg, high=loss.correction_high, off_policy=off_policy)
    total = sum(len(s.completion_ids) for s in seqs)
    if loss.drops_tokens:
        assert 0 < kept < total  # the case drops some tokens, not all
    for layout in LAYOUTS.values():
        metrics, grads = update(tiny_model, seqs, loss, **layout)
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4)
        assert metrics["mismatch/dropped_frac"] == pytest.approx(1 - kept / total)


def lora_policy(model):
    from test_lora import perturb_adapters, with_lora

    policy, _ = with_lora(model)
    perturb_adapters(policy, seed=4)
    return policy, policy


def compiled_policy(model):
    """The fast path's learner: segment attention, gradient checkpointing, compiled decoder layers (the expected
    gradients come from the same weights run eager)."""
    from fgrpo.learner.compiled_layers import compile_decoder_layers
    from fgrpo.learner.segment_attention import SEGMENT_ATTENTION

    policy = copy.deepcopy(model)
    policy.set_attn_implementation(SEGMENT_ATTENTION)
    policy.gradient_checkpointing_enable()
    torch._dynamo.reset()  # other tests' graphs of these layers' code count towards its recompile limit
    assert compile_decoder_layers(policy, grad_only=True) == 2
    return model, policy


@pytest.mark.parametrize("path", ["lora", "compiled"])
def test_a_correction_on_the_lora_and_compiled_learners_is_the_loss_over_the_kept_tokens(tiny_model, path):
    """The same check as above for token_mask with the off-policy mask, on LoRA's adapters (the base frozen: no
    gradient) and on compiled layers, packed as the default run packs."""
    eager, policy = (lora_policy if path == "lora" else compiled_policy)(tiny_model)
    seqs = with_sampler_logprobs(eager, grouped_seqs(3, 4, seed=1), noise=0.4, seed=2)
    expected, kept = hand_gradients(eager, seqs, "token_mask", "token-mean", off_policy=0.1)
    total = sum(len(s.completion_ids) for s in seqs)
    assert 0 < kept < total
    loss = dataclasses.replace(algo("grpo"), rollout_correction="token_mask", off_policy_mask=0.1)
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
    metrics = update_policy(policy, optimizer, seqs, loss=loss, pad_id=0, temperature=1.0, grad_clip=1e9,
                            max_new_tokens=24, micro_batch_size=4, micro_batch_tokens=64)
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    if path == "lora":
        assert grads and all(".lora_" in name for name in grads)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4)
    assert metrics["mismatch/dropped_frac"] == pytest.approx(1 - kept / total)


def test_the_samplers_logprobs_as_the_old_policy_give_the_ratio_to_the_sampler(tiny_model):
    """algo.old_logprobs=sampler: the ratio is pi / pi_sampler; the mismatch is still the learner's log-probs before
    the update against the sampler's, read from the forward of the update itself."""
    seqs = with_sampler_logprobs(tiny_model, grouped_seqs(2, 4, seed=3), noise=0.2)
    learner_old = update(tiny_model, seqs, algo("grpo"))[0]
    bypass = [dataclasses.replace(s, old_logp=torch.tensor(s.sampler_logp)) for s in seqs]
    sampler_old = update(tiny_model, bypass, dataclasses.replace(algo("grpo"), old_logprobs="sampler"))[0]
    assert learner_old["ratio_mean"] == pytest.approx(1.0)
    assert abs(sampler_old["ratio_mean"] - 1.0) > 0.01  # exp(noise) meaned
    assert sampler_old["mismatch/kl_token"] == pytest.approx(learner_old["mismatch/kl_token"], rel=1e-4)
