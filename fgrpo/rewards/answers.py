"""Pure answer checks: is a completion's final answer the reference answer? 1.0 if so, else 0.0.

- :func:`verify_numeric`: pure Python, microseconds per call. The final answer is the last ``\\boxed{...}``
  or else the last number; it is compared to the reference as an exact rational number, so
  ``"7.0"`` equals ``"7"`` and ``"1,234"`` equals ``"1234"``. For arithmetic and GSM8K-style answers.
- :func:`verify_math`: math-verify (sympy) for LaTeX answers (fractions, radicals, intervals, tuples),
  bounded by a wall-clock timeout; milliseconds per call.

Completions are untrusted model output: both look at only the last ``SCAN_CHARS`` characters, use
regexes that cannot backtrack catastrophically, and return 0.0 instead of raising. Which check a run
uses, and in which processes, is :mod:`fgrpo.rewards.scoring`'s business: they are the built-in reward
functions ``numeric`` and ``math`` (:mod:`fgrpo.rewards.entries`).
"""

from __future__ import annotations

import functools
import logging
import re
from fractions import Fraction

from fgrpo.user_code.time_limit import TimeLimitExceeded, check_timeout, run_with_time_limit

__all__ = ["SCAN_CHARS", "extract_answer", "verify_numeric", "verify_math", "check_timeout"]

SCAN_CHARS = 20_000
"""Only this many trailing characters of a completion are searched for its final answer.

Bounds the work on pathological input; the final answer of a real completion is at its end.
"""

# "\boxed{" (also "\boxed {"); the match ends just after the opening brace.
_BOXED_OPEN = re.compile(r"\\boxed\s*\{")
# A number that does not start inside a word or another number: "-3", "12", "1,234", "0.5".
# The thousands branch needs whole groups of 3 digits ("1,2345" is "1" and "2345"). Every
# repetition is followed by a fixed separator, so a failed attempt costs at most one run of digits.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# What Fraction() may read: no exponents, so "1e999999999" cannot cost a huge power of ten.
_PLAIN_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?(?:/\d+)?")
_LATEX_FRACTION = re.compile(r"(-?)\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}")
# LaTeX spacing commands that models put inside numbers ("1\,234").
_LATEX_SPACING = re.compile(r"\\[,;:! ]")
_MAX_NUMBER_CHARS = 100
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def _last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance, found in one linear pass."""
    content_starts = [match.end() for match in _BOXED_OPEN.finditer(text)]
    if not content_starts:
        return None
    # Match every brace once with a stack; an unmatched "{" simply has no entry.
    close_of_open: dict[int, int] = {}
    open_positions: list[int] = []
    for brace in re.finditer(r"[{}]", text[content_starts[0] - 1 :]):
        position = brace.start() + content_starts[0] - 1
        if brace.group() == "{":
            open_positions.append(position)
        elif open_positions:
            close_of_open[open_positions.pop()] = position
    for start in reversed(content_starts):
        close = close_of_open.get(start - 1)
        if close is not None:
            return text[start:close]
    return None


def _last_number(text: str) -> str | None:
    """The last number in ``text`` with thousands commas removed, or None."""
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return None if last is None else last.group().replace(",", "")


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: the last balanced ``\\boxed{...}``, else the last number.

    A boxed answer wins over numbers written after it, since models often restate or check the
    answer after boxing it. The boxed content is returned as written (stripped); a bare number is
    returned with thousands commas removed ("1,234" -> "1234"). Only the last ``SCAN_CHARS``
    characters are searched. None when there is neither.
    """
    if not isinstance(text, str):
        return None
    tail = text[-SCAN_CHARS:]
    boxed = _last_boxed_content(tail)
    if boxed is not None:
        return boxed.strip()
    return _last_number(tail)


