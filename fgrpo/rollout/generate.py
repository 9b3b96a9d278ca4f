"""A user's generator (``dataset.generator="my_task.py:make"``) called in a worker process, never in the trainer: the
file's top level (which may also hold reward functions, or code that exits) runs there, the call has a time limit
(``dataset.generator_timeout_s``), and whatever it does (raise, ``sys.exit``, hang, die) comes back as one error that
names it, raised on this rank, and through ``distributed.agree`` on every rank. Its rows come back pickled.

Torch-free: the worker imports this module and the user's file only.
"""

from __future__ import annotations

import traceback
from typing import Any, Mapping

from fgrpo.infra.errors import ConfigError, DataError

__all__ = ["generate_rows", "make_rows"]


def make_rows(spec: str, args: Mapping[str, Any]) -> tuple[str, Any]:
    """In the worker: ``("rows", list)``, or ``("config", message)`` where the function cannot be loaded or its
    parameters and ``args`` do not match, ``("data", message)`` where it raised (any exception, ``sys.exit`` too)."""
    from fgrpo.user_code.loading import load_function
    from fgrpo.rewards.binding import bind

    try:
        fn = load_function(spec, "dataset.generator")
        binding = bind(fn)
    except (ConfigError, ValueError) as error:
        return "config", str(error)
    problem = _arguments_problem(binding, dict(args))
    if problem:
        return "config", f"dataset.generator={spec!r} takes ({', '.join(binding.params)}): {problem}"
    try:
        return "rows", list(fn(**args))
    except BaseException as error:  # noqa: BLE001 - in a worker: every exception is the generator's
        text = "".join(traceback.format_exception(error)[-6:])
        return "data", f"dataset.generator={spec!r} raised:\n{text}"


def _arguments_problem(binding, args: dict) -> str:
    unknown = [key for key in args if key not in binding.params]
    missing = [param for param in binding.params if param not in args and param not in binding.with_defaults]
    problems = []
    if unknown and not binding.takes_kwargs:
        problems.append(f"dataset.generator_args has {unknown}, which it does not take")
    if missing:
        problems.append(f"no value for {missing}: set dataset.generator_args.{missing[0]}=...")
    if binding.positional_only:
        problems.append(f"its positional-only parameters {list(binding.positional_only)} cannot be given by name")
    return "; ".join(problems)


def generate_rows(spec: str, args: Mapping[str, Any], *, timeout_s: float, import_timeout_s: float) -> list:
    """The generator's rows, made in a worker process within ``timeout_s`` (its imports within
    ``import_timeout_s``).

    Raises:
        ConfigError: it cannot be loaded, or its parameters and ``args`` do not match.
        DataError: it raised, exited, died or ran past its time limit.
    """
    from fgrpo.user_code.pool import Fault, StartupTimeout, WorkerPool

    with WorkerPool(make_rows, 1, timeout_s=timeout_s, stuck_margin_s=1.0, startup_limit_s=import_timeout_s) as pool:
        try:
            (result,) = pool.run([(spec, dict(args))])
        except StartupTimeout as error:
            raise DataError(f"dataset.generator={spec!r}: its worker was not ready within "
                            f"dataset.reward_import_timeout_s={import_timeout_s:g} s ({error})") from error
    if isinstance(result, Fault):
        what = ("ran past its time limit" if result.kind == "stuck" else f"ended its process ({result.detail})")
        limit = f" (dataset.generator_timeout_s={timeout_s:g})" if result.kind == "stuck" else ""
        raise DataError(f"dataset.generator={spec!r} {what}{limit}: it must return its rows, as a list of dicts")
    kind, value = result
    if kind == "config":
        raise ConfigError(value)
    if kind == "data":
        raise DataError(value)
    return value
