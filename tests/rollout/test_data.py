import json
import operator
import re
import shutil
import socket
import subprocess
import sys
import time

import pandas as pd
import pytest

from fgrpo.infra import hub
from fgrpo.rollout.data import Problem, arithmetic_problems, build_prompt, load_problems
from fgrpo.infra.errors import DataError

QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@pytest.fixture(autouse=True)
def isolated_datasets_cache(tmp_path, monkeypatch):
    """Keep the Arrow copies `datasets` makes out of the user's ~/.cache."""
    import datasets

    cache = tmp_path / "hf_datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    bars_were_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    yield cache
    if not bars_were_disabled:
        datasets.enable_progress_bars()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --- arithmetic ------------------------------------------------------------------------------


def test_arithmetic_sizes_and_disjoint_split():
    train, held_out = arithmetic_problems()
    assert (len(train), len(held_out)) == (160, 40)
    ids = [p.id for p in train + held_out]
    assert len(set(ids)) == 200
    assert {p.id for p in train}.isdisjoint({p.id for p in held_out})
    assert {p.question for p in train}.isdisjoint({p.question for p in held_out})
    assert {p.source for p in train + held_out} == {"arithmetic"}


def test_arithmetic_answers_are_right():
    train, held_out = arithmetic_problems(ops=("+", "-", "*"), max_operand=12, n_eval=50)
    assert len(train) + len(held_out) == 3 * 13 * 13
    for problem in train + held_out:
        a, op, b = QUESTION.fullmatch(problem.question).groups()
        assert problem.answer == str(OPS[op](int(a), int(b)))
        assert problem.id == f"arithmetic/{a}{op}{b}"
    assert any(p.answer.startswith("-") for p in train + held_out)


def test_arithmetic_split_is_seeded():
    first = arithmetic_problems(seed=3)
    assert arithmetic_problems(seed=3) == first
    other_train, other_eval = arithmetic_problems(seed=4)
    assert [p.id for p in other_eval] != [p.id for p in first[1]]
    assert {p.id for p in other_train + other_eval} == {p.id for p in first[0] + first[1]}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ops=("+", "/")), r"unknown arithmetic ops \['/'\].*choose from \['\+', '-', '\*'\]"),
        (dict(ops=()), "ops is empty"),
        (dict(ops=("+", "+")), "repeats an op"),
        (dict(n_eval=200), r"n_eval=200 leaves no training problems.*give 200 problems; use n_eval < 200"),
        (dict(n_eval=0), "n_eval must be >= 1"),
        (dict(max_operand=-1), "max_operand must be >= 0"),
        (dict(seed=1.5), "seed must be an integer"),
    ],
)
def test_arithmetic_rejects_bad_arguments(kwargs, message):
    with pytest.raises(DataError, match=message):
        arithmetic_problems(**kwargs)


# --- local files -----------------------------------------------------------------------------


def test_load_jsonl(tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [{"question": "What is 2 + 2?", "answer": "4"}, {"question": " Half of 3? ", "answer": 1.5, "extra": 1}],
    )
    problems = load_problems(name="mine", kind="file", path=str(path))
    assert problems == [
        Problem(id="mine/0", question="What is 2 + 2?", answer="4", source="mine"),
        Problem(id="mine/1", question="Half of 3?", answer="1.5", source="mine"),
    ]


def test_numeric_answers_become_exact_text(tmp_path):
    # 3 and 2.5 in one JSON column load as floats 3.0 and 2.5
    rows = [{"question": f"q{i}", "answer": value} for i, value in enumerate([3, 2.5, -7, 1e-7, 12345678901])]
    path = write_jsonl(tmp_path / "numbers.jsonl", rows)
    answers = [p.answer for p in load_problems(name="n", kind="file", path=str(path))]
    assert answers == ["3", "2.5", "-7", "0.0000001", "12345678901"]


def test_list_answers(tmp_path):
    rows = [{"question": "q0", "answer": ["$\\frac{1}{2}$"]}, {"question": "q1", "answer": ["1", "2"]}]
    path = write_jsonl(tmp_path / "lists.jsonl", rows)
    assert [p.answer for p in load_problems(name="l", kind="file", path=str(path))] == ["$\\frac{1}{2}$", "1, 2"]


