"""fgrpo.integrations.trl: real TRL GRPOTrainer runs (two steps, the tiny random Llama, CPU) with FocalGRPOTrainer.
The advantages the loss reads are fgrpo's F-GRPO advantages of the same rewards under every ``scale_rewards``
option (gamma 0: TRL's own), the verdict being one reward column of two; on two gloo ranks a group straddles them
and each rank's slice carries its groups' weights. Also the refusals: a TRL it does not know, a verdict it cannot
find."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fgrpo.algorithm.advantages import focal_group_advantages, focal_weight

from ci_strict import skip_unless_ci
from trl_case import recording_trainer

try:
    import trl  # noqa: F401
    MISSING = None
except ImportError as error:  # skipped where TRL is missing; CI=true fails instead
    MISSING = f"TRL does not import ({error}): FGRPO_WITH_INTEGRATIONS=1 bash scripts/setup.sh installs it"


@pytest.fixture(autouse=True)
def _needs_trl():
    if MISSING:
        skip_unless_ci(MISSING)

CHILDREN = Path(__file__).resolve().parents[1] / "children"  # trl_case.py: the run, in-process or under torchrun


@pytest.fixture(scope="module")
def model_folder(compose):
    from fgrpo.learner.model import resolve_model_folder

    return resolve_model_folder(compose("model=tiny_random").model)


def expected_advantages(rewards: torch.Tensor, scale: str, gamma: float, generations: int) -> torch.Tensor:
    """F-GRPO's advantage from the gathered [N, 2] rewards (the verdict in column 0): fgrpo's focal_group_advantages
    at TRL's epsilon (1e-4) for "group" and "none"; "batch" divides by the batch's std, so by hand, times fgrpo's
    focal weight."""
    total = rewards.sum(dim=1).view(-1, generations).double()
    correct = (rewards[:, 0] >= 1.0).double().view(-1, generations)
    if scale == "batch":
        centred = total - total.mean(dim=1, keepdim=True)
        return (focal_weight(correct, gamma)[:, None] * centred / (total.std() + 1e-4)).flatten()
    return focal_group_advantages(total, gamma, correct=correct, std_normalize=scale == "group", eps=1e-4).flatten()


@pytest.mark.parametrize("scale, gamma", [("group", 1.0), ("batch", 2.0), ("none", 0.5), ("group", 0.0)])
def test_the_advantages_trained_on_are_fgrpos_of_the_same_rewards(model_folder, tmp_path, scale, gamma):
    trainer = recording_trainer(model_folder, tmp_path, scale_rewards=scale, gamma=gamma, per_device=8, generations=4)
    trainer.records.clear()
    trainer.train()
    assert len(trainer.records) == 2  # a generation per step
    mixed = 0
    for record in trainer.records:
        rewards = torch.tensor(record["rewards"])
        expected = expected_advantages(rewards, scale, gamma, 4)
        torch.testing.assert_close(torch.tensor(record["advantages"]).double(), expected, atol=2e-6, rtol=1e-5)
        solved = (rewards[:, 0] >= 1).view(-1, 4).double().mean(dim=1)
        mixed += int(((solved > 0) & (solved < 1)).sum())
    assert mixed >= 1  # a group with a weight strictly between 0 and 1 was trained on
    logged = [row for row in trainer.state.log_history if "fgrpo/focal_weight_mean" in row]  # a row per step
    weights = [row["fgrpo/focal_weight_mean"] for row in logged]
    assert len(weights) == 2 and all(0 <= w <= 1 for w in weights)
    assert all(0 <= row["fgrpo/success_rate"] <= 1 for row in logged)
    if gamma == 0:  # TRL's own advantages, untouched
        assert weights == [1.0, 1.0]


def test_normalize_then_sum_is_weighted_after_trls_own_normalisation(model_folder, tmp_path):
    trainer = recording_trainer(model_folder, tmp_path, scale_rewards="group", gamma=1.0, per_device=8, generations=4,
                                aggregation="normalize_then_sum")
    trainer.records.clear()
    trainer.train()
    for record in trainer.records:
        rewards = torch.tensor(record["rewards"]).double()
        grouped = rewards.view(-1, 4, 2)
        z = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
        summed = z.sum(dim=2).flatten()
        trl_own = (summed - summed.mean()) / (summed.std() + 1e-4)
        weight = focal_weight((rewards[:, 0] >= 1).double().view(-1, 4), 1.0).repeat_interleave(4)
        torch.testing.assert_close(torch.tensor(record["advantages"]).double(), weight * trl_own, atol=2e-6, rtol=1e-5)


def test_on_two_ranks_a_group_straddles_them_and_each_slice_has_its_groups_weight(model_folder, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHILDREN), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    with socket.socket() as probe:  # a free port: torchrun's rendezvous does not take port 0
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), str(CHILDREN / "trl_case.py"), str(model_folder), str(tmp_path), "group", "1.0"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    misplaced = 0
    for step in range(2):
        rewards = torch.tensor(ranks[0][step]["rewards"])
        assert rewards.tolist() == ranks[1][step]["rewards"]  # both ranks gathered the same [12, 2] rewards
        assert rewards.shape == (12, 2)  # three groups of 4, six completions on each rank: group 1 straddles them
        trained = torch.tensor(ranks[0][step]["advantages"] + ranks[1][step]["advantages"]).double()
        expected = expected_advantages(rewards, "group", 1.0, 4)
        torch.testing.assert_close(trained, expected, atol=2e-6, rtol=1e-5)
        # had rank 1 weighed its slice as rank 0's (a wrong slice start), would this step have caught it?
        weights = focal_weight((rewards[:, 0] >= 1).double().view(-1, 4), 1.0).repeat_interleave(4)
        unweighted = expected / torch.where(weights > 0, weights, 1.0)
        misplaced += not torch.allclose(weights[:6] * unweighted[6:], expected[6:], atol=1e-6)
    assert misplaced >= 1


def test_an_unknown_trl_or_verdict_is_refused_naming_it(model_folder, tmp_path):
    from fgrpo.integrations.trl import check_trl_version

    with pytest.raises(ImportError, match=r"supports TRL 1\.16\.x .* this is TRL 1\.17\.0: install trl==1\.16\.\*"):
        check_trl_version("1.17.0")
    check_trl_version("1.16.0")
    from datasets import Dataset

    import trl_case
    from fgrpo.integrations.trl import FocalGRPOTrainer

    made = recording_trainer(model_folder, tmp_path, scale_rewards="group", gamma=1.0, per_device=8, generations=4)
    given = dict(model=made.model, args=made.args, train_dataset=Dataset.from_dict({"prompt": ["1 + 1 ="] * 8}),
                 processing_class=made.processing_class)
    rewards = [trl_case.solved, trl_case.length_bonus]
    unknown = r"verdict='accuracy' names no reward function .* \['solved', 'length_bonus'\]"
    with pytest.raises(ValueError, match=unknown):
        FocalGRPOTrainer(reward_funcs=rewards, verdict="accuracy", **given)
    with pytest.raises(ValueError, match=r"verdict='accuracy' names no reward function"):  # before any model loads
        FocalGRPOTrainer("/no/such/model", rewards, verdict="accuracy", args=made.args)
    with pytest.raises(ValueError, match=r"needs verdict=NAME, the reward function that says solved, among \['solved'"):
        FocalGRPOTrainer(reward_funcs=rewards, **given)
    with pytest.raises(ValueError, match=r"focal_gamma must be a number >= 0"):
        FocalGRPOTrainer(reward_funcs=rewards, verdict="solved", focal_gamma=-1, **given)
    assert FocalGRPOTrainer(reward_funcs=rewards[:1], **given).verdict_column == 0  # one reward function: the verdict
