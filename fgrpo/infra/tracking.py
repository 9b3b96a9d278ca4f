"""Experiment tracking: metrics.jsonl always, and Weights & Biases as its mirror when it works.

The training loop talks to one small :class:`Tracker` so that it stays readable and tests can run
with ``backend="none"``. ``metrics.jsonl`` in the run directory is the project's own record: it is
appended, flushed and fsynced on every :meth:`Tracker.log`, so a crash loses at most the line being
written. W&B is a mirror of it: if W&B cannot be imported, fails to start, or raises mid-run, the
tracker logs ONE warning (logger ``"fgrpo"``) and goes on with metrics.jsonl alone.

metrics.jsonl holds one JSON object per :meth:`Tracker.log` call,
``{"step": step, "time": unix_seconds, **metrics}``; list values (histograms) are JSON lists.
Non-finite floats (NaN, +-inf) are written as ``null`` because ``NaN`` is not valid JSON;
:func:`fgrpo.infra.run_files.read_metrics` turns ``null`` back into ``nan`` (the sign of an infinity is not kept there;
W&B gets the exact value).

Plots are :mod:`fgrpo.evaluation.plots`; tests read W&B's run files back with ``tests/helpers/wandb_files.py``.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from fgrpo.infra.run_files import METRICS_FILE, SUMMARY_FILE, supersede_rows_after, write_json_atomic
from fgrpo.infra.wandb_file import wait_for_exit_record

__all__ = [
    "BACKENDS",
    "WANDB_MODES",
    "Tracker",
    "resolve_wandb_mode",
]

logger = logging.getLogger("fgrpo")

BACKENDS = ("wandb", "none")
WANDB_MODES = ("offline", "online", "disabled", "shared", "dryrun", "run")
"""The modes wandb 0.31's ``wandb.Settings`` accepts; anything else is a config typo."""

_RESERVED_KEYS = ("step", "time")

# Quiet and cheap, but keep what helps reproduce a run (git commit, hardware, pip freeze) and the
# GPU/CPU stats W&B samples in its own process (they do not slow the training loop).
_DEFAULT_WANDB_SETTINGS: dict[str, Any] = {"console": "off", "save_code": False, "quiet": True}


def resolve_wandb_mode(mode: str | None) -> str:
    """The W&B mode a run uses: ``mode`` if given, else $WANDB_MODE, else ``"offline"``.

    Offline is the project's default so that no run ever needs a network or an API key unless
    the user asks for it.
    """
    resolved = mode if mode is not None else (os.environ.get("WANDB_MODE") or "offline")
    if resolved not in WANDB_MODES:
        source = "mode" if mode is not None else "$WANDB_MODE"
        raise ValueError(f"{source}={resolved!r} is not a W&B mode; choose one of {', '.join(WANDB_MODES)}")
    return resolved


# --------------------------------------------------------------------------------------------
# value cleaning (shared by metrics.jsonl and W&B)
# --------------------------------------------------------------------------------------------


def _scalar(key: str, value: Any) -> int | float | bool:
    """A Python number from ints, floats, numpy scalars or 0-d arrays/tensors (via ``.item()``)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (bool, numbers.Integral)):
        return bool(value) if isinstance(value, bool) else int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r} must be a number or a list of numbers, got {type(value).__name__}: {value!r}")


def _metric_value(key: str, value: Any) -> int | float | bool | list[float]:
    """A number, or a flat list of floats for a histogram (lists, tuples, 1-D arrays/tensors)."""
    if hasattr(value, "tolist") and getattr(value, "ndim", None) == 1:
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [float(_scalar(key, element)) for element in value]
    return _scalar(key, value)


def _json_safe(value: Any) -> Any:
    """Replace non-finite floats by None (JSON null), recursively, since NaN is not valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return _json_safe(value.item())
    if hasattr(value, "tolist"):
        return _json_safe(value.tolist())
    return value




# --------------------------------------------------------------------------------------------
# Tracker
# --------------------------------------------------------------------------------------------