def test_load_json_csv_parquet_with_custom_fields(tmp_path):
    rows = [{"problem": f"What is {i} + 1?", "final": str(i + 1)} for i in range(5)]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    for suffix in ("json", "csv", "parquet"):
        problems = load_problems(
            name=suffix, kind="file", path=str(tmp_path / f"d.{suffix}"), question_field="problem", answer_field="final"
        )
        assert [(p.id, p.question, p.answer) for p in problems] == [
            (f"{suffix}/{i}", f"What is {i} + 1?", str(i + 1)) for i in range(5)
        ]


def test_csv_keeps_answers_as_written(tmp_path):
    (tmp_path / "d.csv").write_text('question,answer\nq0,007\nq1,"1,234"\nq2,0.50\n')
    answers = [p.answer for p in load_problems(name="c", kind="file", path=str(tmp_path / "d.csv"))]
    assert answers == ["007", "1,234", "0.50"]


def test_limit_keeps_the_first_rows_and_only_checks_them(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(6)] + [{"question": "broken"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    problems = load_problems(name="d", kind="file", path=str(path), limit=3)
    assert [p.id for p in problems] == ["d/0", "d/1", "d/2"]
    assert len(load_problems(name="d", kind="file", path=str(path), limit=6)) == 6
    with pytest.raises(DataError, match=r"line 7 has no usable answer"):
        load_problems(name="d", kind="file", path=str(path), limit=100)
    with pytest.raises(DataError, match="limit must be >= 1"):
        load_problems(name="d", kind="file", path=str(path), limit=0)


def test_missing_file_names_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as caught:
        load_problems(name="d", kind="file", path="no/such/train.jsonl")
    message = str(caught.value)
    assert str(tmp_path / "no/such/train.jsonl") in message
    assert "does not exist" in message


def test_row_without_the_answer_names_file_row_and_fields(tmp_path):
    rows = [
        {"question": "q0", "answer": "0"},
        {"question": "q1", "answer": "1"},
        {"question": "q2", "solution": "the answer is 2"},
    ]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError) as caught:
        load_problems(name="d", kind="file", path=str(path))
    message = str(caught.value)
    assert str(path) in message
    assert ": line 3 has no usable answer field" in message
    assert "'answer'" in message
    assert "['question', 'solution']" in message
    assert "answer_field=" in message


@pytest.mark.parametrize(
    "row, field",
    [
        ({"question": "", "answer": "1"}, "question"),
        ({"question": "   ", "answer": "1"}, "question"),
        ({"question": 5, "answer": "1"}, "question"),
        ({"question": "q", "answer": ""}, "answer"),
        ({"question": "q", "answer": None}, "answer"),
    ],
)
def test_empty_values_are_rejected(tmp_path, row, field):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "ok", "answer": "1"}, row])
    with pytest.raises(DataError, match=rf"line 2 has no usable {field} field '{field}'"):
        load_problems(name="d", kind="file", path=str(path))


def test_field_missing_from_every_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "q", "answer": "1"}])
    with pytest.raises(DataError, match=r"line 1 .*'question' \(missing or null\); the row has fields \['problem', 'answer'\]"):
        load_problems(name="d", kind="file", path=str(path))


def test_bad_file_arguments(tmp_path):
    (tmp_path / "d.txt").write_text("question,answer\n")
    with pytest.raises(DataError, match=r"extension '\.txt'.*\['\.jsonl', '\.json', '\.parquet', '\.csv'\]"):
        load_problems(name="d", kind="file", path=str(tmp_path / "d.txt"))
    with pytest.raises(DataError, match="is not a file"):
        load_problems(name="d", kind="file", path=str(tmp_path))
    with pytest.raises(DataError, match=r"unknown dataset kind 'folder'.*\['file', 'hub'\]"):
        load_problems(name="d", kind="folder", path=str(tmp_path))
    with pytest.raises(DataError, match="needs path="):
        load_problems(name="d", kind="file", path=None)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl"):
        load_problems(name="d", kind="file", path=str(tmp_path / "empty.jsonl"))
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answer": \n')
    with pytest.raises(DataError, match=r"dataset file .*broken.jsonl: no line is a JSON object \(line 1 is not valid"):
        load_problems(name="d", kind="file", path=str(tmp_path / "broken.jsonl"))


