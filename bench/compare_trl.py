"""Side-by-side benchmark: fgrpo's training loop against TRL's GRPOTrainer on the same work.

One invocation runs, for each workload ``PxGxT`` (prompts per step x samples per prompt x new tokens):

1. **ours**: ``fgrpo.train.train`` (vLLM sampler, learner with bf16 autocast where the CPU runs bf16 natively, else fp32;
   DAPO token-mean loss), and
2. **trl**: ``trl.GRPOTrainer`` (transformers ``generate``, fp32, ``loss_type="dapo"``, beta 0),

each in its own subprocess (vLLM changes process-wide torch state), on the same model folder, the
same arithmetic prompts in the same order, the same learning rate and clip range. The first step of
each is a warm-up and is dropped; the table shows medians of the rest, the phase split, tokens per
second, peak RSS, and each phase's share of the machine's measured matmul FLOP/s.

    python bench/compare_trl.py                                  # both workloads, bundled SmolLM2-135M
    python bench/compare_trl.py --workload 4x8x64 --steps 5 --out results.md
    python bench/compare_trl.py --model tiny_random --workload 2x2x8 --steps 2   # smoke run
    python bench/compare_trl.py --hardware gpu --sampler hf --model qwen2_5_1_5b_random   # one CUDA GPU

TRL comes from the ``bench`` extra: ``pip install 'fgrpo[bench]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOADS = ("4x8x64", "8x8x128")
SYSTEMS = ("ours", "trl")
TRL_MISSING = "TRL is not installed: pip install 'fgrpo[bench]' (or --only ours)"


# --------------------------------------------------------------------------------------------------
# shared helpers (parent and children)


def parse_workload(text: str) -> tuple[int, int, int]:
    """``"4x8x64"`` -> ``(prompts, group_size, max_new_tokens)``."""
    try:
        p, g, t = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"workload {text!r}: expected PxGxT, e.g. 4x8x64") from None
    if p < 1 or g < 2 or t < 1:
        raise argparse.ArgumentTypeError(f"workload {text!r}: need P >= 1, G >= 2, T >= 1")
    return p, g, t


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
    ] + ([f"sampler={spec['sampler']}"] if spec.get("sampler") else []) + list(spec.get("overrides", []))
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


def best_matmul(before: dict, after: dict) -> dict:
    """The better of two matmul measurements (before and after the runs), keeping both readings."""
    best = dict(before)
    for key in ("fp32_flops", "bf16_flops"):
        best[key] = max(before[key], after[key])
    best["readings"] = [{key: m[key] for key in ("fp32_flops", "bf16_flops")} for m in (before, after)]
    return best


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

    import fgrpo.train as loop
    from fgrpo.infra.tracking import read_metrics

    p, g, t = spec["workload"]
    cfg = compose_config(spec)
    folder = loop.resolve_model_folder(cfg.model)

    run_dir = Path(spec["workdir"]) / "ours"
    run_dir.mkdir(parents=True, exist_ok=True)
    if spec.get("profile"):  # the second step's update (the first compiles)
        OmegaConf.update(cfg, "trainer.profile_step", 2)
    loop.train(cfg, run_dir, run_name="bench")
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
    sampler = (f"vLLM {_version('vllm')} ({hw.sampler_dtype})" if cfg.sampler.name == "vllm"
               else f"transformers {_version('transformers')} generate ({hw.learner_dtype} + {hw.autocast_dtype} autocast)")
    return {"steps": steps, "params": param_counts(folder), "peak_rss_child_gib": peak_rss_self_gib(),
            "peak_gpu_gib": peak_gpu_gib(), "profiled_step": 1 if spec.get("profile") else None, "sampler": sampler,
            "learner_matmuls": matmul_dtype(hw.autocast_dtype or hw.learner_dtype),
            "sampler_matmuls": matmul_dtype(hw.sampler_dtype if cfg.sampler.name == "vllm"
                                            else hw.autocast_dtype or hw.learner_dtype),
            "learner": f"torch {hw.learner_dtype}" + (f" + {hw.autocast_dtype} autocast" if hw.autocast_dtype else "")
                       + f" on {hw.device}, "
                       + (f"packed rows, micro-batches of at most {hw.micro_batch_tokens} token slots"
                          if hw.get("micro_batch_tokens") else f"micro-batch {hw.micro_batch_size}")
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

    import fgrpo.train as loop
    from fgrpo.rollout.data import build_prompt
    from fgrpo.rollout.rollouts import ProblemStream

    data = loop.load_data(cfg.dataset)
    first_epoch = ProblemStream(data.train, seed=cfg.seed).take(len(data.train))
    return Dataset.from_list([
        {
            "prompt": [{"role": "user", "content": build_prompt(q.question, instruction=cfg.model.instruction)}],
            "answer": q.answer,
            "n_prompt_tokens": len(loop.encode_prompt(tokenizer, cfg.model, q.question)),
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

    import fgrpo.train as loop
    from fgrpo.rollout.verifier import make_verifier

    p, g, t = spec["workload"]
    cfg = compose_config(spec)
    folder = loop.resolve_model_folder(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dataset = trl_dataset(cfg, tokenizer)
    verify = make_verifier(cfg.dataset.verifier)
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
                               processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    import trl

    return {"steps": steps, "params": param_counts(folder), "peak_rss_child_gib": peak_rss_self_gib(),
            "peak_gpu_gib": peak_gpu_gib(), "learner_matmuls": "bf16" if on_gpu else "fp32",
            "sampler_matmuls": "bf16" if on_gpu else "fp32",
            "sampler": f"transformers {_version('transformers')} generate ({precision})",
            "learner": f"trl {trl.__version__} GRPOTrainer ({precision}, micro-batch {micro} x {accumulation} accumulated"
                       + (", gradient checkpointing" if args.gradient_checkpointing else "") + ")"}


# --------------------------------------------------------------------------------------------------
# parent: run children, watch memory, summarise


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in (package, f"{package}-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "-"


def _tree_rss_bytes(root: int) -> int:
    """RSS of ``root`` and all its descendants, from /proc."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parents[int(entry)] = int(fields[1])
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += [child for child, parent in parents.items() if parent == pid]
    return total


