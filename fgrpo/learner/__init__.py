"""The learner: model folders and weights (model.py; model_source.py: what ``eval.model`` names, and a checkpoint
exported as an HF folder), the packed forward pass and its attention kernels (packing.py, forward.py,
segment_attention.py on CPU, flex_attention.py on CUDA, logprobs.py), compiled and checkpointed layers
(compiled_layers.py), the GPU memory check (gpu_memory.py), and the update itself (learner.py: micro-batches, FSDP2,
the optimizer, the weight push into the sampler)."""
