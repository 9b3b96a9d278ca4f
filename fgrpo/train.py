"""The RLVR training loop, top to bottom in :func:`train`: sample groups -> verify -> F-GRPO advantages ->
learner update -> push weights into the sampler -> log. Evaluation (unbiased pass@k on held-out problems) runs
before the first step (unless ``eval.before=false``), every ``eval.every`` steps and after the last.

Everything that can fail on bad input (config ranges, data files, the model source, a missing vLLM) is checked in
fgrpo.prepare, before the model loads; checkpoints and resume are fgrpo.checkpointing's, stop signals
fgrpo.infra.stop's, and what a step logs fgrpo.step_metrics'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from fgrpo.algorithm.advantage_methods import compute_advantages, method_label
from fgrpo.checkpointing import Checkpoints, EvalHistory, plan_resume
from fgrpo.evaluation.held_out import append_counts, evaluate
from fgrpo.evaluation.plots import plot_pass_at_k
from fgrpo.evaluation.rare_set import score as rare_set_score
from fgrpo.evaluation.transcripts import TABLE_COLUMNS, TRANSCRIPTS_KEY, table_rows, write_transcripts
from fgrpo.infra import distributed
from fgrpo.infra.checkpoint import Resumed, restore_rng
from fgrpo.infra.determinism import naming_nondeterministic_ops
from fgrpo.infra.distributed import SINGLE, Ranks
from fgrpo.infra.run_files import COUNTS_FILE, FINAL_MODEL, PASS_AT_K_PLOT, supersede_rows_after
from fgrpo.infra.stop import STOP_MARGIN_S, StopSignals
from fgrpo.infra.tracking import NoTracker, Tracker
from fgrpo.learner.learner import Learner
from fgrpo.prepare import (EVAL_SEED_OFFSET, Run, advantage_settings, learner_settings, loss_settings, make_sampler,
                           make_tracker, prepare)
from fgrpo.validation import advantage_method_of
from fgrpo.rollout.episodes import draw_groups, episode_metrics
from fgrpo.rollout.rollouts import (ProblemStream, collect_groups, learner_sequences, overlong_penalties,
                                    reward_call_metrics)
from fgrpo.step_metrics import StepOutcomes, step_metrics

log = logging.getLogger("fgrpo")


def train(
    cfg: DictConfig, run_dir: Path, *, run_name: str | None = None, overrides: list[str] | None = None,
    saved_config: Path | None = None,
) -> dict[str, float]:
    """Run one experiment; returns the final evaluation metrics. Writes everything into ``run_dir``.

    ``overrides`` (the command line's) go into the W&B config beside the composed config. ``saved_config``:
    the run's saved config file (Hydra's ``.hydra/config.yaml``), rewritten with the settled precision.
    """
    ranks = distributed.init_from_env(single_process_group=cfg.hardware.fsdp)  # several processes (torchrun, Slurm tasks): each its share of the prompts
    distributed.check_shared_run_dir(run_dir, ranks)  # before anything is loaded: a node must see rank 0's files
    run = prepare(cfg, ranks, saved_config=saved_config)
    with contextlib.closing(run.scorer):  # the reward workers end with the run, however it ends
        return train_prepared(cfg, run, run_dir, ranks, run_name=run_name, overrides=overrides)


def train_prepared(cfg: DictConfig, run: Run, run_dir: Path, ranks: Ranks, *, run_name: str | None = None,
                   overrides: list[str] | None = None) -> dict[str, float]:
    """:func:`train` after :func:`~fgrpo.prepare.prepare`: the model, the sampler, the steps and evaluations."""
    from tqdm.auto import tqdm

    # before the model loads (a refusal is cheap); rank 0's answer, so that every rank takes the same path
    resuming = distributed.from_rank0(distributed.agree(lambda: plan_resume(cfg, run_dir, ranks)))
    ranks = dataclasses.replace(ranks, tensor_parallel=cfg.sampler.tensor_parallel_size)
    learner = Learner(run.folder, learner_settings(cfg), loss_settings(cfg.algo), pad_id=run.tokenizer.pad_token_id,
                      generates=cfg.sampler.name == "hf")
    sampler = make_sampler(cfg, run.folder, learner.policy, run.tokenizer, ranks)
    with _sampler_closed_on_error(sampler):
        stream = ProblemStream(run.data.train, seed=cfg.seed)
        checkpoints = Checkpoints(cfg, run_dir, learner, stream, ranks)
        resumed = checkpoints.resume(sampler) if resuming else None

        tables: list[tuple[int, list]] = []  # an environment's transcripts, for the tracker once it logs the step

        def evaluate_now(step: int) -> tuple[dict, object]:
            metrics, curve = evaluate_policy(cfg, step, run, sampler, learner, run_dir, ranks)
            if TRANSCRIPTS_KEY in metrics:
                tables.append((step, metrics.pop(TRANSCRIPTS_KEY)))
            return metrics, curve

        def log_tables(tracker) -> None:
            while tables:
                at, rows = tables.pop(0)
                tracker.log_table("eval/transcripts", TABLE_COLUMNS, rows, step=at)

        stopped_at = None
        with make_tracker(cfg, run_dir, run_name, overrides, run.precision, ranks, resumed) as tracker, \
                StopSignals(cfg.hardware.slurm_signal_delay_s - STOP_MARGIN_S) as signals, naming_nondeterministic_ops():
            history, first_step = start_history(cfg, run_dir, resumed, evaluate_now, tracker, ranks)
            log_tables(tracker)
            checkpoints.restart_clock()
            progress = tqdm(range(first_step, cfg.trainer.steps + 1), desc="training", unit="step", dynamic_ncols=True,
                            disable=not ranks.main, initial=first_step - 1, total=cfg.trainer.steps)
            for step in progress:
                signals.raise_if_interrupted(step)
                metrics = learn_step(cfg, step, run, sampler, learner, stream, run_dir, ranks)
                tracker.log(metrics, step=step)
                progress.set_postfix(reward=f"{metrics.get('train/correct_mean', float('nan')):.3f}")
                if step == cfg.trainer.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                    history.record(step, *evaluate_now(step))
                    tracker.log(history.last, step=step)
                    log_tables(tracker)
                    if ranks.main:
                        progress.write(f"step {step}: eval pass@1 = {history.last['eval/pass@1']:.3f}")
                if checkpoints.save_if_due(step, signals.stop_requested, history, tracker.wandb_run_id):
                    stopped_at = step
                    break
            if stopped_at is None:
                final = finish(cfg, run_dir, tracker, learner, run.tokenizer, history, ranks)
    if stopped_at is not None:
        exit_code, failure = signals.hand_over(stopped_at, run_dir)
    sampler.close()  # vLLM's shutdown takes the process group down with it: last
    distributed.close()
    if stopped_at is not None:
        if failure is not None:  # submitit's "not requeued" error: raised, so that submitit records the reason
            raise failure
        raise SystemExit(exit_code)
    return final


def learn_step(cfg: DictConfig, step: int, run: Run, sampler, learner: Learner, stream: ProblemStream, run_dir: Path,
               ranks: Ranks = SINGLE) -> dict:
    """One training step: sample and verify groups, F-GRPO advantages, the learner's update, the weight push into the
    sampler; returns the step's metrics."""
    algo, sampling = cfg.algo, cfg.sampler
    step_start = time.perf_counter()

    # TRL's trainer_state for the reward functions: this step, and the epochs of training problems it reaches
    run.scorer.at_step(step, cfg.trainer.steps, step * cfg.trainer.prompts_per_step / max(1, len(run.data.train)))

    def draw(problems, seeds):
        return draw_groups(sampler, problems, run.prompt_ids, run.scorer, run.environment, group_size=algo.group_size,
                           max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                           top_p=sampling.top_p, seed=seeds, ranks=ranks)

    groups = collect_groups(draw, stream, cfg.trainer.prompts_per_step, seed=cfg.seed * 100_003 + step,
                            dynamic_sampling=algo.dynamic_sampling, max_rounds=algo.max_sampling_rounds, ranks=ranks)
    timings = {"sample": time.perf_counter() - step_start - groups.verify_time_s, "verify": groups.verify_time_s}
    # an engine's ranks (tensor parallel) scored the same draw: its failed calls count once, its dropped prompts per rank
    errors_here = groups.reward_errors if ranks.rank % ranks.tensor_parallel == 0 else 0
    skipped, errors = distributed.sum_over_ranks([groups.skipped_prompts, errors_here])
    metrics = {"train/skipped_prompts": skipped, "train/reward_errors": errors,
               **reward_call_metrics(groups, "train", ranks, run.scorer.pool_counters)}
    if run.environment is not None:
        metrics.update(episode_metrics(groups, "train"))
    if distributed.sum_over_ranks([len(groups)])[0]:  # every rank updates, with groups of its own or none
        rewards = groups.rewards.clone()  # the weighted sum of the reward functions (fgrpo.rewards)
        if algo.overlong_shaping:
            # an episode's length against its budget (its truncated ones are those cut there)
            longest = run.environment.max_tokens if run.environment is not None else sampling.max_new_tokens
            rewards += overlong_penalties(groups, longest, algo.overlong_buffer, algo.overlong_penalty)
        # F-GRPO (advantage=focal): mu_hat = the group's success rate (Eq. 11, from the verdicts), g = (1 - mu_hat)^gamma
        # (Eq. 12), A^F = g * A with A the group-normalised advantage (Eqs. 3, 13); gamma = 0: the baseline.
        # The other methods (advantage=maxrl, ...): fgrpo.algorithm.advantage_methods
        settings = advantage_settings(cfg)
        # a method declared needs_step (mean_focal) reads every rank's verdicts: all ranks gather, groups or none
        step_correct = (torch.cat([c for c in distributed.gather_objects(groups.correct) if c.numel()])
                        if advantage_method_of(settings.method).needs_step else None)
        advantages = compute_advantages(rewards, groups.correct, settings, groups.mean_logprobs(),
                                        step_correct) if len(groups) else rewards
        seqs = learner_sequences(groups, advantages, run.prompt_ids)
        sampler.release_memory()  # on CPU, vLLM's KV cache and packed weights: dead until the push below
        profiled_step = step if step == cfg.trainer.profile_step and ranks.main else None
        with _timed(timings, "learn"), _profiled(run_dir, profiled_step):
            learned = learner.update(seqs)
        with _timed(timings, "sync"):
            learner.push_weights(sampler)
        outcomes = StepOutcomes.of(groups, rewards, advantages, seqs).gathered()
        metrics.update(step_metrics(outcomes, learned, timings, cfg.focal.gamma, learner.lr, ranks.world))
    else:
        log.warning("step %d: no group to learn from (dynamic sampling found no mixed one, or the reward functions "
                    "skipped every prompt); skipping the update", step)
    metrics["perf/step_time_s"] = time.perf_counter() - step_start
    return metrics


