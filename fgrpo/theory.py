"""The theory of F-GRPO (arXiv 2602.06717, v2) as runnable simulators: Lemma 3.1 and the categorical
simulation of section 5.1.

The command line, and one import point for the theory's public names. The parts:

- :mod:`fgrpo.algorithm.lemma`: Lemma 3.1, the probability that an active update misses a rare correct subset
  (closed form, Monte Carlo, peak).
- :mod:`fgrpo.algorithm.categorical`: the categorical simulation of section 5.1 (a softmax bandit over K actions
  trained on focal-weighted group rewards, a grid of (N, gamma, seed) as the rows of one ``[B, K]`` tensor).
- :mod:`fgrpo.evaluation.theory_figures`: their figures, tables and raw arrays.

Command line: ``python -m fgrpo.theory lemma|categorical --help``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

from fgrpo.algorithm.categorical import (
    OBJECTIVES,
    OPTIMIZERS,
    CategoricalConfig,
    CategoricalResult,
    CategoricalTask,
    correct_mass_metrics,
    focal_weight_from_counts,
    make_optimizer,
    power_of_two_group_sizes,
    run_categorical,
    sample_group_counts,
    summarise_categorical,
    surrogate_gradient,
)
from fgrpo.algorithm.lemma import (
    PAPER_EXAMPLES,
    LemmaPoint,
    lemma_points,
    log_spaced_group_sizes,
    miss_probability,
    miss_probability_peak,
    simulate_miss_probability,
)
from fgrpo.evaluation.theory_figures import categorical_table, lemma_table, plot_categorical, plot_lemma, save_arrays

__all__ = [
    "miss_probability",
    "simulate_miss_probability",
    "miss_probability_peak",
    "PAPER_EXAMPLES",
    "LemmaPoint",
    "lemma_points",
    "CategoricalTask",
    "CategoricalConfig",
    "CategoricalResult",
    "OBJECTIVES",
    "OPTIMIZERS",
    "power_of_two_group_sizes",
    "focal_weight_from_counts",
    "surrogate_gradient",
    "sample_group_counts",
    "make_optimizer",
    "correct_mass_metrics",
    "run_categorical",
    "summarise_categorical",
    "main",
]


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fgrpo.theory", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    lemma = commands.add_parser("lemma", help="Lemma 3.1 figure: closed form, Monte Carlo points, peaks")
    lemma.add_argument("--n-max", type=_positive(int), default=1000, help="largest N on the curve (default 1000)")
    lemma.add_argument("--trials", type=_positive(int), default=20_000, help="Monte Carlo groups per point")
    lemma.add_argument("--seed", type=int, default=0)
    lemma.add_argument("--out", type=Path, default=Path("outputs/theory"), help="folder for the PNG and table")

    cat = commands.add_parser("categorical", help="section 5.1 simulation over the (N, gamma, seed) grid")
    cat.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    cat.add_argument("--lr", type=_positive(float), nargs="+", default=[1e-2],
                     help="learning rate; several run one after another (default 1e-2)")
    cat.add_argument("--weight-decay", type=_non_negative_float, default=None,
                     help="default: 0.01 for adamw, 0 for sgd and adam")
    cat.add_argument("--objective", choices=OBJECTIVES, default="logprob",
                     help="ascend sum rtilde log pi (logprob, default) or sum rtilde pi (prob)")
    cat.add_argument("--steps", type=_positive(int), default=1000)
    cat.add_argument("--seeds", type=_positive(int), default=4, help="seeds per (N, gamma)")
    cat.add_argument("--seed", type=int, default=0, help="base seed")
    cat.add_argument("--n-min", type=_positive(int), default=2, help="smallest group size, a power of two")
    cat.add_argument("--n-max", type=_positive(int), default=131_072, help="largest group size, a power of two")
    cat.add_argument("--gammas", type=_non_negative_float, nargs="+", default=[0.0, 1.0])
    cat.add_argument("--actions", type=_positive(int), default=128_000, help="number of actions K")
    cat.add_argument("--correct", type=_positive(int), default=10_000, help="number of correct actions C")
    cat.add_argument("--record-every", type=_positive(int), default=10, help="steps between metric records")
    cat.add_argument("--threads", type=_positive(int), default=1,
                     help="torch threads (default 1: as fast as 2 on the 2-core test machine, see docs/theory.md)")
    cat.add_argument("--out", type=Path, default=Path("outputs/theory"), help="folder for PNG, table, npz")
    return parser


def _run_lemma_command(args) -> list[Path]:
    group_sizes = log_spaced_group_sizes(args.n_max)
    points = lemma_points(PAPER_EXAMPLES, group_sizes, trials=args.trials, seed=args.seed)
    png, table = args.out / "theory-lemma.png", args.out / "theory-lemma.md"
    plot_lemma(png, PAPER_EXAMPLES, points, args.n_max)
    table.write_text(lemma_table(points, PAPER_EXAMPLES, args.n_max))
    return [png, table]


def _run_categorical_command(args) -> list[Path]:
    task = CategoricalTask(num_actions=args.actions, num_correct=args.correct)
    written = []
    for lr in args.lr:
        config = CategoricalConfig(
            optimizer=args.optimizer, lr=lr, weight_decay=args.weight_decay, steps=args.steps, seeds=args.seeds,
            seed=args.seed, group_sizes=power_of_two_group_sizes(args.n_min, args.n_max),
            gammas=tuple(args.gammas), objective=args.objective, record_every=args.record_every,
        )

        def progress(step, seconds, total=config.steps):
            if step % max(1, total // 10) < config.record_every:
                print(f"  step {step}/{total}  {seconds:.0f} s", file=sys.stderr, flush=True)

        print(f"categorical: {config.optimizer} lr {lr:g} ...", file=sys.stderr, flush=True)
        result = run_categorical(task, config, threads=args.threads, progress=progress)
        stem = f"theory-categorical-{config.optimizer}-lr{lr:g}-{config.objective}"
        args.out.mkdir(parents=True, exist_ok=True)
        png, table, arrays = (args.out / f"{stem}{suffix}" for suffix in (".png", ".md", ".npz"))
        plot_categorical(result, png)
        table.write_text(categorical_table(result))
        save_arrays(result, arrays)
        print(f"  {result.seconds:.1f} s ({result.seconds / config.steps:.3f} s per step, {result.threads} "
              f"thread(s))", file=sys.stderr)
        written += [png, table, arrays]
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        written = _run_lemma_command(args) if args.command == "lemma" else _run_categorical_command(args)
    except ValueError as error:
        parser.error(str(error))  # exits with status 2 and the usage line
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
