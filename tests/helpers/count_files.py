"""eval_counts.jsonl rows and per-problem counts made by hand, for the tests of fgrpo.evaluation.eval_counts,
fgrpo.evaluation.significance and `python -m fgrpo.compare`."""

import json
from pathlib import Path

import numpy as np
import yaml


def write_counts(directory: Path, rows, *, run_dir: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if run_dir:
        (directory / ".hydra").mkdir(exist_ok=True)
        (directory / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"algo": {"name": "grpo"}, "seed": 0}))
    (directory / "eval_counts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return directory


def count_rows(counts: dict[str, np.ndarray], n: int, step=30):
    return [{"step": step, "dataset": dataset, "problem": f"{dataset}/{i}", "n": n, "c": int(c)}
            for dataset, cs in counts.items() for i, c in enumerate(cs)]


def binomial_counts(seed, n=16, problems=40, shift=0.0, datasets=("arithmetic", "logic")):
    """A and B drawn binomially from per-problem success rates; A's rates raised by ``shift``."""
    rng = np.random.default_rng(seed)
    a, b = {}, {}
    for dataset in datasets:
        rates = rng.random(problems)
        a[dataset] = rng.binomial(n, np.clip(rates + shift, 0, 1))
        b[dataset] = rng.binomial(n, rates)
    return a, b
