"""The learner's forward: token log-probs (and entropies) of sampled completions under the policy.

Rows come from fgrpo.learner.packing; the LM head runs only on completion positions (fgrpo.learner.logprobs.token_logprobs), so no
``[B, L, vocab]`` logits tensor is built for prompt tokens. Four attention paths: transformers' own mask from the
position ids (packed rows), an explicit mask (shared prompts, eager or sdpa), fgrpo.learner.segment_attention (the CPU's)
or fgrpo.learner.flex_attention (CUDA's), the last two over one packed row per micro-batch.
"""

from __future__ import annotations

import functools

import torch

from fgrpo.learner.logprobs import at_least_fp32, token_logprobs
from fgrpo.learner.packing import Sequence, lay_out_rows
from fgrpo.learner.flex_attention import BLOCK, FLEX_ATTENTION, block_mask, slot_labels
from fgrpo.learner.segment_attention import SEGMENT_ATTENTION, segment_buckets

# hardware.attention: transformers' sdpa or eager kernels, fgrpo.learner.segment_attention or fgrpo.learner.flex_attention in packed rows
ATTENTIONS = ("sdpa", "eager", "segments", "flex")


def mixed_precision(device_type: str, dtype: torch.dtype | None):
    """Matmuls in ``dtype`` (e.g. bfloat16) over the weights' own dtype; a no-op context when ``dtype`` is None."""
    return torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None)



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

    ``fused_head`` computes the LM head and log-softmax in chunks (fgrpo.learner.logprobs.token_logprobs),
    without a ``[N, vocab]`` tensor in the graph, the entropy's gradient included (``entropy_grad``); False: the
    straightforward path through full logits, the reference the fused one is tested against.

    ``rows`` (indices into ``seqs``, e.g. from :func:`fgrpo.learner.packing.pack_rows`) packs several sequences into each
    row; None: one right-padded sequence per row. Either way positions restart at each sequence (and
    at the padding) and no attention mask is passed, so transformers builds its packed-sequence mask
    from the position ids and each sequence attends only to itself: packed rows give the padded
    layout's result without its padding. ``share_prompts``: consecutive sequences in a row with the
    same prompt share one copy of it (:func:`lay_out_rows`), through an explicit attention mask
    (eager or sdpa attention). With segment attention (fgrpo.learner.segment_attention) no mask is built:
    each prompt copy and completion is handed its own keys as index tensors instead.
    """
    device = compute_device(model)
    if rows is None:
        rows = [[i] for i in range(len(seqs))]
    segments = packs_one_row(model)
    layout = lay_out_rows(seqs, rows, pad_id, device, share_prompts=share_prompts, dense_mask=not segments,
                          width_multiple=row_multiple(model))
    targets = torch.tensor([t for s in seqs for t in s.completion_ids], dtype=torch.long, device=device)
    head = model.get_output_embeddings()
    fused = fused_head and getattr(head, "bias", None) is None
    # through the FSDP2 root when the learner is sharded
    sharded_root = model.__dict__.get(SHARDED_PASS)
    model_pass = sharded_root or functools.partial(_logprobs_pass, model)
    flat_logp, flat_entropy = model_pass(
        layout.input_ids, layout.position_ids, layout.predict_at, targets, _attention_inputs(model, layout, segments),
        temperature=temperature, fused=fused, with_entropy=with_entropy, entropy_grad=entropy_grad,
        autocast_dtype=autocast_dtype)
    if sharded_root is not None and not torch.is_grad_enabled():
        sharded_root.reshard()  # FSDP2 reshards a root only after a backward: none follows this pass

    lengths = [len(s.completion_ids) for s in seqs]
    mask = torch.arange(max(lengths), device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    logp = torch.zeros(mask.shape, dtype=flat_logp.dtype, device=device).masked_scatter(mask, flat_logp)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(mask.shape, dtype=flat_entropy.dtype, device=device).masked_scatter(mask, flat_entropy)
    return logp, loss_mask(seqs, mask), entropy


def loss_mask(seqs: list[Sequence], mask: torch.Tensor) -> torch.Tensor:
    """``mask [B, T]`` (the completions' tokens) less the tokens of episodes' observations, tools and templates
    (``Sequence.loss_mask`` 0): every term of the loss, its counts and metrics read only the tokens the model sampled."""
    if all(s.loss_mask is None for s in seqs):
        return mask
    kept = torch.zeros_like(mask)
    for row, seq in enumerate(seqs):
        length = len(seq.completion_ids)
        kept[row, :length] = True if seq.loss_mask is None else torch.tensor(seq.loss_mask, dtype=torch.bool)
    return mask & kept


def compute_device(model) -> torch.device:
    """Where ``model`` computes: its parameters' device, or, for a learner sharded with CPU offload (FSDP2 keeps the
    parameters in CPU memory between uses), its mesh's device, where the inputs must be."""
    param = next(model.parameters())
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None and mesh.device_type != param.device.type:
        return torch.device(mesh.device_type, torch.cuda.current_device() if mesh.device_type == "cuda" else None)
    return param.device


