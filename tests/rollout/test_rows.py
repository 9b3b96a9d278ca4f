"""fgrpo.rollout.rows and the row-reading parts of fgrpo.rollout.data: every column kept, dotted fields, prompt
templates, chat messages, verl's parquet layout as it is, and a user's generator by import path."""

import json

import pandas as pd
import pytest

from fgrpo.infra.errors import ConfigError, DataError
from fgrpo.rollout.data import RowFormat, generated_problems, load_problems, rows_to_problems, with_prompts
from fgrpo.rollout.rows import MISSING, field_value, render_template, template_fields


def test_fields_by_name_or_dotted_path():
    row = {"reward_model": {"ground_truth": "72", "style": "rule"}, "a.b": 1, "a": {"b": 2}}
    assert field_value(row, "reward_model.ground_truth") == "72"
    assert field_value(row, "a.b") == 1  # a column whose own name has the dot wins
    assert field_value(row, "reward_model.missing") is MISSING and field_value(row, "nope") is MISSING


def test_templates_render_columns_nested_fields_and_the_instruction():
    row = {"numbers": [3, 5], "target": 8, "meta": {"level": "easy"}}
    template = "Reach {target} from {numbers} ({meta.level}, {target:03d}). {instruction}"
    assert template_fields(template) == ["target", "numbers", "meta.level", "target", "instruction"]
    assert render_template(template, row, instruction="Be brief.", where="w", place="row 1") == (
        "Reach 8 from [3, 5] (easy, 008). Be brief.")
    with pytest.raises(ConfigError, match="a placeholder must name a column"):
        template_fields("Reach {} now")
    with pytest.raises(ConfigError, match="write placeholders as"):
        template_fields("Reach {target now")


def test_a_template_naming_a_missing_column_names_it_and_the_row(tmp_path):
    rows = [{"numbers": "3, 5", "target": 8}, {"numbers": "2, 2", "goal": 4}]
    fmt = RowFormat(prompt_template="Make {target} from {numbers}.", require_answer=False)
    with pytest.raises(DataError, match=r"w: dataset.prompt_template names \{target\}, which row 2 \(counting from "
                                        r"1\) does not have; its fields are \['goal', 'numbers'\]"):
        rows_to_problems(rows, where="w", name="t", fmt=fmt)


def test_every_column_reaches_the_problem_and_the_answer_may_be_absent():
    fmt = RowFormat(prompt_template="Make {target}.", require_answer=False)
    (problem,) = rows_to_problems([{"target": 8, "numbers": [3, 5]}], where="w", name="t", fmt=fmt)
    assert problem.fields == {"target": 8, "numbers": [3, 5]} and problem.answer is None
    assert problem.prompt == problem.question == "Make 8."  # no model.instruction unless the template asks
    (plain,) = with_prompts(rows_to_problems([{"question": "Hi?", "answer": 1}], where="w", name="t",
                                             fmt=RowFormat()), "Answer with just the number.")
    assert plain.prompt == "Hi? Answer with just the number."


def test_verls_parquet_layout_loads_as_it_is(tmp_path):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "ability": "math", "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
             "extra_info": {"index": i, "split": "train"}} for i in range(3)]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    problems = load_problems(name="gsm8k", kind="file", path=str(tmp_path / "train.parquet"),
                             answer_field="reward_model.ground_truth", messages_field="prompt")
    assert [p.answer for p in problems] == ["0", "2", "4"]
    assert problems[1].prompt == ({"role": "user", "content": "What is 1 + 1?"},)
    assert problems[1].question == "What is 1 + 1?" and problems[1].fields["extra_info"]["index"] == 1
    with pytest.raises(DataError, match=r"row 1 \(counting from 1\) has no chat messages in 'ability'"):
        load_problems(name="gsm8k", kind="file", path=str(tmp_path / "train.parquet"),
                      answer_field="reward_model.ground_truth", messages_field="ability")


GENERATOR = """
import random

def make(seed, count, largest=9):
    rng = random.Random(seed)
    return [{"question": f"{a} + {b}?", "answer": a + b, "a": a, "b": b}
            for a, b in ((rng.randint(1, largest), rng.randint(1, largest)) for _ in range(count))]

def broken(seed):
    raise RuntimeError("no rows today")

def hangs(seed):
    import time
    time.sleep(3600)

def exits(seed):
    import sys
    sys.exit(4)

def dies(seed):
    import os
    os._exit(0)
"""


