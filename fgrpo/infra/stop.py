"""Stopping a run cleanly: Slurm's SIGUSR2 (its warning before a time limit or a preemption, which submitit asks for,
or ``scancel --signal=USR2``) asks the loop to save a checkpoint at the end of the step and stop; a SIGINT that
something swallowed on the way (torch.compile was seen to) still stops the run at the next step.

:class:`StopSignals` installs both handlers for the length of the loop and puts the ones before back afterwards
(train() may be one call of a longer program). Main thread only: elsewhere no handler is installed.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from fgrpo.infra import distributed

log = logging.getLogger("fgrpo")

# the exit code of a run that stopped on SIGUSR2 outside submitit: EX_TEMPFAIL, "try again" (it resumes)
STOPPED_EXIT_CODE = 75
# of the time between Slurm's SIGUSR2 and its time limit, what the requeue needs after the save (submitit's calls)
STOP_MARGIN_S = 30


class StopSignals:
    """Records each SIGUSR2 and SIGINT while the ``with`` block lasts.

    ``deadline_s``: if the step, its evaluation and the save are not done that long after SIGUSR2 (a slow step would
    run into the time limit, and nothing would requeue the job), the handler before (submitit's requeue) runs at once,
    from wherever the run is: the job is requeued and resumes from the checkpoint before. Only where there is such a
    handler (a Slurm job of a sweep)."""

    def __init__(self, deadline_s: float = 0.0):
        self.deadline_s = deadline_s
        self.stop_requests: list[int] = []
        self.interrupts: list[int] = []
        self.previous_usr2 = None  # submitit's requeue handler, in a Slurm job of a sweep
        self._previous: dict[int, object] = {}

    @property
    def stop_requested(self) -> bool:
        return bool(self.stop_requests)

    def raise_if_interrupted(self, step: int) -> None:
        """A Ctrl-C that landed where it was swallowed stops the run here, before ``step``."""
        if self.interrupts:
            raise KeyboardInterrupt(f"interrupted during step {step - 1}")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        self.previous_usr2 = signal.signal(signal.SIGUSR2, self._on_usr2)
        self._previous = {signal.SIGUSR2: self.previous_usr2, signal.SIGALRM: signal.signal(signal.SIGALRM, self._too_late),
                          signal.SIGINT: signal.signal(signal.SIGINT, self._on_interrupt)}
        return self

    def __exit__(self, *exc) -> bool:
        if self._previous:
            signal.alarm(0)
        for signum, handler in self._previous.items():  # None: set outside Python, cannot be put back; default is closest
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        return False

    def _on_usr2(self, signum, frame) -> None:
        if not self.stop_requests and self.deadline_s > 0 and callable(self.previous_usr2):
            signal.alarm(max(1, int(self.deadline_s)))
        self.stop_requests.append(signum)

    def _too_late(self, signum, frame) -> None:
        log.warning("no step boundary within %.0f s of SIGUSR2: requeueing now, from the checkpoint before", self.deadline_s)
        self.previous_usr2(signal.SIGUSR2, frame)

    def _on_interrupt(self, signum, frame) -> None:
        self.interrupts.append(signum)
        signal.default_int_handler(signum, frame)  # still raises KeyboardInterrupt, as Python does by default

    def hand_over(self, step: int, run_dir: Path) -> tuple[int, Exception | None]:
        """After a stop's checkpoint: in a Slurm job of a sweep, rank 0 gives the signal to submitit's handler, which
        requeues the job (the requeued job runs the same Hydra job in the same directory, and resumes). Returns the
        code the process exits with, the same on every rank (submitit's -1, else :data:`STOPPED_EXIT_CODE`), and on
        rank 0 the error of a handler that would not requeue (submitit's "timed-out too many times"). Every rank waits
        here until rank 0 has requeued: a rank that left first could end the job (srun --kill-on-bad-exit) before it."""
        log.warning("stopped after step %d on SIGUSR2, its checkpoint saved in %s; the same command (same run "
                    "directory) continues the run", step, run_dir)
        code, failure = STOPPED_EXIT_CODE, None
        if callable(self.previous_usr2) and distributed.rank() == 0:
            try:
                self.previous_usr2(signal.SIGUSR2, None)  # submitit's: requeue, then sys.exit(-1)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            except Exception as error:  # noqa: BLE001 - raised again once every rank is done
                log.error("the job was not requeued: %s", error)
                code, failure = 1, error
        return distributed.from_rank0(code), failure