def run_child(mode: str, spec: dict, workdir: Path, log_path: Path, timeout_s: float) -> dict:
    """Run this script as ``--_child mode``; return its JSON result plus the polled peak RSS of its tree."""
    spec_path, result_path = workdir / f"{mode}-spec.json", workdir / f"{mode}-result.json"
    spec_path.write_text(json.dumps({**spec, "workdir": str(workdir)}))
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    command = [sys.executable, str(Path(__file__).resolve()), "--_child", mode, "--_spec", str(spec_path),
               "--_result", str(result_path)]
    peak, start = 0, time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            peak = max(peak, _tree_rss_bytes(proc.pid))
            if time.monotonic() - start > timeout_s:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"{mode} ran past {timeout_s:.0f} s; its log: {log_path}")
            time.sleep(0.25)
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}); last lines of {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["peak_rss_gib"] = max(peak / 2**30, result.get("peak_rss_child_gib", 0.0))
    return result


def summarise(result: dict, p: int, g: int, matmul: dict) -> dict:
    """Medians over the measured steps (the first is dropped), tokens/s and FLOP/s fractions."""
    # drop the warm-up step, and the profiled step (the profiler slows it down)
    drop = {0, result.get("profiled_step", -1)}
    steps = [s for i, s in enumerate(result["steps"]) if i not in drop] or result["steps"][-1:]
    med = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    body, head = result["params"]["body"], result["params"]["head"]
    # per step: prompt tokens count once per sample (what both samplers prefill without prefix sharing)
    prompt_per_sample = med["prompt_tokens"] / (p * g)
    gen = med["generated_tokens"]
    # the positions the learner's forward and backward ran over: ours leaves padding out and may compute a
    # group's shared prompt once (perf/learner_computed_tokens); TRL: every sample's prompt + completion
    computed = med.get("computed_tokens", med["prompt_tokens"] + gen)
    sampler_flops = 2 * body * (med["prompt_tokens"] + gen) + 2 * head * (gen + p * g)
    learner_flops = 6 * (body * computed + head * gen)
    out = {
        "step_s": med["step_s"], "sample_s": med["sample_s"], "score_s": med["score_s"], "learn_s": med["learn_s"],
        "other_s": med["other_s"], "generated_tokens": gen, "prompt_tokens_per_sample": prompt_per_sample,
        "sampler_tok_s": statistics.median(s["generated_tokens"] / max(s["sample_s"], 1e-9) for s in steps),
        "learner_tok_s": statistics.median((s["generated_tokens"] + s["prompt_tokens"]) / max(s["learn_s"], 1e-9)
                                           for s in steps),
        "sampler_gflop_s": sampler_flops / max(med["sample_s"], 1e-9) / 1e9,
        "learner_gflop_s": learner_flops / max(med["learn_s"], 1e-9) / 1e9,
        "peak_rss_gib": result["peak_rss_gib"], "peak_gpu_gib": result.get("peak_gpu_gib"),
        "measured_steps": len(steps),
        "learner_padding_pct": 100 * med["padding_frac"] if "padding_frac" in med else None,
        "learner_computed_tokens": computed,
        "learner_matmuls_kept_pct": 100 * med["matmuls_kept_frac"] if "matmuls_kept_frac" in med else None,
    }
    for phase in ("sampler", "learner"):
        for dtype in ("bf16", "fp32"):
            out[f"{phase}_pct_{dtype}"] = 100 * out[f"{phase}_gflop_s"] * 1e9 / matmul[f"{dtype}_flops"]
        if matmul.get("bf16_source"):  # bf16 only probed (emulated here, nothing ran in it): no bf16 reference
            out[f"{phase}_pct_bf16"] = None
        # against the rate of the dtype this phase's matmuls actually run in (fp32 where bf16 is emulated)
        own = result.get(f"{phase}_matmuls", "bf16")
        out[f"{phase}_matmuls"] = own
        out[f"{phase}_pct_own"] = out[f"{phase}_pct_{own}"]
    return out


ROWS = [  # (key, label, format)
    ("step_s", "seconds per step (median)", "{:.2f}"),
    ("sample_s", "  sampling s", "{:.2f}"),
    ("score_s", "  scoring s", "{:.3f}"),
    ("learn_s", "  learning s", "{:.2f}"),
    ("other_s", "  other s (ours: weight sync; TRL: batch prep)", "{:.2f}"),
    ("generated_tokens", "generated tokens per step", "{:.0f}"),
    ("prompt_tokens_per_sample", "prompt tokens per sample", "{:.1f}"),
    ("sampler_tok_s", "sampler tokens/s (generated)", "{:.1f}"),
    ("learner_tok_s", "learner tokens/s (prompt+completion)", "{:.1f}"),
    ("learner_padding_pct", "learner padding, % of token slots", "{:.1f}"),
    ("learner_computed_tokens", "learner positions computed per step (a shared prompt once)", "{:.0f}"),
    ("learner_matmuls_kept_pct", "learner layer slots whose matmuls were kept, not recomputed, %", "{:.0f}"),
    ("sampler_gflop_s", "sampler GFLOP/s", "{:.1f}"),
    ("sampler_matmuls", "sampler matmul dtype", "{}"),
    ("sampler_pct_own", "sampler % of matmul in its dtype", "{:.1f}"),
    ("sampler_pct_bf16", "sampler % of bf16 matmul", "{:.1f}"),
    ("sampler_pct_fp32", "sampler % of fp32 matmul", "{:.1f}"),
    ("learner_gflop_s", "learner GFLOP/s", "{:.1f}"),
    ("learner_matmuls", "learner matmul dtype", "{}"),
    ("learner_pct_own", "learner % of matmul in its dtype", "{:.1f}"),
    ("learner_pct_bf16", "learner % of bf16 matmul", "{:.1f}"),
    ("learner_pct_fp32", "learner % of fp32 matmul", "{:.1f}"),
    ("peak_rss_gib", "peak RSS GiB", "{:.2f}"),
    ("peak_gpu_gib", "peak GPU memory GiB (torch allocator)", "{:.2f}"),
]


def markdown(report: dict) -> str:
    mm = report["matmul"]
    lines = [
        f"# fgrpo vs TRL GRPOTrainer ({report['date']})",
        "",
        f"Machine: {report['machine']}. Versions: {report['versions']}.",
        f"Model: {report['model']}; ours with hardware={report.get('hardware', 'cpu')}"
        + (f" sampler={report['sampler']}" if report.get("sampler") else "")
        + "".join(f" {o}" for o in report.get("overrides", []))
        + f"; lr {report['lr']}; {report['steps']} steps per run, the first dropped.",
        f"Precision: {_precision_line(mm)}.",
        f"Matmul {mm['size']}^3 on " + (f"{mm['threads']} threads" if mm.get("device", "cpu") == "cpu" else mm["device"])
        + f": fp32 {mm['fp32_flops'] / 1e9:.1f} GFLOP/s, "
        f"bf16 {mm['bf16_flops'] / 1e9:.1f} GFLOP/s"
        + (f" from the {mm['bf16_source']}" if mm.get("bf16_source") else "")
        + f" (best of {mm.get('reps', 6)}"
        + (", before and after the runs: " + " and ".join(f"{r['fp32_flops'] / 1e9:.1f} / {r['bf16_flops'] / 1e9:.1f}"
                                                           for r in mm["readings"]) if "readings" in mm else "")
        + "). Each phase is also held to the matmul rate of the dtype its matmuls run in.",
        "FLOPs: learner 6 x (body params x positions computed + head params x completion tokens), positions "
        "computed = prompt+completion tokens, less a shared prompt's repeats (ours); "
        "sampler 2 x (body params x (prompt tokens x G + generated) + head params x (generated + P x G)); "
        "attention scores not counted.",
        "",
    ]
    for name, wl in report["workloads"].items():
        lines.append(f"## Workload {name} (prompts x samples x max new tokens)")
        lines.append("")
        for system in [s for s in SYSTEMS if s in wl]:
            if "error" in wl[system]:
                lines.append(f"- {system}: FAILED: {wl[system]['error']}")
            else:
                lines.append(f"- {system}: sampler {wl[system]['sampler']}; learner {wl[system]['learner']}")
        lines.append("")
        systems = [s for s in SYSTEMS if "summary" in wl.get(s, {})]
        if not systems:
            continue
        header = ["metric", *systems] + (["TRL / ours"] if len(systems) == 2 else [])
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for key, label, fmt in ROWS:
            if all(wl[s]["summary"].get(key) is None for s in systems):
                continue  # e.g. GPU memory on a CPU run
            cells = [fmt.format(wl[s]["summary"][key]) if wl[s]["summary"].get(key) is not None else "-" for s in systems]
            if len(systems) == 2:
                ours, trl = wl["ours"]["summary"].get(key), wl["trl"]["summary"].get(key)
                numbers = isinstance(ours, (int, float)) and isinstance(trl, (int, float))
                cells.append(f"{trl / ours:.2f}" if numbers and ours else "-")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _precision_line(matmul: dict) -> str:
    """What ours' ``auto`` dtypes became here, and the probe behind it (from the matmul child)."""
    precision = matmul.get("precision")
    if not precision:
        return "-"
    return (f"ours' learner matmuls in {precision['autocast_dtype'] or 'float32'}, sampler in "
            f"{precision['sampler_dtype']} ({precision['reason']})")


def machine_line(cpu: str | None = None) -> str:
    """``cpu``: fgrpo.infra.precision.describe_cpu() as a child saw it (name, instruction-set kind, torch's kernels)."""
    from fgrpo.infra.precision import describe_cpu

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu or describe_cpu()}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} {platform.release()}"


