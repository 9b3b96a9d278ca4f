"""Verifiable rewards: 1.0 when a completion's final answer matches the reference answer, else 0.0.

Two verifiers, picked by :func:`make_verifier`:

- ``numeric``: pure Python, microseconds per call. The final answer is the last ``\\boxed{...}``
  or else the last number; it is compared to the reference as an exact rational number, so
  ``"7.0"`` equals ``"7"`` and ``"1,234"`` equals ``"1234"``. For arithmetic and GSM8K-style answers.
- ``math``: math-verify (sympy) for LaTeX answers (fractions, radicals, intervals, tuples),
  bounded by a wall-clock timeout; milliseconds per call, so a step's answers can be spread over
  a :class:`VerifierPool` of worker processes (``make_verifier(..., workers=N)``, then
  :func:`verify_batch`).

Completions are untrusted model output: both verifiers look at only the last
``SCAN_CHARS`` characters, use regexes that cannot backtrack catastrophically, and return 0.0
instead of raising.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import math
import json
import multiprocessing.connection
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from fractions import Fraction
from multiprocessing.connection import Connection
from typing import Callable

__all__ = ["SCAN_CHARS", "VERIFIER_KINDS", "AUTO_WORKERS", "extract_answer", "verify_numeric", "verify_math",
           "make_verifier", "verify_batch", "close_verifier", "auto_verifier_workers", "resolve_workers",
           "VerifierPool"]

log = logging.getLogger(__name__)

SCAN_CHARS = 20_000
"""Only this many trailing characters of a completion are searched for its final answer.

Bounds the work on pathological input; the final answer of a real completion is at its end.
"""

# "\boxed{" (also "\boxed {"); the match ends just after the opening brace.
_BOXED_OPEN = re.compile(r"\\boxed\s*\{")
# A number that does not start inside a word or another number: "-3", "12", "1,234", "0.5".
# The thousands branch needs whole groups of 3 digits ("1,2345" is "1" and "2345"). Every
# repetition is followed by a fixed separator, so a failed attempt costs at most one run of digits.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# What Fraction() may read: no exponents, so "1e999999999" cannot cost a huge power of ten.
_PLAIN_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?(?:/\d+)?")
_LATEX_FRACTION = re.compile(r"(-?)\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}")
# LaTeX spacing commands that models put inside numbers ("1\,234").
_LATEX_SPACING = re.compile(r"\\[,;:! ]")
_MAX_NUMBER_CHARS = 100
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def _last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance, found in one linear pass."""
    content_starts = [match.end() for match in _BOXED_OPEN.finditer(text)]
    if not content_starts:
        return None
    # Match every brace once with a stack; an unmatched "{" simply has no entry.
    close_of_open: dict[int, int] = {}
    open_positions: list[int] = []
    for brace in re.finditer(r"[{}]", text[content_starts[0] - 1 :]):
        position = brace.start() + content_starts[0] - 1
        if brace.group() == "{":
            open_positions.append(position)
        elif open_positions:
            close_of_open[open_positions.pop()] = position
    for start in reversed(content_starts):
        close = close_of_open.get(start - 1)
        if close is not None:
            return text[start:close]
    return None


def _last_number(text: str) -> str | None:
    """The last number in ``text`` with thousands commas removed, or None."""
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return None if last is None else last.group().replace(",", "")


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: the last balanced ``\\boxed{...}``, else the last number.

    A boxed answer wins over numbers written after it, since models often restate or check the
    answer after boxing it. The boxed content is returned as written (stripped); a bare number is
    returned with thousands commas removed ("1,234" -> "1234"). Only the last ``SCAN_CHARS``
    characters are searched. None when there is neither.
    """
    if not isinstance(text, str):
        return None
    tail = text[-SCAN_CHARS:]
    boxed = _last_boxed_content(tail)
    if boxed is not None:
        return boxed.strip()
    return _last_number(tail)


def _parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number if it is one whole number ("7", "-3.50", "1,234", "1/2", "\\frac{1}{2}")."""
    cleaned = _LATEX_SPACING.sub("", text).strip().strip("$").strip()
    if len(cleaned) > _MAX_NUMBER_CHARS:
        return None
    if _THOUSANDS.fullmatch(cleaned):
        cleaned = cleaned.replace(",", "")
    try:
        if _PLAIN_NUMBER.fullmatch(cleaned):
            return Fraction(cleaned)
        fraction = _LATEX_FRACTION.fullmatch(cleaned)
        if fraction:
            sign = -1 if fraction.group(1) else 1
            return sign * Fraction(int(fraction.group(2)), int(fraction.group(3)))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _to_number(text: str) -> Fraction | None:
    """``text`` as a number, or else the last number inside it ("12 \\text{cm}" -> 12)."""
    number = _parse_number(text)
    if number is not None:
        return number
    last = _last_number(text)
    return None if last is None else _parse_number(last)


