"""The weights a push sends, cast before they are gathered, against the push before issue 65: every tensor gathered
whole in fp32 (a LoRA layer's W, B and A each gathered whole and merged after), then cast.

``torchrun --nproc_per_node 2 tests/children/sharded_push_dtype.py OUT_PREFIX [MODEL]``: each rank builds the same
random model (``tiny``: dims that do not split evenly over 2 ranks, so FSDP2's shards differ in size; or ``smollm2``
for SmolLM2-135M's shape), with LoRA adapters (B perturbed so that they act) or
without, shards it (FSDP2, gloo) and gathers its weights for a bf16 sampler both ways, timing each and counting the
bytes gathered (after: the tied LM head not gathered again); rank 0 writes ``OUT_PREFIX.json``: per case the largest difference of any element and the bytes and
seconds of each way. bench/RESULTS.md gives its numbers at SmolLM2-135M's shape (the command is there).
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fgrpo.infra import distributed  # noqa: E402
from fgrpo.learner.learner import shard_policy  # noqa: E402
from fgrpo.learner.lora import ADAPTER, LoraSettings, apply_lora, is_adapter_weight, sampler_weights  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=257, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=1001),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152),
}


def build(shape: str, lora: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], tie_word_embeddings=True))
    if lora:
        apply_lora(model, LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=None))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(0, 0.05)
    shard_policy(model, device="cpu")
    return model


def gathered_then_cast(model):
    """The push before: each tensor gathered whole in fp32, a LoRA weight merged from its whole W, B and A."""
    modules = dict(model.named_modules())
    for name, tensor in model.state_dict().items():
        if is_adapter_weight(name):
            continue
        weight = distributed.whole(tensor)
        if ".base_layer." in name:
            owner, leaf = name.split(".base_layer.")
            if leaf == "weight":
                layer = modules[owner]
                delta = distributed.whole(layer.lora_B[ADAPTER].weight) @ distributed.whole(layer.lora_A[ADAPTER].weight)
                weight = (weight.float() + layer.scaling[ADAPTER] * delta).to(weight.dtype)
            name = f"{owner}.{leaf}"
        yield name, weight


def gathered(weights) -> tuple[dict, int, float]:
    if distributed.active():
        torch.distributed.barrier()  # both ranks start the gathers together: the time is the push's, not a wait
    start = time.perf_counter()
    out = {name: tensor.detach() for name, tensor in weights}
    return out, sum(t.numel() * t.element_size() for t in out.values()), time.perf_counter() - start


def main(out_prefix: str, shape: str) -> None:
    ranks = distributed.init_from_env(timeout_s=120)
    cases = {}
    for lora in (False, True):
        model = build(shape, lora)
        # before: gathered whole in the learner's fp32, then cast (bytes counted as gathered, in fp32)
        before, before_bytes, before_s = gathered(gathered_then_cast(model))
        before = {name: t.to(torch.bfloat16) for name, t in before.items()}
        # after: cast on each shard, then gathered; the tied LM head (the embedding's weight) not gathered again
        after, after_bytes, after_s = gathered(sampler_weights(model, distributed.whole, dtype=torch.bfloat16,
                                                               skip=frozenset({"lm_head.weight"})))
        assert before.keys() - after.keys() == {"lm_head.weight"} and torch.equal(before["lm_head.weight"],
                                                                                   after["model.embed_tokens.weight"])
        assert all(t.dtype == torch.bfloat16 for t in after.values())
        differing = [name for name in after if not torch.equal(before[name], after[name])]
        largest = max(float((before[n].float() - after[n].float()).abs().max()) for n in after)
        cases["lora" if lora else "every weight"] = dict(
            tensors=len(before), differing=differing, largest_difference=largest, bytes_before=before_bytes,
            bytes_after=after_bytes, seconds_before=before_s, seconds_after=after_s)
    if ranks.main:
        Path(f"{out_prefix}.json").write_text(json.dumps({"world": ranks.world, "cases": cases}))
    distributed.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tiny")
