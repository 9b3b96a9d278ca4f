"""A user's advantage method by path, checked before any model loads (issue 71): a wrong signature, a ``[P]`` return,
a NaN, a method that hangs, each refused naming the method; a parameter named like a built-in one (``k``) gets the
user's own default or value, never the built-in's."""

import textwrap

import pytest

from fgrpo.infra.errors import ConfigError
from fgrpo.prepare import advantage_settings
from fgrpo.validation import validate

METHODS = '''
import time
from fgrpo.algorithm.advantage_registry import Param, advantage_method

def two_arguments(rewards, correct):
    return rewards

def per_prompt(rewards, correct, settings, seq_logp=None):
    return rewards.mean(dim=1)

def with_nan(rewards, correct, settings, seq_logp=None):
    return rewards * float("nan")

def as_float64(rewards, correct, settings, seq_logp=None):
    return rewards.double()

def raises(rewards, correct, settings, seq_logp=None):
    raise IndexError("my bug")

def hangs(rewards, correct, settings, seq_logp=None):
    time.sleep(3600)

@advantage_method("top_k", label="k", params={"k": Param(8, low=1, doc="mine")})
def top_k(rewards, correct, settings, seq_logp=None):
    return rewards.new_full(rewards.shape, float(settings.k))
'''


@pytest.fixture(scope="module")
def methods_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("adv") / "user_methods.py"
    path.write_text(textwrap.dedent(METHODS))
    return path


@pytest.mark.parametrize("name, message", [
    ("two_arguments", r"takes \(rewards, correct\), which cannot be called as fn\(rewards, correct, settings"),
    ("per_prompt", r"returned shape \[3\].* a finite \[P, G\] tensor"),
    ("with_nan", r"returned 12 non-finite values"),
    ("as_float64", r"returned dtype float64"),
    ("raises", r"raised on a synthetic \[3, 4\] float32 batch:(.|\n)*IndexError: my bug"),
])
def test_a_wrong_method_is_refused_before_load_naming_it(compose, methods_file, name, message):
    with pytest.raises(ConfigError, match=r"advantage.name=.*user_methods.py:" + name + r"(.|\n)*" + message):
        validate(compose(f"advantage.name={methods_file}:{name}", "algo.group_size=4"))


def test_a_method_that_hangs_on_the_synthetic_batch_is_refused(compose, methods_file, monkeypatch):
    from fgrpo.algorithm import user_method

    monkeypatch.setattr(user_method, "CHECK_LIMIT_S", 0.5)
    with pytest.raises(ConfigError, match=r"hangs.*did not return within 0.5 s"):
        validate(compose(f"advantage.name={methods_file}:hangs"))


def test_a_users_parameter_named_like_a_built_in_gets_its_own_default_and_value(compose, methods_file):
    cfg = compose(f"advantage.name={methods_file}:top_k")  # passk's k (4) is not set here: the user's default, 8
    validate(cfg)
    assert advantage_settings(cfg).k == 8
    assert advantage_settings(compose(f"advantage.name={methods_file}:top_k", "advantage.k=3")).k == 3
    assert advantage_settings(compose("advantage=passk")).k == 4  # the built-in keeps its own
