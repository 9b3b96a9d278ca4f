"""The RLVR training loop, top to bottom in one function: sample -> verify -> F-GRPO advantages ->
policy loss -> AdamW step -> push weights into the sampler -> log. Evaluation (unbiased pass@k on
held-out problems) runs before the first step, every ``eval.every`` steps and after the last.

Everything that can fail on bad input (config ranges, data files, the model source, a missing vLLM)
is checked before the model loads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from fgrpo.advantages import focal_weight, group_advantages, success_rate
from fgrpo.config import ConfigError, to_container, validate
from fgrpo.data import Problem, arithmetic_problems, build_prompt, load_problems
from fgrpo.learner import (Sequence, auto_kept_matmul_gib, bound_kernel_caches, compile_decoder_layers,
                           fill_old_logprobs, keep_freed_memory, release_freed_memory, require_cpp_compiler,
                           update_policy)
from fgrpo.metrics import pass_at_k_curve
from fgrpo.model import load_policy, load_tokenizer, resolve_model_folder
from fgrpo.precision import resolve_precision
from fgrpo.samplers import HFSampler, Sampler, VLLMSampler, check_vllm_dtype, require_vllm
from fgrpo.tracking import Tracker, plot_pass_at_k
from fgrpo.verifier import make_verifier

log = logging.getLogger("fgrpo")


@dataclass
class Data:
    train: list[Problem]
    eval: dict[str, list[Problem]]  # dataset name -> held-out problems


def load_data(dataset_cfg) -> Data:
    """Read (or generate) every problem up front, so a bad file fails before the model loads."""
    if dataset_cfg.kind == "arithmetic":
        a = dataset_cfg.arithmetic
        train, held_out = arithmetic_problems(ops=tuple(a.ops), max_operand=a.max_operand, seed=a.seed, n_eval=a.n_eval)
        return Data(train=train, eval={dataset_cfg.name: held_out})
    if dataset_cfg.train is None or not dataset_cfg.eval:
        raise ConfigError(f"dataset={dataset_cfg.name}: a 'sources' dataset needs dataset.train and a dataset.eval list")

    def read(source) -> list[Problem]:
        if source.path is None:
            raise ConfigError(f"dataset source '{source.name}' has no path: set it, e.g. dataset.train.path=/data/train.jsonl")
        return load_problems(
            name=source.name, kind=source.kind, path=source.path, split=source.split, subset=source.subset,
            question_field=source.question_field, answer_field=source.answer_field, limit=source.limit,
        )

    return Data(train=read(dataset_cfg.train), eval={source.name: read(source) for source in dataset_cfg.eval})


def encode_prompt(tokenizer, model_cfg, question: str) -> list[int]:
    """Token ids of one prompt, through the model's chat template unless ``chat_template: plain``."""
    text = build_prompt(question, instruction=model_cfg.instruction)
    if model_cfg.chat_template == "plain" or tokenizer.chat_template is None:
        prefix = f"{model_cfg.system_prompt}\n\n" if model_cfg.system_prompt else ""
        return tokenizer(prefix + text, add_special_tokens=True)["input_ids"]
    messages = [{"role": "user", "content": text}]
    if model_cfg.system_prompt:
        messages.insert(0, {"role": "system", "content": model_cfg.system_prompt})
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer, then falling linearly to -penalty."""
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / max(buffer, 1))


def make_sampler(cfg: DictConfig, folder: Path, policy, tokenizer) -> Sampler:
    if cfg.sampler.name == "vllm":
        return VLLMSampler(
            folder, dtype=cfg.hardware.sampler_dtype, max_model_len=cfg.sampler.max_model_len, seed=cfg.seed,
            device=cfg.hardware.device, kv_cache_gib=cfg.hardware.sampler_kv_cache_gib,
            gpu_memory_utilization=cfg.hardware.sampler_gpu_memory_utilization,
        )
    return HFSampler(policy, tokenizer, batch_size=cfg.sampler.hf_batch_size, autocast_dtype=cfg.hardware.autocast_dtype)


def evaluate(sampler: Sampler, data: Data, prompt_cache: dict, verifier, cfg: DictConfig, *, seed: int):
    """Unbiased pass@k for k = 1, 2, 4, ..., n on each held-out set; keys ``eval/pass@k`` average the sets."""
    metrics: dict[str, float] = {}
    curves: dict[str, list] = {}
    n = cfg.eval.n_samples
    for name, problems in data.eval.items():
        problems = problems[: cfg.eval.max_problems]
        groups = sampler.generate(
            [prompt_cache[p.id] for p in problems], n, max_new_tokens=cfg.sampler.max_new_tokens,
            temperature=cfg.sampler.temperature, top_p=cfg.sampler.top_p, seed=seed,
        )
        counts = [sum(verifier(c.text, p.answer) for c in group) for p, group in zip(problems, groups)]
        curve = pass_at_k_curve([int(c) for c in counts], n, seed=seed)
        curves[name] = [(pt.k, pt.mean, pt.ci_low, pt.ci_high) for pt in curve]
        for pt in curve:
            metrics[f"eval/{name}/pass@{pt.k}"] = pt.mean
            metrics[f"eval/{name}/pass@{pt.k}_ci_low"] = pt.ci_low
            metrics[f"eval/{name}/pass@{pt.k}_ci_high"] = pt.ci_high
    for k, *_ in next(iter(curves.values())):
        for suffix in ("", "_ci_low", "_ci_high"):
            values = [metrics[f"eval/{name}/pass@{k}{suffix}"] for name in curves]
            metrics[f"eval/pass@{k}{suffix}"] = float(np.mean(values))
    return metrics, curves


@contextlib.contextmanager
def _remembering_interrupts():
    """Yield a list that records each SIGINT; each one still raises KeyboardInterrupt as Python does by default.

    The loop checks the list at each step: an interrupt that something caught on the way (torch.compile
    was seen to) still stops the run. The handler before is restored on the way out (train() may be one
    call of a longer program). Main thread only; elsewhere the list stays empty.
    """
    import signal
    import threading

    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def on_interrupt(signum, frame):
        received.append(signum)
        signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)


def settle_hardware(cfg: DictConfig, saved_config: Path | None = None):
    """Replace ``auto`` in ``hardware.autocast_dtype`` / ``sampler_dtype`` by what this machine runs fast
    (fgrpo.precision) and in ``hardware.keep_matmul_outputs_gib`` by the budget for that dtype, log the choice
    and its reason, and write the settled config to ``saved_config`` (the run's ``.hydra/config.yaml``) so that
    the run directory says what ran. Before the model loads; returns the :class:`~fgrpo.precision.Precision`."""
    hw = cfg.hardware
    precision = resolve_precision(hw.device, hw.autocast_dtype, hw.sampler_dtype)
    hw.autocast_dtype, hw.sampler_dtype = precision.autocast_dtype, precision.sampler_dtype
    if hw.keep_matmul_outputs_gib == "auto":
        selective = hw.gradient_checkpointing and hw.compile_learner
        matmul_dtype = getattr(torch, hw.autocast_dtype or hw.learner_dtype)
        hw.keep_matmul_outputs_gib = auto_kept_matmul_gib(matmul_dtype) if selective else 0.0
    log.info("precision: learner matmuls in %s (%s weights%s), sampler in %s; %s%s",
             hw.autocast_dtype or hw.learner_dtype, hw.learner_dtype,
             f", up to {hw.keep_matmul_outputs_gib:g} GiB of matmul outputs kept" if hw.keep_matmul_outputs_gib else "",
             hw.sampler_dtype, f"{precision.cpu}: " if precision.cpu else "", precision.reason)
    if cfg.sampler.name == "vllm":
        check_vllm_dtype(hw.sampler_dtype, hw.device)
    if saved_config is not None and saved_config.is_file():
        OmegaConf.save(cfg, saved_config)
    return precision


def train(
    cfg: DictConfig, run_dir: Path, *, run_name: str | None = None, overrides: list[str] | None = None,
    saved_config: Path | None = None,
) -> dict[str, float]:
    """Run one experiment; returns the final evaluation metrics. Writes everything into ``run_dir``.

    ``overrides`` (the command line's) go into the W&B config beside the composed config. ``saved_config``:
    the run's saved config file (Hydra's ``.hydra/config.yaml``), rewritten with the settled precision.
    """
    validate(cfg)
    data = load_data(cfg.dataset)
    verifier = make_verifier(cfg.dataset.verifier, timeout_s=cfg.dataset.verifier_timeout_s)
    if cfg.sampler.name == "vllm":
        require_vllm()
    if cfg.hardware.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("hardware=gpu (hardware.device=cuda) but torch sees no CUDA device: use hardware=cpu")
    if cfg.hardware.compile_learner and cfg.hardware.device == "cpu":
        require_cpp_compiler()
    folder = resolve_model_folder(cfg.model)
    if cfg.hardware.device == "cpu":
        keep_freed_memory()
        bound_kernel_caches()  # before the first matmul (vLLM's start-up)

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.hardware.device == "cpu" and cfg.hardware.threads > 0:
        torch.set_num_threads(cfg.hardware.threads)
    precision = settle_hardware(cfg, saved_config)

    tokenizer = load_tokenizer(folder)
    policy = load_policy(folder, dtype=cfg.hardware.learner_dtype, device=cfg.hardware.device,
                         attention=cfg.hardware.attention)
    if cfg.hardware.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    # sampler=hf generates with the policy itself: compiled for the learner only (a KV cache would recompile)
    if cfg.hardware.compile_learner and not compile_decoder_layers(
            policy, grad_only=cfg.sampler.name == "hf", selective_checkpoint=cfg.hardware.keep_matmul_outputs_gib > 0):
        log.warning("hardware.compile_learner: %s has no decoder-layer list to compile; running eager", cfg.model.name)
    reference = None
    if cfg.algo.kl_coef > 0:
        reference = load_policy(folder, dtype=cfg.hardware.learner_dtype, device=cfg.hardware.device,
                                attention=cfg.hardware.attention).eval()
        reference.requires_grad_(False)
    # fused: one kernel over all parameters (on CPU 9x faster than the default per-tensor loop, same math)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=cfg.trainer.lr, betas=tuple(cfg.trainer.betas), weight_decay=cfg.trainer.weight_decay,
        fused=True,
    )
    # linear warm-up, then constant (the paper: constant lr after 15 warm-up steps)
    warmup = max(cfg.trainer.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / (warmup + 1)))

    prompt_cache = {p.id: encode_prompt(tokenizer, cfg.model, p.question) for p in data.train}
    for problems in data.eval.values():
        prompt_cache.update({p.id: encode_prompt(tokenizer, cfg.model, p.question) for p in problems})
    too_long = [pid for pid, ids in prompt_cache.items() if len(ids) + cfg.sampler.max_new_tokens > cfg.sampler.max_model_len]
    if too_long:
        raise ConfigError(
            f"{len(too_long)} prompts (e.g. {too_long[0]}) plus sampler.max_new_tokens={cfg.sampler.max_new_tokens} "
            f"exceed sampler.max_model_len={cfg.sampler.max_model_len}: raise sampler.max_model_len"
        )

    sampler = make_sampler(cfg, folder, policy, tokenizer)
    tracker = Tracker(
        run_dir, backend=cfg.logger.name, project=cfg.logger.get("project", "fgrpo"),
        name=cfg.run_name or run_name, group=cfg.logger.get("group"), mode=cfg.logger.get("mode"),
        entity=cfg.logger.get("entity"), tags=list(cfg.logger.get("tags") or []),
        config={**to_container(cfg), "overrides": list(overrides or []), "precision": precision.as_dict()},
    )
    curves: dict[str, dict] = {}
    eval_seed = cfg.seed + 1_000_003
    group_size = cfg.algo.group_size
    order = np.random.default_rng(cfg.seed).permutation(len(data.train))
    cursor = 0

    def next_problems(count: int) -> list[Problem]:
        nonlocal cursor, order
        picked = []
        for _ in range(count):
            if cursor == len(order):  # a new epoch: reshuffle
                order, cursor = np.random.default_rng(cfg.seed + len(picked) + 1).permutation(len(data.train)), 0
            picked.append(data.train[order[cursor]])
            cursor += 1
        return picked

    verify_seconds = 0.0  # time inside the verifier, accumulated over a step's sampling rounds

    def sample_groups(problems: list[Problem], seed: int):
        nonlocal verify_seconds
        groups = sampler.generate(
            [prompt_cache[p.id] for p in problems], group_size, max_new_tokens=cfg.sampler.max_new_tokens,
            temperature=cfg.sampler.temperature, top_p=cfg.sampler.top_p, seed=seed,
        )
        verify_start = time.perf_counter()
        correct = torch.tensor([[verifier(c.text, p.answer) for c in g] for p, g in zip(problems, groups)])
        verify_seconds += time.perf_counter() - verify_start
        return groups, correct

    from tqdm.auto import tqdm

    with tracker, _remembering_interrupts() as interrupted:
        eval_metrics, curves["before training"] = _timed_eval(sampler, data, prompt_cache, verifier, cfg, eval_seed)
        before = {k: v for k, v in eval_metrics.items() if k.startswith("eval/pass@") and "_ci_" not in k}
        tracker.log(eval_metrics, step=0)
        progress = tqdm(range(1, cfg.trainer.steps + 1), desc="training", unit="step", dynamic_ncols=True)
        for step in progress:
            if interrupted:  # a Ctrl-C that landed where it was swallowed (seen inside torch.compile) stops here
                raise KeyboardInterrupt(f"interrupted during step {step - 1}")
            step_start = time.perf_counter()
            verify_seconds = 0.0
            problems = next_problems(cfg.trainer.prompts_per_step)
            groups, correct = sample_groups(problems, seed=cfg.seed * 100_003 + step)
            sample_time = time.perf_counter() - step_start
            if cfg.algo.dynamic_sampling:  # DAPO: keep only groups with both outcomes, resample the rest
                rounds = 1
                keep = [i for i in range(len(problems)) if 0 < correct[i].sum() < group_size]
                problems, groups, correct = [problems[i] for i in keep], [groups[i] for i in keep], correct[keep]
                while len(problems) < cfg.trainer.prompts_per_step and rounds < cfg.algo.max_sampling_rounds:
                    extra_problems = next_problems(cfg.trainer.prompts_per_step)
                    extra_groups, extra_correct = sample_groups(extra_problems, seed=cfg.seed * 100_003 + step + 7919 * rounds)
                    keep = [i for i in range(len(extra_problems)) if 0 < extra_correct[i].sum() < group_size]
                    problems += [extra_problems[i] for i in keep]
                    groups += [extra_groups[i] for i in keep]
                    correct = torch.cat([correct, extra_correct[keep]])
                    rounds += 1
                problems, groups, correct = problems[: cfg.trainer.prompts_per_step], groups[: cfg.trainer.prompts_per_step], correct[: cfg.trainer.prompts_per_step]
                sample_time = time.perf_counter() - step_start
            # sample_time covers generation and verification; report them apart
            verify_time, sample_time = verify_seconds, sample_time - verify_seconds

            step_metrics: dict[str, float | list[float]] = {}
            if len(problems) > 0:
                rewards = correct.clone()
                if cfg.algo.overlong_shaping:
                    rewards += torch.tensor([[overlong_penalty(len(c.token_ids), cfg.sampler.max_new_tokens,
                                                                cfg.algo.overlong_buffer, cfg.algo.overlong_penalty)
                                              for c in g] for g in groups])
                # Eq. 13: the focal weight (from correctness) times the group-normalised advantage
                weights = focal_weight(correct, cfg.focal.gamma)
                advantages = weights[:, None] * group_advantages(rewards, std_normalize=cfg.algo.std_normalize)
                seqs = [
                    Sequence(prompt_cache[p.id], c.token_ids, float(advantages[i, j]))
                    for i, (p, g) in enumerate(zip(problems, groups))
                    for j, c in enumerate(g)
                    if len(c.token_ids) > 0
                ]
                sampler.release_memory()  # on CPU, vLLM's KV cache and packed weights: dead until the push below
                learn_start = time.perf_counter()
                learn_metrics = _learn(policy, optimizer, seqs, cfg, tokenizer.pad_token_id, reference)
                scheduler.step()
                learn_time = time.perf_counter() - learn_start
                sync_start = time.perf_counter()
                # the step has used the gradients: free them (0.5 GiB for SmolLM2) before the push packs new weights
                optimizer.zero_grad(set_to_none=True)
                sampler.update_weights(policy)
                if cfg.hardware.device == "cpu":
                    release_freed_memory()  # the step's freed activations and the push's copies
                sync_time = time.perf_counter() - sync_start

                rates = success_rate(correct)
                lengths = [len(c.token_ids) for g in groups for c in g]
                sampled_tokens = sum(lengths)
                learner_tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)
                padding_frac = learn_metrics.pop("padding_frac")
                computed_tokens = learn_metrics.pop("computed_tokens")
                matmuls_kept_frac = learn_metrics.pop("matmuls_kept_frac")
                step_metrics.update({f"train/{k}": v for k, v in learn_metrics.items()})
                step_metrics.update({
                    "train/reward_mean": float(rewards.mean()),
                    "train/correct_mean": float(correct.mean()),
                    "train/frac_all_correct": float((rates == 1).float().mean()),
                    "train/frac_all_wrong": float((rates == 0).float().mean()),
                    "train/frac_mixed": float(((rates > 0) & (rates < 1)).float().mean()),
                    "train/success_rate_hist": rates.tolist(),
                    "train/focal_weight_mean": float(weights.mean()),
                    "train/focal_weight_min": float(weights.min()),
                    "train/adv_abs_mean": float(advantages.abs().mean()),
                    "train/completion_len_mean": float(np.mean(lengths)),
                    "train/completion_len_max": float(np.max(lengths)),
                    "train/truncated_frac": float(np.mean([c.truncated for g in groups for c in g])),
                    "train/lr": optimizer.param_groups[0]["lr"],
                    "train/groups": float(len(problems)),
                    "perf/sample_time_s": sample_time,
                    "perf/verify_time_s": verify_time,
                    "perf/learn_time_s": learn_time,
                    "perf/sync_time_s": sync_time,
                    "perf/sampler_tokens_per_s": sampled_tokens / max(sample_time, 1e-9),
                    "perf/learner_tokens_per_s": learner_tokens / max(learn_time, 1e-9),
                    "perf/learner_padding_frac": padding_frac,
                    # positions the learner ran over (padding out, a shared prompt once): its FLOPs are ~6 x params x this
                    "perf/learner_computed_tokens": computed_tokens,
                    # share of the layers' token slots whose backward reused kept matmul outputs (no recompute)
                    "perf/learner_matmuls_kept_frac": matmuls_kept_frac,
                    "perf/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                })
            else:
                log.warning("step %d: dynamic sampling found no mixed group; skipping the update", step)
            step_metrics["perf/step_time_s"] = time.perf_counter() - step_start
            tracker.log(step_metrics, step=step)
            progress.set_postfix(reward=f"{float(correct.mean()) if len(problems) else float('nan'):.3f}")

            last = step == cfg.trainer.steps
            if last or (cfg.eval.every and step % cfg.eval.every == 0):
                eval_metrics, step_curves = _timed_eval(sampler, data, prompt_cache, verifier, cfg, eval_seed)
                tracker.log(eval_metrics, step=step)
                progress.write(f"step {step}: eval pass@1 = {eval_metrics['eval/pass@1']:.3f}")
                if last:
                    curves["after training"] = step_curves

        final = {k: v for k, v in eval_metrics.items() if not k.endswith(("_ci_low", "_ci_high"))}
        plot_path = run_dir / "pass_at_k.png"
        _plot(curves, plot_path, cfg)
        tracker.log_image("eval/pass_at_k_curve", plot_path, step=cfg.trainer.steps)
        tracker.summary({**final, **{f"{k}_before": v for k, v in before.items()}})
        if cfg.trainer.save_final:
            policy.save_pretrained(run_dir / "final_model")
            tokenizer.save_pretrained(run_dir / "final_model")
    sampler.close()
    return final


def _learn(policy, optimizer, seqs, cfg, pad_id, reference) -> dict[str, float]:
    """One update per mini-batch; with one mini-batch the batch is on-policy (no extra forward)."""
    autocast = cfg.hardware.autocast_dtype
    common = dict(
        algo_cfg=cfg.algo, pad_id=pad_id, temperature=cfg.sampler.temperature,
        micro_batch_size=cfg.hardware.micro_batch_size, micro_batch_tokens=cfg.hardware.micro_batch_tokens,
        autocast_dtype=getattr(torch, autocast) if autocast else None,
        share_prompts=cfg.hardware.share_prompts,
    )
    if cfg.trainer.mini_batches > 1:
        fill_old_logprobs(policy, seqs, **{k: v for k, v in common.items() if k != "algo_cfg"})
    order = np.random.default_rng(len(seqs)).permutation(len(seqs))
    chunks = np.array_split(order, cfg.trainer.mini_batches)
    results = [
        update_policy(policy, optimizer, [seqs[i] for i in chunk], grad_clip=cfg.trainer.grad_clip,
                      max_new_tokens=cfg.sampler.max_new_tokens, ref_model=reference,
                      kept_matmul_bytes=int(cfg.hardware.keep_matmul_outputs_gib * 2**30), **common)
        for chunk in chunks if len(chunk)
    ]
    out = {key: float(np.mean([r[key] for r in results])) for key in results[0]}
    out["computed_tokens"] = float(sum(r["computed_tokens"] for r in results))
    return out


def _timed_eval(sampler, data, prompt_cache, verifier, cfg, seed):
    start = time.perf_counter()
    metrics, curves = evaluate(sampler, data, prompt_cache, verifier, cfg, seed=seed)
    metrics["perf/eval_time_s"] = time.perf_counter() - start
    if len(curves) == 1:
        curves = next(iter(curves.values()))
    else:  # several eval sets: plot their average
        first = next(iter(curves.values()))
        curves = [(k, metrics[f"eval/pass@{k}"], metrics[f"eval/pass@{k}_ci_low"], metrics[f"eval/pass@{k}_ci_high"])
                  for k, *_ in first]
    return metrics, curves


def _plot(curves, path: Path, cfg) -> None:
    title = f"{cfg.model.name} | {cfg.algo.name} gamma={cfg.focal.gamma} | {cfg.dataset.name}"
    plot_pass_at_k(curves, path, title=title)