# --- hub -------------------------------------------------------------------------------------


def assert_offline_message(message: str, dataset_id: str):
    assert f"dataset '{dataset_id}' is not in the local Hugging Face cache" in message
    assert "the hub cannot be reached" in message
    assert "dataset=local dataset.train.path=" in message


def test_hub_dataset_offline_by_env_fails_fast(monkeypatch):
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(DataError) as caught:
        load_problems(name="m", kind="hub", path="fgrpo-tests/not-cached", split="test")
    assert time.perf_counter() - started < 10
    assert_offline_message(str(caught.value), "fgrpo-tests/not-cached")
    assert "HF_HUB_OFFLINE=1" in str(caught.value)
    assert datasets.config.HF_HUB_OFFLINE is False  # offline mode is restored after the load


def test_hub_dataset_with_unreachable_hub_fails_fast(monkeypatch):
    for var in hub.OFFLINE_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    started = time.perf_counter()
    with pytest.raises(DataError) as caught:
        load_problems(name="m", kind="hub", path="fgrpo-tests/not-cached")
    assert time.perf_counter() - started < 10
    assert_offline_message(str(caught.value), "fgrpo-tests/not-cached")
    assert "no network" in str(caught.value)


def test_cached_hub_dataset_loads_offline(tmp_path, monkeypatch, isolated_datasets_cache):
    """A dataset in the local cache loads without a network. The cache entry is built by hand in
    the layout datasets 5 uses (<namespace>___<name>/<config>/<version>/<hash>/<name>-<split>.arrow)."""
    import datasets

    pd.DataFrame({"problem": ["What is 1 + 1?", "What is 2 + 2?"], "answer": [2, 4]}).to_parquet(tmp_path / "t.parquet")
    datasets.load_dataset("parquet", data_files=str(tmp_path / "t.parquet"), split="train")
    built = next(p for p in (isolated_datasets_cache / "parquet").glob("*/*/*") if p.is_dir())
    cached = isolated_datasets_cache / "fgrpo-tests___tiny" / "default" / "0.0.0" / built.name
    shutil.copytree(built, cached)
    (cached / "parquet-train.arrow").rename(cached / "tiny-train.arrow")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problems = load_problems(name="tiny", kind="hub", path="fgrpo-tests/tiny", question_field="problem")
    assert [(p.id, p.answer) for p in problems] == [("tiny/0", "2"), ("tiny/1", "4")]
    with pytest.raises(DataError, match=r"could not load hub dataset 'fgrpo-tests/tiny'.*Unknown split"):
        load_problems(name="tiny", kind="hub", path="fgrpo-tests/tiny", split="test")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_hub_probe():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert hub.hub_reachable(f"https://127.0.0.1:{server.getsockname()[1]}", timeout_s=2.0) is True
    assert hub.hub_reachable(f"https://127.0.0.1:{closed_port()}", timeout_s=2.0) is False
    assert hub.hub_reachable("not a url", timeout_s=2.0) is False
    assert hub.hub_reachable("https://127.0.0.1:notaport", timeout_s=2.0) is False


def test_hub_probe_is_bounded_when_dns_or_connect_hangs(monkeypatch):
    # getaddrinfo has no timeout of its own: a stuck resolver must not stall the probe
    def stuck_connection(address, timeout=None):
        time.sleep(5)
        raise OSError("never answered")

    monkeypatch.setattr(hub.socket, "create_connection", stuck_connection)
    started = time.perf_counter()
    assert hub.hub_reachable("https://huggingface.co", timeout_s=0.5) is False
    assert time.perf_counter() - started < 1.5


# --- prompts and imports ---------------------------------------------------------------------


def test_build_prompt():
    assert build_prompt("What is 3 * 4?", instruction="Put the answer in \\boxed{}.") == (
        "What is 3 * 4? Put the answer in \\boxed{}."
    )
    assert build_prompt("What is 3 * 4?", instruction="") == "What is 3 * 4?"


def test_import_is_cheap():
    code = "import sys, fgrpo.rollout.data; print(sorted({'datasets', 'torch', 'transformers'} & set(sys.modules)))"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert completed.stdout.strip() == "[]", completed.stderr
