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
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fgrpo.learner.packing import Sequence

log = logging.getLogger("fgrpo")

SET_FILE = "rare_set.jsonl"
META_FILE = "rare_set.json"
SCORE_TOKENS = 16_384  # padded token slots per no-grad forward: long reasoning traces go a few at a time


def token_budget_batches(seqs: list[Sequence], budget: int) -> list[list[Sequence]]:
    """Consecutive batches whose padded size (count x longest prompt + completion) stays within ``budget`` token
    slots; a sequence longer than the budget goes alone."""
    batches, batch, longest = [], [], 0
    for seq in seqs:
        length = len(seq.prompt_ids) + len(seq.completion_ids)
        if batch and (len(batch) + 1) * max(longest, length) > budget:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(seq)
        longest = max(longest, length)
    return batches + [batch] if batch else batches


def length_normalised_nll(model, seqs: list[Sequence], *, pad_id: int, budget: int = SCORE_TOKENS) -> np.ndarray:
    """``[S]`` float64: each completion's mean token NLL under ``model`` at temperature 1, without gradients.

    Several ranks with a sharded model: every rank must pass the same ``seqs`` (each forward is collective).
    """
    from fgrpo.learner.forward import completion_logprobs

    if any(not s.completion_ids for s in seqs):
        raise ValueError("every sequence needs at least one completion token to have a length-normalised NLL")
    was_training = model.training
    model.eval()
    nll = []
    try:
        with torch.no_grad():
            for batch in token_budget_batches(seqs, budget):
                logp, mask, _ = completion_logprobs(model, batch, pad_id=pad_id, temperature=1.0)
                token_counts = mask.sum(dim=1).double()
                nll += (-(logp.double() * mask).sum(dim=1) / token_counts).tolist()
    finally:
        model.train(was_training)
    return np.asarray(nll, dtype=np.float64)


def select_rarest(nll: np.ndarray, fraction: float) -> np.ndarray:
    """Indices of the ``fraction`` of ``nll`` ``[S]`` with the highest values (at least one), highest first."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if nll.ndim != 1 or nll.size == 0:
        raise ValueError(f"nll must be a non-empty 1-D array, got shape {nll.shape}")
    keep = max(1, int(round(fraction * nll.size)))
    return np.argsort(-nll, kind="stable")[:keep]


@dataclass
class RareSet:
    """The fixed set of rare correct trajectories and the base model's NLL on each."""

    problems: list[str]
    seqs: list[Sequence]
    base_nll: np.ndarray  # [S]
    meta: dict

    @property
    def base_mean(self) -> float:
        return float(self.base_nll.mean())


def save_rare_set(out_dir: Path, rare: RareSet, texts: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / SET_FILE, "w", encoding="utf-8") as file:
        for problem, seq, nll, text in zip(rare.problems, rare.seqs, rare.base_nll, texts):
            file.write(json.dumps({"problem": problem, "prompt_ids": seq.prompt_ids, "completion_ids": seq.completion_ids,
                                   "base_nll": float(nll), "text": text}) + "\n")
    (out_dir / META_FILE).write_text(json.dumps(rare.meta, indent=2) + "\n")


