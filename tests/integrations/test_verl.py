"""fgrpo.integrations.verl: the estimator through verl's own lookup on the same tensors as fgrpo's F-GRPO advantage
(gamma 0: verl's GRPO estimator bit for bit; with and without std normalisation; groups out of order, of unequal
sizes, and of one response), its config errors, one registration however often it is imported, and registration by
the entry point and by VERL_USE_EXTERNAL_MODULES in a fresh interpreter. verl 0.9 is installed without its GPU
dependencies (scripts/setup.sh, FGRPO_WITH_INTEGRATIONS=1)."""

import importlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from fgrpo.algorithm.advantages import focal_group_advantages

from ci_strict import skip_unless_ci

try:
    from verl.trainer.ppo import core_algos

    import fgrpo.integrations.verl as estimator  # registers "fgrpo"
except ImportError as error:  # skipped where verl is missing; CI=true fails instead
    core_algos = estimator = None
    MISSING = f"verl does not import ({error}): FGRPO_WITH_INTEGRATIONS=1 bash scripts/setup.sh installs it"


@pytest.fixture(autouse=True)
def _needs_verl():
    if core_algos is None:
        skip_unless_ci(MISSING)


def algorithm(**keys):
    """verl's `algorithm` node as its trainer passes it: a DictConfig, the user's +algorithm.* keys in it."""
    return OmegaConf.create({"adv_estimator": "fgrpo", "norm_adv_by_std_in_grpo": True, **keys})


def batch(prompts=6, group=8, length=5, seed=0):
    """A verl batch of prompts x group responses in shuffled order: 0/1 scores spread over the response's tokens
    (verl sums them), padding masked out, uids per prompt. Returns it with the [P, G] scores in prompt order."""
    gen = torch.Generator().manual_seed(seed)
    solved = (torch.rand(prompts, group, generator=gen) < torch.linspace(0.0, 1.0, prompts)[:, None]).double()
    order = torch.randperm(prompts * group, generator=gen)
    scores = solved.flatten()[order]
    lengths = torch.randint(1, length + 1, (prompts * group,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]).double()
    token_rewards = torch.zeros(prompts * group, length, dtype=torch.float64)
    token_rewards[torch.arange(prompts * group), lengths - 1] = scores  # the score on the last token, as verl puts it
    uids = np.array([f"uid-{int(i) // group}" for i in order], dtype=object)
    return token_rewards, mask, uids, solved, order


@pytest.mark.parametrize("std", [True, False])
def test_the_registered_estimator_is_fgrpos_focal_advantage_and_gamma_0_is_verls_grpo(std):
    fn = core_algos.get_adv_estimator_fn("fgrpo")
    assert fn is estimator.fgrpo_outcome_advantage
    token_rewards, mask, uids, solved, order = batch()
    for gamma in (0.5, 1.0, 2.0):
        advantages, returns = fn(token_level_rewards=token_rewards, response_mask=mask, index=uids,
                                 config=algorithm(norm_adv_by_std_in_grpo=std, fgrpo_gamma=gamma,
                                                  fgrpo_success_threshold=1.0))
        expected = focal_group_advantages(solved, gamma, std_normalize=std, eps=1e-6).flatten()[order]
        torch.testing.assert_close(advantages, expected[:, None] * mask, atol=1e-9, rtol=0)
        assert torch.equal(advantages, returns)
    grpo = core_algos.get_adv_estimator_fn("grpo")(token_rewards, mask, uids, norm_adv_by_std_in_grpo=std)[0]
    ours = fn(token_level_rewards=token_rewards, response_mask=mask, index=uids,
              config=algorithm(norm_adv_by_std_in_grpo=std, fgrpo_gamma=0.0, fgrpo_success_threshold=1.0))[0]
    assert torch.equal(ours, grpo)
    assert not torch.equal(grpo, fn(token_level_rewards=token_rewards, response_mask=mask, index=uids,
                                    config=algorithm(norm_adv_by_std_in_grpo=std, fgrpo_success_threshold=1.0))[0])


