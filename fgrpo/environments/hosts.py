"""The trainer's side of the episode hosts: a draw's episodes spread over hosts (:class:`~fgrpo.environments.host.
HostEpisodes`, long-lived tasks on the workers of the user-code pool), each turn round's calls sent to the hosts holding
them, the replies collected within a deadline.

A host that dies (its worker segfaults, calls ``os._exit``, runs out of memory) or does not answer in time (a call stuck
in C code that holds off its own time limit: its worker is killed) ends every episode it held: their later calls fail
at once (``died`` or ``timeout``), counted as the pool's worker deaths or stuck workers. The other hosts go on.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from multiprocessing.connection import wait

from fgrpo.environments.host import HostEpisodes, Op, Reply
from fgrpo.user_code.pool import STUCK_MARGIN_S, WorkerPool
from fgrpo.user_code.worker import describe_exit

__all__ = ["EpisodeHosts"]

log = logging.getLogger(__name__)


class EpisodeHosts:
    """``episodes`` episodes (numbered 0..episodes-1) of ``target`` on at most ``pool.workers`` hosts, episode ``e`` on
    host ``e % hosts``. Use as a context manager: leaving it ends the hosts (their workers go back to the pool)."""

    def __init__(self, pool: WorkerPool, target: str, episodes: int, *, timeout_s: float, kwargs: dict | None = None,
                 startup_s: float = 120.0):
        self.pool, self.timeout_s, self.startup_s = pool, timeout_s, startup_s
        self.count = max(1, min(pool.workers, episodes))
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe() for _ in range(self.count)]
        self.conns = [mine for mine, _ in pipes]
        self._theirs = [theirs for _, theirs in pipes]  # closed once the host answered (it holds its own copy then)
        self.futures = pool.serve([HostEpisodes(target, theirs, timeout_s, tuple((kwargs or {}).items()))
                                   for _, theirs in pipes])
        self.lost: dict[int, Reply] = {}  # host -> the reply every call of its episodes gets now
        self.rounds = 0

    def __enter__(self) -> EpisodeHosts:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def host_of(self, episode: int) -> int:
        return episode % self.count

    def call(self, ops: list[Op]) -> list[Reply]:
        """Each op's reply, in their order: every host gets its ops in one message, all hosts at once."""
        replies: list[Reply | None] = [None] * len(ops)
        by_host: dict[int, list[int]] = {}
        for index, op in enumerate(ops):
            host = self.host_of(op[1])
            if host in self.lost:
                replies[index] = self.lost[host]
            else:
                by_host.setdefault(host, []).append(index)
        for host, indices in list(by_host.items()):
            try:
                self.conns[host].send([ops[i] for i in indices])
            except (BrokenPipeError, OSError):
                self._lose(host, "died", "its worker ended")
                by_host.pop(host)
        # the host runs its calls one after another: each within its limit, plus a margin for a stalled machine
        started = time.monotonic()
        deadlines = {host: started + len(indices) * (self.timeout_s + 1.0) + STUCK_MARGIN_S
                     + (self.startup_s if self.rounds == 0 else 0.0) for host, indices in by_host.items()}
        waiting = dict(by_host)
        while waiting:
            ready = wait([self.conns[h] for h in waiting], timeout=0.25)
            for host in [h for h in list(waiting) if self.conns[h] in ready]:
                try:
                    answered = self.conns[host].recv()
                except (EOFError, OSError):
                    self._lose(host, "died", self._exit_of(host))
                    continue
                for index, reply in zip(waiting.pop(host), answered):
                    replies[index] = reply
                self._close_theirs(host)
            for host in list(waiting):
                if host in self.lost:
                    continue
                if self.futures[host].done():  # its worker ended (pebble noticed) without answering
                    self._lose(host, "died", self._exit_of(host))
                elif time.monotonic() > deadlines[host]:
                    self.futures[host].cancel()  # pebble kills the worker and starts another
                    self._lose(host, "stuck", f"no answer within {deadlines[host] - started:.0f} s (a call stuck past "
                                              "its time limit in code that holds off the alarm): its worker was killed")
            for host in [h for h in list(waiting) if h in self.lost]:
                for index in waiting.pop(host):
                    replies[index] = self.lost[host]
        self.rounds += 1
        return replies

    def close(self) -> None:
        """End every live host (its worker goes back to the pool) and close the pipes."""
        for host, conn in enumerate(self.conns):
            if host not in self.lost:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 5.0
        for host, future in enumerate(self.futures):
            if host in self.lost:
                continue
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a host that will not end is killed: the pool replaces its worker
                future.cancel()
        for conn in self.conns + self._theirs:
            if conn is not None:
                conn.close()
        self._theirs = [None] * len(self._theirs)

    def _close_theirs(self, host: int) -> None:
        if self._theirs[host] is not None:
            self._theirs[host].close()
            self._theirs[host] = None

    def _exit_of(self, host: int) -> str:
        future = self.futures[host]
        deadline = time.monotonic() + 2.0
        while not future.done() and time.monotonic() < deadline:
            time.sleep(0.02)
        error = future.exception() if future.done() and not future.cancelled() else None
        return describe_exit(getattr(error, "exitcode", None), self.pool.memory_gib) if error else "its worker ended"

    def _lose(self, host: int, kind: str, detail: str) -> None:
        self.lost[host] = Reply("failed", kind="died" if kind == "died" else "timeout",
                                message=f"the worker holding this episode {'died' if kind == 'died' else 'was stuck'}: "
                                        f"{detail}")
        self.pool.count_lost(kind)
        log.warning("an environment host %s (%s); the episodes it held end as failed", "died" if kind == "died"
                    else "was stuck and killed", detail)
