"""User code that cannot hurt the run (issue 71): every exception a reward can raise is a counted failure of its call
of the right kind, async rewards share one event loop per worker, hung calls do not queue behind each other, a
function failing its first calls the same way stops early, a worker past its memory cap ends alone, and rewards that
draw random numbers give the same scores on a rerun. All through the real pool: spawned workers importing the file."""

import textwrap
import time

import pytest

from fgrpo.infra.errors import RewardError
from fgrpo.rewards.binding import sample_view
from fgrpo.rewards.entries import reward_entries
from fgrpo.rewards.scoring import Scorer

REWARDS = '''
import asyncio, os, random, sys, time

def exits(completion):
    if completion == "exit":
        sys.exit(3)
    if completion == "interrupt":
        raise KeyboardInterrupt
    if completion == "cancel":
        raise asyncio.CancelledError()
    if completion == "quit":
        os._exit(0)
    return 1.0

LOCK = asyncio.Lock()
SEMAPHORE = asyncio.Semaphore(2)
CALLS = []

async def locked(completion):
    async with LOCK, SEMAPHORE:
        await asyncio.sleep(0.01)
        CALLS.append(completion)
    return float(len(CALLS) > 0)

async def sleepy(completion):
    await asyncio.sleep(0.5)
    return 1.0

def hangs_sometimes(completion):
    if completion.startswith("hang"):
        time.sleep(3600)
    return 1.0

def always_hangs(completion):
    time.sleep(3600)

def leaks(completion):
    if completion == "big":
        return float(len(bytearray(3 * 2 ** 30)))
    return 1.0

def dice(completion):
    return random.random()
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "fault_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def views(completions: list[str]) -> list[dict]:
    return [sample_view(completion=c, completion_ids=[1], prompt="Say it.", answer="x", source="toy", fields={},
                        timeout_s=1.0) for c in completions]


def scorer(reward_file, fn: str, **settings) -> Scorer:
    made = Scorer(reward_entries([{"fn": f"{reward_file}:{fn}"}]), **{"workers": 2, "timeout_s": 1.0, **settings})
    made.describe()
    return made


def test_exit_interrupt_cancel_and_os_exit_are_counted_and_the_run_goes_on(reward_file):
    made = scorer(reward_file, "exits")
    try:
        assert made.score(views(["ok"])).rewards == [1.0]  # a first batch that works
        batch = made.score(views(["exit", "interrupt", "cancel", "quit", "ok"]))
        after = made.score(views(["ok", "ok"]))
    finally:
        made.close()
    assert batch.rewards == [0.0, 0.0, 0.0, 0.0, 1.0] and after.rewards == [1.0, 1.0]
    assert batch.failures["exits"] == {"raised": 3, "died": 1}  # os._exit(0): a death, not a timeout
    assert made.pool.worker_deaths == 1


def test_os_exit_zero_is_reported_as_a_death_at_once(reward_file):
    made = scorer(reward_file, "exits", timeout_s=20.0)
    try:
        made.score(views(["ok"]))
        started = time.monotonic()
        made.score(views(["quit"]))
        took = time.monotonic() - started
    finally:
        made.close()
    assert took < 10, f"os._exit(0) waited for its 20 s time limit ({took:.1f} s)"


def test_an_async_reward_keeps_its_module_level_lock_across_batches(reward_file):
    made = scorer(reward_file, "locked", workers=1)
    try:
        first = made.score(views(["a", "b", "c"]))
        second = made.score(views(["d", "e"]))  # asyncio.run per call would fail here: the lock's loop is gone
    finally:
        made.close()
    assert first.rewards == [1.0] * 3 and second.rewards == [1.0] * 2 and second.errors == 0


def test_the_samples_of_an_async_reward_run_concurrently(reward_file):
    made = scorer(reward_file, "sleepy", workers=1)
    try:
        made.score(views(["warm"]))
        started = time.monotonic()
        batch = made.score(views([f"s{i}" for i in range(8)]))
        took = time.monotonic() - started
    finally:
        made.close()
    assert batch.rewards == [1.0] * 8
    assert took < 8 * 0.5, f"8 calls of 0.5 s on one worker took {took:.1f} s: they ran one after another"


def test_hung_calls_do_not_queue_behind_each_other(reward_file):
    """64 samples, 8 of them hang: with 4 workers the batch costs about two time limits, not eight (serially)."""
    made = scorer(reward_file, "hangs_sometimes", workers=4)
    made.pool.stuck_margin_s = 1.0
    try:
        made.score(views(["ok"]))
        completions = ["hang" if i % 8 == 3 else "ok" for i in range(64)]
        started = time.monotonic()
        batch = made.score(views(completions))
        took = time.monotonic() - started
    finally:
        made.close()
    assert batch.failures["hangs_sometimes"] == {"timeout": 8} and sum(batch.rewards) == 56
    assert took < 8 * 1.0, f"8 hung calls of a 1 s limit on 4 workers took {took:.1f} s: they queued"


def test_a_function_failing_its_first_calls_the_same_way_stops_early(reward_file):
    made = scorer(reward_file, "always_hangs", workers=4, stop_after=8)
    made.pool.stuck_margin_s = 1.0
    try:
        started = time.monotonic()
        with pytest.raises(RewardError, match=r"failed its first 8 calls, all the same way \(timeout\)"):
            made.score(views([f"s{i}" for i in range(64)]))
        took = time.monotonic() - started
    finally:
        made.close()
    assert took < 16, f"the stop waited for the whole batch ({took:.1f} s; 64 x 1 s / 4 workers = 16 s)"


def test_a_reward_past_its_memory_cap_ends_its_worker_only(reward_file):
    made = scorer(reward_file, "leaks", memory_gib=0.5)
    try:
        made.score(views(["ok"]))
        batch = made.score(views(["big", "ok", "ok"]))
        after = made.score(views(["ok", "ok"]))
    finally:
        made.close()
    assert batch.rewards == [0.0, 1.0, 1.0] and batch.failures["leaks"] == {"died": 1}
    assert after.rewards == [1.0, 1.0] and made.pool.worker_deaths == 1


def test_a_reward_drawing_random_numbers_scores_the_same_on_a_rerun(reward_file):
    def scores(seeds):
        made = scorer(reward_file, "dice", workers=3)
        try:
            return made.score(views(["x"] * 6), seeds).rewards
        finally:
            made.close()

    first, again, other = scores(list(range(6))), scores(list(range(6))), scores(list(range(100, 106)))
    assert first == again and first != other and len(set(first)) == 6


def test_a_worker_is_replaced_after_its_calls_when_asked(reward_file):
    made = scorer(reward_file, "exits", workers=1, max_calls=2)
    try:
        made.score(views(["ok"]))  # the Describe and this call: the first worker's two
        first = set(made.pool.pids)
        batch = made.score(views(["ok", "ok"]))
        second = set(made.pool.pids)
    finally:
        made.close()
    assert batch.rewards == [1.0, 1.0] and batch.errors == 0 and made.pool.worker_deaths == 0
    assert first and second and first != second


def test_imports_past_their_limit_name_the_entry_and_the_key(tmp_path):
    from fgrpo.infra.errors import ConfigError

    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(30)\ndef score(completion):\n    return 1.0\n")
    made = Scorer(reward_entries([{"fn": f"{tmp_path / 'slow_import.py'}:score"}]), workers=1, import_timeout_s=1.0)
    try:
        with pytest.raises(ConfigError, match=r"did not finish importing dataset.rewards\[0\].fn=.*slow_import.py:score"
                                              r".* within dataset.reward_import_timeout_s=1 s"):
            made.describe()
    finally:
        made.close()
