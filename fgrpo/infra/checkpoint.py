"""Checkpoints: a run that stops (a crash, ``kill -9``, a Slurm time limit or preemption) continues from its last
checkpoint exactly, by running the same command with the same run directory.

Under the run directory::

    checkpoints/
      step_0000010/              one complete checkpoint, renamed into place only once every file is written
        weights/                 torch.distributed.checkpoint: the policy and AdamW's moments, a file per rank
        trainer.pt               rank 0's: the step, the data cursor, the lr schedule, the evaluations so far, the
                                 W&B run id and the experiment's config
        rng/rank_0.pt ...        each rank's random states (Python, NumPy, torch, CUDA)
      .step_0000020.partial/     a save under way, or cut short by a kill: never loaded, removed by the next save
      latest                     the name of the newest complete checkpoint, replaced (atomically) last

The same code serves one process (DCP writes one file) and N ranks (each writes its shards); a checkpoint saved by
N ranks loads on M (DCP reshards on load). The sampling seeds of a step derive from the run's seed and the step
(fgrpo.rollout.rollouts), so with the data cursor and the random states they make the continued run draw what the
uninterrupted one would: bitwise with the HF sampler. vLLM on CPU draws from its engine's own generator, which is
not saved: a resumed run continues the same experiment, not the same draws.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from fgrpo.infra import distributed
from fgrpo.infra.run_files import CHECKPOINTS, write_text_atomic
from fgrpo.infra.errors import CheckpointError

log = logging.getLogger("fgrpo")

LATEST = "latest"
TRAINER_FILE = "trainer.pt"
WEIGHTS = "weights"
RNG = "rng"



@dataclass
class TrainerState:
    """What rank 0 saves beside the weights: everything else the loop needs to go on from ``step``."""

    step: int  # the last step whose update is in the weights
    stream: dict  # fgrpo.rollout.rollouts.ProblemStream.state_dict(): epoch and cursor of the data order
    scheduler: dict  # the lr schedule's state (its warm-up position)
    before: dict = field(default_factory=dict)  # the evaluation before training (the summary reports it)
    last_eval: dict = field(default_factory=dict)  # the latest evaluation's metrics
    last_eval_step: int = 0  # the step of that evaluation
    curves: dict = field(default_factory=dict)  # the pass@k curves so far, for the final plot
    wandb_run_id: str | None = None  # the resumed run logs to the same W&B run
    config: dict = field(default_factory=dict)  # the experiment's config: a resume must not change the experiment
    world_size: int = 1  # of the run that saved it (it may load on another)


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def read_step(path: Path) -> int:
    """The step of checkpoint folder ``path`` (from its name)."""
    return int(Path(path).name.removeprefix("step_"))


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def _is_complete(path: Path) -> bool:
    # DCP writes .metadata last, after every rank's data file
    return (path / TRAINER_FILE).is_file() and (path / WEIGHTS / ".metadata").is_file()


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (partial saves are not among them)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and _is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def resume_candidates(run_dir: Path) -> list[Path]:
    """The checkpoints to try, in order: the one ``latest`` names, then the older complete ones, newest first (a
    ``latest`` that names a missing or partial checkpoint is passed over with a warning). Empty when the run has
    none. Raises :class:`CheckpointError` when checkpoints were written but none is complete."""
    root = checkpoints_dir(run_dir)
    pointer = root / LATEST
    complete = complete_checkpoints(run_dir)[::-1]
    named = root / pointer.read_text().strip() if pointer.is_file() else None
    if named is None or named in complete:
        start = complete.index(named) if named is not None else 0
        return complete[start:]
    if not complete:
        raise CheckpointError(
            f"{pointer} names {named.name}, which is incomplete or missing, and no other checkpoint in {root} is "
            f"complete: nothing to resume from. Start over with trainer.resume=false (the run's files are moved "
            f"aside) or in another run directory")
    older = [p for p in complete if p.name < named.name] or complete
    log.warning("checkpoint %s is incomplete or missing; trying %s", named, older[0].name)
    return older


# ---- random states ----------------------------------------------------------------------------------------------

def capture_rng() -> dict:
    """This process's random states: Python's, NumPy's, torch's CPU generator and each CUDA device's."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device: a resume may see another count of GPUs
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- saving -----------------------------------------------------------------------------------------------------

