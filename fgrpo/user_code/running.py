"""How a worker runs a user's code, whatever it is (a reward function, an environment's method): the process marked
a worker (:func:`in_worker`: there every exception of the user's is the call's failure, ``sys.exit`` and
``KeyboardInterrupt`` included), one event loop per process kept for its life (:func:`await_result`: a lock or client
made at import binds to it), the call's draws seeded (:func:`seed_call`), and the user's traceback without fgrpo's own
frames (:func:`user_traceback`). :func:`run_request` is what every worker of the pool runs: the request's own ``run``.

Nothing here imports torch: a worker is a fresh interpreter with the user's module and little else.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import traceback
from typing import Any, Callable

from fgrpo.user_code.time_limit import run_with_time_limit
from fgrpo.user_code.worker import end_if_over_memory

__all__ = ["in_worker", "user_faults", "await_result", "call_bounded", "seed_call", "user_traceback", "run_request",
           "raised_text", "warm_up_each"]

_worker = {"on": False}
_USER_FAULTS: tuple[type[BaseException], ...] = (Exception,)  # in the trainer: a Ctrl-C there is the user's wish
_loop: dict[str, asyncio.AbstractEventLoop] = {}
_FGRPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def run_request(request) -> Any:
    """What a worker of the pool runs for each task: ``request.run()`` (a reward call, an environment's episodes, a
    description of a user's function or class). A request never raises for the user's faults: a raise here would fail
    the whole batch in the pool."""
    return request.run()


def warm_up_each(warm_ups: tuple[Callable[[], Any], ...]) -> None:
    """A worker's warm-up made of several (the reward functions' imports, an environment's class)."""
    for warm_up in warm_ups:
        warm_up()


def in_worker() -> None:
    """Mark this process a worker of the pool (the workers' warm-up does, at their start)."""
    _worker["on"] = True


def user_faults() -> tuple[type[BaseException], ...]:
    """What counts as the user's own failure: in a worker every exception (``sys.exit``, ``KeyboardInterrupt``,
    ``CancelledError``: a worker's SIGINT is ignored, so they come from the user's code) except the time limit's."""
    return (BaseException,) if _worker["on"] else _USER_FAULTS


def event_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop, made once and kept."""
    loop = _loop.get("loop")
    if loop is None or loop.is_closed():
        loop = _loop["loop"] = asyncio.new_event_loop()
    return loop


def await_result(awaitable) -> Any:
    """Run ``awaitable`` to its end on this process's loop; on an interruption (the time limit) its task is
    cancelled and given a moment to end, so that the next call starts on a loop with nothing of this one left."""
    loop = event_loop()
    task = asyncio.ensure_future(awaitable, loop=loop)
    try:
        return loop.run_until_complete(task)
    except BaseException:
        task.cancel()
        try:
            loop.run_until_complete(asyncio.wait([task], timeout=1.0))
        except BaseException:  # noqa: BLE001 - a task that will not end: the loop is replaced
            loop.close()
        raise


def call_bounded(fn: Callable, kwargs: dict, time_limit_s: float | None) -> Any:
    """``fn(**kwargs)``, awaited when it returns a coroutine, within ``time_limit_s`` (None: the call bounds itself);
    raises :class:`~fgrpo.user_code.time_limit.TimeLimitExceeded` past it."""

    def call():
        result = fn(**kwargs)
        return await_result(result) if asyncio.iscoroutine(result) or asyncio.isfuture(result) else result

    return call() if time_limit_s is None else run_with_time_limit(call, time_limit_s)


def seed_call(seed: int | None) -> None:
    """Seed the generators user code may draw from (``random``; numpy's and torch's where the process imported them):
    the same call gets the same draws on a rerun, whichever worker takes it."""
    if seed is None:
        return
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2 ** 32)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


def user_traceback() -> str:
    """The exception being handled, its traceback without fgrpo's own frames (the call's wrapping): the user's code."""
    error = traceback.TracebackException(*sys.exc_info())
    error.stack = traceback.StackSummary.from_list(
        [frame for frame in error.stack if not frame.filename.startswith(_FGRPO)
         and "asyncio" + os.sep not in frame.filename])
    return "".join(error.format())


def raised_text() -> str:
    """:func:`user_traceback` of the exception being handled; a capped worker past its memory ends here instead."""
    end_if_over_memory(sys.exc_info()[1])
    return user_traceback()
