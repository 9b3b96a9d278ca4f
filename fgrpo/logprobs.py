"""Token log-probs straight from hidden states, without a full-vocabulary logits tensor in the graph.

The policy-gradient losses need ``log pi(y_t | y_<t)`` for each completion token: one number per
position, out of a ``[N, vocab]`` log-softmax. Built naively, autograd keeps that ``[N, vocab]`` logits
tensor (and its softmax) alive until the backward: 300 MB in fp32 for 32 x 48 tokens of a 49k
vocabulary, plus several more passes over it for the max, exp, gather and the gradient.

:func:`token_logprobs` computes the LM head in row chunks instead, keeps only the hidden states and
one log-normaliser per row, and recomputes each chunk's logits in the backward. Its gradient is the
exact one of ``log_softmax(h @ W.T / T)[target]``:

    d logp / d logits = (onehot(target) - softmax(logits)) / T

The entropy of each position's distribution comes out of the same pass as a metric (no gradient;
use the straightforward path in fgrpo.learner when ``algo.entropy_coef > 0``).
"""

from __future__ import annotations

import torch

# bytes of one [chunk, vocab] fp32 logits block. CPU: 24 MiB (128 rows of a 49k vocabulary), cache-sized
# and reused from the heap. GPU: 1 GiB, so each chunk's matmul fills the device and the LM-head weight
# gradient (V x H, fp32) is read and written once per ~1.7k rows, not once per 128 (measured on an H100
# with a 152k vocabulary: that accumulation dominated the backward at 128 rows)
CHUNK_BYTES = {"cpu": 24 * 2**20, "cuda": 2**30}


def default_chunk_rows(vocab_size: int, device: torch.device | str) -> int:
    """Rows per chunk so that one ``[rows, vocab_size]`` fp32 block takes about ``CHUNK_BYTES[device]``."""
    budget = CHUNK_BYTES.get(torch.device(device).type, CHUNK_BYTES["cpu"])
    return max(1, budget // (4 * vocab_size))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[n, H] @ [V, H].T`` in the operands' dtype, then fp32 and divided by the temperature."""
    logits = (hidden @ weight.t()).float()
    return logits / temperature if temperature != 1.0 else logits


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_rows):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        log_norm = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = _chunk_logits(hidden[rows], weight, temperature)
            lse = torch.logsumexp(logits, dim=-1)
            log_norm[rows] = lse
            logp[rows] = logits.gather(-1, targets[rows, None]).squeeze(-1) - lse
            # H = lse - sum_v p_v * logit_v, with p = exp(logits - lse)
            probs = torch.exp(logits.sub_(lse[:, None]))  # logits now hold log-probs
            entropy[rows] = -(probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, log_norm)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, log_norm = ctx.saved_tensors
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = _chunk_logits(hidden[rows], weight, temperature)
            g = grad_logp[rows].float()
            # d logp / d logits = onehot - softmax; chain through the 1/T scaling of the logits
            grad_logits = torch.exp(logits.sub_(log_norm[rows, None])).mul_(-g[:, None])
            grad_logits.scatter_add_(-1, targets[rows, None], g[:, None])
            if temperature != 1.0:
                grad_logits.div_(temperature)
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:
                grad_weight += grad_logits.t() @ hidden[rows]  # each chunk's product in the operands' dtype
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [N], entropy [N])`` of ``targets [N]`` under ``softmax(hidden [N, H] @ weight [V, H].T / T)``.

    The matmuls run in ``hidden``'s dtype (``weight`` is cast to it once); the log-softmax, the
    returned log-probs and entropies and the weight's gradient accumulation are fp32. ``logp`` has a
    gradient with respect to ``hidden`` and ``weight``; ``entropy`` is a metric without one.
    ``chunk_rows`` defaults to :func:`default_chunk_rows` for the vocabulary and device.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0], hidden.device)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)  # differentiable cast: the gradient flows back to the fp32 weight
    return _TokenLogProbs.apply(hidden, weight, targets, float(temperature), int(chunk_rows))
