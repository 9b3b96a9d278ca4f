"""fgrpo.learner.logprobs.token_logprobs against a full-vocabulary log-softmax built the plain way."""

import pytest
import torch

from fgrpo.learner.logprobs import token_logprobs


def plain(hidden, weight, targets, temperature):
    logits = (hidden @ weight.t()).float() / temperature
    log_probs = torch.log_softmax(logits, -1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, targets[:, None])[:, 0], entropy


def leaves(n=37, h=16, v=211, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(v, h, generator=gen, dtype=dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)  # a loss that weights each token differently
    return hidden, weight, targets, upstream


def grads(fn, hidden, weight, upstream):
    hidden.grad = weight.grad = None
    logp, entropy = fn()
    (logp * upstream).sum().backward()
    return logp.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_rows", [1, 8, 1000])
def test_values_entropy_and_gradients_equal_the_plain_log_softmax(temperature, chunk_rows, compiled):
    hidden, weight, targets, upstream = leaves()
    ours = grads(lambda: token_logprobs(hidden, weight, targets, temperature=temperature, chunk_rows=chunk_rows,
                                        compiled=compiled), hidden, weight, upstream)
    ref = grads(lambda: plain(hidden, weight, targets, temperature), hidden, weight, upstream)
    # fp32 throughout: differences are summation order only (up to 2.3e-5 in the hidden states' gradient at
    # T=0.6 with an Intel Xeon's BLAS, under 1e-5 on an AMD EPYC)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)


def test_bf16_matmuls_stay_within_bf16_rounding_of_the_fp32_result():
    hidden, weight, targets, upstream = leaves(n=64, h=32, v=1000)
    ours = grads(lambda: token_logprobs(hidden.bfloat16(), weight, targets), hidden, weight, upstream)
    ref = grads(lambda: plain(hidden, weight, targets, 1.0), hidden, weight, upstream)
    # logits of size ~6 rounded to bf16 (8 bits of mantissa): |error| <~ 0.05 per token
    torch.testing.assert_close(ours[0], ref[0], atol=0.1, rtol=0.02)
    for got, want in zip(ours[2:], ref[2:]):
        assert got.dtype == want.dtype == torch.float32  # gradients reach the fp32 leaves
        assert (got - want).norm() / want.norm() < 0.02


def test_compiled_kernels_give_the_eager_result_in_bf16_at_any_row_count():
    """The compiled passes read the bf16 logits block as it is; eager upcasts it first: the same numbers."""
    hidden, weight, targets, upstream = leaves(n=300, h=32, v=1000)
    for n in (300, 257, 31):  # the row count changes with every batch: one dynamic graph serves them all
        h, t, u = hidden[:n].detach().bfloat16().requires_grad_(), targets[:n], upstream[:n]
        eager = grads(lambda: token_logprobs(h, weight, t, temperature=0.7, chunk_rows=64), h, weight, u)
        fused = grads(lambda: token_logprobs(h, weight, t, temperature=0.7, chunk_rows=64, compiled=True), h, weight, u)
        for got, want in zip(fused, eager):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-2)


def entropy_grads(fn, hidden, weight, upstream, entropy_weight):
    """Gradients of a loss with an entropy bonus: sum(upstream * logp) + sum(entropy_weight * entropy)."""
    hidden.grad = weight.grad = None
    logp, entropy = fn()
    ((logp * upstream).sum() + (entropy * entropy_weight).sum()).backward()
    return logp.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_rows", [1, 8, 1000])
def test_entropy_gradient_equals_the_plain_log_softmax(temperature, chunk_rows, compiled):
    """algo.entropy_coef > 0 through the chunked head: values and gradients of logp and entropy as the full logits'."""
    hidden, weight, targets, upstream = leaves(seed=3)
    entropy_weight = torch.randn(upstream.shape, generator=torch.Generator().manual_seed(9))
    ours = entropy_grads(lambda: token_logprobs(hidden, weight, targets, temperature=temperature, chunk_rows=chunk_rows,
                                                compiled=compiled, entropy_grad=True), hidden, weight, upstream,
                         entropy_weight)
    ref = entropy_grads(lambda: plain(hidden, weight, targets, temperature), hidden, weight, upstream, entropy_weight)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
    # the entropy's part is not nothing: without it the gradients differ
    without = grads(lambda: token_logprobs(hidden, weight, targets, temperature=temperature), hidden, weight, upstream)
    assert not torch.allclose(without[3], ours[3], atol=1e-3)


