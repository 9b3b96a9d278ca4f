"""reasoning-gym's tasks by name (``dataset=reasoning_gym``, ``dataset.kind=reasoning_gym``): its seeded generators
make the problems in the trainer's process before any model loads, and :func:`score_answer`, a reward function that
runs in the reward workers like a user's, scores a completion with the task's own ``score_answer``.

The split. Each task makes its problems from one reasoning-gym dataset, its seed a hash of ``dataset.tasks_seed``
(default: the run's seed) and the task's name (:func:`task_seed`; reasoning-gym's item ``i`` of seed ``s`` is drawn
from ``s + i``, so seeds 3 and 4 themselves would share all but one item). The held-out problems are the first
``dataset.tasks_eval_size`` distinct questions from index 0 on; the training rows come from the indices after them,
skipping any row whose question is held out (by any task), so a held-out problem never appears in training even where
a task has few distinct problems. ``dataset.tasks_train_size`` training rows are shared among the tasks by weight;
each task is its own evaluation set (``eval/<task>/pass@k``; ``eval/pass@k`` averages the tasks). A problem's id,
``<task>/<tasks_seed>/<index>``, says how to make it again.

What a worker needs to score a row travels in its columns: ``task`` (the name), ``task_config`` (the task's settings:
some tasks' scorers read their config) and ``entry`` (the item as reasoning-gym made it: question, answer, metadata);
each worker builds a task's scorer once. reasoning-gym is an optional extra: imported only here, this module loads
without it, and a run that asks for it without it stops before any model loads, naming the install command.

``python -m fgrpo.tasks.reasoning_gym`` lists the task names; ``... <name>`` one task's settings and defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import json
import logging
import math
import numbers
import re
import sys
from dataclasses import dataclass, replace
from typing import Any, Mapping

from omegaconf import OmegaConf

from fgrpo.infra.errors import ConfigError, DataError
from fgrpo.rollout.data import Problem, RowFormat, rows_to_problems

with contextlib.suppress(ImportError):  # a reward worker imports it at its start, not within a call's time limit
    import reasoning_gym  # noqa: F401

__all__ = ["REQUIREMENT", "TaskSpec", "require_reasoning_gym", "task_specs", "task_seed", "reasoning_gym_problems",
           "extract_answer", "score_answer"]

log = logging.getLogger("fgrpo")

REQUIREMENT = "reasoning-gym==0.1.25"  # pyproject.toml's reasoning-gym extra (tests/tasks/test_reasoning_gym.py)
_TASK_KEYS = ("name", "weight", "config")
_OWN_SETTINGS = {"seed": "dataset.tasks_seed", "size": "dataset.tasks_train_size and dataset.tasks_eval_size"}
_OPEN, _CLOSE = "<answer>", "</answer>"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # an integer or a decimal, its sign kept
_LIST_HINT = "python -m fgrpo.tasks.reasoning_gym lists them"


def install_command() -> str:
    """The command that installs the extra into the interpreter running now."""
    return f"{sys.executable} -m pip install '{REQUIREMENT}'"


def require_reasoning_gym():
    """The ``reasoning_gym`` package, or a one-line ConfigError naming the command that installs it."""
    try:
        import reasoning_gym
    except ModuleNotFoundError as error:
        if error.name not in (None, "reasoning_gym"):
            raise ConfigError(f"reasoning-gym is installed but cannot import {error.name!r} ({error}): reinstall it "
                              f"with {install_command()}") from error
        raise ConfigError(f"dataset.kind=reasoning_gym needs the package reasoning-gym, which is not installed here: "
                          f"install it with {install_command()} (or FGRPO_WITH_REASONING_GYM=1 bash scripts/setup.sh)"
                          ) from error
    return reasoning_gym


def _registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's tasks: name -> (dataset class, config class); its composite left out (fgrpo mixes)."""
    require_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return {name: classes for name, classes in DATASETS.items() if name != "composite"}


# --- the config ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """One checked entry of ``dataset.tasks``."""

    name: str
    weight: float
    config: dict[str, Any]  # reasoning-gym's settings for the task, without seed and size (fgrpo sets those)
    key: str  # dataset.tasks[i], for messages


