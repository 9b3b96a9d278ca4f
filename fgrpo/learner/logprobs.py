"""Token log-probs straight from hidden states, without a full-vocabulary logits tensor in the graph.

The policy-gradient losses need ``log pi(y_t | y_<t)`` for each completion token: one number per
position, out of a ``[N, vocab]`` log-softmax. Built naively, autograd keeps that ``[N, vocab]`` logits
tensor (and its softmax) alive until the backward: 300 MB in fp32 for 32 x 48 tokens of a 49k
vocabulary, plus several more passes over it for the max, exp, gather and the gradient.

:func:`token_logprobs` computes the LM head in row chunks instead, keeps only the hidden states and
one log-normaliser per row, and recomputes the logits in the backward, one vocabulary slice of all
rows at a time (so each slice of the weight's gradient is written once). Its gradient is the
exact one of ``log_softmax(h @ W.T / T)[target]``:

    d logp / d logits = (onehot(target) - softmax(logits)) / T

The entropy of each position's distribution comes out of the same pass, as a metric or, with ``entropy_grad``
(``algo.entropy_coef > 0``), with its gradient, also recomputed slice by slice in the backward
(``d H / d z_v = -p_v (log p_v + H)``, z the tempered logits): no ``[N, vocab]`` tensor either way.

Each block's elementwise work (log-normaliser, gathered log-prob and entropy in the forward; the
logits' gradient in the backward) is a pure function, run eager or, with ``compiled=True``, as one
``torch.compile`` kernel that reads the block in the matmul's dtype once.
"""

from __future__ import annotations

import functools

import torch

# bytes of one fp32 logits block: [rows, vocab] in the forward, [all rows, slice of the vocab] in the
# backward. CPU: 24 MiB (128 rows of a 49k vocabulary), cache-sized and reused from the heap. GPU: 1 GiB,
# so each block's matmul fills the device
CHUNK_BYTES = {"cpu": 24 * 2**20, "cuda": 2**30}


def default_chunk_rows(vocab_size: int, device: torch.device | str) -> int:
    """Rows per chunk so that one ``[rows, vocab_size]`` fp32 block takes about ``CHUNK_BYTES[device]``."""
    budget = CHUNK_BYTES.get(torch.device(device).type, CHUNK_BYTES["cpu"])
    return max(1, budget // (4 * vocab_size))


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the softmax statistics: fp32 for bf16 / fp16 / fp32 logits, fp64 for an fp64 model (tests)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[n, H] @ [V, H].T`` in the operands' dtype (bf16 logits under autocast: the kernels below read them
    once and upcast in registers, so no fp32 copy of the block is written)."""
    return hidden @ weight.t()


def log_softmax_stats(
    logits: torch.Tensor, targets: torch.Tensor, inv_temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_norm, logp, entropy)``, each ``[n]`` fp32, of ``softmax(logits [n, V] * inv_temperature)``
    at ``targets [n]``. Entropy: ``H = lse - sum_v p_v * z_v``, with ``z`` the scaled logits."""
    z = logits.to(at_least_fp32(logits.dtype)) * inv_temperature
    log_norm = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - log_norm
    z -= log_norm[:, None]  # now log-probs (z is this function's own tensor)
    entropy = -torch.exp(z).mul_(z).sum(-1)
    return log_norm, logp, entropy


def logits_grad(
    logits: torch.Tensor, log_norm: torch.Tensor, grad_logp: torch.Tensor, local_targets: torch.Tensor,
    inv_temperature: float,
) -> torch.Tensor:
    """``d loss / d logits`` for a vocabulary slice ``logits [n, C]``, in ``logits``' dtype.

    ``d logp / d logits = (onehot(target) - softmax) * inv_temperature``, times ``grad_logp [n]``.
    ``local_targets [n]``: each target's column in this slice (out of ``[0, C)`` where it lies in another).
    """
    # in place on this function's own fp32 block: run eager (hardware.compile_learner=false), one block at a time
    grad = (logits.to(at_least_fp32(logits.dtype)) * inv_temperature).sub_(log_norm[:, None]).exp_().neg_()  # -softmax
    grad += torch.arange(logits.shape[1], device=logits.device)[None, :] == local_targets[:, None]
    return grad.mul_((grad_logp * inv_temperature)[:, None]).to(logits.dtype)


def logits_grad_with_entropy(
    logits: torch.Tensor, log_norm: torch.Tensor, entropy: torch.Tensor, grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor, local_targets: torch.Tensor, inv_temperature: float,
) -> torch.Tensor:
    """:func:`logits_grad` plus the entropy's part, ``grad_entropy [n]`` times ``d H / d logits``.

    With ``log p = z - log_norm`` (z the scaled logits) and ``H = -sum_v p_v log p_v`` (``entropy [n]``, the
    forward's): ``d H / d z_v = -p_v (log p_v + H)``, so ``d loss / d z = g_logp (onehot - p) - g_H p (log p + H)``.
    """
    log_p = (logits.to(at_least_fp32(logits.dtype)) * inv_temperature).sub_(log_norm[:, None])
    p = log_p.exp()
    grad = log_p.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_logp[:, None]).mul_(p).neg_()
    grad += (torch.arange(logits.shape[1], device=logits.device)[None, :] == local_targets[:, None]) * grad_logp[:, None]
    return grad.mul_(inv_temperature).to(logits.dtype)