def evaluate_policy(cfg: DictConfig, step: int, run: Run, sampler, learner: Learner, run_dir: Path,
                    ranks: Ranks = SINGLE) -> tuple[dict, object]:
    """pass@k metrics and curve of the policy after ``step``; its per-problem counts go to eval_counts.jsonl."""
    sampling = cfg.sampler
    run.scorer.at_step(step, cfg.trainer.steps, step * cfg.trainer.prompts_per_step / max(1, len(run.data.train)))
    transcripts = {} if run.environment is not None else None  # an environment's: a few episodes to read
    metrics, curve, count_rows = evaluate(
        sampler, run.data.eval, run.prompt_ids, run.scorer, n_samples=cfg.eval.n_samples,
        max_problems=cfg.eval.max_problems, max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature, top_p=sampling.top_p, seed=cfg.seed + EVAL_SEED_OFFSET, ranks=ranks,
        environment=run.environment, transcripts=transcripts)
    if ranks.main:
        append_counts(run_dir, step, count_rows)
        if transcripts:
            rows = write_transcripts(run_dir, step, transcripts)
            metrics[TRANSCRIPTS_KEY] = table_rows(rows)  # the tracker's table (popped before the metrics are logged)
    if run.rare_set is not None:  # the paper's Delta NLL_rare: is what the base model found rarely forgotten?
        rare = rare_set_score(learner.policy, run.rare_set, pad_id=run.tokenizer.pad_token_id)
        metrics.update({f"eval/{key}": value for key, value in rare.items()})
    return metrics, curve


