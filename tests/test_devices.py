"""The HF sampler's log-probs, and the learner on a CUDA device, against CPU float32.

Tests marked ``gpu`` need a CUDA device; CI has none, so they skip there (they ran on an H100 lent to
a development session; see the README). The CPU cases run everywhere.
"""

import copy

import pytest
import torch

from fgrpo.learner.packing import Sequence
from fgrpo.learner.forward import completion_logprobs
from fgrpo.learner.step import update_policy
from fgrpo.learner.logprobs import token_logprobs
from fgrpo.learner.model import load_policy, load_tokenizer, resolve_model_folder
from fgrpo.rollout.samplers import HFSampler

HAVE_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device (none here)")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


@pytest.fixture(scope="module")
def tiny_folder(compose):
    return resolve_model_folder(compose("model=tiny_random").model)


# (autocast dtype, max |sampler - learner| log-prob difference): the sampler decodes with a KV cache,
# the learner runs one full forward; in fp32 only summation order differs
PRECISIONS = [(None, 2e-4), ("bfloat16", 0.1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast, tolerance", PRECISIONS)
def test_hf_sampler_logprobs_are_the_learners(tiny_folder, device, autocast, tolerance):
    tokenizer = load_tokenizer(tiny_folder)
    model = load_policy(tiny_folder, dtype="float32", device=device, attention="eager")
    sampler = HFSampler(model, tokenizer, batch_size=3, autocast_dtype=autocast)  # 3: two generate calls
    prompts = [tokenizer.encode("1 + 2 ="), tokenizer.encode("What is 3 + 4? Answer:")]
    groups = sampler.generate(prompts, 3, max_new_tokens=8, temperature=0.7, top_p=1.0, seed=0)
    seqs = [Sequence(prompt, c.token_ids, advantage=0.0) for prompt, group in zip(prompts, groups) for c in group]
    assert all(len(s.completion_ids) > 0 for s in seqs) and model.training  # train mode restored
    with torch.no_grad():
        logp, mask, _ = completion_logprobs(model, seqs, pad_id=tokenizer.pad_token_id, temperature=0.7,
                                            autocast_dtype=getattr(torch, autocast) if autocast else None)
    for row, (seq, completion) in enumerate(zip(seqs, [c for g in groups for c in g])):
        n = len(seq.completion_ids)
        sampled = torch.tensor(completion.logprobs)
        assert sampled.shape == (n,) and (sampled <= 0).all()
        assert (sampled - logp[row, :n].float().cpu()).abs().max() <= tolerance


def update_on(device, model, *, autocast_dtype=None, attention=None, compiled=False, **learner_options):
    """Loss and gradients (on the CPU) of one on-policy DAPO update of ``model`` moved to ``device``."""
    from fgrpo.algorithm.losses import LossSettings
    from fgrpo.learner.compiled_layers import compile_decoder_layers

    model = copy.deepcopy(model).to(device)
    if attention:
        model.set_attn_implementation(attention)
    if compiled:  # the CPU defaults' learner: checkpointed layers, compiled, that keep their matmul outputs
        model.gradient_checkpointing_enable()
        compile_decoder_layers(model, selective_checkpoint=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 97, (5 + i,), generator=gen).tolist() for i in range(2)]  # two groups of 4
    seqs = [Sequence(prompts[i // 4], torch.randint(1, 97, (3 + i % 4,), generator=gen).tolist(), advantage=(-1.0) ** i)
            for i in range(8)]
    algo = LossSettings(algo="dapo", clip_low=0.2, clip_high=0.28, agg="token-mean", kl_coef=0.0, entropy_coef=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = update_policy(model, optimizer, seqs, loss=algo, pad_id=0, temperature=0.8, micro_batch_size=3,
                            grad_clip=1e9, max_new_tokens=8, autocast_dtype=autocast_dtype, **learner_options)
    return metrics, {n: p.grad.float().cpu() for n, p in model.named_parameters()}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("autocast_dtype, loss_atol, grad_rel", [
    (None, 1e-5, 1e-3),  # fp32 on both (TF32 off by default in torch)
    (torch.bfloat16, 2e-3, 0.03),  # bf16 matmuls on the GPU against fp32 on the CPU
])
def test_learner_update_on_cuda_matches_cpu_fp32(tiny_model, autocast_dtype, loss_atol, grad_rel):
    model = tiny_model
    (cpu_metrics, cpu_grads) = update_on("cpu", model)
    (gpu_metrics, gpu_grads) = update_on("cuda", model, autocast_dtype=autocast_dtype)
    assert gpu_metrics["loss"] == pytest.approx(cpu_metrics["loss"], abs=loss_atol)
    for name, want in cpu_grads.items():
        assert (gpu_grads[name] - want).norm() <= grad_rel * want.norm() + 1e-9, name


@pytest.mark.gpu
@needs_cuda
def test_cpu_fast_path_on_cuda_matches_cpu_fp32(tiny_model):
    """What hardware=cpu runs (segment attention over packed rows with shared prompts, compiled layers keeping
    their matmul outputs, the compiled LM-head kernels), here in Triton on a GPU in bf16: the CPU fp32 update."""
    from fgrpo.learner.segment_attention import SEGMENT_ATTENTION

    cpu_metrics, cpu_grads = update_on("cpu", tiny_model)
    gpu_metrics, gpu_grads = update_on("cuda", tiny_model, autocast_dtype=torch.bfloat16, attention=SEGMENT_ATTENTION,
                                       compiled=True, micro_batch_tokens=40, share_prompts=True,
                                       kept_matmul_bytes=2**20)
    assert gpu_metrics["matmuls_kept_frac"] == 1.0 and gpu_metrics["padding_frac"] == 0.0
    assert gpu_metrics["loss"] == pytest.approx(cpu_metrics["loss"], abs=2e-3)
    for name, want in cpu_grads.items():
        assert (gpu_grads[name] - want).norm() <= 0.03 * want.norm() + 1e-9, name


@pytest.mark.gpu
@needs_cuda
def test_fused_logprobs_on_cuda_match_cpu():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(300, 64, generator=gen), torch.randn(1000, 64, generator=gen)
    targets = torch.randint(0, 1000, (300,), generator=gen)
    upstream = torch.randn(300, generator=gen)
    results = {}
    for device in ("cpu", "cuda"):
        h, w = (t.to(device).clone().requires_grad_() for t in (hidden, weight))  # fresh leaves per device
        logp, entropy = token_logprobs(h, w, targets.to(device), temperature=0.7, chunk_rows=64)
        (logp * upstream.to(device)).sum().backward()
        results[device] = [t.detach().cpu() for t in (logp, entropy, h.grad, w.grad)]
    for got, want in zip(results["cuda"], results["cpu"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_training_run_on_cuda_with_the_hf_sampler(compose, tmp_path):
    from fgrpo.train import train
    from fgrpo.infra.run_files import read_metrics

    cfg = compose("model=tiny_random", "hardware=gpu", "sampler=hf", "logger=none", "trainer.steps=2",
                  "trainer.prompts_per_step=2", "algo.group_size=4", "eval.n_samples=2", "eval.max_problems=4",
                  "eval.every=1", "sampler.max_new_tokens=8")
    final = train(cfg, tmp_path, run_name="gpu")
    assert "eval/pass@1" in final
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "perf/learn_time_s" in r]
    assert len(steps) == 2 and all(r["perf/learn_time_s"] > 0 for r in steps)


def test_random_model_of_another_architecture_and_vocabulary():
    """conf/model/qwen2_5_1_5b_random's mechanism at a tiny size: model_type and vocab_size are honoured."""
    from transformers import AutoConfig

    from fgrpo.learner.model import random_folder

    from fgrpo.infra.errors import ModelSourceError

    shape = dict(model_type="qwen2", vocab_size=60000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=1, num_key_value_heads=1)
    folder = random_folder(shape, seed=0)
    config = AutoConfig.from_pretrained(folder)
    assert folder.name.startswith("random-qwen2-") and config.model_type == "qwen2"
    assert config.vocab_size == 60000 and config.hidden_size == 64 and config.tie_word_embeddings
    model = load_policy(folder, dtype="float32", device="cpu")
    assert model.get_output_embeddings().weight.shape == (60000, 64)
    with pytest.raises(ModelSourceError, match="vocab_size=100 is below the tokenizer"):
        random_folder({**shape, "vocab_size": 100}, seed=0)


def test_qwen_shaped_config_has_qwen2_5_1_5b_parameter_count(compose):
    from transformers import AutoConfig, AutoModelForCausalLM

    init = dict(compose("model=qwen2_5_1_5b_random").model.random_init)
    config = AutoConfig.for_model(init.pop("model_type"), **init)
    with torch.device("meta"):  # shapes only: nothing allocated
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 1_543_714_304  # Qwen2.5-1.5B: 1.54B, tied embeddings
