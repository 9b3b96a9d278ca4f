"""The learner's update against the straightforward computation, on a tiny model, and the Learner object."""

import copy
import dataclasses

import pytest
import torch

from fgrpo.learner.forward import completion_logprobs
from fgrpo.learner.step import fill_old_logprobs, update_policy
from learner_cases import algo, assert_same_update, make_seqs, reference_logprobs, update_grads


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


@pytest.mark.parametrize("autocast_dtype, loss_atol, grad_rel", [(None, 1e-6, 1e-5), (torch.bfloat16, 1e-3, 0.02)])
def test_entropy_bonus_through_the_fused_head_gives_the_full_logits_update(tiny_model, autocast_dtype, loss_atol,
                                                                           grad_rel):
    model, seqs = copy.deepcopy(tiny_model), make_seqs(seed=8, count=9)
    with_bonus = dataclasses.replace(algo("dapo"), entropy_coef=0.5)
    fused = update_grads(model, seqs, loss_settings=with_bonus, autocast_dtype=autocast_dtype, fused_head=True)
    plain = update_grads(model, seqs, loss_settings=with_bonus, autocast_dtype=autocast_dtype, fused_head=False)
    assert_same_update(fused, plain, loss_atol=loss_atol, grad_rel=grad_rel)


def test_eager_attention_gives_the_sdpa_gradients(tiny_model):
    seqs = make_seqs(seed=7, count=8)
    sdpa = copy.deepcopy(tiny_model)
    sdpa.set_attn_implementation("sdpa")
    eager = copy.deepcopy(tiny_model)
    eager.set_attn_implementation("eager")
    assert_same_update(update_grads(eager, seqs), update_grads(sdpa, seqs), loss_atol=1e-6, grad_rel=1e-5)


# ---- the Learner object: what the loop (and a resumed run) holds


def make_learner(compose, *overrides):
    from fgrpo.learner.learner import Learner
    from fgrpo.learner.model import resolve_model_folder
    from fgrpo.prepare import learner_settings, loss_settings

    cfg = compose("model=tiny_random", "hardware.compile_learner=false", "hardware.keep_matmul_outputs_gib=0",
                  "hardware.autocast_dtype=null", "hardware.sampler_dtype=float32", "trainer.warmup_steps=2", *overrides)
    return Learner(resolve_model_folder(cfg.model), learner_settings(cfg), loss_settings(cfg.algo), pad_id=0)


def test_learner_update_push_and_state_round_trip(compose, tmp_path):
    """update() steps the optimizer and the warm-up schedule; push_weights() frees the gradients before the
    sampler copies the weights; a second Learner given state_dict() continues exactly as the first would."""
    from fgrpo.rollout.samplers import HFSampler

    learner = make_learner(compose)
    before = {n: p.detach().clone() for n, p in learner.policy.named_parameters()}
    lr_first = learner.lr
    metrics = learner.update(make_seqs(seed=1, count=8))
    assert {"loss", "grad_norm", "computed_tokens"} <= metrics.keys() and metrics["grad_norm"] > 0
    assert learner.lr > lr_first  # the warm-up moved on
    assert all(not torch.equal(p, before[n]) for n, p in learner.policy.named_parameters())
    assert any(p.grad is not None for p in learner.policy.parameters())

    sampler = HFSampler(make_learner(compose).policy, tokenizer=None)
    learner.push_weights(sampler)
    assert all(p.grad is None for p in learner.policy.parameters())
    for name, tensor in sampler.model.state_dict().items():
        torch.testing.assert_close(tensor, learner.policy.state_dict()[name], rtol=0, atol=0)

    state = copy.deepcopy(learner.state_dict())
    resumed = make_learner(compose)
    resumed.load_state_dict(state)
    assert resumed.lr == learner.lr
    seqs = make_seqs(seed=2, count=8)
    learner.update(seqs)
    resumed.update(seqs)
    for (name, a), b in zip(learner.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    moments = [s["exp_avg_sq"] for s in resumed.optimizer.state_dict()["state"].values()]
    assert moments and all(m.abs().sum() > 0 for m in moments)  # the moments came with the state, not from zero


@pytest.mark.parametrize("counts,mini_batches", [([16], 4), ([12, 4], 4), ([5, 0, 3], 2), ([1, 1], 4), ([0, 0], 2)])
def test_sharded_mini_batches_are_one_processs_split(counts, mini_batches):
    from fgrpo.learner.learner import mini_batch_indices

    whole = mini_batch_indices([sum(counts)], 0, mini_batches)  # one process holding every sequence
    per_rank = [mini_batch_indices(counts, rank, mini_batches) for rank in range(len(counts))]
    assert all(len(chunks) == len(whole) for chunks in per_rank)  # every rank steps as often
    for index, chunk in enumerate(whole):
        offsets = [sum(counts[:rank]) for rank in range(len(counts))]
        held = sorted(offsets[rank] + i for rank, chunks in enumerate(per_rank) for i in chunks[index])
        assert held == sorted(chunk)  # the ranks' parts of mini-batch k make one process's mini-batch k
    assert len(whole) == min(mini_batches, sum(counts))  # empty mini-batches are left out, on every rank
