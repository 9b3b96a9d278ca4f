"""Verifiable rewards for a run: which answer check scores a completion, and in which processes.

:func:`make_verifier` turns a config's ``verifier`` kind into the reward function
``(completion, reference_answer) -> 0.0 | 1.0``; the checks themselves are in :mod:`fgrpo.rollout.answers`.

- ``numeric``: :func:`~fgrpo.rollout.answers.verify_numeric`, always in this process (microseconds per call).
- ``math``: :func:`~fgrpo.rollout.answers.verify_math` under a wall-clock timeout; milliseconds per call, so a
  step's answers can be spread over a :class:`VerifierPool` of worker processes (``make_verifier(..., workers=N)``,
  then :func:`verify_batch`).

The pool is pebble's ``ProcessPool``: pebble kills the worker of an answer that overruns its time and replaces a
worker that dies. This module scores those answers 0.0, counts and logs them, and starts a new pebble pool where
pebble gives up on one.
"""

from __future__ import annotations

import contextlib
import functools
import math
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import weakref
from concurrent.futures import Future, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from pebble import ProcessExpired, ProcessPool

from fgrpo.rollout.answers import check_timeout, verify_math, verify_numeric

__all__ = ["VERIFIER_KINDS", "AUTO_WORKERS", "make_verifier", "verify_batch", "close_verifier",
           "auto_verifier_workers", "resolve_workers", "VerifierPool"]

log = logging.getLogger(__name__)

VERIFIER_KINDS = ("numeric", "math")
AUTO_WORKERS = "auto"
MAX_AUTO_WORKERS = 8
"""``auto`` uses at most this many workers (about 65 MB each): at some 50 answers per second per worker, 8 verify a
step's thousand-odd answers in a few seconds, and more would take cores from the sampler."""

STUCK_MARGIN_S = 5.0
"""A worker still on one answer this long after its timeout is stuck (a C call that holds off SIGALRM) and killed.

Generous: on an overloaded machine a worker can stall for seconds (once 7 s, on 2 cores at load 7), and a stuck
worker only holds up its own slot meanwhile."""

MAX_POOL_RESTARTS = 3
"""New pebble pools one batch may start after pebble gives up on one, before the batch fails (the run stops)."""

STARTUP_LIMIT_S = 120.0
"""A batch's first answer must have reached a worker by then: a new worker imports its verifier (math-verify: about
a second alone, more on a busy machine) before it takes answers."""


def make_verifier(kind: str, *, timeout_s: float = 5.0, workers: int | str = 1) -> Callable[[str, str], float]:
    """The reward function ``(completion, reference_answer) -> 0.0 | 1.0`` for a config's ``verifier``.

    ``timeout_s`` bounds each ``math`` call; ``numeric`` needs none (its work is bounded by input
    size). ``workers`` (an int >= 1 or ``"auto"``, :func:`auto_verifier_workers`): with more than
    one, ``math`` answers are verified in a :class:`VerifierPool` of that many processes; 1 verifies
    in this process, serially. ``numeric`` always runs in this process: it takes microseconds, less
    than sending an answer to another process. The returned callable is picklable, and
    :func:`verify_batch` verifies a list of answers with it (in one call to a pool).
    """
    timeout_s = check_timeout(timeout_s)
    workers = resolve_workers(workers)
    if kind == "numeric":
        return verify_numeric
    if kind == "math":
        verify = functools.partial(verify_math, timeout_s=timeout_s)
        return verify if workers == 1 else VerifierPool(verify, workers, timeout_s=timeout_s)
    raise ValueError(f"unknown verifier kind {kind!r}; choose one of {list(VERIFIER_KINDS)}")


def verify_batch(verifier: Callable[[str, str], float], completions: list[str], answers: list[str]) -> list[float]:
    """Each completion's reward against its answer, in order: one call to ``verifier.verify_batch``
    where it has one (a :class:`VerifierPool`), else one call of ``verifier`` per answer."""
    batch = getattr(verifier, "verify_batch", None)
    if batch is not None:
        return batch(completions, answers)
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    return [float(verifier(completion, answer)) for completion, answer in zip(completions, answers)]


def close_verifier(verifier: Callable[[str, str], float]) -> None:
    """Stop a :class:`VerifierPool`'s worker processes (a plain function has none; a pool used again restarts them)."""
    close = getattr(verifier, "close", None)
    if close is not None:
        close()


