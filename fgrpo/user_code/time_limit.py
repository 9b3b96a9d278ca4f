"""A wall-clock bound on one call: :func:`run_with_time_limit` raises :class:`TimeLimitExceeded` into a call that runs
past its time. The math check (:func:`fgrpo.rewards.answers.verify_math`) bounds itself with it, and a worker of the
reward pool bounds each call of a user's reward function with it (:mod:`fgrpo.rewards.calls`).

In the main thread the bound is a SIGALRM timer: it also stops CPython's big-integer power loop, which checks for
signals. Signals reach only the main thread, so in other threads a watchdog thread raises an asynchronous exception
instead: that stops Python-level work but not a single C call that holds the GIL. Where neither stops a call (C code
that blocks SIGALRM), the reward pool's workers are killed from outside (:mod:`fgrpo.user_code.pool`).
"""

from __future__ import annotations

import ctypes
import math
import signal
import threading
import time
from typing import Callable, TypeVar

__all__ = ["TimeLimitExceeded", "run_with_time_limit", "check_timeout"]

T = TypeVar("T")


class TimeLimitExceeded(BaseException):
    """Raised into a running call when its time is up.

    A BaseException so that the ``except Exception`` blocks inside the call (math-verify's, sympy's, a user's) let it
    through instead of swallowing it and carrying on unbounded.
    """


def check_timeout(timeout_s) -> float:
    """``timeout_s`` as a float; ValueError unless it is a positive, finite number of seconds."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}; e.g. timeout_s=5.0")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}; e.g. timeout_s=5.0")
    return float(timeout_s)


def run_with_time_limit(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()``, interrupted by :class:`TimeLimitExceeded` after ``timeout_s`` seconds: by SIGALRM in the main thread,
    else by a watchdog thread."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    run = _run_with_alarm if in_main_thread and hasattr(signal, "setitimer") else _run_with_watchdog
    return run(fn, timeout_s)


def _run_with_alarm(fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn`` in the main thread, interrupted by SIGALRM after ``timeout_s`` seconds.

    Saves and restores any SIGALRM handler and interval timer already set (a timer due during
    the call fires late, right after it).
    """

    def on_alarm(signum, frame):
        raise TimeLimitExceeded()

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


def _run_with_watchdog(fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn`` in this (non-main) thread, interrupted by a watchdog thread after ``timeout_s``.

    The watchdog raises :class:`TimeLimitExceeded` in this thread through CPython's asynchronous-exception API. A lock
    makes sure the exception is either raised while ``fn`` runs, or cancelled before this function returns. It lands
    between bytecodes only: a C call that holds the GIL (a huge integer power) blocks the watchdog itself until the
    call ends.
    """
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"finished": False, "fired": False}

    def interrupt() -> None:
        with lock:
            if not state["finished"]:
                state["fired"] = True
                _set_async_exception(thread_id, TimeLimitExceeded)

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
