"""Read an offline W&B run back from its ``run-<id>.wandb`` file, without any network, so tests can check what
reached W&B (wandb 0.31 ships no Python reader for it; the record framing is :func:`fgrpo.infra.wandb_file.iter_records`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fgrpo.infra.wandb_file import iter_records


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
    what :meth:`fgrpo.infra.tracking.Tracker.summary` set).
    """
    from wandb.proto import wandb_internal_pb2

    file = find_wandb_run_file(path)
    run = WandbRun(path=file)

    def apply_summary(summary_record) -> None:
        for item in summary_record.update:
            _set_path(run.summary, _item_path(item), json.loads(item.value_json))
        for item in summary_record.remove:
            _remove_path(run.summary, _item_path(item))

    for raw in iter_records(file.read_bytes(), str(file)):
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
