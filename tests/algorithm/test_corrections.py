"""The sampler/learner corrections (fgrpo.algorithm.corrections) and the loss terms that use them, each against a hand
computation on small tensors: values and gradients."""

import math

import pytest
import torch

from fgrpo.algorithm.corrections import (mismatch_metrics, mismatch_sums, off_policy_keep, rollout_weights,
                                         sequence_ratio)
from fgrpo.algorithm.losses import policy_loss

# two sequences of three tokens, the second two long; log rho = old - sampler per token
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, 0.0]], dtype=torch.float64)
LOG_RHO = torch.tensor([[0.1, -0.9, 1.0], [0.2, 0.3, 0.0]], dtype=torch.float64)
SAMPLER = OLD - LOG_RHO
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)


def test_token_truncate_caps_each_ratio_from_above_and_keeps_every_token():
    weights, kept = rollout_weights(OLD, SAMPLER, MASK, "token_truncate", low=0.5, high=2.0)
    hand = [[math.exp(0.1), math.exp(-0.9), 2.0], [math.exp(0.2), math.exp(0.3)]]
    assert weights[0].tolist() == pytest.approx(hand[0]) and weights[1, :2].tolist() == pytest.approx(hand[1])
    assert kept.tolist() == MASK.bool().tolist()


def test_token_mask_drops_the_tokens_beyond_either_bound_and_weights_the_rest():
    weights, kept = rollout_weights(OLD, SAMPLER, MASK, "token_mask", low=0.5, high=2.0)
    # exp(-0.9) = 0.41 < 0.5 and exp(1.0) = 2.72 > 2: out; the padding stays out
    assert kept.tolist() == [[True, False, False], [True, True, False]]
    assert weights[0].tolist() == pytest.approx([math.exp(0.1), 0.0, 0.0])
    assert weights[1, :2].tolist() == pytest.approx([math.exp(0.2), math.exp(0.3)])


def test_the_sequence_modes_weight_every_token_by_the_product_of_the_sequences_ratios():
    # sequence 0: log rho = 0.1 - 0.9 + 1.0 = 0.2; sequence 1: 0.5 (its padding's 0.0 left out)
    weights, kept = rollout_weights(OLD, SAMPLER, MASK, "sequence_truncate", low=0.5, high=1.5)
    assert weights[0].tolist() == pytest.approx([math.exp(0.2)] * 3)
    assert weights[1, :2].tolist() == pytest.approx([1.5, 1.5])  # exp(0.5) = 1.65, capped
    weights, kept = rollout_weights(OLD, SAMPLER, MASK, "sequence_mask", low=0.5, high=1.5)
    assert kept.tolist() == [[True, True, True], [False, False, False]]
    assert weights[0].tolist() == pytest.approx([math.exp(0.2)] * 3) and weights[1].tolist() == [0.0] * 3


def test_a_long_sequences_ratio_does_not_overflow():
    old, sampler, mask = torch.zeros(1, 4000), torch.full((1, 4000), -0.5), torch.ones(1, 4000)  # log rho = 2000
    weights, _ = rollout_weights(old, sampler, mask, "sequence_truncate", low=0.5, high=2.0)
    assert torch.isfinite(weights).all() and weights[0, 0].item() == pytest.approx(2.0)


@pytest.mark.parametrize("low, high", [(0.0, 2.0), (1.2, 2.0), (0.5, 0.9)])
def test_bounds_that_would_drop_an_on_policy_token_are_refused(low, high):
    with pytest.raises(ValueError, match="0 < low <= 1 <= high"):
        rollout_weights(OLD, SAMPLER, MASK, "token_mask", low=low, high=high)


def test_the_mismatch_metrics_are_the_k3_kl_and_the_ratios_beyond_the_bounds():
    sums, largest = mismatch_sums(OLD, SAMPLER, MASK, low=0.5, high=2.0)
    metrics = mismatch_metrics(sums, largest)
    log_rho = [0.1, -0.9, 1.0, 0.2, 0.3]
    k3 = [math.exp(x) - 1 - x for x in log_rho]
    assert metrics["mismatch/kl_token"] == pytest.approx(sum(k3) / 5)
    assert metrics["mismatch/kl_seq"] == pytest.approx(sum(k3) / 2)  # the sum over each sequence, meaned
    assert metrics["mismatch/log_ratio_abs_mean"] == pytest.approx(sum(abs(x) for x in log_rho) / 5)
    assert metrics["mismatch/log_ratio_abs_max"] == pytest.approx(1.0)
    assert metrics["mismatch/tokens_out_frac"] == pytest.approx(2 / 5)
    assert metrics["mismatch/seqs_out_frac"] == 0.0  # exp(0.2) and exp(0.5) lie inside [0.5, 2]
    same = mismatch_metrics(*mismatch_sums(OLD, OLD, MASK, low=0.5, high=2.0))
    assert all(value == 0.0 for value in same.values())


