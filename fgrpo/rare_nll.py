"""Rare-trajectory retention (the paper's Delta NLL_rare): does training forget the correct answers the base model
found only rarely?

    python -m fgrpo.rare_nll build --prompts 256 --samples 800 --out rare/   [Hydra overrides: model=... dataset=...]
    python -m fgrpo.rare_nll score rare/ outputs/2026-11-25/10-00-00        # a run, checkpoint, HF folder or hub id

``build`` samples ``--samples`` completions from the base model (the ``model`` group) for each of ``--prompts``
training prompts (a seeded draw), keeps the correct ones, and of those the ``--fraction`` (1%) with the highest
length-normalised NLL under the base model: the paper's fixed set (256 x 800 samples, 1,263 trajectories). It
writes ``rare_set.jsonl`` (one row per trajectory: problem, prompt_ids, completion_ids, base_nll, text) and
``rare_set.json`` (how it was built, and the base model's mean NLL on it).

``score`` gives a model's mean length-normalised NLL on the set and its change from the base model's
(``delta``; > 0: the rare correct answers became less likely). ``eval.rare_set=rare/`` in a training run logs
both at every evaluation (``eval/rare_nll``, ``eval/rare_nll_delta``).

NLL here is ``-mean_t log pi(y_t | x, y_<t)`` over a completion's tokens, at temperature 1 (the paper samples at
1.0), in fp32 for ``build`` and ``score`` (no autocast), so that scores of different runs compare. In training,
``eval/rare_nll`` uses the learner's weights as they are (fp32 on CPU; bf16 weights on a GPU add their rounding,
which ``eval/rare_nll_delta`` at step 0 shows).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

# the modules that import torch are imported inside the functions: the reward pool's workers start by re-importing
# this module (multiprocessing's spawn, under `python -m fgrpo.rare_nll`), and each would load torch
from fgrpo.config import register_configs
from fgrpo.infra.errors import BAD_INPUT

if TYPE_CHECKING:
    from fgrpo.evaluation.rare_set import RareSet

log = logging.getLogger("fgrpo")


def build(cfg, out_dir: Path, *, prompts: int, samples: int, fraction: float, chunk_prompts: int = 8) -> RareSet:
    """Sample, verify and keep the rarest correct trajectories of the base model ``cfg.model`` (module docstring)."""
    from tqdm.auto import tqdm

    from fgrpo.evaluation.rare_set import RareSet, length_normalised_nll, save_rare_set, select_rarest
    from fgrpo.learner.model import load_policy
    from fgrpo.learner.packing import Sequence
    from fgrpo.prepare import make_sampler, prepare
    from fgrpo.rollout.rollouts import prompt_seeds, sample_groups

    if prompts < 1 or samples < 1:
        raise ValueError(f"--prompts and --samples must be >= 1, got {prompts} and {samples}")
    select_rarest(np.zeros(1), fraction)  # checks the fraction before the model loads

    def enough_prompts(data) -> None:
        if prompts > len(data.train):
            raise ValueError(f"--prompts {prompts} is more than the {len(data.train)} training prompts of dataset="
                             f"{cfg.dataset.name}: pass --prompts {len(data.train)} or fewer")

    run = prepare(cfg, training=False, check_data=enough_prompts)
    folder, tokenizer, prompt_ids = run.folder, run.tokenizer, run.prompt_ids
    order = np.random.default_rng(cfg.seed).permutation(len(run.data.train))[:prompts]
    problems = [run.data.train[i] for i in order]
    policy = load_policy(folder, dtype=cfg.hardware.learner_dtype, device=cfg.hardware.device)
    sampler = make_sampler(cfg, folder, policy, tokenizer)
    start = time.perf_counter()
    kept_problems, seqs, texts = [], [], []
    try:
        seeds = prompt_seeds(cfg.seed + 17, len(problems))
        for begin in tqdm(range(0, len(problems), chunk_prompts), desc="sampling the base model", unit="chunk"):
            chunk = problems[begin:begin + chunk_prompts]
            groups = sample_groups(sampler, chunk, prompt_ids, run.scorer, group_size=samples,
                                   max_new_tokens=cfg.sampler.max_new_tokens, temperature=1.0, top_p=1.0,
                                   seed=seeds[begin:begin + chunk_prompts])
            for problem, group, correct in zip(chunk, groups.completions, groups.correct):
                for completion, ok in zip(group, correct.tolist()):
                    if ok and completion.token_ids:
                        kept_problems.append(problem.id)
                        seqs.append(Sequence(prompt_ids[problem.id], completion.token_ids))
                        texts.append(completion.text)
    finally:
        run.scorer.close()
        sampler.close()
    if not seqs:
        raise ValueError(f"none of the {prompts} x {samples} base samples was correct: nothing to build a rare set "
                         "from; raise --samples or --prompts, or pick an easier dataset")
    # scored in fp32 (as `score` does): the set's ranking and the base's NLL must not carry bf16 rounding
    scorer = policy if cfg.hardware.learner_dtype == "float32" else load_policy(folder, dtype="float32",
                                                                                device=cfg.hardware.device)
    nll = length_normalised_nll(scorer, seqs, pad_id=tokenizer.pad_token_id)
    chosen = select_rarest(nll, fraction)
    meta = {"model": cfg.model.name, "model_folder": str(folder), "dataset": cfg.dataset.name, "prompts": prompts,
            "samples_per_prompt": samples, "fraction": fraction, "correct": len(seqs), "kept": len(chosen),
            "correct_rate": len(seqs) / (prompts * samples), "nll_threshold": float(nll[chosen].min()),
            "base_nll_mean_all_correct": float(nll.mean()), "base_nll_mean": float(nll[chosen].mean()),
            "max_new_tokens": cfg.sampler.max_new_tokens, "seed": cfg.seed, "nll_dtype": "float32",
            "build_time_s": time.perf_counter() - start}
    rare = RareSet([kept_problems[i] for i in chosen], [seqs[i] for i in chosen], nll[chosen], meta)
    save_rare_set(out_dir, rare, [texts[i] for i in chosen])
    return rare


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def score_model(set_path: Path, model_spec: str, device: str = "cpu") -> dict[str, float]:
    """``score``: the model that ``model_spec`` names (as fgrpo.evaluate's ``eval.model``) on the set, in fp32 on
    ``device``."""
    from fgrpo.evaluation.rare_set import check_vocabulary, load_rare_set, score
    from fgrpo.learner.model import load_policy, load_tokenizer
    from fgrpo.learner.model_source import locate_model, model_folder

    rare = load_rare_set(set_path)  # a missing set fails before the model loads
    source = locate_model(model_spec)
    with tempfile.TemporaryDirectory(prefix="fgrpo-rare-") as scratch:
        folder = model_folder(source, None, Path(scratch))
        tokenizer = load_tokenizer(folder)
        check_vocabulary(rare, len(tokenizer))
        policy = load_policy(folder, dtype="float32", device=device)
        result = score(policy, rare, pad_id=tokenizer.pad_token_id)
    return {**result, "base_nll": rare.base_mean, "trajectories": len(rare.seqs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fgrpo.rare_nll", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("build", help="build the fixed set from the base model")
    make.add_argument("--prompts", type=int, default=256, help="training prompts drawn (default 256, the paper's)")
    make.add_argument("--samples", type=int, default=800, help="base samples per prompt (default 800, the paper's)")
    make.add_argument("--fraction", type=float, default=0.01, help="share of the correct ones kept (default 0.01)")
    make.add_argument("--out", type=Path, required=True, help="the folder to write the set into")
    make.add_argument("overrides", nargs="*", help="Hydra overrides as for run.py: model=..., dataset=..., sampler=...")
    rate = commands.add_parser("score", help="a model's NLL on the set and its change from the base")
    rate.add_argument("rare_set", type=Path, help="the folder build wrote (or its rare_set.jsonl)")
    rate.add_argument("model", help="a run directory, a checkpoint folder, an HF folder or a hub id")
    rate.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    rate.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs (fp32; default cpu)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "build":
            rare = build(_compose(args.overrides), args.out, prompts=args.prompts, samples=args.samples,
                         fraction=args.fraction)
            print(f"rare set: {rare.meta['kept']} of {rare.meta['correct']} correct trajectories, base NLL "
                  f"{rare.base_mean:.4f} (threshold {rare.meta['nll_threshold']:.4f}), written to {args.out}")
            return 0
        result = score_model(args.rare_set, args.model, args.device)
    except (ValueError, *BAD_INPUT) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"rare NLL {result['rare_nll']:.4f} (base {result['base_nll']:.4f}, delta {result['rare_nll_delta']:+.4f}) "
          f"on {result['trajectories']} trajectories")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
