"""fgrpo.rewards.answers: extracting the final answer, the numeric and math checks, their timeouts on pathological
input. The pool that runs them: tests/user_code/test_pool.py; as reward entries: tests/rewards/test_scoring.py."""

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from answer_cases import MATH_CASES, POWER_TOWER
from fgrpo.rewards.answers import SCAN_CHARS, extract_answer, verify_math, verify_numeric


def run_isolated(code: str, limit_s: float = 30.0) -> dict:
    """Run ``code`` in a fresh interpreter: a broken timeout fails the test instead of hanging the suite."""
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=limit_s
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


# --- extract_answer / verify_numeric ----------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 12.", "12"),
        ("So 3 + 4 = 7", "7"),
        (r"First \boxed{7}, then I checked 8 and 9.", "7"),  # a boxed answer wins over later numbers
        (r"\boxed{1} and finally \boxed{ 2 }", "2"),  # the last box, stripped
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces balance
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\boxed {5}", "5"),
        (r"\boxed{unclosed 5", "5"),  # no balanced box: fall back to the last number
        ("x = -3", "-3"),
        ("It costs 1,234 dollars", "1234"),
        ("about 2.5 units", "2.5"),
        ("1,2345", "2345"),  # not a thousands group
        ("from 2020-2021", "2021"),  # a hyphen between numbers is not a minus sign
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_searches_only_the_tail():
    far_number = "42 " + "x" * (SCAN_CHARS + 10)
    assert extract_answer(far_number) is None
    assert extract_answer(far_number + " 7") == "7"


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("The answer is 12.", "12", 1.0),
        ("The answer is 12.", "13", 0.0),
        ("The answer is 7.0", "7", 1.0),
        ("The answer is 7", "7.0", 1.0),
        ("The answer is 7.5", "7", 0.0),
        ("x = -3", "-3", 1.0),
        ("x = 3", "-3", 0.0),
        ("The total is 1,234.", "1234", 1.0),
        ("The total is 1234.", "1,234", 1.0),
        (r"\boxed{7} although 8 is close", "7", 1.0),
        (r"\boxed{7} although 8 is close", "8", 0.0),
        (r"\boxed{x = 7}", "7", 1.0),
        (r"\boxed{12 \text{ cm}}", "12", 1.0),
        (r"\boxed{1\,234}", "1234", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"$\boxed{-\dfrac{3}{4}}$", "-0.75", 1.0),
        ("1/2", "0.5", 0.0),  # a bare fraction is two numbers; the last is 2
        ("I don't know", "7", 0.0),
        (r"\boxed{}", "7", 0.0),
        ("7", "seven", 0.0),  # a reference without a number matches nothing
    ],
)
def test_verify_numeric(completion, answer, reward):
    assert verify_numeric(completion, answer) == reward


def test_verify_numeric_is_exact_for_big_numbers():
    assert verify_numeric("12345678901234567890", "12345678901234567890") == 1.0
    assert verify_numeric("12345678901234567891", "12345678901234567890") == 0.0
    assert verify_numeric("0.1", "0.10000000000000001") == 0.0


def test_verify_numeric_never_raises_on_wrong_types():
    assert verify_numeric(None, "7") == 0.0
    assert verify_numeric("7", None) == 0.0
    assert extract_answer(None) is None


PATHOLOGICAL = {
    "digits": "1" * 200_000,
    "digits then answer": "9" * 200_000 + " so 7",
    "open braces": "{" * 200_000,
    "close braces": "}" * 200_000,
    "unclosed boxes": r"\boxed{" * 30_000,
    "box holding digits": r"\boxed{" + "1" * 200_000 + "}",
    "thousands chain": "1," * 100_000 + "2345",
    "dots": "1." * 100_000,
    "minus signs": "-" * 200_000,
    "boxes and spaces": (r"\boxed" + " " * 1000) * 200,
    "huge exponent": r"\boxed{1e999999999}" * 10_000,  # exponents are never evaluated
}


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_numeric_is_fast_on_pathological_input(name):
    started = time.perf_counter()
    for _ in range(3):
        reward = verify_numeric(PATHOLOGICAL[name], "7")
        extract_answer(PATHOLOGICAL[name])
    assert (time.perf_counter() - started) / 3 < 1.0
    assert reward == (1.0 if name == "digits then answer" else 0.0)


# --- verify_math -----------------------------------------------------------------------------