def auto_verifier_workers() -> int:
    """``workers="auto"``: this process's share of the usable cores less one, at most 8, at least 1.

    One core stays with the trainer (and its sampler's engine process); ranks on one machine
    (``LOCAL_WORLD_SIZE``) split its cores. A 2-core machine gets 1, so verifies in-process.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks_on_machine = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(MAX_AUTO_WORKERS, cores // ranks_on_machine - 1))


def resolve_workers(workers: int | str) -> int:
    """``workers`` as a count: ``"auto"`` resolved by :func:`auto_verifier_workers`, an int >= 1 as it is."""
    if workers == AUTO_WORKERS:
        return auto_verifier_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be {AUTO_WORKERS!r} or an int >= 1 (1 = in this process), got {workers!r}; "
                         "e.g. workers=4")
    return workers


# --- the pool's helpers ----------------------------------------------------------------------


# Ctrl-C and Slurm's stop signals reach every process of the job: the pool's process decides what stops. A worker
# is born with them blocked (:func:`_signals_blocked`) and unblocks them once it ignores them, so that one arriving
# while it starts (importing the main module again, for seconds) cannot end it.
WORKER_SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@contextlib.contextmanager
def _signals_blocked():
    """Block :data:`WORKER_SIGNALS` in this thread meanwhile: the threads and processes started meanwhile inherit the
    mask (pebble starts replacement workers from its own threads); this thread gets what arrived when it ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _prepare_worker(verify_fn: Callable[[str, str], float]) -> None:
    """A worker's initializer, run by pebble before the worker takes answers (pebble's worker ignores SIGINT)."""
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_SIGNALS)
    try:
        verify_fn("0", "0")  # lazy imports (math-verify's) now: pebble's timeout starts when an answer is taken
    except Exception:  # noqa: BLE001 - a verify function that fails here fails on its answers, where it is reported
        pass


class _SpawnContext:
    """multiprocessing's ``spawn`` context for pebble, noting the worker processes pebble starts through it.

    Spawn makes a worker a fresh interpreter rather than a ``fork`` of the trainer, whose torch, CUDA and vLLM threads
    would be copied mid-state. Pebble does not list its workers; the processes noted here give
    :attr:`VerifierPool.pids`, and let a batch wait for the replacement of a worker it lost.
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


def _describe_exit(exit_code: int | None) -> str:
    """A worker's exit code in words: a negative one is the signal that ended it."""
    if exit_code is None:
        return "exit code unknown"
    if exit_code < 0:
        name = signal.Signals(-exit_code).name
        return f"killed by {name}" + (" (out of memory?)" if -exit_code == signal.SIGKILL else "")
    return f"exit code {exit_code}"


def _pebbles_own(error: BaseException) -> bool:
    """Whether pebble raised ``error`` in this process (a timeout, a death), not the verify function in a worker:
    pebble gives the verify function's exceptions the remote ``traceback`` text."""
    return not hasattr(error, "traceback")


# --- the pool --------------------------------------------------------------------------------


