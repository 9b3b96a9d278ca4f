"""fgrpo.infra.run_files: the JSON-lines files a run appends to (a cut-off last line tolerated, corruption before it
refused) and the rows a resumed run supersedes."""

import json

import pytest

from fgrpo.infra.run_files import SUPERSEDED_FILE, read_metrics, supersede_rows_after


def test_read_metrics_rejects_corruption_before_the_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(path)


def test_rows_after_the_checkpoint_move_aside_and_a_half_line_with_them(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "train/loss": float(s)} for s in (0, 1, 2, 3, 4)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "tra')
    assert supersede_rows_after(metrics, 2) == 3
    assert [r["step"] for r in read_metrics(metrics)] == [0, 1, 2]
    moved = (tmp_path / SUPERSEDED_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in moved[:2]] == [3, 4] and moved[2] == '{"step": 5, "tra'


def test_a_config_saved_before_reward_functions_reads_in_todays_keys():
    from fgrpo.config import experiment_differences
    from fgrpo.infra.run_files import upgraded_config

    old = {"seed": 0, "dataset": {"name": "arithmetic", "verifier": "numeric", "verifier_timeout_s": 5.0,
                                  "verifier_workers": "auto"}}
    new = {"seed": 0, "dataset": {"name": "arithmetic", "rewards": [{"fn": "numeric", "name": None, "weight": 1.0,
                                                                     "verdict": False, "threshold": 1.0,
                                                                     "kwargs": None}],
                                  "reward_timeout_s": 5.0, "reward_workers": "auto", "prompt_template": None}}
    assert upgraded_config(old)["dataset"] == {k: v for k, v in new["dataset"].items() if k != "prompt_template"}
    assert experiment_differences(old, new) == []  # a checkpoint of an older run resumes
    changed = {**new, "dataset": {**new["dataset"], "rewards": [{**new["dataset"]["rewards"][0], "fn": "math"}]}}
    assert experiment_differences(old, changed) == [
        "dataset.rewards: [{'fn': 'numeric', 'name': None, 'weight': 1.0, 'verdict': False, 'threshold': 1.0, "
        "'kwargs': None}] -> [{'fn': 'math', 'name': None, 'weight': 1.0, 'verdict': False, 'threshold': 1.0, "
        "'kwargs': None}]"]
    assert upgraded_config(new) == new
    # before 2026-12-03 every built-in method's parameters were saved, used or not: only the chosen one's count
    saved = {"advantage": {"name": "passk", "k": 2, "beta": 0.25, "lam": 0.1}}
    assert upgraded_config(saved)["advantage"] == {"name": "passk", "k": 2, "beta": None, "lam": None}


def test_an_unset_lr_saved_before_2026_12_01_is_the_1e_5_it_meant():
    from fgrpo.infra.run_files import upgraded_config

    assert upgraded_config({"trainer": {"lr": None}, "model": {}})["trainer"]["lr"] == 1e-5
    assert upgraded_config({"trainer": {"lr": None}, "model": {"lora": {"rank": None}}})["trainer"]["lr"] == 1e-5
    assert upgraded_config({"trainer": {"lr": 3e-6}})["trainer"]["lr"] == 3e-6
    lora = {"trainer": {"lr": None}, "model": {"lora": {"rank": 8}}}  # LoRA's default (2e-4) is what it was
    assert upgraded_config(lora)["trainer"]["lr"] is None