def test_entropy_gradient_alone_when_the_loss_has_no_logp():
    hidden, weight, targets, _ = leaves(seed=4)
    logp, entropy = token_logprobs(hidden, weight, targets, chunk_rows=5, entropy_grad=True)
    entropy.sum().backward()
    ours = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    plain(hidden, weight, targets, 1.0)[1].sum().backward()
    for got, want in zip(ours, (hidden.grad, weight.grad)):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)


# the peak of a forward and backward with the entropy's gradient at Qwen2.5's vocabulary, in a fresh process (the
# high-water mark of this one is any earlier test's): its full fp32 logits alone would be 2048 x 151936 x 4 = 1.16 GiB
ENTROPY_PEAK_SCRIPT = """
import resource, sys, torch
from fgrpo.learner.logprobs import token_logprobs
torch.set_num_threads(1)
n, h, v = 2048, 32, 151936
hidden = torch.randn(n, h).requires_grad_()
weight = (torch.randn(v, h) * 0.02).requires_grad_()
targets = torch.randint(0, v, (n,))
weight.grad = torch.zeros_like(weight)
hidden.grad = torch.zeros_like(hidden)
small = hidden[:64].detach().requires_grad_()  # the kernels' libraries and thread pools, loaded before measuring
logp, entropy = token_logprobs(small, weight, targets[:64], entropy_grad=True)
(logp.sum() + 0.1 * entropy.sum()).backward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
logp, entropy = token_logprobs(hidden, weight, targets, entropy_grad=True)
(logp.sum() + 0.1 * entropy.sum()).backward()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""


def test_entropy_gradient_peak_memory_stays_bounded_at_a_152k_vocabulary():
    import subprocess
    import sys

    import os

    # blocks of 128 KiB and more straight from mmap and back on free, so the peak resident memory is the peak of the
    # live tensors (glibc's heap would otherwise keep freed blocks and move its threshold, and the peak with them)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run([sys.executable, "-c", ENTROPY_PEAK_SCRIPT], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    extra = int(done.stdout.split()[-1])
    full_logits = 2048 * 151936 * 4
    # a 24 MiB block (the CPU's budget) and its elementwise temporaries: measured 0.04 GiB (2026-11-27, EPYC)
    assert extra < full_logits / 8, f"peak rose {extra / 2**30:.2f} GiB"


def test_entropy_has_no_gradient_and_logp_is_fp32():
    hidden, weight, targets, _ = leaves()
    logp, entropy = token_logprobs(hidden.bfloat16(), weight, targets)
    assert logp.dtype == entropy.dtype == torch.float32
    assert logp.requires_grad and not entropy.requires_grad
    assert (logp <= 0).all() and (entropy >= 0).all()


def test_frozen_weight_gets_no_gradient_buffer():
    hidden, weight, targets, upstream = leaves()
    weight.requires_grad_(False)
    logp, _ = token_logprobs(hidden, weight, targets)
    (logp * upstream).sum().backward()
    assert hidden.grad is not None and weight.grad is None


@pytest.mark.parametrize("shapes, message", [
    (((5, 4), (9, 3), (5,)), r"hidden \[N, H\] and weight \[V, H\]"),
    (((5, 4), (9, 4), (6,)), r"targets must be \[N\]"),
])
def test_shape_errors_name_the_contract(shapes, message):
    hidden, weight, targets = torch.randn(*shapes[0]), torch.randn(*shapes[1]), torch.zeros(shapes[2], dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        token_logprobs(hidden, weight, targets)


def test_default_chunk_rows_follow_the_device_budget():
    from fgrpo.learner.logprobs import CHUNK_BYTES, default_chunk_rows

    assert default_chunk_rows(49152, "cpu") == 128  # SmolLM2's vocabulary: 24 MiB blocks on the CPU
    assert default_chunk_rows(151936, "cuda") == CHUNK_BYTES["cuda"] // (4 * 151936) > 1000
    assert default_chunk_rows(10**12, "cpu") == 1  # never zero rows
