"""A user's advantage method (``advantage.name="my_adv.py:fn"``), checked before the model loads: its signature takes
what every method is given, and a call on a small synthetic batch returns a finite ``[P, G]`` tensor of the rewards'
dtype within a time limit. The method then runs in the trainer (it works on the step's tensors); these checks make a
wrong one fail in seconds, naming it, instead of after the model loaded with a raw traceback."""

from __future__ import annotations

import inspect
import traceback

from fgrpo.algorithm.advantage_registry import AdvantageMethod

__all__ = ["user_method_problem", "CHECK_LIMIT_S"]

CHECK_LIMIT_S = 10.0  # the synthetic call's time limit: four small tensors, so a method taking longer is stuck
_SIGNATURE = "fn(rewards, correct, settings, seq_logp=None)"


def user_method_problem(method: AdvantageMethod, params: dict, group_size: int) -> str | None:
    """Why ``method`` cannot run (its signature, or what a call on a synthetic ``[3, group_size]`` batch returned or
    raised), or None. ``params``: the values its declared parameters take in this config."""
    signature = _SIGNATURE[:-1] + (", step_correct=None)" if method.needs_step else ")")
    try:
        bound = inspect.signature(method.fn)
    except (TypeError, ValueError) as error:
        return f"its signature cannot be read ({error}); write it as {signature}"
    try:
        if method.needs_step:
            bound.bind(1, 2, 3, 4, step_correct=5)
        else:
            bound.bind(1, 2, 3, 4)
    except TypeError as error:
        return f"takes ({', '.join(bound.parameters)}), which cannot be called as {signature} ({error})"
    return _synthetic_call_problem(method, params, group_size)


def _synthetic_call_problem(method: AdvantageMethod, params: dict, group_size: int) -> str | None:
    import torch

    from fgrpo.algorithm.advantage_methods import AdvantageError, AdvantageSettings, compute_advantages
    from fgrpo.user_code.time_limit import TimeLimitExceeded, run_with_time_limit

    group = max(2, group_size)
    generator = torch.Generator().manual_seed(0)
    correct = (torch.rand(3, group, generator=generator) < 0.5).float()
    correct[0, 0], correct[0, 1] = 1.0, 0.0  # one mixed group at least
    rewards = correct.clone()
    seq_logp = -torch.rand(3, group, generator=generator)
    settings = AdvantageSettings(method.name, **params)
    try:
        run_with_time_limit(lambda: compute_advantages(rewards, correct, settings, seq_logp, correct), CHECK_LIMIT_S)
    except TimeLimitExceeded:
        return f"did not return within {CHECK_LIMIT_S:g} s on a [3, {group}] batch"
    except AdvantageError as error:
        return f"on a synthetic [3, {group}] float32 batch: {error}"
    except Exception as error:  # noqa: BLE001 - the user's method raised: its traceback's end says where
        lines = "".join(traceback.format_exception(error)).rstrip().splitlines()
        return f"raised on a synthetic [3, {group}] float32 batch:\n" + "\n".join("    " + l for l in lines[-8:])
    return None
