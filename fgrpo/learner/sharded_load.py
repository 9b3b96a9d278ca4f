"""A sharded model's weights, read once: rank 0 loads the model as one process does; every other rank builds it on
the meta device (its shapes, no memory), shards it with FSDP2, and takes its shard of each weight as rank 0
broadcasts the weights one tensor at a time, before rank 0 shards its own copy (verl's FSDP2 loading broadcasts so). A
non-zero rank's host memory while loading is then its shards and one whole tensor, not the whole model in fp32
(Qwen2.5-7B: 30 GB a rank, and each rank reading every weight file from the shared filesystem); rank 0's own
(anonymous) memory is what it was, and it maps every page of the weight files instead of its half
(bench/rank_load_memory.py; bench/RESULTS.md).

What a state dict does not carry comes from rank 0 too: the buffers (the rotary embedding's ``inv_freq`` is
non-persistent). A tied LM head is the embedding's parameter on every rank: the meta build ties it as
``from_pretrained`` does, and it is one parameter, sent once. Any source that resolves to an HF folder loads this way
(the bundled GGUF's dequantised folder, a hub folder, a run's ``final_model/``), and so does the KL reference; a
resumed run then reads each rank's slices of its checkpoint (fgrpo.checkpointing) over them, after rank 0 has read
and sent the folder's weights all the same (time spent, nothing changed; not skipped yet).
"""

from __future__ import annotations

from typing import Callable

import torch

from fgrpo.infra import distributed
from fgrpo.infra.errors import ModelSourceError


def builds_on_meta(sharded: bool) -> bool:
    """Whether this process builds the model without weights: a rank other than 0 of a sharded learner over several."""
    return sharded and distributed.world_size() > 1 and distributed.rank() != 0


def shard_from_rank0(model, shard: Callable[[], None], *, device: str, shard_device: str, source: str = "") -> None:
    """``shard()`` (FSDP2 over the ranks) on every rank, each rank's shards and buffers set from rank 0's model.

    A collective. Rank 0's ``model`` holds the weights, every other rank's is on the meta device; first every rank
    checks that its tensors are rank 0's (names, shapes, dtypes: ``source``, the folder, names it in the error).
    The other ranks shard and allocate their shards on ``shard_device`` (the host with CPU offload); rank 0 sends each
    weight whole (on ``device``, where its process group sends from) and then shards: its whole copy is freed
    tensor by tensor as FSDP2 replaces it, never held beside all its shards. FSDP2's sharding itself sends nothing."""
    if distributed.world_size() == 1:
        shard()
        return
    distributed.agree(lambda: _check_same_tensors(model, source))
    main = distributed.rank() == 0
    if not main:
        shard()
        model.to_empty(device=torch.device(shard_device))  # this rank's shards and the buffers, not yet set
    with torch.no_grad():
        for param in model.parameters():  # the same order on every rank (checked); a tied weight once
            # a fresh buffer each time (not one kept for the largest): the rank's peak is its shards and one tensor
            whole = param.detach() if main else torch.empty(param.shape, dtype=param.dtype, device=device)
            torch.distributed.broadcast(whole, src=0)
            if not main:
                from torch.distributed.tensor import distribute_tensor

                # this rank's slice as FSDP2 cuts it (src_data_rank None: each rank slices its own copy, no sends)
                mine = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(mine.to_local())
            del whole
        # rotary inv_freq, whatever else no state dict carries; a buffer two modules share, in each of them
        for name, buffer in list(model.named_buffers(remove_duplicate=False)):
            sent = buffer if main else torch.empty_like(buffer, device=device)
            torch.distributed.broadcast(sent, src=0)
            if not main:  # on the compute device, where rank 0's are (to_empty put them with offloaded shards)
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._buffers[leaf] = sent
    if main:
        shard()


def _tensors(model) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in [*model.named_parameters(), *model.named_buffers()]]


def _check_same_tensors(model, source: str) -> None:
    """Every rank's model has rank 0's tensors, in its order: the broadcast pairs them by position. A model that
    transformers loads otherwise than it builds (modules kept in fp32 only when loading, a quantized checkpoint's
    layers) would differ on the meta-built ranks: an error naming the first tensor, before anything is sent."""
    mine = _tensors(model)
    rank0 = distributed.from_rank0(mine)
    if mine == rank0:
        return
    first = next((i for i, (a, b) in enumerate(zip(mine, rank0)) if a != b), min(len(mine), len(rank0)))
    here = " ".join(map(str, mine[first])) if first < len(mine) else "nothing"
    there = " ".join(map(str, rank0[first])) if first < len(rank0) else "nothing"
    raise ModelSourceError(
        f"rank {distributed.rank()} built the model of {source or 'this folder'} on the meta device with other tensors "
        f"than rank 0 loaded: tensor {first} is {here} here and {there} on rank 0 ({len(mine)} tensors here, "
        f"{len(rank0)} there). fgrpo.learner.sharded_load cannot shard this model from rank 0; a model folder in "
        f"plain safetensors, unquantized, loads this way (see docs/scaling.md, Loading).")