def verify_numeric(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals the reference as a number, else 0.0.

    Exact rational comparison ("7" == "7.0", "1/2" == "0.5"), no tolerance. A boxed answer that
    is not a plain number counts by the last number inside it ("\\boxed{x = 7}" -> 7). Never
    raises; a reference that holds no number gives 0.0 for every completion.
    """
    try:
        if not isinstance(completion, str) or not isinstance(answer, str):
            return 0.0
        reference = _to_number(answer[-SCAN_CHARS:])
        extracted = extract_answer(completion)
        if reference is None or extracted is None:
            return 0.0
        return 1.0 if _to_number(extracted) == reference else 0.0
    except Exception:
        return 0.0


# --- math-verify, under a timeout ------------------------------------------------------------


class _VerifyTimeout(BaseException):
    """Raised into a running verification when its time is up.

    A BaseException so that the ``except Exception`` blocks inside math-verify and sympy let it
    through instead of swallowing it and carrying on unbounded.
    """


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its own timeout is off; here :func:`verify_math` bounds time."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@functools.cache
def _math_verify_functions():
    """Import math-verify (sympy, antlr: about a second) on first use, not with this module."""
    from math_verify import parse, verify

    for logger_name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(logger_name).addFilter(_DropTimeoutDisabledWarning())
    return parse, verify


def _parse_reference(answer: str) -> list:
    """Parse a reference answer; bare LaTeX ("2\\sqrt{3}") only parses whole between ``$...$``."""
    parse, _ = _math_verify_functions()
    if _UNESCAPED_DOLLAR.search(answer) or "\\boxed" in answer:
        candidates = [answer]
    else:
        candidates = [f"${answer}$", f"\\boxed{{{answer}}}", answer]
    for candidate in candidates:
        parsed = parse(candidate, parsing_timeout=None)
        if parsed:
            return parsed
    return []


def _math_verify_match(completion: str, answer: str) -> bool:
    """math-verify's verdict with its own (SIGALRM, whole-second) timeouts off; the caller bounds time."""
    parse, verify = _math_verify_functions()
    reference = _parse_reference(answer)
    if not reference:
        return False
    predicted = parse(completion, parsing_timeout=None)
    if not predicted:
        return False
    return bool(verify(reference, predicted, timeout_seconds=None))


def _run_with_alarm(fn: Callable[[], bool], timeout_s: float) -> bool:
    """Run ``fn`` in the main thread, interrupted by SIGALRM after ``timeout_s`` seconds.

    Saves and restores any SIGALRM handler and interval timer already set (a timer due during
    the call fires late, right after it).
    """

    def on_alarm(signum, frame):
        raise _VerifyTimeout()

    started = time.monotonic()
    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_handler is None else previous_handler)
        if previous_delay > 0:
            remaining = previous_delay - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-6), previous_interval)