def _logprobs_pass(model, input_ids, position_ids, predict_at, targets, attention_inputs: dict, *, temperature: float,
                   fused: bool, with_entropy: bool, entropy_grad: bool, autocast_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's part of :func:`completion_logprobs`: flat log-probs (and entropies) of the ``targets`` predicted
    at the flat positions ``predict_at``."""
    head = model.get_output_embeddings()
    with mixed_precision(input_ids.device.type, autocast_dtype):
        hidden = model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                  **attention_inputs).last_hidden_state
        # only completion positions go through the LM head: [N, hidden] -> [N, vocab]
        selected_hidden = hidden.flatten(0, 1)[predict_at]
        logits = None if fused else head(selected_hidden)
    if fused:
        if autocast_dtype is not None:
            selected_hidden = selected_hidden.to(autocast_dtype)
        return token_logprobs(selected_hidden, head.weight, targets, temperature=temperature,
                              compiled=getattr(head, "compiled_log_softmax", False),
                              entropy_grad=with_entropy and entropy_grad and torch.is_grad_enabled())
    return _plain_head_logprobs(logits, targets, temperature, with_entropy, entropy_grad)


# the attribute of a sharded policy that holds its PolicyPass (a plain attribute, not a submodule: no cycle)
SHARDED_PASS = "fgrpo_sharded_pass"


class PolicyPass(torch.nn.Module):
    """The policy's whole log-prob pass (base model and LM head) as one module call. A sharded learner
    (fgrpo.learner.learner, FSDP2) makes this the root it shards: the root's forward gathers the embedding, the final norm
    and the LM head for the pass (the fused head reads ``head.weight`` itself, outside any ``forward`` of the HF
    model), and its backward reduces their gradients. ``attach`` makes :func:`completion_logprobs` call it."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def attach(self) -> PolicyPass:
        self.policy.__dict__[SHARDED_PASS] = self
        return self

    def forward(self, *args, generate: dict | None = None, **kwargs):
        """:func:`_logprobs_pass` on the policy; with ``generate`` (keyword arguments), HF ``generate`` instead, run
        inside the root's forward so that its weights stay gathered for the whole decoding (fgrpo.rollout.samplers)."""
        if generate is not None:
            return self.policy.generate(**generate)
        return _logprobs_pass(self.policy, *args, **kwargs)


def _attention_inputs(model, layout, segments: bool) -> dict:
    """What the base model needs besides ids and positions to keep the row's sequences apart."""
    if not segments:  # None: transformers builds its packed-sequence mask from the position ids
        return {"attention_mask": None if layout.allowed is None else _attention_mask(model, layout.allowed)}
    # each segment gathers its own keys, or flex reads its block mask; an empty 4D mask, which transformers passes on
    # as it is, keeps it from building a [R, 1, W, W] one from the positions
    device = layout.input_ids.device
    empty_mask = torch.ones(layout.input_ids.shape[0], 1, 0, 0, dtype=torch.bool, device=device)
    if model.config._attn_implementation == FLEX_ATTENTION:
        labels = slot_labels(layout.unit_of, layout.completion_of).to(device)
        return {"attention_mask": empty_mask, "flex_block_mask": block_mask(labels)}
    queries, keys, allowed = segment_buckets(layout.segments, layout.input_ids.numel(), device)
    return {"attention_mask": empty_mask, "segment_queries": queries, "segment_keys": keys, "segment_allowed": allowed}


def _plain_head_logprobs(logits, targets, temperature: float, with_entropy: bool, entropy_grad: bool):
    """Log-probs (and entropies) from the full ``[N, vocab]`` logits: the reference the fused head is tested against."""
    logits = logits.to(at_least_fp32(logits.dtype))
    if temperature != 1.0:
        logits = logits / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    flat_logp = logits.gather(-1, targets[:, None]).squeeze(-1) - log_norm
    flat_entropy = None
    if with_entropy:
        # a metric unless entropy_coef > 0: no graph through the [N, vocab] softmax then
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.softmax(logits, dim=-1)
            flat_entropy = log_norm - (probs * logits).sum(-1)
    return flat_logp, flat_entropy


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



def packs_one_row(model) -> bool:
    """Whether ``model`` attends through fgrpo.learner.segment_attention or fgrpo.learner.flex_attention (hardware.attention=segments
    or flex): one packed row per micro-batch, whose width costs no attention work for masked-out pairs."""
    return model.config._attn_implementation in (SEGMENT_ATTENTION, FLEX_ATTENTION)


def row_multiple(model) -> int:
    """What a packed row's width is rounded up to: flex attention's tile, else 1 (no padding)."""
    return BLOCK if model.config._attn_implementation == FLEX_ATTENTION else 1


def attention_width_cost(model) -> float:
    """Attention's work per token slot and unit of row width, relative to the rest of a decoder layer.

    Per token, a layer's matmuls take ``2 * P`` FLOPs (P: its parameters) and attention over a row of
    width W ``4 * W * hidden`` (scores and weighted sum; the eager kernel computes the masked ones
    too), so the ratio is ``W * 2 * hidden / P``. 0 where the model has no decoder-layer list, and with
    segment or flex attention, whose work does not grow with the row width (masked-out pairs are skipped).
    """
    if packs_one_row(model):
        return 0.0
    layers = getattr(model.base_model, "layers", None)
    hidden = getattr(model.config, "hidden_size", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers) or not hidden:
        return 0.0
    return 2 * hidden / sum(p.numel() for p in layers[0].parameters())
