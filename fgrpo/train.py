"""The RLVR training loop, top to bottom in :func:`train`: sample groups -> verify -> F-GRPO advantages ->
learner update -> push weights into the sampler -> log. Evaluation (unbiased pass@k on held-out problems) runs
before the first step (unless ``eval.before=false``), every ``eval.every`` steps and after the last.

Everything that can fail on bad input (config ranges, data files, the model source, a missing vLLM)
is checked in :func:`prepare`, before the model loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from fgrpo.infra import checkpoint, distributed

from fgrpo import rare_nll
from fgrpo.algorithm.advantages import focal_group_advantages, focal_weight, success_rate
from fgrpo.learner.compiled_layers import auto_kept_matmul_gib, require_cpp_compiler
from fgrpo.learner.flex_attention import flex_available
from fgrpo.config import experiment_differences, to_container, validate, validate_layout
from fgrpo.infra.errors import ConfigError
from fgrpo.infra.distributed import SINGLE, Ranks
from fgrpo.rollout.data import Problem, arithmetic_problems, build_prompt, load_problems
from fgrpo.evaluation.held_out import COUNTS_FILE, append_counts, evaluate
from fgrpo.learner.learner import Learner, LearnerSettings
from fgrpo.algorithm.losses import LossSettings
from fgrpo.learner.gpu_memory import check_learner_fits_gpus
from fgrpo.learner.model import load_tokenizer, resolve_model_folder
from fgrpo.infra.precision import Precision, resolve_precision
from fgrpo.infra.process_memory import bound_kernel_caches, keep_freed_memory
from fgrpo.rollout.rollouts import Groups, ProblemStream, collect_groups, learner_sequences, overlong_penalties, sample_groups
from fgrpo.rollout.samplers import HFSampler, Sampler, VLLMSampler, check_vllm_dtype, require_vllm
from fgrpo.evaluation.plots import plot_pass_at_k
from fgrpo.infra.tracking import NoTracker, Tracker, supersede_rows_after
from fgrpo.rollout.verifier import close_verifier, make_verifier

log = logging.getLogger("fgrpo")


def train(
    cfg: DictConfig, run_dir: Path, *, run_name: str | None = None, overrides: list[str] | None = None,
    saved_config: Path | None = None,
) -> dict[str, float]:
    """Run one experiment; returns the final evaluation metrics. Writes everything into ``run_dir``.

    ``overrides`` (the command line's) go into the W&B config beside the composed config. ``saved_config``:
    the run's saved config file (Hydra's ``.hydra/config.yaml``), rewritten with the settled precision.
    """
    from tqdm.auto import tqdm

    ranks = distributed.init_from_env(single_process_group=cfg.hardware.fsdp)  # several processes (torchrun, Slurm tasks): each its share of the prompts
    run = prepare(cfg, saved_config, ranks)
    # before the model loads (a refusal is cheap); rank 0's answer, so that every rank takes the same path
    resuming = distributed.from_rank0(distributed.agree(lambda: plan_resume(cfg, run_dir, ranks)))
    ranks = dataclasses.replace(ranks, tensor_parallel=cfg.sampler.tensor_parallel_size)
    algo, sampling = cfg.algo, cfg.sampler
    learner = Learner(run.folder, learner_settings(cfg), loss_settings(algo), pad_id=run.tokenizer.pad_token_id,
                      generates=sampling.name == "hf")
    sampler = make_sampler(cfg, run.folder, learner.policy, run.tokenizer, ranks)
    stream = ProblemStream(run.data.train, seed=cfg.seed)
    resumed = checkpoint.resume(run_dir, learner.policy, learner.optimizer) if resuming else None
    if resumed is not None:
        learner.scheduler.load_state_dict(resumed.state.scheduler)
        stream.load_state_dict(resumed.state.stream)
        learner.push_weights(sampler)
        log.info("resumed from %s: step %d done, %d to go", resumed.path, resumed.state.step,
                 max(0, cfg.trainer.steps - resumed.state.step))

    def draw(problems: list[Problem], seeds: list[int]) -> Groups:
        return sample_groups(sampler, problems, run.prompt_ids, run.verifier, group_size=algo.group_size,
                             max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                             top_p=sampling.top_p, seed=seeds)

    def evaluate_now(step: int):
        """pass@k metrics and curve of the model after ``step``; its per-problem counts go to eval_counts.jsonl."""
        metrics, curve, count_rows = evaluate(
            sampler, run.data.eval, run.prompt_ids, run.verifier, n_samples=cfg.eval.n_samples,
            max_problems=cfg.eval.max_problems, max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature, top_p=sampling.top_p, seed=cfg.seed + EVAL_SEED_OFFSET, ranks=ranks)
        if ranks.main:
            append_counts(run_dir, step, count_rows)
        if run.rare_set is not None:  # the paper's Delta NLL_rare: is what the base model found rarely forgotten?
            metrics.update({f"eval/{key}": value
                            for key, value in rare_nll.score(learner.policy, run.rare_set, pad_id=run.tokenizer.pad_token_id).items()})
        return metrics, curve

    def save(step: int) -> None:
        state = checkpoint.TrainerState(
            step=step, stream=stream.state_dict(), scheduler=learner.scheduler.state_dict(), before=before,
            last_eval=eval_metrics, last_eval_step=last_eval_step, curves=curves, config=to_container(cfg),
            # a W&B that failed to start this time must not lose the run's id for the attempts after
            wandb_run_id=tracker.wandb_run_id or (resumed.state.wandb_run_id if resumed else None),
            world_size=ranks.world)
        start = time.perf_counter()
        path = checkpoint.save_checkpoint(run_dir, learner.policy, learner.optimizer, state,
                                          keep=cfg.trainer.keep_checkpoints)
        log.info("checkpoint of step %d saved in %.1f s: %s", step, time.perf_counter() - start, path)

    stopped_at = None
    with make_tracker(cfg, run_dir, run_name, overrides, run.precision, ranks, resumed) as tracker, \
            _remembering_interrupts() as interrupted, \
            _stop_requests(cfg.hardware.slurm_signal_delay_s - STOP_MARGIN_S) as stop_requests:
        if ranks.main:  # counts of steps after the checkpoint (or of an attempt that saved none) are redone
            supersede_rows_after(run_dir / COUNTS_FILE, resumed.state.step if resumed else -1)
        if resumed is None:
            eval_metrics, curves = {}, {}
            if cfg.eval.before:
                eval_metrics, curves["before training"] = evaluate_now(0)
                tracker.log(eval_metrics, step=0)
            before, first_step, last_eval_step = eval_metrics, 1, 0
        else:
            state = resumed.state
            before, eval_metrics, curves, first_step = state.before, state.last_eval, state.curves, state.step + 1
            last_eval_step = state.last_eval_step
            if first_step > cfg.trainer.steps and last_eval_step != state.step:
                # nothing left to train (trainer.steps lowered to the checkpoint's): the final numbers are its own
                eval_metrics, curves["after training"] = evaluate_now(state.step)
                tracker.log(eval_metrics, step=state.step)
                last_eval_step = state.step
            checkpoint.restore_rng(resumed.rng)  # last: nothing between the save and the next step draws
        last_save = time.monotonic()
        progress = tqdm(range(first_step, cfg.trainer.steps + 1), desc="training", unit="step", dynamic_ncols=True,
                        disable=not ranks.main, initial=first_step - 1, total=cfg.trainer.steps)
        for step in progress:
            if interrupted:  # a Ctrl-C that landed where it was swallowed (seen inside torch.compile) stops here
                raise KeyboardInterrupt(f"interrupted during step {step - 1}")
            step_start = time.perf_counter()
            groups = collect_groups(draw, stream, cfg.trainer.prompts_per_step, seed=cfg.seed * 100_003 + step,
                                    dynamic_sampling=algo.dynamic_sampling, max_rounds=algo.max_sampling_rounds,
                                    ranks=ranks)
            timings = {"sample": time.perf_counter() - step_start - groups.verify_time_s, "verify": groups.verify_time_s}
            metrics = {}
            if distributed.sum_over_ranks([len(groups)])[0]:  # every rank updates, with groups of its own or none
                rewards = groups.correct.clone()
                if algo.overlong_shaping:
                    rewards += overlong_penalties(groups, sampling.max_new_tokens, algo.overlong_buffer,
                                                  algo.overlong_penalty)
                # F-GRPO: mu_hat = the group's success rate (Eq. 11, from correctness), g = (1 - mu_hat)^gamma
                # (Eq. 12), A^F = g * A with A the group-normalised advantage (Eqs. 3, 13); gamma = 0: the baseline
                advantages = focal_group_advantages(rewards, cfg.focal.gamma, correct=groups.correct,
                                                    std_normalize=algo.std_normalize) if len(groups) else rewards
                seqs = learner_sequences(groups, advantages, run.prompt_ids)
                sampler.release_memory()  # on CPU, vLLM's KV cache and packed weights: dead until the push below
                profiled_step = step if step == cfg.trainer.profile_step and ranks.main else None
                with _timed(timings, "learn"), _profiled(run_dir, profiled_step):
                    learned = learner.update(seqs)
                with _timed(timings, "sync"):
                    learner.push_weights(sampler)
                outcomes = StepOutcomes.of(groups, rewards, advantages, seqs).gathered()
                metrics = step_metrics(outcomes, learned, timings, cfg.focal.gamma, learner.lr, ranks.world)
            else:
                log.warning("step %d: dynamic sampling found no mixed group; skipping the update", step)
            metrics["perf/step_time_s"] = time.perf_counter() - step_start
            tracker.log(metrics, step=step)
            progress.set_postfix(reward=f"{metrics.get('train/correct_mean', float('nan')):.3f}")
            if step == cfg.trainer.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                eval_metrics, curves["after training"] = evaluate_now(step)
                last_eval_step = step
                tracker.log(eval_metrics, step=step)
                if ranks.main:
                    progress.write(f"step {step}: eval pass@1 = {eval_metrics['eval/pass@1']:.3f}")
            every, minutes = cfg.trainer.checkpoint_every, cfg.trainer.checkpoint_every_min
            # one decision for all ranks: a signal may reach some of them only, and the clock is rank 0's
            stop, timed = distributed.max_over_ranks(
                [float(bool(stop_requests)), float(ranks.main and minutes > 0 and time.monotonic() - last_save >= 60 * minutes)])
            if stop or timed or (every and step % every == 0):
                save(step)
                last_save = time.monotonic()
            if stop:
                stopped_at = step
                break
        if stopped_at is None:
            final = finish(cfg, run_dir, tracker, learner, run.tokenizer, curves, before, eval_metrics, ranks)
    if stopped_at is not None:
        exit_code, failure = hand_over_stop(stopped_at, run_dir, stop_requests)
    close_verifier(run.verifier)
    sampler.close()  # vLLM's shutdown takes the process group down with it: last
    distributed.close()
    if stopped_at is not None:
        if failure is not None:  # submitit's "not requeued" error: raised, so that submitit records the reason
            raise failure
        raise SystemExit(exit_code)
    return final


@dataclass
class Run:
    """What :func:`prepare` checked and loaded before the model: the data, the verifier, the model's folder and
    tokenizer, every prompt's token ids, and the precision settled for this machine."""

    data: Data
    verifier: object
    folder: Path
    tokenizer: object
    prompt_ids: dict[str, list[int]]
    precision: Precision
    rare_set: rare_nll.RareSet | None = None  # eval.rare_set, scored at each evaluation