def _set_async_exception(thread_id: int, exception: type[BaseException] | None) -> None:
    """Schedule ``exception`` in another thread (None cancels a pending one). CPython only."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), None if exception is None else ctypes.py_object(exception)
    )


def _run_with_watchdog(fn: Callable[[], bool], timeout_s: float) -> bool:
    """Run ``fn`` in this (non-main) thread, interrupted by a watchdog thread after ``timeout_s``.

    Signals only reach the main thread, so the watchdog raises :class:`_VerifyTimeout` in this
    thread through CPython's asynchronous-exception API instead. A lock makes sure the exception
    is either raised while ``fn`` runs, or cancelled before this function returns. It lands
    between bytecodes only: a C call that holds the GIL (a huge integer power) blocks the
    watchdog itself until the call ends.
    """
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"finished": False, "fired": False}

    def interrupt() -> None:
        with lock:
            if not state["finished"]:
                state["fired"] = True
                _set_async_exception(thread_id, _VerifyTimeout)

    watchdog = threading.Timer(timeout_s, interrupt)
    watchdog.daemon = True
    watchdog.start()
    try:
        return fn()
    finally:
        with lock:
            state["finished"] = True
            if state["fired"]:
                _set_async_exception(thread_id, None)
        watchdog.cancel()


def _check_timeout(timeout_s) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}; e.g. timeout_s=5.0")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}; e.g. timeout_s=5.0")
    return float(timeout_s)


def verify_math(completion: str, answer: str, timeout_s: float = 5.0) -> float:
    """1.0 if math-verify finds the completion's answer equivalent to the reference, else 0.0.

    The reference is parsed as LaTeX (wrapped in ``$...$`` when it has no delimiters), the
    completion's last ``SCAN_CHARS`` characters with math-verify's default extraction (boxed
    answers first). Parsing plus comparison get ``timeout_s`` seconds of wall clock in all;
    time up, any exception, or nothing to compare gives 0.0.

    The bound is a SIGALRM timer in the main thread: it also stops CPython's big-integer power
    loop, which checks for signals (``\\boxed{10^{10^{10^{10}}}}`` returns after ``timeout_s``).
    Signals only reach the main thread, so in other threads a watchdog thread raises an
    asynchronous exception instead: that stops Python-level work (sympy's simplification,
    factorials) but not a single C call that holds the GIL, such as that power, which then runs
    until it ends or memory runs out. For a hard bound, call this from the main thread of this
    process or of worker processes (``make_verifier`` returns a picklable callable).

    Raises:
        ValueError: ``timeout_s`` is not a positive finite number (an argument error, not a
            verdict on the completion).
    """
    timeout_s = _check_timeout(timeout_s)
    if not isinstance(completion, str) or not isinstance(answer, str):
        return 0.0
    completion_tail = completion[-SCAN_CHARS:]
    answer_tail = answer[-SCAN_CHARS:]
    _math_verify_functions()  # the first call's import (about a second) is not the answer's time
    in_main_thread = threading.current_thread() is threading.main_thread()
    run = _run_with_alarm if in_main_thread and hasattr(signal, "setitimer") else _run_with_watchdog
    try:
        matched = run(lambda: _math_verify_match(completion_tail, answer_tail), timeout_s)
    except (Exception, _VerifyTimeout):
        return 0.0
    return 1.0 if matched else 0.0


VERIFIER_KINDS = ("numeric", "math")


def make_verifier(kind: str, *, timeout_s: float = 5.0, workers: int | str = 1) -> Callable[[str, str], float]:
    """The reward function ``(completion, reference_answer) -> 0.0 | 1.0`` for a config's ``verifier``.

    ``timeout_s`` bounds each ``math`` call; ``numeric`` needs none (its work is bounded by input
    size). ``workers`` (an int >= 1 or ``"auto"``, :func:`auto_verifier_workers`): with more than
    one, ``math`` answers are verified in a :class:`VerifierPool` of that many processes; 1 verifies
    in this process, serially. ``numeric`` always runs in this process: it takes microseconds, less
    than sending an answer to another process. The returned callable is picklable, and
    :func:`verify_batch` verifies a list of answers with it (in one call to a pool).
    """
    timeout_s = _check_timeout(timeout_s)
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


# --- a pool of verifier processes ------------------------------------------------------------

AUTO_WORKERS = "auto"
MAX_AUTO_WORKERS = 8
"""``auto`` uses at most this many workers (about 65 MB each): at some 50 answers per second per worker, 8 verify a
step's thousand-odd answers in a few seconds, and more would take cores from the sampler."""

STUCK_MARGIN_S = 5.0
"""A worker still on one answer this long after its timeout is stuck (a C call that holds off SIGALRM) and killed.

Generous: on an overloaded machine a worker can stall for seconds (once 7 s, on 2 cores at load 7), and a stuck
worker only holds up its own slot meanwhile."""

MAX_FAILED_STARTS = 3
"""Replacement workers that may die in a row before one gets ready, before the pool gives up (the run stops)."""

