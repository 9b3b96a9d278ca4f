"""The advantage methods' names, settings and labels, without torch (the sweep report reads them from saved configs).
The methods themselves: :mod:`fgrpo.algorithm.advantage_methods`."""

from __future__ import annotations

from dataclasses import dataclass

# "focal" at gamma 0 is the plain GRPO / DAPO / CISPO advantage, the reference of every comparison
METHODS = ("focal", "mean_focal", "dr_grpo", "maxrl", "unlikeliness", "w_reinforce", "passk")
REFERENCE = "focal"
# the one parameter that sets a method apart, shown in its label
_PARAMETER = {"w_reinforce": "lam", "unlikeliness": "beta", "passk": "k"}


@dataclass(frozen=True)
class AdvantageSettings:
    """One method and its parameters (the ``advantage`` config group plus ``focal.gamma``). Its defaults are the
    config schema's too (``AdvantageConfig`` reads them from here)."""

    method: str  # a name in METHODS
    gamma: float = 0.0  # focal: (1 - mu_hat) ** gamma; mean_focal: its mean over the step
    lam: float = 0.1  # w_reinforce: the weight of a correct sample
    beta: float = 0.25  # unlikeliness: the largest rank penalty
    k: int = 4  # passk: the k of the pass@k the advantage trains


def method_label(settings: AdvantageSettings, *, with_gamma: bool = True) -> str:
    """The method with the parameter that sets it apart: ``focal gamma=1`` (``focal`` without gamma), ``passk k=4``,
    ``maxrl``."""
    key = _PARAMETER.get(settings.method,
                         "gamma" if settings.method in ("focal", "mean_focal") and with_gamma else None)
    return f"{settings.method} {key}={getattr(settings, key):g}" if key else settings.method
