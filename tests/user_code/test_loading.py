"""fgrpo.user_code.loading: a user's function by import path, and the errors that name the key and the fix."""

import pytest

from fgrpo.infra.errors import ConfigError
from fgrpo.user_code.loading import function_name, is_import_path, load_function, resolve_target


def test_a_module_path_and_a_file_path(tmp_path, monkeypatch):
    assert load_function("os.path:join", "k")("a", "b") == "a/b"
    (tmp_path / "helper.py").write_text("SCALE = 3\n")
    (tmp_path / "task.py").write_text("from helper import SCALE\n\ndef score(x):\n    return SCALE * x\n")
    monkeypatch.chdir(tmp_path)
    score = load_function("task.py:score", "dataset.rewards[0].fn")
    assert score(2) == 6  # its folder is on the import path: it imports its neighbour
    assert load_function(f"{tmp_path / 'task.py'}:score", "k") is score  # one module per file, whatever the spelling
    assert resolve_target("task.py:score", "k") == f"{tmp_path / 'task.py'}:score"
    assert resolve_target("pkg.mod:fn", "k") == "pkg.mod:fn"
    assert function_name("a/b.py:score") == "score" and is_import_path("a.py:f") and not is_import_path("math")


def test_two_files_of_one_name_do_not_clash(tmp_path):
    for folder, value in (("one", 1), ("two", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "task.py").write_text(f"def value():\n    return {value}\n")
    assert [load_function(f"{tmp_path / f / 'task.py'}:value", "k")() for f in ("one", "two")] == [1, 2]


@pytest.mark.parametrize("spec, message", [
    ("score", r"k='score': name a function as 'package.module:function' or 'path/to/file.py:function'"),
    ("task.py:", "name a function as"),
    ("no/such/task.py:score", r"the file .*no/such/task.py does not exist \(relative paths start at the working"),
    ("no_such_module_here:score", "no module named 'no_such_module_here' on the import path"),
    ("os.path:no_such_function", r"os.path has no 'no_such_function'; its functions: \[.*'join'"),
    ("os:sep", "'sep' in os is a str, not a function"),
])
def test_what_cannot_be_loaded_names_the_key(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_function(spec, "k")


def test_a_file_that_raises_while_importing_shows_its_traceback(tmp_path):
    (tmp_path / "bad.py").write_text("import json\nvalue = json.loads('{')\n")
    with pytest.raises(ConfigError, match=r"(?s)k=.*importing .*bad.py failed:.*bad.py\", line 2.*JSONDecodeError"):
        load_function(f"{tmp_path / 'bad.py'}:score", "k")
