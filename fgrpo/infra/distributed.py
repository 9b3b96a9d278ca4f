"""Several processes, one run (SPMD): each process (rank) runs the same loop on its share of the prompts.

Launch with ``torchrun --nproc_per_node N run.py ...`` or through Slurm (``hydra/launcher=slurm`` with
``hydra.launcher.tasks_per_node=N``): :func:`init_from_env` reads the rank from torchrun's variables, or from
Slurm's through submitit. One process and no launcher: world size 1, no process group, today's path.

The collectives here move a few numbers or small objects (counts, metrics, verdicts); the weights move inside
FSDP2 (fgrpo.learner.learner) and vLLM. On CPU the process group is gloo; on GPU NCCL for CUDA tensors beside gloo for the
CPU ones these helpers send.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fgrpo.infra.errors import ConfigError

log = logging.getLogger("fgrpo")

# a collective that waits longer than this fails instead of hanging (a rank that died, a mismatched call);
# FGRPO_COLLECTIVE_TIMEOUT_S shortens it, e.g. for tests, where a hang must fail soon
DEFAULT_TIMEOUT_S = float(os.environ.get("FGRPO_COLLECTIVE_TIMEOUT_S", 1800))
# How long close() leaves the GIL free for gloo's worker threads before the interpreter may start its exit (see close)
GLOO_DRAIN_S = 0.25
_joined_group = False  # set once this process joins a process group


@dataclass(frozen=True)
class Ranks:
    """Where this process sits: ``rank`` of ``world`` (``local`` on its node). ``tensor_parallel`` consecutive ranks
    share one vLLM engine; the data-parallel groups are ``world // tensor_parallel``."""

    rank: int = 0
    world: int = 1
    local: int = 0
    tensor_parallel: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes metrics, W&B, plots and files."""
        return self.rank == 0

    @property
    def data_parallel_rank(self) -> int:
        return self.rank // self.tensor_parallel

    @property
    def data_parallel_size(self) -> int:
        return self.world // self.tensor_parallel

    def share(self, items: list, *, of_engine: bool = False) -> list:
        """This rank's contiguous share of ``items`` (their count must divide by the world size); with ``of_engine``
        the share of its vLLM engine (the ranks of its tensor-parallel group together)."""
        parts, index = (self.data_parallel_size, self.data_parallel_rank) if of_engine else (self.world, self.rank)
        size = len(items) // parts
        return items[index * size:(index + 1) * size]

    def own_part(self, engine_share: list) -> list:
        """Of what this rank's engine drew (``share(..., of_engine=True)``), the part this rank learns on: the ranks
        of one tensor-parallel group sample together and learn apart."""
        size = len(engine_share) // self.tensor_parallel
        index = self.rank % self.tensor_parallel
        return engine_share[index * size:(index + 1) * size]


SINGLE = Ranks()


def launched_world_size() -> int:
    """Processes this run was launched with (torchrun's WORLD_SIZE, else the tasks of this Slurm job step), before any
    process group exists. Slurm's step, not its job: ``python run.py`` typed in a batch script of 8 tasks is one."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))


def launcher_rendezvous() -> bool:
    """Whether a launcher (torchrun, even with one process) named where the ranks meet: all that ``env://`` reads."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(*, timeout_s: float = DEFAULT_TIMEOUT_S, single_process_group: bool = False) -> Ranks:
    """Join the run's process group (once; later calls return the same ranks). World size 1: no group, unless
    ``single_process_group`` (FSDP2 in one process, ``hardware.fsdp``) asks for a group of one: through the launcher's
    rendezvous under torchrun, else on a free local port of its own (``python run.py``, one Slurm task).

    Under Slurm without torchrun, each task exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from
    Slurm's variables (submitit's TorchDistributedEnvironment) first."""
    if launched_world_size() == 1:
        if single_process_group and not dist.is_initialized():
            # under torchrun (TORCHELASTIC_USE_AGENT_STORE) every store is a client of its agent's: one on a port of
            # our own would wait for a server that never starts (a hang), so join where the launcher says
            where = {} if launcher_rendezvous() else dict(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                                          world_size=1)
            _join("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", timeout_s, **where)
        return SINGLE
    if "RANK" not in os.environ:
        from submitit.helpers import TorchDistributedEnvironment

        # overwrite: Slurm's values are this task's; a stale LOCAL_WORLD_SIZE (vLLM sets one) must not stop it
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            backend = "cpu:gloo,cuda:nccl"
        else:
            backend = "gloo"
        _join(backend, timeout_s)
    return Ranks(rank=dist.get_rank(), world=dist.get_world_size(), local=local)


def _join(backend: str, timeout_s: float, **where) -> None:
    global _joined_group
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **where)
    _joined_group = True


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded learner's tensor (an FSDP2 DTensor) gathered from every rank, a collective; any other as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def sum_over_ranks(values: list[float]) -> list[float]:
    """Each value summed over the ranks (float64, on the CPU); the values as they are with one process."""
    return _all_reduce(values, "SUM")


def max_over_ranks(values: list[float]) -> list[float]:
    return _all_reduce(values, "MAX")


def _all_reduce(values: list[float], op: str) -> list[float]:
    if not active():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    return tensor.tolist()


def gather_objects(obj) -> list:
    """Every rank's ``obj`` in rank order, on every rank (``[obj]`` with one process)."""
    if not active():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def from_rank0(obj):
    """Rank 0's ``obj`` on every rank: one decision (a timed probe, a clock) for the whole run."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(step):
    """``step()`` on every rank, then all ranks learn whether any of them failed, and each raises the first failing
    rank's error (so rank 0 can say why, with the same message and type, and every rank exits). Without this, a rank
    whose check passed would go on alone into a collective that never comes."""
    error = None
    try:
        result = step()
    except Exception as exc:  # noqa: BLE001 - raised again below, on every rank
        error = exc
    if not active():
        if error is not None:
            raise error
        return result
    errors = gather_objects(_portable(error))
    failed = [rank for rank, e in enumerate(errors) if e is not None]
    if failed:
        raise error if failed[0] == dist.get_rank() else errors[failed[0]]
    return result


def _portable(error: BaseException | None) -> BaseException | None:
    """``error`` if it survives pickling as it is, else a RuntimeError with its message."""
    import pickle

    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


def close() -> None:
    """Leave the process group, if one was joined (vLLM's shutdown may have destroyed it already), once every rank
    is done with it, and without the abort that gloo may cause at interpreter exit.

    That abort (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#190489): a gloo worker
    thread drops a finished collective's tensors a moment after the collective completed, and a tensor that Python
    no longer holds needs the GIL to be freed. If the interpreter has begun to exit by then, the thread is killed
    inside a C++ destructor and the process aborts, after all its work was done: torchrun then reports the rank
    failed and Slurm the job. Seen in 3 of 63 launches of tests/children/sharded_update.py on 2 cores (page cache dropped
    before some), 0 of 60 with what follows (AVX512-BF16 machine, bench/RESULTS.md). The sync
    point is an all-reduce on a tensor held here, not ``dist.barrier()``, which also holds the unfinished
    collectives before it; the pause after it, with the GIL released, lets the workers drop what they hold while
    the interpreter is whole. The process group itself stays alive until exit: FSDP's meshes keep it.
    """
    if dist.is_available() and dist.is_initialized():
        held = torch.zeros(1)
        if dist.get_world_size() > 1:
            dist.all_reduce(held)  # every rank is done with the group: none tears its connections down under a peer
        dist.destroy_process_group()
    if _joined_group:  # also when vLLM's shutdown destroyed the group: the workers live on
        time.sleep(GLOO_DRAIN_S)


def check_shared_run_dir(run_dir, ranks: Ranks) -> None:
    """Every rank must see what rank 0 writes in the run directory (checkpoints, and the listing a resume reads): rank
    0 writes a marker there and each rank looks for it. A rank that cannot see it (a node-local path, a directory
    not mounted on its node) stops every rank with one line naming ``hydra.run.dir``, before any model loads."""
    if not active():
        return
    run_dir = Path(run_dir)
    marker = run_dir / from_rank0(f".fgrpo-shared-{uuid.uuid4().hex}" if ranks.main else None)

    def write() -> None:
        if ranks.main:  # a directory rank 0 cannot write (read-only, full) stops every rank too
            run_dir.mkdir(parents=True, exist_ok=True)
            marker.write_text("written by rank 0 to check that every rank sees this directory\n")

    agree(write)

    def look() -> None:
        deadline = time.monotonic() + 10  # a network filesystem may show a new file to other nodes a little later
        while not marker.is_file() and time.monotonic() < deadline:
            time.sleep(0.5)
        if not marker.is_file():
            raise ConfigError(
                f"hydra.run.dir={run_dir}: rank {ranks.rank} (on {socket.gethostname()}) does not see the files rank 0 "
                "writes there; every node needs the run directory on a filesystem they all mount: set "
                "hydra.run.dir (or hydra.sweep.dir) to such a path, e.g. one under your home or project space")

    try:
        agree(look)
    finally:
        dist.barrier()  # every rank has looked before the marker goes
        if ranks.main:
            marker.unlink(missing_ok=True)
