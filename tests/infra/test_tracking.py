"""Tracker, metrics.jsonl and W&B offline files: real wandb (offline, never a server), no mocks
except where a fault cannot be caused otherwise."""

import json
import logging
import math
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("wandb")
pytest.importorskip("matplotlib")

from fgrpo.evaluation.plots import plot_pass_at_k  # noqa: E402
from fgrpo.infra.tracking import Tracker, resolve_wandb_mode  # noqa: E402
from fgrpo.infra.run_files import read_metrics
from wandb_files import find_wandb_run_file, read_wandb_history, read_wandb_run, read_wandb_summary  # noqa: E402

# Small runs: no system-stats sampler process per run.
FAST = {"x_disable_stats": True, "x_save_requirements": False}


@pytest.fixture(autouse=True, scope="module")
def offline_wandb(tmp_path_factory):
    """Keep W&B offline and out of $HOME; an unreachable base URL makes any contact fail fast.

    Module-scoped: wandb reads these once, when its service starts with the first run.
    """
    home = tmp_path_factory.mktemp("wandb_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
        patch.delenv("WANDB_API_KEY", raising=False)
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            patch.setenv(var, str(home / var.lower()))
        yield


def fgrpo_warnings(caplog):
    return [r for r in caplog.records if r.name == "fgrpo" and r.levelno >= logging.WARNING]


def assert_no_bare_nan(path):
    """Every JSON document in the file (one per line for .jsonl) parses without NaN/Infinity."""

    def reject(constant):
        raise AssertionError(f"{path} holds {constant}, which is not valid JSON")

    documents = path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]
    for document in documents:
        json.loads(document, parse_constant=reject)


STEPS = [
    {"eval/pass@1": 0.25, "eval/pass@4": 0.5, "train/reward_mean": 0.125, "train/group_success": [0.0, 0.5, 1.0, 1.0]},
    {"eval/pass@1": 0.375, "eval/pass@4": 0.625, "train/reward_mean": 0.25, "train/group_success": [0.25, 0.25, 0.75]},
    {"eval/pass@1": 0.5, "eval/pass@4": 0.75, "train/reward_mean": 0.5, "train/group_success": [1.0, 1.0, 1.0, 0.0, 0.5]},
]


def test_wandb_offline_values_reach_wandb_files_and_jsonl(tmp_path, caplog):
    # A 100 kB config entry makes the run record span several 32 KiB blocks of the .wandb log,
    # so reading it back exercises the first/middle/last chunk reassembly.
    config = {"algo": "grpo", "lr": 1e-5, "notes": "x" * 100_000}
    plot = tmp_path / "plots" / "pass_at_k.png"
    plot_pass_at_k({"before training": [(1, 0.2, 0.1, 0.3), (2, 0.3, 0.2, 0.4)]}, plot, title="pass@k")

    with caplog.at_level(logging.WARNING, logger="fgrpo"):
        tracker = Tracker(tmp_path, mode="offline", name="t", group="g", tags=["test"], config=config, wandb_settings=FAST)
        assert tracker.wandb_active
        for step, metrics in enumerate(STEPS):
            tracker.log(metrics, step=step)
        tracker.log_image("eval/pass_at_k_plot", plot, step=2)
        tracker.summary({"final/pass@1": 0.5, "final/nan_metric": float("nan")})
        tracker.close()  # returns only once W&B's file holds the exit record
        tracker.close()  # idempotent
    assert fgrpo_warnings(caplog) == []

    run = read_wandb_run(tmp_path)
    assert run.exit_code == 0
    assert run.config["algo"] == "grpo" and run.config["lr"] == 1e-5 and run.config["notes"] == config["notes"]
    assert [row["_step"] for row in run.history] == [0, 1, 2]
    for row, metrics in zip(run.history, STEPS):
        for key in ("eval/pass@1", "eval/pass@4", "train/reward_mean"):
            assert row[key] == metrics[key]
        histogram = row["train/group_success"]
        assert histogram["_type"] == "histogram"
        assert sum(histogram["values"]) == len(metrics["train/group_success"])
        assert histogram["bins"][0] == min(metrics["train/group_success"])
        assert histogram["bins"][-1] == max(metrics["train/group_success"])
    assert run.history[2]["eval/pass_at_k_plot"]["_type"] == "image-file"
    assert "eval/pass_at_k_plot" not in run.history[1]
    assert read_wandb_history(tmp_path) == run.history

    summary = read_wandb_summary(tmp_path)
    assert summary["final/pass@1"] == 0.5
    assert summary["final/nan_metric"] is None  # wandb 0.31 stores a non-finite summary value as null
    assert summary["eval/pass@1"] == 0.5  # W&B's own last-value summary

    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    for step, (row, metrics) in enumerate(zip(rows, STEPS)):
        assert row["step"] == step and row["time"] > 1e9
        assert {k: v for k, v in row.items() if k not in ("step", "time")} == metrics
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final/nan_metric": None, "final/pass@1": 0.5}
    assert_no_bare_nan(tmp_path / "summary.json")