def task_specs(tasks: Any, key: str = "dataset.tasks") -> list[TaskSpec]:
    """``dataset.tasks`` checked: each a task's name or ``{name, weight, config}``, a known name, a positive finite
    weight, settings that reasoning-gym's own config class takes and validates.

    Raises:
        ConfigError: listing every problem, each naming its key and the fix.
    """
    if isinstance(tasks, (str, Mapping)) or not tasks:
        raise ConfigError(f"{key}={tasks!r}: list reasoning-gym tasks by name, e.g. '{key}=[leg_counting]' or "
                          f"'{key}=[{{name: basic_arithmetic, weight: 2, config: {{max_terms: 2}}}}]' ({_LIST_HINT})")
    registry = _registry()
    problems: list[str] = []
    specs = [spec for index, item in enumerate(tasks)
             if (spec := _task_spec(item, f"{key}[{index}]", registry, problems)) is not None]
    names = [spec.name for spec in specs]
    for name in sorted({name for name in names if names.count(name) > 1}):
        problems.append(f"{', '.join(s.key for s in specs if s.name == name)} all name {name!r}: list each task once "
                        "(its settings in one entry's config)")
    if problems:
        raise ConfigError("invalid reasoning-gym tasks:\n  " + "\n  ".join(problems))
    return specs


def _task_spec(item: Any, key: str, registry: dict, problems: list[str]) -> TaskSpec | None:
    if isinstance(item, str):
        item = {"name": item}
    if not isinstance(item, Mapping):
        problems.append(f"{key}={item!r}: give a task's name or {{name: ..., weight: ..., config: {{...}}}}")
        return None
    unknown = [k for k in item if k not in _TASK_KEYS]
    if unknown:
        problems.append(f"{key} has {unknown}: an entry takes {list(_TASK_KEYS)} (the task's own settings go under "
                        f"{key}.config)")
    name = item.get("name")
    if name == "composite":
        problems.append(f"{key}.name='composite': fgrpo mixes tasks itself: list each in dataset.tasks with a weight")
        return None
    if not isinstance(name, str) or name not in registry:
        close = difflib.get_close_matches(str(name), list(registry), n=4, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        problems.append(f"{key}.name={name!r} is not a reasoning-gym task: {hint}({len(registry)} tasks; {_LIST_HINT})")
        return None
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight) or weight <= 0:
        problems.append(f"{key}.weight={weight!r}: must be a positive finite number (its share of the training "
                        "problems, e.g. weight: 1.0)")
        return None
    config = item.get("config") or {}
    if not isinstance(config, Mapping):
        problems.append(f"{key}.config={config!r}: must be the task's settings, e.g. {{min_terms: 2}}")
        return None
    config = dict(config)
    problem = _config_problem(name, config, f"{key}.config", registry[name][1])
    if problem:
        problems.append(problem)
        return None
    return TaskSpec(name, float(weight), config, key)


def _config_problem(name: str, config: dict, key: str, config_cls: type) -> str | None:
    """Why reasoning-gym's config class refuses ``config`` (None: it takes it), naming the setting."""
    settings = [f.name for f in dataclasses.fields(config_cls) if f.name not in _OWN_SETTINGS]
    for own, where in _OWN_SETTINGS.items():
        if own in config:
            return f"{key}.{own}: fgrpo sets each task's {own} ({where}): remove it"
    unknown = [setting for setting in config if setting not in settings]
    if unknown:
        return (f"{key}.{unknown[0]}: {name} has no setting {unknown[0]!r}; its settings: {settings} "
                f"(python -m fgrpo.tasks.reasoning_gym {name} shows their defaults)")
    try:
        made = config_cls(**config)
        if callable(getattr(made, "validate", None)):
            made.validate()
    except Exception as error:  # noqa: BLE001 - reasoning-gym's validation (asserts, ValueError): its message
        return f"{key}={config}: reasoning-gym's {name} refuses it: {str(error) or type(error).__name__}"
    return None


