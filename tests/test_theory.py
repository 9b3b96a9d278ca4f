"""The theory's command line (python -m fgrpo.theory): the files it writes, the arguments it refuses. The simulators
themselves: tests/algorithm/test_lemma.py and tests/algorithm/test_categorical.py."""

import pytest

from fgrpo.theory import main


def test_cli_writes_its_files(tmp_path, capsys):
    assert main(["lemma", "--n-max", "60", "--trials", "300", "--out", str(tmp_path)]) == 0
    assert main(["categorical", "--actions", "64", "--correct", "8", "--steps", "5", "--seeds", "1",
                 "--n-max", "8", "--optimizer", "sgd", "--lr", "0.5", "2", "--record-every", "2",
                 "--threads", "1", "--out", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"theory-lemma.png", "theory-lemma.md"} <= names
    for lr in ("0.5", "2"):
        for suffix in (".png", ".md", ".npz"):
            assert f"theory-categorical-sgd-lr{lr}-logprob{suffix}" in names
    table = (tmp_path / "theory-categorical-sgd-lr0.5-logprob.md").read_text()
    assert "| 8 | 1 |" in table and "+-" in table
    assert (tmp_path / "theory-lemma.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv", [
    ["categorical", "--lr", "0"], ["categorical", "--lr", "-1"], ["categorical", "--steps", "0"],
    ["categorical", "--optimizer", "rmsprop"], ["categorical", "--n-max", "12"],
    ["categorical", "--actions", "10", "--correct", "10"], ["lemma", "--trials", "0"], [],
])
def test_cli_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err
