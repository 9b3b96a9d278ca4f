"""The learner's packed rows on CUDA: torch's flex_attention with a block mask of prompts and completions.

A micro-batch is one packed row (fgrpo.learner.packing, ``one_row``): a prompt once, then its samples, then the next
prompt, and so on. Each completion attends to its prompt and, causally, to itself; each prompt to itself
(the mask of :func:`fgrpo.learner.packing.lay_out_rows` with shared prompts). flex_attention takes that mask as a
*block mask*: tiles of 128 x 128 (query, key) slots that are all masked are skipped, tiles that are all allowed
run without evaluating the mask, and only the tiles on a segment's edge evaluate it (:func:`_allowed_pairs`) pair
by pair. So the work follows the pairs that count, ``sum(Lq * (Lp + Lq))``, as with fgrpo.learner.segment_attention on the CPU,
but in one fused Triton kernel (forward and backward) instead of gathered batched matmuls and a softmax over
a materialised score tensor.

Registered with transformers as the attention implementation :data:`FLEX_ATTENTION`; called without a block
mask (HF generation, a plain forward), it is transformers' sdpa attention.
"""

from __future__ import annotations

import functools

import torch

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fgrpo.infra.errors import ConfigError

FLEX_ATTENTION = "fgrpo_flex"
# architectures whose attention is transformers' sdpa one (the fallback here) plus at most q/k norms
FLEX_ATTENTION_MODELS = ("llama", "qwen2", "qwen3")
# flex_attention's tile: a packed row is padded to a multiple of it (fgrpo.learner.packing), so every tile is whole
BLOCK = 128
# the smallest head dimension its Triton kernels take (tests' 8-wide heads failed on an H100)
MIN_HEAD_DIM = 16


def flex_available(device: str) -> str | None:
    """Why flex attention cannot run on ``device`` here, or None when it can: the block-mask API (torch >= 2.5) and,
    on CUDA, Triton (its kernels are generated) on a GPU of compute capability 8.0 or later (bf16 tiles)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs torch >= 2.5)"
    if device == "cuda":
        from torch.utils._triton import has_triton

        if not torch.cuda.is_available():
            return "no CUDA device is visible"
        if not has_triton():
            return "Triton is not installed (flex_attention generates its CUDA kernels with it)"
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            return f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}; flex attention needs 8.0+"
    return None


def slot_labels(unit_of: torch.Tensor, completion_of: torch.Tensor) -> torch.Tensor:
    """``[R, 2, W]`` int32: each slot's unit (a prompt copy and its completions; each padding slot its own) and
    completion (-1: a prompt), from a layout's ``[R, W]`` labels (fgrpo.learner.packing.RowLayout)."""
    return torch.stack([unit_of, completion_of], dim=1).to(torch.int32)


def _allowed_pairs(labels: torch.Tensor):
    """The mask_mod of rows with ``labels`` [R, 2, W]: causal, in the same unit, to a prompt key or one's own."""
    unit, completion = labels[:, 0], labels[:, 1]

    def allowed(row, head, q, kv):
        same_unit = unit[row, q] == unit[row, kv]
        visible = (completion[row, kv] < 0) | (completion[row, kv] == completion[row, q])
        return (q >= kv) & same_unit & visible

    return allowed


# (query, key) pairs evaluated at once while classifying tiles: 64 Mi (64 MiB of bools), whatever the row's width
PAIRS_PER_CHUNK = 2**26


