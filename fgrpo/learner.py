"""The PyTorch learner: token log-probs of sampled completions, and one policy update per batch.

A batch is a list of :class:`Sequence` (prompt tokens, completion tokens, one advantage). Sequences
are packed several to a row (``hardware.micro_batch_tokens``) or right-padded one per row; the LM
head runs only on completion positions, so no ``[B, L, vocab]`` logits tensor is built for prompt tokens.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch

from fgrpo.logprobs import token_logprobs
from fgrpo.losses import policy_loss
from fgrpo.segment_attention import SEGMENT_ATTENTION, segment_buckets


@dataclass
class Sequence:
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float = 0.0
    old_logp: torch.Tensor | None = None  # [len(completion_ids)], set when mini_batches > 1


def mixed_precision(device_type: str, dtype: torch.dtype | None):
    """Matmuls in ``dtype`` (e.g. bfloat16) over the weights' own dtype; a no-op context when ``dtype`` is None."""
    return torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None)


@dataclass
class RowLayout:
    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor  # [R, W]
    predict_at: torch.Tensor  # [N]: flat index r * W + t of the hidden state that predicts each completion token
    allowed: torch.Tensor | None  # [R, 1, W, W] bool (query, key); None: transformers' packed mask from the positions
    real_tokens: int  # token slots holding prompt or completion tokens (a shared prompt counts once)
    # (query start, query length, prompt start, prompt length) in flat slots: each prompt copy (prompt length 0)
    # and each completion; what fgrpo.segment_attention computes instead of the dense masked square
    segments: list[tuple[int, int, int, int]]


def _lay_out_rows(
    seqs: list[Sequence], rows: list[list[int]], pad_id: int, device, *, share_prompts: bool = False,
    dense_mask: bool = True,
) -> RowLayout:
    """Token ids, positions and the prediction index for ``seqs`` laid out in ``rows`` (indices into ``seqs``).

    Each row holds its sequences one after the other, then padding; positions restart at 0 for each
    sequence and for the padding, so transformers' packed-sequence mask keeps them apart. With
    ``share_prompts``, a run of consecutive sequences in a row with the same prompt is laid out as
    the prompt once and then each completion, positions continuing from the prompt's end: every
    completion attends to the prompt and to itself only (the ``allowed`` mask), which gives each
    completion the log-probs of its own unshared sequence while the prompt is computed once.
    ``predict_at`` lists, sequence by sequence in ``seqs``' order, where each completion token is
    predicted from: the prompt's last token for the first, then the completion's own tokens.
    ``dense_mask=False`` leaves ``allowed`` out (segment attention reads ``segments`` instead).
    """
    if any(not seqs[i].prompt_ids for row in rows for i in row):  # a first completion token needs a predictor
        raise ValueError("a sequence needs at least one prompt token (e.g. BOS)")
    units = [_prompt_units(seqs, row, share_prompts) for row in rows]
    fills = [_units_length(seqs, row_units) for row_units in units]
    width = max(fills)
    shared = any(len(u) > 1 for row_units in units for u in row_units)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    # for the mask: which unit (prompt + its completions) a slot is in, and which completion (-1: the prompt);
    # each padding slot is a unit of its own, so it attends to itself only
    unit_of = torch.arange(len(rows) * width).view(len(rows), width)
    completion_of = torch.full((len(rows), width), -1, dtype=torch.long)
    predict_at: list[torch.Tensor | None] = [None] * len(seqs)
    segments: list[tuple[int, int, int, int]] = []
    for r, row_units in enumerate(units):
        start = 0
        for unit in row_units:
            prompt = seqs[unit[0]].prompt_ids
            unit_start = start
            input_ids[r, start : start + len(prompt)] = torch.tensor(prompt)
            position_ids[r, start : start + len(prompt)] = torch.arange(len(prompt))
            segments.append((r * width + start, len(prompt), 0, 0))
            start += len(prompt)
            for i in unit:
                completion = seqs[i].completion_ids
                input_ids[r, start : start + len(completion)] = torch.tensor(completion, dtype=torch.long)
                position_ids[r, start : start + len(completion)] = torch.arange(len(prompt), len(prompt) + len(completion))
                completion_of[r, start : start + len(completion)] = i
                segments.append((r * width + start, len(completion), r * width + unit_start, len(prompt)))
                # the hidden state at t predicts the token after t: the prompt's last token predicts the first
                # completion token, completion token j - 1 predicts token j
                flat = r * width
                predict_at[i] = torch.cat([torch.tensor([flat + unit_start + len(prompt) - 1]),
                                           torch.arange(flat + start, flat + start + len(completion) - 1)])[: len(completion)]
                start += len(completion)
            unit_of[r, unit_start:start] = unit_of[r, unit_start]
        position_ids[r, start:] = torch.arange(width - start)
    allowed = None
    if shared and dense_mask:  # segment attention needs only the segments
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same_unit = unit_of[:, :, None] == unit_of[:, None, :]
        key_visible = (completion_of[:, None, :] == -1) | (completion_of[:, None, :] == completion_of[:, :, None])
        allowed = (causal & same_unit & key_visible)[:, None].to(device)
    return RowLayout(input_ids.to(device), position_ids.to(device), torch.cat(predict_at).to(device), allowed,
                     sum(fills), segments)


