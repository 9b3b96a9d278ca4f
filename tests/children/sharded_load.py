"""The learner on 2 ranks built two ways from one model folder, then one update on the same batch: rank 1 on the
meta device with its shards and buffers from rank 0 (fgrpo.learner.sharded_load), and every rank reading the whole
model itself (the load before it, which the test restores by switching the new steps off). Run as
``torchrun --nproc_per_node 2 tests/children/sharded_load.py CASES OUT_DIR``; rank 0 saves OUT_DIR/CASE.pt with both
builds' results (tests/learner/test_sharded_load.py compares them). ``... sharded_load.py faults OUT_DIR``: a build
that fails on rank 0 alone, and a rank whose model differs from rank 0's; each rank saves OUT_DIR/FAULT-RANK.pt
with the error it stopped with and when.
"""

import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fgrpo.learner.learner as learner_module  # noqa: E402
from fgrpo.infra import distributed  # noqa: E402
from fgrpo.learner.learner import Learner, LearnerSettings  # noqa: E402
from fgrpo.learner.lora import LoraSettings  # noqa: E402
from learner_cases import algo, grouped_seqs  # noqa: E402

CASES = {
    # the LM head tied to the embedding (SmolLM2's, Qwen2.5-1.5B's), gradient checkpointing
    "tied": dict(tie=True),
    # an untied head, and a KL term against a second, frozen model (loaded the same way)
    "untied-kl": dict(tie=False, kl=0.1),
    # LoRA adapters over the frozen base (rank 1's adapters come from rank 0 too), a KL term against the base
    "lora-kl": dict(tie=True, kl=0.1, lora=True),
    # bf16 matmuls over fp32 weights (FSDP2's mixed-precision policy) in compiled layers, built on meta
    "compiled-bf16": dict(tie=True, compile=True, autocast="bfloat16"),
}
PROMPTS, SAMPLES = 4, 4


def save_model(folder: Path, tie: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tie, rope_theta=5000.0, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)


def settings(lora: bool, compile: bool = False, autocast: str | None = None) -> LearnerSettings:
    return LearnerSettings(
        model_name="tiny", max_new_tokens=24, temperature=0.8, device="cpu", dtype="float32", autocast_dtype=autocast,
        attention="sdpa", compile=compile, gradient_checkpointing=True, fsdp=False, cpu_offload=False,
        sync_grads_once=False, kept_matmul_gib=0.0, micro_batch_size=3, micro_batch_tokens=None, share_prompts=False,
        lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0, grad_clip=1e9, mini_batches=1,
        lora=LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=None) if lora else None)


def build(folder: Path, case: dict, *, from_rank0: bool) -> tuple[Learner, list[bool]]:
    """The learner, and the ``empty`` argument of each load_policy call (True: built on the meta device)."""
    import fgrpo.learner.model as model_module

    empties = []
    original_load = model_module.load_policy

    def recorded(*args, **kwargs):
        empties.append(bool(kwargs.get("empty")))
        return original_load(*args, **kwargs)

    saved = (learner_module.builds_on_meta, learner_module.shard_from_rank0)
    model_module.load_policy = recorded
    if not from_rank0:  # the load before: every rank reads the whole model, FSDP2 shards it, nothing is broadcast
        learner_module.builds_on_meta = lambda sharded: False
        learner_module.shard_from_rank0 = lambda model, shard, **where: shard()
    try:
        torch.manual_seed(11)  # LoRA's A: the same draw on every rank in the load before
        loss = dataclasses.replace(algo("grpo"), kl_coef=case.get("kl", 0.0))
        learner = Learner(folder, settings(case.get("lora", False), case.get("compile", False), case.get("autocast")),
                          loss, pad_id=0)
    finally:
        model_module.load_policy = original_load
        learner_module.builds_on_meta, learner_module.shard_from_rank0 = saved
    return learner, empties


def whole_state(model) -> dict[str, torch.Tensor]:
    return {name: distributed.whole(p).detach().clone() for name, p in model.named_parameters()}


def one_build(folder: Path, case: dict, ranks, *, from_rank0: bool) -> dict:
    learner, empties = build(folder, case, from_rank0=from_rank0)
    policy = learner.policy
    loaded = whole_state(policy)
    buffers = {name: b.detach().clone() for name, b in policy.named_buffers()}
    # every rank's buffers, gathered: rank 1's must be rank 0's
    rank_buffers = distributed.gather_objects(buffers)
    tied = policy.get_output_embeddings().weight is policy.get_input_embeddings().weight
    seqs = grouped_seqs(PROMPTS, SAMPLES, seed=5)
    seqs = seqs[: 3 * SAMPLES] if ranks.rank == 0 else seqs[3 * SAMPLES:]  # uneven shares: 3 groups and 1
    metrics = learner.update(seqs)
    result = {"empties": distributed.gather_objects(empties), "loaded": loaded, "rank_buffers": rank_buffers,
              "tied": distributed.gather_objects(tied), "metrics": metrics, "updated": whole_state(policy),
              "reference": whole_state(learner.reference) if learner.reference is not None else None,
              "generation_eos": distributed.gather_objects(policy.generation_config.eos_token_id)}
    return result


def faults(out_dir: Path, ranks) -> None:
    """Each fault's error on each rank: the build of one rank fails (rank 0 reads a truncated weight file, which rank
    1, building on meta, never opens), and rank 1's model differs from rank 0's (its inv_freq in float64, as a model
    that transformers keeps partly in fp32 only when loading would)."""
    import fgrpo.learner.model as model_module

    folder = out_dir / "model-truncated"
    if ranks.main:
        save_model(folder, tie=True)
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    differs = out_dir / "model-differs"
    if ranks.main:
        save_model(differs, tie=True)
    torch.distributed.barrier()
    original_load = model_module.load_policy

    def float64_buffer(*args, **kwargs):
        model = original_load(*args, **kwargs)
        if kwargs.get("empty"):
            model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to(torch.float64)
        return model

    for fault, source in (("rank0-fails", folder), ("differs", differs)):
        model_module.load_policy = float64_buffer if fault == "differs" else original_load
        start = time.perf_counter()
        try:
            Learner(source, settings(False), algo("grpo"), pad_id=0)
            error = None
        except Exception as exc:  # noqa: BLE001 - the error is the result
            error = (type(exc).__name__, str(exc))
        torch.save({"error": error, "seconds": time.perf_counter() - start}, out_dir / f"{fault}-{ranks.rank}.pt")
    model_module.load_policy = original_load


def main(case_names: list[str], out_dir: Path) -> None:
    ranks = distributed.init_from_env(timeout_s=60)
    assert ranks.world == 2
    if case_names == ["faults"]:
        faults(out_dir, ranks)
        case_names = []
    for name in case_names:
        case = CASES[name]
        folder = out_dir / f"model-{name}"
        if ranks.main:
            save_model(folder, case["tie"])
        torch.distributed.barrier()
        results = {way: one_build(folder, case, ranks, from_rank0=way == "from rank 0")
                   for way in ("from rank 0", "each rank whole")}
        if ranks.main:
            torch.save(results, out_dir / f"{name}.pt")
    distributed.close()


if __name__ == "__main__":
    main(sys.argv[1].split(","), Path(sys.argv[2]))
