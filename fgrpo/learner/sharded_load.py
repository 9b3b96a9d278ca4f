"""A sharded model's weights, read once: rank 0 loads the model as one process does; every other rank builds it on
the meta device (its shapes, no memory), shards it with FSDP2, and takes its shard of each weight as rank 0
broadcasts the weights one tensor at a time, before rank 0 shards its own copy (as torchtitan and verl load). A
non-zero rank's host memory while loading is then its shards and one whole tensor, not the whole model in fp32
(Qwen2.5-7B: 30 GB a rank, and each rank reading every weight file from the shared filesystem); rank 0's own
(anonymous) memory is what it was, and it maps every page of the weight files instead of its half
(bench/rank_load_memory.py; bench/RESULTS.md).

What a state dict does not carry comes from rank 0 too: the buffers (the rotary embedding's ``inv_freq`` is
non-persistent). A tied LM head is the embedding's parameter on every rank: the meta build ties it as
``from_pretrained`` does, and it is one parameter, sent once. Any source that resolves to an HF folder loads this way
(the bundled GGUF's dequantised folder, a hub folder, a run's ``final_model/``), and so does the KL reference; a
resumed run then reads each rank's slices of its checkpoint (fgrpo.checkpointing) over them.
"""

from __future__ import annotations

from typing import Callable

import torch

from fgrpo.infra import distributed


def builds_on_meta(sharded: bool) -> bool:
    """Whether this process builds the model without weights: a rank other than 0 of a sharded learner over several."""
    return sharded and distributed.world_size() > 1 and distributed.rank() != 0


def shard_from_rank0(model, shard: Callable[[], None], *, device: str, shard_device: str) -> None:
    """``shard()`` (FSDP2 over the ranks) on every rank, each rank's shards and buffers set from rank 0's model.

    A collective. Rank 0's ``model`` holds the weights, every other rank's is on the meta device. The other ranks
    shard first and allocate their shards on ``shard_device`` (the host with CPU offload); rank 0 sends each weight
    whole (on ``device``, where its process group sends from) and then shards: its whole copy is freed tensor by
    tensor as FSDP2 replaces it, never held beside all its shards. FSDP2's sharding itself sends nothing."""
    if distributed.world_size() == 1:
        shard()
        return
    main = distributed.rank() == 0
    if not main:
        shard()
        model.to_empty(device=torch.device(shard_device))  # this rank's shards and the buffers, not yet set
    with torch.no_grad():
        for param in model.parameters():  # the same order on every rank; a tied weight once
            # a fresh buffer each time (not one kept for the largest): the rank's peak is its shards and one tensor
            whole = param.detach() if main else torch.empty(param.shape, dtype=param.dtype, device=device)
            torch.distributed.broadcast(whole, src=0)
            if not main:
                from torch.distributed.tensor import distribute_tensor

                # this rank's slice as FSDP2 cuts it (src_data_rank None: each rank slices its own copy, no sends)
                mine = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(mine.to_local())
            del whole
        for buffer in model.buffers():  # a few small tensors: rotary inv_freq, whatever else no state dict carries
            sent = buffer if main else torch.empty_like(buffer, device=device)
            torch.distributed.broadcast(sent, src=0)
            if not main:
                buffer.copy_(sent)
    if main:
        shard()