def test_groups_of_unequal_size_and_of_one_response_take_their_own_success_rate():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # groups a: 3 (1/3 solved), b: 3 (2/3), c: 1 (solved)
    uids = np.array(["a", "b", "a", "b", "c", "a", "b"], dtype=object)
    mask = torch.ones(7, 1)
    grpo = core_algos.compute_grpo_outcome_advantage(scores[:, None], mask, uids)[0]
    ours = estimator.fgrpo_outcome_advantage(scores[:, None], mask, uids,
                                             config=algorithm(fgrpo_gamma=1.0, fgrpo_success_threshold=0.5))[0]
    weights = torch.tensor([2 / 3, 1 / 3, 2 / 3, 1 / 3, 0.0, 2 / 3, 1 / 3])
    torch.testing.assert_close(ours, grpo * weights[:, None])
    # verl's lone response: mean 0, std 1; solved, so its weight is 0
    assert float(grpo[4, 0]) == pytest.approx(1.0) and ours[4, 0] == 0


@pytest.mark.parametrize("keys, message", [
    ({}, "needs +algorithm.fgrpo_success_threshold=T"),
    ({"fgrpo_success_threshold": 1.0, "fgrpo_gamma": -1.0}, "algorithm.fgrpo_gamma must be a number >= 0"),
    ({"fgrpo_success_threshold": "high"}, "algorithm.fgrpo_success_threshold must be a finite number"),
])
def test_a_bad_algorithm_node_is_refused_naming_the_key(keys, message):
    token_rewards, mask, uids, _, _ = batch(prompts=2, group=2)
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        estimator.fgrpo_outcome_advantage(token_rewards, mask, uids, config=algorithm(**keys))
    with pytest.raises(ValueError, match="groups responses by their uid"):
        estimator.fgrpo_outcome_advantage(token_rewards, mask, None, config=algorithm(fgrpo_success_threshold=1.0))


def test_importing_twice_or_reloading_keeps_one_registration_and_a_foreign_fgrpo_is_refused():
    importlib.import_module("fgrpo.integrations.verl")
    reloaded = importlib.reload(estimator)
    assert core_algos.get_adv_estimator_fn("fgrpo") is reloaded.fgrpo_outcome_advantage
    foreign = lambda **kwargs: None  # noqa: E731
    foreign.__qualname__ = "foreign"
    core_algos.ADV_ESTIMATOR_REGISTRY["fgrpo"] = foreign
    try:
        with pytest.raises(ValueError, match="verl already has an advantage estimator named 'fgrpo'"):
            reloaded.register()
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY["fgrpo"] = reloaded.fgrpo_outcome_advantage


def test_an_unsupported_verl_is_refused_naming_the_versions(monkeypatch):
    import verl

    monkeypatch.setattr(verl, "__version__", "0.5.0")
    with pytest.raises(ImportError, match=r"supports verl 0\.9\.x; this is verl 0\.5\.0"):
        estimator.register()


LOOKUP = ("import verl; from verl.trainer.ppo.core_algos import get_adv_estimator_fn; "
          "print(get_adv_estimator_fn('fgrpo').__module__)")


@pytest.mark.parametrize("how", ["entry point", "VERL_USE_EXTERNAL_MODULES"])
def test_a_fresh_interpreter_finds_the_estimator(how):
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "auto"}
    if how == "VERL_USE_EXTERNAL_MODULES":  # entry points off: only the module named by the variable registers it
        env.update(VERL_USE_EXTERNAL_PLUGINS="none", VERL_USE_EXTERNAL_MODULES="fgrpo.integrations.verl")
    else:
        env.pop("VERL_USE_EXTERNAL_MODULES", None)
    done = subprocess.run([sys.executable, "-c", LOOKUP], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "fgrpo.integrations.verl"
    env.update(VERL_USE_EXTERNAL_PLUGINS="none")
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    missing = subprocess.run([sys.executable, "-c", LOOKUP], env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "Unknown advantage estimator" in missing.stderr  # neither: not registered
