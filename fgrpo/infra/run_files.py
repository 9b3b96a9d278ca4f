"""The files of a run directory: their names (defined here once) and the few ways this project writes and reads them:
atomic replacement (a crash leaves the old file or the new one), append-only JSON lines whose last line a crash may
cut short, the rows a resumed run supersedes, and a saved config in today's keys (upgraded_config).

    RUN_DIR/
      .hydra/config.yaml      the composed config, rewritten with what the run settled (SAVED_CONFIG)
      metrics.jsonl           one row per logged step (METRICS_FILE); metrics_superseded.jsonl beside it
      eval_counts.jsonl       per-problem correct counts of each evaluation (COUNTS_FILE)
      summary.json            the final numbers (SUMMARY_FILE)
      pass_at_k.png           the pass@k curves (PASS_AT_K_PLOT)
      checkpoints/step_N/     fgrpo.infra.checkpoint (CHECKPOINTS)
      final_model/            the final weights as an HF folder, with trainer.save_final (FINAL_MODEL)
      replaced-<time>/        a previous run's files, moved aside by trainer.resume=false (REPLACED_PREFIX)
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("fgrpo")

METRICS_FILE = "metrics.jsonl"
COUNTS_FILE = "eval_counts.jsonl"
SUMMARY_FILE = "summary.json"
SUPERSEDED_FILE = "metrics_superseded.jsonl"
PASS_AT_K_PLOT = "pass_at_k.png"
CHECKPOINTS = "checkpoints"
FINAL_MODEL = "final_model"
SAVED_CONFIG = Path(".hydra") / "config.yaml"
REPLACED_PREFIX = "replaced-"


def nulls_to_nan(value: Any) -> Any:
    """Undo fgrpo.infra.tracking's JSON-safe writing: null (a non-finite float) becomes nan."""
    if value is None:
        return math.nan
    if isinstance(value, list):
        return [nulls_to_nan(v) for v in value]
    return value


def supersede_rows_after(path: Path, last_step: int) -> int:
    """Keep in the jsonl file ``path`` (metrics.jsonl, eval_counts.jsonl) the rows up to ``last_step``; move later
    ones (and a half-written last line) to ``<stem>_superseded.jsonl`` beside it (metrics_superseded.jsonl), so
    nothing logged is lost. The file is replaced atomically. Returns how many rows moved."""
    if not path.exists():
        return 0
    kept, moved = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            row_step = json.loads(line)["step"] if line.endswith("\n") else None
        except (ValueError, KeyError, TypeError):
            row_step = None
        (kept if row_step is not None and row_step <= last_step else moved).append(line)
    if moved:
        superseded_path = path.with_name(f"{path.stem}_superseded.jsonl")
        with open(superseded_path, "a", encoding="utf-8") as superseded:
            superseded.writelines(line if line.endswith("\n") else line + "\n" for line in moved)
        write_text_atomic(path, "".join(kept))
        log.info("%s: %d rows after step %d moved to %s", path, len(moved), last_step, superseded_path.name)
    return len(moved)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, allow_nan=False, sort_keys=True) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` via a fsynced temp file + rename, so a crash leaves the old file or the new one, never half."""
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
    return [{key: nulls_to_nan(value) for key, value in row.items()} for _, row in read_jsonl(path)]


def read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """``(line number, parsed value)`` of each non-blank line of a JSON-lines file that this project appends to
    (metrics.jsonl, eval_counts.jsonl). A last line that does not parse is skipped: a crash cut it short.

    Raises:
        ValueError: a line other than the last is not valid JSON (the file is corrupt).
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as error:
            if number == len(lines):
                log.debug("skipping truncated last line %d of %s", number, path)
                break
            raise ValueError(f"{path}:{number} is not valid JSON ({error}); the file is corrupt") from error
    return rows


# what an unset trainer.lr meant for every weight until 2026-12-01 (DEFAULT_LR then); runs since save the lr they ran
LR_UNSET_BEFORE_2026_12_01 = 1e-5


def upgraded_config(saved: dict) -> dict:
    """A config saved by an older fgrpo in today's keys: ``dataset.verifier: <kind>`` (before 2026-12-01) is the
    one-entry ``dataset.rewards`` list of that built-in check, ``verifier_timeout_s`` and ``verifier_workers`` are
    ``reward_timeout_s`` and ``reward_workers``; an unset ``trainer.lr`` without LoRA is the 1e-5 it meant then (the
    LoRA default has not moved); a reward entry without ``kwargs`` (before 2026-12-03) has none; and an ``advantage``
    parameter of a built-in method other than the one the run chose is unset (before 2026-12-03 every built-in
    method's parameters were saved with their defaults, used or not)."""
    trainer = saved.get("trainer") or {}
    lora_rank = ((saved.get("model") or {}).get("lora") or {}).get("rank")
    if "lr" in trainer and trainer["lr"] is None and lora_rank is None:
        saved = {**saved, "trainer": {**trainer, "lr": LR_UNSET_BEFORE_2026_12_01}}
    saved = _unused_advantage_params_unset(saved)
    dataset = dict(saved.get("dataset") or {})
    if "verifier" in dataset:
        dataset["rewards"] = [{"fn": dataset.pop("verifier"), "name": None, "weight": 1.0, "verdict": False,
                               "threshold": 1.0}]
        for old, new in (("verifier_timeout_s", "reward_timeout_s"), ("verifier_workers", "reward_workers")):
            if old in dataset:
                dataset[new] = dataset.pop(old)
    if isinstance(dataset.get("rewards"), list):
        dataset["rewards"] = [{**entry, "kwargs": entry.get("kwargs")} if isinstance(entry, dict) else entry
                              for entry in dataset["rewards"]]
    return {**saved, "dataset": dataset} if dataset else saved


def _unused_advantage_params_unset(saved: dict) -> dict:
    advantage = saved.get("advantage")
    if not isinstance(advantage, dict):
        return saved
    from fgrpo.algorithm.advantage_methods import methods

    known = methods()
    chosen = known.get(advantage.get("name"))
    if chosen is None:  # a user's method by path: what it was given is what it ran with
        return saved
    built_in = {param for method in known.values() for param in method.params}
    unset = {key: None for key in advantage if key in built_in and key not in chosen.params}
    return {**saved, "advantage": {**advantage, **unset}}