STARTUP_LIMIT_S = 120.0
"""A new worker must have imported its verifier (math-verify: about a second alone, more on a busy machine) by then."""

# A worker is a fresh interpreter with the pool's sys.path, serving the socket whose fd it is given.
_WORKER_BOOTSTRAP = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
                     "from fgrpo.rollout.verifier import _worker_main; _worker_main(int(sys.argv[2]))")


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


def _worker_main(fd: int) -> None:
    """A worker process's entry: receive the pickled verify function, then serve answers until told to stop."""
    connection = Connection(fd)
    # Ctrl-C and Slurm's stop signals reach every process of the job: the pool's process decides what stops
    for signum in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    try:
        verify_fn = pickle.loads(connection.recv_bytes())
    except (EOFError, OSError):
        return
    _serve(connection, verify_fn)


def _serve(connection: Connection, verify_fn: Callable[[str, str], float]) -> None:
    """Verify each ``(completion, answer)`` received, in this process's main thread (where :func:`verify_math`'s
    SIGALRM bound holds), and reply ``("ok", reward)`` or ``("error", traceback)``. Stops at ``None`` or when the
    pool's end of the socket closes (the pool's process is gone)."""
    try:
        verify_fn("0", "0")  # lazy imports (math-verify's) now, not within the first answer's timeout
    except Exception:  # noqa: BLE001 - a verify function that fails here fails on its answers, where it is reported
        pass
    connection.send(("ready", None))
    while True:
        try:
            task = connection.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            reply = ("ok", float(verify_fn(*task)))
        except Exception:  # noqa: BLE001 - sent to the pool's process, which raises it
            reply = ("error", traceback.format_exc(limit=8))
        connection.send(reply)


@dataclass
class _Worker:
    """One worker process, the pool's end of its socket, and what it is doing."""

    process: subprocess.Popen
    connection: Connection
    ready: bool = False  # imported and warmed up
    task: int | None = None  # the index of the answer it is verifying
    deadline: float = math.inf  # monotonic time: stuck after it (busy), or failed to start (not ready)


def _end_worker(worker: _Worker) -> None:
    """Kill ``worker`` if it still runs, reap it and close its socket."""
    if worker.process.poll() is None:
        worker.process.kill()
    try:
        worker.process.wait(10)
    except subprocess.TimeoutExpired:  # unkillable for now (uninterruptible I/O): the OS reaps it later
        pass
    worker.connection.close()


def _end_workers(workers: list[_Worker], owner_pid: int) -> None:
    """End every worker, from the process that started them only (a fork of it must leave them alone)."""
    if os.getpid() != owner_pid:
        return
    for worker in workers:
        _end_worker(worker)
    workers.clear()


def _describe_exit(exit_code: int | None) -> str:
    """A worker's exit code in words: a negative one is the signal that ended it."""
    if exit_code is None:
        return "its socket closed"
    if exit_code < 0:
        name = signal.Signals(-exit_code).name
        return f"killed by {name}" + (" (out of memory?)" if -exit_code == signal.SIGKILL else "")
    return f"exit code {exit_code}"