class Tracker:
    """Logs a run's metrics to metrics.jsonl (always) and to W&B (``backend="wandb"``).

    W&B failures never stop training: the first one logs a single warning and W&B is dropped
    for the rest of the run. Use as a context manager so an exception marks the W&B run as
    failed (exit code 1) and is re-raised.

    Args:
        run_dir: the run's directory; created if missing. Holds metrics.jsonl, summary.json and
            W&B's ``wandb/`` folder.
        backend: ``"wandb"`` or ``"none"`` (metrics.jsonl only).
        project, name, group, tags, entity, config: passed to ``wandb.init``.
        mode: W&B mode; None means $WANDB_MODE, else ``"offline"`` (see :func:`resolve_wandb_mode`).
        wandb_settings: overrides for ``wandb.Settings`` (defaults: ``console="off"``,
            ``save_code=False``, ``quiet=True``), e.g. ``{"x_disable_stats": True}``.
        resume_id: continue this W&B run (a run resumed from a checkpoint); W&B drops rows of steps it has.
        keep_steps_through: a resumed run: rows of later steps in an existing metrics.jsonl (logged after the
            checkpoint, before the crash) move to metrics_superseded.jsonl, so each step appears once.
    """

    WANDB_FLUSH_TIMEOUT_S = 30.0
    """How long close() waits for wandb-core to write the end of the run's .wandb file."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        backend: str = "wandb",
        project: str = "fgrpo",
        name: str | None = None,
        group: str | None = None,
        mode: str | None = None,
        config: dict | None = None,
        tags: Sequence[str] | None = None,
        entity: str | None = None,
        wandb_settings: Mapping[str, Any] | None = None,
        resume_id: str | None = None,
        keep_steps_through: int | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not supported; choose one of {', '.join(BACKENDS)}")
        self.wandb_mode = resolve_wandb_mode(mode) if backend == "wandb" else None
        self.backend = backend
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.summary_path = self.run_dir / SUMMARY_FILE
        self._summary: dict[str, Any] = {}
        self._closed = False
        self._wandb_warned = False
        self._wandb = None  # the wandb module, once imported
        self._wandb_run = None  # the live wandb Run; None when W&B is off or has failed
        self._wandb_run_started = None  # kept after a failure so close() can still finish it
        if keep_steps_through is not None:
            supersede_rows_after(self.metrics_path, keep_steps_through)
        self._metrics_file = self._open_metrics_file()
        if backend == "wandb":
            self._start_wandb(
                project=project,
                name=name,
                group=group,
                config=config,
                tags=list(tags) if tags is not None else None,
                entity=entity,
                settings_overrides=dict(wandb_settings or {}),
                **({"id": resume_id, "resume": "allow"} if resume_id else {}),
            )

    # ---- public state -------------------------------------------------------------------

    @property
    def wandb_run(self):
        """The live ``wandb`` Run, or None when W&B is off or has failed (e.g. for its URL)."""
        return self._wandb_run

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run's id (a checkpoint keeps it, so a resumed run logs to the same run); None without W&B."""
        run = self._wandb_run_started
        return run.id if run is not None else None

    @property
    def wandb_active(self) -> bool:
        """Whether metrics still go to W&B."""
        return self._wandb_run is not None

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- logging ------------------------------------------------------------------------

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        """Append one line to metrics.jsonl (flushed and fsynced) and mirror it to W&B.

        List values (e.g. the per-group success rates) stay lists in metrics.jsonl and become a
        ``wandb.Histogram`` in W&B. W&B drops rows whose step is below its last one; metrics.jsonl
        keeps them.

        Raises:
            TypeError: a value is not a number or a flat list of numbers.
            ValueError: bad step, or a key that is empty, reserved ("step", "time") or starts
                with "_" (W&B's own keys).
            RuntimeError: the tracker is closed.
        """
        self._check_open()
        step = self._check_step(step)
        clean = {}
        for key, value in metrics.items():
            self._check_key(key)
            clean[key] = _metric_value(key, value)
        row = {"step": step, "time": time.time(), **clean}
        self._append_line(json.dumps(_json_safe(row), allow_nan=False))
        if self._wandb_run is not None and clean:
            self._wandb_call("log", lambda: self._wandb_run.log(self._to_wandb(clean), step=step))

    def log_histogram(self, key: str, values: Sequence[float], *, step: int) -> None:
        """Log one list of values as a histogram; same as ``log({key: list(values)}, step=step)``."""
        self.log({key: values if hasattr(values, "tolist") else list(values)}, step=step)

    def log_image(self, key: str, path: str | os.PathLike, *, step: int) -> None:
        """Log an image file (e.g. a pass@k plot) to W&B as ``wandb.Image``; nothing else is written.

        Raises:
            FileNotFoundError: ``path`` does not exist (checked with every backend, so tests
                catch it without W&B).
        """
        self._check_open()
        step = self._check_step(step)
        self._check_key(key)
        image_path = Path(path)
        if not image_path.is_file():
            raise FileNotFoundError(f"image {str(image_path)!r} for {key!r} does not exist")
        if self._wandb_run is not None:
            wandb = self._wandb
            self._wandb_call("log_image", lambda: self._wandb_run.log({key: wandb.Image(str(image_path))}, step=step))

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], *, step: int) -> None:
        """Log rows of text (an environment's transcripts) to W&B as a ``wandb.Table``; nothing else is written (the
        caller keeps its own file)."""
        self._check_open()
        step = self._check_step(step)
        self._check_key(key)
        if self._wandb_run is not None:
            wandb = self._wandb
            self._wandb_call("log_table", lambda: self._wandb_run.log(
                {key: wandb.Table(columns=list(columns), data=[list(row) for row in rows])}, step=step))

    def summary(self, metrics: Mapping[str, Any]) -> None:
        """Record final numbers: merged into summary.json (rewritten atomically) and the W&B summary.

        Values may be numbers, strings, lists or nested dicts; non-finite floats become null in
        summary.json as in metrics.jsonl.
        """
        self._check_open()
        for key in metrics:
            if not isinstance(key, str) or not key:
                raise ValueError(f"summary keys must be non-empty strings, got {key!r}")
        plain = {key: _json_safe_keep_nan(value) for key, value in metrics.items()}
        self._summary.update(plain)
        write_json_atomic(self.summary_path, _json_safe(self._summary))
        if self._wandb_run is not None:
            self._wandb_call("summary", lambda: self._wandb_run.summary.update(plain))

    def close(self, *, exit_code: int = 0) -> None:
        """Close metrics.jsonl and finish the W&B run (``exit_code != 0`` marks it failed). Idempotent.

        The W&B run is finished even after a W&B failure dropped it, so its files end cleanly;
        an error there only warns (once per tracker).
        """
        if self._closed:
            return
        self._closed = True
        try:
            run = self._wandb_run_started
            self._wandb_run = None
            self._wandb_run_started = None
            if run is not None:
                try:
                    self._finish_wandb(run, exit_code)
                except Exception as error:  # noqa: BLE001 - W&B must never break shutdown
                    self._warn_wandb("finishing the W&B run failed", error)
        finally:
            self._metrics_file.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(exit_code=0 if exc_type is None else 1)
        return False

    def __del__(self) -> None:  # last resort: never leave the jsonl handle open
        file = getattr(self, "_metrics_file", None)
        if file is not None and not file.closed:
            file.close()

    # ---- internals ----------------------------------------------------------------------

    def _open_metrics_file(self):
        """Open metrics.jsonl for appending, first cutting a half-written last line from a crash.

        Without the cut, the next line would be glued onto the fragment and both would be lost.
        """
        if self.metrics_path.exists():
            with open(self.metrics_path, "rb+") as existing:
                size = existing.seek(0, os.SEEK_END)
                keep = _end_of_last_complete_line(existing, size)
                if keep < size:
                    existing.truncate(keep)
                    logger.warning(
                        "%s ended with a partial line (%d bytes, from a crash); removed it before appending",
                        self.metrics_path,
                        size - keep,
                    )
        return open(self.metrics_path, "a", encoding="utf-8")

    def _append_line(self, line: str) -> None:
        self._metrics_file.write(line + "\n")
        self._metrics_file.flush()
        os.fsync(self._metrics_file.fileno())

    def _start_wandb(self, *, settings_overrides: dict[str, Any], **init_kwargs) -> None:
        try:
            import wandb
        except Exception as error:  # noqa: BLE001 - a broken install is as good as none
            self._warn_wandb("wandb is not importable", error)
            return
        self._wandb = wandb
        try:
            settings = wandb.Settings(**{**_DEFAULT_WANDB_SETTINGS, **settings_overrides})
            run = wandb.init(
                dir=str(self.run_dir),
                mode=self.wandb_mode,
                reinit="create_new",  # never touch (or finish) another tracker's run
                settings=settings,
                **init_kwargs,
            )
        except Exception as error:  # noqa: BLE001 - training must go on without W&B
            self._warn_wandb("wandb.init failed", error)
            return
        self._wandb_run = run
        self._wandb_run_started = run

    def _finish_wandb(self, run, exit_code: int) -> None:
        """Finish the run and wait (bounded) until its transaction log is complete on disk.

        wandb-core writes the .wandb file asynchronously and ``finish`` can return before it has
        (seen with wandb 0.31); waiting makes the files complete when close() returns, for
        readers such as a job that copies the run directory.
        """
        sync_file = Path(run.settings.sync_file) if self.wandb_mode != "disabled" else None
        log_exists = sync_file is not None and sync_file.exists()
        run.finish(exit_code=exit_code)
        if log_exists and not wait_for_exit_record(sync_file, self.WANDB_FLUSH_TIMEOUT_S):
            raise TimeoutError(f"{sync_file} got no exit record within {self.WANDB_FLUSH_TIMEOUT_S} s of finish")

    def _to_wandb(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Lists become histograms of their finite values (numpy cannot bin NaN); empty ones are skipped."""
        payload = {}
        for key, value in metrics.items():
            if isinstance(value, list):
                finite = [v for v in value if math.isfinite(v)]
                if finite:
                    payload[key] = self._wandb.Histogram(finite)
            else:
                payload[key] = value
        return payload

    def _wandb_call(self, what: str, call) -> None:
        try:
            call()
        except Exception as error:  # noqa: BLE001 - W&B must never stop training
            self._wandb_run = None
            self._warn_wandb(f"W&B {what} failed", error)

    def _warn_wandb(self, what: str, error: BaseException) -> None:
        """The single W&B warning of this tracker; later failures only go to debug."""
        logger.debug("%s", what, exc_info=error)
        if self._wandb_warned:
            return
        self._wandb_warned = True
        logger.warning(
            "%s (%s: %s); going on without W&B, every metric is still written to %s",
            what,
            type(error).__name__,
            error,
            self.metrics_path,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Tracker for {self.run_dir} is closed")

    @staticmethod
    def _check_step(step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        return int(step)

    @staticmethod
    def _check_key(key: Any) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"metric keys must be non-empty strings, got {key!r}")
        if key in _RESERVED_KEYS:
            raise ValueError(f"metric key {key!r} is reserved for the row's own {key}")
        if key.startswith("_"):
            raise ValueError(f"metric key {key!r} starts with '_', which W&B reserves for its own keys")




def _end_of_last_complete_line(file, size: int, window: int = 64 * 1024) -> int:
    """Offset just past the last newline of a binary file (0 if none), reading only its tail."""
    end = size
    while end > 0:
        start = max(0, end - window)
        file.seek(start)
        newline = file.read(end - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def _json_safe_keep_nan(value: Any) -> Any:
    """Plain Python values (numpy/tensor scalars unwrapped) with NaN kept, for the W&B summary."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe_keep_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe_keep_nan(v) for v in value]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value











class NoTracker:
    """What the other ranks of a multi-process run hold instead of a :class:`Tracker`: rank 0 alone writes the
    metrics, the summary and W&B, from numbers already gathered from every rank."""

    wandb_run_id = None

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        pass

    def log_image(self, key: str, path: str | os.PathLike, *, step: int) -> None:
        pass

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], *, step: int) -> None:
        pass

    def summary(self, metrics: Mapping[str, Any]) -> None:
        pass

    def __enter__(self) -> NoTracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return False

