"""fgrpo.user_code.pool: the worker pool (pebble's) with its per-task time limits, deaths, stuck workers and signals,
run here on the math check (the reward functions through it: tests/rewards/test_scoring.py). The answer checks
themselves: tests/rewards/test_answers.py."""

import functools
import gc
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from answer_cases import MATH_CASES, POWER_TOWER
from fgrpo.rewards.answers import verify_math
from fgrpo.user_code.pool import Fault, WorkerPool


def math_pool(verify=None, *, workers: int = 2, timeout_s: float = 2.0, **settings) -> WorkerPool:
    """A pool running ``verify(completion, answer)`` (default: the math check), warmed up as the scorer does."""
    verify = verify or functools.partial(verify_math, timeout_s=timeout_s)
    return WorkerPool(verify, workers, timeout_s=timeout_s, warm_up=functools.partial(verify, "0", "0"), **settings)


def verdicts(pool: WorkerPool, completions: list[str], answers: list[str]) -> list[float]:
    """Each answer's verdict, a task lost to a fault (its worker died or was stuck) counted 0.0."""
    return [0.0 if isinstance(result, Fault) else result for result in pool.run(list(zip(completions, answers)))]
# --- the pool on the math check --------------------------------------------------------------

# (completion, reference, math-verify's verdict): MATH_CASES and more forms models write
POOL_CASES = [
    *MATH_CASES,
    (r"Adding them gives \boxed{42}.", "42", 1.0),
    (r"Adding them gives \boxed{41}.", "42", 0.0),
    (r"\boxed{-7}", "-7", 1.0),
    (r"\boxed{7}", "-7", 0.0),
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),
    (r"\boxed{\tfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{\frac{4}{3}}", r"\frac{3}{4}", 0.0),
    (r"\boxed{x^2 + 2x + 1}", r"(x+1)^2", 1.0),
    (r"\boxed{x^2 + 2x}", r"(x+1)^2", 0.0),
    (r"\boxed{[2, 5)}", r"[2,5)", 1.0),
    (r"\boxed{(2, 5]}", r"[2,5)", 0.0),
    (r"\boxed{\pi}", r"\pi", 1.0),
    (r"\boxed{3.14}", r"\pi", 0.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{\sqrt{3}}", r"\frac{1}{\sqrt{2}}", 0.0),
    (r"\boxed{10\%}", "10", 0.0),
    (r"\boxed{2^{10}}", "1024", 1.0),
    (r"\boxed{2^{11}}", "1024", 0.0),
    (r"\boxed{\{1, 2, 3\}}", r"\{3, 2, 1\}", 1.0),
    (r"\boxed{\{1, 2\}}", r"\{1, 2, 3\}", 0.0),
    (r"\boxed{\infty}", r"\infty", 1.0),
    (r"\boxed{\ln(e^3)}", "3", 1.0),
    (r"\boxed{\binom{5}{2}}", "10", 1.0),
    (r"\boxed{5!}", "120", 1.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{y = 2x + 1}", r"2x+1", 1.0),
    (r"\boxed{\text{(B)}}", r"\text{(B)}", 1.0),
    (r"$x = \frac{-b}{2a}$, so the answer is $\boxed{-\frac{1}{2}}$", "-0.5", 1.0),
    ("Therefore the area is 36 square units.", "36", 1.0),
    ("Therefore the area is 35 square units.", "36", 0.0),
    (r"\boxed{12\text{ cm}}", "12", 1.0),
    (r"\boxed{3 + 2i}", r"3+2i", 1.0),
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", 1.0),
    (r"\boxed{}", "5", 0.0),
    (r"\boxed{\frac{1}{}}", "1", 0.0),
    (r"\boxed{1}", r"\frac{", 0.0),
    ("", "0", 0.0),
    (POWER_TOWER, "1", 0.0),  # timed out
]
POOL_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def faulty_pool():
    """Two workers running tests/helpers/verifier_faults.py's verify function (a stuck one is killed 1 s after its timeout)."""
    from verifier_faults import faulty_verify

    with math_pool(functools.partial(faulty_verify, timeout_s=POOL_TIMEOUT_S), timeout_s=POOL_TIMEOUT_S,
                   stuck_margin_s=1.0) as pool:
        yield pool


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie left to a container's init counts as gone)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_pool_gives_the_serial_verdicts_in_order_despite_timeouts_and_crashes(faulty_pool, caplog):
    from verifier_faults import FAULTS

    completions = [c for c, _, _ in POOL_CASES]
    answers = [a for _, a, _ in POOL_CASES]
    serial = [verify_math(c, a, timeout_s=POOL_TIMEOUT_S) for c, a in zip(completions, answers)]
    assert serial == [reward for _, _, reward in POOL_CASES]
    # every fault among them, each scored 0.0 where it stands
    at = [5, 17, 30, 41]
    for position, fault in zip(at, FAULTS):
        completions.insert(position, rf"\boxed{{1}} {fault}")
        answers.insert(position, "1")
        serial.insert(position, 0.0)
    before = dict(faulty_pool.counters)
    with caplog.at_level(logging.WARNING, logger="fgrpo.user_code.pool"):
        assert verdicts(faulty_pool, completions, answers) == serial
    assert faulty_pool.worker_deaths - before["worker_deaths"] == 3  # exit, kill, segfault
    assert faulty_pool.stuck_workers_killed - before["stuck_workers_killed"] == 1  # the hang
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("died" in w for w in warnings) == 3 and sum("still on task" in w for w in warnings) == 1
    assert any("killed by SIGSEGV" in w for w in warnings) and any("exit code 3" in w for w in warnings)


def test_pool_keeps_working_after_deaths(faulty_pool):
    from verifier_faults import KILL

    pids = set(faulty_pool.pids)
    deaths = faulty_pool.worker_deaths
    batch = [rf"\boxed{{{n}}}" for n in range(10)]
    batch[3] += KILL
    assert verdicts(faulty_pool, batch, ["4"] * 10) == [0.0] * 4 + [1.0] + [0.0] * 5
    assert faulty_pool.worker_deaths == deaths + 1
    assert len(set(faulty_pool.pids) - pids) == 1  # the dead worker's replacement
    assert verdicts(faulty_pool, [r"\boxed{\frac{1}{2}}"], ["0.5"]) == [1.0]
    assert verdicts(faulty_pool, [], []) == []


def test_a_replacement_that_dies_while_starting_is_started_again(caplog):
    from verifier_faults import KILL, faulty_verify

    with math_pool(functools.partial(faulty_verify, timeout_s=POOL_TIMEOUT_S), timeout_s=POOL_TIMEOUT_S) as pool:
        assert verdicts(pool, [r"\boxed{1}", r"\boxed{2}"], ["1", "2"]) == [1.0, 1.0]  # both workers got ready
        first = set(pool.pids)
        assert verdicts(pool, [rf"\boxed{{1}} {KILL}"], ["1"]) == [0.0]  # one dies on the answer: replaced
        (replacement,) = set(pool.pids) - first
        os.kill(replacement, signal.SIGKILL)  # still importing math-verify
        batch = [rf"\boxed{{{n}}}" for n in range(8)]
        with caplog.at_level(logging.WARNING, logger="fgrpo.user_code.pool"):
            assert verdicts(pool, batch, ["3"] * 8) == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        deadline = time.monotonic() + 60
        while len(set(pool.pids) - first - {replacement}) < 1 and time.monotonic() < deadline:
            verdicts(pool, batch, ["3"] * 8)
        assert len(pool.pids) == 2 and replacement not in pool.pids  # started again
        # pebble replaces it unseen, or gives up on its pool (no answer running) and a new one takes the batch:
        # either way no answer was on it, so the only death reported is the one on an answer
        assert sum("died" in r.getMessage() for r in caplog.records) == 1
        assert pool.worker_deaths == 1  # the death on an answer; the failed start held none


def test_pool_kills_a_worker_stuck_past_its_timeout():
    from verifier_faults import HANG, faulty_verify

    with math_pool(functools.partial(faulty_verify, timeout_s=0.5), timeout_s=0.5, stuck_margin_s=0.5) as pool:
        verdicts(pool, ["1"], ["1"])  # started
        started = time.perf_counter()
        assert verdicts(pool, [HANG, r"\boxed{2}"], ["1", "2"]) == [0.0, 1.0]
        assert time.perf_counter() - started < 0.5 + 0.5 + 2.0
        assert pool.counters == {"worker_deaths": 0, "stuck_workers_killed": 1}


def test_pool_raises_the_verify_functions_own_error_and_recovers(faulty_pool):
    from verifier_faults import RAISE

    with pytest.raises(RuntimeError, match=r"raised on task 1:(.|\n)*a bug in the verify function"):
        verdicts(faulty_pool, [r"\boxed{1}", RAISE, r"\boxed{3}"], ["1", "2", "3"])
    assert verdicts(faulty_pool, [r"\boxed{1}", r"\boxed{3}"], ["1", "2"]) == [1.0, 0.0]


def test_pool_leaves_no_process_behind():
    with math_pool() as pool:
        assert pool.pids == []  # started on first use
        assert verdicts(pool, [r"\boxed{2}"] * 3, ["2", "3", "2"]) == [1.0, 0.0, 1.0]
        pids = pool.pids
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
    assert pool.pids == [] and not any(alive(pid) for pid in pids)
    pool.start()  # again, ahead of its first batch
    assert len(pool.pids) == 2 and pool.pids != pids
    assert verdicts(pool, [r"\boxed{2}"], ["2"]) == [1.0]
    pids = pool.pids
    del pool
    gc.collect()  # the finalizer ends the workers of a pool nobody holds
    assert not any(alive(pid) for pid in pids)


def test_workers_exit_when_the_pool_process_is_killed():
    code = r"""
import json, os, signal
import functools
from fgrpo.rewards.answers import verify_math
from fgrpo.user_code.pool import WorkerPool
pool = WorkerPool(functools.partial(verify_math, timeout_s=2.0), 2)
pool.run([(r"\boxed{1}", "1")])
print(json.dumps(pool.pids), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no finalizer, no atexit
"""
    # the workers share its stdout: run() returns once they have exited too
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    pids = json.loads(done.stdout)
    deadline = time.monotonic() + 10  # their stdout closes a moment before they are gone
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


def test_pool_reports_a_verify_function_its_workers_cannot_import():
    import sys
    import types

    module = types.ModuleType("only_in_this_process")
    exec("def verify(completion, answer):\n    return 1.0", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with WorkerPool(module.verify, workers=2) as pool:
            with pytest.raises(RuntimeError, match="before it was ready"):
                verdicts(pool, ["1"], ["1"])
            assert pool.pids == []
    finally:
        del sys.modules[module.__name__]


def test_pool_pickles_its_settings_only(faulty_pool):
    copy = pickle.loads(pickle.dumps(faulty_pool))
    assert (copy.workers, copy.timeout_s, copy.stuck_margin_s) == (2, POOL_TIMEOUT_S, 1.0)
    assert copy.pids == [] and copy.counters == {"worker_deaths": 0, "stuck_workers_killed": 0}


def test_one_worker_runs_in_this_process_only_where_asked():
    alone = WorkerPool(functools.partial(verify_math, timeout_s=3.0), 1, timeout_s=3.0, in_process_alone=True)
    assert alone.in_process and alone.run([(r"\boxed{2}", "2")]) == [1.0] and alone.pids == []
    with WorkerPool(functools.partial(verify_math, timeout_s=3.0), 1, timeout_s=3.0) as pooled:  # a user's code
        assert not pooled.in_process and pooled.run([(r"\boxed{2}", "2")]) == [1.0] and len(pooled.pids) == 1
    for bad in (0, -2, 1.5, "many", True, None):
        with pytest.raises(ValueError, match="workers must be 'auto' or an int >= 1"):
            WorkerPool(verify_math, bad)


@pytest.mark.parametrize("cores, ranks, expected", [(2, 1, 1), (1, 1, 1), (4, 1, 3), (64, 1, 8), (16, 4, 3),
                                                    (8, 8, 1)])
def test_auto_workers(monkeypatch, cores, ranks, expected):
    from fgrpo.user_code.pool import auto_workers, resolve_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    assert auto_workers() == resolve_workers("auto") == expected


@pytest.mark.parametrize("value", [0, -1, "many", 2.5, True])
def test_config_rejects_bad_reward_workers(compose, value):
    from fgrpo.validation import validate
    from fgrpo.infra.errors import ConfigError

    cfg = compose(f"dataset.reward_workers={str(value).lower() if isinstance(value, bool) else value}")
    with pytest.raises(ConfigError, match=r"dataset.reward_workers=.*must be auto or an int >= 1"):
        validate(cfg)


@pytest.mark.parametrize("value", ["auto", 1, 4])
def test_config_accepts_reward_workers(compose, value):
    from fgrpo.validation import validate

    validate(compose(f"dataset.reward_workers={value}"))


def test_stop_signals_while_workers_start_neither_kill_them_nor_reach_them_later():
    """Slurm's SIGUSR2 (and Ctrl-C's SIGINT) reach every process of a job, a pool's workers too: one that arrives
    while a worker is still starting (re-importing the main module, then math-verify) must not end it, and once it
    runs it ignores them."""
    from verifier_faults import faulty_verify

    with math_pool(functools.partial(faulty_verify, timeout_s=POOL_TIMEOUT_S), timeout_s=POOL_TIMEOUT_S) as pool:
        pool.start()
        starting = pool.pids
        assert len(starting) == 2
        for signum in (signal.SIGUSR2, signal.SIGUSR1, signal.SIGINT):
            for pid in starting:
                os.kill(pid, signum)
        assert verdicts(pool, [r"\boxed{1}", r"\boxed{2}", r"\boxed{3}"], ["1", "2", "4"]) == [1.0, 1.0, 0.0]
        for pid in starting:
            os.kill(pid, signal.SIGUSR2)  # now running: ignored
        assert verdicts(pool, [r"\boxed{5}"], ["5"]) == [1.0]
        assert pool.worker_deaths == 0 and sorted(pool.pids) == sorted(starting)


def test_a_batch_whose_pool_stops_answering_goes_to_a_new_pool(monkeypatch, caplog):
    """pebble's workers share one lock on their channel: one killed while it holds it blocks the others, and pebble
    does not notice. A fault that cannot be caused on purpose, so it is stood in for: the pool's first schedule after
    a working batch hands back answers that are taken and never finished. The batch ends at its deadline and its
    answers go to a new pool."""
    from concurrent.futures import Future

    with math_pool(timeout_s=0.2, stuck_margin_s=0.2) as pool:
        assert verdicts(pool, [r"\boxed{1}"], ["1"]) == [1.0]  # the workers run: a stuck pool is bad luck
        stuck_pool = pool._pool

        def taken_never_finished(*args, **kwargs):
            future = Future()
            future.set_running_or_notify_cancel()
            return future

        monkeypatch.setattr(stuck_pool, "schedule", taken_never_finished)
        usual_start_up_limit_s = pool.startup_limit_s
        monkeypatch.setattr(pool, "startup_limit_s", 1.0)  # the stuck pool's deadline: 1 s + two rounds
        stop_stuck_pool = pool._stop

        def stop_then_usual_start_up_limit():
            # the new pool's workers start at the machine's pace (over 1 s on a loaded 2-core AVX2 EPYC)
            stop_stuck_pool()
            monkeypatch.setattr(pool, "startup_limit_s", usual_start_up_limit_s)

        monkeypatch.setattr(pool, "_stop", stop_then_usual_start_up_limit)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="fgrpo.user_code.pool"):
            assert verdicts(pool, [r"\boxed{2}", r"\boxed{3}", r"\boxed{4}"], ["2", "3", "5"]) == [1.0, 1.0, 0.0]
        assert time.monotonic() - started < 30
        assert pool._pool is not stuck_pool
        assert any("still open" in r.getMessage() for r in caplog.records)