def _prompt_units(seqs: list[Sequence], row: list[int], share_prompts: bool) -> list[list[int]]:
    """A row's sequences as laid out behind one copy of their prompt: runs of consecutive same-prompt
    sequences when ``share_prompts``, else one sequence each."""
    units: list[list[int]] = []
    for i in row:
        if share_prompts and units and seqs[units[-1][0]].prompt_ids == seqs[i].prompt_ids:
            units[-1].append(i)
        else:
            units.append([i])
    return units


def _units_length(seqs: list[Sequence], units: list[list[int]]) -> int:
    """Token slots the units take: each prompt once, then its completions."""
    return sum(len(seqs[u[0]].prompt_ids) + sum(len(seqs[i].completion_ids) for i in u) for u in units)


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """First-fit decreasing: indices of ``lengths`` grouped into rows of at most ``width`` tokens each.

    A length over ``width`` gets a row of its own. Deterministic; rows in order of their first (longest) item.
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def completion_logprobs(
    model,
    seqs: list[Sequence],
    *,
    pad_id: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    autocast_dtype: torch.dtype | None = None,
    fused_head: bool = True,
    rows: list[list[int]] | None = None,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs of each completion token under ``model`` (with grad if enabled).

    Returns ``(logp [B, T], mask [B, T], entropy [B, T] or None)`` with T the longest completion.
    Logits are divided by the sampling temperature, so the log-probs are those of the distribution
    the sampler drew from (as verl does). ``autocast_dtype`` (e.g. bfloat16) runs the matmuls in
    that dtype over fp32 weights; the log-softmax is always fp32.

    ``fused_head`` computes the LM head and log-softmax in chunks (fgrpo.logprobs.token_logprobs),
    without a ``[N, vocab]`` tensor in the graph; an entropy with a gradient (``entropy_grad``) takes
    the straightforward path, which is also the reference the fused one is tested against.

    ``rows`` (indices into ``seqs``, e.g. from :func:`pack_rows`) packs several sequences into each
    row; None: one right-padded sequence per row. Either way positions restart at each sequence (and
    at the padding) and no attention mask is passed, so transformers builds its packed-sequence mask
    from the position ids and each sequence attends only to itself: packed rows give the padded
    layout's result without its padding. ``share_prompts``: consecutive sequences in a row with the
    same prompt share one copy of it (:func:`_lay_out_rows`), through an explicit attention mask
    (eager or sdpa attention). With segment attention (fgrpo.segment_attention) no mask is built:
    each prompt copy and completion is handed its own keys as index tensors instead.
    """
    device = next(model.parameters()).device
    if rows is None:
        rows = [[i] for i in range(len(seqs))]
    segments = uses_segment_attention(model)
    layout = _lay_out_rows(seqs, rows, pad_id, device, share_prompts=share_prompts, dense_mask=not segments)
    segment_kwargs = {}
    if segments:
        # each segment gathers its own keys; an empty 4D mask, which transformers passes on as it is, keeps it
        # from building a [R, 1, W, W] one from the positions
        attention_mask = torch.ones(layout.input_ids.shape[0], 1, 0, 0, dtype=torch.bool, device=device)
        queries, keys, allowed = segment_buckets(layout.segments, layout.input_ids.numel(), device)
        segment_kwargs = dict(segment_queries=queries, segment_keys=keys, segment_allowed=allowed)
    else:
        attention_mask = None if layout.allowed is None else _attention_mask(model, layout.allowed)
    targets = torch.tensor([t for s in seqs for t in s.completion_ids], dtype=torch.long, device=device)
    head = model.get_output_embeddings()
    fused = fused_head and not (with_entropy and entropy_grad) and getattr(head, "bias", None) is None
    with mixed_precision(device.type, autocast_dtype):
        hidden = model.base_model(input_ids=layout.input_ids, position_ids=layout.position_ids,
                                  attention_mask=attention_mask, use_cache=False, **segment_kwargs).last_hidden_state
        # only completion positions go through the LM head: [N, hidden] -> [N, vocab]
        selected_hidden = hidden.flatten(0, 1)[layout.predict_at]
        if not fused:
            logits = head(selected_hidden)
    if fused:
        if autocast_dtype is not None:
            selected_hidden = selected_hidden.to(autocast_dtype)
        flat_logp, flat_entropy = token_logprobs(selected_hidden, head.weight, targets, temperature=temperature,
                                                 compiled=getattr(head, "compiled_log_softmax", False))
    else:
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        log_norm = torch.logsumexp(logits, dim=-1)
        flat_logp = logits.gather(-1, targets[:, None]).squeeze(-1) - log_norm
        if with_entropy:
            # a metric unless entropy_coef > 0: no graph through the [N, vocab] softmax then
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                probs = torch.softmax(logits, dim=-1)
                flat_entropy = log_norm - (probs * logits).sum(-1)

    lengths = [len(s.completion_ids) for s in seqs]
    width = max(lengths)
    mask = torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    logp = torch.zeros(mask.shape, dtype=flat_logp.dtype, device=device).masked_scatter(mask, flat_logp)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(mask.shape, dtype=flat_entropy.dtype, device=device).masked_scatter(mask, flat_entropy)
    return logp, mask, entropy


