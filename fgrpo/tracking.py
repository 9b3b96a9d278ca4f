"""Experiment tracking: metrics.jsonl always, Weights & Biases when it works, and pass@k plots.

The training loop talks to one small :class:`Tracker` so that it stays readable and tests can run
with ``backend="none"``. ``metrics.jsonl`` in the run directory is the project's own record: it is
appended, flushed and fsynced on every :meth:`Tracker.log`, so a crash loses at most the line being
written. W&B is a mirror of it: if W&B cannot be imported, fails to start, or raises mid-run, the
tracker logs ONE warning (logger ``"fgrpo"``) and goes on with metrics.jsonl alone.

metrics.jsonl holds one JSON object per :meth:`Tracker.log` call,
``{"step": step, "time": unix_seconds, **metrics}``; list values (histograms) are JSON lists.
Non-finite floats (NaN, +-inf) are written as ``null`` because ``NaN`` is not valid JSON;
:func:`read_metrics` turns ``null`` back into ``nan`` (the sign of an infinity is not kept there;
W&B gets the exact value).

:func:`read_wandb_history` reads an offline W&B run's transaction log (``run-<id>.wandb``) back
without any network, so tests can check that values reached W&B's files.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import struct
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

__all__ = [
    "BACKENDS",
    "WANDB_MODES",
    "Tracker",
    "resolve_wandb_mode",
    "read_metrics",
    "WandbRun",
    "find_wandb_run_file",
    "read_wandb_run",
    "read_wandb_history",
    "read_wandb_summary",
    "plot_pass_at_k",
]

logger = logging.getLogger("fgrpo")

BACKENDS = ("wandb", "none")
WANDB_MODES = ("offline", "online", "disabled", "shared", "dryrun", "run")
"""The modes wandb 0.31's ``wandb.Settings`` accepts; anything else is a config typo."""

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
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


def _nulls_to_nan(value: Any) -> Any:
    """Undo :func:`_json_safe` for reading: null (a non-finite float) becomes nan."""
    if value is None:
        return math.nan
    if isinstance(value, list):
        return [_nulls_to_nan(v) for v in value]
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
            )

    # ---- public state -------------------------------------------------------------------

    @property
    def wandb_run(self):
        """The live ``wandb`` Run, or None when W&B is off or has failed (e.g. for its URL)."""
        return self._wandb_run

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
        _write_json_atomic(self.summary_path, _json_safe(self._summary))
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
        readers such as :func:`read_wandb_run` or a job that copies the run directory.
        """
        sync_file = Path(run.settings.sync_file) if self.wandb_mode != "disabled" else None
        log_exists = sync_file is not None and sync_file.exists()
        run.finish(exit_code=exit_code)
        if log_exists and not _wait_for_exit_record(sync_file, self.WANDB_FLUSH_TIMEOUT_S):
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


def _write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON via a temp file + rename, so a crash leaves the old file or the new one, never half."""
    text = json.dumps(data, indent=2, allow_nan=False, sort_keys=True) + "\n"
    handle, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------
# reading metrics.jsonl
# --------------------------------------------------------------------------------------------


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (or of the metrics.jsonl in a run directory), in order.

    A last line that does not parse is skipped: it is the one a crash cut short. ``null`` values
    become ``nan`` (they were non-finite floats).

    Raises:
        ValueError: a line other than the last is not valid JSON (the file is corrupt).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                logger.debug("skipping truncated last line %d of %s", number, path)
                break
            raise ValueError(f"{path}:{number} is not valid JSON ({error}); the file is corrupt") from error
        rows.append({key: _nulls_to_nan(value) for key, value in row.items()})
    return rows


# --------------------------------------------------------------------------------------------
# reading W&B offline runs (the run-<id>.wandb transaction log)
# --------------------------------------------------------------------------------------------

