import pytest
import torch

from fgrpo.algorithm.losses import AGG_MODES, aggregate, per_token_policy_loss, policy_loss

CLIPS = {"grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "cispo": (1.0, 5.0)}


def make_batch(batch=6, tokens=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(batch, tokens, generator=gen) * 3).requires_grad_(True)
    mask = torch.ones(batch, tokens)
    lengths = torch.randint(1, tokens + 1, (batch,), generator=gen)
    for i, length in enumerate(lengths):
        mask[i, length:] = 0
    advantages = torch.randn(batch, generator=gen)
    return logp, mask, advantages


def test_grpo_hand_values_inside_and_outside_clip():
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.5, 0.5]]))
    old = torch.zeros(1, 5)
    adv_pos = torch.tensor([2.0])
    loss, *_ = per_token_policy_loss("grpo", logp, old, adv_pos, clip_low=0.2, clip_high=0.2)
    # A > 0: min(r*A, clip(r)*A) -> r=1.5 capped at 1.2; r=0.5 stays 0.5 (min picks the unclipped)
    torch.testing.assert_close(loss, -torch.tensor([[2.0, 2.4, 1.0, 2.4, 1.0]]))
    loss, _, low, high = per_token_policy_loss("grpo", logp, old, -adv_pos, clip_low=0.2, clip_high=0.2)
    # A < 0: r=0.5 is lifted to 0.8 (loss 1.6); r=1.5 stays (loss 3.0)
    torch.testing.assert_close(loss, torch.tensor([[2.0, 3.0, 1.6, 3.0, 1.6]]))
    assert low.tolist() == [[False, False, True, False, True]]
    assert not high.any()


def test_dapo_uses_its_asymmetric_clip():
    logp = torch.log(torch.tensor([[1.5]]))
    loss, *_ = per_token_policy_loss("dapo", logp, torch.zeros(1, 1), torch.tensor([1.0]), clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28)


def test_cispo_weight_is_clamped_on_both_sides_and_detached():
    # the paper's CISPO (Eqs. 15-16): weight sg(clip(r, 1 - 1.0, 1 + 5.0)) in [0, 6], two-sided
    ratios = torch.tensor([[0.5, 3.0, 10.0, 1.0]])
    logp = (torch.log(ratios) + 0.0).requires_grad_(True)
    old = torch.zeros(1, 4)
    loss, ratio, low, high = per_token_policy_loss("cispo", logp, old, torch.tensor([1.0]), clip_low=1.0, clip_high=5.0)
    weights = torch.tensor([[0.5, 3.0, 6.0, 1.0]])  # 10 is capped at 6 (TRL would cap too; below 0 is impossible here)
    torch.testing.assert_close(loss, -weights * logp.detach())
    loss.sum().backward()
    # gradient only through logp, with the detached weight: d/dlogp = -w * A
    torch.testing.assert_close(logp.grad, -weights)
    assert high.tolist() == [[False, False, True, False]]
    # a tighter lower clip shows the two-sided clamp: r = 0.5 lifted to 0.8
    loss, *_ = per_token_policy_loss("cispo", logp.detach(), old, torch.tensor([1.0]), clip_low=0.2, clip_high=5.0)
    assert loss[0, 0].item() == pytest.approx(-0.8 * logp[0, 0].item())


