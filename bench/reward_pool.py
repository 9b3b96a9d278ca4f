"""How fast samples are scored through fgrpo's reward path (fgrpo.rewards.scoring.Scorer): the math check in the
trainer's process (dataset.reward_workers=1) and in a pool of N worker processes, and a user's reward function (a
trivial one, loaded by its file path: what the pool's per-call cost is) in the pool, on a seeded mix of realistic
completions: reasoning text ending in boxed integers, fractions, radicals, polynomials, intervals, tuples and
multiples of pi, or in a bare number; about a third of them wrong.

    python bench/reward_pool.py                      # 400 answers, workers 2 and 4, 3 repeats
    python bench/reward_pool.py --answers 1024 --workers 2,4,8 --repeats 5

Prints the pool's start-up time (new interpreters importing math-verify, once per run) and, per setting, the
median answers per second over the repeats with its speed-up over one process. All math settings must give the
same verdicts; the script fails if they do not.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fgrpo.rewards.binding import sample_view  # noqa: E402
from fgrpo.rewards.entries import reward_entries  # noqa: E402
from fgrpo.rewards.scoring import Scorer  # noqa: E402

USER_REWARD = "def length(completion):\n    return min(1.0, len(completion) / 1000)\n"

REASONING = [
    r"Let $n$ be the number of terms. Each step adds $3$ to the previous one, so after $k$ steps we have $3k + 2$.",
    r"We square both sides: $(x - 1)^2 = x^2 - 2x + 1$, and collecting terms gives a quadratic in $x$.",
    r"By the Pythagorean theorem, $a^2 + b^2 = c^2$, so $c = \sqrt{a^2 + b^2}$ for the hypotenuse.",
    r"The probability is the number of favourable outcomes over the total, $\frac{m}{n}$, in lowest terms.",
    r"Substituting $y = 2x + 1$ into the second equation, $3x + 2(2x + 1) = 16$, so $7x = 14$ and $x = 2$.",
    r"Hmm, wait. Let me double check the arithmetic: $12 \times 7 = 84$ and $84 - 19 = 65$.",
]


def answer_pair(rng: random.Random) -> tuple[str, str]:
    """One (final answer as the model writes it, reference answer), right about two times in three."""
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    right = rng.random() < 0.67
    kind = rng.choice(["integer", "fraction", "radical", "polynomial", "interval", "tuple", "pi", "bare"])
    if kind == "integer":
        return rf"\boxed{{{a * b if right else a * b + 1}}}", str(a * b)
    if kind == "fraction":
        return (rf"\boxed{{\dfrac{{{a}}}{{{a + b}}}}}" if right else rf"\boxed{{\frac{{{a + b}}}{{{a}}}}}",
                rf"\frac{{{2 * a}}}{{{2 * (a + b)}}}")
    if kind == "radical":
        return rf"\boxed{{{a}\sqrt{{{b if right else b + 1}}}}}", rf"\sqrt{{{a * a * b}}}"
    if kind == "polynomial":
        return rf"\boxed{{x^2 + {2 * a}x + {a * a if right else a * a + 1}}}", rf"(x + {a})^2"
    if kind == "interval":
        return rf"\boxed{{[{a}, {a + b})}}" if right else rf"\boxed{{({a}, {a + b}]}}", rf"[{a},{a + b})"
    if kind == "tuple":
        return rf"\boxed{{({a}, {b})}}" if right else rf"\boxed{{({b}, {a + 1})}}", rf"\left({a}, {b}\right)"
    if kind == "pi":
        return rf"\boxed{{\frac{{{a}\pi}}{{{b}}}}}", rf"\frac{{{a if right else a + 1}\pi}}{{{b}}}"
    return f"So the answer is {a + b if right else a + b + 2}.", str(a + b)


def completions(count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``count`` completions (a few sentences of reasoning, then the final answer) and their reference answers."""
    rng = random.Random(seed)
    texts, references = [], []
    for _ in range(count):
        final, reference = answer_pair(rng)
        reasoning = " ".join(rng.choices(REASONING, k=rng.randint(3, 10)))
        texts.append(f"{reasoning}\n\nTherefore, {final}")
        references.append(reference)
    return texts, references


def answers_per_second(scorer: Scorer, texts: list[str], references: list[str], repeats: int) -> tuple[float, list]:
    """The median rate of ``scorer`` over the batch in ``repeats`` runs, and its verdicts."""
    views = [sample_view(completion=text, completion_ids=[], prompt="", answer=reference, source="bench", fields={},
                         timeout_s=scorer.timeout_s) for text, reference in zip(texts, references)]
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        verdicts = scorer.score(views).correct
        rates.append(len(texts) / (time.perf_counter() - start))
    return statistics.median(rates), verdicts


def scorer(fn: str, workers: int, timeout_s: float) -> Scorer:
    made = Scorer(reward_entries([{"fn": fn}]), workers=workers, timeout_s=timeout_s)
    made.describe()  # loads the function where it runs (starts the pool's workers)
    return made


def worker_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers takes counts >= 2 separated by commas, got {text!r}") from None
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(f"--workers takes counts >= 2 separated by commas, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=400, help="completions per batch (default: 400)")
    parser.add_argument("--workers", type=worker_counts, default=[2, 4], help="pool sizes, e.g. 2,4,8 (default: 2,4)")
    parser.add_argument("--repeats", type=int, default=3, help="batches timed per setting; the median is printed")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per answer (dataset.reward_timeout_s)")
    args = parser.parse_args(argv)

    texts, references = completions(args.answers)
    cores = len(os.sched_getaffinity(0))
    print(f"{args.answers} answers, {sum(len(t) for t in texts) // len(texts)} characters each on average; "
          f"{cores} usable cores; median of {args.repeats}")
    numeric = scorer("numeric", 1, args.timeout)
    numeric_rate, _ = answers_per_second(numeric, texts, references, args.repeats)
    print(f"numeric check, in-process: {numeric_rate:,.0f} answers/s (never pooled)")

    serial = scorer("math", 1, args.timeout)
    answers_per_second(serial, texts[:1], references[:1], 1)  # math-verify's import, not timed
    serial_rate, expected = answers_per_second(serial, texts, references, args.repeats)
    print(f"math check, 1 (in-process): {serial_rate:7.1f} answers/s, {sum(expected):.0f} right")
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "user_reward.py").write_text(USER_REWARD)
        for count in args.workers:
            start = time.perf_counter()
            pooled = scorer("math", count, args.timeout)
            answers_per_second(pooled, texts[:count], references[:count], 1)  # every worker has math-verify
            started_s = time.perf_counter() - start
            rate, verdicts = answers_per_second(pooled, texts, references, args.repeats)
            counters = pooled.pool.counters
            pooled.close()
            if verdicts != expected:
                sys.exit(f"the pool of {count} disagrees with the in-process check on "
                         f"{sum(v != e for v, e in zip(verdicts, expected))} answers")
            user = scorer(f"{folder}/user_reward.py:length", count, args.timeout)
            user_rate, _ = answers_per_second(user, texts, references, args.repeats)
            user.close()
            print(f"math check, {count} workers: {rate:7.1f} answers/s, x{rate / serial_rate:.2f}; "
                  f"started in {started_s:.2f} s; {counters['worker_deaths']} deaths, "
                  f"{counters['stuck_workers_killed']} stuck; a user's function: {user_rate:,.0f} samples/s")

if __name__ == "__main__":
    main()
