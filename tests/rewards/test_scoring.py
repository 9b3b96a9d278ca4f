"""fgrpo.rewards.scoring: a user's reward functions, from a file outside the package, run through the real pool (spawned
workers that import the file by its path): every convention, weights and the one verdict, faults, skips."""

import textwrap

import pytest

from fgrpo.infra.errors import ConfigError, RewardError
from fgrpo.rewards.binding import sample_view
from fgrpo.rewards.entries import reward_entries
from fgrpo.rewards.scoring import Scorer

# written in each stack's shape (our own code): fgrpo's per-sample function, verl's compute_score, TRL's batch function
REWARDS = '''
import asyncio, os, signal, time

def exact(completion, answer):
    return {"score": float(completion.strip() == answer), "correct": completion.strip() == answer,
            "chars": len(completion)}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "toy" and extra_info["level"] in (1, 2)
    return {"score": 1.0 if ground_truth in solution_str else -1.0, "level": extra_info["level"]}

def accuracy(prompts, completions, solution, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(s in t) for s, t in zip(solution, texts)]

async def polite(completion):
    await asyncio.sleep(0)
    return 0.5 if "please" in completion else 0.0

def short(completion_ids):
    return 1.0 if len(completion_ids) <= 2 else 0.0

def fragile(completion):
    if "crash" in completion:
        os._exit(3)
    if "hang" in completion:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    if "slow" in completion:
        time.sleep(3600)
    if "bug" in completion:
        raise ValueError("a bug")
    return 1.0

def undecided(completion):
    return None if "?" in completion else 1.0

def broken(completion):
    return {}["missing"]
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user_task") / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def views(completions: list[str], answers: list[str], level: int = 1) -> list[dict]:
    return [sample_view(completion=c, completion_ids=list(range(len(c.split()))), prompt="Say it.", answer=a,
                        source="toy", fields={"solution": a, "level": level}, timeout_s=1.0)
            for c, a in zip(completions, answers)]


def scorer(reward_file, *entries: dict, workers: int = 2, timeout_s: float = 1.0, **chat) -> Scorer:
    made = Scorer(reward_entries([{**e, "fn": f"{reward_file}:{e['fn']}"} for e in entries]), workers=workers,
                  timeout_s=timeout_s, **chat)
    made.describe()
    made.check_columns({"solution", "level"})
    return made


def test_every_convention_weighted_with_one_verdict(reward_file):
    made = scorer(reward_file, {"fn": "exact", "verdict": True}, {"fn": "compute_score", "weight": 0.5},
                  {"fn": "accuracy", "weight": 0.25}, {"fn": "polite", "weight": 2.0}, {"fn": "short", "weight": 0},
                  conversational=True)
    try:
        batch = made.score(views(["4", "4 please", "5 5 5"], ["4", "4", "4"]))
        assert made.pool.pids and not made.pool.in_process  # a user's code ran in workers
    finally:
        made.close()
    assert batch.correct == [1.0, 0.0, 0.0]  # exact's "correct", not the weighted sum
    assert batch.values["exact"] == [1.0, 0.0, 0.0] and batch.values["exact/chars"] == [1.0, 8.0, 5.0]
    assert batch.values["compute_score"] == [1.0, 1.0, -1.0] and batch.values["compute_score/level"] == [1.0] * 3
    assert batch.values["accuracy"] == [1.0, 1.0, 0.0]  # TRL's chat form, then the solution column by name
    assert batch.values["polite"] == [0.0, 0.5, 0.0] and batch.values["short"] == [1.0, 1.0, 0.0]
    assert batch.rewards == [1 + 0.5 + 0.25, 0 + 0.5 + 0.25 + 1.0, 0 - 0.5 + 0]
    assert batch.errors == 0 and batch.skipped == [False] * 3


def test_a_score_over_the_threshold_is_the_verdict(reward_file):
    made = scorer(reward_file, {"fn": "compute_score", "verdict": True, "threshold": 0.5}, workers=1)
    try:
        assert made.score(views(["4", "5"], ["4", "4"])).correct == [1.0, 0.0]
        assert len(made.pool.pids) == 1  # one worker: still out of the trainer's process
    finally:
        made.close()


def test_crashes_hangs_and_bugs_cost_their_sample_and_are_counted(reward_file, caplog):
    made = scorer(reward_file, {"fn": "fragile"}, timeout_s=0.5)
    made.pool.stuck_margin_s = 0.5
    try:
        first = made.score(views(["ok", "fine"], ["x", "x"]))  # the first batch works: later faults are counted
        assert first.rewards == [1.0, 1.0]
        batch = made.score(views(["crash", "hang", "slow", "bug", "ok"], ["x"] * 5))
        again = made.score(views(["bug", "ok"], ["x", "x"]))
    finally:
        made.close()
    assert batch.rewards == [0.0, 0.0, 0.0, 0.0, 1.0] and batch.correct == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert batch.errors == 4 and again.errors == 1 and again.rewards == [0.0, 1.0]
    assert made.pool.counters == {"worker_deaths": 1, "stuck_workers_killed": 1}  # the slow one: its own time limit
    # by kind: the crash died, the hang (SIGALRM blocked) was killed past its limit, the slow one hit it, the bug raised
    assert batch.failures["fragile"] == {"died": 1, "timeout": 2, "raised": 1}
    assert again.failures["fragile"] == {"raised": 1}
    reports = [r.getMessage() for r in caplog.records if "reward function fragile" in r.getMessage()]
    assert sorted(r.split("failed (")[1].split(")")[0] for r in reports) == ["died", "raised", "timeout"]  # once each


def test_none_skips_a_sample_and_other_entries_keep_their_values(reward_file):
    made = scorer(reward_file, {"fn": "undecided", "verdict": True}, {"fn": "polite", "weight": 0.0})
    alone = scorer(reward_file, {"fn": "undecided"})
    try:
        mixed = made.score(views(["why?", "yes"], ["x", "x"]))
        skipped = alone.score(views(["why?", "yes"], ["x", "x"]))
    finally:
        made.close()
        alone.close()
    assert mixed.skipped == [False, False] and mixed.values["undecided"] == [None, 1.0]  # polite still scored it
    assert skipped.skipped == [True, False] and skipped.correct == [0.0, 1.0]


def test_a_function_failing_its_whole_first_batch_stops_the_run_with_its_traceback(reward_file):
    made = scorer(reward_file, {"fn": "exact", "verdict": True}, {"fn": "broken"})
    try:
        with pytest.raises(RewardError, match=r"(?s)reward function broken .* failed on all 2 samples of its first "
                                              r"batch.*KeyError: 'missing'"):
            made.score(views(["4", "5"], ["4", "4"]))
    finally:
        made.close()


def test_functions_that_cannot_load_or_bind_are_named_before_any_batch(reward_file):
    with pytest.raises(ConfigError, match=r"dataset.rewards\[0\].fn=.*has no 'nope'; its functions: .*'exact'"):
        scorer(reward_file, {"fn": "nope"})
    (reward_file.parent / "needs_target.py").write_text("def hits(completion, target):\n    return 1.0\n")
    made = Scorer(reward_entries([{"fn": f"{reward_file.parent / 'needs_target.py'}:hits"}]), workers=1)
    try:
        made.describe()
        with pytest.raises(ConfigError, match=r"no value for its parameter\(s\) target: .*a column every row has "
                                              r"\(level, solution\)"):
            made.check_columns({"solution", "level"})
        made.check_columns({"target"})
    finally:
        made.close()


def test_a_draw_goes_to_the_pool_in_one_batch(reward_file, monkeypatch):
    made = scorer(reward_file, {"fn": "exact", "verdict": True}, {"fn": "polite", "weight": 0.1})
    batches = []
    run = made.pool.run
    monkeypatch.setattr(made.pool, "run", lambda tasks, timeouts=None, on_result=None:
                        batches.append(len(tasks)) or run(tasks, timeouts, on_result))
    try:
        made.score(views(["4"] * 6, ["4"] * 6))
    finally:
        made.close()
    # exact's 6 calls and the async polite's 2 (a share per worker, its samples concurrent), spread together
    assert batches == [8]