def test_wandb_log_failure_warns_once_and_jsonl_keeps_everything(tmp_path, monkeypatch, caplog):
    plot = tmp_path / "plot.png"
    plot_pass_at_k({"a": [(1, 0.5, 0.4, 0.6)]}, plot, title="t")
    tracker = Tracker(tmp_path, mode="offline", wandb_settings=FAST)
    tracker.log({"train/loss": 1.0}, step=0)

    def broken_log(*args, **kwargs):  # a W&B fault (service died, disk full) cannot be caused here
        raise ConnectionError("wandb-core went away")

    monkeypatch.setattr(tracker.wandb_run, "log", broken_log)
    with caplog.at_level(logging.DEBUG, logger="fgrpo"):
        for step in range(1, 4):
            tracker.log({"train/loss": 1.0 / (step + 1)}, step=step)
        tracker.log_image("plot", plot, step=3)
        tracker.summary({"final/loss": 0.25})
        tracker.close()

    warnings = fgrpo_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "ConnectionError" in warnings[0].getMessage() and "metrics.jsonl" in warnings[0].getMessage()
    assert not tracker.wandb_active
    assert [row["train/loss"] for row in read_metrics(tmp_path)] == [1.0, 0.5, 1.0 / 3, 0.25]
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final/loss": 0.25}
    run = read_wandb_run(tmp_path)
    assert [row["train/loss"] for row in run.history] == [1.0]  # what W&B got before the fault
    assert run.exit_code == 0  # and the run was still finished cleanly


def test_wandb_init_failure_warns_once_and_runs_on(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="fgrpo"):
        tracker = Tracker(tmp_path, mode="offline", wandb_settings={"console": "not-a-console-mode"})
        tracker.log({"a": 1}, step=0)
        tracker.close(exit_code=1)
    assert len(fgrpo_warnings(caplog)) == 1
    assert "wandb.init failed" in fgrpo_warnings(caplog)[0].getMessage()
    assert tracker.wandb_run is None
    assert [(row["step"], row["a"]) for row in read_metrics(tmp_path)] == [(0, 1)]


def test_wandb_not_importable_warns_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with caplog.at_level(logging.WARNING, logger="fgrpo"):
        with Tracker(tmp_path) as tracker:
            tracker.log({"a": 1.5}, step=0)
    assert len(fgrpo_warnings(caplog)) == 1
    assert "not importable" in fgrpo_warnings(caplog)[0].getMessage()
    assert read_metrics(tmp_path)[0]["a"] == 1.5
    assert not (tmp_path / "wandb").exists()


def test_backend_none_writes_jsonl_only(tmp_path, caplog):
    plot = tmp_path / "plot.png"
    plot_pass_at_k({"a": [(1, 0.5, 0.4, 0.6)]}, plot, title="t")
    with caplog.at_level(logging.WARNING, logger="fgrpo"):
        with Tracker(tmp_path / "run", backend="none") as tracker:
            tracker.log({"train/loss": np.float32(0.5), "n": np.int64(3), "hist": np.array([0.1, 0.2])}, step=0)
            tracker.log_histogram("hist2", (0.5, 1.0), step=1)
            tracker.log_image("plot", plot, step=1)
            with pytest.raises(FileNotFoundError, match="missing.png"):
                tracker.log_image("plot", tmp_path / "missing.png", step=1)
            tracker.summary({"final": 1})
    assert fgrpo_warnings(caplog) == []
    assert tracker.wandb_run is None and tracker.closed
    assert not (tmp_path / "run" / "wandb").exists()
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["train/loss"] == 0.5 and rows[0]["n"] == 3 and isinstance(rows[0]["n"], int)
    assert rows[0]["hist"] == pytest.approx([0.1, 0.2])
    assert rows[1]["hist2"] == [0.5, 1.0] and rows[1]["step"] == 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"final": 1}