@functools.cache
def _kernels(compiled: bool):
    """The elementwise passes (forward; backward without and with the entropy's gradient), eager or through
    torch.compile. Compiled, each is one fused kernel that reads the bf16 block once (eager: an fp32 copy, then about
    eight passes over it; on 2 CPU cores that was 0.3 s of a 2.0 s LM-head forward and backward at 2400 tokens)."""
    if not compiled:
        return log_softmax_stats, logits_grad, logits_grad_with_entropy
    return torch.compile(log_softmax_stats), torch.compile(logits_grad), torch.compile(logits_grad_with_entropy)


def _dynamic_rows(*tensors: torch.Tensor) -> None:
    # the row count changes with every chunk and step: one dynamic graph instead of a recompile per size
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)


class _TokenLogProbs(torch.autograd.Function):
    """Forward in row chunks; backward in vocabulary slices, so each slice of the weight's gradient is
    written once (row chunks would add a ``[V, H]`` product into it once per chunk: on the CPU that
    accumulation and its dtype casts took 16% of a learner step). ``weight`` keeps its own dtype (fp32
    under autocast) and is cast to ``hidden``'s slice by slice; its gradient comes back in its dtype.
    ``entropy_grad``: the entropy has a gradient too (else it is a metric, marked non-differentiable)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_rows, compiled, entropy_grad):
        n = hidden.shape[0]
        stats = _kernels(compiled)[0]
        stats_dtype = at_least_fp32(hidden.dtype)
        logp = torch.empty(n, dtype=stats_dtype, device=hidden.device)
        entropy = torch.empty(n, dtype=stats_dtype, device=hidden.device)
        log_norm = torch.empty(n, dtype=stats_dtype, device=hidden.device)
        compute_weight = weight.to(hidden.dtype)  # once per call: [V, H] in the matmul dtype
        for start in range(0, n, chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits, chunk_targets = _chunk_logits(hidden[rows], compute_weight), targets[rows]
            _dynamic_rows(logits, chunk_targets)
            log_norm[rows], logp[rows], entropy[rows] = stats(logits, chunk_targets, 1.0 / temperature)
        ctx.save_for_backward(hidden, weight, targets, log_norm, entropy if entropy_grad else None)
        ctx.temperature, ctx.chunk_rows, ctx.compiled = temperature, chunk_rows, compiled
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not a zero tensor
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, log_norm, entropy = ctx.saved_tensors
        _, grad_of_logits, grad_with_entropy = _kernels(ctx.compiled)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, vocab = hidden.shape[0], weight.shape[0]
        # as many vocabulary columns per slice as the forward's row chunk has elements: the same memory bound
        cols = max(1, ctx.chunk_rows * vocab // max(n, 1))
        stats_dtype = at_least_fp32(hidden.dtype)
        g = (torch.zeros(n, dtype=stats_dtype, device=hidden.device) if grad_logp is None
             else grad_logp.to(stats_dtype))
        g_entropy = None if grad_entropy is None or entropy is None else grad_entropy.to(stats_dtype)
        grad_hidden = torch.zeros(hidden.shape, dtype=at_least_fp32(hidden.dtype), device=hidden.device) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        for start in range(0, vocab, cols):
            stop = min(start + cols, vocab)
            compute_weight = weight[start:stop].to(hidden.dtype)
            logits, local_targets = _chunk_logits(hidden, compute_weight), targets - start  # [N, slice]
            _dynamic_rows(logits, log_norm, g, local_targets)
            torch._dynamo.maybe_mark_dynamic(logits, 1)  # the last slice is narrower
            if g_entropy is None:
                grad_logits = grad_of_logits(logits, log_norm, g, local_targets, 1.0 / ctx.temperature)
            else:
                _dynamic_rows(entropy, g_entropy)
                grad_logits = grad_with_entropy(logits, log_norm, entropy, g, g_entropy, local_targets,
                                                1.0 / ctx.temperature)
            if need_hidden:
                grad_hidden += grad_logits @ compute_weight
            if need_weight:
                grad_weight[start:stop] = grad_logits.t() @ hidden  # each slice written once
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    compiled: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [N], entropy [N])`` of ``targets [N]`` under ``softmax(hidden [N, H] @ weight [V, H].T / T)``.

    The matmuls run in ``hidden``'s dtype (``weight`` is cast to it inside); the log-softmax, the
    returned log-probs and entropies and the hidden states' gradient sum are fp32. ``logp`` has a
    gradient with respect to ``hidden`` and ``weight``; ``entropy`` is a metric without one unless ``entropy_grad``
    (an entropy bonus in the loss), computed in the same vocabulary slices as the log-probs' gradient.
    ``chunk_rows`` defaults to :func:`default_chunk_rows` for the vocabulary and device. ``compiled``: the
    elementwise passes over each logits block go through ``torch.compile`` (one fused kernel each; on the CPU
    that needs a C++ compiler, as the compiled decoder layers do).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0], hidden.device)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return _TokenLogProbs.apply(hidden, weight, targets, float(temperature), int(chunk_rows), bool(compiled),
                                bool(entropy_grad))
