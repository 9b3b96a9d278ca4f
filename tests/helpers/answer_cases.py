"""Completions and answers shared by the answer-check tests (tests/rewards/test_answers.py) and the pool's
(tests/user_code/test_pool.py)."""

# Sympy has to compute 10^(10^(10^10)) to compare it with anything: without a timeout this runs
# until memory runs out.
POWER_TOWER = r"The answer is \boxed{10^{10^{10^{10}}}}"


MATH_CASES = [
    (r"so the result is \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"so the result is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"so the result is \boxed{0.4}", r"\frac{1}{2}", 0.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),
    (r"\boxed{2\sqrt{3}}", r"2\sqrt{2}", 0.0),
    (r"\boxed{(3, \frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"\boxed{1,234}", "1234", 1.0),
    (r"The answer is $\boxed{5}$.", r"$5$", 1.0),  # a reference with its own delimiters
    ("I give up.", "5", 0.0),
]