def block_mask(labels: torch.Tensor):
    """The flex block mask of packed rows (``labels`` [R, 2, W], W a multiple of :data:`BLOCK`).

    Each 128 x 128 tile is classified empty, full or partial by evaluating the mask over a band of query tiles at a
    time (at most :data:`PAIRS_PER_CHUNK` pairs), so memory stays bounded however wide the row (torch's
    create_block_mask, uncompiled, materialises the whole ``[W, W]`` square and its intermediates: gigabytes at
    W = 16384)."""
    from torch.nn.attention.flex_attention import BlockMask

    rows, width = labels.shape[0], labels.shape[2]
    if width % BLOCK:
        raise ValueError(f"a packed row for flex attention must be a multiple of {BLOCK} slots, got {width}")
    tiles = width // BLOCK
    allowed = _allowed_pairs(labels)
    keys = torch.arange(width, device=labels.device)
    band = max(1, PAIRS_PER_CHUNK // (BLOCK * width))  # query tiles per evaluation
    any_pair = torch.empty(rows, tiles, tiles, dtype=torch.bool, device=labels.device)
    all_pairs = torch.empty_like(any_pair)
    for row in range(rows):
        for start in range(0, tiles, band):
            stop = min(start + band, tiles)
            queries = torch.arange(start * BLOCK, stop * BLOCK, device=labels.device)
            pairs = allowed(row, 0, queries[:, None], keys[None, :]).view(stop - start, BLOCK, tiles, BLOCK)
            any_pair[row, start:stop] = pairs.any(3).any(1)
            all_pairs[row, start:stop] = pairs.all(3).all(1)
    partial_count, partial_index = _ordered(any_pair & ~all_pairs)
    full_count, full_index = _ordered(all_pairs)
    return BlockMask.from_kv_blocks(partial_count, partial_index, full_count, full_index, BLOCK_SIZE=BLOCK,
                                    mask_mod=allowed, seq_lengths=(width, width))


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tiles [R, Q, K]`` bool -> (count [R, 1, Q], indices [R, 1, Q, K]) int32: per query tile, how many key tiles
    are set, and their indices first (BlockMask's layout; one head dimension, shared by all heads)."""
    count = tiles.sum(-1, dtype=torch.int32)
    index = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[:, None], index[:, None]


# widest row flex_attention may run uncompiled over: uncompiled it materialises the [R, H, W, W] scores (at 16,384
# slots and 12 heads, 12 GiB in fp32) instead of running the fused kernel; wider is an error (EagerFlexAttention)
EAGER_FLEX_MAX_SLOTS = 2048


class EagerFlexAttention(ConfigError):
    """flex_attention reached uncompiled over a wide packed row (torch.compile fell back to eager); names the
    settings, printed without a traceback (fgrpo.infra.errors.BAD_INPUT)."""


def _flex_refusing_eager(query, key, value, block_mask, scale: float):
    """flex_attention, refusing to run over a row wider than :data:`EAGER_FLEX_MAX_SLOTS` outside torch.compile.

    Compiled, the check is traced away (``is_compiling()`` is True while dynamo traces). Where dynamo gives up on
    the call (its recompile limit hit, a graph break, ``TORCHDYNAMO_DISABLE=1``, the ``force_eager`` stance) it runs
    this function as plain Python: flex_attention would then build the whole score matrix, out of memory at 16k
    slots with no word of why."""
    from torch.nn.attention.flex_attention import flex_attention

    width = query.shape[-2]
    if not torch.compiler.is_compiling() and width > EAGER_FLEX_MAX_SLOTS:
        scores = query.shape[0] * query.shape[1] * width * width * 4
        raise EagerFlexAttention(
            f"flex attention ran uncompiled over a packed row of {width} slots (torch.compile fell back to eager: "
            f"its recompile limit, a graph break, or TORCHDYNAMO_DISABLE); uncompiled it builds the full score matrix "
            f"({scores / 2**30:.1f} GiB). Set hardware.micro_batch_tokens to at most {EAGER_FLEX_MAX_SLOTS}, or "
            "hardware.attention=sdpa hardware.micro_batch_tokens=null hardware.share_prompts=false (padded "
            "micro-batches), or find why torch.compile gave up (TORCH_LOGS=recompiles)")
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)


@functools.cache
def _compiled_flex():
    # flex_attention is fast only compiled (a Triton kernel); dynamic: each micro-batch's row has its own width
    return torch.compile(_flex_refusing_eager, dynamic=True)


def _flex(query, key, value, mask, scale: float):
    from torch.nn.attention.flex_attention import flex_attention

    if query.device.type != "cuda":
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            return _dense_reference(query, key, value, mask, scale)
        # torch refuses inputs that require a gradient on the CPU even where none is recorded
        query, key, value = query.detach(), key.detach(), value.detach()
    if torch.compiler.is_compiling() or query.device.type != "cuda":  # in a compiled layer: traced into its graph
        return flex_attention(query, key, value, block_mask=mask, scale=scale, enable_gqa=True)
    return _compiled_flex()(query, key, value, mask, scale)


def _dense_reference(query, key, value, mask, scale: float):
    """The same attention with the block mask's pairs materialised, through sdpa: torch's flex_attention has no
    backward on the CPU, where the learner's tests run (hardware=cpu uses segment attention instead)."""
    from torch.nn.attention.flex_attention import create_mask

    rows, width = query.shape[0], query.shape[2]
    allowed = create_mask(mask.mask_mod, rows, None, width, width, device=query.device)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale,
                                                            enable_gqa=True)


def flex_segment_attention(
    module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scaling: float,
    dropout: float = 0.0, flex_block_mask=None, **kwargs,
):
    """transformers' attention-function signature: ``query [R, H, W, D]``, ``key``/``value [R, Hkv, W, D]``
    -> ``(output [R, W, H, D], None)``. With ``flex_block_mask`` (from :func:`block_mask`), ``attention_mask``
    is ignored; without it this is transformers' sdpa attention."""
    if flex_block_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout:
        raise ValueError("flex attention here has no dropout: set the model's attention_dropout to 0")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError("flex attention here has no sliding window or logit softcap: set hardware.attention=sdpa")
    # one dtype for the kernel, the projections' (the rotary embedding may leave q and k in fp32 under autocast),
    # and autocast off around it: flex_attention computes its softmax in fp32 itself
    dtype = value.dtype
    with torch.autocast(query.device.type, enabled=False):
        out = _flex(query.to(dtype), key.to(dtype), value, flex_block_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLEX_ATTENTION, flex_segment_attention)
# generation and plain forwards (no block mask) fall back to sdpa attention, so they need its mask
AttentionMaskInterface.register(FLEX_ATTENTION, sdpa_mask)
