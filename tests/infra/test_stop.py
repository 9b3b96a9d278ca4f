"""fgrpo.infra.stop: Slurm's SIGUSR2 and a swallowed SIGINT, recorded for the training loop, with the handlers before
put back afterwards. Whole runs that stop and resume are in tests/test_resume.py and tests/test_run.py."""

import os
import signal
import time

import pytest

from fgrpo.infra.stop import StopSignals


def test_a_stop_that_misses_its_deadline_hands_over_at_once():
    """SIGUSR2 under a handler such as submitit's: if no step boundary comes within the deadline, that handler runs
    (it requeues the job) from wherever the run is. Here it is a stand-in that records the call."""
    handed_over = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: handed_over.append(signum))
    try:
        with StopSignals(deadline_s=1) as signals:
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.2)
            assert signals.stop_requests == [signal.SIGUSR2] and handed_over == []  # recorded, not handed over yet
            deadline = time.time() + 10
            while not handed_over and time.time() < deadline:
                time.sleep(0.05)
            assert handed_over == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR2) is not None and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_interrupt_record_raises_as_python_does_and_restores_the_handler_before():
    def mine(signum, frame):
        raise AssertionError("the training loop's handler should be the one called")

    previous = signal.signal(signal.SIGINT, mine)
    try:
        with StopSignals() as signals:
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs between bytecodes; it never gets here
            assert signals.interrupts == [signal.SIGINT]  # recorded, for an interrupt that something swallowed
        assert signal.getsignal(signal.SIGINT) is mine  # train() may be one call of a longer program
    finally:
        signal.signal(signal.SIGINT, previous)
