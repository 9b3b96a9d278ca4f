"""fgrpo.algorithm.advantage_registry: a method is one decorated function; the schema, the range checks, the labels and
the choices derive from its declaration, and a user's method loads by import path."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fgrpo.algorithm import advantage_registry
from fgrpo.algorithm.advantage_methods import AdvantageSettings, compute_advantages, method_label, methods
from fgrpo.algorithm.advantage_registry import Param, advantage_method
from fgrpo.infra.errors import ConfigError


@pytest.fixture(autouse=True)
def declarations_restored(monkeypatch):
    """What a test declares is forgotten after it (the declarations are process-wide)."""
    methods()
    monkeypatch.setattr(advantage_registry, "_DECLARED", dict(advantage_registry._DECLARED))

USER_METHOD = '''
from fgrpo.algorithm.advantage_registry import Param, advantage_method

@advantage_method("constant_push", label="alpha", params={
    "alpha": Param(1.0, low=0.0, low_open=True, doc="the advantage of every sample"),
    "rounds": Param(2, low=1, high="algo.group_size", doc="unused here: an integer bounded by another key")})
def constant_push(rewards, correct, settings, seq_logp=None):
    """Every sample's advantage is alpha, right or wrong."""
    return rewards.new_full(rewards.shape, settings.alpha)
'''


def test_the_schema_and_its_defaults_come_from_the_declarations(compose):
    from fgrpo.config import advantage_node

    # unset (null: the chosen method's own default); gamma is focal.gamma's: its group
    assert advantage_node() == {"name": "???", "lam": None, "beta": None, "k": None}
    assert compose("advantage=passk").advantage.k == 4 and compose("advantage=passk", "advantage.k=2").advantage.k == 2
    with pytest.raises(Exception, match="advantage.lamm"):  # a misspelt key fails at start with Hydra's message
        compose("advantage.lamm=0.5")
    declared = methods()
    assert declared["mean_focal"].needs_step and not declared["focal"].needs_step
    assert {name for name, m in declared.items() if not m.shaped_rewards} == {"maxrl", "w_reinforce", "passk"}


def test_the_declarations_load_without_torch():
    code = ("import sys; import fgrpo.config, fgrpo.algorithm.advantage_methods as m; m.methods(); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_a_params_range_with_a_bound_from_another_key():
    param = Param(4, low=1, high="algo.group_size", doc="a k-subset")
    assert param.problem(4, {"algo.group_size": 8}.get) is None
    assert param.problem(9, {"algo.group_size": 8}.get) == "must be in [1, algo.group_size=8] (a k-subset)"
    assert param.problem(2.5, {"algo.group_size": 8}.get) == "must be an integer (a k-subset)"
    assert Param(0.1, low=0.0, low_open=True, doc="d").problem(0.0) == "must be > 0.0 (d)"


def test_a_method_declared_in_a_test_is_called_with_its_parameters():
    @advantage_method("test_scaled_centre", label="scale", params={"scale": Param(2.0, low=0.0, doc="x")})
    def scaled_centre(rewards, correct, settings, seq_logp=None):
        return settings.scale * (rewards - rewards.mean(dim=1, keepdim=True))

    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    out = compute_advantages(rewards, rewards, AdvantageSettings("test_scaled_centre", scale=3.0))
    torch.testing.assert_close(out, torch.tensor([[1.5, -1.5, -1.5, 1.5]]))
    assert method_label("test_scaled_centre", {"scale": 3.0}) == "test_scaled_centre scale=3"
    assert AdvantageSettings("test_scaled_centre").scale == 2.0  # the declared default
    with pytest.raises(ValueError, match="two advantage methods are named 'focal'"):
        advantage_method("focal")(scaled_centre)


@pytest.fixture
def user_method(tmp_path):
    path = tmp_path / "my_advantage.py"
    path.write_text(USER_METHOD)
    return f"{path}:constant_push"


def test_a_users_method_by_import_path_is_checked_and_changes_the_advantages(compose, user_method):
    from fgrpo.prepare import advantage_settings
    from fgrpo.validation import validate

    cfg = compose(f"advantage.name={user_method}", "+advantage.alpha=2.5")
    validate(cfg)
    settings = advantage_settings(cfg)
    assert settings.params == {"alpha": 2.5, "rounds": 2}
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(compute_advantages(rewards, rewards, settings), torch.full((2, 2), 2.5))
    assert method_label(user_method, settings.params) == f"{user_method} alpha=2.5"
    for override, message in (("+advantage.alpha=-1", r"advantage.alpha=-1: must be > 0.0 \(the advantage of every"),
                              ("+advantage.alpha=much", r"advantage.alpha='much': must be a finite number"),
                              ("+advantage.rounds=9", r"advantage.rounds=9: must be in \[1, algo.group_size=8\]"),
                              ("+advantage.alhpa=2", r"advantage.alhpa=2: is not a parameter of advantage=.*"
                                                     r"\(its parameters: \['alpha', 'rounds'\]\)"),
                              ("focal.gamma=1", "focal.gamma=1.0: weights advantage=focal only")):
        with pytest.raises(ConfigError, match=message):
            validate(compose(f"advantage.name={user_method}", override))


def test_an_unknown_method_lists_the_choices_and_the_import_path_form(compose):
    from fgrpo.validation import validate

    with pytest.raises(ConfigError, match=r"advantage.name='grpo_passk': must be one of \('focal', .*'passk'\) "
                                          r"\(advantage=<name>\), or a function of yours by import path"):
        validate(compose("advantage.name=grpo_passk"))
    with pytest.raises(ConfigError, match="the file .*no_such.py does not exist"):
        validate(compose("advantage.name=no_such.py:method"))


def test_a_users_method_takes_its_parameters_from_an_experiment_file(tmp_path, user_method):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from fgrpo.prepare import advantage_settings
    from fgrpo.validation import validate

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        f"# @package _global_\nadvantage:\n  name: {user_method}\n  alpha: 3.0\n")
    repo = Path(__file__).resolve().parents[2]
    with initialize_config_dir(config_dir=str(repo / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine"])
    validate(cfg)
    assert advantage_settings(cfg).alpha == 3.0
