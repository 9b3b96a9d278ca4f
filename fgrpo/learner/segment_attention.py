"""Attention over the segments of a packed learner batch, without the masked-out square.

In the learner's rows (fgrpo.learner.packing.lay_out_rows) each completion attends to its prompt and,
causally, to itself; each prompt to itself. A dense attention over a row of width W computes all
W x W scores and masks most of them away: at 8x8x128 with shared prompts, rows of ~550 slots hold
a prompt and 4-8 completions, and about 3/4 of the scores are masked. Here each segment (a prompt
copy or a completion) gathers only its own keys, ``prompt + itself``, and the segments are batched
in two buckets of similar length, so the scores computed are about ``sum(Lq * (Lp + Lq))`` instead
of ``R * W * W``. Same math as the dense masked softmax: a masked key contributes exp(-inf) = 0 there.

Registered with transformers as the attention implementation :data:`SEGMENT_ATTENTION`; called
without segments (generation, the reference model's plain forward), it is transformers' eager attention.
"""
from __future__ import annotations

import itertools

import torch

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from fgrpo.learner.logprobs import at_least_fp32

SEGMENT_ATTENTION = "fgrpo_segments"
# architectures whose attention is transformers' eager one (the fallback here) plus at most q/k norms
SEGMENT_ATTENTION_MODELS = ("llama", "qwen2", "qwen3")