def save_checkpoint(run_dir: Path, policy, optimizer, state: TrainerState, *, keep: int) -> Path:
    """Write checkpoint ``state.step`` (every rank calls this: the sharded weights are written by all), make it
    ``latest``, and keep the newest ``keep``. Atomic: the files go to ``.step_N.partial`` and are renamed into
    place once all ranks are done; a kill before that leaves the previous checkpoint current. A full disk raises
    :class:`CheckpointError` on every rank, with the previous checkpoint kept and the partial one removed."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = checkpoints_dir(run_dir)
    final = root / step_name(state.step)
    partial = root / f".{step_name(state.step)}.partial"
    ranks_main = distributed.rank() == 0

    def prepare():
        if ranks_main:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".step_*.partial"):  # a save a kill cut short
                shutil.rmtree(stale, ignore_errors=True)
            (partial / RNG).mkdir(parents=True)

    def write():
        model_state, optimizer_state = get_state_dict(policy, optimizer, options=_trained_only())
        model_state = _without_frozen(policy, model_state)
        _dcp("save", {"model": model_state, "optimizer": optimizer_state}, partial / WEIGHTS)
        _save_synced(capture_rng(), partial / RNG / f"rank_{distributed.rank()}.pt")
        if ranks_main:
            _save_synced(asdict(state), partial / TRAINER_FILE)

    def publish():
        if ranks_main:
            _sync_directory(partial / RNG)
            _sync_directory(partial)
            if final.exists():  # a checkpoint of this step from an attempt that went on past it: superseded
                shutil.rmtree(final)
            os.replace(partial, final)
            _sync_directory(root)
            write_text_atomic(root / LATEST, final.name)
            _sync_directory(root)
            # later steps than this one are an abandoned attempt's (a resume fell back past them): they go first,
            # or pruning by step would keep them and delete this one
            kept = [p for p in complete_checkpoints(run_dir) if read_step(p) <= state.step]
            for stale in [p for p in complete_checkpoints(run_dir) if read_step(p) > state.step] + kept[:-keep]:
                shutil.rmtree(stale, ignore_errors=True)

    try:
        distributed.agree(prepare)
        distributed.agree(write)
        distributed.agree(publish)
    except Exception as error:  # on every rank (distributed.agree raises the first failing rank's error everywhere)
        message = _save_failure(root, state.step, error)  # before the partial files go: they fill the disk
        if ranks_main:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(message) from error
    return final


def _save_failure(root: Path, step: int, error: BaseException) -> str:
    causes = [error]
    while len(causes) < 10 and (causes[-1].__cause__ or causes[-1].__context__) is not None:
        causes.append(causes[-1].__cause__ or causes[-1].__context__)
    existing = next(p for p in (root, *root.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    full = free < 2**20 or any(
        getattr(c, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(c) for c in causes)
    kept = complete_checkpoints(root.parent)
    where = f"the previous one ({kept[-1].name}) is kept and a re-run resumes from it" if kept else "there is no earlier one"
    if full:
        return (f"checkpoint of step {step}: the disk under {root} is full ({free / 2**20:.1f} MiB free); {where}. Free "
                f"space, lower trainer.keep_checkpoints, or checkpoint less often (trainer.checkpoint_every)")
    return f"checkpoint of step {step} could not be written to {root} ({type(error).__name__}: {error}); {where}"


def _dcp(operation: str, state: dict, path: Path) -> None:
    """dcp.save / dcp.load of ``state`` at ``path``, with DCP's failure (a BaseException: it would slip past every
    ``except Exception``, distributed.agree's too, and leave the other ranks waiting) turned into a RuntimeError
    that names each failing rank's error."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    call = dcp.save if operation == "save" else dcp.load
    try:
        with warnings.catch_warnings():  # one process without a group is a case DCP handles, not one to warn of
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            call(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except CheckpointException as error:
        reasons = "; ".join(f"rank {rank}: {_last_line(failure)}" for rank, failure in error.failures.items())
        raise RuntimeError(f"torch.distributed.checkpoint {operation} of {path} failed: {reasons}") from None


def _last_line(failure) -> str:
    error = failure[0] if isinstance(failure, tuple) and failure else failure  # (exception, its frames)
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1]}" if lines else type(error).__name__


