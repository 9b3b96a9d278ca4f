"""Environments the tests run, one of each shape and each fault, written as a user would (imported by path in the
workers of the user-code pool)."""

import asyncio
import os
import time


class Countdown:
    """A text game: say the row's number; a wrong try is told "higher" or "lower"; three tries."""

    def reset(self, answer: str):
        self.answer, self.tries = int(answer), 0
        return "Say the number."

    def step(self, text):
        self.tries += 1
        digits = "".join(c for c in text if c.isdigit())
        if digits and int(digits) == self.answer:
            return None, {"score": 1.0, "correct": True, "tries": float(self.tries)}, True
        return ("higher" if not digits or int(digits) < self.answer else "lower"), 0.0, self.tries >= 3


class DictGame(Countdown):
    """The same game, its step returning a dict."""

    def step(self, text):
        observation, reward, done = super().step(text)
        return {"observation": observation, "reward": reward, "done": done}


class Tools:
    """TRL's environment_factory shape: tools with hints and docstrings, get_reward."""

    def reset(self, answer: str, **row):
        self.answer, self.total = int(answer), 0
        return None

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first.
            b: The second.
        """
        self.total = a + b
        return self.total

    async def wait_and_echo(self, text: str) -> str:
        """Echo a text after a short wait (an async tool).

        Args:
            text: What to echo.
        """
        await asyncio.sleep(0.01)
        return text

    def explode(self, why: str) -> str:
        """A tool that raises.

        Args:
            why: The reason.
        """
        raise RuntimeError(f"tool exploded: {why}")

    def die(self, code: int) -> str:
        """A tool that kills its worker.

        Args:
            code: The exit code.
        """
        os._exit(code)

    def get_reward(self) -> float:
        return {"score": float(self.total == self.answer), "correct": self.total == self.answer}


class HangingStep(Countdown):
    def step(self, text):
        time.sleep(3600)


class RaisingReset:
    def reset(self, answer: str):
        raise ValueError("reset is broken")

    def step(self, text):
        return None, 0.0, True


class BadStep(Countdown):
    def step(self, text):
        return "not a tuple"


class NoShape:
    def reset(self):
        return None


class ToolWithoutDocstring:
    def reset(self):
        return None

    def lookup(self, key: str) -> str:
        return key


class StepTakingTwo:
    def reset(self):
        return None

    def step(self, text, extra):
        return None, 0.0, True


class ResetNeedsColumn:
    def reset(self, missing_column):
        return None

    def step(self, text):
        return None, 0.0, True


class StuckStep(Countdown):
    """A step stuck where its time limit cannot reach it (SIGALRM blocked, as C code may do)."""

    def step(self, text):
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
