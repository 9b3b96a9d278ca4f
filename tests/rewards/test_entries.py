"""fgrpo.rewards.entries: ``dataset.rewards`` checked before anything loads: forms, names, weights, one verdict."""

import pytest

from fgrpo.infra.errors import ConfigError
from fgrpo.rewards.entries import BUILTINS, reward_entries, verdict_entry


def test_one_built_in_entry_is_its_own_verdict():
    (entry,) = reward_entries([{"fn": "numeric"}])
    assert (entry.name, entry.target, entry.weight, entry.verdict, entry.threshold) == (
        "numeric", BUILTINS["numeric"], 1.0, True, 1.0)
    assert entry.builtin and entry.in_process
    (math,) = reward_entries([{"fn": "math"}])
    assert math.builtin and not math.in_process  # the pool's, where reward_workers > 1


def test_a_users_file_is_made_absolute_and_named_after_its_function(tmp_path, monkeypatch):
    (tmp_path / "task.py").write_text("def score(completion):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    first, second = reward_entries([{"fn": "task.py:score", "verdict": True},
                                    {"fn": "pkg.rewards:compute_score", "weight": 0.5, "name": "fmt"}])
    assert first.target == f"{tmp_path / 'task.py'}:score" and first.name == "score" and not first.builtin
    assert second.target == "pkg.rewards:compute_score" and second.name == "fmt" and second.weight == 0.5
    assert verdict_entry([first, second]) is first


@pytest.mark.parametrize("entries, message", [
    ([], "dataset.rewards is empty"),
    ([{"fn": "exact"}], r"dataset.rewards\[0\].fn='exact': not a built-in check \(numeric, math\)"),
    ([{"fn": "no_such_file.py:score"}], r"the file .*no_such_file.py does not exist"),
    ([{"fn": "task.py:"}], "name a function as"),
    ([{"fn": "numeric"}, {"fn": "numeric", "verdict": True}], r"dataset.rewards\[0\], dataset.rewards\[1\] are all "
                                                              "named 'numeric'"),
    ([{"fn": "numeric"}, {"fn": "math"}], "has 2 entries and none is marked verdict: true"),
    ([{"fn": "numeric", "verdict": True}, {"fn": "math", "verdict": True}], "are all marked verdict: true"),
    ([{"fn": "numeric", "weight": float("nan")}], r"dataset.rewards\[0\].weight=nan: must be a finite number"),
    ([{"fn": "numeric", "weight": float("inf")}], r"weight=inf: must be a finite number"),
    ([{"fn": "numeric", "name": "a/b"}], r"name='a/b': use letters"),
])
def test_bad_entries_name_the_key_and_the_fix(entries, message):
    with pytest.raises(ConfigError, match=message):
        reward_entries(entries)


def test_every_problem_is_listed_together():
    with pytest.raises(ConfigError) as caught:
        reward_entries([{"fn": "exact"}, {"fn": "numeric", "weight": float("nan")}, {"fn": "math"}])
    assert str(caught.value).count("\n  ") == 3  # the unknown check, the weight, the missing verdict
