"""The learner: the policy's model folder and weights (model.py), the packed forward pass and its attention kernels
(forward.py, packing.py, segment_attention.py, flex_attention.py, logprobs.py), compiled and checkpointed layers,
and the update itself (learner.py: micro-batches, FSDP2, the optimizer, the weight push into the sampler)."""
