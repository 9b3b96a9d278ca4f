"""One learner step on fixed rollouts per case, in however many processes launched it: ``python
tests/children/sharded_update.py CASES OUT_DIR`` (one process, no process group), ``torchrun --nproc_per_node 2
tests/children/sharded_update.py CASES OUT_DIR`` (the policy sharded with FSDP2 over gloo), or ``python
tests/children/sharded_update.py CASES OUT_DIR fsdp`` (sharded in one process). CASES is a comma-separated list: the
cases run one after another in one launch (each launch costs about 10 s of start-up). Rank 0 saves each case's
metrics and updated full parameters to OUT_DIR/CASE.pt; tests/learner/test_sharded.py compares one process's files
with two's.

The batch is 4 prompts x 4 samples. With 2 ranks, rank 0 learns on 3 groups and rank 1 on 1: uneven shares, so
rank 0 runs more micro-batches than rank 1, which must pad with fillers or the job hangs (a 60 s process-group
timeout turns a hang into a failure).
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fgrpo.infra import distributed  # noqa: E402
from fgrpo.learner.learner import shard_policy  # noqa: E402
from fgrpo.learner.forward import completion_logprobs  # noqa: E402
from fgrpo.learner.step import fill_old_logprobs, update_policy  # noqa: E402
from fgrpo.learner.lora import sampler_weights  # noqa: E402
from fgrpo.learner.segment_attention import SEGMENT_ATTENTION  # noqa: E402
from learner_cases import algo, grouped_seqs  # noqa: E402

CASES = {
    # padded micro-batches of 3, a clip that binds (grad_norm > 0.05), gradient checkpointing
    "fp64-clip-checkpointing": dict(dtype=torch.float64, loss="grpo", checkpointing=True, grad_clip=0.05,
                                    layout=dict(micro_batch_size=3)),
    # packed rows with shared prompts, segment attention, an off-policy mini-batch (old log-probs filled first)
    "fp64-packed-offpolicy": dict(dtype=torch.float64, loss="dapo", checkpointing=False, grad_clip=1e9,
                                  layout=dict(micro_batch_size=4, micro_batch_tokens=48, share_prompts=True),
                                  attention=SEGMENT_ATTENTION, old_logprobs=True),
    "fp32-clip-checkpointing": dict(dtype=torch.float32, loss="cispo", checkpointing=True, grad_clip=0.05,
                                    layout=dict(micro_batch_size=3)),
    # fp32 weights, bf16 compute: one process under autocast, two under FSDP2's bf16 mixed-precision policy (the GPUs'
    # gpu_8 numerics); gradients reduce-scattered once, after the last micro-batch, instead of after each
    # (measured on 2 CPU ranks: gradients within 1.2% per tensor, grad_norm within 1e-4, loss within 1e-7)
    "bf16-policy-sync-once": dict(dtype=torch.float32, loss="dapo", checkpointing=True, grad_clip=1e9,
                                  layout=dict(micro_batch_size=3), autocast=torch.bfloat16, sync_once=True,
                                  rel=dict(metrics=1e-3, grads=0.03)),
    "fp32-sync-once": dict(dtype=torch.float32, loss="dapo", checkpointing=False, grad_clip=1e9,
                           layout=dict(micro_batch_size=3), sync_once=True),
    "fp32-sync-each": dict(dtype=torch.float32, loss="dapo", checkpointing=False, grad_clip=1e9,
                           layout=dict(micro_batch_size=3)),
    # LoRA adapters (rank 4, B perturbed so that they act) over a frozen base, sharded with it; a KL term against the
    # base (the adapters off) and an off-policy mini-batch
    # an environment's episodes: each sequence's loss mask leaves out a run of observation / tool tokens in its middle
    # (fgrpo.rollout.episodes), packed with shared prompts and segment attention
    "fp64-episode-masks": dict(dtype=torch.float64, loss="dapo", checkpointing=False, grad_clip=1e9,
                               layout=dict(micro_batch_size=4, micro_batch_tokens=48, share_prompts=True),
                               attention=SEGMENT_ATTENTION, masks=True),
    # the sampler's log-probs (the model's own moved by noise): read and not used (rollout_correction=none: the same
    # step as fp64-packed-offpolicy bit for bit), and used: tokens masked out of the loss and of its counts, which
    # sum over the ranks (each rank drops its own), and whole sequences by the off-policy mask under seq-mean
    "fp64-sampler-none": dict(dtype=torch.float64, loss="dapo", checkpointing=False, grad_clip=1e9,
                              layout=dict(micro_batch_size=4, micro_batch_tokens=48, share_prompts=True),
                              attention=SEGMENT_ATTENTION, old_logprobs=True, sampler=dict()),
    "fp64-token-mask": dict(dtype=torch.float64, loss="grpo", checkpointing=False, grad_clip=1e9,
                            layout=dict(micro_batch_size=3), sampler=dict(rollout_correction="token_mask")),
    "fp64-sequence-mask-seq-mean": dict(dtype=torch.float64, loss="grpo", checkpointing=False, grad_clip=1e9,
                                        layout=dict(micro_batch_size=4, micro_batch_tokens=48),
                                        sampler=dict(rollout_correction="sequence_mask", correction_high=1.6,
                                                     off_policy_mask=0.1, agg="seq-mean-token-mean")),
    "fp32-lora": dict(dtype=torch.float32, loss="grpo", checkpointing=True, grad_clip=1e9,
                      layout=dict(micro_batch_size=3), lora=True, old_logprobs=True),
}
PROMPTS, SAMPLES = 4, 4


def build_model(dtype, attention):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(dtype)
    model.set_attn_implementation(attention)
    if dtype == torch.float64:  # fp64 end to end: transformers computes rotary angles and RMS norms in fp32, where
        # sums in another order (one process vs two) flip an fp32 ulp now and then
        model.model.rotary_emb.forward = _rotary_in_fp64.__get__(model.model.rotary_emb)
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.forward = _rms_norm_in_input_dtype.__get__(module)
    return model.train()


def _rms_norm_in_input_dtype(self, hidden):
    return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@torch.no_grad()
def _rotary_in_fp64(self, x, position_ids):
    angles = position_ids[..., None].double() * self.inv_freq.double()
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * self.attention_scaling).to(x.dtype), (angles.sin() * self.attention_scaling).to(x.dtype)


def with_sampler_logprobs(model, seqs, *, temperature):
    """Each sequence with a sampler's log-probs: the model's own, moved by Gaussian noise (scale 0.4)."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        logp, _, _ = completion_logprobs(model, seqs, pad_id=0, temperature=temperature)
    return [dataclasses.replace(s, sampler_logp=(logp[row, : len(s.completion_ids)]
                                                 + 0.4 * torch.randn(len(s.completion_ids), generator=gen,
                                                                     dtype=logp.dtype)).tolist())
            for row, s in enumerate(seqs)]