def load_rare_set(path: str | Path) -> RareSet:
    """A set written by ``build``: its folder or its rare_set.jsonl. Raises ValueError naming what is missing."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if not (folder / SET_FILE).is_file():
        raise ValueError(f"{path}: no {SET_FILE} there; build one with `python -m fgrpo.rare_nll build --out DIR`")
    rows = [json.loads(line) for line in (folder / SET_FILE).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{folder / SET_FILE} is empty")
    meta = json.loads((folder / META_FILE).read_text()) if (folder / META_FILE).is_file() else {}
    return RareSet([r["problem"] for r in rows], [Sequence(r["prompt_ids"], r["completion_ids"]) for r in rows],
                   np.array([r["base_nll"] for r in rows], dtype=np.float64), meta)


def check_vocabulary(rare: RareSet, vocab_size: int) -> None:
    """The set's token ids must be the model's: a set built with another tokenizer would score nonsense."""
    largest = max(max(s.prompt_ids + s.completion_ids) for s in rare.seqs)
    if largest >= vocab_size:
        raise ValueError(f"the rare set holds token id {largest}, past this model's vocabulary of {vocab_size}: it was "
                         f"built with another tokenizer (its model: {rare.meta.get('model', 'unknown')}); build one with "
                         "this model's tokenizer")


def score(model, rare: RareSet, *, pad_id: int) -> dict[str, float]:
    """``rare_nll``: the model's mean length-normalised NLL on the set; ``rare_nll_delta``: minus the base's."""
    mean = float(length_normalised_nll(model, rare.seqs, pad_id=pad_id).mean())
    return {"rare_nll": mean, "rare_nll_delta": mean - rare.base_mean}


def build(cfg, out_dir: Path, *, prompts: int, samples: int, fraction: float, chunk_prompts: int = 8) -> RareSet:
    """Sample, verify and keep the rarest correct trajectories of the base model ``cfg.model`` (module docstring)."""
    from tqdm.auto import tqdm

    from fgrpo.config import validate
    from fgrpo.learner.model import load_policy, resolve_model_folder
    from fgrpo.rollout.rollouts import prompt_seeds, sample_groups
    from fgrpo.rollout.samplers import require_vllm
    from fgrpo.train import _encode_prompts, load_data, make_sampler, settle_hardware
    from fgrpo.rollout.verifier import close_verifier, make_verifier

    if prompts < 1 or samples < 1:
        raise ValueError(f"--prompts and --samples must be >= 1, got {prompts} and {samples}")
    select_rarest(np.zeros(1), fraction)  # checks the fraction before the model loads
    validate(cfg)
    data = load_data(cfg.dataset)
    if prompts > len(data.train):
        raise ValueError(f"--prompts {prompts} is more than the {len(data.train)} training prompts of dataset="
                         f"{cfg.dataset.name}: pass --prompts {len(data.train)} or fewer")
    verifier = make_verifier(cfg.dataset.verifier, timeout_s=cfg.dataset.verifier_timeout_s,
                             workers=cfg.dataset.verifier_workers)
    if cfg.sampler.name == "vllm":
        require_vllm()
    order = np.random.default_rng(cfg.seed).permutation(len(data.train))[:prompts]
    problems = [data.train[i] for i in order]
    folder = resolve_model_folder(cfg.model)
    settle_hardware(cfg)
    tokenizer, prompt_ids = _encode_prompts(cfg, folder, data)
    policy = load_policy(folder, dtype=cfg.hardware.learner_dtype, device=cfg.hardware.device)
    sampler = make_sampler(cfg, folder, policy, tokenizer)
    start = time.perf_counter()
    kept_problems, seqs, texts = [], [], []
    try:
        seeds = prompt_seeds(cfg.seed + 17, len(problems))
        for begin in tqdm(range(0, len(problems), chunk_prompts), desc="sampling the base model", unit="chunk"):
            chunk = problems[begin:begin + chunk_prompts]
            groups = sample_groups(sampler, chunk, prompt_ids, verifier, group_size=samples,
                                   max_new_tokens=cfg.sampler.max_new_tokens, temperature=1.0, top_p=1.0,
                                   seed=seeds[begin:begin + chunk_prompts])
            for problem, group, correct in zip(chunk, groups.completions, groups.correct):
                for completion, ok in zip(group, correct.tolist()):
                    if ok and completion.token_ids:
                        kept_problems.append(problem.id)
                        seqs.append(Sequence(prompt_ids[problem.id], completion.token_ids))
                        texts.append(completion.text)
    finally:
        close_verifier(verifier)
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

    from fgrpo.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def score_model(set_path: Path, model_spec: str, device: str = "cpu") -> dict[str, float]:
    """``score``: the model that ``model_spec`` names (as fgrpo.evaluate's ``eval.model``) on the set, in fp32 on
    ``device``."""
    import tempfile

    from fgrpo.evaluate import locate_model, model_folder
    from fgrpo.learner.model import load_policy, load_tokenizer

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
    from fgrpo.infra.errors import CheckpointError
    from fgrpo.infra.errors import ConfigError
    from fgrpo.infra.errors import ModelSourceError

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
    except (ValueError, ConfigError, ModelSourceError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"rare NLL {result['rare_nll']:.4f} (base {result['base_nll']:.4f}, delta {result['rare_nll_delta']:+.4f}) "
          f"on {result['trajectories']} trajectories")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
