"""fgrpo.tasks.reasoning_gym (dataset=reasoning_gym) with the real reasoning-gym library: rows seeded and split so that
held-out problems never train, tasks mixed by weight, the reward through fgrpo's real Scorer (a worker process), bad
input refused before anything loads, the error where the package is missing, and a short run through run.py."""

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ci_strict import skip_unless_ci
from fgrpo.infra.errors import ConfigError
from fgrpo.infra.run_files import read_metrics
from fgrpo.rewards.binding import sample_view
from fgrpo.rewards.entries import reward_entries
from fgrpo.rewards.scoring import Scorer
from fgrpo.tasks.reasoning_gym import REQUIREMENT, extract_answer, main, require_reasoning_gym, task_specs
from test_run import EAGER, TINY, run_cli

REPO = Path(__file__).resolve().parents[2]
SMALL = ["dataset=reasoning_gym", "dataset.tasks_train_size=60", "dataset.tasks_eval_size=10"]
ARITHMETIC = ("{name: basic_arithmetic, weight: 1, config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, "
              "operators: ['+'], allow_parentheses: false, allow_negation: false}}")
FEW_LEGS = "{name: leg_counting, weight: 3, config: {min_animals: 1, max_animals: 1, max_instances: 2}}"
LEGS = "dataset.tasks=[{name: leg_counting, config: {min_animals: 1, max_animals: 2}}]"


@pytest.fixture
def installed():
    if importlib.util.find_spec("reasoning_gym") is None:
        skip_unless_ci(f"reasoning-gym is not installed here: FGRPO_WITH_REASONING_GYM=1 bash scripts/setup.sh "
                       f"(scripts/test.sh does), or pip install '{REQUIREMENT}'")


@pytest.fixture
def load(compose, installed):
    from fgrpo.prepare import load_data

    return lambda *overrides: load_data(compose(*SMALL, *overrides).dataset, instruction="Just the answer.",
                                        require_answer=False)


def questions(problems) -> list[str]:
    return [p.question for p in problems]


def test_rows_are_the_same_for_a_seed_and_differ_for_another(load):
    first, again, other = load(LEGS, "seed=3"), load(LEGS, "seed=3"), load(LEGS, "seed=4")
    assert first.digest() == again.digest()
    # another seed, other problems: not reasoning-gym's items shifted by one (its item i is drawn from seed + i)
    assert not set(questions(first.eval["leg_counting"])) & set(questions(other.eval["leg_counting"]))
    assert len(set(questions(first.train)) & set(questions(other.train))) < 6
    pinned = load(LEGS, "seed=4", "dataset.tasks_seed=3")  # the data's own seed keeps them while the run's changes
    assert pinned.digest() == first.digest()
    problem = first.eval["leg_counting"][0]
    assert problem.id == "leg_counting/3/0" and problem.source == "leg_counting"
    assert problem.prompt == f"{problem.question} Just the answer."  # the task's question, then model.instruction
    assert problem.fields["entry"]["metadata"]["source_dataset"] == "leg_counting"
    assert first.columns() == {"question", "answer", "task", "task_config", "entry"}


def test_held_out_problems_never_appear_in_training(load):
    data = load(f"dataset.tasks=[{FEW_LEGS}]", "dataset.tasks_eval_size=12")  # one animal, 1 or 2 of it: few problems
    held_out = questions(data.eval["leg_counting"])
    assert len(held_out) == len(set(held_out)) == 12
    train = questions(data.train)
    assert len(train) == 60 and not set(train) & set(held_out)
    # the training rows come after the held-out items and skip their repeats: a small task repeats often
    indices = [int(p.id.rsplit("/", 1)[1]) for p in data.train]
    assert min(indices) > max(int(p.id.rsplit("/", 1)[1]) for p in data.eval["leg_counting"])
    assert indices != list(range(indices[0], indices[0] + 60))


def test_a_mix_of_tasks_shares_the_training_problems_by_weight(load):
    data = load(f"dataset.tasks=[{FEW_LEGS}, {ARITHMETIC}]", "dataset.tasks_train_size=40")
    by_task = [p.fields["task"] for p in data.train]
    assert by_task.count("leg_counting") == 30 and by_task.count("basic_arithmetic") == 10
    assert {name: len(problems) for name, problems in data.eval.items()} == {"leg_counting": 10,
                                                                             "basic_arithmetic": 10}
    assert all(p.source == p.fields["task"] for p in data.train)  # data_source names the task
    assert data.train[-1].fields["task_config"]["operators"] == ["+"]  # its settings travel to the reward workers


def test_the_reward_scores_right_1_and_wrong_0_in_a_worker(load):
    data = load(f"dataset.tasks=[{FEW_LEGS}, {ARITHMETIC}]")
    problems = [p for held_out in data.eval.values() for p in held_out[:3]]
    scorer = Scorer(reward_entries([{"fn": "fgrpo.tasks.reasoning_gym:score_answer"}]), workers=1, timeout_s=10.0)
    try:
        scorer.describe()
        scorer.check_columns(data.columns())
        replies = []
        for p in problems:
            wrong = str(int(p.answer) + 1)
            replies += [(p, f"I think <answer>{p.answer}</answer>"), (p, f"<answer>{wrong}</answer>"),
                        (p, f"So it is {p.answer}"), (p, f"so {p.answer} + 1 = {wrong}")]
        batch = scorer.score([sample_view(completion=text, completion_ids=[1, 2], prompt=p.prompt, answer=p.answer,
                                          source=p.source, fields=p.fields, timeout_s=10.0) for p, text in replies])
        assert scorer.pool.pids  # it ran in a worker process, not here
    finally:
        scorer.close()
    assert batch.correct == [1.0, 0.0, 1.0, 0.0] * len(problems) and batch.errors == 0
    assert batch.values["score_answer"] == [1.0, 0.0, 1.0, 0.0] * len(problems)
    assert batch.values["score_answer/tagged"] == [1.0, 1.0, 0.0, 0.0] * len(problems)


