"""A text game for fgrpo's environments (docs/environments.md): an arithmetic question, answered in up to three tries.
After a wrong try the model is told whether it was too high or too low, and tries again.

    python run.py --config-dir examples/guess experiment=guess

The rows are fgrpo's arithmetic problems (their columns: question, answer, a, op, b); ``reset`` takes the answer by
name. A right answer scores 1 and ends the episode; its reward says whether it was the first try (``first_try``,
logged as train/env/reward/first_try and eval/<set>/env/reward/first_try).
"""

import re

NUMBER = re.compile(r"-?\d+")


class GuessTheAnswer:
    def __init__(self, tries: int = 3):
        self.tries = tries

    def reset(self, answer: str) -> str:
        self.answer, self.tried = int(answer), 0
        return (f"You have {self.tries} tries. After a wrong one you are told whether it was too high or too low. "
                "Answer with just the number.")

    def step(self, text: str):
        self.tried += 1
        numbers = NUMBER.findall(text)
        if numbers and int(numbers[-1]) == self.answer:
            return None, {"score": 1.0, "correct": True, "first_try": float(self.tried == 1)}, True
        if self.tried >= self.tries:
            return None, {"score": 0.0, "correct": False, "first_try": 0.0}, True
        if not numbers:
            hint = "That is not a number. Answer with just the number."
        else:
            hint = f"{numbers[-1]} is too {'high' if int(numbers[-1]) > self.answer else 'low'}. Try again."
        return hint, {"score": 0.0, "first_try": 0.0}, False