def _attention_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """``allowed`` [R, 1, W, W] in the form the model's attention takes: sdpa a bool mask, eager an additive one."""
    implementation = model.config._attn_implementation
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"shared prompts need eager, sdpa or segments attention, not {implementation!r}: set "
                     "hardware.attention=segments (or eager, sdpa), or hardware.share_prompts=false")


def require_cpp_compiler() -> None:
    """torch.compile on CPU writes C++; fail before the model loads when there is no compiler."""
    from fgrpo.config import ConfigError

    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:
        raise ConfigError(
            f"hardware.compile_learner=true needs a C++ compiler for torch.compile on CPU ({exc}); install one "
            "(apt install g++, or xcode-select --install on macOS; CXX=... picks another) or set "
            "hardware.compile_learner=false"
        ) from None


@functools.cache
def _glibc():
    """glibc's C library, or None where it is not the allocator (macOS, musl); looked up once."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of handing it back to the OS.

    Each step frees and re-allocates the same few GB (activations, LM-head chunks); by default glibc
    unmaps blocks over its mmap threshold and trims the heap, so the next step page-faults them in
    again (learner alone at 4x8x64, measured with the equivalent MALLOC_*_ environment
    variables: median step 4.8 s -> 4.0 s). Returns False where glibc is not the allocator (macOS, musl).
    See :func:`release_freed_memory` for the other half.
    """
    libc = _glibc()
    if libc is None:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return all(libc.mallopt(option, value) == 1 for option, value in (
        (m_mmap_threshold, 1 << 30), (m_trim_threshold, 2**31 - 1), (m_top_pad, 64 << 20)))


