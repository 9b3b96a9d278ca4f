"""The Countdown numbers game as an fgrpo task, in one file: a seeded generator of problems and the reward that checks
an answer. Reach the target from the given numbers with + - * / and parentheses, each number used at most once.

Used by examples/countdown/experiment/countdown.yaml through fgrpo's public interface only:

    dataset.kind=generator  dataset.generator="examples/countdown/countdown.py:generate"  (rows as dicts)
    dataset.messages_field=messages  (each row's chat is its prompt)
    dataset.rewards=[{fn: "examples/countdown/countdown.py:reaches_target", verdict: true},
                     {fn: "examples/countdown/countdown.py:writes_an_expression", weight: 0.1}]
    (the reward functions take the row's columns numbers and target by name)

The answer is read with a small parser of its own (numbers, + - * /, parentheses; exact fractions), never ``eval``.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
# two worked examples before the question (as chat turns): SmolLM2-135M-Instruct asked plainly is right 4% of the
# time, mostly from not answering with an expression; shown two, about a third of the time
EXAMPLES = [("3, 5", 8, "3 + 5"), ("9, 3", 6, "9 - 3")]
MAX_ANSWER_CHARS = 200  # longer "expressions" are not answers; it also bounds the parser's work


# --- the generator -------------------------------------------------------------------------------


def generate(seed: int, count: int, numbers: int = 2, largest: int = 9, largest_target: int = 40) -> list[dict]:
    """``count`` distinct problems: ``numbers`` numbers from 1 to ``largest`` and a whole target from 1 to
    ``largest_target`` that an expression over all of them with + - * reaches (so each has a solution, kept in the
    row as ``solution``), asked in chat ``messages`` after :data:`EXAMPLES`. The same arguments give the same rows.

    Raises:
        ValueError: these settings have fewer than ``count`` distinct problems.
    """
    rng = random.Random(seed)
    rows, seen = [], set()
    for _ in range(1000 * count):
        values = [rng.randint(1, largest) for _ in range(numbers)]
        solution, target = str(values[0]), values[0]
        for value in values[1:]:
            symbol = rng.choice(sorted(OPERATIONS))
            solution, target = f"{solution} {symbol} {value}", OPERATIONS[symbol](target, value)
        if 1 <= target <= largest_target and (tuple(sorted(values)), target) not in seen:
            seen.add((tuple(sorted(values)), target))
            numbers_text = ", ".join(map(str, values))
            rows.append({"numbers": numbers_text, "target": target, "solution": solution,
                         "messages": question_with_examples(numbers_text, target)})
            if len(rows) == count:
                return rows
    raise ValueError(f"only {len(rows)} distinct problems with numbers={numbers}, largest={largest}, "
                     f"largest_target={largest_target}: ask for fewer, or widen the ranges")


def question_with_examples(numbers: str, target: int) -> list[dict]:
    """The chat that asks for ``target`` from ``numbers``, after the worked examples."""
    messages = []
    for example_numbers, example_target, answer in EXAMPLES:
        messages += [{"role": "user", "content": ask(example_numbers, example_target)},
                     {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": ask(numbers, target)}]


def ask(numbers: str, target: int) -> str:
    return f"Make {target} from the numbers {numbers} with + - *."


# --- the rewards ---------------------------------------------------------------------------------


def reaches_target(completion: str, numbers: str, target: int) -> dict:
    """1 when the answer's last expression equals ``target`` and uses only the given numbers (each at most once).
    The extras say why not: ``found`` (an expression was there) and ``numbers_ok``."""
    expression = last_expression(completion)
    if expression is None:
        return {"score": 0.0, "correct": False, "found": 0.0, "numbers_ok": 0.0}
    value, used = evaluate(expression)
    allowed = Counter(int(n) for n in numbers.split(","))
    numbers_ok = value is not None and not (Counter(used) - allowed)
    right = numbers_ok and value == target
    return {"score": float(right), "correct": right, "found": 1.0, "numbers_ok": float(numbers_ok)}


def writes_an_expression(completion: str) -> float:
    """A small format reward: 1 when the answer holds an arithmetic expression at all."""
    return 1.0 if last_expression(completion) is not None else 0.0


# --- reading an answer ---------------------------------------------------------------------------

# a run of digits, operators, parentheses and spaces holding at least one operator between numbers
_CANDIDATE = re.compile(r"[\d(][\d\s()+\-*/×x÷]*[\d)]")
_TOKEN = re.compile(r"\s*(\d+|[()+\-*/])")


def last_expression(text: str) -> str | None:
    """The last arithmetic expression in ``text`` ("3 + 5" of "3 + 5 = 8"), with × and ÷ as * and /."""
    found = None
    for match in _CANDIDATE.finditer(text[-MAX_ANSWER_CHARS * 10:]):
        candidate = match.group().replace("×", "*").replace("x", "*").replace("÷", "/").strip()
        if re.search(r"\d\s*[+\-*/]\s*[\d(]", candidate) and len(candidate) <= MAX_ANSWER_CHARS:
            found = candidate
    return found


def evaluate(expression: str) -> tuple[Fraction | None, list[int]]:
    """The exact value of ``expression`` and the numbers it uses; None for the value where it does not parse or
    divides by zero. Grammar: expr = term (("+" | "-") term)*, term = factor (("*" | "/") factor)*,
    factor = number | "(" expr ")"."""
    tokens = _tokens(expression)
    if tokens is None:
        return None, []
    used: list[int] = []
    position = 0

    def peek() -> str | None:
        return tokens[position] if position < len(tokens) else None

    def take() -> str:
        nonlocal position
        position += 1
        return tokens[position - 1]

    def factor() -> Fraction:
        token = take() if peek() is not None else None
        if token == "(":
            value = expr()
            if take() != ")":
                raise ValueError("unclosed parenthesis")
            return value
        if token is None or not token.isdigit():
            raise ValueError(f"a number expected, got {token!r}")
        used.append(int(token))
        return Fraction(int(token))

    def term() -> Fraction:
        value = factor()
        while peek() in ("*", "/"):
            value = value * factor() if take() == "*" else value / factor()
        return value

    def expr() -> Fraction:
        value = term()
        while peek() in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value

    try:
        value = expr()
    except (ValueError, ZeroDivisionError, IndexError):
        return None, used
    return (value, used) if position == len(tokens) else (None, used)


def _tokens(expression: str) -> list[str] | None:
    tokens, position = [], 0
    while position < len(expression):
        match = _TOKEN.match(expression, position)
        if match is None:
            return None if expression[position:].strip() else tokens
        tokens.append(match.group(1))
        position = match.end()
    return tokens
