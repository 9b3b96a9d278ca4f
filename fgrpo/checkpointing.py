"""What a run carries across a stop: whether to resume (:func:`plan_resume`, before the model loads), the evaluations
so far (:class:`EvalHistory`) and the checkpoints themselves (:class:`Checkpoints`: when to save, what, and loading
the newest one back). The files are fgrpo.infra.checkpoint's."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from fgrpo.config import experiment_differences, to_container
from fgrpo.infra import checkpoint, distributed
from fgrpo.infra.distributed import SINGLE, Ranks
from fgrpo.infra.errors import ConfigError
from fgrpo.infra.run_files import CHECKPOINTS, METRICS_FILE, REPLACED_PREFIX

log = logging.getLogger("fgrpo")


@dataclass
class EvalHistory:
    """The run's evaluations so far: what the summary and the final plot need, and what a checkpoint carries."""

    before: dict = field(default_factory=dict)  # the metrics of the evaluation before training
    last: dict = field(default_factory=dict)  # the latest evaluation's metrics
    last_step: int = 0  # the step of that evaluation
    curves: dict = field(default_factory=dict)  # label -> pass@k curve: "before training", "after training"

    def record(self, step: int, metrics: dict, curve, label: str = "after training") -> None:
        self.last, self.last_step, self.curves[label] = metrics, step, curve

    @classmethod
    def of(cls, state: checkpoint.TrainerState) -> EvalHistory:
        return cls(state.before, state.last_eval, state.last_eval_step, state.curves)


class Checkpoints:
    """When to save (every ``trainer.checkpoint_every`` steps, every ``trainer.checkpoint_every_min`` minutes of rank
    0's clock, or at a stop request: one decision for all ranks), the save itself, and the resume."""

    def __init__(self, cfg: DictConfig, run_dir: Path, learner, stream, ranks: Ranks = SINGLE):
        self.cfg, self.run_dir, self.learner, self.stream, self.ranks = cfg, run_dir, learner, stream, ranks
        self.resumed: checkpoint.Resumed | None = None
        self.last_save = time.monotonic()

    def resume(self, sampler) -> checkpoint.Resumed | None:
        """Load the newest readable checkpoint into the learner, the lr schedule and the data stream, and push the
        weights into the sampler; None when there is none."""
        learner = self.learner
        self.resumed = resumed = checkpoint.resume(self.run_dir, learner.policy, learner.optimizer)
        if resumed is not None:
            learner.scheduler.load_state_dict(resumed.state.scheduler)
            self.stream.load_state_dict(resumed.state.stream)
            learner.push_weights(sampler)
            log.info("resumed from %s: step %d done, %d to go", resumed.path, resumed.state.step,
                     max(0, self.cfg.trainer.steps - resumed.state.step))
        return resumed

    def restart_clock(self) -> None:
        self.last_save = time.monotonic()

    def save_if_due(self, step: int, stop_requested: bool, history: EvalHistory, wandb_run_id: str | None) -> bool:
        """Save after ``step`` if it is time or a stop was requested on any rank; returns whether the run stops."""
        every, minutes = self.cfg.trainer.checkpoint_every, self.cfg.trainer.checkpoint_every_min
        # one decision for all ranks: a signal may reach some of them only, and the clock is rank 0's
        stop, timed = distributed.max_over_ranks(
            [float(stop_requested), float(self.ranks.main and minutes > 0 and time.monotonic() - self.last_save >= 60 * minutes)])
        if stop or timed or (every and step % every == 0):
            self.save(step, history, wandb_run_id)
            self.last_save = time.monotonic()
        return bool(stop)

    def save(self, step: int, history: EvalHistory, wandb_run_id: str | None) -> None:
        learner, resumed = self.learner, self.resumed
        state = checkpoint.TrainerState(
            step=step, stream=self.stream.state_dict(), scheduler=learner.scheduler.state_dict(), before=history.before,
            last_eval=history.last, last_eval_step=history.last_step, curves=history.curves,
            config=to_container(self.cfg),
            # a W&B that failed to start this time must not lose the run's id for the attempts after
            wandb_run_id=wandb_run_id or (resumed.state.wandb_run_id if resumed else None), world_size=self.ranks.world)
        start = time.perf_counter()
        path = checkpoint.save_checkpoint(self.run_dir, learner.policy, learner.optimizer, state,
                                          keep=self.cfg.trainer.keep_checkpoints)
        log.info("checkpoint of step %d saved in %.1f s: %s", step, time.perf_counter() - start, path)


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
    if not any(p.name in (CHECKPOINTS, METRICS_FILE) for p in previous):
        return
    aside = run_dir / f"{REPLACED_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for path in previous:
        path.rename(aside / path.name)
    log.warning("trainer.resume=false: the previous run's files in %s moved to %s; starting over", run_dir, aside.name)