def _shares(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders get the rest; ties to the earlier task)."""
    exact = [total * weight / sum(weights) for weight in weights]
    counts = [math.floor(share) for share in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def task_seed(seed: int, task: str) -> int:
    """reasoning-gym's seed for ``task`` under ``dataset.tasks_seed=seed``: a 32-bit hash of both, so that two seeds'
    items (drawn from reasoning-gym's seed + index) do not overlap, and two tasks draw apart."""
    digest = hashlib.sha256(f"fgrpo.tasks.reasoning_gym/{seed}/{task}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def _whole(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{key}={value!r}: must be an integer >= {minimum}")
    return int(value)


# --- the problems ----------------------------------------------------------------------------


def reasoning_gym_problems(dataset_cfg, fmt: RowFormat) -> tuple[list[Problem], dict[str, list[Problem]]]:
    """(training problems, held-out problems per task) of ``dataset.tasks`` (the module's docstring says how they
    are split); each prompt per ``fmt`` (the question with ``model.instruction``, or ``dataset.prompt_template``)."""
    tasks = dataset_cfg.tasks
    specs = task_specs(OmegaConf.to_container(tasks, resolve=True) if OmegaConf.is_config(tasks) else tasks)
    seed = _whole("dataset.tasks_seed", dataset_cfg.tasks_seed, 0)
    n_train = _whole("dataset.tasks_train_size", dataset_cfg.tasks_train_size, 1)
    n_eval = _whole("dataset.tasks_eval_size", dataset_cfg.tasks_eval_size, 1)
    counts = _shares(n_train, [spec.weight for spec in specs])
    starved = [f"{spec.key} ({spec.name}, weight {spec.weight:g})" for spec, count in zip(specs, counts) if not count]
    if starved:
        raise ConfigError(f"{', '.join(starved)} get none of the dataset.tasks_train_size={n_train} training problems: "
                          "raise their weight or dataset.tasks_train_size")
    made = [_TaskRows(spec, seed, n_eval, count) for spec, count in zip(specs, counts)]
    held_questions = {item["question"] for task in made for _, item in task.held_out}
    train, held_out = [], {}
    for task in made:
        task.fill_training(held_questions)
        held_out[task.spec.name] = task.problems(task.held_out, fmt)
        train += task.problems(task.train, fmt)
    log.info("reasoning-gym (seed %d): %s", seed, "; ".join(task.describe() for task in made))
    return train, held_out


class _TaskRows:
    """One task's items: the held-out ones (made on construction) and the training ones (:meth:`fill_training`)."""

    def __init__(self, spec: TaskSpec, seed: int, n_eval: int, n_train: int):
        self.spec, self.seed, self.n_train = spec, seed, n_train
        self.eval_limit, self.train_limit = 10 * n_eval + 100, 10 * n_train + 100  # indices looked at, at most
        # the size comes from the config alone (a few tasks draw their items' kinds from it up front)
        self.dataset = require_reasoning_gym().create_dataset(spec.name, **spec.config, seed=task_seed(seed, spec.name),
                                                              size=self.eval_limit + self.train_limit)
        self.held_out: list[tuple[int, dict]] = []
        self.train: list[tuple[int, dict]] = []
        self.skipped = 0
        seen: set[str] = set()
        self.next_index = 0
        while len(self.held_out) < n_eval and self.next_index < self.eval_limit:
            item = self._item(self.next_index)
            if item["question"] not in seen:
                seen.add(item["question"])
                self.held_out.append((self.next_index, item))
            self.next_index += 1
        if len(self.held_out) < n_eval:
            raise ConfigError(f"{spec.key} ({spec.name}): its config makes only {len(self.held_out)} distinct "
                              f"problems in {self.eval_limit} tries, fewer than dataset.tasks_eval_size={n_eval}: "
                              f"lower it, or widen {spec.key}.config")

    def _item(self, index: int) -> dict:
        try:
            return self.dataset[index]
        except Exception as error:  # noqa: BLE001 - reasoning-gym's generator raised: say which task and item
            raise DataError(f"{self.spec.key}: reasoning-gym's {self.spec.name} raised making item {index} of seed "
                            f"{self.dataset.seed}: {type(error).__name__}: {error}") from error

    def fill_training(self, held_questions: set[str]) -> None:
        """Training items from the indices after the held-out ones, any with a held-out question skipped."""
        stop = self.next_index + self.train_limit
        while len(self.train) < self.n_train and self.next_index < stop:
            item = self._item(self.next_index)
            if item["question"] in held_questions:
                self.skipped += 1
            else:
                self.train.append((self.next_index, item))
            self.next_index += 1
        if len(self.train) < self.n_train:
            raise ConfigError(f"{self.spec.key} ({self.spec.name}): only {len(self.train)} of its "
                              f"{self.train_limit} items after the held-out ones are not held out, fewer than its "
                              f"{self.n_train} training problems: lower dataset.tasks_train_size or "
                              f"dataset.tasks_eval_size, or widen {self.spec.key}.config")

    def problems(self, items: list[tuple[int, dict]], fmt: RowFormat) -> list[Problem]:
        """The items as problems: the columns question, answer, task, task_config and entry; ids
        ``<task>/<seed>/<index>``."""
        name = self.spec.name
        rows = [{"question": item["question"], "answer": item["answer"], "task": name, "task_config": self.spec.config,
                 "entry": item} for _, item in items]
        made = rows_to_problems(rows, where=f"reasoning-gym task {name} ({self.spec.key})", name=name, fmt=fmt,
                                places=[f"item {index} of seed {self.dataset.seed}" for index, _ in items])
        return [replace(problem, id=f"{name}/{self.seed}/{index}") for problem, (index, _) in zip(made, items)]

    def describe(self) -> str:
        distinct = len({item["question"] for _, item in self.train})
        return (f"{self.spec.name} (its seed {self.dataset.seed}): {len(self.held_out)} held out (items from 0), "
                f"{len(self.train)} training ({distinct} distinct; {self.skipped} skipped as held out)")


# --- the reward ------------------------------------------------------------------------------


def extract_answer(completion: str, reference: str | None = None) -> tuple[str, bool]:
    """The answer in a completion and whether it was tagged. reasoning-gym's convention first: the text of the last
    ``<answer>...</answer>`` (an ``<answer>`` left open: what follows it). Untagged, for a small model that writes
    just the answer or ends with it: the last number where the task's answer (``reference``) is a number (as fgrpo's
    ``numeric`` check reads "1 + 5 = 6"), else the whole completion. Stripped; no backtracking regex, so a long
    completion costs linear time."""
    close = completion.rfind(_CLOSE)
    opened = completion.rfind(_OPEN, 0, close) if close >= 0 else -1
    if opened >= 0:
        return completion[opened + len(_OPEN):close].strip(), True
    opened = completion.rfind(_OPEN)
    if opened >= 0:
        return completion[opened + len(_OPEN):].strip(), True
    if isinstance(reference, str) and _NUMBER.fullmatch(reference.strip()):
        numbers = _NUMBER.findall(completion)
        if numbers:
            return numbers[-1], False
    return completion.strip(), False


@functools.lru_cache(maxsize=64)
def _scorer(task: str, config_json: str):
    """The task's dataset as a scorer, made once per worker (some load word lists or read their config)."""
    return require_reasoning_gym().create_dataset(task, **json.loads(config_json), seed=0, size=1)


def score_answer(completion: str, task: str, entry: Mapping[str, Any],
                 task_config: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The reward of ``dataset=reasoning_gym``: the task's own ``score_answer`` (1.0 right, some tasks give partial
    credit below it) on the completion's answer (:func:`extract_answer`, by the task's answer in ``entry``). Also
    logged: ``tagged`` (the answer was in ``<answer>`` tags) and ``unscorable`` (the task's scorer raised on the
    answer, e.g. text where it parses a number: scored 0, as a wrong answer)."""
    answer, tagged = extract_answer(completion, entry.get("answer"))
    scorer = _scorer(task, json.dumps(dict(task_config or {}), sort_keys=True))
    try:
        value, unscorable = float(scorer.score_answer(answer, entry=dict(entry))), 0.0
    except Exception:  # noqa: BLE001 - an answer the task cannot read is a wrong one
        value, unscorable = 0.0, 1.0
    return {"score": value if math.isfinite(value) else 0.0, "tagged": float(tagged), "unscorable": unscorable}


# --- python -m fgrpo.tasks.reasoning_gym [task] ----------------------------------------------


def main(argv: list[str]) -> int:
    """Print the task names, or one task's settings with their defaults and an example question."""
    try:
        registry = _registry()
        if not argv:
            print("\n".join(sorted(registry)))
            return 0
        name = argv[0]
        if name not in registry:
            task_specs([name])  # raises, with the close matches
        example = _scorer(name, "{}")  # the defaults, seed 0
        for setting, value in dataclasses.asdict(example.config).items():
            if setting not in _OWN_SETTINGS:
                print(f"{setting}: {value!r}")
        print(f"\nexample question (item 0 of seed 0):\n{example[0]['question']}")
        return 0
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