def test_extracting_the_answer():
    assert extract_answer("x <answer>a</answer> then <answer> b </answer>", "b") == ("b", True)  # the last, stripped
    assert extract_answer("so <answer>12", "12") == ("12", True)  # left open: what follows
    assert extract_answer("1 + 5 = 6", "6") == ("6", False)  # a number's task: the last number
    assert extract_answer("The answer is -4.", "-4") == ("-4", False)
    assert extract_answer("  olleh \n", "olleh") == ("olleh", False)  # else the whole reply
    assert extract_answer("", "3") == ("", False)


@pytest.mark.parametrize("tasks, says", [
    (["leg_count"], "'leg_count' is not a reasoning-gym task: did you mean leg_counting"),
    (["no_such_thing_at_all"], "python -m fgrpo.tasks.reasoning_gym lists them"),
    (["composite"], "fgrpo mixes tasks itself"),
    ([{"name": "leg_counting", "config": {"max_animals": 0}}],
     "dataset.tasks[0].config={'max_animals': 0}: reasoning-gym's leg_counting refuses it: max_animals"),
    ([{"name": "leg_counting", "config": {"legs": 3}}], "dataset.tasks[0].config.legs: leg_counting has no setting"),
    ([{"name": "leg_counting", "config": {"seed": 3}}], "dataset.tasks[0].config.seed: fgrpo sets each task's seed"),
    ([{"name": "leg_counting", "weight": 0}], "dataset.tasks[0].weight=0: must be a positive finite number"),
    ([{"name": "leg_counting", "weight": float("inf")}], "dataset.tasks[0].weight=inf"),
    ([{"name": "leg_counting", "weight": float("nan")}], "dataset.tasks[0].weight=nan"),
    ([{"name": "leg_counting", "weight": "heavy"}], "dataset.tasks[0].weight='heavy'"),
    ([{"name": "leg_counting", "weight": True}], "dataset.tasks[0].weight=True"),
    ([{"name": "leg_counting", "weights": 2}], "dataset.tasks[0] has ['weights']: an entry takes"),
    (["leg_counting", "gcd", "leg_counting"], "dataset.tasks[0], dataset.tasks[2] all name 'leg_counting'"),
    ([], "list reasoning-gym tasks by name"),
])
def test_bad_tasks_are_refused_naming_the_key(installed, tasks, says):
    with pytest.raises(ConfigError) as raised:
        task_specs(tasks)
    assert says in str(raised.value)


def test_bad_tasks_stop_load_data_before_any_model(load):
    with pytest.raises(ConfigError, match=r"dataset.tasks\[1\].weight=-1"):
        load(f"dataset.tasks=[{FEW_LEGS}, {{name: gcd, weight: -1}}]")
    with pytest.raises(ConfigError, match="makes only .* distinct problems"):
        load(f"dataset.tasks=[{FEW_LEGS}]", "dataset.tasks_eval_size=80")


def test_listing_the_tasks(installed, capsys):
    assert main([]) == 0 and "leg_counting" in capsys.readouterr().out.split()
    assert main(["leg_counting"]) == 0 and "max_animals: 10" in capsys.readouterr().out
    assert main(["leg_count"]) == 2 and "did you mean leg_counting" in capsys.readouterr().err


def test_without_the_package_the_error_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises: as where it is missing
    with pytest.raises(ConfigError) as raised:
        require_reasoning_gym()
    message = str(raised.value)
    assert "\n" not in message and f"-m pip install '{REQUIREMENT}'" in message


def test_a_run_without_the_package_stops_before_the_model_with_one_line(tmp_path):
    # the trainer's process sees no reasoning_gym (None in sys.modules); a model that cannot be found shows that the
    # data's check came first
    hide = ("import runpy, sys; sys.modules['reasoning_gym'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hide, str(REPO / "run.py"), f"hydra.run.dir={tmp_path}",
                             "dataset=reasoning_gym", "model=tiny_random", "model.source=hub",
                             "model.path=/nonexistent/model", "sampler=hf", "logger=none"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs the package reasoning-gym" in errors[0], result.stderr[-3000:]
    assert f"pip install '{REQUIREMENT}'" in errors[0] and "nonexistent" not in result.stderr


def test_the_extra_is_pinned_and_installed_by_the_tests_only():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["reasoning-gym"] == [REQUIREMENT]
    setup, tests = ((REPO / "scripts" / name).read_text() for name in ("setup.sh", "test.sh"))
    assert 'extras="run,dev"' in setup  # not by default
    assert '[ "${FGRPO_WITH_REASONING_GYM:-0}" = 1 ] && extras="$extras,reasoning-gym"' in setup
    assert "FGRPO_WITH_REASONING_GYM=1" in tests


def test_a_short_run_on_a_reasoning_gym_task_logs_its_reward(tmp_path, installed):
    result = run_cli(tmp_path, *TINY, "sampler=hf", "logger=none", EAGER, *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert len(steps) == 2 and len(evals) == 3
    assert all("train/reward/score_answer" in r and r["train/reward_errors"] == 0 for r in steps)
    assert {"eval/products/pass@1", "eval/products/reward/score_answer/tagged"} <= set(evals[-1])  # conf's task