# oneDNN's primitive cache and ideep's kernel cache hold one compiled kernel per matmul shape, 1024 each by default.
# RL batches change the learner's row width every step, so every step adds kernels that are rarely used again:
# learner alone, 40 steps at 8x8x32, RSS after each step grew 2.08 -> 2.97 GiB (peak 4.07); with both at 64
# it stays at 2.10 from step 8 on (peak 3.19), no slower
KERNEL_CACHE_CAPACITY = 64


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> dict[str, str]:
    """Cap the CPU matmul kernel caches at ``capacity`` entries, unless the environment already sets them.

    Both libraries read these variables when they first build a kernel, so this must run before the
    process's first CPU matmul; later it changes nothing. Returns the variables as they now are.
    """
    names = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    return {name: os.environ.setdefault(name, str(capacity)) for name in names}


def release_freed_memory() -> bool:
    """Hand the pages of freed blocks back to the OS once per step (glibc ``malloc_trim``).

    With :func:`keep_freed_memory` alone, the sampler's and the learner's allocations interleave in
    the heap and the holes between them do not fit the next step's tensors, so the heap grows every
    step (default run, 30 steps: peak RSS 3.8 -> 7.5 GiB). Trimming once after each update keeps the
    within-step reuse and stops most of that growth (14 steps: 5.6 -> 5.05 GiB; median learner step
    5.5 -> 5.6 s, the pages fault in again). Returns False where glibc is not the allocator.
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def discard_pages(storage: torch.UntypedStorage) -> int:
    """Hand the whole pages of a CPU tensor's storage back to the OS (Linux ``madvise(MADV_DONTNEED)``).

    The storage stays allocated; its pages read as zeros when next touched. Only for memory whose
    contents are no longer needed. Returns the bytes handed back (0 where glibc is not the C library).
    """
    libc = _glibc()
    if libc is None or storage.device.type != "cpu":
        return 0
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-storage.data_ptr() // page) * page  # whole pages inside the block: rounded in at both ends
    end = (storage.data_ptr() + storage.nbytes()) // page * page
    if end <= start:
        return 0
    madv_dontneed = 4
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), madv_dontneed) != 0:
        return 0
    return end - start


def compile_decoder_layers(model, *, grad_only: bool = False, selective_checkpoint: bool = False) -> int:
    """``torch.compile`` each decoder layer, fusing its norms, rotary embedding, activation and casts.

    All layers run the same code, so they share one dynamic-shape graph (compiled on the first step,
    about 20 s on 2 cores). Returns how many layers were compiled (0: no ``layers`` list found).
    ``grad_only``: compiled only where autograd records (the learner's forward and its recompute);
    without gradients the layers run eager, so a policy that is also the sampler (``sampler=hf``)
    generates with its KV cache as before instead of recompiling for each cache length.
    ``selective_checkpoint`` (with the model's gradient checkpointing on): a second graph per layer
    that keeps the outputs of its matmuls and recomputes only the rest in the backward (norms, rotary,
    attention scores, SiLU, casts), used where :func:`keep_matmul_outputs` says. A checkpoint around
    a compiled layer cannot see which of its ops are matmuls, so this one sits inside the graph.
    The LM head's log-softmax passes (fgrpo.logprobs.token_logprobs) are compiled too, from here on.
    """
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return 0
    # sizes that happen to be equal on the first compile (a segment bucket's count and its length, say) would
    # otherwise be guarded equal, and each new coincidence recompiles (about 20 s; after 8, torch runs eager)
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    if selective_checkpoint:
        logging.getLogger("torch._higher_order_ops.wrap").addFilter(_quiet_context_fn_warning)
    for layer in layers:
        eager = layer._call_impl
        if grad_only or selective_checkpoint:
            # nn.Module.__call__ runs _compiled_call_impl when it is set (what Module.compile sets)
            layer._compiled_call_impl = functools.partial(
                _compiled_call, layer, torch.compile(eager, dynamic=True),
                torch.compile(functools.partial(_checkpoint_keeping_matmuls, eager), dynamic=True)
                if selective_checkpoint else None,
                eager if grad_only else None)
            layer.can_keep_matmul_outputs = selective_checkpoint
        else:
            layer.compile(dynamic=True)
    # the LM head's log-softmax passes too (fgrpo.logprobs): fused kernels instead of eager passes over fp32 copies
    model.get_output_embeddings().compiled_log_softmax = True
    return len(layers)


def _quiet_context_fn_warning(record: logging.LogRecord) -> bool:
    """Drops torch's warning that a checkpoint under torch.compile got a ``context_fn`` (ours keeps the
    matmul outputs): it printed four lines on every run's first step, and what it warns of, in-place ops
    in the checkpointed region, would show as gradients unlike the eager model's, which tests/test_learner.py checks."""
    return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


def _compiled_call(layer, compiled, compiled_keeping_matmuls, eager, *args, **kwargs):
    if eager is not None and not torch.is_grad_enabled():
        return eager(*args, **kwargs)
    if compiled_keeping_matmuls is not None and getattr(layer, "keeps_matmul_outputs", False):
        return compiled_keeping_matmuls(*args, **kwargs)
    return compiled(*args, **kwargs)


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _keep_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _keeping_matmuls_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_matmuls)