def gpu_line() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def run_workloads(args, systems: list[str], workloads, matmul: dict, workdir: Path) -> dict:
    """Each workload, each system in its own child process: {name: {system: result or {"error": ...}}}."""
    workloads_run: dict = {}
    for p, g, t in workloads:
        name = f"{p}x{g}x{t}"
        entry: dict = {}
        for system in systems:
            spec = {"workload": [p, g, t], "steps": args.steps, "lr": args.lr, "model": args.model,
                    "hardware": args.hardware, "sampler": args.sampler, "overrides": args.overrides,
                    "trl_micro_batch": args.trl_micro_batch}
            sub = workdir / name
            sub.mkdir(exist_ok=True)
            if args.profile and system == "ours":
                spec["profile"] = str(sub / f"{system}-learner-profile.txt")
            print(f"[{name}] running {system} ({args.steps} steps) ...", file=sys.stderr)
            started = time.perf_counter()
            try:
                result = run_child(system, spec, sub, sub / f"{system}.log", args.timeout)
            except RuntimeError as exc:  # e.g. killed for memory: report it, go on with the rest
                print(f"[{name}] {system} FAILED: {exc}", file=sys.stderr)
                entry[system] = {"error": str(exc).splitlines()[0]}
                continue
            result["wall_s"] = time.perf_counter() - started
            entry[system] = result
            print(f"[{name}] {system}: {summarise(result, p, g, matmul)['step_s']:.2f} s/step, "
                  f"wall {result['wall_s']:.0f} s", file=sys.stderr)
        workloads_run[name] = entry
    return workloads_run


