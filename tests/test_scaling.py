"""The paper's experiment configs, the checks of a config against its launch (world size, tensor parallel, bf16
weights at a small lr) and the GPU memory estimate that refuses a learner too big for its GPUs."""

from pathlib import Path

import pytest
import torch

from fgrpo.validation import smallest_kept_lr, validate, validate_layout

from fgrpo.infra.errors import ConfigError
from fgrpo.learner.gpu_memory import GIB, fit_learner_to_gpus, learner_memory, model_shape

EXPERIMENTS = ["paper_grpo", "paper_dapo", "paper_cispo"]
CLIPS = {"paper_grpo": (0.2, 0.2), "paper_dapo": (0.2, 0.28), "paper_cispo": (1.0, 5.0)}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("hardware,world", [("gpu_8", 8), ("gpu_2x8", 16)])
def test_paper_experiments_have_the_papers_settings(compose, experiment, hardware, world):
    cfg = compose(f"experiment={experiment}", f"hardware={hardware}", "focal=fgrpo")
    validate(cfg)
    validate_layout(cfg, world)  # 256 prompts over 8 or 16 ranks
    assert (cfg.model.name, cfg.model.path, cfg.dataset.name) == ("qwen2_5_7b", "Qwen/Qwen2.5-7B", "deepscaler")
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == CLIPS[experiment]
    assert (cfg.trainer.prompts_per_step, cfg.algo.group_size) == (256, 8)
    assert cfg.trainer.prompts_per_step // cfg.trainer.mini_batches == 64  # the paper's mini-batch
    assert (cfg.trainer.lr, cfg.trainer.warmup_steps, cfg.trainer.grad_clip) == (1e-6, 15, 1.0)
    assert (cfg.sampler.max_new_tokens, cfg.sampler.temperature, cfg.sampler.top_p) == (8192, 1.0, 1.0)
    assert (cfg.algo.kl_coef, cfg.algo.loss_agg, cfg.focal.gamma) == (0.0, "token-mean", 1.0)
    assert cfg.trainer.steps * cfg.trainer.prompts_per_step == pytest.approx(10 * 39_202, rel=0.01)  # 10 epochs
    hw = cfg.hardware
    assert (hw.device, hw.learner_dtype, hw.slurm_tasks_per_node, hw.slurm_gpus_per_node) == ("cuda", "float32", 8, 8)
    assert hw.slurm_nodes * hw.slurm_tasks_per_node == world
    assert compose(f"experiment={experiment}", "focal.gamma=0").focal.gamma == 0  # the baseline run


def test_the_slurm_launcher_asks_for_one_task_per_gpu(compose):
    from omegaconf import OmegaConf

    cfg = compose("experiment=paper_grpo", "hardware=gpu_2x8", "hydra/launcher=slurm", hydra=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (2, 8, 8)


def test_launch_layout_is_checked_against_the_world_size(compose):
    validate_layout(compose("trainer.prompts_per_step=8"), 4)
    with pytest.raises(ConfigError, match=r"trainer.prompts_per_step=6 does not divide over 4 processes .* "
                                          r"use a multiple of 4 \(e.g. 8\); or launch 2, 3, 6 processes"):
        validate_layout(compose("trainer.prompts_per_step=6"), 4)
    with pytest.raises(ConfigError, match="sampler.tensor_parallel_size=3 does not divide the 4 processes"):
        validate_layout(compose("trainer.prompts_per_step=8", "sampler.tensor_parallel_size=3"), 4)
    with pytest.raises(ConfigError, match="sampler.tensor_parallel_size=2: splits a vLLM engine over ranks"):
        validate(compose("sampler=hf", "sampler.tensor_parallel_size=2"))


def test_bf16_weights_at_the_papers_lr_are_refused(compose):
    assert smallest_kept_lr("bfloat16") == pytest.approx(3.9e-5, rel=0.01)
    with pytest.raises(ConfigError, match=r"hardware.learner_dtype='bfloat16': with trainer.lr=1e-06 most updates "
                                          r"round to nothing.*hardware.cpu_offload=true"):
        validate(compose("hardware.learner_dtype=bfloat16", "trainer.lr=1e-6"))
    validate(compose("hardware.learner_dtype=bfloat16", "trainer.lr=1e-4"))
    # the claim behind the check: at |w| = 0.01 a bf16 weight does not move by 1e-6, an fp32 one does
    weight = torch.tensor(0.01)
    assert weight.bfloat16() + torch.tensor(1e-6).bfloat16() == weight.bfloat16()
    assert weight + 1e-6 != weight


QWEN2_5_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)


def qwen_7b_folder(tmp_path: Path) -> Path:
    """A folder with Qwen2.5-7B's config only (no weights: the estimate reads the shape)."""
    from transformers import Qwen2Config

    Qwen2Config(**QWEN2_5_7B).save_pretrained(tmp_path)
    return tmp_path