def _save_synced(obj, path: Path) -> None:
    """torch.save, then fsync: a node that dies after the rename must not leave an empty file in a checkpoint."""
    with open(path, "wb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())


def _sync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ---- loading ----------------------------------------------------------------------------------------------------

def read_trainer_state(path: Path) -> TrainerState:
    return TrainerState(**torch.load(Path(path) / TRAINER_FILE, weights_only=False))


def newest_readable(run_dir: Path) -> tuple[Path, TrainerState] | None:
    """The first of :func:`resume_candidates` whose trainer state reads (one that does not is passed over with a
    warning); None when the run has no checkpoint. Raises :class:`CheckpointError` if none reads."""
    candidates = resume_candidates(run_dir)
    failures = []
    for path in candidates:
        try:
            return path, read_trainer_state(path)
        except Exception as error:  # noqa: BLE001 - a truncated or garbled trainer.pt: the one before may do
            failures.append(f"{path.name}: {type(error).__name__}: {error}")
            log.warning("checkpoint %s: its %s does not read (%s); trying an older one", path, TRAINER_FILE, error)
    if failures:
        raise CheckpointError(f"no checkpoint in {checkpoints_dir(run_dir)} has a readable {TRAINER_FILE}:\n  "
                              + "\n  ".join(failures) + "\nStart over with trainer.resume=false (the run's files "
                              "are moved aside)")
    return None


@dataclass
class Resumed:
    path: Path
    state: TrainerState
    rng: dict  # this rank's random states at the save: restore_rng() them just before the next step


def _trained_only(strict: bool = True):
    """The weights a checkpoint holds: those that train (all of them, or LoRA's adapters alone: the frozen base comes
    from the model's folder again, as it did at the start; fgrpo.learner.lora)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def _without_frozen(policy, model_state: dict) -> dict:
    """``model_state`` less the frozen weights that torch's ``ignore_frozen_params`` keeps under a second name (a tied
    LM head is the frozen embedding: 113 MB for SmolLM2)."""
    frozen = {name for name, param in policy.named_parameters(remove_duplicate=False) if not param.requires_grad}
    return {name: value for name, value in model_state.items() if name not in frozen}


def load_checkpoint(path: Path, policy, optimizer=None) -> Resumed:
    """Load checkpoint ``path`` into ``policy`` (and ``optimizer``), sharded or not, whatever the world size that
    saved it. Every rank calls this. The random states returned are this rank's (rank 0's when the saving run had
    fewer ranks)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    state = read_trainer_state(path)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        model_state = _without_frozen(policy, get_model_state_dict(policy, options=_trained_only()))
        _dcp("load", {"model": model_state}, path / WEIGHTS)
        set_model_state_dict(policy, model_state, options=_trained_only(strict=False))
    else:
        model_state, optimizer_state = get_state_dict(policy, optimizer, options=_trained_only())
        loaded = {"model": _without_frozen(policy, model_state), "optimizer": optimizer_state}
        _dcp("load", loaded, path / WEIGHTS)
        set_state_dict(policy, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"],
                       options=_trained_only(strict=False))
    rng_file = path / RNG / f"rank_{distributed.rank()}.pt"
    return Resumed(path, state, torch.load(rng_file if rng_file.is_file() else path / RNG / "rank_0.pt",
                                           weights_only=False))


def resume(run_dir: Path, policy, optimizer) -> Resumed | None:
    """Load the newest readable checkpoint of ``run_dir`` (every rank calls this); None when there is none. One
    that fails to load (a corrupt file) is passed over with a warning for the one before it; if none loads,
    :class:`CheckpointError`."""
    # rank 0's list: ranks that saw the file system differently must still try the same checkpoints in order
    candidates = distributed.from_rank0(distributed.agree(lambda: resume_candidates(run_dir)))
    failures = []
    for path in candidates:
        try:
            return distributed.agree(lambda: load_checkpoint(path, policy, optimizer))
        except Exception as error:  # noqa: BLE001 - the next older one may load
            failures.append(f"{path.name}: {type(error).__name__}: {error}")
            log.warning("checkpoint %s could not be loaded (%s: %s); trying an older one", path, type(error).__name__,
                        error)
    if failures:
        raise CheckpointError(f"no checkpoint in {checkpoints_dir(run_dir)} could be loaded:\n  " + "\n  ".join(failures)
                              + "\nStart over with trainer.resume=false (the run's files are moved aside)")
    return None
