"""Episodes hosted in real worker processes of the user-code pool (fgrpo.environments.hosts): each shape's calls, and
each fault a user's class can cause, each caused for real: a call that raises, hangs, kills its worker, returns what
its shape does not allow; a tool called wrongly. The episode it hits ends, the others go on, the pool counts it."""

from pathlib import Path

import pytest

from fgrpo.environments.hosts import EpisodeHosts
from fgrpo.environments.spec import describe
from fgrpo.infra.errors import ConfigError
from fgrpo.user_code.pool import WorkerPool
from fgrpo.user_code.running import run_request

ENVS = Path(__file__).with_name("envs.py")


def target(name: str) -> str:
    return f"{ENVS}:{name}"


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(run_request, 2, timeout_s=5.0, seed=0) as workers:
        yield workers


def test_a_text_game_plays_on_each_episodes_own_instance(pool):
    with EpisodeHosts(pool, target("Countdown"), 3, timeout_s=5.0) as hosts:
        resets = hosts.call([("reset", e, ({"answer": str(10 + e)}, e)) for e in range(3)])
        assert [r.value for r in resets] == ["Say the number."] * 3
        first = hosts.call([("step", e, "5") for e in range(3)])
        assert [r.value[0] for r in first] == ["higher"] * 3 and not any(r.value[2] for r in first)
        right = hosts.call([("step", e, str(10 + e)) for e in range(3)])  # each instance holds its own answer
        assert all(r.value == (None, (1.0, True, {"tries": 2.0}), True) for r in right), right
    with EpisodeHosts(pool, target("DictGame"), 1, timeout_s=5.0) as hosts:
        hosts.call([("reset", 0, ({"answer": "7"}, 0))])
        assert hosts.call([("step", 0, "9")])[0].value == ("lower", (0.0, None, {}), False)


def test_tools_sync_and_async_wrong_calls_and_get_reward(pool):
    with EpisodeHosts(pool, target("Tools"), 2, timeout_s=5.0) as hosts:
        hosts.call([("reset", e, ({"answer": "5", "question": "q"}, e)) for e in range(2)])
        replies = hosts.call([("tool", 0, ("add", {"a": 2, "b": 3})), ("tool", 1, ("wait_and_echo", {"text": "hi"})),
                              ("tool", 1, ("nope", {})), ("tool", 1, ("add", {"a": 1})), ("tool", 1, ("reset", {}))])
        assert [r.status for r in replies] == ["ok", "ok", "tool_error", "tool_error", "tool_error"]
        assert replies[0].value == "5" and replies[1].value == "hi"
        assert "unknown tool 'nope'" in replies[2].value and "missing a required argument: 'b'" in replies[3].value
        rewards = hosts.call([("reward", 0, None), ("reward", 1, None)])
        assert [r.value for r in rewards] == [(1.0, True, {}), (0.0, False, {})]


def test_a_raising_tool_a_bad_step_and_a_raising_reset_end_their_episode_only(pool):
    with EpisodeHosts(pool, target("Tools"), 2, timeout_s=5.0) as hosts:
        hosts.call([("reset", e, ({"answer": "5"}, e)) for e in range(2)])
        replies = hosts.call([("tool", 0, ("explode", {"why": "test"})), ("tool", 1, ("add", {"a": 2, "b": 3}))])
        assert replies[0].status == "failed" and replies[0].kind == "raised"
        assert "RuntimeError: tool exploded: test" in replies[0].message and "fgrpo" not in replies[0].message
        assert replies[1].value == "5"
        assert hosts.call([("tool", 0, ("add", {"a": 1, "b": 1}))])[0].status == "failed"  # its instance is gone
    with EpisodeHosts(pool, target("BadStep"), 1, timeout_s=5.0) as hosts:
        hosts.call([("reset", 0, ({"answer": "1"}, 0))])
        reply = hosts.call([("step", 0, "1")])[0]
        assert reply.kind == "value" and "return (observation, reward, done)" in reply.message
    with EpisodeHosts(pool, target("RaisingReset"), 1, timeout_s=5.0) as hosts:
        reply = hosts.call([("reset", 0, ({"answer": "1"}, 0))])[0]
        assert reply.kind == "raised" and "ValueError: reset is broken" in reply.message


def test_a_hanging_step_times_out_and_a_dying_tool_ends_its_hosts_episodes(pool):
    with EpisodeHosts(pool, target("HangingStep"), 1, timeout_s=1.0) as hosts:
        hosts.call([("reset", 0, ({"answer": "1"}, 0))])
        reply = hosts.call([("step", 0, "2")])[0]
        assert reply.kind == "timeout" and "1 s time limit" in reply.message
    deaths = pool.worker_deaths
    with EpisodeHosts(pool, target("Tools"), 2, timeout_s=5.0) as hosts:  # episode 0 on host 0, episode 1 on host 1
        hosts.call([("reset", e, ({"answer": "5"}, e)) for e in range(2)])
        replies = hosts.call([("tool", 0, ("die", {"code": 3})), ("tool", 1, ("add", {"a": 2, "b": 3}))])
        assert replies[0].kind == "died" and "exit code 3" in replies[0].message
        assert replies[1].value == "5"  # the other host goes on
        assert hosts.call([("tool", 0, ("add", {"a": 1, "b": 1}))])[0].kind == "died"
    assert pool.worker_deaths == deaths + 1
    with EpisodeHosts(pool, target("Countdown"), 2, timeout_s=5.0) as hosts:  # the pool serves the next batch
        assert [r.status for r in hosts.call([("reset", e, ({"answer": "1"}, e)) for e in range(2)])] == ["ok", "ok"]


@pytest.mark.parametrize("name,message", [
    ("NoShape", "has reset but neither step(text)"),
    ("ToolWithoutDocstring", "tool method ToolWithoutDocstring.lookup cannot be described"),
    ("StepTakingTwo", "step must take one argument"),
])
def test_a_class_of_neither_shape_is_refused_naming_the_key(name, message):
    with pytest.raises(ConfigError, match="dataset.environment") as error:
        describe(target(name))
    assert message in str(error.value)


def test_describe_reads_each_shape_and_reset_checks_the_columns():
    game, tools = describe(target("Countdown")), describe(target("Tools"))
    assert (game.shape, game.reset_params, tools.shape, tools.has_get_reward) == ("game", ("answer",), "tools", True)
    assert set(tools.tool_names) == {"add", "wait_and_echo", "explode", "die"} and tools.reset_any
    assert tools.tools[0]["function"]["parameters"]["required"] == ["a", "b"]
    with pytest.raises(ConfigError, match=r"reset takes \['missing_column'\]"):
        describe(target("ResetNeedsColumn")).check_columns({"question", "answer"})


def test_a_step_stuck_past_its_alarm_gets_its_worker_killed_and_the_pool_goes_on(pool):
    stuck = pool.stuck_workers_killed
    with EpisodeHosts(pool, target("StuckStep"), 1, timeout_s=1.0) as hosts:
        hosts.call([("reset", 0, ({"answer": "1"}, 0))])
        reply = hosts.call([("step", 0, "2")])[0]
        assert reply.kind == "timeout" and "its worker was killed" in reply.message
    assert pool.stuck_workers_killed == stuck + 1
    with EpisodeHosts(pool, target("Countdown"), 2, timeout_s=5.0) as hosts:
        assert [r.status for r in hosts.call([("reset", e, ({"answer": "1"}, e)) for e in range(2)])] == ["ok", "ok"]