def test_memory_estimate_of_the_7b_learner(tmp_path):
    shape = model_shape(qwen_7b_folder(tmp_path))
    assert shape["params"] == 7_615_616_512 and shape["layers"] == 28  # Qwen2.5-7B's published count

    def per_gpu(world, offload=False):
        return learner_memory(**shape, weight_dtype="float32", compute_dtype="bfloat16", world=world,
                              sharded=world > 1 or offload, cpu_offload=offload, checkpointing=True,
                              micro_batch_tokens=2 * 9216)

    assert per_gpu(1).weights + per_gpu(1).gradients + per_gpu(1).moments == pytest.approx(16 * 7.6157e9, rel=1e-3)
    assert per_gpu(1).total / GIB > 110  # the 122 GB: it cannot fit one 80 GB card
    assert per_gpu(8).total / GIB < 40 and per_gpu(16).total < per_gpu(8).total  # half a card, beside vLLM's half
    assert per_gpu(1, offload=True).total / GIB < 12
    # gathered whole on each GPU: the root unit (embedding and LM head, 2 x 152064 x 3584) and two layers, in bf16
    assert per_gpu(8).gathered == pytest.approx((2 * 152064 * 3584 + 3584 + 2 * shape["layer_params"]) * 2)


def test_checkpointed_layer_inputs_are_counted_in_the_residual_streams_dtype(tmp_path):
    """One process with autocast keeps an fp32 residual stream (4 bytes per hidden unit per layer input); FSDP2's
    bf16 policy a bf16 one (2 bytes). Item 4 of the GPU issue: the estimate had 2 bytes for both."""
    from fgrpo.learner.gpu_memory import residual_dtype

    shape, tokens = model_shape(qwen_7b_folder(tmp_path)), 16384
    common = dict(shape, weight_dtype="float32", compute_dtype="bfloat16", world=1, cpu_offload=False,
                  checkpointing=True, micro_batch_tokens=tokens)
    one, sharded = learner_memory(**common, sharded=False), learner_memory(**common, sharded=True)
    assert residual_dtype(weight_dtype="float32", compute_dtype="bfloat16", sharded=False) == "float32"
    hidden, layers = shape["hidden"], shape["layers"]
    # the layers' inputs, and the two norms' inputs of the layer that recomputes, at 2 more bytes each
    assert one.activations - sharded.activations == tokens * hidden * (2 * layers + 2 * 2)
    # the fp32 stream alone: 28 layers x 16384 x 3584 x 4 bytes = 6.1 GiB
    assert one.activations / GIB > 6.1 + 2  # with the recomputing layer and the LM head's blocks


class _Card:
    total_memory = 80 * 10**9


def test_a_learner_too_big_for_its_gpus_is_refused_before_loading(compose, tmp_path, monkeypatch):
    # no GPU here: the card's size is the one thing faked (torch.cuda asked for an 80 GB card)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Card())
    folder = qwen_7b_folder(tmp_path)
    cfg = compose("experiment=paper_grpo")
    # 75 GiB per card, half of it vLLM's: 37 GiB for the learner, which takes 25 GiB on 8 GPUs (39 on 4)
    with pytest.raises(ConfigError, match=r"needs about 125 GiB per GPU with 1 process \(.*but each GPU has 37 GiB "
                                          r".*launch 8 or more GPUs.*hardware.cpu_offload=true with hardware.fsdp"):
        fit_learner_to_gpus(folder, cfg, 1)
    fit_learner_to_gpus(folder, cfg, 8)  # fits beside vLLM's half of the card
    # reducing the gradients once per step holds them whole (28 GiB in fp32) on each of the 8: no longer fits
    with pytest.raises(ConfigError, match=r"with 8 processes .*Options: hardware.sync_grads_once=false \(it holds "
                                          r"the whole fp32 gradients on each GPU, 28.4 GiB"):
        fit_learner_to_gpus(folder, compose("experiment=paper_grpo", "hardware.sync_grads_once=true"), 8)
    fit_learner_to_gpus(folder, compose("experiment=paper_grpo", "hardware.cpu_offload=true",
                                            "hardware.fsdp=true"), 1)