def start_history(cfg: DictConfig, run_dir: Path, resumed: Resumed | None, evaluate_now, tracker: Tracker | NoTracker,
                  ranks: Ranks = SINGLE) -> tuple[EvalHistory, int]:
    """The evaluations before the first step of this attempt, and that step: a new run evaluates the model before
    training (``eval.before``); a resumed one takes its checkpoint's history and random states."""
    if ranks.main:  # counts of steps after the checkpoint (or of an attempt that saved none) are redone
        supersede_rows_after(run_dir / COUNTS_FILE, resumed.state.step if resumed else -1)
    if resumed is None:
        history = EvalHistory()
        if cfg.eval.before:
            history.record(0, *evaluate_now(0), label="before training")
            tracker.log(history.last, step=0)
        history.before = history.last
        return history, 1
    state = resumed.state
    history = EvalHistory.of(state)
    if state.step + 1 > cfg.trainer.steps and history.last_step != state.step:
        # nothing left to train (trainer.steps lowered to the checkpoint's): the final numbers are its own
        history.record(state.step, *evaluate_now(state.step))
        tracker.log(history.last, step=state.step)
    restore_rng(resumed.rng)  # last: nothing between the save and the next step draws
    return history, state.step + 1


def finish(cfg: DictConfig, run_dir: Path, tracker: Tracker | NoTracker, learner: Learner, tokenizer,
           history: EvalHistory, ranks: Ranks = SINGLE) -> dict[str, float]:
    """The pass@k plot, the run's summary (final and before-training pass@k) and, if asked, the final weights
    (rank 0 writes; every rank takes part in gathering sharded weights)."""
    final = {k: v for k, v in history.last.items() if not k.endswith(("_ci_low", "_ci_high"))}
    plot_path = run_dir / PASS_AT_K_PLOT
    settings = advantage_settings(cfg)
    title = f"{cfg.model.name} | {cfg.algo.name} {method_label(settings.method, settings.params)} | {cfg.dataset.name}"
    if ranks.main:
        plot_pass_at_k(history.curves, plot_path, title=title)
        tracker.log_image("eval/pass_at_k_curve", plot_path, step=cfg.trainer.steps)
    before = {k: v for k, v in history.before.items() if k.startswith("eval/pass@") and "_ci_" not in k}
    tracker.summary({**final, **{f"{k}_before": v for k, v in before.items()}})
    if cfg.trainer.save_final:
        learner.save_pretrained(run_dir / FINAL_MODEL, tokenizer)
    return final


@contextlib.contextmanager
def _sampler_closed_on_error(sampler):
    """A run that fails (a reward function stopping it, a crash) shuts vLLM's engine down before the error leaves:
    left to its finalizer at interpreter exit, the engine would find the process group already gone and print a
    traceback after the run's one error."""
    try:
        yield
    except BaseException:
        sampler.close()
        raise


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
