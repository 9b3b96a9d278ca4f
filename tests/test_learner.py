"""The learner's log-probs and update against the straightforward computation, on a tiny model."""

import copy

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from fgrpo.learner import Sequence, completion_logprobs, fill_old_logprobs, update_policy


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).float()


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
    return OmegaConf.create(dict(name=name, clip_low=clips[0], clip_high=clips[1], loss_agg="token-mean",
                                 kl_coef=0.0, entropy_coef=0.0))


def grads_after_update(model, seqs, micro_batch_size, algo_cfg):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: inspect the gradient only
    update_policy(model, optimizer, seqs, algo_cfg=algo_cfg, pad_id=0, temperature=1.0,
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
    metrics = update_policy(model, optimizer, seqs, algo_cfg=algo("cispo"), pad_id=0, temperature=1.0,
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