def test_auto_micro_batches_and_kept_matmul_outputs_are_sized_from_the_cards_memory(compose, tmp_path, monkeypatch):
    """hardware.micro_batch_tokens=auto and keep_matmul_outputs_gib=auto on a GPU: the micro-batch's activations take
    half of what the state leaves, half of the rest keeps matmul outputs; a bigger card or a smaller model, more."""
    from fgrpo.learner.gpu_memory import ACTIVATIONS_SHARE, AUTO_TOKENS_MAX, auto_gpu_layout

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Card())
    folder = qwen_7b_folder(tmp_path)
    auto = ("hardware.micro_batch_tokens=auto", "hardware.keep_matmul_outputs_gib=auto")
    cfg = compose("experiment=paper_grpo", "hardware=gpu_8", *auto)
    fit_learner_to_gpus(folder, cfg, 8)
    tokens, kept = cfg.hardware.micro_batch_tokens, cfg.hardware.keep_matmul_outputs_gib
    assert isinstance(tokens, int) and tokens % 2048 == 0 and 9216 <= tokens <= AUTO_TOKENS_MAX
    shape = model_shape(folder)

    def per_gpu(n: int):
        return learner_memory(**shape, weight_dtype="float32", compute_dtype="bfloat16", world=8, sharded=True,
                              cpu_offload=False, checkpointing=True, micro_batch_tokens=n)

    headroom = 80 * 10**9 * 0.5 - per_gpu(0).state  # gpu_8: vLLM has half the card
    assert per_gpu(tokens).activations <= ACTIVATIONS_SHARE * headroom < per_gpu(tokens + 2048).activations
    # gpu_8 does not compile its layers: nothing can keep matmul outputs
    assert kept == 0
    # one GPU's compiled layers: a 1.5B-sized model on 80 GB keeps matmul outputs, and a bigger card sizes bigger
    small = dict(params=1_543_714_304, layer_params=46_797_824, root_params=233_373_696, hidden=1536, layers=28)

    def estimate(n):
        return learner_memory(**small, weight_dtype="float32", compute_dtype="bfloat16", world=1, sharded=False,
                              cpu_offload=False, checkpointing=True, micro_batch_tokens=n)

    tokens_80, kept_80 = auto_gpu_layout(estimate, 80 * GIB, 512)
    tokens_140, kept_140 = auto_gpu_layout(estimate, 140 * GIB, 512)
    assert 16384 < tokens_80 <= tokens_140 <= AUTO_TOKENS_MAX and 0 < kept_80 < kept_140
    assert auto_gpu_layout(estimate, 30 * GIB, 9000)[0] == 9088  # never under the longest sequence (in tiles of 128)


def test_a_micro_batch_whose_activations_cannot_fit_is_refused_naming_the_key(compose, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Card())
    folder = qwen_7b_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"with 8 processes .*activations .*smaller micro-batches: "
                                          r"hardware.micro_batch_tokens=262144 \(now 524288 token slots\), or auto"):
        fit_learner_to_gpus(folder, compose("experiment=paper_grpo", "hardware.micro_batch_tokens=524288"), 8)


def test_auto_micro_batches_are_for_gpus(compose):
    with pytest.raises(ConfigError, match=r"hardware.micro_batch_tokens='auto': .*auto on a GPU .*on the CPU set a "
                                          r"number"):
        validate(compose("hardware.micro_batch_tokens=auto"))
    validate(compose("hardware=gpu", "hardware.micro_batch_tokens=auto"))


def test_the_papers_7b_fits_one_80gb_gpu_with_lora_and_not_with_every_weight(compose, tmp_path, monkeypatch):
    """model.lora on one GPU (hardware=gpu: vLLM takes 35% of the card): the frozen base (bf16 or fp32), the fp32
    adapters with their gradients and moments, and the paper's micro-batch of 2 x 9216 tokens fit 80 GB; every
    weight with AdamW does not."""
    from fgrpo.learner.gpu_memory import adapter_params
    from fgrpo.learner.lora import LoraSettings

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Card())
    folder = qwen_7b_folder(tmp_path)
    one_gpu = ("experiment=paper_grpo", "hardware=gpu", "hardware.micro_batch_tokens=18432")
    # rank 16 on every projection of Qwen2.5-7B: 40.4M parameters
    assert adapter_params(folder, LoraSettings(rank=16, alpha=32, dropout=0.0, target_modules=None)) == 40_370_176
    fit_learner_to_gpus(folder, compose(*one_gpu, "model.lora.rank=16", "hardware.learner_dtype=bfloat16"), 1)
    fit_learner_to_gpus(folder, compose(*one_gpu, "model.lora.rank=16"), 1)
    with pytest.raises(ConfigError, match=r"needs about 125 GiB per GPU with 1 process"):
        fit_learner_to_gpus(folder, compose(*one_gpu), 1)
    shape = model_shape(folder)
    lora = learner_memory(**shape, weight_dtype="bfloat16", compute_dtype="bfloat16", world=1, sharded=False,
                          cpu_offload=False, checkpointing=True, micro_batch_tokens=18432, adapter_params=40_370_176)
    assert lora.gradients == 4 * 40_370_176 and lora.moments == 8 * 40_370_176 and lora.reference == 0
    assert 20 < lora.total / GIB < 25  # 14.3 GiB of bf16 base, 0.5 of adapters' state, 7.5 of activations
