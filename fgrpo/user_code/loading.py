"""A user's function by import path, the one way fgrpo reaches code of the user's (reward functions, task generators,
advantage methods): ``"package.module:function"`` (an importable module) or ``"path/to/file.py:function"`` (a file,
its folder put on the import path after the installed packages, so that it can import its neighbours).

:func:`resolve_target` checks the form and makes a file's path absolute without importing anything (the config's
checks, and what worker processes are sent); :func:`load_function` imports. Both raise :class:`ConfigError` naming the
config key and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

from fgrpo.infra.errors import ConfigError

__all__ = ["is_import_path", "resolve_target", "load_function", "function_name"]

_FORMS = "'package.module:function' or 'path/to/file.py:function'"


def is_import_path(spec: str) -> bool:
    """Whether ``spec`` names a user's function (it has a ``:``) rather than a built-in by name."""
    return isinstance(spec, str) and ":" in spec


def _split(spec: str, key: str) -> tuple[str, str]:
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ConfigError(f"{key}={spec!r}: name a function as {_FORMS}")
    where, _, name = spec.rpartition(":")
    if not where or not name or not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(f"{key}={spec!r}: name a function as {_FORMS} (after the ':' a Python name, e.g. "
                          "my_task.py:score)")
    return where, name


def function_name(spec: str) -> str:
    """The function's own name in ``spec`` (``score`` of ``"task.py:score"``)."""
    return spec.rpartition(":")[2].rpartition(".")[2]


def resolve_target(spec: str, key: str) -> str:
    """``spec`` with a file's path made absolute (relative paths start at the working directory), checking that the
    file exists; a module path as it is. Imports nothing."""
    where, name = _split(spec, key)
    if not where.endswith(".py"):
        if not all(part.isidentifier() for part in where.split(".")):
            raise ConfigError(f"{key}={spec!r}: {where!r} is neither a module name nor a .py file; name a function as "
                              f"{_FORMS}")
        return spec
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{key}={spec!r}: the file {path} does not exist (relative paths start at the working "
                          f"directory {os.getcwd()}); fix the path")
    return f"{path}:{name}"


def load_function(spec: str, key: str) -> Callable:
    """Import ``spec``'s module (or file) and return its function.

    Raises:
        ConfigError: the module cannot be found, importing it raised (its traceback's last lines in the message), it
            has no such function, or the name is not callable.
    """
    where, name = _split(resolve_target(spec, key), key)
    module = _import_file(where, spec, key) if where.endswith(".py") else _import_module(where, spec, key)
    target = module
    for part in name.split("."):
        if not hasattr(target, part):
            functions = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ConfigError(f"{key}={spec!r}: {where} has no {name!r}; its functions: {functions or 'none'}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key}={spec!r}: {name!r} in {where} is a {type(target).__name__}, not a function")
    return target


def _import_module(module_name: str, spec: str, key: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise ConfigError(f"{key}={spec!r}: no module named {error.name!r} on the import path; install it, or "
                              "name a file instead ('path/to/file.py:function')") from error
        raise ConfigError(f"{key}={spec!r}: importing {module_name} failed:\n{_traceback_tail(error)}") from error
    except Exception as error:  # noqa: BLE001 - the user's module raised while importing: say what
        raise ConfigError(f"{key}={spec!r}: importing {module_name} failed:\n{_traceback_tail(error)}") from error


def _import_file(path: str, spec: str, key: str):
    """The module of a file, once per process: registered under a name made from its absolute path (so that two
    files of one name do not clash, and pickling the classes it defines works in this process)."""
    module_name = f"fgrpo_user_{Path(path).stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    folder = str(Path(path).parent)
    if folder not in sys.path:
        sys.path.append(folder)  # after the installed packages: a user's datasets.py cannot shadow the real one
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[module_name]
        if not isinstance(error, Exception):
            raise
        raise ConfigError(f"{key}={spec!r}: importing {path} failed:\n{_traceback_tail(error)}") from error
    return module


def _traceback_tail(error: BaseException, lines: int = 30) -> str:
    """``error``'s traceback without the import machinery's frames (importlib's, this module's), indented: the
    user's code and what it called, the last ``lines`` lines of it."""
    summary = traceback.TracebackException.from_exception(error)
    summary.stack = traceback.StackSummary.from_list(
        [frame for frame in summary.stack if not frame.filename.startswith("<frozen ") and frame.filename != __file__])
    text = "".join(summary.format()).rstrip().splitlines()
    return "\n".join("    " + line for line in text[-lines:])
