"""What a worker process of the reward pool does to itself before it takes tasks, and how its end reads: Ctrl-C and
Slurm's stop signals left to the trainer, the functions imported, a memory cap, and an exit code that says why it
ended (:func:`describe_exit`).

A worker's memory cap (``dataset.reward_memory_gib``) is an address-space limit (``RLIMIT_AS``) over what the worker
had mapped once its imports were done: an allocation past it raises ``MemoryError`` in the call, and the worker then
ends at once (:data:`OVER_MEMORY_EXIT`) so that its memory goes back and a fresh worker replaces it; the trainer is
never the process the kernel's OOM killer picks for a leaking reward. A function that calls ``os._exit(0)`` ends its
worker with :data:`EXITED_ZERO` instead (pebble reads an exit code of 0 as a worker that ended by plan, and would wait
for the task until its time limit).
"""

from __future__ import annotations

import os
import random
import resource
import signal
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["WORKER_SIGNALS", "WorkerSetup", "prepare_worker", "describe_exit", "end_if_over_memory",
           "OVER_MEMORY_EXIT", "EXITED_ZERO"]

# Ctrl-C and Slurm's stop signals reach every process of the job: the pool's process decides what stops. A worker
# is born with them blocked (the pool blocks them while it starts workers) and unblocks them once it ignores them,
# so that one arriving while it starts (importing the main module again, for seconds) cannot end it.
WORKER_SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)

OVER_MEMORY_EXIT = 87  # a call allocated past the worker's memory cap
EXITED_ZERO = 86  # the function called os._exit(0)

_capped = {"gib": None}


@dataclass(frozen=True)
class WorkerSetup:
    """A worker's start: ``warm_up()`` (imports, before any task's time starts), ``seed`` for ``random`` (the run's
    and rank's; calls are seeded again each, :mod:`fgrpo.rewards.calls`), ``memory_gib`` the cap (None: none)."""

    warm_up: Callable[[], Any] | None = None
    seed: int | None = None
    memory_gib: float | None = None


def prepare_worker(setup: WorkerSetup | None) -> None:
    """A worker's initializer, run by pebble before the worker takes tasks (pebble's worker ignores SIGINT)."""
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_SIGNALS)
    _report_exit_zero()
    if setup is None:
        return
    if setup.seed is not None:
        random.seed(setup.seed)
    if setup.warm_up is not None:
        try:
            setup.warm_up()  # lazy imports (math-verify's, a user's module): pebble's time limit starts at a task
        except Exception:  # noqa: BLE001 - a function that fails here fails on its tasks, where it is reported
            pass
    if setup.memory_gib is not None:
        _cap_memory(setup.memory_gib)


def _report_exit_zero() -> None:
    real_exit = os._exit

    def _exit(code: int = 0) -> None:
        real_exit(code if code else EXITED_ZERO)

    os._exit = _exit


def _mapped_bytes() -> int:
    """This process's mapped address space (VmSize), in bytes; 0 where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cap_memory(gib: float) -> None:
    """Limit the address space to what is mapped now plus ``gib``."""
    limit = _mapped_bytes() + int(gib * 2 ** 30)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    _capped["gib"] = gib


def end_if_over_memory(error: BaseException | None) -> None:
    """In a capped worker, a ``MemoryError`` ends the worker now (:data:`OVER_MEMORY_EXIT`): its memory goes back and
    pebble replaces it."""
    if isinstance(error, MemoryError) and _capped["gib"] is not None:
        os._exit(OVER_MEMORY_EXIT)


def describe_exit(exit_code: int | None, memory_gib: float | None = None) -> str:
    """A worker's exit code in words: a negative one is the signal that ended it."""
    if exit_code is None:
        return "exit code unknown"
    if exit_code == OVER_MEMORY_EXIT:
        cap = f" of {memory_gib:g} GiB" if memory_gib is not None else ""
        return f"allocated past its memory cap{cap} (dataset.reward_memory_gib)"
    if exit_code == EXITED_ZERO:
        return "ended by the function (os._exit(0))"
    if exit_code < 0:
        name = signal.Signals(-exit_code).name
        return f"killed by {name}" + (" (out of memory?)" if -exit_code == signal.SIGKILL else "")
    return f"exit code {exit_code}"