def test_the_sequence_ratio_is_the_geometric_mean_and_its_gradient_gspos():
    logp = torch.tensor([[-1.2, -0.7, -2.0], [-0.4, -0.9, -3.0]], dtype=torch.float64, requires_grad=True)
    ratio = sequence_ratio(logp, OLD, MASK)
    token_ratios = torch.exp(logp.detach() - OLD)
    geometric = [token_ratios[0].prod() ** (1 / 3), token_ratios[1, :2].prod() ** (1 / 2)]
    assert ratio[0].tolist() == pytest.approx([geometric[0].item()] * 3)
    assert ratio[1, :2].tolist() == pytest.approx([geometric[1].item()] * 2)
    # GSPO's objective, s * A per sequence, meaned over the sequences: its gradient, against the loss's with GRPO's
    # clip on the sequence ratio and the seq-mean-token-mean aggregation (no clip active: wide bounds)
    advantages = torch.tensor([0.7, -1.3], dtype=torch.float64)
    loss, _ = policy_loss("gspo", logp, OLD, advantages, MASK, clip_low=0.9, clip_high=9.0,
                          agg="seq-mean-token-mean", ratio_level="sequence")
    loss.backward()
    ours = logp.grad.clone()
    logp.grad = None
    lengths = MASK.sum(dim=1)
    s = torch.exp(((logp - OLD) * MASK).sum(dim=1) / lengths)
    (-(s * advantages).mean()).backward()
    assert torch.allclose(ours * MASK, logp.grad * MASK, atol=1e-12)
    assert loss.item() == pytest.approx(-(s.detach() * advantages).mean().item())


def test_the_sequence_ratio_clips_whole_sequences():
    logp = OLD + torch.tensor([[0.3, 0.3, 0.3], [0.0, 0.0, 0.0]], dtype=torch.float64)  # s = e^0.3 and 1
    logp.requires_grad_(True)
    loss, metrics = policy_loss("gspo", logp, OLD, torch.tensor([1.0, 1.0], dtype=torch.float64), MASK,
                                clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean", ratio_level="sequence")
    loss.backward()
    assert logp.grad[0].abs().max().item() == 0.0  # clipped: s above 1 + 4e-4 with A > 0
    assert logp.grad[1, :2].abs().min().item() > 0.0
    assert metrics["clip_frac_high"] == pytest.approx(3 / 5)  # the first sequence's three tokens of five


def test_cispos_sequence_form_weights_each_token_by_the_clamped_sequence_ratio():
    logp = torch.tensor([[-1.2, -0.7, -2.0], [-0.4, -0.9, -3.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([0.5, -2.0], dtype=torch.float64)
    loss, _ = policy_loss("cispo", logp, OLD, advantages, MASK, clip_low=1.0, clip_high=5.0, agg="token-mean",
                          ratio_level="sequence")
    loss.backward()
    s = sequence_ratio(logp.detach(), OLD, MASK)
    assert torch.allclose(logp.grad * MASK, -s * advantages[:, None] * MASK / MASK.sum(), atol=1e-12)


def test_rollout_weights_multiply_each_tokens_policy_gradient():
    logp = OLD.clone().requires_grad_(True)
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    weights, kept = rollout_weights(OLD, SAMPLER, MASK, "token_truncate", low=0.5, high=2.0)
    loss, _ = policy_loss("grpo", logp, OLD, advantages, kept.double(), clip_low=0.2, clip_high=0.2, weights=weights)
    loss.backward()
    # on-policy (ratio 1): d loss / d logp_t = -w_t * A / N over the N kept tokens
    assert torch.allclose(logp.grad, -weights * advantages[:, None] * MASK / MASK.sum(), atol=1e-12)


def test_the_off_policy_mask_drops_negative_sequences_the_learner_has_moved_away_from():
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    sampler = torch.tensor([[-0.2, -0.2], [-0.2, -0.2], [-1.0, -1.0]])  # mean drift 0.8, 0.8, 0.0
    mask = torch.ones(3, 2)
    keep = off_policy_keep(logp, sampler, torch.tensor([-1.0, 1.0, -1.0]), mask, threshold=0.5)
    assert keep.tolist() == [False, True, True]  # only a negative advantage with drift above the threshold
    assert off_policy_keep(logp, sampler, torch.tensor([-1.0, 1.0, -1.0]), mask, threshold=0.9).all()


def test_the_bias_corrected_kl_has_the_reverse_kls_gradient():
    """k3 times the ratio pi / pi_old: its gradient from samples of pi_old is the exact reverse KL's gradient
    E_pi[grad k3 + k3 grad log pi] (DeepSeek-V3.2); without the ratio the second term is missing."""
    logp = torch.tensor([[-1.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.4, -0.2]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)

    def kl_grad(correct: bool) -> torch.Tensor:
        logp.grad = None
        loss, _ = policy_loss("grpo", logp, logp.detach(), zero, mask, clip_low=0.2, clip_high=0.2, ref_logp=ref,
                              kl_coef=1.0, kl_bias_correction=correct)
        loss.backward()
        return logp.grad.clone()

    x = (ref - logp.detach())
    k3, grad_k3 = torch.exp(x) - x - 1, -(torch.exp(x) - 1)  # d k3 / d logp
    assert torch.allclose(kl_grad(False), grad_k3 / 2, atol=1e-12)
    assert torch.allclose(kl_grad(True), (grad_k3 + k3) / 2, atol=1e-12)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none here)")])])
def test_every_correction_runs_on_the_tensors_device(device):
    """The bounds are numbers, not host tensors: a CUDA batch is clamped and compared where it lies."""
    old, sampler, mask = OLD.to(device), SAMPLER.to(device), MASK.to(device)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        weights, kept = rollout_weights(old, sampler, mask, mode, low=0.5, high=2.0)
        assert weights.device.type == device and kept.device.type == device
        reference = rollout_weights(OLD, SAMPLER, MASK, mode, low=0.5, high=2.0)[0]
        assert torch.allclose(weights.cpu(), reference)
    sums, largest = mismatch_sums(old, sampler, mask, low=0.5, high=2.0)
    assert (sums, largest) == mismatch_sums(OLD, SAMPLER, MASK, low=0.5, high=2.0)