def segment_buckets(
    segments: list[tuple[int, int, int, int]], pad_slot: int, device, *, buckets: int = 2
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Index tensors for :func:`segment_attention`, one entry per bucket.

    ``segments``: ``(query_start, query_len, prompt_start, prompt_len)`` in flat slots ``r * W + t``;
    a prompt's own segment has ``prompt_len`` 0. Its queries attend to ``prompt_len`` keys from
    ``prompt_start`` and causally to its own. ``pad_slot`` (R * W): the zero slot that padding reads and writes.
    Returns ``(queries [S, Lq], keys [S, Lk], allowed [S, Lq, Lk] bool)`` per bucket. Segments are
    sorted by key length and split where the padded work ``S * Lq * Lk`` of the buckets is least.
    """
    segments = sorted((s for s in segments if s[1] > 0), key=lambda s: (s[1] + s[3], s[1]))
    if not segments:
        raise ValueError("segment attention needs at least one segment with tokens")
    count = len(segments)
    split_points = [count]
    if buckets >= 2 and count >= 4:
        # work of the split before segment k: k * Lq * Lk of the first bucket plus the rest's; sorted by key
        # length, so each bucket's Lk is its last segment's, and its Lq a running maximum
        q_max_before = list(itertools.accumulate((s[1] for s in segments), max))
        q_max_after = list(itertools.accumulate((s[1] for s in reversed(segments)), max))[::-1]
        key_len = [s[1] + s[3] for s in segments]

        def work(k: int) -> int:
            return k * q_max_before[k - 1] * key_len[k - 1] + (count - k) * q_max_after[k] * key_len[-1]

        # each bucket at least 2 segments: a size-1 dimension would be specialised by torch.compile
        split_points = [min(range(2, count - 1), key=work), count]
    out_queries, out_keys, out_allowed = [], [], []
    start = 0
    for end in split_points:
        part = torch.tensor(segments[start:end], dtype=torch.long)
        q_start, q_len, p_start, p_len = part.unbind(1)
        q_pos = torch.arange(int(q_len.max()))[None, :]  # [1, Lq]
        k_pos = torch.arange(int((q_len + p_len).max()))[None, :]  # [1, Lk]
        queries = torch.where(q_pos < q_len[:, None], q_start[:, None] + q_pos, pad_slot)
        own = k_pos - p_len[:, None]  # key position inside the segment itself; < 0: a prompt key
        keys = torch.where(own < 0, p_start[:, None] + k_pos,
                           torch.where(own < q_len[:, None], q_start[:, None] + own, pad_slot))
        allowed = (q_pos[:, :, None] < q_len[:, None, None]) & (
            (own[:, None, :] < 0) | ((own[:, None, :] <= q_pos[:, :, None]) & (own[:, None, :] < q_len[:, None, None])))
        out_queries.append(queries.to(device))
        out_keys.append(keys.to(device))
        out_allowed.append(allowed.to(device))
        start = end
    return tuple(out_queries), tuple(out_keys), tuple(out_allowed)


def segment_attention(
    module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scaling: float,
    dropout: float = 0.0, segment_queries=None, segment_keys=None, segment_allowed=None, **kwargs,
):
    """transformers' attention-function signature: ``query [R, H, W, D]``, ``key``/``value [R, Hkv, W, D]``
    -> ``(output [R, W, H, D], None)``.

    With ``segment_*`` (from :func:`segment_buckets`), ``attention_mask`` is ignored: each bucket's
    queries are gathered with their keys, the query heads that share a key head are stacked so one
    batched matmul serves them (grouped-query attention without repeating keys), and the outputs
    are written back to their slots. Slots in no segment (row padding) get zeros.
    """
    if segment_queries is None:
        return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if dropout:
        raise ValueError("segment attention has no dropout: set the model's attention_dropout to 0")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError("segment attention has no sliding window or logit softcap: set hardware.attention=eager")
    rows, heads, width, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads

    def slots(x: torch.Tensor) -> torch.Tensor:  # [R, h, W, D] -> [R * W + 1, h, D]; the last slot is padding
        flat = x.transpose(1, 2).reshape(rows * width, x.shape[1], head_dim)
        return torch.cat([flat, flat.new_zeros(1, x.shape[1], head_dim)])

    q_slots, k_slots, v_slots = slots(query), slots(key), slots(value)
    out = None  # in the matmuls' dtype (bf16 under autocast, while q may be fp32 after the rotary embedding)
    for queries, keys, allowed in zip(segment_queries, segment_keys, segment_allowed):
        count, q_len = queries.shape
        k_len = keys.shape[1]
        # [S, Lq, Hkv, groups, D] -> [S, Hkv, groups * Lq, D]
        q = q_slots[queries].view(count, q_len, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(count, kv_heads, groups * q_len, head_dim)
        k = gather_rows(k_slots, keys).transpose(1, 2)  # [S, Hkv, Lk, D]
        v = gather_rows(v_slots, keys).transpose(1, 2)
        scores = (torch.matmul(q, k.transpose(2, 3)) * scaling).view(count, kv_heads, groups, q_len, k_len)
        scores = scores.masked_fill(~allowed[:, None, None], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=at_least_fp32(q.dtype)).to(q.dtype)
        o = torch.matmul(probs.view(count, kv_heads, groups * q_len, k_len), v)
        o = o.view(count, kv_heads, groups, q_len, head_dim).permute(0, 3, 1, 2, 4).reshape(count * q_len, heads, head_dim)
        if out is None:
            out = o.new_zeros(rows * width + 1, heads, head_dim)
        out = out.index_put((queries.flatten(),), o)  # padding queries all land on the discarded last slot
    return out[:-1].view(rows, width, heads, head_dim), None


# A shared prompt's keys and values are read by each of its G completions, so their gradient is a sum over readers.
# Compiled, ``k_slots[keys]``'s backward added the readers' gradients with atomics from every thread, in whatever order
# the threads got there: on 2 threads four default runs had four step-1 gradient norms (1.70771 to 1.70813) and
# diverged from step 2 (bench/RESULTS.md). These two ops are opaque to the compiler: index_add_ sums in index order,
# in fp32. (Queries are read once each; only the padding slot, whose gradient is dropped, is read more than once.)
@torch.library.custom_op("fgrpo::gather_rows", mutates_args=())
def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]``: ``[N, ...]`` by ``[S, L]`` -> ``[S, L, ...]``, with a backward that sums in a fixed order."""
    return rows[index]


@gather_rows.register_fake
def _gather_rows_shape(rows, index):
    return rows.new_empty((*index.shape, *rows.shape[1:]))


@torch.library.custom_op("fgrpo::sum_into_rows", mutates_args=())
def sum_into_rows(grad: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """The gradient of :func:`gather_rows`: ``[count, ...]``, row ``n`` the fp32 sum, in index order, of the
    ``grad`` rows read from row ``n``, rounded once to ``grad``'s dtype."""
    summed = grad.new_zeros((count, *grad.shape[index.dim():]), dtype=at_least_fp32(grad.dtype))
    summed.index_add_(0, index.flatten(), grad.flatten(0, index.dim() - 1).to(summed.dtype))
    return summed.to(grad.dtype)


@sum_into_rows.register_fake
def _sum_into_rows_shape(grad, index, count):
    return grad.new_empty((count, *grad.shape[index.dim():]))


def _save_index(ctx, inputs, output):
    rows, index = inputs
    ctx.save_for_backward(index)
    ctx.count = rows.shape[0]


def _gather_rows_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return sum_into_rows(grad, index, ctx.count), None


gather_rows.register_autograd(_gather_rows_backward, setup_context=_save_index)

AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
# generation and plain forwards (no segments) fall back to eager attention, so they need its causal mask
AttentionMaskInterface.register(SEGMENT_ATTENTION, eager_mask)