def add_adapters(model) -> None:
    """LoRA rank 4 on every projection, B drawn so that the adapters change the outputs (peft starts it at 0)."""
    from fgrpo.learner.lora import LoraSettings, apply_lora

    apply_lora(model, LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=None))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))


def count_gradient_reductions() -> list[int]:
    """A counter of FSDP2's gradient reductions (one reduce-scatter per parameter group and backward), in a list that
    the wrapped function adds to."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    count, reduce = [0], _fsdp_param_group.foreach_reduce

    def counted(*args, **kwargs):
        count[0] += 1
        return reduce(*args, **kwargs)

    _fsdp_param_group.foreach_reduce = counted
    return count


def one_case(case_name: str, out: Path, ranks, reductions: list[int], fsdp_alone: bool) -> None:
    """``fsdp_alone``: one process, sharded over a process group of one (hardware.fsdp=true)."""
    case = CASES[case_name]
    model = build_model(case["dtype"], case.get("attention", "sdpa"))
    if case["checkpointing"]:
        model.gradient_checkpointing_enable()
    autocast = case.get("autocast")
    if case.get("lora"):
        add_adapters(model)
    seqs = grouped_seqs(PROMPTS, SAMPLES, seed=5)
    if "sampler" in case:  # from the whole model, on every rank alike
        seqs = with_sampler_logprobs(model, seqs, temperature=0.8)
    if ranks.world > 1 or fsdp_alone:
        shard_policy(model, device="cpu", autocast_dtype=str(autocast).removeprefix("torch.") if autocast else None)
    reductions[0] = 0
    if case.get("masks"):  # tokens 2-4 of each completion as an environment's (0: out of the loss)
        seqs = [dataclasses.replace(s, loss_mask=[0 if 2 <= i < 5 else 1 for i in range(len(s.completion_ids))])
                for s in seqs]
    if ranks.world == 2:  # groups 0-2 on rank 0, group 3 on rank 1
        seqs = seqs[: 3 * SAMPLES] if ranks.rank == 0 else seqs[3 * SAMPLES:]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    common = dict(pad_id=0, temperature=0.8, autocast_dtype=autocast, **case["layout"])
    if case.get("old_logprobs"):
        fill_old_logprobs(model, seqs, **common)
        # a pass without a backward must not leave the root's weights gathered (FSDP2 reshards a root after backward)
        assert ranks.world == 1 or type(model.model.embed_tokens.weight).__name__ == "DTensor"
    loss = algo(case["loss"])
    if case.get("lora"):
        loss = dataclasses.replace(loss, kl_coef=0.1)
    loss = dataclasses.replace(loss, **case.get("sampler", {}))
    metrics = update_policy(model, optimizer, seqs, loss=loss, grad_clip=case["grad_clip"],
                            max_new_tokens=24, sync_grads_once=case.get("sync_once", False), **common)
    params = {name: distributed.whole(p).detach().clone() for name, p in model.named_parameters()}
    grads = {name: distributed.whole(p.grad).detach().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    merged = {name: t.detach().clone() for name, t in sampler_weights(model, distributed.whole)}  # clipped, as the step used them
    if ranks.main:
        torch.save({"metrics": metrics, "params": params, "grads": grads, "world": ranks.world, "merged": merged,
                    "reductions": reductions[0], "micro_batches": -(-len(seqs) // case["layout"]["micro_batch_size"])},
                   out)


def main(case_names: list[str], out_dir: Path, fsdp_alone: bool = False) -> None:
    ranks = distributed.init_from_env(timeout_s=60, single_process_group=fsdp_alone)
    reductions = count_gradient_reductions()
    for name in case_names:
        one_case(name, out_dir / f"{name}.pt", ranks, reductions, fsdp_alone)
    distributed.close()


if __name__ == "__main__":
    main(sys.argv[1].split(","), Path(sys.argv[2]), fsdp_alone=sys.argv[3:] == ["fsdp"])
