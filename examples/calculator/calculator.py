"""A tool task in TRL's ``environment_factory`` shape (docs/environments.md): two-digit products, which the model can
compute with a ``multiply`` tool. The class runs unchanged as TRL 1.16's ``GRPOTrainer(environment_factory=Calculator)``.

    python run.py --config-dir examples/calculator experiment=calculator

The episode's verdict is fgrpo's ``numeric`` check on the whole assistant text (its last number against the row's
answer): the class has no ``get_reward``, as the tool cannot see the final answer.
"""


class Calculator:
    def reset(self, **row) -> None:
        self.calls = 0  # nothing to add to the prompt: the question and the worked example are in it

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.

        Returns:
            The product a * b.
        """
        self.calls += 1
        return a * b


def generate(seed: int = 0, count: int = 400, largest: int = 99) -> list[dict]:
    """Rows of two-digit products, each prompt a chat that first works one example through the tool (a call, its
    result, the answer), as a model that has never seen the tool format needs."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(10, largest), rng.randint(10, largest)
        x, y = rng.randint(10, largest), rng.randint(10, largest)
        call = f'<tool_call>{{"name": "multiply", "arguments": {{"a": {x}, "b": {y}}}}}</tool_call>'
        messages = [
            {"role": "user", "content": f"What is {x} * {y}? Use the multiply tool, then answer with just the number."},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": str(x * y)},
            {"role": "assistant", "content": str(x * y)},
            {"role": "user", "content": f"What is {a} * {b}? Use the multiply tool, then answer with just the number."},
        ]
        rows.append({"messages": messages, "answer": str(a * b), "a": a, "b": b})
    return rows
