"""Verify functions that fail on purpose, for the worker pool's tests (tests/user_code/test_pool.py).

A pool's workers import this module by name: the tests folder is on their ``sys.path``, which
they copy from the pool's process (pytest puts the folder there).
"""

import ctypes
import os
import signal
import time

from fgrpo.rewards.answers import verify_math

EXIT = "<<exit>>"  # the worker ends at once (os._exit), as after a fatal error in a C extension
KILL = "<<kill>>"  # SIGKILL: what the out-of-memory killer sends
SEGFAULT = "<<segfault>>"  # a real segmentation fault: reading address 0
HANG = "<<hang>>"  # sleeps with SIGALRM blocked: a C call that never lets the timeout in
RAISE = "<<raise>>"  # a bug in the verify function itself
FAULTS = (EXIT, KILL, SEGFAULT, HANG)


def faulty_verify(completion: str, answer: str, timeout_s: float = 2.0) -> float:
    """:func:`verify_math`, except on a completion holding one of the markers above."""
    if EXIT in completion:
        os._exit(3)
    if KILL in completion:
        os.kill(os.getpid(), signal.SIGKILL)
    if SEGFAULT in completion:
        ctypes.string_at(0)
    if HANG in completion:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    if RAISE in completion:
        raise ValueError("a bug in the verify function")
    return verify_math(completion, answer, timeout_s=timeout_s)