def test_exception_in_context_propagates_keeps_lines_and_finishes_wandb_as_failed(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with Tracker(tmp_path, mode="offline", wandb_settings=FAST) as tracker:
            tracker.log({"train/loss": 2.0}, step=0)
            tracker.log({"train/loss": 1.0}, step=1)
            1 / 0
    assert tracker.closed
    assert [row["train/loss"] for row in read_metrics(tmp_path)] == [2.0, 1.0]
    run = read_wandb_run(tmp_path)
    assert run.exit_code == 1
    assert [row["train/loss"] for row in run.history] == [2.0, 1.0]
    with pytest.raises(RuntimeError, match="closed"):
        tracker.log({"a": 1}, step=2)


def test_non_finite_floats_are_valid_json_and_read_back_as_nan(tmp_path):
    with Tracker(tmp_path, backend="none") as tracker:
        tracker.log({"nan": float("nan"), "inf": float("inf"), "hist": [1.0, float("-inf")]}, step=0)
    assert_no_bare_nan(tmp_path / "metrics.jsonl")
    assert '"nan": null' in (tmp_path / "metrics.jsonl").read_text()
    row = read_metrics(tmp_path)[0]
    assert math.isnan(row["nan"]) and math.isnan(row["inf"])
    assert row["hist"][0] == 1.0 and math.isnan(row["hist"][1])


def test_read_metrics_tolerates_truncated_last_line_and_tracker_cuts_it_before_appending(tmp_path, caplog):
    with Tracker(tmp_path, backend="none") as tracker:
        tracker.log({"a": 1}, step=0)
        tracker.log({"a": 2}, step=1)
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as file:
        file.write('{"step": 2, "time": 17000')  # a crash mid-write
    assert [row["a"] for row in read_metrics(path)] == [1, 2]

    with caplog.at_level(logging.WARNING, logger="fgrpo"):
        with Tracker(tmp_path, backend="none") as tracker:  # a resumed run appends to the same file
            tracker.log({"a": 3}, step=2)
    assert "partial line" in fgrpo_warnings(caplog)[0].getMessage()
    assert [row["a"] for row in read_metrics(path)] == [1, 2, 3]




def test_read_wandb_run_tolerates_a_cut_off_tail(tmp_path):
    with Tracker(tmp_path / "run", mode="offline", wandb_settings=FAST) as tracker:
        for step in range(5):
            tracker.log({"a": float(step)}, step=step)
    original = find_wandb_run_file(tmp_path / "run")
    cut = tmp_path / "cut.wandb"
    data = original.read_bytes()
    cut.write_bytes(data[: len(data) - 20])  # e.g. a live or killed run
    run = read_wandb_run(cut)
    assert [row["a"] for row in run.history] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert run.exit_code is None
    second_run = tmp_path / "run" / "wandb" / "offline-run-20990101_000000-second"
    second_run.mkdir()
    shutil.copy(original, second_run / "run-second.wandb")
    with pytest.raises(ValueError, match="several W&B runs"):
        read_wandb_run(tmp_path / "run")
    assert read_wandb_run(second_run).history == read_wandb_run(original).history
    (tmp_path / "bogus").mkdir()
    (tmp_path / "bogus" / "run-x.wandb").write_bytes(b"not a wandb file")
    with pytest.raises(ValueError, match="not a W&B transaction log"):
        read_wandb_run(tmp_path / "bogus")
    with pytest.raises(FileNotFoundError):
        read_wandb_run(tmp_path / "nothing-here")


def test_invalid_arguments_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="wandb, none"):
        Tracker(tmp_path, backend="tensorboard")
    with pytest.raises(ValueError, match="offline, online"):
        Tracker(tmp_path, mode="onlin")
    with Tracker(tmp_path, backend="none") as tracker:
        with pytest.raises(TypeError, match="'train/text'"):
            tracker.log({"train/text": "hello"}, step=0)
        with pytest.raises(TypeError, match="'nested'"):
            tracker.log({"nested": [[1.0]]}, step=0)
        for key in ("step", "time", "_step", ""):
            with pytest.raises(ValueError, match="key"):
                tracker.log({key: 1.0}, step=0)
        for step in (-1, 1.5, True, None):
            with pytest.raises(ValueError, match="step"):
                tracker.log({"a": 1.0}, step=step)
    assert not (tmp_path / "metrics.jsonl").read_text()  # nothing half-logged


def test_wandb_mode_defaults_to_offline_unless_env_or_argument(monkeypatch):
    monkeypatch.delenv("WANDB_MODE")
    assert resolve_wandb_mode(None) == "offline"
    assert resolve_wandb_mode("online") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode(None) == "disabled"
    assert resolve_wandb_mode("offline") == "offline"
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ValueError, match=r"\$WANDB_MODE='bogus'"):
        resolve_wandb_mode(None)