def prepare(cfg: DictConfig, saved_config: Path | None = None, ranks: Ranks = SINGLE) -> Run:
    """Every check that can fail on bad input, before the model loads; seeds, threads and process memory.

    Several ranks: each checks, and if any fails all raise the first failure (distributed.agree), so rank 0 can
    say why and no rank is left waiting in a collective."""
    data, verifier, folder = distributed.agree(lambda: _check_inputs(cfg, ranks.world))
    hw = cfg.hardware
    if hw.device == "cpu":
        keep_freed_memory()
        bound_kernel_caches()  # before the first matmul (the precision probe, vLLM's start-up)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if hw.device == "cpu" and (hw.threads > 0 or ranks.world > 1):
        # several ranks on one machine split its cores (all of them each would oversubscribe)
        torch.set_num_threads(hw.threads or max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    precision = settle_hardware(cfg, saved_config, ranks)
    tokenizer, prompt_ids = distributed.agree(lambda: _encode_prompts(cfg, folder, data))
    rare_set = distributed.agree(lambda: _load_rare_set(cfg.eval.rare_set, len(tokenizer))) if cfg.eval.rare_set else None
    return Run(data, verifier, folder, tokenizer, prompt_ids, precision, rare_set)


def _load_rare_set(path: str, vocab_size: int) -> rare_nll.RareSet:
    try:
        rare = rare_nll.load_rare_set(path)
        rare_nll.check_vocabulary(rare, vocab_size)
    except (OSError, ValueError) as error:
        raise ConfigError(f"eval.rare_set={path}: {error}") from error
    return rare


def _check_inputs(cfg: DictConfig, world: int) -> tuple[Data, object, Path]:
    """The config's ranges, its fit to ``world`` processes, the data files, the verifier, the sampler's package, the
    device, the compiler and the model's folder (and, on GPUs, whether the learner fits them)."""
    validate(cfg)
    validate_layout(cfg, world)
    data = load_data(cfg.dataset)
    verifier = make_verifier(cfg.dataset.verifier, timeout_s=cfg.dataset.verifier_timeout_s,
                             workers=cfg.dataset.verifier_workers)
    hw = cfg.hardware
    if cfg.sampler.name == "vllm":
        require_vllm()
    if hw.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("hardware=gpu (hardware.device=cuda) but torch sees no CUDA device: use hardware=cpu")
    if hw.compile_learner and hw.device == "cpu":
        require_cpp_compiler()
    if hw.attention == "flex":
        require_flex(hw.device)
    folder = resolve_model_folder(cfg.model)
    if hw.device == "cuda":
        check_learner_fits_gpus(folder, cfg, world)
    return data, verifier, folder


def require_flex(device: str) -> None:
    """hardware.attention=flex on a machine that cannot run it: fail before the model loads, naming the way out."""
    problem = flex_available(device)
    if problem:
        raise ConfigError(f"hardware.attention=flex cannot run here: {problem}. Set hardware.attention=sdpa (and, for "
                          "padded micro-batches, hardware.micro_batch_tokens=null hardware.share_prompts=false)")


def _encode_prompts(cfg: DictConfig, folder: Path, data: Data) -> tuple[object, dict[str, list[int]]]:
    """The tokenizer and every prompt's token ids, each checked to leave room for a completion."""
    tokenizer = load_tokenizer(folder)
    problems = data.train + [p for eval_set in data.eval.values() for p in eval_set]
    prompt_ids = {p.id: encode_prompt(tokenizer, cfg.model, p.question) for p in problems}
    too_long = [pid for pid, ids in prompt_ids.items() if len(ids) + cfg.sampler.max_new_tokens > cfg.sampler.max_model_len]
    if too_long:
        raise ConfigError(
            f"{len(too_long)} prompts (e.g. {too_long[0]}) plus sampler.max_new_tokens={cfg.sampler.max_new_tokens} "
            f"exceed sampler.max_model_len={cfg.sampler.max_model_len}: raise sampler.max_model_len"
        )
    return tokenizer, prompt_ids


def learner_settings(cfg: DictConfig) -> LearnerSettings:
    hw, trainer = cfg.hardware, cfg.trainer
    return LearnerSettings(
        model_name=cfg.model.name, max_new_tokens=cfg.sampler.max_new_tokens, temperature=cfg.sampler.temperature, device=hw.device,
        dtype=hw.learner_dtype, autocast_dtype=hw.autocast_dtype, attention=hw.attention, compile=hw.compile_learner,
        gradient_checkpointing=hw.gradient_checkpointing, fsdp=hw.fsdp, cpu_offload=hw.cpu_offload,
        kept_matmul_gib=hw.keep_matmul_outputs_gib,
        micro_batch_size=hw.micro_batch_size, micro_batch_tokens=hw.micro_batch_tokens,
        share_prompts=hw.share_prompts, lr=trainer.lr, betas=tuple(trainer.betas), weight_decay=trainer.weight_decay,
        warmup_steps=trainer.warmup_steps, grad_clip=trainer.grad_clip, mini_batches=trainer.mini_batches,
    )


def loss_settings(algo: DictConfig) -> LossSettings:
    return LossSettings(algo=algo.name, clip_low=algo.clip_low, clip_high=algo.clip_high, agg=algo.loss_agg,
                        kl_coef=algo.kl_coef, entropy_coef=algo.entropy_coef)


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


def make_sampler(cfg: DictConfig, folder: Path, policy, tokenizer, ranks: Ranks = SINGLE) -> Sampler:
    if cfg.sampler.name == "vllm":
        return VLLMSampler(
            # one seed per engine: on CPU the engine's seed drives every draw, and engines with one seed would
            # draw the same random numbers for different prompts
            folder, dtype=cfg.hardware.sampler_dtype, max_model_len=cfg.sampler.max_model_len,
            seed=cfg.seed + 7_919 * ranks.data_parallel_rank, device=cfg.hardware.device,
            kv_cache_gib=cfg.hardware.sampler_kv_cache_gib,
            gpu_memory_utilization=cfg.hardware.sampler_gpu_memory_utilization,
            tensor_parallel_size=cfg.sampler.tensor_parallel_size, distributed=ranks.world > 1,
            sleep=cfg.hardware.sampler_sleep,
        )
    return HFSampler(policy, tokenizer, batch_size=cfg.sampler.hf_batch_size, autocast_dtype=cfg.hardware.autocast_dtype)


# evaluations draw from their own seed (cfg.seed + this), apart from the training steps' (fgrpo.evaluate uses it too)
EVAL_SEED_OFFSET = 1_000_003
# the exit code of a run that stopped on SIGUSR2 outside submitit: EX_TEMPFAIL, "try again" (it resumes)
STOPPED_EXIT_CODE = 75
# of the time between Slurm's SIGUSR2 and its time limit, what the requeue needs after the save (submitit's calls)
STOP_MARGIN_S = 30
REPLACED_PREFIX = "replaced-"


def plan_resume(cfg: DictConfig, run_dir: Path, ranks: Ranks = SINGLE) -> bool:
    """Whether this run continues from a checkpoint in ``run_dir``; before the model loads. Raises ConfigError if
    the checkpoint is of another experiment (a key outside config.RESUMABLE_KEYS changed), listing the keys.
    ``trainer.resume=false``: rank 0 moves a previous run's files into ``replaced-<time>/`` inside the directory,
    and the run starts over."""
    restarted = max(int(os.environ.get(k, 0) or 0) for k in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"))
    if not cfg.trainer.resume and restarted:  # a requeued job or a restarted torchrun has the first attempt's command
        log.info("trainer.resume=false holds for the first attempt only: this is restart %d, it resumes", restarted)
    elif not cfg.trainer.resume:
        if ranks.main:
            _move_previous_run_aside(run_dir)
        return False
    found = checkpoint.newest_readable(run_dir)
    if found is None:
        return False
    saved = found[1]
    if cfg.trainer.steps < saved.step:
        raise ConfigError(f"trainer.steps={cfg.trainer.steps} is below the step of {run_dir}'s checkpoint ({saved.step}): "
                          f"set trainer.steps to {saved.step} or more to go on, or start over with trainer.resume=false")
    differences = experiment_differences(saved.config, to_container(cfg))
    if differences:
        raise ConfigError(
            f"{run_dir} holds a checkpoint (step {saved.step}) of another experiment; these keys differ (saved -> now):"
            "\n  " + "\n  ".join(differences) + "\nRun the saved experiment's command to resume it, or start over: "
            "trainer.resume=false (the directory's files move to a replaced-<time>/ folder) or another hydra.run.dir")
    return True


def _move_previous_run_aside(run_dir: Path) -> None:
    """A previous run's outputs (not Hydra's .hydra/ and run.log, which are this run's now) into replaced-<time>/."""
    previous = [p for p in run_dir.iterdir() if p.name not in (".hydra", "run.log")
                and not p.name.startswith(REPLACED_PREFIX)] if run_dir.is_dir() else []
    if not any(p.name in (checkpoint.CHECKPOINTS, "metrics.jsonl") for p in previous):
        return
    aside = run_dir / f"{REPLACED_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for path in previous:
        path.rename(aside / path.name)
    log.warning("trainer.resume=false: the previous run's files in %s moved to %s; starting over", run_dir, aside.name)


@contextlib.contextmanager
def _stop_requests(deadline_s: float = 0.0):
    """Yield a list that records each SIGUSR2: Slurm's warning before a time limit (submitit asks for it) or a
    preemption's, or ``scancel --signal=USR2``. The loop saves a checkpoint at the end of the step and stops
    (:func:`hand_over_stop`). The handler before (submitit's requeue) is kept in the list's ``previous``.

    ``deadline_s``: if the step, its evaluation and the save are not done that long after the signal (a slow step
    would run into the time limit, and nothing would requeue the job), submitit's handler runs at once, from
    wherever the run is: the job is requeued and resumes from the checkpoint before. Only where there is such a
    handler (a Slurm job of a sweep)."""
    import signal
    import threading

    received = _Requests()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def on_signal(signum, frame):
        if not received and deadline_s > 0 and callable(received.previous):
            signal.alarm(max(1, int(deadline_s)))
        received.append(signum)

    def too_late(signum, frame):
        log.warning("no step boundary within %.0f s of SIGUSR2: requeueing now, from the checkpoint before", deadline_s)
        received.previous(signal.SIGUSR2, frame)

    received.previous = signal.signal(signal.SIGUSR2, on_signal)
    previous_alarm = signal.signal(signal.SIGALRM, too_late)
    try:
        yield received
    finally:  # None: a handler set outside Python, which cannot be put back; the default is the closest
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous_alarm if previous_alarm is not None else signal.SIG_DFL)
        signal.signal(signal.SIGUSR2, received.previous if received.previous is not None else signal.SIG_DFL)


class _Requests(list):
    previous = None


def hand_over_stop(step: int, run_dir: Path, requests: _Requests) -> tuple[int, Exception | None]:
    """After a stop's checkpoint: in a Slurm job of a sweep, rank 0 gives the signal to submitit's handler, which
    requeues the job (the requeued job runs the same Hydra job in the same directory, and resumes). Returns the
    code the process exits with, the same on every rank (submitit's -1, else :data:`STOPPED_EXIT_CODE`), and on
    rank 0 the error of a handler that would not requeue (submitit's "timed-out too many times"). Every rank waits
    here until rank 0 has requeued: a rank that left first could end the job (srun --kill-on-bad-exit) before it."""
    import signal

    log.warning("stopped after step %d on SIGUSR2, its checkpoint saved in %s; the same command (same run directory) "
                "continues the run", step, run_dir)
    code, failure = STOPPED_EXIT_CODE, None
    if callable(requests.previous) and distributed.rank() == 0:
        try:
            requests.previous(signal.SIGUSR2, None)  # submitit's: requeue, then sys.exit(-1)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except Exception as error:  # noqa: BLE001 - raised again once every rank is done
            log.error("the job was not requeued: %s", error)
            code, failure = 1, error
    return distributed.from_rank0(code), failure


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


def settle_hardware(cfg: DictConfig, saved_config: Path | None = None, ranks: Ranks = SINGLE):
    """Replace ``auto`` in ``hardware.autocast_dtype`` / ``sampler_dtype`` by what this machine runs fast
    (fgrpo.infra.precision) and in ``hardware.keep_matmul_outputs_gib`` by the budget for that dtype, log the choice
    and its reason, and write the settled config to ``saved_config`` (the run's ``.hydra/config.yaml``) so that
    the run directory says what ran. Before the model loads; returns the :class:`~fgrpo.infra.precision.Precision`.
    Several ranks: rank 0 probes and decides for all (a timed probe could tip differently on another rank)."""
    hw = cfg.hardware
    precision = distributed.from_rank0(distributed.agree(
        lambda: resolve_precision(hw.device, hw.autocast_dtype, hw.sampler_dtype) if ranks.main else None))
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
        distributed.agree(lambda: check_vllm_dtype(hw.sampler_dtype, hw.device))
    if saved_config is not None and saved_config.is_file() and ranks.main:
        OmegaConf.save(cfg, saved_config)
    return precision


def make_tracker(cfg: DictConfig, run_dir: Path, run_name, overrides, precision: Precision,
                 ranks: Ranks = SINGLE, resumed: checkpoint.Resumed | None = None) -> Tracker | NoTracker:
    """Rank 0's tracker. Resumed: the same W&B run, and metrics.jsonl keeps the rows up to the checkpoint's step
    (later ones, logged before the run stopped, move to metrics_superseded.jsonl); a run that starts at step 0 in a
    directory with rows from an attempt that saved no checkpoint supersedes all of them."""
    if not ranks.main:
        return NoTracker()
    return Tracker(
        run_dir, resume_id=resumed.state.wandb_run_id if resumed else None,
        keep_steps_through=resumed.state.step if resumed else -1, backend=cfg.logger.name, project=cfg.logger.get("project", "fgrpo"),
        name=cfg.run_name or run_name, group=cfg.logger.get("group"), mode=cfg.logger.get("mode"),
        entity=cfg.logger.get("entity"), tags=list(cfg.logger.get("tags") or []),
        config={**to_container(cfg), "overrides": list(overrides or []), "precision": precision.as_dict(),
                "world_size": ranks.world},
    )


@dataclass
class StepOutcomes:
    """What a step's metrics are computed from, small enough to gather from every rank each step."""

    correct: torch.Tensor  # [P, G] the verifier's verdicts
    rewards: torch.Tensor  # [P, G] after shaping
    advantages: torch.Tensor  # [P, G] focal-weighted
    lengths: list[int]  # each completion's tokens
    truncated: list[bool]  # each completion stopped by max_new_tokens
    learner_tokens: int  # prompt and completion tokens of the learner's sequences

    @classmethod
    def of(cls, groups: Groups, rewards: torch.Tensor, advantages: torch.Tensor, seqs) -> StepOutcomes:
        completions = [c for group in groups.completions for c in group]
        return cls(groups.correct, rewards, advantages, [len(c.token_ids) for c in completions],
                   [c.truncated for c in completions], sum(len(s.prompt_ids) + len(s.completion_ids) for s in seqs))

    def gathered(self) -> StepOutcomes:
        """The whole run's outcomes: every rank's, in rank order (this rank's own with one process)."""
        parts = distributed.gather_objects(self)
        if len(parts) == 1:
            return self
        return StepOutcomes(*(torch.cat([getattr(p, key) for p in parts]) for key in ("correct", "rewards", "advantages")),
                            sum((p.lengths for p in parts), []), sum((p.truncated for p in parts), []),
                            sum(p.learner_tokens for p in parts))


def step_metrics(outcomes: StepOutcomes, learned: dict[str, float], timings: dict[str, float], gamma: float, lr: float,
                 world_size: int = 1) -> dict:
    """What one step logs: the batch's outcomes and F-GRPO weights (``train/``) and where the time went (``perf/``:
    rank 0's times; token rates of the whole run)."""
    correct, rewards, advantages, lengths = outcomes.correct, outcomes.rewards, outcomes.advantages, outcomes.lengths
    rates, weights = success_rate(correct), focal_weight(correct, gamma)
    learner_tokens = outcomes.learner_tokens
    work = {key: learned.pop(key) for key in ("padding_frac", "computed_tokens", "matmuls_kept_frac")}
    return {
        **{f"train/{key}": value for key, value in learned.items()},
        "train/reward_mean": float(rewards.mean()),
        "train/correct_mean": float(correct.mean()),
        "train/frac_all_correct": float((rates == 1).float().mean()),
        "train/frac_all_wrong": float((rates == 0).float().mean()),
        "train/frac_mixed": float(((rates > 0) & (rates < 1)).float().mean()),
        "train/success_rate_hist": rates.tolist(),
        "train/focal_weight_mean": float(weights.mean()),
        "train/focal_weight_min": float(weights.min()),
        "train/adv_abs_mean": float(advantages.abs().mean()),
        "train/adv_abs_mean_per_group": advantages.abs().mean(dim=1).tolist(),  # in the order of success_rate_hist
        "train/completion_len_mean": float(np.mean(lengths)),
        "train/completion_len_max": float(np.max(lengths)),
        "train/truncated_frac": float(np.mean(outcomes.truncated)),
        "train/lr": lr,
        "train/groups": float(len(correct)),
        "perf/world_size": world_size,
        "perf/sample_time_s": timings["sample"],
        "perf/verify_time_s": timings["verify"],
        "perf/learn_time_s": timings["learn"],
        "perf/sync_time_s": timings["sync"],
        "perf/sampler_tokens_per_s": sum(lengths) / max(timings["sample"], 1e-9),
        "perf/learner_tokens_per_s": learner_tokens / max(timings["learn"], 1e-9),
        "perf/learner_padding_frac": work["padding_frac"],
        # positions the learner ran over (padding out, a shared prompt once): its FLOPs are ~6 x params x this
        "perf/learner_computed_tokens": work["computed_tokens"],
        # share of the layers' token slots whose backward reused kept matmul outputs (no recompute)
        "perf/learner_matmuls_kept_frac": work["matmuls_kept_frac"],
        "perf/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def finish(cfg, run_dir: Path, tracker: Tracker | NoTracker, learner: Learner, tokenizer, curves: dict, before: dict,
           last_eval: dict, ranks: Ranks = SINGLE) -> dict[str, float]:
    """The pass@k plot, the run's summary (final and before-training pass@k) and, if asked, the final weights
    (rank 0 writes; every rank takes part in gathering sharded weights)."""
    final = {k: v for k, v in last_eval.items() if not k.endswith(("_ci_low", "_ci_high"))}
    plot_path = run_dir / "pass_at_k.png"
    title = f"{cfg.model.name} | {cfg.algo.name} gamma={cfg.focal.gamma} | {cfg.dataset.name}"
    if ranks.main:
        plot_pass_at_k(curves, plot_path, title=title)
        tracker.log_image("eval/pass_at_k_curve", plot_path, step=cfg.trainer.steps)
    before = {k: v for k, v in before.items() if k.startswith("eval/pass@") and "_ci_" not in k}
    tracker.summary({**final, **{f"{k}_before": v for k, v in before.items()}})
    if cfg.trainer.save_final:
        learner.save_pretrained(run_dir / "final_model", tokenizer)
    return final


@contextlib.contextmanager
def _timed(timings: dict[str, float], key: str):
    start = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - start


@contextlib.contextmanager
def _profiled(run_dir: Path, step: int | None):
    """trainer.profile_step: that step's update under torch.profiler; the top ops by self time go to
    ``profile_step<N>.txt`` in the run directory (by CUDA time on a GPU)."""
    if step is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    (run_dir / f"profile_step{step}.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=25))