def _parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number if it is one whole number ("7", "-3.50", "1,234", "1/2", "\\frac{1}{2}")."""
    cleaned = _LATEX_SPACING.sub("", text).strip().strip("$").strip()
    if len(cleaned) > _MAX_NUMBER_CHARS:
        return None
    if _THOUSANDS.fullmatch(cleaned):
        cleaned = cleaned.replace(",", "")
    try:
        if _PLAIN_NUMBER.fullmatch(cleaned):
            return Fraction(cleaned)
        fraction = _LATEX_FRACTION.fullmatch(cleaned)
        if fraction:
            sign = -1 if fraction.group(1) else 1
            return sign * Fraction(int(fraction.group(2)), int(fraction.group(3)))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _to_number(text: str) -> Fraction | None:
    """``text`` as a number, or else the last number inside it ("12 \\text{cm}" -> 12)."""
    number = _parse_number(text)
    if number is not None:
        return number
    last = _last_number(text)
    return None if last is None else _parse_number(last)


def verify_numeric(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals the reference as a number, else 0.0.

    Exact rational comparison ("7" == "7.0", "1/2" == "0.5"), no tolerance. A boxed answer that
    is not a plain number counts by the last number inside it ("\\boxed{x = 7}" -> 7). Never
    raises; a reference that holds no number gives 0.0 for every completion.
    """
    try:
        if not isinstance(completion, str) or not isinstance(answer, str):
            return 0.0
        reference = _to_number(answer[-SCAN_CHARS:])
        extracted = extract_answer(completion)
        if reference is None or extracted is None:
            return 0.0
        return 1.0 if _to_number(extracted) == reference else 0.0
    except Exception:
        return 0.0


# --- math-verify, under a timeout ------------------------------------------------------------


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its own timeout is off; here :func:`verify_math` bounds time."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@functools.cache
def _math_verify_functions():
    """Import math-verify (sympy, antlr: about a second) on first use, not with this module."""
    from math_verify import parse, verify

    for logger_name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(logger_name).addFilter(_DropTimeoutDisabledWarning())
    return parse, verify


def _parse_reference(answer: str) -> list:
    """Parse a reference answer; bare LaTeX ("2\\sqrt{3}") only parses whole between ``$...$``."""
    parse, _ = _math_verify_functions()
    if _UNESCAPED_DOLLAR.search(answer) or "\\boxed" in answer:
        candidates = [answer]
    else:
        candidates = [f"${answer}$", f"\\boxed{{{answer}}}", answer]
    for candidate in candidates:
        parsed = parse(candidate, parsing_timeout=None)
        if parsed:
            return parsed
    return []


def _math_verify_match(completion: str, answer: str) -> bool:
    """math-verify's verdict with its own (SIGALRM, whole-second) timeouts off; the caller bounds time."""
    parse, verify = _math_verify_functions()
    reference = _parse_reference(answer)
    if not reference:
        return False
    predicted = parse(completion, parsing_timeout=None)
    if not predicted:
        return False
    return bool(verify(reference, predicted, timeout_seconds=None))


def verify_math(completion: str, answer: str, timeout_s: float = 5.0) -> float:
    """1.0 if math-verify finds the completion's answer equivalent to the reference, else 0.0.

    The reference is parsed as LaTeX (wrapped in ``$...$`` when it has no delimiters), the
    completion's last ``SCAN_CHARS`` characters with math-verify's default extraction (boxed
    answers first). Parsing plus comparison get ``timeout_s`` seconds of wall clock in all;
    time up, any exception, or nothing to compare gives 0.0.

    The bound is a SIGALRM timer in the main thread: it also stops CPython's big-integer power
    loop, which checks for signals (``\\boxed{10^{10^{10^{10}}}}`` returns after ``timeout_s``).
    Signals only reach the main thread, so in other threads a watchdog thread raises an
    asynchronous exception instead: that stops Python-level work (sympy's simplification,
    factorials) but not a single C call that holds the GIL, such as that power, which then runs
    until it ends or memory runs out. For a hard bound, call this from the main thread of this
    process or of worker processes (the reward pool, :mod:`fgrpo.user_code.pool`, calls it in each
    worker's main thread).

    Raises:
        ValueError: ``timeout_s`` is not a positive finite number (an argument error, not a
            verdict on the completion).
    """
    timeout_s = check_timeout(timeout_s)
    if not isinstance(completion, str) or not isinstance(answer, str):
        return 0.0
    completion_tail = completion[-SCAN_CHARS:]
    answer_tail = answer[-SCAN_CHARS:]
    _math_verify_functions()  # the first call's import (about a second) is not the answer's time
    try:
        matched = run_with_time_limit(lambda: _math_verify_match(completion_tail, answer_tail), timeout_s)
    except (Exception, TimeLimitExceeded):
        return 0.0
    return 1.0 if matched else 0.0
