"""Sequences, models and update helpers shared by the learner's tests (test_learner, test_packing,
test_compiled_layers): each fast path is checked against the straightforward computation with these."""


import pytest
import torch

from fgrpo.learner.forward import completion_logprobs
from fgrpo.learner.step import update_policy
from fgrpo.algorithm.losses import LossSettings
from fgrpo.learner.packing import Sequence


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


def algo(name="dapo"):
    clips = {"grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "cispo": (1.0, 5.0)}[name]
    return LossSettings(algo=name, clip_low=clips[0], clip_high=clips[1], agg="token-mean", kl_coef=0.0, entropy_coef=0.0)


def update_grads(model, seqs, *, autocast_dtype=None, fused_head=True, loss_settings=None, micro_batch_tokens=None,
                 share_prompts=False, kept_matmul_bytes=0):
    """Loss and gradients of one on-policy update, with the LM-head path chosen by ``fused_head``."""
    import fgrpo.learner.step as learner

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


def rl_like_seqs(count, seed=0):
    """A fixed-length prompt and mostly short completions with a few at the cap, as RL rollouts come."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [60 if i % 8 == 0 else int(torch.randint(2, 20, (1,), generator=gen)) for i in range(count)]
    return [Sequence(torch.randint(1, 97, (12,), generator=gen).tolist(), torch.randint(1, 97, (n,), generator=gen).tolist(),
                     advantage=float(torch.randn(1, generator=gen))) for n in lengths]


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(config).float()


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