def _checkpoint_keeping_matmuls(call, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(call, *args, use_reentrant=False, context_fn=_keeping_matmuls_context, **kwargs)


# hardware.keep_matmul_outputs_gib=auto: 0.3 GiB of bf16 outputs, or what keeps the same layers in another dtype.
# bench, AVX512-BF16, bf16: 0 -> 0.3 GiB: 4x8x64 45.9 -> 52.9% of the bf16 rate (peak RSS 3.28 -> 3.48 GiB).
# fp32 (AVX2 kernels): 0.3 -> 0.6 GiB: learner 7.81 -> 7.04 s (4x8x64), 24.5 -> 22.0 s (8x8x128), peak +0.14-0.21 GiB
KEPT_MATMUL_GIB_IN_BF16 = 0.3


def auto_kept_matmul_gib(matmul_dtype: torch.dtype) -> float:
    """The ``auto`` budget of :func:`keep_matmul_outputs` for matmul outputs in ``matmul_dtype``."""
    return KEPT_MATMUL_GIB_IN_BF16 * matmul_dtype.itemsize / torch.bfloat16.itemsize


def matmul_output_bytes(model, dtype: torch.dtype | None) -> int:
    """Bytes per token slot that one decoder layer's kept matmul outputs take (q, k, v, attention output,
    gate and up; the MLP's down projection is not needed by the backward)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    widths = (2 * config.num_attention_heads * head_dim + 2 * config.num_key_value_heads * head_dim
              + 2 * config.intermediate_size)
    return widths * (dtype or next(model.parameters()).dtype).itemsize


def keep_matmul_outputs(model, count: int) -> None:
    """The first ``count`` decoder layers keep their matmul outputs (selective checkpoint); the others
    are recomputed whole in the backward. Needs :func:`compile_decoder_layers` with ``selective_checkpoint``."""
    if not model.is_gradient_checkpointing:
        raise ValueError("keeping matmul outputs chooses what gradient checkpointing keeps: call "
                         "model.gradient_checkpointing_enable() first (hardware.gradient_checkpointing=true)")
    decoder_layers = getattr(model.base_model, "layers", [])
    if not all(getattr(layer, "can_keep_matmul_outputs", False) for layer in decoder_layers):
        # else a layer taken out of transformers' checkpoint would keep all its activations, silently
        raise ValueError("keeping matmul outputs needs compile_decoder_layers(model, selective_checkpoint=True) "
                         "first (hardware.compile_learner=true)")
    for index, layer in enumerate(decoder_layers):
        layer.keeps_matmul_outputs = index < count
        layer.gradient_checkpointing = index >= count  # transformers' whole-layer checkpoint, around the graph


@dataclass
class MicroBatch:
    seqs: list[Sequence]
    rows: list[list[int]] | None  # packed rows (indices into seqs); None: one padded sequence per row
    padded_tokens: int  # rows x width: what the forward and backward compute over
    real_tokens: int  # of those, the slots holding tokens (a shared prompt counts once)
    share_prompts: bool = False  # runs of same-prompt sequences in a row share one copy of the prompt


def micro_batches(
    seqs: list[Sequence], *, size: int, tokens: int | None = None, width_cost: float = 0.0,
    share_prompts: bool = False, one_row: bool = False,
) -> list[MicroBatch]:
    """Split a step's sequences for gradient accumulation.

    ``tokens`` set: each micro-batch holds at most ``tokens`` token slots (rows x its widest row; a
    row longer than that gets a micro-batch of its own). Several layouts are tried and the one with
    the least estimated work kept: one sequence per row, sorted by length (best when lengths are
    even), and sequences packed several to a row (:func:`pack_rows`) in rows 1, 1.5 or 2 times as
    wide as the longest sequence (wider rows pack better, as RL completions of mixed lengths need).
    ``share_prompts`` adds layouts where the samples of one prompt (all of them, or split in 2 or 4
    parts) follow one copy of it: a group's G samples then cost one prompt instead of G.
    The work of a micro-batch is ``slots * (1 + width * width_cost)``: attention over a row costs in
    proportion to its width (:func:`attention_width_cost`). None: ``size`` sequences per
    micro-batch, sorted by length, one per row.
    ``one_row`` (with ``tokens``; for segment attention, where a row's width costs nothing): each
    micro-batch is one row without padding; sequences, or groups whole or in parts, are packed into
    micro-batches by the tokens they hold, and the choice with the fewest slots (then micro-batches) is kept. The
    batch dimension is then always 1, which torch.compile would otherwise recompile for when it first
    turns up.
    """
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    if tokens is None:
        order = sorted(range(len(seqs)), key=lambda i: lengths[i])
        chunks = [order[i : i + size] for i in range(0, len(order), size)]
        return [MicroBatch([seqs[i] for i in chunk], None, len(chunk) * max(lengths[i] for i in chunk),
                           sum(lengths[i] for i in chunk)) for chunk in chunks]

    def widths(longest: int) -> list[int]:  # wider rows only while one still fits the budget
        return sorted({min(int(longest * scale), max(tokens, longest)) for scale in (1, 1.5, 2)})

    # the pieces a layout is made of: (units of sequence indices, the tokens each unit holds, whether the
    # unit's sequences share their prompt): single sequences, and with share_prompts each group whole or in 2 or 4 parts
    pieces = [([[i] for i in range(len(seqs))], lengths, False)]
    if share_prompts:
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, seq in enumerate(seqs):
            groups.setdefault(tuple(seq.prompt_ids), []).append(i)
        for parts in (1, 2, 4):
            units = [group[k::parts] for group in groups.values() for k in range(min(parts, len(group)))]
            pieces.append((units, [_units_length(seqs, [u]) for u in units], True))
    if one_row:
        return _one_row_micro_batches(seqs, pieces, tokens)
    # candidate layouts: (rows of sequence indices, the tokens each row holds, whether prompts are shared)
    layouts = [pieces[0]]
    for units, unit_lengths, shared in pieces:
        for width in widths(max(unit_lengths)):
            rows = [[i for u in row for i in units[u]] for row in pack_rows(unit_lengths, width)]
            if shared:  # a row's units sorted by prompt, so parts of one group that share a row share one prompt copy
                rows = [sorted(row, key=lambda i: (seqs[i].prompt_ids, i)) for row in rows]
            layouts.append((rows, [_units_length(seqs, _prompt_units(seqs, row, shared)) for row in rows], shared))
    best, best_shared, best_work = [], False, math.inf
    for rows, fills, shared in layouts:
        batches = _fill_micro_batches(rows, fills, tokens)
        work = sum(slots * (1 + width * width_cost) for _, slots, width, _ in batches)
        if work < best_work:
            best, best_shared, best_work = batches, shared, work
    out = []
    for group, slots, _, real in best:
        order = [i for row in group for i in row]
        local = {i: j for j, i in enumerate(order)}
        out.append(MicroBatch([seqs[i] for i in order], [[local[i] for i in row] for row in group], slots, real,
                              best_shared))
    return out


def _one_row_micro_batches(
    seqs: list[Sequence], pieces: list[tuple[list[list[int]], list[int], bool]], tokens: int
) -> list[MicroBatch]:
    """Each candidate's units packed into micro-batches of at most ``tokens`` slots, each laid out as one row; the
    candidate with the fewest slots in all, then the fewest micro-batches. A unit over ``tokens`` goes alone."""
    best: list[tuple[list[int], int]] = []
    best_shared, best_key = False, (math.inf, math.inf)
    for units, unit_lengths, shared in pieces:
        batches = []
        for packed in pack_rows(unit_lengths, tokens):
            order = [i for u in packed for i in units[u]]
            if shared:  # parts of one group side by side, so that they share one prompt copy
                order.sort(key=lambda i: (seqs[i].prompt_ids, i))
            batches.append((order, _units_length(seqs, _prompt_units(seqs, order, shared))))
        key = (sum(slots for _, slots in batches), len(batches))
        if key < best_key:
            best, best_shared, best_key = batches, shared, key
    return [MicroBatch([seqs[i] for i in order], [list(range(len(order)))], slots, slots, best_shared)
            for order, slots in best]


def uses_segment_attention(model) -> bool:
    """Whether ``model`` attends through fgrpo.segment_attention (hardware.attention=segments)."""
    return model.config._attn_implementation == SEGMENT_ATTENTION


def attention_width_cost(model) -> float:
    """Attention's work per token slot and unit of row width, relative to the rest of a decoder layer.

    Per token, a layer's matmuls take ``2 * P`` FLOPs (P: its parameters) and attention over a row of
    width W ``4 * W * hidden`` (scores and weighted sum; the eager kernel computes the masked ones
    too), so the ratio is ``W * 2 * hidden / P``. 0 where the model has no decoder-layer list, and with
    segment attention, whose work does not grow with the row width (each segment's keys are gathered).
    """
    if uses_segment_attention(model):
        return 0.0
    layers = getattr(model.base_model, "layers", None)
    hidden = getattr(model.config, "hidden_size", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers) or not hidden:
        return 0.0
    return 2 * hidden / sum(p.numel() for p in layers[0].parameters())


def _fill_micro_batches(
    rows: list[list[int]], fills: list[int], tokens: int
) -> list[tuple[list[list[int]], int, int, int]]:
    """Rows, widest first, into micro-batches of at most ``tokens`` slots: ``[(rows, slots, width, filled slots)]``.

    ``fills[r]``: the tokens row ``r`` holds.
    """
    groups: list[list] = []  # [rows, width (the first, widest, row's fill), filled slots]
    for r in sorted(range(len(rows)), key=lambda r: -fills[r]):
        if groups and (len(groups[-1][0]) + 1) * groups[-1][1] <= tokens:
            groups[-1][0].append(rows[r])
            groups[-1][2] += fills[r]
        else:
            groups.append([[rows[r]], fills[r], fills[r]])
    return [(group, len(group) * width, width, filled) for group, width, filled in groups]


@torch.no_grad()
def fill_old_logprobs(
    model, seqs: list[Sequence], *, pad_id: int, temperature: float, micro_batch_size: int,
    micro_batch_tokens: int | None = None, autocast_dtype: torch.dtype | None = None, share_prompts: bool = False,
) -> None:
    """Record each sequence's log-probs under the current (sampling) policy, for off-policy mini-batches."""
    was_training = model.training
    model.eval()
    width_cost = attention_width_cost(model)
    for micro in micro_batches(seqs, size=micro_batch_size, tokens=micro_batch_tokens, width_cost=width_cost,
                               share_prompts=share_prompts, one_row=uses_segment_attention(model)):
        logp, mask, _ = completion_logprobs(
            model, micro.seqs, pad_id=pad_id, temperature=temperature, autocast_dtype=autocast_dtype, rows=micro.rows,
            share_prompts=micro.share_prompts,
        )
        for row, seq in enumerate(micro.seqs):
            seq.old_logp = logp[row, : len(seq.completion_ids)].detach().clone()
    model.train(was_training)


def update_policy(
    model,
    optimizer: torch.optim.Optimizer,
    seqs: list[Sequence],
    *,
    algo_cfg,
    pad_id: int,
    temperature: float,
    micro_batch_size: int,
    grad_clip: float,
    max_new_tokens: int,
    micro_batch_tokens: int | None = None,
    ref_model=None,
    autocast_dtype: torch.dtype | None = None,
    share_prompts: bool = False,
    kept_matmul_bytes: int = 0,
) -> dict[str, float]:
    """One optimizer step on ``seqs`` with gradient accumulation over micro-batches.

    The loss is aggregated with the whole step's token / sequence counts, so the accumulated gradient
    equals the full-batch gradient. ``old_logp`` comes from each sequence when set (mini_batches > 1);
    otherwise the batch is on-policy and old = current log-probs, detached (ratio exactly 1).
    ``ref_model`` (frozen) is needed only for the optional KL penalty, ``algo.kl_coef > 0``.
    ``kept_matmul_bytes``: per micro-batch, as many layers as fit in it keep their matmul outputs for
    the backward instead of recomputing them (:func:`keep_matmul_outputs`); 0 for none.
    """
    num_tokens = float(sum(len(s.completion_ids) for s in seqs))
    num_seqs = float(len(seqs))
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    ratio_max = 0.0
    loss_total = 0.0
    padded_tokens = computed_tokens = kept_slots = 0
    width_cost = attention_width_cost(model)
    kept_per_slot = matmul_output_bytes(model, autocast_dtype) if kept_matmul_bytes else 0
    for micro in micro_batches(seqs, size=micro_batch_size, tokens=micro_batch_tokens, width_cost=width_cost,
                               share_prompts=share_prompts, one_row=uses_segment_attention(model)):
        padded_tokens += micro.padded_tokens
        computed_tokens += micro.real_tokens
        if kept_matmul_bytes:
            layers = kept_matmul_bytes // (micro.padded_tokens * kept_per_slot)
            keep_matmul_outputs(model, layers)
            kept_slots += micro.padded_tokens * min(layers, model.config.num_hidden_layers)
        logp, mask, entropy = completion_logprobs(
            model, micro.seqs, pad_id=pad_id, temperature=temperature, with_entropy=True,
            entropy_grad=algo_cfg.entropy_coef > 0, autocast_dtype=autocast_dtype, rows=micro.rows,
            share_prompts=micro.share_prompts,
        )
        if all(s.old_logp is not None for s in micro.seqs):
            old_logp = torch.zeros_like(logp)
            for row, seq in enumerate(micro.seqs):
                old_logp[row, : len(seq.completion_ids)] = seq.old_logp
        else:
            old_logp = logp.detach()
        advantages = torch.tensor([s.advantage for s in micro.seqs], dtype=logp.dtype, device=logp.device)
        ref_logp = None
        if algo_cfg.kl_coef > 0:
            with torch.no_grad():
                ref_logp, _, _ = completion_logprobs(
                    ref_model, micro.seqs, pad_id=pad_id, temperature=temperature, autocast_dtype=autocast_dtype,
                    rows=micro.rows, share_prompts=micro.share_prompts,
                )
        loss, metrics = policy_loss(
            algo_cfg.name,
            logp,
            old_logp,
            advantages,
            mask,
            clip_low=algo_cfg.clip_low,
            clip_high=algo_cfg.clip_high,
            agg=algo_cfg.loss_agg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            norm_constant=float(max_new_tokens),
            ref_logp=ref_logp,
            kl_coef=algo_cfg.kl_coef,
            entropy=entropy if algo_cfg.entropy_coef > 0 else None,
            entropy_coef=algo_cfg.entropy_coef,
        )
        loss.backward()
        loss_total += loss.item()
        micro_tokens = float(mask.sum())
        for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "kl_ref"):
            if key not in metrics:
                continue
            totals[key] = totals.get(key, 0.0) + metrics[key] * micro_tokens
        ratio_max = max(ratio_max, metrics["ratio_max"])
        if entropy is not None:
            totals["entropy"] = totals.get("entropy", 0.0) + float((entropy.detach() * mask).sum())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError("the gradient norm is not finite; lower trainer.lr or check the rewards")
    optimizer.step()
    out = {key: value / max(num_tokens, 1.0) for key, value in totals.items()}
    # computed_tokens: the token positions the forward and backward ran over, padding left out (a shared prompt once)
    out.update(loss=loss_total, grad_norm=grad_norm, ratio_max=ratio_max, computed_tokens=float(computed_tokens),
               padding_frac=1.0 - computed_tokens / max(padded_tokens, 1),
               # of the layers' token slots, the share whose matmul outputs were kept instead of recomputed
               matmuls_kept_frac=kept_slots / max(padded_tokens * model.config.num_hidden_layers, 1))
    return out
