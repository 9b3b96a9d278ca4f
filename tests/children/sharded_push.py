"""After a push from the sharded learner, each rank's vLLM engine scores the tokens it samples as the learner does.

``torchrun --nproc_per_node 2 tests/children/sharded_push.py OUT_PREFIX [TENSOR_PARALLEL]``: each rank shards tiny_random's
policy (FSDP2, gloo), starts its vLLM engine in the same process group (external_launcher), changes the policy's
weights (every projection x3), pushes them, samples its own prompts, and writes ``OUT_PREFIX.<rank>.json``: the
largest gap between vLLM's and the learner's log-prob of each sampled token, after and before the push.
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fgrpo.infra import distributed  # noqa: E402
from fgrpo.learner.forward import completion_logprobs  # noqa: E402
from fgrpo.learner.learner import shard_policy  # noqa: E402
from fgrpo.learner.model import load_policy, random_folder  # noqa: E402
from fgrpo.learner.packing import Sequence  # noqa: E402
from fgrpo.rollout.samplers import VLLMSampler  # noqa: E402

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=1024)  # conf/model/tiny_random.yaml


def largest_gap(policy, groups, prompts) -> float:
    seqs = [Sequence(prompt, c.token_ids) for prompt, group in zip(prompts, groups) for c in group]
    with torch.no_grad():
        logp, mask, _ = completion_logprobs(policy, seqs, pad_id=0)
    sampled = [torch.tensor(c.logprobs) for group in groups for c in group]
    return max(float((logp[row, : len(s)] - s).abs().max()) for row, s in enumerate(sampled))


def main(out_prefix: str, tensor_parallel: int) -> None:
    ranks = distributed.init_from_env(timeout_s=120)
    folder = random_folder(TINY, seed=0)
    policy = load_policy(folder, dtype="float32", device="cpu", attention="eager")
    shard_policy(policy, device="cpu")
    sampler = VLLMSampler(folder, dtype="float32", max_model_len=128, seed=ranks.rank // tensor_parallel,
                          device="cpu", kv_cache_gib=0.0625, tensor_parallel_size=tensor_parallel, distributed=True)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "proj" in name:
                param.mul_(3.0)
    engine = ranks.rank // tensor_parallel
    prompts = [[1, 2, 3 + engine], [7, 8 + engine, 9, 10]]
    sample = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, seed=0)
    before = largest_gap(policy, sampler.generate(prompts, 3, **sample), prompts)
    sampler.update_weights(policy)
    after = largest_gap(policy, sampler.generate(prompts, 3, **sample), prompts)
    Path(f"{out_prefix}.{ranks.rank}.json").write_text(json.dumps({"after": after, "before": before,
                                                                   "world": ranks.world}))
    sampler.close()  # vLLM's shutdown destroys the process group: last
    distributed.close()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