def test_a_generator_by_path_is_seeded_and_split(tmp_path):
    (tmp_path / "gen.py").write_text(GENERATOR)
    spec = f"{tmp_path / 'gen.py'}:make"
    train, held_out = generated_problems(spec, {"seed": 3, "count": 10}, name="sums", n_eval=4, fmt=RowFormat())
    again, _ = generated_problems(spec, {"seed": 3, "count": 10}, name="sums", n_eval=4, fmt=RowFormat())
    assert len(train) == 6 and len(held_out) == 4 and train == again
    assert held_out[0].id == "sums/0" and train[0].id == "sums/train/0" and train[0].source == "sums"
    assert set(train[0].fields) == {"question", "answer", "a", "b"}
    with pytest.raises(ConfigError, match=r"takes \(seed, count, largest\): .*generator_args has \['size'\], which it "
                                          r"does not take; no value for \['count'\]"):
        generated_problems(spec, {"seed": 3, "size": 10}, name="sums", n_eval=4, fmt=RowFormat())
    with pytest.raises(DataError, match="made 10 rows, which leaves none for training"):
        generated_problems(spec, {"seed": 3, "count": 10}, name="sums", n_eval=10, fmt=RowFormat())
    with pytest.raises(DataError, match="(?s)raised:.*RuntimeError: no rows today"):
        generated_problems(f"{tmp_path / 'gen.py'}:broken", {"seed": 1}, name="s", n_eval=1, fmt=RowFormat())


def test_a_generator_runs_in_a_worker_so_its_faults_come_back_as_one_error(tmp_path):
    (tmp_path / "gen.py").write_text(GENERATOR + "\nimport os\nTOP_LEVEL_PID = os.getpid()\n")
    spec = f"{tmp_path / 'gen.py'}:"
    with pytest.raises(DataError, match=r"hangs' ran past its time limit \(dataset.generator_timeout_s=0.5\)"):
        generated_problems(spec + "hangs", {"seed": 1}, name="s", n_eval=1, fmt=RowFormat(), timeout_s=0.5)
    with pytest.raises(DataError, match="(?s)exits' raised:.*SystemExit: 4"):
        generated_problems(spec + "exits", {"seed": 1}, name="s", n_eval=1, fmt=RowFormat())
    with pytest.raises(DataError, match=r"dies' ended its process \(ended by the function \(os._exit\(0\)\)\)"):
        generated_problems(spec + "dies", {"seed": 1}, name="s", n_eval=1, fmt=RowFormat())
    import sys

    assert not any(name.startswith("fgrpo_user_gen") for name in sys.modules)  # its top level never ran here


def test_load_data_reads_a_generator_from_the_config(compose, tmp_path):
    from fgrpo.prepare import load_data

    (tmp_path / "gen.py").write_text(GENERATOR)
    cfg = compose("dataset.kind=generator", f"dataset.generator={tmp_path / 'gen.py'}:make", "dataset.name=sums",
                  "dataset.generator_args={seed: 1, count: 12}", "dataset.generator_n_eval=2",
                  "dataset.prompt_template='Add {a} and {b}. {instruction}'")
    data = load_data(cfg.dataset, instruction="Just the number.")
    assert len(data.train) == 10 and list(data.eval) == ["sums"] and len(data.eval["sums"]) == 2
    first = data.train[0]
    assert first.prompt == f"Add {first.fields['a']} and {first.fields['b']}. Just the number."
    assert data.columns() == {"question", "answer", "a", "b"}
    json.dumps([p.fields for p in data.train])  # plain values: they travel to the reward workers


def test_arithmetic_takes_a_template_over_its_columns(compose):
    from fgrpo.prepare import load_data

    data = load_data(compose("dataset.prompt_template='{a} {op} {b} = ? {instruction}'").dataset, instruction="Go.")
    problem = data.train[0]
    assert problem.prompt == f"{problem.fields['a']} {problem.fields['op']} {problem.fields['b']} = ? Go."
    assert load_data(compose().dataset, instruction="Go.").train[0].prompt.endswith("? Go.")  # the default: question