@pytest.mark.parametrize("algo", ["grpo", "dapo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_on_policy_gradient_equals_reinforce(algo, agg):
    logp, mask, advantages = make_batch()
    loss, metrics = policy_loss(
        algo, logp, logp.detach(), advantages, mask, clip_low=CLIPS[algo][0], clip_high=CLIPS[algo][1], agg=agg
    )
    (grad,) = torch.autograd.grad(loss, logp)
    reinforce = aggregate(-advantages[:, None] * logp, mask, agg)
    (expected,) = torch.autograd.grad(reinforce, logp)
    torch.testing.assert_close(grad, expected)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0


def test_cispo_gradient_flows_only_through_logp():
    logp, mask, advantages = make_batch()
    old = (logp.detach() + 0.3 * torch.randn_like(logp)).requires_grad_(True)
    adv = advantages.clone().requires_grad_(True)
    loss, _ = policy_loss("cispo", logp, old, adv, mask, clip_low=1.0, clip_high=5.0)
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    assert old.grad is None and adv.grad is None


def test_metrics_report_clipping_and_kl():
    logp = torch.log(torch.tensor([[2.0, 0.5, 1.0, 1.0]]))
    old = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    _, metrics = policy_loss("grpo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 3)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 3)
    assert metrics["ratio_max"] == pytest.approx(2.0)
    assert metrics["ratio_mean"] == pytest.approx(3.5 / 3)
    expected_kl = ((2.0 - 1 - torch.log(torch.tensor(2.0))) + (0.5 - 1 - torch.log(torch.tensor(0.5)))) / 3
    assert metrics["approx_kl"] == pytest.approx(expected_kl.item(), rel=1e-5)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_with_global_counts_is_invariant_to_micro_batching(mode):
    gen = torch.Generator().manual_seed(1)
    loss_mat = torch.randn(12, 7, generator=gen)
    mask = (torch.rand(12, 7, generator=gen) > 0.3).float()
    mask[3] = 0  # a sequence with no tokens
    kwargs = {"norm_constant": 7.0}
    full = aggregate(loss_mat, mask, mode, **kwargs)
    counts = {"num_tokens": mask.sum().item(), "num_seqs": 12}
    for splits in ([12], [6, 6], [5, 4, 3], [1] * 12):
        total = sum(
            aggregate(lm, m, mode, **counts, **kwargs)
            for lm, m in zip(loss_mat.split(splits), mask.split(splits))
        )
        torch.testing.assert_close(total, full)


def test_aggregate_modes_hand_values():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss_mat, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum-norm", norm_constant=3).item() == pytest.approx((2 + 4 / 3) / 2)


def test_policy_loss_micro_batches_give_full_batch_gradient():
    logp, mask, advantages = make_batch(batch=8, tokens=6, seed=2)
    old = logp.detach() + 0.1 * torch.randn_like(logp)
    full, _ = policy_loss("dapo", logp, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    (full_grad,) = torch.autograd.grad(full, logp)
    total = 0
    for idx in (slice(0, 3), slice(3, 8)):
        part, _ = policy_loss(
            "dapo", logp[idx], old[idx], advantages[idx], mask[idx], clip_low=0.2, clip_high=0.28,
            num_tokens=mask.sum().item(),
        )
        total = total + part
    (micro_grad,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(micro_grad, full_grad)


def test_optional_kl_and_entropy_terms():
    logp, mask, advantages = make_batch()
    ref = logp.detach() - 0.2
    entropy = torch.rand_like(logp)
    base, _ = policy_loss("grpo", logp, logp.detach(), advantages, mask, clip_low=0.2, clip_high=0.2)
    with_terms, metrics = policy_loss(
        "grpo", logp, logp.detach(), advantages, mask, clip_low=0.2, clip_high=0.2,
        ref_logp=ref, kl_coef=0.1, entropy=entropy, entropy_coef=0.01,
    )
    log_ratio = ref - logp.detach()
    kl = torch.exp(log_ratio) - log_ratio - 1
    expected = base + aggregate(0.1 * kl - 0.01 * entropy, mask, "token-mean")
    torch.testing.assert_close(with_terms, expected)
    assert metrics["kl_ref"] > 0 and "entropy" in metrics


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(algo="ppo"), "algo must be one of"),
        (dict(clip_low=0.0), "clip_low must be a number > 0, got 0.0"),
        (dict(clip_high=-1.0), "clip_high must be a number > 0"),
        (dict(agg="mean"), "agg mode must be one of"),
        (dict(advantages=torch.ones(5)), r"advantages has shape \(5,\)"),
        (dict(mask=torch.ones(6, 4)), "mask has shape"),
        (dict(kl_coef=0.1), "needs ref_logp"),
        (dict(agg="seq-mean-token-sum-norm"), "needs norm_constant"),
    ],
)
def test_bad_input_names_argument_and_value(kwargs, message):
    logp, mask, advantages = make_batch()
    args = dict(algo="grpo", logp=logp, old_logp=logp.detach(), advantages=advantages, mask=mask, clip_low=0.2, clip_high=0.2)
    args.update(kwargs)
    algo = args.pop("algo")
    with pytest.raises(ValueError, match=message):
        policy_loss(algo, **args)