class VerifierPool:
    """Verifies answers in ``workers`` processes, each calling ``verify_fn(completion, answer)`` in its main thread.

    Own processes and sockets rather than ``concurrent.futures.ProcessPoolExecutor``: one dead
    worker breaks that whole executor (``BrokenProcessPool`` fails every pending answer), and it
    cannot kill the process of one stuck answer. Here each worker has its own socket and one answer
    at a time, so a death or a kill costs exactly the answer it was on:

    - a worker that dies (segfault, ``os._exit``, killed, out of memory) scores its answer 0.0, is
      replaced, and counts in :attr:`worker_deaths` with a logged warning;
    - a worker still on an answer ``timeout_s + stuck_margin_s`` after receiving it (a C call that
      holds off ``verify_fn``'s own SIGALRM timeout) is killed and replaced, its answer 0.0, counted
      in :attr:`stuck_workers_killed`.

    A worker is a fresh interpreter (``subprocess``, ``python -c``) that imports only this module
    and ``verify_fn``'s: ``fork`` would copy the trainer's torch, CUDA and vLLM threads mid-state,
    and multiprocessing's ``spawn`` and ``forkserver`` re-run the main script in every worker (the
    trainer's imports again; a script without a ``__main__`` guard fails). Workers start on first
    use, in parallel (about a second: math-verify's import), and serve every later batch;
    :meth:`close`, leaving a ``with`` block, garbage collection or interpreter exit ends them, and
    a worker whose pool's process is gone exits at its next read. ``workers=1`` calls ``verify_fn``
    in this process. ``verify_fn`` may be any picklable callable. A pickled pool carries its
    settings only: its copy starts workers of its own when used.
    """

    def __init__(self, verify_fn: Callable[[str, str], float], workers: int | str = AUTO_WORKERS, *,
                 timeout_s: float = 5.0, stuck_margin_s: float = STUCK_MARGIN_S):
        self.verify_fn = verify_fn
        self.workers = resolve_workers(workers)
        self.timeout_s = _check_timeout(timeout_s)
        self.stuck_margin_s = stuck_margin_s
        self.worker_deaths = 0
        self.stuck_workers_killed = 0
        self._ever_ready = False  # a worker of this pool got ready: the setup works, a failed start is bad luck
        self._failed_starts = 0  # in a row, after that
        self._workers: list[_Worker] = []
        self._payload = b""  # verify_fn pickled, for each new worker
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()  # one batch at a time: a worker serves one answer at a time

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
        return [worker.process.pid for worker in self._workers]

    def verify_batch(self, completions: list[str], answers: list[str]) -> list[float]:
        """The reward of each completion against its answer, in their order, spread over the workers.

        Raises:
            RuntimeError: ``verify_fn`` raised on an answer (after the answers in flight finish),
                or a new worker could not start.
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
                self._start()
                return self._verify_all(tasks)
            except BaseException:
                self._stop()  # workers in an unknown state (an interrupt mid-batch): the next batch starts afresh
                raise

    def start(self) -> None:
        """Start the workers now (say, while the model loads) rather than at the first batch; no wait for them."""
        if self.workers > 1:
            with self._lock:
                self._start()

    def close(self) -> None:
        """End the workers (a later batch starts new ones)."""
        with self._lock:
            self._stop()

    # --- internals ---

    def _start(self) -> None:
        """Start the workers unless they run (lazily: a pool that is never used starts none)."""
        if self._workers:
            return
        self._payload = pickle.dumps(self.verify_fn)  # an unpicklable verify function fails here, before any process
        self._workers = []
        self._finalizer = weakref.finalize(self, _end_workers, self._workers, os.getpid())
        for _ in range(self.workers):
            self._workers.append(self._spawn(self._payload))

    def _stop(self) -> None:
        """End the workers now; the next batch starts new ones."""
        if self._finalizer is not None:
            self._finalizer()  # ends the workers (the list it holds) and detaches itself
        self._finalizer, self._workers = None, []

    def _spawn(self, payload: bytes) -> _Worker:
        """Start a worker and send it the pickled verify function; it reports "ready" once warmed up."""
        ours, theirs = socket.socketpair()
        with theirs:  # closed here once the child holds its copy: it then reads EOF when this process is gone
            process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_BOOTSTRAP, json.dumps(sys.path), str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        connection = Connection(ours.detach())
        worker = _Worker(process, connection, deadline=time.monotonic() + STARTUP_LIMIT_S)
        try:
            connection.send_bytes(payload)
        except OSError:  # it died at once: found at the first wait, as a worker that never got ready
            pass
        return worker

    def _replace(self, slot: int) -> None:
        """End the worker in ``slot`` (if it still runs) and start a new one there."""
        _end_worker(self._workers[slot])
        self._workers[slot] = self._spawn(self._payload)  # in place: the finalizer holds this list

    def _verify_all(self, tasks: list[tuple[str, str]]) -> list[float]:
        """Hand the answers out one at a time to whichever worker is free, until every one has its reward."""
        rewards = [0.0] * len(tasks)
        waiting = collections.deque(range(len(tasks)))
        failure = None
        while True:
            if failure is None:
                self._hand_out(tasks, waiting)
            in_flight = any(worker.task is not None for worker in self._workers)
            if not in_flight and (failure is not None or not waiting):
                break  # a worker still starting (a replacement) is not waited for: its "ready" is read next batch
            failure = self._collect(rewards) or failure
            self._end_overdue()
        if failure is not None:
            raise RuntimeError(f"the verify function raised on answer {failure}")
        return rewards

    def _hand_out(self, tasks: list[tuple[str, str]], waiting: collections.deque) -> None:
        """Give the next waiting answers to the ready, idle workers."""
        for slot, worker in enumerate(self._workers):
            if not waiting:
                return
            if not worker.ready or worker.task is not None:
                continue
            index = waiting.popleft()
            try:
                worker.connection.send(tasks[index])
            except OSError:  # it died while idle: not this answer's doing, which waits for another worker
                waiting.appendleft(index)
                self._on_death(slot, None)
                continue
            worker.task, worker.deadline = index, time.monotonic() + self.timeout_s + self.stuck_margin_s

    def _collect(self, rewards: list[float]) -> str | None:
        """Wait for replies, deaths (EOF) or the next deadline; record what came. A verify function's error, if any."""
        slot_of = {worker.connection: slot for slot, worker in enumerate(self._workers)}
        next_deadline = min(worker.deadline for worker in self._workers)
        ready = multiprocessing.connection.wait(list(slot_of), max(0.0, next_deadline - time.monotonic()))
        failure = None
        for slot in sorted(slot_of[connection] for connection in ready):
            failure = self._read(slot, rewards) or failure
        return failure

    def _read(self, slot: int, rewards: list[float]) -> str | None:
        """Take one worker's message: ready, a reward, or a verify function's error (returned); EOF is a death."""
        worker = self._workers[slot]
        try:
            kind, value = worker.connection.recv()
        except (EOFError, OSError):  # the worker's end closed: it exited
            self._on_death(slot, worker.task)
            return None
        if kind == "ready":
            worker.ready, worker.deadline = True, math.inf
            self._ever_ready, self._failed_starts = True, 0
            return None
        index, worker.task, worker.deadline = worker.task, None, math.inf
        if kind == "ok":
            rewards[index] = value
            return None
        return f"{index}:\n{value}"

    def _on_death(self, slot: int, index: int | None) -> None:
        """A worker exited by itself: its answer (if any) keeps 0.0; it is counted, logged and replaced."""
        worker = self._workers[slot]
        try:
            worker.process.wait(1)
        except subprocess.TimeoutExpired:
            pass
        how = _describe_exit(worker.process.returncode)
        if not worker.ready and self._ever_ready and self._failed_starts < MAX_FAILED_STARTS:
            # a replacement that died starting (memory ran short for a moment): it held no answer; try again
            self._failed_starts += 1
            log.warning("a replacement verifier worker ended (%s) before it was ready; starting another (%d of %d)",
                        how, self._failed_starts, MAX_FAILED_STARTS)
            self._replace(slot)
            return
        if not worker.ready:  # the first workers, or several replacements in a row: a setup problem, not an answer's
            raise RuntimeError(f"a verifier worker ended ({how}) before it was ready: importing or warming up "
                               f"{self.verify_fn!r} failed in a fresh process (its error is above), or memory ran out")
        self.worker_deaths += 1
        on = "while idle" if index is None else f"on answer {index} (scored 0.0)"
        log.warning("verifier worker pid %s died (%s) %s; replaced (%d worker deaths so far)",
                    worker.process.pid, how, on, self.worker_deaths)
        self._replace(slot)

    def _end_overdue(self) -> None:
        """Kill and replace workers past their deadline: stuck on an answer, or never ready."""
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
            if worker.deadline > now or worker.connection.poll():  # a reply that just came is read next round
                continue
            if not worker.ready:
                raise RuntimeError(f"a verifier worker was not ready {STARTUP_LIMIT_S:.0f} s after it started "
                                   "(importing the verify function hangs, or the machine is overloaded)")
            self.stuck_workers_killed += 1
            log.warning("verifier worker pid %s still on answer %d %.1f s after its %.1f s timeout: killed, the "
                        "answer scored 0.0, replaced (%d stuck workers so far)", worker.process.pid, worker.task,
                        self.stuck_margin_s, self.timeout_s, self.stuck_workers_killed)
            self._replace(slot)
