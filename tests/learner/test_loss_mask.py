"""An episode's loss mask (fgrpo.rollout.episodes): the template, observation and tool tokens between its turns are the
context of later turns but not in the loss. The update's gradient equals the REINFORCE gradient over the sampled
tokens only, on the padded, packed and shared-prompt layouts; the loss's gradient with respect to each masked token's
log-prob is zero; a one-turn episode (every token sampled) gives the single-turn loss exactly; the counts and metrics
read the sampled tokens only. The 2-rank sharded learner with masks: tests/learner/test_sharded.py's
fp64-episode-masks case."""

import copy
import dataclasses

import pytest
import torch

from fgrpo.algorithm.losses import policy_loss
from fgrpo.learner.forward import completion_logprobs
from fgrpo.learner.step import update_policy
from fgrpo.learner.packing import Sequence
from learner_cases import algo, grouped_seqs, reference_logprobs


def episode_masks(seqs: list[Sequence], seed: int = 0) -> list[Sequence]:
    """Each sequence as an episode: a run of sampled tokens, then some environment tokens (0), then sampled again."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for seq in seqs:
        n = len(seq.completion_ids)
        mask = [1] * n
        if n >= 3:
            start = int(torch.randint(1, n - 1, (1,), generator=gen))
            stop = min(n - 1, start + int(torch.randint(1, 6, (1,), generator=gen)))
            mask[start:stop] = [0] * (stop - start)
        out.append(dataclasses.replace(seq, loss_mask=mask))
    return out


def update(model, seqs, **layout):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = update_policy(model, optimizer, seqs, loss=algo("grpo"), pad_id=0, temperature=1.0, grad_clip=1e9,
                            max_new_tokens=24, **{"micro_batch_size": 4, **layout})
    return metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


LAYOUTS = {"padded": {}, "packed": dict(micro_batch_tokens=64), "shared prompts": dict(micro_batch_tokens=96,
                                                                                     share_prompts=True)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_update_is_the_reinforce_gradient_over_the_sampled_tokens_only(tiny_model, layout):
    seqs = episode_masks(grouped_seqs(3, 4, seed=1))
    assert any(0 in s.loss_mask for s in seqs)
    metrics, grads = update(tiny_model, seqs, **LAYOUTS[layout])
    model = copy.deepcopy(tiny_model)
    sampled = sum(sum(s.loss_mask) for s in seqs)
    loss = sum(-(s.advantage * reference_logprobs(model, s) * torch.tensor(s.loss_mask, dtype=torch.float32)).sum()
               for s in seqs) / sampled
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-4)
    # on-policy the ratio is 1: the loss is minus the advantages' mean over the sampled tokens
    expected = -sum(s.advantage * sum(s.loss_mask) for s in seqs) / sampled
    assert metrics["loss"] == pytest.approx(expected, abs=1e-6)


def test_the_losss_gradient_at_masked_tokens_is_zero(tiny_model):
    seqs = episode_masks(grouped_seqs(2, 4, seed=2))
    logp, mask, entropy = completion_logprobs(tiny_model, seqs, pad_id=0, with_entropy=True)
    logp.retain_grad()
    loss, metrics = policy_loss("grpo", logp, logp.detach(), torch.tensor([s.advantage for s in seqs]), mask,
                                clip_low=0.2, clip_high=0.2, entropy=entropy, entropy_coef=0.0)
    loss.backward()
    for row, seq in enumerate(seqs):
        keep = torch.tensor(seq.loss_mask, dtype=torch.bool)
        grad = logp.grad[row, : len(seq.completion_ids)]
        assert (grad[~keep] == 0).all()  # observation, tool and template tokens: no gradient
        assert (grad[keep] != 0).all()  # every sampled token has one (advantages are non-zero)
        assert mask[row, : len(seq.completion_ids)].tolist() == [bool(m) for m in seq.loss_mask]


def test_a_one_turn_episode_gives_the_single_turn_update_exactly(tiny_model):
    seqs = grouped_seqs(2, 4, seed=3)
    one_turn = [dataclasses.replace(s, loss_mask=[1] * len(s.completion_ids)) for s in seqs]
    (metrics_a, grads_a), (metrics_b, grads_b) = update(tiny_model, seqs), update(tiny_model, one_turn)
    assert metrics_a == metrics_b
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_trailing_environment_tokens_change_nothing(tiny_model):
    """An episode ending with masked tokens (an observation after the last turn) learns as if they were not there:
    they come after every sampled token, so no sampled token's context holds them."""
    seqs = grouped_seqs(2, 4, seed=4)
    gen = torch.Generator().manual_seed(0)
    with_tail = [dataclasses.replace(s, completion_ids=s.completion_ids + torch.randint(1, 97, (5,), generator=gen).tolist(),
                                     loss_mask=[1] * len(s.completion_ids) + [0] * 5) for s in seqs]
    (metrics_a, grads_a), (metrics_b, grads_b) = update(tiny_model, seqs), update(tiny_model, with_tail)
    assert metrics_b["loss"] == pytest.approx(metrics_a["loss"], abs=1e-7)
    assert metrics_b["entropy"] == pytest.approx(metrics_a["entropy"], rel=1e-5)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-7, rtol=1e-5)
