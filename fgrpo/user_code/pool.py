"""A pool of worker processes that runs one call per task, each with its own time limit: pebble's ``ProcessPool``, which
kills the worker of a task that overruns its time and replaces a worker that dies. This module gives such a task a
:class:`Fault` instead of a result, counts and logs it, and starts a new pebble pool where pebble gives up on one.

The reward functions run here (:mod:`fgrpo.rewards.scoring`): a user's always, even with one worker, so that their
crash, hang or leak cannot stop the trainer; the built-in ``math`` check where ``dataset.reward_workers`` > 1.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import pickle
import signal
import threading
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable

from pebble import ProcessExpired, ProcessPool

from fgrpo.user_code.time_limit import check_timeout
from fgrpo.user_code.worker import WORKER_SIGNALS, WorkerSetup, describe_exit, prepare_worker

__all__ = ["AUTO_WORKERS", "Fault", "WorkerPool", "StartupTimeout", "auto_workers", "resolve_workers"]

log = logging.getLogger(__name__)

AUTO_WORKERS = "auto"
MAX_AUTO_WORKERS = 8
"""``auto`` uses at most this many workers (about 65 MB each): at some 50 answers per second per worker, 8 verify a
step's thousand-odd answers in a few seconds, and more would take cores from the sampler."""

STUCK_MARGIN_S = 5.0
"""A worker still on one task this long after its time limit is stuck (a C call that holds off SIGALRM) and killed.

Generous: on an overloaded machine a worker can stall for seconds (once 7 s, on 2 cores at load 7), and a stuck
worker only holds up its own slot meanwhile."""

MAX_POOL_RESTARTS = 3
"""New pebble pools one batch may start after pebble gives up on one, before the batch fails (the run stops)."""

STARTUP_LIMIT_S = 120.0
"""A batch's first task must have reached a worker by then (the default of ``startup_limit_s``,
``dataset.reward_import_timeout_s``): a new worker imports the task's function (math-verify: about a second alone,
more on a busy machine) before it takes tasks."""


class StartupTimeout(RuntimeError):
    """No worker was ready within the start-up limit: importing the functions hangs or takes longer."""


@dataclass(frozen=True)
class Fault:
    """What a task got instead of a result: its worker ``died`` (segfault, ``os._exit``, killed, out of memory) or was
    ``stuck`` past the task's time limit and killed."""

    kind: str  # died | stuck
    detail: str  # in words: the exit code or signal, or the time limit


def auto_workers() -> int:
    """``workers="auto"``: this process's share of the usable cores less one, at most 8, at least 1.

    One core stays with the trainer (and its sampler's engine process); ranks on one machine
    (``LOCAL_WORLD_SIZE``) split its cores. A 2-core machine gets 1.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks_on_machine = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(MAX_AUTO_WORKERS, cores // ranks_on_machine - 1))


def resolve_workers(workers: int | str) -> int:
    """``workers`` as a count: ``"auto"`` resolved by :func:`auto_workers`, an int >= 1 as it is."""
    if workers == AUTO_WORKERS:
        return auto_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be {AUTO_WORKERS!r} or an int >= 1, got {workers!r}; e.g. workers=4")
    return workers


# --- the pool's helpers ----------------------------------------------------------------------


@contextlib.contextmanager
def _signals_blocked():
    """Block :data:`WORKER_SIGNALS` in this thread meanwhile: the threads and processes started meanwhile inherit the
    mask (pebble starts replacement workers from its own threads); this thread gets what arrived when it ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _SpawnContext:
    """multiprocessing's ``spawn`` context for pebble, noting the worker processes pebble starts through it.

    Spawn makes a worker a fresh interpreter rather than a ``fork`` of the trainer, whose torch, CUDA and vLLM threads
    would be copied mid-state. Pebble does not list its workers; the processes noted here give
    :attr:`WorkerPool.pids`, and let a batch wait for the replacement of a worker it lost.
    """

    def __init__(self) -> None:
        self._spawn = multiprocessing.get_context("spawn")
        self._processes: list = []
        self._lock = threading.Lock()  # pebble starts replacements from its own thread

    def Process(self, *args, **kwargs):  # noqa: N802 - the name pebble calls, as on a multiprocessing context
        process = self._spawn.Process(*args, **kwargs)
        with self._lock:
            self._processes.append(process)
        return process

    def __getattr__(self, name: str):
        return getattr(self._spawn, name)  # Pipe, RLock, get_start_method: spawn's own

    def live_pids(self) -> list[int]:
        """The process ids of the started workers that still run; ended ones are forgotten."""
        with self._lock:
            self._processes = [p for p in self._processes if p.pid is None or p.is_alive()]
            return [p.pid for p in self._processes if p.pid is not None]