class VerifierPool:
    """Verifies answers in ``workers`` processes of a pebble ``ProcessPool``, each calling ``verify_fn(completion,
    answer)`` in its main thread (where :func:`~fgrpo.rollout.answers.verify_math`'s SIGALRM bound holds).

    Each answer is a pebble task with its own timeout, so a death or a kill costs exactly the answer it was on:

    - a worker that dies (segfault, ``os._exit``, killed, out of memory) scores its answer 0.0; pebble replaces it;
      it counts in :attr:`worker_deaths` with a logged warning;
    - a worker still on an answer ``timeout_s + stuck_margin_s`` after taking it (a C call that holds off
      ``verify_fn``'s own SIGALRM timeout) is killed and replaced by pebble, its answer 0.0, counted in
      :attr:`stuck_workers_killed`;
    - pebble gives up on its whole pool when a worker ends while no answer at all is running (one that died while
      starting, between batches): then the batch goes on in a new pebble pool, up to ``MAX_POOL_RESTARTS`` times,
      unless no worker of this pool ever verified an answer (the workers cannot import or run ``verify_fn``:
      RuntimeError).

    Workers are ``spawn`` processes (fresh interpreters with this process's ``sys.path``): they import this module and
    ``verify_fn``'s, and, as multiprocessing's ``spawn`` does, the main module again under the name ``__mp_main__``
    (a script that uses a pool needs an ``if __name__ == "__main__":`` guard). Workers start on first use (about a
    second: math-verify's import) and serve every later batch; :meth:`close`, leaving a ``with`` block, garbage
    collection or interpreter exit ends them, and a worker whose pool's process is gone exits at its next read.
    ``workers=1`` calls ``verify_fn`` in this process. ``verify_fn`` may be any picklable callable. A pickled pool
    carries its settings only: its copy starts workers of its own when used.
    """

    def __init__(self, verify_fn: Callable[[str, str], float], workers: int | str = AUTO_WORKERS, *,
                 timeout_s: float = 5.0, stuck_margin_s: float = STUCK_MARGIN_S):
        self.verify_fn = verify_fn
        self.workers = resolve_workers(workers)
        self.timeout_s = check_timeout(timeout_s)
        self.stuck_margin_s = stuck_margin_s
        self.worker_deaths = 0
        self.stuck_workers_killed = 0
        self._ever_ready = False  # a worker of this pool verified an answer: the setup works, a broken pool is bad luck
        self._pool: ProcessPool | None = None
        self._context: _SpawnContext | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()  # one batch at a time

    def __getstate__(self) -> dict:
        return {"verify_fn": self.verify_fn, "workers": self.workers, "timeout_s": self.timeout_s,
                "stuck_margin_s": self.stuck_margin_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __call__(self, completion: str, answer: str) -> float:
        """One answer's reward (a batch of one)."""
        return self.verify_batch([completion], [answer])[0]

    @property
    def counters(self) -> dict[str, int]:
        """Worker deaths and stuck workers killed so far (each scored the answer it was on 0.0)."""
        return {"worker_deaths": self.worker_deaths, "stuck_workers_killed": self.stuck_workers_killed}

    @property
    def pids(self) -> list[int]:
        """The running workers' process ids (none before the first batch and after :meth:`close`)."""
        return [] if self._context is None else self._context.live_pids()

    def verify_batch(self, completions: list[str], answers: list[str]) -> list[float]:
        """The reward of each completion against its answer, in their order, spread over the workers.

        Raises:
            RuntimeError: ``verify_fn`` raised on an answer (after the batch's other answers finish), or the
                workers could not start.
        """
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        tasks = list(zip(completions, answers))
        if self.workers == 1:
            return [float(self.verify_fn(completion, answer)) for completion, answer in tasks]
        if not tasks:
            return []
        with self._lock:
            try:
                return self._verify_all(tasks)
            except BaseException:
                self._stop()  # workers in an unknown state (an interrupt mid-batch): the next batch starts afresh
                raise

    def start(self) -> None:
        """Start the workers now (say, while the model loads) rather than at the first batch; no wait for them."""
        if self.workers > 1:
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
        pickle.dumps(self.verify_fn)  # an unpicklable verify function fails here, not in pebble's threads
        self._context = _SpawnContext()
        with _signals_blocked():
            self._pool = ProcessPool(self.workers, initializer=_prepare_worker, initargs=(self.verify_fn,),
                                     context=self._context)
            self._pool.schedule(os.getpid)  # pebble starts its threads and workers with the first task: a no-op one
        self._finalizer = weakref.finalize(self, _stop_pool, self._pool, os.getpid())

    def _stop(self) -> None:
        """End the workers now; the next batch starts a new pebble pool."""
        if self._finalizer is not None:
            self._finalizer()  # stops the pool and detaches itself
        self._pool = self._context = self._finalizer = None

    def _verify_all(self, tasks: list[tuple[str, str]]) -> list[float]:
        """Every answer's reward, in a new pebble pool for the answers left when pebble gives up on one."""
        rewards = [0.0] * len(tasks)
        waiting = list(range(len(tasks)))
        restarts = 0
        while True:
            self._start()
            waiting, failure = self._run(tasks, waiting, rewards)
            if failure is not None:
                raise RuntimeError(f"the verify function raised on answer {failure}")
            if not waiting:
                return rewards
            self._stop()
            if not self._ever_ready:
                raise RuntimeError(f"a verifier worker ended before it was ready: importing or warming up "
                                   f"{self.verify_fn!r} failed in a fresh process (its error is above; a script that "
                                   "starts a pool needs an `if __name__ == \"__main__\":` guard), or memory ran out")
            restarts += 1
            if restarts > MAX_POOL_RESTARTS:
                raise RuntimeError(f"verifier workers kept ending while starting: {MAX_POOL_RESTARTS} new pools in a "
                                   "row lost one before any answer reached it (memory short?)")
            log.warning("the verifier pool broke (a worker ended while no answer ran, or the batch ran past its "
                        "deadline); %d answers go to a new pool (%d of %d)", len(waiting), restarts, MAX_POOL_RESTARTS)

    def _run(self, tasks: list[tuple[str, str]], indices: list[int],
             rewards: list[float]) -> tuple[list[int], str | None]:
        """Verify the answers at ``indices`` in the current pebble pool, into ``rewards``.

        Returns the answers left unverified because pebble gave up on the pool or the batch ran past its deadline,
        and the verify function's first error (``"index:\\ntraceback"``), if any.
        """
        futures: dict[int, Future] = {}
        for index in indices:
            try:
                futures[index] = self._pool.schedule(self.verify_fn, tasks[index],
                                                     timeout=self.timeout_s + self.stuck_margin_s)
            except RuntimeError:  # pebble already gave up on this pool
                break
        self._wait(list(futures.values()))
        left, failure, lost = [], None, False
        for index in indices:
            future = futures.get(index)
            error = future.exception() if future is not None and future.done() else BrokenProcessPool()
            if error is None:
                rewards[index], self._ever_ready = float(future.result()), True
            elif isinstance(error, BrokenProcessPool):
                left.append(index)
            elif isinstance(error, ProcessExpired) and _pebbles_own(error):
                self.worker_deaths += 1
                lost = True
                log.warning("verifier worker pid %s died (%s) on answer %d (scored 0.0); replaced (%d worker deaths "
                            "so far)", error.pid, _describe_exit(error.exitcode), index, self.worker_deaths)
            elif isinstance(error, TimeoutError) and _pebbles_own(error):
                self.stuck_workers_killed += 1
                lost = True
                log.warning("verifier worker still on answer %d %.1f s after its %.1f s timeout: killed, the answer "
                            "scored 0.0, replaced (%d stuck workers so far)", index, self.stuck_margin_s,
                            self.timeout_s, self.stuck_workers_killed)
            else:  # raised by verify_fn in a worker, which therefore got going
                self._ever_ready = True
                failure = failure or f"{index}:\n{getattr(error, 'traceback', repr(error))}"
        if lost:
            self._await_replacements()
        return left, failure

    def _wait(self, futures: list[Future]) -> None:
        """Until every future is done, pebble gives up on the pool, or the batch's deadline passes (then some may
        never be done). The deadline: the start-up limit plus every answer's timeout and margin, run one worker after
        another; only a pool whose workers block each other gets there (pebble's workers share one lock on their
        channel, and one killed while it holds it blocks the rest without pebble noticing).

        Raises:
            RuntimeError: no answer reached a worker within ``STARTUP_LIMIT_S``: the workers hang while starting.
        """
        started, reached = time.monotonic(), False
        rounds = math.ceil(len(futures) / self.workers)
        deadline = started + STARTUP_LIMIT_S + rounds * (self.timeout_s + self.stuck_margin_s)
        pending = set(futures)
        while pending and self._pool.active:
            _, pending = wait(pending, timeout=0.25)  # and look again whether pebble gave up
            reached = reached or any(future.running() or future.done() for future in futures)
            if not reached and time.monotonic() - started > STARTUP_LIMIT_S:
                raise RuntimeError(f"no verifier worker was ready {STARTUP_LIMIT_S:.0f} s after the batch came "
                                   "(importing the verify function hangs, or the machine is overloaded)")
            if pending and time.monotonic() > deadline:
                log.warning("%d verifier answers still open %.0f s after the batch came: the pool is stuck; they go "
                            "to a new one", len(pending), time.monotonic() - started)
                return

    def _await_replacements(self, limit_s: float = 5.0) -> None:
        """Let pebble start the replacements of the workers this batch lost (it looks every 0.1 s), so that the batch
        ends with the pool at full strength."""
        deadline = time.monotonic() + limit_s
        while len(self.pids) < self.workers and self._pool.active and time.monotonic() < deadline:
            time.sleep(0.01)
