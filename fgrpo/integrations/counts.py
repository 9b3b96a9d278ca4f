"""Another trainer's evaluation as an fgrpo run directory, so that fgrpo's instruments read it
(docs/integrations.md): per-sample results in, ``eval_counts.jsonl`` (one row per problem: c correct of n) out, and,
given the run's arm and seed, the ``.hydra/config.yaml`` and ``metrics.jsonl`` that ``python -m fgrpo.report``
reads a run from (its final pass@k by the unbiased estimator).

    python -m fgrpo.integrations.counts samples.jsonl --out runs/fgrpo_seed3 --gamma 1 --seed 3
    python -m fgrpo.integrations.counts samples.csv --out runs/grpo_seed3 --gamma 0 --seed 3 \\
        --problem-key prompt_id --score-key reward --threshold 1.0
    python -m fgrpo.report runs/          # the paired test over seeds, the variance split, the planner
    python -m fgrpo.compare runs/fgrpo_seed3 runs/grpo_seed3

The samples: a ``.jsonl`` file (a JSON object per line) or a ``.csv`` file with a header, one record per sample: the
problem's id (``--problem-key``, default ``problem``) and its verdict: ``--correct-key`` (default ``correct``: true /
false or 1 / 0), or ``--score-key`` with ``--threshold`` (correct: score >= threshold). Every problem needs the same
number of samples, n.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter
from pathlib import Path

from fgrpo.evaluation.pass_at_k import default_ks, pass_at_k
from fgrpo.infra.run_files import COUNTS_FILE, METRICS_FILE


class CountsError(ValueError):
    """Samples that do not make per-problem counts; the message names the record or problem and the fix."""


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        raise CountsError(f"{path}: no such file")
    if path.suffix == ".csv":
        with path.open(newline="") as handle:
            return list(csv.DictReader(handle))
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise CountsError(f"{path}:{number}: not a JSON object ({error.msg}); the samples file is .jsonl "
                                  "(one object per line) or .csv") from None
    return records


def _verdict(record: dict, where: str, correct_key: str | None, score_key: str | None, threshold: float | None) -> bool:
    key = score_key or correct_key
    if key not in record:
        raise CountsError(f"{where} has no {key!r} (its keys: {', '.join(map(str, record))}); name the verdict's "
                          "column with --correct-key, or a score's with --score-key and --threshold")
    value = record[key]
    if score_key is not None:
        try:
            return float(value) >= threshold
        except (TypeError, ValueError):
            raise CountsError(f"{where}: {score_key}={value!r} is not a number") from None
    if isinstance(value, str):
        if value.strip().lower() in ("true", "1", "1.0", "yes"):
            return True
        if value.strip().lower() in ("false", "0", "0.0", "no"):
            return False
    elif isinstance(value, (bool, int, float)) and value in (0, 1):
        return bool(value)
    raise CountsError(f"{where}: {correct_key}={value!r} is not a verdict (true / false, 1 / 0); for a reward, use "
                      "--score-key and --threshold")


def count_rows(records: list[dict], *, problem_key: str = "problem", correct_key: str = "correct",
               score_key: str | None = None, threshold: float | None = None, dataset: str = "eval",
               step: int | None = None) -> list[dict]:
    """The ``eval_counts.jsonl`` rows of per-sample ``records``, problems in order of first appearance."""
    if not records:
        raise CountsError("the samples file holds no records")
    if (score_key is None) != (threshold is None):
        raise CountsError("--score-key and --threshold go together (correct: score >= threshold)")
    n, c = Counter(), Counter()
    for number, record in enumerate(records, start=1):
        where = f"record {number}"
        if problem_key not in record:
            raise CountsError(f"{where} has no {problem_key!r} (its keys: {', '.join(map(str, record))}); name the "
                              "problem id's column with --problem-key")
        problem = str(record[problem_key])
        n[problem] += 1
        c[problem] += _verdict(record, where, correct_key, score_key, threshold)
    sizes = Counter(n.values())
    if len(sizes) > 1:
        usual = sizes.most_common(1)[0][0]
        odd = [f"{p} ({count})" for p, count in n.items() if count != usual][:5]
        raise CountsError(f"problems have different numbers of samples ({usual} for most; {', '.join(odd)}): pass@k "
                          "is compared at one n, so evaluate every problem with the same number of samples")
    return [{"step": step, "dataset": dataset, "problem": p, "n": n[p], "c": c[p]} for p in n]


def write_run(rows: list[dict], out: Path, *, gamma: float | None = None, seed: int | None = None,
              algo: str = "grpo", method: str = "focal") -> None:
    """``out/eval_counts.jsonl``; with ``seed`` (and ``gamma``), also the config and the final metrics row that make
    ``out`` a completed run for ``fgrpo.report``."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / COUNTS_FILE).exists():
        raise CountsError(f"{out / COUNTS_FILE} exists: pass another --out (nothing was written)")
    (out / COUNTS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    if seed is None:
        return
    import yaml

    n, step = rows[0]["n"], rows[0]["step"] or 0
    config = {"algo": {"name": algo}, "focal": {"gamma": float(gamma or 0.0)}, "advantage": {"name": method},
              "seed": seed, "trainer": {"steps": step}, "dataset": {"name": rows[0]["dataset"]},
              "eval": {"n_samples": n, "max_problems": len(rows)}}
    (out / ".hydra").mkdir(exist_ok=True)
    (out / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    final = {"step": step, **{f"eval/pass@{k}": sum(pass_at_k(n, r["c"], k) for r in rows) / len(rows)
                              for k in default_ks(n)}}
    (out / METRICS_FILE).write_text(json.dumps(final) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fgrpo.integrations.counts", description=__doc__.split("\n")[0])
    parser.add_argument("samples", type=Path, help="per-sample results: .jsonl or .csv")
    parser.add_argument("--out", type=Path, required=True, help="the run directory to write")
    parser.add_argument("--problem-key", default="problem")
    parser.add_argument("--correct-key", default="correct")
    parser.add_argument("--score-key", default=None)
    parser.add_argument("--threshold", type=float, default=None)
    parser.add_argument("--dataset", default="eval", help="the evaluation set's name (default eval)")
    parser.add_argument("--step", type=int, default=None, help="the training step of the evaluated weights")
    parser.add_argument("--seed", type=int, default=None, help="with --gamma: write a run fgrpo.report reads")
    parser.add_argument("--gamma", type=float, default=None, help="the run's focal gamma (0: GRPO)")
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--method", default="focal", help="the advantage method's name (default focal)")
    args = parser.parse_args(argv)
    if (args.seed is None) != (args.gamma is None):
        parser.error("--seed and --gamma go together: they place the run in fgrpo.report's table")
    try:
        rows = count_rows(_records(args.samples), problem_key=args.problem_key, correct_key=args.correct_key,
                          score_key=args.score_key, threshold=args.threshold, dataset=args.dataset, step=args.step)
        write_run(rows, args.out, gamma=args.gamma, seed=args.seed, algo=args.algo, method=args.method)
    except CountsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{args.out / COUNTS_FILE}: {len(rows)} problems x {rows[0]['n']} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