def _stop_pool(pool: ProcessPool, owner_pid: int) -> None:
    """Stop a pebble pool's workers and threads, from the process that started them only (a fork leaves them be)."""
    if os.getpid() == owner_pid:
        pool.stop()
        pool.join()


def _pebbles_own(error: BaseException) -> bool:
    """Whether pebble raised ``error`` in this process (a timeout, a death), not the function in a worker:
    pebble gives the function's exceptions the remote ``traceback`` text."""
    return not hasattr(error, "traceback")


# --- the pool --------------------------------------------------------------------------------


class WorkerPool:
    """Runs ``fn(*task)`` for a batch of tasks in ``workers`` processes of a pebble ``ProcessPool``, each call in a
    worker's main thread (where a SIGALRM time limit holds: :mod:`fgrpo.user_code.time_limit`).

    Each task is a pebble task with its own time limit, so a death or a kill costs exactly the task it was on:

    - a worker that dies (segfault, ``os._exit``, killed, out of memory) gives its task a :class:`Fault` ``died``;
      pebble replaces it; it counts in :attr:`worker_deaths` with a logged warning;
    - a worker still on a task ``stuck_margin_s`` after the task's time limit (a C call that holds off the call's own
      SIGALRM bound) is killed and replaced by pebble, its task a :class:`Fault` ``stuck``, counted in
      :attr:`stuck_workers_killed`;
    - pebble gives up on its whole pool when a worker ends while no task at all is running (one that died while
      starting, between batches): then the batch goes on in a new pebble pool, up to ``MAX_POOL_RESTARTS`` times,
      unless no worker of this pool ever finished a task (the workers cannot import or run ``fn``: RuntimeError).

    ``fn`` raising in a worker fails the batch (RuntimeError, after its other tasks finish): a function whose errors
    are a result (a user's reward function) catches them itself (:func:`fgrpo.rewards.calls.run_call`).

    Workers are ``spawn`` processes (fresh interpreters with this process's ``sys.path``): they import ``fn``'s module
    and, as multiprocessing's ``spawn`` does, the main module again under the name ``__mp_main__`` (a script that uses
    a pool needs an ``if __name__ == "__main__":`` guard). They start on first use, run ``warm_up()`` (imports, before
    any task's time starts) and serve every later batch; :meth:`close`, leaving a ``with`` block, garbage collection or
    interpreter exit ends them, and a worker whose pool's process is gone exits at its next read. With ``workers=1``
    and ``in_process_alone=True`` the calls run in this process (the math check: a process is not worth it). ``fn``
    and ``warm_up`` may be any picklable callables. A pickled pool carries its settings only.
    """

    def __init__(self, fn: Callable[..., Any], workers: int | str = AUTO_WORKERS, *, timeout_s: float = 5.0,
                 stuck_margin_s: float = STUCK_MARGIN_S, warm_up: Callable[[], Any] | None = None,
                 in_process_alone: bool = False, seed: int | None = None, memory_gib: float | None = None,
                 max_calls: int = 0, startup_limit_s: float = STARTUP_LIMIT_S):
        self.fn = fn
        self.workers = resolve_workers(workers)
        self.timeout_s = check_timeout(timeout_s)
        self.stuck_margin_s = stuck_margin_s
        self.warm_up = warm_up
        self.in_process_alone = in_process_alone
        self.seed, self.memory_gib, self.max_calls = seed, memory_gib, max_calls
        self.startup_limit_s = startup_limit_s
        self.worker_deaths = 0
        self.stuck_workers_killed = 0
        self._ever_ready = False  # a worker of this pool finished a task: the setup works, a broken pool is bad luck
        self._pool: ProcessPool | None = None
        self._context: _SpawnContext | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()  # one batch at a time

    def __getstate__(self) -> dict:
        return {"fn": self.fn, "workers": self.workers, "timeout_s": self.timeout_s,
                "stuck_margin_s": self.stuck_margin_s, "warm_up": self.warm_up,
                "in_process_alone": self.in_process_alone, "seed": self.seed, "memory_gib": self.memory_gib,
                "max_calls": self.max_calls, "startup_limit_s": self.startup_limit_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def in_process(self) -> bool:
        """Whether the calls run in this process (one worker, and ``in_process_alone``)."""
        return self.workers == 1 and self.in_process_alone

    @property
    def counters(self) -> dict[str, int]:
        """Worker deaths and stuck workers killed so far (each cost the task it was on)."""
        return {"worker_deaths": self.worker_deaths, "stuck_workers_killed": self.stuck_workers_killed}

    @property
    def pids(self) -> list[int]:
        """The running workers' process ids (none before the first batch and after :meth:`close`)."""
        return [] if self._context is None else self._context.live_pids()

    def run(self, tasks: list[tuple], timeouts: list[float] | None = None,
            on_result: Callable[[int, Any], bool] | None = None) -> list[Any]:
        """``fn(*task)`` of each task, in their order, spread over the workers; a :class:`Fault` for a task whose worker
        died or was stuck. ``timeouts``: each task's time limit (default ``timeout_s``; a task that bounds itself,
        as the math check, is killed only ``stuck_margin_s`` after it). ``on_result(index, result)``: called as each
        task ends, in the order they end; True stops the batch (its workers are ended; the tasks not done are None).

        Raises:
            RuntimeError: ``fn`` raised on a task (after the batch's other tasks finish), or the workers could not
                start (:class:`StartupTimeout`: not within ``startup_limit_s``).
        """
        timeouts = [self.timeout_s] * len(tasks) if timeouts is None else list(timeouts)
        if len(timeouts) != len(tasks):
            raise ValueError(f"{len(timeouts)} time limits for {len(tasks)} tasks")
        if self.in_process:
            results = []
            for index, task in enumerate(tasks):
                results.append(self.fn(*task))
                if on_result is not None and on_result(index, results[-1]):
                    return results + [None] * (len(tasks) - len(results))
            return results
        if not tasks:
            return []
        with self._lock:
            try:
                return self._run_all(list(tasks), timeouts, on_result)
            except BaseException:
                self._stop()  # workers in an unknown state (an interrupt mid-batch): the next batch starts afresh
                raise

    def serve(self, requests: list) -> list[Future]:
        """Long-lived tasks, ``fn(request)`` each on a worker of its own until it returns (an environment's episode
        hosts: fgrpo.environments.hosts), without a time limit: the caller bounds each exchange with them and cancels a
        stuck one (pebble then kills its worker and starts another; :meth:`count_lost` counts it)."""
        if len(requests) > self.workers:
            raise ValueError(f"{len(requests)} long-lived tasks for {self.workers} workers")
        with self._lock:
            if self._pool is not None and not self._pool.active:
                self._stop()
            self._start()
            return [self._pool.schedule(self.fn, (request,)) for request in requests]

    def count_lost(self, kind: str) -> None:
        """A worker of a long-lived task lost: ``died`` (it ended) or ``stuck`` (killed past its time limit)."""
        if kind == "died":
            self.worker_deaths += 1
        else:
            self.stuck_workers_killed += 1

    def start(self) -> None:
        """Start the workers now (say, while the model loads) rather than at the first batch; no wait for them."""
        if not self.in_process:
            with self._lock:
                if self._pool is not None and not self._pool.active:
                    self._stop()  # pebble gave up on it (a worker ended between batches): a new one
                self._start()

    def close(self) -> None:
        """End the workers (a later batch starts new ones)."""
        with self._lock:
            self._stop()

    # --- internals ---

    def _start(self) -> None:
        """A pebble pool unless one is there (lazily: a pool that is never used starts none)."""
        if self._pool is not None:
            return
        pickle.dumps((self.fn, self.warm_up))  # an unpicklable function fails here, not in pebble's threads
        self._context = _SpawnContext()
        with _signals_blocked():
            setup = WorkerSetup(self.warm_up, self.seed, self.memory_gib)
            self._pool = ProcessPool(self.workers, max_tasks=self.max_calls, initializer=prepare_worker,
                                     initargs=(setup,), context=self._context)
            self._pool.schedule(os.getpid)  # pebble starts its threads and workers with the first task: a no-op one
        self._finalizer = weakref.finalize(self, _stop_pool, self._pool, os.getpid())

    def _stop(self) -> None:
        """End the workers now; the next batch starts a new pebble pool."""
        if self._finalizer is not None:
            self._finalizer()  # stops the pool and detaches itself
        self._pool = self._context = self._finalizer = None

    def _run_all(self, tasks: list[tuple], timeouts: list[float],
                 on_result: Callable[[int, Any], bool] | None) -> list[Any]:
        """Every task's result, in a new pebble pool for the tasks left when pebble gives up on one."""
        results: list[Any] = [None] * len(tasks)
        waiting = list(range(len(tasks)))
        restarts = 0
        while True:
            self._start()
            waiting, failure, stopped = self._run(tasks, timeouts, waiting, results, on_result)
            if failure is not None:
                raise RuntimeError(f"{self.fn!r} raised on task {failure}")
            if stopped:
                self._stop()  # its workers may be on tasks nobody waits for: the next batch starts afresh
                return results
            if not waiting:
                return results
            self._stop()
            if not self._ever_ready:
                raise RuntimeError(f"a worker ended before it was ready: importing or warming up {self.fn!r} failed "
                                   "in a fresh process (its error is above; a script that starts a pool needs an "
                                   "`if __name__ == \"__main__\":` guard), or memory ran out")
            restarts += 1
            if restarts > MAX_POOL_RESTARTS:
                raise RuntimeError(f"workers kept ending while starting: {MAX_POOL_RESTARTS} new pools in a row lost "
                                   "one before any task reached it (memory short?)")
            log.warning("the worker pool broke (a worker ended while no task ran, or the batch ran past its "
                        "deadline); %d tasks go to a new pool (%d of %d)", len(waiting), restarts, MAX_POOL_RESTARTS)

    def _run(self, tasks: list[tuple], timeouts: list[float], indices: list[int], results: list[Any],
             on_result: Callable[[int, Any], bool] | None) -> tuple[list[int], str | None, bool]:
        """Run the tasks at ``indices`` in the current pebble pool, into ``results``, each handed to ``on_result`` as
        it ends.

        Returns the tasks left undone because pebble gave up on the pool or the batch ran past its deadline, ``fn``'s
        first error (``"index:\\ntraceback"``), if any, and whether ``on_result`` stopped the batch.
        """
        futures: dict[Future, int] = {}
        for index in indices:
            try:
                future = self._pool.schedule(self.fn, tasks[index], timeout=timeouts[index] + self.stuck_margin_s)
            except RuntimeError:  # pebble already gave up on this pool
                break
            futures[future] = index
        state = {"failure": None, "lost": False, "stopped": False}
        placed: set[int] = set()

        def take(future: Future) -> None:
            index = futures[future]
            if self._take(future, index, timeouts[index], results, state):
                placed.add(index)
                if on_result is not None and not state["stopped"]:
                    state["stopped"] = bool(on_result(index, results[index]))

        self._wait(list(futures), max(timeouts[i] for i in indices), take, lambda: state["stopped"])
        left = [index for index in indices if index not in placed] if not state["stopped"] else []
        if state["lost"] and not state["stopped"]:
            self._await_replacements()
        return left, state["failure"], state["stopped"]

    def _take(self, future: Future, index: int, timeout_s: float, results: list[Any], state: dict) -> bool:
        """A done task's result into ``results`` (a :class:`Fault` for a death or a kill); False where pebble gave
        up on the pool (the task is left for a new one) or ``fn`` raised (noted in ``state``)."""
        error = future.exception()
        if error is None:
            results[index], self._ever_ready = future.result(), True
            return True
        if isinstance(error, BrokenProcessPool):
            return False
        if isinstance(error, ProcessExpired) and _pebbles_own(error):
            self.worker_deaths += 1
            state["lost"] = True
            results[index] = Fault("died", describe_exit(error.exitcode, self.memory_gib))
            log.warning("worker pid %s died (%s) on task %d (it counts as failed); replaced (%d worker deaths so far)",
                        error.pid, results[index].detail, index, self.worker_deaths)
            return True
        if isinstance(error, TimeoutError) and _pebbles_own(error):
            self.stuck_workers_killed += 1
            state["lost"] = True
            results[index] = Fault("stuck", f"still running {self.stuck_margin_s:.1f} s after its {timeout_s:.1f} s "
                                            "time limit")
            log.warning("worker still on task %d %s: killed, the task counts as failed, replaced (%d stuck workers so "
                        "far)", index, results[index].detail, self.stuck_workers_killed)
            return True
        self._ever_ready = True  # raised by fn in a worker, which therefore got going
        state["failure"] = state["failure"] or f"{index}:\n{getattr(error, 'traceback', repr(error))}"
        return False

    def _wait(self, futures: list[Future], longest_s: float, take: Callable[[Future], None],
              stop: Callable[[], bool]) -> None:
        """Hand each future to ``take`` as it is done, until all are, ``stop()`` says so, pebble gives up on the pool,
        or the batch's deadline passes. The deadline: the start-up limit plus the longest
        time limit and margin per task, run one worker after another; only a pool whose workers block each other
        gets there (pebble's workers share one lock on their channel, and one killed while it holds it blocks the rest
        without pebble noticing).

        Raises:
            StartupTimeout: no task reached a worker within ``startup_limit_s``: the workers hang while starting.
        """
        started, reached = time.monotonic(), False
        rounds = math.ceil(len(futures) / self.workers)
        deadline = started + self.startup_limit_s + rounds * (longest_s + self.stuck_margin_s)
        pending, done = set(futures), set()
        place = {future: index for index, future in enumerate(futures)}  # hand over in the tasks' order
        while pending and not stop():
            finished, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            for future in sorted(finished, key=place.__getitem__):
                done.add(future)
                take(future)
            if not self._pool.active:  # pebble gave up: what it finished is taken, the rest goes to a new pool
                break
            reached = reached or bool(done) or any(future.running() for future in futures)
            if not reached and time.monotonic() - started > self.startup_limit_s:
                raise StartupTimeout(f"no worker was ready {self.startup_limit_s:.0f} s after the batch came "
                                     "(importing the function hangs or takes longer, or the machine is overloaded)")
            if pending and time.monotonic() > deadline:
                log.warning("%d tasks still open %.0f s after the batch came: the pool is stuck; they go to a new one",
                            len(pending), time.monotonic() - started)
                break

    def _await_replacements(self, limit_s: float = 5.0) -> None:
        """Let pebble start the replacements of the workers this batch lost (it looks every 0.1 s), so that the batch
        ends with the pool at full strength."""
        deadline = time.monotonic() + limit_s
        while len(self.pids) < self.workers and self._pool.active and time.monotonic() < deadline:
            time.sleep(0.01)
