"""The sampler's settings as they reach vLLM's engine (fgrpo.rollout.samplers.vllm_engine_args): CUDA graphs on a GPU
by default, eager on the CPU, the memory share or the KV cache size. A CUDA engine cannot start on the CPU: its
arguments are checked here, the CPU engine's for real."""

import pytest

from fgrpo.infra.errors import ConfigError
from fgrpo.rollout.samplers import release_cached_gpu_memory, vllm_enforce_eager, vllm_engine_args
from fgrpo.validation import validate

ARGS = dict(dtype="bfloat16", max_model_len=512, seed=3, kv_cache_gib=0.25, gpu_memory_utilization=0.6,
            max_num_seqs=256, tensor_parallel_size=2, distributed=False, sleep=True)


def test_auto_is_eager_on_the_cpu_and_cuda_graphs_on_a_gpu_and_a_set_value_wins():
    assert vllm_enforce_eager("auto", "cpu") is True
    assert vllm_enforce_eager("auto", "cuda") is False
    assert vllm_enforce_eager(True, "cuda") is True and vllm_enforce_eager(False, "cpu") is False


def test_the_settings_reach_the_engine_arguments(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    gpu = vllm_engine_args("/models/m", device="cuda", enforce_eager=vllm_enforce_eager("auto", "cuda"), **ARGS)
    assert gpu["enforce_eager"] is False and gpu["gpu_memory_utilization"] == 0.6 and gpu["enable_sleep_mode"]
    assert "kv_cache_memory_bytes" not in gpu and "distributed_executor_backend" not in gpu
    cpu = vllm_engine_args("/models/m", device="cpu", enforce_eager=vllm_enforce_eager("auto", "cpu"),
                           **{**ARGS, "distributed": True})
    assert cpu["enforce_eager"] is True and cpu["kv_cache_memory_bytes"] == 2**28
    assert "gpu_memory_utilization" not in cpu and "enable_sleep_mode" not in cpu  # sleep mode is vLLM's on a GPU
    assert (cpu["distributed_executor_backend"], cpu["tensor_parallel_size"]) == ("external_launcher", 2)
    assert (cpu["model"], cpu["dtype"], cpu["seed"], cpu["enable_prefix_caching"]) == ("/models/m", "bfloat16", 3, True)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM's own variable wins over ours
    assert "kv_cache_memory_bytes" not in vllm_engine_args("/m", device="cpu", enforce_eager=True, **ARGS)


def test_enforce_eager_is_checked_and_resumable(compose):
    from fgrpo.config import experiment_differences, to_container

    assert compose().sampler.enforce_eager == "auto"
    for value in ("true", "false", "auto"):
        validate(compose(f"sampler.enforce_eager={value}"))
    with pytest.raises(ConfigError, match=r"sampler.enforce_eager='graphs': must be true, false or auto"):
        validate(compose("sampler.enforce_eager=graphs"))
    # how the engine runs, not what is learned: a resumed run may change it
    saved, resumed = compose("trainer.lr=3e-5"), compose("trainer.lr=3e-5", "sampler.enforce_eager=true")
    assert experiment_differences(to_container(saved), to_container(resumed)) == []


def test_releasing_cached_gpu_memory_gives_back_what_torch_holds_unused():
    import torch

    if not torch.cuda.is_available():
        assert release_cached_gpu_memory() == 0  # nothing to give back, and no CUDA call made
        return
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # a segment of its own (large allocations)
    del block  # freed to torch's cache, still reserved from the driver
    reserved = torch.cuda.memory_reserved()
    assert release_cached_gpu_memory() >= 64 * 2**20
    assert reserved - torch.cuda.memory_reserved() >= 64 * 2**20


@pytest.mark.slow
@pytest.mark.vllm
def test_the_cpu_engine_built_from_the_config_runs_eager(compose):
    from fgrpo.learner.model import random_folder
    from fgrpo.prepare import make_sampler

    cfg = compose("model=tiny_random", "sampler=vllm", "hardware.sampler_dtype=float32", "sampler.max_model_len=128",
                  "hardware.sampler_kv_cache_gib=0.125")
    sampler = make_sampler(cfg, random_folder(dict(cfg.model.random_init), seed=0), policy=None, tokenizer=None)
    assert sampler.llm.llm_engine.vllm_config.model_config.enforce_eager is True  # auto, on the CPU