def add_summaries(report: dict, systems: list[str], matmul: dict) -> None:
    """Each run's summary against the better matmul reading, and TRL / ours where both ran."""
    for name, entry in report["workloads"].items():
        p, g, _ = parse_workload(name)
        for system in systems:
            if "error" not in entry.get(system, {"error": None}):
                entry[system]["summary"] = summarise(entry[system], p, g, matmul)
        if all("summary" in entry.get(s, {}) for s in SYSTEMS):
            entry["ratio_trl_over_ours"] = {key: entry["trl"]["summary"][key] / entry["ours"]["summary"][key]
                                            for key, _, _ in ROWS
                                            if isinstance(entry["ours"]["summary"].get(key), (int, float))
                                            and entry["ours"]["summary"][key]
                                            and isinstance(entry["trl"]["summary"].get(key), (int, float))}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="append", type=parse_workload, metavar="PxGxT",
                        help=f"prompts x samples x max new tokens; repeatable (default: {' and '.join(DEFAULT_WORKLOADS)})")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run; the first is dropped (default 5)")
    parser.add_argument("--only", choices=SYSTEMS, help="run one system only")
    parser.add_argument("--model", default="smollm2_135m",
                        help="a conf/model name: smollm2_135m (the bundled model, default), tiny_random, or "
                             "qwen2_5_1_5b_random (Qwen2.5-1.5B's shape, random weights; for a GPU)")
    parser.add_argument("--hardware", choices=("cpu", "gpu"), default="cpu",
                        help="conf/hardware for ours (TRL follows its device, micro-batch, precision); default cpu")
    parser.add_argument("--sampler", choices=("vllm", "hf"),
                        help="conf/sampler for ours (default: the config's, vllm); hf = transformers generate, as TRL")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra Hydra override for ours, e.g. hardware.micro_batch_size=16 (repeatable); TRL "
                             "follows hardware.micro_batch_size, and on a GPU hardware.gradient_checkpointing")
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate for both (default 1e-6, TRL's default)")
    parser.add_argument("--out", type=Path, action="append", default=[], help="write the results: .json or .md (repeatable)")
    parser.add_argument("--workdir", type=Path, help="keep run directories and child logs here (default: a temp dir)")
    parser.add_argument("--profile", action="store_true",
                        help="profile our second learner step with torch.profiler (top ops to the workdir); that "
                             "step is left out of ours' statistics, so use --steps >= 3")
    parser.add_argument("--trl-micro-batch", type=int,
                        help="TRL's per-device batch (gradient accumulation up to P x G); default: ours' "
                             "hardware.micro_batch_size (32)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child run (default 3600)")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    if args._child:
        spec = json.loads(Path(args._spec).read_text()) if args._spec else {}
        result = {"ours": child_ours, "trl": child_trl}[args._child](spec) if args._child != "matmul" \
            else child_matmul(spec.get("threads", 2), spec.get("device", "cpu"), spec.get("hardware"))
        Path(args._result).write_text(json.dumps(result))
        return 0

    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up and is dropped)")
    for out in args.out:
        if out.suffix not in (".json", ".md"):
            parser.error(f"--out {out}: must end in .json or .md")
    systems = [args.only] if args.only else list(SYSTEMS)
    if "trl" in systems and not trl_available():
        if args.only == "trl":
            parser.error(TRL_MISSING)
        print(f"note: {TRL_MISSING}; running ours only", file=sys.stderr)
        systems = ["ours"]
    workloads = args.workload or [parse_workload(w) for w in DEFAULT_WORKLOADS]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fgrpo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)

    threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count() or 1
    device = "cuda" if args.hardware == "gpu" else "cpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--hardware gpu: torch sees no CUDA device (use --hardware cpu)")
    print(f"measuring matmul FLOP/s on {threads} threads ..." if device == "cpu" else "measuring GPU matmul FLOP/s ...",
          file=sys.stderr)
    # ours' dtype keys as composed (auto, unless --set says otherwise): the matmul child settles them as the run will
    composed = compose_config({"workload": workloads[0], "model": args.model, "steps": args.steps, "lr": args.lr,
                               "hardware": args.hardware, "sampler": args.sampler, "overrides": args.overrides}).hardware
    matmul_spec = {"threads": threads, "device": device,
                   "hardware": {"autocast_dtype": composed.autocast_dtype, "sampler_dtype": composed.sampler_dtype}}
    matmul = run_child("matmul", matmul_spec, workdir, workdir / "matmul.log", args.timeout)
    print(f"precision: {_precision_line(matmul)}", file=sys.stderr)
    gpu = gpu_line() if device == "cuda" else None
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_line(matmul.get("cpu")) + (f"; GPU {gpu}" if gpu else ""),
        "hardware": args.hardware, "sampler": args.sampler, "overrides": args.overrides,
        "versions": ", ".join(f"{name} {_version(name)}" for name in ("torch", "vllm", "transformers", "trl"))
                    + f", python {platform.python_version()}",
        "model": args.model, "lr": args.lr, "steps": args.steps, "matmul": matmul, "workloads": {},
    }
    report["workloads"] = run_workloads(args, systems, workloads, matmul, workdir)

    # the matmul rate moves by up to 1.6x between minutes on a shared 2-core VM: measure it again
    # after the runs and divide by the better reading, so no phase looks closer to the limit than it is
    print("measuring matmul FLOP/s again ...", file=sys.stderr)
    matmul = report["matmul"] = best_matmul(
        matmul, run_child("matmul", matmul_spec, workdir, workdir / "matmul-after.log", args.timeout))
    add_summaries(report, systems, matmul)

    table = markdown(report)
    print(table)
    for out in args.out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) if out.suffix == ".json" else table + "\n")
    print(f"run directories and logs: {workdir}", file=sys.stderr)
    failed = [f"{w}/{s}" for w, e in report["workloads"].items() for s in SYSTEMS if "error" in e.get(s, {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