# right and wrong answers in the forms models write, with math-verify's verdict


@pytest.mark.parametrize("completion, answer, reward", MATH_CASES)
def test_verify_math(completion, answer, reward):
    assert verify_math(completion, answer) == reward


def test_verify_math_never_raises_on_odd_input():
    assert verify_math(None, "1") == 0.0
    assert verify_math("1", None) == 0.0
    assert verify_math(r"\boxed{\frac{1}{}}", "1") == 0.0
    assert verify_math(r"\boxed{1}", r"\frac{") == 0.0


def test_verify_math_rejects_a_bad_timeout():
    for bad in (0, -1.0, float("nan"), float("inf"), "5", True):
        with pytest.raises(ValueError, match="timeout_s"):
            verify_math(r"\boxed{1}", "1", timeout_s=bad)


def test_verify_math_times_out_on_a_power_tower_in_the_main_thread():
    result = run_isolated(
        f"""
        import json, time
        from fgrpo.rewards.answers import verify_math
        verify_math("1", "1")  # math-verify's import (not part of an answer's timeout)
        started = time.perf_counter()
        reward = verify_math({POWER_TOWER!r}, "1", timeout_s=1.0)
        elapsed = time.perf_counter() - started
        # the interrupted sympy/parser state must still give right answers afterwards
        after = [verify_math(r"\\boxed{{0.5}}", r"\\frac{{1}}{{2}}"), verify_math(r"\\boxed{{3}}", "4")]
        print(json.dumps({{"reward": reward, "elapsed": elapsed, "after": after}}))
        """
    )
    assert result["reward"] == 0.0
    assert result["elapsed"] < 1.0 + 2.0
    assert result["after"] == [1.0, 0.0]


def test_verify_math_times_out_in_a_worker_thread():
    # A factorial sympy works out in Python: the watchdog can stop it (a C-level big power it cannot).
    result = run_isolated(
        r"""
        import json, threading, time
        from fgrpo.rewards.answers import verify_math
        verify_math("1", "1")  # math-verify's import (not part of an answer's timeout)
        outcome = {}
        def work():
            started = time.perf_counter()
            outcome["reward"] = verify_math(r"\boxed{99999999999!}", "1", timeout_s=1.0)
            outcome["elapsed"] = time.perf_counter() - started
            outcome["after"] = verify_math(r"\boxed{0.5}", r"\frac{1}{2}", timeout_s=1.0)
        worker = threading.Thread(target=work)
        worker.start()
        worker.join(30)
        time.sleep(1.5)  # a cancelled watchdog must not raise into the thread later
        outcome["alive"] = worker.is_alive()
        print(json.dumps(outcome))
        """
    )
    assert result["alive"] is False
    assert result["reward"] == 0.0
    assert result["elapsed"] < 1.0 + 2.0
    assert result["after"] == 1.0


def test_verify_math_in_a_thread_does_not_leak_its_timeout():
    outcome = {}

    def work():
        outcome["reward"] = verify_math(r"\boxed{2}", "2", timeout_s=0.3)
        time.sleep(0.6)  # past the timeout: a pending watchdog exception would surface here
        outcome["survived"] = True

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(10)
    assert outcome == {"reward": 1.0, "survived": True}


@pytest.mark.parametrize("name", ["open braces", "unclosed boxes", "digits", "box holding digits"])
def test_verify_math_on_huge_input_returns_within_the_timeout(name):
    started = time.perf_counter()
    assert verify_math(PATHOLOGICAL[name], "7", timeout_s=2.0) == 0.0
    assert time.perf_counter() - started < 2.0 + 2.0


def test_verify_math_imports_math_verify_outside_the_timeout():
    result = run_isolated(
        r"""
        import json
        from fgrpo.rewards.answers import verify_math
        # the import alone takes about 0.8 s
        print(json.dumps({"reward": verify_math(r"\boxed{0.5}", r"\frac{1}{2}", timeout_s=0.5)}))
        """
    )
    assert result["reward"] == 1.0


def test_verify_math_restores_the_alarm_handler_and_timer():
    def previous_handler(signum, frame):
        pass

    saved_handler = signal.signal(signal.SIGALRM, previous_handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        assert verify_math(r"\boxed{3}", "3") == 1.0
        assert signal.getsignal(signal.SIGALRM) is previous_handler
        remaining, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        assert 90.0 < remaining <= 100.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, saved_handler)