# The .wandb file is a 7-byte W&B header followed by the LevelDB log format: 32 KiB blocks of
# chunks, each with a 7-byte header (CRC-32 of type byte + payload, little-endian uint32; length,
# uint16; type: 1 full, 2 first, 3 middle, 4 last). Each reassembled record is a serialized
# wandb.proto.wandb_internal_pb2.Record. wandb 0.31 writes it from Go (wandb-core) and ships no
# Python reader, so this is one.
_WANDB_HEADER = struct.Struct("<4sHB")
_WANDB_IDENT, _WANDB_MAGIC, _WANDB_VERSION = b":W&B", 0xBEE1, 0
_BLOCK_SIZE = 32 * 1024
_CHUNK_HEADER = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _iter_wandb_records(data: bytes, source: str, offset: int = 0) -> Iterator[bytes]:
    """Serialized Record messages from a .wandb file's bytes; a cut-off tail (live or crashed run) ends it.

    ``data`` starts at byte ``offset`` of the file: 0, or a block boundary to read only the tail
    (chunks never cross blocks, so a record's leftover middle/last chunks there are skipped).
    """
    if offset % _BLOCK_SIZE:
        raise ValueError(f"offset {offset} is not a multiple of the {_BLOCK_SIZE}-byte block size")
    position = 0
    if offset == 0:
        header = data[: _WANDB_HEADER.size]
        if len(header) < _WANDB_HEADER.size or _WANDB_HEADER.unpack(header) != (_WANDB_IDENT, _WANDB_MAGIC, _WANDB_VERSION):
            raise ValueError(f"{source} is not a W&B transaction log (header {header!r})")
        position = _WANDB_HEADER.size
    pending: bytearray | None = None
    skipping_leftover = offset > 0
    while True:
        left_in_block = _BLOCK_SIZE - position % _BLOCK_SIZE
        if left_in_block < _CHUNK_HEADER.size:  # block trailer padding
            position += left_in_block
            continue
        if position + _CHUNK_HEADER.size > len(data):
            return
        checksum, length, chunk_type = _CHUNK_HEADER.unpack_from(data, position)
        start = position + _CHUNK_HEADER.size
        payload = data[start : start + length]
        if chunk_type == 0 and length == 0:  # zeroed (preallocated) rest of a block
            position += left_in_block
            continue
        if len(payload) < length:
            return
        if zlib.crc32(payload, zlib.crc32(bytes([chunk_type]))) != checksum:
            if start + length >= len(data):
                return  # the last chunk was being written
            raise ValueError(f"{source}: checksum mismatch in the chunk at byte {offset + position}; the file is corrupt")
        position = start + length
        if chunk_type in (_FULL, _FIRST):
            skipping_leftover = False
        if chunk_type == _FULL:
            pending = None
            yield payload
        elif chunk_type == _FIRST:
            pending = bytearray(payload)
        elif chunk_type in (_MIDDLE, _LAST) and pending is not None:
            pending += payload
            if chunk_type == _LAST:
                yield bytes(pending)
                pending = None
        elif not (chunk_type in (_MIDDLE, _LAST) and skipping_leftover):
            raise ValueError(
                f"{source}: unexpected chunk type {chunk_type} at byte {offset + start - _CHUNK_HEADER.size}; "
                "the file is corrupt"
            )


