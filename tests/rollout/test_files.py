"""fgrpo.rollout.files: a data file that does not parse names the file and the line (counting from 1) or the reader's
message, before any model loads; a row's error names its line in a JSONL or CSV file, its row in parquet."""

import pandas as pd
import pytest

from fgrpo.infra.errors import DataError
from fgrpo.rollout.data import load_problems


def load(path):
    return load_problems(name="d", kind="file", path=str(path))


def refused(path, content: str | bytes, message: str) -> None:
    """``path`` written with ``content`` is refused at load with a DataError matching ``message``."""
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(DataError, match=message):
        load(path)


def test_a_broken_jsonl_line_is_named_by_its_number_and_its_start(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "q1", "answer": "1"}\n\n{"question": "q2", "answer": \n{"question": "q3"}\n')
    with pytest.raises(DataError) as caught:
        load(path)
    assert str(caught.value) == (f"dataset file {path}: line 3 is not valid JSON (Expecting value at column 29): "
                                 "'{\"question\": \"q2\", \"answer\":'; fix that line (one JSON object per line)")


def test_a_jsonl_line_that_is_no_object_and_a_file_with_no_object(tmp_path):
    refused(tmp_path / "list.jsonl", '{"question": "q", "answer": 1}\n[1, 2]\n',
            r"list.jsonl: line 2 is a JSON list, not an object: '\[1, 2\]'")
    refused(tmp_path / "csv_really.jsonl", "question,answer\nq,1\n",
            r"csv_really.jsonl: no line is a JSON object \(line 1 is not valid JSON")


@pytest.mark.parametrize("name, text", [("empty.jsonl", ""), ("blank.jsonl", "\n\n  \n"), ("empty.csv", ""),
                                        ("empty.json", " ")])
def test_an_empty_file_says_so(tmp_path, name, text):
    refused(tmp_path / name, text, rf"dataset file .*{name} is empty: it holds no rows")


def test_row_errors_name_the_line_in_jsonl_and_csv_and_the_row_in_parquet(tmp_path):
    refused(tmp_path / "d.jsonl", '{"question": "q1", "answer": "1"}\n\n\n{"question": "q4"}\n',
            r"d.jsonl: line 4 has no usable answer field 'answer'")
    refused(tmp_path / "d.csv", 'question,answer\n"a question\nover two lines",1\nq3,\n',
            r"d.csv: line 4 has no usable answer field 'answer'")
    pd.DataFrame({"question": ["q1", "q2"], "answer": ["1", None]}).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d.parquet: row 2 \(counting from 1\) has no usable answer field"):
        load(tmp_path / "d.parquet")


def test_files_that_do_not_parse_name_the_file_and_the_readers_message(tmp_path):
    refused(tmp_path / "d.json", '[{"question": "q", "answer": 1},\n {"question": }]',
            r"d.json: not valid JSON at line 2, column 15 \(Expecting value\)")
    refused(tmp_path / "d.csv", 'question,answer\nq1,1\n"q2,2\n',
            r"could not read dataset file .*d.csv as csv: ParserError: Error tokenizing data. C error: EOF inside "
            r"string")
    refused(tmp_path / "d.parquet", b"PAR1 this is not a parquet file",
            r"could not read dataset file .*d.parquet as parquet: \w+")