def _has_exit_record(path: Path) -> bool:
    """Whether the end of a .wandb file holds the run's exit record (read from its last two blocks only)."""
    from wandb.proto import wandb_internal_pb2

    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            offset = max(0, (size // _BLOCK_SIZE - 1) * _BLOCK_SIZE)
            file.seek(offset)
            data = file.read()
    except FileNotFoundError:
        return False
    for raw in _iter_wandb_records(data, str(path), offset):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "exit":
            return True
    return False


def _wait_for_exit_record(path: Path, timeout_s: float) -> bool:
    """Poll until W&B has written the exit record; ``run.finish()`` can return before wandb-core does."""
    deadline = time.monotonic() + timeout_s
    while not _has_exit_record(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@dataclass
class WandbRun:
    """What an offline W&B run recorded, read back from its transaction log."""

    path: Path
    run_id: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    """None when the run never finished (killed, or still running)."""


def find_wandb_run_file(path: str | os.PathLike) -> Path:
    """The one ``run-*.wandb`` file of a run directory, its ``wandb/`` folder, a run folder, or the file itself.

    Raises:
        FileNotFoundError: none found.
        ValueError: several runs found (pass the one you mean).
    """
    path = Path(path)
    if path.is_file():
        return path
    patterns = ("run-*.wandb", "*/run-*.wandb", "wandb/*/run-*.wandb")
    # resolve() folds wandb/latest-run (a symlink) into the run folder it points at
    found = sorted({file.resolve() for pattern in patterns for file in path.glob(pattern)})
    if not found:
        raise FileNotFoundError(f"no W&B run file (run-*.wandb) under {path}")
    if len(found) > 1:
        listing = "\n  ".join(str(file) for file in found)
        raise ValueError(f"several W&B runs under {path}; pass one of:\n  {listing}")
    return found[0]


def _item_path(item) -> list[str]:
    return list(item.nested_key) if item.nested_key else [item.key]


def _set_path(target: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        child = target.get(key)
        if not isinstance(child, dict):
            child = target[key] = {}
        target = child
    target[keys[-1]] = value


def _remove_path(target: dict, keys: list[str]) -> None:
    for key in keys[:-1]:
        target = target.get(key)
        if not isinstance(target, dict):
            return
    target.pop(keys[-1], None)


def read_wandb_run(path: str | os.PathLike) -> WandbRun:
    """Read an offline (or online) W&B run's ``run-<id>.wandb`` file, without any network.

    History rows are ``{key: value}`` with W&B's own ``_step``, ``_runtime`` and ``_timestamp``;
    a histogram reads back as ``{"_type": "histogram", "values": counts, "bins": edges}``. The
    summary is every summary update of the run applied in order (W&B's last-value summary plus
    what :meth:`Tracker.summary` set).
    """
    from wandb.proto import wandb_internal_pb2

    file = find_wandb_run_file(path)
    run = WandbRun(path=file)

    def apply_summary(summary_record) -> None:
        for item in summary_record.update:
            _set_path(run.summary, _item_path(item), json.loads(item.value_json))
        for item in summary_record.remove:
            _remove_path(run.summary, _item_path(item))

    for raw in _iter_wandb_records(file.read_bytes(), str(file)):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _set_path(row, _item_path(item), json.loads(item.value_json))
            run.history.append(row)
        elif kind == "summary":
            apply_summary(record.summary)
        elif kind == "run":
            run.run_id = record.run.run_id
            for item in record.run.config.update:
                _set_path(run.config, _item_path(item), json.loads(item.value_json))
            apply_summary(record.run.summary)
        elif kind == "config":
            for item in record.config.update:
                _set_path(run.config, _item_path(item), json.loads(item.value_json))
            for item in record.config.remove:
                _remove_path(run.config, _item_path(item))
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def read_wandb_history(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The history rows W&B wrote for a run (see :func:`read_wandb_run`)."""
    return read_wandb_run(path).history


def read_wandb_summary(path: str | os.PathLike) -> dict[str, Any]:
    """The final W&B summary of a run (see :func:`read_wandb_run`)."""
    return read_wandb_run(path).summary


# --------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------


def _log2_ticks(ks: list[int], max_powers: int = 12, min_gap_log2: float = 0.3) -> list[int]:
    """x ticks: the powers of two over the k range, plus other ks (e.g. n = 1000) that do not
    crowd a tick already there, so labels never overlap."""
    low, high = math.floor(math.log2(ks[0])), math.floor(math.log2(ks[-1]))
    exponents = list(range(low, high + 1))
    stride = math.ceil(len(exponents) / max_powers)
    ticks = [2**e for e in exponents[::stride]]
    for k in ks:
        if all(abs(math.log2(k) - math.log2(tick)) >= min_gap_log2 for tick in ticks):
            ticks.append(k)
    return sorted(ticks)


def _pass_at_k_point(label: str, point: Any) -> tuple[int, float, float, float]:
    if all(hasattr(point, name) for name in ("k", "mean", "ci_low", "ci_high")):
        point = (point.k, point.mean, point.ci_low, point.ci_high)
    try:
        k, mean, ci_low, ci_high = point
        return int(k), float(mean), float(ci_low), float(ci_high)
    except (TypeError, ValueError) as error:
        raise ValueError(f"curve {label!r}: a point must be (k, mean, ci_low, ci_high), got {point!r}") from error


def plot_pass_at_k(
    curves: Mapping[str, Sequence[tuple[int, float, float, float]]],
    path: str | os.PathLike,
    *,
    title: str,
) -> None:
    """Save a PNG of pass@k against k (log2 axis), one line per label with a shaded CI band.

    Args:
        curves: label (e.g. "before training", "after training", a dataset) -> points, each a
            ``(k, mean, ci_low, ci_high)`` tuple or a :class:`fgrpo.metrics.PassAtK`, so
            ``pass_at_k_curve(...)`` can be passed as is.
        path: the PNG to write; its folder is created.
        title: the figure title.
    """
    from matplotlib.figure import Figure  # no pyplot: no global backend or display involved
    from matplotlib.ticker import FixedLocator, NullLocator

    if not curves:
        raise ValueError("plot_pass_at_k needs at least one curve")
    parsed = {}
    for label, points in curves.items():
        rows = sorted(_pass_at_k_point(label, point) for point in points)
        if not rows:
            raise ValueError(f"curve {label!r} has no points")
        if rows[0][0] < 1:
            raise ValueError(f"curve {label!r} has k={rows[0][0]}; k must be >= 1 for a log2 axis")
        parsed[label] = rows

    figure = Figure(figsize=(7, 4.5), dpi=150, layout="constrained")
    axes = figure.add_subplot()
    all_ks = sorted({k for rows in parsed.values() for k, *_ in rows})
    for label, rows in parsed.items():
        ks, means, lows, highs = (list(column) for column in zip(*rows))
        (line,) = axes.plot(ks, means, marker="o", markersize=4, linewidth=1.8, label=label)
        axes.fill_between(ks, lows, highs, color=line.get_color(), alpha=0.18, linewidth=0)

    ticks = _log2_ticks(all_ks)
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_locator(FixedLocator(ticks))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.set_xticklabels([str(k) for k in ticks])
    if len(all_ks) > 1:
        axes.set_xlim(all_ks[0] / 1.15, all_ks[-1] * 1.15)
    axes.set_ylim(0.0, 1.02)
    axes.set_xlabel("k (samples per problem)")
    axes.set_ylabel("pass@k")
    axes.set_title(title)
    axes.grid(True, which="major", alpha=0.35)
    axes.legend(loc="lower right", frameon=True)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
